"""realtime.session.Session, sans-I/O: turn-taking, manual turns, pacing, barge-in, acks, truncation,
engine errors. Simulated monotonic clock (`now` passed explicitly), no sleeps, no engine.

Speech is engine/codec/synth.py's `speech_like` (numpy only), which Silero VAD detects reliably.
The session is driven only through the helpers below: if its input API changes, only they change.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np
import pytest
from fake_engine import answer_pcm

from engine.codec.synth import speech_like
from realtime.session import (
    CancelResponse,
    ConfirmResponse,
    DiscardResponse,
    EndTurn,
    InputCleared,
    InputCommitted,
    ItemTruncated,
    OutputCleared,
    PushAudio,
    ResponseAudio,
    ResponseCreated,
    ResponseDone,
    ResponseStatus,
    ResponseText,
    Session,
    SessionError,
    SessionLimits,
    SpeechStarted,
    SpeechStopped,
    StartResponse,
    TruncateResponse,
)
from realtime.vad import VadParams

RATE = 16_000
T0 = 100.0  # simulated time.monotonic() at the start of each test
LEAD_MS = 150.0
FRAME_MS = 40
VAD = VadParams(silence_duration_ms=300)

# ---- helpers: the only code that touches the Session's input API --------------------------------


def new_session(vad: VadParams | None = VAD, lead_ms: float = LEAD_MS, frame_ms: int = FRAME_MS, **limits) -> Session:
    return Session("sess_test", vad, SessionLimits(output_frame_ms=frame_ms, lead_ms=lead_ms, **limits))


def manual_turn_answered() -> tuple[Session, "Rec", float, str]:
    """A client-committed turn of 200 ms of silence and a response created for it."""
    s, rec = new_session(vad=None), Rec()
    now = feed_audio(s, silence(200), T0, rec)
    commit(s, now, rec)
    return s, rec, now, create_response(s, now, rec)


@dataclass
class Rec:
    """Everything the session put out, with the simulated time it came out at."""

    out: list = field(default_factory=list)  # (now, event or command), events before commands per drain

    def of(self, *classes) -> list:
        return [x for _, x in self.out if isinstance(x, classes)]

    def timed(self, *classes) -> list:
        return [(t, x) for t, x in self.out if isinstance(x, classes)]

    def types(self, *classes) -> list[str]:
        return [type(x).__name__ for x in self.of(*classes)]

    def clear(self) -> None:
        self.out.clear()


def drain(s: Session, rec: Rec, now: float) -> None:
    rec.out += [(now, x) for x in s.events()]
    rec.out += [(now, x) for x in s.commands()]


def feed_audio(s: Session, pcm: np.ndarray, now: float, rec: Rec, piece_ms: int = 20, poll: bool = False) -> float:
    """Client audio in `piece_ms` pieces at real time from `now`; polls the output pacer after each
    piece if asked. Returns the time after the last piece."""
    n = RATE * piece_ms // 1000
    for i in range(0, pcm.size, n):
        s.receive_audio(pcm[i : i + n], now)
        if poll:
            s.poll_audio(now)
        drain(s, rec, now)
        now += piece_ms / 1000
    return now


def poll(s: Session, now: float, rec: Rec) -> float | None:
    nxt = s.poll_audio(now)
    drain(s, rec, now)
    return nxt


def run_clock(s: Session, start: float, seconds: float, rec: Rec, step_s: float = 0.01) -> float:
    """Poll the pacer every `step_s` of simulated time; returns the end time."""
    steps = int(round(seconds / step_s))
    for k in range(steps + 1):
        poll(s, start + k * step_s, rec)
    return start + steps * step_s


def commit(s: Session, now: float, rec: Rec) -> None:
    s.receive_commit(now)
    drain(s, rec, now)


def clear(s: Session, now: float, rec: Rec) -> None:
    s.receive_clear()
    drain(s, rec, now)


def create_response(s: Session, now: float, rec: Rec) -> str:
    rid = s.receive_response_create(now)
    drain(s, rec, now)
    return rid


def cancel_response(s: Session, now: float, rec: Rec, response_id: str | None = None) -> None:
    s.receive_response_cancel(now, response_id)
    drain(s, rec, now)


def engine_chunk(s: Session, rid: str, pcm: np.ndarray, now: float, rec: Rec, is_last: bool = False,
                 deadline: float | None = None, text: str = "") -> None:
    s.receive_engine_chunk(rid, pcm, text, is_last, deadline, now)
    drain(s, rec, now)


def engine_error(s: Session, rid: str, now: float, rec: Rec) -> None:
    s.receive_engine_error(rid, now)
    drain(s, rec, now)


def played(s: Session, played_ms: float, rec: Rec, now: float, response_id: str | None = None) -> None:
    s.receive_played(played_ms, response_id=response_id)
    drain(s, rec, now)


def truncate(s: Session, item_id: str, audio_end_ms: float, now: float, rec: Rec) -> None:
    s.receive_truncate(item_id, audio_end_ms, now)
    drain(s, rec, now)


# ---- audio ---------------------------------------------------------------------------------------


def silence(ms: float) -> np.ndarray:
    return np.zeros(int(RATE * ms / 1000), np.int16)


def speech(seconds: float, seed: int) -> np.ndarray:
    return (speech_like(seconds, seed=seed) * 20000).astype(np.int16)


def answer(ms: float, response_index: int = 0) -> np.ndarray:
    """The fake engine's known answer audio (a ramp), so the samples that went out can be checked."""
    return answer_pcm(0, response_index, 0, int(RATE * ms / 1000))


