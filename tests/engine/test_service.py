"""engine.service on the real engine (tiny model, CPU): conversations over several turns equal
the reference pipeline, barge-in truncation, KV reuse across turns, admission control."""

from __future__ import annotations

import asyncio
import itertools

import numpy as np
import pytest
import torch

from engine import vocab
from engine.codec.dac import DAC
from engine.codec.streaming import snr_db
from engine.codec.synth import speech_like
from engine.dialogue import DialogueTurn, response_prompt
from engine.reference import ReferenceOpusLM
from engine.request import AudioRequest
from engine.sampling import GREEDY
from engine.service import Engine, EngineServiceConfig, engine_cpu_threads
from engine.service_api import AtCapacity, ConversationClosed, ConversationOptions, Role

pytestmark = pytest.mark.vllm

MAX_RESPONSE_MS = 900.0  # 45 frames
GREEDY_OPTIONS = ConversationOptions(temperature=0.0, max_response_ms=MAX_RESPONSE_MS)


@pytest.fixture(scope="module")
def engine(loop_thread, tiny_model):
    eng = loop_thread.run(Engine.start(EngineServiceConfig(model=str(tiny_model), capacity_override=2)))
    yield eng
    loop_thread.run(eng.shutdown())


@pytest.fixture(scope="module")
def reference(tiny_model):
    return ReferenceOpusLM.from_dir(tiny_model), DAC.from_dir(tiny_model, device="cpu")


def speech(seconds: float, seed: int) -> np.ndarray:
    return (speech_like(seconds, seed=seed) * 20000).astype(np.int16)


async def talk(conv, pcm: np.ndarray, piece_ms: float = 100.0, realtime: bool = True) -> None:
    step = int(16 * piece_ms)
    for i in range(0, len(pcm), step):
        conv.push_user_audio(pcm[i : i + step])
        await asyncio.sleep(piece_ms / 1000.0 if realtime else 0)
    conv.end_user_turn()


_response_ids = itertools.count()


async def answer(conv, cancel_after_ms: float | None = None, played_ms: float = 0.0):
    chunks = []
    handle = conv.respond(f"resp_{next(_response_ids)}")
    async for chunk in handle.chunks():
        chunks.append(chunk)
        if cancel_after_ms is not None and chunk.start_ms + chunk.duration_ms >= cancel_after_ms:
            handle.cancel(played_ms)
    return chunks


