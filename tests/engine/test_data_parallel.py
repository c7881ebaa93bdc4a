"""Several engines in one server (`engine.data_parallel_size`, engine/README.md "Several engines"):
vLLM's data-parallel engine cores on CPU with our scheduler and worker, one thread each. Conversations
spread over the ranks and stay on theirs (its prefix cache serves their next turn), every answer equals
the reference, a CFG pair runs on its conversation's rank, and admission is per rank."""

from __future__ import annotations

import asyncio
import itertools

import numpy as np
import pytest

from engine.codec.synth import speech_like
from engine.reference import ReferenceOpusLM
from engine.request import AudioRequest
from engine.sampling import GREEDY
from engine.service import Engine, EngineServiceConfig
from engine.service_api import AtCapacity, ConversationOptions

RANKS = 2
MAX_RESPONSE_MS = 400.0  # 20 frames
GREEDY_OPTIONS = ConversationOptions(temperature=0.0, max_response_ms=MAX_RESPONSE_MS)


@pytest.mark.parametrize("bad", [0, -1, 1.5, "2", None, True])
def test_data_parallel_size_must_be_a_positive_integer(bad) -> None:
    with pytest.raises(ValueError, match="engine.data_parallel_size"):
        EngineServiceConfig(data_parallel_size=bad)


