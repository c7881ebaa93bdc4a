"""Delay-pattern bookkeeping: pure functions, property-tested for every length."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine import delay, vocab
from engine.delay import Stream0Rule


def frames_strategy(max_frames: int = 40):
    return st.integers(0, max_frames).flatmap(
        lambda t: st.lists(
            st.lists(st.integers(vocab.SSL_OFFSET, 20_000), min_size=9, max_size=9), min_size=t, max_size=t
        ).map(lambda rows: np.array(rows, dtype=np.int64).reshape(t, 9))
    )


@given(frames_strategy())
def test_interleave_roundtrip_and_layout(frames: np.ndarray) -> None:
    steps = delay.interleave(frames)
    t = frames.shape[0]
    assert steps.shape == (t + 8, 9)
    for k in range(9):
        # stream k lags k steps, and the corners are PAD
        assert np.array_equal(steps[k : k + t, k], frames[:, k])
        assert (steps[:k, k] == vocab.PAD).all()
        assert (steps[k + t :, k] == vocab.PAD).all()
    np.testing.assert_array_equal(delay.deinterleave(steps), frames)


@given(frames_strategy())
def test_assembler_emits_each_frame_once_8_steps_after_its_first_token(frames: np.ndarray) -> None:
    t = frames.shape[0]
    steps = delay.interleave(frames)
    steps[t, 0] = vocab.SOS_EOS  # stream 0 ends the segment at step F
    asm = delay.FrameAssembler()
    emitted = []
    for s, row in enumerate(steps):
        out = asm.push(row)
        if len(out):
            emitted.append((s, out[0]))
    assert [s for s, _ in emitted] == [f + 8 for f in range(t)]
    got = np.array([f for _, f in emitted]).reshape(t, 9)
    np.testing.assert_array_equal(got, frames)
    assert asm.done
    np.testing.assert_array_equal(asm.frames(), frames)
    np.testing.assert_array_equal(delay.segment_frames(steps), frames)
    cut = steps[: t + 8 - min(t, 3)]  # a segment stopped before its last frames completed
    np.testing.assert_array_equal(delay.segment_frames(cut), frames[: max(0, cut.shape[0] - 8)])


def test_deinterleave_rejects_short_input() -> None:
    with pytest.raises(ValueError):
        delay.deinterleave(np.zeros((7, 9), dtype=np.int64))
    with pytest.raises(ValueError):
        delay.interleave(np.zeros((3, 8), dtype=np.int64))


def _simulate(num_frames: int, min_frames: int, max_frames: int) -> list[tuple[int, np.ndarray]]:
    """Run the generation rules with a stream 0 that emits EOS as soon as allowed at num_frames."""
    eos, trace = delay.NO_EOS, []
    for s in range(max_frames + 20):
        rule = Stream0Rule(delay.stream0_rules(np.array([s]), np.array([eos]), min_frames, max_frames)[0])
        active = delay.aux_active(np.array([s]), np.array([eos]))[0]
        trace.append((rule, active))
        if rule == Stream0Rule.FORCE_EOS or (rule == Stream0Rule.SSL_OR_EOS and s >= num_frames):
            if eos == delay.NO_EOS:
                eos = s
        if rule == Stream0Rule.FORCE_STOP:
            break
    return trace


@settings(max_examples=200)
@given(st.integers(1, 60), st.integers(0, 60), st.integers(1, 60))
def test_generation_rules(num_frames: int, min_frames: int, max_frames: int) -> None:
    min_frames = min(min_frames, max_frames)
    trace = _simulate(num_frames, min_frames, max_frames)
    f = min(max(num_frames, min_frames), max_frames)  # where EOS lands
    # F frames take F + 8 steps, the last one forced to stop
    assert len(trace) == f + delay.FLUSH_STEPS
    rules = [r for r, _ in trace]
    assert rules[-1] == Stream0Rule.FORCE_STOP
    assert all(r == Stream0Rule.FORCE_PAD for r in rules[f + 1 : -1])
    assert all(r in (Stream0Rule.SSL, Stream0Rule.SSL_OR_EOS) for r in rules[: min(f, max_frames)])
    assert all(r == Stream0Rule.SSL for r in rules[:min_frames])
    # stream k carries a code exactly for frames 0..F-1, i.e. steps k..F-1+k
    active = np.array([a for _, a in trace])
    for k in range(1, 9):
        expect = np.zeros(len(trace), dtype=bool)
        expect[k : f + k] = True
        np.testing.assert_array_equal(active[:, k - 1], expect)
