"""OpenTelemetry spans of the sessions whose client turned `tracing` on (docs/protocol.md, "Tracing").

    provider = provider_from_env()                  # None: no exporter configured, nothing is recorded
    trace = SessionTrace(provider.get_tracer(...), config, session_id, transport, started_ns)
    trace.observe(session_events, ("audio",))       # response spans start and end with the responses
    trace.end(end_reason, stats, model, resumes)

One span per session (`realtime.session`) and one per response (`realtime.response`, its child), with
the figures the session already keeps (time to first audio, frames and milliseconds sent, played,
why it was cancelled): no span per frame, and nothing at all for a session with `tracing: null` or a
server with no exporter configured. Export is the OpenTelemetry SDK's: batched on its own thread,
configured by the standard `OTEL_*` environment variables, so the event loop never waits for it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING

from opentelemetry import trace
from opentelemetry.trace import Span, StatusCode, Tracer
from opentelemetry.util.types import AttributeValue

from realtime.session import ResponseAudio, ResponseCreated, ResponseDone, ResponseStatus, SessionStats
from realtime.tracing_config import TracingConfig

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider

SESSION_SPAN = "realtime.session"
RESPONSE_SPAN = "realtime.response"
TRACER_NAME = "duplex.realtime"
EXPORTERS = ("otlp", "console")  # OTEL_TRACES_EXPORTER's values this server ships; "none" turns export off


def exporter_names(env: Mapping[str, str] = os.environ) -> list[str]:
    """The span exporters the standard variables ask for; [] when none is configured. Unlike the SDK's
    own default ("otlp" to localhost), a server started with no OTEL_* setting sends nothing. Raises
    ValueError for a value this server cannot honour (an exporter or OTLP protocol it does not ship)."""
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return []
    names = [n.strip().lower() for n in env.get("OTEL_TRACES_EXPORTER", "").split(",") if n.strip()]
    if not names and (env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")):
        names = ["otlp"]
    names = [n for n in names if n != "none"]
    for name in names:
        if name not in EXPORTERS:
            raise ValueError(f"OTEL_TRACES_EXPORTER={env['OTEL_TRACES_EXPORTER']!r}: unknown exporter {name!r} "
                             f"(this server exports to {', '.join(EXPORTERS)} or none)")
    protocol = env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "http/protobuf"
    if "otlp" in names and protocol != "http/protobuf":
        raise ValueError(f"OTEL_EXPORTER_OTLP_PROTOCOL={protocol!r}: this server exports OTLP over http/protobuf only")
    return names


def provider_from_env(env: Mapping[str, str] = os.environ) -> TracerProvider | None:
    """A TracerProvider exporting as the OTEL_* variables say (the OTLP exporter reads its endpoint,
    headers, timeout and compression from them itself), or None when no exporter is configured: the
    SDK is then not even imported."""
    names = exporter_names(env)
    if not names:
        return None
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter

    # OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES are read by Resource.create; ours is only the default name
    provider = TracerProvider(resource=Resource.create({} if env.get("OTEL_SERVICE_NAME") else {"service.name": "duplex"}))
    for name in names:
        exporter: SpanExporter
        if name == "otlp":
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            exporter = OTLPSpanExporter()
        else:
            exporter = ConsoleSpanExporter()
        provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider


def config_attributes(config: TracingConfig) -> dict[str, AttributeValue]:
    """The client's workflow_name, group_id and metadata as span attributes (metadata values that are
    not a string, number or boolean as JSON; so is an integer beyond OTLP's int64, which would fail
    the export of the whole batch)."""
    attrs: dict[str, AttributeValue] = {}
    if config.workflow_name is not None:
        attrs["duplex.tracing.workflow_name"] = config.workflow_name
    if config.group_id is not None:
        attrs["duplex.tracing.group_id"] = config.group_id
    for key, value in (config.metadata or {}).items():
        name = f"duplex.tracing.metadata.{key}"
        if isinstance(value, (str, bool, float)) or (isinstance(value, int) and -(2**63) <= value < 2**63):
            attrs[name] = value
        else:
            attrs[name] = json.dumps(value, separators=(",", ":"))
    return attrs


class SessionTrace:
    """The spans of one traced session; fed the session's events by its runner, in the loop."""

    def __init__(self, tracer: Tracer, config: TracingConfig, session_id: str, transport: str, started_ns: int) -> None:
        """`started_ns`: the session's start (time.time_ns()); tracing may be turned on later, the
        session span still covers the whole session."""
        self._tracer = tracer
        self._common = config_attributes(config)
        self._span = tracer.start_span(SESSION_SPAN, kind=trace.SpanKind.SERVER, start_time=started_ns, attributes={
            "session.id": session_id, "duplex.transport": transport, **self._common})
        self._context = trace.set_span_in_context(self._span)
        self._responses: dict[str, tuple[Span, int]] = {}  # open response spans: id -> (span, frames sent)
        self.turns = 0  # responses ended

    def observe(self, events: list, session_modalities: tuple[str, ...]) -> None:
        """The session's events as the protocol gets them (`session_modalities`: a response's output
        modalities when response.create did not choose its own)."""
        for ev in events:
            if isinstance(ev, ResponseAudio):
                if (open_ := self._responses.get(ev.response_id)) is not None:
                    self._responses[ev.response_id] = (open_[0], open_[1] + 1)
            elif isinstance(ev, ResponseCreated):
                modality = (ev.output_modalities or session_modalities)[0]
                span = self._tracer.start_span(RESPONSE_SPAN, context=self._context, attributes={
                    "duplex.response.id": ev.response_id, "duplex.response.epoch": ev.epoch,
                    "duplex.response.output_modality": modality, **self._common})
                self._responses[ev.response_id] = (span, 0)
            elif isinstance(ev, ResponseDone):
                self._response_done(ev)

    def _response_done(self, ev: ResponseDone) -> None:
        span, frames = self._responses.pop(ev.response_id, (None, 0))
        if span is None:
            return
        self.turns += 1
        status = ev.status.name.lower()
        attrs: dict[str, AttributeValue] = {"duplex.response.status": status, "duplex.response.frames_sent": frames,
                 "duplex.response.audio_sent_ms": round(ev.audio_ms, 1), "duplex.response.played_ms": round(ev.played_ms, 1)}
        if ev.reason is not None:
            attrs["duplex.response.reason"] = ev.reason
        if ev.ttfa_ms is not None:
            attrs["duplex.response.ttfa_ms"] = round(ev.ttfa_ms, 1)
        if ev.after_confirm_ms is not None:
            attrs["duplex.response.after_confirm_ms"] = round(ev.after_confirm_ms, 1)
        span.set_attributes(attrs)
        if ev.status is ResponseStatus.FAILED:
            span.set_status(StatusCode.ERROR, ev.reason or status)
        span.end()

    def end(self, end_reason: str, stats: SessionStats, model: str, resumes: int) -> None:
        """The session ended: a response still open ends with it (status `incomplete`)."""
        for span, frames in self._responses.values():
            span.set_attributes({"duplex.response.status": "incomplete", "duplex.response.reason": "session_ended",
                                 "duplex.response.frames_sent": frames})
            span.end()
        self._responses.clear()
        self._span.set_attributes({"duplex.model": model, "duplex.turns": self.turns, "duplex.barge_ins": stats.barge_ins,
                                   "duplex.end_reason": end_reason, "duplex.resumes": resumes})
        self._span.end()
