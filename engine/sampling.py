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
# The text phase's stream-0 generator (the engine samples text itself, engine/modality.py).
_TEXT_SEED_SALT = 0x7E47_5EED


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
        return self._generator(_AUX_SEED_SALT, device)

    def text_generator(self, device: torch.device | str = "cpu") -> torch.Generator | None:
        return self._generator(_TEXT_SEED_SALT, device)

    def _generator(self, salt: int, device: torch.device | str) -> torch.Generator | None:
        if self.seed is None or self.greedy:
            return None
        return torch.Generator(device=device).manual_seed((self.seed + salt) % (2**63))


GREEDY = SamplingConfig(temperature=0.0)


def sample_rows(
    logits: torch.Tensor, configs: list[SamplingConfig], generators: list[torch.Generator | None]
) -> torch.Tensor:
    """Sample one id per row of `logits` [rows, ..., C] along the last axis, vectorised.

    Steps: greedy rows take the argmax; the others are scaled by temperature, cut to their top-k
    (every entry at or above the k-th largest value, ties included, as vLLM does) and top-p, and
    drawn by the exponential race. Each row may have its own generator: seeded rows draw their
    noise from it, so a request's draws do not depend on its batch companions.
    When every sampling row has a top-k, only its candidates are ever looked at again: with
    8 streams x 1024 codes per row, the full-width work would dominate the step on a CPU.
    """
    greedy, top_ks = row_limits(configs, logits.shape[-1])
    if logits.shape[0] == 0 or all(greedy):
        return logits.argmax(dim=-1)
    if logits.device.type == "cpu" and all(k for k, g in zip(top_ks, greedy) if not g):
        return torch.from_numpy(_sample_top_k_numpy(logits.float().numpy(), configs, generators, greedy, top_ks))
    return _sample_torch(logits, configs, generators, greedy, top_ks)


def row_limits(configs: list[SamplingConfig], width: int) -> tuple[list[bool], list[int]]:
    """Per row: greedy or not, and its top-k (0: none, also when k covers the whole width)."""
    greedy = [c.greedy for c in configs]
    return greedy, [0 if g else (c.top_k if 0 < c.top_k < width else 0) for c, g in zip(configs, greedy)]


def _sample_torch(
    logits: torch.Tensor,
    configs: list[SamplingConfig],
    generators: list[torch.Generator | None],
    greedy: list[bool],
    top_ks: list[int],
) -> torch.Tensor:
    """sample_rows on any device, in full-width torch ops (cheap where a GPU runs them)."""
    rows = logits.shape[0]
    dev = logits.device
    bshape = (rows,) + (1,) * (logits.dim() - 1)
    temps = torch.tensor([1.0 if c.greedy else c.temperature for c in configs], device=dev).view(bshape)
    x = logits.float() / temps
    if any(top_ks):
        kmax = max(top_ks)
        top = torch.topk(x, kmax, dim=-1).values
        ks = torch.tensor([max(k, 1) for k in top_ks], device=dev).view(bshape)
        kth = top.gather(-1, (ks - 1).expand(top.shape[:-1] + (1,)))
        kth = kth.masked_fill(torch.tensor([k == 0 for k in top_ks], device=dev).view(bshape), float("-inf"))
        x = x.masked_fill(x < kth, float("-inf"))
    top_ps = torch.tensor([c.top_p for c in configs], device=dev)
    if bool((top_ps < 1.0).any()):
        x = _apply_top_p(x, top_ps.view(bshape))
    uniform = torch.rand_like(x)
    for i, gen in enumerate(generators):
        if gen is not None and not greedy[i]:
            uniform[i] = torch.rand(uniform[i].shape, generator=gen, device=dev)
    # exponential race: argmax p / q with q ~ Exp(1) draws from p (one log instead of Gumbel's two)
    drawn = (x.softmax(dim=-1) / -torch.log(uniform.clamp(1e-10, 1.0 - 1e-7))).argmax(dim=-1)
    if not any(greedy):
        return drawn
    greedy_t = torch.tensor(greedy, device=dev).view(bshape[:-1])
    return torch.where(greedy_t, logits.argmax(dim=-1), drawn)


