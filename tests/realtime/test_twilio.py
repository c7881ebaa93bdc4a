"""The Twilio Media Streams bridge: the sans-I/O protocol, TwiML and its signature, and a call over a real socket.

The simulated Twilio (`TwilioPeer`) is written from Twilio's documentation
(https://www.twilio.com/docs/voice/media-streams/websocket-messages, /docs/voice/twiml/stream,
/docs/usage/security), not from our server: it fetches the TwiML like a phone number's webhook (signed
with X-Twilio-Signature), opens the <Stream> it names, sends `connected`, `start` (the <Parameter>s
as customParameters) and the caller's voice as 20 ms mu-law `media` at real-time pace, plays our
`media` at real-time pace, echoes each `mark` once the audio queued before it has played, and on
`clear` drops the unplayed audio and returns the pending marks at once. Its G.711 is CPython's
`audioop`, not ours.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import json
import logging
import time
import urllib.error
import urllib.parse
import urllib.request
import warnings
import xml.etree.ElementTree as ET
from collections import deque

import numpy as np
import pytest
import soxr
from rt_helpers import running_gateway, silence

from realtime.config import config_from_dict
from realtime.halfband import DELAY_SAMPLES, Downsampler, Upsampler
from realtime.messages import CloseReason, Closing
from realtime.session import CancelResponse, Session, SessionLimits
from realtime.transports.twilio import TicketBook
from realtime.twilio_protocol import (
    FRAME_BYTES,
    StreamState,
    TwilioProtocol,
    mark_name,
    parse_mark,
    render_twiml,
    signature_valid,
    stream_url,
    twilio_signature,
)
from realtime.session_input import apply_inputs
from realtime.vad import VadParams

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    import audioop  # the peer's G.711: independent of realtime/audio.py

TOKEN = "test-token"
TWILIO_AUTH_TOKEN = "twilio-auth-token-for-tests"
CAPACITY = 3
MAX_RESPONSE_MS = 8000.0
SID = "MZ00000000000000000000000000000001"
FORMAT = {"encoding": "audio/x-mulaw", "sampleRate": 8000, "channels": 1}


def ulaw(pcm8k: np.ndarray) -> bytes:
    return audioop.lin2ulaw(pcm8k.astype("<i2").tobytes(), 2)


def unulaw(data: bytes) -> np.ndarray:
    return np.frombuffer(audioop.ulaw2lin(data, 2), dtype="<i2").astype(np.int16)


def snr_db(ref: np.ndarray, got: np.ndarray) -> float:
    ref, got = ref.astype(np.float64), got.astype(np.float64)
    return 10 * np.log10(np.sum(ref**2) / max(np.sum((ref - got) ** 2), 1e-9))


# ==== sans-I/O: the protocol over a real Session, no sockets ===========================================


class Wire:
    """Twilio's messages as the docs show them, with sequence numbers counting from 1."""

    def __init__(self, sid: str = SID) -> None:
        self.sid, self.seq = sid, 0

    def _msg(self, event: str, **body) -> str:
        self.seq += 1
        return json.dumps({"event": event, "sequenceNumber": str(self.seq), "streamSid": self.sid, **body})

    def connected(self) -> str:
        return json.dumps({"event": "connected", "protocol": "Call", "version": "1.0.0"})

    def start(self, fmt: dict = FORMAT, params: dict | None = None) -> str:
        return self._msg("start", start={"streamSid": self.sid, "accountSid": "AC1", "callSid": "CA1", "tracks": ["inbound"],
                                         "customParameters": params or {"token": "t"}, "mediaFormat": fmt})

    def media(self, data: bytes, chunk: int = 1, track: str = "inbound") -> str:
        return self._msg("media", media={"track": track, "chunk": str(chunk), "timestamp": str(20 * chunk),
                                         "payload": base64.b64encode(data).decode()})

    def mark(self, name: str) -> str:
        return self._msg("mark", mark={"name": name})

    def dtmf(self, digit: str) -> str:
        return self._msg("dtmf", dtmf={"track": "inbound_track", "digit": digit})

    def stop(self) -> str:
        return self._msg("stop", stop={"accountSid": "AC1", "callSid": "CA1"})


PHONE_VAD = VadParams()


def started(vad: VadParams | None = PHONE_VAD, **kw) -> tuple[TwilioProtocol, Wire]:
    proto, wire = TwilioProtocol(Session("sess_t", vad, SessionLimits(output_frame_ms=20, lead_ms=100.0, acked_playback=True)), **kw), Wire()
    feed(proto, wire.connected(), 0.0)
    feed(proto, wire.start(), 0.0)
    assert proto.state is StreamState.STREAMING and proto.stream_sid == SID
    return proto, wire


def feed(proto: TwilioProtocol, message: str | bytes, now: float) -> None:
    """One message from Twilio, its inputs applied to the session, as the runner does."""
    proto.receive(message, now)
    apply_inputs(proto, proto.session, now)


def out(proto: TwilioProtocol, now: float = 0.0) -> list[dict]:
    """What the socket would carry: the call's inputs applied and the session's events turned into
    messages first, as the runner does."""
    apply_inputs(proto, proto.session, now)
    proto.send_session_events(proto.session.events())
    return [json.loads(m) for m in proto.data_to_send()]


