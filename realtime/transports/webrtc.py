"""WebRTC transport (aiortc), signalled like the OpenAI Realtime API's WebRTC mode.

    POST /v1/realtime/calls   body: the SDP offer (application/sdp)  ->  201, body: the SDP answer

The browser sends its microphone as Opus 48 kHz on an audio track and opens a data channel named
`oai-events` that carries the same JSON events as `WS /v1/realtime` (one `RealtimeProtocol` serves
both). Differences, as in OpenAI's WebRTC mode: audio never travels in events, and the server owns the
output buffer. So the protocol runs with `audio_out_of_band` and the runner hands the session's paced
audio to this transport's `TrackAudioOut`, which puts it on our `PacedAudioTrack` (one 20 ms frame per
20 ms of wall time to aiortc); the playback cursor is what that track has actually sent, and a
barge-in drops the track's queue and sends `output_audio_buffer.cleared`.
`output_audio_buffer.started|stopped` bracket each answer's audio.

ICE: no STUN/TURN servers are configured (host candidates only; the offer must carry its candidates,
no trickle). aioice never offers 127.0.0.1; when the gateway listens on loopback we add it, so a
browser on the same machine connects without any network. Behind a 1:1 NAT (a cloud VM, a Kubernetes
pod on the host network) `webrtc.public_host` is the address the answer announces.

Every peer connection belongs to one session and is closed when the session ends (hang-up, page
gone, ICE/DTLS failure, server stop); `live_peer_connections` is exported in /metrics.
"""

from __future__ import annotations

import asyncio
import fractions
import logging
import time
from collections import deque
from collections.abc import AsyncIterator
from http import HTTPStatus

import aioice.ice
import numpy as np
from aiortc import RTCConfiguration, RTCPeerConnection, RTCSessionDescription
from aiortc.mediastreams import MediaStreamError, MediaStreamTrack
from av import AudioFrame

from engine.service_api import AtCapacity
from realtime import client_json
from realtime.audio import StreamResampler
from realtime.http import HttpReply, HttpRequest, HttpRoute, Scope, json_error
from realtime.metrics import GatewayMetrics
from realtime.runner import SessionRunner
from realtime.session import RATE_HZ
from realtime.transports.context import TransportContext
from realtime.transports.websocket import realtime_protocol


log = logging.getLogger("duplex.webrtc")

NAME = "webrtc"
CALLS_PATH = "/v1/realtime/calls"
DATA_CHANNEL = "oai-events"
RTP_RATE_HZ = 48_000
FRAME_SAMPLES = RTP_RATE_HZ // 50  # 20 ms, Opus's frame
MAX_OFFER_BYTES = 64 * 1024
_MAX_LATE_FRAMES = 5  # behind schedule by more than this: restart the clock instead of bursting
SIP_ACTIONS = ("accept", "reject", "refer")


def register(ctx: TransportContext) -> WebRtcCalls:
    calls = WebRtcCalls(ctx)
    ctx.routes.http[CALLS_PATH] = HttpRoute(calls.handle_offer, scope=Scope.SESSION, cors=True)
    ctx.routes.http[CALLS_PATH + "/{call_id}/hangup"] = HttpRoute(calls.hangup, cors=True)
    for action in SIP_ACTIONS:  # OpenAI's SIP call control: there is no SIP side here
        ctx.routes.http[CALLS_PATH + "/{call_id}/" + action] = HttpRoute(_no_sip, cors=True)
    ctx.metrics.webrtc_peers.set_function(lambda: len(calls.peers))
    if _is_loopback(ctx.config.server.host):
        _offer_loopback_candidates()
    ctx.on_stop(calls.close_all)
    return calls


