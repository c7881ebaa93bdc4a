"""One session's task, shared by every transport (docs/architecture.md, "The session runner").

A transport brings two things: a `Link` (its message channel: the WebSocket, the WebRTC data channel)
and a `WireProtocol` (its sans-I/O event machine: OpenAI Realtime events, Twilio Media Streams). The
runner owns everything else: the session loop, the engine's response handles, bounded queues,
pacing wake-ups, idle timeout, slow-client disconnect, metrics. Only this loop calls the session.

    link reader ──client lane──▶ session loop ──outbound──▶ link writer
    transport audio ─┘           (protocol + Session + engine commands; the only owner of their state)
    response handles ──server lane──┘   (engine chunks never wait behind client input)

The loop waits for input or the next pacing deadline, feeds the protocol, releases due audio, runs
engine commands and hands wire messages to the writer. A full outbound queue means the client does
not read: it is disconnected with a reason.

Resume (a runner given a `resume_token`; docs/protocol.md "Reconnect and resume"): every message sent
is numbered and kept in a bounded `ReplayBuffer`. When the link is lost without a goodbye
(`link.lost()`), the session is detached, not ended: its loop goes on (the engine may finish the
answer) but output pacing stops, so audio not delivered is not played and stays pending. `attach()`
with a new link within `limits.resume_grace_s` replays what the client did not receive and resumes
pacing where it stopped; past the grace the session ends like a close.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np
from opentelemetry.trace import Tracer

from engine.service_api import AtCapacity, Conversation, ConversationOptions, ResponseHandle
from realtime.clock import SYSTEM_CLOCK, Clock
from realtime.config import LimitsSection
from realtime.link import Link
from realtime.messages import (
    Attach, ClientMessage, CloseReason, Closing, EngineChunk, EngineFailed, HistoryDropped, Inbound, LinkClosed, Shutdown,
    Throttled, TransportAudio, EngineUserTranscript, EngineUserTranscriptEnd, VadReady,
)
from realtime.metrics import GatewayMetrics
from realtime.resume import ReplayBuffer, ResumeRefused
from realtime.session import (
    AddUserText, CancelResponse, ConfirmResponse, DeleteTurn, DiscardResponse, EndTurn, OutputCleared, PushAudio, ResponseAudio,
    ResponseDone, Session, SessionError, SessionEvent, SessionStats, StartResponse, TruncateResponse,
)
from realtime.input_budget import InputBudget
from realtime.session_input import SessionInput, apply_inputs, rate_error
from realtime.tracing import SessionTrace
from realtime.tracing_config import TracingConfig
from realtime.vad_batch import VadBatcher

log = logging.getLogger("duplex.gateway")

_OBSERVE_FRAMES_S = 0.25


class AudioOut(Protocol):
    """A transport that plays the answer itself, beside its message link (WebRTC's paced media track).
    The runner feeds it the session's paced audio and reads the playback cursor back from it."""

    def play(self, response_id: str, pcm: np.ndarray) -> None:
        """The next paced frame of an answer (int16, 16 kHz)."""

    def finish(self, response_id: str) -> None:
        """The answer's audio is complete: what is queued still plays."""

    def clear(self, response_id: str) -> None:
        """Barge-in: drop what is queued."""

    def played_ms(self, response_id: str) -> float: ...

    def take_drained(self) -> str | None:
        """The id of a finished answer whose audio has all been played, once; else None."""


class WireProtocol(Protocol):
    """A transport's sans-I/O event machine over one Session."""

    session: Session
    closing: tuple[int, str] | None  # set when the protocol itself ends the session (e.g. Twilio `stop`)
    client_errors: int
    offered_tools: bool  # the client listed function tools (session.tools or response.create's): counted at the end

    @property
    def resumable(self) -> bool:
        """The client holds a resume token (only clients that opted in get one): worth keeping a lost session."""

    @property
    def tracing(self) -> TracingConfig | None:
        """The client's session.tracing: the runner records the session's spans while it is on (None: off;
        a wire with no such setting: always None)."""

    @property
    def model(self) -> str:
        """The model name the client sees (a traced session's span reports it)."""

    def open(self) -> None: ...

    def receive(self, message: str | bytes, now: float) -> None: ...

    def receive_audio(self, pcm: np.ndarray, now: float) -> None: ...

    def send_session_events(self, events: list[SessionEvent]) -> None: ...

    def data_to_send(self) -> list[str | bytes]: ...

    def error(self, code: str, message: str, retry_after_s: float | None = None) -> None: ...

    def engine_options(self, output_modalities: tuple[str, ...] | None = None,
                       max_output_tokens: int | str | None = None) -> ConversationOptions:
        """The engine options of the session's settings; of one answer's, when response.create asked it
        for other output modalities or another max_output_tokens."""

    def take_engine_options(self) -> ConversationOptions | None:
        """New engine options when the client changed them since the last call, else None."""

    def inputs(self) -> list[SessionInput]:
        """What the client asked of the session since the last call (the runner applies them, in order)."""

    def input_refused(self, error: SessionError, event_id: str | None) -> None:
        """The session refused an input: tell the client (an error naming its event), or count it."""

    def playback_stopped(self, response_id: str) -> None:
        """The transport's own audio output (`AudioOut`) has played all of this answer."""

    def resumed_message(self, last_seq: int, replayed: int, missed: int) -> str | bytes:
        """The first message on a resumed link, outside the numbered stream (sent before the replay)."""


@dataclass(frozen=True)
class RunnerDeps:
    """What a session's task needs from the server around it, and nothing more."""

    limits: LimitsSection
    metrics: GatewayMetrics
    vad: VadBatcher | None  # None: each session runs its own VAD windows at once
    server_closing: Callable[[], bool]  # True once the server stops: a lost link is then not kept for a resume
    gateway_full: Callable[[], str | None] = lambda: None  # why no session may take a slot now (the gateway's cap), or None
    report_delivery: Callable[[int, int, int], None] = lambda chunks, late, underruns: None  # to admission control
    tracer: Tracer | None = None  # OpenTelemetry, when an exporter is configured (realtime/tracing.py); None: no spans
    clock: Clock = SYSTEM_CLOCK  # every time the runner reads or waits for (tests: a virtual one)


class SessionInbox:
    """The session loop's two input lanes and its one waiter.

    The client lane is bounded (`limit`): a reader waits for room, a transport pushing audio learns
    that it is full and counts the frame dropped. The server lane (engine chunks, VAD and shutdown
    notices) is never full, so an answer is never stalled by a client's input.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._client: deque[Inbound] = deque()
        self._server: deque[Inbound] = deque()
        self._waiter: asyncio.Future | None = None
        self._room: asyncio.Future | None = None

    def wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    def put_server(self, item: Inbound) -> None:
        self._server.append(item)
        self.wake()

    def put_client_nowait(self, item: Inbound) -> bool:
        if len(self._client) >= self.limit:
            return False
        self._client.append(item)
        self.wake()
        return True

    async def put_client(self, item: Inbound) -> None:
        while len(self._client) >= self.limit:
            if self._room is None or self._room.done():
                self._room = asyncio.get_running_loop().create_future()
            await asyncio.shield(self._room)
        self._client.append(item)
        self.wake()

    @property
    def empty(self) -> bool:
        return not self._client and not self._server

    async def wait(self) -> None:
        """Until an item arrives or `wake()` (the deadline timer) is called."""
        if not self.empty:
            return
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    def take_all(self) -> list[Inbound]:
        """Everything queued, the server lane's first (neither lane's order depends on the other's)."""
        items = [*self._server, *self._client]
        self._server.clear()
        if self._client:
            self._client.clear()
            if self._room is not None and not self._room.done():
                self._room.set_result(None)
        return items


class SessionRunner:
    """Runs one session until the client goes, the protocol ends it, or the server stops it."""

    def __init__(self, deps: RunnerDeps, link: Link, proto: WireProtocol, conv: Conversation, transport: str,
                 resume_token: str | None = None, audio_out: AudioOut | None = None) -> None:
        """`audio_out`: the transport plays the answer itself; the session's playback cursor is set from it
        before every batch of input, so a barge-in truncates at what the listener heard."""
        lim = deps.limits
        self.deps, self.proto, self.conv = deps, proto, conv
        self.clock = deps.clock
        self.limits = lim
        self.link: Link | None = link  # None while detached
        self.session = proto.session
        self.id = self.session.id
        self.transport = transport
        self.inbox = SessionInbox(lim.inbound_queue)
        self.outbound: asyncio.Queue = asyncio.Queue(lim.outbound_queue)  # the current link's; a new one per attach
        self.task: asyncio.Task | None = None
        self.resume_token = resume_token  # set: a lost link detaches the session instead of ending it
        self.resumes = 0
        self._replay = ReplayBuffer(lim.resume_buffer_bytes) if resume_token else None
        self._detached_at: float | None = None
        self._reader_task: asyncio.Task | None = None
        self._writer_task: asyncio.Task | None = None
        self._link_closers: set[asyncio.Task] = set()
        self.closing: Closing | None = None
        self._stats = SessionStats()
        self._latest: ResponseHandle | None = None  # the one response the session may still cancel or cut
        self._pumps: set[asyncio.Task] = set()  # each response's chunks -> the server lane
        self._started = self.clock.now()
        self._last_client = self._started
        self._vad_submitted = False  # the session's VAD stream waits in the gateway's batcher
        self._observed_at = self._started
        self._deadline_timer: asyncio.TimerHandle | None = None
        self._audio_out = audio_out
        self.budget = InputBudget(lim.input, self._started)
        self.suspended = False  # detached between answers: the engine slot is given back until a resume
        # The engine reads a conversation's options when an answer starts, so they are set before each
        # respond(): the session's, or those of the answer's own output modalities (response.create).
        self._options = proto.engine_options()  # the session's (what the conversation was opened with)
        self._applied = self._options  # what the conversation has now
        self._override: tuple | None = None  # the latest answer's own (output modalities, max_output_tokens), if any
        self._started_ns = self.clock.wall_ns()
        self._trace: SessionTrace | None = None  # the client turned session.tracing on (and the server exports)

    async def run(self) -> None:
        self.task = asyncio.current_task()
        self.proto.open()
        if (options := self.proto.take_engine_options()) is not None:
            # a config given with the connection (WebRTC's calls.create(session=...)), applied by open():
            # the conversation was opened before it, and a microphone's turn may come before any client event
            self._options = options
            self._use_options(options)
        self._trace_if_asked()
        self._flush()
        assert self.link is not None  # set by __init__; only a lost link or a resume takes it away
        self._start_link(self.link, [])
        try:
            await self._session_loop()
        finally:
            if self._deadline_timer is not None:
                self._deadline_timer.cancel()
            self._observe(self.clock.now(), force=True)
            if self._reader_task is not None:
                self._reader_task.cancel()
            for t in self._pumps:
                t.cancel()
            await self.outbound.put(None) if not self.outbound.full() else None
            if self._writer_task is not None:
                try:
                    await asyncio.wait_for(self._writer_task, timeout=self.limits.close_timeout_s)
                except Exception:  # a timeout or the writer's own failure: the socket is closed below anyway
                    self._writer_task.cancel()
            if self.link is not None:
                closing = self.closing or Closing(CloseReason.CLIENT_CLOSED)
                await self._close_link(self.link, closing.close_code, closing.text)
            if self._link_closers:
                await asyncio.wait(self._link_closers, timeout=self.limits.close_timeout_s)
            if self._trace is not None:
                self._trace.end(self.end_reason().label, self.session.stats, self.proto.model, self.resumes)

    async def attach(self, link: Link, last_seq: int) -> None:
        """Resume this session on a new link (the client received messages 1..last_seq).

        Replaces the current link if there is one (the client noticed the drop first). Raises
        ResumeRefused when the session cannot be resumed (ended, or last_seq out of range).
        """
        if self._replay is None:
            raise ResumeRefused("resume_failed", "this session cannot be resumed")
        done: asyncio.Future = asyncio.get_running_loop().create_future()
        try:
            await asyncio.wait_for(self.inbox.put_client(Attach(link, last_seq, done)), self.limits.open_timeout_s)
        except asyncio.TimeoutError:
            raise ResumeRefused("resume_failed", "the session is too busy to resume") from None
        if self.task is not None:
            await asyncio.wait([done, self.task], return_when=asyncio.FIRST_COMPLETED)
        if not done.done():
            raise ResumeRefused("resume_failed", "the session has ended")
        if (error := done.exception()) is not None:
            raise error

    @property
    def messages_sent(self) -> int | None:
        """Messages numbered so far (the resume sequence); None when the session cannot be resumed."""
        return None if self._replay is None else self._replay.last_seq

    def shutdown(self, reason: CloseReason, code: str, message: str, retry_after_s: float | None = None) -> None:
        """Ask the session task to send a final error event (with `retry_after_s`, if given) and close (server
        stop, idle timeout, overload)."""
        self.inbox.put_server(Shutdown(reason, code, message, retry_after_s))

    def end_reason(self) -> CloseReason:
        """Why the session ended, for `duplex_sessions_ended_total{reason}` and the log."""
        if self.closing is not None:
            return self.closing.reason
        if getattr(self.link, "sent_close_code", lambda: None)() == CloseReason.MESSAGE_TOO_BIG.close_code:
            return CloseReason.MESSAGE_TOO_BIG
        return CloseReason.CLIENT_CLOSED

    def _submit_vad(self) -> None:
        """Waiting user audio: settle what needs no model call, queue the rest's windows in the batch."""
        self.session.settle_vad(run=False)  # audio that completes no window
        if not self.session.vad_pending:
            return
        stream = self.session.vad_stream()
        if self.deps.vad is None or stream is None:  # batching off (or no model stream to batch): run the windows now
            self.session.settle_vad()
            return
        self._vad_submitted = True
        self.deps.vad.submit(stream, self._vad_ran)

    def _vad_ran(self) -> None:
        """The batcher ran this session's VAD windows: settle its waiting audio in the loop."""
        self._vad_submitted = False
        self.inbox.put_server(VadReady())

    def push_audio(self, pcm: np.ndarray) -> bool:
        """Transport audio (int16, 16 kHz) for the session; False when the client lane is full (frame dropped)."""
        return self.inbox.put_client_nowait(TransportAudio(pcm))

    async def _reader(self, link: Link) -> None:
        try:
            async for message in link.messages():
                while (rejection := self.budget.message(self.clock.now(), len(message))) is not None:
                    self.deps.metrics.input_rejected.labels(rejection.what).inc()  # messages / bytes (of messages)
                    self.inbox.put_server(Throttled(rejection))
                    if self.budget.exhausted(self.clock.now()):
                        await asyncio.Event().wait()  # the session loop closes the session; this task is cancelled
                    await self.clock.sleep(rejection.retry_after_s)
                await self.inbox.put_client(ClientMessage(message))
        except Exception as e:  # a dropped connection ends the session like a close
            log.debug("session %s: reader ended: %s", self.id, e)
        self.inbox.put_server(LinkClosed(link))  # never dropped, even behind a full client lane

    async def _writer(self, link: Link, outbound: asyncio.Queue, first: list[str | bytes]) -> None:
        try:
            for msg in first:
                await link.send(msg)
            while (msg := await outbound.get()) is not None:
                await link.send(msg)
        except Exception as e:  # the link died; its reader reports it
            log.debug("session %s: writer ended: %s", self.id, e)

    def _start_link(self, link: Link, first: list[str | bytes]) -> None:
        """Reader and writer for `link` (the current one); the writer sends `first` (a resume's replay) before the queue."""
        self._reader_task = asyncio.create_task(self._reader(link))
        self._writer_task = asyncio.create_task(self._writer(link, self.outbound, first))

    def _drop_link(self, link: Link, code: int, reason: str) -> None:
        """Stop using the current link `link` (lost, or replaced by a resume) and close it in the background."""
        for t in (self._reader_task, self._writer_task):
            if t is not None:
                t.cancel()
        self._reader_task = self._writer_task = None
        closer = asyncio.create_task(self._close_link(link, code, reason))
        self._link_closers.add(closer)
        closer.add_done_callback(self._link_closers.discard)
        self.link = None

    async def _close_link(self, link: Link, code: int, reason: str) -> None:
        try:
            await link.close(code, reason)
        except Exception as e:  # the peer may already be gone; nothing is lost by not closing twice
            log.debug("session %s: close failed: %s", self.id, e)

    def _on_link_closed(self, link: Link, now: float) -> bool:
        """The current link ended: True to keep the session (detached, resumable), False to end it."""
        lost = self.resume_token is not None and self.proto.resumable and link.lost()
        if not lost or self.deps.server_closing() or self.limits.resume_grace_s <= 0:
            return False
        self._drop_link(link, CloseReason.CONNECTION_LOST.close_code, "connection lost")
        self._detached_at = now
        log.info("session %s: connection lost, kept %.0f s for a resume", self.id, self.limits.resume_grace_s)
        return True

    def _attach(self, link: Link, last_seq: int, done: asyncio.Future, now: float) -> None:
        buffer = self._replay
        try:
            if self.closing is not None:
                raise ResumeRefused("resume_failed", "the session is closing")
            if buffer is None:  # (attach() refuses a session without one before it gets here)
                raise ResumeRefused("resume_failed", "this session cannot be resumed")
            replay = buffer.since(last_seq)
            self._take_slot()
        except ResumeRefused as e:
            done.set_exception(e)
            return
        if replay.missed and self.session.response is not None and not self.session.response.status.finished:
            # Some of the answer never reached the client and cannot be resent: end it cleanly
            # (output_audio_buffer.cleared + response.done cancelled, history cut to the last ack).
            self.session.receive_output_clear(now)
            self._send_session_events()
            self._run_commands()
            self._flush()
            replay = buffer.since(last_seq)
        if self.link is not None:
            self._drop_link(self.link, 1000, "resumed on another connection")
        self.link, self._detached_at, self._last_client = link, None, now
        self.outbound = asyncio.Queue(self.limits.outbound_queue)
        self.resumes += 1
        resumed = self.proto.resumed_message(last_seq, len(replay.messages), replay.missed)
        self._start_link(link, [resumed, *replay.messages])
        log.info("session %s: resumed (after message %d: %d replayed, %d missed)", self.id, last_seq, len(replay.messages), replay.missed)
        done.set_result(None)

    def _release_slot_if_away(self) -> None:
        """A detached session between answers gives its engine slot back (a vanished client must not
        keep callers out for the whole grace); an answer still generating keeps it until it ends."""
        r = self.session.response
        if self._detached_at is None or self.suspended or (r is not None and not r.status.finished) or self.session.vad_pending:
            return  # (audio still in the VAD could end the turn and start an answer)
        if self.session.speculation is not None:
            self.session.discard_speculation()  # no audio comes to confirm it: the turn stays open for a resume
            self._run_commands()  # (the engine takes it back before the slot goes)
        self.conv.suspend()
        self.suspended = True
        log.info("session %s: detached, engine slot released until a resume", self.id)

    def _take_slot(self) -> None:
        """A resume of a suspended session: a slot again, or ResumeRefused (it stays detached, resumable)."""
        if not self.suspended:
            return
        try:
            if (why := self.deps.gateway_full()) is not None:
                raise AtCapacity(why)
            self.conv.resume()
        except AtCapacity as e:
            raise ResumeRefused(AtCapacity.code, f"cannot resume now: {e}") from None
        self.suspended = False

    async def _session_loop(self) -> None:
        lim = self.limits
        next_due: float | None = None
        while self.closing is None:
            now = self.clock.now()
            idle_at = self._last_client + lim.idle_timeout_s if self._detached_at is None else self._detached_at + lim.resume_grace_s
            r = self.session.response
            # A playing answer defers the idle timeout: its deadline is no wake-up (a past one would spin the loop).
            idle_wake = None if self._detached_at is None and r is not None and not r.status.finished else idle_at
            # Frames and chunks not yet in the metrics are counted by a deadline, not only at the next input:
            # a caller who went quiet would leave its last quarter-second uncounted until the session ends.
            st, seen = self.session.stats, self._stats
            observe_due = (self._observed_at + _OBSERVE_FRAMES_S
                           if (st.input_frames, st.chunks) != (seen.input_frames, seen.chunks) else None)
            wake = min((t for t in (next_due, idle_wake, observe_due) if t is not None), default=None)
            if self.inbox.empty and (wake is None or wake > now):
                if wake is not None:
                    self._arm_deadline(wake)
                await self.inbox.wait()
            # Handling everything queued before the per-wake work (pacing, events, engine commands,
            # metrics) does that work once per wake-up instead of once per audio packet.
            items = self.inbox.take_all()
            now = self.clock.now()
            if self._audio_out is not None:
                self._sync_playback(self._audio_out)  # a barge-in in this input truncates at what was really played
            for item in items:
                if isinstance(item, LinkClosed) and item.link is self.link and not self._on_link_closed(item.link, now):
                    return
                self._handle(item, now)
                self._send_session_events()  # keeps events and errors in input order
                if self.closing is not None or self.proto.closing is not None:
                    break  # the rest is not for a session that is ending
            if self.closing is not None:
                return  # its final error is out: nothing may follow it
            if not items:  # woken by a deadline, not by input
                if self._detached_at is not None and now >= idle_at:
                    log.info("session %s: not resumed within %.0f s", self.id, lim.resume_grace_s)
                    self.closing = Closing(CloseReason.CONNECTION_LOST, "not resumed in time")
                    return
                if now >= idle_at and (self.session.response is None or self.session.response.status.finished):
                    self._close_with_error(CloseReason.IDLE_TIMEOUT, "idle_timeout", f"no client event for {lim.idle_timeout_s:.0f} s")
            self._release_slot_if_away()
            if self.session.vad_pending and not self._vad_submitted:
                self._submit_vad()
            # While detached nothing is paced out: undelivered audio is not played; pacing resumes on attach.
            next_due = self.session.poll_audio(now) if self.link is not None else None
            self._send_session_events()
            self._run_commands()
            if self._audio_out is not None and (rid := self._audio_out.take_drained()) is not None:
                self.proto.playback_stopped(rid)
            self._flush()
            self._observe(now)
            if self.proto.closing is not None and self.closing is None:
                code, text = self.proto.closing
                self.closing = Closing(CloseReason.PROTOCOL_END if code == 1000 else CloseReason.POLICY, text, code)

    def _send_session_events(self) -> None:
        """The session's events to the protocol; their audio, when the transport plays it, to its output."""
        events = self.session.events()
        if self._audio_out is not None:
            for ev in events:
                match ev:
                    case ResponseAudio(response_id=rid, pcm=pcm):
                        self._audio_out.play(rid, pcm)
                    case OutputCleared(response_id=rid):
                        self._audio_out.clear(rid)
                    case ResponseDone(response_id=rid):
                        self._audio_out.finish(rid)
        if self._trace is not None:
            self._trace.observe(events, ("audio",) if self._options.output_audio else ("text",))
        self.proto.send_session_events(events)

    def _trace_if_asked(self) -> None:
        """The client turned session.tracing on (only the Realtime protocol has it): the session's span
        starts, back-dated to the session's start. Once on it stays on (realtime/tracing_config.py)."""
        if self._trace is None and self.deps.tracer is not None and (config := self.proto.tracing) is not None:
            self._trace = SessionTrace(self.deps.tracer, config, self.id, self.transport, self._started_ns)

    def _sync_playback(self, audio_out: AudioOut) -> None:
        r = self.session.response
        if r is not None and not r.status.finished:
            self.session.receive_played(audio_out.played_ms(r.id), 0, r.id)

    def _arm_deadline(self, when: float) -> None:
        """Have the loop woken at `when`, or earlier: one timer kept across waits, not one per
        wait. The idle deadline moves with every client message and the pacing one with every
        frame; a timer already due sooner is kept (its early wake-up just looks at the clock
        and re-arms), so most waits arm nothing."""
        if self._deadline_timer is not None:
            if self._deadline_timer.when() <= when:
                return
            self._deadline_timer.cancel()
        self._deadline_timer = self.clock.call_at(when, self._deadline_due)

    def _deadline_due(self) -> None:
        self._deadline_timer = None
        self.inbox.wake()

    def _handle(self, item: Inbound, now: float) -> None:
        match item:
            case ClientMessage(data):
                self._last_client = now
                self._client_input(lambda: self.proto.receive(data, now), now)
                if (options := self.proto.take_engine_options()) is not None:
                    self.session.discard_speculation()  # it answers with the old settings
                    self._options = options  # applies from the conversation's next response on (an answer's own kept)
                    self._use_options(options if self._override is None else self.proto.engine_options(*self._override))
                self._trace_if_asked()
            case TransportAudio(pcm):
                self._last_client = now
                self._client_input(lambda: self.proto.receive_audio(pcm, now), now)
            case EngineChunk(rid, chunk):
                self.session.receive_engine_chunk(rid, chunk.pcm, chunk.text_delta, chunk.is_last, chunk.deadline, now)
            case EngineUserTranscript(rid, delta):
                self.session.receive_user_transcript(rid, delta)
            case EngineUserTranscriptEnd(rid, error):
                if error is None:
                    self.session.receive_user_transcript_end(rid)
                else:
                    self.session.receive_user_transcript_end(rid, getattr(error, "code", "engine_error"), str(error))
            case HistoryDropped(rids, for_response):
                self.session.receive_history_dropped(rids, for_response)
            case EngineFailed(rid, error):
                if self.session.receive_engine_error(rid, now):
                    self.proto.error(getattr(error, "code", "engine_error"), f"the engine failed this response: {error}")
            case Throttled(rejection):
                if rejection.report:
                    self.proto.input_refused(rate_error(rejection, self.budget.limits), None)
                self._close_if_over_budget(now)
            case VadReady():
                self.session.settle_vad(run=False)  # audio that came after the batch waits for the next one
            case Shutdown(reason, code, message, retry_after_s):
                self._close_with_error(reason, code, message, retry_after_s)
            case Attach(link, last_seq, done):
                self._attach(link, last_seq, done, now)
            case LinkClosed():
                pass  # an old link's reader, replaced by a resume

    def _client_input(self, receive: Callable[[], None], now: float) -> None:
        """Parse one client input and apply what it asks. A failure here is our bug, not the client's:
        the client gets an error event and the session goes on (the input is lost, nothing else)."""
        items_refused = self.budget.rejected_items
        try:
            receive()
            dropped = apply_inputs(self.proto, self.session, now, self.budget)
        except Exception:
            log.exception("session %s: a client input could not be handled", self.id)
            self.proto.error("internal_error", "the server failed to handle this input (see its log); the session goes on")
            return
        if dropped:
            self.deps.metrics.input_rejected.labels("audio").inc(dropped)
            self.deps.metrics.frames_dropped.labels(self.transport, "input_rate").inc(dropped)
        if items_refused != self.budget.rejected_items:  # conversation items whose audio the budget could not take
            self.deps.metrics.input_rejected.labels("item_audio").inc(self.budget.rejected_items - items_refused)
        self._close_if_over_budget(now)

    def _close_if_over_budget(self, now: float) -> None:
        if self.closing is None and self.budget.exhausted(now):
            lim = self.budget.limits
            self._close_with_error(CloseReason.POLICY, "input_rate_exceeded",
                                   f"input beyond the session's budget for {lim.overrun_close_s:g} s: closed")

    def _run_commands(self) -> None:
        for cmd in self.session.commands():
            match cmd:
                case PushAudio(pcm):
                    self.conv.push_user_audio(pcm)
                case EndTurn():
                    self.conv.end_user_turn()
                case AddUserText(text):
                    self.conv.add_user_text(text)
                case StartResponse(rid, speculative, modalities, instructions, tokens):
                    self._override = None if modalities is None and tokens is None else (modalities, tokens)
                    options = self._options if self._override is None else self.proto.engine_options(*self._override)
                    self._use_options(options)
                    self._latest = handle = self.conv.respond(rid, speculative=speculative, instructions=instructions)
                    answer = self._start_pump(self._pump(handle))
                    if options.transcribe_user:
                        self._start_pump(self._pump_transcript(handle, answer))
                case ConfirmResponse(rid):
                    if self._latest is not None and self._latest.id == rid:
                        self._latest.confirm()
                        self.deps.metrics.speculative.labels("confirmed").inc()
                case DiscardResponse(rid):
                    if self._latest is not None and self._latest.id == rid:
                        self._latest.discard()
                        self.deps.metrics.speculative.labels("discarded").inc()
                case CancelResponse(rid, played_ms):
                    if self._latest is not None and self._latest.id == rid:
                        self._latest.cancel(played_ms)
                case TruncateResponse(rid, played_ms):
                    self.conv.truncate(rid, played_ms)
                case DeleteTurn(rid, role):
                    self.conv.delete_turn(rid, role)

    def _use_options(self, options: ConversationOptions) -> None:
        if options is not self._applied:
            self.conv.update_options(options)
            self._applied = options

    def _start_pump(self, coro) -> asyncio.Task:
        pump = asyncio.create_task(coro)
        self._pumps.add(pump)
        pump.add_done_callback(self._pumps.discard)
        return pump

    async def _pump(self, handle: ResponseHandle) -> BaseException | None:
        """The answer's chunks -> the server lane; returns its failure, if it failed."""
        dropped_told = False

        def tell_dropped() -> None:  # the handle's `dropped_exchanges` is final by its first chunk or its end
            nonlocal dropped_told
            if not dropped_told and handle.dropped_exchanges:
                self.inbox.put_server(HistoryDropped(handle.dropped_exchanges, handle.id))
            dropped_told = True

        try:
            async for chunk in handle.chunks():
                tell_dropped()
                self.inbox.put_server(EngineChunk(handle.id, chunk))
            tell_dropped()
        except asyncio.CancelledError:
            raise
        except Exception as e:  # EngineError, or anything else the engine raised: the session reports it
            log.warning("session %s response %s failed: %s", self.id, handle.id, e)
            tell_dropped()
            self.inbox.put_server(EngineFailed(handle.id, e))
            return e
        return None

    async def _pump_transcript(self, handle: ResponseHandle, answer: asyncio.Task) -> None:
        """The user turn's transcript, written beside the answer -> the server lane. One that ends empty
        waits for the answer: when the answer failed before the transcript could be written, the
        transcript failed with it (else it is empty)."""
        error: BaseException | None = None
        try:
            written = False
            async for delta in handle.user_transcript():
                written = True
                self.inbox.put_server(EngineUserTranscript(handle.id, delta))
            if not written:
                error = await answer
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the transcript fails alone: the answer goes on
            log.warning("session %s: the user transcript of response %s failed: %s", self.id, handle.id, e)
            error = e
        self.inbox.put_server(EngineUserTranscriptEnd(handle.id, error))

    def _flush(self) -> None:
        for msg in self.proto.data_to_send():
            if self._replay is not None:
                self._replay.append(msg)
            if self.link is None:
                continue  # detached: kept in the replay buffer for the resume
            try:
                self.outbound.put_nowait(msg)
            except asyncio.QueueFull:
                self.closing = Closing(CloseReason.SLOW_CLIENT, "slow client: outbound queue full")
                self.deps.metrics.sessions_refused.labels("slow_client").inc()
                return

    def _close_with_error(self, reason: CloseReason, code: str, message: str, retry_after_s: float | None = None) -> None:
        self.proto.error(code, message, retry_after_s=retry_after_s)
        self._flush()
        self.closing = self.closing or Closing(reason, message[:120])

    def _observe(self, now: float, force: bool = False) -> None:
        """Count the session's new figures in the gateway's metrics and admission control's feedback.
        Input frames and chunks change with every packet, so alone they are counted at most every
        `_OBSERVE_FRAMES_S` (and at the end)."""
        st, seen = self.session.stats, self._stats
        if (st.barge_ins, st.underruns_reported, st.chunks_late, st.exchanges_dropped, len(st.ttfa_ms)) == (
                seen.barge_ins, seen.underruns_reported, seen.chunks_late, seen.exchanges_dropped, len(seen.ttfa_ms)):
            if ((st.input_frames, st.chunks) == (seen.input_frames, seen.chunks)
                    or (not force and now - self._observed_at < _OBSERVE_FRAMES_S)):
                return
        self.deps.metrics.add_stats_delta(st, seen)
        if st.chunks > seen.chunks or st.underruns_reported > seen.underruns_reported:
            self.deps.report_delivery(st.chunks - seen.chunks, st.chunks_gap - seen.chunks_gap,
                                      st.underruns_reported - seen.underruns_reported)
        self._stats = dataclasses.replace(st, ttfa_ms=list(st.ttfa_ms))
        self._observed_at = now

    def log_end(self) -> None:
        st = self.session.stats
        ttfa = f"{statistics.median(st.ttfa_ms):.0f} ms" if st.ttfa_ms else "-"
        log.info("session %s (%s) end: %.1f s, %d responses, %d barge-ins, ttfa p50 %s, %d chunks late, %d underruns reported, %s%s",
                 self.id, self.transport, self.clock.now() - self._started, st.responses, st.barge_ins, ttfa, st.chunks_late,
                 st.underruns_reported, self.end_reason().label, f": {self.closing.text}" if self.closing and self.closing.text else "")