def answer(proto: TwilioProtocol, pcm16k: np.ndarray, t0: float = 1.0, until: float = 60.0) -> tuple[str, list[dict]]:
    """A response whose engine audio is `pcm16k`, paced out in simulated time; the wire messages."""
    s = proto.session
    rid = s.receive_response_create(t0)
    s.receive_engine_chunk(rid, pcm16k, "", True, None, t0)
    msgs, now = [], t0
    while now < until and not s.response.status.finished:
        due = s.poll_audio(now)
        proto.send_session_events(s.events())
        msgs += out(proto)
        now = due if due is not None and due > now else now + 0.02
    return rid, msgs


def test_halfband_streaming_equals_one_shot_and_filters():
    rng = np.random.default_rng(0)
    band = lambda n, rate: sum(np.sin(2 * np.pi * hz * np.arange(n) / rate + rng.uniform(0, 6)) for hz in range(200, 3400, 150))
    x8 = (band(8000, 8000) * 1000).astype(np.int16)  # telephone band: 200 .. 3350 Hz
    x16 = (rng.standard_normal(16000) * 3000).astype(np.int16)
    up, down = Upsampler(), Downsampler()
    cuts = np.cumsum(rng.integers(1, 400, 100))
    up_chunks = np.concatenate([up.process(c) for c in np.split(x8, cuts[cuts < x8.size])])
    down_chunks = np.concatenate([down.process(c) for c in np.split(x16, cuts[cuts < x16.size])])
    assert np.array_equal(up_chunks, Upsampler().process(x8)) and up_chunks.size == 16000  # exact, and nothing held back
    assert np.array_equal(down_chunks, Downsampler().process(x16)) and down_chunks.size == 8000
    # against soxr (offline, HQ) once the 63-sample group delay is removed
    d = DELAY_SAMPLES
    assert snr_db(soxr.resample(x8, 8000, 16000)[: 16000 - d], up_chunks[d:]) > 45.0  # measured 57 dB
    t = np.arange(16000) / 16000
    tone = lambda hz: (10000 * np.sin(2 * np.pi * hz * t)).astype(np.int16)
    rms = lambda y: np.sqrt(np.mean(y[200:-200].astype(np.float64) ** 2))
    assert abs(20 * np.log10(rms(Downsampler().process(tone(1000))) / rms(tone(1000)))) < 0.1  # speech band: flat
    assert 20 * np.log10(rms(Downsampler().process(tone(5000))) / rms(tone(5000))) < -60  # would alias to 3 kHz