class PacedAudioTrack(MediaStreamTrack):
    """The answer's audio, one 20 ms frame per 20 ms of wall time; silence when there is nothing to say.

    `emitted_ms(response_id)` is the playback cursor: audio of that response handed to the encoder.
    """

    kind = "audio"

    def __init__(self) -> None:
        super().__init__()
        self._queue: deque[tuple[str, np.ndarray]] = deque()
        self._queued = 0
        self._emitted: dict[str, int] = {}
        self._start: float | None = None
        self._pts = 0
        self.underrun_frames = 0  # frames short of audio while an answer was queued and unfinished

    def push(self, response_id: str, pcm48: np.ndarray) -> None:
        if pcm48.size:
            self._queue.append((response_id, pcm48))
            self._queued += pcm48.size
            self._emitted.setdefault(response_id, 0)

    def clear(self) -> None:
        self._queue.clear()
        self._queued = 0

    @property
    def queued_ms(self) -> float:
        return 1000.0 * self._queued / RTP_RATE_HZ

    def emitted_ms(self, response_id: str) -> float:
        return 1000.0 * self._emitted.get(response_id, 0) / RTP_RATE_HZ

    def forget(self, response_id: str) -> None:
        self._emitted.pop(response_id, None)

    async def recv(self) -> AudioFrame:
        if self.readyState != "live":
            raise MediaStreamError
        now = time.monotonic()
        if self._start is None or now - (self._start + self._pts / RTP_RATE_HZ) > _MAX_LATE_FRAMES * 0.02:
            self._start = now - self._pts / RTP_RATE_HZ
        wait = self._start + self._pts / RTP_RATE_HZ - now
        if wait > 0:
            await asyncio.sleep(wait)
        out = np.zeros(FRAME_SAMPLES, np.int16)
        got = 0
        while got < FRAME_SAMPLES and self._queue:
            rid, head = self._queue[0]
            take = min(FRAME_SAMPLES - got, head.size)
            out[got:got + take] = head[:take]
            if take == head.size:
                self._queue.popleft()
            else:
                self._queue[0] = (rid, head[take:])
            self._queued -= take
            self._emitted[rid] = self._emitted.get(rid, 0) + take
            got += take
        frame = AudioFrame.from_ndarray(out.reshape(1, -1), format="s16", layout="mono")
        frame.sample_rate = RTP_RATE_HZ
        frame.pts = self._pts
        frame.time_base = fractions.Fraction(1, RTP_RATE_HZ)
        self._pts += FRAME_SAMPLES
        return frame


class TrackAudioOut:
    """The runner's `AudioOut` for WebRTC: the session's paced 16 kHz audio, resampled to 48 kHz, on the
    paced track; the playback cursor is what the track has handed to the encoder."""

    def __init__(self, track: PacedAudioTrack) -> None:
        self.track = track
        self._resampler = StreamResampler(RATE_HZ, RTP_RATE_HZ)
        self._playing: str | None = None  # response whose audio is in or was in the track
        self._finished: set[str] = set()

    def play(self, response_id: str, pcm: np.ndarray) -> None:
        if self._playing != response_id:
            self._playing = response_id
            self._resampler = StreamResampler(RATE_HZ, RTP_RATE_HZ)  # one stream per answer: no tail of the last
        self.track.push(response_id, self._resampler.process(pcm))

    def finish(self, response_id: str) -> None:
        if response_id == self._playing:
            self.track.push(response_id, self._resampler.flush())
            self._finished.add(response_id)

    def clear(self, response_id: str) -> None:
        self.track.clear()
        if self._playing == response_id:
            self.track.forget(response_id)
            self._playing = None

    def played_ms(self, response_id: str) -> float:
        return self.track.emitted_ms(response_id)

    def take_drained(self) -> str | None:
        rid = self._playing
        if rid is None or rid not in self._finished or self.track.queued_ms > 0:
            return None
        self.track.forget(rid)
        self._finished.discard(rid)
        self._playing = None
        return rid


