"""The OpusLM dialogue prompt: a conversation's turns as the [T, 9] sequence the model reads.

Layout (ESPnet's chat format, checked against ESPnet's code; the sources and the other tasks are in
engine/tasks.py, whose test rebuilds this layout the way ESPnet does and compares):

    5 <audio_dialogue task 89>
    8 37  speaker prompt: L frames (cut, or zero-padded) + 8-step flush    (optional voice)
    9 34  user audio + 8-step flush                        | one pair of segments
    9 35  user text + 8 pads                  (optional)   | per turn, in this order
    10 35 assistant text + 8 pads             (optional)   | (speechlm_dialogue_assemble.py:
    10 34 assistant audio + 8-step flush                   | user audio first, assistant text first)
    ...
    10 34                                     <- the model generates the assistant's audio
    10 35                                     <- or, `text_first`, the assistant's text first

Every segment is followed by 8 all-PAD rows (ESPnet's `inter_segment_pad`, nq - 1 for the delay
architecture); ESPnet delay-interleaves the whole sequence, which with those pads equals
interleaving each audio segment on its own (its 8-step flush is the pad rows). History segments carry
no end token: ESPnet ends a *target* segment with <sos/eos> (<eou> mid-dialogue in the fork the
dialogue model was trained with), but the contexts of that model's last training stage (DPO) and the
espnet/vllm fork's `_build_dialogue_sequence` have none, and this path is unchanged from before.
The history holds what was actually said and played: an interrupted assistant turn keeps only its
played frames.

L is the checkpoint's `speaker_prompt_length` (500 for the released models and the tiny one), and a
shorter voice is padded to it only with `pad_speaker_prompt`: both come from the checkpoint's training
config (engine/layout.py), and every function here that lays out or counts the head takes that
`layout` (default: DEFAULT_LAYOUT, the tiny model's).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import accumulate

import numpy as np

from engine import delay, vocab
from engine.layout import DEFAULT_LAYOUT, PromptLayout
from engine.prompt import audio_segment, open_audio_segment, special_rows

# The default layout's speaker prompt length (the tiny model's, the released models'); a checkpoint's
# own is `checkpoint.OpusLMConfig.prompt_layout` (engine/layout.py has ESPnet's rule).
SPEAKER_PROMPT_FRAMES = DEFAULT_LAYOUT.speaker_prompt_length
SEGMENT_ROWS = 2 + delay.FLUSH_STEPS  # a segment's role and modality rows, and its 8-step flush
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


def speaker_prompt_frames(frames: np.ndarray, layout: PromptLayout = DEFAULT_LAYOUT) -> np.ndarray:
    """The speaker prompt as ESPnet lays it out: the first `layout.speaker_prompt_length` frames of
    `frames`, then (`layout.pad_speaker_prompt`) all-PAD frames up to that length."""
    return layout.speaker_frames(frames)


def speaker_segment(frames: np.ndarray, layout: PromptLayout = DEFAULT_LAYOUT) -> np.ndarray:
    return audio_segment(vocab.SYSTEM, speaker_prompt_frames(frames, layout), modality=vocab.SPEAKER)


def history_rows(turns: list[DialogueTurn], speaker_frames: np.ndarray | None = None, *,
                 system_ids: Sequence[int] = (), layout: PromptLayout = DEFAULT_LAYOUT) -> np.ndarray:
    """The prompt up to and including the last turn (no opener). `system_ids`: the system text (the
    session's instructions, global text ids), a `8 35` segment after the speaker prompt."""
    parts = [special_rows(vocab.SOS_EOS, vocab.TASK_AUDIO_DIALOGUE)]
    if speaker_frames is not None and len(speaker_frames):
        parts.append(speaker_segment(speaker_frames, layout))
    if len(system_ids):
        parts.append(text_segment(vocab.SYSTEM, [int(i) for i in system_ids]))
    for turn in turns:
        if turn.deleted:
            continue
        if turn.role == vocab.USER:
            if len(turn.frames) or not turn.text_ids:  # a typed turn (text only) has no audio segment
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


def response_prompt(
    turns: list[DialogueTurn], speaker_frames: np.ndarray | None = None, *, text_first: bool = False,
    system_ids: Sequence[int] = (), layout: PromptLayout = DEFAULT_LAYOUT,
) -> np.ndarray:
    """The full prompt for the assistant's next answer: it opens the assistant's audio segment, or
    with `text_first` its text segment (`10 35`), so that the model writes the answer's text and ends
    it (<sos/eos>, the only end ESPnet's text mask allows), and the caller then appends the text's 8
    pad rows and opens the audio segment (`10 34`)."""
    opener = special_rows(vocab.ASSISTANT, vocab.TEXT_BPE) if text_first else open_audio_segment(vocab.ASSISTANT)
    return np.concatenate([history_rows(turns, speaker_frames, system_ids=system_ids, layout=layout), opener])


def answer_audio_prompt(
    turns: list[DialogueTurn], text_ids: Sequence[int], speaker_frames: np.ndarray | None = None, *,
    system_ids: Sequence[int] = (), layout: PromptLayout = DEFAULT_LAYOUT,
) -> np.ndarray:
    """After a `text_first` answer wrote `text_ids` and ended them: the prompt that opens the answer's
    audio segment, laid out as the history will hold the answer (its text segment, then `10 34`), so the
    next turn's prompt extends it and the prefix cache serves it. (ESPnet's chat inference generates one
    target segment per call the same way.)"""
    parts = [history_rows(turns, speaker_frames, system_ids=system_ids, layout=layout)]
    if len(text_ids):
        parts.append(text_segment(vocab.ASSISTANT, [int(i) for i in text_ids]))
    parts.append(open_audio_segment(vocab.ASSISTANT))
    return np.concatenate(parts)


def stable_user_prefix(
    turns: list[DialogueTurn], user_frames: np.ndarray, speaker_frames: np.ndarray | None = None, *,
    system_ids: Sequence[int] = (), layout: PromptLayout = DEFAULT_LAYOUT,
) -> np.ndarray:
    """The part of the next prompt that is final while the user is still talking.

    The user segment's last 8 steps still change as frames arrive (their stream 0 is PAD until
    the next frame fills it), so only the steps of complete frames are included.
    """
    user = np.asarray(user_frames, dtype=np.int64).reshape(-1, vocab.NUM_STREAMS)
    steps = delay.interleave(user)[: len(user)]
    return np.concatenate([history_rows(turns, speaker_frames, system_ids=system_ids, layout=layout),
                           special_rows(vocab.USER, vocab.CODEC_SSL), steps])


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
    audio = len(turn.frames) or turn.role != vocab.USER or not turn.text_ids  # as history_rows lays it out
    rows = SEGMENT_ROWS + len(turn.frames) if audio else 0
    return rows + (SEGMENT_ROWS + len(turn.text_ids) if turn.text_ids else 0)


def head_rows(speaker_frames: int, system_tokens: int = 0, layout: PromptLayout = DEFAULT_LAYOUT) -> int:
    """The positions before the first turn: the task marker, the speaker prompt if any (of
    `layout.speaker_rows(speaker_frames)` frames: cut to the layout's length, and padded to it when
    the layout pads) and the system text if any."""
    speaker = SEGMENT_ROWS + layout.speaker_rows(speaker_frames) if speaker_frames > 0 else 0
    return HEAD_ROWS + speaker + (SEGMENT_ROWS + system_tokens if system_tokens > 0 else 0)


def answer_rows(max_frames: int, max_text_tokens: int = 0) -> int:
    """The positions an answer of `max_frames` takes once generated: frames, flush, slack; and for a
    `text_first` answer of up to `max_text_tokens` tokens, its text, end token and 8 pads and the
    audio segment's two opener rows."""
    text = max_text_tokens + 1 + delay.MAX_DELAY + OPENER_ROWS if max_text_tokens > 0 else 0
    return max_frames + delay.FLUSH_STEPS + ANSWER_MARGIN_ROWS + text


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
    max_text_tokens: int = 0,
    system_tokens: int = 0,
    layout: PromptLayout = DEFAULT_LAYOUT,
) -> ContextFit:
    """How many leading `turns` to drop so that the prompt (history + the current user turn of
    `user_frames`) and an answer of `max_frames` fit `max_model_len` positions.

    Nothing is dropped while it all fits. Once it does not, whole exchanges go, oldest first, until
    the conversation (the kept turns and the user turn) takes at most `retention_ratio` of the room
    it has beside the head and the answer: a ratio of 1 drops just enough, lower ratios drop more at
    once so that the next drops come later. `retention_ratio` None: truncation disabled, nothing is
    dropped (`fits` False when it does not fit). `at_least`: drop no fewer turns than this (what an
    incremental prefill already assumed, so the response reuses its cache). `max_text_tokens`: the
    answer is `text_first`, with up to that many text tokens before its audio. `system_tokens`: the
    system text's length (never dropped, like the speaker prompt). `layout`: the checkpoint's, which
    sizes the speaker prompt.

    When even the user turn alone leaves no room for the whole answer, every earlier turn goes and
    the answer is capped to what fits, if that is at least `MIN_ANSWER_FRAMES` (or all it asked).
    """
    rows = [turn_rows(t) for t in turns]
    after = list(accumulate(reversed(rows), initial=0))[::-1]  # after[k]: rows of turns[k:]
    head = head_rows(speaker_frames, system_tokens, layout) + OPENER_ROWS
    user = SEGMENT_ROWS + user_frames
    room = max_model_len - head - answer_rows(max_frames, max_text_tokens)  # for the kept turns and the user turn
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
    frames = min(max_frames, max_model_len - head - user - answer_rows(0, max_text_tokens))
    return verdict(drop, max(frames, 0), frames >= min(MIN_ANSWER_FRAMES, max_frames))
