"""HTTP on the gateway's port: request/reply/route types, static files, bearer-token auth, and the
connection class that lets `websockets` take a small POST body.

Route handlers are bound at registration (closures over what they need): no handler takes the server.
`websockets` parses only bodiless requests; `BodyConnection` reads a POST body itself before handing
the request head to websockets, so one port serves WebSocket upgrades, pages and small POST bodies.
"""

from __future__ import annotations

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
    handler: Callable[[HttpRequest], Awaitable[HttpReply]]
    methods: tuple[str, ...] = ("POST",)
    auth: bool = True  # False: the handler authenticates itself (e.g. a signed webhook)


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
        return bool(self.token) and bool(token) and same_secret(token, self.token)


def json_error(status: HTTPStatus, code: str, message: str, headers: dict | None = None) -> HttpReply:
    """An OpenAI-shaped error body."""
    body = json.dumps({"error": {"type": "invalid_request_error" if status < 500 else "server_error", "code": code, "message": message}})
    return HttpReply(status, body, "application/json", headers or {})


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
    """A websockets connection that also accepts one request body (POST), up to `MAX_BODY` bytes.

    websockets rejects any request with a body. This reads the head; when it announces a body, the
    body is read here, kept in `self.body`, and websockets gets the head without Content-Length.
    """

    MAX_BODY = 256 * 1024
    on_incomplete_handshake: Callable[[], None] | None = None  # a server subclasses this with its counter

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
        if self.request is None and self.on_incomplete_handshake is not None:
            self.on_incomplete_handshake()  # no complete request head: a dropped, slow or malformed handshake
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