class DataChannelLink:
    """The runner's link over the `oai-events` data channel; the peer connection's life is the link's."""

    def __init__(self, pc: RTCPeerConnection) -> None:
        self.pc = pc
        self.channel = None
        self._open = asyncio.Event()
        self._inbox: asyncio.Queue = asyncio.Queue(256)
        self.dropped_messages = 0

    def attach(self, channel) -> None:
        self.channel = channel

        @channel.on("message")
        def _on_message(message) -> None:
            try:
                self._inbox.put_nowait(message)
            except asyncio.QueueFull:
                self.dropped_messages += 1  # a flooding client; the session reads at its own pace

        @channel.on("close")
        def _on_close() -> None:
            self.end()

        if channel.readyState == "open":
            self._open.set()
        else:
            channel.on("open", self._open.set)

    def end(self) -> None:
        self._open.set()  # wake a waiting sender: it finds no channel and drops
        try:
            self._inbox.put_nowait(None)
        except asyncio.QueueFull:
            self._inbox.get_nowait()
            self._inbox.put_nowait(None)

    async def messages(self) -> AsyncIterator[str | bytes]:
        while (message := await self._inbox.get()) is not None:
            yield message

    async def send(self, message: str | bytes) -> None:
        await self._open.wait()
        ch = self.channel
        if ch is None or ch.readyState != "open":
            return  # the peer is gone; the runner's reader ends the session
        ch.send(message)
        while ch.bufferedAmount > 256 * 1024 and ch.readyState == "open":
            await asyncio.sleep(0.02)  # SCTP backpressure: the writer waits, the outbound queue bounds it

    async def close(self, code: int, reason: str) -> None:
        # the data channel first, and its close seen through: closing the peer connection at once has aiortc
        # abort the SCTP association, which a browser reports to the page as an error (`sctp-failure`)
        ch = self.channel
        if ch is not None and ch.readyState == "open":
            ch.close()
            for _ in range(50):
                if ch.readyState == "closed":
                    break
                await asyncio.sleep(0.02)
        await self.pc.close()

    def lost(self) -> bool:
        """A WebRTC call is never resumed (its session gets no resume token): the peer connection's end is the call's."""
        return False

    async def opened(self) -> None:
        """Until the data channel is open (or the link ended)."""
        await self._open.wait()


