"""realtime.runner.SessionRunner and realtime.admission.Admission, end to end without sockets or a model.

A real RealtimeProtocol and Session, RunnerDeps/Admission built from realtime.config, the fake engine
(tests/realtime/fake_engine.py) and an in-memory `MemoryLink` in place of the WebSocket. Each test runs
its own event loop (asyncio.run) and checks concrete values: wire events, the samples that went out,
what the engine was told, close codes, end reasons, metrics.

Speech is engine/codec/synth.py's `speech_like` (Silero detects it); the client sends it as
input_audio_buffer.append events of pcm16 at 24 kHz, faster than real time (VAD works on sample
positions, not on the clock). Every test runs on virtual time (`run_virtual`, virtual_time.py): the
runner's clock is the event loop's, which jumps to the next timer whenever every task waits on one, so
answers are paced in virtual seconds that take no wall time, and the times asserted are exact.
"""

from __future__ import annotations

import asyncio
import dataclasses
import base64
import json

import numpy as np
import pytest
from fake_engine import FakeEngine, TruncateCall
from virtual_time import lag

from engine.service_api import AtCapacity, Role
from realtime.audio import InputDecoder, WireFormat
from realtime.messages import CloseReason
from realtime.resume import ResumeRefused

from runner_rig import (
    FRAME_MS, LEAD_MS, RATE, STALL_MS, WIRE_RATE, FloodLink, MemoryLink, Rig, appends, assert_audio_equal, decode_deltas,
    delta_ms, index_of, run_virtual, silence16, speech16, until, user_turn16, wire_answer,
)


# ---- turn-taking --------------------------------------------------------------------------------------


