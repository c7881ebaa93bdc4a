"""engine.capacity: the whole pipeline's capacity from recorded measurements, each resource's bound
and which one limits; the lateness feedback on a simulated clock."""

import pytest

from engine.capacity import CapacityModel, LatenessFeedback


def test_capacity_from_measured_step_times() -> None:
    m = CapacityModel(max_conversations=64, margin=0.8)  # budget 16 ms per step
    assert m.capacity() == 64 and m.limited_by() == "max_conversations"  # nothing measured yet: only the hard cap
    m.observe(1, 4.0)
    m.observe(8, 8.0)  # fit: 4 + (b - 1) * 4/7 ms
    cap = m.capacity()
    assert m.predicted_step_ms(cap) <= 16.0 < m.predicted_step_ms(cap + 1)
    assert cap == 22 and m.limited_by() == "engine"


def test_live_measurements_move_the_estimate() -> None:
    m = CapacityModel(max_conversations=64, ema=0.5)
    m.observe(1, 4.0)
    m.observe(8, 8.0)
    before = m.capacity()
    for _ in range(10):
        m.observe(8, 14.0)  # the box got slower
    assert m.capacity() < before


def test_the_engine_bound_is_re_measured_from_live_steps_under_the_real_batch() -> None:
    """Issue 40: warm-up on an idle machine says 22; the real batch's steps on this machine now say otherwise."""
    m = CapacityModel(max_conversations=64, margin=0.8, live_window_s=30.0)
    m.observe(1, 4.0)
    m.observe(8, 8.0)  # warm-up: 4 + (b - 1) * 4/7 ms, 22 fit in 16 ms
    assert m.rank_bound() == 22 and m.live_samples() == 0
    m.observe(3, 2 * (4.0 + 2 * 4 / 7), now=100.0)  # live: twice the warm-up's step at batch 3
    assert m.live_samples() == 1
    assert m.predicted_step_ms(8) == pytest.approx(16.0) and m.rank_bound() == 8  # the warm-up's shape, twice as slow
    m.observe(5, 0.5 * (4.0 + 4 * 4 / 7), now=200.0)  # a minute later: half the warm-up's (the older one ages out)
    assert m.live_samples() == 1 and m.rank_bound() == 50  # 4 + (b - 1) * 4/7 <= 32
    for b in (2, 4, 6):  # several live batch sizes: the median ratio sets the level
        m.observe(b, 1.5 * (4.0 + (b - 1) * 4 / 7), now=201.0)
    assert m.predicted_step_ms(8) == pytest.approx(12.0)


def test_the_cpu_bound_adds_each_sessions_parts_on_the_machines_cores() -> None:
    # recorded on this 2-core machine (warm-up: codec and tokenizer real-time factors)
    m = CapacityModel(max_conversations=64, margin=0.8, cpu_cores=2.0, codec_rtf=0.02, tokenizer_rtf=0.04,
                      answer_share=0.5, talk_share=0.5, session_cpu=0.02, engine_cpu=0.03, fixed_cpu=0.3)
    m.observe(1, 4.0)
    m.observe(8, 6.0)  # the engine's steps alone: dozens
    assert m.cpu_cost_per_session() == pytest.approx(0.02 * 0.5 + 0.04 * 0.5 + 0.02 + 0.03)
    assert m.bounds()["cpu"] == 16  # floor((1.6 - 0.3) / 0.08)
    assert m.capacity() == 16 and m.limited_by() == "cpu"
    # both processes with no session, and the machine's other processes, take their share first
    for t in range(1, 61):
        m.observe_host(float(t), 1.0, 0, ours_cpu=0.4, other_cpu=0.3)
    assert m.fixed_cpu == pytest.approx(0.4) and m.other_cpu == pytest.approx(0.3)
    assert m.bounds()["cpu"] == 11  # floor((1.6 - 0.4 - 0.3) / 0.08)
    # measured live: 8 sessions cost 0.12 cores each, more than the parts said; trusted once the window
    # holds 20 session-seconds
    m.observe_host(61.0, 1.0, 8, ours_cpu=0.4 + 8 * 0.12, other_cpu=0.3)
    assert m.per_session_measured is None
    for t in range(62, 122):
        m.observe_host(float(t), 1.0, 8, ours_cpu=0.4 + 8 * 0.12, other_cpu=0.3)
    assert m.cpu_cost_per_session() == pytest.approx(0.12)
    assert m.capacity() == 7 and m.limited_by() == "cpu"
    # one noisy second moves the ratio over the window little
    m.observe_host(122.0, 1.0, 1, ours_cpu=1.4, other_cpu=0.3)
    assert m.cpu_cost_per_session() == pytest.approx(0.12, abs=0.005)
    # a measured cost below the sum of the parts never raises the bound above the parts' (a quiet spell)
    for t in range(123, 190):
        m.observe_host(float(t), 1.0, 8, ours_cpu=0.4 + 8 * 0.01, other_cpu=0.3)
    assert m.cpu_cost_per_session() == pytest.approx(0.08)


