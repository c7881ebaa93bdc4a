"""The clock a session's task reads (docs/architecture.md, "The session runner").

The runner never reads the time module or arms loop timers itself: it is handed a `Clock` (through
`RunnerDeps`, which `Admission` builds). The server's is `SYSTEM_CLOCK`; the runner's tests hand it
the clock of an event loop whose time is virtual (tests/realtime/virtual_time.py), so a session's
seconds of pacing, idle timeout and resume grace pass at once and in the same order on every run.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Protocol


class Clock(Protocol):
    def now(self) -> float:
        """Monotonic seconds on the running event loop's time base (what `call_at` takes)."""

    def wall_ns(self) -> int:
        """Wall-clock time, ns since the epoch (span start times, never durations)."""

    async def sleep(self, seconds: float) -> None: ...

    def call_at(self, when: float, callback: Callable[[], None]) -> asyncio.TimerHandle:
        """Run `callback` on the running event loop at `now() >= when`."""


class SystemClock:
    """The real clock: the time module and the running loop's timers. asyncio's loops keep time with
    time.monotonic(), so `now()` and `call_at()` share one base (as the runner always assumed)."""

    def now(self) -> float:
        return time.monotonic()

    def wall_ns(self) -> int:
        return time.time_ns()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)

    def call_at(self, when: float, callback: Callable[[], None]) -> asyncio.TimerHandle:
        return asyncio.get_running_loop().call_at(when, callback)


SYSTEM_CLOCK: Clock = SystemClock()
