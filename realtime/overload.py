"""Overload control: slow start of admissions, and graceful degradation of admitted calls (issue 40).

The capacity model (engine/capacity.py) predicts how many calls the machine serves on time. Before
any live measurement exists it predicts from the warm-up's priors, and callers arriving in a burst
are all admitted on them; a machine slower or busier than its warm-up said then serves every one of
them late, and the lateness feedback only lowers the ceiling for new ones. Two rules close that gap:

**Slow start** (`SlowStart`, TCP's treatment of an unknown path): new sessions are admitted in steps
no larger than what live data has confirmed. The first step is `first_step`, bounded by the priors'
capacity; after each confirmation window (`confirm_s`) in which the open sessions' audio was on time
(enough chunks, none heard late, the engine's live bound agreeing) the open count is confirmed and
the step doubles (up to `max_step`) when the last one was used; a window with lateness sets it back
to one (none while calls are degraded). A caller beyond `confirmed + step` is refused with
`server_at_capacity` and `retry_after_s`, the one refusal path of every transport. Refused, not
queued: a confirmation takes seconds and may grant nothing, a queued caller holds its socket and its
client's timers meanwhile (a Twilio call would be silent), and a refusal with `retry_after_s` (and
/healthz at capacity) lets a balancer or the client go to another replica at once.

**Degradation** (`Ladder`): when the engine falls behind — the engine's live bound below the calls
open, or chunks past the engine's deadline beyond `late_share` of the window (still inside the
client's lead), or any chunk late beyond the lead — the admitted calls' next answers are made
cheaper, cheapest for quality first, one step every `escalate_s`: CFG's unconditional shadow off
for the newest half of the sessions still using it (each such answer steps one row instead of two),
then every answer capped at `short_response_ms`; only when clients still hear lateness (`shed_gaps`
chunks late beyond their lead, or underruns, in the window) `shed_after_s` after the last step, the newest session is
ended with `server_overloaded` and `retry_after_s` (again every `shed_after_s` while they do; the
last session is never ended). On time for
`recover_s`, the steps are undone in reverse, one at a time: length back, then CFG back.

`OverloadControl` applies both to the gateway's sessions (Admission owns it): it reads each
session's delivery counters and the engine's load every `tick_s`, changes conversations through
`Conversation.degrade` (engine/service_api.py), logs every step and counts it in /metrics.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.service_api import NO_DEGRADATION, Degradation, EngineLike, uses_guidance
from realtime.config import OverloadLimits
from realtime.messages import CloseReason

if TYPE_CHECKING:
    from realtime.metrics import GatewayMetrics
    from realtime.runner import SessionRunner

log = logging.getLogger("duplex.gateway")


@dataclass(frozen=True)
class Delivery:
    """What the sessions' clients got over some time: audio chunks, those past the engine's deadline (inside
    the client's lead), those late beyond the lead (a gap the client hears) and client-reported underruns."""

    chunks: int = 0
    late: int = 0
    gaps: int = 0

    def __add__(self, o: Delivery) -> Delivery:
        return Delivery(self.chunks + o.chunks, self.late + o.late, self.gaps + o.gaps)


@dataclass
class DeliveryWindow:
    window_s: float
    _items: deque = field(default_factory=deque)  # (t, Delivery)
    total: Delivery = Delivery()

    def add(self, now: float, d: Delivery) -> Delivery:
        self._items.append((now, d))
        self.total = self.total + d
        while self._items and self._items[0][0] < now - self.window_s:
            _, old = self._items.popleft()
            self.total = Delivery(self.total.chunks - old.chunks, self.total.late - old.late, self.total.gaps - old.gaps)
        return self.total


@dataclass
class SlowStart:
    """Admissions in steps that live data confirms (module docstring). Time is passed in."""

    limits: OverloadLimits
    confirmed: int = 0  # sessions open at once whose audio a window showed on time
    step: int | None = None  # more sessions allowed beyond `confirmed`; None: nobody admitted yet
    window_start: float = 0.0
    peak: int = 0  # the most sessions open in this window
    got: Delivery = Delivery()  # in this window
    changes: list[str] = field(default_factory=list)  # for the log (drained by the caller)

    @property
    def allowed(self) -> int | None:
        return None if self.step is None else self.confirmed + self.step

    def refusal(self, now: float, open_sessions: int, prior_capacity: int) -> str | None:
        """Why a new session may not be admitted now with `open_sessions` holding a slot, or None. The first
        call sets the first step (bounded by `prior_capacity`, the engine's capacity then)."""
        if self.step is None:
            self.step = max(1, min(self.limits.first_step, prior_capacity))
            self.window_start = now
            self.changes.append(f"slow start: first step {self.step} sessions (the warm-up's capacity {prior_capacity})")
        return self.would_refuse(now, open_sessions)

    def would_refuse(self, now: float, open_sessions: int) -> str | None:
        if self.step is None or open_sessions < self.confirmed + self.step:
            return None
        wait = max(0.0, self.window_start + self.limits.confirm_s - now)
        return (f"server at capacity: slow start admits {self.confirmed + self.step} sessions until live data confirms "
                f"more ({self.confirmed} confirmed on time, {self.step} more this window; next window in {wait:.1f} s)")

    def admitted(self, open_sessions: int) -> None:
        self.peak = max(self.peak, open_sessions)

    def observe(self, now: float, open_sessions: int, got: Delivery, live_bound: int, degraded: bool) -> None:
        """The sessions' delivery since the last call; at a window's end, confirm or step back."""
        if self.step is None:
            return
        self.peak = max(self.peak, open_sessions)
        self.got = self.got + got
        if now - self.window_start < self.limits.confirm_s:
            return
        g = self.got
        heard_late = g.gaps > (1.0 - self.limits.on_time_share) * max(g.chunks, 1)
        if self.peak == 0 and open_sessions == 0 and not degraded:
            # idle a whole window: the lateness that cut the step was the load of calls now gone (TCP's
            # restart after idle), so the first step is allowed again, beyond what is confirmed
            first = max(1, self.limits.first_step)
            if self.step < first:
                self.changes.append(f"slow start: idle for a window: {self.confirmed} confirmed, {first} more per window")
                self.step = first
        elif degraded or heard_late:
            step = 0 if degraded else 1
            confirmed = min(self.confirmed, open_sessions)
            if (step, confirmed) != (self.step, self.confirmed):
                self.changes.append(f"slow start: {'calls degraded' if degraded else f'{g.gaps} of {g.chunks} chunks heard late'}: "
                                    f"{confirmed} confirmed, {step} more per window")
            self.step, self.confirmed = step, confirmed
        elif g.chunks < self.limits.confirm_chunks:
            if open_sessions:
                return  # no evidence yet (nobody answered): the window goes on
            # (none open: a new window starts, so a whole idle one can be seen)
        else:
            used = self.peak >= self.confirmed + self.step
            confirmed = max(self.confirmed, min(open_sessions, live_bound))
            step = min(max(1, 2 * self.step), self.limits.max_step) if used else max(1, self.step)
            if (step, confirmed) != (self.step, self.confirmed):
                self.changes.append(f"slow start: {open_sessions} open on time ({g.chunks} chunks, the live bound {live_bound}): "
                                    f"{confirmed} confirmed, {step} more per window")
            self.step, self.confirmed = step, confirmed
        self.window_start, self.peak, self.got = now, open_sessions, Delivery()


@dataclass(frozen=True)
class Candidate:
    """A session the ladder may degrade or end: oldest first in the list it is given."""

    id: str
    uses_cfg: bool  # its options ask for CFG


@dataclass
class Ladder:
    """Degradation steps for the admitted calls (module docstring). Time is passed in; `step()` returns
    what to do now: ("cfg_off", ids), ("short", ()), ("shed", (id,)), ("length_back", ()), ("cfg_on", ids)."""

    limits: OverloadLimits
    cfg_off: set[str] = field(default_factory=set)
    short: bool = False
    last_change: float = -math.inf
    clear_since: float | None = None

    @property
    def degraded(self) -> bool:
        return self.short or bool(self.cfg_off)

    def degradation(self, session_id: str) -> Degradation:
        return Degradation(cfg=session_id not in self.cfg_off,
                           max_response_ms=self.limits.short_response_ms if self.short else None)

    def step(self, now: float, behind: bool, late: bool, sessions: list[Candidate]) -> tuple[str, tuple[str, ...]] | None:
        """`behind`: the engine falls behind (predicted, or chunks past its deadline); `late`: clients hear it (chunks
        late beyond their lead, underruns): only then is a call ended. `sessions`: the candidates, oldest first."""
        self.cfg_off &= {s.id for s in sessions}  # ended ones
        if behind:
            self.clear_since = None
            if now - self.last_change < self.limits.escalate_s:
                return None
            with_cfg = [s.id for s in reversed(sessions) if s.uses_cfg and s.id not in self.cfg_off]  # newest first
            if with_cfg:
                ids = tuple(with_cfg[: math.ceil(len(with_cfg) / 2)])
                self.cfg_off.update(ids)
                self.last_change = now
                return "cfg_off", ids
            if not self.short:
                self.short, self.last_change = True, now
                return "short", ()
            if late and len(sessions) > 1 and now - self.last_change >= self.limits.shed_after_s:
                self.last_change = now
                return "shed", (sessions[-1].id,)
            return None
        if not self.degraded:
            return None
        if self.clear_since is None:
            self.clear_since = now
        if now - max(self.clear_since, self.last_change) < self.limits.recover_s:
            return None
        self.last_change = now
        if self.short:
            self.short = False
            return "length_back", ()
        ids = tuple(sorted(self.cfg_off))
        self.cfg_off.clear()
        return "cfg_on", ids


_STEP_TEXT = {"cfg_off": "CFG's unconditional shadow off for the next answers of {n} session(s)",
              "short": "new answers capped at {ms:g} ms",
              "shed": "the newest session ended (server_overloaded)",
              "length_back": "answers' length back",
              "cfg_on": "CFG back for {n} session(s)"}


def _fixed(load) -> bool:
    """The operator fixed the capacity (engine.capacity_override): the model alone never degrades calls."""
    return load.extra.get("limited_by") == "capacity_override"


class OverloadControl:
    """Slow start and degradation over the gateway's sessions (`sessions()`: the registry, oldest first)."""

    def __init__(self, limits: OverloadLimits, engine: EngineLike, metrics: GatewayMetrics, retry_after_s: float,
                 sessions: Callable[[], list[SessionRunner]], clock: Callable[[], float] = time.monotonic) -> None:
        self.limits, self.engine, self.metrics, self.retry_after_s = limits, engine, metrics, retry_after_s
        self.sessions, self.clock = sessions, clock
        self.slow_start = SlowStart(limits)
        self.ladder = Ladder(limits)
        self.window = DeliveryWindow(limits.window_s)
        self._seen: dict[str, Delivery] = {}  # each session's counters at the last tick
        self._applied: dict[str, Degradation] = {}
        self._over_since: float | None = None  # since when the engine's live bound is below the calls open
        self._task: asyncio.Task | None = None

    # --- admission ---------------------------------------------------------------------------
    def refusal(self, open_sessions: int) -> str | None:
        """Slow start's reason to refuse one more session now, or None."""
        if not self.limits.slow_start:
            return None
        why = self.slow_start.refusal(self.clock(), open_sessions, self.engine.load().capacity)
        self._log_changes()
        return why

    def would_refuse(self, open_sessions: int) -> str | None:
        return self.slow_start.would_refuse(self.clock(), open_sessions) if self.limits.slow_start else None

    def admitted(self, runner: SessionRunner, open_sessions: int) -> None:
        """A session took a slot (new or resumed): it runs under the degradation now in force."""
        self.slow_start.admitted(open_sessions)
        self._apply(runner)
        self._ensure_task()

    # --- the loop ----------------------------------------------------------------------------
    def _ensure_task(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.limits.tick_s)
            try:
                self.tick()
            except Exception:  # overload control must not stop: the calls go on undegraded
                log.exception("overload control failed")

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    def tick(self) -> None:
        now = self.clock()
        runners = [r for r in self.sessions() if not r.suspended]
        got = self._delivery(runners)
        recent = self.window.add(now, got)
        load = self.engine.load()
        bounds = load.extra.get("bounds") or {}
        # the model alone, without the feedback's ceiling; a capacity the operator fixed (engine.capacity_override) is theirs
        fixed = _fixed(load)
        live_bound = min(bounds.values()) if bounds and not fixed else load.capacity
        # the model alone must say so for escalate_s (one CPU sample of callers connecting is no overload);
        # chunks past their deadline act at once
        if len(runners) <= live_bound:
            self._over_since = None
        elif self._over_since is None:
            self._over_since = now
        over = self._over_since is not None and now - self._over_since >= self.limits.escalate_s
        late = (recent.late >= self.limits.min_late and recent.late > self.limits.late_share * max(recent.chunks, 1)) or recent.gaps > 0
        if self.limits.degrade:  # (a call is ended only for lateness its client hears: gaps beyond its lead, underruns)
            candidates = [Candidate(r.id, uses_guidance(r.proto.engine_options().cfg_scale)) for r in runners]
            action = self.ladder.step(now, over or late, recent.gaps >= self.limits.shed_gaps, candidates)
            if action is not None:
                self._act(action, runners, recent, live_bound)
            for r in runners:  # (a resumed session, too, runs under the degradation in force)
                self._apply(r)
            registered = {r.id for r in self.sessions()}  # (a suspended one keeps its entry: its conversation keeps its degradation)
            self._applied = {k: v for k, v in self._applied.items() if k in registered}
        if self.limits.slow_start:
            self.slow_start.observe(now, len(runners), got, live_bound, self.ladder.degraded)
            self._log_changes()
        m = self.metrics
        m.degraded_sessions.labels("cfg_off").set(len(self.ladder.cfg_off))
        m.degraded_sessions.labels("short").set(len(runners) if self.ladder.short else 0)
        if self.slow_start.allowed is not None:
            m.slow_start_allowed.set(self.slow_start.allowed)
            m.slow_start_confirmed.set(self.slow_start.confirmed)

    def _delivery(self, runners: list[SessionRunner]) -> Delivery:
        """The sessions' new chunks since the last tick (a session's counters are cumulative)."""
        total, seen = Delivery(), {}
        for r in runners:
            st = r.session.stats
            now = Delivery(st.chunks, st.chunks_late, st.chunks_gap + st.underruns_reported)
            old = self._seen.get(r.id, Delivery())
            total = total + Delivery(now.chunks - old.chunks, now.late - old.late, now.gaps - old.gaps)
            seen[r.id] = now
        self._seen = seen
        return total

    def _act(self, action: tuple[str, tuple[str, ...]], runners: list[SessionRunner], recent: Delivery, live_bound: int) -> None:
        kind, ids = action
        self.metrics.overload_steps.labels(kind).inc()
        why = (f"{len(runners)} sessions, the engine's live bound {live_bound}; {recent.late} of {recent.chunks} chunks past "
               f"the engine's deadline, {recent.gaps} heard late in {self.limits.window_s:g} s")
        text = _STEP_TEXT[kind].format(n=len(ids), ms=self.limits.short_response_ms)
        (log.info if kind in ("length_back", "cfg_on") else log.warning)("overload: %s (%s)", text, why)
        if kind == "shed":
            victim = next(r for r in runners if r.id == ids[0])
            victim.shutdown(CloseReason.SERVER_OVERLOADED, "server_overloaded",
                            f"the server is overloaded: this call was the newest and is ended so the others stay on time; "
                            f"try again in {self.retry_after_s:g} s", retry_after_s=self.retry_after_s)
            return

    def _apply(self, runner: SessionRunner) -> None:
        d = self.ladder.degradation(runner.id)
        if self._applied.get(runner.id, NO_DEGRADATION) != d:
            runner.conv.degrade(d)
            self._applied[runner.id] = d

    def _log_changes(self) -> None:
        for line in self.slow_start.changes:
            log.info("admission: %s", line)
        self.slow_start.changes.clear()
