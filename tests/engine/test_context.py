"""Context management on the real engine (tiny model, CPU, a 512-position context): a conversation
far longer than the model's context goes on answering, the oldest exchanges dropped whole; the model
then sees exactly the kept history (greedy answer equal to the reference on that prompt); truncation
disabled fails the answer with `conversation_too_long` and the conversation goes on; the client's own
edits (an older answer cut, audio turns deleted) are what the model reads next."""

from __future__ import annotations

import asyncio
import itertools

import numpy as np
import pytest

from engine import vocab
from engine.codec.synth import speech_like
from engine.dialogue import ANSWER_MARGIN_ROWS, DialogueTurn, response_prompt
from engine.reference import ReferenceOpusLM
from engine.request import AudioRequest
from engine.sampling import GREEDY
from engine.service import Engine, EngineServiceConfig
from engine.service_api import ConversationOptions, EngineError, ResponseInProgress, Role

pytestmark = pytest.mark.vllm

MAX_MODEL_LEN = 512
ANSWER_MS = 300.0  # 15 frames
GREEDY_SHORT = ConversationOptions(temperature=0.0, max_response_ms=ANSWER_MS)
_ids = itertools.count()


@pytest.fixture(scope="module")
def engine(loop_thread, tiny_model):
    eng = loop_thread.run(Engine.start(EngineServiceConfig(model=str(tiny_model), capacity_override=2,
                                                           max_model_len=MAX_MODEL_LEN, warmup=False)))
    yield eng
    loop_thread.run(eng.shutdown())


def speech(seconds: float, seed: int) -> np.ndarray:
    return (speech_like(seconds, seed=seed) * 20000).astype(np.int16)


async def turn(conv, seconds: float, seed: int):
    """One user turn (pushed in 100 ms pieces, no waiting) and its whole answer: (handle, chunks, error)."""
    pcm = speech(seconds, seed)
    for i in range(0, len(pcm), 1600):
        conv.push_user_audio(pcm[i : i + 1600])
        await asyncio.sleep(0)
    conv.end_user_turn()
    handle = conv.respond(f"resp_ctx_{next(_ids)}")
    chunks = []
    try:
        async for chunk in handle.chunks():
            chunks.append(chunk)
    except EngineError as e:
        return handle, chunks, e
    return handle, chunks, None


