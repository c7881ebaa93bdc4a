"""Classifier-free guidance by paired request co-scheduling, on the real vLLM engine (CPU).

Greedy parity with the reference's CFG (two passes per step, merged) for a mixed batch and under
KV pressure; the scheduler's pair check runs at every engine step (a split pair raises in the
engine core, which fails the test); an abort frees both rows; no shadow output reaches a caller.
"""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from engine import guidance, vocab
from engine.prompt import synthetic_prompt
from engine.reference import ReferenceOpusLM
from engine.request import AudioRequest
from engine.sampling import GREEDY, SamplingConfig
from engine.vllm_plugin.cfg_pairs import CfgPairsMixin
from parity import assert_same_steps as assert_same

SCALES = [1.0, 3.0, 1.5, 0.5, 2.0]


@pytest.fixture(scope="module")
def ref(tiny_model):
    return ReferenceOpusLM.from_dir(tiny_model)


def mixed_requests(n: int, prompt_frames: int = 24) -> list[AudioRequest]:
    """CFG and plain requests, different w, ragged prompts, lengths and end rules."""
    reqs = []
    for i in range(n):
        max_frames = 14 + (i * 11) % 29
        min_frames = max_frames if i % 2 == 0 else 1
        reqs.append(AudioRequest(synthetic_prompt(i, prompt_frames), max_frames, min_frames, GREEDY,
                                 cfg_scale=SCALES[i % len(SCALES)]))
    return reqs


async def run_collect(engine, req: AudioRequest):
    """(steps [S, 9], max CFG pairs seen in one step, preemptions) through stream_steps."""
    chunks = [c async for c in engine.stream_steps(req)]
    steps = np.concatenate([c.steps for c in chunks]) if chunks else np.empty((0, 9), np.int64)
    return steps, max(c.engine_cfg_pairs for c in chunks), max(c.num_preemptions for c in chunks)


# --- pure parts ------------------------------------------------------------------------------


def test_unconditional_prompt_and_merge_formula() -> None:
    p = synthetic_prompt(3, 10)
    u = guidance.unconditional_prompt(p)
    assert u.shape == p.shape and (u == vocab.PAD).all()
    c, n = torch.randn(4, 7), torch.randn(4, 7)
    w = torch.tensor([1.0, 0.0, 3.0, 0.5])
    m = guidance.merge(c, n, w)
    torch.testing.assert_close(m, n + w[:, None] * (c - n))
    assert torch.equal(m[0], c[0]) and torch.equal(m[1], n[1])
    assert not guidance.uses_cfg(1.0) and guidance.uses_cfg(3.0) and guidance.uses_cfg(0.0)
    with pytest.raises(ValueError):
        AudioRequest(p, 5, cfg_scale=-1.0)


def test_reference_cfg_changes_the_output_and_w1_is_plain(ref) -> None:
    base = AudioRequest(synthetic_prompt(1, 16), 20, 20, GREEDY)
    plain = ref.generate(base).steps
    same = ref.generate(AudioRequest(base.prompt, 20, 20, GREEDY, cfg_scale=1.0)).steps
    guided_gen = ref.generate(AudioRequest(base.prompt, 20, 20, GREEDY, cfg_scale=3.0))
    guided = guided_gen.steps
    np.testing.assert_array_equal(plain, same)
    assert guided.shape == plain.shape and not np.array_equal(guided, plain)
    assert vocab.in_stream_range(guided_gen.frames).all()


def test_pair_check_rejects_a_split() -> None:
    """The per-step check on hand-made scheduler outputs (vLLM's own scheduler-test style)."""

    class Sched(CfgPairsMixin):
        pass

    s = Sched()
    s._init_pairs()
    s.requests = {"a": SimpleNamespace(num_computed_tokens=40), "a#uncond": SimpleNamespace(num_computed_tokens=40)}
    s.shadow_of_main, s.main_of_shadow = {"a": "a#uncond"}, {"a#uncond": "a"}
    assert s.check_pairs(SimpleNamespace(num_scheduled_tokens={"a": 1, "a#uncond": 1, "b": 1})) == 1
    assert s.check_pairs(SimpleNamespace(num_scheduled_tokens={"b": 1})) == 0
    for split in ({"a": 1, "b": 1}, {"a#uncond": 1}, {"a": 2, "a#uncond": 1}):
        with pytest.raises(RuntimeError, match="CFG pair split"):
            s.check_pairs(SimpleNamespace(num_scheduled_tokens=split))
    s.requests["a#uncond"].num_computed_tokens = 39  # same tokens, different positions
    with pytest.raises(RuntimeError, match="CFG pair split"):
        s.check_pairs(SimpleNamespace(num_scheduled_tokens={"a": 1, "a#uncond": 1}))


# --- the engine ------------------------------------------------------------------------------


