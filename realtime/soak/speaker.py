"""What a caller hears: one answer played through a jitter buffer, with deadlines per chunk.

Playback of an answer starts `jitter_ms` after its first audio arrives (the client's jitter buffer);
chunk k is due when the audio before it has played. A chunk that arrives after its deadline is late;
one that leaves the speaker silent for `underrun_ms` or more is an underrun, after which playback
resumes with the late chunk (the schedule shifts by the gap).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Playout:
    speech_end: float | None  # when the caller's last speech sample left the microphone (monotonic s)
    jitter_ms: float = 60.0
    underrun_ms: float = 100.0
    first_arrival: float | None = None
    start: float | None = None  # when sample 0 is audible
    received_ms: float = 0.0
    shift_ms: float = 0.0
    arrivals: list[float] = field(default_factory=list)  # per chunk
    lateness_ms: list[float] = field(default_factory=list)  # per chunk; <= 0 is on time
    late_at: list[tuple[float, float]] = field(default_factory=list)  # (arrival, lateness) of late chunks
    underruns: int = 0

    def on_audio(self, t: float, duration_ms: float) -> None:
        if self.start is None:  # the first chunk: set together with first_arrival
            self.first_arrival = t
            self.start = t + self.jitter_ms / 1000.0
        due = self.start + (self.received_ms + self.shift_ms) / 1000.0
        late = 1000.0 * (t - due)
        self.arrivals.append(t)
        self.lateness_ms.append(late)
        if late > 0:
            self.late_at.append((t, late))
            if late >= self.underrun_ms:
                self.underruns += 1
            self.shift_ms += late  # the speaker waited for this chunk
        self.received_ms += duration_ms

    def played_ms(self, t: float) -> float:
        """Audio the speaker has played by time t (what a client acknowledges)."""
        if self.start is None or t <= self.start:
            return 0.0
        return max(0.0, min(self.received_ms, 1000.0 * (t - self.start) - self.shift_ms))

    @property
    def ttfa_ms(self) -> float | None:
        """End of the caller's speech -> the answer's first audio received."""
        if self.first_arrival is None or self.speech_end is None:
            return None
        return 1000.0 * (self.first_arrival - self.speech_end)

    @property
    def mouth_to_ear_ms(self) -> float | None:
        """End of the caller's speech -> the answer's first sample audible (after the jitter buffer)."""
        if self.start is None or self.speech_end is None:
            return None
        return 1000.0 * (self.start - self.speech_end)

    @property
    def chunks_on_time(self) -> int:
        return sum(1 for x in self.lateness_ms if x <= 0)
