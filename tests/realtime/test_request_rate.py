"""The per-client HTTP request rate (realtime/request_rate.py, issue 39), on a clock the test moves."""

from __future__ import annotations

import pytest

from realtime.config import config_from_dict
from realtime.request_rate import HttpRateLimits, RequestRate, client_address

A = ("server-token", "10.0.0.1")
B = ("server-token", "10.0.0.2")


class FakeClock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def limiter(**limits) -> tuple[RequestRate, FakeClock]:
    clock = FakeClock()
    return RequestRate(HttpRateLimits(**limits), clock), clock


def test_the_burst_is_admitted_then_refused_with_the_wait_for_the_next_token():
    rate, clock = limiter(requests_per_s=20.0, burst=40)
    assert [rate.admit(A) for _ in range(40)] == [None] * 40
    assert rate.admit(A) == pytest.approx(0.05)  # one token at 20/s
    clock.t += 0.02
    assert rate.admit(A) == pytest.approx(0.03)  # refusals take nothing: the wait only shrinks
    assert rate.refused_total == 2


def test_a_client_that_waits_what_it_was_told_is_admitted():
    rate, clock = limiter(requests_per_s=3.0, burst=1)
    assert rate.admit(A) is None
    retry = rate.admit(A)
    assert retry == pytest.approx(1 / 3)
    clock.t += retry  # exactly that long (float drift in the refill must not refuse it)
    assert rate.admit(A) is None
    assert rate.admit(A) == pytest.approx(1 / 3)


def test_the_bucket_refills_at_the_rate_up_to_the_burst():
    rate, clock = limiter(requests_per_s=10.0, burst=5)
    for _ in range(5):
        assert rate.admit(A) is None
    assert rate.admit(A) is not None
    clock.t += 0.3  # three tokens back
    assert [rate.admit(A) is None for _ in range(4)] == [True, True, True, False]
    clock.t += 3600  # an hour idle: the burst again, not 36 000 requests
    assert sum(rate.admit(A) is None for _ in range(10)) == 5


def test_a_client_keeping_to_the_rate_is_never_refused():
    rate, clock = limiter(requests_per_s=20.0, burst=2)
    for _ in range(1000):
        assert rate.admit(A) is None
        clock.t += 0.05
    assert rate.refused_total == 0


def test_one_clients_flood_leaves_anothers_budget_whole():
    rate, clock = limiter(requests_per_s=20.0, burst=40)
    admitted = sum(rate.admit(A) is None for _ in range(10_000))
    assert admitted == 40 and rate.refused_total == 10_000 - 40
    assert [rate.admit(B) for _ in range(40)] == [None] * 40
    assert rate.admit(B) is not None
    # the same address with another credential, the same credential from another address: other clients
    assert rate.admit(("anonymous", "10.0.0.1")) is None and rate.admit(("ek_1", "10.0.0.1")) is None


def test_switched_off_nothing_is_refused_or_kept():
    rate, clock = limiter(enabled=False, burst=1)
    assert all(rate.admit(A) is None for _ in range(100))
    assert len(rate) == 0 and rate.refused_total == 0


def test_a_flood_of_distinct_clients_stays_within_max_clients_and_a_client_mid_burst_keeps_its_bucket():
    rate, clock = limiter(requests_per_s=20.0, burst=40, max_clients=100)
    for _ in range(39):
        assert rate.admit(A) is None  # A has one token left
    for i in range(50_000):  # one-shot keys, far faster than any bucket refills (no time passes)
        assert rate.admit(("server-token", f"10.1.{i >> 8}.{i & 255}")) is None
        assert len(rate) <= 100
    assert len(rate) == 100
    # A was not forgotten in favour of them (a fresh bucket would admit 40 more): it has its one token
    assert rate.admit(A) is None
    assert rate.admit(A) == pytest.approx(0.05)
    # the one-shot keys evicted one another, each forgiving the one request it made
    assert rate.evicted_total == 50_000 - 99


