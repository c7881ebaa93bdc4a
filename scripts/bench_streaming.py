#!/usr/bin/env python
"""Streaming capacity of the engine service, side by side in one run.

For N = 1, 2, 4, ... conversations answering at once (each: a user turn of speech pushed in
100 ms pieces, then a response of --response-ms), it measures through engine.service:

  viability     share of audio chunks that reach the client before its playback needs them
                (playback starts when the first chunk arrives, no jitter buffer)
  ttfa          end of the user's turn -> first audio chunk, p50 / p99
  capacity      the largest batch whose measured engine step fits the 20 ms frame period (the
                bound, from the step-time fit that admission control uses)

then time to first audio with incremental prefill against prefill at the end of the turn, on a
conversation with a long history. Last line:
viable_sessions=N capacity_bound=M ratio=R ttfa_incremental_vs_full=X
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.codec.synth import speech_like  # noqa: E402
from engine.service import Engine, EngineServiceConfig  # noqa: E402
from engine.service_api import ConversationOptions  # noqa: E402

FRAME_MS = 20.0


def speech(seconds: float, seed: int) -> np.ndarray:
    return (speech_like(seconds, seed=seed) * 20000).astype(np.int16)


async def user_turn(conv, pcm: np.ndarray, piece_ms: float = 100.0) -> None:
    step = int(16 * piece_ms)
    for i in range(0, len(pcm), step):
        conv.push_user_audio(pcm[i : i + step])
        await asyncio.sleep(piece_ms / 1000.0)


async def one_turn(engine: Engine, name: str, args: argparse.Namespace, seed: int) -> dict:
    conv = engine.open_conversation(name, ConversationOptions(temperature=0.8, top_k=30, seed=seed,
                                                              max_response_ms=args.response_ms))
    try:
        await user_turn(conv, speech(args.user_s, seed))
        t_end = time.monotonic()
        conv.end_user_turn()
        arrivals, starts = [], []
        async for chunk in conv.respond():
            arrivals.append(time.monotonic())
            starts.append(chunk.start_ms / 1000.0)
        play0 = arrivals[0]
        on_time = sum(a <= play0 + s + 1e-3 for a, s in zip(arrivals, starts))
        return {"ttfa": arrivals[0] - t_end, "chunks": len(arrivals), "on_time": on_time}
    finally:
        await conv.close()


async def ttfa_with_history(engine: Engine, name: str, turns: int, args: argparse.Namespace) -> float:
    """Time to first audio of the last of `turns` turns (a long prompt to prefill)."""
    conv = engine.open_conversation(name, ConversationOptions(temperature=0.0, max_response_ms=400))
    try:
        ttfa = 0.0
        for t in range(turns):
            await user_turn(conv, speech(2.0, 100 + t))
            t_end = time.monotonic()
            conv.end_user_turn()
            first = None
            async for _ in conv.respond():
                first = first or time.monotonic()
            ttfa = first - t_end
        return ttfa
    finally:
        await conv.close()


def capacity_bound(engine: Engine, limit: int = 4096) -> int:
    model = engine._capacity
    return max([b for b in range(1, limit) if model.predicted_step_ms(b) <= FRAME_MS], default=0)


async def main_async(args: argparse.Namespace) -> int:
    cfg = EngineServiceConfig(model=args.model, max_conversations=max(args.sessions), capacity_override=max(args.sessions))
    engine = await Engine.start(cfg)
    rows = []
    try:
        for n in args.sessions:
            results = await asyncio.gather(*(one_turn(engine, f"n{n}-{i}", args, seed=i) for i in range(n)))
            chunks = sum(r["chunks"] for r in results)
            viability = sum(r["on_time"] for r in results) / chunks
            ttfas = np.array([r["ttfa"] for r in results]) * 1000
            step_ms = engine._capacity.predicted_step_ms(n)
            rows.append((n, viability))
            print(f"N={n:3d}  viability {viability:6.1%}  ttfa p50 {np.percentile(ttfas, 50):6.0f} ms  "
                  f"p99 {np.percentile(ttfas, 99):6.0f} ms  engine step at this batch {step_ms:5.1f} ms",
                  flush=True)
        bound = capacity_bound(engine)
        print(f"measured step ms by batch: { {b: round(t, 2) for b, t in sorted(engine._capacity.step_ms.items())} }")
        inc = await ttfa_with_history(engine, "hist-inc", args.history_turns, args)
    finally:
        await engine.shutdown()
    engine_full = await Engine.start(replace(cfg, incremental_prefill=False))
    try:
        full = await ttfa_with_history(engine_full, "hist-full", args.history_turns, args)
    finally:
        await engine_full.shutdown()
    viable = max([n for n, v in rows if v >= 1.0], default=0)
    print(f"ttfa after {args.history_turns} turns: incremental prefill {inc * 1000:.0f} ms, "
          f"prefill at end of turn {full * 1000:.0f} ms")
    print(f"viable_sessions={viable} capacity_bound={bound} ratio={viable / bound if bound else 0:.2f} "
          f"ttfa_incremental_vs_full={inc / full:.2f}")
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="checkpoint dir (default: the tiny model)")
    p.add_argument("--sessions", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    p.add_argument("--response-ms", type=float, default=3000.0)
    p.add_argument("--user-s", type=float, default=1.0)
    p.add_argument("--history-turns", type=int, default=4)
    return asyncio.run(main_async(p.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
