"""Streaming-aware scheduling: least slack first, comfortable requests held, bounded lead."""

from __future__ import annotations

import math
import time

import pytest

from engine.prompt import synthetic_prompt
from engine.request import AudioRequest
from engine.sampling import GREEDY
from engine.vllm_plugin.scheduler import DEFAULT_PACING_LEAD_MS, order_by_slack


def test_order_by_slack_tightest_first_and_holds_the_comfortable() -> None:
    slacks = [0.3, -math.inf, 0.0, 0.9, -0.2, 0.45, 2.0]
    active, held = order_by_slack(slacks, lead_s=0.5)
    assert [slacks[i] for i in active] == [-math.inf, -0.2, 0.0, 0.3, 0.45]
    assert held == [3, 6]
    # under overload (everyone late) nobody is held and the latest goes first
    active, held = order_by_slack([-0.1, -0.5, -0.3], lead_s=0.5)
    assert active == [1, 2, 0] and held == []


@pytest.mark.vllm
def test_realtime_request_stays_a_bounded_lead_ahead_of_playback(vllm_engine, loop_thread) -> None:
    frames = 150  # 3 s of audio; the tiny model alone generates it several times faster
    lead_s = DEFAULT_PACING_LEAD_MS / 1000.0

    async def run(realtime: bool):
        req = AudioRequest(synthetic_prompt(2, 10), frames, frames, GREEDY, realtime=realtime)
        seen, t0, worst_lead = 0, None, -math.inf
        async for chunk in vllm_engine.stream_steps(req):
            now = time.monotonic()
            seen += len(chunk.steps)
            done = seen - 8  # complete frames: playback could have started at frame 0
            if done > 0 and t0 is None:
                t0 = now
            if t0 is not None:
                worst_lead = max(worst_lead, done * 0.020 - (now - t0))
        return now - t0, worst_lead

    paced_s, paced_lead = loop_thread.run(run(realtime=True))
    # never more than the lead (plus a step or two) ahead of real time...
    assert paced_lead <= lead_s + 0.1, paced_lead
    # ...so 3 s of audio take at least 3 s minus the lead (a busy machine only makes it slower;
    # without pacing the tiny model finishes in well under a second on an idle one)
    assert paced_s >= frames * 0.020 - lead_s - 0.1, paced_s


def _scheduler_with_clock(tiny_model, token_budget: int):
    """The real OpusScheduler (over vLLM's Scheduler) in this process, on a clock the test moves.

    No model runs: each step's output is one token for every request whose prompt is complete. The
    per-step token budget is what an overloaded engine cannot stretch; the clock is how slow it is.
    """
    import dataclasses
    from types import SimpleNamespace

    import torch
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    from engine.async_engine import EngineConfig, _set_vllm_env, engine_args
    from engine.vllm_plugin import register, scheduler

    cfg = EngineConfig(model=str(tiny_model), max_num_seqs=4, enable_prefix_caching=False)
    _set_vllm_env(cfg)
    register()
    args = engine_args(cfg)
    kw = {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineArgs)}
    vc = EngineArgs(**{**kw, "max_num_scheduled_tokens": token_budget}).create_engine_config()
    vc.cache_config.num_gpu_blocks = 256
    spec = FullAttentionSpec(block_size=32, num_kv_heads=1, head_size=16, dtype=torch.float32)
    kv = KVCacheConfig(num_blocks=256, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)])
    clock = SimpleNamespace(t=1000.0)
    real_time = scheduler.time
    scheduler.time = SimpleNamespace(monotonic=lambda: clock.t)
    try:
        s = scheduler.OpusScheduler(vc, kv, StructuredOutputManager(vc), block_size=32)
    except Exception:
        scheduler.time = real_time
        raise
    return s, clock, lambda: setattr(scheduler, "time", real_time)