def test_a_conversation_far_past_the_context_keeps_answering_with_the_kept_history(engine, loop_thread, tiny_model):
    ref = ReferenceOpusLM.from_dir(tiny_model)

    async def main():
        conv = engine.open_conversation("ctx_long", GREEDY_SHORT)
        answered, dropped, checked = 0, [], 0
        for t in range(40):
            before = [h.audio_frames for h in conv.history]
            handle, chunks, err = await turn(conv, 0.6, seed=100 + t)
            assert err is None, f"turn {t}: {err}"
            assert chunks and chunks[-1].is_last
            answered += 1
            prompt = conv.last_prompt
            # the prompt and the longest answer fit the context (with the flush and a margin)
            assert len(prompt) + int(ANSWER_MS // 20) + vocab.NUM_STREAMS - 1 + ANSWER_MARGIN_ROWS <= MAX_MODEL_LEN
            if handle.dropped_exchanges:
                dropped.append((t, handle.dropped_exchanges))
                n = 2 * len(handle.dropped_exchanges)  # whole exchanges: a user turn and its answer each
                assert [h.audio_frames for h in conv.history][: len(before) - n] == before[n:]
                if checked < 2:  # the answer right after a drop is the model's answer to the kept history
                    frames = ref.generate(AudioRequest(prompt, int(ANSWER_MS // 20), 1, GREEDY)).frames
                    assert np.array_equal(conv._turns[-1].frames, frames)
                    checked += 1
            roles = [h.role for h in conv.history]
            assert roles == [Role.USER, Role.ASSISTANT] * (len(roles) // 2)  # the history starts at a user turn
        # drops came in batches (down to the retention ratio), not one exchange at every turn
        assert answered == 40 and len(dropped) >= 2 and checked == 2
        assert sum(len(d) for _, d in dropped) > len(dropped)
        assert len(response_prompt(conv._turns, None)) < MAX_MODEL_LEN
        await conv.close()

    loop_thread.run(main())


def test_truncation_disabled_fails_the_answer_that_does_not_fit_and_the_conversation_goes_on(engine, loop_thread):
    async def main():
        conv = engine.open_conversation("ctx_disabled", ConversationOptions(temperature=0.0, max_response_ms=ANSWER_MS,
                                                                            retention_ratio=None))
        errors = []
        for t in range(12):
            handle, chunks, err = await turn(conv, 0.6, seed=200 + t)
            assert handle.dropped_exchanges == ()
            if err is not None:
                errors.append((t, err))
        assert errors, "12 exchanges of ~65 positions must overflow 512"
        first = errors[0][0]
        assert all(getattr(e, "code", None) == "conversation_too_long" for _, e in errors)
        assert "truncation is disabled" in str(errors[0][1])
        assert [t for t, _ in errors] == list(range(first, 12))  # every later answer too: nothing was dropped
        # switching truncation on (session.update) lets the next answer through, dropping the oldest
        conv.update_options(ConversationOptions(temperature=0.0, max_response_ms=ANSWER_MS))
        handle, chunks, err = await turn(conv, 0.6, seed=300)
        assert err is None and chunks[-1].is_last and handle.dropped_exchanges
        await conv.close()

    loop_thread.run(main())


def test_one_user_turn_longer_than_the_room_gets_a_shorter_answer_or_a_clear_error(engine, loop_thread):
    async def main():
        conv = engine.open_conversation("ctx_long_turn", ConversationOptions(temperature=0.0, max_response_ms=5000.0))
        # 8 s of user speech = 400 frames: the 512-position context leaves room for far less than 5 s of answer
        handle, chunks, err = await turn(conv, 8.0, seed=400)
        assert err is None and chunks[-1].is_last
        assert 50 <= conv.history[-1].audio_frames < 250  # capped to what fits, at least a second
        assert len(conv.last_prompt) + conv.history[-1].audio_frames + vocab.NUM_STREAMS - 1 <= MAX_MODEL_LEN
        # 10 s leaves less than a second: refused with conversation_too_long, the conversation goes on
        handle, chunks, err = await turn(conv, 10.0, seed=401)
        assert err is not None and err.code == "conversation_too_long" and chunks == []
        handle, chunks, err = await turn(conv, 0.6, seed=402)
        assert err is None and chunks[-1].is_last
        await conv.close()

    loop_thread.run(main())


def test_the_client_cuts_and_deletes_turns_and_the_model_reads_exactly_what_is_left(engine, loop_thread, tiny_model):
    """conversation.item.truncate of an older answer and conversation.item.delete of audio turns: the
    next prompt is the edited history (built here from the turns' own frames), and the greedy answer
    is the reference model's on it (so nothing stale came from the prefix cache)."""
    ref = ReferenceOpusLM.from_dir(tiny_model)

    async def main():
        conv = engine.open_conversation("ctx_edit", GREEDY_SHORT)
        handles = []
        for t in range(3):
            handle, _, err = await turn(conv, 0.6, seed=500 + t)
            assert err is None
            handles.append(handle)
        u1, a1, u2, a2, u3, a3 = (t.frames.copy() for t in conv._turns)
        assert len(a1) > 5
        conv.truncate(handles[0].id, 100.0)  # an older answer: 5 frames kept
        conv.delete_turn(handles[1].id, Role.USER)
        conv.delete_turn(handles[2].id, Role.ASSISTANT)
        conv.delete_turn(handles[2].id, Role.ASSISTANT)  # again: nothing more
        assert [(h.role, h.audio_frames) for h in conv.history] == [
            (Role.USER, len(u1)), (Role.ASSISTANT, 5), (Role.ASSISTANT, len(a2)), (Role.USER, len(u3))]
        handle, chunks, err = await turn(conv, 0.6, seed=510)
        assert err is None and chunks[-1].is_last
        u4 = conv._turns[-2].frames
        kept = [DialogueTurn(vocab.USER, u1), DialogueTurn(vocab.ASSISTANT, a1[:5]), DialogueTurn(vocab.ASSISTANT, a2),
                DialogueTurn(vocab.USER, u3), DialogueTurn(vocab.USER, u4)]
        assert np.array_equal(conv.last_prompt, response_prompt(kept))
        frames = ref.generate(AudioRequest(conv.last_prompt, int(ANSWER_MS // 20), 1, GREEDY)).frames
        assert np.array_equal(conv._turns[-1].frames, frames)
        # an answer in progress cannot lose a turn
        conv.end_user_turn()
        running = conv.respond("resp_ctx_running")
        with pytest.raises(ResponseInProgress):
            conv.delete_turn(running.id, Role.USER)
        async for _ in running.chunks():
            pass
        await conv.close()

    loop_thread.run(main())
