"""realtime.session.Session with text, sans-I/O: the answer's text before its audio (no pacing, no lateness
of its own), text-only answers, the user's transcript told for the turn's audio item (held for a
speculative answer, dropped with a discarded one), typed user turns. Simulated clock, no engine."""

from __future__ import annotations

import numpy as np
from test_session import (
    FRAME_MS, LEAD_MS, RATE, T0, Rec, answer, commit, create_response, drain, engine_chunk, feed_audio, manual_turn_answered,
    new_session, pcm_of, poll, run_clock, silence, speech,
)

from realtime.session import (
    AddUserText, DiscardResponse, EndTurn, InputCommitted, InputTranscriptDelta, InputTranscriptDone, InputTranscriptFailed,
    PushAudio, ResponseAudio, ResponseCreated, ResponseDone, ResponseStatus, ResponseText, SpeechStopped,
)

NO_AUDIO = np.zeros(0, np.int16)


def text_chunk(s, rid: str, delta: str, now: float, rec: Rec, deadline: float, is_last: bool = False) -> None:
    engine_chunk(s, rid, NO_AUDIO, now, rec, is_last=is_last, deadline=deadline, text=delta)


def test_the_answers_text_comes_first_and_is_neither_paced_nor_late():
    s, rec, now, rid = manual_turn_answered()
    # the engine stamps text chunks with the time it wrote them: by now long past, beyond the client's lead
    for k, word in enumerate(["Hello", " there"]):
        text_chunk(s, rid, word, now + 0.5 + 0.1 * k, rec, deadline=now)
    assert [t.delta for t in rec.of(ResponseText)] == ["Hello", " there"] and rec.of(ResponseAudio) == []
    assert (s.stats.chunks, s.stats.chunks_late, s.stats.chunks_gap) == (0, 0, 0)
    t_audio = now + 1.0
    assert s.response.first_chunk_at is None  # the engine's audio deadlines count from its first audio
    engine_chunk(s, rid, answer(400), t_audio, rec, is_last=True, deadline=t_audio + 0.06)
    assert s.response.first_chunk_at == t_audio and (s.stats.chunks, s.stats.chunks_late) == (1, 0)
    poll(s, t_audio, rec)
    first = rec.of(ResponseAudio)
    assert first and first[0].start_ms == 0 and len(first) * FRAME_MS <= LEAD_MS + FRAME_MS  # the lead, from the first audio
    run_clock(s, t_audio, 1.0, rec)
    np.testing.assert_array_equal(pcm_of(rec.of(ResponseAudio)), answer(400))
    done = rec.of(ResponseDone)[-1]
    assert done.status is ResponseStatus.COMPLETED and done.transcript == "Hello there" and done.audio_ms == 400


def test_a_text_only_answer_completes_without_audio():
    s, rec, now, _ = manual_turn_answered()
    s.receive_response_cancel(now)  # (the first answer is cancelled: a new one may start)
    drain(s, rec, now)
    rid = s.receive_response_create(now, output_modalities=("text",))
    drain(s, rec, now)
    assert rec.of(ResponseCreated)[-1].output_modalities == ("text",)
    text_chunk(s, rid, "Just text.", now + 0.1, rec, deadline=now)
    text_chunk(s, rid, "", now + 0.2, rec, deadline=now, is_last=True)
    poll(s, now + 0.2, rec)
    done = rec.of(ResponseDone)[-1]
    assert done.response_id == rid and done.status is ResponseStatus.COMPLETED
    assert (done.transcript, done.audio_ms, done.played_ms, done.ttfa_ms) == ("Just text.", 0.0, 0.0, None)
    assert s.stats.chunks == 0 and not [a for a in rec.of(ResponseAudio) if a.response_id == rid]


def _speculating(pcm: np.ndarray):
    """A VAD session fed up to just past the turn's last pause: a speculative answer is running."""
    s, rec = new_session(), Rec()
    n = 1600 * RATE // 1000  # past its last pause (1520 ms of input), before the end of the turn (1680 ms)
    t = feed_audio(s, pcm[:n], T0, rec)
    return s, rec, t, s.speculation.id, n


