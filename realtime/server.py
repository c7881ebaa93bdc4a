"""The gateway's I/O shell: HTTP and WebSocket on one port with `websockets` (DESIGN.md §5).

    GET /healthz          engine readiness (no auth)
    GET /metrics          Prometheus text (auth)
    GET /                 placeholder page (auth)
    WS  /v1/realtime      OpenAI-Realtime-style events (auth; realtime/protocol.py)

Per connection, three tasks and two bounded queues:

    reader ──inbound──▶ session task ──outbound──▶ writer
    engine response ─┘      (protocol + Session + engine commands; the only owner of their state)

The session task is the recipe loop: wait for input or the next pacing deadline, feed it to the
protocol, release due audio, run engine commands, hand wire messages to the writer. A full outbound
queue means the client does not read: it is disconnected with a reason. Audio work runs inline: it is
measured cheap (Silero ~0.2 ms per 32 ms window, Opus encode ~0.1 ms per 20 ms frame, soxr ~10 us;
`scripts/bench_gateway.py` reports the total per session as a fraction of one core).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import logging
import statistics
import time
from http import HTTPStatus
from urllib.parse import parse_qs, urlsplit

from websockets.asyncio.server import ServerConnection, serve
from websockets.exceptions import ConnectionClosed
from websockets.http11 import Request, Response

from engine.service_api import AtCapacity, ConversationOptions, EngineError
from realtime.config import ServerConfig
from realtime.metrics import CONTENT_TYPE, GatewayMetrics
from realtime.protocol import OpusOutput, ProtocolLimits, RealtimeProtocol, SessionSettings
from realtime.session import CancelResponse, EndTurn, PushAudio, Session, SessionLimits, SessionStats, StartResponse, new_id
from realtime.vad import VadParams

log = logging.getLogger("duplex.gateway")

REALTIME_PATH = "/v1/realtime"
PLACEHOLDER_PAGE = "duplex realtime gateway\n\nWebSocket: /v1/realtime (OpenAI Realtime events; see docs/protocol.md)\n"
_CLOSE_SLOW_CLIENT = 1008
_CLOSE_TRY_AGAIN = 1013


def session_settings(cfg: ServerConfig) -> SessionSettings:
    s = cfg.session
    return SessionSettings(instructions=s.instructions, voice=s.voice, temperature=s.temperature, top_k=s.top_k, top_p=s.top_p,
                           seed=s.seed, cfg_scale=s.cfg_scale, max_response_ms=s.max_response_ms)


def conversation_options(s: SessionSettings) -> ConversationOptions:
    return ConversationOptions(system_prompt=s.instructions or None, temperature=s.temperature, top_k=s.top_k, top_p=s.top_p,
                               seed=s.seed, cfg_scale=s.cfg_scale, max_response_ms=s.max_response_ms)


class Gateway:
    """One server: the engine, the connections, the metrics. `await start()`, `await stop()`."""

    def __init__(self, engine, config: ServerConfig, token: str | None = None) -> None:
        self.engine = engine
        self.config = config
        self.token = token if token is not None else config.server.token
        self.metrics = GatewayMetrics()
        self.connections: dict[str, RealtimeConnection] = {}
        self._server = None
        self.port: int | None = None

    async def start(self) -> None:
        lim = self.config.limits
        self._server = await serve(
            self._handle, self.config.server.host, self.config.server.port, process_request=self._process_request,
            max_size=lim.max_message_bytes, open_timeout=lim.open_timeout_s, close_timeout=lim.close_timeout_s,
            ping_interval=lim.ping_interval_s, ping_timeout=lim.ping_timeout_s, max_queue=32, compression=None,
        )
        self.port = self._server.sockets[0].getsockname()[1]

    def conversation(self, session_id: str):
        """The engine conversation behind a session (tests read its history)."""
        return self.connections[session_id].conv

    async def stop(self) -> None:
        """Tell every session the server is going away, close them, stop listening."""
        for conn in list(self.connections.values()):
            conn.shutdown("server_shutting_down", "the server is shutting down")
        if self.connections:
            await asyncio.wait([c.task for c in self.connections.values() if c.task], timeout=self.config.limits.close_timeout_s)
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    # ---- HTTP ----
    def _authorized(self, request: Request) -> bool:
        if not self.token:
            return True
        header = request.headers.get("Authorization", "")
        if header.startswith("Bearer ") and hmac.compare_digest(header[7:].strip(), self.token):
            return True
        tokens = parse_qs(urlsplit(request.path).query).get("token", [])
        return any(hmac.compare_digest(t, self.token) for t in tokens)

    def _process_request(self, connection: ServerConnection, request: Request) -> Response | None:
        path = urlsplit(request.path).path
        if path == "/healthz":
            health = self.engine.health()
            body = json.dumps({"ready": health.ready, "detail": health.detail, "sessions": len(self.connections)})
            return _respond(connection, HTTPStatus.OK if health.ready else HTTPStatus.SERVICE_UNAVAILABLE, body, "application/json")
        if not self._authorized(request):
            self.metrics.sessions_refused.labels("unauthorized").inc() if path == REALTIME_PATH else None
            resp = _respond(connection, HTTPStatus.UNAUTHORIZED, "missing or invalid token\n")
            resp.headers["WWW-Authenticate"] = 'Bearer realm="duplex"'
            return resp
        if path == "/metrics":
            return _respond(connection, HTTPStatus.OK, self.metrics.render(self.engine).decode(), CONTENT_TYPE)
        if path == "/":
            return _respond(connection, HTTPStatus.OK, PLACEHOLDER_PAGE)
        if path != REALTIME_PATH:
            return _respond(connection, HTTPStatus.NOT_FOUND, "not found\n")
        if request.headers.get("Upgrade", "").lower() != "websocket":
            return _respond(connection, HTTPStatus.UPGRADE_REQUIRED, "this endpoint is a WebSocket\n")
        return None

    # ---- WebSocket ----
    async def _handle(self, ws: ServerConnection) -> None:
        session_id = new_id("sess")
        settings = session_settings(self.config)
        cap = self.config.limits.max_sessions
        try:
            if cap is not None and len(self.connections) >= cap:
                raise AtCapacity(f"server at capacity: {len(self.connections)} sessions open (limit {cap})")
            conv = self.engine.open_conversation(session_id, conversation_options(settings))
        except AtCapacity as e:
            self.metrics.sessions_refused.labels("capacity").inc()
            err = {"type": "error", "event_id": "event_0", "error": {"type": "server_error", "code": AtCapacity.code,
                                                                  "message": str(e), "param": None, "event_id": None}}
            await ws.send(json.dumps(err))
            await ws.close(_CLOSE_TRY_AGAIN, "server at capacity")
            return
        conn = RealtimeConnection(self, ws, session_id, conv, settings)
        self.connections[session_id] = conn
        self.metrics.sessions_total.inc()
        self.metrics.sessions_active.inc()
        try:
            await conn.run()
        finally:
            self.connections.pop(session_id, None)
            self.metrics.sessions_active.dec()
            await conn.conv.close()
            conn.log_end()


def _respond(connection: ServerConnection, status: HTTPStatus, body: str, content_type: str | None = None) -> Response:
    resp = connection.respond(status, body)
    if content_type:
        del resp.headers["Content-Type"]
        resp.headers["Content-Type"] = content_type
    return resp


class RealtimeConnection:
    """One WebSocket session: reader, session task, writer (module docstring)."""

    def __init__(self, gw: Gateway, ws: ServerConnection, session_id: str, conv, settings: SessionSettings) -> None:
        cfg = gw.config
        self.gw, self.ws, self.conv, self.id = gw, ws, conv, session_id
        v = cfg.vad
        vad = VadParams(v.threshold, v.prefix_padding_ms, v.silence_duration_ms, v.create_response, v.interrupt_response, v.min_speech_ms) if v.enabled else None
        self.session = Session(session_id, vad, SessionLimits(cfg.audio.output_frame_ms, cfg.audio.lead_ms, cfg.limits.max_turn_ms))
        self.proto = RealtimeProtocol(self.session, ProtocolLimits(max_append_bytes=cfg.limits.max_append_bytes), settings,
                                      OpusOutput(cfg.audio.opus_bitrate, cfg.audio.opus_complexity))
        self.inbound: asyncio.Queue = asyncio.Queue(cfg.limits.inbound_queue)
        self.outbound: asyncio.Queue = asyncio.Queue(cfg.limits.outbound_queue)
        self.task: asyncio.Task | None = None
        self._stats = SessionStats()
        self._responses: dict[str, asyncio.Task] = {}
        self._entered: set[str] = set()  # responses whose conv.respond() has begun
        self._cancelled_early: set[str] = set()
        self._last_response: asyncio.Task | None = None
        self._closing: tuple[int, str] | None = None
        self._started = time.monotonic()
        self._last_client = self._started
        self._errors_sent = 0

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
            except (asyncio.TimeoutError, ConnectionClosed):
                writer.cancel()
            code, reason = self._closing or (1000, "")
            await self.ws.close(code, reason)

    def shutdown(self, code: str, message: str) -> None:
        """Ask the session task to send a final error event and close (server stop, idle timeout)."""
        try:
            self.inbound.put_nowait(("shutdown", code, message))
        except asyncio.QueueFull:
            self._closing = (1001, message)
            if self.task:
                self.task.cancel()

    async def _reader(self) -> None:
        try:
            async for message in self.ws:
                await self.inbound.put(("message", message))
        except ConnectionClosed:
            pass
        await self.inbound.put(("closed",))

    async def _writer(self) -> None:
        while (msg := await self.outbound.get()) is not None:
            await self.ws.send(msg)

    async def _session_loop(self) -> None:
        lim = self.gw.config.limits
        next_due: float | None = None
        while self._closing is None:
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
                await self._handle(item, now)
            elif now >= idle_at and (self.session.response is None or self.session.response.status.finished):
                self._close_with_error("idle_timeout", f"no client event for {lim.idle_timeout_s:.0f} s", 1000)
            next_due = self.session.poll_audio(now)
            self.proto.send_session_events(self.session.events())
            self._run_commands()
            self._flush()
            self._observe()

    async def _handle(self, item: tuple, now: float) -> None:
        kind = item[0]
        if kind == "message":
            self._last_client = now
            message = item[1]
            if isinstance(message, bytes):
                self.proto.receive_binary(message, now)
            else:
                self.proto.receive_text(message, now)
            if self.proto.settings_changed:
                self.proto.settings_changed = False
                await self._apply_settings()
        elif kind == "chunk":
            _, rid, chunk = item
            self.session.receive_engine_chunk(rid, chunk.pcm, chunk.text_delta, chunk.is_last, chunk.deadline, now)
        elif kind == "engine_error":
            _, rid, exc = item
            self.session.receive_engine_error(rid, now)
            self.proto.error(getattr(exc, "code", "engine_error"), f"the engine failed this response: {exc}")
        elif kind == "shutdown":
            self._close_with_error(item[1], item[2], 1001)

    async def _apply_settings(self) -> None:
        """Sampling and response settings apply from the conversation's next response on."""
        self.conv.update_options(conversation_options(self.proto.settings))

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
                self._closing = (_CLOSE_SLOW_CLIENT, "slow client: outbound queue full")
                self.gw.metrics.sessions_refused.labels("slow_client").inc()
                return

    def _close_with_error(self, code: str, message: str, close_code: int) -> None:
        self.proto.error(code, message)
        self._flush()
        self._closing = self._closing or (close_code, message[:120])

    def _observe(self) -> None:
        st = self.session.stats
        self.gw.metrics.add_stats_delta(st, self._stats)
        self._stats = dataclasses.replace(st, ttfa_ms=list(st.ttfa_ms))

    def log_end(self) -> None:
        st = self.session.stats
        ttfa = f"{statistics.median(st.ttfa_ms):.0f} ms" if st.ttfa_ms else "-"
        log.info("session %s end: %.1f s, %d responses, %d barge-ins, ttfa p50 %s, %d chunks late, %d underruns reported%s",
                 self.id, time.monotonic() - self._started, st.responses, st.barge_ins, ttfa, st.chunks_late,
                 st.underruns_reported, f", closed: {self._closing[1]}" if self._closing and self._closing[1] else "")