def user_turn(s: Session, now: float, rec: Rec) -> tuple[float, np.ndarray]:
    """300 ms silence, ~1 s of speech, 600 ms silence: one VAD turn. Returns (time after, audio fed)."""
    pcm = np.concatenate([silence(300), speech(1.0, seed=3), silence(600)])
    return feed_audio(s, pcm, now, rec), pcm


def pcm_of(frames: list[ResponseAudio]) -> np.ndarray:
    return np.concatenate([f.pcm for f in frames]) if frames else np.zeros(0, np.int16)


# ---- turn-taking with server VAD ------------------------------------------------------------------


def test_server_vad_turn_events_and_commands_in_order():
    s, rec = new_session(), Rec()
    now, pcm = user_turn(s, T0, rec)
    events = rec.of(SpeechStarted, SpeechStopped, InputCommitted, ResponseCreated, InputCleared, ResponseDone)
    assert [type(e) for e in events] == [SpeechStarted, SpeechStopped, InputCommitted, ResponseCreated]
    started, stopped, committed, created = events
    assert 0 <= started.audio_start_ms <= 300 and 900 <= stopped.audio_end_ms <= 1400
    assert stopped.audio_end_ms - started.audio_start_ms > 700
    assert started.item_id == stopped.item_id == committed.item_id and committed.previous_item_id is None
    assert created.epoch == 0 and created.item_id != committed.item_id
    cmds = rec.of(PushAudio, EndTurn, StartResponse, ConfirmResponse, DiscardResponse, CancelResponse)
    kinds = [type(c) for c in cmds]
    # the answer started at the pause (speculate_after_ms of silence), unseen, and was confirmed at the end
    # of the turn; a pause within the speech started one that the speech coming back discarded
    assert kinds[-2:] == [StartResponse, ConfirmResponse] and EndTurn not in kinds and len(cmds) > 20
    assert cmds[-2] == StartResponse(created.response_id, speculative=True) and cmds[-1] == ConfirmResponse(created.response_id)
    for k, c in enumerate(cmds[:-2]):
        if isinstance(c, StartResponse):
            assert c.speculative and cmds[k + 1] == DiscardResponse(c.response_id)
    # what went to the engine is the input from the (padded) speech start on, sample for sample,
    # through speculate_after_ms of the silence that ended the turn, not the rest of it
    pushed = np.concatenate([c.pcm for c in cmds if isinstance(c, PushAudio)])
    first = int(started.audio_start_ms * RATE / 1000)
    np.testing.assert_array_equal(pushed, pcm[first : first + pushed.size])
    assert first + pushed.size == int((stopped.audio_end_ms + VAD.speculate_after_ms) * RATE / 1000)
    # events come out when the audio that causes them arrives (20 ms pieces from T0)
    t_spec = next(t for t, x in rec.out if x == cmds[-2])
    t_stop = next(t for t, x in rec.out if isinstance(x, SpeechStopped))
    t_pause = T0 + (stopped.audio_end_ms + VAD.speculate_after_ms) / 1000
    t_endpoint = T0 + (stopped.audio_end_ms + VAD.silence_duration_ms) / 1000  # speech end + the silence that ends it
    assert t_pause - 0.02 <= t_spec <= t_pause + 0.04 and t_endpoint - 0.02 <= t_stop <= t_endpoint + 0.1
    assert s.stats.responses == 1 and s.stats.input_frames == pcm.size // 320
    assert s.stats.speculative_confirmed == 1 and s.stats.speculative_discarded == kinds.count(DiscardResponse)
    # more silence: nothing more happens
    rec.clear()
    feed_audio(s, silence(1000), now, rec)
    assert rec.out == []


