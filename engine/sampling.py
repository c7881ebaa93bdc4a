"""Sampling of the auxiliary streams (1-8), shared by the vLLM model and the reference.

vLLM samples stream 0 with its own sampler; the model samples streams 1-8 in the same forward
with the request's own parameters, in the order vLLM uses: temperature, top-k, top-p, draw.
Temperature 0 means greedy.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

_SAMPLING_EPS = 1e-5
# Offsets the aux generator's seed from the one vLLM gives stream 0, so the two draw differently.
_AUX_SEED_SALT = 0x0A0C_5EED


@dataclass(frozen=True)
class SamplingConfig:
    """Per-request sampling parameters, applied to all 9 streams (as ESPnet does)."""

    temperature: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be >= -1, got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature < _SAMPLING_EPS

    def aux_generator(self, device: torch.device | str = "cpu") -> torch.Generator | None:
        if self.seed is None or self.greedy:
            return None
        return torch.Generator(device=device).manual_seed((self.seed + _AUX_SEED_SALT) % (2**63))


GREEDY = SamplingConfig(temperature=0.0)


def sample_rows(
    logits: torch.Tensor, configs: list[SamplingConfig], generators: list[torch.Generator | None]
) -> torch.Tensor:
    """Sample one id per row of `logits` [rows, ..., C] along the last axis, vectorised.

    Steps: greedy rows take the argmax; the others are scaled by temperature, cut to their top-k
    and top-p, and drawn by the exponential race. Each row may have its own generator: seeded rows
    draw their noise from it, so a request's draws do not depend on its batch companions.
    When every sampling row has a top-k, only its k candidates are ever looked at again: with
    8 streams x 1024 codes per row, the full-width work would dominate the step on a CPU.
    """
    rows, width = logits.shape[0], logits.shape[-1]
    greedy = [c.greedy for c in configs]
    if rows == 0 or all(greedy):
        return logits.argmax(dim=-1)
    dev = logits.device
    bshape = (rows,) + (1,) * (logits.dim() - 1)
    temps = torch.tensor([1.0 if c.greedy else c.temperature for c in configs], device=dev).view(bshape)
    top_ks = [0 if g else (c.top_k if 0 < c.top_k < width else 0) for c, g in zip(configs, greedy)]
    cand_idx = None
    if all(k for k, g in zip(top_ks, greedy) if not g):
        # the top k do not depend on a positive temperature: select first, scale only the k
        cand, cand_idx = _top_candidates(logits.float(), top_ks)
        cand = cand / temps
    else:
        x = logits.float() / temps
        for i, k in enumerate(top_ks):
            if k:
                x[i] = x[i].masked_fill(x[i] < torch.topk(x[i], k, dim=-1).values[..., -1:], float("-inf"))
        cand = x
    top_ps = torch.tensor([c.top_p for c in configs], device=dev)
    if bool((top_ps < 1.0).any()):
        cand = _apply_top_p(cand, top_ps.view(bshape), presorted=cand_idx is not None)
    uniform = torch.rand_like(cand)
    for i, gen in enumerate(generators):
        if gen is not None and not greedy[i]:
            # as many draws as the row's own candidates, so the batch does not shift its stream
            n = top_ks[i] if cand_idx is not None and top_ks[i] else cand.shape[-1]
            uniform[i, ..., :n] = torch.rand(uniform[i, ..., :n].shape, generator=gen, device=dev)
    # exponential race: argmax p / q with q ~ Exp(1) draws from p (one log instead of Gumbel's two)
    race = cand.softmax(dim=-1) / -torch.log(uniform.clamp(1e-10, 1.0 - 1e-7))
    drawn = race.argmax(dim=-1, keepdim=True)
    if cand_idx is not None:
        drawn = cand_idx.gather(-1, drawn)
    if not any(greedy):
        return drawn.squeeze(-1)
    greedy_t = torch.tensor(greedy, device=dev).view(bshape[:-1])
    return torch.where(greedy_t, logits.argmax(dim=-1), drawn.squeeze(-1))


def _top_candidates(x: torch.Tensor, top_ks: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The best max(k) entries of each row, sorted best first; entries past a row's k are -inf."""
    kmax, width = max(top_ks), x.shape[-1]
    if x.device.type == "cpu":  # introselect: a few times faster than torch.topk on a CPU
        xn = x.numpy()
        part = np.argpartition(xn, width - kmax, axis=-1)[..., width - kmax :]
        idx = torch.from_numpy(np.ascontiguousarray(part))
        vals = torch.from_numpy(np.take_along_axis(xn, part, axis=-1))
    else:
        vals, idx = torch.topk(x, kmax, dim=-1, sorted=False)
    vals, order = torch.sort(vals, dim=-1, descending=True)
    idx = idx.gather(-1, order)
    ks = torch.tensor([k or kmax for k in top_ks], device=x.device).view((-1,) + (1,) * (x.dim() - 1))
    vals = vals.masked_fill(torch.arange(kmax, device=x.device) >= ks, float("-inf"))
    return vals, idx


def _apply_top_p(x: torch.Tensor, top_p: torch.Tensor, presorted: bool) -> torch.Tensor:
    """Keep the smallest best-first prefix whose mass reaches top_p (the best always stays)."""
    if presorted:
        p = x.softmax(dim=-1)
        return x.masked_fill((p.cumsum(dim=-1) - p) >= top_p, float("-inf"))
    sorted_x, sorted_idx = torch.sort(x, dim=-1, descending=True)
    p = sorted_x.softmax(dim=-1)
    drop_sorted = (p.cumsum(dim=-1) - p) >= top_p
    return x.masked_fill(torch.zeros_like(drop_sorted).scatter(-1, sorted_idx, drop_sorted), float("-inf"))
