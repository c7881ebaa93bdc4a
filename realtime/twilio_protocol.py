"""Twilio Media Streams (bidirectional), sans-I/O: the protocol behind `WS /v1/telephony/twilio`.

Messages as Twilio documents them (https://www.twilio.com/docs/voice/media-streams/websocket-messages),
all JSON text frames:

    Twilio -> us   connected, start {streamSid, accountSid, callSid, tracks, customParameters, mediaFormat},
                   media {track, chunk, timestamp, payload}, dtmf {track, digit}, mark {name}, stop;
                   every one but `connected` has `sequenceNumber` and `streamSid`
    us -> Twilio   media {payload}   one 20 ms frame each: 160 bytes of 8 kHz mu-law, base64
                   mark {name}       after each chunk of media; Twilio echoes it once the audio before
                                     it has played (or when a `clear` drops it)
                   clear             drop the audio Twilio holds but has not played yet

    proto = TwilioProtocol(session)
    proto.receive(message, now)                   # a Twilio message
    proto.send_session_events(session.events())   # session events -> media / mark / clear
    for msg in proto.data_to_send(): ...          # JSON text for the socket

The playback cursor comes from echoed marks only: a mark is named `<response_id>:<ms>`, the wire
audio of that response sent before it, so its echo means those `ms` have played. On barge-in the
Session truncates at the last echoed mark; we send `clear`, and the marks Twilio returns for the
cleared audio (and any late engine audio) belong to a response that is no longer live: ignored.

Bad input never raises: each fault is counted by kind, logged with the streamSid (the first few of
each kind), and answered by skipping the message, or, when the stream cannot go on (a media format
we cannot decode, a `start` without a streamSid), by closing it (`closing`).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import logging
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from enum import IntEnum
from typing import ClassVar
from urllib.parse import urlsplit, urlunsplit
from xml.sax.saxutils import quoteattr

from engine.service_api import ConversationOptions
from realtime import client_json
from realtime.audio import ulaw_decode, ulaw_encode
from realtime.credentials import same_secret
from realtime.halfband import Downsampler, Upsampler
from realtime.session_input import AudioIn, Played, SessionInput
from realtime.session import (
    InputTranscriptDone,
    InputTranscriptFailed,
    OutputCleared,
    ResponseAudio,
    ResponseCreated,
    ResponseDone,
    ResponseStatus,
    Session,
    SessionError,
    SessionEvent,
)

log = logging.getLogger("duplex.twilio")

MULAW_RATE_HZ = 8_000
FRAME_MS = 20  # one outbound media message
FRAME_BYTES = MULAW_RATE_HZ * FRAME_MS // 1000  # 160
ULAW_SILENCE = b"\xff"  # mu-law code of sample 0
DTMF_DIGITS = "0123456789*#ABCD"
MEDIA_FORMAT = {"encoding": "audio/x-mulaw", "sampleRate": MULAW_RATE_HZ, "channels": 1}

CLOSE_NORMAL = 1000
CLOSE_PROTOCOL_ERROR = 1002
CLOSE_UNSUPPORTED_DATA = 1003


class StreamState(IntEnum):
    """Ordered: a stream only moves forward."""

    AWAITING_START = 0  # connected; no `start` yet (media is refused)
    STREAMING = 1
    STOPPED = 2  # `stop`, the end-call digit, or a fault that ends the stream: input is ignored


@dataclass(frozen=True)
class StreamStart:
    """The `start` message: who is calling and with what."""

    stream_sid: str
    account_sid: str
    call_sid: str
    tracks: tuple[str, ...]
    custom_parameters: dict[str, str]  # the TwiML <Parameter> pairs (our stream token travels here)


@dataclass(frozen=True)
class TwilioLimits:
    max_payload_bytes: int = 8_000  # one inbound media payload (1 s of audio); larger ones are skipped
    logged_faults_per_kind: int = 3  # per stream; the rest are only counted


@dataclass
class _Playback:
    """Outbound state of the live response: the one whose marks move the cursor."""

    response_id: str | None = None  # None: no response, or it was cleared (its marks are stale)
    sent_ms: int = 0  # wire audio sent for it, whole 20 ms frames
    echoed_ms: int = 0  # the last mark Twilio echoed for it


@dataclass
class StreamStats:
    media_in: int = 0  # inbound media frames decoded
    media_out: int = 0  # outbound media frames sent
    marks_sent: int = 0
    marks_echoed: int = 0  # echoes that moved the cursor
    clears: int = 0
    digits: list[str] = field(default_factory=list)  # DTMF, in order


class TwilioProtocol:
    resumable = False  # a Twilio stream is never resumed (Twilio reconnects by calling again)

    def __init__(self, session: Session, limits: TwilioLimits | None = None, end_call_digit: str | None = "#",
                 on_fault: Callable[[str], None] | None = None, options: ConversationOptions | None = None,
                 log_text: bool = True) -> None:
        """`log_text`: the call's text (the caller's transcripts, the model's text) is logged at INFO."""
        self.session = session  # the runner's: this machine reads only its id
        self.log_text = log_text
        self.options = options or ConversationOptions()  # the server's session defaults: a call cannot change them
        self.client_errors = 0  # Twilio gets no error events: its faults are counted by kind (`faults`)
        self.offered_tools = False  # a call has no tools
        self.limits = limits or TwilioLimits()
        self.end_call_digit = end_call_digit
        self.state = StreamState.AWAITING_START
        self.start: StreamStart | None = None
        self.closing: tuple[int, str] | None = None  # the runner closes the socket with this
        self.stats = StreamStats()
        self.faults: Counter[str] = Counter()
        self._on_fault = on_fault
        self._out: list[str | bytes] = []
        self._inputs: list[SessionInput] = []
        self._upsampler = Upsampler()  # one stream per direction: no clicks at 20 ms frame edges
        self._encoder = _FrameEncoder()
        self._playback = _Playback()
        self._last_sequence: int | None = None

    @property
    def stream_sid(self) -> str | None:
        return self.start.stream_sid if self.start else None

    # ---- the WireProtocol interface (realtime/runner.py) ----
    def open(self) -> None:
        """Twilio speaks first (`connected`, `start`); nothing to send."""

    def data_to_send(self) -> list[str | bytes]:
        out, self._out = self._out, []
        return out

    def engine_options(self, output_modalities: tuple[str, ...] | None = None,
                       max_output_tokens: int | str | None = None) -> ConversationOptions:
        return self.options  # a call always answers in audio

    def take_engine_options(self) -> None:
        return None  # Twilio has no way to change them mid-call

    tracing = None  # a call has no session.tracing (its spans would have no client to ask for them)
    model = "duplex-opuslm"  # never reported: a call is not traced

    def playback_stopped(self, response_id: str) -> None:
        """Never called: Twilio's audio travels in `media` messages, not on a transport's own `AudioOut`."""

    def resumed_message(self, last_seq: int, replayed: int, missed: int) -> str:
        raise RuntimeError("a Twilio stream is never resumed (it has no resume token)")

    def error(self, code: str, message: str, retry_after_s: float | None = None) -> None:
        """A server-side error (idle timeout, shutdown, engine failure, overload): Twilio has no error message;
        log it (the close's code and reason carry an overload's retry: CloseReason.SERVER_OVERLOADED, 1013)."""
        log.warning("twilio stream %s: %s: %s", self.stream_sid or "-", code, message)

    def receive_audio(self, pcm, now: float) -> None:
        self._inputs.append(AudioIn(pcm))

    def inputs(self) -> list[SessionInput]:
        """What the call asked of the session since the last call, in order (the runner applies them)."""
        out, self._inputs = self._inputs, []
        return out

    def input_refused(self, error: SessionError, event_id: str | None) -> None:
        self._fault("session_error", f"{error.code}: {error.message}")  # not raised in VAD mode; counted if it were

    def receive(self, message: str | bytes, now: float) -> None:
        if self.state is StreamState.STOPPED:
            return  # after stop or a fatal fault nothing more is read
        if isinstance(message, bytes):
            return self._fault("binary_frame", f"{len(message)} bytes (Twilio sends JSON text frames)")
        try:
            msg = client_json.loads(message)
        except client_json.BadJson as e:
            return self._fault("invalid_json", str(e))
        if not isinstance(msg, dict):
            return self._fault("invalid_json", "a message must be a JSON object")
        event = msg.get("event")
        handler = self._HANDLERS.get(event) if isinstance(event, str) else None
        if handler is None:
            return self._fault("unknown_event", f"event {str(event)[:40]!r}", msg)
        if self.start is not None and msg.get("streamSid") not in (None, self.start.stream_sid):
            return self._fault("wrong_stream_sid", f"{str(msg.get('streamSid'))[:40]!r} on a {event} message", msg)
        self._check_sequence(msg)
        handler(self, msg, now)

    # ---- Twilio -> us ----
    def _on_connected(self, msg: dict, now: float) -> None:
        log.debug("twilio: connected (protocol %s, version %s)", msg.get("protocol"), msg.get("version"))

    def _on_start(self, msg: dict, now: float) -> None:
        if self.state is not StreamState.AWAITING_START:
            return self._fault("duplicate_start", "a second start message", msg)
        start = msg.get("start")
        if not isinstance(start, dict):
            return self._stop_on_fault("bad_start", "'start' must be an object", CLOSE_PROTOCOL_ERROR, msg)
        sid = start.get("streamSid", msg.get("streamSid"))
        if not isinstance(sid, str) or not sid:
            return self._stop_on_fault("bad_start", "start has no streamSid", CLOSE_PROTOCOL_ERROR, msg)
        fmt = start.get("mediaFormat")
        if not isinstance(fmt, dict) or any(fmt.get(k) != v for k, v in MEDIA_FORMAT.items()):
            return self._stop_on_fault("wrong_media_format", f"mediaFormat {str(fmt)[:120]} (we take {MEDIA_FORMAT})",
                                       CLOSE_UNSUPPORTED_DATA, msg)
        params = start.get("customParameters") or {}
        tracks = start.get("tracks") or ["inbound"]
        self.start = StreamStart(
            stream_sid=sid, account_sid=str(start.get("accountSid", "")), call_sid=str(start.get("callSid", "")),
            tracks=tuple(str(t) for t in tracks) if isinstance(tracks, list) else ("inbound",),
            custom_parameters={str(k): str(v) for k, v in params.items()} if isinstance(params, dict) else {},
        )
        self.state = StreamState.STREAMING
        log.info("twilio stream %s: start (call %s, tracks %s, session %s)", sid, self.start.call_sid,
                 ",".join(self.start.tracks), self.session.id)

    def _on_media(self, msg: dict, now: float) -> None:
        if self.state is not StreamState.STREAMING:
            return self._fault("media_before_start", "media before start: frame skipped", msg)
        media = msg.get("media")
        if not isinstance(media, dict) or not isinstance(media.get("payload"), str):
            return self._fault("bad_media", "media without a string payload: frame skipped")
        if media.get("track", "inbound") != "inbound":
            return  # a fork's outbound track (our own audio): not the caller
        payload = media["payload"]
        if len(payload) * 3 // 4 > self.limits.max_payload_bytes:
            return self._fault("payload_too_large", f"{len(payload)} base64 characters: frame skipped")
        try:
            audio = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            return self._fault("invalid_base64", f"chunk {media.get('chunk')}: frame skipped")
        if not audio:
            return self._fault("empty_payload", f"chunk {media.get('chunk')}: frame skipped")
        if len(audio) != FRAME_BYTES:  # mu-law has no framing: any byte count is that many samples
            self._fault("odd_payload_size", f"chunk {media.get('chunk')}: {len(audio)} bytes, not {FRAME_BYTES} (used)")
        self.stats.media_in += 1
        self._inputs.append(AudioIn(self._upsampler.process(ulaw_decode(audio))))

    def _on_dtmf(self, msg: dict, now: float) -> None:
        if self.state is not StreamState.STREAMING:
            return self._fault("media_before_start", "dtmf before start: skipped", msg)
        dtmf = msg.get("dtmf")
        digit = dtmf.get("digit") if isinstance(dtmf, dict) else None
        if not isinstance(digit, str) or len(digit) != 1 or digit not in DTMF_DIGITS:
            return self._fault("bad_dtmf", f"digit {str(digit)[:10]!r}: skipped")
        self.stats.digits.append(digit)
        log.info("twilio stream %s: DTMF %s", self.stream_sid, digit)
        if digit == self.end_call_digit:
            self._stop(CLOSE_NORMAL, f"caller pressed {digit}")

    def _on_mark(self, msg: dict, now: float) -> None:
        mark = msg.get("mark")
        name = mark.get("name") if isinstance(mark, dict) else None
        parsed = parse_mark(name) if isinstance(name, str) else None
        if parsed is None:
            return self._fault("bad_mark", f"mark {str(name)[:60]!r} is not one of ours: skipped")
        response_id, ms = parsed
        pb = self._playback
        if response_id != pb.response_id:
            return  # stale: a cleared or older response (Twilio returns cleared marks at once)
        if ms < pb.echoed_ms or ms > pb.sent_ms:
            return self._fault("bad_mark", f"mark {name!r} out of order (last echoed {pb.echoed_ms} ms, sent {pb.sent_ms} ms)")
        pb.echoed_ms = ms
        self.stats.marks_echoed += 1
        self._inputs.append(Played(float(ms), response_id=response_id))

    def _on_stop(self, msg: dict, now: float) -> None:
        log.info("twilio stream %s: stop", self.stream_sid or msg.get("streamSid"))
        self._stop(CLOSE_NORMAL, "stream stopped")

    _HANDLERS: ClassVar[dict] = {"connected": _on_connected, "start": _on_start, "media": _on_media, "dtmf": _on_dtmf,
                 "mark": _on_mark, "stop": _on_stop}

    # ---- session events -> Twilio ----
    def send_session_events(self, events: list[SessionEvent]) -> None:
        for ev in events:
            if isinstance(ev, ResponseCreated):
                self._encoder.reset()
                self._playback = _Playback(ev.response_id)  # nothing has played until a mark says so (SessionLimits.acked_playback)
            elif isinstance(ev, ResponseAudio):
                if ev.response_id == self._playback.response_id:  # else: late audio of a cleared response
                    self._send_media(self._encoder.encode(ev.pcm))
            elif isinstance(ev, OutputCleared):
                if ev.response_id == self._playback.response_id:
                    self._clear()
            elif isinstance(ev, ResponseDone):
                if ev.response_id == self._playback.response_id and ev.status is ResponseStatus.COMPLETED:
                    self._send_media(self._encoder.flush())  # the last frame padded with silence
                else:
                    self._encoder.reset()
                if ev.transcript and self.log_text:
                    log.info("twilio stream %s: assistant (%s, %s): %s", self.stream_sid, ev.response_id, ev.status.name.lower(),
                             ev.transcript)
            elif isinstance(ev, InputTranscriptDone) and self.log_text:
                log.info("twilio stream %s: caller (%s): %s", self.stream_sid, ev.item_id, ev.transcript)
            elif isinstance(ev, InputTranscriptFailed):
                log.warning("twilio stream %s: the caller's transcript (%s) failed: %s: %s", self.stream_sid, ev.item_id, ev.code,
                            ev.message)
            # speech started/stopped, text deltas, commits: Twilio has no message for them (a call's text is logged whole)

    def _send_media(self, frames: list[bytes]) -> None:
        pb = self._playback
        if not frames or self.start is None or self.state is StreamState.STOPPED or pb.response_id is None:
            return
        for f in frames:
            self._emit({"event": "media", "streamSid": self.start.stream_sid, "media": {"payload": base64.b64encode(f).decode("ascii")}})
        pb.sent_ms += FRAME_MS * len(frames)
        self.stats.media_out += len(frames)
        self._emit({"event": "mark", "streamSid": self.start.stream_sid, "mark": {"name": mark_name(pb.response_id, pb.sent_ms)}})
        self.stats.marks_sent += 1

    def _clear(self) -> None:
        self._encoder.reset()
        self._playback = _Playback()
        if self.start is not None and self.state is StreamState.STREAMING:
            self._emit({"event": "clear", "streamSid": self.start.stream_sid})
            self.stats.clears += 1

    def _emit(self, msg: dict) -> None:
        self._out.append(json.dumps(msg, separators=(",", ":")))

    # ---- faults ----
    def _check_sequence(self, msg: dict) -> None:
        seq = msg.get("sequenceNumber")
        if seq is None:
            return
        try:
            n = int(seq)
        except (TypeError, ValueError):
            return self._fault("bad_sequence_number", f"sequenceNumber {str(seq)[:20]!r}", msg)
        if self._last_sequence is not None and n != self._last_sequence + 1:
            self._fault("sequence_gap", f"sequenceNumber {n} after {self._last_sequence} (message used)", msg)
        self._last_sequence = n

    def _fault(self, kind: str, detail: str, msg: dict | None = None) -> None:
        self.faults[kind] += 1
        if self._on_fault is not None:
            self._on_fault(kind)
        n = self.faults[kind]
        if n <= self.limits.logged_faults_per_kind:
            sid = self.stream_sid or _sid_of(msg) or "-"
            more = " (further ones only counted)" if n == self.limits.logged_faults_per_kind else ""
            log.warning("twilio stream %s: %s: %s%s", str(sid)[:64], kind, detail, more)

    def _stop_on_fault(self, kind: str, detail: str, code: int, msg: dict | None = None) -> None:
        self._fault(kind, detail + ": stream closed", msg)
        self._stop(code, kind)

    def _stop(self, code: int, reason: str) -> None:
        self.state = StreamState.STOPPED
        self.closing = self.closing or (code, reason)


