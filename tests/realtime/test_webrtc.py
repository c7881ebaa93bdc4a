"""The WebRTC transport with aiortc as the client, over real ICE/DTLS/SRTP/SCTP on 127.0.0.1.

Signalling is OpenAI's WebRTC mode: POST the SDP offer to /v1/realtime/calls, get the answer; events
on the `oai-events` data channel; the microphone is an Opus track fed with espeak-ng speech at
real-time pace. (The browser page is tested in test_web_page.py.)
"""

from __future__ import annotations

import asyncio
import fractions
import json
import time
import urllib.error
import urllib.request

import numpy as np
import pytest
from rt_helpers import aiortc_offer, running_gateway, silence

from engine.service_api import Role

pytestmark = pytest.mark.vllm

TOKEN = "webrtc-token"
CAPACITY = 2


@pytest.fixture(scope="module")
def gateway(loop_thread, tiny_model):
    with running_gateway(loop_thread, tiny_model, CAPACITY, {
        "server": {"port": 0, "token": TOKEN},
        "vad": {"silence_duration_ms": 400},
        "session": {"max_response_ms": 6000.0, "temperature": 0.0},
    }) as gw:
        yield gw


def run(coro, timeout: float = 180):
    return asyncio.run(asyncio.wait_for(coro, timeout))


class MicTrack:
    """A microphone: 48 kHz mono int16 in 20 ms frames at real-time pace, silence when the script ends."""

    def __new__(cls, pcm48: np.ndarray):
        from aiortc.mediastreams import MediaStreamTrack
        from av import AudioFrame

        class _Mic(MediaStreamTrack):
            kind = "audio"

            def __init__(self) -> None:
                super().__init__()
                self.pcm, self.pos, self.t0 = pcm48, 0, None

            def say(self, pcm: np.ndarray) -> None:
                """Speak `pcm` from now on (replaces what is left of the script)."""
                self.pcm, self.pos = pcm, 0

            async def recv(self):
                if self.t0 is None:
                    self.t0 = time.monotonic()
                    self.n = 0
                wait = self.t0 + self.n * 0.02 - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                out = np.zeros(960, np.int16)
                chunk = self.pcm[self.pos:self.pos + 960]
                out[:chunk.size] = chunk
                self.pos += 960
                frame = AudioFrame.from_ndarray(out.reshape(1, -1), format="s16", layout="mono")
                frame.sample_rate, frame.pts, frame.time_base = 48000, self.n * 960, fractions.Fraction(1, 48000)
                self.n += 1
                return frame

        return _Mic()


class RtcClient:
    def __init__(self, gw, pcm48: np.ndarray, token: str = TOKEN) -> None:
        from aiortc import RTCConfiguration, RTCPeerConnection

        self.gw, self.token = gw, token
        self.pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
        self.mic = MicTrack(pcm48)
        self.pc.addTrack(self.mic)
        self.dc = self.pc.createDataChannel("oai-events")
        self.events: list[dict] = []
        self.audio: list[np.ndarray] = []
        self.voiced_ms = 0.0  # non-silent audio received on the answer track
        self._new = asyncio.Event()
        self._tasks: list[asyncio.Task] = []

        @self.dc.on("message")
        def _on(m) -> None:
            self.events.append(json.loads(m))
            self._new.set()

        @self.pc.on("track")
        def _on_track(track) -> None:
            self._tasks.append(asyncio.create_task(self._play(track)))

    async def _play(self, track) -> None:
        from aiortc.mediastreams import MediaStreamError

        try:
            while True:
                f = await track.recv()
                a = f.to_ndarray().reshape(-1, len(f.layout.channels))[:, 0]
                self.audio.append(a)
                if np.abs(a).max() > 0:
                    self.voiced_ms += 1000.0 * a.size / f.sample_rate
        except MediaStreamError:
            pass

    async def connect(self) -> tuple[int, str]:
        await self.pc.setLocalDescription(await self.pc.createOffer())
        status, body = await asyncio.to_thread(post_offer, self.gw, self.pc.localDescription.sdp, self.token)
        if status == 201:
            from aiortc import RTCSessionDescription

            await self.pc.setRemoteDescription(RTCSessionDescription(sdp=body, type="answer"))
        return status, body

    async def wait_for(self, kind: str, timeout: float = 60, start: int = 0, **match) -> dict:
        deadline = time.monotonic() + timeout
        i = start
        while True:
            while i < len(self.events):
                ev = self.events[i]
                i += 1
                if ev["type"] == kind and all(ev.get(k) == v for k, v in match.items()):
                    return ev
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no {kind} within {timeout} s; got {[e['type'] for e in self.events]}")
            self._new.clear()
            try:
                await asyncio.wait_for(self._new.wait(), left)
            except asyncio.TimeoutError:
                pass

    def send(self, **event) -> None:
        self.dc.send(json.dumps(event))

    async def close(self) -> None:
        await self.pc.close()
        for t in self._tasks:
            t.cancel()


