"""Replies whose body is produced while it is sent (SSE events, speech audio): HTTP/1.1 chunked,
written by the server itself on the connection's transport, which it closes after the reply.

    reply = HttpStream(HTTPStatus.OK, chunks, "text/event-stream")   # a route handler returns it
    await send_stream(connection, reply, close_timeout_s)             # the server writes it (realtime/server.py)

Why the server writes it itself, and how that fits websockets 17. `process_request` may return a
`Response`, which websockets serializes whole (status, headers, body) once `process_request` has
returned: a body still being generated cannot be one. So the reply is written inside
`process_request`, straight on `connection.transport`: the head (`Transfer-Encoding: chunked`,
`Connection: close`), each piece as a chunk as soon as it exists, the last chunk (`0\\r\\n\\r\\n`);
then the transport is closed and the server waits until the connection is lost. When
`process_request` then returns, the protocol's state is CLOSED, and websockets sends nothing on a
closed connection (`handshake()` responds only `if self.state is CONNECTING`) and its handler ends
(`transport.abort()` of a closed transport). One thing had to move: websockets wraps the whole
handshake, `process_request` included, in `asyncio.timeout(open_timeout)`, which would cut a stream
after 10 s. The gateway serves with `open_timeout=None`; `BodyConnection` (realtime/http.py) holds the
same deadline on receiving the request, where slow clients are, and the server bounds the ordinary
routes' handlers by it (`HttpRoute.bounded`). Rejected: handing the transport to another protocol
(`set_protocol`, plus a stub transport for websockets to abort) leans on more of websockets'
internals; a second port for plain HTTP would break "one port for everything" (docs/scaling.md).

Why chunked, with `Connection: close`: the last chunk tells a complete reply from a cut one. A reply
whose body fails midway (the engine fails; audio has no way to carry an error) is closed without
it, so the client's HTTP library reports an incomplete body rather than handing over a short file
as if whole. SSE replies put their error in the stream as an event first, then end normally.

Back-pressure: after each chunk the writer waits while the transport's buffer is over its high-water
mark (websockets' `write_limit`, 32 KiB), so a slow reader slows the body's iterator, which pulls
from the engine no faster than the client reads. A client that takes nothing for `stall_timeout_s`
is dropped. A client that goes away cancels the writer (the server watches `lost`); either way the
body's iterator is closed (`aclose`), which closes the engine's iterator: the engine cancels.
"""

from __future__ import annotations

import asyncio
import contextlib
import email.utils
import logging
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from enum import IntEnum
from http import HTTPStatus
from typing import Protocol

log = logging.getLogger("duplex.http")

LAST_CHUNK = b"0\r\n\r\n"


@dataclass
class HttpStream:
    """A reply whose body is `chunks`, sent as they come; iterated once, closed when the reply ends."""

    status: HTTPStatus
    chunks: AsyncGenerator[bytes, None]  # a generator: closing it runs its finally (the engine's iterator closed)
    content_type: str
    headers: dict[str, str] = field(default_factory=dict)
    stall_timeout_s: float = 30.0  # the client took no byte for this long: dropped, the body's iterator closed


class StreamEnd(IntEnum):
    COMPLETED = 0  # the last chunk was sent
    FAILED = 1  # the body's iterator raised: closed without the last chunk
    STALLED = 2  # the client read nothing for stall_timeout_s: aborted


class StreamTarget(Protocol):
    """What the writer needs of the connection (realtime.http.BodyConnection)."""

    transport: asyncio.Transport
    lost: asyncio.Future

    async def writable(self) -> None: ...


def chunk(piece: bytes) -> bytes:
    """One chunk of a chunked body (never empty: an empty chunk ends the body)."""
    return b"%x\r\n%s\r\n" % (len(piece), piece)


def head(stream: HttpStream, server_header: str | None = None) -> bytes:
    lines = [f"HTTP/1.1 {stream.status.value} {stream.status.phrase}", f"Date: {email.utils.formatdate(usegmt=True)}",
             f"Content-Type: {stream.content_type}", "Transfer-Encoding: chunked", "Connection: close", "Cache-Control: no-cache"]
    if server_header:
        lines.append(f"Server: {server_header}")
    lines += [f"{k}: {v}" for k, v in stream.headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


async def send_stream(conn: StreamTarget, stream: HttpStream, close_timeout_s: float, server_header: str | None = None) -> StreamEnd:
    """Write `stream` on `conn`, then close the connection and wait until it is gone (at most
    `close_timeout_s`, then abort). Cancelled (the client left, the server stops): the body's
    iterator is closed, the transport closed, and the cancellation goes on."""
    transport = conn.transport
    transport.write(head(stream, server_header))
    end = StreamEnd.FAILED
    try:
        end = await _pump(conn, stream)
    except Exception:
        log.exception("a streamed reply failed midway: closed without its last chunk")
    finally:
        if end is StreamEnd.COMPLETED:
            transport.write(LAST_CHUNK)
        if end is StreamEnd.STALLED:
            transport.abort()
        else:
            transport.close()  # what was written is flushed first
    await wait_lost(conn, close_timeout_s)
    return end


async def wait_lost(conn: StreamTarget, timeout_s: float) -> None:
    """Until the closed connection is gone; a client that keeps it open past `timeout_s` is cut off."""
    try:
        await asyncio.wait_for(asyncio.shield(conn.lost), timeout_s)
    except TimeoutError:
        conn.transport.abort()
        await asyncio.shield(conn.lost)


async def _pump(conn: StreamTarget, stream: HttpStream) -> StreamEnd:
    async with contextlib.aclosing(stream.chunks) as pieces:
        async for piece in pieces:
            if not piece:
                continue
            conn.transport.write(chunk(piece))
            try:
                async with asyncio.timeout(stream.stall_timeout_s):
                    await conn.writable()
            except TimeoutError:
                log.info("streamed reply: the client read nothing for %.0f s; dropped", stream.stall_timeout_s)
                return StreamEnd.STALLED
    return StreamEnd.COMPLETED
