"""WAV files in and out (stdlib `wave`, 16-bit PCM) and resampling to 16 kHz."""

from __future__ import annotations

import pathlib
import wave

import numpy as np

from engine.units import SAMPLE_RATE_HZ

_SINC_HALF_TAPS = 16  # taps each side of the windowed-sinc interpolator
_KAISER_BETA = 8.0


def read_wav(path: pathlib.Path) -> tuple[np.ndarray, int]:
    """Mono float32 in [-1, 1] and the file's rate. Multi-channel files are averaged.
    Raises ValueError for anything but 16-bit PCM WAV."""
    try:
        with wave.open(str(path), "rb") as f:
            if f.getcomptype() != "NONE" or f.getsampwidth() != 2:
                raise ValueError(f"{path}: need 16-bit PCM WAV, got {8 * f.getsampwidth()}-bit "
                                 f"{f.getcomptype()}")
            channels, rate = f.getnchannels(), f.getframerate()
            data = f.readframes(f.getnframes())
    except (wave.Error, EOFError) as exc:
        raise ValueError(f"{path}: not a readable WAV file ({exc})") from None
    pcm = np.frombuffer(data, dtype="<i2").astype(np.float32) / 32768.0
    return pcm.reshape(-1, channels).mean(axis=1), rate


def write_wav(path: pathlib.Path, pcm: np.ndarray, rate_hz: int = SAMPLE_RATE_HZ) -> None:
    """float PCM (clipped to [-1, 1]) -> 16-bit mono WAV."""
    ints = np.round(np.clip(pcm, -1.0, 1.0) * 32767.0).astype("<i2")
    with wave.open(str(path), "wb") as f:
        f.setnchannels(1)
        f.setsampwidth(2)
        f.setframerate(rate_hz)
        f.writeframes(ints.tobytes())


def resample(pcm: np.ndarray, from_hz: int, to_hz: int = SAMPLE_RATE_HZ) -> np.ndarray:
    """Band-limited resampling by Kaiser-windowed sinc interpolation, cut-off at the lower
    Nyquist rate (anti-aliasing when downsampling). Exact identity when the rates are equal."""
    if from_hz == to_hz:
        return pcm.astype(np.float32)
    n_out = int(round(len(pcm) * to_hz / from_hz))
    cutoff = min(1.0, to_hz / from_hz)  # fraction of the input Nyquist band kept
    half = int(np.ceil(_SINC_HALF_TAPS / cutoff))
    positions = np.arange(n_out) * (from_hz / to_hz)
    out = np.zeros(n_out, dtype=np.float64)
    base = np.floor(positions).astype(np.int64)
    for offset in range(-half + 1, half + 1):
        idx = base + offset
        dist = positions - idx
        window = np.kaiser(2 * half + 1, _KAISER_BETA)
        w = cutoff * np.sinc(cutoff * dist) * np.interp(dist, np.arange(-half, half + 1), window)
        valid = (idx >= 0) & (idx < len(pcm))
        out[valid] += w[valid] * pcm[idx[valid]]
    return out.astype(np.float32)
