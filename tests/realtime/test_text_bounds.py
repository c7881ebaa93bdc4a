"""Per-session text bounds (realtime/text_limits.py) over a real WebSocket on 127.0.0.1, on the fake engine:
each bound refused with an error naming it, before the text is tokenized, and the session goes on; text the
model cannot read refused in its tokens; a witness call keeps its audio beside a flood of 1.9 MB instructions.
The hostile inputs are generated here (emoji, zero-width and combining characters: few characters, many
bytes and tokens)."""

from __future__ import annotations

import asyncio
import base64
import json
import threading
import time

import websockets
from fake_engine import FakeEngine
from rt_helpers import fake_gateway

TOKEN = "text-token"
EMOJI, ZERO_WIDTH, COMBINING = "\U0001F600", "\u200b", "\u0301"  # 4, 3 and 2 bytes a character in UTF-8

LIMITS = {"max_items": 12, "max_item_text_bytes": 1000, "max_conversation_text_bytes": 4000, "max_instructions_bytes": 1500,
          "max_system_text_bytes": 2500}


class Client:
    """A Realtime client that reads every event into a list."""

    def __init__(self, ws) -> None:
        self.ws, self.events = ws, []
        self._new = asyncio.Event()
        self._rx = asyncio.create_task(self._read())

    @classmethod
    async def connect(cls, port: int) -> Client:
        ws = await websockets.connect(f"ws://127.0.0.1:{port}/v1/realtime", additional_headers={"Authorization": f"Bearer {TOKEN}"},
                                      max_size=1 << 22)
        c = cls(ws)
        await c.next("session.created")
        return c

    async def _read(self) -> None:
        try:
            async for m in self.ws:
                self.events.append((time.monotonic(), json.loads(m)))
                self._new.set()
        except websockets.ConnectionClosed:
            pass

    async def next(self, *kinds: str, timeout: float = 10.0) -> dict:
        """The first event of `kinds` not yet taken by a `next`."""
        deadline = time.monotonic() + timeout
        while True:
            for k, (_, e) in enumerate(self.events):
                if e["type"] in kinds and not e.get("_taken"):
                    e["_taken"] = True
                    return e
            self._new.clear()
            if time.monotonic() > deadline:
                raise AssertionError(f"no {kinds}; got {[e['type'] for _, e in self.events]}")
            try:
                await asyncio.wait_for(self._new.wait(), max(0.01, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                pass

    async def send(self, **event) -> None:
        await self.ws.send(json.dumps(event))

    async def item(self, role: str, text: str, **kw) -> dict:
        """conversation.item.create of a message with one text part: its conversation.item.done or error."""
        part = "input_text" if role in ("user", "system") else "output_text"
        await self.send(type="conversation.item.create", item={"type": "message", "role": role, **kw,
                                                               "content": [{"type": part, "text": text}]})
        return await self.next("conversation.item.done", "error")

    async def close(self) -> None:
        await self.ws.close()
        await self._rx


def refused(ev: dict, code: str, param: str, *words: str) -> None:
    assert ev["type"] == "error", ev
    err = ev["error"]
    assert (err["type"], err["code"], err["param"]) == ("invalid_request_error", code, param), err
    for w in words:
        assert w in err["message"], (w, err["message"])


def run(main, timeout_s: float = 60) -> None:
    asyncio.run(asyncio.wait_for(main(), timeout_s))


def test_each_text_bound_is_an_error_naming_it_and_the_session_goes_on():
    async def main():
        engine = FakeEngine(text_context=1 << 20)  # the model's context is not the bound here (next test)
        async with fake_gateway(engine, {"limits": {"text": LIMITS}}, TOKEN) as gw:
            c = await Client.connect(gw.port)
            # one item's text, in bytes: 251 emoji are 1004 bytes (and 251 characters); a 1.9 MB part is
            # refused without being encoded; a function output counts as text too
            refused(await c.item("assistant", EMOJI * 251), "string_above_max_length", "item.content[0].text",
                    "1000 bytes", "limits.text.max_item_text_bytes")
            refused(await c.item("user", "x" * 1_900_000), "string_above_max_length", "item.content[0].text", "1900000")
            await c.send(type="conversation.item.create", item={"type": "message", "role": "system", "content": [
                {"type": "input_text", "text": ZERO_WIDTH * 200}, {"type": "input_text", "text": COMBINING * 201}]})
            refused(await c.next("error"), "string_above_max_length", "item.content[1].text")  # 600 + 402 bytes together
            await c.send(type="conversation.item.create", item={"type": "function_call_output", "call_id": "c1",
                                                                "output": "{" + "9" * 1000 + "}"})
            refused(await c.next("error"), "string_above_max_length", "item.output")

            # the instructions, then the system text (instructions + system messages) in bytes
            await c.send(type="session.update", session={"instructions": COMBINING * 751, "temperature": 0.5})
            refused(await c.next("error"), "string_above_max_length", "session.instructions", "limits.text.max_instructions_bytes")
            updated = (await c.next("session.updated"))["session"]  # the other field applied, the instructions unchanged
            assert updated["instructions"] == "" and engine.conversations[updated["id"]].options.system_prompt is None
            await c.send(type="session.update", session={"instructions": "i" * 1400})
            assert (await c.next("session.updated"))["session"]["instructions"] == "i" * 1400
            assert (await c.item("system", "s" * 900))["type"] == "conversation.item.done"  # 1400 + 901
            refused(await c.item("system", "t" * 300), "conversation_limit_exceeded", "item", "limits.text.max_system_text_bytes")
            await c.send(type="session.update", session={"instructions": "j" * 1500})  # 1500 + 901 > 2500? no: 2401
            assert (await c.next("session.updated", "error"))["type"] == "session.updated"
            await c.send(type="response.create", response={"instructions": "k" * 1600})
            refused(await c.next("error"), "string_above_max_length", "response.instructions")
            await c.send(type="response.create", response={"instructions": "k" * 1499 + EMOJI})  # 1503 bytes
            refused(await c.next("error"), "string_above_max_length", "response.instructions", "1503")

            # every client item's text together; deleting one makes room again
            kept = [(await c.item("assistant", "a" * 900))["item"]["id"] for _ in range(3)]  # 2700 + the system's 900
            refused(await c.item("assistant", "b" * 500), "conversation_limit_exceeded", "item",
                    "limits.text.max_conversation_text_bytes")
            await c.send(type="conversation.item.delete", item_id=kept[0])
            await c.next("conversation.item.deleted")
            assert (await c.item("assistant", "b" * 500))["type"] == "conversation.item.done"

            # the items a conversation holds at once (here 12)
            held = 4  # the system message, two of the three assistant items and the last one
            for _ in range(LIMITS["max_items"] - held):
                assert (await c.item("assistant", "c"))["type"] == "conversation.item.done"
            refused(await c.item("assistant", "c"), "conversation_limit_exceeded", "item", "12 items", "limits.text.max_items")
            refused(await c.item("user", "hi"), "conversation_limit_exceeded", "item")

            # the session goes on: an answer, and no text was counted (the fake's context is not the bound here)
            await c.send(type="response.create")
            assert (await c.next("response.done"))["response"]["status"] == "completed"
            await c.close()
            assert c.ws.close_code == 1000 and len(engine.token_counts) <= 8  # only texts within the bounds were counted
            assert max(engine.token_counts) <= 1500

    run(main)


def test_text_beyond_the_models_context_is_refused_in_tokens_before_the_engine_reads_it():
    async def main():
        # the fake counts a token per byte; a context of 400 positions leaves the system text 100 tokens and
        # a typed turn 200 (FakeEngine.text_budget)
        engine = FakeEngine(text_context=400, answer_ms=200)
        async with fake_gateway(engine, {}, TOKEN) as gw:
            c = await Client.connect(gw.port)
            sid = engine.opened[-1].id
            refused(await c.item("user", EMOJI * 51), "context_length_exceeded", "item.content",  # 51 characters, 204 tokens
                    "204 tokens", "at most 200", "400 positions")
            assert (await c.item("user", EMOJI * 50))["type"] == "conversation.item.done"
            await c.send(type="session.update", session={"instructions": ZERO_WIDTH * 34})  # 102 tokens
            refused(await c.next("error"), "context_length_exceeded", "session.instructions", "102 tokens", "at most 100")
            await c.next("session.updated")
            await c.send(type="session.update", session={"instructions": "be brief"})  # 8 tokens
            await c.next("session.updated")
            # system messages: each counted once, as it comes (8 + 3 x 26 = 86 tokens with the line breaks; a fourth is 113)
            for k in range(3):
                assert (await c.item("system", f"rule {k}: " + "r" * 17))["type"] == "conversation.item.done"
            refused(await c.item("system", "rule 3: " + "r" * 18), "context_length_exceeded", "item", "at most 100")
            counted = engine.token_counts
            assert sorted(counted) == sorted([51, 50, 34, 8, 25, 25, 25, 26]), counted  # never the whole system text again
            # one answer's own instructions, with the system messages: 30 + 78 > 100
            await c.send(type="response.create", response={"instructions": "q" * 30})
            refused(await c.next("error"), "context_length_exceeded", "response.instructions")
            await c.send(type="response.create", response={"instructions": "short"})
            assert (await c.next("response.done"))["response"]["status"] == "completed"
            conv = engine.conversations[sid]
            assert conv.handles[-1].instructions == "short\n" + "\n".join(f"rule {k}: " + "r" * 17 for k in range(3))
            await c.close()

    run(main)


def test_new_text_to_tokenize_is_taken_from_a_budget():
    """Distinct texts for the tokenizer cost the event loop ~0.3 ms a KiB each: new ones beyond
    `tokenize_bytes_per_s` are refused, text already counted is free, and the session goes on."""
    async def main():
        engine = FakeEngine(text_context=1 << 20)
        config = {"limits": {"text": {"tokenize_bytes_per_s": 1, "tokenize_bytes_burst": 20_000}}}
        async with fake_gateway(engine, config, TOKEN) as gw:
            c = await Client.connect(gw.port)
            first, second = "a" * 16_000, "b" * 16_000
            for text in (first, second, first):
                await c.send(type="session.update", session={"instructions": text})
                if text is second:
                    refused(await c.next("error"), "input_rate_exceeded", "session.instructions",
                            "limits.text.tokenize_bytes_per_s", "try again in")
                assert (await c.next("session.updated"))["session"]["instructions"] == first
            refused(await c.item("user", "c" * 5000), "input_rate_exceeded", "item.content")  # a typed turn, counted too
            await c.close()
            assert engine.token_counts == [16_000]  # the first text, once

    run(main)


def _flood(port: int, message: str, stop: threading.Event, answered: list[float]) -> None:
    """A client on its own thread and loop (its own costs are not the server's): the same huge
    session.update again and again, each sent once the server answered the last."""

    async def main():
        async with websockets.connect(f"ws://127.0.0.1:{port}/v1/realtime", additional_headers={"Authorization": f"Bearer {TOKEN}"},
                                      max_size=1 << 22) as ws:
            await ws.recv()  # session.created
            try:
                while not stop.is_set():
                    t0 = time.monotonic()
                    await ws.send(message)
                    while json.loads(await ws.recv())["type"] != "session.updated":
                        pass
                    answered.append(time.monotonic() - t0)
            except websockets.ConnectionClosed as e:  # over its input budget too long: closed (1008), as it may be
                assert e.rcvd is not None and e.rcvd.code == 1008, e

    asyncio.run(main())


def test_a_witness_keeps_its_audio_beside_a_flood_of_huge_instructions():
    """Instructions of 1.9 MB were tokenized on the event loop at each session.update (2 to 5 s each, a
    witness call stalled up to 4 s). Now they are refused by their size before anything reads them: the
    flood is answered update after update while the witness's answer streams, and no text reaches the
    engine. (Its audio gaps are measured side by side with the code before, by scripts/text_flood.py:
    timings are not asserted in tests.)"""
    async def main():
        engine = FakeEngine(answer_ms=6000, chunk_ms=40)
        async with fake_gateway(engine, {"vad": {"enabled": False}}, TOKEN) as gw:
            witness = await Client.connect(gw.port)
            await witness.send(type="response.create")
            await witness.next("response.output_audio.delta")
            message = json.dumps({"type": "session.update", "session": {"instructions": (ZERO_WIDTH + "word ") * 240_000}},
                                 ensure_ascii=False)
            assert 1_900_000 < len(message.encode()) < 2 << 20  # within limits.max_message_bytes
            stop, answered = threading.Event(), []
            flooder = threading.Thread(target=_flood, args=(gw.port, message, stop, answered))
            flooder.start()
            done = await witness.next("response.done", timeout=30)
            during = len(answered)
            stop.set()
            await asyncio.to_thread(flooder.join, 30)
            audio = sum(len(base64.b64decode(e["delta"])) for _, e in witness.events if e["type"] == "response.output_audio.delta")
            await witness.close()
            flood_conv = engine.opened[-1]
            return done, during, audio, flood_conv

    done, during, audio, flood_conv = asyncio.run(asyncio.wait_for(main(), 60))
    assert done["response"]["status"] == "completed" and audio == 6 * 24_000 * 2  # the whole answer
    assert during >= 3  # the flood ran beside it (as fast as the input budget reads it), each update answered: refused
    assert flood_conv.options.system_prompt is None and flood_conv.engine.token_counts == []  # nothing tokenized
