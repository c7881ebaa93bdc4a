"""`WS /v1/realtime`: OpenAI-Realtime-style JSON events (and our binary Opus frames) over a WebSocket.

The protocol is `realtime.protocol.RealtimeProtocol`; the WebSocket is the runner's link.

Reconnect and resume (docs/protocol.md): `session.created` carries a resume token when
`limits.resume_grace_s` > 0. A connection that dies without a close frame leaves its session detached;
`GET /v1/realtime?resume=TOKEN&last_seq=N` (authenticated like any connection) re-attaches it: the
handler finds the session by its token, hands the runner the new link, and lives as long as that link.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

from engine.service_api import AtCapacity
from realtime.http import Scope, WsRoute
from realtime.protocol import OpusOutput, ProtocolLimits, RealtimeProtocol, ResumeOffer, SessionSettings
from realtime.resume import ResumeRefused, new_resume_token
from realtime.session import Session
from realtime.text_limits import TokenMeter
from realtime.transports.context import TransportContext
from realtime.web_socket import ServerWebSocket


NAME = "websocket"
PATH = "/v1/realtime"
CLOSE_NORMAL = 1000
CLOSE_TRY_AGAIN = 1013


class WebSocketLink:
    def __init__(self, ws: ServerWebSocket) -> None:
        self.ws = ws

    async def messages(self) -> AsyncIterator[str | bytes]:
        async for message in self.ws:
            yield message

    async def send(self, message: str | bytes) -> None:
        await self.ws.send(message)

    async def close(self, code: int, reason: str) -> None:
        await self.ws.close(code, reason)

    def lost(self) -> bool:
        return self.ws.lost()

    def sent_close_code(self) -> int | None:
        """The code of the close frame we sent (1009 for a message too big is sent for us)."""
        return self.ws.sent_close_code()


def error_event(code: str, message: str, retry_after_s: float | None = None) -> str:
    """An `error` event sent before any session exists (capacity refusal: with `retry_after_s`)."""
    error: dict[str, str | float | None] = {"type": "server_error", "code": code, "message": message, "param": None, "event_id": None}
    if retry_after_s is not None:
        error["retry_after_s"] = retry_after_s
    return json.dumps({"type": "error", "event_id": "event_0", "error": error})


def realtime_protocol(ctx: TransportContext, session: Session, resume_token: str | None = None,
                      audio_out_of_band: bool = False, extensions: bool = False) -> RealtimeProtocol:
    """The OpenAI Realtime event machine for a session, with the server's settings (WebRTC's data channel too)."""
    cfg = ctx.config
    resume = ResumeOffer(resume_token, cfg.limits.resume_grace_s) if resume_token else None
    engine = ctx.admission.engine
    tokens = TokenMeter(engine.count_text_tokens, engine.text_budget(), cfg.limits.text) if engine.supports_text else None
    return RealtimeProtocol(session, ProtocolLimits(max_append_bytes=cfg.limits.max_append_bytes),
                            SessionSettings.of(cfg.session, ctx.voices), OpusOutput(cfg.audio.opus_bitrate, cfg.audio.opus_complexity),
                            resume, audio_out_of_band, extensions, text_model=engine.supports_text, text_limits=cfg.limits.text,
                            tokens=tokens)


def register(ctx: TransportContext) -> None:
    admission, limits = ctx.admission, ctx.config.limits

    async def handle(ws: ServerWebSocket) -> None:
        query = ws.query
        if "resume" in query:
            return await resume(ws, query)
        token = new_resume_token(ctx.config.server.replica_id) if limits.resume_grace_s > 0 else None
        # `?duplex=1` (our SDK): our additions from session.created on, its resume token included
        proto = realtime_protocol(ctx, admission.new_session(), token, extensions=query.get("duplex", ["0"])[0] == "1")
        if ws.credential.grant is not None:  # an ephemeral key's session config: applied as the session opens
            proto.preconfigure(ws.credential.grant.session)
        try:
            runner = admission.open_session(NAME, WebSocketLink(ws), proto, resume_token=token)
        except AtCapacity as e:
            await ws.send(error_event(AtCapacity.code, f"{e}; try again in {e.retry_after_s:g} s", e.retry_after_s))
            await ws.close(CLOSE_TRY_AGAIN, f"server at capacity: retry in {e.retry_after_s:g} s")
            return
        await admission.run(runner)

    async def resume(ws: ServerWebSocket, query: dict[str, list[str]]) -> None:
        """`?resume=TOKEN&last_seq=N`: re-attach a detached (or still attached) session to this connection."""
        runner = admission.find_resumable(query["resume"][0])
        try:
            try:
                last_seq = int(query.get("last_seq", ["0"])[0])
            except ValueError:
                raise ResumeRefused("invalid_last_seq", "last_seq must be an integer") from None
            if runner is None:
                raise ResumeRefused("resume_failed", f"no session to resume with this token (sessions are kept "
                                                     f"{limits.resume_grace_s:.0f} s after a dropped connection)")
            await runner.attach(WebSocketLink(ws), last_seq)
        except ResumeRefused as e:
            await ws.send(error_event(e.code, e.message))
            # at capacity the session stays detached: the client may try again within the grace
            await ws.close(CLOSE_TRY_AGAIN if e.code == AtCapacity.code else CLOSE_NORMAL, e.message[:120])
            return
        await ws.wait_closed()  # the runner owns the connection now; it closes it when the session ends

    ctx.routes.ws[PATH] = WsRoute(handle, Scope.SESSION)
