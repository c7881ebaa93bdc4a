"""The vLLM-against-reference comparison the engine tests share."""

from __future__ import annotations

import numpy as np


def assert_same_steps(got: np.ndarray, want: np.ndarray, what: str) -> None:
    """Generated steps equal, or an error naming the first differing step and stream."""
    if not np.array_equal(got, want):
        n = min(len(got), len(want))
        bad = np.argwhere(got[:n] != want[:n])
        where = f"first difference at step/stream {tuple(bad[0])}" if len(bad) else "lengths differ"
        raise AssertionError(f"{what}: vLLM {got.shape} != reference {want.shape}; {where}")
