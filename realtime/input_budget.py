"""How much a client may make its session do per second, sans-I/O.

Every session shares the gateway's event loop (and the VAD with it): a client that sends audio faster
than real time, or messages by the thousand, would add latency to everyone else's calls (issue 23:
empty Opus packets at full speed took a witness's round trip from 0.7 ms to 535 ms). So each session
has two token buckets: audio (seconds of audio per second of wall time, with a burst allowance for a
client that sends a recording at once) and messages. Audio beyond its budget is dropped, not queued;
messages beyond theirs are not read until their turn (the reader waits, and TCP holds the client
back: a flood of tiny messages costs the event loop nothing). Either way the client gets an
`input_rate_exceeded` error (at most one a second, with the count since the last), and a client that
keeps exceeding for `overrun_close_s` is disconnected.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class InputLimits:
    audio_rate: float = 2.0  # seconds of audio per second, sustained (1.0 = real time)
    audio_burst_s: float = 10.0  # audio accepted beyond the rate at once (a recording sent in one go)
    messages_per_s: float = 200.0  # a real-time client sends 50 (20 ms frames) plus a few events
    message_burst: float = 400.0
    overrun_close_s: float = 5.0  # rejecting input this long without a pause: the session is closed

    def problems(self) -> list[tuple[str, str]]:
        """The out-of-range fields, as (field, why): the config names them under `limits.input`."""
        names = ("audio_rate", "audio_burst_s", "messages_per_s", "message_burst", "overrun_close_s")
        return [(name, "must be > 0") for name in names if not getattr(self, name) > 0]


class TokenBucket:
    def __init__(self, rate: float, burst: float, now: float) -> None:
        self.rate, self.burst = rate, burst
        self._level, self._at = burst, now

    def take(self, amount: float, now: float) -> bool:
        self._level = min(self.burst, self._level + (now - self._at) * self.rate)
        self._at = now
        if amount > self._level:
            return False
        self._level -= amount
        return True

    def wait_s(self, amount: float) -> float:
        """How long until `amount` could be taken (as of the last `take`)."""
        return max(0.0, (amount - self._level) / self.rate)


@dataclass(frozen=True)
class Rejection:
    """Input refused by the budget. `report`: tell the client now (else it is counted for the next report)."""

    what: str  # "audio" | "messages"
    report: bool
    since_report: int  # inputs rejected since the last report, this one included
    retry_after_s: float = 0.0  # messages: when the next one will be taken


_REPORT_EVERY_S = 1.0
_QUIET_S = 1.0  # this long without a rejection ends an overrun


class InputBudget:
    def __init__(self, limits: InputLimits, now: float) -> None:
        self.limits = limits
        self._audio = TokenBucket(limits.audio_rate, limits.audio_burst_s, now)
        self._messages = TokenBucket(limits.messages_per_s, limits.message_burst, now)
        self.rejected_audio_s = 0.0
        self.rejected_messages = 0
        self._overrun_since: float | None = None
        self._last_rejection = float("-inf")
        self._reported_at = float("-inf")
        self._unreported = 0

    def message(self, now: float) -> Rejection | None:
        """One client message is to be read: None to read it now, else a Rejection saying how long to
        wait first (the reader then stops reading: TCP holds the client back, at no cost to us)."""
        if self._messages.take(1.0, now):
            return None
        self.rejected_messages += 1
        return dataclasses.replace(self._reject("messages", now), retry_after_s=self._messages.wait_s(1.0))

    def audio(self, seconds: float, now: float) -> Rejection | None:
        """`seconds` of decoded client audio: None to use it, else a Rejection (the audio is dropped)."""
        if self._audio.take(seconds, now):
            return None
        self.rejected_audio_s += seconds
        return self._reject("audio", now)

    def exhausted(self, now: float) -> bool:
        """The client has been over its budget for `overrun_close_s` without a pause: close it."""
        if self._overrun_since is not None and now - self._last_rejection > _QUIET_S:
            self._overrun_since = None
        return self._overrun_since is not None and now - self._overrun_since >= self.limits.overrun_close_s

    def _reject(self, what: str, now: float) -> Rejection:
        if self._overrun_since is None or now - self._last_rejection > _QUIET_S:
            self._overrun_since = now
        self._last_rejection = now
        self._unreported += 1
        if now - self._reported_at < _REPORT_EVERY_S:
            return Rejection(what, False, self._unreported)
        self._reported_at, count, self._unreported = now, self._unreported, 0
        return Rejection(what, True, count)