def reference_audio(reference, prompt: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    ref, dac = reference
    frames = ref.generate(AudioRequest(prompt, int(MAX_RESPONSE_MS // 20), 1, GREEDY)).frames
    codes = torch.from_numpy(vocab.global_to_dac(frames[:, 1:]).T[None].copy())
    return frames, dac.decode(codes)[0, 0].numpy()


def test_two_conversations_several_turns_equal_the_reference(engine, loop_thread, reference) -> None:
    async def dialogue(session: str, seed: int):
        conv = engine.open_conversation(session, GREEDY_OPTIONS)
        turns = []
        for t in range(2):
            await talk(conv, speech(1.2 + 0.3 * t, seed + t))
            chunks = await answer(conv)
            turns.append((conv.last_prompt.copy(), chunks, conv.cached_tokens_last_response))
        history = conv.history
        await conv.close()
        return turns, history

    async def both():
        return await asyncio.gather(dialogue("alice", 1), dialogue("bob", 7))

    results = loop_thread.run(both())
    for turns, history in results:
        assert [h.role for h in history] == [Role.USER, Role.ASSISTANT] * 2
        for prompt, chunks, _ in turns:
            assert chunks[-1].is_last and not any(c.is_last for c in chunks[:-1])
            starts = [c.start_ms for c in chunks]
            assert starts == sorted(starts) and starts[0] == 0.0
            got = np.concatenate([c.pcm for c in chunks]).astype(np.float32) / 32767.0
            frames, want = reference_audio(reference, prompt)
            assert len(got) == len(frames) * vocab.HOP_SAMPLES == len(want)
            # streamed codec vs offline decode of the same codes, plus int16 rounding
            assert snr_db(want, got) > 30.0
        # turn 2's prompt extends turn 1's history, whose KV came from the prefix cache
        first_prompt = turns[0][0]
        history_len = len(first_prompt) - 2 + history[1].audio_frames + 8 + 2
        assert turns[1][2] >= (history_len // 32) * 32 > 0
    # different users, different answers
    assert not np.array_equal(results[0][0][0][0], results[1][0][0][0])


def test_barge_in_truncates_history_to_the_played_frames(engine, loop_thread) -> None:
    async def run():
        conv = engine.open_conversation("carol", GREEDY_OPTIONS)
        await talk(conv, speech(1.0, 3), realtime=False)
        full = await answer(conv)
        await talk(conv, speech(0.8, 4), realtime=False)
        cut = await answer(conv, cancel_after_ms=200, played_ms=170)
        after = conv.history
        prompt = conv.next_prompt()
        turns = list(conv._turns)
        await conv.close()
        return full, cut, after, prompt, turns

    full, cut, history, prompt, turns = loop_thread.run(run())
    assert sum(c.duration_ms for c in full) == pytest.approx(MAX_RESPONSE_MS, abs=20)
    assert sum(c.duration_ms for c in cut) < MAX_RESPONSE_MS
    assert history[-1].role == Role.ASSISTANT and history[-1].audio_frames == 170 // 20
    # the next prompt holds exactly those 8 frames of the interrupted answer, after the rest
    want = response_prompt(turns[:-1] + [DialogueTurn(vocab.ASSISTANT, turns[-1].frames[:8])])
    np.testing.assert_array_equal(prompt, want)
    assert history[1].audio_frames == round(MAX_RESPONSE_MS / 20)


def test_close_during_an_answer_and_options_for_the_next(engine, loop_thread) -> None:
    async def run():
        conv = engine.open_conversation("dave", GREEDY_OPTIONS)
        await talk(conv, speech(0.6, 5), realtime=False)
        got = []
        async for chunk in conv.respond("resp_dave").chunks():
            got.append(chunk)
            if len(got) == 2:
                await conv.close()  # the client went away mid-answer
        with pytest.raises(ConversationClosed):
            conv.end_user_turn()
        other = engine.open_conversation("erin", GREEDY_OPTIONS)
        other.update_options(ConversationOptions(temperature=0.0, max_response_ms=200.0))
        await talk(other, speech(0.6, 6), realtime=False)
        short = await answer(other)
        await other.close()
        return got, conv.history, short

    got, history, short = loop_thread.run(run())
    assert len(got) == 2 and [h.role for h in history] == [Role.USER, Role.ASSISTANT]
    assert sum(c.duration_ms for c in short) == pytest.approx(200.0, abs=20)


def test_admission_control_and_closed_conversations(engine, loop_thread) -> None:
    async def run():
        a = engine.open_conversation("x1")
        b = engine.open_conversation("x2")
        with pytest.raises(AtCapacity):
            engine.open_conversation("x3")
        load = engine.load()
        await a.close()
        c = engine.open_conversation("x3")  # a slot came free
        with pytest.raises(ConversationClosed):
            a.push_user_audio(np.zeros(160, np.int16))
        await b.close()
        await c.close()
        return load

    load = loop_thread.run(run())
    assert load.conversations == 2 and load.capacity == 2 and load.step_ms > 0


def test_the_largest_sampling_values_the_gateway_accepts_run(engine, loop_thread) -> None:
    """realtime.config.SessionSection.problems() accepts these; a response with them must not fail
    (vLLM takes temperature <= 2, and seed/top_k travel to the engine core as 64-bit integers)."""
    from realtime.config import MAX_SEED, MAX_TOP_K, SessionSection

    edge = SessionSection(temperature=2.0, top_k=MAX_TOP_K, top_p=1.0, seed=MAX_SEED, max_response_ms=200.0)
    assert edge.problems() == []

    async def run():
        conv = engine.open_conversation("edge", edge.engine_options({}))
        await talk(conv, speech(0.4, 8), realtime=False)
        chunks = await answer(conv)
        await conv.close()
        return chunks

    chunks = loop_thread.run(run())
    assert chunks[-1].is_last and sum(c.duration_ms for c in chunks) == pytest.approx(200.0, abs=20)


def test_a_suspended_conversation_holds_no_slot_and_keeps_its_history(engine, loop_thread) -> None:
    async def run():
        away = engine.open_conversation("away", ConversationOptions(temperature=0.0, max_response_ms=200.0))
        await talk(away, speech(0.4, 9), realtime=False)
        await answer(away)
        before = away.history
        away.suspend()
        b = engine.open_conversation("b")  # capacity 2: "away" no longer counts
        c = engine.open_conversation("c")
        with pytest.raises(AtCapacity):
            away.resume()
        await c.close()
        away.resume()
        with pytest.raises(AtCapacity):
            engine.open_conversation("d")
        await talk(away, speech(0.4, 10), realtime=False)
        second = await answer(away)
        history = away.history
        await away.close()
        await b.close()
        return before, second, history

    before, second, history = loop_thread.run(run())
    assert second[-1].is_last
    assert [h.role for h in history] == [Role.USER, Role.ASSISTANT] * 2 and history[:2] == before


def test_a_speaker_prompt_leads_the_prompt_conditions_the_answer_and_can_be_dropped(engine, loop_thread, reference, tiny_model) -> None:
    from engine.dialogue import speaker_segment
    from engine.prompt import special_rows

    voice = speech(1.5, seed=11)
    options = ConversationOptions(speaker_prompt_pcm=voice, temperature=0.0, max_response_ms=MAX_RESPONSE_MS)

    async def run():
        conv = engine.open_conversation("speaker", options)
        await talk(conv, speech(1.0, seed=12), realtime=False)
        await answer(conv)
        first, said = conv.last_prompt, conv._turns[-1].frames
        conv.update_options(GREEDY_OPTIONS)  # no speaker prompt from the next answer on
        await talk(conv, speech(0.6, seed=13), realtime=False)
        await answer(conv)
        second = conv.last_prompt
        await conv.close()
        # the voice's frames as the engine's tokenizer makes them (in its thread, one torch thread: another
        # thread count may flip a near-tie of the k-means, and the tokenizer is tested on its own)
        return first, said, second, await engine.pipeline.tokenize_clip(voice)

    first, said, second, frames = loop_thread.run(run())
    assert len(frames) == 75  # 1.5 s at 50 Hz
    head = special_rows(vocab.SOS_EOS, vocab.TASK_AUDIO_DIALOGUE)
    with_speaker = np.concatenate([head, speaker_segment(frames)])
    np.testing.assert_array_equal(first[: len(with_speaker)], with_speaker)
    # the answer is the reference's greedy answer to exactly that prompt
    ref_frames, _ = reference_audio(reference, first)
    np.testing.assert_array_equal(said, ref_frames)
    # dropped: the next prompt starts with the user's first turn right after the task marker
    assert not np.array_equal(second[: len(with_speaker)], with_speaker)
    np.testing.assert_array_equal(second[len(head) : len(head) + 1], special_rows(vocab.USER, vocab.CODEC_SSL)[:1])


def test_the_engine_lays_out_the_checkpoints_speaker_prompt_length(loop_thread, tiny_model, tmp_path) -> None:
    """A checkpoint converted from a config with speaker_prompt_length 150 (config.json's opuslm block, as
    engine/convert/espnet.py writes it): the conversation's prompt holds a 150-frame speaker segment."""
    import json
    import shutil

    from engine.dialogue import speaker_segment
    from engine.layout import PromptLayout
    from engine.prompt import special_rows

    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    config = json.loads((model / "config.json").read_text())
    config["opuslm"]["speaker_prompt_length"] = 150
    (model / "config.json").write_text(json.dumps(config))
    voice = speech(4.0, seed=21)  # 200 frames: cut to 150

    async def run():
        eng = await Engine.start(EngineServiceConfig(model=str(model), capacity_override=1, warmup=False))
        try:
            conv = eng.open_conversation("layout", ConversationOptions(speaker_prompt_pcm=voice, temperature=0.0,
                                                                       max_response_ms=200.0))
            await talk(conv, speech(0.5, seed=22), realtime=False)
            await answer(conv)
            prompt = conv.last_prompt
            await conv.close()
            return eng.pipeline.prompt_layout, prompt, await eng.pipeline.tokenize_clip(voice[: 150 * 320])
        finally:
            await eng.shutdown()

    layout, prompt, frames = loop_thread.run(run())
    assert layout == PromptLayout(150)
    assert len(frames) == 150
    head = np.concatenate([special_rows(vocab.SOS_EOS, vocab.TASK_AUDIO_DIALOGUE), speaker_segment(frames, layout)])
    assert len(head) == 2 + 2 + 150 + 8
    np.testing.assert_array_equal(prompt[: len(head)], head)
    np.testing.assert_array_equal(prompt[len(head) : len(head) + 2, 0], [vocab.USER, vocab.CODEC_SSL])


def test_the_cpu_engine_leaves_the_codec_a_core(engine, loop_thread) -> None:
    import os

    cores = len(os.sched_getaffinity(0))
    assert engine_cpu_threads(None, "cpu") == max(1, cores - 1)
    assert engine_cpu_threads(None, "cuda") == 0  # vLLM's default when the codec is elsewhere
    assert engine_cpu_threads(3, "cpu") == 3
    for bad in (0, -1, 1.5, "2", True):
        with pytest.raises(ValueError, match="engine.cpu_threads"):
            EngineServiceConfig(cpu_threads=bad)
    if not torch.cuda.is_available():
        # the codec and tokenizer run on this CPU: the engine core's OpenMP team spans all cores but one
        assert loop_thread.run(engine.pipeline.llm.engine_threads()) == max(1, cores - 1)
