import argparse
import pathlib
import wave

import numpy as np
import pytest

from engine.cli import decode as decode_cli
from engine.cli import encode as encode_cli
from engine.codec.streaming import snr_db
from engine.codec.wavio import read_wav, resample, write_wav
from engine.vocab import HOP_SAMPLES, NUM_STREAMS, SAMPLE_RATE_HZ


def _run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="duplex")
    sub = parser.add_subparsers()
    decode_cli.register(sub)
    encode_cli.register(sub)
    args = parser.parse_args(argv)
    return args.func(args)


def test_encode_decode_round_trip(tiny_dir: pathlib.Path, tmp_path: pathlib.Path, speech: np.ndarray) -> None:
    wav, codes, out = tmp_path / "in.wav", tmp_path / "codes.npy", tmp_path / "out.wav"
    write_wav(wav, speech)
    assert _run(["encode", "--model", str(tiny_dir), "--wav", str(wav), "--out", str(codes)]) == 0
    frames = np.load(codes)
    assert frames.shape == (-(-len(speech) // HOP_SAMPLES), NUM_STREAMS)
    # generate's layout [N, F, 9]: take request 1
    np.save(codes, np.stack([frames[::-1], frames]))
    assert _run(["decode", "--model", str(tiny_dir), "--codes", str(codes), "--out", str(out), "--index", "1"]) == 0
    streamed, rate = read_wav(out)
    assert rate == SAMPLE_RATE_HZ and len(streamed) == len(frames) * HOP_SAMPLES
    whole = tmp_path / "whole.wav"
    np.save(codes, frames)
    assert _run(["decode", "--model", str(tiny_dir), "--codes", str(codes), "--out", str(whole),
                 "--chunk-frames", "100000", "--first-chunk-frames", "100000"]) == 0
    assert snr_db(read_wav(whole)[0], streamed) > 30  # int16 rounding bounds it here


def test_encode_resamples_other_rates(tiny_dir: pathlib.Path, tmp_path: pathlib.Path, speech: np.ndarray) -> None:
    wav, codes = tmp_path / "in48k.wav", tmp_path / "codes.npy"
    write_wav(wav, resample(speech, SAMPLE_RATE_HZ, 48_000), rate_hz=48_000)
    assert _run(["encode", "--model", str(tiny_dir), "--wav", str(wav), "--out", str(codes)]) == 0
    assert np.load(codes).shape[0] == -(-len(speech) // HOP_SAMPLES)


def _bad(argv: list[str], capsys: pytest.CaptureFixture[str], message: str) -> None:
    assert _run(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_decode_bad_input(tiny_dir: pathlib.Path, tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = str(tmp_path / "o.wav")
    base = ["decode", "--model", str(tiny_dir), "--out", out, "--codes"]
    _bad(base + [str(tmp_path / "missing.npy")], capsys, "does not exist")
    np.save(tmp_path / "shape.npy", np.zeros((4, 8), np.int64))
    _bad(base + [str(tmp_path / "shape.npy")], capsys, "need [F, 9]")
    np.save(tmp_path / "range.npy", np.zeros((4, 9), np.int64))  # pad ids are not audio
    _bad(base + [str(tmp_path / "range.npy")], capsys, "outside the stream's range")
    np.save(tmp_path / "float.npy", np.zeros((4, 9)))
    _bad(base + [str(tmp_path / "float.npy")], capsys, "integer")
    np.save(tmp_path / "batch.npy", np.zeros((2, 4, 9), np.int64))
    _bad(base + [str(tmp_path / "batch.npy"), "--index", "5"], capsys, "out of range")
    (tmp_path / "junk.npy").write_text("not numpy")
    _bad(base + [str(tmp_path / "junk.npy")], capsys, "not a .npy")
    np.save(tmp_path / "ok.npy", np.zeros((4, 9), np.int64))
    _bad(["decode", "--model", str(tmp_path), "--codes", str(tmp_path / "missing.npy"), "--out", out], capsys, "does not exist")


def test_encode_bad_input(tiny_dir: pathlib.Path, tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = ["encode", "--model", str(tiny_dir), "--out", str(tmp_path / "c.npy"), "--wav"]
    _bad(base + [str(tmp_path / "missing.wav")], capsys, "does not exist")
    (tmp_path / "junk.wav").write_bytes(b"RIFF....garbage")
    _bad(base + [str(tmp_path / "junk.wav")], capsys, "not a readable WAV")
    with wave.open(str(tmp_path / "u8.wav"), "wb") as f:
        f.setnchannels(1)
        f.setsampwidth(1)
        f.setframerate(16000)
        f.writeframes(bytes(1600))
    _bad(base + [str(tmp_path / "u8.wav")], capsys, "16-bit PCM")
    write_wav(tmp_path / "ok.wav", np.zeros(1600, np.float32))
    _bad(["encode", "--model", str(tmp_path), "--wav", str(tmp_path / "ok.wav"), "--out", str(tmp_path / "c.npy")],
         capsys, "does not exist")
