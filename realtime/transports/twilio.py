"""Telephony: Twilio Media Streams (`WS /v1/telephony/twilio`) and the TwiML that opens them (`/v1/telephony/twiml`).

A call to a Twilio number fetches our TwiML (`POST|GET /v1/telephony/twiml`), which answers
`<Connect><Stream url="wss://HOST/v1/telephony/twilio"><Parameter name="token" .../></Stream></Connect>`:
Twilio opens a bidirectional stream to us and passes the token back in `start.customParameters`
(it cannot set headers), so the WebSocket route takes no HTTP auth and the stream authenticates at
`start`. The token in the TwiML is a one-time ticket bound to the call, valid `ticket_ttl_s`: the
TwiML body (which Twilio logs) never holds the gateway's token. A stream may also carry the gateway
token itself (custom TwiML). The webhook takes a valid X-Twilio-Signature when
`telephony.twilio_auth_token` is set, or the gateway token (`?token=` / Bearer).

The protocol is `realtime.twilio_protocol.TwilioProtocol`; this module is its I/O shell.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
import time
from collections.abc import Callable
from http import HTTPStatus
from urllib.parse import parse_qsl, urlencode

from engine.service_api import AtCapacity
from realtime.auth import SERVER
from realtime.http import HttpReply, HttpRequest, HttpRoute, Scope, WsRoute
from realtime.transports.context import TransportContext
from realtime.transports.websocket import CLOSE_TRY_AGAIN, WebSocketLink
from realtime.web_socket import ServerWebSocket
from realtime.twilio_protocol import (
    FRAME_MS,
    StreamStart,
    StreamState,
    TwilioProtocol,
    render_twiml,
    signature_valid,
    stream_url,
)


log = logging.getLogger("duplex.twilio")

NAME = "twilio"
STREAM_PATH = "/v1/telephony/twilio"
TWIML_PATH = "/v1/telephony/twiml"
CLOSE_POLICY = 1008


def register(ctx: TransportContext) -> TwilioBridge:
    bridge = TwilioBridge(ctx)
    # Twilio's messages are under 1 KiB (`start` with its parameters a few): the server-wide limit
    # (megabytes, for audio appends) would let an unauthenticated socket make us parse megabytes.
    stream = WsRoute(bridge.stream, Scope.PUBLIC, max_message_bytes=ctx.config.telephony.max_message_bytes)
    ctx.routes.ws[STREAM_PATH] = stream
    if ctx.config.server.replica_id:  # the TwiML names this replica: the balancer routes the stream on it
        ctx.routes.ws[replica_stream_path(ctx.config.server.replica_id)] = stream
    ctx.routes.http[TWIML_PATH] = HttpRoute(bridge.twiml, methods=("POST", "GET"), scope=Scope.PUBLIC)
    return bridge


def replica_stream_path(replica_id: str | None) -> str:
    """Where a replica's TwiML sends the stream: behind a load balancer the path names the replica (Twilio
    Media Streams take no query string), so the stream reaches the replica holding the call's ticket."""
    return f"{STREAM_PATH}/{replica_id}" if replica_id else STREAM_PATH


_LOOPBACK = ("localhost", "127.0.0.1", "[::1]")


def host_allowed(host: str, allowed: list[str]) -> bool:
    """A Host header (name[:port]) that may name this server: loopback, or one of `allowed` (with or without its port)."""
    host = host.strip().lower()
    name = host.rsplit(":", 1)[0] if not host.endswith("]") else host
    allowed = [a.strip().lower() for a in allowed]
    return bool(host) and (name in _LOOPBACK or host in allowed or name in allowed)


