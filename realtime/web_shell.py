"""The gateway's HTTP and WebSocket server on one port, on aiohttp's low-level server: it turns
requests into the transports' terms (realtime/http.py, realtime/web_socket.py) and back.

A request goes: public endpoints (health, the demo page) → a CORS preflight → the credential
(realtime/auth.py) against the route's scope (401) → the client's request rate (429, HTTP routes) →
the route: a WebSocket upgrade handed to its handler, or an HTTP handler in this request's task, which
aiohttp cancels when the client goes away (so the engine request it awaits ends). The body is read by
the handler, on demand, within the route's limits (realtime/http_body.py).

Deadlines: a request head must arrive within `limits.open_timeout_s` of the connection's start or of
the previous reply (aiohttp's keep-alive timer, which closes a connection waiting for a head); its body
by the route's deadline; an ordinary handler runs within `open_timeout_s` (503); engine work
(transcription, streamed replies) as long as its client reads.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import ssl
from collections.abc import Callable
from http import HTTPStatus
from typing import Any
from urllib.parse import parse_qs

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestHandler

from realtime.auth import Auth, Credential
from realtime.config import ServerConfig
from realtime.cors import allow_origin, preflight
from realtime.http import (HttpError, HttpReply, HttpRequest, HttpRoute, HttpStream, Routes, Scope, WsRoute, json_error,
                           static_file)
from realtime.http_body import RequestBody
from realtime.metrics import GatewayMetrics
from realtime.request_rate import RequestRate
from realtime.web_socket import ServerWebSocket

log = logging.getLogger("duplex.http")

SUBPROTOCOL = "realtime"  # what a browser WebSocket offers beside its key; the one we select
# A WebSocket's socket is read this much at a time (asyncio's default: 256 KiB). aiohttp parses a whole
# read at once, and a flood of tiny frames (the soak's empty_opus: 1-byte messages as fast as a client
# can send) then took the loop's round trip p99 from 4 ms to 43 ms; with 16 KiB reads, 6 ms. A large
# append costs a few more reads.
WS_READ_BYTES = 16 * 1024
CHALLENGE = {"WWW-Authenticate": 'Bearer realm="duplex"'}


class _MalformedRequests(logging.Filter):
    """aiohttp logs each malformed request head at ERROR with a traceback: any client could flood the log
    with them. They are answered 400 and counted (`duplex_handshakes_incomplete_total`); not logged."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not isinstance(exc, HttpProcessingError)


_server_log = logging.getLogger("duplex.http.server")
_server_log.addFilter(_MalformedRequests())