def test_without_speculation_the_turn_the_engine_hears_is_the_same():
    spec, rec_spec = new_session(), Rec()
    plain, rec_plain = new_session(vad=replace(VAD, speculative=False)), Rec()
    user_turn(spec, T0, rec_spec)
    user_turn(plain, T0, rec_plain)
    cmds = rec_plain.of(PushAudio, EndTurn, StartResponse, ConfirmResponse, DiscardResponse)
    assert [type(c) for c in cmds[-2:]] == [EndTurn, StartResponse] and not cmds[-1].speculative
    assert all(isinstance(c, PushAudio) for c in cmds[:-2])
    np.testing.assert_array_equal(np.concatenate([c.pcm for c in rec_plain.of(PushAudio)]),
                                  np.concatenate([c.pcm for c in rec_spec.of(PushAudio)]))
    assert rec_plain.types(SpeechStarted, SpeechStopped, InputCommitted, ResponseCreated) == \
        rec_spec.types(SpeechStarted, SpeechStopped, InputCommitted, ResponseCreated)
    assert (plain.stats.speculative_confirmed, plain.stats.speculative_discarded) == (0, 0)


def test_a_pause_that_does_not_end_the_turn_discards_the_speculation_unseen():
    s, rec = new_session(), Rec()
    # this speech pauses longer than speculate_after_ms (160) and shorter than silence_duration_ms (300)
    # about 460 ms in (the VAD's pause at 620 ms of input, the speech again by 760 ms)
    pcm = np.concatenate([silence(300), speech(1.0, seed=3), silence(600)])
    n_pause_end = 700 * RATE // 1000
    now = feed_audio(s, pcm[:n_pause_end], T0, rec)
    spec_id = rec.of(StartResponse)[-1].response_id
    assert s.speculation is not None and s.speculation.id == spec_id
    # the engine answers meanwhile: held, never sent
    engine_chunk(s, spec_id, answer(400), now, rec)
    assert poll(s, now, rec) is None and rec.of(ResponseAudio, ResponseCreated) == []
    now = feed_audio(s, pcm[n_pause_end:], now, rec)
    cmds = rec.of(PushAudio, EndTurn, StartResponse, ConfirmResponse, DiscardResponse)
    k = cmds.index(DiscardResponse(spec_id))
    assert isinstance(cmds[k + 1], PushAudio)  # the held silence joins the turn after the discard
    assert [type(c) for c in cmds[-2:]] == [StartResponse, ConfirmResponse] and cmds[-2].response_id != spec_id
    # the engine heard one turn, the input from the speech start to the second pause, sample for sample
    started = rec.of(SpeechStarted)
    assert len(started) == 1 and len(rec.of(SpeechStopped)) == 1
    pushed = np.concatenate([c.pcm for c in rec.of(PushAudio)])
    first = int(started[0].audio_start_ms * RATE / 1000)
    np.testing.assert_array_equal(pushed, pcm[first : first + pushed.size])
    # the client saw one response: the confirmed one; the discarded one's late output is dropped
    created = rec.of(ResponseCreated)
    assert [c.response_id for c in created] == [cmds[-2].response_id]
    engine_chunk(s, spec_id, answer(400), now, rec)
    engine_chunk(s, created[0].response_id, answer(400), now, rec, is_last=True)
    run_clock(s, now, 1.0, rec)
    assert {f.response_id for f in rec.of(ResponseAudio)} == {created[0].response_id}
    done = rec.of(ResponseDone)
    assert len(done) == 1 and done[0].status is ResponseStatus.COMPLETED and done[0].audio_ms == 400
    assert (s.stats.speculative_confirmed, s.stats.speculative_discarded, s.stats.responses) == (1, 1, 1)


