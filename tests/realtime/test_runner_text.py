"""Text through the session runner, end to end without sockets or a model: the user's transcript
(session.update's input transcription), text-only answers (a session's or one response's
output_modalities), the answer's text on its audio transcript (config session.assistant_text), typed
user turns, and the refusals of a model without text. A real RealtimeProtocol, Session and
SessionRunner over the fake engine (tests/realtime/fake_engine.py) and an in-memory link, on virtual time
(tests/realtime/virtual_time.py)."""

from __future__ import annotations

import numpy as np
from fake_engine import AnswerPlan, FakeEngine, answer_text, user_transcript_text

from runner_rig import MemoryLink, Rig, appends, decode_deltas, run_virtual, until, user_turn16, wire_answer, assert_audio_equal

TRANSCRIBE = {"type": "session.update", "session": {"type": "realtime", "audio": {"input": {"transcription": {"model": "whisper-1"}}}}}


def test_a_spoken_turns_transcript_comes_for_its_item_and_stays_on_it():
    async def main():
        rig = Rig(FakeEngine(answer_ms=300, step_s=0.002))
        link = MemoryLink()
        runner = rig.open(link)
        link.feed(TRANSCRIBE)
        await until(lambda: link.of("session.updated"), "session.updated")
        assert link.of("session.updated")[0]["session"]["audio"]["input"]["transcription"] == {"model": "whisper-1"}
        link.feed(*appends(user_turn16()))
        await until(lambda: link.of("conversation.item.input_audio_transcription.completed") and link.of("response.done"),
                    "the transcript and the answer")
        item = link.of("input_audio_buffer.committed")[0]["item_id"]
        handle = rig.conv(runner).handles[-1]
        assert handle.options.transcribe_user and not handle.options.assistant_text and handle.options.output_audio
        want = user_transcript_text(handle.user_frames)  # the frames the engine got for the turn
        deltas = link.of("conversation.item.input_audio_transcription.delta")
        assert {(d["item_id"], d["content_index"]) for d in deltas} == {(item, 0)} and len(deltas) == len(want.split())
        assert "".join(d["delta"] for d in deltas) == want
        done = link.of("conversation.item.input_audio_transcription.completed")
        assert len(done) == 1  # (speculative answers discarded on the way told nothing)
        assert done[0]["item_id"] == item and done[0]["transcript"] == want and done[0]["content_index"] == 0
        heard_s = rig.conv(runner).user_audio(-1).size / 16_000  # the turn's audio the engine got
        assert done[0]["usage"] == {"type": "duration", "seconds": round(heard_s, 3)} and handle.user_frames == int(heard_s * 50)
        link.feed({"type": "conversation.item.retrieve", "item_id": item})
        await until(lambda: link.of("conversation.item.retrieved"), "retrieved")
        assert link.of("conversation.item.retrieved")[0]["item"]["content"] == [{"type": "input_audio", "transcript": want}]
        assert link.of("response.done")[0]["response"]["status"] == "completed" and link.of("error") == []
        link.hang_up()
        await rig.ended(runner)

    run_virtual(main)


def test_a_failed_transcript_is_told_for_its_item_and_the_answer_goes_on():
    async def main():
        engine = FakeEngine(answer_ms=300, step_s=0.002)
        engine.plan = AnswerPlan(answer_ms=300, step_s=0.002, transcript_fail_after=1)
        rig = Rig(engine, {"vad": {"enabled": False}})
        link = MemoryLink()
        runner = rig.open(link)
        link.feed(TRANSCRIBE, *appends(user_turn16()), {"type": "input_audio_buffer.commit"}, {"type": "response.create"})
        await until(lambda: link.of("conversation.item.input_audio_transcription.failed") and link.of("response.done"), "failed")
        item = link.of("input_audio_buffer.committed")[0]["item_id"]
        failed = link.of("conversation.item.input_audio_transcription.failed")[0]
        assert failed["item_id"] == item and failed["content_index"] == 0 and failed["error"]["code"] == "engine_error"
        assert "injected transcript failure" in failed["error"]["message"]
        assert len(link.of("conversation.item.input_audio_transcription.delta")) == 1
        assert link.of("response.done")[0]["response"]["status"] == "completed"
        link.hang_up()
        await rig.ended(runner)

    run_virtual(main)


