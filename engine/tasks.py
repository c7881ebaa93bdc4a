"""Prompts for OpusLM's single-shot tasks, laid out as ESPnet's trained models read them.

Each builder writes ESPnet's *undelayed* sequence the way the training preprocessor does, then
delay-interleaves the whole of it, as ESPnet's model does, and keeps the rows up to the opener of
the segment to be generated. Sources: jctian98/espnet, ESPnet's SpeechLM development fork, whose
task list is the only one found that gives the released checkpoints' task ids; siddhu001/espnet,
which holds the DPO dialogue training the dialogue model's config names (`model: dpo`):

- Task ids: jctian98/espnet@19093b81 espnet2/speechlm/definitions.py::SPEECHLM_TASKS, in insertion
  order from 64: codec_ssl_asr 80, codec_ssl_tts 81, codec_ssl_plain_tts 82, codec_ssl_audiolm 83,
  text_dialogue 88, audio_dialogue 89 (modalities from 32: codec_ssl 34, text_bpe 35, spk 37).
  espnet/espnet master has since renumbered its shorter list (codec_ssl_asr is 66 there): the
  released checkpoints' token lists are what counts, and the converter checks the ids by name.
- Segments: jctian98/espnet@72221036 espnet2/train/preprocessor.py::SpeechLMPreprocessor.__call__
  and .modality_specific_processing. The sequence is <sos/eos> <task> then, per segment of the
  task's conditions then targets (SpeechLMTaskTemplate.data_triplets): [role, chat tasks only]
  <modality> content [<sos/eos>, targets only] then `inter_segment_pad` all-PAD rows. Conditions
  (what a prompt holds) have no end token. The speaker prompt (modality spk) is
  `speaker_prompt_length` frames, cut, or padded with PAD in all 9 streams when `pad_speaker_prompt`
  (.modality_specific_processing).
- Layout values: the preprocessor's arguments come from the experiment's config
  (espnet2/tasks/speechlm.py::SpeechLMTask.build_preprocess_fn; argparse defaults in
  .add_task_arguments: speaker_prompt_length 150, pad_speaker_prompt true; the same at
  jctian98@42e484b6). The converter carries the first two into the checkpoint's config
  (engine/layout.py) and every builder here takes that `layout`; `codec_token_in_use` (the row width,
  ARDelayLM's nq) must be 9, or the converter refuses the checkpoint.
- The pad: espnet2/tasks/speechlm.py::SpeechLMTask.build_preprocess_fn passes
  inter_segment_pad = codec_token_in_use - 1 (= 8) when corelm is ar_delay (jctian98@72221036,
  jctian98@42e484b6, siddhu001@f94fdb6d); the preprocessor's comment: "after the interleave, there is
  still no overlap between consecutive segments".
- Interleave: espnet2/speechlm/core_lm/ar_delay.py::ARDelayLM.forward interleaves the whole
  dec_seq (stream k lags k steps); .inference (jctian98@814cd9ab, unchanged at jctian98@42e484b6)
  interleaves the prefill (history plus the target's role/modality rows), truncated to its length,
  and feeds its last row to start; earlier (espnet@54f98b34, with espnet2/bin/speechlm_inference.py:
  start = the target modality's token) it appends [start modality, 0...] to the prefix and
  interleaves prefix + start + suffix. Same rows either way. Thanks to the 8 pad rows, interleaving
  the whole sequence equals interleaving each audio segment on its own with an 8-step tail
  (engine/dialogue.py's layout).
- Inference split: espnet2/speechlm/inference_utils.py::parse_sequence cuts at modality tokens
  (chat mode: one row earlier, at the role); a target is prefilled with its modality token (task
  mode) or role and modality (chat mode) and generated from there.

Layouts (rows of the undelayed sequence; audio is delay-interleaved, "+ 8" is the pad rows):

    ASR (codec_ssl_asr 80)           TTS (codec_ssl_tts 81; plain 82: no 37 segment)
    5 80                             5 81
    34 user audio (T frames) + 8     35 text + 8
    35  <- transcript (text)         37 speaker prompt (L frames, cut or zero-padded) + 8
                                     34  <- speech (audio)

    continuation (codec_ssl_audiolm 83)          text dialogue (text_dialogue 88)
    5 83                                         5 88
    34 prompt audio (T frames) -> more frames    [8 35 system text + 8]
       of the same segment (no end, no pads)     9 35 user text + 8
                                                 10 35 assistant text [5] + 8
                                                 ...
                                                 10 35  <- assistant text

(L: the checkpoint's speaker_prompt_length, 500 for the released models and the tiny one.)

Where this differs from the espnet/vllm fork (its opuslm.py model file): the fork's ASR path ends
the user audio with a `34` before its 8 pads (ESPnet adds no end token to a condition), and its TTS
path (`_layout_task_sequence`) lays out [5 81 35 text 0x8 34] with no `37` speaker segment between
the text and the target. We follow ESPnet's preprocessor: it made the sequences the weights learnt.

The continuation is the one task whose prompt does not end with a segment opener: ESPnet's audiolm
task is a single segment, so the prompt is its beginning and the delay pattern carries the prompt's
last frames into the first generated steps (`TaskPrompt.carry`). Here we depart from ESPnet's
inference loop on purpose: ARDelayLM.inference (jctian98@42e484b6, as @814cd9ab) forces streams
k > s to PAD at every generated step s <= nq whatever the prompt ends with, and its prefill cuts the
interleave at the prompt's length, so those codes are lost. Its training layout is the other way:
ARDelayLM.forward interleaves the whole sequence, so in the middle of a segment stream k at step s
holds frame T + s - k, a prompt frame for s < k. The carry feeds the model that sequence, the one it
was trained on. (For a fresh segment, a prompt ending with its opener, the carry is all PAD: the same
rows as ESPnet's. Our other departure, PAD right after the end token, is in engine/README.md,
"Generation".)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from engine import delay, vocab
from engine.dialogue import speaker_prompt_frames
from engine.layout import DEFAULT_LAYOUT, PromptLayout
from engine.prompt import special_rows

# ESPnet's inter_segment_pad for the delay architecture: nq - 1 all-PAD rows after every segment.
INTER_SEGMENT_PAD = delay.MAX_DELAY


@dataclass(frozen=True, eq=False)
class TaskPrompt:
    """A task's prompt and how its generation starts."""

    rows: np.ndarray  # [P, 9] int64 global ids, delay-interleaved: what the model reads
    start_modality: int  # vocab.CODEC_SSL or vocab.TEXT_BPE: the modality of the generated segment
    # [8, 9]: at generated step s, stream k > s takes carry[s, k] instead of a sampled token (the
    # delay warm-up). All PAD for a fresh segment (the engine's warm-up today); a continuation
    # carries its prompt's last frames there. Column 0 is unused (PAD).
    carry: np.ndarray

    def __post_init__(self) -> None:
        if self.rows.ndim != 2 or self.rows.shape[1] != vocab.NUM_STREAMS or self.rows.dtype != np.int64:
            raise ValueError(f"rows must be int64 [P, {vocab.NUM_STREAMS}], got {self.rows.dtype} {self.rows.shape}")
        if self.carry.shape != (delay.MAX_DELAY, vocab.NUM_STREAMS):
            raise ValueError(f"carry must be [{delay.MAX_DELAY}, {vocab.NUM_STREAMS}], got {self.carry.shape}")
        if self.start_modality not in (vocab.CODEC_SSL, vocab.TEXT_BPE):
            raise ValueError(f"start_modality {self.start_modality} is neither codec_ssl nor text_bpe")

    @property
    def continues_segment(self) -> bool:
        """True when generation continues the prompt's last segment (its carry is not all PAD)."""
        return bool(np.any(self.carry != vocab.PAD))


