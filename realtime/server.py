"""The gateway: the engine, the sessions, the metrics and the transports' routes, served on one port by
the web shell (realtime/web_shell.py, on aiohttp; docs/architecture.md).

    GET  /healthz               readiness: 200 when a new session would be admitted (no auth)
    GET  /livez                 liveness: 200 while the server serves, draining or full included (no auth)
    GET  /metrics               Prometheus text (the server token)
    GET  /, /web/...            the demo page, static files from web/ (no auth: they hold no secrets)
    WS   /v1/realtime           OpenAI-Realtime-style events (token or ek_ key; realtime/transports/websocket.py)
    POST /v1/realtime/calls     WebRTC SDP offer -> answer (token or ek_ key; realtime/transports/webrtc.py)
    POST /v1/realtime/calls/{id}/hangup   end a WebRTC call (token)
    POST /v1/realtime/client_secrets      mint an ephemeral ek_ key (token; realtime/transports/client_secrets_api.py)
    WS   /v1/telephony/twilio   Twilio Media Streams (token in `start`; realtime/transports/twilio.py)
    POST /v1/telephony/twiml    TwiML for a call (realtime/transports/twilio.py)
    POST /v1/audio/transcriptions, /v1/audio/speech   OpenAI's one-shot audio API (token; realtime/transports/audio_api.py)

The transports are the explicit list `TRANSPORTS`: each `register(ctx)` adds its routes, bound to
what it needs from `TransportContext`, and they share one admission path (realtime/admission.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from collections.abc import Awaitable, Callable
from http import HTTPStatus
from typing import TYPE_CHECKING

from engine.service_api import Conversation, EngineLike
from realtime.admission import Admission
from realtime.config import ServerConfig
from realtime.auth import Auth
from realtime.client_secrets import ClientSecrets
from realtime.http import HttpReply, Routes
from realtime.metrics import CONTENT_TYPE, GatewayMetrics
from realtime.tracing import TRACER_NAME, provider_from_env
from realtime.tls import server_context
from realtime.transports import audio_api, client_secrets_api, twilio, webrtc, websocket
from realtime.transports.context import TransportContext
from realtime.vad_batch import VadBatcher
from realtime.voices import load_voices
from realtime.web_shell import WebShell

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider

    from realtime.runner import SessionRunner

log = logging.getLogger("duplex.gateway")

TRANSPORTS = (websocket, webrtc, twilio, audio_api, client_secrets_api)  # a new transport is one new module here


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
        token = token if token is not None else config.server.token
        self.auth = Auth(token, ClientSecrets.for_server(config.server, token))
        self.metrics = GatewayMetrics()
        self.voices = load_voices(config.session.voices) if voices is None else voices  # name -> 16 kHz PCM
        self.vad = VadBatcher(config.audio.vad_batch_ms) if config.audio.vad_batch_ms > 0 else None
        self._own_tracer_provider = tracer_provider is None
        self.tracer_provider = provider_from_env() if tracer_provider is None else tracer_provider
        tracer = None if self.tracer_provider is None else self.tracer_provider.get_tracer(TRACER_NAME)
        self.admission = Admission(engine, config, self.metrics, self.vad, tracer)
        self.routes = Routes()
        self._cleanup: list[Callable[[], Awaitable[None]]] = []  # transports' resources, closed at stop()
        ctx = TransportContext(config, self.admission, self.metrics, self.auth, self.voices, self.routes, self._cleanup.append)
        self.transports = {t.NAME: t.register(ctx) for t in TRANSPORTS}  # name -> the transport's state (tests read it)
        self.shell = WebShell(config, self.routes, self.auth, self.metrics, {"/healthz": self._health, "/livez": self._live},
                              lambda: HttpReply(HTTPStatus.OK, self.metrics.render(self.engine), CONTENT_TYPE))
        self.port: int | None = None

    @property
    def token(self) -> str | None:
        return self.auth.token

    @property
    def sessions(self) -> dict[str, SessionRunner]:
        return self.admission.sessions

    async def start(self) -> None:
        """Listen (TLS when configured: ValueError naming the file at fault)."""
        await self.shell.start(server_context(self.config.server))
        self.port = self.shell.port

    def conversation(self, session_id: str) -> Conversation:
        """The engine conversation behind a session (tests read its history)."""
        return self.sessions[session_id].conv

    async def stop(self) -> None:
        """Tell every session the server is going away, close them, stop listening."""
        await self.admission.stop()
        await self.shell.stop_exchanges()
        for close in self._cleanup:
            await close()
        await self.shell.stop()
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
