"""Paced output on an absolute schedule counted in samples, with a bounded lead.

The n-th sample of a response is due at `start + n / rate - lead`: the client never holds more than
`lead_ms` of unplayed audio, so a barge-in silences it within `lead_ms`, and the pacer's own estimate of
what has been played (`played_samples`) is meaningful when the client sends no acknowledgements.

If the source falls behind (the client's buffer ran dry: an underrun), the schedule is re-anchored at
`now` instead of bursting to catch up. The clock is a parameter, so tests run in simulated time.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class _PacerState:
    start: float | None = None  # when sample 0 plays (monotonic seconds); None before the first frame
    sent_samples: int = 0
    reanchors: int = 0  # times the schedule slipped because audio came late (server-side underruns)


class Pacer:
    def __init__(self, rate_hz: int, lead_ms: float = 150.0) -> None:
        if lead_ms < 0:
            raise ValueError("lead_ms must be >= 0")
        self.rate_hz = rate_hz
        self.lead_s = lead_ms / 1000.0
        self._state = _PacerState()

    @property
    def sent_samples(self) -> int:
        return self._state.sent_samples

    @property
    def reanchors(self) -> int:
        return self._state.reanchors

    def reset(self) -> None:
        self._state = _PacerState()

    def due(self, now: float) -> float:
        """When the next sample may be sent (== now or earlier means: send it now)."""
        st = self._state
        if st.start is None:
            return now
        return st.start + st.sent_samples / self.rate_hz - self.lead_s

    def on_sent(self, n_samples: int, now: float) -> None:
        st = self._state
        if st.start is None:
            st.start = now
        elif now > st.start + st.sent_samples / self.rate_hz:  # everything sent has played: underrun
            st.start = now - st.sent_samples / self.rate_hz
            st.reanchors += 1
        st.sent_samples += n_samples

    def played_samples(self, now: float) -> int:
        """Samples the client has played by `now` if it plays as scheduled."""
        st = self._state
        if st.start is None:
            return 0
        return max(0, min(st.sent_samples, int((now - st.start) * self.rate_hz)))
