"""At capacity, over real sockets on 127.0.0.1 (fake engine): /healthz says `at_capacity` (503, so a load
balancer routes elsewhere) with when to retry; a new caller is refused on every transport with
`server_at_capacity` and the same `retry_after_s`; the admitted session goes on; lateness the
sessions see reaches admission control (`report_delivery`)."""

from __future__ import annotations

import asyncio
import base64
import json
import urllib.error
import urllib.request

import numpy as np
import websockets
from fake_engine import FakeEngine
from rt_helpers import aiortc_offer

from realtime.config import config_from_dict
from realtime.server import Gateway

TOKEN = "cap-token"


def _get(port: int, path: str) -> tuple[int, dict, dict]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return r.status, dict(r.headers), json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), json.loads(e.read())


def test_at_capacity_every_transport_refuses_with_when_to_retry():
    async def main():
        engine = FakeEngine(capacity=1)
        gw = Gateway(engine, config_from_dict({"server": {"port": 0}, "limits": {"retry_after_s": 7}}), token=TOKEN)
        await gw.start()
        port = gw.port
        try:
            status, _, body = await asyncio.to_thread(_get, port, "/healthz")
            assert status == 200 and body["at_capacity"] is False and body["capacity"] == 1
            first = await websockets.connect(f"ws://127.0.0.1:{port}/v1/realtime", additional_headers={"Authorization": f"Bearer {TOKEN}"})
            assert json.loads(await first.recv())["type"] == "session.created"
            status, _, body = await asyncio.to_thread(_get, port, "/healthz")
            assert status == 503 and body["detail"] == "at_capacity" and body["at_capacity"] is True
            assert body["ready"] is True and body["retry_after_s"] == 7 and body["sessions"] == 1
            # WebSocket: an error event with the code and when to retry, then 1013 (try again later)
            ws = await websockets.connect(f"ws://127.0.0.1:{port}/v1/realtime", additional_headers={"Authorization": f"Bearer {TOKEN}"})
            err = json.loads(await ws.recv())
            assert err["type"] == "error" and err["error"]["code"] == "server_at_capacity" and err["error"]["retry_after_s"] == 7
            assert "try again in 7 s" in err["error"]["message"]
            await ws.wait_closed()
            assert ws.close_code == 1013 and "retry in 7 s" in ws.close_reason
            # WebRTC: 503, Retry-After, the code
            req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/realtime/calls", data=(await aiortc_offer()).encode(), method="POST",
                                         headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/sdp"})
            try:
                await asyncio.to_thread(urllib.request.urlopen, req, None, 10)
                raise AssertionError("the call was admitted")
            except urllib.error.HTTPError as e:
                assert e.code == 503 and e.headers["Retry-After"] == "7"
                assert json.loads(e.read())["error"]["code"] == "server_at_capacity"
            # Twilio Media Streams: closed 1013 after `start`, the reason says when to retry
            tw = await websockets.connect(f"ws://127.0.0.1:{port}/v1/telephony/twilio")
            await tw.send(json.dumps({"event": "connected", "protocol": "Call", "version": "1.0.0"}))
            await tw.send(json.dumps({"event": "start", "sequenceNumber": "1", "streamSid": "MZ1", "start": {
                "streamSid": "MZ1", "accountSid": "AC1", "callSid": "CA1", "tracks": ["inbound"], "customParameters": {"token": TOKEN},
                "mediaFormat": {"encoding": "audio/x-mulaw", "sampleRate": 8000, "channels": 1}}}))
            await tw.wait_closed()
            assert tw.close_code == 1013 and "retry in 7 s" in tw.close_reason
            # the admitted session goes on
            pcm = (np.zeros(480)).astype("<i2").tobytes()
            await first.send(json.dumps({"type": "input_audio_buffer.append", "audio": base64.b64encode(pcm).decode()}))
            await first.send(json.dumps({"type": "session.update", "session": {"instructions": "hi"}}))
            while json.loads(await first.recv())["type"] != "session.updated":
                pass
            await first.close()
            for _ in range(100):
                status, _, body = await asyncio.to_thread(_get, port, "/healthz")
                if status == 200:
                    break
                await asyncio.sleep(0.05)
            assert status == 200 and body["at_capacity"] is False
            assert gw.metrics.sessions_refused.labels("capacity")._value.get() == 3
        finally:
            await gw.stop()

    asyncio.run(asyncio.wait_for(main(), 60))


def test_chunks_late_at_the_gateway_reach_admission_control():
    async def main():
        # every chunk's deadline is already past when it arrives
        engine = FakeEngine(capacity=2, answer_ms=600, deadline_offset_s=-1.0)
        gw = Gateway(engine, config_from_dict({"server": {"port": 0}, "vad": {"enabled": False}}), token=TOKEN)
        await gw.start()
        try:
            ws = await websockets.connect(f"ws://127.0.0.1:{gw.port}/v1/realtime", additional_headers={"Authorization": f"Bearer {TOKEN}"})
            await ws.recv()
            pcm = (np.zeros(4800)).astype("<i2").tobytes()
            await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": base64.b64encode(pcm).decode()}))
            await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
            await ws.send(json.dumps({"type": "response.create"}))
            while json.loads(await ws.recv())["type"] != "response.done":
                pass
            await ws.close()
            for _ in range(100):
                if sum(late for _, late, _ in engine.deliveries) >= 1:
                    break
                await asyncio.sleep(0.05)
            chunks, late = sum(c for c, _, _ in engine.deliveries), sum(x for _, x, _ in engine.deliveries)
            assert chunks == 600 // 80 + 1 == late and all(u == 0 for _, _, u in engine.deliveries)
        finally:
            await gw.stop()

    asyncio.run(asyncio.wait_for(main(), 60))