def test_a_confirmed_speculation_sends_its_held_audio_at_once_then_paced():
    s, rec = new_session(), Rec()
    pcm = np.concatenate([silence(300), speech(1.0, seed=3), silence(600)])
    n = 1600 * RATE // 1000  # past its last pause (at 1520 ms of input), before the end of the turn (1680 ms)
    t = feed_audio(s, pcm[:n], T0, rec)
    spec_id = s.speculation.id
    engine_chunk(s, spec_id, answer(1000), t, rec, is_last=True)  # the whole answer before the turn is confirmed
    now = feed_audio(s, pcm[n:], t, rec)
    t_stop = next(t for t, x in rec.out if isinstance(x, SpeechStopped))
    created = rec.of(ResponseCreated)
    assert [c.response_id for c in created] == [spec_id] and rec.of(ResponseAudio) == []
    poll(s, t_stop, rec)  # the lead goes out at once
    frames = rec.of(ResponseAudio)
    assert frames and frames[0].after_confirm_ms == 0.0 and frames[0].ttfa_ms is not None
    assert len(frames) * FRAME_MS <= LEAD_MS + FRAME_MS
    run_clock(s, now, 1.5, rec)
    np.testing.assert_array_equal(pcm_of(rec.of(ResponseAudio)), answer(1000))
    done = rec.of(ResponseDone)
    assert done[-1].status is ResponseStatus.COMPLETED and done[-1].after_confirm_ms == 0.0


def test_client_input_during_a_speculation_discards_it():
    s, rec = new_session(), Rec()
    pcm = np.concatenate([silence(300), speech(1.0, seed=3), silence(200)])
    now = feed_audio(s, pcm, T0, rec)
    spec = rec.of(StartResponse)
    assert len(spec) == 1 and spec[0].speculative
    commit(s, now, rec)  # the client ends the turn itself
    cmds = rec.of(DiscardResponse, EndTurn)
    assert cmds == [DiscardResponse(spec[0].response_id), EndTurn(rec.of(InputCommitted)[0].item_id)]
    assert s.speculation is None and rec.of(ResponseCreated) == []


def test_server_vad_ignores_silence_and_a_commit_without_speech_is_an_error():
    s, rec = new_session(), Rec()
    now = feed_audio(s, silence(1000), T0, rec)
    assert rec.out == []
    with pytest.raises(SessionError) as e:
        commit(s, now, rec)
    assert e.value.code == "input_audio_buffer_commit_empty"


# ---- manual turns ---------------------------------------------------------------------------------


def test_manual_commit_clear_and_errors():
    s, rec = new_session(vad=None), Rec()
    with pytest.raises(SessionError) as e:
        commit(s, T0, rec)
    assert e.value.code == "input_audio_buffer_commit_empty"
    noise = (1000 * np.random.default_rng(0).standard_normal(8000)).astype(np.int16)
    now = feed_audio(s, noise, T0, rec)
    assert rec.out == []  # buffered until the commit, whatever it sounds like
    commit(s, now, rec)
    (committed,) = rec.of(InputCommitted)
    assert committed.previous_item_id is None
    cmds = rec.of(PushAudio, EndTurn)
    assert [type(c) for c in cmds] == [PushAudio, EndTurn] and cmds[1] == EndTurn(committed.item_id)
    np.testing.assert_array_equal(cmds[0].pcm, noise)
    # a cleared buffer pushes nothing and is empty again
    rec.clear()
    now = feed_audio(s, noise[:3200], now, rec)
    clear(s, now, rec)
    assert rec.of(InputCleared) == [InputCleared()] and rec.of(PushAudio, EndTurn) == []
    with pytest.raises(SessionError) as e:
        commit(s, now, rec)
    assert e.value.code == "input_audio_buffer_commit_empty"
    # response.create answers the committed item; a second one while it runs is refused
    rid = create_response(s, now, rec)
    (created,) = rec.of(ResponseCreated)
    assert created.response_id == rid and created.epoch == 0 and rec.of(StartResponse) == [StartResponse(rid)]
    with pytest.raises(SessionError) as e:
        create_response(s, now, rec)
    assert e.value.code == "conversation_already_has_active_response"
    # the next turn's commit names the assistant item as its predecessor
    rec.clear()
    now = feed_audio(s, noise[:1600], now, rec)
    commit(s, now, rec)
    assert rec.of(InputCommitted)[0].previous_item_id == created.item_id


def test_manual_buffer_is_bounded():
    s, rec = new_session(vad=None, max_turn_ms=1000.0), Rec()
    now = feed_audio(s, silence(1000), T0, rec)
    with pytest.raises(SessionError) as e:
        feed_audio(s, silence(20), now, rec)
    assert e.value.code == "input_audio_buffer_full"
    commit(s, now, rec)  # the session goes on: the buffer holds the 1000 ms
    assert sum(c.pcm.size for c in rec.of(PushAudio)) == RATE


# ---- pacing ---------------------------------------------------------------------------------------


