"""SmolLM2/Llama-style backbone: a tiny ESPnet-layout checkpoint converted, then the reference and the vLLM
engine generate exactly what ESPnet's own forward does (greedy, token for token)."""

from __future__ import annotations

import pytest

BACKBONE = "llama"


@pytest.fixture(scope="module")
def converted(tmp_path_factory, espnet_layout):
    return espnet_layout.convert_tiny(tmp_path_factory.mktemp(BACKBONE), BACKBONE, seed=3)


def test_reference_matches_espnet_forward(converted, espnet_layout) -> None:
    espnet_layout.check_reference(*converted)


@pytest.mark.vllm
def test_vllm_matches_espnet_forward(converted, espnet_layout, loop_thread) -> None:
    model_dir, oracle = converted
    espnet_layout.check_vllm(model_dir, loop_thread, oracle)