@pytest.mark.vllm
def test_cfg_greedy_parity_mixed_batch(vllm_engine, loop_thread, ref) -> None:
    reqs = mixed_requests(10)

    async def run():
        return await asyncio.gather(*(run_collect(vllm_engine, r) for r in reqs))

    results = loop_thread.run(run())
    assert max(pairs for _, pairs, _ in results) >= 3, "CFG pairs never ran together with others"
    for i, (req, (steps, _, _)) in enumerate(zip(reqs, results)):
        assert_same(steps, ref.generate(req).steps, f"request {i} (w={req.cfg_scale})")
    # guidance did something: a guided request differs from its unguided twin
    guided = [i for i, r in enumerate(reqs) if guidance.uses_cfg(r.cfg_scale)]
    plain_twins = [ref.generate(AudioRequest(reqs[i].prompt, reqs[i].max_frames, reqs[i].min_frames, GREEDY)).steps
                   for i in guided]
    assert sum(not np.array_equal(results[i][0], t) for i, t in zip(guided, plain_twins)) >= len(guided) - 1


@pytest.mark.vllm
def test_cfg_greedy_parity_under_preemption(loop_thread, engine_factory, tiny_model, ref) -> None:
    # 8 requests of ~200-300 tokens (CFG ones twice that) in 10 blocks of 128 force preemptions
    engine = engine_factory(
        model=str(tiny_model), block_size=128, max_num_seqs=16, num_kv_blocks=10, max_model_len=512, log_stats=True
    )
    try:
        reqs = [
            AudioRequest(synthetic_prompt(i, 120), max_frames=70 + 5 * i, min_frames=70 + 5 * i, sampling=GREEDY,
                         cfg_scale=[2.0, 1.0, 0.5, 3.0][i % 4])
            for i in range(8)
        ]

        async def run():
            return await asyncio.gather(*(run_collect(engine, r) for r in reqs))

        results = loop_thread.run(run())
        freed = loop_thread.run(wait_kv_free(engine))
    finally:
        engine.shutdown()
    preempted_cfg = [p for r, (_, _, p) in zip(reqs, results) if guidance.uses_cfg(r.cfg_scale)]
    assert sum(preempted_cfg) > 0, "KV pressure did not preempt a CFG pair"
    for i, (req, (steps, _, p)) in enumerate(zip(reqs, results)):
        assert_same(steps, ref.generate(req).steps, f"request {i} (w={req.cfg_scale}, preempted {p}x)")
    assert freed, "KV blocks still in use after every request finished"


async def wait_kv_free(engine, timeout_s: float = 30.0) -> bool:
    """True once no KV block is in use (vLLM's reset_prefix_cache succeeds only then)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if await engine._llm.reset_prefix_cache():
            return True
        await asyncio.sleep(0.1)
    return False


@pytest.mark.vllm
def test_abort_of_a_main_frees_both_and_no_shadow_output_reaches_the_caller(vllm_engine, loop_thread) -> None:
    sampling = SamplingConfig(temperature=0.9, top_k=30, seed=5)
    long_req = AudioRequest(synthetic_prompt(4, 30), 400, 400, sampling, cfg_scale=2.5)
    short_req = AudioRequest(synthetic_prompt(6, 20), 30, 30, sampling, cfg_scale=2.5)

    async def run():
        from engine.async_engine import sampling_params

        # the raw vLLM stream of a CFG request: every output is the main's, its tokens in order
        rid = vllm_engine.new_request_id("raw")
        prompt = {"prompt_token_ids": [int(t) for t in short_req.prompt[:, 0]], "cache_salt": rid}
        outs = [o async for o in vllm_engine._llm.generate(prompt, sampling_params(short_req), rid)]
        ids = {o.request_id for o in outs}
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        # abort a long CFG request a few steps in
        seen = 0
        stream = vllm_engine.stream_steps(long_req)
        async for chunk in stream:
            seen += len(chunk.steps)
            if seen >= 5:
                break
        await stream.aclose()
        freed = await wait_kv_free(vllm_engine)
        with pytest.raises(ValueError, match="reserved"):
            await vllm_engine.stream_steps(short_req, request_id="x" + guidance.SHADOW_SUFFIX).__anext__()
        return ids, tokens, rid, seen, freed

    ids, tokens, rid, seen, freed = loop_thread.run(run())
    assert ids == {rid}
    assert tokens == short_req.max_steps  # 30 frames + 8: the shadow's steps are nowhere
    assert 5 <= seen < long_req.max_steps
    assert freed, "KV blocks still in use after aborting the CFG request (its shadow leaked?)"


@pytest.mark.vllm
def test_seeded_cfg_is_reproducible_and_in_range(vllm_engine, loop_thread) -> None:
    def req(seed: int) -> AudioRequest:
        return AudioRequest(synthetic_prompt(3, 20), 30, 30, SamplingConfig(temperature=1.0, top_k=40, seed=seed),
                            cfg_scale=2.0)

    async def run():
        first = await vllm_engine.generate(req(11))
        others = [vllm_engine.generate(r) for r in mixed_requests(4)]
        together = await asyncio.gather(vllm_engine.generate(req(11)), *others)
        return first, together[0]

    a, b = loop_thread.run(run())
    np.testing.assert_array_equal(a.steps, b.steps)
    assert a.frames.shape == (30, 9) and vocab.in_stream_range(a.frames).all()
