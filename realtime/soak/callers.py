"""Simulated callers, one class per transport, one conversation script for all.

A caller's microphone is always on: every 20 ms it sends one frame (speech when the script says
something, silence otherwise), like a phone or a browser. The script: pause, say a sentence, listen
to the answer; with probability `barge_in` it starts its next sentence while the answer plays.
Every frame sent is counted (the run checks the count against the server's own counter), every
answer is played through a simulated speaker (`Playout`), every error event is kept.

The wire formats are written from our protocol document (docs/protocol.md) and Twilio's Media
Streams documentation, not from the server's code.
"""

from __future__ import annotations

import asyncio
import base64
import json
import random
import time
from abc import ABC, abstractmethod
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from realtime.soak.speaker import Playout

FRAME_MS = 20


class Refused(Exception):
    """The server refused the session (e.g. server_at_capacity)."""

    def __init__(self, code: str, message: str = "") -> None:
        super().__init__(f"{code}: {message}")
        self.code = code


@dataclass
class Utterance:
    text: str
    pcm16k: np.ndarray


@dataclass
class Answer:
    response_id: str
    created: float
    playout: Playout
    status: str | None = None  # completed | cancelled | failed
    reason: str | None = None
    barge_in_at: float | None = None  # when the caller started speaking over it
    cleared_at: float | None = None  # output_audio_buffer.cleared received
    server_ttfa_ms: float | None = None


@dataclass
class CallerRecord:
    transport: str
    index: int
    started: float = 0.0
    ended: float = 0.0
    frames_sent: int = 0
    utterances: int = 0
    answers: list[Answer] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # error event codes
    refused: str | None = None
    shed: str | None = None  # admitted, then ended by the server to keep the others on time (server_overloaded)
    frames_after_shed: int = 0  # sent after the server said it ended the call (WebRTC's track runs until hang-up)
    frames_in_flight_at_shed: int = 0  # sent in the 200 ms before that word came: perhaps after the server's close
    crashed: str | None = None  # an unexpected exception or an unexpected close
    closed_by_server: str | None = None


@dataclass(frozen=True)
class Script:
    sentences: tuple[Utterance, ...]
    pause_s: tuple[float, float] = (0.6, 2.0)
    barge_in: float = 0.2  # share of answers the caller speaks over
    barge_after_ms: tuple[float, float] = (300.0, 1200.0)  # answer audio heard before barging in
    jitter_ms: float = 60.0
    ack_every_ms: float = 200.0  # output_audio_buffer.played cadence (WebSocket transports)
    answer_wait_s: float = 10.0  # silence after speaking before the caller tries again without an answer


