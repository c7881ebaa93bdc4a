#!/usr/bin/env python
"""ASR throughput, side by side in one run: seconds of audio transcribed per second of wall time.

  ours       the engine service's `Engine.transcribe` (tokenizer thread + vLLM with the plugin; what
             POST /v1/audio/transcriptions runs), N requests at once
  reference  the same clips tokenized by the same tokenizer and transcribed by the plain-PyTorch
             reference, one at a time (it has no batching)
and the language model alone (clips tokenized beforehand): vLLM with the plugin, N at once, against
the reference. On a CPU the tokenizer (one thread, shared by both sides) bounds the end-to-end rate.

Every clip is --clip-s of speech-like audio; each transcript is --tokens text tokens long (the tiny
model never ends its text on its own, so the length is held fixed: the same work on both sides).
Best of --repeats, ours and the reference alternating. Last line:
asr_rtf_ours_1=X asr_rtf_ours_16=Y asr_rtf_reference=Z speedup_16=Y/Z
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine import oneshot  # noqa: E402
from engine.codec.synth import speech_like  # noqa: E402
from engine.service_api import TranscriptionOptions  # noqa: E402


async def time_ours(engine, clips: list[np.ndarray], options: TranscriptionOptions) -> float:
    async def one(pcm: np.ndarray) -> None:
        async for _ in engine.transcribe(pcm, options):
            pass

    t0 = time.perf_counter()
    await asyncio.gather(*(one(c) for c in clips))
    return sum(len(c) for c in clips) / 16000.0 / (time.perf_counter() - t0)


async def time_reference(engine, ref, clips: list[np.ndarray], options: TranscriptionOptions) -> float:
    t0 = time.perf_counter()
    for pcm in clips:
        frames = await engine.pipeline.tokenize_clip(pcm)
        ref.generate(oneshot.asr_request(frames, options, engine.pipeline.max_model_len))
    return sum(len(c) for c in clips) / 16000.0 / (time.perf_counter() - t0)


async def time_lm(engine, ref, requests: list, seconds: float) -> float:
    """The language model alone: vLLM (all at once) or, with `ref`, the reference (one at a time)."""
    t0 = time.perf_counter()
    if ref is None:
        await asyncio.gather(*(engine.pipeline.llm.generate(r) for r in requests))
    else:
        for r in requests:
            ref.generate(r)
    return seconds / (time.perf_counter() - t0)


async def main_async(args: argparse.Namespace) -> int:
    from engine.reference import ReferenceOpusLM
    from engine.service import Engine, EngineServiceConfig

    engine = await Engine.start(EngineServiceConfig(model=args.model, max_num_seqs=max(args.concurrency)))
    ref = ReferenceOpusLM.from_dir(engine.pipeline.model_dir)
    options = TranscriptionOptions(max_tokens=args.tokens, min_tokens=args.tokens)  # fixed-length transcripts
    clips = [(speech_like(args.clip_s, seed=i) * 20000).astype(np.int16) for i in range(max(args.concurrency))]
    rates: dict[str, float] = {}

    def best(key: str, value: float) -> None:
        rates[key] = max(rates.get(key, 0.0), value)

    try:
        await time_ours(engine, clips[:2], options)  # warm
        reqs = [oneshot.asr_request(await engine.pipeline.tokenize_clip(c), options, engine.pipeline.max_model_len) for c in clips]
        for _ in range(args.repeats):
            for n in args.concurrency:
                best(f"ours_{n}", await time_ours(engine, clips[:n], options))
                best(f"lm_{n}", await time_lm(engine, None, reqs[:n], n * args.clip_s))
            best("reference", await time_reference(engine, ref, clips[: args.reference_clips], options))
            best("lm_reference", await time_lm(engine, ref, reqs[: args.reference_clips], args.reference_clips * args.clip_s))
    finally:
        await engine.shutdown()
    for n in args.concurrency:
        print(f"{n:2d} at once: end to end {rates[f'ours_{n}']:7.1f} s of audio per s (reference {rates['reference']:.1f}), "
              f"language model alone {rates[f'lm_{n}']:7.1f} (reference {rates['lm_reference']:.1f})", flush=True)
    top = max(args.concurrency)
    print(" ".join(f"asr_rtf_ours_{n}={rates[f'ours_{n}']:.1f}" for n in args.concurrency)
          + f" asr_rtf_reference={rates['reference']:.1f} speedup_{top}={rates[f'ours_{top}'] / rates['reference']:.1f}"
          + f" lm_speedup_{top}={rates[f'lm_{top}'] / rates['lm_reference']:.1f}")
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="checkpoint dir (default: the tiny model)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    p.add_argument("--clip-s", type=float, default=5.0)
    p.add_argument("--tokens", type=int, default=40, help="text tokens per transcript")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--reference-clips", type=int, default=4, help="clips per reference round (its rate does not depend on it)")
    args = p.parse_args()
    if min(args.concurrency) < 1 or args.tokens < 1 or args.clip_s <= 0:
        p.error("--concurrency and --tokens must be >= 1, --clip-s > 0")
    return asyncio.run(main_async(args))


if __name__ == "__main__":
    sys.exit(main())
