#!/usr/bin/env python
"""Classifier-free guidance throughput, side by side in one run, at 8 and 32 user requests:

  plain   our engine, no guidance (cfg_scale 1)
  cfg     our engine, every request guided (cfg_scale --scale): each user request runs beside its
          shadow in the same batch (Paired Request Co-Scheduling), one forward per step
  naive   sequential CFG: the conditional and the unconditional pass as two separate forwards per
          step, one request at a time (engine/reference.py, the project's naive baseline; its rate
          does not depend on the batch, so it runs --reference-max-requests of them)

Throughput = user frames per second (a frame is 20 ms of audio, all 9 streams; shadows count
nothing). One engine serves both plain and cfg runs, alternately, best of --repeats, so machine
noise hits both alike. Last line, at the largest batch:
cfg_vs_plain=X.XX cfg_vs_naive=Y.YY
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from engine.prompt import synthetic_prompt  # noqa: E402
from engine.request import AudioRequest  # noqa: E402
from engine.sampling import SamplingConfig  # noqa: E402

SAMPLINGS = {
    "topk": SamplingConfig(temperature=0.8, top_k=30),  # OpusLM's serving defaults
    "greedy": SamplingConfig(temperature=0.0),
}


def requests(batch: int, frames: int, prompt_frames: int, sampling: SamplingConfig, scale: float) -> list[AudioRequest]:
    return [
        AudioRequest(synthetic_prompt(i, prompt_frames), max_frames=frames, min_frames=frames, sampling=sampling,
                     cfg_scale=scale)
        for i in range(batch)
    ]


async def time_engine(engine, reqs: list[AudioRequest]) -> tuple[float, float]:
    """(user frames/s, median engine step ms over the steps that ran the whole batch)."""
    from engine.delay import FrameAssembler

    step_ms: list[float] = []

    async def one(r: AudioRequest) -> int:
        frames = FrameAssembler()
        async for chunk in engine.stream_steps(r):
            for row in chunk.steps:
                frames.push(row)
            if chunk.engine_batch == len(reqs) and chunk.engine_tokens == len(reqs) + chunk.engine_cfg_pairs:
                step_ms.append(chunk.engine_step_ms)  # pure decode steps of the full batch
        return frames.num_emitted

    t0 = time.perf_counter()
    counts = await asyncio.gather(*(one(r) for r in reqs))
    return sum(counts) / (time.perf_counter() - t0), float(np.median(step_ms)) if step_ms else float("nan")


def time_reference(ref, reqs: list[AudioRequest]) -> float:
    t0 = time.perf_counter()
    frames = sum(ref.generate(r).frames.shape[0] for r in reqs)
    return frames / (time.perf_counter() - t0)


async def main_async(args: argparse.Namespace) -> int:
    from engine.async_engine import AsyncOpusEngine, EngineConfig
    from engine.reference import ReferenceOpusLM
    from engine.tiny import ensure_tiny

    model = Path(args.model) if args.model else ensure_tiny()
    sampling = SAMPLINGS[args.sampling]
    # a guided request is two rows: room for every pair of the largest batch
    engine = await AsyncOpusEngine.start(EngineConfig(model=str(model), max_num_seqs=2 * max(args.batches)))
    ref = ReferenceOpusLM.from_dir(model)
    rows = []
    try:
        for b in args.batches:
            plain = requests(b, args.frames, args.prompt_frames, sampling, 1.0)
            guided = [replace(r, cfg_scale=args.scale) for r in plain]
            await time_engine(engine, plain[:2])  # warm up at this shape
            await time_engine(engine, guided[:2])
            p, c, n = [], [], []
            for _ in range(args.repeats):
                p.append(await time_engine(engine, plain))
                c.append(await time_engine(engine, guided))
                n.append(time_reference(ref, guided[: min(b, args.reference_max_requests)]))
            (pf, pms), (cf, cms) = max(p), max(c)
            rows.append((b, pf, cf, max(n)))
            print(
                f"{args.sampling} {b:3d} user requests: plain {pf:8.1f} frames/s   cfg {cf:8.1f}   "
                f"naive cfg {max(n):7.1f}   cfg/plain {cf / pf:.2f}   cfg/naive {cf / max(n):.1f}   "
                f"(engine step {pms:.1f} ms plain, {cms:.1f} ms cfg)",
                flush=True,
            )
    finally:
        engine.shutdown()
    b, p, c, n = rows[-1]
    print(f"cfg_vs_plain={c / p:.2f} cfg_vs_naive={c / n:.2f}")
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="checkpoint dir (default: the tiny model)")
    p.add_argument("--batches", type=int, nargs="+", default=[8, 32], help="user requests; the last gives the last line")
    p.add_argument("--frames", type=int, default=120)
    p.add_argument("--prompt-frames", type=int, default=25)
    p.add_argument("--scale", type=float, default=3.0, help="cfg_scale of the guided runs")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--sampling", choices=sorted(SAMPLINGS), default="topk")
    p.add_argument("--reference-max-requests", type=int, default=4,
                   help="the naive loop runs one request at a time; its rate does not depend on the batch")
    args = p.parse_args()
    return asyncio.run(main_async(args))


if __name__ == "__main__":
    sys.exit(main())
