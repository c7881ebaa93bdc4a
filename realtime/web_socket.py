"""An accepted WebSocket as the transports see it (`WsRoute` handlers, `WebSocketLink`): messages in,
send, close, and how it ended. It wraps aiohttp's `WebSocketResponse`, the shell's (realtime/server.py),
so no transport depends on the framework.

How it ended matters to resumable sessions (`lost()`): a client that sent a close frame left on
purpose; a connection that died (TCP gone, no pong in time) may come back and resume.

Keepalive is ours, not aiohttp's heartbeat: that one pings only after a quiet spell in what the client
sends, so a client that keeps sending but stopped reading (its buffers full, our pings unread) would
never be found out. Here a ping goes every `ping_interval_s` whatever arrives, and a pong must come
back within `ping_timeout_s` (the ping's own write included), else the connection is cut.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Mapping
from typing import TYPE_CHECKING

from aiohttp import WebSocketError, WSCloseCode, WSMsgType, web

if TYPE_CHECKING:
    from realtime.auth import Credential


class ServerWebSocket:
    def __init__(self, ws: web.WebSocketResponse, path: str, query: dict[str, list[str]], headers: Mapping[str, str],
                 credential: Credential, cut: Callable[[], None], ping_interval_s: float | None = None,
                 ping_timeout_s: float | None = None) -> None:
        """`ws`: prepared, with autoping off (pings are answered here). `cut`: drops the connection at once."""
        self._ws, self._cut = ws, cut
        self.path, self.query, self.headers, self.credential = path, query, headers, credential
        self._close_received: int | None = None  # the client's close frame, if it sent one
        self._close_sent: int | None = None  # ours (or aiohttp's, for a protocol error: 1009 too big, 1007 bad UTF-8)
        self._ended = asyncio.get_running_loop().create_future()
        self._pong = asyncio.Event()
        self._keepalive: asyncio.Task | None = None
        if ping_interval_s and ping_timeout_s:
            self._keepalive = asyncio.ensure_future(self._keep_alive(ping_interval_s, ping_timeout_s))

    def __aiter__(self) -> AsyncIterator[str | bytes]:
        return self._messages()

    async def _messages(self) -> AsyncIterator[str | bytes]:
        try:
            while True:
                msg = await self._ws.receive()
                if msg.type is WSMsgType.TEXT or msg.type is WSMsgType.BINARY:
                    yield msg.data
                    continue
                if msg.type is WSMsgType.PING:
                    with contextlib.suppress(ConnectionError):
                        await self._ws.pong(msg.data)
                    continue
                if msg.type is WSMsgType.PONG:
                    self._pong.set()
                    continue
                if msg.type is WSMsgType.CLOSE:
                    self._close_received = int(msg.data)
                elif msg.type is WSMsgType.ERROR and isinstance(msg.data, WebSocketError):
                    self._close_sent = msg.data.code  # the protocol error aiohttp closed with
                return
        finally:
            self._end()

    async def send(self, message: str | bytes) -> None:
        """Waits while the socket's buffer is full (a slow client slows its sender); ConnectionError once closed."""
        if self._ws.closed:
            raise ConnectionError("the WebSocket is closed")
        if isinstance(message, str):
            await self._ws.send_str(message)
        else:
            await self._ws.send_bytes(message)

    async def close(self, code: int = 1000, reason: str = "") -> None:
        if self._close_sent is None and not self._ws.closed and not self._ended.done():  # (a dead connection stays lost)
            self._close_sent = code
        await self._ws.close(code=code, message=reason.encode()[:123])
        self._end()

    async def wait_closed(self) -> None:
        await asyncio.shield(self._ended)

    @property
    def closed(self) -> bool:
        return self._ws.closed

    def lost(self) -> bool:
        """The client never said goodbye (no close frame): its TCP connection died or stopped answering
        pings. A close by the client, or by us for a reason (1009 too big...), is not a loss."""
        return self._close_received is None and (self._close_sent is None or self._close_sent == WSCloseCode.INTERNAL_ERROR)

    def sent_close_code(self) -> int | None:
        return self._close_sent

    def _end(self) -> None:
        if self._keepalive is not None:
            self._keepalive.cancel()
        if not self._ended.done():
            self._ended.set_result(None)

    async def _keep_alive(self, interval_s: float, timeout_s: float) -> None:
        while not self._ws.closed:
            await asyncio.sleep(interval_s)
            self._pong.clear()
            try:
                async with asyncio.timeout(timeout_s):
                    await self._ws.ping()
                    await self._pong.wait()
            except TimeoutError:
                self._cut()  # its messages end; no close frame either way: lost, resumable
                return
            except ConnectionError:
                return
