"""Hostile and broken clients (issue 23): every bad input gets an error and the session goes on; auth
never answers 500; a client cannot make its session do unbounded work; a vanished client holds no slot.

Fast: the fake engine (tests/realtime/fake_engine.py). Where the behaviour is the socket's (HTTP auth,
TwiML, WebSocket closes, message size limits), a real Gateway listens on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import contextlib
import json

import numpy as np
import pytest
from fake_engine import FakeEngine
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from runner_rig import MemoryLink, Rig, appends, run, until
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from realtime import client_json
from realtime.config import config_from_dict
from realtime.input_budget import InputBudget, InputLimits
from realtime.messages import CloseReason
from realtime.protocol import RealtimeProtocol, SessionSettings
from realtime.resume import ResumeRefused
from realtime.server import Gateway
from realtime.session import Session, SessionLimits, SessionError
from realtime.session_input import apply_inputs
from realtime.twilio_protocol import TwilioProtocol
from realtime.vad import SileroVad, VadParams
from realtime.vad_batch import MAX_ROUNDS_PER_TICK, VadBatcher

TOKEN = "s3cret"


# ---- the sans-I/O protocols: the attack list ------------------------------------------------------------


class Client:
    """A RealtimeProtocol over a real Session: what a message did, as events."""

    def __init__(self, vad: VadParams | None = None) -> None:
        self.session = Session("sess_test", vad, SessionLimits())
        self.proto = RealtimeProtocol(self.session, settings=SessionSettings())
        self.proto.open()
        self.proto.data_to_send()
        self.now = 100.0

    def send(self, message: str | bytes) -> list[dict]:
        self.proto.receive(message, self.now)
        apply_inputs(self.proto, self.session, self.now)
        self.proto.send_session_events(self.session.events())
        return [json.loads(m) for m in self.proto.data_to_send() if isinstance(m, str)]

    def errors(self, message: str | bytes) -> list[dict]:
        return [e["error"] for e in self.send(message) if e["type"] == "error"]


ATTACKS = [
    ("array nested 100000 deep", "[" * 100_000 + "]" * 100_000, "invalid_json"),
    ("object nested 50000 deep in session.update",
     '{"type":"session.update","session":' + '{"a":' * 50_000 + "1" + "}" * 50_000 + "}", "invalid_json"),
    ("integer of 5000 digits", '{"type":"output_audio_buffer.played","played_ms":' + "9" * 5000 + "}", "invalid_json"),
    ("truncate at NaN", '{"type":"conversation.item.truncate","item_id":"item_x","content_index":0,"audio_end_ms":NaN}',
     "invalid_json"),
    ("played with underruns 10**400",
     '{"type":"output_audio_buffer.played","played_ms":10,"underruns":1' + "0" * 400 + "}", "invalid_json"),
    ("a float of 1e400", '{"type":"output_audio_buffer.played","played_ms":1e400}', "invalid_json"),
    ("negative played_ms", '{"type":"output_audio_buffer.played","played_ms":-5}', "invalid_value"),
    ("underruns beyond any count", '{"type":"output_audio_buffer.played","played_ms":5,"underruns":12345678901}',
     "invalid_value"),
    ("type null", '{"type":null}', "invalid_type"),
    ("append with audio null", '{"type":"input_audio_buffer.append","audio":null}', "invalid_type"),
    ("not JSON", "{'type': 1", "invalid_json"),
    ("undecodable bytes as text", b"\xff\xfe{}".decode("latin-1"), "invalid_json"),
    # valid JSON, not valid Unicode: each closed the session with no error event once it was echoed or tokenized
    ("instructions with a lone surrogate", '{"type":"session.update","session":{"instructions":"hi \\ud800"}}', "invalid_json"),
    ("a system item with a lone surrogate", '{"type":"conversation.item.create","item":{"type":"message","role":"system",'
     '"content":[{"type":"input_text","text":"\\udfff be brief"}]}}', "invalid_json"),
    ("a user text item with a lone surrogate", '{"type":"conversation.item.create","item":{"type":"message","role":"user",'
     '"content":[{"type":"input_text","text":"hello \\ud83d"}]}}', "invalid_json"),
    ("binary: an empty Opus packet", b"\x01", "invalid_audio"),
    ("binary: an unknown frame type", b"\x07abc", "invalid_binary_frame"),
    ("binary: nothing", b"", "invalid_binary_frame"),
    ("temperature 5", '{"type":"session.update","session":{"temperature":5}}', "invalid_value"),
    ("seed 2**64", '{"type":"session.update","session":{"duplex":{"seed":18446744073709551616}}}', "invalid_value"),
    ("top_k 2**40", '{"type":"session.update","session":{"duplex":{"top_k":1099511627776}}}', "invalid_value"),
    ("negative seed", '{"type":"session.update","session":{"duplex":{"seed":-1}}}', "invalid_value"),
]


def _applies_update(message) -> bool:
    """A well-formed session.update (with bad fields): answered by the errors, then session.updated."""
    try:
        ev = json.loads(message)
        json.dumps(ev, ensure_ascii=False).encode()  # a lone surrogate: not valid Unicode, refused whole
    except (ValueError, TypeError, RecursionError):
        return False
    return isinstance(ev, dict) and ev.get("type") == "session.update" and isinstance(ev.get("session"), dict)


@pytest.mark.parametrize("message,code", [(m, c) for _, m, c in ATTACKS], ids=[n for n, _, _ in ATTACKS])
def test_each_attack_gets_exactly_one_error_and_the_session_goes_on(message, code):
    c = Client()
    events = c.send(message)
    # a session.update applies what it can: its refused field gets the error, then session.updated
    assert [e["type"] for e in events] == ["error", "session.updated"] if _applies_update(message) else ["error"]
    assert events[0]["error"]["code"] == code, events[0]
    # the session is intact: a valid update is taken, and another bad message is answered again
    assert [e["type"] for e in c.send('{"type":"session.update","session":{"instructions":"hi"}}')] == ["session.updated"]
    assert len(c.errors(message)) == 1


def test_rejected_settings_name_their_param_and_keep_the_old_ones():
    c = Client()
    err = c.errors('{"type":"session.update","session":{"temperature":2.5,"instructions":"kept"}}')
    assert len(err) == 1 and err[0]["param"] == "session.temperature" and "[0, 2]" in err[0]["message"]
    # the refused field keeps its old value; the valid one sent with it applies (as OpenAI does)
    assert c.proto.settings.temperature == SessionSettings().temperature and c.proto.settings.instructions == "kept"
    assert c.errors('{"type":"session.update","session":{"duplex":{"seed":9223372036854775808}}}')[0]["param"] == "session.duplex.seed"
    # the largest values the engine takes are accepted (tests/engine/test_service.py runs a response with them)
    ok = c.send('{"type":"session.update","session":{"temperature":2,"duplex":{"seed":9223372036854775807,"top_k":1000000}}}')
    assert [e["type"] for e in ok] == ["session.updated"]
    assert (c.proto.settings.seed, c.proto.settings.top_k, c.proto.settings.temperature) == (2**63 - 1, 1_000_000, 2.0)


def test_the_server_config_refuses_what_session_update_refuses():
    for key, value in (("temperature", 3.0), ("seed", 2**64), ("top_k", -1), ("top_p", 0.0), ("max_response_ms", 0.0)):
        with pytest.raises(ValueError, match=f"session.{key}"):
            config_from_dict({"session": {key: value}})
    with pytest.raises(ValueError, match="limits.input.audio_rate"):
        config_from_dict({"limits": {"input": {"audio_rate": 0}}})


def test_client_json_bounds_depth_numbers_and_never_raises_anything_else():
    assert client_json.loads('{"a":[1,2.5,{"b":null}]}') == {"a": [1, 2.5, {"b": None}]}
    assert client_json.loads("[" * 32 + "]" * 32) is not None  # MAX_DEPTH levels are fine
    for text in ("[" * 33 + "]" * 33, "1" * 21, "-Infinity", "NaN", "1e999", b"\xff", "", "[1,"):
        with pytest.raises(client_json.BadJson):
            client_json.loads(text)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4),
    max_leaves=20,
)
EVENT_TYPES = sorted(RealtimeProtocol._HANDLERS) + ["response.create", "nonsense", ""]


@st.composite
def client_events(draw):
    """Events of the real types with generated fields (the likely way to reach a handler's corner)."""
    ev = draw(st.dictionaries(st.sampled_from(["type", "event_id", "audio", "session", "item_id", "audio_end_ms",
                                               "played_ms", "underruns", "response_id", "content_index", "response"]),
                              json_values, max_size=6))
    ev["type"] = draw(st.sampled_from(EVENT_TYPES) | json_values)
    return json.dumps(ev, allow_nan=True)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(client_events() | json_values.map(lambda v: json.dumps(v, allow_nan=True)) | st.binary(max_size=64), max_size=8))
