"""Silero VAD of every session in one batched model call per tick.

Silero is the gateway's largest per-session CPU cost: ~150 us per 32 ms window run alone, ~60 us
per window when 8 streams run as rows of one call (`realtime.vad.run_silero`). Sessions created
with `vad_deferred=True` keep user audio waiting for its speech probabilities; their runner submits
the session's Silero stream here and settles the session when told the windows were run.

A stream is submitted once it has a whole window to run. A tick runs when every stream active in the
last `_ACTIVE_S` has submitted again (the usual case: all sessions stream audio, so a tick every 32 ms
runs one window of each as one call) or `period_ms` after the first submission, whichever comes first. So a lone session is never delayed, and with many the added VAD latency is bounded by
`period_ms` (barge-in and end-of-turn detection are that much later at most; TTFA is still measured
from the audio's arrival).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from realtime.vad import SileroVad, run_silero

log = logging.getLogger("duplex.gateway")

_ACTIVE_S = 0.1  # a stream that submitted this recently is expected to submit again (> one 32 ms window)
# A tick runs at most this many windows of a stream (512 ms of audio, ~1-2.5 ms of CPU): a session that
# sent seconds of audio at once has it run over several ticks, with the event loop free in between,
# instead of one tick stalling every other session's audio (issue 23).
MAX_ROUNDS_PER_TICK = 16


class VadBatcher:
    def __init__(self, period_ms: float) -> None:
        if period_ms <= 0:
            raise ValueError("VadBatcher period_ms must be > 0")
        self.period_s = period_ms / 1000.0
        self._waiting: dict[SileroVad, Callable[[], None]] = {}
        self._active: dict[SileroVad, float] = {}  # stream -> when it last submitted
        self._timer: asyncio.TimerHandle | None = None
        self._soon: asyncio.Handle | None = None
        self.ticks = 0
        self.calls = 0  # model calls (rounds) over all ticks
        self.windows = 0  # windows run over all ticks
        self.cpu_s = 0.0  # CPU seconds of the model calls (onnxruntime runs them on the loop's thread)

    def submit(self, stream: SileroVad, done: Callable[[], None]) -> None:
        """Run `stream`'s pending windows in the next tick, then call `done()` (on the event loop)."""
        self._waiting[stream] = done
        self._active[stream] = time.monotonic()
        loop = asyncio.get_running_loop()
        if self._timer is None:
            self._timer = loop.call_later(self.period_s, self._tick)
        if len(self._waiting) >= len(self._active) and self._soon is None:
            self._soon = loop.call_soon(self._tick)  # after the submitting task's step, not inside it

    def _tick(self) -> None:
        for h in (self._timer, self._soon):
            if h is not None:
                h.cancel()
        self._timer = self._soon = None
        waiting, self._waiting = self._waiting, {}
        if not waiting:
            return
        stale = time.monotonic() - _ACTIVE_S
        self._active = {s: t for s, t in self._active.items() if t >= stale}
        streams = list(waiting)
        pending = sum(s.windows_pending for s in streams)
        try:
            cpu0 = time.thread_time()
            self.calls += run_silero(streams, MAX_ROUNDS_PER_TICK)
            self.cpu_s += time.thread_time() - cpu0
            self.windows += pending - sum(s.windows_pending for s in streams)
        except Exception:  # each session settles its own audio and reports its own failure
            log.exception("batched VAD failed for %d sessions", len(streams))
        self.ticks += 1
        for done in waiting.values():
            done()
