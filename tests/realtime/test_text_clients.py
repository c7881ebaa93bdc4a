"""Text on the other clients, against a real Gateway on the fake engine (loopback, fast): WebRTC's data
channel carries the transcription events of what the microphone track said (aiortc as the browser),
and the Python client SDK (realtime/client) gives them as typed events, with text-only answers and
typed turns."""

from __future__ import annotations

import asyncio

import numpy as np
import soxr
from fake_engine import FakeEngine, answer_text, user_transcript_text
from rt_helpers import fake_gateway
from runner_rig import silence16, speech16
from test_webrtc import RtcClient

from realtime.client import (
    AudioChunk, DuplexClient, InputCommitted, ProtocolError, ResponseDone, TextDelta, TranscriptDelta, UserTranscript,
    UserTranscriptDelta,
)

TOKEN = "webrtc-token"  # test_webrtc's RtcClient sends it


def gateway(engine: FakeEngine, config: dict | None = None):
    return fake_gateway(engine, config, TOKEN)


def test_the_webrtc_data_channel_carries_both_sides_text():
    async def main():
        engine = FakeEngine(capacity=1, answer_ms=300, step_s=0.002)
        async with gateway(engine, {"vad": {"silence_duration_ms": 300}, "session": {"assistant_text": True}}) as gw:
            said = np.concatenate([silence16(300), speech16(1.0, seed=3), silence16(3000)])
            c = RtcClient(gw, soxr.resample(said, 16000, 48000).astype(np.int16))
            assert (await c.connect())[0] == 201
            created = await c.wait_for("session.created", timeout=10)
            assert created["session"]["duplex"]["text"] is True and created["session"]["duplex"]["assistant_text"] is True
            c.send(type="session.update", session={"audio": {"input": {"transcription": {"model": "duplex"}}}})
            await c.wait_for("session.updated", timeout=10)
            done = await c.wait_for("conversation.item.input_audio_transcription.completed", timeout=20)
            answered = await c.wait_for("response.done", timeout=20)
            conv = engine.conversation(created["session"]["id"])
            await c.close()
            return c.events, done, answered, conv

    events, done, answered, conv = asyncio.run(asyncio.wait_for(main(), 40))
    committed = [e for e in events if e["type"] == "input_audio_buffer.committed"]
    h = conv.handles[-1]
    assert done["item_id"] == committed[-1]["item_id"] and done["transcript"] == user_transcript_text(h.user_frames)
    deltas = [e for e in events if e["type"] == "conversation.item.input_audio_transcription.delta"]
    assert "".join(d["delta"] for d in deltas) == done["transcript"] and {d["item_id"] for d in deltas} == {done["item_id"]}
    want = answer_text(conv.index, h.index)
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_audio_transcript.delta") == want
    assert answered["response"]["output"][0]["content"][0]["transcript"] == want
    assert not any(e["type"] == "error" for e in events)


def test_the_client_sdk_gives_transcripts_text_answers_and_typed_turns_as_typed_events():
    async def main():
        engine = FakeEngine(capacity=1, answer_ms=200, step_s=0.002)
        async with gateway(engine) as gw:
            async with DuplexClient(f"ws://127.0.0.1:{gw.port}/v1/realtime", TOKEN) as c:
                assert c.session["duplex"]["text"] is True
                s = await c.update_session(turn_detection=None, transcribe=True, output_modalities=["text"])
                assert s["output_modalities"] == ["text"] and s["audio"]["input"]["transcription"] == {"model": "duplex"}
                await c.send_audio(speech16(0.6, seed=1), 16_000)
                await c.commit()
                await c.create_response()
                got: list = []
                async for ev in c.events():
                    got.append(ev)
                    if isinstance(ev, ResponseDone) and any(isinstance(e, UserTranscript) for e in got):
                        break
                await c.send_text("And now in audio?", respond=False)
                await c.create_response(output_modalities=["audio"])
                second: list = []
                async for ev in c.events():
                    second.append(ev)
                    if isinstance(ev, ResponseDone):
                        break
                conv = engine.conversation(c.session_id)
            return got, second, conv

    got, second, conv = asyncio.run(asyncio.wait_for(main(), 30))
    item = next(e for e in got if isinstance(e, InputCommitted)).item_id
    words = [e for e in got if isinstance(e, UserTranscriptDelta)]
    done = next(e for e in got if isinstance(e, UserTranscript))
    want_user = user_transcript_text(conv.handles[0].user_frames)
    assert {w.item_id for w in words} == {item} and "".join(w.delta for w in words) == want_user
    assert done == UserTranscript(item, want_user)
    text = [e for e in got if isinstance(e, TextDelta)]
    first = next(e for e in got if isinstance(e, ResponseDone))
    assert "".join(t.delta for t in text) == answer_text(conv.index, 0) == first.transcript and first.text_only
    assert not any(isinstance(e, (AudioChunk, TranscriptDelta)) for e in got)
    # the typed turn, answered in audio for this response only
    assert conv.user_texts == ["And now in audio?"]
    last = next(e for e in second if isinstance(e, ResponseDone))
    assert last.status == "completed" and not last.text_only and sum(e.duration_ms for e in second if isinstance(e, AudioChunk)) > 150
    assert not any(isinstance(e, TextDelta) for e in second)


def test_the_client_sdk_raises_the_refusal_of_a_model_without_text():
    async def main():
        async with gateway(FakeEngine(capacity=1, text_model=False)) as gw:
            async with DuplexClient(f"ws://127.0.0.1:{gw.port}/v1/realtime", TOKEN) as c:
                assert c.session["duplex"]["text"] is False
                try:
                    await c.update_session(transcribe=True)
                except ProtocolError as e:
                    return e
        return None

    e = asyncio.run(asyncio.wait_for(main(), 20))
    assert e is not None and e.param == "session.audio.input.transcription" and "text tokenizer" in e.message
