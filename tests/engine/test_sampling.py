"""The aux-stream sampler: greedy, top-k/top-p support, the drawn distribution, seeds.

Both implementations are checked: numpy's top-k path (what a CPU engine runs) and the full-width
torch path (what a GPU runs, and a CPU row without top-k).
"""

from __future__ import annotations

import pytest
import torch

from engine.sampling import SamplingConfig, _sample_torch, row_limits, sample_rows

ROW = torch.tensor([0.0, 1.0, 2.0, 3.0, 4.0, 5.0, -1.0])


def torch_path(logits: torch.Tensor, cfgs: list[SamplingConfig], gens: list) -> torch.Tensor:
    return _sample_torch(logits, cfgs, gens, *row_limits(cfgs, logits.shape[-1]))


SAMPLERS = {"numpy-top-k": sample_rows, "torch": torch_path}


def freqs(cfg: SamplingConfig, n: int = 40_000, row: torch.Tensor = ROW, sampler=sample_rows) -> torch.Tensor:
    torch.manual_seed(0)
    out = sampler(row.repeat(n, 1), [cfg] * n, [None] * n)
    return torch.bincount(out, minlength=len(row)).float() / n


@pytest.mark.parametrize(
    "cfg, support",
    [
        (SamplingConfig(temperature=1.0, top_k=3), [3, 4, 5]),
        (SamplingConfig(temperature=2.0), list(range(7))),
        (SamplingConfig(temperature=0.5, top_k=4, top_p=0.7), [5]),  # p(best) at T=0.5 is 0.87
        (SamplingConfig(temperature=1.0, top_p=0.9), [3, 4, 5]),  # no top-k: the full-width path
    ],
)
@pytest.mark.parametrize("sampler", SAMPLERS)
def test_drawn_distribution_matches_softmax_on_support(cfg: SamplingConfig, support: list[int], sampler: str) -> None:
    want = torch.zeros_like(ROW)
    want[support] = (ROW[support] / cfg.temperature).softmax(0)
    got = freqs(cfg, sampler=SAMPLERS[sampler])
    assert torch.allclose(got, want, atol=0.01), (got, want)


@pytest.mark.parametrize("sampler", SAMPLERS)
def test_top_k_keeps_every_tie_at_the_kth_value(sampler: str) -> None:
    """vLLM's rule for stream 0, so all 9 streams agree: top-k keeps whatever is >= the k-th."""
    row = torch.tensor([1.0, 3.0, 3.0, 3.0, 0.0, 2.0])
    got = freqs(SamplingConfig(temperature=1.0, top_k=2), row=row, sampler=SAMPLERS[sampler])
    want = torch.tensor([0.0, 1 / 3, 1 / 3, 1 / 3, 0.0, 0.0])
    assert torch.allclose(got, want, atol=0.01), got


@pytest.mark.parametrize("sampler", SAMPLERS)
def test_greedy_rows_and_seeded_rows_in_one_batch(sampler: str) -> None:
    sample = SAMPLERS[sampler]
    torch.manual_seed(1)
    logits = 3 * torch.randn(4, 8, 1024)
    cfgs = [
        SamplingConfig(temperature=0.0),
        SamplingConfig(1.0, top_k=5, seed=1),
        SamplingConfig(0.7, top_k=30, top_p=0.5, seed=2),
        SamplingConfig(1.0, top_k=1),
    ]
    a = sample(logits, cfgs, [c.aux_generator() for c in cfgs])
    b = sample(logits, cfgs, [c.aux_generator() for c in cfgs])
    assert torch.equal(a, b)
    assert torch.equal(a[0], logits[0].argmax(-1)) and torch.equal(a[3], logits[3].argmax(-1))
    top5 = logits[1].topk(5, -1).indices
    assert all(a[1, k] in top5[k] for k in range(8))
    # a seeded row draws the same whatever shares its batch
    alone = sample(logits[1:2], cfgs[1:2], [cfgs[1].aux_generator()])
    assert torch.equal(alone[0], a[1])
