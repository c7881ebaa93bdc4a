"""How much a client may make its session do per second, sans-I/O.

Every session shares the gateway's event loop (and the VAD with it): a client that sends audio faster
than real time, or messages by the thousand, would add latency to everyone else's calls (issue 23:
empty Opus packets at full speed took a witness's round trip from 0.7 ms to 535 ms). So each session
has token buckets: audio (seconds of audio per second of wall time, with a burst allowance for a
client that sends a recording at once) and messages. Audio beyond its budget is dropped, not queued;
messages beyond theirs are not read until their turn (the reader waits, and TCP holds the client
back: a flood of tiny messages costs the event loop nothing; messages are weighed too, as each is
parsed before anything can refuse it, and large ones cost per byte). Either way the client gets an
`input_rate_exceeded` error (at most one a second, with the count since the last), and a client that
keeps exceeding for `overrun_close_s` is disconnected.

Audio inside `conversation.item.create` (issue 39: 1,962 s of it was once taken in 3.7 s) comes out of
the same audio bucket, costed before it is decoded (base64 and resampling are the work): an item is
taken whole if the bucket holds all of it now, else refused with `input_rate_exceeded` saying when it
would fit (an item is a request the client waits on, so each refusal is reported). Nothing is
overdrawn: a client that sent a long item and then streams its microphone is not starved of the
budget its microphone needs. An item longer than `max_item_audio_s` (or than the burst, if that is
shorter: it could never fit) is refused as too large, whatever the bucket holds.
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
    # what the messages weigh: each is parsed on the event loop before anything can refuse it (JSON and
    # the WebSocket's framing cost ~1.5 ms per MiB), so 200 messages of 2 MiB a second would take most
    # of the loop. 1 MiB/s is 8x what audio at the audio budget (2x real time, base64 pcm16) needs.
    message_bytes_per_s: float = float(1 << 20)
    message_bytes_burst: float = float(4 << 20)  # at least the largest message (limits.max_message_bytes, 2 MiB)
    overrun_close_s: float = 5.0  # rejecting input this long without a pause: the session is closed
    max_item_audio_s: float = 10.0  # audio in one conversation.item.create (taken whole from the bucket: a shorter burst caps it)

    def problems(self) -> list[tuple[str, str]]:
        """The out-of-range fields, as (field, why): the config names them under `limits.input`."""
        names = ("audio_rate", "audio_burst_s", "messages_per_s", "message_burst", "message_bytes_per_s", "message_bytes_burst",
                 "overrun_close_s", "max_item_audio_s")
        return [(name, "must be > 0") for name in names if not getattr(self, name) > 0]

    def item_audio_limit(self) -> tuple[float, str]:
        """The most audio one item may hold, and the config key that sets it: `max_item_audio_s`, or the
        burst when that is shorter (an item is taken whole from the bucket: a longer one never fits)."""
        if self.max_item_audio_s <= self.audio_burst_s:
            return self.max_item_audio_s, "limits.input.max_item_audio_s"
        return self.audio_burst_s, "limits.input.audio_burst_s"


class TokenBucket:
    def __init__(self, rate: float, burst: float, now: float) -> None:
        self.rate, self.burst = rate, burst
        self._level, self._at = burst, now

    def take(self, amount: float, now: float) -> bool:
        if not self.fits(amount, now):
            return False
        self._level -= amount
        return True

    def fits(self, amount: float, now: float) -> bool:
        """Whether `amount` could be taken now (refilled to `now`; nothing taken)."""
        self._level = min(self.burst, self._level + (now - self._at) * self.rate)
        self._at = now
        return amount <= self._level

    def wait_s(self, amount: float) -> float:
        """How long until `amount` could be taken (as of the last `take`)."""
        return max(0.0, (amount - self._level) / self.rate)


@dataclass(frozen=True)
class Rejection:
    """Input refused by the budget. `report`: tell the client now (else it is counted for the next report)."""

    what: str  # "audio" | "item_audio" | "messages" | "bytes" (of messages)
    report: bool
    since_report: int  # inputs rejected since the last report, this one included
    retry_after_s: float = 0.0  # messages, item audio: when the next one (this item) would be taken


_REPORT_EVERY_S = 1.0
_QUIET_S = 1.0  # this long without a rejection ends an overrun


class InputBudget:
    def __init__(self, limits: InputLimits, now: float) -> None:
        self.limits = limits
        self._audio = TokenBucket(limits.audio_rate, limits.audio_burst_s, now)
        self._messages = TokenBucket(limits.messages_per_s, limits.message_burst, now)
        self._bytes = TokenBucket(limits.message_bytes_per_s, limits.message_bytes_burst, now)
        self.rejected_audio_s = 0.0
        self.rejected_messages = 0
        self.rejected_items = 0  # conversation items refused for their audio (over the budget now)
        self._overrun_since: float | None = None
        self._last_rejection = float("-inf")
        self._reported_at = float("-inf")
        self._unreported = 0

    def message(self, now: float, size: int = 0) -> Rejection | None:
        """One client message of `size` bytes (characters of a text message) was received: None to pass it
        on now, else a Rejection saying how long to wait first (the reader then reads no further: TCP
        holds the client back, at no cost to us). Both its count and its size come out of the budget."""
        weight = min(float(size), self._bytes.burst)  # one larger than the burst (max_message_bytes above it) waits for a full bucket
        count_fits, weight_fits = self._messages.fits(1.0, now), self._bytes.fits(weight, now)  # (both refilled)
        if count_fits and weight_fits:
            self._messages.take(1.0, now)
            self._bytes.take(weight, now)
            return None
        self.rejected_messages += 1
        what = "bytes" if count_fits else "messages"
        wait_s = max(self._messages.wait_s(1.0), self._bytes.wait_s(weight))
        rejection = dataclasses.replace(self._reject(what, now), retry_after_s=wait_s)
        # held back until then: still over budget (a heavy message's wait may be longer than the quiet
        # gap that would otherwise end the overrun, and such a client could be held back for ever)
        self._last_rejection = now + wait_s
        return rejection

    def audio(self, seconds: float, now: float) -> Rejection | None:
        """`seconds` of decoded client audio: None to use it, else a Rejection (the audio is dropped)."""
        if self._audio.take(seconds, now):
            return None
        self.rejected_audio_s += seconds
        return self._reject("audio", now)

    def item_audio(self, seconds: float, now: float) -> Rejection | None:
        """A conversation item's `seconds` of audio, before it is decoded: None to decode and use it (the
        bucket is charged whole), else a Rejection, always reported (the item is refused, and the
        client waits on its answer), with when it would fit. (The caller refuses items beyond
        `item_audio_limit()` first: they never fit.)"""
        if self._audio.take(seconds, now):
            return None
        self.rejected_audio_s += seconds
        self.rejected_items += 1
        return dataclasses.replace(self._reject("item_audio", now, always_report=True), retry_after_s=self._audio.wait_s(seconds))

    def exhausted(self, now: float) -> bool:
        """The client has been over its budget for `overrun_close_s` without a pause: close it."""
        if self._overrun_since is not None and now - self._last_rejection > _QUIET_S:
            self._overrun_since = None
        return self._overrun_since is not None and now - self._overrun_since >= self.limits.overrun_close_s

    def _reject(self, what: str, now: float, always_report: bool = False) -> Rejection:
        if self._overrun_since is None or now - self._last_rejection > _QUIET_S:
            self._overrun_since = now
        self._last_rejection = now
        self._unreported += 1
        if now - self._reported_at < _REPORT_EVERY_S and not always_report:
            return Rejection(what, False, self._unreported)
        self._reported_at, count, self._unreported = now, self._unreported, 0
        return Rejection(what, True, count)
