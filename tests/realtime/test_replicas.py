"""One replica among several, over real sockets on 127.0.0.1 (fake engine): the replica's name in resume
tokens and Twilio stream URLs (what the balancer routes on, deploy/haproxy.cfg), /livez, and the drain
(SIGTERM's first half: no new session, running ones and their resumes go on, then the stop)."""

from __future__ import annotations

import asyncio
import json
import re
import urllib.error
import urllib.parse
import urllib.request

import pytest
import websockets
from fake_engine import FakeEngine

from realtime.config import config_from_dict
from realtime.resume import new_resume_token
from realtime.server import Gateway

TOKEN = "replica-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def _get(port: int, path: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.mark.parametrize("good", ["duplex-0", "r1", "a" * 63, "0"])
def test_replica_id_accepts_dns_labels(good):
    assert config_from_dict({"server": {"replica_id": good}}).server.replica_id == good


@pytest.mark.parametrize("bad", ["", "Duplex-0", "-r", "r-", "a.b", "a_b", "a" * 64, "r/1", 7])
def test_replica_id_refuses_what_cannot_be_a_url_segment_and_backend_name(bad):
    with pytest.raises(ValueError, match=r"server\.replica_id"):
        config_from_dict({"server": {"replica_id": bad}})


def test_drain_timeout_range():
    assert config_from_dict({"limits": {"drain_timeout_s": 0}}).limits.drain_timeout_s == 0
    with pytest.raises(ValueError, match=r"limits\.drain_timeout_s"):
        config_from_dict({"limits": {"drain_timeout_s": -1}})


def test_resume_tokens_name_the_replica_in_their_second_dot_field():
    named, plain = new_resume_token("duplex-3"), new_resume_token()
    assert named.split(".")[0:2] == ["resume", "duplex-3"] and len(named.split(".")) == 3
    assert plain.startswith("resume_") and "." not in plain  # one server: the field the balancer reads is absent


async def _gateway(**config) -> Gateway:
    gw = Gateway(FakeEngine(capacity=4), config_from_dict({"server": {"port": 0}, **config}), token=TOKEN)
    await gw.start()
    return gw


def test_a_replica_names_itself_in_resume_tokens_and_twilio_stream_urls():
    async def main():
        gw = await _gateway(server={"port": 0, "replica_id": "duplex-1"})
        try:
            ws = await websockets.connect(f"ws://127.0.0.1:{gw.port}/v1/realtime?duplex=1", additional_headers=AUTH)
            created = json.loads(await ws.recv())
            # the TwiML's stream URL names the replica; the stream opened there is served, its ticket redeemed
            req = urllib.request.Request(f"http://127.0.0.1:{gw.port}/v1/telephony/twiml?token={TOKEN}",
                                         data=urllib.parse.urlencode({"CallSid": "CA1"}).encode(), method="POST")
            twiml = (await asyncio.to_thread(urllib.request.urlopen, req, None, 5)).read().decode()
            url = re.search(r'Stream url="([^"]+)"', twiml).group(1)
            ticket = re.search(r'name="token" value="([^"]+)"', twiml).group(1)
            stream = await websockets.connect(f"ws://127.0.0.1:{gw.port}{urllib.parse.urlsplit(url).path}")
            await stream.send(json.dumps({"event": "connected", "protocol": "Call", "version": "1.0.0"}))
            await stream.send(json.dumps({"event": "start", "sequenceNumber": "1", "streamSid": "MZ1", "start": {
                "streamSid": "MZ1", "callSid": "CA1", "accountSid": "AC1", "tracks": ["inbound"], "customParameters": {"token": ticket},
                "mediaFormat": {"encoding": "audio/x-mulaw", "sampleRate": 8000, "channels": 1}}}))
            for _ in range(50):
                if len(gw.sessions) == 2:
                    break
                await asyncio.sleep(0.05)
            transports = sorted(r.transport for r in gw.sessions.values())
            status, live = await asyncio.to_thread(_get, gw.port, "/livez")
            await stream.close()
            await ws.close()
            return created, url, transports, status, live
        finally:
            await gw.stop()

    created, url, transports, status, live = asyncio.run(main())
    assert created["resume_token"].startswith("resume.duplex-1.")
    assert url.endswith("/v1/telephony/twilio/duplex-1")
    assert transports == ["twilio", "websocket"]
    assert status == 200 and live == {"live": True, "draining": False, "detail": "ready", "replica_id": "duplex-1"}


