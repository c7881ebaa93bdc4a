"""The resume replay buffer (realtime/resume.py), sans-I/O."""

from __future__ import annotations

import pytest

from realtime.resume import ReplayBuffer, ResumeRefused


def test_replays_what_came_after_last_seq():
    buf = ReplayBuffer(max_bytes=1000)
    for i in range(1, 6):
        assert buf.append(f"m{i}") == i
    assert buf.since(5).messages == [] and buf.since(5).missed == 0
    r = buf.since(2)
    assert r.messages == ["m3", "m4", "m5"] and r.missed == 0
    assert buf.since(0).messages == ["m1", "m2", "m3", "m4", "m5"]


def test_bounded_by_bytes_and_counts_what_is_gone():
    buf = ReplayBuffer(max_bytes=10)
    for i in range(1, 8):
        buf.append(b"abcd" + bytes([i]))  # 5 bytes each: the newest two fit
    assert buf.first_seq == 6 and buf.last_seq == 7
    r = buf.since(3)
    assert r.messages == [b"abcd\x06", b"abcd\x07"] and r.missed == 2  # 4 and 5 are gone
    assert buf.since(6).messages == [b"abcd\x07"] and buf.since(6).missed == 0


def test_the_newest_message_is_always_kept():
    buf = ReplayBuffer(max_bytes=0)
    buf.append("a long message")
    assert buf.since(0).messages == ["a long message"]


@pytest.mark.parametrize("last_seq", [-1, 4])
def test_last_seq_out_of_range_is_refused(last_seq):
    buf = ReplayBuffer(max_bytes=100)
    for m in ("a", "b", "c"):
        buf.append(m)
    with pytest.raises(ResumeRefused) as e:
        buf.since(last_seq)
    assert e.value.code == "invalid_last_seq"