def test_clients_mid_burst_are_evicted_least_recently_used_first_when_nothing_else_is_left():
    rate, clock = limiter(requests_per_s=1.0, burst=2, max_clients=3)
    keys = [("server-token", f"10.0.0.{i}") for i in range(4)]
    for key in keys[:3]:
        rate.admit(key), rate.admit(key)  # each mid-burst: its bucket empty
    rate.admit(keys[0])  # refused, but used: keys[1] is now the least recently used
    assert rate.admit(keys[3]) is None
    assert len(rate) == 3 and rate.evicted_total == 1
    assert rate.admit(keys[0]) is not None and rate.admit(keys[2]) is not None
    assert rate.admit(keys[1]) is None  # forgotten: a full bucket again (what eviction of a client mid-burst costs)


def test_refilled_buckets_are_dropped_as_time_passes():
    rate, clock = limiter(requests_per_s=10.0, burst=3, max_clients=1000)
    for i in range(500):
        rate.admit(("anonymous", f"10.2.{i >> 8}.{i & 255}"))
    rate.admit(A), rate.admit(A), rate.admit(A)  # A owes 2 tokens: 0.2 s to refill
    assert len(rate) == 501
    clock.t += 0.15  # the one-shot keys have refilled (0.1 s), A has not
    for _ in range(300):
        rate.admit(B)
        clock.t += 0.1  # B keeps to the rate: always full when it comes
    assert len(rate) == 1  # B itself; A refilled and was dropped too
    assert rate.evicted_total == 0


@pytest.mark.parametrize("http_rate, key", [
    ({"requests_per_s": 0}, "limits.http_rate.requests_per_s"),
    ({"requests_per_s": -1.5}, "limits.http_rate.requests_per_s"),
    ({"burst": 0}, "limits.http_rate.burst"),
    ({"max_clients": 0}, "limits.http_rate.max_clients"),
    ({"burst": 2.5}, "limits.http_rate.burst"),
    ({"enabled": "yes"}, "limits.http_rate.enabled"),
    ({"per_ip": 3}, "limits.http_rate.per_ip"),
])
def test_config_errors_name_the_key(http_rate, key):
    with pytest.raises(ValueError, match=f"'{key}'"):
        config_from_dict({"limits": {"http_rate": http_rate}})


def test_config_section_is_read():
    cfg = config_from_dict({"limits": {"http_rate": {"requests_per_s": 5, "burst": 10, "max_clients": 7, "enabled": False}}})
    assert cfg.limits.http_rate == HttpRateLimits(enabled=False, requests_per_s=5.0, burst=10, max_clients=7)


@pytest.mark.parametrize("address, counted_as", [
    ("203.0.113.7", "203.0.113.7"),
    ("2001:db8:1:2:aaaa::1", "2001:db8:1:2::/64"),
    ("2001:DB8:1:2:bbbb:0:0:9", "2001:db8:1:2::/64"),  # the same host's other address: the same client
    ("::ffff:203.0.113.7", "203.0.113.7"),  # IPv4 on a dual-stack socket
    ("fe80::1%eth0", "fe80::/64"),
    ("/run/duplex.sock", "/run/duplex.sock"),
    ("not:an:address", "not:an:address"),
    ("", ""),
])
def test_an_ipv6_host_is_counted_by_its_64(address, counted_as):
    assert client_address(address) == counted_as


def test_a_host_hopping_between_its_ipv6_addresses_shares_one_bucket():
    rate, clock = limiter(requests_per_s=1.0, burst=3)
    assert [rate.admit(("ek_1", f"2001:db8:1:2::{i:x}")) for i in range(3)] == [None] * 3
    assert rate.admit(("ek_1", "2001:db8:1:2:ffff::1")) is not None
    assert rate.admit(("ek_1", "2001:db8:1:3::1")) is None  # another /64: another client
    assert rate.admit(("ek_1", "::ffff:10.0.0.1")) is None and rate.admit(("ek_1", "10.0.0.1")) is None
    assert rate.admit(("ek_1", "10.0.0.1")) is None and rate.admit(("ek_1", "::ffff:10.0.0.1")) is not None
