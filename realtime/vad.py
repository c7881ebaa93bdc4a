"""Voice activity detection: Silero VAD (ONNX, no torch) and OpenAI `server_vad` endpointing.

`SileroVad` runs the model that ships inside the `silero-vad` package (`silero_vad/data/silero_vad.onnx`)
with onnxruntime over 32 ms windows (512 samples at 16 kHz): ~150 us per window alone on one core,
~60 us when the windows of 8 streams run as one batch (`run_silero`; the gateway's `VadBatcher`).
The package itself is never imported (its `__init__` imports torch): only its data file is read.

`ServerVad` turns per-window speech probabilities into turn events with OpenAI's semantics:
speech starts when a window's probability reaches `threshold` (after `min_speech_ms` of such windows),
its reported start includes `prefix_padding_ms`; it stops after `silence_duration_ms` of windows below
`threshold - hysteresis`. Between the two, after `speculate_after_ms` of silence, it reports a pause
(the point where the session starts its answer speculatively and where the user's turn, as the model
hears it, ends) and, if speech comes back before the turn ends, a resume. It is pure: positions in,
events out, no clock.
"""

from __future__ import annotations

import importlib.util
import os
from collections import deque
from dataclasses import dataclass, field
from enum import IntEnum

import numpy as np

from engine.service_api import SAMPLE_RATE_HZ as ENGINE_RATE_HZ

VAD_RATE_HZ = ENGINE_RATE_HZ  # Silero takes 16 kHz, the engine-side rate the session works at
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
    pending: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))  # not yet run
    probs: deque = field(default_factory=deque)  # computed, not yet taken
    taken_samples: int = 0  # audio whose probabilities were taken


class SileroVad:
    """Streaming speech probabilities for one audio stream (int16 at 16 kHz in, one float per 32 ms out).

    Two ways to use it: `process(pcm)` runs the model at once and returns the probabilities of the
    windows this audio completed; or `feed(pcm)` now, `run_silero([...streams])` later over many
    streams in one batched call, then `take(n_samples)` per piece of audio fed, in order.
    """

    def __init__(self) -> None:
        _shared_session()  # a missing model fails here, not at the first audio
        self._state = _SileroState()

    def reset(self) -> None:
        self._state = _SileroState()

    def feed(self, pcm16k: np.ndarray) -> None:
        st = self._state
        st.pending = np.concatenate([st.pending, pcm16k.astype(np.float32) / 32768.0])

    @property
    def windows_pending(self) -> int:
        return self._state.pending.size // WINDOW_SAMPLES

    def can_take(self, n_samples: int) -> bool:
        st = self._state
        return (st.taken_samples + n_samples) // WINDOW_SAMPLES - st.taken_samples // WINDOW_SAMPLES <= len(st.probs)

    def take(self, n_samples: int) -> list[float]:
        """The probabilities of the windows completed by the next `n_samples` fed (they must have been run)."""
        st = self._state
        n = (st.taken_samples + n_samples) // WINDOW_SAMPLES - st.taken_samples // WINDOW_SAMPLES
        if n > len(st.probs):
            raise RuntimeError("SileroVad.take: the windows of this audio have not been run")
        st.taken_samples += n_samples
        return [st.probs.popleft() for _ in range(n)]

    def process(self, pcm16k: np.ndarray) -> list[float]:
        """Probabilities of every whole window completed by this audio, in order."""
        self.feed(pcm16k)
        run_silero([self])
        return self.take(pcm16k.size)

    def _next_window(self) -> np.ndarray:
        """The model input of the oldest pending window (with its context); consumes it."""
        st = self._state
        window = st.pending[:WINDOW_SAMPLES]
        st.pending = st.pending[WINDOW_SAMPLES:]
        inp = np.concatenate([st.context, window])
        st.context = window[-_CONTEXT_SAMPLES:]
        return inp


_SR = np.array(VAD_RATE_HZ, dtype=np.int64)


