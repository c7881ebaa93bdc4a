"""One session's task, shared by every transport (DESIGN.md §2).

A transport brings two things: a `Link` (its message channel: the WebSocket, the WebRTC data channel)
and a `WireProtocol` (its sans-I/O event machine: OpenAI Realtime events, Twilio Media Streams). The
runner owns everything else: the session loop, the engine conversation's commands and responses,
bounded queues, pacing wake-ups, idle timeout, slow-client disconnect, metrics.

    link reader ──inbound──▶ session loop ──outbound──▶ link writer
    engine responses ──┘     (protocol + Session + engine commands; the only owner of their state)
    transport audio ───┘     (WebRTC track: ("audio", pcm16k) items)

The session loop waits for input or the next pacing deadline, feeds the protocol, releases due audio,
runs engine commands and hands wire messages to the writer. A full outbound queue means the client
does not read: it is disconnected with a reason.

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
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Protocol

import numpy as np

from engine.service_api import ConversationOptions, EngineError
from realtime.resume import ReplayBuffer, ResumeRefused
from realtime.session import CancelResponse, EndTurn, PushAudio, Session, SessionStats, StartResponse

if TYPE_CHECKING:
    from realtime.server import Gateway

log = logging.getLogger("duplex.gateway")

CLOSE_NORMAL = 1000
CLOSE_GOING_AWAY = 1001
CLOSE_SLOW_CLIENT = 1008
CLOSE_TRY_AGAIN = 1013

_OBSERVE_FRAMES_S = 0.25
_DEADLINE = ("deadline",)  # queued by the loop's timer: wake up and look at the clock


class Link(Protocol):
    """A transport's message channel. A link of a resumable session also has `lost() -> bool`: after
    `messages()` ended, True when the connection died without a goodbye (the client may come back)."""

    def messages(self) -> AsyncIterator[str | bytes]:
        """The client's messages; ends when the client goes away."""

    async def send(self, message: str | bytes) -> None: ...

    async def close(self, code: int, reason: str) -> None: ...


class WireProtocol(Protocol):
    """A transport's sans-I/O event machine over one Session."""

    session: Session
    closing: tuple[int, str] | None  # set when the protocol itself ends the session (e.g. Twilio `stop`)

    def open(self) -> None: ...

    def receive(self, message: str | bytes, now: float) -> None: ...

    def receive_audio(self, pcm: np.ndarray, now: float) -> None: ...

    def send_session_events(self, events: list) -> None: ...

    def data_to_send(self) -> list[str | bytes]: ...

    def error(self, code: str, message: str) -> None: ...

    def take_engine_options(self) -> ConversationOptions | None:
        """New engine options when the client changed them since the last call, else None."""


