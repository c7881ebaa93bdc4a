"""One-shot ASR and TTS on the engine service (engine/oneshot.py): what `Engine.transcribe` and
`Engine.synthesize` return is the reference's greedy output for the same task prompt, they run beside a
conversation, and bad input fails clearly. Real vLLM, tokenizer and codec stage on CPU."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from engine import oneshot, vocab
from engine.codec.dac import DAC
from engine.codec.streaming import snr_db
from engine.codec.synth import speech_like
from engine.reference import ReferenceOpusLM
from engine.service import Engine, EngineServiceConfig
from engine.service_api import ConversationOptions, SpeechOptions, TranscriptionOptions
from engine.text import TextTokenizer

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def engine(loop_thread, tiny_model):
    eng = loop_thread.run(Engine.start(EngineServiceConfig(model=str(tiny_model), capacity_override=2)))
    yield eng
    loop_thread.run(eng.shutdown())


@pytest.fixture(scope="module")
def ref(tiny_model):
    return ReferenceOpusLM.from_dir(tiny_model)


def speech(seconds: float, seed: int) -> np.ndarray:
    return (speech_like(seconds, seed=seed) * 20000).astype(np.int16)


async def collect(it):
    return [x async for x in it]


def test_transcribe_is_the_reference_transcript_in_deltas(engine, loop_thread, ref, tiny_model) -> None:
    pcm = speech(1.2, seed=3)
    options = TranscriptionOptions(max_tokens=24)

    async def run():
        return await collect(engine.transcribe(pcm, options)), await engine.pipeline.tokenize_clip(pcm)

    deltas, frames = loop_thread.run(run())
    want = ref.generate(oneshot.asr_request(frames, options, engine.pipeline.max_model_len))
    text = TextTokenizer.from_dir(tiny_model).decode(want.text_ids)
    assert len(want.text_ids) == 24 and len(deltas) > 3  # streamed, not one piece at the end
    assert "".join(deltas) == text


def test_synthesize_is_the_reference_speech_in_chunks(engine, loop_thread, ref, tiny_model) -> None:
    options = SpeechOptions(temperature=0.0, max_ms=800.0)
    text = "Hello there, how are you?"
    chunks = loop_thread.run(collect(engine.synthesize(text, options)))
    ids = [int(i) for i in TextTokenizer.from_dir(tiny_model).encode(text)]
    want = ref.generate(oneshot.tts_request(ids, None, options, engine.pipeline.max_model_len))
    assert len(want.frames) == 40 and chunks[-1].is_last and len(chunks) > 1
    got = np.concatenate([c.pcm for c in chunks]).astype(np.float32) / 32768.0
    codes = torch.from_numpy(vocab.global_to_dac(want.frames[:, 1:]).T[None].copy())
    expected = DAC.from_dir(tiny_model, device="cpu").decode(codes)[0, 0].numpy()
    assert len(got) == len(expected) == 40 * vocab.HOP_SAMPLES
    assert snr_db(expected, got) > 30.0


def test_one_shot_requests_beside_a_conversation_and_bad_input(engine, loop_thread) -> None:
    async def run():
        conv = engine.open_conversation("beside", ConversationOptions(temperature=0.0, max_response_ms=600.0))
        conv.push_user_audio(speech(0.8, seed=5))
        conv.end_user_turn()
        handle = conv.respond("resp_beside")
        answer, text, audio = await asyncio.gather(
            collect(handle.chunks()),
            collect(engine.transcribe(speech(0.6, seed=6), TranscriptionOptions(max_tokens=8))),
            collect(engine.synthesize("One two three.", SpeechOptions(temperature=0.0, max_ms=400.0))),
        )
        await conv.close()
        errors = []
        for bad in (lambda: engine.synthesize("   ", SpeechOptions()), lambda: engine.transcribe(np.zeros(0, np.int16))):
            with pytest.raises(ValueError) as e:
                await collect(bad())
            errors.append(str(e.value))
        return answer, text, audio, errors

    answer, text, audio, errors = loop_thread.run(run())
    assert answer[-1].is_last and sum(len(c.pcm) for c in answer) == 30 * vocab.HOP_SAMPLES
    assert "".join(text) and audio[-1].is_last
    assert "non-empty text" in errors[0] and "at least one sample" in errors[1]
