"""The official openai SDK's realtime client against a real Gateway (fake engine, loopback): the session
its users configure, conversation items, metadata, a cancelled answer, with no error event; input
transcription, text-only answers, the model's text on the audio transcript, a typed turn, and the
text fields a model without text refuses by name."""

from __future__ import annotations

import asyncio
import base64

import numpy as np
from fake_engine import FakeEngine
from rt_helpers import fake_gateway, sdk_until
from openai import AsyncOpenAI


TOKEN = "sdk-token"


def gateway():
    return fake_gateway(FakeEngine(capacity=2, answer_ms=600), None, TOKEN)


def test_the_openai_sdk_holds_two_turns_and_a_cancel_without_errors():
    async def main():
        async with gateway() as gw:
            client = AsyncOpenAI(api_key=TOKEN, websocket_base_url=f"ws://127.0.0.1:{gw.port}/v1")
            seen: list = []
            async with client.realtime.connect(model="gpt-realtime") as conn:
                created = await sdk_until(conn, "session.created", seen)
                assert "resume_token" not in (created.model_extra or {})
                await conn.session.update(session={"type": "realtime", "instructions": "Be brief.", "audio": {"input": {
                    "transcription": None, "turn_detection": {"type": "semantic_vad", "eagerness": "high"}}}})
                upd = await sdk_until(conn, "session.updated", seen)
                assert upd.session.audio.input.turn_detection.type == "semantic_vad"
                await conn.conversation.item.create(item={"type": "message", "role": "system",
                                                          "content": [{"type": "input_text", "text": "You are terse."}]})
                pcm = (3000 * np.sin(np.arange(24 * 500) / 7)).astype("<i2").tobytes()
                await conn.conversation.item.create(item={"type": "message", "role": "user", "content": [
                    {"type": "input_audio", "audio": base64.b64encode(pcm).decode()}]})
                await conn.response.create(response={"metadata": {"turn": "1"}})
                done = await sdk_until(conn, "response.done", seen)
                assert done.response.status == "completed" and done.response.metadata == {"turn": "1"}
                await conn.response.create(response={"metadata": {"turn": "2"}})
                await sdk_until(conn, "response.output_audio.delta", seen)
                await conn.response.cancel()
                done = await sdk_until(conn, "response.done", seen)
                assert done.response.status == "cancelled" and done.response.metadata == {"turn": "2"}
            errors = [ev for ev in seen if ev.type == "error"]
            assert errors == []

    asyncio.run(asyncio.wait_for(main(), 30))


def text_gateway(engine: FakeEngine, config: dict | None = None):
    return fake_gateway(engine, config, TOKEN)


def _pcm24(ms: int) -> str:
    return base64.b64encode((3000 * np.sin(np.arange(24 * ms) / 7)).astype("<i2").tobytes()).decode()


def test_the_openai_sdk_gets_input_transcription_for_the_right_item_and_a_text_only_answer():
    from fake_engine import answer_text, user_transcript_text

    async def main():
        async with text_gateway(FakeEngine(capacity=1, answer_ms=300, step_s=0.002)) as gw:
            client = AsyncOpenAI(api_key=TOKEN, websocket_base_url=f"ws://127.0.0.1:{gw.port}/v1")
            seen: list = []
            async with client.realtime.connect(model="gpt-realtime") as conn:
                await sdk_until(conn, "session.created", seen)
                await conn.session.update(session={"type": "realtime", "output_modalities": ["text"], "audio": {"input": {
                    "transcription": {"model": "gpt-4o-transcribe"}, "turn_detection": None}}})
                upd = await sdk_until(conn, "session.updated", seen)
                assert upd.session.output_modalities == ["text"]
                assert upd.session.audio.input.transcription.model == "gpt-4o-transcribe"
                await conn.input_audio_buffer.append(audio=_pcm24(600))
                await conn.input_audio_buffer.commit()
                committed = await sdk_until(conn, "input_audio_buffer.committed", seen)
                await conn.response.create()
                done = await sdk_until(conn, "response.done", seen)
                if not any(ev.type == "conversation.item.input_audio_transcription.completed" for ev in seen):
                    await sdk_until(conn, "conversation.item.input_audio_transcription.completed", seen)
                sid = next(ev for ev in seen if ev.type == "session.created").session.id
                conv = gw.engine.conversation(sid)
            assert [ev for ev in seen if ev.type == "error"] == []
            want_user = user_transcript_text(30)  # 600 ms: 30 frames
            deltas = [ev for ev in seen if ev.type == "conversation.item.input_audio_transcription.delta"]
            assert {d.item_id for d in deltas} == {committed.item_id} and "".join(d.delta for d in deltas) == want_user
            completed = next(ev for ev in seen if ev.type == "conversation.item.input_audio_transcription.completed")
            assert (completed.item_id, completed.content_index, completed.transcript) == (committed.item_id, 0, want_user)
            assert completed.usage.type == "duration" and completed.usage.seconds == 0.6
            want = answer_text(conv.index, 0)
            text = [ev for ev in seen if ev.type == "response.output_text.delta"]
            assert "".join(d.delta for d in text) == want and {d.response_id for d in text} == {done.response.id}
            assert next(ev for ev in seen if ev.type == "response.output_text.done").text == want
            assert done.response.output_modalities == ["text"] and done.response.output[0].content[0].type == "output_text"
            assert done.response.output[0].content[0].text == want
            assert not any(ev.type.startswith("response.output_audio") for ev in seen)

    asyncio.run(asyncio.wait_for(main(), 30))


