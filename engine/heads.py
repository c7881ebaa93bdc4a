"""OpusLM output heads: stream k's logits = lm_head(h + head_emb[k]), restricted to its range.

Shared by the vLLM model and the reference so both apply the same masks. Only the slices a stream
may emit are multiplied out: stream 0 in audio needs [0, 5256) (specials + SSL), streams 1-8 each
need their own 1024-row block; the text range is never touched while generating audio.
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


def stream0_logits(
    h: torch.Tensor, lm_head: torch.Tensor, head_emb: torch.Tensor, rules: np.ndarray, vocab_size: int
) -> torch.Tensor:
    """[rows, vocab_size] float32 logits for stream 0; disallowed ids are -inf.

    Forced rows get a single finite entry, so any sampler (greedy or not) picks it.
    """
    rows = h.shape[0]
    out = torch.full((rows, vocab_size), float("-inf"), dtype=torch.float32, device=h.device)
    h0 = h + head_emb[0]
    # one matmul over specials + SSL: EOS lives in the specials
    part = torch.nn.functional.linear(h0, lm_head[:_SSL_HI]).float()
    out[:, _SSL_LO:_SSL_HI] = part[:, _SSL_LO:_SSL_HI]
    rules_t = torch.from_numpy(np.asarray(rules, dtype=np.int64)).to(h.device)
    eos_ok = rules_t == Stream0Rule.SSL_OR_EOS
    out[:, vocab.SOS_EOS] = torch.where(eos_ok, part[:, vocab.SOS_EOS], out[:, vocab.SOS_EOS])
    forced = np.nonzero(np.asarray(rules) >= Stream0Rule.FORCE_EOS)[0]
    if len(forced):
        idx = torch.from_numpy(forced).to(h.device)
        tok = torch.tensor([_FORCED_TOKEN[Stream0Rule(int(rules[i]))] for i in forced], device=h.device)
        out[idx] = float("-inf")
        out[idx, tok] = 0.0
    return out


def aux_logits(h: torch.Tensor, lm_head: torch.Tensor, head_emb: torch.Tensor) -> torch.Tensor:
    """[rows, 8, 1024] float32 logits of streams 1-8 over their own codebook blocks."""
    lo = vocab.DAC_OFFSET
    w = lm_head[lo : lo + vocab.NUM_CODEBOOKS * vocab.CODEBOOK_SIZE]
    w = w.view(vocab.NUM_CODEBOOKS, vocab.CODEBOOK_SIZE, -1)  # [8, 1024, H]
    hk = h[None, :, :] + head_emb[1 : vocab.NUM_STREAMS][:, None, :]  # [8, rows, H]
    return torch.bmm(hk, w.transpose(1, 2)).transpose(0, 1).float()  # [rows, 8, 1024]


_CODEBOOK_BASE = vocab.DAC_OFFSET + vocab.CODEBOOK_SIZE * np.arange(vocab.NUM_CODEBOOKS)


def aux_ids(codes: np.ndarray, active: np.ndarray) -> np.ndarray:
    """Local codes [rows, 8] -> global ids, PAD where the stream is not active this step."""
    return np.where(active, np.asarray(codes, dtype=np.int64) + _CODEBOOK_BASE, vocab.PAD)