def _sample_top_k_numpy(
    x: np.ndarray,
    configs: list[SamplingConfig],
    generators: list[torch.Generator | None],
    greedy: list[bool],
    top_ks: list[int],
) -> np.ndarray:
    """sample_rows on a CPU when every sampling row has a top-k, in numpy.

    Why numpy: the candidates are small ([rows x 8, ~k]) and torch runs even small softmax, log
    and sort ops as OpenMP parallel regions, whose hand-offs between the two threads of a busy
    2-core engine cost more than the arithmetic; numpy's vectorised partition of values is also
    several times faster than an argpartition or torch.topk over 8 x 1024 codes per request.
    """
    rows, width = x.shape[0], x.shape[-1]
    flat = x.reshape(-1, width)
    per_row = flat.shape[0] // rows  # e.g. the 8 streams of a request
    kmax = max(top_ks)
    ks = np.repeat([k or kmax for k in top_ks], per_row)
    # each row's threshold: its k-th largest value; the entries at or above it are its candidates
    part = np.partition(flat, sorted({width - int(k) for k in set(ks.tolist())}), axis=-1)
    kth = part[np.arange(len(flat)), width - ks]
    vals, cols = _at_or_above(flat, kth)
    temps = np.repeat([1.0 if c.greedy else c.temperature for c in configs], per_row).astype(np.float32)
    top_ps = np.repeat([c.top_p for c in configs], per_row)
    nucleus = np.nonzero(top_ps < 1.0)[0]
    if len(nucleus):
        # those rows best first (only those: a row's order must not depend on its companions),
        # then the smallest prefix whose mass reaches top_p
        v, c = vals[nucleus], cols[nucleus]
        order = np.argsort(-v, axis=-1, kind="stable")
        v, c = np.take_along_axis(v, order, -1), np.take_along_axis(c, order, -1)
        p = _softmax(v / temps[nucleus, None])
        vals[nucleus] = np.where((np.cumsum(p, axis=-1) - p) >= top_ps[nucleus, None], -np.inf, v)
        cols[nucleus] = c
    uniform = torch.rand(vals.shape).numpy()
    for i, gen in enumerate(generators):
        if gen is not None and not greedy[i]:
            # as many draws as the request's own candidates, so the batch does not shift its stream
            block = slice(i * per_row, (i + 1) * per_row)
            n = int(np.isfinite(vals[block]).sum(-1).max())
            uniform[block, :n] = torch.rand((per_row, n), generator=gen).numpy()
    # exponential race: argmax p / q, q ~ Exp(1), draws from p; p's normaliser does not matter
    with np.errstate(divide="ignore"):
        weight = np.exp((vals - vals.max(-1, keepdims=True)) / temps[:, None])
        race = weight / -np.log(np.clip(uniform, 1e-10, 1.0 - 1e-7))
    drawn = cols[np.arange(len(cols)), race.argmax(-1)]
    if any(greedy):
        g = np.repeat(greedy, per_row)
        drawn[g] = flat[g].argmax(-1)
    return drawn.reshape(x.shape[:-1])


def _softmax(z: np.ndarray) -> np.ndarray:
    e = np.exp(z - z.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _at_or_above(flat: np.ndarray, kth: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each row's entries >= its threshold: (values, columns) [rows, c], -inf padded.

    Usually every row has exactly k of them; ties at a threshold make a row longer.
    """
    width = flat.shape[-1]
    hits = np.flatnonzero(flat >= kth[:, None])  # several times faster than a 2-D np.nonzero
    rows, cols = np.divmod(hits, width)
    counts = np.bincount(rows, minlength=flat.shape[0])
    c = int(counts.max())
    if len(hits) == c * flat.shape[0]:
        cols = cols.reshape(-1, c)
        return np.take_along_axis(flat, cols, axis=-1), cols
    slot = np.arange(len(rows)) - np.repeat(np.cumsum(counts) - counts, counts)
    vals = np.full((flat.shape[0], c), -np.inf, dtype=flat.dtype)
    out_cols = np.zeros((flat.shape[0], c), dtype=np.int64)
    vals[rows, slot] = flat[rows, cols]
    out_cols[rows, slot] = cols
    return vals, out_cols


def _apply_top_p(x: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep the smallest best-first prefix whose mass reaches top_p (the best always stays)."""
    sorted_x, sorted_idx = torch.sort(x, dim=-1, descending=True)
    p = sorted_x.softmax(dim=-1)
    drop_sorted = (p.cumsum(dim=-1) - p) >= top_p
    return x.masked_fill(torch.zeros_like(drop_sorted).scatter(-1, sorted_idx, drop_sorted), float("-inf"))
