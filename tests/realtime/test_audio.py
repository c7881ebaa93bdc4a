"""Audio edge: G.711 against CPython's audioop tables, soxr streaming, Opus round trips, framing."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from realtime import audio as A

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    import audioop  # removed in 3.13; the reference for G.711 here


ALL_INT16 = np.arange(-32768, 32768, dtype=np.int16)


def test_g711_matches_audioop_bit_for_bit():
    raw = ALL_INT16.astype("<i2").tobytes()
    assert A.ulaw_encode(ALL_INT16) == audioop.lin2ulaw(raw, 2)
    assert A.alaw_encode(ALL_INT16) == audioop.lin2alaw(raw, 2)
    codes = bytes(range(256))
    assert A.ulaw_decode(codes).astype("<i2").tobytes() == audioop.ulaw2lin(codes, 2)
    assert A.alaw_decode(codes).astype("<i2").tobytes() == audioop.alaw2lin(codes, 2)


def _sine(freq: float, rate: int, ms: float, amp: float = 8000) -> np.ndarray:
    t = np.arange(int(rate * ms / 1000)) / rate
    return (amp * np.sin(2 * np.pi * freq * t)).astype(np.int16)


def _snr_db(ref: np.ndarray, got: np.ndarray) -> float:
    n = min(ref.size, got.size)
    ref, got = ref[:n].astype(float), got[:n].astype(float)
    return 10 * np.log10(np.sum(ref**2) / max(np.sum((ref - got) ** 2), 1e-9))


def _best_lag(ref: np.ndarray, got: np.ndarray, max_lag: int) -> int:
    n = min(ref.size, got.size) - max_lag
    scores = [np.dot(ref[:n].astype(float), got[lag : lag + n].astype(float)) for lag in range(max_lag)]
    return int(np.argmax(scores))


def test_pcm16_24k_in_is_resampled_to_16k_in_chunks_like_offline():
    src24 = _sine(440, 24_000, 1000)
    dec = A.InputDecoder(A.WireFormat.PCM16)
    chunks = [dec.decode(src24[i : i + 480].astype("<i2").tobytes()) for i in range(0, src24.size, 480)]
    got = np.concatenate(chunks)
    ref = _sine(440, 16_000, 1000)
    lag = _best_lag(ref, got, 200)
    assert _snr_db(ref[200:12000], got[200 + lag : 12000 + lag]) > 40  # tolerance: 40 dB (soxr HQ)


def test_output_encoder_frames_pcm16_and_flushes_the_tail():
    enc = A.OutputEncoder(A.WireFormat.PCM16, frame_ms=40)
    frames = enc.encode(_sine(300, 16_000, 500)) + enc.flush()
    assert all(len(f) == 24_000 * 40 // 1000 * 2 for f in frames[:-1])
    total = sum(len(f) for f in frames) // 2
    assert abs(total - 12_000) <= 2  # 500 ms at 24 kHz, resampler delay flushed


def test_g711_output_frames_are_8k():
    enc = A.OutputEncoder(A.WireFormat.PCMU, frame_ms=20)
    frames = enc.encode(_sine(300, 16_000, 200)) + enc.flush()
    assert all(len(f) == 160 for f in frames)


def test_opus_round_trip_20ms_frames():
    src = _sine(440, 16_000, 1000)
    enc = A.OutputEncoder(A.WireFormat.OPUS)
    packets = enc.encode(src) + enc.flush()
    assert len(packets) == 50
    dec = A.InputDecoder(A.WireFormat.OPUS)
    got = np.concatenate([dec.decode(p) for p in packets])
    assert got.size == src.size
    lag = _best_lag(src, got, 400)
    assert _snr_db(src[1000:15000], got[1000 + lag : 15000 + lag]) > 10  # lossy codec: waveform SNR > 10 dB


def test_opus_decoder_equals_opuslib_sample_for_sample():
    """The reused-buffer decoder returns exactly what opuslib's own `Decoder.decode` returns."""
    import opuslib

    enc = A.OutputEncoder(A.WireFormat.OPUS)
    packets = enc.encode(_sine(300, 16_000, 500)) + enc.flush()
    ours, theirs = A.OpusDecoder(16_000), opuslib.Decoder(16_000, 1)
    for p in packets:
        got = ours.decode(p)
        want = np.frombuffer(theirs.decode(p, 1920), dtype="<i2")
        assert got.dtype == np.int16 and got.size == 320
        np.testing.assert_array_equal(got, want)
    assert ours.decode(packets[0]) is not ours.decode(packets[1])  # each call owns its samples


def test_corrupt_opus_and_odd_pcm_raise_format_errors():
    with pytest.raises(A.AudioFormatError, match="Opus"):
        A.InputDecoder(A.WireFormat.OPUS).decode(b"\xff\xff\xff\x00garbage")
    with pytest.raises(A.AudioFormatError, match="even"):
        A.InputDecoder(A.WireFormat.PCM16).decode(b"\x00\x01\x02")


@pytest.mark.parametrize("value, expected", [
    ({"type": "audio/pcm", "rate": 24000}, A.WireFormat.PCM16), ("pcm16", A.WireFormat.PCM16),
    ("g711_ulaw", A.WireFormat.PCMU), ({"type": "audio/pcma"}, A.WireFormat.PCMA), ({"type": "audio/opus"}, A.WireFormat.OPUS),
])
def test_parse_wire_format(value, expected):
    assert A.parse_wire_format(value) is expected


@pytest.mark.parametrize("value", [{"type": "audio/pcm", "rate": 16000}, "mp3", {"rate": 1}, 5])
def test_parse_wire_format_rejects(value):
    with pytest.raises(ValueError):
        A.parse_wire_format(value)


def test_sample_queue_takes_across_chunks_and_counts_what_waits():
    from realtime.sample_queue import SampleQueue

    q = SampleQueue()
    q.append(np.arange(5, dtype=np.int16))
    q.append(np.zeros(0, np.int16))  # an empty chunk is no chunk
    q.append(np.arange(10, 13, dtype=np.int16))
    assert q.samples == 8
    assert np.concatenate(q.take(6)).tolist() == [0, 1, 2, 3, 4, 10] and q.samples == 2
    assert np.concatenate(q.take(6)).tolist() == [11, 12] and q.samples == 0  # fewer than asked: what waits
    assert q.take(1) == []
    q.append(np.ones(3, np.int16))
    q.clear()
    assert q.samples == 0 and q.take(3) == []
