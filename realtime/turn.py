"""The user's turn as an explicit state: what the session does with user audio now, and every move
between those states in one table.

    MANUAL ◀─detection on/off─▶ LISTENING ──started──▶ SPEAKING ──paused──▶ PAUSED ──speculation──▶ SPECULATING
                                    ▲                      ▲                │  ▲                        │
                                    │                      └────resumed─────┘  └───────discarded────────┤
                                    └─────── stopped (a speculation is confirmed), committed, cleared ───┘

A speculation is always discarded before the turn resumes, is committed or cleared, or turn detection
changes: those events then find the turn PAUSED; a change of turn detection resumes a paused turn
first, and turning it off goes to MANUAL from SPEAKING too (what was pushed stays in the engine).

The answer is the other half of a full-duplex call and has its own lifecycle (`ResponseStatus`,
realtime/paced_response.py): the user may speak while an answer plays (barge-in cancels it only with
`interrupt_response`), so the two are separate machines, not one product of states.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from enum import Enum

import numpy as np

from engine.service_api import SAMPLE_RATE_HZ as RATE_HZ

from realtime.vad import ServerVad, SileroVad, VadParams


class IllegalTransition(RuntimeError):
    """A state change the session's tables do not allow: a bug in the session, never a client's mistake."""


class TurnPhase(Enum):
    MANUAL = "manual"  # no turn detection: audio fills the input buffer until the client commits or clears it
    LISTENING = "listening"  # server VAD, no speech: recent audio is kept for the next turn's prefix padding
    SPEAKING = "speaking"  # the user speaks: their audio goes to the engine as it comes
    PAUSED = "paused"  # speech paused (`speculate_after_ms`): the turn, as the engine hears it, ends here
    #                    unless the speech resumes; audio since the pause is held
    SPECULATING = "speculating"  # PAUSED, and an answer to the turn so far runs unseen (`Session.speculation`)

    @property
    def in_speech(self) -> bool:
        """The VAD is inside a turn (between speech started and stopped)."""
        return self in (TurnPhase.SPEAKING, TurnPhase.PAUSED, TurnPhase.SPECULATING)

    @property
    def paused(self) -> bool:
        return self in (TurnPhase.PAUSED, TurnPhase.SPECULATING)


class TurnEvent(Enum):
    DETECTION_ON = "detection_on"  # turn detection set (or changed; mid-speech the turn goes on under the new parameters)
    DETECTION_OFF = "detection_off"  # turn detection off: the client commits its turns
    SPEECH_STARTED = "speech_started"
    SPEECH_PAUSED = "speech_paused"
    SPECULATION_STARTED = "speculation_started"
    SPECULATION_DISCARDED = "speculation_discarded"  # speech resumed, the client edited the history or asked for an answer, ...
    SPEECH_RESUMED = "speech_resumed"
    SPEECH_STOPPED = "speech_stopped"  # the turn ended (a speculation is confirmed)
    COMMITTED = "committed"  # the client committed the turn
    CLEARED = "cleared"  # the client cleared the input buffer


_P, _E = TurnPhase, TurnEvent

# (state, event) -> next state. A pair not listed is a bug in the session: `next_phase` raises.
TURN_TRANSITIONS: dict[tuple[TurnPhase, TurnEvent], TurnPhase] = {
    (_P.MANUAL, _E.DETECTION_ON): _P.LISTENING,
    (_P.MANUAL, _E.DETECTION_OFF): _P.MANUAL,
    (_P.MANUAL, _E.COMMITTED): _P.MANUAL,
    (_P.MANUAL, _E.CLEARED): _P.MANUAL,
    (_P.LISTENING, _E.DETECTION_ON): _P.LISTENING,  # a fresh VAD under the new parameters
    (_P.LISTENING, _E.DETECTION_OFF): _P.MANUAL,
    (_P.LISTENING, _E.SPEECH_STARTED): _P.SPEAKING,
    (_P.LISTENING, _E.CLEARED): _P.LISTENING,
    (_P.SPEAKING, _E.DETECTION_ON): _P.SPEAKING,
    (_P.SPEAKING, _E.DETECTION_OFF): _P.MANUAL,  # what was pushed stays in the engine: the next commit ends that turn
    (_P.SPEAKING, _E.SPEECH_PAUSED): _P.PAUSED,
    (_P.SPEAKING, _E.SPEECH_STOPPED): _P.LISTENING,
    (_P.SPEAKING, _E.COMMITTED): _P.LISTENING,
    (_P.SPEAKING, _E.CLEARED): _P.LISTENING,
    (_P.PAUSED, _E.SPECULATION_STARTED): _P.SPECULATING,
    (_P.PAUSED, _E.SPEECH_RESUMED): _P.SPEAKING,
    (_P.PAUSED, _E.SPEECH_STOPPED): _P.LISTENING,
    (_P.PAUSED, _E.COMMITTED): _P.LISTENING,
    (_P.PAUSED, _E.CLEARED): _P.LISTENING,
    (_P.SPECULATING, _E.SPECULATION_DISCARDED): _P.PAUSED,
    (_P.SPECULATING, _E.SPEECH_STOPPED): _P.LISTENING,  # the speculation is confirmed: it becomes the answer
}


def next_phase(phase: TurnPhase, event: TurnEvent) -> TurnPhase:
    try:
        return TURN_TRANSITIONS[phase, event]
    except KeyError:
        raise IllegalTransition(f"user turn: {event.name} in {phase.name}") from None


def _padding_samples(p: VadParams) -> int:
    """The recent audio a listening turn keeps: the prefix padding, the speech the VAD needs before it
    reports a start, and two windows of slack."""
    return int(RATE_HZ * (p.prefix_padding_ms + p.min_speech_ms + 64) / 1000)


@dataclass
class TurnAudio:
    """The user audio each turn state keeps, on one input timeline (int16 at the engine's rate)."""

    input_samples: int = 0  # all user audio received so far: the input timeline
    buffer: list[np.ndarray] = field(default_factory=list)  # MANUAL: the uncommitted input buffer
    buffer_samples: int = 0
    recent: deque[np.ndarray] = field(default_factory=deque)  # LISTENING: the latest audio (`_padding_samples`)
    recent_samples: int = 0
    held: list[np.ndarray] = field(default_factory=list)  # PAUSED / SPECULATING: audio since the pause

    def add_to_buffer(self, pcm: np.ndarray) -> None:
        self.buffer.append(pcm)
        self.buffer_samples += pcm.size
        self.input_samples += pcm.size

    def take_buffer(self) -> np.ndarray:
        pcm = np.concatenate(self.buffer)
        self.buffer, self.buffer_samples = [], 0
        return pcm

    def remember(self, pcm: np.ndarray, p: VadParams) -> None:
        self.recent.append(pcm)
        self.recent_samples += pcm.size
        keep = _padding_samples(p)
        while self.recent and self.recent_samples - self.recent[0].size >= keep:
            self.recent_samples -= self.recent.popleft().size

    def take_recent_from(self, start_ms: float) -> np.ndarray:
        """The recent audio from `start_ms` on the input timeline (a turn's start with its padding); the rest is forgotten."""
        recent = np.concatenate(self.recent) if self.recent else np.zeros(0, np.int16)
        start = int(start_ms * RATE_HZ / 1000) - (self.input_samples - recent.size)
        self.recent.clear()
        self.recent_samples = 0
        return recent[max(0, start):]

    def take_held(self) -> list[np.ndarray]:
        held, self.held = self.held, []
        return held

    def clear(self) -> None:
        """Everything not yet in the engine is dropped (the timeline goes on)."""
        self.buffer, self.buffer_samples, self.held = [], 0, []
        self.recent.clear()
        self.recent_samples = 0


@dataclass
class TurnDetection:
    """Server VAD, while it is on: the endpointing (its parameters: `endpoint.params`) and the
    stream's speech probabilities (the session's one Silero stream: it outlives detection turned off)."""

    endpoint: ServerVad
    silero: SileroVad
