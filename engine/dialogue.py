"""The OpusLM dialogue prompt: a conversation's turns as the [T, 9] sequence the model reads.

Layout (ESPnet's chat format with `inference_last_segment`, as the espnet/vllm fork renders it;
shared/research/opuslm.md §4):

    5 <audio_dialogue task 89>
    8 37  speaker prompt audio + 8-step flush            (optional voice to imitate)
    9 34  user audio + 8-step flush                        | one pair of segments
    9 35  user text + 8 pads                  (optional)   | per turn; text segments
    10 35 assistant text + 8 pads             (optional)   | only when the model has
    10 34 assistant audio + 8-step flush                   | a text tokenizer
    ...
    10 34                                     <- the model generates the assistant's audio

Non-target segments carry no end token, only their 8-step tail; audio is delay-interleaved.
The history holds what was actually said and played: an interrupted assistant turn keeps only
its played frames.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import accumulate

import numpy as np

from engine import delay, vocab
from engine.prompt import audio_segment, open_audio_segment, special_rows

SPEAKER_PROMPT_FRAMES = 500  # ESPnet cuts or zero-pads the speaker prompt to 10 s
_SEGMENT_ROWS = 2 + delay.FLUSH_STEPS  # a segment's role and modality rows, and its 8-step flush
HEAD_ROWS = 2  # <sos> <audio_dialogue task>
OPENER_ROWS = 2  # the assistant audio segment the model generates into
# vLLM stops a request whose prompt + output reaches max_model_len: a few rows of slack keep a
# full-length answer clear of that edge.
ANSWER_MARGIN_ROWS = 4
MIN_ANSWER_FRAMES = 50  # 1 s: a shorter answer than this is not worth giving (conversation_too_long)


@dataclass
class DialogueTurn:
    role: int  # vocab.USER or vocab.ASSISTANT
    frames: np.ndarray  # [T, 9] audio frames (global ids)
    text_ids: list[int] = field(default_factory=list)  # global text ids, if the model has text
    # deleted by the client (conversation.item.delete): the model no longer reads it, but it keeps its
    # place, so the history stays a user turn and an answer per exchange (where context management cuts)
    deleted: bool = False


def text_segment(role: int, text_ids: list[int]) -> np.ndarray:
    rows = special_rows(role, vocab.TEXT_BPE, *text_ids)
    return np.concatenate([rows, special_rows(*([vocab.PAD] * delay.MAX_DELAY))])


def speaker_segment(frames: np.ndarray) -> np.ndarray:
    frames = np.asarray(frames, dtype=np.int64)[:SPEAKER_PROMPT_FRAMES]
    return audio_segment(vocab.SYSTEM, frames, modality=vocab.SPEAKER)


def history_rows(turns: list[DialogueTurn], speaker_frames: np.ndarray | None = None) -> np.ndarray:
    """The prompt up to and including the last turn (no opener)."""
    parts = [special_rows(vocab.SOS_EOS, vocab.TASK_AUDIO_DIALOGUE)]
    if speaker_frames is not None and len(speaker_frames):
        parts.append(speaker_segment(speaker_frames))
    for turn in turns:
        if turn.deleted:
            continue
        if turn.role == vocab.USER:
            parts.append(audio_segment(vocab.USER, turn.frames))
            if turn.text_ids:
                parts.append(text_segment(vocab.USER, turn.text_ids))
        elif turn.role == vocab.ASSISTANT:
            if turn.text_ids:
                parts.append(text_segment(vocab.ASSISTANT, turn.text_ids))
            parts.append(audio_segment(vocab.ASSISTANT, turn.frames))
        else:
            raise ValueError(f"unknown role {turn.role}")
    return np.concatenate(parts)


def response_prompt(turns: list[DialogueTurn], speaker_frames: np.ndarray | None = None) -> np.ndarray:
    """The full prompt for generating the assistant's next audio."""
    return np.concatenate([history_rows(turns, speaker_frames), open_audio_segment(vocab.ASSISTANT)])


def stable_user_prefix(
    turns: list[DialogueTurn], user_frames: np.ndarray, speaker_frames: np.ndarray | None = None
) -> np.ndarray:
    """The part of the next prompt that is final while the user is still talking.

    The user segment's last 8 steps still change as frames arrive (their stream 0 is PAD until
    the next frame fills it), so only the steps of complete frames are included.
    """
    user = np.asarray(user_frames, dtype=np.int64).reshape(-1, vocab.NUM_STREAMS)
    steps = delay.interleave(user)[: len(user)]
    return np.concatenate([history_rows(turns, speaker_frames), special_rows(vocab.USER, vocab.CODEC_SSL), steps])