def test_generated_messages_never_break_a_realtime_session(messages):
    c = Client(VadParams())
    for m in messages:
        events = c.send(m)  # raises nothing
        assert sum(e["type"] == "error" for e in events) <= 1
        for e in events:
            if e["type"] == "error":
                assert e["error"]["code"] and e["error"]["message"]
    assert [e["type"] for e in c.send('{"type":"input_audio_buffer.clear"}')] == ["input_audio_buffer.cleared"]


@settings(max_examples=200, deadline=None)
@given(st.lists(json_values.map(lambda v: json.dumps(v, allow_nan=True)) | st.binary(max_size=32) | st.builds(
    lambda d: json.dumps({"event": "media", "media": d}, allow_nan=True), json_values), max_size=8))
def test_generated_messages_never_break_a_twilio_stream(messages):
    faults: list[str] = []
    proto = TwilioProtocol(Session("sess_tw", None, SessionLimits()), on_fault=faults.append)
    for m in messages:
        before = len(faults)
        proto.receive(m, 0.0)  # raises nothing
        assert len(faults) - before <= 1


# ---- the input budget ------------------------------------------------------------------------------------


def test_input_budget_takes_a_burst_then_real_time_twice_over_and_reports_once_a_second():
    lim = InputLimits(audio_rate=2.0, audio_burst_s=1.0, overrun_close_s=2.0)
    b = InputBudget(lim, now=0.0)
    assert all(b.audio(0.1, 0.0) is None for _ in range(10))  # the burst: 1 s at once
    r = b.audio(0.1, 0.0)
    assert r is not None and r.report and r.since_report == 1
    assert b.audio(0.1, 0.5) is None  # 0.5 s later: 1 s of audio refilled ...
    reports = [b.audio(0.1, 0.5) for _ in range(12)]
    assert sum(r is None for r in reports) == 9 and not any(r.report for r in reports if r)  # ... then refused, unreported
    late = b.audio(2.0, 1.01)  # more than the burst: never fits
    assert late is not None and late.report and late.since_report == 4  # 3 unreported + this one
    assert not b.exhausted(1.01)
    t = 1.01
    while t < 2.1:  # over budget without a pause
        b.audio(5.0, t)
        t += 0.1
    assert b.exhausted(t)
    fresh = InputBudget(lim, now=0.0)
    fresh.audio(5.0, 0.0)
    assert not fresh.exhausted(1.5) and fresh.audio(0.5, 1.5) is None  # a pause ends an overrun


