"""A conversation with cfg_scale != 1 answers with guidance, end to end through engine.service:
its answer is the reference's CFG generation for the same prompt, and differs from the unguided one."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from engine.codec.synth import speech_like
from engine.reference import ReferenceOpusLM
from engine.request import AudioRequest
from engine.sampling import GREEDY
from engine.service import Engine, EngineServiceConfig
from engine.service_api import ConversationOptions

pytestmark = pytest.mark.vllm

MAX_RESPONSE_MS = 600.0  # 30 frames


@pytest.fixture(scope="module")
def service(loop_thread, tiny_model):
    eng = loop_thread.run(Engine.start(EngineServiceConfig(model=str(tiny_model), capacity_override=2, warmup=False)))
    yield eng
    loop_thread.run(eng.shutdown())


def test_guided_conversation_equals_the_reference_cfg(service, loop_thread, tiny_model) -> None:
    options = ConversationOptions(temperature=0.0, max_response_ms=MAX_RESPONSE_MS, cfg_scale=2.5)
    pcm = (speech_like(1.0, seed=11) * 20000).astype(np.int16)

    async def run():
        conv = service.open_conversation("guided", options)
        conv.push_user_audio(pcm)
        conv.end_user_turn()
        chunks = [c async for c in conv.respond("resp_guided").chunks()]
        prompt, frames = conv.last_prompt.copy(), conv._turns[-1].frames.copy()
        await conv.close()
        return chunks, prompt, frames

    chunks, prompt, frames = loop_thread.run(run())
    assert chunks and chunks[-1].is_last
    ref = ReferenceOpusLM.from_dir(tiny_model)
    max_frames = int(MAX_RESPONSE_MS // 20)
    guided = ref.generate(AudioRequest(prompt, max_frames, 1, GREEDY, cfg_scale=2.5)).frames
    plain = ref.generate(AudioRequest(prompt, max_frames, 1, GREEDY)).frames
    np.testing.assert_array_equal(frames, guided)
    assert not np.array_equal(guided, plain)
    assert sum(c.duration_ms for c in chunks) == pytest.approx(len(frames) * 20.0)



def test_incremental_prefill_for_plain_conversations_only(service, loop_thread) -> None:
    """While the user talks, a plain conversation prefills its stable prefix; a guided one does
    not (CFG pairs never read the prefix cache, so it would buy nothing)."""
    pcm = (speech_like(1.2, seed=5) * 20000).astype(np.int16)

    async def talk(session: str, cfg_scale: float) -> int:
        conv = service.open_conversation(session, ConversationOptions(temperature=0.0, cfg_scale=cfg_scale))
        for i in range(0, len(pcm), 1600):  # 100 ms pieces at real-time pace
            conv.push_user_audio(pcm[i : i + 1600])
            await asyncio.sleep(0.1)
        await asyncio.sleep(0.3)
        n = conv.prefilled_requests
        await conv.close()
        return n

    assert loop_thread.run(talk("plain-talker", 1.0)) > 0
    assert loop_thread.run(talk("guided-talker", 2.0)) == 0


def test_degraded_answers_run_without_the_shadow_and_shorter_until_given_back(service, loop_thread, tiny_model) -> None:
    """Overload (realtime/overload.py): `degrade` takes CFG's shadow and length from the next answers only;
    NO_DEGRADATION gives them back; the client's options stay as they were."""
    from engine.service_api import NO_DEGRADATION, Degradation

    options = ConversationOptions(temperature=0.0, max_response_ms=MAX_RESPONSE_MS, cfg_scale=2.5)
    pcm = (speech_like(1.0, seed=12) * 20000).astype(np.int16)

    async def answer(conv, rid: str):
        conv.push_user_audio(pcm)
        conv.end_user_turn()
        chunks = [c async for c in conv.respond(rid).chunks()]
        return chunks, conv.last_prompt.copy(), conv._turns[-1].frames.copy()

    async def run():
        conv = service.open_conversation("degraded", options)
        conv.degrade(Degradation(cfg=False, max_response_ms=200.0))
        first = await answer(conv, "resp_degraded")
        conv.degrade(NO_DEGRADATION)
        second = await answer(conv, "resp_given_back")
        await conv.close()
        return first, second

    (c1, p1, f1), (c2, p2, f2) = loop_thread.run(run())
    ref = ReferenceOpusLM.from_dir(tiny_model)
    np.testing.assert_array_equal(f1, ref.generate(AudioRequest(p1, 10, 1, GREEDY)).frames)  # plain, 200 ms
    assert sum(c.duration_ms for c in c1) == pytest.approx(len(f1) * 20.0) and len(f1) <= 10
    guided = ref.generate(AudioRequest(p2, int(MAX_RESPONSE_MS // 20), 1, GREEDY, cfg_scale=2.5)).frames
    np.testing.assert_array_equal(f2, guided)  # guided again, at full length