class TicketBook:
    """One-time stream tokens handed out in TwiML, each bound to its call (when the webhook named one)."""

    def __init__(self, ttl_s: float, max_open: int = 10_000, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s, self.max_open, self.clock = ttl_s, max_open, clock
        self._open: dict[str, tuple[float, str | None]] = {}  # token -> (expiry, call sid)

    def issue(self, call_sid: str | None) -> str:
        now = self.clock()
        self._open = {t: v for t, v in self._open.items() if v[0] > now}
        while len(self._open) >= self.max_open:  # a flood of webhooks: the oldest tickets go first
            self._open.pop(next(iter(self._open)))
        token = secrets.token_urlsafe(18)
        self._open[token] = (now + self.ttl_s, call_sid)
        return token

    def redeem(self, token: str, call_sid: str) -> bool:
        entry = self._open.pop(token, None)
        return entry is not None and entry[0] > self.clock() and entry[1] in (None, call_sid)


class TwilioBridge:
    def __init__(self, ctx: TransportContext) -> None:
        self.ctx = ctx
        self.config = ctx.config
        self.tickets = TicketBook(ctx.config.telephony.ticket_ttl_s)

    # ---- TwiML webhook ----
    async def twiml(self, req: HttpRequest) -> HttpReply:
        form = parse_qsl((await req.read()).decode("utf-8", "replace"), keep_blank_values=True) if req.method == "POST" else []
        if not self._webhook_authorized(req, form):
            status = HTTPStatus.FORBIDDEN if self.config.telephony.twilio_auth_token else HTTPStatus.UNAUTHORIZED
            self.ctx.metrics.auth_failures.labels(TWIML_PATH).inc()
            self.ctx.metrics.sessions_refused.labels("unauthorized").inc()
            return HttpReply(status, "invalid X-Twilio-Signature or token\n")
        base = self._public_base(req)
        if base is None:
            log.warning("twiml webhook: Host %r is not ours: set telephony.public_url (or list it in telephony.allowed_hosts)",
                        req.headers.get("Host"))
            return HttpReply(HTTPStatus.MISDIRECTED_REQUEST, "this server does not know its public URL for this Host: "
                                                             "set telephony.public_url (or telephony.allowed_hosts)\n")
        if self.ctx.admission.draining or self.ctx.admission.closing:
            # no ticket: a stream opened here would be refused, and the call would fail mid-setup. A 503 makes
            # Twilio try the number's fallback URL (or the balancer, another replica) before the call starts.
            retry = self.config.limits.retry_after_s
            self.ctx.metrics.sessions_refused.labels("draining").inc()
            return HttpReply(HTTPStatus.SERVICE_UNAVAILABLE, "the server is draining (it takes no new calls; another replica does)\n",
                             headers={"Retry-After": str(max(1, round(retry)))})
        call_sid = dict(form).get("CallSid") or next(iter(req.query.get("CallSid", [])), None)
        params = {"token": self.tickets.issue(call_sid)} if self.ctx.auth.token else {}
        return HttpReply(HTTPStatus.OK, render_twiml(stream_url(base, replica_stream_path(self.config.server.replica_id)), params), "text/xml; charset=utf-8")

    def _public_base(self, req: HttpRequest) -> str | None:
        """Where Twilio must open the stream (and take its one-time ticket): the configured public URL.
        Without one, the request's Host only when it is loopback or listed in `telephony.allowed_hosts`:
        a Host header is the client's to choose, and the ticket would go wherever it names."""
        configured = self.config.telephony.public_url or self.config.server.public_url
        if configured:
            return configured
        host = req.headers.get("Host", "")
        return f"https://{host}" if host_allowed(host, self.config.telephony.allowed_hosts) else None

    def _webhook_authorized(self, req: HttpRequest, form: list[tuple[str, str]]) -> bool:
        auth, auth_token = self.ctx.auth, self.config.telephony.twilio_auth_token
        if not auth_token:
            return (cred := auth.identify(req.headers, req.query)) is not None and cred.allows(Scope.SERVER)
        signature = req.headers.get("X-Twilio-Signature")
        if signature and (base := self._public_base(req)) is not None:
            query = urlencode([(k, v) for k, vs in req.query.items() for v in vs])
            url = base.rstrip("/") + req.path + (f"?{query}" if query else "")
            if signature_valid(auth_token, url, form, signature):
                return True
            log.warning("twiml webhook: X-Twilio-Signature does not match %s", url)
        return bool(auth.token) and auth.identify(req.headers, req.query) is SERVER

    # ---- the media stream ----
    async def stream(self, ws: ServerWebSocket) -> None:
        admission, metrics, cfg = self.ctx.admission, self.ctx.metrics, self.config
        # a call's text goes to the log (telephony.transcripts): the caller's turns transcribed, the model's text if it writes any
        transcripts = cfg.telephony.transcripts and admission.engine.supports_text
        options = dataclasses.replace(cfg.session.engine_options(self.ctx.voices), transcribe_user=transcripts)
        proto = TwilioProtocol(admission.new_session(vad=cfg.telephony.vad, output_frame_ms=FRAME_MS, acked_playback=True),
                               end_call_digit=cfg.telephony.end_call_digit,
                               on_fault=lambda kind: metrics.telephony_faults.labels(kind).inc(),
                               options=options, log_text=cfg.telephony.transcripts)
        if (start := await self._await_start(ws, proto)) is None:
            return
        token = start.custom_parameters.get("token", "")
        if not self._stream_authorized(token, start.call_sid):
            log.warning("twilio stream %s (call %s): missing or invalid token: closed", start.stream_sid, start.call_sid)
            metrics.auth_failures.labels(STREAM_PATH).inc()
            metrics.sessions_refused.labels("unauthorized").inc()
            await ws.close(CLOSE_POLICY, "missing or invalid token")
            return
        try:
            runner = admission.open_session(NAME, WebSocketLink(ws), proto)
        except AtCapacity as e:
            log.warning("twilio stream %s (call %s): refused: %s", start.stream_sid, start.call_sid, e)
            await ws.close(CLOSE_TRY_AGAIN, f"server at capacity: retry in {e.retry_after_s:g} s")
            return
        await admission.run(runner)
        log.info("twilio stream %s: ended (%d frames in, %d out, %d marks echoed, %d clears, digits %r, faults %s)",
                 start.stream_sid, proto.stats.media_in, proto.stats.media_out, proto.stats.marks_echoed, proto.stats.clears,
                 "".join(proto.stats.digits), dict(proto.faults) or "none")

    async def _await_start(self, ws: ServerWebSocket, proto: TwilioProtocol) -> StreamStart | None:
        """Read until `start` (`connected` comes first): its fields; None when the stream ended or was closed instead."""
        timeout_s = self.config.telephony.start_timeout_s
        try:
            async with asyncio.timeout(timeout_s):
                async for message in ws:
                    proto.receive(message, self.ctx.admission.deps.clock.now())  # the session's clock
                    if proto.state is not StreamState.AWAITING_START:
                        break
        except TimeoutError:
            log.warning("twilio stream: no start within %.0f s: closed", timeout_s)
            await ws.close(CLOSE_POLICY, "no start message")
            return None
        if ws.closed and proto.state is StreamState.AWAITING_START:
            return None
        if proto.state is not StreamState.STREAMING or proto.start is None:
            code, reason = proto.closing or (1000, "")
            await ws.close(code, reason)
            return None
        return proto.start

    def _stream_authorized(self, token: str, call_sid: str) -> bool:
        auth = self.ctx.auth
        if not auth.token or auth.matches(token):
            return True
        return bool(token) and self.tickets.redeem(token, call_sid)