def test_audio_faster_than_real_time_is_refused_then_the_session_is_closed():
    async def main():
        rig = Rig(FakeEngine(), {"limits": {"input": {"audio_rate": 1.0, "audio_burst_s": 1.0, "overrun_close_s": 0.6}}})
        link = MemoryLink()
        runner = rig.open(link)
        pcm = np.zeros(16_000 * 3, np.int16)  # 3 s of audio sent at once, again and again
        t0 = asyncio.get_running_loop().time()
        for _ in range(6):
            link.feed(*appends(pcm))
            await asyncio.sleep(0.15)
        await rig.ended(runner, timeout=5)
        elapsed = asyncio.get_running_loop().time() - t0
        assert runner.end_reason() is CloseReason.POLICY
        errors = [e["error"] for e in link.of("error")]
        codes = [e["code"] for e in errors]
        assert set(codes) == {"input_rate_exceeded"} and 2 <= len(codes) <= 3  # the first, once a second, the close
        assert "1x real time" in errors[0]["message"]
        assert link.closes[-1][0] == 1008
        # what came within the budget (1 s at once, then real time) was taken; the rest was dropped
        # and counted, never queued
        assert 950 <= runner.session.input_ms <= 1000 * (1 + elapsed) + 40, (runner.session.input_ms, elapsed)
        assert rig.metric("duplex_input_rejected_total", kind="audio") > 100
        assert rig.metric("duplex_input_frames_dropped_total", transport="websocket", reason="input_rate") > 100

    run(main)