def test_the_ranks_share_the_cores_the_codec_leaves() -> None:
    import os

    from engine.service import engine_cpu_threads

    cores = len(os.sched_getaffinity(0))
    assert engine_cpu_threads(None, "cpu", ranks=2) == max(1, (cores - 1) // 2)
    assert engine_cpu_threads(None, "cpu", ranks=1) == engine_cpu_threads(None, "cpu") == max(1, cores - 1)
    assert engine_cpu_threads(1, "cpu", ranks=2) == 1 and engine_cpu_threads(None, "cuda", ranks=2) == 0


def test_the_serve_config_names_the_key() -> None:
    from realtime.config import config_from_dict

    assert config_from_dict({"engine": {"data_parallel_size": 2}}).engine.data_parallel_size == 2
    for bad in ("two", 0):
        with pytest.raises(ValueError, match="engine.data_parallel_size"):
            config_from_dict({"engine": {"data_parallel_size": bad}})


def test_rank_metrics_come_from_the_load() -> None:
    from realtime.metrics import GatewayMetrics
    from engine.service_api import EngineLoad

    class Stub:
        def load(self):
            return EngineLoad(conversations=3, responding=1, capacity=9, step_ms=5.0, batch_size=0.5,
                              extra={"bounds": {"engine": 9}, "limited_by": "engine", "feedback_ceiling": None,
                                     "ranks": [{"rank": 0, "conversations": 2, "responding": 1, "engine_bound": 5, "step_ms": 5.0},
                                               {"rank": 1, "conversations": 1, "responding": 0, "engine_bound": 4, "step_ms": 3.5}]})

    text = GatewayMetrics().render(Stub()).decode()
    assert 'duplex_engine_rank_conversations{rank="0"} 2.0' in text and 'duplex_engine_rank_bound{rank="1"} 4.0' in text
    assert 'duplex_engine_rank_step_ms{rank="1"} 3.5' in text


@pytest.fixture(scope="module")
def engine(loop_thread, tiny_model):
    eng = loop_thread.run(Engine.start(EngineServiceConfig(model=str(tiny_model), data_parallel_size=RANKS, cpu_threads=1,
                                                           max_conversations=8)))
    # what the warm-up measured, before the tests below set the measurements they need
    eng.warm_step_ms = [dict(times) for times in eng._capacity.rank_step_ms]
    # the machine's other work must not refuse these conversations (the cpu bound: test_capacity.py)
    eng._capacity.cpu_cores = 0.0
    yield eng
    loop_thread.run(eng.shutdown())


def measured(engine: Engine, *rank_points: dict[int, float]) -> None:
    """Set each rank's step-time table as its warm-up's, with no live step yet (neither the warm-up's noise
    nor an earlier test's live steps may decide where conversations go)."""
    cap = engine._capacity
    for table, prior, live, points in zip(cap.rank_step_ms, cap.rank_prior, cap.rank_live_at, rank_points, strict=True):
        for d in (table, prior, live):
            d.clear()
        table.update(points)
        prior.update(points)


_ids = itertools.count()


async def one_turn(conv, seconds: float, seed: int) -> tuple[np.ndarray, np.ndarray, int]:
    pcm = (speech_like(seconds, seed=seed) * 20000).astype(np.int16)
    for i in range(0, len(pcm), 1600):
        conv.push_user_audio(pcm[i : i + 1600])
    conv.end_user_turn()
    chunks = [c async for c in conv.respond(f"dp_resp_{next(_ids)}").chunks()]
    assert chunks and chunks[-1].is_last
    return conv.last_prompt.copy(), conv._turns[-1].frames.copy(), conv.cached_tokens_last_response


@pytest.mark.vllm
def test_the_ranks_start_warm_with_one_thread_each(engine, loop_thread) -> None:
    assert loop_thread.run(engine.pipeline.llm.rank_threads()) == [1] * RANKS
    assert [sorted(t) for t in engine.warm_step_ms] == [[1, 4, 8]] * RANKS  # every rank measured its own steps
    assert engine.health().ready and [r["rank"] for r in engine.load().extra["ranks"]] == list(range(RANKS))


@pytest.mark.vllm
def test_conversations_spread_over_the_ranks_and_each_equals_the_reference(engine, loop_thread, tiny_model) -> None:
    measured(engine, {1: 4.0, 8: 8.0}, {1: 4.0, 8: 8.0})  # equal ranks: 8 each (max_conversations)
    guided = ConversationOptions(temperature=0.0, max_response_ms=MAX_RESPONSE_MS, cfg_scale=2.5)

    async def run():
        convs = [engine.open_conversation(f"dp{i}", guided if i == 3 else GREEDY_OPTIONS) for i in range(4)]
        load = engine.load()

        async def dialogue(i, conv):
            turns = [await one_turn(conv, 0.8 + 0.2 * i, seed=20 + i)]
            if i != 3:  # a second turn reads the first's KV from its rank's prefix cache
                turns.append(await one_turn(conv, 0.6, seed=40 + i))
            return turns

        results = await asyncio.gather(*(dialogue(i, c) for i, c in enumerate(convs)))
        ranks = [c.rank for c in convs]
        for c in convs:
            await c.close()
        return ranks, load, results

    ranks, load, results = loop_thread.run(run(), timeout=300)
    assert ranks == [0, 1, 0, 1]
    assert [r["conversations"] for r in load.extra["ranks"]] == [2, 2] and load.conversations == 4
    assert load.extra["bounds"]["engine"] == 16 and load.capacity == 8  # 8 + 8, the server's max_conversations
    ref = ReferenceOpusLM.from_dir(tiny_model)
    max_frames = int(MAX_RESPONSE_MS // 20)
    for i, turns in enumerate(results):
        for prompt, frames, _ in turns:
            want = ref.generate(AudioRequest(prompt, max_frames, 1, GREEDY, cfg_scale=2.5 if i == 3 else 1.0)).frames
            np.testing.assert_array_equal(frames, want, err_msg=f"conversation dp{i} (rank {ranks[i]})")
        if len(turns) == 2:
            assert turns[1][2] >= 32  # its history came from the prefix cache of the rank it stayed on
    # both ranks stepped: each one's table moved from what `measured` set (a rank's steps are its own batch)
    assert all(table != {1: 4.0, 8: 8.0} for table in engine._capacity.rank_step_ms)
    assert engine.load().conversations == 0


@pytest.mark.vllm
def test_admission_is_per_rank_and_a_conversation_keeps_its_rank(engine, loop_thread) -> None:
    # rank 0: 9 + 2(b - 1) ms, 4 fit a 16 ms budget; rank 1: 15 + 4(b - 1) ms, 1 fits
    measured(engine, {1: 9.0, 8: 23.0}, {1: 15.0, 8: 43.0})
    assert engine._capacity.rank_bounds() == [4, 1] and engine.capacity() == 5

    async def run():
        convs = [engine.open_conversation(f"adm{i}") for i in range(5)]
        ranks = [c.rank for c in convs]  # the most headroom first: 4-0 > 1-0 ... 1-3 = 1-0: fewer conversations
        with pytest.raises(AtCapacity, match="server at capacity"):
            engine.open_conversation("adm5")
        away = convs[3]
        away.suspend()  # its slot on rank 1 is free
        other = engine.open_conversation("adm6")
        await convs[0].close()  # the server has room, rank 1 has none: "away" comes back to its rank or not at all
        with pytest.raises(AtCapacity, match="engine rank 1 at capacity"):
            away.resume()
        await other.close()
        away.resume()
        detail = engine.load().extra["ranks"]
        for c in convs[1:]:
            await c.close()
        return ranks, other.rank, away.rank, detail

    ranks, other_rank, away_rank, detail = loop_thread.run(run())
    assert ranks == [0, 0, 0, 1, 0] and other_rank == 1 and away_rank == 1
    assert [(d["conversations"], d["engine_bound"]) for d in detail] == [(3, 4), (1, 1)]
