"""Shared body of the per-backbone parity modules: ESPnet layout -> convert -> reference and vLLM
greedy steps == ESPnet's own forward (espnet_layout.EspnetOracle)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np

from engine.convert import convert_espnet
from engine.prompt import synthetic_prompt
from engine.reference import ReferenceOpusLM
from engine.request import AudioRequest
from engine.sampling import GREEDY

from espnet_layout import EspnetOracle, write_espnet_checkpoint

FRAMES = (6, 11, 9)  # per request; min = max, so stream 0's EOS step is fixed


def convert_tiny(tmp: Path, backbone: str, seed: int) -> tuple[Path, EspnetOracle]:
    sd = write_espnet_checkpoint(tmp / "exp", backbone, seed=seed, deepspeed=backbone == "olmo2")
    convert_espnet(tmp / "exp", tmp / "out", dtype="fp32")
    return tmp / "out", EspnetOracle(backbone, sd)


def requests() -> list[AudioRequest]:
    return [AudioRequest(synthetic_prompt(i, 10 + 3 * i), f, f, GREEDY) for i, f in enumerate(FRAMES)]


def check_reference(model_dir: Path, oracle: EspnetOracle) -> None:
    ref = ReferenceOpusLM.from_dir(model_dir)
    for i, req in enumerate(requests()):
        want = oracle.greedy(req.prompt, req.max_frames)
        got = ref.generate(req).steps
        assert np.array_equal(got, want), f"request {i}: reference != ESPnet forward"


def check_vllm(engine, loop_thread, oracle: EspnetOracle) -> None:
    reqs = requests()

    async def run():
        return await asyncio.gather(*(engine.generate(r) for r in reqs))

    for i, (req, gen) in enumerate(zip(reqs, loop_thread.run(run()))):
        want = oracle.greedy(req.prompt, req.max_frames)
        assert np.array_equal(gen.steps, want), f"request {i}: vLLM != ESPnet forward"
