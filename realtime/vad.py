"""Voice activity detection: Silero VAD (ONNX, no torch) and OpenAI `server_vad` endpointing.

`SileroVad` runs the model that ships inside the `silero-vad` package (`silero_vad/data/silero_vad.onnx`)
with onnxruntime, one 32 ms window (512 samples at 16 kHz) at a time, ~0.2 ms per window on one core.
The package itself is never imported (its `__init__` imports torch): only its data file is read.

`ServerVad` turns per-window speech probabilities into turn events with OpenAI's semantics:
speech starts when a window's probability reaches `threshold` (after `min_speech_ms` of such windows),
its reported start includes `prefix_padding_ms`; it stops after `silence_duration_ms` of windows below
`threshold - hysteresis`. It is pure: positions in, events out, no clock.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, field
from enum import IntEnum

import numpy as np

VAD_RATE_HZ = 16_000
WINDOW_SAMPLES = 512  # 32 ms: the window Silero v5 takes at 16 kHz
WINDOW_MS = 1000.0 * WINDOW_SAMPLES / VAD_RATE_HZ
_CONTEXT_SAMPLES = 64  # Silero v5 prepends the previous window's last 64 samples


def silero_model_path() -> str:
    spec = importlib.util.find_spec("silero_vad")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("silero-vad is not installed (pip install silero-vad)")
    path = os.path.join(list(spec.submodule_search_locations)[0], "data", "silero_vad.onnx")
    if not os.path.exists(path):
        raise RuntimeError(f"silero-vad's ONNX model is missing: {path}")
    return path


_SESSION = None


def _shared_session():
    """One InferenceSession per process (thread-safe for run()); state lives per stream."""
    global _SESSION
    if _SESSION is None:
        import onnxruntime as ort

        opts = ort.SessionOptions()
        opts.inter_op_num_threads = 1
        opts.intra_op_num_threads = 1
        # one small model per 32 ms window: no thread pool to spin up (148 vs 169 us per window)
        opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
        _SESSION = ort.InferenceSession(silero_model_path(), sess_options=opts, providers=["CPUExecutionProvider"])
    return _SESSION


@dataclass
class _SileroState:
    rnn: np.ndarray = field(default_factory=lambda: np.zeros((2, 1, 128), np.float32))
    context: np.ndarray = field(default_factory=lambda: np.zeros(_CONTEXT_SAMPLES, np.float32))
    pending: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))  # < one window


class SileroVad:
    """Streaming speech probabilities for one audio stream (int16 at 16 kHz in, one float per 32 ms out)."""

    def __init__(self) -> None:
        self._session = _shared_session()
        self._sr = np.array(VAD_RATE_HZ, dtype=np.int64)
        self._state = _SileroState()

    def reset(self) -> None:
        self._state = _SileroState()

    def process(self, pcm16k: np.ndarray) -> list[float]:
        """Probabilities of every whole window completed by this audio, in order."""
        st = self._state
        x = np.concatenate([st.pending, pcm16k.astype(np.float32) / 32768.0])
        probs = []
        n = x.size // WINDOW_SAMPLES
        for i in range(n):
            window = x[i * WINDOW_SAMPLES : (i + 1) * WINDOW_SAMPLES]
            inp = np.concatenate([st.context, window])[None, :]
            out, st.rnn = self._session.run(None, {"input": inp, "state": st.rnn, "sr": self._sr})
            st.context = window[-_CONTEXT_SAMPLES:]
            probs.append(float(out[0, 0]))
        st.pending = x[n * WINDOW_SAMPLES :]
        return probs


@dataclass(frozen=True)
class VadParams:
    """OpenAI server_vad parameters, plus two of ours (documented in docs/protocol.md)."""

    threshold: float = 0.5
    prefix_padding_ms: int = 300
    silence_duration_ms: int = 500
    create_response: bool = True
    interrupt_response: bool = True
    min_speech_ms: int = 64  # ours: speech must last this long before speech_started (clicks, coughs)
    hysteresis: float = 0.15  # ours: silence is probability < threshold - hysteresis (Silero's own rule)

    def validate(self) -> None:
        if not 0.0 <= self.threshold <= 1.0:
            raise ValueError("turn_detection.threshold must be within [0, 1]")
        for name in ("prefix_padding_ms", "silence_duration_ms", "min_speech_ms"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= 10_000:
                raise ValueError(f"turn_detection.{name} must be an integer in [0, 10000]")


class VadPhase(IntEnum):
    SILENCE = 0
    MAYBE_SPEECH = 1  # above threshold, not yet min_speech_ms
    SPEECH = 2


@dataclass(frozen=True)
class VadEvent:
    kind: str  # "started" | "stopped"
    audio_ms: float  # started: speech start minus prefix padding; stopped: end of the last speech window


@dataclass
class _ServerVadState:
    phase: VadPhase = VadPhase.SILENCE
    windows_seen: int = 0
    speech_start_window: int = 0
    last_speech_window: int = 0


class ServerVad:
    """Endpointing over a stream of window probabilities; `offset_ms` is where window 0 began."""

    def __init__(self, params: VadParams, offset_ms: float = 0.0) -> None:
        self.params = params
        self.offset_ms = offset_ms
        self._state = _ServerVadState()

    @property
    def speaking(self) -> bool:
        return self._state.phase is VadPhase.SPEECH

    def reset(self, offset_ms: float) -> None:
        self.offset_ms = offset_ms
        self._state = _ServerVadState()

    def feed(self, probs: list[float]) -> list[VadEvent]:
        p, st, events = self.params, self._state, []
        min_windows = max(1, int(np.ceil(p.min_speech_ms / WINDOW_MS)))
        silence_windows = max(1, int(np.ceil(p.silence_duration_ms / WINDOW_MS)))
        for prob in probs:
            i = st.windows_seen
            st.windows_seen += 1
            if st.phase is VadPhase.SPEECH:
                if prob >= p.threshold - p.hysteresis:
                    st.last_speech_window = i
                elif i - st.last_speech_window >= silence_windows:
                    st.phase = VadPhase.SILENCE
                    events.append(VadEvent("stopped", self._ms(st.last_speech_window + 1)))
                continue
            if prob < p.threshold:
                st.phase = VadPhase.SILENCE
                continue
            if st.phase is VadPhase.SILENCE:
                st.phase, st.speech_start_window = VadPhase.MAYBE_SPEECH, i
            if i - st.speech_start_window + 1 >= min_windows:
                st.phase, st.last_speech_window = VadPhase.SPEECH, i
                events.append(VadEvent("started", max(0.0, self._ms(st.speech_start_window) - p.prefix_padding_ms)))
        return events

    def _ms(self, window: int) -> float:
        return self.offset_ms + window * WINDOW_MS
