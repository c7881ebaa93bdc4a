"""Text and audio in one request: which modality each generated step is in, what stream 0 may emit in
a text phase, and how a request's steps split into its text and its audio. Pure numpy, no torch.

ESPnet's semantics (espnet2/speechlm/core_lm/ar_delay.py `ARDelayLM.inference`, with the masks of
espnet2/bin/speechlm_inference.py `SpeechLM.__init__`): generation starts in the modality of the
prompt's last marker and samples under that modality's mask; in a *text* segment stream 0 samples
text ids and streams 1-8 are PAD; when the task has more than one target, stream 0 may also emit a
modality marker ([32, 64)), which switches the modality from the next step on; `<sos/eos>` (allowed
after `minlen` steps) ends the generation.

What we serve of it, and where we differ:
- A request starts in audio (`vocab.CODEC_SSL`, today's segments) or in text (`vocab.TEXT_BPE`).
- A text phase may switch to audio (stream 0 emits `CODEC_SSL`) when the request allows it (the
  dialogue's assistant text before its speech). Only that marker is offered: ESPnet unmasks all of
  [32, 64), but a switch into a modality the request has no mask for (speaker, or text into text) is
  a KeyError there and meaningless here. The audio segment then starts exactly as a prompt's `34`
  opener starts one: with the delay warm-up (stream k PAD for its first k steps), because ESPnet
  interleaves text positions with PAD in streams 1-8, so the codebooks right after the marker are PAD.
- An audio phase never switches back to text: no served layout has generated text after generated
  audio in one turn, and the audio segment would need its delay tail flushed first.
- EOS in a text phase ends the request at once: a text segment has nothing delayed to flush. It
  leaves the engine as `ENGINE_STOP` (the request's only stop token), so no extra step is run.
- `max_text_tokens` forces the end of the text: the switch when the request allows one (the answer
  still gets its audio), else EOS.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum

import numpy as np

from engine import vocab
from engine.delay import NO_EOS

NOT_SWITCHED = -1  # audio_start of a text-first request still in its text phase
SWITCH_TOKEN = vocab.CODEC_SSL  # the only marker a text phase may emit
TEXT_STARTS = (vocab.CODEC_SSL, vocab.TEXT_BPE)


class TextRule(IntEnum):
    """What stream 0 may emit at one step of a text phase."""

    TEXT = 0  # a text id (or the switch marker, where allowed)
    TEXT_OR_EOS = 1  # a text id or EOS (or the switch marker)
    FORCE_EOS = 2  # the text cap is reached and there is no audio to switch to
    FORCE_SWITCH = 3  # the text cap is reached: audio follows


def text_rules(steps: np.ndarray, min_text: np.ndarray, max_text: np.ndarray, switch: np.ndarray) -> np.ndarray:
    """TextRule per row for text-phase steps `steps` (a text phase starts at generated step 0)."""
    steps = np.asarray(steps)
    rules = np.where(steps >= np.asarray(min_text), TextRule.TEXT_OR_EOS, TextRule.TEXT)
    capped = steps >= np.asarray(max_text)
    rules = np.where(capped, np.where(np.asarray(switch), TextRule.FORCE_SWITCH, TextRule.FORCE_EOS), rules)
    return rules.astype(np.int8)


def audio_steps(steps: np.ndarray, audio_start: np.ndarray, eos_steps: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Generated steps and EOS steps counted from each row's audio start (for delay.stream0_rules and
    delay.aux_active). Rows still in a text phase get step 0 (their audio rules are not used)."""
    audio_start = np.asarray(audio_start)
    text = audio_start == NOT_SWITCHED
    start = np.where(text, 0, audio_start)
    eos = np.asarray(eos_steps)
    return np.where(text, 0, np.asarray(steps) - start), np.where(eos == NO_EOS, NO_EOS, eos - start)


# --- the text candidates of stream 0 -----------------------------------------------------------
# A text-phase row's stream 0 is sampled over [EOS, switch marker, text ids...]: column 0 is EOS,
# column 1 the switch marker, column 2 + i the text id TEXT_OFFSET + i.
EOS_COLUMN = 0
SWITCH_COLUMN = 1
TEXT_COLUMN0 = 2
MARKER_IDS = (vocab.SOS_EOS, SWITCH_TOKEN)  # the ids behind columns 0 and 1


def column_token(columns: np.ndarray) -> np.ndarray:
    """Sampled columns -> the stream-0 ids the engine emits (EOS leaves as ENGINE_STOP: it stops)."""
    columns = np.asarray(columns, dtype=np.int64)
    return np.where(
        columns == EOS_COLUMN,
        vocab.ENGINE_STOP,
        np.where(columns == SWITCH_COLUMN, SWITCH_TOKEN, columns - TEXT_COLUMN0 + vocab.TEXT_OFFSET),
    )


def candidate_mask(rules: np.ndarray, switch: np.ndarray, width: int) -> np.ndarray:
    """[rows, width] bool: which text-candidate columns each row may sample (a forced row: one)."""
    rules = np.asarray(rules)
    switch = np.asarray(switch, dtype=bool)
    allowed = np.zeros((len(rules), width), dtype=bool)
    free = rules <= TextRule.TEXT_OR_EOS
    allowed[free, TEXT_COLUMN0:] = True
    allowed[:, EOS_COLUMN] = rules == TextRule.TEXT_OR_EOS
    allowed[:, SWITCH_COLUMN] = free & switch
    allowed[rules == TextRule.FORCE_EOS, EOS_COLUMN] = True
    allowed[rules == TextRule.FORCE_SWITCH, SWITCH_COLUMN] = True
    return allowed


# --- a request's output, split by modality -----------------------------------------------------


@dataclass
class ModalitySplitter:
    """Routes a request's generated steps, in order, to its text and its audio.

    Text-first requests: stream-0 text ids are text; the switch marker starts the audio (the steps
    after it are the audio segment's, as `delay.FrameAssembler` expects them); ENGINE_STOP ends it.
    Audio-first requests: every step is audio.
    """

    start_modality: int = vocab.CODEC_SSL
    text_ids: list[int] = field(default_factory=list)
    in_text: bool = field(init=False)

    def __post_init__(self) -> None:
        if self.start_modality not in TEXT_STARTS:
            raise ValueError(f"start modality must be one of {TEXT_STARTS}, got {self.start_modality}")
        self.in_text = self.start_modality == vocab.TEXT_BPE

    def push(self, steps: np.ndarray) -> tuple[list[int], np.ndarray]:
        """Steps [n, 9] -> (their new text ids, their audio steps [m, 9])."""
        steps = np.asarray(steps, dtype=np.int64).reshape(-1, vocab.NUM_STREAMS)
        new_text: list[int] = []
        i = 0
        while self.in_text and i < len(steps):
            tok = int(steps[i, 0])
            i += 1
            if vocab.TEXT_OFFSET <= tok:
                new_text.append(tok)
            else:  # the switch marker starts the audio; ENGINE_STOP ends the request
                self.in_text = False
                if tok != SWITCH_TOKEN:
                    i = len(steps)
        self.text_ids.extend(new_text)
        return new_text, steps[i:]


def split_steps(steps: np.ndarray, start_modality: int) -> tuple[np.ndarray, np.ndarray]:
    """A whole request's steps -> (its text ids, its audio segment's steps)."""
    splitter = ModalitySplitter(start_modality)
    _, audio = splitter.push(steps)
    return np.asarray(splitter.text_ids, dtype=np.int64), audio