def test_pacing_releases_no_faster_than_real_time_plus_lead_then_completes():
    s, rec, now, rid = manual_turn_answered()
    turn_end = now
    audio = answer(1000)
    t_engine = now + 0.05
    for k in range(0, audio.size, 1280):  # the engine's 80 ms chunks all arrive at once, ahead of time
        engine_chunk(s, rid, audio[k : k + 1280], t_engine, rec, is_last=k + 1280 >= audio.size, text="hi" if k == 0 else "")
    assert rec.of(ResponseText)[0].delta == "hi"
    rec.clear()
    end = run_clock(s, t_engine, 1.5, rec, step_s=0.01)
    frames = rec.timed(ResponseAudio)
    np.testing.assert_array_equal(pcm_of([f for _, f in frames]), audio)  # every sample, in order, once
    assert [f.start_ms for _, f in frames] == [40.0 * i for i in range(25)]
    assert all(f.pcm.size == 640 and f.response_id == rid and f.epoch == 0 for _, f in frames)
    t_first = frames[0][0]
    assert t_first == pytest.approx(t_engine)
    assert frames[0][1].ttfa_ms == pytest.approx(1000 * (t_first - turn_end))
    sent = 0
    for t, f in frames:
        sent += f.pcm.size
        ahead_ms = 1000 * sent / RATE - 1000 * (t - t_first)
        # a frame goes out once its first sample is within the lead of playing: the client never
        # holds more than the lead plus one frame
        assert ahead_ms <= LEAD_MS + FRAME_MS + 1e-6
        if t > t_first:  # and on time: within one 10 ms poll of being due
            assert ahead_ms > LEAD_MS + FRAME_MS - 10 - 1e-6
    # at once: the frames starting within the lead (0, 40, 80, 120 ms), not the whole second
    assert [f.start_ms for t, f in frames if t == t_first] == [0.0, 40.0, 80.0, 120.0]
    (done,) = rec.timed(ResponseDone)
    t_done, d = done
    assert d.status is ResponseStatus.COMPLETED and d.reason is None and d.transcript == "hi"
    assert d.audio_ms == d.played_ms == pytest.approx(1000) and d.ttfa_ms == pytest.approx(1000 * (t_first - turn_end))
    assert rec.out[-1][1] is d and t_done >= t_first + 1.0 - LEAD_MS / 1000 - 1e-9 and t_done <= end
    assert s.response_statuses() == [ResponseStatus.COMPLETED] and s.epoch == 0


def test_pacing_waits_for_a_slow_engine_and_reanchors():
    s, rec, now, rid = manual_turn_answered()
    audio = answer(400)
    engine_chunk(s, rid, audio[:1600], now, rec)  # 100 ms, then the engine stalls
    assert poll(s, now, rec) is None  # all sent (100 ms < lead): nothing due, waiting for the engine
    # whole frames only while the engine is generating: 2 frames out, the last 20 ms held
    assert pcm_of(rec.of(ResponseAudio)).size == 1280
    later = now + 0.5  # the client ran dry long ago
    engine_chunk(s, rid, audio[1600:], later, rec, is_last=True)
    rec_later = Rec()
    run_clock(s, later, 1.0, rec_later)
    # re-anchored at `later`: the lead goes out at once (4 frames), not the 500 ms it fell behind
    assert [f.start_ms for t, f in rec_later.timed(ResponseAudio) if t == later] == [80.0, 120.0, 160.0, 200.0]
    np.testing.assert_array_equal(pcm_of(rec.of(ResponseAudio) + rec_later.of(ResponseAudio)), audio)
    assert rec_later.of(ResponseDone)[0].status is ResponseStatus.COMPLETED


# ---- barge-in ---------------------------------------------------------------------------------------


def _answering(s: Session, rec: Rec, answer_ms: float = 3000) -> tuple[str, float]:
    """A VAD turn, then the engine's whole answer at once; returns (response id, time)."""
    now, _ = user_turn(s, T0, rec)
    (created,) = rec.of(ResponseCreated)
    engine_chunk(s, created.response_id, answer(answer_ms), now, rec)
    return created.response_id, now