def test_the_openai_sdk_gets_the_models_text_on_the_audio_transcript_and_a_typed_turn_answered():
    from fake_engine import answer_text

    async def main():
        engine = FakeEngine(capacity=1, answer_ms=300, step_s=0.002)
        async with text_gateway(engine, {"session": {"assistant_text": True}, "vad": {"enabled": False}}) as gw:
            client = AsyncOpenAI(api_key=TOKEN, websocket_base_url=f"ws://127.0.0.1:{gw.port}/v1")
            seen: list = []
            async with client.realtime.connect(model="gpt-realtime") as conn:
                created = await sdk_until(conn, "session.created", seen)
                await conn.conversation.item.create(item={"type": "message", "role": "user", "content": [
                    {"type": "input_text", "text": "What is the capital of France?"}]})
                added = await sdk_until(conn, "conversation.item.done", seen)
                await conn.response.create()
                done = await sdk_until(conn, "response.done", seen)
            conv = engine.conversation(created.session.id)
            assert [ev for ev in seen if ev.type == "error"] == []
            assert added.item.content[0].text == "What is the capital of France?"
            assert conv.user_texts == ["What is the capital of France?"] and conv.handles[0].user_frames == 0
            want = answer_text(conv.index, 0)
            kinds = [ev.type for ev in seen]
            assert kinds.index("response.output_audio_transcript.delta") < kinds.index("response.output_audio.delta")
            assert "".join(ev.delta for ev in seen if ev.type == "response.output_audio_transcript.delta") == want
            assert next(ev for ev in seen if ev.type == "response.output_audio_transcript.done").transcript == want
            assert done.response.status == "completed" and done.response.output[0].content[0].transcript == want
            assert not any(ev.type.startswith("conversation.item.input_audio_transcription") for ev in seen)  # typed: nothing to transcribe

    asyncio.run(asyncio.wait_for(main(), 30))


def test_the_openai_sdk_is_told_which_text_fields_a_model_without_text_refuses():
    async def main():
        async with text_gateway(FakeEngine(capacity=1, text_model=False)) as gw:
            client = AsyncOpenAI(api_key=TOKEN, websocket_base_url=f"ws://127.0.0.1:{gw.port}/v1")
            seen: list = []
            async with client.realtime.connect(model="gpt-realtime") as conn:
                await sdk_until(conn, "session.created", seen)
                await conn.session.update(session={"type": "realtime", "audio": {"input": {"transcription": {"model": "whisper-1"}}}})
                err1 = await sdk_until(conn, "error", seen)
                await conn.session.update(session={"type": "realtime", "output_modalities": ["text"]})
                err2 = await sdk_until(conn, "error", seen)
                await conn.conversation.item.create(item={"type": "message", "role": "user", "content": [
                    {"type": "input_text", "text": "hello"}]})
                err3 = await sdk_until(conn, "error", seen)
                await conn.response.create(response={"output_modalities": ["text"]})
                err4 = await sdk_until(conn, "error", seen)
            assert [e.error.param for e in (err1, err2, err3, err4)] == [
                "session.audio.input.transcription", "session.output_modalities", "item.content[0].type", "response.output_modalities"]
            updated = [ev for ev in seen if ev.type == "session.updated"]
            assert [u.session.audio.input.transcription for u in updated] == [None, None]
            assert [u.session.output_modalities for u in updated] == [["audio"], ["audio"]]

    asyncio.run(asyncio.wait_for(main(), 30))