def _sid_of(msg: dict | None) -> str | None:
    if not isinstance(msg, dict):
        return None
    start = msg.get("start")
    return msg.get("streamSid") or (start.get("streamSid") if isinstance(start, dict) else None)


class _FrameEncoder:
    """16 kHz PCM -> whole 160-byte mu-law frames; the remainder waits for more audio or `flush`."""

    def __init__(self) -> None:
        self._downsampler = Downsampler()
        self._pending = b""

    def encode(self, pcm16k) -> list[bytes]:
        return self._frames(ulaw_encode(self._downsampler.process(pcm16k)), final=False)

    def flush(self) -> list[bytes]:
        """End of a response: the filter's tail, the last frame padded with silence."""
        return self._frames(ulaw_encode(self._downsampler.flush()), final=True)

    def reset(self) -> None:
        self._downsampler.reset()
        self._pending = b""

    def _frames(self, data: bytes, final: bool) -> list[bytes]:
        data = self._pending + data
        whole = len(data) // FRAME_BYTES
        frames = [data[k * FRAME_BYTES : (k + 1) * FRAME_BYTES] for k in range(whole)]
        self._pending = data[whole * FRAME_BYTES :]
        if final and self._pending:
            frames.append(self._pending.ljust(FRAME_BYTES, ULAW_SILENCE))
            self._pending = b""
        return frames