def post_offer(gw, sdp: str, token: str | None, content_type: str = "application/sdp") -> tuple[int, str]:
    headers = {"Content-Type": content_type}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    req = urllib.request.Request(f"http://127.0.0.1:{gw.port}/v1/realtime/calls?duplex=1", data=sdp.encode(), headers=headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def speech48(speech, text: str, tail_ms: int = 1500) -> np.ndarray:
    return np.concatenate([silence(300, 48000), speech(text, 48000), silence(tail_ms, 48000)])


async def wait_sessions(gw, n: int, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while (len(gw.sessions) != n or len(gw.transports["webrtc"].peers) != n) and time.monotonic() < deadline:
        await asyncio.sleep(0.1)


def test_webrtc_turn_events_and_audio(gateway, speech):
    """Speech on the track -> VAD turn -> the answer on our track, paced, bracketed by buffer events."""

    async def main():
        await wait_sessions(gateway, 0)
        c = RtcClient(gateway, speech48(speech, "Hello there, can you hear me?", tail_ms=10_000))
        status, _ = await c.connect()
        assert status == 201
        created = await c.wait_for("session.created", timeout=30)
        c.send(type="session.update", session={"duplex": {"max_response_ms": 1500}})
        await c.wait_for("session.updated")
        await c.wait_for("input_audio_buffer.speech_started")
        await c.wait_for("input_audio_buffer.speech_stopped")
        started = await c.wait_for("output_audio_buffer.started")
        done = await c.wait_for("response.done", timeout=60)
        stopped = await c.wait_for("output_audio_buffer.stopped", timeout=10)
        await asyncio.sleep(0.5)
        received = np.concatenate(c.audio) if c.audio else np.zeros(0)
        await c.close()
        return created, started, done, stopped, received, c.events

    created, started, done, stopped, received, events = run(main())
    assert created["session"]["id"].startswith("sess_")
    rid = done["response"]["id"]
    assert done["response"]["status"] == "completed"
    assert started["response_id"] == rid and stopped["response_id"] == rid
    assert done["response"]["duplex"]["audio_ms"] == pytest.approx(1500, abs=40)
    # the answer arrived as audio on the track (48 kHz), not in events
    assert not any(e["type"] == "response.output_audio.delta" for e in events)
    assert np.abs(received.astype(np.int32)).max() > 100


def test_webrtc_barge_in_clears_at_what_the_track_sent(gateway, speech):
    async def main():
        await wait_sessions(gateway, 0)
        c = RtcClient(gateway, speech48(speech, "Tell me a long story about the sea.", tail_ms=30_000))
        assert (await c.connect())[0] == 201
        await c.wait_for("session.created", timeout=30)
        await c.wait_for("output_audio_buffer.started", timeout=60)
        while c.voiced_ms < 600:  # hear some of the answer (however slowly a loaded machine makes it)
            await asyncio.sleep(0.02)
        heard = c.voiced_ms
        c.mic.say(speech(" Wait, stop please.", 48000))
        cleared = await c.wait_for("output_audio_buffer.cleared", timeout=30)
        done = await c.wait_for("response.done", timeout=10)
        n = len(c.events)
        await c.wait_for("response.created", timeout=60, start=n)  # the second turn: history now final
        sid = [e for e in c.events if e["type"] == "session.created"][0]["session"]["id"]
        history = list(gateway.conversation(sid).history)
        await c.close()
        return cleared, done, history, heard

    cleared, done, history, heard = run(main())
    resp = done["response"]
    assert resp["status"] == "cancelled" and resp["status_details"]["reason"] == "turn_detected"
    assert cleared["response_id"] == resp["id"]
    played, released = resp["duplex"]["played_ms"], resp["duplex"]["audio_ms"]
    # the cursor is what the paced track sent: at least what we heard, and short of what the session
    # had released to the track by at most its lead (150 ms) and a frame
    assert heard - 40 <= played <= released
    assert released - played <= 150 + 100  # + soxr holds back ~30 ms, + a frame or two in flight
    assert [t.role for t in history[:2]] == [Role.USER, Role.ASSISTANT]
    assert abs(history[1].audio_frames - played / 20) <= 1  # the next prompt holds what was played


def test_webrtc_refusals_and_bad_offers(gateway, speech):
    async def main():
        await wait_sessions(gateway, 0)
        offer = await aiortc_offer()
        out = {
            "no_token": await asyncio.to_thread(post_offer, gateway, offer, None),
            "bad_token": await asyncio.to_thread(post_offer, gateway, offer, "wrong"),
            "not_sdp": await asyncio.to_thread(post_offer, gateway, "hello", TOKEN),
            "wrong_type": await asyncio.to_thread(post_offer, gateway, offer, TOKEN, "application/json"),
            "garbage_sdp": await asyncio.to_thread(post_offer, gateway, "v=0\r\nm=audio 9 UDP/TLS/RTP/SAVPF 111\r\nxx\r\n", TOKEN),
        }
        # capacity: CAPACITY live calls, then one more is refused with 503 and the documented code
        clients = [RtcClient(gateway, silence(1000, 48000)) for _ in range(CAPACITY)]
        for c in clients:
            assert (await c.connect())[0] == 201
            await c.wait_for("session.created", timeout=30)
        out["capacity"] = await asyncio.to_thread(post_offer, gateway, offer, TOKEN)
        for c in clients:
            await c.close()
        await wait_sessions(gateway, 0)
        out["after"] = (len(gateway.sessions), len(gateway.transports["webrtc"].peers))
        return out

    out = run(main())
    assert out["no_token"][0] == 401 and out["bad_token"][0] == 401
    assert out["not_sdp"][0] == 400 and json.loads(out["not_sdp"][1])["error"]["code"] == "invalid_offer"
    assert out["wrong_type"][0] == 415
    assert out["garbage_sdp"][0] == 400
    assert out["capacity"][0] == 503 and json.loads(out["capacity"][1])["error"]["code"] == "server_at_capacity"
    assert out["after"] == (0, 0)


def test_webrtc_peer_connections_do_not_leak(gateway):
    """Connect and hang up repeatedly (some before the data channel opens): nothing stays alive."""

    async def main():
        await wait_sessions(gateway, 0)
        peak, freed_s = 0, []
        for i in range(6):
            c = RtcClient(gateway, silence(500, 48000))
            assert (await c.connect())[0] == 201
            if i % 2 == 0:
                await c.wait_for("session.created", timeout=30)
            peak = max(peak, len(gateway.transports["webrtc"].peers))
            await c.close()
            t0 = time.monotonic()
            await wait_sessions(gateway, 0, timeout=30)
            freed_s.append(time.monotonic() - t0)
        print("peer connection freed after hang-up in (s):", [round(s, 2) for s in freed_s])
        metrics = await asyncio.to_thread(lambda: urllib.request.urlopen(
            f"http://127.0.0.1:{gateway.port}/metrics?token={TOKEN}").read().decode())
        return peak, len(gateway.transports["webrtc"].peers), len(gateway.sessions), metrics

    peak, peers, sessions, metrics = run(main())
    assert peak >= 1
    assert (peers, sessions) == (0, 0)
    assert "duplex_webrtc_peer_connections 0.0" in metrics