class Caller(ABC):
    transport = "?"
    wire_rate_hz = 16_000

    def __init__(self, index: int, base_url: str, token: str, script: Script, seed: int) -> None:
        self.index, self.base_url, self.token, self.script = index, base_url, token, script
        self.rng = random.Random(seed)
        self.record = CallerRecord(self.transport, index)
        self._mic: deque[np.ndarray] = deque()  # queued speech at the wire rate, in 20 ms frames
        self._speaking_until: float | None = None  # when the current utterance's last frame is sent
        self._speech_end: float | None = None  # end of the last finished utterance
        self._answer: Answer | None = None
        self._next_turn_at = 0.0
        self._barge_plan: float | None = None
        self._last_ack = 0.0
        self._rendered: dict[int, list[np.ndarray]] = {}
        self._stop = False
        self._hang_up = False
        self._sent_at: deque[float] = deque(maxlen=64)  # when the last frames were sent (a shed call's in-flight ones)

    # ---- the script, called once per 20 ms frame -------------------------------------------------
    def next_frame(self, now: float) -> np.ndarray:
        """The microphone's next 20 ms at the wire rate; runs the conversation script."""
        a = self._answer
        speaking = bool(self._mic)
        if not speaking and self._speaking_until is not None:
            self._speech_end, self._speaking_until = now, None
            self._next_turn_at = now + self.script.answer_wait_s  # unless an answer comes and ends first
        if not speaking and not self._stop:
            answering = a if a is not None and a.status is None else None  # the answer playing now
            if answering is None and now >= self._next_turn_at:
                self._say()
            elif answering is not None and self._barge_plan is not None and answering.playout.played_ms(now) >= self._barge_plan:
                answering.barge_in_at = now
                self._barge_plan = None
                self._say()
        if self._mic:
            return self._mic.popleft()
        return np.zeros(self.wire_rate_hz * FRAME_MS // 1000, np.int16)

    def _say(self) -> None:
        i = self.rng.randrange(len(self.script.sentences))
        self._mic.extend(self._frames(i))
        self._speaking_until = float("inf")
        self.record.utterances += 1

    def _frames(self, i: int) -> list[np.ndarray]:
        if i not in self._rendered:
            from realtime.audio import StreamResampler

            pcm = self.script.sentences[i].pcm16k
            rs = StreamResampler(16_000, self.wire_rate_hz)
            wire = np.concatenate([rs.process(pcm), rs.flush()]) if self.wire_rate_hz != 16_000 else pcm
            n = self.wire_rate_hz * FRAME_MS // 1000
            wire = np.concatenate([wire, np.zeros((-wire.size) % n, np.int16)])
            self._rendered[i] = list(wire.reshape(-1, n))
        return self._rendered[i]

    # ---- server events, shared ---------------------------------------------------------------------
    def on_response_created(self, response_id: str, now: float) -> Answer:
        self._answer = Answer(response_id, now, Playout(self._speech_end if self._speaking_until is None else None,
                                                        jitter_ms=self.script.jitter_ms))
        self.record.answers.append(self._answer)
        lo, hi = self.script.barge_after_ms
        self._barge_plan = self.rng.uniform(lo, hi) if self.rng.random() < self.script.barge_in else None
        return self._answer

    def on_audio(self, response_id: str | None, duration_ms: float, now: float) -> None:
        a = self._answer
        if a is not None and (response_id is None or response_id == a.response_id) and a.status is None:
            a.playout.on_audio(now, duration_ms)

    def on_first_audio_mark(self, response_id: str, ttfa_ms: float | None) -> None:
        if self._answer is not None and self._answer.response_id == response_id:
            self._answer.server_ttfa_ms = ttfa_ms

    def on_cleared(self, response_id: str | None, now: float) -> None:
        for a in reversed(self.record.answers):
            if response_id in (None, a.response_id):
                a.cleared_at = a.cleared_at or now
                break

    def on_response_done(self, response_id: str, status: str, reason: str | None, now: float) -> None:
        for a in reversed(self.record.answers):
            if a.response_id == response_id:
                a.status, a.reason = status, reason
                break
        if self._answer is not None and self._answer.response_id == response_id:
            self._barge_plan = None
            lo, hi = self.script.pause_s
            self._next_turn_at = now + self.rng.uniform(lo, hi)

    def on_error(self, code: str) -> None:
        self.record.errors.append(code)
        if code == "server_overloaded":  # the server ends this call (then closes): hang up, as a client would
            self.on_shed(code)

    def on_shed(self, why: str) -> None:
        if self.record.shed is None:
            now = time.monotonic()
            self.record.frames_in_flight_at_shed = sum(1 for t in self._sent_at if t >= now - 0.2)
        self.record.shed = self.record.shed or why
        self._hang_up = True
        self._mic.clear()

    def sent_frame(self) -> None:
        self.record.frames_sent += 1
        self._sent_at.append(time.monotonic())

    def ack_due(self, now: float) -> float | None:
        """played_ms to acknowledge now, on the client's cadence (None: nothing to say)."""
        a = self._answer
        if a is None or a.status is not None or a.playout.start is None:
            return None
        if 1000.0 * (now - self._last_ack) < self.script.ack_every_ms:
            return None
        self._last_ack = now
        return a.playout.played_ms(now)

    # ---- the call ----------------------------------------------------------------------------------
    async def run(self, until: float) -> CallerRecord:
        self.record.started = time.monotonic()
        try:
            await self.connect()
        except Refused as e:
            self.record.refused = e.code
            self.record.ended = time.monotonic()
            return self.record
        try:
            await self.converse(until)
        except Refused as e:
            self.record.refused = e.code
        except Exception as e:  # anything unexpected is this session crashing
            self.record.crashed = f"{type(e).__name__}: {e}"
        finally:
            try:
                await asyncio.wait_for(self.close(), 10)
            except Exception as e:
                self.record.crashed = self.record.crashed or f"close: {type(e).__name__}: {e}"
            self.record.ended = time.monotonic()
        return self.record

    def hang_up(self) -> None:
        """End the call now (after the answer in progress), whatever `until` said."""
        self._hang_up = True

    async def drain_and_stop(self, until: float) -> None:
        """Stop starting turns at `until`; let the last answer finish (bounded), then return."""
        while time.monotonic() < until and not self._hang_up:
            await asyncio.sleep(0.1)
        self._stop = True
        if self.record.shed:
            return  # the server ended the call: no answer will finish
        grace = time.monotonic() + 8.0
        while (self._mic or (self._answer and self._answer.status is None)) and time.monotonic() < grace:
            await asyncio.sleep(0.1)

    @abstractmethod
    async def connect(self) -> None: ...

    @abstractmethod
    async def converse(self, until: float) -> None: ...

    @abstractmethod
    async def close(self) -> None: ...


# --- WebSocket, OpenAI-Realtime events ---------------------------------------------------------------


class WebSocketCaller(Caller):
    """`WS /v1/realtime`; pcm16 (24 kHz base64 JSON) or Opus (binary frames) both ways."""

    transport = "ws-pcm16"
    wire_rate_hz = 24_000
    opus = False

    async def connect(self) -> None:
        import websockets

        url = self.base_url.replace("http", "ws", 1) + "/v1/realtime?duplex=1"  # our additions: epochs, latency marks
        self.ws = await websockets.connect(url, additional_headers={"Authorization": f"Bearer {self.token}"},
                                           max_size=1 << 22, open_timeout=30)
        first = json.loads(await asyncio.wait_for(self.ws.recv(), 30))
        if first.get("type") == "error":
            await self.ws.close()
            raise Refused(first["error"]["code"], first["error"].get("message", ""))
        if self.opus:
            import opuslib

            self._enc = opuslib.Encoder(16_000, 1, opuslib.APPLICATION_VOIP)
            await self.ws.send(json.dumps({"type": "session.update", "session": {
                "audio": {"input": {"format": {"type": "audio/opus"}}, "output": {"format": {"type": "audio/opus"}}}}}))
        self._epoch = 0

    async def converse(self, until: float) -> None:
        rx = asyncio.create_task(self._receive())
        tx = asyncio.create_task(self._send_loop())
        try:
            await self.drain_and_stop(until)
            await asyncio.sleep(0.3)  # the last frames reach the server before we hang up
        finally:
            tx.cancel()
        if rx.done() and (err := rx.exception()) is not None:
            raise err
        rx.cancel()

    async def _send_loop(self) -> None:
        t0 = time.monotonic()
        n = 0
        while True:
            n += 1
            wait = t0 + n * FRAME_MS / 1000.0 - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            now = time.monotonic()
            if self.record.shed:
                return  # the server ended the call: the microphone is off
            frame = self.next_frame(now)
            if self.opus:
                await self.ws.send(b"\x01" + self._enc.encode(frame.astype("<i2").tobytes(), frame.size))
            else:
                await self.ws.send(json.dumps({"type": "input_audio_buffer.append",
                                               "audio": base64.b64encode(frame.astype("<i2").tobytes()).decode()}))
            self.sent_frame()  # counted once on the wire (a cancel mid-send does not count)
            if (a := self._answer) is not None and (played := self.ack_due(now)) is not None:
                await self.ws.send(json.dumps({"type": "output_audio_buffer.played", "played_ms": round(played, 1),
                                               "response_id": a.response_id}))

    async def _receive(self) -> None:
        import websockets

        try:
            async for m in self.ws:
                now = time.monotonic()
                if isinstance(m, bytes):
                    epoch = int.from_bytes(m[1:5], "little")
                    if m[:1] == b"\x01" and epoch == self._epoch:
                        self.on_audio(None, FRAME_MS, now)
                    continue
                self._event(json.loads(m), now)
        except websockets.ConnectionClosed as e:
            if self.record.shed:
                self.on_shed(self.record.shed)
                return
            if e.rcvd is not None and e.rcvd.code == 1013:
                self.on_shed(f"closed 1013: {e.rcvd.reason}")
                return
            if not self._stop:
                self.record.closed_by_server = f"{e.rcvd.code if e.rcvd else None} {e.rcvd.reason if e.rcvd else ''}"
                raise

    def _event(self, ev: dict, now: float) -> None:
        t = ev.get("type")
        if t == "response.created":
            self._epoch = ev.get("epoch", 0)
            self.on_response_created(ev["response"]["id"], now)
        elif t == "response.output_audio.delta":
            self.on_audio(ev["response_id"], 1000.0 * len(base64.b64decode(ev["delta"])) / 2 / 24_000, now)
        elif t == "duplex.latency":
            self.on_first_audio_mark(ev["response_id"], ev.get("ttfa_ms"))
        elif t == "output_audio_buffer.cleared":
            self.on_cleared(ev.get("response_id"), now)
        elif t == "response.done":
            r = ev["response"]
            self.on_response_done(r["id"], r["status"], (r.get("status_details") or {}).get("reason"), now)
        elif t == "error":
            self.on_error(ev["error"]["code"])

    async def close(self) -> None:
        await self.ws.close()


class OpusWebSocketCaller(WebSocketCaller):
    transport = "ws-opus"
    wire_rate_hz = 16_000
    opus = True


# --- WebRTC (aiortc as the browser) ------------------------------------------------------------------


class WebRtcCaller(Caller):
    """`POST /v1/realtime/calls`; Opus over RTP both ways, events on `oai-events`."""

    transport = "webrtc"
    wire_rate_hz = 48_000

    async def connect(self) -> None:
        import fractions
        import urllib.error
        import urllib.request

        from aiortc import RTCConfiguration, RTCPeerConnection, RTCSessionDescription
        from aiortc.mediastreams import MediaStreamTrack
        from av import AudioFrame

        caller = self

        class Mic(MediaStreamTrack):
            kind = "audio"

            def __init__(self) -> None:
                super().__init__()
                self.t0: float | None = None
                self.n = 0

            async def recv(self) -> AudioFrame:
                if self.n:
                    # aiortc's sender asks for a frame only once it has encoded and sent the one
                    # before: count that one now. Counting a frame when it is handed over counted
                    # one that a hang-up then kept from leaving (measured: 1-2 per soak run).
                    if caller.record.shed:
                        caller.record.frames_after_shed += 1  # to a call the server has ended: nobody consumes it
                    else:
                        caller.sent_frame()
                if self.t0 is None:
                    self.t0 = time.monotonic()
                wait = self.t0 + self.n * FRAME_MS / 1000.0 - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                pcm = caller.next_frame(time.monotonic())
                f = AudioFrame.from_ndarray(pcm.reshape(1, -1), format="s16", layout="mono")
                f.sample_rate, f.pts, f.time_base = 48_000, self.n * pcm.size, fractions.Fraction(1, 48_000)
                self.n += 1
                return f

        self.pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
        self.mic = Mic()
        self.pc.addTrack(self.mic)
        self.dc = self.pc.createDataChannel("oai-events")
        self._opened = asyncio.Event()
        self._created = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self._in_answer = False
        self.dc.on("message", lambda m: self._event(json.loads(m), time.monotonic()))
        self.pc.on("track", lambda track: self._tasks.append(asyncio.create_task(self._listen(track))))
        await self.pc.setLocalDescription(await self.pc.createOffer())
        req = urllib.request.Request(self.base_url + "/v1/realtime/calls?duplex=1", data=self.pc.localDescription.sdp.encode(),
                                     headers={"Content-Type": "application/sdp", "Authorization": f"Bearer {self.token}"}, method="POST")

        def post() -> tuple[int, str]:
            try:
                with urllib.request.urlopen(req, timeout=30) as r:
                    return r.status, r.read().decode()
            except urllib.error.HTTPError as e:
                return e.code, e.read().decode()

        status, body = await asyncio.to_thread(post)
        if status != 201:
            await self.pc.close()
            try:
                err = json.loads(body)["error"]
            except (ValueError, KeyError):
                err = {"code": f"http_{status}", "message": body[:200]}
            raise Refused(err["code"], err.get("message", ""))
        await self.pc.setRemoteDescription(RTCSessionDescription(sdp=body, type="answer"))
        await asyncio.wait_for(self._created.wait(), 30)

    async def _listen(self, track) -> None:
        from aiortc.mediastreams import MediaStreamError

        try:
            while True:
                f = await track.recv()
                if self._in_answer and np.abs(f.to_ndarray()).max() > 0:
                    self.on_audio(None, 1000.0 * f.samples / f.sample_rate, time.monotonic())
        except MediaStreamError:
            pass

    def _event(self, ev: dict, now: float) -> None:
        t = ev.get("type")
        if t == "session.created":
            self._created.set()
        elif t == "response.created":
            self._in_answer = True
            self.on_response_created(ev["response"]["id"], now)
        elif t == "duplex.latency":
            self.on_first_audio_mark(ev["response_id"], ev.get("ttfa_ms"))
        elif t == "output_audio_buffer.cleared":
            self._in_answer = False
            self.on_cleared(ev.get("response_id"), now)
        elif t == "output_audio_buffer.stopped":
            self._in_answer = False
        elif t == "response.done":
            r = ev["response"]
            self.on_response_done(r["id"], r["status"], (r.get("status_details") or {}).get("reason"), now)
        elif t == "error":
            self.on_error(ev["error"]["code"])

    async def converse(self, until: float) -> None:
        await self.drain_and_stop(until)

    async def close(self) -> None:
        self.mic.stop()  # no more RTP: every frame sent is now on its way
        await asyncio.sleep(0.5)
        await self.pc.close()
        for t in self._tasks:
            t.cancel()


# --- Twilio Media Streams (a phone call) --------------------------------------------------------------


class TwilioCaller(Caller):
    """`WS /v1/telephony/twilio` as Twilio speaks it: μ-law 8 kHz `media`, our `mark`s echoed once played.

    Twilio has no response events: an answer starts with the first media before a mark naming a new
    response ("<response_id>:<ms>"), ends cancelled on `clear`, completed after 600 ms without media.
    """

    transport = "twilio"
    wire_rate_hz = 8_000

    async def connect(self) -> None:
        import websockets

        url = self.base_url.replace("http", "ws", 1) + "/v1/telephony/twilio"
        self.ws = await websockets.connect(url, max_size=1 << 20, open_timeout=30)
        self.sid = f"MZ{self.rng.getrandbits(128):032x}"
        self._seq = 0
        self._pending: list[tuple[float, float]] = []  # media received since the last mark: (t, ms)
        self._marks: list[tuple[str, float]] = []  # (name, ms of the answer before it) to echo once played
        self._last_media = 0.0
        await self._send({"event": "connected", "protocol": "Call", "version": "1.0.0"}, seq=False)
        await self._send({"event": "start", "start": {
            "streamSid": self.sid, "accountSid": "AC" + "0" * 32, "callSid": "CA" + f"{self.index:032x}",
            "tracks": ["inbound"], "customParameters": {"token": self.token},
            "mediaFormat": {"encoding": "audio/x-mulaw", "sampleRate": 8000, "channels": 1}}})
        self._t0 = time.monotonic()

    async def _send(self, msg: dict, seq: bool = True) -> None:
        if seq:
            self._seq += 1
            msg = {**msg, "sequenceNumber": str(self._seq), "streamSid": self.sid}
        await self.ws.send(json.dumps(msg))

    async def converse(self, until: float) -> None:
        rx = asyncio.create_task(self._receive())
        tx = asyncio.create_task(self._send_loop())
        try:
            await self.drain_and_stop(until)
            await asyncio.sleep(0.3)
        finally:
            tx.cancel()
        if rx.done() and (err := rx.exception()) is not None:
            raise err
        if self.record.shed:
            return  # the server closed the stream
        await self._send({"event": "stop", "stop": {"accountSid": "AC" + "0" * 32, "callSid": "CA" + f"{self.index:032x}"}})
        rx.cancel()

    async def _send_loop(self) -> None:
        from realtime.audio import ulaw_encode

        n = 0
        while True:
            n += 1
            wait = self._t0 + n * FRAME_MS / 1000.0 - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            now = time.monotonic()
            if self.record.shed:
                return
            frame = self.next_frame(now)
            await self._send({"event": "media", "media": {"track": "inbound", "chunk": str(n), "timestamp": str(n * FRAME_MS),
                                                          "payload": base64.b64encode(ulaw_encode(frame)).decode()}})
            self.sent_frame()
            a = self._answer
            while self._marks and a is not None and a.playout.played_ms(now) >= self._marks[0][1]:
                await self._send({"event": "mark", "mark": {"name": self._marks.pop(0)[0]}})
            if a is not None and a.status is None and self._last_media and now - self._last_media > 0.6:
                self.on_response_done(a.response_id, "completed", None, now)

    async def _receive(self) -> None:
        import websockets

        try:
            async for m in self.ws:
                now = time.monotonic()
                ev = json.loads(m)
                kind = ev.get("event")
                if ev.get("streamSid") != self.sid:
                    self.on_error("wrong_stream_sid")
                elif kind == "media":
                    payload = base64.b64decode(ev["media"]["payload"])
                    if len(payload) != 160:
                        self.on_error("partial_frame")
                    self._pending.append((now, 1000.0 * len(payload) / 8000))
                    self._last_media = now
                elif kind == "mark":
                    name = ev["mark"]["name"]
                    rid = name.rsplit(":", 1)[0]
                    a = self._answer
                    if a is None or a.response_id != rid:
                        a = self.on_response_created(rid, self._pending[0][0] if self._pending else now)
                        self._marks.clear()
                    for t, ms in self._pending:
                        self.on_audio(rid, ms, t)
                    self._pending.clear()
                    self._marks.append((name, a.playout.received_ms))
                elif kind == "clear":
                    self._pending.clear()
                    self._marks.clear()
                    if self._answer is not None and self._answer.status is None:
                        self.on_cleared(self._answer.response_id, now)
                        self.on_response_done(self._answer.response_id, "cancelled", "turn_detected", now)
                    self._last_media = 0.0
        except websockets.ConnectionClosed as e:
            if e.rcvd is not None and e.rcvd.code == 1013 and "overloaded" in e.rcvd.reason:
                self.on_shed(f"server_overloaded: {e.rcvd.reason}")  # admitted, then ended to keep the others on time
                return
            if e.rcvd is not None and e.rcvd.code == 1013:
                raise Refused("server_at_capacity", e.rcvd.reason) from None
            if not self._stop:
                self.record.closed_by_server = f"{e.rcvd.code if e.rcvd else None} {e.rcvd.reason if e.rcvd else ''}"
                raise

    async def close(self) -> None:
        await self.ws.close()


CALLERS: dict[str, type[Caller]] = {c.transport: c for c in (WebSocketCaller, OpusWebSocketCaller, WebRtcCaller, TwilioCaller)}
