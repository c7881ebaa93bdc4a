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

from dataclasses import dataclass, field

import numpy as np

from engine import delay, vocab
from engine.prompt import audio_segment, open_audio_segment, special_rows

SPEAKER_PROMPT_FRAMES = 500  # ESPnet cuts or zero-pads the speaker prompt to 10 s


@dataclass
class DialogueTurn:
    role: int  # vocab.USER or vocab.ASSISTANT
    frames: np.ndarray  # [T, 9] audio frames (global ids)
    text_ids: list[int] = field(default_factory=list)  # global text ids, if the model has text


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