def test_a_message_flood_is_held_back_unread_then_closed():
    async def main():
        rig = Rig(FakeEngine(), {"limits": {"input": {"messages_per_s": 50, "message_burst": 50, "overrun_close_s": 0.5}}})
        link = MemoryLink()
        runner = rig.open(link)
        junk = "{" * 10  # would be an invalid_json error each, if it were parsed
        t0 = asyncio.get_running_loop().time()
        while not rig.tasks[runner.id].done() and asyncio.get_running_loop().time() - t0 < 3:
            link.feed(*[junk] * 20)
            await asyncio.sleep(0.01)
        await rig.ended(runner)
        elapsed = asyncio.get_running_loop().time() - t0
        codes = [e["error"]["code"] for e in link.of("error")]
        # the burst and the refill were read (and answered); the rest was never read at all
        assert 50 <= codes.count("invalid_json") <= 50 + 50 * elapsed
        assert link._in.qsize() > 500
        assert codes.count("input_rate_exceeded") >= 1 and codes[-1] == "input_rate_exceeded"
        assert runner.end_reason() is CloseReason.POLICY and link.closes[-1][0] == 1008
        assert rig.metric("duplex_input_rejected_total", kind="messages") >= 1

    run(main)


def test_a_vad_tick_runs_a_bounded_number_of_windows_per_stream():
    async def main():
        batcher = VadBatcher(30.0)
        flood, witness = SileroVad(), SileroVad()
        flood.feed(np.zeros(512 * 100, np.int16))  # 100 windows waiting
        witness.feed(np.zeros(512 * 2, np.int16))
        ran = []
        batcher.submit(flood, lambda: ran.append("flood"))
        batcher.submit(witness, lambda: ran.append("witness"))
        await until(lambda: len(ran) == 2, "one tick")
        assert flood.windows_pending == 100 - MAX_ROUNDS_PER_TICK and witness.windows_pending == 0
        assert batcher.windows == MAX_ROUNDS_PER_TICK + 2

    run(main)


# ---- a vanished client holds no slot -------------------------------------------------------------------------


def test_a_detached_session_frees_its_slot_and_resumes_when_there_is_room():
    async def main():
        rig = Rig(FakeEngine(capacity=1, answer_ms=200), {"limits": {"resume_grace_s": 10.0}})
        a = MemoryLink()
        first = rig.open(a, resumable=True)
        a.feed({"type": "response.create"})
        await until(lambda: a.of("response.done"), "the first answer")
        a.hang_up(lost=True)
        await until(lambda: first.suspended, "the slot given back")
        assert rig.conv(first).suspended and not rig.conv(first).closed
        # a new caller gets the slot the vanished one held
        b = MemoryLink()
        second = rig.open(b)
        with pytest.raises(ResumeRefused) as refused:
            await first.attach(MemoryLink(), 0)
        assert refused.value.code == "server_at_capacity"
        assert first.suspended and not first.task.done()  # still resumable within its grace
        b.hang_up()
        await rig.ended(second)
        c = MemoryLink()
        await first.attach(c, len(a.sent))
        assert not first.suspended and not rig.conv(first).suspended
        c.feed({"type": "response.create"})
        await until(lambda: c.of("response.done"), "an answer after the resume")
        assert [t.role.name for t in rig.conv(first).history] == ["USER", "ASSISTANT", "USER", "ASSISTANT"]
        c.hang_up()
        await rig.ended(first)

    run(main)


