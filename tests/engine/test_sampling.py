"""The aux-stream sampler: greedy, top-k/top-p support, the drawn distribution, seeds."""

from __future__ import annotations

import pytest
import torch

from engine.sampling import SamplingConfig, sample_rows

ROW = torch.tensor([0.0, 1.0, 2.0, 3.0, 4.0, 5.0, -1.0])


def freqs(cfg: SamplingConfig, n: int = 40_000) -> torch.Tensor:
    torch.manual_seed(0)
    out = sample_rows(ROW.repeat(n, 1), [cfg] * n, [None] * n)
    return torch.bincount(out, minlength=len(ROW)).float() / n


@pytest.mark.parametrize(
    "cfg, support",
    [
        (SamplingConfig(temperature=1.0, top_k=3), [3, 4, 5]),
        (SamplingConfig(temperature=2.0), list(range(7))),
        (SamplingConfig(temperature=0.5, top_k=4, top_p=0.7), [5]),  # p(best) at T=0.5 is 0.87
        (SamplingConfig(temperature=1.0, top_p=0.9), [3, 4, 5]),  # no top-k: the full-width path
    ],
)
def test_drawn_distribution_matches_softmax_on_support(cfg: SamplingConfig, support: list[int]) -> None:
    want = torch.zeros_like(ROW)
    want[support] = (ROW[support] / cfg.temperature).softmax(0)
    got = freqs(cfg)
    assert torch.allclose(got, want, atol=0.01), (got, want)


def test_greedy_rows_and_seeded_rows_in_one_batch() -> None:
    torch.manual_seed(1)
    logits = 3 * torch.randn(4, 8, 1024)
    cfgs = [
        SamplingConfig(temperature=0.0),
        SamplingConfig(1.0, top_k=5, seed=1),
        SamplingConfig(0.7, top_k=30, top_p=0.5, seed=2),
        SamplingConfig(1.0, top_k=1),
    ]
    a = sample_rows(logits, cfgs, [c.aux_generator() for c in cfgs])
    b = sample_rows(logits, cfgs, [c.aux_generator() for c in cfgs])
    assert torch.equal(a, b)
    assert torch.equal(a[0], logits[0].argmax(-1)) and torch.equal(a[3], logits[3].argmax(-1))
    top5 = logits[1].topk(5, -1).indices
    assert all(a[1, k] in top5[k] for k in range(8))
    # a seeded row draws the same whatever shares its batch
    alone = sample_rows(logits[1:2], cfgs[1:2], [cfgs[1].aux_generator()])
    assert torch.equal(alone[0], a[1])
