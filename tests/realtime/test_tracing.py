"""`session.tracing` honoured as OpenTelemetry spans (realtime/tracing.py), over real WebSockets on
127.0.0.1 against a Gateway on the fake engine; the spans go to an in-memory exporter, or over real
OTLP/HTTP to a collector on 127.0.0.1 configured by the standard OTEL_* variables.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.server
import json
import threading

import pytest
from fake_engine import FakeEngine
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from rt_helpers import fake_gateway
from runner_rig import appends, speech16
from websockets.asyncio.client import connect

from realtime.tracing import RESPONSE_SPAN, SESSION_SPAN, exporter_names

TOKEN = "tracing-token"
FRAME_MS = 40  # the server's audio.output_frame_ms (its default)


class Wire:
    """A Realtime client on a raw WebSocket: every event kept, read up to the one a test waits for."""

    def __init__(self, ws) -> None:
        self.ws, self.events = ws, []

    async def send(self, **event) -> None:
        await self.ws.send(json.dumps(event))

    async def until(self, kind: str, pred=lambda e: True) -> dict:
        while True:
            ev = json.loads(await asyncio.wait_for(self.ws.recv(), 10))
            self.events.append(ev)
            if ev["type"] == kind and pred(ev):
                return ev

    async def update(self, **session) -> tuple[dict, list[dict]]:
        """session.update -> (session.updated's session, the errors it brought)."""
        before = len(self.events)
        await self.send(type="session.update", session=session)
        updated = await self.until("session.updated")
        return updated["session"], [e["error"] for e in self.events[before:] if e["type"] == "error"]

    async def turn(self) -> dict:
        """Half a second of speech, committed and answered: the response.done."""
        for ev in appends(speech16(0.5, seed=1)):
            await self.ws.send(json.dumps(ev))
        await self.send(type="input_audio_buffer.commit")
        await self.send(type="response.create")
        return (await self.until("response.done"))["response"]

    def errors(self) -> list[dict]:
        return [e["error"] for e in self.events if e["type"] == "error"]


@contextlib.asynccontextmanager
async def session(gw):
    async with connect(f"ws://127.0.0.1:{gw.port}/v1/realtime?token={TOKEN}") as ws:
        w = Wire(ws)
        await w.until("session.created")
        # the client ends its turns (no VAD): each test's turn is exactly one commit
        _, errs = await w.update(audio={"input": {"turn_detection": None}})
        assert errs == []
        yield w
    while gw.sessions:  # the server saw the close: the session (and its span) ended
        await asyncio.sleep(0.01)


def recorded(engine: FakeEngine, body, config: dict | None = None):
    """Run `body(gateway)` against a gateway whose spans go to memory; the spans, once the gateway stopped."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))

    async def main():
        async with fake_gateway(engine, config, TOKEN, tracer_provider=provider) as gw:
            result = await body(gw)
        return result

    result = asyncio.run(asyncio.wait_for(main(), 60))
    return result, exporter.get_finished_spans()


def named(spans, name: str) -> list:
    return [s for s in spans if s.name == name]


def test_auto_tracing_is_echoed_and_gives_a_session_span_with_a_child_span_per_response():
    async def body(gw):
        async with session(gw) as w:
            updated, errs = await w.update(tracing="auto", duplex={})  # duplex: response.done's figures, to compare
            assert errs == [] and updated["tracing"] == "auto"
            done = await w.turn()
            deltas = [e for e in w.events if e["type"] == "response.output_audio.delta"]
        return updated, done, deltas, w.errors()

    (updated, done, deltas, errors), spans = recorded(FakeEngine(capacity=1, answer_ms=1000, step_s=0.002), body)
    assert errors == []
    [sess], [resp] = named(spans, SESSION_SPAN), named(spans, RESPONSE_SPAN)
    assert resp.parent is not None and resp.parent.span_id == sess.context.span_id
    assert resp.context.trace_id == sess.context.trace_id and sess.parent is None
    assert resp.end_time is not None and sess.end_time is not None and sess.start_time <= resp.start_time
    a = resp.attributes
    assert a["duplex.response.id"] == done["id"] and a["duplex.response.status"] == "completed"
    assert a["duplex.response.output_modality"] == "audio" and "duplex.response.reason" not in a
    # the figures response.done reports (rounded alike), and the frames the client got
    assert a["duplex.response.ttfa_ms"] == done["duplex"]["ttfa_ms"] > 0
    assert a["duplex.response.audio_sent_ms"] == done["duplex"]["audio_ms"] == 1000.0
    assert a["duplex.response.played_ms"] == done["duplex"]["played_ms"]
    assert a["duplex.response.frames_sent"] == 1000 // FRAME_MS
    assert sum(len(d["delta"]) * 3 // 4 for d in deltas) == 48 * 1000  # 1000 ms of pcm16 at 24 kHz reached the client
    s = sess.attributes
    assert s["session.id"] == updated["id"] and s["duplex.transport"] == "websocket" and s["duplex.model"] == updated["model"]
    assert s["duplex.turns"] == 1 and s["duplex.end_reason"] == "client_closed"
    assert not any(k.startswith("duplex.tracing.") for k in (*s, *a))  # "auto": no workflow of the client's


def test_a_cancelled_response_span_carries_its_reason():
    async def body(gw):
        async with session(gw) as w:
            _, errs = await w.update(tracing="auto")
            assert errs == []
            for ev in appends(speech16(0.5, seed=2)):
                await w.ws.send(json.dumps(ev))
            await w.send(type="input_audio_buffer.commit")
            await w.send(type="response.create")
            await w.until("response.output_audio.delta")
            await w.send(type="response.cancel")
            return (await w.until("response.done"))["response"]

    done, spans = recorded(FakeEngine(capacity=1, answer_ms=20_000, step_s=0.01), body)
    assert done["status"] == "cancelled"
    [resp] = named(spans, RESPONSE_SPAN)
    a = resp.attributes
    assert a["duplex.response.status"] == "cancelled" and a["duplex.response.reason"] == "client_cancelled"
    assert 0 < a["duplex.response.frames_sent"] < 20_000 // FRAME_MS and a["duplex.response.audio_sent_ms"] < 20_000
    assert resp.end_time is not None


def test_the_tracing_objects_workflow_group_and_metadata_are_on_every_span():
    tracing = {"workflow_name": "support line", "group_id": "caller-42",
               "metadata": {"site": "test", "tier": 2, "tags": ["a", "b"], "big": 2**64}}

    async def body(gw):
        async with session(gw) as w:
            updated, errs = await w.update(tracing=tracing)
            assert errs == [] and updated["tracing"] == tracing
            await w.turn()
            await w.turn()

    _, spans = recorded(FakeEngine(capacity=1, answer_ms=200, step_s=0.002), body)
    [sess], responses = named(spans, SESSION_SPAN), named(spans, RESPONSE_SPAN)
    assert len(responses) == 2 and sess.attributes["duplex.turns"] == 2
    for span in (sess, *responses):
        a = span.attributes
        assert a["duplex.tracing.workflow_name"] == "support line" and a["duplex.tracing.group_id"] == "caller-42"
        assert a["duplex.tracing.metadata.site"] == "test" and a["duplex.tracing.metadata.tier"] == 2
        assert a["duplex.tracing.metadata.tags"] == '["a","b"]'  # not a primitive: as JSON
        assert a["duplex.tracing.metadata.big"] == str(2**64)  # beyond OTLP's int64


@pytest.mark.parametrize("tracing", [None, "absent"])
def test_no_tracing_no_spans(tracing):
    async def body(gw):
        async with session(gw) as w:
            updated, errs = await w.update(**({} if tracing == "absent" else {"tracing": tracing}))
            assert errs == [] and updated["tracing"] is None
            return (await w.turn())["status"]

    status, spans = recorded(FakeEngine(capacity=1, answer_ms=200, step_s=0.002), body)
    assert status == "completed" and spans == ()


def test_bad_tracing_values_are_refused_by_name_and_the_session_goes_on():
    async def body(gw):
        async with session(gw) as w:
            seen = []
            for value in ({"workflow_name": 5}, "yes", 7, {"workflow_name": "w", "colour": "red"}, {"metadata": "m"}):
                updated, errs = await w.update(tracing=value, instructions="still applied")
                seen.append(([(e["code"], e["param"]) for e in errs], updated["tracing"], updated["instructions"]))
            # on: the same configuration again, or "auto" (the Agents SDKs send it), changes nothing
            on = {"workflow_name": "w", "group_id": None, "metadata": None}
            for value in ({"workflow_name": "w"}, {"workflow_name": "w"}, "auto"):
                updated, errs = await w.update(tracing=value)
                assert errs == [] and updated["tracing"] == on
            # a change once on is refused, as OpenAI's server does; the trace goes on unchanged
            for value in ({"workflow_name": "other"}, None):
                updated, errs = await w.update(tracing=value)
                assert [(e["code"], e["param"]) for e in errs] == [("invalid_value", "session.tracing")]
                assert "cannot be modified" in errs[0]["message"] and updated["tracing"] == on
            status = (await w.turn())["status"]
        return seen, status

    (seen, status), spans = recorded(FakeEngine(capacity=1, answer_ms=200, step_s=0.002), body)
    assert seen == [
        ([("invalid_type", "session.tracing.workflow_name")], None, "still applied"),
        ([("invalid_value", "session.tracing")], None, "still applied"),
        ([("invalid_type", "session.tracing")], None, "still applied"),
        ([("unknown_parameter", "session.tracing.colour")], None, "still applied"),
        ([("invalid_type", "session.tracing.metadata")], None, "still applied"),
    ]
    assert status == "completed"
    [sess], [resp] = named(spans, SESSION_SPAN), named(spans, RESPONSE_SPAN)
    assert sess.attributes["duplex.tracing.workflow_name"] == resp.attributes["duplex.tracing.workflow_name"] == "w"


def _without_otel_env(monkeypatch) -> None:
    import os

    for key in list(os.environ):
        if key.startswith("OTEL_"):
            monkeypatch.delenv(key)


def test_with_no_otel_settings_the_server_configures_no_exporter_and_tracing_still_answers(monkeypatch):
    _without_otel_env(monkeypatch)

    async def main():
        async with fake_gateway(FakeEngine(capacity=1, answer_ms=200, step_s=0.002), token=TOKEN) as gw:
            assert gw.tracer_provider is None and gw.admission.deps.tracer is None
            async with session(gw) as w:
                updated, errs = await w.update(tracing="auto")
                assert errs == [] and updated["tracing"] == "auto"
                assert (await w.turn())["status"] == "completed"
                runner = next(iter(gw.sessions.values()))
                assert runner._trace is None  # nothing recorded: no exporter to send it to
                assert w.errors() == []

    asyncio.run(asyncio.wait_for(main(), 30))


@pytest.mark.parametrize("env,names", [
    ({}, []),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}, ["otlp"]),
    ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:4318/v1/traces"}, ["otlp"]),
    ({"OTEL_TRACES_EXPORTER": "otlp"}, ["otlp"]),
    ({"OTEL_TRACES_EXPORTER": "console,otlp"}, ["console", "otlp"]),
    ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}, []),
    ({"OTEL_SDK_DISABLED": "true", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}, []),
])
def test_exporters_come_from_the_standard_variables(env, names):
    assert exporter_names(env) == names


@pytest.mark.parametrize("env,named_var", [
    ({"OTEL_TRACES_EXPORTER": "zipkin"}, "OTEL_TRACES_EXPORTER"),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}, "OTEL_EXPORTER_OTLP_PROTOCOL"),
])
def test_an_exporter_the_server_cannot_honour_stops_serve_before_the_engine_starts(env, named_var, monkeypatch, capsys):
    from realtime.cli.main import main

    _without_otel_env(monkeypatch)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert main(["serve", "--port", "0"]) == 2
    assert named_var in capsys.readouterr().err


class _Collector(http.server.BaseHTTPRequestHandler):
    received: list[tuple[str, bytes]] = []

    def do_POST(self):  # noqa: N802 (http.server's name)
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.received.append((self.path, body))
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


def test_spans_reach_an_otlp_collector_named_by_otel_exporter_otlp_endpoint(monkeypatch):
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    _Collector.received = []
    collector = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Collector)
    threading.Thread(target=collector.serve_forever, daemon=True).start()
    _without_otel_env(monkeypatch)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{collector.server_address[1]}")

    async def main():
        async with fake_gateway(FakeEngine(capacity=1, answer_ms=200, step_s=0.002), token=TOKEN) as gw:
            async with session(gw) as w:
                _, errs = await w.update(tracing={"workflow_name": "exported", "metadata": {"big": 2**64, "n": 3}})
                assert errs == []
                await w.turn()
        # stop() flushed the batch to the collector

    try:
        asyncio.run(asyncio.wait_for(main(), 30))
    finally:
        collector.shutdown()
    assert _Collector.received and {path for path, _ in _Collector.received} == {"/v1/traces"}
    spans, services = [], set()
    for _, body in _Collector.received:
        req = ExportTraceServiceRequest.FromString(body)
        for rs in req.resource_spans:
            services |= {a.value.string_value for a in rs.resource.attributes if a.key == "service.name"}
            spans += [s for ss in rs.scope_spans for s in ss.spans]
    assert services == {"duplex"} and sorted(s.name for s in spans) == [RESPONSE_SPAN, SESSION_SPAN]
    for s in spans:
        attrs = {a.key: a.value for a in s.attributes}
        assert attrs["duplex.tracing.workflow_name"].string_value == "exported"
        assert attrs["duplex.tracing.metadata.big"].string_value == str(2**64) and attrs["duplex.tracing.metadata.n"].int_value == 3
