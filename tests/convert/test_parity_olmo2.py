"""OLMo-2 backbone: a tiny ESPnet-layout checkpoint converted, then the reference and the vLLM
engine generate exactly what ESPnet's own forward does (greedy, token for token)."""

from __future__ import annotations

import pytest

from conftest import start_engine
from parity import check_reference, check_vllm, convert_tiny

BACKBONE = "olmo2"


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    return convert_tiny(tmp_path_factory.mktemp(BACKBONE), BACKBONE, seed=4)


def test_reference_matches_espnet_forward(converted) -> None:
    check_reference(*converted)


@pytest.mark.vllm
def test_vllm_matches_espnet_forward(converted, loop_thread) -> None:
    model_dir, oracle = converted
    engine = start_engine(loop_thread, model=str(model_dir), max_num_seqs=4)
    try:
        check_vllm(engine, loop_thread, oracle)
    finally:
        engine.shutdown()
