"""The Realtime event machine + Session, sans-I/O: JSON in, JSON/commands out, simulated time, no engine."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest
from rt_helpers import silence

from realtime.audio import OutputEncoder, WireFormat
from realtime.config import SessionSection
from realtime.protocol import RealtimeProtocol
from realtime.session import (
    CancelResponse, ConfirmResponse, DiscardResponse, EndTurn, PushAudio, Session, SessionLimits, StartResponse,
)
from realtime.session_input import apply_inputs
from realtime.vad import VadParams


class Client:
    """Drives a protocol machine like a socket would, on a simulated monotonic clock."""

    def __init__(self, vad: VadParams | None = VadParams(silence_duration_ms=300), extensions: bool = True,
                 text_model: bool = False, settings=None) -> None:
        self.session = Session("sess_test", vad, SessionLimits(output_frame_ms=40, lead_ms=100))
        # most tests look at our additions too; `text_model`: the engine reads and writes text
        self.proto = RealtimeProtocol(self.session, settings=settings, extensions=extensions, text_model=text_model)
        self.now = 100.0
        self.sent: list = []
        self.commands: list = []
        self.proto.open()
        self._drain()

    def _drain(self) -> None:
        apply_inputs(self.proto, self.session, self.now)  # as the runner does
        self.proto.send_session_events(self.session.events())
        for m in self.proto.data_to_send():
            self.sent.append(json.loads(m) if isinstance(m, str) else m)
        self.commands += self.session.commands()

    def send(self, event: dict | str) -> None:
        self.proto.receive_text(event if isinstance(event, str) else json.dumps(event), self.now)
        self._drain()

    def append_pcm24(self, pcm24: np.ndarray, piece_ms: int = 20) -> None:
        n = 24 * piece_ms
        for i in range(0, pcm24.size, n):
            self.send({"type": "input_audio_buffer.append", "audio": base64.b64encode(pcm24[i : i + n].astype("<i2").tobytes()).decode()})
            self.tick(piece_ms / 1000)

    def tick(self, seconds: float) -> None:
        self.now += seconds
        self.session.poll_audio(self.now)
        self._drain()

    def engine_chunk(self, rid: str, ms: float, is_last: bool = False, text: str = "") -> None:
        pcm = (3000 * np.sin(np.arange(int(16 * ms)) / 5)).astype(np.int16)
        self.session.receive_engine_chunk(rid, pcm, text, is_last, None, self.now)
        self.tick(0)

    def types(self) -> list[str]:
        return [e["type"] for e in self.sent if isinstance(e, dict)]

    def take(self) -> list[dict]:
        out, self.sent = self.sent, []
        return out

    def errors(self) -> list[dict]:
        return [e["error"] for e in self.sent if isinstance(e, dict) and e["type"] == "error"]


def test_open_and_session_update_roundtrip():
    c = Client()
    assert c.types() == ["session.created"]
    c.send({"type": "session.update", "event_id": "e1", "session": {
        "type": "realtime", "instructions": "be brief",
        "audio": {"input": {"format": {"type": "audio/pcmu"}, "turn_detection": None},
                  "output": {"format": {"type": "audio/opus"}, "voice": "alloy"}},
        "duplex": {"top_k": 5, "seed": 3}}})
    upd = c.sent[-1]
    assert upd["type"] == "session.updated"
    s = upd["session"]
    assert s["audio"]["input"] == {"format": {"type": "audio/pcmu"}, "turn_detection": None, "transcription": None, "noise_reduction": None}
    assert s["audio"]["output"]["format"] == {"type": "audio/opus"} and s["instructions"] == "be brief"
    assert c.proto.settings.top_k == 5 and c.proto.settings.seed == 3 and c.proto.settings_changed
    assert not c.session.vad_enabled
    c.send({"type": "session.update", "session": {"input_audio_format": "pcm16", "turn_detection": {"type": "server_vad", "threshold": 0.7}}})
    assert c.session.vad_params.threshold == 0.7 and c.proto.settings.input_format is WireFormat.PCM16


def test_truncation_setting_reaches_the_engine_and_is_echoed_as_the_client_sent_it():
    c = Client(extensions=False)
    assert c.sent[-1]["session"]["truncation"] == "auto"
    assert c.proto.engine_options().retention_ratio == SessionSection().retention_ratio
    c.send({"type": "session.update", "session": {"truncation": {"type": "retention_ratio", "retention_ratio": 0.5}}})
    assert c.sent[-1]["session"]["truncation"] == {"type": "retention_ratio", "retention_ratio": 0.5}
    assert c.proto.take_engine_options().retention_ratio == 0.5
    c.send({"type": "session.update", "session": {"truncation": "disabled", "instructions": "hi"}})
    assert c.sent[-1]["session"]["truncation"] == "disabled"
    assert c.proto.take_engine_options().retention_ratio is None  # conversation_too_long instead of dropping
    # a refused ratio names its field; the instructions sent with it still apply, the truncation is unchanged
    c.take()
    c.send({"type": "session.update", "session": {"truncation": {"type": "retention_ratio", "retention_ratio": 0}, "instructions": "yo"}})
    assert [e["param"] for e in c.errors()] == ["session.truncation.retention_ratio"]
    assert c.sent[-1]["session"]["truncation"] == "disabled" and c.sent[-1]["session"]["instructions"] == "yo"


def _vad_turn(c: Client, speech) -> str:
    c.append_pcm24(np.concatenate([silence(300, 24_000), speech("hello, can you hear me", 24_000), silence(700, 24_000)]))
    created = [e for e in c.sent if isinstance(e, dict) and e["type"] == "response.created"]
    assert created, c.types()
    return created[-1]["response"]["id"]


def test_server_vad_turn_to_paced_response(speech):
    c = Client()
    rid = _vad_turn(c, speech)
    t = c.types()
    order = ["input_audio_buffer.speech_started", "input_audio_buffer.speech_stopped", "input_audio_buffer.committed",
             "conversation.item.added", "response.created", "response.output_item.added", "conversation.item.added"]
    assert [x for x in t if x in order] == order
    started = next(e for e in c.sent if e["type"] == "input_audio_buffer.speech_started")
    stopped = next(e for e in c.sent if e["type"] == "input_audio_buffer.speech_stopped")
    assert 0 < started["audio_start_ms"] < stopped["audio_end_ms"]
    pushed = sum(cmd.pcm.size for cmd in c.commands if isinstance(cmd, PushAudio))
    assert pushed > 16 * (stopped["audio_end_ms"] - started["audio_start_ms"]) * 0.9
    # the answer started speculatively at the last pause, confirmed at the end of the turn (earlier pauses
    # within the speech started answers the speech coming back discarded)
    others = [x for x in c.commands if not isinstance(x, PushAudio)]
    assert others[-2:] == [StartResponse(rid, speculative=True), ConfirmResponse(rid)] and EndTurn not in map(type, others)
    assert all(isinstance(x, DiscardResponse) == (k % 2 == 1) for k, x in enumerate(others[:-2]))
    c.take()
    # The engine answers 1 s at once: only the lead (100 ms) + one frame go out now, the rest on schedule.
    c.engine_chunk(rid, 1000, is_last=True, text="hi")
    deltas = [e for e in c.sent if e["type"] == "response.output_audio.delta"]
    assert 2 <= len(deltas) <= 4, len(deltas)
    assert any(e["type"] == "response.output_audio_transcript.delta" and e["delta"] == "hi" for e in c.sent)
    assert any(e["type"] == "duplex.latency" and e["ttfa_ms"] is not None for e in c.sent)
    for _ in range(60):
        c.tick(0.02)
    deltas = [e for e in c.sent if e["type"] == "response.output_audio.delta"]
    audio = b"".join(base64.b64decode(e["delta"]) for e in deltas)
    assert abs(len(audio) // 2 - 24_000) < 50  # 1 s at 24 kHz
    done = c.sent[-1]
    assert done["type"] == "response.done" and done["response"]["status"] == "completed"
    assert done["response"]["duplex"]["audio_ms"] == pytest.approx(1000)


def test_barge_in_cancels_clears_and_truncates_to_acked_ms(speech):
    c = Client()
    rid = _vad_turn(c, speech)
    c.engine_chunk(rid, 3000)
    for _ in range(25):
        c.tick(0.02)
    c.send({"type": "output_audio_buffer.played", "played_ms": 240, "response_id": rid})
    c.take()
    c.commands.clear()
    c.append_pcm24(np.concatenate([speech("stop, wait", 24_000), silence(100, 24_000)]))
    cancels = [x for x in c.commands if isinstance(x, CancelResponse)]
    assert cancels == [CancelResponse(rid, 240.0)]
    t = c.types()
    assert t.index("input_audio_buffer.speech_started") < t.index("output_audio_buffer.cleared") < t.index("response.done")
    done = next(e for e in c.sent if e["type"] == "response.done")
    assert done["response"]["status"] == "cancelled" and done["response"]["status_details"]["reason"] == "turn_detected"
    assert c.session.stats.barge_ins == 1
    # Late engine output of the cancelled response is dropped.
    c.take()
    c.engine_chunk(rid, 500, is_last=True)
    assert not any(e["type"] == "response.output_audio.delta" for e in c.sent)


def test_barge_in_without_acks_uses_the_pacing_cursor(speech):
    c = Client()
    rid = _vad_turn(c, speech)
    c.engine_chunk(rid, 3000)
    for _ in range(25):
        c.tick(0.02)  # 500 ms of schedule: ~500 ms played, ~600 ms sent (100 ms lead)
    c.commands.clear()
    c.session.receive_response_cancel(c.now)
    (cancel,) = [x for x in c.session.commands() if isinstance(x, CancelResponse)]
    assert 440 <= cancel.played_ms <= 520


def test_manual_turns_commit_create_cancel_truncate():
    c = Client(vad=None)
    c.send({"type": "input_audio_buffer.commit", "event_id": "c0"})
    assert c.errors()[-1]["code"] == "input_audio_buffer_commit_empty" and c.errors()[-1]["event_id"] == "c0"
    c.append_pcm24((1000 * np.random.default_rng(0).standard_normal(24_000)).astype(np.int16))
    assert not any(isinstance(x, PushAudio) for x in c.commands)  # buffered until commit
    c.send({"type": "input_audio_buffer.commit"})
    c.send({"type": "response.create"})
    rid = c.sent[-4]["response"]["id"] if c.sent[-4]["type"] == "response.created" else next(e["response"]["id"] for e in c.sent if e["type"] == "response.created")
    item = next(e["item"]["id"] for e in c.sent if e["type"] == "response.output_item.added")
    c.send({"type": "response.create", "event_id": "dup"})
    assert c.errors()[-1]["code"] == "conversation_already_has_active_response"
    c.engine_chunk(rid, 400)
    c.tick(0.3)
    c.send({"type": "conversation.item.truncate", "item_id": item, "content_index": 0, "audio_end_ms": 99999})
    err = c.errors()[-1]
    assert (err["code"], err["param"]) == ("invalid_value", "audio_end_ms") and "is already shorter than 99999ms" in err["message"]
    c.commands.clear()
    c.send({"type": "conversation.item.truncate", "item_id": item, "content_index": 0, "audio_end_ms": 120})
    assert c.sent[-1] == {**c.sent[-1], "type": "conversation.item.truncated", "audio_end_ms": 120}
    assert CancelResponse(rid, 120.0) in c.commands
    c.send({"type": "response.cancel", "event_id": "x"})
    assert c.errors()[-1]["code"] == "response_cancel_not_active"
    assert c.errors()[-1]["message"].startswith("Cancellation failed: no active response found")  # LiveKit's prefix


@pytest.mark.parametrize("message, code, param", [
    ("{not json", "invalid_json", None),
    ("[1, 2]", "invalid_json", None),
    ({"type": "no.such.event"}, "unknown_event_type", "type"),
    ({"no_type": 1}, "missing_required_parameter", "type"),
    ({"type": "input_audio_buffer.append"}, "missing_required_parameter", "audio"),
    ({"type": "input_audio_buffer.append", "audio": 5}, "invalid_type", "audio"),
    ({"type": "input_audio_buffer.append", "audio": "%%%notbase64"}, "invalid_base64", "audio"),
    ({"type": "input_audio_buffer.append", "audio": base64.b64encode(b"\x01\x02\x03").decode()}, "invalid_audio", "audio"),
    ({"type": "conversation.item.truncate", "item_id": "nope", "audio_end_ms": 10}, "item_truncate_invalid_item_id", "item_id"),
    ({"type": "conversation.item.retrieve", "item_id": "nope"}, "item_retrieve_invalid_item_id", "item_id"),
    ({"type": "conversation.item.delete", "item_id": "nope"}, "item_delete_invalid_item_id", "item_id"),
    ({"type": "conversation.item.truncate", "item_id": "x", "audio_end_ms": "10"}, "invalid_type", "audio_end_ms"),
    ({"type": "response.cancel"}, "response_cancel_not_active", None),
    ({"type": "session.update", "session": {"audio": {"input": {"format": {"type": "audio/pcm", "rate": 16000}}}}}, "invalid_value", "session.audio.input.format"),
    ({"type": "session.update", "session": {"audio": {"input": {"turn_detection": {"type": "magic_vad"}}}}}, "invalid_value", "session.audio.input.turn_detection.type"),
    ({"type": "session.update", "session": {"temperature": "hot"}}, "invalid_type", "session.temperature"),
    ({"type": "output_audio_buffer.played", "played_ms": True}, "invalid_type", "played_ms"),
])
def test_each_bad_input_gets_an_error_and_the_session_goes_on(message, code, param):
    c = Client(vad=None)
    c.take()
    c.send(message if isinstance(message, str) else {**message, "event_id": "bad1"})
    (err,) = c.errors()
    assert err["code"] == code and err["param"] == param and err["message"]
    if not isinstance(message, str) and "type" in message:
        assert err["event_id"] == "bad1"
    c.take()
    c.append_pcm24(np.full(4800, 100, np.int16), piece_ms=20)
    c.send({"type": "input_audio_buffer.commit"})
    assert "input_audio_buffer.committed" in c.types() and not c.errors()


def test_corrupt_opus_binary_frame_is_an_error_and_good_ones_are_audio():
    c = Client(vad=None)
    c.take()
    c.proto.receive_binary(b"\x01\xff\xff\xff\x00garbage", c.now)
    c.proto.receive_binary(b"\x07abc", c.now)
    c._drain()
    assert [e["code"] for e in c.errors()] == ["invalid_audio", "invalid_binary_frame"]
    enc = OutputEncoder(WireFormat.OPUS)
    for pkt in enc.encode(np.zeros(1600, np.int16)):
        c.proto.receive_binary(b"\x01" + pkt, c.now)
        c._drain()
    assert c.session.input_ms == pytest.approx(100)


def test_opus_output_is_binary_with_epoch_header():
    c = Client(vad=None)
    c.send({"type": "session.update", "session": {"audio": {"output": {"format": {"type": "audio/opus"}}}}})
    c.append_pcm24(np.full(2400, 10, np.int16))
    c.send({"type": "input_audio_buffer.commit"})
    c.send({"type": "response.create"})
    rid = next(e["response"]["id"] for e in c.sent if isinstance(e, dict) and e["type"] == "response.created")
    c.take()
    c.engine_chunk(rid, 200, is_last=True)
    for _ in range(20):
        c.tick(0.02)
    frames = [m for m in c.sent if isinstance(m, bytes)]
    assert len(frames) == 10 and all(f[0] == 1 and f[1:5] == b"\x00\x00\x00\x00" for f in frames)
    assert not any(e["type"] == "response.output_audio.delta" for e in c.sent if isinstance(e, dict))
    assert c.types()[-1] == "response.done"


def test_a_manual_commit_holds_every_sample_the_client_sent():
    """24 kHz pcm16 in, 16 kHz to the engine: the resampler's tail belongs to the committed turn, not the next."""
    c = Client(vad=None)
    sent = (1000 * np.random.default_rng(1).standard_normal(24 * 990)).astype(np.int16)  # 990 ms in 20 ms appends (+ a short last one)
    c.append_pcm24(sent)
    c.send({"type": "input_audio_buffer.commit"})
    pushed = sum(x.pcm.size for x in c.commands if isinstance(x, PushAudio))
    assert pushed == 16 * 990
    assert c.session.stats.input_frames == 50  # client frames only; the tail is not one


