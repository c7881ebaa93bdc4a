"""The fake engine honours the contract of engine/service_api.py (so gateway tests built on it mean something)."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
from fake_engine import AnswerPlan, FakeEngine, answer_pcm, answer_text, user_transcript_text

from engine.service_api import (
    AtCapacity,
    ConversationClosed,
    ConversationOptions,
    EngineError,
    HistoryTurn,
    NoTextModel,
    ResponseInProgress,
    Role,
)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 5))


async def collect(handle) -> list:
    return [c async for c in handle.chunks()]


def user_turn(conv, ms: int) -> None:
    conv.push_user_audio(np.full(16 * ms, 100, np.int16))
    conv.end_user_turn()


def answering(eng: FakeEngine, user_ms: int):
    """Conversation "s1" after a user turn of `user_ms`, and the handle of its answer "r1"."""
    conv = eng.open_conversation("s1")
    user_turn(conv, user_ms)
    return conv, conv.respond("r1")


def test_a_full_answer_is_the_known_audio_in_order_and_the_history_keeps_it():
    async def main():
        eng = FakeEngine(answer_ms=500, chunk_ms=80, text="hello there friend")
        conv = eng.open_conversation("s1")
        user_turn(conv, 400)
        t0 = time.monotonic()
        h = conv.respond("resp_a")
        assert h.id == "resp_a" and not h.started  # returns at once, generation runs in a task
        chunks = await collect(h)
        assert [c.start_ms for c in chunks] == [0, 80, 160, 240, 320, 400, 480]
        assert [c.duration_ms for c in chunks] == [80] * 6 + [20]
        assert [c.is_last for c in chunks] == [False] * 6 + [True]
        assert all(c.response_id == "resp_a" and c.pcm.dtype == np.int16 for c in chunks)
        np.testing.assert_array_equal(np.concatenate([c.pcm for c in chunks]), answer_pcm(0, 0, 0, 8000))
        np.testing.assert_array_equal(h.expected_pcm(), answer_pcm(0, 0, 0, 8000))
        assert all(c.text_delta == "" for c in chunks)  # no assistant_text asked: the answer writes none
        assert t0 <= chunks[0].deadline - 0.5 <= time.monotonic()
        assert chunks[3].deadline - chunks[0].deadline == pytest.approx(0.24)
        await h.wait_ended()
        assert h.status == "completed"
        assert conv.history == [HistoryTurn(Role.USER, 20), HistoryTurn(Role.ASSISTANT, 25)]
        assert conv.respond_ids == ["resp_a"] and conv.end_turn_calls == 1 and conv.user_samples == [6400]
        with pytest.raises(RuntimeError):
            h.chunks()  # iterate once

    run(main())


def test_answers_differ_per_conversation_and_response():
    a, b, c = answer_pcm(0, 0, 0, 320), answer_pcm(0, 1, 0, 320), answer_pcm(1, 0, 0, 320)
    assert not np.array_equal(a, b) and not np.array_equal(a, c)
    ramp = answer_pcm(0, 0, 0, 65536).astype(np.int64)
    assert np.unique(ramp).size == 65536  # every position of 4 s is distinct
    np.testing.assert_array_equal(answer_pcm(2, 3, 1000, 50), answer_pcm(2, 3, 0, 1050)[1000:])


def test_cancel_before_start_never_starts():
    async def main():
        eng = FakeEngine(answer_ms=400, step_s=0.01)
        conv, h = answering(eng, user_ms=200)
        h.cancel(0)
        assert await collect(h) == []
        await h.wait_ended()
        assert not h.started and h.status == "cancelled" and h.produced == []
        assert conv.history == [HistoryTurn(Role.USER, 10), HistoryTurn(Role.ASSISTANT, 0)]
        assert conv.cancels == [("r1", 0.0)]

    run(main())


def test_cancel_midway_ends_chunks_without_is_last_and_history_keeps_played_ms():
    async def main():
        eng = FakeEngine(answer_ms=2000, chunk_ms=80, step_s=0.005)
        conv, h = answering(eng, user_ms=300)
        got = []
        async for c in h.chunks():
            got.append(c)
            if len(got) == 5:  # 400 ms generated; the client played 130 ms of it
                h.cancel(130)
                h.cancel(130)  # idempotent
                h.cancel(400)  # a later cancel never extends what the history keeps
        assert len(got) == 5 and not any(c.is_last for c in got)
        await h.wait_ended()
        assert h.status == "cancelled" and h.generated_ms < 2000
        assert conv.history == [HistoryTurn(Role.USER, 15), HistoryTurn(Role.ASSISTANT, 6)]  # 130 // 20
        assert conv.cancels == [("r1", 130.0), ("r1", 130.0), ("r1", 400.0)]
        # played_ms beyond what was generated keeps only the generated frames
        user_turn(conv, 100)
        h2 = conv.respond("r2")
        async for c in h2.chunks():
            h2.cancel(10_000)
        await h2.wait_ended()
        assert conv.history[-1] == HistoryTurn(Role.ASSISTANT, 4)  # one 80 ms chunk

    run(main())


def test_no_chunk_is_yielded_after_cancel_even_if_queued():
    async def main():
        conv = FakeEngine(answer_ms=800, chunk_ms=80, step_s=0).open_conversation("s1")
        user_turn(conv, 100)
        h = conv.respond("r1")
        await asyncio.sleep(0.01)  # the producer runs ahead: all 10 chunks are queued
        assert len(h.produced) == 10 and h.ended and h.status == "completed"
        got = []
        async for c in h.chunks():
            got.append(c)
            h.cancel(60)  # after the end: cuts, and the consumer gets nothing more
        assert len(got) == 1 and h.delivered == got
        assert conv.history[-1] == HistoryTurn(Role.ASSISTANT, 3)

    run(main())


def test_truncate_cuts_any_answer_in_the_history_and_cancel_after_completion_the_latest_only():
    async def main():
        eng = FakeEngine(answer_ms=600)
        conv, h = answering(eng, user_ms=100)
        await collect(h)
        await h.wait_ended()
        assert conv.history[-1] == HistoryTurn(Role.ASSISTANT, 30)
        conv.truncate("r1", 250)
        assert conv.history[-1] == HistoryTurn(Role.ASSISTANT, 12)
        conv.truncate("r1", 400)  # cuts only shorten
        assert conv.history[-1] == HistoryTurn(Role.ASSISTANT, 12)
        h.cancel(100)  # cancel after the end cuts too
        assert conv.history[-1] == HistoryTurn(Role.ASSISTANT, 5)
        conv.truncate("nope", 0)
        user_turn(conv, 100)
        h2 = conv.respond("r2")
        await collect(h2)
        await h2.wait_ended()
        h.cancel(0)  # an older handle: ignored
        assert [t.audio_frames for t in conv.history] == [5, 5, 5, 30]
        conv.truncate("r1", 40)  # an older answer still in the history: cut
        assert [t.audio_frames for t in conv.history] == [5, 2, 5, 30]
        assert [(t.response_id, t.played_ms, t.applied) for t in conv.truncates] == [
            ("r1", 250, True), ("r1", 400, True), ("nope", 0, False), ("r1", 40, True)]

    run(main())


def test_respond_while_generating_raises_and_after_cancel_waits_for_the_wind_down():
    async def main():
        eng = FakeEngine(answer_ms=1000, step_s=0.02)
        conv = eng.open_conversation("s1")
        user_turn(conv, 100)
        h1 = conv.respond("r1")
        with pytest.raises(ResponseInProgress) as e:
            conv.respond("r2")
        assert e.value.code == "conversation_already_has_active_response"
        await asyncio.sleep(0.05)
        assert h1.started and eng.load().responding == 1
        h1.cancel(40)
        user_turn(conv, 100)
        h2 = conv.respond("r2")  # allowed: r1 is cancelled, still winding down
        assert not h1.ended and not h2.started
        chunks = await collect(h2)
        assert h1.ended and h2.started and chunks[-1].is_last
        assert h1.status == "cancelled" and h2.status == "completed"
        assert conv.respond_ids == ["r1", "r2"]
        assert [(t.role, t.audio_frames) for t in conv.history] == [
            (Role.USER, 5), (Role.ASSISTANT, 2), (Role.USER, 5), (Role.ASSISTANT, 50)]

    run(main())


def test_respond_ends_an_open_turn_or_adds_an_empty_one():
    async def main():
        conv = FakeEngine(answer_ms=40).open_conversation("s1")
        conv.push_user_audio(np.ones(3200, np.int16))
        conv.push_user_audio(np.ones(1000, np.int16))
        h = conv.respond("r1")  # the open turn is ended by respond
        await collect(h)
        await h.wait_ended()
        h2 = conv.respond("r2")  # no user turn since: an empty one
        await collect(h2)
        await h2.wait_ended()
        assert [(t.role, t.audio_frames) for t in conv.history] == [
            (Role.USER, 13), (Role.ASSISTANT, 2), (Role.USER, 0), (Role.ASSISTANT, 2)]
        assert conv.user_samples == [4200, 0] and conv.end_turn_calls == 0
        assert conv.calls[:3] == [("push", 3200), ("push", 1000), ("respond", "r1")]

    run(main())


def test_capacity_refusal_and_load():
    async def main():
        eng = FakeEngine(capacity=2)
        a = eng.open_conversation("a")
        eng.open_conversation("b")
        with pytest.raises(AtCapacity) as e:
            eng.open_conversation("c")
        assert e.value.code == "server_at_capacity" and eng.refused == ["c"]
        load = eng.load()
        assert (load.conversations, load.capacity, load.responding) == (2, 2, 0)
        await a.close()
        c = eng.open_conversation("c")  # the slot was freed
        assert c.index == 2 and eng.load().conversations == 2
        await eng.shutdown()
        assert not eng.health().ready and eng.conversations == {} and c.closed
        with pytest.raises(AtCapacity):
            eng.open_conversation("d")

    run(main())


def test_failure_injection_raises_engine_error_from_chunks():
    async def main():
        eng = FakeEngine(answer_ms=1000, chunk_ms=80, fail_after_chunks=3)
        conv, h = answering(eng, user_ms=100)
        got = []
        with pytest.raises(EngineError) as e:
            async for c in h.chunks():
                got.append(c)
        assert e.value.code == "engine_error" and len(got) == 3
        await h.wait_ended()
        assert h.status == "failed" and conv.history[-1] == HistoryTurn(Role.ASSISTANT, 12)
        h.cancel(100)  # the gateway reports what was played: the history is cut
        assert conv.history[-1] == HistoryTurn(Role.ASSISTANT, 5)

    run(main())


def test_close_is_idempotent_cancels_and_refuses_later_calls():
    async def main():
        eng = FakeEngine(answer_ms=5000, step_s=0.01)
        conv, h = answering(eng, user_ms=100)
        await asyncio.sleep(0.035)
        await conv.close()
        await conv.close()
        assert conv.closed and conv.close_calls == 2 and "s1" not in eng.conversations
        assert h.ended and h.status == "cancelled" and 0 < h.generated_ms < 5000
        assert await collect(h) == []
        assert conv.history[-1].audio_frames == h.generated_samples // 320  # close keeps what was generated
        for call in (lambda: conv.push_user_audio(np.zeros(320, np.int16)), conv.end_user_turn, lambda: conv.respond("r2"),
                     lambda: conv.update_options(ConversationOptions())):
            with pytest.raises(ConversationClosed):
                call()
        conv2 = eng.open_conversation("s1")  # the id can be reused once closed
        assert eng.conversation("s1") is conv2 and conv2 is not conv

    run(main())


def test_options_updates_are_recorded():
    conv = FakeEngine().open_conversation("s1", ConversationOptions(temperature=0.5))
    conv.update_options(ConversationOptions(top_k=5))
    assert conv.options.top_k == 5 and [o.top_k for o in conv.options_updates] == [5]
    assert conv.calls == [("update_options",)]


async def answer_and_transcript(h) -> tuple[list, list[str]]:
    return await asyncio.gather(collect(h), _all(h.user_transcript()))


async def _all(it) -> list:
    return [x async for x in it]


def test_assistant_text_comes_first_without_audio_then_the_audio():
    async def main():
        eng = FakeEngine(answer_ms=200, chunk_ms=80, text="hello there friend")
        conv = eng.open_conversation("s1", ConversationOptions(assistant_text=True))
        user_turn(conv, 400)
        chunks, transcript = await answer_and_transcript(conv.respond("r1"))
        assert transcript == []  # not asked for
        text = [c for c in chunks if c.text_delta]
        assert [c.text_delta for c in text] == ["hello", " there", " friend"] and chunks[:3] == text
        assert all(c.pcm.size == 0 and c.duration_ms == 0 and not c.is_last for c in text)
        audio = chunks[3:]
        assert [c.duration_ms for c in audio] == [80, 80, 40] and audio[-1].is_last and not any(c.text_delta for c in audio)
        assert audio[0].deadline >= text[-1].deadline  # the audio's deadlines count from its own start
        assert conv.history[-1] == HistoryTurn(Role.ASSISTANT, 10, "hello there friend")

    run(main())


def test_text_only_answers_and_typed_turns_and_the_users_transcript():
    async def main():
        eng = FakeEngine(answer_ms=200)
        opts = ConversationOptions(assistant_text=True, output_audio=False, transcribe_user=True)
        conv = eng.open_conversation("s1", opts)
        user_turn(conv, 400)
        chunks, transcript = await answer_and_transcript(conv.respond("r1"))
        assert "".join(c.text_delta for c in chunks) == answer_text(0, 0)
        assert all(c.pcm.size == 0 for c in chunks) and chunks[-1].is_last and chunks[-1].text_delta == ""
        assert "".join(transcript) == user_transcript_text(20) == "you spoke for 400 milliseconds" and len(transcript) == 5
        conv.push_user_audio(np.full(16 * 100, 5, np.int16))
        conv.add_user_text("What time is it?")  # joins the open audio turn
        chunks, transcript = await answer_and_transcript(conv.respond("r2"))
        assert "".join(transcript) == user_transcript_text(5)
        assert conv.history[2] == HistoryTurn(Role.USER, 5, "What time is it?")
        conv.add_user_text("Only text.")
        chunks, transcript = await answer_and_transcript(conv.respond("r3"))
        assert transcript == [] and "".join(c.text_delta for c in chunks) == answer_text(0, 2)  # no audio: nothing to transcribe
        with pytest.raises(ValueError):
            conv.add_user_text("  ")

    run(main())


def test_the_transcript_goes_on_after_a_cancel_and_fails_when_told():
    async def main():
        eng = FakeEngine(answer_ms=2000, step_s=0.005)
        conv = eng.open_conversation("s1", ConversationOptions(transcribe_user=True))
        user_turn(conv, 200)
        h = conv.respond("r1")
        h.cancel(0.0)
        assert "".join(await _all(h.user_transcript())) == user_transcript_text(10)
        conv.plan = AnswerPlan(answer_ms=200, transcript_fail_after=2)
        user_turn(conv, 200)
        h2 = conv.respond("r2")
        got = []
        with pytest.raises(EngineError):
            async for d in h2.user_transcript():
                got.append(d)
        assert len(got) == 2 and h2.transcript_status == "failed"

    run(main())


def test_a_model_without_text_refuses_text_options_and_typed_turns():
    eng = FakeEngine(text_model=False)
    assert not eng.supports_text and FakeEngine().supports_text
    for opts in (ConversationOptions(transcribe_user=True), ConversationOptions(assistant_text=True)):
        with pytest.raises(NoTextModel):
            eng.open_conversation("x", opts)
    conv = eng.open_conversation("s1")
    with pytest.raises(NoTextModel):
        conv.add_user_text("hello")
    with pytest.raises(NoTextModel):
        conv.update_options(ConversationOptions(transcribe_user=True))
    with pytest.raises(ValueError):
        FakeEngine().open_conversation("y", ConversationOptions(output_audio=False))
