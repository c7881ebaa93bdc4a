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
from realtime.session import CancelResponse, EndTurn, PushAudio, Session, SessionStats, StartResponse

if TYPE_CHECKING:
    from realtime.server import Gateway

log = logging.getLogger("duplex.gateway")

CLOSE_NORMAL = 1000
CLOSE_GOING_AWAY = 1001
CLOSE_SLOW_CLIENT = 1008
CLOSE_TRY_AGAIN = 1013


class Link(Protocol):
    """A transport's message channel."""

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

    def __init__(self, gw: Gateway, link: Link, proto: WireProtocol, conv, transport: str) -> None:
        lim = gw.config.limits
        self.gw, self.link, self.proto, self.conv = gw, link, proto, conv
        self.session = proto.session
        self.id = self.session.id
        self.transport = transport
        self.inbound: asyncio.Queue = asyncio.Queue(lim.inbound_queue)
        self.outbound: asyncio.Queue = asyncio.Queue(lim.outbound_queue)
        self.task: asyncio.Task | None = None
        self.closing: tuple[int, str] | None = None
        self._stats = SessionStats()
        self._responses: dict[str, asyncio.Task] = {}
        self._entered: set[str] = set()  # responses whose conv.respond() has begun
        self._cancelled_early: set[str] = set()
        self._last_response: asyncio.Task | None = None
        self._started = time.monotonic()
        self._last_client = self._started

    async def run(self) -> None:
        self.task = asyncio.current_task()
        self.proto.open()
        self._flush()
        reader = asyncio.create_task(self._reader())
        writer = asyncio.create_task(self._writer())
        try:
            await self._session_loop()
        finally:
            reader.cancel()
            for t in self._responses.values():
                t.cancel()
            await self.outbound.put(None) if not self.outbound.full() else None
            try:
                await asyncio.wait_for(writer, timeout=self.gw.config.limits.close_timeout_s)
            except (asyncio.TimeoutError, Exception):
                writer.cancel()
            code, reason = self.closing or (CLOSE_NORMAL, "")
            try:
                await self.link.close(code, reason)
            except Exception as e:  # the peer may already be gone; nothing is lost by not closing twice
                log.debug("session %s: close failed: %s", self.id, e)

    def shutdown(self, code: str, message: str) -> None:
        """Ask the session task to send a final error event and close (server stop, idle timeout)."""
        try:
            self.inbound.put_nowait(("shutdown", code, message))
        except asyncio.QueueFull:
            self.closing = (CLOSE_GOING_AWAY, message)
            if self.task:
                self.task.cancel()

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

    async def _reader(self) -> None:
        try:
            async for message in self.link.messages():
                await self.inbound.put(("message", message))
        except Exception as e:  # a dropped connection ends the session like a close
            log.debug("session %s: reader ended: %s", self.id, e)
        await self.inbound.put(("closed",))

    async def _writer(self) -> None:
        while (msg := await self.outbound.get()) is not None:
            await self.link.send(msg)

    async def _session_loop(self) -> None:
        lim = self.gw.config.limits
        next_due: float | None = None
        while self.closing is None:
            now = time.monotonic()
            idle_at = self._last_client + lim.idle_timeout_s
            wake = min(next_due if next_due is not None else idle_at, idle_at)
            try:
                item = await asyncio.wait_for(self.inbound.get(), max(0.0, wake - now)) if wake > now else self.inbound.get_nowait()
            except (asyncio.TimeoutError, asyncio.QueueEmpty):
                item = None
            now = time.monotonic()
            if item is not None:
                if item[0] == "closed":
                    return
                self._handle(item, now)
            elif now >= idle_at and (self.session.response is None or self.session.response.status.finished):
                self._close_with_error("idle_timeout", f"no client event for {lim.idle_timeout_s:.0f} s", CLOSE_NORMAL)
            next_due = self.session.poll_audio(now)
            self.proto.send_session_events(self.session.events())
            self._run_commands()
            self._flush()
            self._observe()
            if self.proto.closing is not None and self.closing is None:
                self.closing = self.proto.closing

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
        elif kind == "shutdown":
            self._close_with_error(item[1], item[2], CLOSE_GOING_AWAY)

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

    def _observe(self) -> None:
        st = self.session.stats
        self.gw.metrics.add_stats_delta(st, self._stats)
        self._stats = dataclasses.replace(st, ttfa_ms=list(st.ttfa_ms))

    def log_end(self) -> None:
        st = self.session.stats
        ttfa = f"{statistics.median(st.ttfa_ms):.0f} ms" if st.ttfa_ms else "-"
        log.info("session %s (%s) end: %.1f s, %d responses, %d barge-ins, ttfa p50 %s, %d chunks late, %d underruns reported%s",
                 self.id, self.transport, time.monotonic() - self._started, st.responses, st.barge_ins, ttfa, st.chunks_late,
                 st.underruns_reported, f", closed: {self.closing[1]}" if self.closing and self.closing[1] else "")