# --- context management --------------------------------------------------------------------------
# A prompt longer than the model's positions is refused by vLLM, and a prompt whose answer would run
# past them has it cut short. So before each answer the oldest turns are dropped: whole exchanges
# (the kept history starts at a user turn), never the task marker or the speaker prompt, and down to
# `retention_ratio` of the room, so that the prefix cache (which a drop invalidates: the prompt's
# start changes) is rebuilt once every several turns rather than at every one.


def turn_rows(turn: DialogueTurn) -> int:
    """The positions `turn` takes in a prompt (its audio segment, and its text segment if any)."""
    if turn.deleted:
        return 0
    rows = _SEGMENT_ROWS + len(turn.frames)
    return rows + (_SEGMENT_ROWS + len(turn.text_ids) if turn.text_ids else 0)


def head_rows(speaker_frames: int) -> int:
    """The positions before the first turn: the task marker and the speaker prompt, if any."""
    speaker = min(speaker_frames, SPEAKER_PROMPT_FRAMES)
    return HEAD_ROWS + (_SEGMENT_ROWS + speaker if speaker else 0)


def answer_rows(max_frames: int) -> int:
    """The positions an answer of `max_frames` takes once generated: frames, flush, slack."""
    return max_frames + delay.FLUSH_STEPS + ANSWER_MARGIN_ROWS


@dataclass(frozen=True)
class ContextFit:
    """What the next answer's prompt keeps: `fit_context`'s verdict."""

    drop: int  # leading history turns to drop (0: none)
    max_frames: int  # the answer's frame cap: as asked, or less when one long user turn leaves less room
    prompt_rows: int  # the response prompt's positions once `drop` turns are gone
    fits: bool  # False: even so the answer does not fit (or truncation is disabled): conversation_too_long


def exchange_starts(turns: Sequence[DialogueTurn]) -> list[int]:
    """Where the history may be cut: before a user turn, or after the last turn."""
    return [k for k, t in enumerate(turns) if t.role == vocab.USER] + [len(turns)]


def fit_context(
    turns: Sequence[DialogueTurn],
    user_frames: int,
    max_model_len: int,
    max_frames: int,
    retention_ratio: float | None,
    speaker_frames: int = 0,
    at_least: int = 0,
) -> ContextFit:
    """How many leading `turns` to drop so that the prompt (history + the current user turn of
    `user_frames`) and an answer of `max_frames` fit `max_model_len` positions.

    Nothing is dropped while it all fits. Once it does not, whole exchanges go, oldest first, until
    the conversation (the kept turns and the user turn) takes at most `retention_ratio` of the room
    it has beside the head and the answer: a ratio of 1 drops just enough, lower ratios drop more at
    once so that the next drops come later. `retention_ratio` None: truncation disabled, nothing is
    dropped (`fits` False when it does not fit). `at_least`: drop no fewer turns than this (what an
    incremental prefill already assumed, so the response reuses its cache).

    When even the user turn alone leaves no room for the whole answer, every earlier turn goes and
    the answer is capped to what fits, if that is at least `MIN_ANSWER_FRAMES` (or all it asked).
    """
    rows = [turn_rows(t) for t in turns]
    after = list(accumulate(reversed(rows), initial=0))[::-1]  # after[k]: rows of turns[k:]
    head = head_rows(speaker_frames) + OPENER_ROWS
    user = _SEGMENT_ROWS + user_frames
    room = max_model_len - head - answer_rows(max_frames)  # for the kept turns and the user turn
    starts = [k for k in exchange_starts(turns) if k >= min(at_least, len(turns))]
    drop = starts[0]

    def verdict(k: int, frames: int, fits: bool) -> ContextFit:
        return ContextFit(drop=k, max_frames=frames, prompt_rows=head + after[k] + user, fits=fits)

    if after[drop] + user <= room:
        return verdict(drop, max_frames, True)
    if retention_ratio is None:
        return verdict(drop, max_frames, False)
    target = retention_ratio * room
    drop = next((k for k in starts if after[k] + user <= target), starts[-1])
    if after[drop] + user <= room:
        return verdict(drop, max_frames, True)
    # one user turn too long for a full answer: the longest answer that fits, if it is worth giving
    frames = min(max_frames, max_model_len - head - user - answer_rows(0))
    return verdict(drop, max(frames, 0), frames >= min(MIN_ANSWER_FRAMES, max_frames))
