"""Measure how many frames of context a windowed stage needs, by probing it.

Streaming cuts non-causal conv stacks into windows; a window must reach as far as the stack's
receptive field so that its kept frames equal the offline result. Measuring beats deriving it by
hand from kernels, dilations, strides and padding rules, and stays right when a config changes.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

_PROBE_FRAMES = 96


@torch.inference_mode()
def context_frames(
    fn: Callable[[torch.Tensor], torch.Tensor],
    in_channels: int,
    in_per_frame: int,
    out_per_frame: int,
    device: torch.device | str = "cpu",
    seed: int = 0,
) -> tuple[int, int]:
    """(left, right): output frame t depends on input frames [t - left, t + right] only.

    `fn` maps [1, in_channels, n * in_per_frame] -> [1, C, n * out_per_frame]. The probe changes
    one input frame in the middle of a long random input and sees which output frames move.
    """
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(1, in_channels, _PROBE_FRAMES * in_per_frame, generator=gen).to(device)
    probe = _PROBE_FRAMES // 2
    x2 = x.clone()
    x2[..., probe * in_per_frame : (probe + 1) * in_per_frame] += 1.0
    diff = (fn(x2) - fn(x)).abs().amax(dim=(0, 1))
    moved = torch.nonzero(diff > 0).flatten()
    if moved.numel() == 0:
        return 0, 0
    first = int(moved[0]) // out_per_frame
    last = int(moved[-1]) // out_per_frame
    if first == 0 or last >= _PROBE_FRAMES - 1:
        raise ValueError(f"receptive field exceeds the {_PROBE_FRAMES}-frame probe")
    return last - probe, probe - first