class WebRtcCalls:
    """The calls of this server: SDP offers in, one peer connection per session."""

    def __init__(self, ctx: TransportContext) -> None:
        self.ctx = ctx
        self.links: dict[str, DataChannelLink] = {}  # call id (the session's) -> its data channel (and peer connection)

    @property
    def peers(self) -> list[RTCPeerConnection]:
        """The live peer connections, one per call (exported in /metrics)."""
        return [link.pc for link in self.links.values()]

    async def close_all(self) -> None:
        for pc in self.peers:
            await pc.close()

    async def hangup(self, req: HttpRequest) -> HttpReply:
        """`POST /v1/realtime/calls/{call_id}/hangup`: end that call, as OpenAI's (its session closes as if the
        peer had left)."""
        link = self.links.get(req.params["call_id"])
        if link is None:
            return json_error(HTTPStatus.NOT_FOUND, "call_not_found", f"no call {req.params['call_id']!r} on this server",
                              param="call_id")
        link.end()
        return HttpReply(HTTPStatus.OK, "{}", "application/json")

    async def handle_offer(self, req: HttpRequest) -> HttpReply:
        ctype = req.headers.get("Content-Type", "")
        # an ephemeral key's session config first; the form's own (below) is applied over it
        session_cfg: dict | None = dict(req.credential.grant.session) if req.credential.grant is not None else None
        if ctype.split(";")[0].strip().lower() == "multipart/form-data":  # the openai SDK's calls.create(sdp=, session=)
            form = await req.form()
            try:
                body = form["sdp"]
                if "session" in form:
                    loaded = client_json.loads(form["session"].decode("utf-8"))
                    if not isinstance(loaded, dict):
                        raise ValueError("'session' must be a JSON object")
                    session_cfg = {**(session_cfg or {}), **loaded}
            except (KeyError, UnicodeDecodeError, ValueError, client_json.BadJson) as e:
                return json_error(HTTPStatus.BAD_REQUEST, "invalid_request", f"the form needs an 'sdp' field and an optional "
                                                                             f"'session' JSON object ({e})")
        elif ctype.split(";")[0].strip().lower() == "application/sdp":
            body = await req.read()
        else:
            return json_error(HTTPStatus.UNSUPPORTED_MEDIA_TYPE, "invalid_request",
                              "the offer must be sent as application/sdp or multipart/form-data (sdp, session)")
        try:
            sdp = body.decode("utf-8")
        except UnicodeDecodeError:
            return json_error(HTTPStatus.BAD_REQUEST, "invalid_offer", "the SDP offer is not UTF-8 text")
        if not sdp.startswith("v=0") or "m=audio" not in sdp:
            return json_error(HTTPStatus.BAD_REQUEST, "invalid_offer", "the SDP offer must be an SDP document with an audio m-line")

        admission, open_timeout_s = self.ctx.admission, self.ctx.config.limits.open_timeout_s
        track = PacedAudioTrack()
        pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
        link = DataChannelLink(pc)
        proto = realtime_protocol(self.ctx, admission.new_session(output_frame_ms=20), audio_out_of_band=True,
                                  extensions=req.query.get("duplex", ["0"])[0] == "1")
        if session_cfg is not None:
            proto.preconfigure(session_cfg)  # applied like a session.update before session.created
        try:
            # counted against the cap while its data channel opens; a barge-in truncates at what the track really sent
            runner = admission.open_session(NAME, link, proto, audio_out=TrackAudioOut(track))
        except AtCapacity as e:
            await pc.close()
            return json_error(HTTPStatus.SERVICE_UNAVAILABLE, AtCapacity.code, f"{e}; try again in {e.retry_after_s:g} s",
                              {"Retry-After": str(max(1, round(e.retry_after_s)))})
        session_id = runner.id
        self.links[session_id] = link
        inputs: list[asyncio.Task] = []
        mic = MicCounts()

        @pc.on("datachannel")
        def _on_datachannel(channel) -> None:
            if channel.label == DATA_CHANNEL and link.channel is None:
                link.attach(channel)

        @pc.on("track")
        def _on_track(remote) -> None:
            if remote.kind == "audio":
                mic.receivers = [r for r in pc.getReceivers() if r.track is remote]
                inputs.append(asyncio.create_task(_read_microphone(remote, runner, self.ctx.metrics, mic)))

        @pc.on("connectionstatechange")
        async def _on_state() -> None:
            if pc.connectionState in ("failed", "closed"):
                link.end()

        try:
            await pc.setRemoteDescription(RTCSessionDescription(sdp=sdp, type="offer"))
            pc.addTrack(track)  # answers the offer's audio m-line: sendrecv
            await pc.setLocalDescription(await pc.createAnswer())
        except Exception as e:  # a malformed or unsupported offer
            log.info("session %s: bad offer: %s", session_id, e)
            await pc.close()
            self.links.pop(session_id, None)
            await admission.abandon(runner)
            return json_error(HTTPStatus.BAD_REQUEST, "invalid_offer", f"the SDP offer could not be used: {e}")

        async def run() -> None:
            try:
                await asyncio.wait_for(link.opened(), open_timeout_s)
            except asyncio.TimeoutError:
                log.info("session %s: no %r data channel within %.0f s; closing", session_id, DATA_CHANNEL, open_timeout_s)
                link.end()
            try:
                await admission.run(runner)
            finally:
                for t in inputs:
                    t.cancel()
                track.stop()
                await pc.close()
                self.links.pop(session_id, None)
                await mic.account(runner, self.ctx.metrics)

        admission.background(run())
        answer = pc.localDescription.sdp
        if (public := self.ctx.config.webrtc.public_host) is not None:
            answer = announce_host(answer, public)
        return HttpReply(HTTPStatus.CREATED, answer, "application/sdp", {"Location": f"{CALLS_PATH}/{session_id}"})


async def _no_sip(req: HttpRequest) -> HttpReply:
    return json_error(HTTPStatus.BAD_REQUEST, "sip_not_supported",
                      f"this server has no SIP calls to {req.path.rsplit('/', 1)[-1]}: its calls are WebRTC (hang one up with "
                      f"POST {CALLS_PATH}/{{call_id}}/hangup)")


