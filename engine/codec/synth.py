"""A speech-like test signal made in numpy, so tests and benchmarks need no TTS or recordings.

Voiced syllables: a harmonic source (glottal-like 1/k roll-off) with a gliding pitch, shaped by
three formant resonances that move between vowel targets, separated by short noise bursts
(fricatives) and pauses. Deterministic for a given seed.
"""

from __future__ import annotations

import numpy as np

from engine.units import SAMPLE_RATE_HZ

_VOWEL_FORMANTS_HZ = np.array(
    [[730, 1090, 2440], [270, 2290, 3010], [300, 870, 2240], [530, 1840, 2480], [570, 840, 2410]]
)


def _resonator(x: np.ndarray, freq_hz: np.ndarray, bandwidth_hz: float) -> np.ndarray:
    """Two-pole resonance whose centre frequency may vary per sample."""
    r = np.exp(-np.pi * bandwidth_hz / SAMPLE_RATE_HZ)
    a1 = -2 * r * np.cos(2 * np.pi * freq_hz / SAMPLE_RATE_HZ)
    a2 = r * r
    y = np.zeros_like(x)
    y1 = y2 = 0.0
    for i in range(len(x)):
        y0 = (1 - r) * x[i] - a1[i] * y1 - a2 * y2
        y[i] = y0
        y2, y1 = y1, y0
    return y


def speech_like(duration_s: float, seed: int = 0) -> np.ndarray:
    """float32 mono at 16 kHz in [-1, 1]."""
    rng = np.random.default_rng(seed)
    n_total = int(round(duration_s * SAMPLE_RATE_HZ))
    out = np.zeros(n_total, dtype=np.float64)
    pos = int(0.05 * SAMPLE_RATE_HZ)
    while pos < n_total:
        syll = int(rng.uniform(0.12, 0.3) * SAMPLE_RATE_HZ)
        syll = min(syll, n_total - pos)
        if syll <= 0:
            break
        t = np.arange(syll) / SAMPLE_RATE_HZ
        f0_hz = rng.uniform(100, 220) * (1 + 0.15 * np.sin(2 * np.pi * rng.uniform(1, 4) * t))
        phase = 2 * np.pi * np.cumsum(f0_hz) / SAMPLE_RATE_HZ
        source = np.zeros(syll)
        for k in range(1, 30):
            source += np.sin(k * phase) / k
        v0, v1 = _VOWEL_FORMANTS_HZ[rng.integers(0, len(_VOWEL_FORMANTS_HZ), size=2)]
        glide = np.linspace(0, 1, syll)[:, None]
        formants_hz = v0 * (1 - glide) + v1 * glide
        voiced = np.zeros(syll)
        for j, (bw, gain) in enumerate([(80, 1.0), (100, 0.6), (140, 0.3)]):
            voiced += _resonator(source, formants_hz[:, j], bw) * gain
        envelope = np.sin(np.pi * np.linspace(0, 1, syll)) ** 0.5
        seg = voiced * envelope
        if rng.random() < 0.4:  # a fricative onset
            burst = int(min(syll, 0.05 * SAMPLE_RATE_HZ))
            seg[:burst] += 0.3 * rng.standard_normal(burst) * np.hanning(burst)
        out[pos : pos + syll] += seg
        pos += syll + int(rng.choice([0.02, 0.05, 0.25]) * SAMPLE_RATE_HZ)  # gaps and pauses
    peak = np.abs(out).max()
    if peak > 0:
        out *= 0.7 / peak
    return out.astype(np.float32)