def test_barge_in_cancels_at_the_pacer_cursor_clears_and_starts_a_new_epoch():
    s, rec = new_session(), Rec()
    rid, now = _answering(s, rec)
    rec.clear()
    now = feed_audio(s, silence(600), now, rec, poll=True)  # the user listens for 600 ms
    barge = np.concatenate([speech(0.8, seed=2), silence(600)])
    now = feed_audio(s, barge, now, rec, poll=True)
    frames = rec.timed(ResponseAudio)
    (t_cancel, cancel), = rec.timed(CancelResponse)
    t_first = frames[0][0]
    sent_before = sum(f.pcm.size for t, f in frames if t <= t_cancel)
    expected_played = 1000 * min(sent_before, int((t_cancel - t_first) * RATE)) / RATE
    assert cancel == CancelResponse(rid, pytest.approx(expected_played, abs=0.1))
    assert 600 <= cancel.played_ms <= 1000  # 600 ms of listening + the speech VAD needs to fire
    assert 1000 * sent_before / RATE - cancel.played_ms <= LEAD_MS + FRAME_MS  # unplayed audio the client drops
    assert all(t <= t_cancel for t, _ in frames)  # nothing of the old answer after the cancel
    kinds = rec.types(OutputCleared, ResponseDone, SpeechStarted, SpeechStopped, InputCommitted, ResponseCreated)
    assert kinds == ["SpeechStarted", "OutputCleared", "ResponseDone", "SpeechStopped", "InputCommitted", "ResponseCreated"]
    done = rec.of(ResponseDone)[0]
    assert (done.response_id, done.status, done.reason, done.epoch) == (rid, ResponseStatus.CANCELLED, "turn_detected", 0)
    assert done.played_ms == cancel.played_ms and done.audio_ms == pytest.approx(1000 * sent_before / RATE)
    assert rec.of(OutputCleared) == [OutputCleared(rid)]
    assert s.epoch == 1 and s.stats.barge_ins == 1
    new = rec.of(ResponseCreated)[0]
    assert new.epoch == 1 and new.response_id != rid
    # the engine commands: cancel the old answer before pushing the new turn, then answer it
    cmds = [type(c).__name__ for c in rec.of(CancelResponse, PushAudio, EndTurn, StartResponse, ConfirmResponse, DiscardResponse)]
    assert cmds[0] == "CancelResponse" and cmds[-2:] == ["StartResponse", "ConfirmResponse"] and cmds[1] == "PushAudio"
    assert set(cmds[1:-2]) <= {"PushAudio", "StartResponse", "DiscardResponse"}  # (pauses within the speech)
    # late output of the cancelled answer is dropped
    rec.clear()
    engine_chunk(s, rid, answer(500), now, rec, is_last=True)
    run_clock(s, now, 0.2, rec)
    assert rec.of(ResponseAudio) == []


def test_client_acks_bound_the_cursor():
    s, rec = new_session(), Rec()
    rid, now = _answering(s, rec)
    now = feed_audio(s, silence(500), now, rec, poll=True)
    sent_ms = 1000 * pcm_of(rec.of(ResponseAudio)).size / RATE
    assert s.played_ms(now) > 300
    played(s, 240, rec, now, response_id="resp_other")  # an older response: ignored
    assert s.played_ms(now) > 300
    played(s, 240, rec, now, response_id=rid)
    assert s.played_ms(now) == 240.0 and s.played_ms(now + 5) == 240.0  # acks win over the schedule
    played(s, 99_999, rec, now)
    assert s.played_ms(now) == pytest.approx(sent_ms)  # never more than was sent
    played(s, 240, rec, now)
    rec.clear()
    now = feed_audio(s, np.concatenate([speech(0.8, seed=2), silence(100)]), now, rec)  # no polls: nothing more sent
    assert rec.of(CancelResponse) == [CancelResponse(rid, 240.0)]
    assert rec.of(ResponseDone)[0].played_ms == 240.0


def test_client_cancel_without_acks_uses_the_schedule():
    s, rec = new_session(), Rec()
    rid, now = _answering(s, rec)
    t_start = now
    now = run_clock(s, now, 0.5, rec, step_s=0.02)
    rec.clear()
    cancel_response(s, now, rec)
    (cancel,) = rec.of(CancelResponse)
    assert cancel == CancelResponse(rid, pytest.approx(1000 * (now - t_start), abs=0.1))
    done = rec.of(ResponseDone)[0]
    assert done.reason == "client_cancelled" and done.status is ResponseStatus.CANCELLED
    with pytest.raises(SessionError) as e:
        cancel_response(s, now, rec)
    assert (e.value.code, e.value.message) == ("response_cancel_not_active", "Cancellation failed: no active response found")


# ---- truncation -----------------------------------------------------------------------------------


