"""`WS /v1/realtime`: OpenAI-Realtime-style JSON events (and our binary Opus frames) over a WebSocket.

The protocol is `realtime.protocol.RealtimeProtocol`; the WebSocket is the runner's link.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from websockets.asyncio.server import ServerConnection
from websockets.exceptions import ConnectionClosed

from engine.service_api import AtCapacity
from realtime.protocol import OpusOutput, ProtocolLimits, RealtimeProtocol
from realtime.runner import CLOSE_TRY_AGAIN, SessionRunner
from realtime.session import new_id

if TYPE_CHECKING:
    from realtime.server import Gateway

PATH = "/v1/realtime"


class WebSocketLink:
    def __init__(self, ws: ServerConnection) -> None:
        self.ws = ws

    async def messages(self) -> AsyncIterator[str | bytes]:
        try:
            async for message in self.ws:
                yield message
        except ConnectionClosed:
            return

    async def send(self, message: str | bytes) -> None:
        await self.ws.send(message)

    async def close(self, code: int, reason: str) -> None:
        await self.ws.close(code, reason)


def register(gw: Gateway) -> None:
    from realtime.server import WsRoute

    gw.ws_routes[PATH] = WsRoute(handle)


def error_event(code: str, message: str) -> str:
    """An `error` event sent before any session exists (capacity refusal)."""
    return json.dumps({"type": "error", "event_id": "event_0", "error": {"type": "server_error", "code": code,
                                                                        "message": message, "param": None, "event_id": None}})


def realtime_protocol(gw: Gateway, session) -> RealtimeProtocol:
    from realtime.server import session_settings

    cfg = gw.config
    return RealtimeProtocol(session, ProtocolLimits(max_append_bytes=cfg.limits.max_append_bytes), session_settings(cfg),
                            OpusOutput(cfg.audio.opus_bitrate, cfg.audio.opus_complexity))


async def handle(gw: Gateway, ws: ServerConnection) -> None:
    session_id = new_id("sess")
    proto = realtime_protocol(gw, gw.new_session(session_id))
    try:
        conv = gw.open_conversation(session_id, proto.settings.engine_options())
    except AtCapacity as e:
        await ws.send(error_event(AtCapacity.code, str(e)))
        await ws.close(CLOSE_TRY_AGAIN, "server at capacity")
        return
    await gw.run_session(SessionRunner(gw, WebSocketLink(ws), proto, conv, "websocket"))