def run_silero(streams: list[SileroVad], max_rounds: int | None = None) -> int:
    """Run the pending windows of every stream, at most `max_rounds` each (None: all); one model call
    per round, each stream a row of it.

    Rows are independent (the recurrent state is per row), so a stream's probabilities do not depend
    on who it was batched with; a batch of 8 costs ~60 us a window against ~150 us alone. Returns the
    number of model calls.
    """
    session, calls = _shared_session(), 0
    while (max_rounds is None or calls < max_rounds) and (active := [s for s in streams if s.windows_pending]):
        inp = np.stack([s._next_window() for s in active])
        rnn = np.concatenate([s._state.rnn for s in active], axis=1)
        out, rnn = session.run(None, {"input": inp, "state": rnn, "sr": _SR})
        for i, s in enumerate(active):
            s._state.rnn = rnn[:, i : i + 1]
            s._state.probs.append(float(out[i, 0]))
        calls += 1
    return calls


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
    # ours: after this much silence the answer is started speculatively, while the VAD waits out the
    # rest of `silence_duration_ms` (docs/protocol.md, "Speculative response"); the user's turn as the
    # model hears it ends here whether or not `speculative` is on, so both give the same answer
    speculate_after_ms: int = 160
    speculative: bool = True

    @property
    def pauses(self) -> bool:
        """The pause comes before the end of the turn (else there is no pause: the turn keeps all its silence)."""
        return _windows(self.speculate_after_ms) < _windows(self.silence_duration_ms)

    def problems(self) -> list[tuple[str, str]]:
        """The out-of-range fields, as (field, why): callers name the field in their own terms."""
        out = [] if 0.0 <= self.threshold <= 1.0 else [("threshold", "must be within [0, 1]")]
        for name in ("prefix_padding_ms", "silence_duration_ms", "min_speech_ms", "speculate_after_ms"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= 10_000:
                out.append((name, "must be an integer in [0, 10000]"))
        return out

    def validate(self) -> None:
        if bad := self.problems():
            name, why = bad[0]
            raise ValueError(f"turn_detection.{name} {why}")


class VadPhase(IntEnum):
    SILENCE = 0
    MAYBE_SPEECH = 1  # above threshold, not yet min_speech_ms
    SPEECH = 2


def _windows(ms: float) -> int:
    """Whole windows that make at least `ms` (at least one)."""
    return max(1, int(np.ceil(ms / WINDOW_MS)))


# What `ServerVad.feed` reports; `at_ms` is the end of the window that decided it: where in the stream
# it happened (the session splits the audio there: what came before goes where the old state sent it).


@dataclass(frozen=True)
class VoiceStarted:
    """Speech began: `min_speech_ms` of windows at or above `threshold`."""

    audio_start_ms: float  # the speech's first window minus `prefix_padding_ms` (never before 0)
    at_ms: float


@dataclass(frozen=True)
class VoicePaused:
    """`speculate_after_ms` of silence within speech: where the user's turn, as the model hears it, ends
    unless the speech resumes."""

    at_ms: float


@dataclass(frozen=True)
class VoiceResumed:
    """Speech again after a pause, before the turn ended (`at_ms`: where that window began)."""

    at_ms: float


@dataclass(frozen=True)
class VoiceStopped:
    """`silence_duration_ms` of silence: the turn ended."""

    audio_end_ms: float  # the end of the last speech window
    at_ms: float


VadEvent = VoiceStarted | VoicePaused | VoiceResumed | VoiceStopped


@dataclass
class _ServerVadState:
    phase: VadPhase = VadPhase.SILENCE
    windows_seen: int = 0
    speech_start_window: int = 0
    last_speech_window: int = 0
    paused: bool = False


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
        p, st = self.params, self._state
        events: list[VadEvent] = []
        min_windows = _windows(p.min_speech_ms)
        silence_windows = _windows(p.silence_duration_ms)
        pause_windows = _windows(p.speculate_after_ms) if p.pauses else None
        for prob in probs:
            i = st.windows_seen
            st.windows_seen += 1
            end = self._ms(i + 1)
            if st.phase is VadPhase.SPEECH:
                if prob >= p.threshold - p.hysteresis:
                    st.last_speech_window = i
                    if st.paused:
                        st.paused = False
                        events.append(VoiceResumed(self._ms(i)))
                elif i - st.last_speech_window >= silence_windows:
                    st.phase, st.paused = VadPhase.SILENCE, False
                    events.append(VoiceStopped(self._ms(st.last_speech_window + 1), end))
                elif pause_windows is not None and not st.paused and i - st.last_speech_window >= pause_windows:
                    st.paused = True
                    events.append(VoicePaused(end))
                continue
            if prob < p.threshold:
                st.phase = VadPhase.SILENCE
                continue
            if st.phase is VadPhase.SILENCE:
                st.phase, st.speech_start_window = VadPhase.MAYBE_SPEECH, i
            if i - st.speech_start_window + 1 >= min_windows:
                st.phase, st.last_speech_window = VadPhase.SPEECH, i
                events.append(VoiceStarted(max(0.0, self._ms(st.speech_start_window) - p.prefix_padding_ms), end))
        return events

    def _ms(self, window: int) -> float:
        return self.offset_ms + window * WINDOW_MS