# --- mark names ------------------------------------------------------------------------------------


def mark_name(response_id: str, sent_ms: int) -> str:
    return f"{response_id}:{sent_ms}"


def parse_mark(name: str) -> tuple[str, int] | None:
    """`<response_id>:<ms>` -> (response_id, ms); None for a name we did not make."""
    rid, sep, ms = name.rpartition(":")
    if not sep or not rid or not ms.isdigit() or len(ms) > 9:
        return None
    return rid, int(ms)


# --- TwiML and the webhook signature ---------------------------------------------------------------


def stream_url(base_url: str, path: str) -> str:
    """The wss:// URL Twilio connects to, from our public base URL (http(s):// or ws(s)://)."""
    parts = urlsplit(base_url)
    scheme = {"http": "ws", "https": "wss"}.get(parts.scheme, parts.scheme)
    return urlunsplit((scheme, parts.netloc, parts.path.rstrip("/") + path, "", ""))


def render_twiml(url: str, parameters: dict[str, str]) -> str:
    """`<Connect><Stream>`: a bidirectional stream to `url`; `parameters` arrive as start.customParameters."""
    params = "".join(f"<Parameter name={quoteattr(k)} value={quoteattr(v)}/>" for k, v in parameters.items())
    return (f'<?xml version="1.0" encoding="UTF-8"?>\n<Response><Connect><Stream url={quoteattr(url)}>{params}'
            "</Stream></Connect></Response>\n")


