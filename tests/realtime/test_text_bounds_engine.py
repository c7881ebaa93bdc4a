"""Text the real model cannot read, refused in its tokens before the engine is asked: `/v1/audio/speech`
with 4096 emoji, zero-width or combining characters (within the 4096-character limit: 16384, 12288 and
8192 byte-level tokens of a 4096-position context) is a 400 naming the limit in tokens, not an engine
failure; and on the realtime API a typed turn or instructions beyond the model's context are an error
event, the session going on. Real engine (tiny model, CPU, vLLM), real sockets on 127.0.0.1."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request

import pytest
import websockets
from rt_helpers import running_gateway

from engine.text import TextTokenizer
from engine.text_budget import text_budget

pytestmark = pytest.mark.vllm

TOKEN = "text-engine-token"


@pytest.fixture(scope="module")
def gateway(loop_thread, tiny_model):
    with running_gateway(loop_thread, tiny_model, 2, {
        "server": {"token": TOKEN}, "session": {"max_response_ms": 600.0, "temperature": 0.0},
        "vad": {"enabled": False}, "audio_api": {"max_speech_s": 0.4},
    }) as gw:
        yield gw


def speech(gw, text: str) -> tuple[int, dict | bytes]:
    body = json.dumps({"model": "duplex", "input": text, "voice": "alloy", "response_format": "pcm"}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{gw.port}/v1/audio/speech", body, method="POST",
                                 headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())["error"]


@pytest.mark.parametrize("char,tokens", [("\U0001F600", 16384), ("\u200b", 12288), ("\u0301", 8192)],
                         ids=["emoji", "zero-width", "combining"])
def test_speech_beyond_the_models_context_is_a_400_naming_the_limit_in_tokens(gateway, tiny_model, char, tokens):
    tokenizer = TextTokenizer.from_dir(tiny_model)
    assert len(tokenizer.encode(char * 4096)) == tokens  # 4096 characters, the character limit: allowed so far
    limit = gateway.admission.engine.text_budget().speech_tokens
    assert limit == text_budget(4096, gateway.admission.engine.pipeline.prompt_layout, 128).speech_tokens
    status, err = speech(gateway, char * 4096)
    assert status == 400, err
    assert isinstance(err, dict) and (err["type"], err["code"], err["param"]) == ("invalid_request_error", "context_length_exceeded", "input")
    assert err["message"] == f"input is {tokens} tokens of this model; at most {limit} fit its context of 4096 positions"
    status, audio = speech(gateway, "Hello there.")  # the endpoint goes on serving
    assert status == 200 and isinstance(audio, bytes) and len(audio) > 0


def test_a_typed_turn_or_instructions_beyond_the_context_are_errors_and_the_session_goes_on(gateway):
    budget = gateway.admission.engine.text_budget()
    assert budget.system_tokens == 1024 and 2000 < budget.user_text_tokens < 3000

    async def main():
        async with websockets.connect(f"ws://127.0.0.1:{gateway.port}/v1/realtime",
                                      additional_headers={"Authorization": f"Bearer {TOKEN}"}) as ws:
            async def send(**ev) -> None:
                await ws.send(json.dumps(ev))

            async def until(*kinds: str) -> dict:
                while (ev := json.loads(await asyncio.wait_for(ws.recv(), 120)))["type"] not in kinds:
                    pass
                return ev

            await until("session.created")
            await send(type="conversation.item.create", item={"type": "message", "role": "user",  # 3000 bytes, 3000 tokens
                                                               "content": [{"type": "input_text", "text": "\U0001F600" * 750}]})
            typed = (await until("error", "conversation.item.done"))
            await send(type="session.update", session={"instructions": "\u200b" * 400})  # 1200 tokens
            instructions = await until("error", "session.updated")
            await until("session.updated")
            await send(type="conversation.item.create", item={"type": "message", "role": "user",
                                                               "content": [{"type": "input_text", "text": "Hello, how are you?"}]})
            await until("conversation.item.done")
            await send(type="response.create")
            done = await until("response.done")
            return typed, instructions, done

    typed, instructions, done = asyncio.run(asyncio.wait_for(main(), 300))
    assert typed["type"] == "error" and typed["error"]["code"] == "context_length_exceeded", typed
    assert typed["error"]["message"] == f"the typed user turn is 3000 tokens of this model; at most {budget.user_text_tokens} fit " \
                                        "(of its context of 4096 positions)"
    assert instructions["type"] == "error" and instructions["error"]["param"] == "session.instructions"
    assert "1200 tokens" in instructions["error"]["message"] and "at most 1024" in instructions["error"]["message"]
    assert done["response"]["status"] == "completed"