def test_max_sessions_counts_only_sessions_holding_a_slot():
    async def main():
        rig = Rig(FakeEngine(capacity=8), {"limits": {"max_sessions": 1, "resume_grace_s": 10.0}})
        a = MemoryLink()
        first = rig.open(a, resumable=True)
        await until(lambda: a.sent, "session.created")
        a.hang_up(lost=True)
        await until(lambda: first.suspended, "detached")
        b = MemoryLink()
        second = rig.open(b)  # admitted: the detached one holds nothing
        with pytest.raises(ResumeRefused, match="limit 1"):
            await first.attach(MemoryLink(), 1)
        b.hang_up()
        await rig.ended(second)
        await first.attach(MemoryLink(), 1)
        assert not first.suspended
        first.shutdown(CloseReason.SERVER_SHUTDOWN, "server_shutting_down", "bye")
        await rig.ended(first)

    run(main)


# ---- real sockets: auth, TwiML, Twilio's size limit -------------------------------------------------------------


@contextlib.asynccontextmanager
async def gateway(config: dict | None = None, capacity: int = 4):
    cfg = config_from_dict({**(config or {}), "server": {"port": 0, **(config or {}).get("server", {})}})
    gw = Gateway(FakeEngine(capacity=capacity, answer_ms=200), cfg, token=TOKEN)
    await gw.start()
    try:
        yield gw
    finally:
        await gw.stop()


async def http(port: int, request_head: bytes, body: bytes = b"") -> tuple[int, bytes]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(request_head + b"\r\n" + body)
    await writer.drain()
    data = await asyncio.wait_for(reader.read(), 5)
    writer.close()
    status = int(data.split(b" ", 2)[1])
    return status, data.partition(b"\r\n\r\n")[2]


def head(method: str, target: str, *headers: str) -> bytes:
    lines = [f"{method} {target} HTTP/1.1", "Host: 127.0.0.1", "Connection: close", *headers]
    return "".join(f"{ln}\r\n" for ln in lines).encode("utf-8")


@pytest.mark.parametrize("path", ["/metrics", "/v1/realtime", "/v1/realtime/calls", "/v1/telephony/twiml", "/no/such/path"])
def test_malformed_credentials_are_401_on_every_endpoint(path):
    async def main():
        async with gateway() as gw:
            method = "POST" if path.endswith(("calls", "twiml")) else "GET"
            upgrade = ("Upgrade: websocket", "Connection: Upgrade", "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==",
                       "Sec-WebSocket-Version: 13") if path == "/v1/realtime" else ()
            for creds in (("Authorization: Bearer s3cr\u00e9t",), ("Authorization: Bearer \u2603\u2603",), ()):
                for query in ("", "?token=%C3%A9", "?token=%FF%FE", "?token=%ED%A0%80"):
                    status, _ = await http(gw.port, head(method, path + query, *creds, *upgrade, "Content-Length: 0"))
                    assert status == 401, (creds, query, status)
            assert gw.metrics.registry.get_sample_value("duplex_auth_failures_total",
                                                        {"endpoint": path if path != "/no/such/path" else "other"}) == 12

    run(main)


