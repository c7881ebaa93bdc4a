"""The official openai SDK's realtime client against a real Gateway (fake engine, loopback): the session
its users configure, conversation items, metadata, a cancelled answer, with no error event."""

from __future__ import annotations

import asyncio
import base64
import contextlib

import numpy as np
from fake_engine import FakeEngine
from openai import AsyncOpenAI

from realtime.config import config_from_dict
from realtime.server import Gateway

TOKEN = "sdk-token"


@contextlib.asynccontextmanager
async def gateway():
    gw = Gateway(FakeEngine(capacity=2, answer_ms=600), config_from_dict({"server": {"port": 0}}), token=TOKEN)
    await gw.start()
    try:
        yield gw
    finally:
        await gw.stop()


async def _until(conn, kind: str, seen: list) -> object:
    async for ev in conn:
        seen.append(ev)
        if ev.type == kind:
            return ev
    raise AssertionError(f"closed before {kind}")


def test_the_openai_sdk_holds_two_turns_and_a_cancel_without_errors():
    async def main():
        async with gateway() as gw:
            client = AsyncOpenAI(api_key=TOKEN, websocket_base_url=f"ws://127.0.0.1:{gw.port}/v1")
            seen: list = []
            async with client.realtime.connect(model="gpt-realtime") as conn:
                created = await _until(conn, "session.created", seen)
                assert "resume_token" not in (created.model_extra or {})
                await conn.session.update(session={"type": "realtime", "instructions": "Be brief.", "audio": {"input": {
                    "transcription": None, "turn_detection": {"type": "semantic_vad", "eagerness": "high"}}}})
                upd = await _until(conn, "session.updated", seen)
                assert upd.session.audio.input.turn_detection.type == "semantic_vad"
                await conn.conversation.item.create(item={"type": "message", "role": "system",
                                                          "content": [{"type": "input_text", "text": "You are terse."}]})
                pcm = (3000 * np.sin(np.arange(24 * 500) / 7)).astype("<i2").tobytes()
                await conn.conversation.item.create(item={"type": "message", "role": "user", "content": [
                    {"type": "input_audio", "audio": base64.b64encode(pcm).decode()}]})
                await conn.response.create(response={"metadata": {"turn": "1"}})
                done = await _until(conn, "response.done", seen)
                assert done.response.status == "completed" and done.response.metadata == {"turn": "1"}
                await conn.response.create(response={"metadata": {"turn": "2"}})
                await _until(conn, "response.output_audio.delta", seen)
                await conn.response.cancel()
                done = await _until(conn, "response.done", seen)
                assert done.response.status == "cancelled" and done.response.metadata == {"turn": "2"}
            errors = [ev for ev in seen if ev.type == "error"]
            assert errors == []

    asyncio.run(asyncio.wait_for(main(), 30))
