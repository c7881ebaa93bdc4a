"""HTTP on the gateway's port: request/reply/route types, static files, bearer-token auth, and the
connection class that lets `websockets` take a POST body.

Route handlers are bound at registration (closures over what they need): no handler takes the server.
`websockets` parses only bodiless requests; `BodyConnection` reads a POST body itself before handing
the request head to websockets, so one port serves WebSocket upgrades, pages and POST bodies (256 KiB,
or a route's own `max_body_bytes`: an audio upload). It also holds the request's deadline (the
server's `limits.open_timeout_s`, or a route's `body_timeout_s` for a large upload), which websockets'
own `open_timeout` used to hold: that one also bounds `process_request`, and a streamed reply
(realtime/http_stream.py) runs inside it for as long as it streams.
"""

from __future__ import annotations

import asyncio
import json
import mimetypes
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from http import HTTPStatus
from pathlib import Path

from websockets.asyncio.server import ServerConnection
from websockets.datastructures import Headers
from websockets.http11 import Response

from realtime.credentials import same_secret
from realtime.http_stream import HttpStream

WEB_DIR = Path(__file__).resolve().parent.parent / "web"
_MAX_HEAD = 16 * 1024
MAX_BODY = 256 * 1024  # a request body on any route without its own max_body_bytes


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
    handler: Callable[[HttpRequest], Awaitable[HttpReply | HttpStream]]
    methods: tuple[str, ...] = ("POST",)
    auth: bool = True  # False: the handler authenticates itself (e.g. a signed webhook)
    max_body_bytes: int = MAX_BODY  # larger bodies: 413 before they are read (with valid credentials: else 401)
    body_timeout_s: float | None = None  # the whole request must arrive within this; None: limits.open_timeout_s
    # True: the handler runs within limits.open_timeout_s (else 503); False: as long as it needs, ended
    # when its client goes away (an engine request: transcription, a streamed reply)
    bounded: bool = True
    on_refused: Callable[[int], None] | None = None  # told the status of a request refused before its handler (401, 413)


@dataclass(frozen=True)
class BodyLimit:
    """What `BodyConnection` accepts for one request, from its head (the server's `body_limit`)."""

    max_bytes: int
    timeout_s: float  # head and body must have arrived this long after the connection opened
    authorized: bool = True  # False: a body over max_bytes is refused with 401 (the route's larger limit needs the token)


@dataclass(frozen=True)
class WsRoute:
    handler: Callable[[ServerConnection], Awaitable[None]]
    auth: bool = True  # False: the protocol carries its own credentials (Twilio's customParameters)


@dataclass
class Routes:
    """The server's route table, filled by the transports at start."""

    ws: dict[str, WsRoute] = field(default_factory=dict)
    http: dict[str, HttpRoute] = field(default_factory=dict)


@dataclass(frozen=True)
class TokenAuth:
    """The gateway's bearer token (`Authorization: Bearer T` or `?token=T`); None or "": no auth."""

    token: str | None

    def authorized(self, headers: Headers, query: dict[str, list[str]]) -> bool:
        if not self.token:
            return True
        header = headers.get("Authorization", "")
        if header.startswith("Bearer ") and same_secret(header[7:].strip(), self.token):
            return True
        return any(same_secret(t, self.token) for t in query.get("token", []))

    def matches(self, token: str) -> bool:
        """A token carried by the protocol itself (Twilio's customParameters)."""
        return bool(self.token and token and same_secret(token, self.token))


def json_error(status: HTTPStatus, code: str, message: str, headers: dict | None = None, param: str | None = None) -> HttpReply:
    """An OpenAI-shaped error body (`param`: the request field at fault, if any)."""
    body = json.dumps(error_body(status, code, message, param))
    return HttpReply(status, body, "application/json", headers or {})


def error_body(status: int, code: str, message: str, param: str | None = None) -> dict:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"type": kind, "code": code, "message": message, "param": param}}


def static_file(path: str) -> HttpReply:
    rel = "index.html" if path == "/" else path[len("/web/"):]
    target = (WEB_DIR / rel).resolve()
    if WEB_DIR not in target.parents or not target.is_file():
        return HttpReply(HTTPStatus.NOT_FOUND, "not found\n")
    ctype = mimetypes.guess_type(target.name)[0] or "application/octet-stream"
    if ctype.startswith("text/") or ctype in ("application/javascript", "text/javascript"):
        ctype += "; charset=utf-8"
    return HttpReply(HTTPStatus.OK, target.read_bytes(), ctype, {"Cache-Control": "no-cache"})


