"""Virtual time for gateway tests: an asyncio event loop whose clock jumps to its next timer whenever
every task is waiting on one (the idea of LiveKit Agents' and `looptime`'s fake-time loops).

The loop's `time()` is a `VirtualClock` (realtime/clock.py's `Clock`, handed to the runner through
`Admission(clock=...)`), so asyncio's own timers (sleep, wait_for, call_at/call_later) and the runner's
`now()` share one virtual time base. Each iteration of the loop first polls real I/O without waiting;
when no callback is ready and none arrived, the clock moves to the earliest timer instead of sleeping.
A session's seconds of pacing, idle timeout and resume grace thus pass in no wall time, and the order
of events depends on the code alone, never on how busy the machine is.

What it assumes: no thread the test waits for (a thread's result arrives in wall time, so the clock
would run past it); nothing here runs one (the VAD runs on the loop's thread).

`busy_s` (default 0): virtual seconds each iteration that runs callbacks costs. A test of a client that
floods the session keeps the loop busy without a pause, so without it no time would ever pass.

A test that does not finish within `wall_limit_s` of wall time fails with the reason: a task that
keeps the loop busy (a spin) stops virtual time, and with it every timeout a test sets.
"""

from __future__ import annotations

import asyncio
import selectors
import time
from collections.abc import Callable, Coroutine
from typing import Any

from realtime.clock import SYSTEM_CLOCK, Clock

WALL_LIMIT_S = 30.0  # each test: seconds of wall time (they take well under one)


class VirtualClock:
    """Virtual monotonic seconds (starting at `start`), read by its loop and by the code under test."""

    def __init__(self, start: float = 1000.0) -> None:
        self._t = start
        self._wall0_ns = time.time_ns() - int(start * 1e9)

    def now(self) -> float:
        return self._t

    def wall_ns(self) -> int:
        return self._wall0_ns + int(self._t * 1e9)

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)  # the running loop's timers are on this clock

    def call_at(self, when: float, callback: Callable[[], None]) -> asyncio.TimerHandle:
        return asyncio.get_running_loop().call_at(when, callback)

    def advance(self, seconds: float) -> None:
        """Time passes with no callback run: the loop was late (a GC pause, a busy neighbour)."""
        self._t += max(0.0, seconds)


class _Selector(selectors.DefaultSelector):
    """Real I/O is polled, never waited for while a timer is pending: the clock jumps to it instead."""

    def __init__(self, clock: VirtualClock, busy_s: float, wall_limit_s: float) -> None:
        super().__init__()
        self.clock, self.busy_s = clock, busy_s
        self.wall_deadline = time.monotonic() + wall_limit_s
        self.overran = False

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        if not self.overran and time.monotonic() > self.wall_deadline:
            self.overran = True  # once: asyncio's own cleanup still runs on this loop
            raise TimeoutError("virtual-time test past its wall-clock limit: a task keeps the event loop busy "
                               "(virtual time stands still while it does), or waits on a thread")
        events = super().select(0)
        if events:
            return events
        if timeout is None:  # no timer and nothing ready: only real I/O or a thread can wake the loop
            return super().select(max(0.0, self.wall_deadline - time.monotonic()))
        self.clock.advance(timeout if timeout > 0 else self.busy_s)  # to the earliest timer; or a busy turn's cost
        return []


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    def __init__(self, clock: VirtualClock | None = None, busy_s: float = 0.0, wall_limit_s: float = WALL_LIMIT_S) -> None:
        self.clock = clock or VirtualClock()
        super().__init__(_Selector(self.clock, busy_s, wall_limit_s))
        self._clock_resolution = 1e-9

    def time(self) -> float:
        return self.clock.now()


def current_clock() -> Clock:
    """The running loop's virtual clock, or the system's on an ordinary loop."""
    loop = asyncio.get_running_loop()
    return loop.clock if isinstance(loop, VirtualTimeLoop) else SYSTEM_CLOCK


def lag(seconds: float) -> None:
    """The event loop is late by `seconds` (virtual: the clock moves; wall: the thread blocks)."""
    loop = asyncio.get_running_loop()
    if isinstance(loop, VirtualTimeLoop):
        loop.clock.advance(seconds)
    else:
        time.sleep(seconds)


def run_virtual(main: Callable[[], Coroutine[Any, Any, Any]], busy_s: float = 0.0, wall_limit_s: float = WALL_LIMIT_S) -> Any:
    """Run `main()` to its end on a fresh virtual-time loop."""
    with asyncio.Runner(loop_factory=lambda: VirtualTimeLoop(busy_s=busy_s, wall_limit_s=wall_limit_s)) as runner:
        return runner.run(main())
