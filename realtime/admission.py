"""The one way a session enters and leaves the server, whatever its transport.

    runner = admission.open_session("websocket", link, make_protocol)   # AtCapacity: refused, counted
    await admission.run(runner)                                         # to its end; never raises

`open_session` makes the session (with the server's VAD and pacing settings, or a transport's own),
its protocol, its engine conversation (the gateway's cap first, then slow start, then the engine's
measured capacity) and its runner, and registers it at once, so a session still connecting (a WebRTC
data channel opening) counts against the cap. `run` runs it, then frees its conversation and counts
why it ended. `overload` (realtime/overload.py) admits new sessions in steps live data confirms and
degrades the admitted calls' answers when the engine falls behind.
"""

from __future__ import annotations

import asyncio
import logging
from enum import Enum

from opentelemetry.trace import Tracer

from engine.service_api import AtCapacity, EngineLike
from realtime.clock import SYSTEM_CLOCK, Clock
from realtime.config import ServerConfig
from realtime.credentials import same_secret
from realtime.link import Link
from realtime.messages import CloseReason
from realtime.metrics import GatewayMetrics
from realtime.overload import OverloadControl
from realtime.runner import AudioOut, RunnerDeps, SessionRunner, WireProtocol
from realtime.session import Session, SessionLimits, new_id
from realtime.vad import VadParams
from realtime.vad_batch import VadBatcher

log = logging.getLogger("duplex.gateway")


class ServerDefault(Enum):
    """`new_session`'s default turn detection: the server config's `vad` section (None means "none")."""

    VAD = "vad"


SERVER_VAD = ServerDefault.VAD


