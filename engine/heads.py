"""OpusLM output heads: stream k's logits = lm_head(h + head_emb[k]), restricted to its range.

Since lm_head is linear, lm_head(h + e_k) = lm_head(h) + lm_head(e_k): the per-stream vector only
adds a constant bias over the stream's own ids. So one projection of h with a bias precomputed
once from the weights (`stream_bias`) gives every stream's logits -- one GEMM for 9 streams, the
bias fused into it, and the vLLM model uses vLLM's own GEMM kernel for it. Only lm_head's audio
rows [0, AUDIO_END) are projected for audio rows; text-phase rows project the text rows instead
(below). For the released models, whose text vocabulary is several times the audio one, projecting
both for every row would make the text rows most of the head's cost.

Shared by the vLLM model and the reference so both apply the same masks.
"""

from __future__ import annotations

import numpy as np
import torch

from engine import modality, vocab
from engine.delay import Stream0Rule

_FORCED_TOKEN = {
    Stream0Rule.FORCE_EOS: vocab.SOS_EOS,
    Stream0Rule.FORCE_PAD: vocab.PAD,
    Stream0Rule.FORCE_STOP: vocab.ENGINE_STOP,
}
_SSL_LO, _SSL_HI = vocab.stream_range(0)
AUDIO_END = vocab.TEXT_OFFSET  # ids [0, AUDIO_END): specials, SSL, the 8 DAC codebooks


@torch.no_grad()
def stream_bias(lm_head: torch.Tensor, head_emb: torch.Tensor) -> torch.Tensor:
    """[AUDIO_END] float32: lm_head(head_emb[k]) over stream k's ids (stream 0 owns [0, 5256))."""
    w = lm_head[:AUDIO_END].float()
    e = head_emb.float()
    bias = torch.empty(AUDIO_END, dtype=torch.float32, device=lm_head.device)
    bias[:_SSL_HI] = w[:_SSL_HI] @ e[0]
    for k in range(1, vocab.NUM_STREAMS):
        lo, hi = vocab.stream_range(k)
        bias[lo:hi] = w[lo:hi] @ e[k]
    return bias


def project(h: torch.Tensor, lm_head: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """Every stream's logits [rows, AUDIO_END] float32: lm_head's audio rows + `stream_bias`.

    (The vLLM model computes the same with vLLM's GEMM kernel.)"""
    return torch.nn.functional.linear(h, lm_head[:AUDIO_END], bias.to(lm_head.dtype)).float()


def aux_logits(logits: torch.Tensor) -> torch.Tensor:
    """[rows, 8, 1024] logits of streams 1-8 over their own codebook blocks (a view)."""
    return logits[:, vocab.DAC_OFFSET : AUDIO_END].view(-1, vocab.NUM_CODEBOOKS, vocab.CODEBOOK_SIZE)


# Stream 0 emits only ids below this in an audio segment (specials, SSL); its logits stop here, so
# a sampler looks at 5256 ids instead of the whole vocabulary and a sampled index is the global id.
STREAM0_WIDTH = _SSL_HI


def stream0_logits_(logits: torch.Tensor, rules: np.ndarray) -> torch.Tensor:
    """Stream 0's logits [rows, STREAM0_WIDTH], written over `logits` (take `aux_logits` first).

    Stream 0 samples SSL ids, plus EOS where the rule allows it; everything else is -inf, and a
    forced row gets a single finite entry, so any sampler (greedy or not) picks it. Working in
    place saves passes over a [rows, vocab] tensor per step.
    """
    out = logits[:, :STREAM0_WIDTH]
    rules_t = torch.from_numpy(np.asarray(rules, dtype=np.int64)).to(out.device)
    eos = torch.where(rules_t == Stream0Rule.SSL_OR_EOS, out[:, vocab.SOS_EOS], float("-inf"))
    out[:, :_SSL_LO] = float("-inf")
    out[:, vocab.SOS_EOS] = eos
    forced = np.nonzero(np.asarray(rules) >= Stream0Rule.FORCE_EOS)[0]
    if len(forced):
        idx = torch.from_numpy(forced).to(out.device)
        tok = torch.tensor([_FORCED_TOKEN[Stream0Rule(int(rules[i]))] for i in forced], device=out.device)
        out[idx] = float("-inf")
        out[idx, tok] = 0.0
    return out


_CODEBOOK_BASE = vocab.DAC_OFFSET + vocab.CODEBOOK_SIZE * np.arange(vocab.NUM_CODEBOOKS)


def aux_ids(codes: np.ndarray, active: np.ndarray, fill: np.ndarray | int = vocab.PAD) -> np.ndarray:
    """Local codes [rows, 8] -> global ids; where the stream is not active this step, `fill` (PAD, or a
    continued segment's carried prompt codes during the warm-up: `carry_fill`)."""
    return np.where(active, np.asarray(codes, dtype=np.int64) + _CODEBOOK_BASE, fill)


def carry_fill(carry: np.ndarray | None, audio_step: int) -> np.ndarray | int:
    """What inactive aux streams hold at audio step `audio_step` of a request with `carry` [8, 8]: its
    row during the warm-up, PAD otherwise."""
    if carry is None or not 0 <= audio_step < len(carry):
        return vocab.PAD
    return carry[audio_step]


# --- the text phase (engine/modality.py) ---------------------------------------------------------
# A text-phase row samples stream 0 over [EOS, switch marker, text ids...]; only those rows pay for
# lm_head's text rows, and they skip the audio rows (and streams 1-8, which are PAD in text).


@torch.no_grad()
def text_bias(lm_head: torch.Tensor, head_emb: torch.Tensor, text_end: int) -> torch.Tensor:
    """[2 + text_size] float32: stream 0's bias (lm_head(head_emb[0])) over the text candidates."""
    w = lm_head[list(modality.MARKER_IDS)].float(), lm_head[vocab.TEXT_OFFSET : text_end].float()
    e = head_emb[0].float()
    return torch.cat([w[0] @ e, w[1] @ e])


def text_logits(h: torch.Tensor, lm_head: torch.Tensor, bias: torch.Tensor, text_end: int) -> torch.Tensor:
    """Stream 0's logits [rows, 2 + text_size] float32 over the text candidates (modality.py's columns).

    (The vLLM model computes the text block with vLLM's GEMM kernel.)"""
    markers = torch.nn.functional.linear(h, lm_head[list(modality.MARKER_IDS)], bias[: modality.TEXT_COLUMN0].to(lm_head.dtype))
    text = torch.nn.functional.linear(h, lm_head[vocab.TEXT_OFFSET : text_end], bias[modality.TEXT_COLUMN0 :].to(lm_head.dtype))
    return torch.cat([markers, text], dim=-1).float()


def mask_text_logits_(logits: torch.Tensor, rules: np.ndarray, switch: np.ndarray) -> torch.Tensor:
    """-inf over the columns each row may not sample (modality.candidate_mask), in place; a forced row
    keeps one finite entry, so any sampler picks it."""
    allowed = torch.from_numpy(modality.candidate_mask(rules, switch, logits.shape[-1])).to(logits.device)
    forced = torch.from_numpy(np.asarray(rules) >= modality.TextRule.FORCE_EOS).to(logits.device)
    logits.masked_fill_(~allowed, float("-inf"))
    return logits.masked_fill_(forced[:, None] & allowed, 0.0)