def test_truncate_errors_and_cuts():
    s, rec, now, rid = manual_turn_answered()
    item = rec.of(ResponseCreated)[0].item_id
    engine_chunk(s, rid, answer(400), now, rec, is_last=True)
    now = run_clock(s, now, 0.1, rec)  # 100 ms of schedule: frames starting up to 250 ms -> 280 ms sent
    sent_ms = 1000 * pcm_of(rec.of(ResponseAudio)).size / RATE
    assert sent_ms == 280.0
    with pytest.raises(SessionError) as e:
        truncate(s, "item_nope", 10, now, rec)
    assert (e.value.code, e.value.param) == ("item_truncate_invalid_item_id", "item_id")
    with pytest.raises(SessionError) as e:
        truncate(s, item, sent_ms + 1, now, rec)
    assert (e.value.code, e.value.param, e.value.message.split(" (")[0]) == (
        "invalid_value", "audio_end_ms", "Audio content of 280ms is already shorter than 281ms")  # OpenAI's wording
    with pytest.raises(SessionError) as e:
        truncate(s, item, -1, now, rec)
    assert e.value.code == "invalid_value"
    rec.clear()
    truncate(s, item, 200, now, rec)  # of the running answer: cancels it at 200 ms
    assert rec.of(CancelResponse) == [CancelResponse(rid, 200.0)] and rec.of(TruncateResponse) == []
    assert rec.of(ItemTruncated) == [ItemTruncated(item, 200.0)]
    done = rec.of(ResponseDone)[0]
    assert (done.status, done.reason, done.played_ms) == (ResponseStatus.CANCELLED, "client_cancelled", 200.0)


def test_truncate_after_completion_recuts_the_engine_turn_of_any_item_in_the_history():
    s, rec, now, rid = manual_turn_answered()
    item = rec.of(ResponseCreated)[0].item_id
    engine_chunk(s, rid, answer(400), now, rec, is_last=True)
    now = run_clock(s, now, 1.0, rec)
    assert rec.of(ResponseDone)[0].status is ResponseStatus.COMPLETED
    rec.clear()
    truncate(s, item, 120, now, rec)
    assert rec.of(TruncateResponse) == [TruncateResponse(rid, 120.0)] and rec.of(CancelResponse) == []
    assert rec.of(ItemTruncated) == [ItemTruncated(item, 120.0)]
    assert rec.of(ResponseDone) == [] and s.epoch == 0  # finished already: no second done
    now = feed_audio(s, silence(200), now, rec)
    commit(s, now, rec)
    create_response(s, now, rec)
    rec.clear()
    truncate(s, item, 100, now, rec)  # no longer the latest, still in the history: cut again, nothing cancelled
    assert rec.of(TruncateResponse) == [TruncateResponse(rid, 100.0)] and rec.of(CancelResponse) == []
    with pytest.raises(SessionError) as e:
        truncate(s, item, 500, now, rec)
    assert (e.value.code, e.value.param) == ("invalid_value", "audio_end_ms")


# ---- engine errors and late chunks ----------------------------------------------------------------


def test_engine_error_fails_the_response():
    s, rec, now, rid = manual_turn_answered()
    engine_chunk(s, rid, answer(1000), now, rec)
    now = run_clock(s, now, 0.2, rec, step_s=0.02)
    t_first = rec.timed(ResponseAudio)[0][0]
    rec.clear()
    engine_error(s, rid, now, rec)
    (done,) = rec.of(ResponseDone)
    assert (done.status, done.reason) == (ResponseStatus.FAILED, "engine_error")
    assert done.played_ms == pytest.approx(1000 * (now - t_first), abs=0.1)
    assert rec.of(CancelResponse) == [] and s.epoch == 1
    assert poll(s, now + 1, rec) is None and rec.of(ResponseAudio) == []  # the rest is dropped
    engine_error(s, rid, now, rec)  # twice: ignored
    assert len(rec.of(ResponseDone)) == 1
    create_response(s, now, rec)  # the session goes on
    assert rec.of(ResponseCreated)[0].epoch == 1


def test_late_chunks_are_counted():
    s, rec, now, rid = manual_turn_answered()
    engine_chunk(s, rid, answer(80), now, rec, deadline=now + 0.1)  # in time
    engine_chunk(s, rid, answer(80), now, rec, deadline=None)  # no deadline
    engine_chunk(s, rid, answer(80), now + 0.3, rec, deadline=now + 0.2)  # late
    engine_chunk(s, rid, answer(80), now + 0.4, rec, deadline=now + 0.35)  # late
    engine_chunk(s, "resp_other", answer(80), now + 0.5, rec, deadline=now)  # not this response: not counted
    assert s.stats.chunks_late == 2
    cancel_response(s, now + 0.5, rec)
    engine_chunk(s, rid, answer(80), now + 0.6, rec, deadline=now)  # after the cancel: dropped, not counted
    assert s.stats.chunks_late == 2