def test_a_gpu_codec_bounds_on_its_own_and_leaves_the_host() -> None:
    m = CapacityModel(max_conversations=64, cpu_cores=16.0, codec_on_host=False, codec_rtf=0.004, answer_share=0.5,
                      tokenizer_rtf=0.1, session_cpu=0.01, engine_cpu=0.01, fixed_cpu=0.6)
    assert m.bounds()["gpu_codec"] == 400 and m.bounds()["cpu"] == 610  # floor((12.8 - 0.6) / 0.02): no codec on the CPU
    assert m.capacity() == 64 and m.limited_by() == "max_conversations"


def test_lateness_cuts_at_once_and_recovers_slowly() -> None:
    fb = LatenessFeedback(decrease=0.75, recover_s=30.0, window_s=10.0, max_late_share=0.005, min_late=3, min_chunks=50)
    m = CapacityModel(max_conversations=16)
    assert fb.ceiling is None and m.capacity(fb.ceiling) == 16
    fb.record(12, 89.0, chunks=3, late=3)  # the first chunks of the first answers: too few to say anything
    assert fb.ceiling is None
    # 12 sessions get 12 chunks a second: 2 late in 10 s is within the goal (99.5 % on time)
    for t in range(10):
        fb.record(12, 100.0 + t, chunks=60, late=1 if t in (3, 7) else 0)
    assert fb.ceiling is None
    fb.record(12, 110.0, chunks=60, late=2)  # 4 of 660 in the window (100 to 110 s): 0.61 % late
    assert fb.ceiling == 9 and m.capacity(fb.ceiling) == 9 and m.limited_by(fb.ceiling) == "feedback"
    assert fb.reasons == ["4 of 660 chunks late in 10 s with 12 sessions open: capacity ceiling 9"]
    fb.record(12, 111.0, chunks=60, late=2)  # the window started anew at the cut: 2 late is not yet a pattern
    assert fb.ceiling == 9
    fb.record(9, 112.0, chunks=45, late=5, why="3 underruns reported")  # late again at the ceiling: cut again
    assert fb.ceiling == 6 and fb.reasons[-1].endswith("(3 underruns reported) with 9 sessions open: capacity ceiling 6")
    fb.record(12, 113.0, chunks=60, late=10)  # a cut never raises the ceiling (12 open: 9 > 6)
    assert fb.ceiling == 6
    fb.tick(now=130.0, top=16)  # 18 s since the last change: not yet
    assert fb.ceiling == 6
    fb.tick(now=142.0, top=16)
    assert fb.ceiling == 7
    for k in range(1, 20):
        fb.tick(now=142.0 + 30.0 * k, top=16)
    assert fb.ceiling is None  # back to the measured bound
    fb.record(1, 1000.0, chunks=10, late=10)  # one session is always served
    assert fb.ceiling is None


def test_engine_ranks_each_bound_their_own_batch_and_share_the_machine() -> None:
    """engine.data_parallel_size: each rank's step times bound its own conversations (at most its
    max_num_seqs), the engine bound is their sum, and the cpu bound is the machine's, counted once."""
    m = CapacityModel(max_conversations=64, margin=0.8, ranks=2, rank_max=32)
    assert m.rank_bounds() == [32, 32] and m.bounds()["engine"] == 64  # nothing measured: each rank's max_num_seqs
    m.observe(1, 4.0)
    m.observe(8, 8.0)  # rank 0: 4 + (b - 1) * 4/7 ms, 22 fit in 16 ms (test_capacity_from_measured_step_times)
    m.observe(1, 6.0, rank=1)
    m.observe(8, 13.0, rank=1)  # rank 1 is slower: 6 + (b - 1) ms, 11 fit
    assert m.step_ms == {1: 4.0, 8: 8.0}  # rank 0's, as with one engine
    assert m.rank_bounds() == [22, 11] and m.bounds()["engine"] == 33
    assert m.capacity() == 33 and m.limited_by() == "engine"
    # the machine's cores bound all ranks together, once
    m.cpu_cores, m.fixed_cpu, m.session_cpu, m.engine_cpu, m.codec_rtf, m.tokenizer_rtf = 2.0, 0.3, 0.05, 0.05, 0.0, 0.0
    assert m.bounds()["cpu"] == 13 and m.capacity() == 13 and m.limited_by() == "cpu"  # floor((1.6 - 0.3) / 0.1)
    # a new conversation goes where the headroom is: rank 0 until it has 11 more than rank 1
    assert m.pick_rank([0, 0]) == 0 and m.pick_rank([10, 0]) == 0 and m.pick_rank([12, 0]) == 1
    assert m.pick_rank([11, 0]) == 1  # equal headroom (11 each): the rank with fewer conversations
    # equal ranks alternate
    e = CapacityModel(max_conversations=8, ranks=2, rank_max=4)
    assert [e.pick_rank(a) for a in ([0, 0], [1, 0], [1, 1], [2, 1])] == [0, 1, 0, 1]
    assert e.bounds()["engine"] == 8 and e.bounds()["max_conversations"] == 8


def test_one_rank_reads_as_before() -> None:
    m = CapacityModel(max_conversations=16)
    assert m.ranks == 1 and m.rank_step_ms == [m.step_ms] and m.pick_rank([5]) == 0
    m.observe(1, 4.0)
    assert m.rank_bounds() == [m.bounds()["engine"]] and m.predicted_step_ms(3) == m.predicted_step_ms(3, 0)
    with pytest.raises(ValueError):
        CapacityModel(max_conversations=16, ranks=0)