def test_resume_and_twilio_start_with_non_ascii_tokens_are_refused_not_crashed():
    async def main():
        async with gateway() as gw:
            url = f"ws://127.0.0.1:{gw.port}/v1/realtime?token={TOKEN}&resume=%E2%98%83&last_seq=0"
            async with connect(url) as ws:
                err = json.loads(await asyncio.wait_for(ws.recv(), 5))
                assert err["error"]["code"] == "resume_failed"
                with pytest.raises(ConnectionClosed):
                    await asyncio.wait_for(ws.recv(), 5)
                assert ws.close_code == 1000
            async with connect(f"ws://127.0.0.1:{gw.port}/v1/telephony/twilio") as ws:
                await ws.send(json.dumps({"event": "start", "sequenceNumber": "1", "streamSid": "MZ1", "start": {
                    "streamSid": "MZ1", "callSid": "CA1", "tracks": ["inbound"], "customParameters": {"token": "\u00e9\u2603"},
                    "mediaFormat": {"encoding": "audio/x-mulaw", "sampleRate": 8000, "channels": 1}}}))
                with pytest.raises(ConnectionClosed):
                    await asyncio.wait_for(ws.recv(), 5)
                assert ws.close_code == 1008
            assert gw.metrics.registry.get_sample_value("duplex_auth_failures_total", {"endpoint": "/v1/telephony/twilio"}) == 1

    run(main)


@pytest.mark.parametrize("host", ["evil.example.com", "127.0.0.1.evil.example.com", "evil.example.com:443",
                                  "voice.example.com.evil:80", "", "[::2]"])
def test_twiml_never_points_a_call_at_a_host_the_request_chose(host):
    async def main():
        async with gateway() as gw:
            status, body = await http(gw.port, head("POST", f"/v1/telephony/twiml?token={TOKEN}", "Content-Length: 0")
                                      .replace(b"Host: 127.0.0.1", f"Host: {host}".encode()))
            assert status == 421 and b"telephony.public_url" in body
        async with gateway({"telephony": {"allowed_hosts": ["voice.example.com"]}}) as gw:
            status, _ = await http(gw.port, head("POST", f"/v1/telephony/twiml?token={TOKEN}", "Content-Length: 0")
                                   .replace(b"Host: 127.0.0.1", f"Host: {host}".encode()))
            assert status == 421

    run(main)


def test_twiml_uses_the_configured_url_or_an_allowed_host():
    async def main():
        async with gateway({"telephony": {"public_url": "https://voice.example.com"}}) as gw:
            status, body = await http(gw.port, head("POST", f"/v1/telephony/twiml?token={TOKEN}", "Content-Length: 0")
                                      .replace(b"Host: 127.0.0.1", b"Host: evil.example.com"))
            assert status == 200 and b'url="wss://voice.example.com/v1/telephony/twilio"' in body and b"evil" not in body
        async with gateway({"telephony": {"allowed_hosts": ["Voice.Example.com"]}}) as gw:
            status, body = await http(gw.port, head("POST", f"/v1/telephony/twiml?token={TOKEN}", "Content-Length: 0")
                                      .replace(b"Host: 127.0.0.1", b"Host: voice.example.com:8443"))
            assert status == 200 and b'url="wss://voice.example.com:8443/v1/telephony/twilio"' in body
            status, body = await http(gw.port, head("POST", f"/v1/telephony/twiml?token={TOKEN}", "Content-Length: 0"))
            assert status == 200 and b"wss://127.0.0.1/v1/telephony/twilio" in body  # loopback: a local test

    run(main)


def test_a_twilio_socket_cannot_send_megabytes_before_start():
    async def main():
        async with gateway() as gw:
            async with connect(f"ws://127.0.0.1:{gw.port}/v1/telephony/twilio", max_size=None) as ws:
                await ws.send(json.dumps({"event": "connected", "padding": "x" * 2_000_000}))
                with pytest.raises(ConnectionClosed):
                    await asyncio.wait_for(ws.recv(), 5)
                assert ws.close_code == 1009

    run(main)


def test_a_bad_message_on_a_real_socket_is_an_error_event_not_a_close():
    async def main():
        async with gateway() as gw:
            async with connect(f"ws://127.0.0.1:{gw.port}/v1/realtime?token={TOKEN}", max_size=None) as ws:
                assert json.loads(await ws.recv())["type"] == "session.created"
                for _, message, code in ATTACKS:
                    await ws.send(message)
                    ev = json.loads(await asyncio.wait_for(ws.recv(), 5))
                    assert ev["type"] == "error" and ev["error"]["code"] == code, (code, ev)
                    if _applies_update(message):  # what it could apply (nothing) is echoed
                        assert json.loads(await asyncio.wait_for(ws.recv(), 5))["type"] == "session.updated"
                await ws.send(json.dumps({"type": "response.create"}))
                kinds = []
                while "response.done" not in kinds:
                    kinds.append(json.loads(await asyncio.wait_for(ws.recv(), 5))["type"])
                assert "error" not in kinds

    run(main)


