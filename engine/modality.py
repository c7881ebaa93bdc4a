"""Text and audio in one request: which modality each generated step is in, what stream 0 may emit in
a text phase, and how a request's steps split into its text and its audio. Pure numpy, no torch.

ESPnet's loop, the one that matches the released checkpoints (one shared `lm_head` for all 9 streams
plus the per-stream `head_emb`; no `aux_lm_head`, which the converter refuses):
espnet2/speechlm/core_lm/ar_delay.py::ARDelayLM.inference at jctian98/espnet@42e484b6 (master of the
fork that carries ESPnet's SpeechLM code, the branch of espnet/espnet PR #6146; its sampling loop is
jctian98/espnet@814cd9ab's but for the end detection, engine/README.md "Generation"). It is driven
by espnet2/bin/speechlm_inference.py::SpeechLM.__call__, which cuts the sequence into segments
(espnet2/speechlm/inference_utils.py::parse_sequence) and makes one `inference` call per target
segment, with the mask and sampling options of that segment's modality: the marker that ends the
prefill (`<codec_ssl_start/end>` or `<text_bpe_start/end>`; inference_utils.py::build_inference_config,
::build_mask). Within a call the modality never changes: in audio, stream 0 samples SSL ids (or its
own marker, or `<sos/eos>` after `minlen`) and stream k its codebook or PAD; in text, stream 0 samples
text ids (or its marker, or `<sos/eos>`) and streams 1-8 only PAD. `<sos/eos>` ends the segment.

An older loop (espnet/espnet@54f98b34 ARDelayLM.inference, with the masks of espnet2/bin/
speechlm_inference.py SpeechLM.__init__) had an `aux_lm_head` for streams 1-8 and switched modality
when stream 0 emitted a marker in [32, 64): not the released checkpoints' architecture.

What we serve of it, and where we differ:
- A request starts in audio (`vocab.CODEC_SSL`, today's segments) or in text (`vocab.TEXT_BPE`): the
  modality of its prompt's last marker, as ESPnet picks the segment's options.
- A text phase may switch to audio (stream 0 emits `CODEC_SSL`) when the request allows it. This is
  ours, not ESPnet's current loop: ESPnet's chat inference, and our dialogue answers, run an answer's
  text and its audio as two calls (engine/README.md, "Text and audio in one request"); the switch
  serves multi-target task prompts and `duplex generate`. Only that marker is offered (a switch into
  speaker, or text into text, is meaningless). The audio segment then starts exactly as a prompt's
  `34` opener starts one: with the delay warm-up (stream k PAD for its first k steps), because ESPnet's
  training layout (the whole sequence interleaved, ARDelayLM.forward) has text rows PAD in streams 1-8,
  so the codebooks right after the marker are PAD.
- An audio phase never switches back to text: no served layout has generated text after generated
  audio in one turn, and the audio segment would need its delay tail flushed first.
- Streams 1-8 never sample PAD inside an audio segment (ESPnet's mask allows it): a DAC frame with a
  PAD cannot be decoded. Their warm-up and flush PADs are forced, as ESPnet forces them.
- EOS in a text phase ends the request at once: a text segment has nothing delayed to flush (ESPnet
  still runs its flush steps, all PAD in streams 1-8). It leaves the engine as `ENGINE_STOP` (the
  request's only stop token), so no extra step is run.
- `max_text_tokens` forces the end of the text: the switch when the request allows one (the answer
  still gets its audio), else EOS (ESPnet forces `<sos/eos>` where its `maxlen` would cut the flush).

The two places where our audio steps depart from ESPnet's loop on purpose (the warm-up of a continued
segment carries the prompt's frames; PAD right after the end token) follow ESPnet's training layout
instead: engine/README.md, "Generation", gives the argument.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum

import numpy as np
import numpy.typing as npt

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


def text_rules(steps: npt.ArrayLike, min_text: npt.ArrayLike, max_text: npt.ArrayLike, switch: npt.ArrayLike) -> np.ndarray:
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
