"""Text in conversations (engine/service.py): answers that write their text before their audio, text-only
answers, the user's transcript written by the model, typed user turns; each equal to the reference's
greedy output for the prompt the history makes. Real vLLM, tokenizer and codec stage on CPU."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from engine import vocab
from engine.codec.synth import speech_like
from engine.dialogue import DialogueTurn, answer_audio_prompt, history_rows, response_prompt
from engine.prompt import special_rows
from engine.reference import ReferenceOpusLM
from engine.request import AudioRequest
from engine.sampling import GREEDY
from engine.service import Engine, EngineServiceConfig
from engine.service_api import ConversationOptions, NoTextModel
from engine.text import TextTokenizer

pytestmark = pytest.mark.vllm

TEXT = ConversationOptions(temperature=0.0, max_response_ms=400.0, assistant_text=True, max_text_tokens=10)


@pytest.fixture(scope="module")
def engine(loop_thread, tiny_model):
    eng = loop_thread.run(Engine.start(EngineServiceConfig(model=str(tiny_model), capacity_override=3)))
    yield eng
    loop_thread.run(eng.shutdown())


@pytest.fixture(scope="module")
def ref(tiny_model):
    return ReferenceOpusLM.from_dir(tiny_model)


@pytest.fixture(scope="module")
def tok(tiny_model):
    return TextTokenizer.from_dir(tiny_model)


def speech(seconds: float, seed: int) -> np.ndarray:
    return (speech_like(seconds, seed=seed) * 20000).astype(np.int16)


def text_request(prompt: np.ndarray, max_text: int) -> AudioRequest:
    return AudioRequest(prompt, max_frames=0, start_modality=vocab.TEXT_BPE, max_text_tokens=max_text,
                        min_text_tokens=1, sampling=GREEDY)


async def answer(conv, rid: str, instructions: str | None = None):
    handle = conv.respond(rid, instructions=instructions)
    chunks, transcript = await asyncio.gather(
        _collect(handle.chunks()), _collect(handle.user_transcript()))
    return chunks, transcript


async def _collect(it):
    return [x async for x in it]


def test_answer_writes_its_text_then_speaks_it_and_the_history_keeps_both(engine, loop_thread, ref, tok) -> None:
    async def run():
        conv = engine.open_conversation("text1", TEXT)
        conv.push_user_audio(speech(0.8, seed=1))
        first = await answer(conv, "r1")
        turns_after_first = list(conv._turns)
        conv.push_user_audio(speech(0.5, seed=2))
        second = await answer(conv, "r2")
        prompt2 = conv.last_prompt
        await conv.close()
        return first, second, turns_after_first, prompt2

    (chunks, transcript), (chunks2, _), turns, prompt2 = loop_thread.run(run())
    assert transcript == []  # not asked for
    text_chunks = [c for c in chunks if c.text_delta]
    kinds = ["text" if c.text_delta else "audio" for c in chunks if c.text_delta or len(c.pcm)]
    assert kinds.count("text") >= 2 and kinds == sorted(kinds, key=lambda k: k == "audio")  # all text, then audio
    assert all(len(c.pcm) == 0 and c.duration_ms == 0 for c in text_chunks) and chunks[-1].is_last
    user, said = turns
    want_text = ref.generate(text_request(response_prompt([user], text_first=True), 10)).text_ids
    assert "".join(c.text_delta for c in text_chunks) == tok.decode(want_text)
    assert said.text_ids == list(want_text)
    want_audio = ref.generate(AudioRequest(answer_audio_prompt([user], want_text), 20, 1, GREEDY)).frames
    np.testing.assert_array_equal(said.frames, want_audio)
    # the next answer reads the first one's text and audio, as history_rows lays them out
    np.testing.assert_array_equal(prompt2[: len(history_rows([user, said]))], history_rows([user, said]))
    assert any(c.text_delta for c in chunks2)


def test_text_only_answers_transcripts_and_typed_turns(engine, loop_thread, ref, tok) -> None:
    opts = ConversationOptions(temperature=0.0, assistant_text=True, output_audio=False, transcribe_user=True,
                               max_text_tokens=8)

    async def run():
        conv = engine.open_conversation("text2", opts)
        conv.push_user_audio(speech(0.7, seed=3))
        spoken = await answer(conv, "t1")
        turns = list(conv._turns)
        conv.add_user_text("What time is it?")
        typed = await answer(conv, "t2")
        typed_prompt = conv.last_prompt
        await conv.close()
        return spoken, typed, turns, typed_prompt

    (chunks, transcript), (typed_chunks, typed_transcript), (user, said), typed_prompt = loop_thread.run(run())
    assert all(len(c.pcm) == 0 for c in chunks) and chunks[-1].is_last and said.frames.shape[0] == 0
    # the user's transcript: the model writing `9 35` after the user's audio, greedy
    want = ref.generate(text_request(np.concatenate([history_rows([user]), special_rows(vocab.USER, vocab.TEXT_BPE)]), 8))
    assert "".join(transcript) == tok.decode(want.text_ids) and len(transcript) > 1
    assert user.text_ids == []  # the history keeps the audio only
    # a typed turn: a text segment, no audio segment, and no transcript to write
    ids = [int(i) for i in tok.encode("What time is it?")]
    typed_turn = DialogueTurn(vocab.USER, np.zeros((0, vocab.NUM_STREAMS), np.int64), ids)
    np.testing.assert_array_equal(typed_prompt, response_prompt([user, said, typed_turn], text_first=True))
    assert bytes(special_rows(vocab.USER, vocab.TEXT_BPE, *ids)) in bytes(typed_prompt)
    assert typed_transcript == [] and "".join(c.text_delta for c in typed_chunks)


def test_instructions_are_the_system_text_after_the_task_marker(engine, loop_thread, ref, tok) -> None:
    opts = ConversationOptions(temperature=0.0, max_response_ms=300.0, system_prompt="Be brief and kind.")

    async def run():
        conv = engine.open_conversation("system", opts)
        conv.push_user_audio(speech(0.5, seed=4))
        chunks, _ = await answer(conv, "s1")
        prompt, turns = conv.last_prompt, list(conv._turns)
        conv.update_options(ConversationOptions(temperature=0.0, max_response_ms=300.0))  # instructions gone
        conv.push_user_audio(speech(0.4, seed=5))
        await answer(conv, "s2")
        second = conv.last_prompt
        await conv.close()
        return prompt, turns, second

    prompt, (user, said), second = loop_thread.run(run())
    ids = [int(i) for i in tok.encode("Be brief and kind.")]
    head = np.concatenate([special_rows(vocab.SOS_EOS, vocab.TASK_AUDIO_DIALOGUE, vocab.SYSTEM, vocab.TEXT_BPE, *ids),
                           special_rows(*[vocab.PAD] * 8)])
    np.testing.assert_array_equal(prompt[: len(head)], head)
    np.testing.assert_array_equal(said.frames, ref.generate(AudioRequest(prompt, 15, 1, GREEDY)).frames)
    assert second[2, 0] == vocab.USER  # the next prompt has no system segment


def test_text_options_need_a_text_model_and_make_sense(engine, loop_thread) -> None:
    with pytest.raises(ValueError, match="assistant_text"):
        engine.open_conversation("bad1", ConversationOptions(output_audio=False))
    tokenizer, engine.pipeline.text_tokenizer = engine.pipeline.text_tokenizer, None
    try:
        with pytest.raises(NoTextModel):
            engine.open_conversation("bad2", ConversationOptions(transcribe_user=True))
        conv = engine.open_conversation("audio_only")
        with pytest.raises(NoTextModel):
            conv.add_user_text("hello")
        with pytest.raises(NoTextModel):
            conv.update_options(ConversationOptions(assistant_text=True))
        loop_thread.run(conv.close())
    finally:
        engine.pipeline.text_tokenizer = tokenizer


def _system_head(ids: list[int]) -> np.ndarray:
    return np.concatenate([special_rows(vocab.SOS_EOS, vocab.TASK_AUDIO_DIALOGUE, vocab.SYSTEM, vocab.TEXT_BPE, *ids),
                           special_rows(*[vocab.PAD] * 8)])


def test_an_answer_with_its_own_instructions_reads_them_alone_and_the_next_is_back_on_the_sessions(engine, loop_thread, tok) -> None:
    session, greeting = "Be brief and kind.", "Greet the user warmly and offer your help."
    opts = ConversationOptions(temperature=0.0, max_response_ms=300.0, system_prompt=session)

    async def run():
        # LiveKit's quickstart: generate_reply(instructions=...) on an empty conversation (no user turn)
        conv = engine.open_conversation("own_instructions", opts)
        greeted, _ = await answer(conv, "g1", instructions=greeting)
        greet_prompt, turns, history_next = conv.last_prompt, list(conv._turns), conv.next_prompt()
        await conv._prefill_task  # the history, in the session's layout, into the prefix cache
        conv.add_user_text("Hello there.")  # a typed turn: no incremental prefill, so a cache hit is the history's
        await answer(conv, "r2")
        second, cached = conv.last_prompt, conv.cached_tokens_last_response
        await conv.close()
        # the same answer from a conversation whose session instructions are the greeting's
        same = engine.open_conversation("session_greeting", ConversationOptions(temperature=0.0, max_response_ms=300.0,
                                                                                system_prompt=greeting))
        greeted_too, _ = await answer(same, "g2")
        turns_too = list(same._turns)
        await same.close()
        return greeted, greet_prompt, turns, history_next, second, cached, greeted_too, turns_too

    greeted, greet_prompt, (user, said), history_next, second, cached, greeted_too, (_, said_too) = loop_thread.run(run())
    session_ids, greeting_ids = [int(i) for i in tok.encode(session)], [int(i) for i in tok.encode(greeting)]
    assert len(user.frames) == 0 and not user.text_ids  # a greeting answers an empty user turn
    assert greeted[-1].is_last and sum(len(c.pcm) for c in greeted) == len(said.frames) * vocab.HOP_SAMPLES > 0
    # the greeting read its own system text, in the session's place, and answered as a session with it would
    np.testing.assert_array_equal(greet_prompt, response_prompt([user], system_ids=greeting_ids))
    np.testing.assert_array_equal(said.frames, said_too.frames)
    assert sum(len(c.pcm) for c in greeted_too) == sum(len(c.pcm) for c in greeted)
    # the history keeps the session's: the next prompt, and the next answer's, have it and not the greeting's
    np.testing.assert_array_equal(history_next[: len(_system_head(session_ids))], _system_head(session_ids))
    kept = history_rows([user, said], system_ids=session_ids)
    np.testing.assert_array_equal(second[: len(kept)], kept)
    assert bytes(special_rows(*greeting_ids)) not in bytes(second)
    # ... whose KV the prefill after the greeting left in the cache (a typed turn prefills nothing while it is typed)
    assert cached >= (len(kept) // 32) * 32 > 0


def test_a_model_without_text_ignores_an_answers_instructions_as_the_sessions(engine, loop_thread) -> None:
    tokenizer, engine.pipeline.text_tokenizer = engine.pipeline.text_tokenizer, None
    try:
        async def run():
            conv = engine.open_conversation("own_instructions_no_text", ConversationOptions(temperature=0.0, max_response_ms=200.0))
            chunks, _ = await answer(conv, "n1", instructions="Greet the user.")
            prompt, turns = conv.last_prompt, list(conv._turns)
            await conv.close()
            return chunks, prompt, turns

        chunks, prompt, (user, _) = loop_thread.run(run())
    finally:
        engine.pipeline.text_tokenizer = tokenizer
    assert chunks[-1].is_last
    np.testing.assert_array_equal(prompt, response_prompt([user]))  # no system segment: read nothing, refused nothing