def twilio_signature(auth_token: str, url: str, params: Iterable[tuple[str, str]]) -> str:
    """X-Twilio-Signature: base64(HMAC-SHA1(auth token, url + each POST parameter's name and value, sorted by name))."""
    data = url + "".join(k + v for k, v in sorted(params))
    return base64.b64encode(hmac.new(auth_token.encode(), data.encode("utf-8", "surrogatepass"), hashlib.sha1).digest()).decode("ascii")


def signature_valid(auth_token: str, url: str, params: Iterable[tuple[str, str]], signature: str) -> bool:
    """Checks `url` as given and with its default port added or removed (Twilio signs the URL as configured)."""
    params = list(params)
    return any(same_secret(signature, twilio_signature(auth_token, u, params)) for u in _port_variants(url))


def _port_variants(url: str) -> list[str]:
    parts = urlsplit(url)
    default = {"https": 443, "http": 80}.get(parts.scheme)
    if default is None or parts.hostname is None:
        return [url]
    host = parts.hostname if ":" not in parts.hostname else f"[{parts.hostname}]"
    userinfo = parts.netloc.rpartition("@")[0]
    prefix = f"{userinfo}@" if userinfo else ""
    with_port = urlunsplit(parts._replace(netloc=f"{prefix}{host}:{parts.port or default}"))
    without = urlunsplit(parts._replace(netloc=f"{prefix}{host}")) if parts.port in (None, default) else url
    return list(dict.fromkeys([url, with_port, without]))
