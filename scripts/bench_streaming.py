#!/usr/bin/env python
"""Streaming capacity of the engine service, side by side in one run.

For N = 1, 2, 4, ... conversations answering at once (each: a user turn of speech pushed in
100 ms pieces, then a response of --response-ms), it measures through engine.service:

  viability     share of audio chunks that reach the client before its playback needs them
                (playback starts when the first chunk arrives, no jitter buffer)
  ttfa          end of the user's turn -> first audio chunk, p50 / p99
  capacity      the capacity model's prediction (engine/capacity.py: the smallest bound of the
                engine's step time and the machine's CPU, measured in this process), and the engine
                step's bound alone

The edge here is the engine service's alone (no gateway, no transports, no callers): the whole
pipeline's edge against the same model is scripts/capacity_sweep.py (soaks over real sockets).

then time to first audio with incremental prefill against prefill at the end of the turn, on a
conversation with a long history: two engines (one of each) stay up and are measured alternately,
median of --ttfa-repeats, so machine noise hits both alike. Beside them, the issue's goal for
time to first audio: (first-chunk frames + delay steps + 1) x the engine's step at batch 1 + one
first-chunk decode, i.e. no prefill wait left at the end of the turn. Last line:
viable_sessions=N predicted_capacity=P ratio=N/P engine_bound=M ttfa_incremental_vs_full=X
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
        async for chunk in conv.respond(f"{name}-resp").chunks():
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
            await user_turn(conv, speech(args.history_user_s, 100 + t))
            t_end = time.monotonic()
            conv.end_user_turn()
            first = None
            async for _ in conv.respond(f"{name}-resp{t}").chunks():
                first = first or time.monotonic()
            ttfa = first - t_end
        return ttfa
    finally:
        await conv.close()


def first_chunk_decode_ms(engine: Engine, repeats: int = 20) -> float:
    """Median time to decode a response's first chunk with the engine's codec settings."""
    from engine.codec.dac import DAC
    from engine.codec.streaming import DecoderState, StreamConfig, StreamingDecoder
    from engine.vocab import CODEBOOK_SIZE, NUM_CODEBOOKS

    cfg = engine.config
    dec = StreamingDecoder(DAC.from_dir(engine.pipeline.model_dir), StreamConfig(first_chunk_frames=cfg.first_chunk_frames,
                                                                        chunk_frames=cfg.chunk_frames))
    rng = np.random.default_rng(0)
    times = []
    for _ in range(repeats + 1):
        state = DecoderState.new()
        dec.push(state, rng.integers(0, CODEBOOK_SIZE, (cfg.first_chunk_frames + 8, NUM_CODEBOOKS)))
        t0 = time.perf_counter()
        dec.decode([state])
        times.append(time.perf_counter() - t0)
    return 1000.0 * float(np.median(times[1:]))


def capacity_bound(engine: Engine, limit: int = 4096) -> int:
    model = engine._capacity
    return max([b for b in range(1, limit) if model.predicted_step_ms(b) <= FRAME_MS], default=0)


async def main_async(args: argparse.Namespace) -> int:
    from engine.delay import MAX_DELAY

    cfg = EngineServiceConfig(model=args.model, max_conversations=max(args.sessions), capacity_override=max(args.sessions))
    engine = await Engine.start(cfg)
    engine_full = None
    rows = []
    try:
        for n in args.sessions:
            results = await asyncio.gather(*(one_turn(engine, f"n{n}-{i}", args, seed=i) for i in range(n)))
            chunks = sum(r["chunks"] for r in results)
            viability = sum(r["on_time"] for r in results) / chunks
            ttfas = np.array([r["ttfa"] for r in results]) * 1000
            step_ms = engine._capacity.predicted_step_ms(n)
            rows.append((n, viability, float(np.percentile(ttfas, 50)), step_ms))
            print(f"N={n:3d}  viability {viability:6.1%}  ttfa p50 {np.percentile(ttfas, 50):6.0f} ms  "
                  f"p99 {np.percentile(ttfas, 99):6.0f} ms  engine step at this batch {step_ms:5.1f} ms",
                  flush=True)
        bound = capacity_bound(engine)
        bounds = engine._capacity.bounds()
        predicted = min(bounds.values())
        print(f"measured step ms by batch: { {b: round(t, 2) for b, t in sorted(engine._capacity.step_ms.items())} }")
        # the step the first row's conversations saw (the fit as it stood after that row)
        n0, _, ttfa0, step0 = rows[0]
        decode_ms = first_chunk_decode_ms(engine)
        goal_ms = (cfg.first_chunk_frames + MAX_DELAY + 1) * step0 + decode_ms
        print(f"ttfa goal at N={n0}: ({cfg.first_chunk_frames} + {MAX_DELAY} + 1) x {step0:.1f} ms step "
              f"+ {decode_ms:.1f} ms first-chunk decode = {goal_ms:.0f} ms; measured p50 {ttfa0:.0f} ms", flush=True)
        engine_full = await Engine.start(replace(cfg, incremental_prefill=False))
        inc, full = [], []
        for r in range(args.ttfa_repeats):  # alternate: machine noise hits both alike
            inc.append(await ttfa_with_history(engine, f"hist-inc-{r}", args.history_turns, args))
            full.append(await ttfa_with_history(engine_full, f"hist-full-{r}", args.history_turns, args))
    finally:
        await engine.shutdown()
        if engine_full is not None:
            await engine_full.shutdown()
    viable = max([n for n, v, _, _ in rows if v >= 1.0], default=0)
    inc_ms, full_ms = 1000 * float(np.median(inc)), 1000 * float(np.median(full))
    print(f"ttfa after {args.history_turns} turns of {args.history_user_s:g} s (median of {args.ttfa_repeats}): "
          f"incremental prefill {inc_ms:.0f} ms, prefill at end of turn {full_ms:.0f} ms")
    print(f"capacity model bounds {bounds} (limited by {min(bounds, key=bounds.get)})")
    print(f"viable_sessions={viable} predicted_capacity={predicted} ratio={viable / predicted if predicted else 0:.2f} "
          f"engine_bound={bound} ttfa_incremental_vs_full={inc_ms / full_ms:.2f}")
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="checkpoint dir (default: the tiny model)")
    p.add_argument("--sessions", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    p.add_argument("--response-ms", type=float, default=3000.0)
    p.add_argument("--user-s", type=float, default=1.0)
    p.add_argument("--history-turns", type=int, default=4)
    p.add_argument("--history-user-s", type=float, default=4.0, help="user speech per turn in the TTFA comparison")
    p.add_argument("--ttfa-repeats", type=int, default=3)
    return asyncio.run(main_async(p.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
