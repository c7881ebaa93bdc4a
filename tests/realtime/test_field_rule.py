"""The rule for the fields stock clients send (docs/protocol.md, "Every session field"), over a real
WebSocket to a Gateway on the fake engine: what an agent framework sends on its defaults (function
tools under "auto", transcription hints, a reasoning effort, parallel_tool_calls, max_output_tokens,
function_call items) gets no error, is echoed as in force, and reaches the engine where it means
something; a forced tool call is refused by name and the session goes on; the error wording clients
match on is OpenAI's; clients that opted in are told the hints in `duplex.notice`. That the engine
bounds an answer by the options these map to is tested on the real engine (test_server.py)."""

from __future__ import annotations

import asyncio
import base64
import json

import httpx
import numpy as np
import pydantic
import websockets
from fake_engine import FakeEngine
from openai.types.realtime import RealtimeServerEvent
from rt_helpers import fake_gateway

TOKEN = "rule-token"
SERVER_EVENT = pydantic.TypeAdapter(RealtimeServerEvent)
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
# what the Agents SDK / Pipecat / a typical openai-SDK app send on their defaults, with one tool
AGENT_SESSION = {
    "type": "realtime", "instructions": "You are a helpful assistant.", "tools": [WEATHER], "tool_choice": "auto",
    "parallel_tool_calls": True, "reasoning": {"effort": "low"}, "max_output_tokens": 10,
    "audio": {"input": {"transcription": {"model": "gpt-4o-transcribe", "language": "en", "prompt": "weather, cities"}},
              "output": {"voice": "alloy", "speed": 1.0}},
}


class Ws:
    def __init__(self, ws) -> None:
        self.ws, self.events = ws, []

    async def until(self, kind: str) -> dict:
        while True:
            self.events.append(json.loads(await self.ws.recv()))
            if self.events[-1]["type"] == kind:
                return self.events[-1]

    async def send(self, **event) -> None:
        await self.ws.send(json.dumps(event))

    def of(self, kind: str) -> list[dict]:
        return [e for e in self.events if e["type"] == kind]


async def _connect(gw, query: str = "") -> Ws:
    ws = await websockets.connect(f"ws://127.0.0.1:{gw.port}/v1/realtime{query}", additional_headers={"Authorization": f"Bearer {TOKEN}"})
    c = Ws(ws)
    await c.until("session.created")
    return c


def _silence_b64(ms: int) -> str:
    return base64.b64encode(np.zeros(24 * ms, "<i2").tobytes()).decode()


