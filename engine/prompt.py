"""Prompt building: segments of the OpusLM sequence as [T, 9] rows of global ids.

A segment is a role token, a modality token, then its content. Audio content is delay-interleaved
(T frames -> T + 8 steps; the 8-step tail is the segment's pad flush). A segment to be generated
is opened by its role and modality rows and left for the model.
"""

from __future__ import annotations

import numpy as np

from engine import delay, vocab


def special_rows(*ids: int) -> np.ndarray:
    """Text/special positions: stream 0 holds the id, streams 1-8 hold PAD."""
    rows = np.full((len(ids), vocab.NUM_STREAMS), vocab.PAD, dtype=np.int64)
    rows[:, 0] = ids
    return rows


def audio_segment(role: int, frames: np.ndarray, modality: int = vocab.CODEC_SSL) -> np.ndarray:
    """A complete (non-target) audio segment: role, modality, interleaved frames + flush."""
    return np.concatenate([special_rows(role, modality), delay.interleave(np.asarray(frames, np.int64))])


def open_audio_segment(role: int = vocab.ASSISTANT) -> np.ndarray:
    return special_rows(role, vocab.CODEC_SSL)


def random_frames(rng: np.random.Generator, num_frames: int) -> np.ndarray:
    ssl = rng.integers(0, vocab.SSL_SIZE, size=num_frames)
    dac = rng.integers(0, vocab.CODEBOOK_SIZE, size=(num_frames, vocab.NUM_CODEBOOKS))
    return vocab.frames_to_global(ssl, dac)


def synthetic_prompt_frames(index: int, prompt_frames: int) -> int:
    """Prompt length of request `index`: 0.5x to 1.5x `prompt_frames`, so batches are ragged."""
    return max(1, round(prompt_frames * (0.5 + ((index * 37) % 11) / 10)))


def synthetic_prompt(index: int, prompt_frames: int, seed: int = 0) -> np.ndarray:
    """A deterministic pseudo-random audio-continuation prompt for request `index`.

    Layout: <sos> <audiolm task> | user: audio(P frames) | assistant: audio -> generate.
    """
    rng = np.random.default_rng([seed, index])
    frames = random_frames(rng, synthetic_prompt_frames(index, prompt_frames))
    return np.concatenate(
        [
            special_rows(vocab.SOS_EOS, vocab.TASK_AUDIOLM),
            audio_segment(vocab.USER, frames),
            open_audio_segment(vocab.ASSISTANT),
        ]
    )
