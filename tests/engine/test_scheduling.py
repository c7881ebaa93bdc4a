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