def test_a_failed_speculation_is_discarded_and_the_turn_gets_a_plain_answer():
    s, rec = new_session(), Rec()
    pcm = np.concatenate([silence(300), speech(1.0, seed=3), silence(600)])
    n = 1600 * RATE // 1000  # past the last pause, before the end of the turn
    now = feed_audio(s, pcm[:n], T0, rec)
    spec_id = s.speculation.id
    assert s.receive_engine_error(spec_id, now) is False  # not the client's business
    drain(s, rec, now)
    assert rec.of(DiscardResponse)[-1] == DiscardResponse(spec_id) and s.speculation is None
    assert rec.of(ResponseCreated, ResponseDone) == []
    feed_audio(s, pcm[n:], now, rec)
    cmds = rec.of(EndTurn, StartResponse, ConfirmResponse)
    created = rec.of(ResponseCreated)
    assert len(created) == 1 and created[0].response_id != spec_id
    assert [type(c) for c in cmds[-2:]] == [EndTurn, StartResponse] and cmds[-1] == StartResponse(created[0].response_id)
    assert s.stats.speculative_confirmed == 0 and s.stats.responses == 1


def test_a_confirmed_speculation_is_late_against_its_playback_not_the_engines_first_chunk():
    s, rec = new_session(), Rec()
    pcm = np.concatenate([silence(300), speech(1.0, seed=3), silence(600)])
    n = 1600 * RATE // 1000  # past the last pause (1520 ms of input), before the end of the turn (1680 ms)
    t = feed_audio(s, pcm[:n], T0, rec)
    spec_id = s.speculation.id
    first_at = t
    engine_chunk(s, spec_id, answer(80), first_at, rec, deadline=first_at + 0.06)
    now = feed_audio(s, pcm[n:], t, rec)  # confirmed ~100 ms later: playback starts then
    t_confirm = next(t for t, x in rec.out if isinstance(x, ConfirmResponse))
    shift = t_confirm - first_at
    assert shift > 0.05
    # the engine's deadline for the next chunk, from its first chunk: 80 ms on
    engine_chunk(s, spec_id, answer(80), first_at + 0.08 + shift - 0.01, rec, deadline=first_at + 0.08)
    assert s.stats.chunks_late == 0  # past the engine's deadline, not past the playback's
    engine_chunk(s, spec_id, answer(80), first_at + 0.16 + shift + 0.01, rec, deadline=first_at + 0.16)
    assert s.stats.chunks_late == 1 and s.stats.chunks == 2  # (the chunk held while speculative is not counted)
    assert s.stats.chunks_gap == 0  # 10 ms late: the lead the client holds (150 ms) covers it
    engine_chunk(s, spec_id, answer(80), first_at + 0.24 + shift + LEAD_MS / 1000 + 0.01, rec, deadline=first_at + 0.24)
    assert s.stats.chunks_late == 2 and s.stats.chunks_gap == 1  # late beyond the lead: a gap the client hears


def test_exchanges_dropped_for_a_speculation_are_told_once_confirmed_and_never_once_discarded():
    s, rec = new_session(), Rec()
    pcm = np.concatenate([silence(300), speech(1.0, seed=3), silence(600)])
    now = feed_audio(s, pcm[: 700 * RATE // 1000], T0, rec)  # the pause within the speech: a speculation
    first = s.speculation.id
    s.receive_history_dropped(("resp_a",), first)
    assert s.speculation.dropped == ("resp_a",) and s.stats.exchanges_dropped == 0  # held
    now = feed_audio(s, pcm[700 * RATE // 1000 : 1600 * RATE // 1000], now, rec)  # speech again: discarded
    assert rec.of(DiscardResponse)[0] == DiscardResponse(first)
    s.receive_history_dropped(("resp_b",), first)  # late news of the discarded one: the engine restored them
    assert s.stats.exchanges_dropped == 0
    second = s.speculation.id
    s.receive_history_dropped(("resp_c",), second)
    feed_audio(s, pcm[1600 * RATE // 1000 :], now, rec)  # the turn ends: confirmed, its drops told
    assert rec.of(ResponseCreated)[0].response_id == second and s.stats.exchanges_dropped == 1
