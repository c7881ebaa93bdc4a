from engine.capacity import CapacityModel


def test_capacity_from_measured_step_times() -> None:
    m = CapacityModel(max_conversations=64, margin=0.8)  # budget 16 ms per step
    assert m.capacity() == 64  # nothing measured yet: only the hard cap
    m.observe(1, 4.0)
    m.observe(8, 8.0)  # fit: 4 + (b - 1) * 4/7 ms
    cap = m.capacity()
    assert m.predicted_step_ms(cap) <= 16.0 < m.predicted_step_ms(cap + 1)
    assert cap == 22
    m.codec_rtf = 0.05  # the codec keeps 16 sessions fed on its core at 80 %
    assert m.capacity() == 16


def test_live_measurements_move_the_estimate() -> None:
    m = CapacityModel(max_conversations=64, ema=0.5)
    m.observe(1, 4.0)
    m.observe(8, 8.0)
    before = m.capacity()
    for _ in range(10):
        m.observe(8, 14.0)  # the box got slower
    assert m.capacity() < before
