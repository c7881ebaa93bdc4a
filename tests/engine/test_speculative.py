"""Speculative answers on the real engine (tiny model, CPU, greedy): `respond(speculative=True)` on
an open user turn, then `confirm()` gives exactly the answer `end_user_turn()` + `respond()` gives;
`discard()` leaves the conversation as if the answer had never started, the user turn going on
(the next answer, the history and the next prompt equal those of a conversation that never
speculated), also when context management dropped exchanges for it; with and without guidance (CFG pairs)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from dataclasses import dataclass

import numpy as np
import pytest

from engine.codec.streaming import snr_db
from engine.codec.synth import speech_like
from engine.service import Engine, EngineServiceConfig
from engine.service_api import ConversationOptions

pytestmark = pytest.mark.vllm

MAX_MODEL_LEN = 512
GREEDY = ConversationOptions(temperature=0.0, max_response_ms=400.0)  # 20 frames
GUIDED = ConversationOptions(temperature=0.0, max_response_ms=400.0, cfg_scale=2.0)  # a CFG pair per answer
_ids = itertools.count()


@pytest.fixture(scope="module")
def engine(loop_thread, tiny_model):
    eng = loop_thread.run(Engine.start(EngineServiceConfig(model=str(tiny_model), capacity_override=4,
                                                           max_model_len=MAX_MODEL_LEN, warmup=False)))
    yield eng
    loop_thread.run(eng.shutdown())


def speech(seconds: float, seed: int) -> np.ndarray:
    return (speech_like(seconds, seed=seed) * 20000).astype(np.int16)


async def push(conv, pcm: np.ndarray) -> None:
    for i in range(0, len(pcm), 1600):  # 100 ms pieces, no waiting
        conv.push_user_audio(pcm[i : i + 1600])
        await asyncio.sleep(0)


@dataclass
class Answer:
    frames: np.ndarray  # the model's tokens, [T, 9]
    pcm: np.ndarray  # as decoded by the codec stage (batched with whatever else it decodes)


async def collect(conv, handle) -> Answer:
    """The answer's chunks; its tokens are its turn in the history, which is there once chunks() ends."""
    chunks = [c async for c in handle.chunks()]
    assert chunks and chunks[-1].is_last
    return Answer(conv._turns[-1].frames.copy(), np.concatenate([c.pcm for c in chunks]))


def same_answer(got: Answer, want: Answer) -> None:
    """Token for token; the audio to the codec's batch-dependent rounding (a few LSB)."""
    np.testing.assert_array_equal(got.frames, want.frames)
    assert got.pcm.size == want.pcm.size and snr_db(want.pcm.astype(np.float64), got.pcm.astype(np.float64)) > 40.0


async def plain_turn(conv, pcm: np.ndarray) -> Answer:
    await push(conv, pcm)
    conv.end_user_turn()
    return await collect(conv, conv.respond(f"resp_plain_{next(_ids)}"))


async def confirmed_turn(conv, pcm: np.ndarray) -> Answer:
    await push(conv, pcm)
    handle = conv.respond(f"resp_spec_{next(_ids)}", speculative=True)
    await asyncio.sleep(0.05)  # it generates while undecided
    handle.confirm()
    return await collect(conv, handle)


async def discarded(conv, pcm: np.ndarray, after_chunks: int) -> tuple:
    """The user says `pcm` and pauses: an answer starts; it is discarded after `after_chunks` chunks."""
    await push(conv, pcm)
    handle = conv.respond(f"resp_spec_{next(_ids)}", speculative=True)
    got = []
    if after_chunks == 0:
        handle.discard()
    async for chunk in handle.chunks():
        got.append(chunk)
        if len(got) == after_chunks:
            handle.discard()
    handle.discard()  # idempotent
    assert len(got) == after_chunks and not any(c.is_last for c in got)  # nothing after the discard
    return handle, got


