"""HTTP on the gateway's port, as the transports see it: request, reply and route types, static
files, OpenAI-shaped errors. No framework here: the shell (realtime/server.py, on aiohttp) turns
its requests into `HttpRequest`s and writes `HttpReply`s and `HttpStream`s.

Route handlers are bound at registration (closures over what they need): no handler takes the server.
A handler reads the body itself (`await req.read()`, `await req.form(...)`), so a request it refuses
(capacity, a wrong content type) is refused before a byte of its body is read or held; the body
source enforces the route's size and time limits and answers `Expect: 100-continue` only when read.
"""

from __future__ import annotations

import json
import mimetypes
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from http import HTTPStatus
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from realtime.auth import Credential, Scope

if TYPE_CHECKING:
    from realtime.web_socket import ServerWebSocket

WEB_DIR = Path(__file__).resolve().parent.parent / "web"
MAX_BODY = 256 * 1024  # a request body on any route without its own max_body_bytes


class HttpError(Exception):
    """A refusal raised while the request is read (413, 400 for a malformed form, 408 too slow): the
    shell answers it as an OpenAI-shaped error; a handler may catch it to count the outcome."""

    def __init__(self, status: HTTPStatus, code: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.param = status, code, message, param

    def reply(self) -> HttpReply:
        return json_error(self.status, self.code, self.message, param=self.param)


class BodySource(Protocol):
    """The request body, read on demand within the route's limits (the shell's)."""

    async def read(self) -> bytes: ...

    async def form(self, max_fields: int) -> dict[str, bytes]: ...


@dataclass
class HttpRequest:
    method: str
    path: str
    query: dict[str, list[str]]
    headers: Mapping[str, str]  # case-insensitive
    credential: Credential  # who the request authenticated as (the route's scope allowed it)
    source: BodySource
    params: dict[str, str] = field(default_factory=dict)  # a route pattern's parts ({call_id})
    client: str = ""  # the peer's address

    async def read(self) -> bytes:
        """The whole body (HttpError 413 past the route's `max_body_bytes`, 408 past its deadline)."""
        return await self.source.read()

    async def form(self, max_fields: int = 8) -> dict[str, bytes]:
        """A `multipart/form-data` body (RFC 7578): field name -> its bytes. HttpError 400 when it is not a
        flat form of at most `max_fields` parts with unique names, except that a name ending in "[]" (an
        array, as the openai SDK sends `include[]`) may repeat: its first value is kept."""
        return await self.source.form(max_fields)


@dataclass
class HttpReply:
    status: HTTPStatus
    body: str | bytes = b""
    content_type: str = "text/plain; charset=utf-8"
    headers: dict[str, str] = field(default_factory=dict)


@dataclass
class HttpStream:
    """A reply whose body is `chunks`, sent as they come (HTTP/1.1 chunked), iterated once and closed
    when the reply ends, however it ends: closing it runs its `finally` (the engine's iterator closed).

    The last chunk tells a complete reply from a cut one: a body whose iterator raises midway (the
    engine failed; audio has no way to carry an error) is closed without it, so the client's HTTP
    library reports an incomplete body rather than a short file. Back-pressure: each chunk is written
    once the transport takes it, so a slow reader slows the iterator; a client that takes nothing for
    `stall_timeout_s` is dropped."""

    status: HTTPStatus
    chunks: AsyncGenerator[bytes, None]
    content_type: str
    headers: dict[str, str] = field(default_factory=dict)
    stall_timeout_s: float = 30.0


@dataclass(frozen=True)
class HttpRoute:
    handler: Callable[[HttpRequest], Awaitable[HttpReply | HttpStream]]
    methods: tuple[str, ...] = ("POST",)
    scope: Scope = Scope.SERVER
    max_body_bytes: int = MAX_BODY  # larger bodies: 413, before they are read when Content-Length says so
    body_timeout_s: float | None = None  # the whole body must arrive within this of the request's start; None: limits.open_timeout_s
    # True: the handler runs within limits.open_timeout_s (else 503); False: as long as it needs, ended
    # when its client goes away (an engine request: transcription, a streamed reply)
    bounded: bool = True
    cors: bool = False  # a browser may call it from another origin (preflights answered, replies carry the headers)
    on_refused: Callable[[int], None] | None = None  # told the status of a request refused before its handler (401, 429)


@dataclass(frozen=True)
class WsRoute:
    handler: Callable[[ServerWebSocket], Awaitable[None]]
    scope: Scope = Scope.SESSION
    max_message_bytes: int | None = None  # None: limits.max_message_bytes


@dataclass
class Routes:
    """The server's route table, filled by the transports at start. An HTTP path may hold `{name}`
    parts (`/v1/realtime/calls/{call_id}/hangup`), handed to the handler in `req.params`."""

    ws: dict[str, WsRoute] = field(default_factory=dict)
    http: dict[str, HttpRoute] = field(default_factory=dict)

    def match(self, path: str) -> tuple[str, HttpRoute, dict[str, str]] | None:
        """(the route's path as registered, the route, its parts' values) for a request's path."""
        if (route := self.http.get(path)) is not None:
            return path, route, {}
        parts = path.split("/")
        for pattern, route in self.http.items():
            if "{" not in pattern:
                continue
            want = pattern.split("/")
            if len(want) != len(parts):
                continue
            params: dict[str, str] = {}
            for w, p in zip(want, parts):
                if w.startswith("{") and w.endswith("}") and p:
                    params[w[1:-1]] = p
                elif w != p:
                    break
            else:
                return pattern, route, params
        return None


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