class Admission:
    def __init__(self, engine: EngineLike, config: ServerConfig, metrics: GatewayMetrics, vad: VadBatcher | None,
                 tracer: Tracer | None = None, clock: Clock = SYSTEM_CLOCK) -> None:
        """`tracer`: sessions that turn session.tracing on record spans with it (realtime/tracing.py).
        `clock`: the sessions' and overload control's time (tests: a virtual one)."""
        self.engine = engine
        self.config = config
        self.metrics = metrics
        self.sessions: dict[str, SessionRunner] = {}
        self.closing = False  # the server is stopping: nobody is admitted, lost links are not kept
        self.draining = False  # the server is draining: no new session; running ones (and their resumes) go on
        self.deps = RunnerDeps(config.limits, metrics, vad, lambda: self.closing, lambda: self._gateway_full(resume=True),
                               engine.report_delivery, tracer, clock)
        self._idle = asyncio.Event()  # no session registered
        self._idle.set()
        self._background: set[asyncio.Task] = set()
        self.overload = OverloadControl(config.limits.overload, engine, metrics, config.limits.retry_after_s,
                                        lambda: list(self.sessions.values()), clock.now)

    def new_session(self, vad: VadParams | None | ServerDefault = SERVER_VAD, output_frame_ms: int | None = None,
                    acked_playback: bool = False) -> Session:
        """A session with the server's pacing and turn detection, or a transport's own (`vad`, `output_frame_ms`,
        `acked_playback`: see SessionLimits)."""
        a = self.config.audio
        limits = SessionLimits(output_frame_ms or a.output_frame_ms, a.lead_ms, self.config.limits.max_turn_ms,
                               acked_playback=acked_playback)
        turn_detection = self.config.vad.params() if isinstance(vad, ServerDefault) else vad
        return Session(new_id("sess"), turn_detection, limits, vad_deferred=self.deps.vad is not None,
                       noise_reduction=self.config.session.noise_reduction)

    def open_session(self, transport: str, link: Link, proto: WireProtocol, resume_token: str | None = None,
                     audio_out: AudioOut | None = None) -> SessionRunner:
        """A registered runner for `proto`'s session (from `new_session`); raises AtCapacity (counted)
        when the gateway's cap or the engine's capacity is reached."""
        session = proto.session
        conv = self._open_conversation(session.id, proto)
        runner = SessionRunner(self.deps, link, proto, conv, transport, resume_token, audio_out)
        self.sessions[runner.id] = runner
        self._idle.clear()
        self.overload.admitted(runner, self._holding())
        self.metrics.sessions_total.inc()
        self.metrics.sessions_active.inc()
        log.info("session %s (%s) start: %d open", runner.id, transport, len(self.sessions))
        return runner

    async def run(self, runner: SessionRunner) -> None:
        """Run an admitted session to its end, free its conversation, count its end. Never raises."""
        try:
            await runner.run()
        except Exception:
            log.exception("session %s failed", runner.id)
        finally:
            await self.discard(runner)

    def background(self, coro) -> asyncio.Task:
        """A session's task that no socket handler waits for (WebRTC: the HTTP answer returns at once);
        `stop()` waits for it too."""
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    async def abandon(self, runner: SessionRunner) -> None:
        """Unregister a session that never ran (its transport failed to set up) and free its conversation."""
        if self.sessions.pop(runner.id, None) is not None:
            self.metrics.sessions_active.dec()
            self._note_idle()
            await runner.conv.close()

    async def discard(self, runner: SessionRunner) -> None:
        """Unregister an ended session, free its engine conversation, count why it ended."""
        if self.sessions.pop(runner.id, None) is None:
            return
        self.metrics.sessions_active.dec()
        self._note_idle()
        await runner.conv.close()
        m = self.metrics
        m.sessions_ended.labels(runner.transport, runner.end_reason().label).inc()
        m.client_errors.inc(runner.proto.client_errors)
        if runner.proto.offered_tools:
            m.sessions_with_tools.inc()
        for status in runner.session.response_statuses():
            m.responses.labels(status.name.lower()).inc()
        runner.log_end()

    def find_resumable(self, token: str) -> SessionRunner | None:
        return next((r for r in list(self.sessions.values())
                     if r.resume_token is not None and same_secret(token, r.resume_token)), None)

    def _note_idle(self) -> None:
        if not self.sessions:
            self._idle.set()

    async def drain(self, timeout_s: float) -> bool:
        """Admit no new session and wait until the running ones end (True) or `timeout_s` passes (False).
        Their resumes are still taken: a call whose link dropped is a running call."""
        self.draining = True
        log.info("draining: no new sessions; waiting up to %.0f s for %d running", timeout_s, len(self.sessions))
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            return False
        return True

    async def stop(self) -> None:
        """Tell every session the server is going away and wait for them to close."""
        self.closing = True
        self.overload.stop()
        for runner in list(self.sessions.values()):
            runner.shutdown(CloseReason.SERVER_SHUTDOWN, "server_shutting_down", "the server is shutting down")
        tasks = [r.task for r in self.sessions.values() if r.task] + list(self._background)
        if tasks:
            await asyncio.wait(tasks, timeout=self.config.limits.close_timeout_s)

    def _gateway_full(self, resume: bool = False) -> str | None:
        """Why no session (`resume`: no resumed session) may take a slot now, or None. Detached sessions
        between answers hold none."""
        cap = self.config.limits.max_sessions
        if self.closing:
            return "the server is shutting down"
        if self.draining and not resume:
            return "the server is draining (it takes no new sessions; another replica does)"
        holding = self._holding()
        if cap is not None and holding >= cap:
            return f"server at capacity: {holding} sessions active (limit {cap})"
        return None

    def _holding(self) -> int:
        return sum(1 for r in self.sessions.values() if not r.suspended)

    def full(self) -> str | None:
        """Why a new session would be refused now (the gateway's cap, slow start, the engine's capacity, a stop),
        or None: /healthz's `at_capacity`, so a load balancer sends callers elsewhere before they are refused."""
        if (why := self._gateway_full() or self.overload.would_refuse(self._holding())) is not None:
            return why
        load = self.engine.load()
        if load.conversations >= load.capacity:
            return f"server at capacity: {load.conversations} conversations active, {load.capacity} can respond in real time"
        return None

    def _open_conversation(self, session_id: str, proto: WireProtocol):
        reason = "capacity"
        try:
            if (why := self._gateway_full()) is not None:
                raise AtCapacity(why)
            if (why := self.overload.refusal(self._holding())) is not None:
                load = self.engine.load()
                if load.conversations < load.capacity:  # else the engine's own capacity refuses (and says so)
                    reason = "slow_start"
                    raise AtCapacity(why)
            return self.engine.open_conversation(session_id, proto.engine_options())
        except AtCapacity as e:
            self.metrics.sessions_refused.labels(reason).inc()
            e.retry_after_s = self.config.limits.retry_after_s
            raise