def test_drain_refuses_new_sessions_keeps_running_ones_and_their_resumes():
    async def main():
        gw = await _gateway(limits={"drain_timeout_s": 30, "retry_after_s": 3})
        try:
            ws = await websockets.connect(f"ws://127.0.0.1:{gw.port}/v1/realtime?duplex=1", additional_headers=AUTH)
            created = json.loads(await ws.recv())
            drain = asyncio.create_task(gw.drain())
            await asyncio.sleep(0.1)
            health = await asyncio.to_thread(_get, gw.port, "/healthz")
            live = await asyncio.to_thread(_get, gw.port, "/livez")
            new = await websockets.connect(f"ws://127.0.0.1:{gw.port}/v1/realtime", additional_headers=AUTH)
            refusal = json.loads(await new.recv())
            await new.wait_closed()
            # a phone call's TwiML gets no stream ticket: a 503 sends Twilio to the number's fallback URL
            req = urllib.request.Request(f"http://127.0.0.1:{gw.port}/v1/telephony/twiml?token={TOKEN}",
                                         data=urllib.parse.urlencode({"CallSid": "CA9"}).encode(), method="POST")
            try:
                await asyncio.to_thread(urllib.request.urlopen, req, None, 5)
                twiml = None
            except urllib.error.HTTPError as e:
                twiml = (e.code, e.headers.get("Retry-After"), e.read().decode())
            # the running session's connection dies; its resume is still taken while draining
            ws.transport.abort()
            again = await websockets.connect(f"ws://127.0.0.1:{gw.port}/v1/realtime?resume={created['resume_token']}&last_seq=1",
                                             additional_headers=AUTH)
            resumed = json.loads(await again.recv())
            await again.send(json.dumps({"type": "input_audio_buffer.clear"}))
            cleared = json.loads(await again.recv())
            still_draining = not drain.done()
            await again.close()  # the last session ends: the drain is over
            drained = await asyncio.wait_for(drain, 10)
            return health, live, refusal, new.close_code, resumed, cleared, still_draining, drained, twiml
        finally:
            await gw.stop()

    health, live, refusal, close_code, resumed, cleared, still_draining, drained, twiml = asyncio.run(main())
    assert twiml is not None and twiml[:2] == (503, "3") and "draining" in twiml[2] and "token" not in twiml[2]
    assert health[0] == 503 and health[1]["detail"] == "draining" and health[1]["retry_after_s"] == 3
    assert live == (200, {"live": True, "draining": True, "detail": "ready", "replica_id": None})
    assert refusal["error"]["code"] == "server_at_capacity" and "draining" in refusal["error"]["message"] and close_code == 1013
    assert resumed["type"] == "session.resumed" and cleared["type"] == "input_audio_buffer.cleared"
    assert still_draining and drained is True


def test_drain_timeout_then_stop_tells_running_sessions_the_server_is_shutting_down():
    async def main():
        gw = await _gateway(limits={"drain_timeout_s": 0.5})
        ws = await websockets.connect(f"ws://127.0.0.1:{gw.port}/v1/realtime", additional_headers=AUTH)
        await ws.recv()
        drained = await gw.drain()
        running = len(gw.sessions)
        await gw.stop()
        messages = [json.loads(m) async for m in ws]
        return drained, running, messages, ws.close_code

    drained, running, messages, close_code = asyncio.run(main())
    assert drained is False and running == 1
    assert messages[-1]["type"] == "error" and messages[-1]["error"]["code"] == "server_shutting_down"
    assert close_code is not None


def test_webrtc_answer_announces_the_public_host():
    from rt_helpers import aiortc_offer

    async def main():
        gw = await _gateway(webrtc={"public_host": "203.0.113.7"})
        try:
            req = urllib.request.Request(f"http://127.0.0.1:{gw.port}/v1/realtime/calls", data=(await aiortc_offer()).encode(),
                                         method="POST", headers={**AUTH, "Content-Type": "application/sdp"})
            with await asyncio.to_thread(urllib.request.urlopen, req, None, 10) as r:
                return r.status, r.read().decode()
        finally:
            await gw.stop()

    status, answer = asyncio.run(main())
    candidates = [line.split() for line in answer.splitlines() if line.startswith("a=candidate:") and " typ host" in line]
    assert status == 201 and candidates
    assert {c[4] for c in candidates} == {"203.0.113.7"}
    assert all(line == "c=IN IP4 203.0.113.7" for line in answer.splitlines() if line.startswith("c="))


@pytest.mark.parametrize("bad", ["voice.example.com", "1.2.3", ""])
def test_webrtc_public_host_must_be_an_address(bad):
    with pytest.raises(ValueError, match=r"webrtc\.public_host"):
        config_from_dict({"webrtc": {"public_host": bad}})
