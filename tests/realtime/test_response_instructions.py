"""`response.create`'s own `instructions` (docs/protocol.md, "Per-response instructions") over a real
WebSocket to a Gateway on the fake engine: LiveKit's quickstart greeting (`generate_reply(instructions=...)`)
on an empty conversation gets an answer and no error, and the engine is given those instructions for that
answer alone. That the engine's model reads them (and the history keeps the session's) is tested on the
real engine (tests/engine/test_service_text.py)."""

from __future__ import annotations

import asyncio
import json

import websockets
from fake_engine import FakeEngine
from rt_helpers import fake_gateway

from engine.service_api import Role

TOKEN = "instructions-token"
SESSION = "You are a helpful voice assistant."
# LiveKit's RealtimeSession.generate_reply sends the session's instructions, a newline, then the reply's
GREETING = f"{SESSION}\nGreet the user and offer your assistance."


def test_a_greeting_with_its_own_instructions_on_an_empty_conversation_is_answered_with_them_alone():
    async def main():
        engine = FakeEngine(capacity=1, answer_ms=300, step_s=0.002)
        async with fake_gateway(engine, None, TOKEN) as gw:
            ws = await websockets.connect(f"ws://127.0.0.1:{gw.port}/v1/realtime",
                                          additional_headers={"Authorization": f"Bearer {TOKEN}"})
            events: list[dict] = []

            async def until(kind: str) -> dict:
                while True:
                    events.append(json.loads(await ws.recv()))
                    if events[-1]["type"] == kind:
                        return events[-1]

            async def send(**event) -> None:
                await ws.send(json.dumps(event))

            created = await until("session.created")
            await send(type="session.update", session={"type": "realtime", "instructions": SESSION})
            await until("session.updated")
            await send(type="response.create", response={"instructions": GREETING, "metadata": {"client_event_id": "greet"}})
            greeted = await until("response.done")
            await send(type="response.create", response={})  # the next answer: the session's
            plain = await until("response.done")
            await send(type="response.create", response={"instructions": SESSION})  # the session's own: as none
            same = await until("response.done")
            # a system message's text follows the instructions, the session's or an answer's own
            await send(type="conversation.item.create", item={"type": "message", "role": "system",
                                                              "content": [{"type": "input_text", "text": "Speak slowly."}]})
            await until("conversation.item.done")
            await send(type="response.create", response={"instructions": "Say goodbye."})
            await until("response.done")
            await send(type="response.create", response={"instructions": 7}, event_id="bad")  # not a string
            error = await until("error")
            await ws.close()
            return events, created, (greeted, plain, same), error, engine.conversation(created["session"]["id"])

    events, created, dones, error, conv = asyncio.run(asyncio.wait_for(main(), 30))
    greeted, plain, same = dones
    assert [d["response"]["status"] for d in dones] == ["completed"] * 3
    assert greeted["response"]["metadata"] == {"client_event_id": "greet"}
    assert [e for e in events if e["type"] == "error"] == [error]  # only the bad one
    assert error["error"]["param"] == "response.instructions" and error["error"]["event_id"] == "bad"
    # the engine: each answer's own system text, for it alone; the conversation's stays the session's
    assert [h.instructions for h in conv.handles] == [GREETING, None, None, "Say goodbye.\nSpeak slowly."]
    assert all(h.options.system_prompt == SESSION for h in conv.handles[:3])
    assert conv.handles[3].options.system_prompt == f"{SESSION}\nSpeak slowly."
    # the greeting answered an empty conversation: an empty user turn, then its answer
    assert [(t.role, t.audio_frames) for t in conv.history[:2]] == [(Role.USER, 0), (Role.ASSISTANT, 15)]