def test_a_speculation_holds_its_text_and_the_users_transcript_until_the_turn_is_confirmed():
    pcm = np.concatenate([silence(300), speech(1.0, seed=3), silence(600)])
    s, rec, t, spec, n = _speculating(pcm)
    text_chunk(s, spec, "Hi", t, rec, deadline=t)
    s.receive_user_transcript(spec, "hello")
    s.receive_user_transcript(spec, " you")
    s.receive_user_transcript_end(spec)
    drain(s, rec, t)
    assert rec.of(ResponseText, InputTranscriptDelta, InputTranscriptDone) == []  # unseen while undecided
    feed_audio(s, pcm[n:], t, rec)  # the silence confirms the turn
    item = rec.of(InputCommitted)[-1].item_id
    assert rec.of(SpeechStopped)[-1].item_id == item
    told = rec.of(ResponseCreated, ResponseText, InputTranscriptDelta, InputTranscriptDone)
    assert [type(x) for x in told] == [ResponseCreated, ResponseText, InputTranscriptDelta, InputTranscriptDone]
    assert told[1].delta == "Hi" and told[2] == InputTranscriptDelta(item, "hello you")
    pushed = sum(c.pcm.size for c in rec.of(PushAudio))  # the turn as the engine heard it: up to the pause
    assert told[3] == InputTranscriptDone(item, "hello you", 1000.0 * pushed / RATE) and 1000 <= told[3].audio_ms <= 1600


def test_a_discarded_speculation_tells_nothing_of_its_transcript():
    pcm = np.concatenate([silence(300), speech(1.0, seed=3), silence(600)])
    s, rec = new_session(), Rec()
    now = feed_audio(s, pcm[: 700 * RATE // 1000], T0, rec)  # the pause within the speech: a speculation
    first = s.speculation.id
    s.receive_user_transcript(first, "hel")
    now = feed_audio(s, pcm[700 * RATE // 1000 : 1600 * RATE // 1000], now, rec)  # speech again: discarded
    assert rec.of(DiscardResponse)[0] == DiscardResponse(first)
    s.receive_user_transcript(first, "lo")
    s.receive_user_transcript_end(first)
    second = s.speculation.id
    s.receive_user_transcript(second, "hello again")
    s.receive_user_transcript_end(second)
    feed_audio(s, pcm[1600 * RATE // 1000 :], now, rec)
    assert [x.transcript for x in rec.of(InputTranscriptDone)] == ["hello again"]
    assert [x.delta for x in rec.of(InputTranscriptDelta)] == ["hello again"]


def test_the_transcript_goes_to_the_turns_last_audio_item_and_outlives_the_answer():
    s, rec = new_session(vad=None), Rec()
    now = feed_audio(s, silence(200) + 300, T0, rec)
    commit(s, now, rec)
    now = feed_audio(s, silence(100) + 300, now, rec)
    commit(s, now, rec)  # two audio items, one user turn: the model transcribes them as one
    first, last = [c.item_id for c in rec.of(InputCommitted)]
    rid = create_response(s, now, rec)
    s.receive_response_cancel(now, rid)  # the answer ends; its turn's transcript is still being written
    drain(s, rec, now)
    s.receive_user_transcript(rid, "two parts")
    s.receive_user_transcript_end(rid)
    drain(s, rec, now)
    assert rec.of(InputTranscriptDelta) == [InputTranscriptDelta(last, "two parts")]
    assert rec.of(InputTranscriptDone) == [InputTranscriptDone(last, "two parts", 300.0)]
    # a failed transcript, for a turn that came as an item with audio and typed text
    s.receive_user_item("mixed", answer(200), "and some text")
    drain(s, rec, now)
    assert [type(c) for c in rec.of(PushAudio, AddUserText, EndTurn)][-2:] == [PushAudio, AddUserText]
    rid2 = create_response(s, now, rec)
    s.receive_user_transcript_end(rid2, "engine_error", "it broke")
    drain(s, rec, now)
    assert rec.of(InputTranscriptFailed) == [InputTranscriptFailed("mixed", "engine_error", "it broke")]


def test_a_typed_turn_has_no_transcript_and_one_dropped_from_the_context_is_not_told():
    s, rec = new_session(vad=None), Rec()
    s.receive_user_item("typed", None, "What time is it?")
    drain(s, rec, T0)
    assert rec.of(AddUserText) == [AddUserText("What time is it?")] and not rec.of(EndTurn, PushAudio)
    rid = create_response(s, T0, rec)
    s.receive_user_transcript_end(rid)  # the engine transcribes no audio: nothing to tell
    drain(s, rec, T0)
    assert rec.of(InputTranscriptDone, InputTranscriptDelta) == []
    engine_chunk(s, rid, answer(40), T0, rec, is_last=True)
    run_clock(s, T0, 0.5, rec)
    now = feed_audio(s, silence(200) + 300, T0 + 1, rec)
    commit(s, now, rec)
    item = rec.of(InputCommitted)[-1].item_id
    rid2 = create_response(s, now, rec)
    s.receive_history_dropped((rid2,), None)  # (its own exchange, as context management may drop it later)
    s.receive_user_transcript(rid2, "gone")
    s.receive_user_transcript_end(rid2)
    drain(s, rec, now)
    assert rec.of(InputTranscriptDone) == [] and item in s._exchanges.deleted