def test_an_agent_frameworks_defaults_get_no_error_and_reach_the_engine_as_asked():
    async def main():
        engine = FakeEngine(capacity=1, answer_ms=300, step_s=0.002)
        async with fake_gateway(engine, {"vad": {"enabled": False}}, TOKEN) as gw:
            c = await _connect(gw)
            sid = c.events[0]["session"]["id"]
            await c.send(type="session.update", session=AGENT_SESSION)
            updated = await c.until("session.updated")
            await c.send(type="session.update", session={"type": "realtime", "audio": {"input": {"turn_detection": None}}})
            await c.until("session.updated")
            await c.send(type="input_audio_buffer.append", audio=_silence_b64(300))
            await c.send(type="input_audio_buffer.commit")
            # one answer with its own bound and tools (Pipecat sends the context's tools with each response)
            await c.send(type="response.create", response={"tools": [WEATHER], "tool_choice": "none", "max_output_tokens": 5,
                                                           "parallel_tool_calls": False, "reasoning": {"effort": "minimal"}})
            own = await c.until("response.done")
            # the Agents SDK answers a tool call with these items, then asks for a response
            await c.send(type="conversation.item.create", item={"type": "function_call", "id": "fc_1", "call_id": "call_1",
                                                                 "name": "get_weather", "arguments": '{"city": "Paris"}'})
            await c.send(type="conversation.item.create", item={"type": "function_call_output", "call_id": "call_1",
                                                                 "output": '{"temp_c": 21}'})
            await c.until("conversation.item.done")
            await c.until("conversation.item.done")
            await c.send(type="response.create")
            session_bound = await c.until("response.done")
            # LiveKit's barge-in cancels what may have ended: OpenAI's wording, which it ignores
            await c.send(type="response.cancel", event_id="late_cancel")
            cancel = await c.until("error")
            # what cannot be honoured is still refused by name, and the session goes on
            await c.send(type="session.update", event_id="forced", session={"type": "realtime", "tool_choice": "required"})
            forced = await c.until("error")
            after = await c.until("session.updated")
            await c.ws.close()
            await asyncio.sleep(0.2)  # the session's end is counted
            async with httpx.AsyncClient() as http:
                metrics = (await http.get(f"http://127.0.0.1:{gw.port}/metrics", headers={"Authorization": f"Bearer {TOKEN}"})).text
            return c, sid, updated, (own, session_bound), (cancel, forced, after), metrics, engine.conversation(sid)

    c, sid, updated, dones, refusals, metrics, conv = asyncio.run(asyncio.wait_for(main(), 30))
    for ev in c.events:  # every event, the echoes included, parses as the openai SDK's models
        SERVER_EVENT.validate_python(ev)
    s = updated["session"]
    assert s["tools"] == [WEATHER] and s["tool_choice"] == "auto" and s["max_output_tokens"] == 10
    assert s["audio"]["input"]["transcription"] == {"model": "gpt-4o-transcribe", "language": "en", "prompt": "weather, cities"}
    assert "duplex.notice" not in [e["type"] for e in c.events]  # a plain client sees only OpenAI's events
    cancel, forced, after = refusals
    assert [e["error"]["event_id"] for e in c.of("error")] == ["late_cancel", "forced"]  # nothing else was an error
    assert (cancel["error"]["code"], cancel["error"]["message"]) == ("response_cancel_not_active",
                                                                     "Cancellation failed: no active response found")
    assert forced["error"]["param"] == "session.tool_choice" and forced["error"]["code"] == "unsupported_parameter"
    assert after["session"]["tool_choice"] == "auto" and after["session"]["tools"] == [WEATHER]
    # the items are the conversation's, as OpenAI echoes them; the engine heard none of them
    added = [e["item"] for e in c.of("conversation.item.added") if e["item"]["type"] != "message"]
    assert [(i["type"], i["call_id"]) for i in added] == [("function_call", "call_1"), ("function_call_output", "call_1")]
    assert added[0]["id"] == "fc_1" and added[1]["output"] == '{"temp_c": 21}'
    assert all(d["response"]["status"] == "completed" for d in dones)
    # max_output_tokens: N steps of the answer, 20 ms of audio and one text token each (the response's own, then the session's)
    own, bound = conv.handles[0].options, conv.handles[1].options
    assert (own.max_response_ms, own.max_text_tokens) == (100.0, 5)
    assert (bound.max_response_ms, bound.max_text_tokens) == (200.0, 10)
    assert conv.handles[0].options.transcribe_user  # the transcription with its hints is on
    assert "duplex_sessions_with_tools_total 1.0" in metrics


def test_clients_that_opted_in_are_told_what_was_taken_as_a_hint():
    async def main():
        engine = FakeEngine(capacity=1, answer_ms=300, step_s=0.002)
        async with fake_gateway(engine, None, TOKEN) as gw:
            c = await _connect(gw, "?duplex=1")
            await c.send(type="session.update", event_id="u1", session=AGENT_SESSION)
            await c.until("session.updated")
            await c.send(type="session.update", event_id="u2", session={"type": "realtime", "max_output_tokens": "inf", "tools": []})
            plain = await c.until("session.updated")
            await c.send(type="response.create", event_id="r1", response={"tools": [WEATHER], "tool_choice": "auto"})
            await c.until("response.created")
            await c.ws.close()
            return c, plain

    c, plain = asyncio.run(asyncio.wait_for(main(), 30))
    notices = [e["notice"] for e in c.of("duplex.notice")]
    assert {n["param"] for n in notices[:-1]} == {"session.tools", "session.reasoning", "session.audio.input.transcription.language",
                                                  "session.audio.input.transcription.prompt"}
    assert all(n["event_id"] == "u1" and n["message"] for n in notices[:-1])  # none for u2: it asked for nothing of the kind
    assert (notices[-1]["param"], notices[-1]["event_id"]) == ("response.tools", "r1")
    types = [e["type"] for e in c.events]
    assert types.index("duplex.notice") > types.index("session.updated")  # after the update they explain
    assert plain["session"]["max_output_tokens"] == "inf" and plain["session"]["tools"] == []
    assert c.of("error") == []