@pytest.mark.vllm
def test_overload_serves_the_tightest_deadline_first(tiny_model) -> None:
    """Three realtime answers, a budget of two tokens a step. While the engine is fast, answers ahead
    of playback sit out (which lets the third one in); once it is slower than real time (a slowed
    clock), every step serves the two with the least slack, so all three fall behind evenly instead
    of two running on time and one starving (vLLM's own order)."""
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request

    from engine.async_engine import sampling_params

    s, clock, restore = _scheduler_with_clock(tiny_model, token_budget=2)
    try:
        for i in range(3):
            req = AudioRequest(synthetic_prompt(i, 3), 400, 400, GREEDY, realtime=True)
            s.add_request(Request(f"r{i}", [int(t) for t in req.prompt[:, 0]], sampling_params(req), None))

        def step(dt: float) -> dict[str, int]:
            clock.t += dt
            out = s.schedule()
            ids = list(out.num_scheduled_tokens)
            done = [s.requests[r].num_computed_tokens + out.num_scheduled_tokens[r] >= s.requests[r].num_prompt_tokens for r in ids]
            s.update_from_output(out, ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                                        sampled_token_ids=[[300] if d else [] for d in done]))
            return dict(out.num_scheduled_tokens)

        # a fast engine (2 ms a step): answers get ahead, are held, and the third one is admitted
        for _ in range(300):
            step(0.002)
        reqs = [s.requests[f"r{i}"] for i in range(3)]
        assert all(r.num_output_tokens > 14 for r in reqs), [r.num_output_tokens for r in reqs]
        assert all(s.slack_s(r, clock.t) > 0 for r in reqs)

        # a slow engine (30 ms a step for 2 tokens: 67 tokens/s against the 150 three answers need)
        start = [r.num_output_tokens for r in reqs]
        served_late = 0
        for _ in range(200):
            slack = {r.request_id: s.slack_s(r, clock.t + 0.030) for r in reqs}
            scheduled = step(0.030)
            assert len(scheduled) == 2
            left_out = [rid for rid in slack if rid not in scheduled]
            # nobody was served while someone closer to (or past) their deadline waited
            assert max(slack[r] for r in scheduled) <= min(slack[r] for r in left_out)
            served_late += min(slack.values()) < 0
        gained = [r.num_output_tokens - g for r, g in zip(reqs, start)]
        assert served_late > 100  # the overload was real: answers were behind their playback
        assert sum(gained) == 400 and max(gained) - min(gained) <= 2, gained
    finally:
        restore()


@pytest.mark.vllm
def test_a_realtime_answer_writing_text_is_urgent_and_its_audio_is_paced_from_the_switch(tiny_model) -> None:
    """A text-first realtime answer plays nothing while it writes text and its audio waits for it: it stays
    most urgent (never held by pacing) until its audio's first chunk; from then on its lead counts the
    audio segment's tokens only."""
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request

    from engine import vocab
    from engine.async_engine import sampling_params

    s, clock, restore = _scheduler_with_clock(tiny_model, token_budget=64)
    try:
        req = AudioRequest(synthetic_prompt(0, 3)[:-1], 400, 400, GREEDY, realtime=True, start_modality=vocab.TEXT_BPE,
                           max_text_tokens=40, switch_to_audio=True)
        s.add_request(Request("t0", [int(t) for t in req.prompt[:, 0]], sampling_params(req), None))
        tokens = [vocab.TEXT_OFFSET + 7] * 30 + [vocab.CODEC_SSL] + [300] * 200

        def step(dt: float) -> None:
            clock.t += dt
            out = s.schedule()
            ids = list(out.num_scheduled_tokens)
            r = s.requests["t0"]
            prefilled = r.num_computed_tokens + out.num_scheduled_tokens["t0"] >= r.num_prompt_tokens
            s.update_from_output(out, ModelRunnerOutput(req_ids=ids, req_id_to_index={"t0": 0},
                                                        sampled_token_ids=[[tokens[r.num_output_tokens]] if prefilled else []]))

        r = s.requests["t0"]
        while r.num_output_tokens < 31:  # the text and the switch: fast steps, yet never held or paced
            step(0.001)
            assert s.slack_s(r, clock.t) == -math.inf
        for _ in range(s.urgent_tokens + 10):  # its audio: urgent until the first chunk, then a lead of audio frames
            step(0.001)
        audio = r.num_output_tokens - 31
        assert audio == s.urgent_tokens + 10
        lead = s.slack_s(r, clock.t)
        assert 0 < lead <= (audio - 8) * 0.020  # counted from the audio's first frame, not the text's first token
    finally:
        restore()