def announce_host(sdp: str, host: str) -> str:
    """The answer with `host` (webrtc.public_host) as the address of its host candidates and its c= lines:
    behind a 1:1 NAT the browser's connectivity checks go to the public address, which forwards the same
    ports to ours. Candidates that become duplicates (two interfaces, one public address) keep the first."""
    family = "IP6" if ":" in host else "IP4"
    out, seen = [], set()
    for line in sdp.splitlines():
        if line.startswith("a=candidate:") and " typ host" in line:
            f = line.split()
            f[4] = host  # foundation component transport priority ADDRESS port typ host ...
            key = (f[1], f[2], host, f[5])
            if key in seen:
                continue
            seen.add(key)
            line = " ".join(f)
        elif line.startswith("c=IN "):
            line = f"c=IN {family} {host}"
        out.append(line)
    return "\r\n".join(out) + "\r\n"


class MicCounts:
    """Every RTP audio frame that reached us is consumed by the session or dropped with a counted reason."""

    def __init__(self) -> None:
        self.receivers: list = []
        self.decoded = 0  # frames out of aiortc's decoder
        self.queue_full = 0  # dropped: the session's inbound queue was full

    async def account(self, runner: SessionRunner, metrics: GatewayMetrics) -> None:
        """At hang-up: frames decoded but not consumed, and packets still in aiortc's jitter buffer."""
        drop = metrics.frames_dropped
        tail = self.decoded - self.queue_full - runner.session.stats.input_frames
        if tail > 0:
            drop.labels("webrtc", "in_queue_at_hangup").inc(tail)
        received = lost = 0
        for receiver in self.receivers:
            try:
                stats = await receiver.getStats()
            except Exception:  # stats of a torn-down transport: nothing more to count
                continue
            inbound = [st for st in stats.values() if getattr(st, "type", "") == "inbound-rtp"]
            received += sum(st.packetsReceived for st in inbound)
            lost += sum(max(0, st.packetsLost) for st in inbound)
        if received > self.decoded:
            drop.labels("webrtc", "jitter_buffer_at_hangup").inc(received - self.decoded)
        if lost:  # sequence gaps: sent, never received (a full UDP socket buffer on an overloaded host)
            drop.labels("webrtc", "lost_in_network").inc(lost)


async def _read_microphone(remote, runner: SessionRunner, metrics: GatewayMetrics, counts: MicCounts) -> None:
    """Decoded RTP audio -> int16 16 kHz mono -> the session (through the runner's queue)."""
    resampler: StreamResampler | None = None
    try:
        while True:
            frame = await remote.recv()
            counts.decoded += 1
            pcm = frame.to_ndarray()
            channels = len(frame.layout.channels)
            pcm = pcm.reshape(-1, channels).mean(axis=1).astype(np.int16) if channels > 1 else pcm.reshape(-1)
            if pcm.dtype != np.int16:
                pcm = np.clip(pcm * 32768.0, -32768, 32767).astype(np.int16)
            if resampler is None or resampler.in_rate_hz != frame.sample_rate:
                resampler = StreamResampler(frame.sample_rate, RATE_HZ)
            pcm16 = resampler.process(pcm)  # may be empty at first (soxr's delay): still one frame consumed
            if not runner.push_audio(pcm16):
                counts.queue_full += 1
                metrics.frames_dropped.labels("webrtc", "inbound_queue_full").inc()
    except (MediaStreamError, asyncio.CancelledError):
        return


def _is_loopback(host: str) -> bool:
    return host in ("127.0.0.1", "localhost", "::1") or host.startswith("127.")


def _offer_loopback_candidates() -> None:
    """aioice leaves 127.0.0.1 out of its host candidates; a loopback-only server needs it."""
    if getattr(aioice.ice.get_host_addresses, "_duplex_loopback", False):
        return
    original = aioice.ice.get_host_addresses

    def with_loopback(use_ipv4: bool, use_ipv6: bool) -> list[str]:
        addresses = original(use_ipv4, use_ipv6)
        return [*addresses, "127.0.0.1"] if use_ipv4 and "127.0.0.1" not in addresses else addresses

    setattr(with_loopback, "_duplex_loopback", True)  # a mark on the function itself: patched once per process
    aioice.ice.get_host_addresses = with_loopback
