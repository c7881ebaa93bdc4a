"""Sampling of the auxiliary streams (1-8), shared by the vLLM model and the reference.

vLLM samples stream 0 with its own sampler; the model samples streams 1-8 in the same forward
with the request's own parameters, in the order vLLM uses: temperature, top-k, top-p, draw.
Temperature 0 means greedy.
"""

from __future__ import annotations

from dataclasses import dataclass

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

    Each row has its own config and optional generator; seeded rows draw their noise from their
    own generator, so a request's draws do not depend on which other requests share the batch.
    Draws use the exponential race (argmax p / q with q ~ Exp(1)), as vLLM's sampler does.
    """
    rows = logits.shape[0]
    if rows == 0:
        return torch.empty(logits.shape[:-1], dtype=torch.long, device=logits.device)
    greedy = torch.tensor([c.greedy for c in configs], device=logits.device)
    best = logits.argmax(dim=-1)
    if bool(greedy.all()):
        return best
    bshape = (rows,) + (1,) * (logits.dim() - 1)
    temps = torch.tensor([1.0 if c.greedy else c.temperature for c in configs], device=logits.device)
    x = logits.float() / temps.view(bshape)
    top_ks = [c.top_k if 0 < c.top_k < logits.shape[-1] else 0 for c in configs]
    if any(top_ks):
        kmax = max(top_ks)
        vals = torch.topk(x, kmax, dim=-1).values  # [rows, ..., kmax]
        k_idx = torch.tensor([max(k, 1) - 1 if k else kmax - 1 for k in top_ks], device=x.device)
        kth = vals.gather(-1, k_idx.view(bshape).expand(*vals.shape[:-1], 1))
        use_k = torch.tensor([k > 0 for k in top_ks], device=x.device).view(bshape)
        x = x.masked_fill(use_k & (x < kth), float("-inf"))
    top_ps = torch.tensor([c.top_p for c in configs], device=x.device)
    if bool((top_ps < 1.0).any()):
        sorted_x, sorted_idx = torch.sort(x, dim=-1, descending=True)
        p_sorted = sorted_x.softmax(dim=-1)
        # drop a token once the mass before it already reaches top_p (the best always stays)
        drop_sorted = (p_sorted.cumsum(dim=-1) - p_sorted) >= top_ps.view(bshape)
        x = x.masked_fill(torch.zeros_like(drop_sorted).scatter(-1, sorted_idx, drop_sorted), float("-inf"))
    probs = x.softmax(dim=-1)
    noise = torch.empty_like(probs).exponential_()
    for i, gen in enumerate(generators):
        if gen is not None and not configs[i].greedy:
            noise[i].exponential_(generator=gen)
    drawn = (probs / noise.clamp_min(1e-20)).argmax(dim=-1)
    return torch.where(greedy.view(bshape[:-1]), best, drawn)