def test_a_text_only_session_answers_in_output_text():
    async def main():
        rig = Rig(FakeEngine(answer_ms=300, step_s=0.002))
        link = MemoryLink()
        runner = rig.open(link)
        link.feed({"type": "session.update", "session": {"type": "realtime", "output_modalities": ["text"]}}, *appends(user_turn16()))
        await until(lambda: link.of("response.done"), "response.done")
        conv = rig.conv(runner)
        h = conv.handles[-1]
        assert h.options.assistant_text and not h.options.output_audio
        assert link.of("session.updated")[0]["session"]["output_modalities"] == ["text"]
        want = answer_text(conv.index, h.index)
        rid = link.of("response.created")[0]["response"]["id"]
        deltas = link.of("response.output_text.delta")
        assert "".join(d["delta"] for d in deltas) == want and {d["response_id"] for d in deltas} == {rid}
        assert link.of("response.output_text.done")[0]["text"] == want
        assert link.of("response.content_part.added")[-1]["part"] == {"type": "text", "text": ""}
        assert link.of("response.content_part.done")[-1]["part"] == {"type": "text", "text": want}
        done = link.of("response.done")[0]["response"]
        assert done["status"] == "completed" and done["output_modalities"] == ["text"]
        assert done["output"][0]["content"] == [{"type": "output_text", "text": want}]
        assert done["duplex"]["audio_ms"] == 0
        types = link.types()
        assert not any(t.startswith("response.output_audio") or t.startswith("output_audio_buffer") for t in types)
        link.hang_up()
        await rig.ended(runner)

    run_virtual(main)


def test_a_typed_turn_answered_in_text_then_in_audio_one_response_at_a_time():
    async def main():
        rig = Rig(FakeEngine(answer_ms=200, step_s=0.002), {"vad": {"enabled": False}})
        link = MemoryLink()
        runner = rig.open(link)
        conv = rig.conv(runner)
        link.feed({"type": "conversation.item.create", "item": {"id": "typed1", "type": "message", "role": "user",
                                                                "content": [{"type": "input_text", "text": "What time is it?"}]}},
                  {"type": "response.create", "response": {"output_modalities": ["text"]}})
        await until(lambda: link.of("response.done"), "the text answer")
        assert conv.user_texts == ["What time is it?"] and conv.history[0].text == "What time is it?"
        assert [e["item"]["id"] for e in link.of("conversation.item.done")][0] == "typed1"
        first = conv.handles[0]
        assert not first.options.output_audio and first.options.assistant_text  # this response's own modalities
        assert link.of("response.done")[0]["response"]["output_modalities"] == ["text"]
        assert "".join(d["delta"] for d in link.of("response.output_text.delta")) == answer_text(conv.index, 0)
        link.feed({"type": "response.create"})  # the session's own: audio again
        await until(lambda: len(link.of("response.done")) == 2, "the audio answer")
        second = conv.handles[1]
        assert second.options.output_audio and not second.options.assistant_text
        rid = link.of("response.created")[1]["response"]["id"]
        assert_audio_equal(decode_deltas(link.deltas(rid)), wire_answer(conv.index, 1, 200))
        assert link.of("response.done")[1]["response"]["output"][0]["content"] == [{"type": "output_audio", "transcript": ""}]
        link.feed({"type": "conversation.item.delete", "item_id": "typed1"})  # a typed turn is in the model's history
        await until(lambda: link.of("conversation.item.deleted"), "deleted")
        assert conv.calls[-1][0] == "delete_turn" and link.of("error") == []
        link.hang_up()
        await rig.ended(runner)

    run_virtual(main)