@pytest.mark.parametrize("vad_batch_ms", [0.0, 30.0], ids=["vad_inline", "vad_batched"])
def test_turn_taking_user_speech_to_a_paced_answer_of_the_engines_audio(vad_batch_ms):
    async def main():
        rig = Rig(FakeEngine(capacity=2, answer_ms=1000, chunk_ms=80), {"audio": {"vad_batch_ms": vad_batch_ms}})
        assert (rig.vad is None) == (vad_batch_ms == 0)
        link = MemoryLink()
        runner = rig.open(link)
        assert runner.session.vad_deferred == (vad_batch_ms > 0)
        pcm = user_turn16()
        msgs = appends(pcm)
        link.feed(*msgs)
        await until(lambda: link.of("response.done"), "response.done", timeout=8)
        types = link.types()
        assert types[0] == "session.created"
        assert link.events()[0]["session"]["id"] == runner.id
        i_start = index_of(types, "input_audio_buffer.speech_started")
        i_stop = index_of(types, "input_audio_buffer.speech_stopped", i_start)
        i_commit = index_of(types, "input_audio_buffer.committed", i_stop)
        i_created = index_of(types, "response.created", i_commit)
        i_delta = index_of(types, "response.output_audio.delta", i_created)
        i_done = index_of(types, "response.done", i_delta)
        assert i_start < i_stop < i_commit < i_created < i_delta < i_done == len(types) - 1
        started, stopped, committed = link.of("input_audio_buffer.speech_started")[0], \
            link.of("input_audio_buffer.speech_stopped")[0], link.of("input_audio_buffer.committed")[0]
        assert 0 <= started["audio_start_ms"] <= 300 and 900 <= stopped["audio_end_ms"] <= 1400
        assert started["item_id"] == stopped["item_id"] == committed["item_id"]
        assert types.count("input_audio_buffer.speech_started") == 1 and types.count("response.created") == 1
        rid = link.of("response.created")[0]["response"]["id"]
        done = link.of("response.done")[0]["response"]
        assert done["id"] == rid and done["status"] == "completed" and done["status_details"] is None
        assert done["duplex"]["audio_ms"] == 1000.0 and done["duplex"]["epoch"] == 0
        # the engine: the user's audio from the (padded) speech start, the answer started speculatively at
        # the last pause, then confirmed (a pause within the speech started one that was discarded)
        conv = rig.conv(runner)
        assert conv.respond_ids[-1] == rid and conv.handles[-1].id == rid
        assert all(h.discarded for h in conv.handles[:-1]) and not conv.handles[-1].discarded
        kinds = [c[0] for c in conv.calls]
        assert kinds[-2:] == ["speculate", "confirm"] and conv.calls[-1] == ("confirm", rid) and len(kinds) > 20
        assert set(kinds[:-2]) <= {"push", "speculate", "discard"} and "end_turn" not in kinds
        assert kinds.count("speculate") == kinds.count("discard") + 1
        assert rig.metric("duplex_speculative_responses_total", outcome="discarded") == kinds.count("discard")
        dec = InputDecoder(WireFormat.PCM16)
        decoded = np.concatenate([dec.decode(base64.b64decode(m["audio"])) for m in msgs])
        pushed = conv.user_audio(0)
        first = int(started["audio_start_ms"] * RATE / 1000)
        assert_audio_equal(pushed, decoded[first : first + pushed.size])
        assert pushed.size >= (stopped["audio_end_ms"] - started["audio_start_ms"]) * RATE / 1000
        # the client: every delta of this response, sample for sample the fake's ramp on the wire
        deltas = link.deltas()
        assert {d["response_id"] for d in deltas} == {rid} and {d["epoch"] for d in deltas} == {0}
        assert all(len(base64.b64decode(d["delta"])) == 2 * WIRE_RATE * FRAME_MS // 1000 for d in deltas[:-1])
        out = decode_deltas(deltas)
        assert out.size == WIRE_RATE  # 1 s
        assert_audio_equal(out, wire_answer(conv.index, 0, 1000))
        # the runner counted it
        assert runner.session.stats.responses == 1 and len(runner.session.stats.ttfa_ms) == 1
        link.hang_up()
        await rig.ended(runner)
        assert runner.end_reason() is CloseReason.CLIENT_CLOSED and link.closes == [(1000, "")]
        assert rig.metric("duplex_responses_total", status="completed") == 1.0
        assert rig.metric("duplex_speculative_responses_total", outcome="confirmed") == 1.0
        assert rig.metric("duplex_sessions_ended_total", transport="websocket", reason="client_closed") == 1.0

    run_virtual(main)


def test_pacing_releases_no_faster_than_real_time_plus_lead():
    async def main():
        rig = Rig(FakeEngine(answer_ms=1000, chunk_ms=200, step_s=0.0))  # the engine is far ahead of real time
        link = MemoryLink()
        runner = rig.open(link)
        link.feed({"type": "response.create"})
        await until(lambda: link.of("response.done"), "response.done")
        timed = [(t, e) for t, e in link.timed_events() if e["type"] == "response.output_audio.delta"]
        assert len(timed) >= 24
        t0 = timed[0][0]
        sent_ms = 0.0
        for t, e in timed:
            sent_ms += delta_ms(e)
            # audio out by t: at most the time since the first frame + the lead + one frame (+ resampler, slack)
            assert sent_ms <= 1000 * (t - t0) + LEAD_MS + FRAME_MS + 40 + 30, (sent_ms, t - t0)
        assert sent_ms == pytest.approx(1000, abs=1)
        span = timed[-1][0] - t0
        assert span == pytest.approx(1.0 - LEAD_MS / 1000, abs=FRAME_MS / 1000), span  # 1 s of answer, its lead sent at once
        link.hang_up()
        await rig.ended(runner)

    run_virtual(main)


# ---- barge-in, cancel, truncate -------------------------------------------------------------------------


def test_barge_in_truncates_at_the_playback_cursor():
    async def main():
        rig = Rig(FakeEngine(answer_ms=4000, chunk_ms=80))
        link = MemoryLink()
        runner = rig.open(link)
        conv = rig.conv(runner)
        link.feed({"type": "response.create"})
        await until(lambda: sum(map(delta_ms, link.deltas())) >= 600, "600 ms of answer sent")
        rid = link.of("response.created")[0]["response"]["id"]
        handle = conv.handles[0]
        conv.plan = dataclasses.replace(conv.plan, answer_ms=300)  # the answer to the interruption
        link.feed(*appends(np.concatenate([speech16(1.0, seed=5), silence16(700)])))
        await until(lambda: len(link.of("response.done")) == 2, "the second answer done", timeout=6)
        types = link.types()
        i_clear = index_of(types, "output_audio_buffer.cleared")
        i_done = index_of(types, "response.done")
        i_speech = index_of(types, "input_audio_buffer.speech_started")
        assert i_speech < i_clear < i_done  # OpenAI's order: the interrupted answer is still in progress at speech_started
        assert link.events()[i_clear]["response_id"] == rid
        done = link.events()[i_done]["response"]
        assert done["id"] == rid and done["status"] == "cancelled"
        assert done["status_details"] == {"type": "cancelled", "reason": "turn_detected"}
        # no audio of the interrupted answer after the clear
        assert all(e.get("response_id") != rid for e in link.events()[i_clear + 1:] if e["type"] == "response.output_audio.delta")
        audio_ms, played_ms = done["duplex"]["audio_ms"], done["duplex"]["played_ms"]
        client_ms = sum(map(delta_ms, link.deltas(rid)))
        assert audio_ms - 80 <= client_ms <= audio_ms  # the wire lags the pacer by the resampler's delay at most
        assert 600 <= audio_ms < 4000
        # the engine was cancelled at what the client played: the audio sent, less the lead (the pacer's
        # schedule; STALL_MS: a stalled event loop re-anchors it later, as a client's underrun would)
        assert len(handle.cancels) == 1 and handle.cancels[0] == pytest.approx(played_ms, abs=0.1)
        assert audio_ms - LEAD_MS - FRAME_MS - STALL_MS <= handle.cancels[0] <= audio_ms
        assert client_ms - LEAD_MS - FRAME_MS - STALL_MS <= handle.cancels[0] <= client_ms + 80
        await handle.wait_ended()
        assert handle.cancelled  # (the fake generated all 4 s long before: the cancel cuts its history turn)
        hist = conv.history
        assert [t.role for t in hist[:3]] == [Role.USER, Role.ASSISTANT, Role.USER]
        assert hist[1].audio_frames == int(handle.cancels[0] // 20)
        # the interruption was a user turn and got its own answer, in the next epoch
        second = link.of("response.created")[1]
        assert second["epoch"] == 1 and conv.respond_ids == [rid, second["response"]["id"]]
        assert link.of("response.done")[1]["response"]["status"] == "completed"
        assert {d["epoch"] for d in link.deltas(second["response"]["id"])} == {1}
        assert runner.session.stats.barge_ins == 1
        link.hang_up()
        await rig.ended(runner)
        assert rig.metric("duplex_barge_ins_total") == 1.0

    run_virtual(main)


def test_client_cancel_then_truncate_after_completion():
    async def main():
        rig = Rig(FakeEngine(answer_ms=3000, chunk_ms=80))
        link = MemoryLink()
        runner = rig.open(link)
        conv = rig.conv(runner)
        link.feed({"type": "response.create"})
        await until(lambda: sum(map(delta_ms, link.deltas())) >= 300, "300 ms of answer sent")
        rid1 = link.of("response.created")[0]["response"]["id"]
        conv.plan = dataclasses.replace(conv.plan, answer_ms=400)
        link.feed({"type": "response.cancel", "event_id": "ev_cancel"})
        await until(lambda: link.of("response.done"), "response.done (cancelled)")
        done1 = link.of("response.done")[0]["response"]
        assert done1["id"] == rid1 and done1["status"] == "cancelled"
        assert done1["status_details"] == {"type": "cancelled", "reason": "client_cancelled"}
        assert link.of("output_audio_buffer.cleared") == [{**link.of("output_audio_buffer.cleared")[0], "response_id": rid1}]
        h1 = conv.handles[0]
        assert h1.cancels == [pytest.approx(done1["duplex"]["played_ms"], abs=0.1)]
        assert done1["duplex"]["audio_ms"] - LEAD_MS - FRAME_MS - STALL_MS <= h1.cancels[0] <= done1["duplex"]["audio_ms"]
        # a second answer completes; then the client says it played only 100 ms of it
        link.feed({"type": "response.create"})
        await until(lambda: len(link.of("response.done")) == 2, "the second response.done")
        done2 = link.of("response.done")[1]["response"]
        rid2, item2 = done2["id"], done2["output"][0]["id"]
        assert done2["status"] == "completed" and conv.respond_ids == [rid1, rid2]
        await conv.handles[1].wait_ended()
        link.feed({"type": "conversation.item.truncate", "item_id": item2, "content_index": 0, "audio_end_ms": 100})
        await until(lambda: link.of("conversation.item.truncated"), "conversation.item.truncated")
        assert link.of("conversation.item.truncated")[0]["item_id"] == item2
        assert link.of("conversation.item.truncated")[0]["audio_end_ms"] == 100
        assert [(t.response_id, t.played_ms, t.applied) for t in conv.truncates] == [(rid2, 100.0, True)]
        assert conv.history[-1].role is Role.ASSISTANT and conv.history[-1].audio_frames == 5
        # an older item still in the history can be cut too; past the audio it had: refused, the engine not told
        item1 = done1["output"][0]["id"]
        link.feed({"type": "conversation.item.truncate", "item_id": item1, "audio_end_ms": 20})
        await until(lambda: len(link.of("conversation.item.truncated")) == 2, "the second conversation.item.truncated")
        assert conv.truncates[-1] == TruncateCall(rid1, 20.0, True)
        assert [t.audio_frames for t in conv.history][1] == 1
        link.feed({"type": "conversation.item.truncate", "event_id": "ev_t1", "item_id": item1, "audio_end_ms": 60_000})
        await until(lambda: link.of("error"), "an error")
        err = link.of("error")[0]["error"]
        assert (err["code"], err["param"], err["event_id"]) == ("invalid_value", "audio_end_ms", "ev_t1")
        assert err["message"].startswith("Audio content of ") and "is already shorter than 60000ms" in err["message"]
        assert len(conv.truncates) == 2
        link.hang_up()
        await rig.ended(runner)
        assert rig.metric("duplex_responses_total", status="cancelled") == 1.0
        assert rig.metric("duplex_responses_total", status="completed") == 1.0
        assert rig.metric("duplex_client_errors_total") == 1.0

    run_virtual(main)


def test_exchanges_the_engine_drops_for_its_context_are_deleted_items():
    async def main():
        rig = Rig(FakeEngine(answer_ms=200, chunk_ms=80, context_exchanges=2))
        link = MemoryLink()
        runner = rig.open(link)
        conv = rig.conv(runner)
        for k in range(3):  # a committed user turn, then its answer; the third drops the first exchange
            link.feed(*appends(speech16(0.2, seed=k)), {"type": "input_audio_buffer.commit"}, {"type": "response.create"})
            await until(lambda: len(link.of("response.done")) == k + 1, f"response.done {k + 1}")
        user1 = link.of("input_audio_buffer.committed")[0]["item_id"]
        answer1 = link.of("response.done")[0]["response"]["output"][0]["id"]
        assert conv.handles[2].dropped_exchanges == (conv.respond_ids[0],)
        await until(lambda: len(link.of("conversation.item.deleted")) == 2, "two conversation.item.deleted")
        assert [e["item_id"] for e in link.of("conversation.item.deleted")] == [user1, answer1]
        events = link.events()  # deleted before the answer that needed the room plays
        rid3 = conv.respond_ids[2]
        first_delta3 = next(k for k, e in enumerate(events) if e["type"] == "response.output_audio.delta" and e["response_id"] == rid3)
        assert max(k for k, e in enumerate(events) if e["type"] == "conversation.item.deleted") < first_delta3
        assert [t.role for t in conv.history] == [Role.USER, Role.ASSISTANT, Role.USER, Role.ASSISTANT]
        assert rig.metric("duplex_context_exchanges_dropped_total") == 1.0
        # the deleted answer is gone: truncating it is refused, the engine is not told
        link.feed({"type": "conversation.item.truncate", "event_id": "ev_t", "item_id": answer1, "audio_end_ms": 10})
        await until(lambda: link.of("error"), "an error")
        assert link.of("error")[0]["error"]["code"] == "item_truncate_invalid_item_id" and not conv.truncates
        link.hang_up()
        await rig.ended(runner)

    run_virtual(main)


def test_audio_items_deleted_by_the_client_leave_the_models_history():
    """conversation.item.delete of audio turns (LiveKit's update_chat_ctx deletes what its context lost):
    the engine stops reading that turn; an answer in progress, or a user turn not yet answered, is
    refused with the reason; a deleted item is then unknown."""
    async def main():
        rig = Rig(FakeEngine(answer_ms=200, chunk_ms=80))
        link = MemoryLink()
        runner = rig.open(link)
        conv = rig.conv(runner)
        link.feed({"type": "session.update", "session": {"type": "realtime", "audio": {"input": {"turn_detection": None}}}})
        for k in range(2):  # two exchanges: a committed user turn, then its answer
            link.feed(*appends(speech16(0.2, seed=k)), {"type": "input_audio_buffer.commit"}, {"type": "response.create"})
            await until(lambda: len(link.of("response.done")) == k + 1, f"response.done {k + 1}")
        await conv.handles[1].wait_ended()
        (user1, user2), (answer1, answer2) = ([e["item_id"] for e in link.of("input_audio_buffer.committed")],
                                              [e["response"]["output"][0]["id"] for e in link.of("response.done")])
        rid1, rid2 = conv.respond_ids
        link.feed({"type": "conversation.item.delete", "item_id": answer1}, {"type": "conversation.item.delete", "item_id": user2})
        await until(lambda: len(link.of("conversation.item.deleted")) == 2, "two conversation.item.deleted")
        assert [e["item_id"] for e in link.of("conversation.item.deleted")] == [answer1, user2]
        assert [c for c in conv.calls if c[0] == "delete_turn"] == [("delete_turn", rid1, Role.ASSISTANT), ("delete_turn", rid2, Role.USER)]
        assert [t.role for t in conv.history] == [Role.USER, Role.ASSISTANT]  # user 1, answer 2
        link.feed({"type": "conversation.item.retrieve", "item_id": user1}, {"type": "conversation.item.retrieve", "item_id": answer2})
        await until(lambda: len(link.of("conversation.item.retrieved")) == 2, "the kept items retrieved")
        assert [e["item"]["id"] for e in link.of("conversation.item.retrieved")] == [user1, answer2]
        # refused: a deleted item (unknown now), a committed turn with no answer yet, an answer in progress
        link.feed({"type": "conversation.item.delete", "event_id": "ev_gone", "item_id": answer1},
                  {"type": "conversation.item.truncate", "event_id": "ev_gone_t", "item_id": answer1, "audio_end_ms": 0},
                  *appends(speech16(0.2, seed=5)), {"type": "input_audio_buffer.commit"})
        await until(lambda: len(link.of("input_audio_buffer.committed")) == 3, "the third commit")
        user3 = link.of("input_audio_buffer.committed")[2]["item_id"]
        link.feed({"type": "conversation.item.delete", "event_id": "ev_unanswered", "item_id": user3})
        conv.plan = dataclasses.replace(conv.plan, answer_ms=3000)
        link.feed({"type": "response.create"})
        await until(lambda: len(link.of("response.created")) == 3, "the third response.created")
        answer3 = link.of("response.created")[2]["response"]["id"]
        item3 = link.of("response.output_item.added")[2]["item"]["id"]
        link.feed({"type": "conversation.item.delete", "event_id": "ev_running", "item_id": item3})
        await until(lambda: len(link.of("error")) == 4, "four errors")
        errors = {e["error"]["event_id"]: e["error"]["code"] for e in link.of("error")}
        assert errors == {"ev_gone": "item_delete_invalid_item_id", "ev_gone_t": "item_truncate_invalid_item_id",
                          "ev_unanswered": "item_not_deletable",
                          "ev_running": "item_not_deletable"}
        assert len([c for c in conv.calls if c[0] == "delete_turn"]) == 2 and answer3
        link.hang_up()
        await rig.ended(runner)

    run_virtual(main)


# ---- failures and limits ---------------------------------------------------------------------------------


def test_engine_failure_fails_the_response_and_the_session_goes_on():
    async def main():
        rig = Rig(FakeEngine(answer_ms=500, chunk_ms=80, fail_after_chunks=2))
        link = MemoryLink()
        runner = rig.open(link)
        conv = rig.conv(runner)
        link.feed({"type": "response.create"})
        await until(lambda: link.of("response.done"), "response.done (failed)")
        rid1 = link.of("response.created")[0]["response"]["id"]
        err = link.of("error")
        assert len(err) == 1 and err[0]["error"]["code"] == "engine_error" and err[0]["error"]["type"] == "server_error"
        assert rid1 in err[0]["error"]["message"]
        done1 = link.of("response.done")[0]["response"]
        assert done1["id"] == rid1 and done1["status"] == "failed"
        assert done1["status_details"] == {"type": "failed", "reason": "engine_error"}
        assert conv.handles[0].status == "failed"
        conv.plan = dataclasses.replace(conv.plan, fail_after_chunks=None)
        link.feed({"type": "response.create"})
        await until(lambda: len(link.of("response.done")) == 2, "the second response.done")
        done2 = link.of("response.done")[1]["response"]
        assert done2["status"] == "completed" and done2["duplex"]["audio_ms"] == 500.0
        assert done2["duplex"]["epoch"] == 1  # a failed response starts a new epoch
        assert_audio_equal(decode_deltas(link.deltas(done2["id"])), wire_answer(conv.index, 1, 500))
        assert not rig.tasks[runner.id].done()
        link.hang_up()
        await rig.ended(runner)
        assert runner.end_reason() is CloseReason.CLIENT_CLOSED
        assert rig.metric("duplex_responses_total", status="failed") == 1.0
        assert rig.metric("duplex_client_errors_total") == 0.0  # the engine's failure is not the client's

    run_virtual(main)


def test_idle_timeout_closes_a_silent_session():
    async def main():
        rig = Rig(config={"limits": {"idle_timeout_s": 0.3}})
        link = MemoryLink()
        t0 = asyncio.get_running_loop().time()
        runner = rig.open(link)
        await rig.ended(runner)
        assert asyncio.get_running_loop().time() - t0 == pytest.approx(0.3)
        assert runner.end_reason() is CloseReason.IDLE_TIMEOUT
        assert link.types() == ["session.created", "error"]
        err = link.of("error")[0]["error"]
        assert err["code"] == "idle_timeout" and err["type"] == "server_error" and err["event_id"] is None
        assert len(link.closes) == 1 and link.closes[0][0] == 1000 and "no client event" in link.closes[0][1]
        assert rig.metric("duplex_sessions_ended_total", transport="websocket", reason="idle_timeout") == 1.0
        assert rig.conv(runner).closed

        # a client event restarts the clock
        link2 = MemoryLink()
        t0 = asyncio.get_running_loop().time()
        runner2 = rig.open(link2)
        for _ in range(3):
            await asyncio.sleep(0.2)
            link2.feed({"type": "input_audio_buffer.clear"})
        await rig.ended(runner2)
        assert asyncio.get_running_loop().time() - t0 == pytest.approx(3 * 0.2 + 0.3)
        assert runner2.end_reason() is CloseReason.IDLE_TIMEOUT and link2.types()[-1] == "error"

    run_virtual(main)


def test_idle_timeout_waits_for_a_playing_answer_without_blocking_the_event_loop():
    async def main():
        rig = Rig(FakeEngine(answer_ms=1200, chunk_ms=80), {"limits": {"idle_timeout_s": 0.3}})
        link = MemoryLink()
        ticks: list[float] = []

        async def ticker():
            while True:
                ticks.append(asyncio.get_running_loop().time())
                await asyncio.sleep(0.01)

        tick_task = asyncio.create_task(ticker())
        runner = rig.open(link)
        link.feed({"type": "response.create"})
        await rig.ended(runner)
        tick_task.cancel()
        # the answer (longer than the idle timeout) is not cut: the session closes after it
        assert runner.end_reason() is CloseReason.IDLE_TIMEOUT
        assert link.types()[-2:] == ["response.done", "error"]
        assert link.of("response.done")[0]["response"]["status"] == "completed"
        # ... and it is paced to the end, with the event loop free all along
        # every tick on time: no task held the loop past a timer (on virtual time a task that keeps the loop
        # busy stops the clock instead, and the loop's wall-clock limit fails the test)
        gaps = [b - a for a, b in zip(ticks, ticks[1:])]
        assert max(gaps) == pytest.approx(0.01), f"the event loop was blocked for {max(gaps):.2f} s"
        timed = [(t, e) for t, e in link.timed_events() if e["type"] == "response.output_audio.delta"]
        assert timed[-1][0] - timed[0][0] >= 0.8

    run_virtual(main)


def test_slow_client_is_disconnected():
    async def main():
        rig = Rig(FakeEngine(answer_ms=2000, chunk_ms=80), {"limits": {"outbound_queue": 8, "close_timeout_s": 0.2}})
        link = MemoryLink(block_send=True)
        runner = rig.open(link)
        link.feed({"type": "response.create"})
        await rig.ended(runner, timeout=3)
        assert runner.end_reason() is CloseReason.SLOW_CLIENT
        assert link.closes == [(1008, "slow client: outbound queue full")]
        assert link.sent == [] and link.send_calls == 1  # the writer never got past its first message
        assert rig.metric("duplex_sessions_ended_total", transport="websocket", reason="slow_client") == 1.0
        assert rig.metric("duplex_sessions_refused_total", reason="slow_client") == 1.0
        assert rig.conv(runner).closed and rig.adm.sessions == {}

    run_virtual(main)


def test_engine_chunks_reach_the_client_behind_a_full_client_lane():
    async def main():
        # the message budget off: this flood is about lane priority (the budget has its own tests)
        rig = Rig(FakeEngine(answer_ms=600, chunk_ms=40),
                  {"limits": {"inbound_queue": 1, "input": {"messages_per_s": 1e9, "message_burst": 1e9}}})
        # cheap events that change nothing (an ack of another response), as fast as the session takes them
        link = FloodLink([{"type": "response.create"}],
                         {"type": "output_audio_buffer.played", "played_ms": 0, "response_id": "resp_other"})
        runner = rig.open(link)
        full_seen = 0

        def sample() -> bool:
            nonlocal full_seen
            full_seen += len(runner.inbox._client) >= runner.inbox.limit
            return bool(link.of("response.done"))

        t0 = asyncio.get_running_loop().time()
        await until(sample, "response.done behind the flood", timeout=5)
        elapsed = asyncio.get_running_loop().time() - t0
        flood_at_done = link.flood_sent
        done = link.of("response.done")[0]["response"]
        assert done["status"] == "completed" and done["duplex"]["audio_ms"] == 600.0
        assert_audio_equal(decode_deltas(link.deltas(done["id"])), wire_answer(rig.conv(runner).index, 0, 600))
        assert elapsed <= 0.6, elapsed  # its audio's real time (less the lead) and the loop's busy turns, not behind the flood
        assert flood_at_done > 100 and full_seen > 0  # the client lane was busy all along
        assert link.of("error") == []
        link.flooding = False
        await rig.ended(runner)
        assert runner.end_reason() is CloseReason.CLIENT_CLOSED

    run_virtual(main, busy_s=1e-4)  # each turn of the flooded loop costs 100 µs: time passes while it is busy


# ---- resume ------------------------------------------------------------------------------------------------


def test_lost_link_detaches_and_attach_replays_then_resumes_pacing():
    async def main():
        rig = Rig(FakeEngine(answer_ms=1200, chunk_ms=80), {"limits": {"resume_grace_s": 5.0}})
        a = MemoryLink()
        runner = rig.open(a, resumable=True)
        await until(lambda: a.sent, "session.created")
        created = a.events()[0]
        assert created["type"] == "session.created" and created["resume_token"] == runner.resume_token
        assert created["resume_grace_s"] == 5.0
        a.feed({"type": "response.create"})
        await until(lambda: sum(map(delta_ms, a.deltas())) >= 300, "300 ms of answer on link A")
        a.hang_up(lost=True)
        await until(lambda: a.closes, "link A closed")
        assert a.closes == [(1001, "connection lost")]
        assert runner.link is None and not rig.tasks[runner.id].done()
        assert rig.adm.find_resumable(runner.resume_token) is runner
        await asyncio.sleep(0.3)  # detached: nothing is paced out, nothing ends
        assert not rig.tasks[runner.id].done() and not a.of("response.done")
        sent_a = [m for _, m in a.sent]
        assert runner.messages_sent >= len(sent_a)
        # the client received all but the last two messages link A sent
        last_seq = len(sent_a) - 2
        b = MemoryLink()
        await runner.attach(b, last_seq)
        await until(lambda: b.of("response.done"), "response.done on link B")
        resumed = json.loads(b.sent[0][1])
        assert resumed["type"] == "session.resumed" and resumed["last_seq"] == last_seq and resumed["missed"] == 0
        n = resumed["replayed"]
        assert n >= 2
        replayed = [m for _, m in b.sent[1 : 1 + n]]
        assert replayed[:2] == sent_a[last_seq:]
        assert runner.resumes == 1 and runner.link is b
        # the answer: what the client got on A (up to last_seq), then the replay and the rest on B, is all of it
        got = [json.loads(m) for m in sent_a[:last_seq]] + [json.loads(m) for _, m in b.sent[1:]]
        done = [e for e in got if e["type"] == "response.done"]
        assert len(done) == 1 and done[0]["response"]["status"] == "completed"
        deltas = [e for e in got if e["type"] == "response.output_audio.delta"]
        assert_audio_equal(decode_deltas(deltas), wire_answer(rig.conv(runner).index, 0, 1200))
        assert runner.messages_sent == len(sent_a) + len(b.sent) - 1 - 2  # session.resumed is not numbered
        # a stale seq is refused; the session goes on
        with pytest.raises(ResumeRefused) as e:
            await runner.attach(MemoryLink(), runner.messages_sent + 5)
        assert e.value.code == "invalid_last_seq"
        b.hang_up()  # a goodbye: the session ends
        await rig.ended(runner)
        assert runner.end_reason() is CloseReason.CLIENT_CLOSED and b.closes == [(1000, "")]
        assert rig.adm.find_resumable(runner.resume_token) is None

    run_virtual(main)


def test_resume_past_the_replay_buffer_ends_the_answer_cleanly():
    async def main():
        rig = Rig(FakeEngine(answer_ms=3000, chunk_ms=80), {"limits": {"resume_grace_s": 5.0, "resume_buffer_bytes": 6000}})
        a = MemoryLink()
        runner = rig.open(a, resumable=True)
        a.feed({"type": "response.create"})
        await until(lambda: sum(map(delta_ms, a.deltas())) >= 400, "400 ms of answer on link A")
        a.hang_up(lost=True)
        await until(lambda: runner.link is None, "detached")
        b = MemoryLink()
        await runner.attach(b, 1)  # the client got only session.created
        await until(lambda: b.of("response.done"), "response.done on link B")
        resumed = json.loads(b.sent[0][1])
        assert resumed["type"] == "session.resumed" and resumed["last_seq"] == 1 and resumed["missed"] > 0
        rid = a.of("response.created")[0]["response"]["id"]
        done = b.of("response.done")[0]["response"]
        assert done["id"] == rid and done["status_details"] == {"type": "cancelled", "reason": "client_cancelled"}
        assert b.of("output_audio_buffer.cleared")[0]["response_id"] == rid
        h = rig.conv(runner).handles[0]
        assert h.cancels == [pytest.approx(done["duplex"]["played_ms"], abs=0.1)]
        assert h.cancels[0] <= done["duplex"]["audio_ms"]
        # the session goes on: a new answer on B
        rig.conv(runner).plan = dataclasses.replace(rig.conv(runner).plan, answer_ms=300)
        b.feed({"type": "response.create"})
        await until(lambda: len(b.of("response.done")) == 2, "the second response.done")
        assert b.of("response.done")[1]["response"]["status"] == "completed"
        b.hang_up()
        await rig.ended(runner)

    run_virtual(main)


def test_not_resumed_within_the_grace_ends_the_session():
    async def main():
        rig = Rig(config={"limits": {"resume_grace_s": 0.3}})
        a = MemoryLink()
        runner = rig.open(a, resumable=True)
        await until(lambda: a.sent, "session.created")
        t0 = asyncio.get_running_loop().time()
        a.hang_up(lost=True)
        await rig.ended(runner)
        assert asyncio.get_running_loop().time() - t0 == pytest.approx(0.3)  # the grace
        assert runner.end_reason() is CloseReason.CONNECTION_LOST
        assert a.closes == [(1001, "connection lost")]
        assert rig.conv(runner).closed and rig.adm.find_resumable(runner.resume_token) is None
        assert rig.metric("duplex_sessions_ended_total", transport="websocket", reason="connection_lost") == 1.0
        with pytest.raises(ResumeRefused):
            await runner.attach(MemoryLink(), 1)
        # a link that ends with a goodbye (not lost) ends its session at once, resumable or not
        c = MemoryLink()
        runner2 = rig.open(c, resumable=True)
        await until(lambda: c.sent, "session.created")
        c.hang_up(lost=False)
        await rig.ended(runner2, timeout=1)
        assert runner2.end_reason() is CloseReason.CLIENT_CLOSED

    run_virtual(main)


# ---- admission -------------------------------------------------------------------------------------------


def test_admission_refuses_beyond_the_engines_capacity_and_discard_frees_it():
    async def main():
        rig = Rig(FakeEngine(capacity=1, answer_ms=200))
        a = MemoryLink()
        runner = rig.open(a)
        assert rig.metric("duplex_sessions_active") == 1.0 and rig.metric("duplex_sessions_total") == 1.0
        with pytest.raises(AtCapacity):
            rig.admit(MemoryLink())
        assert rig.metric("duplex_sessions_refused_total", reason="capacity") == 1.0
        assert len(rig.engine.refused) == 1 and list(rig.adm.sessions) == [runner.id]
        conv = rig.conv(runner)
        a.hang_up()
        await rig.ended(runner)
        assert conv.closed and conv.close_calls == 1 and rig.engine.conversations == {}
        assert rig.adm.sessions == {} and rig.metric("duplex_sessions_active") == 0.0
        assert rig.metric("duplex_sessions_ended_total", transport="websocket", reason="client_closed") == 1.0
        await rig.adm.discard(runner)  # twice: nothing more
        assert conv.close_calls == 1
        assert rig.metric("duplex_sessions_ended_total", transport="websocket", reason="client_closed") == 1.0
        # the slot is free again
        b = MemoryLink()
        runner2 = rig.open(b)
        b.hang_up()
        await rig.ended(runner2)
        assert rig.metric("duplex_sessions_total") == 2.0

    run_virtual(main)


def test_admission_refuses_beyond_max_sessions_before_asking_the_engine():
    async def main():
        rig = Rig(FakeEngine(capacity=8), {"limits": {"max_sessions": 2}})
        links = [MemoryLink(), MemoryLink()]
        runners = [rig.open(l) for l in links]
        for _ in range(2):
            with pytest.raises(AtCapacity, match="limit 2"):
                rig.admit(MemoryLink())
        assert rig.metric("duplex_sessions_refused_total", reason="capacity") == 2.0
        assert rig.engine.refused == [] and len(rig.engine.opened) == 2
        for l, r in zip(links, runners):
            l.hang_up()
            await rig.ended(r)

    run_virtual(main)


def test_stop_tells_every_session_and_closes_them_1001():
    async def main():
        rig = Rig(FakeEngine(answer_ms=3000))
        links = [MemoryLink(), MemoryLink()]
        runners = [rig.open(l) for l in links]
        links[0].feed({"type": "response.create"})  # one of them mid-answer
        await until(lambda: links[0].deltas(), "audio on the first session")
        await rig.adm.stop()
        for link, runner in zip(links, runners):
            assert rig.tasks[runner.id].done()
            assert runner.end_reason() is CloseReason.SERVER_SHUTDOWN
            assert link.types()[-1] == "error"  # nothing follows the final error
            err = link.of("error")[-1]["error"]
            assert err["code"] == "server_shutting_down" and err["type"] == "server_error"
            assert link.closes == [(1001, "the server is shutting down")]
        assert rig.adm.sessions == {} and rig.engine.conversations == {}
        assert rig.metric("duplex_sessions_ended_total", transport="websocket", reason="server_shutdown") == 2.0
        with pytest.raises(AtCapacity):
            rig.admit(MemoryLink())

    run_virtual(main)


def test_nothing_follows_the_final_error_of_a_shutdown():
    async def main():
        rig = Rig(FakeEngine(answer_ms=3000))
        link = MemoryLink()
        runner = rig.open(link)
        link.feed({"type": "response.create"})
        await until(lambda: sum(map(delta_ms, link.deltas())) >= 300, "300 ms of answer sent")
        runner.shutdown(CloseReason.SERVER_SHUTDOWN, "server_shutting_down", "the server is shutting down")
        lag(0.12)  # the event loop is late (a GC pause, a busy neighbour): frames are due when the shutdown is handled
        await rig.ended(runner)
        assert runner.end_reason() is CloseReason.SERVER_SHUTDOWN
        assert link.of("error")[0]["error"]["code"] == "server_shutting_down"
        assert link.types()[-1] == "error", link.types()[-4:]

    run_virtual(main)


def test_stop_does_not_keep_a_lost_link_for_a_resume():
    async def main():
        rig = Rig(config={"limits": {"resume_grace_s": 30.0}})
        a = MemoryLink()
        runner = rig.open(a, resumable=True)
        await until(lambda: a.sent, "session.created")
        rig.adm.closing = True  # the server is stopping
        a.hang_up(lost=True)
        await rig.ended(runner, timeout=1)
        assert runner.end_reason() is CloseReason.CLIENT_CLOSED

    run_virtual(main)


def test_a_speculation_is_taken_back_before_a_detached_session_gives_its_slot_back():
    async def main():
        rig = Rig(FakeEngine(answer_ms=1200, chunk_ms=80), {"limits": {"resume_grace_s": 5.0}})
        a = MemoryLink()
        runner = rig.open(a, resumable=True)
        await until(lambda: a.sent, "session.created")
        msgs = appends(user_turn16())
        a.feed(*msgs[: 1600 // 20])  # the speech and its last pause (1520 ms), not the end of the turn (1680 ms)
        conv = rig.conv(runner)
        await until(lambda: runner.session.speculation is not None and runner.session.vad_pending is False
                    and conv.calls and conv.calls[-1][0] in ("speculate", "push"), "the speculation at the last pause")
        spec_id = runner.session.speculation.id
        a.hang_up(lost=True)
        await until(lambda: ("suspend",) in conv.calls, "the slot given back")
        k = conv.calls.index(("suspend",))
        assert conv.calls[k - 1] == ("discard", spec_id)  # taken back first: the user's turn stays open
        assert conv.history == [] and not a.of("response.created")
        assert rig.engine.suspended == {runner.id}

    run_virtual(main)
