"""The session's exchanges (realtime/exchanges.py): which items the engine's history holds as one
exchange (the user items since the last answer, then the answer), and what deleting or dropping them
takes out. Manual turns, simulated clock, no engine."""

from __future__ import annotations

import numpy as np
import pytest

from engine.service_api import Role
from realtime.session import (
    DeleteTurn, InputCommitted, ItemDeleted, ResponseCreated, ResponseDone, ResponseStatus, Session, SessionError, SessionLimits,
)

RATE = 16_000
T0 = 100.0


def committed_turn(s: Session, now: float) -> str:
    s.receive_audio(np.zeros(RATE // 5, np.int16), now)
    s.receive_commit(now)
    return next(e.item_id for e in s.events() if isinstance(e, InputCommitted))


def answered(s: Session, now: float) -> tuple[str, str]:
    """A response created, generated (200 ms) and paced out to its end: (response id, its item)."""
    rid = s.receive_response_create(now)
    item = next(e.item_id for e in s.events() if isinstance(e, ResponseCreated))
    s.receive_engine_chunk(rid, np.ones(RATE // 5, np.int16), "", True, None, now)
    t = now
    while s.poll_audio(t) is not None or s.response is not None and not s.response.status.finished:
        t += 0.01
    assert [e.status for e in s.events() if isinstance(e, ResponseDone)] == [ResponseStatus.COMPLETED]
    return rid, item


def test_an_answer_then_its_user_turn_can_be_deleted():
    s = Session("sess_x", None, SessionLimits())
    user = committed_turn(s, T0)
    rid, answer = answered(s, T0)
    s.commands()
    s.receive_delete(answer)
    s.receive_delete(user)  # its exchange no longer ends with an answer
    assert s.commands() == [DeleteTurn(rid, Role.ASSISTANT), DeleteTurn(rid, Role.USER)]
    assert s.events() == [ItemDeleted(answer), ItemDeleted(user)]
    with pytest.raises(SessionError) as e:
        s.receive_delete(user)  # gone
    assert e.value.code == "item_not_deletable"


def test_one_of_two_user_items_heard_as_one_turn_cannot_be_deleted_alone():
    s = Session("sess_x", None, SessionLimits())
    first, second = committed_turn(s, T0), committed_turn(s, T0)
    with pytest.raises(SessionError, match="no response yet") as e:
        s.receive_delete(first)
    assert e.value.param == "item_id"
    answered(s, T0)
    with pytest.raises(SessionError, match="one of 2 user items"):
        s.receive_delete(second)
    assert not any(isinstance(c, DeleteTurn) for c in s.commands())  # nothing left the history


def test_a_running_answer_cannot_be_deleted_and_a_dropped_one_cannot_be_truncated():
    s = Session("sess_x", None, SessionLimits())
    user = committed_turn(s, T0)
    rid = s.receive_response_create(T0)
    answer = next(e.item_id for e in s.events() if isinstance(e, ResponseCreated))
    with pytest.raises(SessionError, match="in progress: cancel it first"):
        s.receive_delete(user)
    s.receive_response_cancel(T0)
    s.events()
    s.receive_history_dropped((rid,), "resp_next")  # context management dropped the whole exchange
    assert s.events() == [ItemDeleted(user), ItemDeleted(answer)] and s.stats.exchanges_dropped == 1
    with pytest.raises(SessionError) as e:
        s.receive_truncate(answer, 0.0, T0)
    assert e.value.code == "item_truncate_invalid_item_id"
