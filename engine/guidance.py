"""Classifier-free guidance: the unconditional prompt, the merge, and the shadow's name.

A request with `cfg_scale` w != 1 is generated from two sequences run side by side: its own
(conditional) and a shadow holding the unconditional prompt. Every step both rows' logits are
merged, for all 9 streams, and both rows receive the same sampled tokens, so after the prompt the
two sequences differ only in what they were conditioned on.

Rules (the espnet/vllm fork's, the only CFG code in the OpusLM family; ESPnet's own `ar_delay.py`
has none -- shared/research/opuslm.md §5):

- Unconditional prompt: the main prompt with every position PAD (0) in all 9 streams, same length
  (`[0] * len(prompt)` in the fork). Equal lengths keep the two rows at equal positions, so their
  delay-pattern steps, stop rules and KV needs are the same at every step.
- Merge: logits = cond * w + uncond * (1 - w)  (= uncond + w * (cond - uncond)), for all 9
  streams, before the stream masks; w = 1 is plain sampling, w = 0 samples the unconditional
  model. Every stream's logits are lm_head(h) + a per-stream constant (heads.py), linear in the
  final hidden state h, so both the engine and the reference merge h (H wide) and project the
  merged state once -- the same logits as merging the V-wide projections, up to rounding.

Pure numpy / torch; shared by the vLLM plugin and the reference, so both merge bit for bit alike.
"""

from __future__ import annotations

import numpy as np
import torch

from engine import vocab

# The shadow of request "R" is "R#uncond"; callers may not use ids containing the suffix.
SHADOW_SUFFIX = "#uncond"
_NO_CFG_EPS = 1e-6


def uses_cfg(scale: float) -> bool:
    return abs(float(scale) - 1.0) > _NO_CFG_EPS


def shadow_id(main_id: str) -> str:
    return main_id + SHADOW_SUFFIX


def unconditional_prompt(prompt: np.ndarray) -> np.ndarray:
    """[P, 9] -> [P, 9] of PAD: the condition removed, the length (and so every position) kept."""
    return np.full(np.asarray(prompt).shape, vocab.PAD, dtype=np.int64)


def merge(cond: torch.Tensor, uncond: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """uncond + w * (cond - uncond) (= cond * w + uncond * (1 - w)), row-wise: cond/uncond
    [rows, ...], scale [rows]. One fused pass (torch.lerp)."""
    w = scale.to(cond.dtype).view((-1,) + (1,) * (cond.dim() - 1))
    return torch.lerp(uncond, cond, w)