def test_assistant_text_in_the_config_puts_the_models_text_on_the_audio_transcript():
    async def main():
        rig = Rig(FakeEngine(answer_ms=400, chunk_ms=80, step_s=0.002), {"session": {"assistant_text": True}})
        link = MemoryLink()
        runner = rig.open(link)
        link.feed({"type": "response.create"})
        await until(lambda: link.of("response.done"), "response.done")
        conv = rig.conv(runner)
        assert conv.handles[0].options.assistant_text and conv.handles[0].options.output_audio
        want = answer_text(conv.index, 0)
        types = link.types()
        first_text = types.index("response.output_audio_transcript.delta")
        assert first_text < types.index("response.output_audio.delta")  # written first, as the model was trained
        assert "".join(d["delta"] for d in link.of("response.output_audio_transcript.delta")) == want
        assert link.of("response.output_audio_transcript.done")[0]["transcript"] == want
        rid = link.of("response.created")[0]["response"]["id"]
        assert_audio_equal(decode_deltas(link.deltas(rid)), wire_answer(conv.index, 0, 400))
        st = runner.session.stats
        assert st.chunks == 5 and st.chunks_late == 0  # the audio chunks only: text has no playback deadline
        assert link.of("duplex.latency")[0]["ttfa_ms"] is None  # (no user speech: no time to first audio)
        link.hang_up()
        await rig.ended(runner)

    run_virtual(main)


def test_a_model_without_text_refuses_each_text_field_by_name():
    async def main():
        rig = Rig(FakeEngine(text_model=False, answer_ms=200), {"vad": {"enabled": False}})
        link = MemoryLink()
        runner = rig.open(link)
        created = link
        await until(lambda: created.of("session.created"), "session.created")
        assert created.of("session.created")[0]["session"]["duplex"]["text"] is False
        asks = [
            ({"type": "session.update", "session": {"audio": {"input": {"transcription": {"model": "whisper-1"}}}}},
             "session.audio.input.transcription"),
            ({"type": "session.update", "session": {"input_audio_transcription": {"model": "whisper-1"}}}, "session.input_audio_transcription"),
            ({"type": "session.update", "session": {"output_modalities": ["text"]}}, "session.output_modalities"),
            ({"type": "session.update", "session": {"modalities": ["text"]}}, "session.modalities"),
            ({"type": "response.create", "response": {"output_modalities": ["text"]}}, "response.output_modalities"),
            ({"type": "conversation.item.create", "item": {"type": "message", "role": "user",
                                                           "content": [{"type": "input_text", "text": "hi"}]}}, "item.content[0].type"),
        ]
        for k, (ev, param) in enumerate(asks):
            link.feed({**ev, "event_id": f"ask{k}"})
        await until(lambda: len(link.of("error")) == len(asks), "the refusals")
        errors = link.of("error")
        assert [e["error"]["param"] for e in errors] == [p for _, p in asks]
        assert all("text tokenizer" in e["error"]["message"] for e in errors)
        assert [e["error"]["event_id"] for e in errors] == [f"ask{k}" for k in range(len(asks))]
        assert all(u["session"]["audio"]["input"]["transcription"] is None and u["session"]["output_modalities"] == ["audio"]
                   for u in link.of("session.updated"))
        assert link.of("response.created") == [] and rig.conv(runner).options_updates == []
        link.hang_up()
        await rig.ended(runner)

    run_virtual(main)