def test_the_rate_error_names_the_limits():
    """Read by whoever debugs the client from its log."""
    from realtime.input_budget import Rejection
    from realtime.session_input import rate_error

    e = rate_error(Rejection("messages", True, 7), InputLimits())
    assert isinstance(e, SessionError) and e.code == "input_rate_exceeded" and "200 messages" in e.message and "7 dropped" in e.message


def test_clients_that_vanish_without_a_close_do_not_keep_new_callers_out():
    async def main():
        async with gateway(capacity=1) as gw:
            url = f"ws://127.0.0.1:{gw.port}/v1/realtime?token={TOKEN}&duplex=1"  # opted in: resumable
            for _ in range(5):  # each takes the only slot, then its TCP connection is reset
                ws = await connect(url)
                created = json.loads(await asyncio.wait_for(ws.recv(), 5))
                assert created["type"] == "session.created", created
                ws.transport.abort()
                await until(lambda: all(r.suspended for r in gw.sessions.values()), "the slot given back")
            assert len(gw.sessions) == 5  # all still resumable within their grace ...
            async with connect(url) as ws:  # ... and a new caller is admitted
                assert json.loads(await asyncio.wait_for(ws.recv(), 5))["type"] == "session.created"
            assert gw.metrics.registry.get_sample_value("duplex_sessions_refused_total", {"reason": "capacity"}) is None

    run(main)


def test_a_client_that_stops_reading_is_closed_by_keepalive_while_other_pings_are_answered():
    """What Pipecat's `keepalive ping timeout` was (issue 28): after an error event it takes as fatal,
    Pipecat's client leaves its receive loop but keeps the connection and keeps sending audio. Its
    WebSocket library then stops reading the socket once its buffer is full, so it never sees our pings,
    and our keepalive cuts it. Here such a client (its buffer of one message never read)
    is closed by the server's keepalive once an answer fills that buffer, and its session is kept for a resume, while another session's
    pings keep being answered and its session goes on."""
    async def main():
        async with gateway({"limits": {"ping_interval_s": 0.3, "ping_timeout_s": 0.3}}, capacity=2) as gw:
            url = f"ws://127.0.0.1:{gw.port}/v1/realtime?token={TOKEN}&duplex=1"
            # ping_interval=None: only the server's keepalive acts, as it would against a client that pings too late
            async with connect(url, max_queue=1, ping_interval=None) as stalled, connect(url) as healthy:
                assert json.loads(await asyncio.wait_for(healthy.recv(), 5))["type"] == "session.created"
                silence = json.dumps({"type": "input_audio_buffer.append", "audio": "AAAA" * 400})
                await stalled.send(json.dumps({"type": "response.create"}))  # events it will not read
                pongs = 0
                for _ in range(200):  # 10 s at most; the keepalive needs 0.6 s
                    if any(r.suspended for r in gw.sessions.values()):
                        break
                    await stalled.send(silence)  # never reads
                    await asyncio.wait_for(await healthy.ping(), 5)
                    pongs += 1
                    await asyncio.sleep(0.05)
                assert [r.suspended for r in gw.sessions.values()] == [True, False], "the keepalive did not act"
                assert pongs >= 2
                # what the stalled client finds once it reads again: the connection cut (no close frame could
                # get past its full buffers), so it resumes like any client whose connection dropped
                with contextlib.suppress(ConnectionClosed):
                    while True:
                        await asyncio.wait_for(stalled.recv(), 5)
                assert stalled.protocol.close_rcvd is None
                await healthy.send(json.dumps({"type": "response.create"}))
                kinds = []
                while "response.done" not in kinds:
                    kinds.append(json.loads(await asyncio.wait_for(healthy.recv(), 5))["type"])

    run(main)
