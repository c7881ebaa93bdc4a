"""Audio inside conversation.item.create against the input budget (issue 39), beside a witness.

A gateway (the tests' fake engine, so what is measured is the gateway's own loop) listens on
127.0.0.1 in this process; the soak's flood witness (realtime/soak/floods.py: a probe timing
`input_audio_buffer.clear` round trips, a listener timing the gaps between its answers' audio
deltas) talks to it the whole time. An attacker in a child process (niced, as one on another machine)
then sends user items with audio as fast as the socket takes them, one kind at a time:

    big_g711   G.711 μ-law items just under the 2 MiB message limit (~190 s of audio each)
    pcm16_8s   pcm16 items of 8 s (within the default per-item cap of 10 s)

Per kind it prints what the server took (seconds of item audio added, per second of the attack) and
what the witness saw before and during it (largest gap between deltas, gaps over 100 ms, round-trip
p50/p99), side by side in one run. On a shared machine a gap may be the OS running something else,
so the event loop is also timed from inside (a 5 ms ticker): `loop.cpu_max_ms` is the most CPU the
loop's thread spent between two ticks (work that held the loop), `loop.wall_max_ms` the longest wall
time between them (held or not scheduled), `loop.process_cpu_max_ms` the process's CPU between them
(another thread's work holds the loop through the GIL), and `loop.busy` the share of the window the
loop's thread spent on CPU (what one attacker takes from everyone else):

    python scripts/bench_item_audio.py --seconds 4
    python scripts/bench_item_audio.py --attack KIND WS_URL TOKEN SECONDS   # one attacker (what the run starts)
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "realtime"))

KINDS = ("big_g711", "pcm16_8s")
TOKEN = "bench"


def _item(kind: str, n: int) -> tuple[str, float]:
    """One conversation.item.create of `kind` and the seconds of audio it holds."""
    rng = np.random.default_rng(n)
    if kind == "big_g711":
        payload, seconds = rng.integers(0, 256, 1_500_000, dtype=np.uint8).tobytes(), 1_500_000 / 8000
    else:
        payload, seconds = (rng.standard_normal(24_000 * 8) * 3000).astype("<i2").tobytes(), 8.0
    item = {"type": "message", "role": "user", "content": [{"type": "input_audio", "audio": base64.b64encode(payload).decode()}]}
    return json.dumps({"type": "conversation.item.create", "event_id": f"ev_{n}", "item": item}), seconds


async def attack(kind: str, url: str, token: str, seconds: float) -> dict:
    import websockets

    fmt = {"big_g711": "g711_ulaw", "pcm16_8s": "pcm16"}[kind]
    messages = [_item(kind, n) for n in range(4)]  # made before the clock starts: the attacker's own CPU is not the server's
    async with websockets.connect(url, additional_headers={"Authorization": f"Bearer {token}"}, max_size=None,
                                  ping_interval=None) as ws:
        await ws.recv()  # session.created
        await ws.send(json.dumps({"type": "session.update", "session": {"input_audio_format": fmt, "turn_detection": None}}))
        sent: dict[str, float] = {}
        added, errors, closed = [0.0], {}, [None]

        async def read() -> None:
            try:
                async for m in ws:
                    ev = json.loads(m)
                    if ev["type"] == "conversation.item.done" and ev["item"].get("role") == "user":
                        added[0] += sent.get(ev["item"]["id"], 0.0)
                    elif ev["type"] == "error":
                        errors[ev["error"]["code"]] = errors.get(ev["error"]["code"], 0) + 1
            except websockets.ConnectionClosed as e:
                closed[0] = f"{e.rcvd.code if e.rcvd else None} {e.rcvd.reason if e.rcvd else ''}"

        reader = asyncio.create_task(read())
        t0, n = time.monotonic(), 0
        try:
            while time.monotonic() - t0 < seconds:
                message, s = messages[n % len(messages)]
                item_id = f"item_{n}"
                sent[item_id] = s
                await ws.send(message.replace('"type": "message"', f'"id": "{item_id}", "type": "message"', 1))
                n += 1
        except websockets.ConnectionClosed:
            pass
        wall = time.monotonic() - t0
        await asyncio.sleep(1.0)  # the replies to what was sent
        reader.cancel()
    return {"items_sent": n, "audio_sent_s": round(sum(sent.values()), 1), "audio_added_s": round(added[0], 1),
            "attack_s": round(wall, 2), "added_per_s": round(added[0] / wall, 1), "errors": errors, "closed": closed[0]}


class LoopTicker:
    """Ticks every 5 ms on the gateway's loop, recording (when, wall ms, loop-thread CPU ms, process CPU ms)
    between ticks (the process's: another thread holding the GIL also holds the loop)."""

    def __init__(self) -> None:
        self.ticks: list[tuple[float, float, float, float]] = []

    async def run(self, stop: asyncio.Event) -> None:
        wall, cpu, proc = time.monotonic(), time.thread_time(), time.process_time()
        while not stop.is_set():
            await asyncio.sleep(0.005)
            w, c, p = time.monotonic(), time.thread_time(), time.process_time()
            self.ticks.append((w, 1000.0 * (w - wall), 1000.0 * (c - cpu), 1000.0 * (p - proc)))
            wall, cpu, proc = w, c, p

    def window(self, t0: float, t1: float) -> dict:
        inside = [t[1:] for t in self.ticks if t0 <= t[0] < t1]
        if not inside:
            return {}
        return {"wall_max_ms": round(max(t[0] for t in inside), 1), "cpu_max_ms": round(max(t[1] for t in inside), 1),
                "process_cpu_max_ms": round(max(t[2] for t in inside), 1),
                "busy": round(sum(t[1] for t in inside) / sum(t[0] for t in inside), 2)}


async def run(seconds: float, settle_s: float) -> dict:
    from fake_engine import FakeEngine
    from rt_helpers import fake_gateway

    from realtime.soak.floods import Witness

    async with fake_gateway(FakeEngine(capacity=8, answer_ms=3000), token=TOKEN) as gw:
        base = f"http://127.0.0.1:{gw.port}"
        witness, stop = Witness(base, TOKEN), asyncio.Event()
        task = asyncio.create_task(witness.run(stop))
        ticker = LoopTicker()
        ticking = asyncio.create_task(ticker.run(stop))
        await asyncio.sleep(settle_s + 1.0)
        results = {}
        for kind in KINDS:
            t_before, t0 = time.monotonic() - settle_s, time.monotonic()
            proc = await asyncio.create_subprocess_exec(
                sys.executable, __file__, "--attack", kind, base.replace("http", "ws", 1) + "/v1/realtime", TOKEN, str(seconds),
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, preexec_fn=lambda: os.nice(10))
            out, err = await asyncio.wait_for(proc.communicate(), seconds + 120)
            t1 = time.monotonic()
            try:
                client = json.loads(out.decode().strip().splitlines()[-1])
            except (IndexError, ValueError):
                client = {"attacker_failed": err.decode()[-600:]}
            results[kind] = {"attacker": client, "witness_before": {**witness.window(t_before, t0), "loop": ticker.window(t_before, t0)},
                             "witness_during": {**witness.window(t0, t1), "loop": ticker.window(t0, t1)}}
            print(f"{kind}: {json.dumps(results[kind])}", flush=True)
            await asyncio.sleep(settle_s)
        stop.set()
        await asyncio.wait_for(task, 40)
        await ticking
    return {"kinds": results, "witness": {"answers": witness.answers, "errors": witness.errors, "lost": witness.lost}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=4.0, help="how long each attacker sends")
    ap.add_argument("--settle", type=float, default=2.0, help="quiet seconds before and after each attack")
    ap.add_argument("--attack", nargs=4, metavar=("KIND", "WS_URL", "TOKEN", "SECONDS"), help="run one attacker (internal)")
    args = ap.parse_args()
    if args.attack:
        kind, url, token, seconds = args.attack
        print(json.dumps(asyncio.run(attack(kind, url, token, float(seconds)))), flush=True)
        return 0
    result = asyncio.run(run(args.seconds, args.settle))
    print(json.dumps(result["witness"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