def test_turn_detection_speculation_settings():
    c = Client()
    c.send({"type": "session.update", "session": {"audio": {"input": {"turn_detection": {
        "type": "server_vad", "silence_duration_ms": 600, "speculative": False, "speculate_after_ms": 96}}}}})
    assert c.errors() == []
    assert (c.session.vad_params.speculative, c.session.vad_params.speculate_after_ms) == (False, 96)
    td = c.sent[-1]["session"]["audio"]["input"]["turn_detection"]
    assert (td["speculative"], td["speculate_after_ms"], td["silence_duration_ms"]) == (False, 96, 600)
    c.send({"type": "session.update", "session": {"audio": {"input": {"turn_detection": {
        "type": "semantic_vad", "eagerness": "high", "speculative": True, "speculate_after_ms": 128}}}}})
    assert c.errors() == [] and (c.session.vad_params.speculative, c.session.vad_params.speculate_after_ms) == (True, 128)
    c.take()
    for bad, param in (({"speculative": "yes"}, "speculative"), ({"speculate_after_ms": -1}, "speculate_after_ms"),
                       ({"speculate_after_ms": 1.5}, "speculate_after_ms")):
        c.send({"type": "session.update", "session": {"audio": {"input": {"turn_detection": {"type": "server_vad", **bad}}}}})
        (err,) = c.errors()
        assert err["param"] == f"session.audio.input.turn_detection.{param}", err
        c.take()
    assert c.session.vad_params.speculate_after_ms == 128  # a refused setting changes nothing
    # a standard client may set them; it is not shown our fields
    plain = Client(extensions=False)
    plain.send({"type": "session.update", "session": {"audio": {"input": {"turn_detection": {"type": "server_vad", "speculative": False}}}}})
    assert plain.errors() == [] and plain.session.vad_params.speculative is False
    assert "speculative" not in plain.sent[-1]["session"]["audio"]["input"]["turn_detection"]
