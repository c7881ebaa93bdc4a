"""The session's explicit states: the user turn's transition table (realtime/turn.py) and the answer's
(`RESPONSE_TRANSITIONS`, realtime/paced_response.py). A move a table does not list raises
IllegalTransition and changes nothing; a real session on real speech (Silero) only makes listed moves.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from engine.codec.synth import speech_like
from realtime.paced_response import RESPONSE_TRANSITIONS, PacedResponse
from realtime.session import ResponseStatus, Session, SessionError, SessionLimits
from realtime.turn import TURN_TRANSITIONS, IllegalTransition, TurnEvent, TurnPhase, next_phase
from realtime.vad import VadParams

RATE = 16_000
T0 = 100.0


def silence(ms: float) -> np.ndarray:
    return np.zeros(int(RATE * ms / 1000), np.int16)


def speech(seconds: float, seed: int) -> np.ndarray:
    return (speech_like(seconds, seed=seed) * 20000).astype(np.int16)


def test_every_pair_the_table_leaves_out_raises_and_the_listed_ones_move():
    for phase, event in itertools.product(TurnPhase, TurnEvent):
        if (phase, event) in TURN_TRANSITIONS:
            assert next_phase(phase, event) is TURN_TRANSITIONS[phase, event]
        else:
            with pytest.raises(IllegalTransition, match=f"{event.name} in {phase.name}"):
                next_phase(phase, event)
    # spot checks of what the table says about a call
    assert next_phase(TurnPhase.LISTENING, TurnEvent.SPEECH_STARTED) is TurnPhase.SPEAKING
    assert next_phase(TurnPhase.SPECULATING, TurnEvent.SPEECH_STOPPED) is TurnPhase.LISTENING  # confirmed
    with pytest.raises(IllegalTransition):
        next_phase(TurnPhase.MANUAL, TurnEvent.SPEECH_STARTED)  # no VAD, no speech events
    with pytest.raises(IllegalTransition):
        next_phase(TurnPhase.SPECULATING, TurnEvent.SPEECH_RESUMED)  # the speculation is discarded first
    with pytest.raises(IllegalTransition):
        next_phase(TurnPhase.SPEAKING, TurnEvent.SPECULATION_STARTED)  # only at a pause


def test_every_state_is_reachable_and_a_speculation_only_from_a_pause():
    seen, frontier = {TurnPhase.MANUAL}, [TurnPhase.MANUAL]
    while frontier:
        phase = frontier.pop()
        for (src, _), dst in TURN_TRANSITIONS.items():
            if src is phase and dst not in seen:
                seen.add(dst)
                frontier.append(dst)
    assert seen == set(TurnPhase)
    assert {src for (src, _), dst in TURN_TRANSITIONS.items() if dst is TurnPhase.SPECULATING} == {TurnPhase.PAUSED}
    assert all(not phase.in_speech for phase in (TurnPhase.MANUAL, TurnPhase.LISTENING))


def test_an_illegal_move_in_a_session_raises_and_leaves_its_state_alone():
    s = Session("sess_t", VadParams(), SessionLimits())
    assert s.phase is TurnPhase.LISTENING
    with pytest.raises(IllegalTransition):
        s._fire(TurnEvent.SPEECH_RESUMED)  # nothing paused
    assert s.phase is TurnPhase.LISTENING
    s.set_turn_detection(None)
    assert s.phase is TurnPhase.MANUAL
    with pytest.raises(IllegalTransition):
        s._fire(TurnEvent.SPEECH_STOPPED)
    assert s.phase is TurnPhase.MANUAL


def test_a_spoken_turn_with_pauses_walks_the_table():
    """Real speech through Silero: the moves a VAD turn makes, in order; SPECULATING exactly while a speculation runs."""
    s = Session("sess_t", VadParams(silence_duration_ms=300), SessionLimits())
    moves: list[TurnEvent] = []
    fire = s._fire

    def recording(event: TurnEvent) -> None:
        fire(event)  # (raises on a move the table does not list)
        moves.append(event)

    s._fire = recording  # type: ignore[method-assign]  # a spy on the one door every move goes through
    pcm = np.concatenate([silence(300), speech(1.0, seed=3), silence(600)])
    now = T0
    for i in range(0, pcm.size, 320):
        s.receive_audio(pcm[i : i + 320], now)
        assert (s.phase is TurnPhase.SPECULATING) == (s.speculation is not None)
        now += 0.02
    E = TurnEvent
    pause = [E.SPEECH_PAUSED, E.SPECULATION_STARTED]
    resumes = (len(moves) - 4) // 4  # pauses the speech came back from
    assert resumes >= 1  # this speech pauses within the turn (test_session.py's speculation tests use it too)
    assert moves == [E.SPEECH_STARTED, *([*pause, E.SPECULATION_DISCARDED, E.SPEECH_RESUMED] * resumes), *pause, E.SPEECH_STOPPED]
    assert s.phase is TurnPhase.LISTENING and s.response is not None and s.stats.speculative_confirmed == 1


def test_a_commit_during_a_speculation_discards_it_then_ends_the_turn():
    s = Session("sess_t", VadParams(silence_duration_ms=300), SessionLimits())
    pcm = np.concatenate([silence(300), speech(1.0, seed=3), silence(280)])  # ends past the last pause, before the turn's end
    now = T0
    for i in range(0, pcm.size, 320):
        s.receive_audio(pcm[i : i + 320], now)
        now += 0.02
    assert s.phase is TurnPhase.SPECULATING and s.speculation is not None
    s.receive_commit(now)
    assert s.phase is TurnPhase.LISTENING and s.speculation is None and s.stats.speculative_discarded >= 1
    with pytest.raises(SessionError, match="no speech in it to commit"):
        s.receive_commit(now)  # LISTENING: nothing to commit; the state stays
    assert s.phase is TurnPhase.LISTENING


def test_a_response_moves_only_along_its_table():
    r = PacedResponse("resp_t", "item_t", 0)
    with pytest.raises(IllegalTransition):
        r.advance(ResponseStatus.COMPLETED)  # its audio is not all out: the engine has not even finished
    assert r.status is ResponseStatus.IN_PROGRESS
    r.buffer(np.ones(160, np.int16), max_ms=1000.0)
    r.advance(ResponseStatus.GENERATED)
    r.advance(ResponseStatus.CANCELLED)
    assert r.pending.samples == 0 and r.pending.take(1) == []  # a finished response keeps no audio to send
    for status in ResponseStatus:
        with pytest.raises(IllegalTransition):
            r.advance(status)  # finished: it never moves again
    assert all(not RESPONSE_TRANSITIONS[s] for s in ResponseStatus if s.finished)
