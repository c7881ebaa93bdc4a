"""The gateway's I/O shell: HTTP and WebSocket on one port with `websockets` (DESIGN.md §5).

    GET  /healthz               engine readiness (no auth)
    GET  /metrics               Prometheus text (auth)
    GET  /, /web/...            the demo page, static files from web/ (no auth: they hold no secrets)
    WS   /v1/realtime           OpenAI-Realtime-style events (auth; realtime/transports/websocket.py)
    POST /v1/realtime/calls     WebRTC SDP offer -> answer (auth; realtime/transports/webrtc.py)
    WS   /v1/telephony/twilio   Twilio Media Streams (token in `start`; realtime/transports/twilio.py)
    POST /v1/telephony/twiml    TwiML for a call (realtime/transports/twilio.py)

Transports (realtime/transports/, found by `transports.discover()`) register their routes here
(`ws_routes`, `http_routes`) and share the session machinery:
admission (`open_conversation`), the registry of live sessions and their task (`run_session`).

`websockets` parses only bodiless requests; `BodyConnection` reads a POST body itself before handing
the request head to websockets, so one port serves WebSocket upgrades, pages and small POST bodies.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import mimetypes
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from http import HTTPStatus
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

from websockets.asyncio.server import ServerConnection, serve
from websockets.datastructures import Headers
from websockets.http11 import Request, Response

from engine.service_api import AtCapacity, ConversationOptions
from realtime.config import ServerConfig
from realtime.metrics import CONTENT_TYPE, GatewayMetrics
from realtime.protocol import SessionSettings
from realtime.runner import SessionRunner
from realtime.session import Session, SessionLimits
from realtime.vad import VadParams
from realtime.vad_batch import VadBatcher
from realtime.voices import load_voices

log = logging.getLogger("duplex.gateway")

WEB_DIR = Path(__file__).resolve().parent.parent / "web"
_MAX_HEAD = 16 * 1024


@dataclass
class HttpRequest:
    method: str
    path: str
    query: dict[str, list[str]]
    headers: Headers
    body: bytes = b""


@dataclass
class HttpReply:
    status: HTTPStatus
    body: str | bytes = b""
    content_type: str = "text/plain; charset=utf-8"
    headers: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class HttpRoute:
    handler: Callable[[Gateway, HttpRequest], Awaitable[HttpReply]]
    methods: tuple[str, ...] = ("POST",)
    auth: bool = True  # False: the handler authenticates itself (e.g. a signed webhook)


@dataclass(frozen=True)
class WsRoute:
    handler: Callable[[Gateway, ServerConnection], Awaitable[None]]
    auth: bool = True  # False: the protocol carries its own credentials (Twilio's customParameters)


def session_settings(cfg: ServerConfig, voices: dict | None = None) -> SessionSettings:
    s = cfg.session
    return SessionSettings(instructions=s.instructions, voice=s.voice, temperature=s.temperature, top_k=s.top_k, top_p=s.top_p,
                           seed=s.seed, cfg_scale=s.cfg_scale, max_response_ms=s.max_response_ms, voices=voices or {})


def default_vad(cfg: ServerConfig) -> VadParams | None:
    v = cfg.vad
    return VadParams(v.threshold, v.prefix_padding_ms, v.silence_duration_ms, v.create_response, v.interrupt_response, v.min_speech_ms) if v.enabled else None


class Gateway:
    """One server: the engine, the sessions, the metrics. `await start()`, `await stop()`."""

    def __init__(self, engine, config: ServerConfig, token: str | None = None, voices: dict | None = None) -> None:
        """`voices`: `config.session.voices` already loaded (`load_voices`), else they are loaded here."""
        from realtime import transports

        self.engine = engine
        self.config = config
        self.token = token if token is not None else config.server.token
        self.metrics = GatewayMetrics()
        self.voices = load_voices(config.session.voices) if voices is None else voices  # name -> 16 kHz PCM
        self.vad = VadBatcher(config.audio.vad_batch_ms) if config.audio.vad_batch_ms > 0 else None
        self.sessions: dict[str, SessionRunner] = {}
        self.ws_routes: dict[str, WsRoute] = {}
        self.http_routes: dict[str, HttpRoute] = {}
        self.closing = False
        self.background: set[asyncio.Task] = set()  # sessions started by an HTTP request (WebRTC), not a socket
        self._server = None
        self._cleanup: list[Callable[[], Awaitable[None]]] = []  # transports' resources, closed at stop()
        self.port: int | None = None
        for transport in transports.discover():
            transport.register(self)

    async def start(self) -> None:
        lim = self.config.limits
        self._server = await serve(
            self._handle_ws, self.config.server.host, self.config.server.port, process_request=self._process_request,
            max_size=lim.max_message_bytes, open_timeout=lim.open_timeout_s, close_timeout=lim.close_timeout_s,
            ping_interval=lim.ping_interval_s, ping_timeout=lim.ping_timeout_s, max_queue=32, compression=None,
            create_connection=BodyConnection,
        )
        self._server.duplex_metrics = self.metrics  # BodyConnection counts handshakes that never complete
        self.port = self._server.sockets[0].getsockname()[1]

    def conversation(self, session_id: str):
        """The engine conversation behind a session (tests read its history)."""
        return self.sessions[session_id].conv

    def on_stop(self, close: Callable[[], Awaitable[None]]) -> None:
        self._cleanup.append(close)

    async def stop(self) -> None:
        """Tell every session the server is going away, close them, stop listening."""
        self.closing = True
        for runner in list(self.sessions.values()):
            runner.shutdown("server_shutting_down", "the server is shutting down")
        tasks = [r.task for r in self.sessions.values() if r.task] + list(self.background)
        if tasks:
            await asyncio.wait(tasks, timeout=self.config.limits.close_timeout_s)
        for close in self._cleanup:
            await close()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    # ---- sessions, shared by every transport ----
    def new_session(self, session_id: str, vad: VadParams | None | str = "default", output_frame_ms: int | None = None,
                    lead_ms: float | None = None) -> Session:
        a = self.config.audio
        limits = SessionLimits(output_frame_ms or a.output_frame_ms, a.lead_ms if lead_ms is None else lead_ms, self.config.limits.max_turn_ms)
        return Session(session_id, default_vad(self.config) if vad == "default" else vad, limits, vad_deferred=self.vad is not None)

    def open_conversation(self, session_id: str, options: ConversationOptions):
        """The engine conversation of a new session; AtCapacity (counted) when the gateway or the engine is full."""
        cap = self.config.limits.max_sessions
        try:
            if self.closing:
                raise AtCapacity("the server is shutting down")
            if cap is not None and len(self.sessions) >= cap:
                raise AtCapacity(f"server at capacity: {len(self.sessions)} sessions open (limit {cap})")
            return self.engine.open_conversation(session_id, options)
        except AtCapacity:
            self.metrics.sessions_refused.labels("capacity").inc()
            raise

    async def run_session(self, runner: SessionRunner) -> None:
        """Register the session, run it to its end, free its conversation. Never raises."""
        self.sessions[runner.id] = runner
        self.metrics.sessions_total.inc()
        self.metrics.sessions_active.inc()
        log.info("session %s (%s) start: %d open", runner.id, runner.transport, len(self.sessions))
        try:
            await runner.run()
        except Exception:
            log.exception("session %s failed", runner.id)
        finally:
            self.sessions.pop(runner.id, None)
            self.metrics.sessions_active.dec()
            await runner.conv.close()
            self._count_end(runner)
            runner.log_end()

    def _count_end(self, runner: SessionRunner) -> None:
        m = self.metrics
        m.sessions_ended.labels(runner.transport, end_reason(runner)).inc()
        m.client_errors.inc(getattr(runner.proto, "client_errors", 0))
        for status in runner.session.response_statuses():
            m.responses.labels(status.name.lower()).inc()

    # ---- HTTP ----
    def authorized(self, headers: Headers, query: dict[str, list[str]]) -> bool:
        if not self.token:
            return True
        header = headers.get("Authorization", "")
        if header.startswith("Bearer ") and hmac.compare_digest(header[7:].strip(), self.token):
            return True
        return any(hmac.compare_digest(t, self.token) for t in query.get("token", []))

    async def _process_request(self, connection: ServerConnection, request: Request) -> Response | None:
        parts = urlsplit(request.path)
        path, query = parts.path, parse_qs(parts.query)
        if path == "/healthz":
            health = self.engine.health()
            body = json.dumps({"ready": health.ready, "detail": health.detail, "sessions": len(self.sessions)})
            return _respond(connection, HttpReply(HTTPStatus.OK if health.ready else HTTPStatus.SERVICE_UNAVAILABLE, body, "application/json"))
        if request.method == "GET" and (path == "/" or path.startswith("/web/")):
            return _respond(connection, _static(path))
        ws_route, http_route = self.ws_routes.get(path), self.http_routes.get(path)
        needs_auth = (ws_route.auth if ws_route else http_route.auth if http_route else True)
        if needs_auth and not self.authorized(request.headers, query):
            if ws_route or http_route:
                self.metrics.sessions_refused.labels("unauthorized").inc()
            return _respond(connection, HttpReply(HTTPStatus.UNAUTHORIZED, "missing or invalid token\n",
                                                  headers={"WWW-Authenticate": 'Bearer realm="duplex"'}))
        if path == "/metrics":
            return _respond(connection, HttpReply(HTTPStatus.OK, self.metrics.render(self.engine), CONTENT_TYPE))
        if http_route is not None:
            if request.method not in http_route.methods:
                return _respond(connection, HttpReply(HTTPStatus.METHOD_NOT_ALLOWED, f"use {' or '.join(http_route.methods)}\n",
                                                      headers={"Allow": ", ".join(http_route.methods)}))
            req = HttpRequest(request.method, path, query, request.headers, getattr(connection, "body", b""))
            try:
                reply = await http_route.handler(self, req)
            except Exception:
                log.exception("%s %s failed", request.method, path)
                reply = HttpReply(HTTPStatus.INTERNAL_SERVER_ERROR, "internal error (see the server log)\n")
            return _respond(connection, reply)
        if ws_route is None:
            return _respond(connection, HttpReply(HTTPStatus.NOT_FOUND, "not found\n"))
        if request.method != "GET" or request.headers.get("Upgrade", "").lower() != "websocket":
            return _respond(connection, HttpReply(HTTPStatus.UPGRADE_REQUIRED, "this endpoint is a WebSocket\n"))
        return None

    async def _handle_ws(self, ws: ServerConnection) -> None:
        route = self.ws_routes[urlsplit(ws.request.path).path]
        await route.handler(self, ws)


def end_reason(runner: SessionRunner) -> str:
    """Why a session ended, for `duplex_sessions_ended_total{reason}` (faults show up here)."""
    if runner.closing is None:
        ws = getattr(runner.link, "ws", None)
        sent = getattr(getattr(ws, "protocol", None), "close_sent", None)
        if sent is not None and sent.code == 1009:
            return "message_too_big"
        return "client_closed"
    code, reason = runner.closing
    reason = reason.lower()
    for key, name in (("slow client", "slow_client"), ("idle", "idle_timeout"), ("not resumed", "connection_lost"),
                      ("shutting down", "server_shutdown")):
        if key in reason:
            return name
    return "protocol_end" if code == 1000 else f"closed_{code}"


def _static(path: str) -> HttpReply:
    rel = "index.html" if path == "/" else path[len("/web/"):]
    target = (WEB_DIR / rel).resolve()
    if WEB_DIR not in target.parents or not target.is_file():
        return HttpReply(HTTPStatus.NOT_FOUND, "not found\n")
    ctype = mimetypes.guess_type(target.name)[0] or "application/octet-stream"
    if ctype.startswith("text/") or ctype in ("application/javascript", "text/javascript"):
        ctype += "; charset=utf-8"
    return HttpReply(HTTPStatus.OK, target.read_bytes(), ctype, {"Cache-Control": "no-cache"})


def _respond(connection: ServerConnection, reply: HttpReply) -> Response:
    body = reply.body.encode() if isinstance(reply.body, str) else reply.body
    resp = connection.respond(reply.status, "")
    resp.body = body
    del resp.headers["Content-Length"]
    resp.headers["Content-Length"] = str(len(body))
    del resp.headers["Content-Type"]
    resp.headers["Content-Type"] = reply.content_type
    for k, v in reply.headers.items():
        resp.headers[k] = v
    return resp


class BodyConnection(ServerConnection):
    """A websockets connection that also accepts one request body (POST), up to `MAX_BODY` bytes.

    websockets rejects any request with a body. This reads the head; when it announces a body, the
    body is read here, kept in `self.body`, and websockets gets the head without Content-Length.
    """

    MAX_BODY = 256 * 1024

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.body = b""
        self._buf = bytearray()
        self._head: bytes | None = None
        self._need = 0
        self._passthrough = False

    def data_received(self, data: bytes) -> None:
        if self._passthrough:
            return super().data_received(data)
        self._buf += data
        if self._head is None:
            end = self._buf.find(b"\r\n\r\n")
            if end < 0:
                if len(self._buf) > _MAX_HEAD:
                    self._pass(bytes(self._buf))  # websockets refuses the oversize head itself
                return
            head, self._buf = bytes(self._buf[: end + 4]), self._buf[end + 4:]
            length = _content_length(head)
            if length is None or length == 0:
                return self._pass(head + bytes(self._buf))
            if length < 0 or length > self.MAX_BODY:
                self.transport.write(b"HTTP/1.1 413 Content Too Large\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
                self.transport.close()
                self._passthrough = True
                return
            self._head, self._need = _strip_content_length(head), length
        if len(self._buf) >= self._need:
            self.body = bytes(self._buf[: self._need])
            self._pass(self._head)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.request is None:  # no complete request head: a dropped, slow or malformed handshake
            metrics = getattr(self.server, "duplex_metrics", None)
            if metrics is not None:
                metrics.handshakes_incomplete.inc()
        super().connection_lost(exc)

    def _pass(self, data: bytes) -> None:
        self._passthrough = True
        self._buf = bytearray()
        super().data_received(data)


def _content_length(head: bytes) -> int | None:
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            try:
                return int(value.strip())
            except ValueError:
                return -1
    return None


def _strip_content_length(head: bytes) -> bytes:
    lines = [ln for ln in head.split(b"\r\n") if ln.partition(b":")[0].strip().lower() != b"content-length"]
    return b"\r\n".join(lines)