def test_inbound_audio_resampled_as_one_stream():
    """20 ms frames through the protocol equal one-shot resampling (no clicks at frame edges)."""
    proto, wire = started(vad=None)
    t = np.arange(8000) / 8000
    pcm8 = (8000 * np.sin(2 * np.pi * 440 * t) * np.sin(2 * np.pi * 3 * t)).astype(np.int16)
    data = ulaw(pcm8)
    for k in range(0, len(data), FRAME_BYTES):
        feed(proto, wire.media(data[k : k + FRAME_BYTES], chunk=k // FRAME_BYTES + 1), 0.0)
    proto.session.receive_commit(1.0)
    got = next(c.pcm for c in proto.session.commands() if hasattr(c, "pcm"))
    assert got.size == 16000 and np.array_equal(got, Upsampler().process(unulaw(data)))
    d = DELAY_SAMPLES
    assert snr_db(soxr.resample(unulaw(data), 8000, 16000)[: 16000 - d], got[d:]) > 30.0
    # what one stream per call avoids: each frame resampled on its own has edge artefacts
    naive = np.concatenate([Upsampler().process(unulaw(data[k : k + FRAME_BYTES])) for k in range(0, len(data), FRAME_BYTES)])
    assert snr_db(got, naive) < 20.0
    assert proto.stats.media_in == 50 and not proto.faults


def test_outbound_whole_frames_and_a_mark_after_each_chunk():
    proto, _ = started()
    pcm = (3000 * np.sin(np.arange(16_170) / 7)).astype(np.int16)  # 1010.6 ms: the last frame is partial
    rid, msgs = answer(proto, pcm)
    media = [m for m in msgs if m["event"] == "media"]
    marks = [m for m in msgs if m["event"] == "mark"]
    assert all(m["streamSid"] == SID for m in msgs)
    assert {len(base64.b64decode(m["media"]["payload"])) for m in media} == {FRAME_BYTES}
    assert len(media) == 51  # 1010.6 ms -> 50 whole frames + the last one padded with silence
    assert unulaw(base64.b64decode(media[-1]["media"]["payload"]))[-20:].tolist() == [0] * 20
    # each mark is named by the response and the audio sent before it
    n_media = 0
    for m in msgs:
        if m["event"] == "media":
            n_media += 1
        elif m["event"] == "mark":
            assert parse_mark(m["mark"]["name"]) == (rid, 20 * n_media)
    assert msgs[-1]["event"] == "mark" and len(marks) == 51  # one per 20 ms chunk, one after the padded tail
    # the audio is the engine's, resampled to 8 kHz (the filter delays it by 32 samples)
    wire = np.concatenate([unulaw(base64.b64decode(m["media"]["payload"])) for m in media])
    want = soxr.resample(pcm, 16000, 8000)
    d = DELAY_SAMPLES // 2
    assert wire.size == 51 * FRAME_BYTES and snr_db(want[: 8000 - d], wire[d:8000]) > 30.0  # mu-law bounds it (~38 dB)


def test_echoed_marks_are_the_played_cursor_and_barge_in_truncates_at_the_last_one(speech):
    proto, wire = started(vad=VadParams(threshold=0.6, silence_duration_ms=600, min_speech_ms=160))
    s = proto.session
    rid = s.receive_response_create(1.0)
    s.receive_engine_chunk(rid, (3000 * np.sin(np.arange(16000 * 3) / 5)).astype(np.int16), "", False, None, 1.0)
    now, msgs = 1.0, []
    while now < 1.5:  # 0.5 s paced out (plus the lead)
        s.poll_audio(now)
        proto.send_session_events(s.events())
        msgs += out(proto)
        now += 0.02
    names = [m["mark"]["name"] for m in msgs if m["event"] == "mark"]
    assert len(names) >= 20
    for name in names[:10]:  # Twilio played the first 10 chunks
        feed(proto, wire.mark(name), now)
    last_echoed = parse_mark(names[9])[1]
    assert s.played_ms(now) == last_echoed  # the cursor is the echo, not the pacer's estimate
    feed(proto, wire.mark(names[3]), now)  # an echo out of order never moves the cursor back
    assert s.played_ms(now) == last_echoed and proto.faults["bad_mark"] == 1
    # the caller talks over the answer: real speech, 20 ms mu-law frames
    talk = ulaw(np.concatenate([speech("stop, wait a moment", 8000), silence(1000, 8000)]))
    cancel = None
    for k in range(0, len(talk), FRAME_BYTES):
        now += 0.02
        feed(proto, wire.media(talk[k : k + FRAME_BYTES], chunk=k // FRAME_BYTES + 1), now)
        msgs += out(proto)
        cancel = cancel or next((c for c in s.commands() if isinstance(c, CancelResponse)), None)
        if cancel:
            break
    assert cancel is not None and cancel.response_id == rid
    assert cancel.played_ms == last_echoed  # the history keeps exactly what Twilio said it played
    assert msgs[-1] == {"event": "clear", "streamSid": SID}
    # after clear Twilio returns the dropped marks at once, and the engine may still deliver audio: both stale
    for name in names[10:]:
        feed(proto, wire.mark(name), now)
    s.receive_engine_chunk(rid, np.ones(3200, np.int16), "", True, None, now)
    s.poll_audio(now + 1)
    proto.send_session_events(s.events())
    assert out(proto) == [] and s.played_ms(now) == last_echoed and proto.stats.marks_echoed == 10
    assert proto.faults["bad_mark"] == 1  # stale marks are expected after a clear: ignored, not faults
    # the next response starts at 0 played, and a late mark of the old one (same ms range) does not move it
    rid2 = s.receive_response_create(now)
    s.receive_engine_chunk(rid2, np.ones(16000, np.int16), "", False, None, now)
    for k in range(40):
        s.poll_audio(now + 0.02 * k)
        proto.send_session_events(s.events())
    assert parse_mark(out(proto)[-1]["mark"]["name"])[1] > parse_mark(names[12])[1]
    feed(proto, wire.mark(names[12]), now + 1)
    assert s.played_ms(now + 10) == 0.0 and proto.stats.marks_echoed == 10


def test_barge_in_before_any_echo_keeps_nothing():
    """No mark echoed yet: nothing is known to have played, whatever the pacer estimates."""
    proto, _ = started()
    s = proto.session
    rid = s.receive_response_create(1.0)
    s.receive_engine_chunk(rid, np.full(16000, 1000, np.int16), "", False, None, 1.0)
    for k in range(30):
        s.poll_audio(1.0 + 0.02 * k)
        proto.send_session_events(s.events())
    s.receive_response_cancel(1.6)
    assert next(c for c in s.commands() if isinstance(c, CancelResponse)).played_ms == 0.0
    proto.send_session_events(s.events())
    assert out(proto)[-1]["event"] == "clear"


@pytest.mark.parametrize("message, fault", [
    ("{nope", "invalid_json"),
    ("[1, 2]", "invalid_json"),
    ("[" * 100_000 + "]" * 100_000, "invalid_json"),
    (b"\x00\x01binary", "binary_frame"),
    (json.dumps({"event": "hello", "streamSid": SID}), "unknown_event"),
    (json.dumps({"streamSid": SID}), "unknown_event"),
    (json.dumps({"event": "media", "streamSid": SID, "media": {"payload": "!!not base64!!"}}), "invalid_base64"),
    (json.dumps({"event": "media", "streamSid": SID, "media": {"payload": ""}}), "empty_payload"),
    (json.dumps({"event": "media", "streamSid": SID, "media": {}}), "bad_media"),
    (json.dumps({"event": "media", "streamSid": SID, "media": {"payload": "A" * 20_000}}), "payload_too_large"),
    (json.dumps({"event": "media", "streamSid": "MZ-other", "media": {"payload": "//8="}}), "wrong_stream_sid"),
    (json.dumps({"event": "mark", "streamSid": SID, "mark": {"name": "not-ours"}}), "bad_mark"),
    (json.dumps({"event": "dtmf", "streamSid": SID, "dtmf": {"digit": "X"}}), "bad_dtmf"),
    (json.dumps({"event": "start", "streamSid": SID, "start": {"streamSid": SID, "mediaFormat": FORMAT}}), "duplicate_start"),
])
def test_bad_input_is_skipped_with_the_stream_sid_logged(message, fault, caplog):
    proto, wire = started()
    with caplog.at_level(logging.WARNING, logger="duplex.twilio"):
        feed(proto, message, 1.0)
    assert proto.faults[fault] == 1 and proto.state is StreamState.STREAMING and proto.closing is None
    assert any(SID in r.getMessage() and fault in r.getMessage() for r in caplog.records)
    feed(proto, wire.media(b"\xff" * FRAME_BYTES), 1.1)  # the stream goes on
    assert proto.stats.media_in == 1


@pytest.mark.parametrize("size", [1, 7, 159, 161, 320])
def test_odd_payload_sizes_are_counted_and_used(size):
    proto, wire = started(vad=None)
    feed(proto, wire.media(b"\x7f" * size), 1.0)
    assert proto.faults["odd_payload_size"] == 1 and proto.stats.media_in == 1
    proto.session.receive_commit(1.1)
    assert sum(c.pcm.size for c in proto.session.commands() if hasattr(c, "pcm")) > 0


def test_media_before_start_is_skipped_then_start_works(caplog):
    proto, wire = TwilioProtocol(Session("sess_t", VadParams(), SessionLimits(acked_playback=True))), Wire()
    with caplog.at_level(logging.WARNING, logger="duplex.twilio"):
        feed(proto, wire.media(b"\xff" * FRAME_BYTES), 0.0)
        feed(proto, wire.dtmf("5"), 0.0)
    assert proto.faults["media_before_start"] == 2 and proto.state is StreamState.AWAITING_START and proto.stats.media_in == 0
    assert SID in caplog.records[0].getMessage()
    feed(proto, wire.start(), 0.1)
    feed(proto, wire.media(b"\xff" * FRAME_BYTES), 0.2)
    assert proto.state is StreamState.STREAMING and proto.stats.media_in == 1


@pytest.mark.parametrize("start, code", [
    ({"streamSid": SID, "mediaFormat": {"encoding": "audio/l16", "sampleRate": 16000, "channels": 1}}, 1003),
    ({"streamSid": SID, "mediaFormat": {"encoding": "audio/x-mulaw", "sampleRate": 8000, "channels": 2}}, 1003),
    ({"streamSid": SID}, 1003),
    ({"mediaFormat": FORMAT}, 1002),
    ("not an object", 1002),
])
def test_a_start_we_cannot_serve_closes_the_stream(start, code, caplog):
    proto = TwilioProtocol(Session("sess_t", VadParams(), SessionLimits(acked_playback=True)))
    with caplog.at_level(logging.WARNING, logger="duplex.twilio"):
        feed(proto, json.dumps({"event": "start", "sequenceNumber": "1", "start": start}), 0.0)
    assert proto.state is StreamState.STOPPED and proto.closing[0] == code
    if isinstance(start, dict) and "streamSid" in start:
        assert SID in caplog.records[0].getMessage()
    feed(proto, Wire().media(b"\xff" * FRAME_BYTES), 0.1)  # ignored, no crash
    assert proto.stats.media_in == 0


def test_dtmf_is_logged_and_the_end_digit_ends_the_call():
    proto, wire = started(end_call_digit="9")
    for d in "1#*":
        feed(proto, wire.dtmf(d), 1.0)
    assert proto.stats.digits == ["1", "#", "*"] and proto.closing is None
    feed(proto, wire.dtmf("9"), 1.1)
    assert proto.closing == (1000, "caller pressed 9") and proto.state is StreamState.STOPPED
    feed(proto, wire.dtmf("1"), 1.2)
    assert proto.stats.digits == ["1", "#", "*", "9"]


def test_stop_ends_the_stream_and_sequence_gaps_are_counted():
    proto, wire = started()
    wire.seq += 3  # three messages lost
    feed(proto, wire.media(b"\xff" * FRAME_BYTES), 1.0)
    assert proto.faults["sequence_gap"] == 1 and proto.stats.media_in == 1
    feed(proto, wire.stop(), 1.1)
    assert proto.closing == (1000, "stream stopped") and proto.state is StreamState.STOPPED


def test_marks_names_and_twiml():
    assert parse_mark(mark_name("resp_ab:c", 1240)) == ("resp_ab:c", 1240)
    assert parse_mark("resp_x") is None and parse_mark(":20") is None and parse_mark("r:-20") is None and parse_mark("r:2e3") is None
    assert stream_url("https://voice.example.com/", "/v1/telephony/twilio") == "wss://voice.example.com/v1/telephony/twilio"
    assert stream_url("http://h:8000/base", "/p") == "ws://h:8000/base/p"
    root = ET.fromstring(render_twiml("wss://h/v1/telephony/twilio", {"token": 'a"<&>b'}))
    stream = root.find("./Connect/Stream")
    assert root.tag == "Response" and stream.get("url") == "wss://h/v1/telephony/twilio"
    assert [(p.get("name"), p.get("value")) for p in stream.findall("Parameter")] == [("token", 'a"<&>b')]


def test_signature_matches_twilios_documented_example():
    # https://www.twilio.com/docs/usage/security#validating-requests (auth token 12345)
    url = "https://mycompany.com/myapp.php?foo=1&bar=2"
    params = [("CallSid", "CA1234567890ABCDE"), ("Caller", "+12349013030"), ("Digits", "1234"), ("From", "+12349013030"), ("To", "+18005551212")]
    assert twilio_signature("12345", url, params) == "0/KCTR6DLpKmkAf8muzZqo1nDgQ="
    assert signature_valid("12345", url, params, "0/KCTR6DLpKmkAf8muzZqo1nDgQ=")
    assert signature_valid("12345", "https://mycompany.com:443/myapp.php?foo=1&bar=2", params, "0/KCTR6DLpKmkAf8muzZqo1nDgQ=")
    assert not signature_valid("12345", url, params[:-1], "0/KCTR6DLpKmkAf8muzZqo1nDgQ=")
    assert not signature_valid("54321", url, params, "0/KCTR6DLpKmkAf8muzZqo1nDgQ=")


def test_tickets_are_one_time_bound_to_the_call_and_expire():
    now = [0.0]
    book = TicketBook(ttl_s=60.0, clock=lambda: now[0])
    a, b, c = book.issue("CA1"), book.issue(None), book.issue("CA3")
    assert book.redeem(a, "CA1") and not book.redeem(a, "CA1")  # one time
    assert book.redeem(b, "CA-any")
    assert not book.redeem(c, "CA-other")  # bound to its call (and now used up)
    d = book.issue("CA4")
    now[0] = 61.0
    assert not book.redeem(d, "CA4") and not book.redeem("made-up", "CA4")


@pytest.mark.parametrize("data, key", [
    ({"telephony": {"end_call_digit": "x"}}, "telephony.end_call_digit"),
    ({"telephony": {"end_call_digit": "12"}}, "telephony.end_call_digit"),
    ({"telephony": {"public_url": "voice.example.com"}}, "telephony.public_url"),
    ({"telephony": {"vad": {"threshold": 1.5}}}, "telephony.vad.threshold"),
    ({"telephony": {"vad": {"thresh": 0.5}}}, "telephony.vad.thresh"),
    ({"telephony": {"ticket_ttl_s": 0}}, "telephony.ticket_ttl_s"),
    ({"telephony": {"twilio_auth_tokn": "x"}}, "telephony.twilio_auth_tokn"),
])
def test_telephony_config_errors_name_the_key(data, key):
    with pytest.raises(ValueError, match=f"'{key}'"):
        config_from_dict(data)
    assert config_from_dict({"telephony": {"end_call_digit": None, "public_url": "https://v.example"}}).telephony.end_call_digit is None


# ==== a call over a real socket: gateway + real engine (tiny model, CPU) ===============================


@pytest.fixture(scope="module")
def gateway(loop_thread, tiny_model):
    with running_gateway(loop_thread, tiny_model, CAPACITY, {
        "server": {"port": 0, "token": TOKEN},
        "session": {"max_response_ms": MAX_RESPONSE_MS, "temperature": 0.0},
        "telephony": {"twilio_auth_token": TWILIO_AUTH_TOKEN, "end_call_digit": "#", "start_timeout_s": 2.0},
    }) as gw:
        yield gw


def run(coro, timeout: float = 240):
    return asyncio.run(asyncio.wait_for(coro, timeout))


def fetch_twiml(gw, call_sid: str, signature: str | None = "sign", query: str = "") -> tuple[int, str]:
    """Twilio's webhook request: a form POST signed per Twilio's security docs."""
    url = f"http://127.0.0.1:{gw.port}/v1/telephony/twiml{query}"
    signed_url = f"https://127.0.0.1:{gw.port}/v1/telephony/twiml{query}"  # what the console holds (TLS ends at a proxy)
    form = {"AccountSid": "AC0000", "CallSid": call_sid, "From": "+15550001111", "To": "+15550002222", "CallStatus": "ringing", "Direction": "inbound"}
    headers = {"Content-Type": "application/x-www-form-urlencoded"}
    if signature == "sign":
        data = signed_url + "".join(k + form[k] for k in sorted(form))
        headers["X-Twilio-Signature"] = base64.b64encode(hmac.new(TWILIO_AUTH_TOKEN.encode(), data.encode(), hashlib.sha1).digest()).decode()
    elif signature is not None:
        headers["X-Twilio-Signature"] = signature
    req = urllib.request.Request(url, data=urllib.parse.urlencode(form).encode(), headers=headers, method="POST")
    try:
        with urllib.request.urlopen(req) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


class TwilioPeer:
    """Twilio's end of a bidirectional Media Stream (see the module docstring)."""

    def __init__(self, ws, stream_sid: str, call_sid: str, params: dict) -> None:
        self.ws, self.sid, self.call_sid, self.params = ws, stream_sid, call_sid, params
        self.seq = 0
        self.received: list[dict] = []  # every message from the server, in order
        self.played_marks: list[str] = []  # echoed because the audio before them played
        self.cleared_marks: list[str] = []  # echoed because a clear dropped the audio before them
        self.clears_at: list[int] = []  # index into `received` of each clear
        self.played_frames = 0
        self.closed = asyncio.Event()
        self._mic: deque[bytes] = deque()  # caller audio waiting to be sent (silence when empty)
        self._playout: deque[tuple[str, object]] = deque()  # ("media", bytes) | ("mark", name), not yet played
        self._tasks: list[asyncio.Task] = []

    async def send(self, event: str, **body) -> None:
        self.seq += 1
        await self.ws.send(json.dumps({"event": event, "sequenceNumber": str(self.seq), "streamSid": self.sid, **body}))

    async def begin(self) -> None:
        await self.ws.send(json.dumps({"event": "connected", "protocol": "Call", "version": "1.0.0"}))
        self.seq += 1
        await self.ws.send(json.dumps({"event": "start", "sequenceNumber": str(self.seq), "streamSid": self.sid, "start": {
            "streamSid": self.sid, "accountSid": "AC0000", "callSid": self.call_sid, "tracks": ["inbound"],
            "customParameters": self.params, "mediaFormat": FORMAT}}))
        self._tasks = [asyncio.create_task(f()) for f in (self._receive, self._microphone, self._speaker)]

    def say(self, pcm8k: np.ndarray) -> None:
        data = ulaw(pcm8k)
        self._mic.extend(data[k : k + FRAME_BYTES].ljust(FRAME_BYTES, b"\xff") for k in range(0, len(data), FRAME_BYTES))

    @property
    def speaking(self) -> bool:
        return bool(self._mic)

    async def _microphone(self) -> None:
        """One 20 ms frame every 20 ms, speech or line silence, on an absolute schedule."""
        t0, chunk = time.monotonic(), 0
        while not self.closed.is_set():
            frame = self._mic.popleft() if self._mic else b"\xff" * FRAME_BYTES
            chunk += 1
            await self.send("media", media={"track": "inbound", "chunk": str(chunk), "timestamp": str(20 * (chunk - 1)),
                                            "payload": base64.b64encode(frame).decode()})
            await asyncio.sleep(max(0.0, t0 + chunk * 0.02 - time.monotonic()))

    async def _speaker(self) -> None:
        """Plays queued media at 20 ms per 160 bytes; a mark is echoed once everything before it has played."""
        next_t = time.monotonic()
        while not self.closed.is_set():
            while self._playout and self._playout[0][0] == "mark":
                name = self._playout.popleft()[1]
                await self.send("mark", mark={"name": name})
                self.played_marks.append(name)
            if self._playout:
                self._playout.popleft()
                self.played_frames += 1
                next_t += 0.02
            else:
                next_t = time.monotonic() + 0.005  # nothing buffered: idle
            await asyncio.sleep(max(0.0, next_t - time.monotonic()))

    async def _receive(self) -> None:
        import websockets

        try:
            async for raw in self.ws:
                msg = json.loads(raw)
                self.received.append(msg)
                if msg["event"] == "media":
                    self._playout.append(("media", base64.b64decode(msg["media"]["payload"])))
                elif msg["event"] == "mark":
                    self._playout.append(("mark", msg["mark"]["name"]))
                elif msg["event"] == "clear":
                    self.clears_at.append(len(self.received) - 1)
                    pending = [v for k, v in self._playout if k == "mark"]
                    self._playout.clear()
                    for name in pending:  # Twilio returns the marks of the dropped audio
                        await self.send("mark", mark={"name": name})
                        self.cleared_marks.append(name)
        except websockets.ConnectionClosed:
            pass
        finally:
            self.closed.set()

    async def stop(self) -> None:
        await self.send("stop", stop={"accountSid": "AC0000", "callSid": self.call_sid})

    async def finish(self) -> None:
        await asyncio.wait_for(self.closed.wait(), 30)
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


async def dial(gw, call_sid: str) -> TwilioPeer:
    """The phone number's webhook fetches the TwiML; Twilio opens the <Stream> it names."""
    import websockets

    status, body = await asyncio.to_thread(fetch_twiml, gw, call_sid)
    assert status == 200, body
    stream = ET.fromstring(body).find("./Connect/Stream")
    url = urllib.parse.urlsplit(stream.get("url"))
    assert url.scheme == "wss" and url.netloc == f"127.0.0.1:{gw.port}" and url.path == "/v1/telephony/twilio"
    params = {p.get("name"): p.get("value") for p in stream.findall("Parameter")}
    ws = await websockets.connect(f"ws://127.0.0.1:{gw.port}{url.path}")
    peer = TwilioPeer(ws, "MZ" + call_sid[2:], call_sid, params)
    await peer.begin()
    return peer


def runner_of(gw, stream_sid: str):
    return next((r for r in gw.sessions.values() if r.transport == "twilio" and r.proto.stream_sid == stream_sid), None)


async def until(pred, timeout: float = 120.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


def check_marks(received: list[dict]) -> dict[str, list[int]]:
    """Every mark is `<response>:<ms>` with ms = 20 x the media of that response sent before it; per response."""
    per: dict[str, list[int]] = {}
    frames: dict[str, int] = {}
    since = 0  # media since the previous mark (our marks follow each chunk, so these belong to the next mark)
    for m in received:
        if m["event"] == "media":
            since += 1
        elif m["event"] == "mark":
            rid, ms = parse_mark(m["mark"]["name"])
            frames[rid] = frames.get(rid, 0) + since
            since = 0
            assert ms == 20 * frames[rid], (m, frames[rid])
            per.setdefault(rid, []).append(ms)
        elif m["event"] == "clear":
            assert since == 0
    return per


def utterance(speech, text: str) -> np.ndarray:
    return np.concatenate([speech(text, 8000), silence(200, 8000)])


@pytest.mark.vllm
def test_a_call_turn_marks_echoed_and_stop_frees_the_conversation(gateway, speech):
    async def main():
        peer = await dial(gateway, "CA00000000000000000000000000000a01")
        await until(lambda: runner_of(gateway, peer.sid) is not None, 30, "the session")
        runner = runner_of(gateway, peer.sid)
        # junk a broken client might send: skipped, the call goes on
        for junk in ("{nope", json.dumps({"event": "what"}), json.dumps({"event": "media", "streamSid": peer.sid, "media": {"payload": "%%"}})):
            await peer.ws.send(junk)
        peer.say(np.concatenate([silence(300, 8000), utterance(speech, "hello, how are you doing today")]))
        await until(lambda: runner.session.response is not None and runner.session.response.status.finished, 120, "the answer")
        rid = runner.session.response.id
        await until(lambda: runner.proto.stats.marks_echoed == runner.proto.stats.marks_sent, 60, "every mark played and echoed")
        acked, sent_ms = runner.session.response.acked_ms, runner.session.response.sent_samples / 16

        metrics = await asyncio.to_thread(lambda: urllib.request.urlopen(f"http://127.0.0.1:{gateway.port}/metrics?token={TOKEN}").read().decode())
        await peer.stop()
        await peer.finish()
        await until(lambda: runner_of(gateway, peer.sid) is None and gateway.engine.load().conversations == 0, 30, "cleanup")
        return peer, rid, acked, sent_ms, runner, metrics

    peer, rid, acked, sent_ms, runner, metrics = run(main())
    assert runner.session.response.status.name == "COMPLETED"
    media = [m for m in peer.received if m["event"] == "media"]
    assert media and all(m["streamSid"] == peer.sid for m in peer.received)
    assert {len(base64.b64decode(m["media"]["payload"])) for m in media} == {FRAME_BYTES}
    per = check_marks(peer.received)
    assert list(per) == [rid] and per[rid] == sorted(set(per[rid])) and per[rid][-1] == 20 * len(media)
    assert peer.played_marks == [mark_name(rid, ms) for ms in per[rid]]  # all played, echoed in order
    assert acked == min(per[rid][-1], sent_ms)  # the cursor is the last echo (the padded tail is not response audio)
    assert runner.proto.faults["invalid_json"] == 1 and runner.proto.faults["unknown_event"] == 1 and runner.proto.faults["invalid_base64"] == 1
    assert 'duplex_telephony_faults_total{kind="invalid_json"}' in metrics
    assert runner.closing == Closing(CloseReason.PROTOCOL_END, "stream stopped", 1000)


@pytest.mark.vllm
def test_barge_in_sends_clear_and_truncates_at_the_last_echoed_mark(gateway, speech):
    from engine.service_api import Role

    async def main():
        peer = await dial(gateway, "CA00000000000000000000000000000b02")
        await until(lambda: runner_of(gateway, peer.sid) is not None, 30, "the session")
        runner = runner_of(gateway, peer.sid)
        peer.say(np.concatenate([silence(300, 8000), utterance(speech, "tell me a long story please")]))
        await until(lambda: runner.session.response is not None, 120, "the answer")
        rid = runner.session.response.id
        await until(lambda: len(peer.played_marks) >= 15 or runner.session.response.status.finished, 120, "300 ms played")
        played_before = parse_mark(peer.played_marks[-1])[1] if peer.played_marks else 0
        peer.say(utterance(speech, "stop, wait a moment"))
        await until(lambda: peer.clears_at or runner.session.response.status.finished and not peer._playout and not peer.speaking,
                    120, "the clear")
        played_at_clear = [parse_mark(n)[1] for n in peer.played_marks if parse_mark(n)[0] == rid]
        await until(lambda: runner.session.response.id != rid and runner.session.response.status.finished, 120, "the second answer")
        history = list(gateway.conversation(runner.id).history)
        await peer.stop()
        await peer.finish()
        return peer, rid, played_before, played_at_clear, history

    peer, rid, played_before, played_at_clear, history = run(main())
    if not peer.clears_at:
        pytest.skip("the tiny model ended its answer before the barge-in (random weights)")
    assert len(peer.clears_at) == 1 and peer.received[peer.clears_at[0]] == {"event": "clear", "streamSid": peer.sid}
    per = check_marks(peer.received)  # no audio of the cleared response after the clear
    after = [parse_mark(m["mark"]["name"])[0] for m in peer.received[peer.clears_at[0]:] if m["event"] == "mark"]
    assert rid not in after
    assert [t.role for t in history[:3]] == [Role.USER, Role.ASSISTANT, Role.USER]
    kept_ms = history[1].audio_frames * 20
    # truncated at an echoed mark: one the server had before the caller spoke again, or a later one before the clear
    assert kept_ms in played_at_clear and kept_ms >= played_before
    assert all(parse_mark(n)[1] > kept_ms for n in peer.cleared_marks)  # what the clear dropped was not kept
    assert max(per[rid]) >= kept_ms


@pytest.mark.vllm
def test_webhook_and_stream_auth(gateway):
    import websockets

    assert fetch_twiml(gateway, "CA1", signature=None)[0] == 403
    assert fetch_twiml(gateway, "CA1", signature="AAAAAAAAAAAAAAAAAAAAAAAAAAA=")[0] == 403
    assert fetch_twiml(gateway, "CA1", signature=None, query=f"?token={TOKEN}")[0] == 200  # the gateway token also works
    assert fetch_twiml(gateway, "CA1", query="?lang=en")[0] == 200  # the signature covers the query
    with urllib.request.urlopen(f"http://127.0.0.1:{gateway.port}/v1/telephony/twiml?token={TOKEN}") as r:
        assert r.headers["Content-Type"].startswith("text/xml")
        any_call = ET.fromstring(r.read().decode()).find("./Connect/Stream/Parameter").get("value")
    status, body = fetch_twiml(gateway, "CA1")
    ca1 = ET.fromstring(body).find("./Connect/Stream/Parameter").get("value")
    assert status == 200 and ca1 and TOKEN not in (ca1, any_call)  # one-time tickets, never the gateway token

    async def attempt(params: dict | None, call_sid: str = "CA1", fmt: dict = FORMAT, digit: str | None = None) -> int | None:
        ws = await websockets.connect(f"ws://127.0.0.1:{gateway.port}/v1/telephony/twilio")
        await ws.send(json.dumps({"event": "connected", "protocol": "Call", "version": "1.0.0"}))
        if params is not None:  # None: no start at all
            await ws.send(json.dumps({"event": "start", "sequenceNumber": "1", "streamSid": "MZ9", "start": {
                "streamSid": "MZ9", "accountSid": "AC0", "callSid": call_sid, "tracks": ["inbound"], "customParameters": params, "mediaFormat": fmt}}))
        if digit:
            await ws.send(json.dumps({"event": "dtmf", "sequenceNumber": "2", "streamSid": "MZ9", "dtmf": {"track": "inbound_track", "digit": digit}}))
        try:
            await asyncio.wait_for(ws.recv(), 30)
        except websockets.ConnectionClosed:
            pass
        return ws.close_code

    async def main():
        codes = [await attempt({}), await attempt({"token": "guess"}),
                 await attempt({"token": ca1}, call_sid="CA-other"),  # bound to CA1
                 await attempt({"token": ca1}, call_sid="CA1"),  # used up by the wrong call above
                 await attempt({"token": TOKEN}, fmt={"encoding": "audio/l16", "sampleRate": 16000, "channels": 1}),
                 await attempt({"token": any_call}, digit="#"),  # accepted; the end-call digit hangs up
                 await attempt(None)]  # no start within telephony.start_timeout_s
        await until(lambda: not any(r.transport == "twilio" for r in gateway.sessions.values()), 30, "no sessions")
        return codes

    assert run(main()) == [1008, 1008, 1008, 1008, 1003, 1000, 1008]


async def _one_spoken_turn(call_sid: str, telephony: dict, answer_ms: float, wait_for_log, caplog):
    """A call to a Gateway on the fake engine with assistant text on: one spoken turn, answered, hung up;
    waits until the answer finished and `wait_for_log(caplog records)` holds. Returns (peer, conversation)."""
    from fake_engine import FakeEngine

    from engine.codec.synth import speech_like
    from realtime.server import Gateway

    engine = FakeEngine(capacity=1, answer_ms=answer_ms, step_s=0.002)
    gw = Gateway(engine, config_from_dict({
        "server": {"port": 0, "token": TOKEN}, "session": {"assistant_text": True},
        "telephony": {"twilio_auth_token": TWILIO_AUTH_TOKEN, **telephony}}))
    await gw.start()
    try:
        peer = await dial(gw, call_sid)
        await until(lambda: runner_of(gw, peer.sid) is not None, 10, "the session")
        runner = runner_of(gw, peer.sid)
        speech8k = soxr.resample((speech_like(1.0, seed=3) * 20000).astype(np.int16), 16000, 8000).astype(np.int16)
        peer.say(np.concatenate([silence(300, 8000), speech8k, silence(900, 8000)]))
        await until(lambda: wait_for_log(caplog.records) and runner.session.response is not None
                    and runner.session.response.status.finished, 20, "the turn")
        conv = engine.conversation(runner.id)
        await peer.stop()
        await peer.finish()
        return peer, conv
    finally:
        await gw.stop()


def test_a_calls_text_is_logged_the_callers_transcript_and_the_models_text(caplog):
    """Over a real socket to a Gateway on the fake engine: Twilio has no event for text, so a call's text
    goes to the log at INFO, one line per completed caller transcript and per answer's text."""
    from fake_engine import answer_text, user_transcript_text

    with caplog.at_level(logging.INFO, logger="duplex.twilio"):
        peer, conv = run(_one_spoken_turn("CA00000000000000000000000000000t01", {}, 300,
                                          lambda records: any("caller (" in r.getMessage() for r in records), caplog),
                         timeout=40)
    h = conv.handles[-1]
    assert h.options.transcribe_user and h.options.assistant_text and h.options.output_audio
    lines = [r for r in caplog.records if r.name == "duplex.twilio" and peer.sid in r.getMessage()]
    caller = [r.getMessage() for r in lines if "caller (" in r.getMessage()]
    said = [r.getMessage() for r in lines if "assistant (" in r.getMessage()]
    assert len(caller) == 1 and caller[0].endswith(": " + user_transcript_text(h.user_frames))
    assert all(r.levelno == logging.INFO for r in lines if "caller (" in r.getMessage() or "assistant (" in r.getMessage())
    assert len(said) == 1 and f"({h.id}, completed): {answer_text(conv.index, h.index)}" in said[0]
    assert any(m["event"] == "media" for m in peer.received)  # the answer was spoken too


def test_a_call_logs_no_text_when_told_not_to(caplog):
    with caplog.at_level(logging.INFO, logger="duplex.twilio"):
        peer, conv = run(_one_spoken_turn("CA00000000000000000000000000000t02", {"transcripts": False}, 200,
                                          lambda records: True, caplog), timeout=40)
    assert not conv.handles[-1].options.transcribe_user  # not even written
    assert not [r for r in caplog.records if "caller (" in r.getMessage() or "assistant (" in r.getMessage()]