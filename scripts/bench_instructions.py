#!/usr/bin/env python
"""What an answer's own instructions cost (response.create's `instructions`), side by side in one run.

An answer that reads the session's system text finds its prompt in the prefix cache: the history up to
the last answer from the previous turns, the user's turn from the incremental prefill while they spoke.
An answer with its own instructions (conv.respond(instructions=...)) has another system segment right
after the task marker, so past the speaker prompt none of its prompt is cached and the whole history
is prefilled before its first frame. After it, the engine prefills the history in the session's layout
again (engine/README.md, "Per-response instructions"), so the answer after it is back on the cache.

For each history length (--history-s seconds of dialogue already in the conversation), one conversation
answers measured turns alternately with the session's instructions and with its own (--repeats of
each, so machine noise hits both alike; each answer's own instructions differ from the others', as a
prefix no earlier prompt had). A measured turn: --user-s of speech pushed in 100 ms pieces in
real time, the end of the turn, then respond(); time to first audio is respond() -> the first audio
chunk. Printed per length: the prompt's positions, how many the prefix cache served, and the median time
to first audio of each kind. Last line: ttfa_own_vs_session=<ratio at the longest history>.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.codec.synth import speech_like  # noqa: E402
from engine.service import Engine, EngineServiceConfig  # noqa: E402
from engine.service_api import ConversationOptions  # noqa: E402

SESSION = "You are a helpful voice assistant. Answer briefly and kindly."
OWN = "Greet the user warmly and offer your help with turn {}."  # about as many tokens; each answer its own


def speech(seconds: float, seed: int) -> np.ndarray:
    return (speech_like(seconds, seed=seed) * 20000).astype(np.int16)


async def build_history(conv, seconds: float, turn_s: float = 5.0) -> None:
    """About `seconds` of dialogue: user turns of `turn_s` (pushed at once) and the short answers to them."""
    t = 0
    while (t + 1) * turn_s <= seconds:
        conv.push_user_audio(speech(turn_s, seed=1000 + t))
        conv.end_user_turn()
        async for _ in conv.respond(f"{conv.id}-h{t}").chunks():
            pass
        t += 1


async def measured_turn(conv, rid: str, user_s: float, seed: int, instructions: str | None) -> tuple[float, int, int]:
    """(time to first audio in s, prompt positions, positions served by the prefix cache)."""
    pcm = speech(user_s, seed)
    for i in range(0, len(pcm), 1600):
        conv.push_user_audio(pcm[i : i + 1600])
        await asyncio.sleep(0.1)
    conv.end_user_turn()
    t0 = time.monotonic()
    first = None
    async for chunk in conv.respond(rid, instructions=instructions).chunks():
        if first is None and len(chunk.pcm):
            first = time.monotonic()
    return first - t0, len(conv.last_prompt), conv.cached_tokens_last_response


async def main_async(args: argparse.Namespace) -> int:
    engine = await Engine.start(EngineServiceConfig(model=args.model, capacity_override=2))
    ratio = 0.0
    try:
        if not engine.supports_text:
            print("the model has no text tokenizer: it reads no instructions, so there is nothing to measure")
            return 1
        print(f"{'history':>8} {'positions':>9} {'cached session':>14} {'cached own':>10} {'ttfa session':>12} "
              f"{'ttfa own':>9} {'own/session':>11}")
        for h in args.history_s:
            opts = ConversationOptions(temperature=0.0, max_response_ms=args.answer_ms, system_prompt=SESSION)
            conv = engine.open_conversation(f"hist{h:g}", opts)
            try:
                await build_history(conv, h)
                got: dict[str, list] = {"session": [], "own": []}
                for r in range(args.repeats):  # alternate: session, own, session, own, ...
                    for kind, instr in (("session", None), ("own", OWN.format(r))):
                        got[kind].append(await measured_turn(conv, f"{conv.id}-{kind}{r}", args.user_s, 50 + r, instr))
            finally:
                await conv.close()
            ttfa = {k: 1000 * float(np.median([g[0] for g in v])) for k, v in got.items()}
            cached = {k: int(np.median([g[2] for g in v])) for k, v in got.items()}
            positions = int(np.median([g[1] for g in got["own"]]))
            ratio = ttfa["own"] / ttfa["session"]
            print(f"{h:>7g}s {positions:>9d} {cached['session']:>14d} {cached['own']:>10d} {ttfa['session']:>10.0f}ms "
                  f"{ttfa['own']:>7.0f}ms {ratio:>11.2f}", flush=True)
    finally:
        await engine.shutdown()
    print(f"ttfa_own_vs_session={ratio:.2f}")
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="checkpoint dir (default: the tiny model)")
    p.add_argument("--history-s", type=float, nargs="+", default=[0, 15, 30, 45],
                   help="seconds of dialogue in the history before the measured turns")
    p.add_argument("--user-s", type=float, default=1.0, help="the measured turns' user speech")
    p.add_argument("--answer-ms", type=float, default=200.0, help="every answer's cap (the history grows by it)")
    p.add_argument("--repeats", type=int, default=5)
    return asyncio.run(main_async(p.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
