"""OpusLM output heads: stream k's logits = lm_head(h + head_emb[k]), restricted to its range.

Since lm_head is linear, lm_head(h + e_k) = lm_head(h) + lm_head(e_k): the per-stream vector only
adds a constant bias over the stream's own ids. So one projection of h over the audio ids
[0, 13448) plus a bias precomputed once from the weights (`stream_bias`) gives every stream's
logits -- one matmul for 9 streams, and the vLLM model can use vLLM's own lm_head kernel.

Shared by the vLLM model and the reference so both apply the same masks.
"""

from __future__ import annotations

import numpy as np
import torch

from engine import vocab
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


def audio_logits(h: torch.Tensor, lm_head: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """[rows, AUDIO_END] float32 logits of every stream over the audio ids (plain matmul)."""
    return torch.nn.functional.linear(h, lm_head[:AUDIO_END]).float() + bias


def stream0_logits(audio: torch.Tensor, rules: np.ndarray, vocab_size: int) -> torch.Tensor:
    """[rows, vocab_size] float32 logits for stream 0; disallowed ids are -inf.

    Stream 0 samples SSL ids, plus EOS where the rule allows it; forced rows get a single finite
    entry, so any sampler (greedy or not) picks it.
    """
    rows = audio.shape[0]
    out = torch.full((rows, vocab_size), float("-inf"), dtype=torch.float32, device=audio.device)
    out[:, _SSL_LO:_SSL_HI] = audio[:, _SSL_LO:_SSL_HI]
    rules_t = torch.from_numpy(np.asarray(rules, dtype=np.int64)).to(audio.device)
    out[:, vocab.SOS_EOS] = torch.where(rules_t == Stream0Rule.SSL_OR_EOS, audio[:, vocab.SOS_EOS], out[:, vocab.SOS_EOS])
    forced = np.nonzero(np.asarray(rules) >= Stream0Rule.FORCE_EOS)[0]
    if len(forced):
        idx = torch.from_numpy(forced).to(audio.device)
        tok = torch.tensor([_FORCED_TOKEN[Stream0Rule(int(rules[i]))] for i in forced], device=audio.device)
        out[idx] = float("-inf")
        out[idx, tok] = 0.0
    return out


def aux_logits(audio: torch.Tensor) -> torch.Tensor:
    """[rows, 8, 1024] logits of streams 1-8 over their own codebook blocks (a view)."""
    return audio[:, vocab.DAC_OFFSET : AUDIO_END].view(-1, vocab.NUM_CODEBOOKS, vocab.CODEBOOK_SIZE)


_CODEBOOK_BASE = vocab.DAC_OFFSET + vocab.CODEBOOK_SIZE * np.arange(vocab.NUM_CODEBOOKS)


def aux_ids(codes: np.ndarray, active: np.ndarray) -> np.ndarray:
    """Local codes [rows, 8] -> global ids, PAD where the stream is not active this step."""
    return np.where(active, np.asarray(codes, dtype=np.int64) + _CODEBOOK_BASE, vocab.PAD)