@contextlib.asynccontextmanager
async def side_by_side(engine, name: str, options: ConversationOptions):
    """Two conversations that hear the same user: one answered plainly, one speculatively."""
    plain, spec = engine.open_conversation(f"{name}_plain", options), engine.open_conversation(f"{name}_spec", options)
    try:
        yield plain, spec
    finally:
        await plain.close()
        await spec.close()


def same_conversation(a, b) -> None:
    assert a.history == b.history
    np.testing.assert_array_equal(a.next_prompt(), b.next_prompt())


@pytest.mark.parametrize("options", [GREEDY, GUIDED], ids=["greedy", "cfg"])
def test_a_confirmed_speculation_is_the_plain_answer(engine, loop_thread, options) -> None:
    async def main():
        async with side_by_side(engine, f"confirmed_{options.cfg_scale}", options) as (plain, spec):
            for t, seconds in enumerate((1.0, 0.7)):
                pcm = speech(seconds, seed=10 + t)
                want = await plain_turn(plain, pcm)
                await push(spec, pcm)
                handle = spec.respond(f"resp_spec_{next(_ids)}", speculative=True)
                await asyncio.sleep(0.05)  # it generates while undecided
                with pytest.raises(RuntimeError):
                    spec.push_user_audio(pcm[:320])  # no user audio while it is undecided
                handle.confirm()
                same_answer(await collect(spec, handle), want)
                same_conversation(spec, plain)
            with pytest.raises(RuntimeError):
                handle.discard()  # confirmed: it stands

    loop_thread.run(main())


@pytest.mark.parametrize("options", [GREEDY, GUIDED], ids=["greedy", "cfg"])
def test_a_discarded_speculation_never_happened(engine, loop_thread, options) -> None:
    async def main():
        async with side_by_side(engine, f"discarded_{options.cfg_scale}", options) as (plain, spec):
            first = speech(0.8, seed=20)
            same_answer(await confirmed_turn(spec, first), await plain_turn(plain, first))
            for t, after_chunks in enumerate((1, 0)):  # discarded after its first chunk; before any
                # the user pauses (an answer starts, then is discarded) and goes on: one turn of both parts
                before, after = speech(0.9, seed=21 + 2 * t), speech(0.6, seed=22 + 2 * t)
                await discarded(spec, before, after_chunks)
                await push(spec, after)
                spec.end_user_turn()
                got = await collect(spec, spec.respond(f"resp_spec_{next(_ids)}"))
                want = await plain_turn(plain, np.concatenate([before, after]))
                same_answer(got, want)
                same_conversation(spec, plain)
            handle = plain.respond(f"resp_plain_{next(_ids)}")
            with pytest.raises(RuntimeError):
                handle.discard()  # only a speculative answer can be taken back
            handle.cancel(0.0)

    loop_thread.run(main())


def test_a_discard_restores_the_exchanges_dropped_for_it(engine, loop_thread) -> None:
    async def main():
        async with side_by_side(engine, "drop", GREEDY) as (plain, spec):
            for t in range(4):  # 4 exchanges of 100 positions each
                pcm = speech(1.2, seed=30 + t)
                same_answer(await confirmed_turn(spec, pcm), await plain_turn(plain, pcm))
            # a long turn: the prompt and the answer no longer fit 512 positions
            before, after = speech(2.0, seed=40), speech(0.4, seed=41)
            handle, _ = await discarded(spec, before, after_chunks=1)
            assert handle.dropped_exchanges  # context management dropped exchanges for it ...
            same_conversation(spec, plain)  # ... and the discard put them back
            await push(spec, after)
            spec.end_user_turn()
            resumed = spec.respond(f"resp_spec_{next(_ids)}")
            got = await collect(spec, resumed)
            await push(plain, np.concatenate([before, after]))
            plain.end_user_turn()
            want_handle = plain.respond(f"resp_plain_{next(_ids)}")
            same_answer(got, await collect(plain, want_handle))
            assert len(resumed.dropped_exchanges) == len(want_handle.dropped_exchanges) > 0
            same_conversation(spec, plain)

    loop_thread.run(main())
