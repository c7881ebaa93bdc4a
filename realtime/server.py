"""The gateway's I/O shell: HTTP and WebSocket on one port with `websockets` (docs/architecture.md).

    GET  /healthz               readiness: 200 when a new session would be admitted (no auth)
    GET  /livez                 liveness: 200 while the server serves, draining or full included (no auth)
    GET  /metrics               Prometheus text (auth)
    GET  /, /web/...            the demo page, static files from web/ (no auth: they hold no secrets)
    WS   /v1/realtime           OpenAI-Realtime-style events (auth; realtime/transports/websocket.py)
    POST /v1/realtime/calls     WebRTC SDP offer -> answer (auth; realtime/transports/webrtc.py)
    WS   /v1/telephony/twilio   Twilio Media Streams (token in `start`; realtime/transports/twilio.py)
    POST /v1/telephony/twiml    TwiML for a call (realtime/transports/twilio.py)
    POST /v1/audio/transcriptions, /v1/audio/speech   OpenAI's one-shot audio API (auth; realtime/transports/audio_api.py)

The transports are the explicit list `TRANSPORTS`: each `register(ctx)` adds its routes, bound to
what it needs from `TransportContext`, and they share one admission path (realtime/admission.py).

An HTTP route's handler runs in its own task while the server watches the connection: a client
that goes away cancels it (and so the engine request it awaits). A handler may return an
`HttpStream`, which the server writes itself, chunked, then closes the connection
(realtime/http_stream.py says why; websockets' `open_timeout` is therefore off and `BodyConnection`
holds the request's deadline).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from collections.abc import Awaitable, Callable
from http import HTTPStatus
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, urlsplit

from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.datastructures import Headers
from websockets.http11 import SERVER, Request, Response

from engine.service_api import Conversation, EngineLike
from realtime.admission import Admission
from realtime.config import ServerConfig
from realtime.http import (MAX_BODY, BodyConnection, BodyLimit, HttpReply, HttpRequest, HttpRoute, Routes, TokenAuth, json_error,
                           respond, static_file)
from realtime.http_stream import HttpStream, send_stream, wait_lost
from realtime.metrics import CONTENT_TYPE, GatewayMetrics
from realtime.tracing import TRACER_NAME, provider_from_env
from realtime.transports import audio_api, twilio, webrtc, websocket
from realtime.transports.context import TransportContext
from realtime.vad_batch import VadBatcher
from realtime.voices import load_voices

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider

    from realtime.runner import SessionRunner

log = logging.getLogger("duplex.gateway")

TRANSPORTS = (websocket, webrtc, twilio, audio_api)  # a new transport is one new module here


class Gateway:
    """One server: the engine, the sessions, the metrics. `await start()`, `await stop()`."""

    def __init__(self, engine: EngineLike, config: ServerConfig, token: str | None = None, voices: dict | None = None,
                 tracer_provider: TracerProvider | None = None) -> None:
        """`voices`: `config.session.voices` already loaded (`load_voices`), else they are loaded here.
        `tracer_provider`: an OpenTelemetry TracerProvider for the sessions' spans (the caller's to shut
        down), else one from the OTEL_* environment, or none when it configures no exporter."""
        self.engine = engine
        if config.session.assistant_text and not engine.supports_text:
            # every session would be refused by the engine (NoTextModel): serve audio answers without text instead
            log.warning("config session.assistant_text is on, but the model has no text tokenizer: answers carry no text")
            config = dataclasses.replace(config, session=dataclasses.replace(config.session, assistant_text=False))
        self.config = config
        self.auth = TokenAuth(token if token is not None else config.server.token)
        self.metrics = GatewayMetrics()
        self.voices = load_voices(config.session.voices) if voices is None else voices  # name -> 16 kHz PCM
        self.vad = VadBatcher(config.audio.vad_batch_ms) if config.audio.vad_batch_ms > 0 else None
        self._own_tracer_provider = tracer_provider is None
        self.tracer_provider = provider_from_env() if tracer_provider is None else tracer_provider
        tracer = None if self.tracer_provider is None else self.tracer_provider.get_tracer(TRACER_NAME)
        self.admission = Admission(engine, config, self.metrics, self.vad, tracer)
        self.routes = Routes()
        self._server: Server | None = None
        self._cleanup: list[Callable[[], Awaitable[None]]] = []  # transports' resources, closed at stop()
        self._exchanges: set[asyncio.Task] = set()  # HTTP handlers running (their replies streaming), cancelled at stop()
        self.port: int | None = None
        ctx = TransportContext(config, self.admission, self.metrics, self.auth, self.voices, self.routes, self._cleanup.append)
        self.transports = {t.NAME: t.register(ctx) for t in TRANSPORTS}  # name -> the transport's state (tests read it)

    @property
    def token(self) -> str | None:
        return self.auth.token

    @property
    def sessions(self) -> dict[str, SessionRunner]:
        return self.admission.sessions

    async def start(self) -> None:
        lim = self.config.limits

        class Connection(BodyConnection):
            on_incomplete_handshake = staticmethod(self.metrics.handshakes_incomplete.inc)
            request_timeout_s = lim.open_timeout_s
            body_limit = staticmethod(self._body_limit)
            on_body_refused = staticmethod(self._body_refused)

        # open_timeout=None: websockets' would also bound process_request, where replies stream
        # (realtime/http_stream.py); Connection holds the handshake's deadline instead
        self._server = server = await serve(
            self._handle_ws, self.config.server.host, self.config.server.port, process_request=self._process_request,
            max_size=lim.max_message_bytes, open_timeout=None, close_timeout=lim.close_timeout_s,
            ping_interval=lim.ping_interval_s, ping_timeout=lim.ping_timeout_s, max_queue=32, compression=None,
            create_connection=Connection,
        )
        self.port = server.sockets[0].getsockname()[1]

    def conversation(self, session_id: str) -> Conversation:
        """The engine conversation behind a session (tests read its history)."""
        return self.sessions[session_id].conv

    async def stop(self) -> None:
        """Tell every session the server is going away, close them, stop listening."""
        await self.admission.stop()
        for task in self._exchanges:
            task.cancel()  # a transcription or a streamed reply in progress: its engine request ends
        if self._exchanges:
            await asyncio.wait(self._exchanges, timeout=self.config.limits.close_timeout_s)
        for close in self._cleanup:
            await close()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        if self._own_tracer_provider and self.tracer_provider is not None:
            await asyncio.to_thread(self.tracer_provider.shutdown)  # exports the spans still batched (blocking I/O)

    async def drain(self) -> bool:
        """The first half of a graceful stop (SIGTERM; `stop()` is the second): /healthz says `draining`
        and new sessions are refused, so a load balancer sends them to other replicas; running sessions
        go on until they end (True) or `limits.drain_timeout_s` passes (False)."""
        timeout_s = self.config.limits.drain_timeout_s
        if await self.admission.drain(timeout_s):
            log.info("drained: every session ended")
            return True
        log.warning("drain timeout (%.0f s): %d sessions still open", timeout_s, len(self.sessions))
        return False

    # ---- HTTP ----
    def _live(self) -> HttpReply:
        """200 while this server serves its sessions (and their resumes), also when it is full or draining;
        503 once it stops or its engine failed: a load balancer's check for routing resumes and Twilio
        streams to their replica, and a liveness probe."""
        health = self.engine.health()
        live = not self.admission.closing and (health.ready or health.detail == "starting")
        body = {"live": live, "draining": self.admission.draining, "detail": health.detail,
                "replica_id": self.config.server.replica_id}
        return HttpReply(HTTPStatus.OK if live else HTTPStatus.SERVICE_UNAVAILABLE, json.dumps(body), "application/json")

    def _health(self) -> HttpReply:
        """200 when a new session would be admitted; 503 while starting, stopping or at capacity (a load
        balancer's health check then sends new callers elsewhere; running sessions are unaffected)."""
        health = self.engine.health()
        body = {"ready": health.ready, "detail": health.detail, "sessions": len(self.sessions)}
        full = self.admission.full() if health.ready else None
        if health.ready:
            load = self.engine.load()
            body.update(capacity=load.capacity, limited_by=load.extra.get("limited_by"), at_capacity=full is not None,
                        bounds=load.extra.get("bounds"), feedback_ceiling=load.extra.get("feedback_ceiling"))
            if "ranks" in load.extra:  # several engines (engine.data_parallel_size): each one's conversations and bound
                body["ranks"] = load.extra["ranks"]
            if full is not None:
                a = self.admission
                body.update(detail="stopping" if a.closing else "draining" if a.draining else "at_capacity", reason=full,
                            retry_after_s=self.config.limits.retry_after_s)
        ok = health.ready and full is None
        return HttpReply(HTTPStatus.OK if ok else HTTPStatus.SERVICE_UNAVAILABLE, json.dumps(body), "application/json")

    async def _process_request(self, connection: ServerConnection, request: Request) -> Response | None:
        parts = urlsplit(request.path)
        path, query = parts.path, parse_qs(parts.query)
        if path == "/healthz":
            return respond(connection, self._health())
        if path == "/livez":
            return respond(connection, self._live())
        if request.method == "GET" and (path == "/" or path.startswith("/web/")):
            return respond(connection, static_file(path))
        ws_route, http_route = self.routes.ws.get(path), self.routes.http.get(path)
        needs_auth = (ws_route.auth if ws_route else http_route.auth if http_route else True)
        if needs_auth and not self.auth.authorized(request.headers, query):
            known = ws_route is not None or http_route is not None or path == "/metrics"
            self.metrics.auth_failures.labels(path if known else "other").inc()
            if ws_route or http_route:
                self.metrics.sessions_refused.labels("unauthorized").inc()
            challenge = {"WWW-Authenticate": 'Bearer realm="duplex"'}
            if http_route is not None:  # an API client reads an OpenAI-shaped error
                if http_route.on_refused is not None:
                    http_route.on_refused(HTTPStatus.UNAUTHORIZED)
                return respond(connection, json_error(HTTPStatus.UNAUTHORIZED, "invalid_api_key", "missing or invalid token", challenge))
            return respond(connection, HttpReply(HTTPStatus.UNAUTHORIZED, "missing or invalid token\n", headers=challenge))
        if path == "/metrics":
            return respond(connection, HttpReply(HTTPStatus.OK, self.metrics.render(self.engine), CONTENT_TYPE))
        if http_route is not None:
            if request.method not in http_route.methods:
                return respond(connection, HttpReply(HTTPStatus.METHOD_NOT_ALLOWED, f"use {' or '.join(http_route.methods)}\n",
                                                     headers={"Allow": ", ".join(http_route.methods)}))
            assert isinstance(connection, BodyConnection)  # start() serves with create_connection=Connection
            req = HttpRequest(request.method, path, query, request.headers, connection.body)
            return await self._serve_http(connection, http_route, req)
        if ws_route is None:
            return respond(connection, HttpReply(HTTPStatus.NOT_FOUND, "not found\n"))
        if request.method != "GET" or request.headers.get("Upgrade", "").lower() != "websocket":
            return respond(connection, HttpReply(HTTPStatus.UPGRADE_REQUIRED, "this endpoint is a WebSocket\n"))
        return None

    async def _serve_http(self, connection: BodyConnection, route: HttpRoute, req: HttpRequest) -> Response:
        """Run the route's handler in a task, cancelled when the client goes away (its engine request
        ends) or the server stops. A streamed reply is written here and the connection closed: the
        Response returned then is never sent (websockets sends nothing on a closed connection)."""
        work = asyncio.ensure_future(self._exchange(connection, route, req))
        self._exchanges.add(work)
        try:
            either: set[asyncio.Future[Any]] = {work, connection.lost}  # a Response or None: whichever ends first
            await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not work.done():
                work.cancel()
                await asyncio.wait({work})
            self._exchanges.discard(work)
        if not work.cancelled():
            return work.result()
        if connection.transport.is_closing():  # the client left, or a stream was cut by the stop
            await wait_lost(connection, self.config.limits.close_timeout_s)
            return respond(connection, HttpReply(HTTPStatus.OK))  # never sent: the connection is closed
        return respond(connection, json_error(HTTPStatus.SERVICE_UNAVAILABLE, "server_shutting_down", "the server is shutting down"))

    async def _exchange(self, connection: BodyConnection, route: HttpRoute, req: HttpRequest) -> Response:
        lim = self.config.limits
        try:
            if route.bounded:
                async with asyncio.timeout(lim.open_timeout_s):
                    reply = await route.handler(req)
            else:
                reply = await route.handler(req)
        except TimeoutError:
            log.warning("%s %s took longer than limits.open_timeout_s (%.0f s)", req.method, req.path, lim.open_timeout_s)
            reply = json_error(HTTPStatus.SERVICE_UNAVAILABLE, "timeout", "the request took too long; try again")
        except Exception:
            log.exception("%s %s failed", req.method, req.path)
            reply = HttpReply(HTTPStatus.INTERNAL_SERVER_ERROR, "internal error (see the server log)\n")
        if isinstance(reply, HttpStream):
            await send_stream(connection, reply, lim.close_timeout_s, SERVER)
            return respond(connection, HttpReply(HTTPStatus.OK))  # never sent: send_stream closed the connection
        return respond(connection, reply)

    def _body_limit(self, target: str, headers: Headers) -> BodyLimit:
        """A request body's limit from its head: a route's own (an audio upload), given the token."""
        parts = urlsplit(target)
        route = self.routes.http.get(parts.path)
        default = BodyLimit(MAX_BODY, self.config.limits.open_timeout_s)
        if route is None or route.max_body_bytes <= MAX_BODY:
            return default
        if route.auth and not self.auth.authorized(headers, parse_qs(parts.query)):
            return BodyLimit(MAX_BODY, default.timeout_s, authorized=False)
        return BodyLimit(route.max_body_bytes, route.body_timeout_s or default.timeout_s)

    def _body_refused(self, path: str, status: int) -> None:
        route = self.routes.http.get(path)
        if status == HTTPStatus.UNAUTHORIZED:
            self.metrics.auth_failures.labels(path if route is not None else "other").inc()
        if route is not None and route.on_refused is not None:
            route.on_refused(status)

    async def _handle_ws(self, ws: ServerConnection) -> None:
        request = ws.request
        assert request is not None  # a handler runs once the handshake is done
        route = self.routes.ws[urlsplit(request.path).path]
        await route.handler(ws)