def respond(connection: ServerConnection, reply: HttpReply) -> Response:
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
    """A websockets connection that also accepts one request body (POST), within the request's `BodyLimit`.

    websockets rejects any request with a body. This reads the head; when it announces a body, the
    body is read here, kept in `self.body`, and websockets gets the head without Content-Length. A
    body over its limit is refused here (413 JSON, or 401 when only the token would have allowed it)
    and the rest of it is read and dropped until the client closes, so the client reads the refusal
    instead of a reset. `Expect: 100-continue` is answered once the body is known to fit.

    The whole request must arrive within its limit's `timeout_s` of the connection's start, else the
    connection is aborted (a slow or stalled handshake). For the reply: `lost` completes when the
    connection is gone, and `writable()` waits while the transport's buffer is over its high-water mark.
    """

    on_incomplete_handshake: Callable[[], None] | None = None  # a server subclasses this with its counter
    request_timeout_s: float | None = None  # the server's limits.open_timeout_s (a request without a body limit)
    body_limit: Callable[[str, Headers], BodyLimit] | None = None  # the server's, per request target and headers
    on_body_refused: Callable[[str, int], None] | None = None  # (path, status) of a body refused here

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.body = b""
        self.lost: asyncio.Future[None] = self.loop.create_future()
        self._buf = bytearray()
        self._head: bytes | None = None
        self._need = 0
        self._passthrough = False
        self._refused = False  # a body was refused: the rest of the request is dropped
        self._writable = asyncio.Event()
        self._writable.set()
        self._started = self.loop.time()
        self._deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        if self.request_timeout_s is not None:
            self._set_deadline(self.request_timeout_s)

    def data_received(self, data: bytes) -> None:
        if self._passthrough:
            return super().data_received(data)
        if self._refused:
            return  # the refused body's bytes: read so the client gets to read our answer
        self._buf += data
        if self._head is None:
            end = self._buf.find(b"\r\n\r\n")
            if end < 0:
                if len(self._buf) > _MAX_HEAD:
                    self._pass(bytes(self._buf))  # websockets refuses the oversize head itself
                return
            head, self._buf = bytes(self._buf[: end + 4]), self._buf[end + 4:]
            if _header(head, b"transfer-encoding") is not None:
                return self._refuse(head, HTTPStatus.LENGTH_REQUIRED, "length_required",
                                    "send the request body with a Content-Length (chunked uploads are not accepted)")
            length = _content_length(head)
            if length is None or length == 0:
                return self._pass(head + bytes(self._buf))
            if length < 0:
                return self._refuse(head, HTTPStatus.BAD_REQUEST, "invalid_request", "the Content-Length header is not a number")
            limit = self._limit(head)
            if length > limit.max_bytes:
                if not limit.authorized:
                    return self._refuse(head, HTTPStatus.UNAUTHORIZED, "invalid_api_key", "missing or invalid token")
                return self._refuse(head, HTTPStatus.REQUEST_ENTITY_TOO_LARGE, "request_too_large",
                                    f"the request body is {length} bytes; this endpoint takes at most {limit.max_bytes}")
            self._set_deadline(limit.timeout_s)
            self._head, self._need = _strip_content_length(head), length
            if (_header(head, b"expect") or b"").lower() == b"100-continue" and len(self._buf) < length:
                self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        if len(self._buf) >= self._need:
            self.body = bytes(self._buf[: self._need])
            self._pass(self._head)

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_deadline()
        if self.request is None and not self._refused and self.on_incomplete_handshake is not None:
            self.on_incomplete_handshake()  # no complete request head: a dropped, slow or malformed handshake
        super().connection_lost(exc)
        self._writable.set()
        if not self.lost.done():
            self.lost.set_result(None)

    def pause_writing(self) -> None:
        super().pause_writing()
        self._writable.clear()

    def resume_writing(self) -> None:
        super().resume_writing()
        self._writable.set()

    async def writable(self) -> None:
        """Until the transport takes more (or the connection is gone)."""
        await self._writable.wait()

    def _pass(self, data: bytes) -> None:
        self._cancel_deadline()  # the request is complete: the server bounds its handling (HttpRoute.bounded)
        self._passthrough = True
        self._buf = bytearray()
        super().data_received(data)

    def _limit(self, head: bytes) -> BodyLimit:
        default = BodyLimit(MAX_BODY, self.request_timeout_s or float("inf"))
        if self.body_limit is None:
            return default
        target, headers = _target_and_headers(head)
        return self.body_limit(target, headers)

    def _refuse(self, head: bytes, status: HTTPStatus, code: str, message: str) -> None:
        self._refused = True
        self._buf = bytearray()
        body = json.dumps(error_body(status, code, message)).encode()
        extra = b'WWW-Authenticate: Bearer realm="duplex"\r\n' if status == HTTPStatus.UNAUTHORIZED else b""
        self.transport.write(b"HTTP/1.1 %d %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n%sConnection: close\r\n\r\n%s"
                             % (status.value, status.phrase.encode(), len(body), extra, body))
        if self.transport.can_write_eof():
            self.transport.write_eof()  # the client sees the end of our answer; we read (and drop) until it closes
        else:
            self.transport.close()
        if self.on_body_refused is not None:
            self.on_body_refused(_target_and_headers(head)[0].partition("?")[0], status.value)

    def _set_deadline(self, timeout_s: float) -> None:
        self._cancel_deadline()
        if timeout_s != float("inf"):
            self._deadline = self.loop.call_at(self._started + timeout_s, self._too_slow)

    def _cancel_deadline(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _too_slow(self) -> None:
        self._deadline = None
        self.transport.abort()  # what websockets' open_timeout did


def _header(head: bytes, name: bytes) -> bytes | None:
    for line in head.split(b"\r\n")[1:]:
        key, _, value = line.partition(b":")
        if key.strip().lower() == name:
            return value.strip()
    return None


def _target_and_headers(head: bytes) -> tuple[str, Headers]:
    """The request target and headers, decoded as websockets decodes them (ASCII, surrogateescape)."""
    lines = head.split(b"\r\n")
    parts = lines[0].split(b" ")
    target = parts[1].decode("ascii", "surrogateescape") if len(parts) > 1 else ""
    headers = Headers()
    for line in lines[1:]:
        key, sep, value = line.partition(b":")
        if sep:
            headers[key.strip().decode("ascii", "surrogateescape")] = value.strip().decode("ascii", "surrogateescape")
    return target, headers


def _content_length(head: bytes) -> int | None:
    value = _header(head, b"content-length")
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        return -1


def _strip_content_length(head: bytes) -> bytes:
    lines = [ln for ln in head.split(b"\r\n") if ln.partition(b":")[0].strip().lower() != b"content-length"]
    return b"\r\n".join(lines)