@dataclass(frozen=True, eq=False)
class Segment:
    """One segment of ESPnet's undelayed sequence (the preprocessor's data tuple)."""

    modality: int  # vocab.CODEC_SSL, vocab.TEXT_BPE or vocab.SPEAKER
    content: np.ndarray  # [n, 9] undelayed rows: audio frames, or text ids in stream 0 and PAD elsewhere
    role: int | None = None  # vocab.SYSTEM / USER / ASSISTANT in chat tasks; None in task mode
    end: int | None = None  # the end token ESPnet gives a target segment; None for a condition


def audio_segment(frames: np.ndarray, role: int | None = None, modality: int = vocab.CODEC_SSL) -> Segment:
    return Segment(modality, _audio(frames), role)


def speaker_segment(frames: np.ndarray, role: int | None = None, layout: PromptLayout = DEFAULT_LAYOUT) -> Segment:
    """The speaker prompt: `layout.speaker_prompt_length` frames, cut, or zero-padded when the layout pads."""
    return Segment(vocab.SPEAKER, speaker_prompt_frames(_audio(frames), layout), role)


def text_segment(text_ids: Sequence[int], role: int | None = None, end: int | None = None) -> Segment:
    return Segment(vocab.TEXT_BPE, special_rows(*_text(text_ids)), role, end)


def undelayed(task: int, segments: Sequence[Segment], opener: Sequence[int] = ()) -> np.ndarray:
    """ESPnet's dec_seq [T, 9] before the interleave: <sos/eos> <task>, each segment followed by its
    end token (if any) and INTER_SEGMENT_PAD pad rows, then the `opener` rows (role and modality)."""
    parts = [special_rows(vocab.SOS_EOS, task)]
    for seg in segments:
        parts.append(special_rows(*([] if seg.role is None else [seg.role]), seg.modality))
        parts.append(np.asarray(seg.content, dtype=np.int64).reshape(-1, vocab.NUM_STREAMS))
        if seg.end is not None:
            parts.append(special_rows(seg.end))
        parts.append(special_rows(*[vocab.PAD] * INTER_SEGMENT_PAD))
    parts.append(special_rows(*opener))
    return np.concatenate(parts)