class SessionRunner:
    """Runs one session until the client goes, the protocol ends it, or the server stops it."""

    def __init__(self, gw: Gateway, link: Link, proto: WireProtocol, conv, transport: str, resume_token: str | None = None) -> None:
        lim = gw.config.limits
        self.gw, self.proto, self.conv = gw, proto, conv
        self.link: Link | None = link  # None while detached
        self.session = proto.session
        self.id = self.session.id
        self.transport = transport
        self.inbound: asyncio.Queue = asyncio.Queue(lim.inbound_queue)
        self.outbound: asyncio.Queue = asyncio.Queue(lim.outbound_queue)  # the current link's; a new one per attach
        self.task: asyncio.Task | None = None
        self.resume_token = resume_token  # set: a lost link detaches the session instead of ending it
        self.resumes = 0
        self._replay = ReplayBuffer(lim.resume_buffer_bytes) if resume_token else None
        self._detached_at: float | None = None
        self._reader_task: asyncio.Task | None = None
        self._writer_task: asyncio.Task | None = None
        self._link_closers: set[asyncio.Task] = set()
        self.closing: tuple[int, str] | None = None
        self._stats = SessionStats()
        self._responses: dict[str, asyncio.Task] = {}
        self._entered: set[str] = set()  # responses whose conv.respond() has begun
        self._cancelled_early: set[str] = set()
        self._last_response: asyncio.Task | None = None
        self._started = time.monotonic()
        self._last_client = self._started
        self._vad_submitted = False  # the session's VAD stream waits in the gateway's batcher
        self._observed_at = self._started
        self._deadline_timer: asyncio.TimerHandle | None = None

    async def run(self) -> None:
        self.task = asyncio.current_task()
        self.proto.open()
        self._flush()
        self._start_link([])
        try:
            await self._session_loop()
        finally:
            if self._deadline_timer is not None:
                self._deadline_timer.cancel()
            self._observe(time.monotonic(), force=True)
            if self._reader_task is not None:
                self._reader_task.cancel()
            for t in self._responses.values():
                t.cancel()
            await self.outbound.put(None) if not self.outbound.full() else None
            if self._writer_task is not None:
                try:
                    await asyncio.wait_for(self._writer_task, timeout=self.gw.config.limits.close_timeout_s)
                except (asyncio.TimeoutError, Exception):
                    self._writer_task.cancel()
            code, reason = self.closing or (CLOSE_NORMAL, "")
            if self.link is not None:
                await self._close_link(self.link, code, reason)
            if self._link_closers:
                await asyncio.wait(self._link_closers, timeout=self.gw.config.limits.close_timeout_s)

    async def attach(self, link: Link, last_seq: int) -> None:
        """Resume this session on a new link (the client received messages 1..last_seq).

        Replaces the current link if there is one (the client noticed the drop first). Raises
        ResumeRefused when the session cannot be resumed (ended, or last_seq out of range).
        """
        if self._replay is None:
            raise ResumeRefused("resume_failed", "this session cannot be resumed")
        done: asyncio.Future = asyncio.get_running_loop().create_future()
        try:
            await asyncio.wait_for(self.inbound.put(("attach", link, last_seq, done)), self.gw.config.limits.open_timeout_s)
        except asyncio.TimeoutError:
            raise ResumeRefused("resume_failed", "the session is too busy to resume") from None
        if self.task is not None:
            await asyncio.wait([done, self.task], return_when=asyncio.FIRST_COMPLETED)
        if not done.done():
            raise ResumeRefused("resume_failed", "the session has ended")
        if done.exception() is not None:
            raise done.exception()

    @property
    def messages_sent(self) -> int | None:
        """Messages numbered so far (the resume sequence); None when the session cannot be resumed."""
        return None if self._replay is None else self._replay.last_seq

    def shutdown(self, code: str, message: str) -> None:
        """Ask the session task to send a final error event and close (server stop, idle timeout)."""
        try:
            self.inbound.put_nowait(("shutdown", code, message))
        except asyncio.QueueFull:
            self.closing = (CLOSE_GOING_AWAY, message)
            if self.task:
                self.task.cancel()

    def _submit_vad(self) -> None:
        """Waiting user audio: settle what needs no model call, queue the rest's windows in the batch."""
        self.session.settle_vad(run=False)  # audio that completes no window
        if not self.session.vad_pending:
            return
        if self.gw.vad is None:  # batching off: run this session's windows now
            self.session.settle_vad()
            return
        self._vad_submitted = True
        self.gw.vad.submit(self.session.vad_stream(), self._vad_ran)

    def _vad_ran(self) -> None:
        """The batcher ran this session's VAD windows: settle its waiting audio in the loop."""
        self._vad_submitted = False
        try:
            self.inbound.put_nowait(("vad",))
        except asyncio.QueueFull:
            pass  # the loop is busy; it submits the stream again and settles after the next tick

    def push_audio(self, pcm: np.ndarray) -> bool:
        """Transport audio (int16, 16 kHz) for the session; False when the inbound queue is full (frame dropped)."""
        try:
            self.inbound.put_nowait(("audio", pcm))
            return True
        except asyncio.QueueFull:
            return False

    def wake(self) -> None:
        """Make the loop run now (a transport's state changed, e.g. its playback cursor)."""
        try:
            self.inbound.put_nowait(("wake",))
        except asyncio.QueueFull:
            pass  # the loop is busy anyway

    async def _reader(self, link: Link) -> None:
        try:
            async for message in link.messages():
                await self.inbound.put(("message", message))
        except Exception as e:  # a dropped connection ends the session like a close
            log.debug("session %s: reader ended: %s", self.id, e)
        await self.inbound.put(("closed", link))

    async def _writer(self, link: Link, outbound: asyncio.Queue, first: list[str | bytes]) -> None:
        try:
            for msg in first:
                await link.send(msg)
            while (msg := await outbound.get()) is not None:
                await link.send(msg)
        except Exception as e:  # the link died; its reader reports it
            log.debug("session %s: writer ended: %s", self.id, e)

    def _start_link(self, first: list[str | bytes]) -> None:
        """Reader and writer for `self.link`; the writer sends `first` (a resume's replay) before the queue."""
        self._reader_task = asyncio.create_task(self._reader(self.link))
        self._writer_task = asyncio.create_task(self._writer(self.link, self.outbound, first))

    def _drop_link(self, code: int, reason: str) -> None:
        """Stop using the current link (lost, or replaced by a resume) and close it in the background."""
        for t in (self._reader_task, self._writer_task):
            if t is not None:
                t.cancel()
        self._reader_task = self._writer_task = None
        closer = asyncio.create_task(self._close_link(self.link, code, reason))
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
        lost = self.resume_token is not None and link.lost()
        if not lost or self.gw.closing or self.gw.config.limits.resume_grace_s <= 0:
            return False
        self._drop_link(CLOSE_GOING_AWAY, "connection lost")
        self._detached_at = now
        log.info("session %s: connection lost, kept %.0f s for a resume", self.id, self.gw.config.limits.resume_grace_s)
        return True

    def _attach(self, link: Link, last_seq: int, done: asyncio.Future, now: float) -> None:
        try:
            if self.closing is not None:
                raise ResumeRefused("resume_failed", "the session is closing")
            replay = self._replay.since(last_seq)
        except ResumeRefused as e:
            done.set_exception(e)
            return
        if replay.missed and self.session.response is not None and not self.session.response.status.finished:
            # Some of the answer never reached the client and cannot be resent: end it cleanly
            # (output_audio_buffer.cleared + response.done cancelled, history cut to the last ack).
            self.session.receive_output_clear(now)
            self.proto.send_session_events(self.session.events())
            self._run_commands()
            self._flush()
            replay = self._replay.since(last_seq)
        if self.link is not None:
            self._drop_link(CLOSE_NORMAL, "resumed on another connection")
        self.link, self._detached_at, self._last_client = link, None, now
        self.outbound = asyncio.Queue(self.gw.config.limits.outbound_queue)
        self.resumes += 1
        resumed = self.proto.resumed_message(last_seq, len(replay.messages), replay.missed)
        self._start_link([resumed, *replay.messages])
        log.info("session %s: resumed (after message %d: %d replayed, %d missed)", self.id, last_seq, len(replay.messages), replay.missed)
        done.set_result(None)

    async def _session_loop(self) -> None:
        lim = self.gw.config.limits
        next_due: float | None = None
        while self.closing is None:
            now = time.monotonic()
            idle_at = self._last_client + lim.idle_timeout_s if self._detached_at is None else self._detached_at + lim.resume_grace_s
            wake = min(next_due if next_due is not None else idle_at, idle_at)
            items = await self._next_items(wake, now)
            now = time.monotonic()
            for item in items:
                if item[0] == "closed" and item[1] is self.link and not self._on_link_closed(item[1], now):
                    return
                self._handle(item, now)
                self.proto.send_session_events(self.session.events())  # keeps events and errors in input order
                if self.closing is not None or self.proto.closing is not None:
                    break  # the rest is not for a session that is ending
            if not items:  # woken by a deadline, not by input
                if self._detached_at is not None and now >= idle_at:
                    log.info("session %s: not resumed within %.0f s", self.id, lim.resume_grace_s)
                    self.closing = (CLOSE_GOING_AWAY, "not resumed in time")
                    return
                if now >= idle_at and (self.session.response is None or self.session.response.status.finished):
                    self._close_with_error("idle_timeout", f"no client event for {lim.idle_timeout_s:.0f} s", CLOSE_NORMAL)
            if self.session.vad_pending and not self._vad_submitted:
                self._submit_vad()
            # While detached nothing is paced out: undelivered audio is not played; pacing resumes on attach.
            next_due = self.session.poll_audio(now) if self.link is not None else None
            self.proto.send_session_events(self.session.events())
            self._run_commands()
            self._flush()
            self._observe(now)
            if self.proto.closing is not None and self.closing is None:
                self.closing = self.proto.closing

    async def _next_items(self, wake: float, now: float) -> list[tuple]:
        """Everything queued by `wake` (at least one item unless the deadline passed), oldest first.

        Handling all queued items before the loop's per-wake work (pacing, events, engine commands,
        metrics) makes that work once per wake-up instead of once per audio packet.
        """
        q = self.inbound
        items = []
        if q.empty() and wake > now:
            self._arm_deadline(wake)
            items.append(await q.get())
        while not q.empty():
            items.append(q.get_nowait())
        return [item for item in items if item is not _DEADLINE]

    def _arm_deadline(self, when: float) -> None:
        """Have `_DEADLINE` queued at `when`, or earlier: one timer kept across waits, not one per
        wait. The idle deadline moves with every client message and the pacing one with every
        frame; a timer already due sooner is kept (its early wake-up just looks at the clock
        and re-arms), so most waits arm nothing."""
        if self._deadline_timer is not None:
            if self._deadline_timer.when() <= when:
                return
            self._deadline_timer.cancel()
        self._deadline_timer = asyncio.get_running_loop().call_at(when, self._deadline_due)

    def _deadline_due(self) -> None:
        self._deadline_timer = None
        try:
            self.inbound.put_nowait(_DEADLINE)
        except asyncio.QueueFull:
            pass  # the loop has input to handle; it looks at the clock after it

    def _handle(self, item: tuple, now: float) -> None:
        kind = item[0]
        if kind == "message":
            self._last_client = now
            self.proto.receive(item[1], now)
            if (options := self.proto.take_engine_options()) is not None:
                self.conv.update_options(options)  # applies from the conversation's next response on
        elif kind == "audio":
            self._last_client = now
            self.proto.receive_audio(item[1], now)
        elif kind == "chunk":
            _, rid, chunk = item
            self.session.receive_engine_chunk(rid, chunk.pcm, chunk.text_delta, chunk.is_last, chunk.deadline, now)
        elif kind == "engine_error":
            _, rid, exc = item
            self.session.receive_engine_error(rid, now)
            self.proto.error(getattr(exc, "code", "engine_error"), f"the engine failed this response: {exc}")
        elif kind == "vad":
            self.session.settle_vad(run=False)  # audio that came after the batch waits for the next one
        elif kind == "shutdown":
            self._close_with_error(item[1], item[2], CLOSE_GOING_AWAY)
        elif kind == "attach":
            self._attach(item[1], item[2], item[3], now)

    def _run_commands(self) -> None:
        for cmd in self.session.commands():
            if isinstance(cmd, PushAudio):
                self.conv.push_user_audio(cmd.pcm)
            elif isinstance(cmd, EndTurn):
                self.conv.end_user_turn()
            elif isinstance(cmd, StartResponse):
                prev = self._last_response
                self._last_response = self._responses[cmd.response_id] = asyncio.create_task(self._respond(cmd.response_id, prev))
            elif isinstance(cmd, CancelResponse):
                if cmd.response_id in self._responses and cmd.response_id not in self._entered:
                    self._cancelled_early.add(cmd.response_id)
                else:
                    self.conv.cancel(cmd.played_ms)

    async def _respond(self, rid: str, prev: asyncio.Task | None) -> None:
        try:
            if prev is not None:
                await asyncio.wait([prev])
            if rid in self._cancelled_early:
                return
            self._entered.add(rid)
            async for chunk in self.conv.respond():  # no await between add() and the first step
                await self.inbound.put(("chunk", rid, chunk))
        except asyncio.CancelledError:
            raise
        except (EngineError, Exception) as e:
            log.warning("session %s response %s failed: %s", self.id, rid, e)
            await self.inbound.put(("engine_error", rid, e))
        finally:
            self._responses.pop(rid, None)

    def _flush(self) -> None:
        for msg in self.proto.data_to_send():
            if self._replay is not None:
                self._replay.append(msg)
            if self.link is None:
                continue  # detached: kept in the replay buffer for the resume
            try:
                self.outbound.put_nowait(msg)
            except asyncio.QueueFull:
                self.closing = (CLOSE_SLOW_CLIENT, "slow client: outbound queue full")
                self.gw.metrics.sessions_refused.labels("slow_client").inc()
                return

    def _close_with_error(self, code: str, message: str, close_code: int) -> None:
        self.proto.error(code, message)
        self._flush()
        self.closing = self.closing or (close_code, message[:120])

    def _observe(self, now: float, force: bool = False) -> None:
        """Count the session's new figures in the gateway's metrics. Input frames change with every
        packet, so alone they are counted at most every `_OBSERVE_FRAMES_S` (and at the end)."""
        st, seen = self.session.stats, self._stats
        if (st.barge_ins, st.underruns_reported, st.chunks_late, len(st.ttfa_ms)) == (
                seen.barge_ins, seen.underruns_reported, seen.chunks_late, len(seen.ttfa_ms)):
            if st.input_frames == seen.input_frames or (not force and now - self._observed_at < _OBSERVE_FRAMES_S):
                return
        self.gw.metrics.add_stats_delta(st, seen)
        self._stats = dataclasses.replace(st, ttfa_ms=list(st.ttfa_ms))
        self._observed_at = now

    def log_end(self) -> None:
        st = self.session.stats
        ttfa = f"{statistics.median(st.ttfa_ms):.0f} ms" if st.ttfa_ms else "-"
        log.info("session %s (%s) end: %.1f s, %d responses, %d barge-ins, ttfa p50 %s, %d chunks late, %d underruns reported%s",
                 self.id, self.transport, time.monotonic() - self._started, st.responses, st.barge_ins, ttfa, st.chunks_late,
                 st.underruns_reported, f", closed: {self.closing[1]}" if self.closing and self.closing[1] else "")