def test_transcription_hints_are_accepted_and_echoed_and_unknown_fields_refused_by_name():
    async def main():
        rig = Rig(FakeEngine(answer_ms=200), {"vad": {"enabled": False}})
        link = MemoryLink()
        runner = rig.open(link)
        asks = [
            ({"audio": {"input": {"transcription": {"model": "x", "colour": "red"}}}}, "session.audio.input.transcription.colour"),
            ({"audio": {"input": {"transcription": {"model": "x", "language": ["fr"]}}}}, "session.audio.input.transcription.language"),
            ({"output_modalities": ["audio", "text"]}, "session.output_modalities"),
        ]
        for ev, _ in asks:
            link.feed({"type": "session.update", "session": ev})
        # beta's ["text", "audio"] meant audio with its transcript: honoured as audio
        link.feed({"type": "session.update", "session": {"modalities": ["text", "audio"],
                                                         "input_audio_transcription": {"model": "whisper-1", "language": ""}}})
        # language and prompt are hints (OpenAI's too): accepted and echoed; the model writes what it heard
        link.feed({"type": "session.update", "session": {"input_audio_transcription": {"model": "gpt-4o-transcribe", "language": "fr",
                                                                                      "prompt": "names"}}})
        await until(lambda: len(link.of("session.updated")) == len(asks) + 2, "the updates")
        assert [e["error"]["param"] for e in link.of("error")] == [p for _, p in asks]
        updates = link.of("session.updated")
        assert updates[-2]["session"]["output_modalities"] == ["audio"]
        assert updates[-2]["session"]["audio"]["input"]["transcription"] == {"model": "whisper-1"}
        assert updates[-1]["session"]["audio"]["input"]["transcription"] == {"model": "gpt-4o-transcribe", "language": "fr",
                                                                             "prompt": "names"}
        assert rig.conv(runner).options_updates[-1].transcribe_user
        link.hang_up()
        await rig.ended(runner)

    run_virtual(main)


def test_settings_changed_while_a_text_answer_runs_keep_it_text():
    """The engine reads the options when an answer starts: a session.update right after a text-only
    response.create must not turn that answer back into audio (the runner keeps the answer's own)."""

    async def main():
        rig = Rig(FakeEngine(answer_ms=200, step_s=0.01), {"vad": {"enabled": False}})
        link = MemoryLink()
        runner = rig.open(link)
        conv = rig.conv(runner)
        link.feed({"type": "response.create", "response": {"output_modalities": ["text"]}})
        await until(lambda: link.of("response.created"), "response.created")  # respond() has run
        link.feed({"type": "session.update", "session": {"instructions": "Be brief."}})
        await until(lambda: link.of("response.done"), "response.done")
        last = conv.options_updates[-1]
        assert last.system_prompt == "Be brief." and not last.output_audio  # the running answer's modality kept
        link.feed({"type": "response.create"})
        await until(lambda: len(link.of("response.done")) == 2, "the second answer")
        assert conv.handles[1].options.output_audio and conv.handles[1].options.system_prompt == "Be brief."
        assert np.all([e["response"]["status"] == "completed" for e in link.of("response.done")])
        link.hang_up()
        await rig.ended(runner)

    run_virtual(main)


def test_a_config_given_with_the_connection_reaches_the_engine_before_the_first_answer():
    """WebRTC's calls.create(session=...): the session config is applied when the session opens, after the
    engine conversation was opened; the microphone's first turn (no client event before it) must be
    answered and transcribed with it."""

    async def main():
        import asyncio

        rig = Rig(FakeEngine(answer_ms=300, step_s=0.002))
        link = MemoryLink()
        runner = rig.admit(link)
        runner.proto.preconfigure({"type": "realtime", "instructions": "Be brief.",
                                   "audio": {"input": {"transcription": {"model": "gpt-4o-transcribe"}}}})
        rig.tasks[runner.id] = asyncio.create_task(rig.adm.run(runner))
        await until(lambda: link.of("session.created"), "session.created")
        assert link.of("session.created")[0]["session"]["audio"]["input"]["transcription"] == {"model": "gpt-4o-transcribe"}
        turn = user_turn16()
        for i in range(0, turn.size, 320):
            assert runner.push_audio(turn[i : i + 320])  # the microphone track's audio, as WebRTC's transport pushes it
        await until(lambda: link.of("conversation.item.input_audio_transcription.completed"), "the transcript")
        h = rig.conv(runner).handles[-1]
        assert h.options.transcribe_user and h.options.system_prompt == "Be brief."
        link.hang_up()
        await rig.ended(runner)

    run_virtual(main)