def interleaved(seq: np.ndarray, start_modality: int) -> TaskPrompt:
    """Interleave the whole undelayed `seq`, as ESPnet does; the prompt is its first len(seq) steps and
    what the interleave spills past them (the prompt's last frames, if any) is the carry."""
    steps = delay.interleave(seq)
    return TaskPrompt(steps[: len(seq)], start_modality, steps[len(seq) :])


def asr_prompt(frames: np.ndarray) -> TaskPrompt:
    """User audio (frames [T, 9] global ids) -> the model writes its transcript."""
    seq = undelayed(vocab.TASK_ASR, [audio_segment(frames)], opener=[vocab.TEXT_BPE])
    return interleaved(seq, vocab.TEXT_BPE)


def tts_prompt(
    text_ids: Sequence[int], speaker_frames: np.ndarray | None = None, layout: PromptLayout = DEFAULT_LAYOUT
) -> TaskPrompt:
    """Text (global ids) -> speech; with `speaker_frames` (a voice to imitate) the codec_ssl_tts task,
    without it codec_ssl_plain_tts. `layout`: the checkpoint's (the speaker prompt's length)."""
    segments = [text_segment(text_ids)]
    if speaker_frames is not None and len(speaker_frames):
        segments.append(speaker_segment(speaker_frames, layout=layout))
        task = vocab.TASK_TTS
    else:
        task = vocab.TASK_PLAIN_TTS
    return interleaved(undelayed(task, segments, opener=[vocab.CODEC_SSL]), vocab.CODEC_SSL)


def continuation_prompt(frames: np.ndarray) -> TaskPrompt:
    """Audio frames [T, 9] -> more of the same audio (codec_ssl_audiolm: one segment, no roles).

    The prompt is the segment's beginning, so generation continues it: generated step s holds the SSL
    of frame T + s and, in stream k, the codebook of frame T + s - k, which for s < k is a prompt
    frame. Those values are `carry`; an engine that forces the warm-up to PAD instead feeds the model
    a sequence it never saw in training. (engine/prompt.py's synthetic prompt is a different layout,
    <sos> 83 | 9 34 audio + 8 | 10 34: roles and two segments, which ESPnet never pairs with task 83;
    it serves load tests, where the layout does not matter.)
    """
    seq = np.concatenate([undelayed(vocab.TASK_AUDIOLM, [], opener=[vocab.CODEC_SSL]), _audio(frames)])
    return interleaved(seq, vocab.CODEC_SSL)


def text_dialogue_prompt(
    messages: Sequence[tuple[int, Sequence[int]]],
    system_text_ids: Sequence[int] | None = None,
    history_end: int | None = vocab.SOS_EOS,
) -> TaskPrompt:
    """A text chat (text_dialogue 88): (role, global text ids) per message, vocab.USER or
    vocab.ASSISTANT, oldest first -> the model writes the assistant's next message.

    Past assistant messages end with `history_end` before their pads: <sos/eos> by default, since
    ESPnet's text-dialogue data marks assistant messages as targets (e.g. egs2/opuslm_sft_v1/speechlm1/
    local/data_prep_smoltalk.py) and its chat inference keeps a generated segment's <sos/eos> in the
    context; vocab.EOU matches the dialogue model's fork (mid-dialogue targets end with <eou>), None the
    espnet/vllm fork (no end token).
    """
    segments = []
    if system_text_ids is not None:
        segments.append(text_segment(system_text_ids, vocab.SYSTEM))
    for role, ids in messages:
        if role not in (vocab.USER, vocab.ASSISTANT):
            raise ValueError(f"a message's role is vocab.USER or vocab.ASSISTANT, got {role}")
        segments.append(text_segment(ids, role, history_end if role == vocab.ASSISTANT else None))
    seq = undelayed(vocab.TASK_TEXT_DIALOGUE, segments, opener=[vocab.ASSISTANT, vocab.TEXT_BPE])
    return interleaved(seq, vocab.TEXT_BPE)


def _audio(frames: np.ndarray) -> np.ndarray:
    frames = np.asarray(frames)
    if frames.ndim != 2 or frames.shape[1] != vocab.NUM_STREAMS or len(frames) == 0:
        raise ValueError(f"audio must be frames [T >= 1, {vocab.NUM_STREAMS}], got shape {frames.shape}")
    if not vocab.in_stream_range(frames).all():
        raise ValueError("audio frames hold ids outside their streams' ranges (SSL in stream 0, codebook k in k+1)")
    return frames.astype(np.int64)


def _text(text_ids: Sequence[int]) -> list[int]:
    ids = [int(i) for i in np.asarray(text_ids, dtype=np.int64).reshape(-1)]
    if not ids:
        raise ValueError("a text segment needs at least one token")
    if min(ids) < vocab.TEXT_OFFSET:
        raise ValueError(f"text ids are global (tokenizer id + {vocab.TEXT_OFFSET}), got {min(ids)}")
    return ids