class _Server(web.Server):
    """aiohttp's server, counting connections that closed before a complete request (slow, dropped
    or malformed handshakes)."""

    def __init__(self, *args: Any, on_incomplete: Callable[[], None], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._on_incomplete = on_incomplete
        self.served: set[RequestHandler] = set()  # connections that brought a request to a handler

    def connection_lost(self, handler: RequestHandler, exc: BaseException | None = None) -> None:
        if handler in self.served:
            self.served.discard(handler)
        else:
            self._on_incomplete()
        super().connection_lost(handler, exc)


class WebShell:
    def __init__(self, config: ServerConfig, routes: Routes, auth: Auth, metrics: GatewayMetrics,
                 public: dict[str, Callable[[], HttpReply]], metrics_reply: Callable[[], HttpReply]) -> None:
        """`public`: path -> reply of the endpoints anyone may read (health checks)."""
        self.config, self.routes, self.auth, self.metrics = config, routes, auth, metrics
        self._public, self._metrics_reply = public, metrics_reply
        self.rate = RequestRate(config.limits.http_rate)
        self._server: _Server | None = None
        self._runner: web.ServerRunner | None = None
        self._exchanges: set[asyncio.Task] = set()  # HTTP handlers running (their replies streaming), cancelled at stop()
        self._sockets: set[asyncio.Future] = set()  # WebSocket handlers running (they end with their sessions)
        self.port: int | None = None

    async def start(self, ssl_context: ssl.SSLContext | None) -> None:
        lim = self.config.limits
        self._server = _Server(self._handle, on_incomplete=self.metrics.handshakes_incomplete.inc, handler_cancellation=True,
                               keepalive_timeout=lim.open_timeout_s, access_log=None, logger=_server_log)
        self._runner = web.ServerRunner(self._server, handle_signals=False, shutdown_timeout=lim.close_timeout_s)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.config.server.host, self.config.server.port, ssl_context=ssl_context)
        await site.start()
        self.port = self._runner.addresses[0][1]

    async def stop_exchanges(self) -> None:
        """End the HTTP requests in progress: a transcription or a streamed reply, its engine request with it."""
        for task in self._exchanges:
            task.cancel()
        if self._exchanges:
            await asyncio.wait(self._exchanges, timeout=self.config.limits.close_timeout_s)

    async def stop(self) -> None:
        """Stop listening and close every connection."""
        await self.stop_exchanges()
        if self._runner is not None:
            await self._runner.cleanup()

    # ---- dispatch ----
    async def _handle(self, request: web.BaseRequest) -> web.StreamResponse:
        assert self._server is not None
        self._server.served.add(request.protocol)
        resp = await self._dispatch(request)
        if not isinstance(resp, web.WebSocketResponse) and request.body_exists and not request.content.is_eof():
            # a body left unread (a refusal): answered with `Connection: close`; aiohttp reads and drops the
            # rest for a while (its lingering time) so the client gets to read the answer, then closes
            resp.force_close()
        return resp

    async def _dispatch(self, request: web.BaseRequest) -> web.StreamResponse:
        path, method = request.path, request.method
        if (public := self._public.get(path)) is not None:
            return _response(public())
        if method == "GET" and (path == "/" or path.startswith("/web/")):
            return _response(static_file(path))
        ws_route = self.routes.ws.get(path)
        matched = self.routes.match(path)
        route_path, http_route, params = matched if matched is not None else (path, None, {})
        if method == "OPTIONS" and http_route is not None and http_route.cors:
            return web.Response(status=HTTPStatus.NO_CONTENT,
                                headers=preflight(request.headers, http_route.methods, self.config.server.cors_origins))
        cors = allow_origin(request.headers.get("Origin"), self.config.server.cors_origins) if http_route and http_route.cors else {}
        query = parse_qs(request.query_string)
        offered = _subprotocols(request.headers.get("Sec-WebSocket-Protocol", ""))
        scope = ws_route.scope if ws_route else http_route.scope if http_route else Scope.SERVER
        credential = self.auth.identify(request.headers, query, offered)
        if scope is not Scope.PUBLIC and (credential is None or not credential.allows(scope)):
            return self._unauthorized(route_path, ws_route, http_route, cors)
        assert credential is not None or scope is Scope.PUBLIC
        if path == "/metrics":
            return _response(self._metrics_reply())
        if http_route is not None:
            if method not in http_route.methods:
                return _response(HttpReply(HTTPStatus.METHOD_NOT_ALLOWED, f"use {' or '.join(http_route.methods)}\n",
                                           headers={"Allow": ", ".join(http_route.methods), **cors}))
            rate_key = (credential.id if credential is not None else "anonymous", request.remote or "")
            if (retry_s := self.rate.admit(rate_key)) is not None:
                self.metrics.http_rate_limited.inc()
                if http_route.on_refused is not None:
                    http_route.on_refused(HTTPStatus.TOO_MANY_REQUESTS)
                return _response(json_error(HTTPStatus.TOO_MANY_REQUESTS, "rate_limit_exceeded",
                                            f"too many requests from this client; try again in {retry_s:.1f} s",
                                            {"Retry-After": str(max(1, math.ceil(retry_s))), **cors}))
            return await self._serve_http(request, http_route, params, query, credential, cors)
        if ws_route is None:
            return _response(HttpReply(HTTPStatus.NOT_FOUND, "not found\n"))
        if method != "GET" or request.headers.get("Upgrade", "").lower() != "websocket":
            return _response(HttpReply(HTTPStatus.UPGRADE_REQUIRED, "this endpoint is a WebSocket\n"))
        return await self._serve_ws(request, ws_route, query, offered, credential)

    def _unauthorized(self, path: str, ws_route: WsRoute | None, http_route: HttpRoute | None, cors: dict) -> web.Response:
        """`path`: as the route was registered (`/v1/realtime/calls/{call_id}/hangup`), so the metric's labels stay few."""
        known = ws_route is not None or http_route is not None or path == "/metrics"
        self.metrics.auth_failures.labels(path if known else "other").inc()
        if http_route is not None and http_route.on_refused is not None:
            http_route.on_refused(HTTPStatus.UNAUTHORIZED)
        if ws_route or http_route:  # an API client reads an OpenAI-shaped error
            self.metrics.sessions_refused.labels("unauthorized").inc()
            return _response(json_error(HTTPStatus.UNAUTHORIZED, "invalid_api_key", "missing, invalid or expired credential",
                                        {**CHALLENGE, **cors}))
        return _response(HttpReply(HTTPStatus.UNAUTHORIZED, "missing or invalid token\n", headers=CHALLENGE))

    # ---- HTTP routes ----
    async def _serve_http(self, request: web.BaseRequest, route: HttpRoute, params: dict[str, str], query: dict[str, list[str]],
                          credential: Credential | None, cors: dict[str, str]) -> web.StreamResponse:
        lim = self.config.limits
        loop = asyncio.get_running_loop()
        body_deadline = loop.time() + (route.body_timeout_s or lim.open_timeout_s)
        req = HttpRequest(request.method, request.path, query, request.headers, credential or _PUBLIC,
                          RequestBody(request, route.max_body_bytes, body_deadline), params, request.remote or "")
        task = asyncio.current_task()
        assert task is not None
        self._exchanges.add(task)
        try:
            try:
                if route.bounded:
                    async with asyncio.timeout(lim.open_timeout_s):
                        reply = await route.handler(req)
                else:
                    reply = await route.handler(req)
            except HttpError as e:
                if route.on_refused is not None:
                    route.on_refused(e.status)
                reply = e.reply()
            except TimeoutError:
                log.warning("%s %s took longer than limits.open_timeout_s (%.0f s)", req.method, req.path, lim.open_timeout_s)
                reply = json_error(HTTPStatus.SERVICE_UNAVAILABLE, "timeout", "the request took too long; try again")
            except asyncio.CancelledError:
                if request.transport is None or request.transport.is_closing():
                    raise  # the client went away
                reply = json_error(HTTPStatus.SERVICE_UNAVAILABLE, "server_shutting_down", "the server is shutting down")
            except Exception:
                log.exception("%s %s failed", req.method, req.path)
                reply = json_error(HTTPStatus.INTERNAL_SERVER_ERROR, "server_error", "internal error (see the server log)")
            if isinstance(reply, HttpStream):
                return await _send_stream(request, reply, cors)
            reply.headers.update(cors)
            resp = _response(reply)
            if reply.status == HTTPStatus.REQUEST_TIMEOUT:  # a client too slow to send its body: answered, then cut off
                resp.force_close()
                await resp.prepare(request)
                await resp.write_eof()
                _cut(request, abort=False)
            return resp
        finally:
            self._exchanges.discard(task)

    # ---- WebSocket routes ----
    async def _serve_ws(self, request: web.BaseRequest, route: WsRoute, query: dict[str, list[str]], offered: list[str],
                        credential: Credential | None) -> web.StreamResponse:
        lim = self.config.limits
        ws = web.WebSocketResponse(protocols=(SUBPROTOCOL,) if SUBPROTOCOL in offered else (), autoping=False,
                                   max_msg_size=route.max_message_bytes or lim.max_message_bytes, compress=False,
                                   timeout=lim.close_timeout_s, autoclose=True)
        try:
            await ws.prepare(request)
        except web.HTTPException as e:  # not a valid upgrade (a bad Sec-WebSocket-Key...)
            return _response(HttpReply(HTTPStatus(e.status), f"{e.text or e.reason}\n"))
        if request.transport is not None and hasattr(request.transport, "max_size"):
            # asyncio's selector transport reads `max_size` bytes per recv (an attribute, not an API: other
            # loops' transports lack it and keep their own size)
            request.transport.max_size = WS_READ_BYTES
        # aiohttp cancels a request's task when its connection drops; a session must outlive that (it notices
        # the end of its messages itself, and a resumable one is kept for its client to come back)
        socket = ServerWebSocket(ws, request.path, query, request.headers, credential or _PUBLIC, lambda: _cut(request, abort=True),
                                 lim.ping_interval_s, lim.ping_timeout_s)
        session = asyncio.ensure_future(route.handler(socket))
        self._sockets.add(session)
        session.add_done_callback(self._sockets.discard)
        await asyncio.shield(session)
        if not ws.closed:
            await ws.close()
        return ws


