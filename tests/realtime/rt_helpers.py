"""Helpers for the realtime tests (imported by name: tests/ has no packages)."""

from __future__ import annotations

import functools
import subprocess
import tempfile
import wave
from pathlib import Path

import numpy as np


@functools.lru_cache(maxsize=16)
def espeak(text: str, rate_hz: int) -> np.ndarray:
    import soxr

    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "s.wav"
        subprocess.run(["espeak-ng", "-v", "en-us", "-s", "160", "-w", str(path), text], check=True, capture_output=True)
        with wave.open(str(path)) as w:
            src_rate = w.getframerate()
            pcm = np.frombuffer(w.readframes(w.getnframes()), dtype="<i2").astype(np.int16)
    return soxr.resample(pcm, src_rate, rate_hz).astype(np.int16)


def silence(ms: float, rate_hz: int) -> np.ndarray:
    return np.zeros(int(rate_hz * ms / 1000), np.int16)
