"""How many HTTP requests one client may make per second, sans-I/O (issue 39).

1000 authenticated requests a second to `/v1/audio/*` once took a live call's round trip from 2 ms to
93 ms: every request is parsed, authenticated and routed on the event loop that carries the calls. So
each client (a credential and an address: the HTTP shell passes `(credential_id, remote_address)`) has
a token bucket, `requests_per_s` sustained after a burst of `burst`; a request beyond it is answered 429
`rate_limit_exceeded` with `Retry-After` (what `RequestRate.admit` returns), before its body is read.

The table of buckets is bounded (`max_clients`), and admit() does O(1) work whatever the traffic (a
flood of distinct addresses included). What eviction may cost: a bucket that has refilled is the same
as no bucket (a new client starts full), so dropping one loses nothing. Buckets live in two LRU lists:

- `_fresh`: keys whose last request found their bucket full, so it holds all but that one token. Their
  order of last use is their order of refilling, so the refilled ones are at the front and dropped from
  there as admit() goes (a few a call). Evicting any of them forgives at most one request.
- `_indebted`: keys whose last request found their bucket below full (a client in a burst, or going
  faster than its bucket refills): the only state that matters. When the table is full a new key evicts
  the least recently used fresh key; an indebted one only when no fresh key is left (then the least
  recently used one, which gets a full bucket again).

So one-shot keys, however many, only displace each other; a client near its limit keeps its bucket
unless `max_clients` clients are near theirs at once. A client with many addresses gets a bucket for
each, so an IPv6 address is counted as its /64 (what one host is usually given; `client_address`).
"""

from __future__ import annotations

import ipaddress
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from realtime.clock import SYSTEM_CLOCK

_EPS = 1e-9  # float refill drift: a client that waits exactly the Retry-After it was told is admitted
_HIGH_64 = ((1 << 64) - 1) << 64  # an IPv6 address's /64: the network a host is usually given
_PRUNE_PER_CALL = 2  # refilled buckets dropped per admit(): more than the one it may add, so the table keeps up


@dataclass(frozen=True)
class HttpRateLimits:
    """`limits.http_rate` in the server config: one client's HTTP requests (realtime/request_rate.py)."""

    enabled: bool = True  # false: no request is refused for its rate (a balancer in front limits them)
    requests_per_s: float = 20.0  # sustained, per client (credential and address)
    burst: int = 40  # requests at once beyond the rate (a page load, a retry storm's first wave)
    max_clients: int = 10_000  # buckets kept; beyond, the least recently used of the fresh ones go first

    def problems(self) -> list[tuple[str, str]]:
        """The out-of-range fields, as (field, why): the config names them under `limits.http_rate`."""
        checks = (("requests_per_s", self.requests_per_s > 0, "must be > 0"), ("burst", self.burst >= 1, "must be >= 1"),
                  ("max_clients", self.max_clients >= 1, "must be >= 1"))
        return [(name, why) for name, ok, why in checks if not ok]


class _Bucket:
    __slots__ = ("level", "at")

    def __init__(self, level: float, at: float) -> None:
        self.level, self.at = level, at


Key = tuple[str, str]


class RequestRate:
    def __init__(self, limits: HttpRateLimits, clock: Callable[[], float] = SYSTEM_CLOCK.now) -> None:
        self.limits = limits
        self.clock = clock
        self._rate, self._burst = limits.requests_per_s, float(limits.burst)
        self._fresh: OrderedDict[Key, _Bucket] = OrderedDict()
        self._indebted: OrderedDict[Key, _Bucket] = OrderedDict()
        self.refused_total = 0  # requests refused (429)
        self.evicted_total = 0  # buckets dropped for room before they refilled (each forgave what it owed)

    def __len__(self) -> int:
        """Clients whose bucket is kept (at most `max_clients`)."""
        return len(self._fresh) + len(self._indebted)

    def admit(self, key: Key) -> float | None:
        """One request from `key` (credential id, remote address): None if admitted (a token taken), else
        the seconds until this client's next request would be (the 429's Retry-After, to be rounded up to
        whole seconds on the wire). The address is counted as `client_address` says."""
        if not self.limits.enabled:
            return None
        key = key[0], client_address(key[1])
        now = self.clock()
        self._prune(now)
        bucket = self._fresh.pop(key, None) or self._indebted.pop(key, None)
        if bucket is None:
            self._make_room(now)
            bucket = _Bucket(self._burst, now)
        else:
            bucket.level = min(self._burst, bucket.level + max(0.0, now - bucket.at) * self._rate)
            bucket.at = now
        # where it goes by the level it was found at (before this request): full, it owes nothing yet
        (self._fresh if bucket.level >= self._burst else self._indebted)[key] = bucket
        if bucket.level + _EPS >= 1.0:
            bucket.level -= 1.0
            return None
        self.refused_total += 1
        return (1.0 - bucket.level) / self._rate

    def _prune(self, now: float) -> None:
        """Drop a few buckets that have refilled, oldest first (a refilled bucket is no different from none)."""
        for table in (self._fresh, self._indebted):
            for _ in range(_PRUNE_PER_CALL):
                if not table:
                    break
                bucket = next(iter(table.values()))
                if bucket.level + (now - bucket.at) * self._rate < self._burst:
                    break
                table.popitem(last=False)

    def _make_room(self, now: float) -> None:
        if len(self) < self.limits.max_clients:
            return
        _, bucket = (self._fresh or self._indebted).popitem(last=False)
        if bucket.level + (now - bucket.at) * self._rate < self._burst:
            self.evicted_total += 1


def client_address(address: str) -> str:
    """What an address is counted as: an IPv6 address as its /64 (one host is usually given a whole /64,
    and could otherwise take a fresh bucket per address), an IPv4-mapped one as its IPv4 address,
    anything else as it is."""
    if ":" not in address:
        return address  # IPv4 as the socket gives it (canonical), or not an IP address at all: no parsing
    try:
        ip = ipaddress.IPv6Address(address.split("%", 1)[0])
    except ValueError:
        return address
    if ip.ipv4_mapped is not None:  # ::ffff:a.b.c.d, an IPv4 client on a dual-stack socket
        return str(ip.ipv4_mapped)
    return f"{ipaddress.IPv6Address(int(ip) & _HIGH_64)}/64"  # (IPv6Network() is several times slower)
