"""Text and audio in one request (engine/modality.py): the vLLM plugin against the reference, token
for token, for text-only requests (ASR), text that switches to audio (the dialogue's assistant text),
audio after a text prompt (TTS), mixed batches of text- and audio-phase rows, CFG, preemption and
seeded sampling; and the pure rules underneath. Real vLLM on CPU."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import numpy as np
import pytest
from safetensors.torch import load_file, save_file

from engine import checkpoint, modality, vocab
from engine.delay import FLUSH_STEPS
from engine.prompt import audio_segment, random_frames, special_rows, synthetic_prompt
from engine.reference import ReferenceOpusLM
from engine.request import AudioRequest
from engine.sampling import GREEDY, SamplingConfig
from parity import assert_same_steps

TEXT_LO, TEXT_HI = vocab.TEXT_OFFSET, vocab.TEXT_OFFSET + 512  # the tiny model's text range


def user_audio_prompt(i: int, opener: int, task: int = vocab.TASK_ASR, frames: int = 12) -> np.ndarray:
    """<sos> <task> | user: audio | assistant: <opener>"""
    rng = np.random.default_rng([7, i])
    return np.concatenate([special_rows(vocab.SOS_EOS, task), audio_segment(vocab.USER, random_frames(rng, frames + i)),
                           special_rows(vocab.ASSISTANT, opener)])


def asr(i: int, max_text: int = 12, min_text: int = 0, **kw) -> AudioRequest:
    return AudioRequest(user_audio_prompt(i, vocab.TEXT_BPE), max_frames=0, start_modality=vocab.TEXT_BPE,
                        max_text_tokens=max_text, min_text_tokens=min_text, **{"sampling": GREEDY, **kw})


def spoken_answer(i: int, max_text: int = 6, frames: int = 15, **kw) -> AudioRequest:
    """Assistant text first, then its audio (the dialogue's `10 35`)."""
    return AudioRequest(user_audio_prompt(i, vocab.TEXT_BPE, vocab.TASK_AUDIO_DIALOGUE), max_frames=frames,
                        min_frames=frames, start_modality=vocab.TEXT_BPE, max_text_tokens=max_text,
                        switch_to_audio=True, **{"sampling": GREEDY, **kw})


def tts(i: int, frames: int = 14) -> AudioRequest:
    """Text in the prompt, audio generated (audio-first, as before)."""
    text = list(range(TEXT_LO + 3 * i, TEXT_LO + 3 * i + 9))
    prompt = np.concatenate([special_rows(vocab.SOS_EOS, vocab.TASK_TTS, vocab.USER, vocab.TEXT_BPE, *text),
                             special_rows(*[vocab.PAD] * 8), special_rows(vocab.ASSISTANT, vocab.CODEC_SSL)])
    return AudioRequest(prompt, max_frames=frames, min_frames=3, sampling=GREEDY)


def gather(loop_thread, engine, reqs):
    async def run():
        return await asyncio.gather(*(engine.generate(r) for r in reqs))

    return loop_thread.run(run())


@pytest.fixture(scope="module")
def ref(tiny_model):
    return ReferenceOpusLM.from_dir(tiny_model)


# --- pure rules -----------------------------------------------------------------------------------


def test_text_rules_and_candidates() -> None:
    rules = modality.text_rules(np.array([0, 2, 3, 5, 5]), np.array([3, 3, 3, 0, 0]), np.array([5, 5, 5, 5, 5]),
                                np.array([False, False, True, False, True]))
    assert list(rules) == [modality.TextRule.TEXT, modality.TextRule.TEXT, modality.TextRule.TEXT_OR_EOS,
                           modality.TextRule.FORCE_EOS, modality.TextRule.FORCE_SWITCH]
    mask = modality.candidate_mask(rules, np.array([False, False, True, False, True]), 6)
    assert mask[0].tolist() == [False, False, True, True, True, True]  # text only: no EOS before min, no switch
    assert mask[2].tolist() == [True, True, True, True, True, True]  # EOS, the switch marker, text
    assert mask[3].tolist() == [True, False, False, False, False, False]  # forced EOS
    assert mask[4].tolist() == [False, True, False, False, False, False]  # forced switch
    assert modality.column_token(np.array([0, 1, 2, 5])).tolist() == [vocab.ENGINE_STOP, vocab.CODEC_SSL, TEXT_LO, TEXT_LO + 3]


def test_splitter_routes_text_then_audio_incrementally() -> None:
    steps = np.zeros((9, vocab.NUM_STREAMS), dtype=np.int64)
    steps[:3, 0] = [TEXT_LO + 1, TEXT_LO + 2, TEXT_LO + 3]
    steps[3, 0] = vocab.CODEC_SSL
    steps[4:, 0] = vocab.SSL_OFFSET + np.arange(5)
    whole_text, whole_audio = modality.split_steps(steps, vocab.TEXT_BPE)
    splitter = modality.ModalitySplitter(vocab.TEXT_BPE)
    parts = [splitter.push(steps[a:b]) for a, b in [(0, 2), (2, 5), (5, 9)]]
    assert [p[0] for p in parts] == [[TEXT_LO + 1, TEXT_LO + 2], [TEXT_LO + 3], []]
    np.testing.assert_array_equal(np.concatenate([p[1] for p in parts]), steps[4:])
    np.testing.assert_array_equal(whole_audio, steps[4:])
    assert whole_text.tolist() == [TEXT_LO + 1, TEXT_LO + 2, TEXT_LO + 3]
    stopped = steps.copy()
    stopped[3, 0] = vocab.ENGINE_STOP  # text EOS: nothing follows
    assert modality.split_steps(stopped[:4], vocab.TEXT_BPE)[1].shape == (0, vocab.NUM_STREAMS)
    np.testing.assert_array_equal(modality.split_steps(steps, vocab.CODEC_SSL)[1], steps)  # audio-first: all audio


def test_request_validation_and_step_budget() -> None:
    prompt = user_audio_prompt(0, vocab.TEXT_BPE)
    assert asr(0, max_text=12).max_steps == 13  # 12 text tokens and the step that ends them
    assert spoken_answer(0, max_text=6, frames=15).max_steps == 7 + 15 + FLUSH_STEPS
    with pytest.raises(ValueError, match="max_text_tokens"):
        AudioRequest(prompt, max_frames=0, start_modality=vocab.TEXT_BPE)
    with pytest.raises(ValueError, match="switch_to_audio"):
        AudioRequest(prompt, max_frames=5, switch_to_audio=True)
    with pytest.raises(ValueError, match="start_modality"):
        AudioRequest(prompt, max_frames=5, start_modality=vocab.SPEAKER)
    with pytest.raises(ValueError, match="max_frames"):
        AudioRequest(prompt, max_frames=0, start_modality=vocab.TEXT_BPE, max_text_tokens=3, switch_to_audio=True)


def test_reference_text_phase_rules(ref) -> None:
    out = ref.generate(asr(1, max_text=9))
    assert out.steps.shape == (10, vocab.NUM_STREAMS) and out.steps[-1, 0] == vocab.ENGINE_STOP  # forced EOS at the cap
    assert len(out.text_ids) == 9 and ((out.text_ids >= TEXT_LO) & (out.text_ids < TEXT_HI)).all()
    assert (out.steps[:, 1:] == vocab.PAD).all() and out.frames.shape == (0, vocab.NUM_STREAMS)
    spoken = ref.generate(spoken_answer(1, max_text=4, frames=10))
    assert spoken.steps[4, 0] == vocab.CODEC_SSL  # the forced switch
    audio = spoken.steps[5:]
    assert audio.shape[0] == 10 + FLUSH_STEPS and spoken.frames.shape == (10, vocab.NUM_STREAMS)
    for k in range(1, vocab.NUM_STREAMS):  # the audio segment starts with the delay warm-up
        assert (audio[:k, k] == vocab.PAD).all() and audio[k, k] != vocab.PAD
    assert vocab.in_stream_range(spoken.frames).all()
    # CFG merges in the audio phase only: the text is the unguided request's
    guided = ref.generate(spoken_answer(1, max_text=4, frames=10, cfg_scale=2.5))
    np.testing.assert_array_equal(guided.steps[:5], spoken.steps[:5])
    assert not np.array_equal(guided.frames, spoken.frames)


# --- vLLM against the reference -------------------------------------------------------------------


@pytest.mark.vllm
def test_greedy_parity_mixed_batch_of_text_and_audio_rows(vllm_engine, loop_thread, ref) -> None:
    reqs = [asr(0, max_text=12, min_text=4), spoken_answer(1, max_text=7), tts(2), AudioRequest(synthetic_prompt(3, 20), 20, 5, GREEDY),
            asr(4, max_text=20), spoken_answer(5, max_text=3, frames=22, cfg_scale=2.0), tts(6, frames=25),
            AudioRequest(synthetic_prompt(7, 16), 18, 18, GREEDY, cfg_scale=1.5), spoken_answer(8, max_text=10, frames=9)]
    gens = gather(loop_thread, vllm_engine, reqs)
    for i, (req, gen) in enumerate(zip(reqs, gens)):
        want = ref.generate(req)
        assert_same_steps(gen.steps, want.steps, f"request {i}")
        np.testing.assert_array_equal(gen.text_ids, want.text_ids)
        np.testing.assert_array_equal(gen.frames, want.frames)
        assert vocab.in_stream_range(gen.frames).all()
        if req.text_first:
            assert len(gen.text_ids) == req.max_text_tokens  # the tiny model runs to the cap
        if req.has_audio and req.min_frames == req.max_frames:
            assert len(gen.frames) == req.max_frames


@pytest.fixture(scope="module")
def marker_model(tiny_model, ref, tmp_path_factory) -> tuple[Path, int, int]:
    """The tiny model with lm_head's EOS and switch-marker rows copied (scaled up) from text ids that
    greedy decoding picks mid-way, so both are *sampled* there, not forced: (model, switch step, EOS step)."""
    spoken = ref.generate(spoken_answer(0, max_text=12, frames=8)).text_ids
    text = ref.generate(asr(2, max_text=14, min_text=3)).text_ids
    switch_at = next(k for k in range(3, 12) if spoken[k] not in spoken[:k])
    eos_at = next(k for k in range(5, 14) if text[k] not in text[:k] and text[k] != spoken[switch_at])
    out = tmp_path_factory.mktemp("marker_model")
    for item in Path(tiny_model).iterdir():
        (shutil.copytree if item.is_dir() else shutil.copy)(item, out / item.name)
    path = checkpoint.weights_path(out)
    weights = load_file(str(path))
    head = weights["lm_head.weight"].clone()
    head[vocab.CODEC_SSL] = head[int(spoken[switch_at])] * 1.05
    head[vocab.SOS_EOS] = head[int(text[eos_at])] * 1.05
    weights["lm_head.weight"] = head
    save_file(weights, str(path))
    return out, switch_at, eos_at


@pytest.mark.vllm
def test_sampled_switch_and_eos_match_the_reference(loop_thread, engine_factory, marker_model) -> None:
    model, switch_at, eos_at = marker_model
    marked_ref = ReferenceOpusLM.from_dir(model)
    reqs = [spoken_answer(0, max_text=12, frames=8), asr(2, max_text=14, min_text=3), tts(3)]
    engine = engine_factory(model=str(model), max_num_seqs=8)
    try:
        gens = gather(loop_thread, engine, reqs)
    finally:
        engine.shutdown()
    for i, (req, gen) in enumerate(zip(reqs, gens)):
        assert_same_steps(gen.steps, marked_ref.generate(req).steps, f"request {i}")
    assert len(gens[0].text_ids) == switch_at < 12 and gens[0].steps[switch_at, 0] == vocab.CODEC_SSL
    assert len(gens[0].frames) == 8
    assert len(gens[1].text_ids) == eos_at < 14 and gens[1].steps[-1, 0] == vocab.ENGINE_STOP


@pytest.mark.vllm
def test_greedy_parity_under_preemption_across_a_switch(loop_thread, engine_factory, tiny_model, ref) -> None:
    # ~200-300 positions each (CFG ones twice) in 10 blocks of 128: preemption-recompute mid-text and mid-audio
    engine = engine_factory(model=str(tiny_model), block_size=128, max_num_seqs=16, num_kv_blocks=10,
                            max_model_len=512, log_stats=True)
    reqs = []
    for i in range(8):
        prompt = np.concatenate([synthetic_prompt(i, 110)[:-1], special_rows(vocab.TEXT_BPE)])  # `10 35`
        reqs.append(AudioRequest(prompt, max_frames=60 + 5 * i, min_frames=60 + 5 * i, sampling=GREEDY,
                                 start_modality=vocab.TEXT_BPE, max_text_tokens=10 + 3 * i, switch_to_audio=i % 3 != 2,
                                 cfg_scale=2.0 if i % 4 == 1 else 1.0))
    try:
        gens = gather(loop_thread, engine, reqs)
    finally:
        engine.shutdown()
    assert sum(g.num_preemptions for g in gens) > 0, "KV pressure did not preempt anything"
    for i, (req, gen) in enumerate(zip(reqs, gens)):
        assert_same_steps(gen.steps, ref.generate(req).steps, f"request {i} (preempted {gen.num_preemptions}x)")


@pytest.mark.vllm
def test_a_continued_segment_carries_the_prompt_frames_through_the_warm_up(vllm_engine, loop_thread, ref) -> None:
    from engine import tasks

    clips = [random_frames(np.random.default_rng([11, i]), 9 + 4 * i) for i in range(3)]
    prompts = [tasks.continuation_prompt(c) for c in clips]
    reqs = [AudioRequest(p.rows, 16, 16, GREEDY, carry=p.carry[:, 1:]) for p in prompts]
    reqs.append(AudioRequest(prompts[0].rows, 16, 16, GREEDY))  # the same prompt, warm-up forced to PAD
    gens = gather(loop_thread, vllm_engine, reqs + [asr(5)])[:4]
    for i, (req, gen) in enumerate(zip(reqs, gens)):
        assert_same_steps(gen.steps, ref.generate(req).steps, f"request {i}")
    for clip, gen in zip(clips, gens):
        for s in range(FLUSH_STEPS):  # stream k at step s < k holds the clip's frame T + s - k
            for k in range(s + 1, vocab.NUM_STREAMS):
                assert gen.steps[s, k] == clip[len(clip) + s - k, k]
        assert len(gen.frames) == 16 and vocab.in_stream_range(gen.frames).all()
    assert (gens[3].steps[0, 1:] == vocab.PAD).all() and not np.array_equal(gens[3].steps, gens[0].steps)
    with pytest.raises(ValueError, match="carry"):
        AudioRequest(prompts[0].rows, 16, carry=np.zeros((3, 8), np.int64))


@pytest.mark.vllm
def test_seeded_text_sampling_is_reproducible(vllm_engine, loop_thread) -> None:
    def req(seed: int) -> AudioRequest:
        return spoken_answer(4, max_text=16, frames=12, sampling=SamplingConfig(temperature=0.9, top_k=40, seed=seed),
                             text_sampling=SamplingConfig(temperature=1.3, top_k=0, top_p=0.95))

    first = gather(loop_thread, vllm_engine, [req(5)])[0]
    together = gather(loop_thread, vllm_engine, [req(5), req(6), asr(0), tts(1), spoken_answer(2)])
    np.testing.assert_array_equal(first.steps, together[0].steps)
    assert not np.array_equal(first.text_ids, together[1].text_ids)
    assert ((first.text_ids >= TEXT_LO) & (first.text_ids < TEXT_HI)).all() and len(first.frames) == 12
    # the text phase draws with its own parameters: greedy text with sampled audio keeps the greedy text
    greedy_text = spoken_answer(4, max_text=16, frames=12, sampling=SamplingConfig(temperature=0.9, top_k=40, seed=5),
                                text_sampling=GREEDY)
    a, b = gather(loop_thread, vllm_engine, [greedy_text, spoken_answer(4, max_text=16, frames=12)])
    np.testing.assert_array_equal(a.text_ids, b.text_ids)
    assert not np.array_equal(a.frames, b.frames)
