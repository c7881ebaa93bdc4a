"""The layout values a checkpoint was trained with: what ESPnet's preprocessor reads from the
experiment's config and the prompts must repeat. Pure numpy, no torch.

ESPnet builds every training sequence in espnet2/train/preprocessor.py::SpeechLMPreprocessor
(jctian98/espnet@72221036, `__init__` and `modality_specific_processing`) from the values
espnet2/tasks/speechlm.py::SpeechLMTask.build_preprocess_fn passes it (the same at jctian98/espnet@42e484b6
and espnet/espnet@07efb0b2):

- `speaker_prompt_length` (argparse default 150 in ESPnet; 500 in the released configs, and the
  espnet/vllm fork's default): a speaker prompt (modality `spk`) longer than this is cut to this many
  frames (ESPnet: a random window in training; here the first frames).
- `pad_speaker_prompt` (default true): a shorter one is padded to that length with PAD in every stream;
  false keeps it at its own length.
- `codec_token_in_use`: the streams per frame the model reads and writes (`nq` of ARDelayLM), hence
  `inter_segment_pad` = codec_token_in_use - 1 for ar_delay. The engine serves exactly
  vocab.NUM_STREAMS (SSL + 8 codebooks): the converter refuses any other value, so it is not a field here.

The converter (engine/convert/espnet.py) writes these into config.json's `opuslm` block
(engine/checkpoint.py); the tiny model keeps the defaults below.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine import vocab

DEFAULT_SPEAKER_PROMPT_LENGTH = 500  # the released configs' and the espnet/vllm fork's value; the tiny model's


@dataclass(frozen=True)
class PromptLayout:
    """How a checkpoint lays out the parts of a prompt whose size its training config fixes."""

    speaker_prompt_length: int = DEFAULT_SPEAKER_PROMPT_LENGTH  # frames
    pad_speaker_prompt: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.speaker_prompt_length, bool) or not isinstance(self.speaker_prompt_length, int):
            raise ValueError(f"speaker_prompt_length must be an int, got {self.speaker_prompt_length!r}")
        if self.speaker_prompt_length < 1:
            raise ValueError(f"speaker_prompt_length must be >= 1, got {self.speaker_prompt_length}")
        if not isinstance(self.pad_speaker_prompt, bool):
            raise ValueError(f"pad_speaker_prompt must be true or false, got {self.pad_speaker_prompt!r}")

    def speaker_frames(self, frames: np.ndarray) -> np.ndarray:
        """A speaker prompt as ESPnet lays it out: its first `speaker_prompt_length` frames, then (with
        `pad_speaker_prompt`) all-PAD frames up to that length."""
        frames = np.asarray(frames, dtype=np.int64).reshape(-1, vocab.NUM_STREAMS)[: self.speaker_prompt_length]
        if not self.pad_speaker_prompt:
            return frames
        pad = np.full((self.speaker_prompt_length - len(frames), vocab.NUM_STREAMS), vocab.PAD, dtype=np.int64)
        return np.concatenate([frames, pad])

    def speaker_rows(self, given: int) -> int:
        """The frames a speaker segment holds for a voice of `given` frames (0: no speaker segment)."""
        if given <= 0:
            return 0
        return self.speaker_prompt_length if self.pad_speaker_prompt else min(given, self.speaker_prompt_length)


DEFAULT_LAYOUT = PromptLayout()