_PUBLIC = Credential("open", "anonymous")  # on a Scope.PUBLIC route: no credential was asked for


def _subprotocols(header: str) -> list[str]:
    return [p.strip() for p in header.split(",") if p.strip()]


def _response(reply: HttpReply) -> web.Response:
    body = reply.body.encode() if isinstance(reply.body, str) else reply.body
    resp = web.Response(status=reply.status, body=body, headers=reply.headers)
    resp.headers["Content-Type"] = reply.content_type
    return resp


async def _send_stream(request: web.BaseRequest, stream: HttpStream, cors: dict[str, str]) -> web.StreamResponse:
    """Write `stream` chunked as its pieces come; see `HttpStream` for how it ends."""
    resp = web.StreamResponse(status=stream.status, headers={"Content-Type": stream.content_type, "Cache-Control": "no-cache",
                                                            **stream.headers, **cors})
    resp.enable_chunked_encoding()
    resp.force_close()  # one reply per connection: a cut reply must be seen as cut
    async with contextlib.aclosing(stream.chunks) as pieces:
        await resp.prepare(request)
        try:
            async for piece in pieces:
                if not piece:
                    continue
                try:
                    async with asyncio.timeout(stream.stall_timeout_s):
                        await resp.write(piece)
                except TimeoutError:
                    log.info("streamed reply: the client read nothing for %.0f s; dropped", stream.stall_timeout_s)
                    _cut(request, abort=True)
                    return resp
        except Exception:
            log.exception("a streamed reply failed midway: closed without its last chunk")
            _cut(request, abort=False)
            return resp
    await resp.write_eof()
    return resp


def _cut(request: web.BaseRequest, abort: bool) -> None:
    """End the connection without the last chunk (what was written is flushed first, unless `abort`)."""
    transport = request.transport
    if transport is not None:
        transport.abort() if abort else transport.close()
