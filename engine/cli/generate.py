"""`duplex generate`: offline generation of N requests, on vLLM or the reference.

Request i's prompt is a deterministic pseudo-random audio prompt whose length varies with i
(engine/prompt.py), so batches are ragged. The output is an int array [N, F, 9] of de-interleaved
frames in global ids; with free generation (--max-frames) requests end at different frames and
the rows past a request's end are -1.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path

import numpy as np

from engine.cli import CliError
from engine.prompt import synthetic_prompt
from engine.request import AudioRequest, Generation
from engine.sampling import SamplingConfig

FRAME_PAD = -1


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate audio codes offline (vLLM or the reference)")
    p.add_argument("--model", default=None, help="checkpoint dir or hub id owner/name[@rev] (default: the tiny model)")
    p.add_argument("--engine", choices=("vllm", "reference"), default="vllm")
    p.add_argument("--requests", type=int, default=1, help="number of concurrent requests")
    p.add_argument("--prompt-frames", type=int, default=50, help="typical prompt length in frames")
    length = p.add_mutually_exclusive_group()
    length.add_argument("--frames", type=int, help="frames per request (end-of-audio held until then)")
    length.add_argument("--max-frames", type=int, help="free generation: natural end-of-audio, capped")
    p.add_argument("--min-frames", type=int, default=1, help="with --max-frames: no end-of-audio before")
    p.add_argument("--greedy", action="store_true", help="temperature 0")
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-k", type=int, default=30)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None, help="request i uses seed + i")
    p.add_argument("--prompt-seed", type=int, default=0, help="seed of the synthetic prompts")
    p.add_argument("--cfg-scale", type=float, default=1.0,
                   help="classifier-free guidance weight w (1: none); engine/guidance.py")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--out", type=Path, required=True, help="output .npy [N, F, 9]")
    p.set_defaults(func=run)


def build_requests(args: argparse.Namespace) -> list[AudioRequest]:
    if args.requests < 1:
        raise CliError("--requests must be >= 1")
    if args.prompt_frames < 1:
        raise CliError("--prompt-frames must be >= 1")
    if args.frames is not None:
        min_frames = max_frames = args.frames
    else:
        max_frames = args.max_frames if args.max_frames is not None else 100
        min_frames = min(args.min_frames, max_frames)
    if max_frames < 1:
        raise CliError("--frames/--max-frames must be >= 1")
    if not args.cfg_scale >= 0:
        raise CliError("--cfg-scale must be >= 0")
    reqs = []
    for i in range(args.requests):
        sampling = (
            SamplingConfig(temperature=0.0)
            if args.greedy
            else SamplingConfig(
                temperature=args.temperature,
                top_k=args.top_k,
                top_p=args.top_p,
                seed=None if args.seed is None else args.seed + i,
            )
        )
        reqs.append(
            AudioRequest(
                prompt=synthetic_prompt(i, args.prompt_frames, seed=args.prompt_seed),
                max_frames=max_frames,
                min_frames=min_frames,
                sampling=sampling,
                cfg_scale=args.cfg_scale,
            )
        )
    return reqs


def stack_frames(gens: list[Generation]) -> np.ndarray:
    longest = max(g.frames.shape[0] for g in gens)
    out = np.full((len(gens), longest, gens[0].frames.shape[1]), FRAME_PAD, dtype=np.int64)
    for i, g in enumerate(gens):
        out[i, : g.frames.shape[0]] = g.frames
    return out


async def _run_vllm(model: Path, reqs: list[AudioRequest], max_num_seqs: int) -> list[Generation]:
    from engine.async_engine import AsyncOpusEngine, EngineConfig

    engine = await AsyncOpusEngine.start(EngineConfig(model=str(model), max_num_seqs=max_num_seqs))
    try:
        return list(await asyncio.gather(*(engine.generate(r) for r in reqs)))
    finally:
        engine.shutdown()


def run(args: argparse.Namespace) -> int:
    from engine.checkpoint import load_config
    from engine.model_source import resolve_model
    from engine.tiny import ensure_tiny

    model = resolve_model(args.model) if args.model is not None else ensure_tiny()
    load_config(model)  # a clear error for a wrong directory, before starting anything
    reqs = build_requests(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    if args.engine == "reference":
        from engine.reference import ReferenceOpusLM

        ref = ReferenceOpusLM.from_dir(model)
        t0 = time.perf_counter()
        gens = [ref.generate(r) for r in reqs]
    else:
        gens = asyncio.run(_run_vllm(model, reqs, args.max_num_seqs))
    elapsed = time.perf_counter() - t0
    frames = stack_frames(gens)
    np.save(args.out, frames)
    steps = sum(g.steps.shape[0] for g in gens)
    lengths = [g.frames.shape[0] for g in gens]
    print(
        f"{args.engine}: {len(gens)} requests, frames per request {min(lengths)}..{max(lengths)}, "
        f"{steps} steps in {elapsed:.2f}s -> {args.out} {tuple(frames.shape)}"
    )
    return 0
