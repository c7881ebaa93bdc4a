"""The gateway's own CPU cost per session, as a fraction of one core.

N clients (a separate process) talk to the gateway over real sockets on 127.0.0.1 with real speech
(espeak-ng) at real-time pace; the server VAD ends each turn and the answer (2 s of audio) is paced
back. The engine is replaced by a fixed-audio responder IN THIS BENCHMARK ONLY, so what is measured
is the gateway: Opus/pcm16 decode + resampling + Silero VAD + Opus/pcm16 encode + pacing + JSON/base64.

    python scripts/bench_gateway.py --sessions 8 --seconds 20 --format opus

Prints the server process's CPU seconds / wall seconds / sessions, the share of it spent in Silero's
model calls (counted by the VAD batcher), and both figures' medians over `--repeats` runs (this
machine is noisy: one run's figure moves by 15-25 % within minutes, more over a day). The goal,
<= 0.02 core per session, is for the gateway's plumbing (Opus decode + encode + framing +
JSON/base64): the last line, the cost without the VAD. The VAD, a neural model run on every 32 ms of every session, is the largest single
item and is reported beside it.

`--noise-reduction off,near_field` (the default) runs the gateway with each server default of
`session.noise_reduction` in turn, alternating, so machine noise hits both alike: per-session CPU
side by side, with the suppressor's own CPU (counted around `NoiseSuppressor.process`, which runs
on the loop's thread) beside it.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "realtime"))

from engine.service_api import AudioChunk, EngineHealth, EngineLoad, HistoryTurn  # noqa: E402

ANSWER_MS = 2000
NOISE_MODES = ("off", "near_field", "far_field")
_ns_cpu = [0.0]  # thread CPU seconds inside NoiseSuppressor.process (this process is the gateway's)


def _count_noise_suppression_cpu() -> None:
    from realtime.noise_suppression import NoiseSuppressor

    process = NoiseSuppressor.process

    def counted(self, pcm):
        t0 = time.thread_time()
        try:
            return process(self, pcm)
        finally:
            _ns_cpu[0] += time.thread_time() - t0

    NoiseSuppressor.process = counted


class FixedResponse:
    """A 2 s tone, produced 2x faster than real time in 100 ms chunks."""

    def __init__(self, response_id: str, pcm: np.ndarray) -> None:
        self.id = response_id
        self._pcm = pcm
        self._cancelled = False
        self.dropped_exchanges: tuple[str, ...] = ()  # the engine's context management: nothing dropped here

    async def chunks(self):
        step = 1600
        for i in range(0, self._pcm.size, step):
            if self._cancelled:
                return
            await asyncio.sleep(0.05)
            yield AudioChunk(self.id, self._pcm[i : i + step], i / 16, 100.0, time.monotonic() + 1, "", i + step >= self._pcm.size)

    def cancel(self, played_ms: float) -> None:
        self._cancelled = True

    async def user_transcript(self):  # transcription is never asked for here
        return
        yield

    def confirm(self) -> None: ...

    def discard(self) -> None:
        self._cancelled = True


class FixedConversation:
    def __init__(self, sid: str) -> None:
        self.id = sid
        self._pcm = (6000 * np.sin(2 * np.pi * 220 * np.arange(16 * ANSWER_MS) / 16000)).astype(np.int16)

    def update_options(self, options) -> None: ...

    def push_user_audio(self, pcm) -> None: ...

    def end_user_turn(self) -> None: ...

    def respond(self, response_id: str, speculative: bool = False, instructions: str | None = None) -> FixedResponse:
        return FixedResponse(response_id, self._pcm)

    def truncate(self, response_id: str, played_ms: float) -> None: ...

    def add_user_text(self, text: str) -> None: ...

    def delete_turn(self, response_id: str, role) -> None: ...

    def suspend(self) -> None: ...

    def resume(self) -> None: ...

    async def close(self) -> None: ...

    @property
    def history(self) -> list[HistoryTurn]:
        return []


class FixedEngine:
    supports_text = False  # audio only

    def __init__(self) -> None:
        self.open = 0

    def open_conversation(self, sid, options=None):
        self.open += 1
        return FixedConversation(sid)

    def health(self):
        return EngineHealth(True, "fixed-audio responder (benchmark only)")

    def load(self):
        return EngineLoad(self.open, 0, 1000, 0.0, 0.0)

    def report_delivery(self, chunks: int, late_chunks: int, underruns: int) -> None: ...

    async def shutdown(self) -> None: ...


def clients(port: int, n: int, seconds: float, fmt: str, ready, result) -> None:
    from rt_helpers import espeak, silence

    import websockets

    from realtime.audio import InputDecoder, OutputEncoder, WireFormat

    utt = np.concatenate([espeak("hello there, this is a benchmark of the gateway", 24_000), silence(900, 24_000)])

    async def one(k: int) -> dict:
        stats = {"deltas": 0, "binary": 0, "responses": 0}
        async with websockets.connect(f"ws://127.0.0.1:{port}/v1/realtime?token=t", max_size=None) as ws:
            if fmt == "opus":
                await ws.send(json.dumps({"type": "session.update", "session": {"audio": {"output": {"format": {"type": "audio/opus"}}}}}))

            async def rx():
                async for m in ws:
                    if isinstance(m, bytes):
                        stats["binary"] += 1
                    else:
                        t = json.loads(m)["type"]
                        stats["deltas"] += t == "response.output_audio.delta"
                        stats["responses"] += t == "response.done"

            task = asyncio.create_task(rx())
            enc, dec = OutputEncoder(WireFormat.OPUS), InputDecoder(WireFormat.PCM16)
            t0, sent = time.monotonic(), 0
            await asyncio.sleep(k * 0.137)
            while time.monotonic() - t0 < seconds:
                piece = utt[(sent * 480) % (utt.size - 480):][:480]
                if fmt == "opus":
                    for pkt in enc.encode(dec.decode(piece.astype("<i2").tobytes())):
                        await ws.send(b"\x01" + pkt)
                else:
                    await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": base64.b64encode(piece.astype("<i2").tobytes()).decode()}))
                sent += 1
                await asyncio.sleep(max(0.0, t0 + sent * 0.02 - time.monotonic()))
            task.cancel()
        return stats

    async def main():
        ready.wait()
        return await asyncio.gather(*(one(k) for k in range(n)))

    result.put(asyncio.run(main()))


async def serve_and_measure(args, noise: str = "off") -> dict:
    """One run: a fresh gateway and client process; the server's CPU over the clients' run. `noise`:
    the sessions' noise reduction (the server's default, config session.noise_reduction)."""
    from realtime.config import config_from_dict
    from realtime.server import Gateway

    # every session connects at once by design: slow start (which admits a burst a few at a time) is off
    gw = Gateway(FixedEngine(), config_from_dict({"server": {"port": 0, "token": "t"},
                                                 "limits": {"overload": {"slow_start": False}},
                                                 "session": {"noise_reduction": None if noise == "off" else noise}}))
    await gw.start()
    ctx = mp.get_context("spawn")
    ready, result = ctx.Event(), ctx.Queue()
    proc = ctx.Process(target=clients, args=(gw.port, args.sessions, args.seconds, args.format, ready, result))
    proc.start()
    await asyncio.sleep(3.0)  # let the client process import and build its speech
    vad = gw.vad
    vad_cpu0 = vad.cpu_s if vad is not None else 0.0
    cpu0, wall0, ns0 = time.process_time(), time.monotonic(), _ns_cpu[0]
    ready.set()
    while proc.is_alive():
        await asyncio.sleep(0.2)
    cpu, wall, ns_cpu = time.process_time() - cpu0, time.monotonic() - wall0, _ns_cpu[0] - ns0
    vad_cpu = vad.cpu_s - vad_cpu0 if vad is not None else float("nan")
    stats = result.get(timeout=5)
    await gw.stop()
    per, vad_per, ns_per = cpu / wall / args.sessions, vad_cpu / wall / args.sessions, ns_cpu / wall / args.sessions
    print(f"format={args.format} noise_reduction={noise} sessions={args.sessions} wall={wall:.1f}s gateway_cpu={cpu:.2f}s "
          f"vad_cpu={vad_cpu:.2f}s noise_suppression_cpu={ns_cpu:.2f}s "
          f"responses={sum(s['responses'] for s in stats)} audio_msgs={sum(s['deltas'] + s['binary'] for s in stats)}")
    if vad is not None and vad.calls:
        print(f"  vad: {vad.windows} windows in {vad.calls} batched calls ({vad.windows / vad.calls:.1f} per call, {vad.ticks} ticks)")
    print(f"  per session: {100 * per:.2f}% of one core, of which Silero VAD {100 * vad_per:.2f}%, "
          f"noise suppression {100 * ns_per:.2f}%")
    return {"all": per, "vad": vad_per, "ns": ns_per}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sessions", type=int, default=8)
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--format", choices=["opus", "pcm16"], default="opus")
    p.add_argument("--repeats", type=int, default=3, help="runs, each with a fresh gateway; the medians are reported")
    p.add_argument("--noise-reduction", default="off,near_field",
                   help=f"comma-separated session noise reductions to compare, alternating ({', '.join(NOISE_MODES)})")
    args = p.parse_args()
    modes = [m for m in args.noise_reduction.split(",") if m]
    if args.sessions < 1 or args.seconds <= 0 or args.repeats < 1:
        p.error("--sessions and --repeats must be >= 1 and --seconds > 0")
    if not modes or any(m not in NOISE_MODES for m in modes):
        p.error(f"--noise-reduction takes a comma-separated list of {', '.join(NOISE_MODES)}")
    _count_noise_suppression_cpu()
    by_mode: dict[str, list[dict]] = {m: [] for m in modes}
    for _ in range(args.repeats):
        for m in modes:  # alternating: machine noise hits every mode alike
            by_mode[m].append(asyncio.run(serve_and_measure(args, m)))
    base = by_mode[modes[0]]
    for m in modes:
        r = by_mode[m]
        total, ns = statistics.median(x["all"] for x in r), statistics.median(x["ns"] for x in r)
        diff = statistics.median(a["all"] - b["all"] for a, b in zip(r, base))
        print(f"noise_reduction={m}: gateway CPU per session {100 * total:.2f}% of one core (median of {len(r)}), "
              f"noise suppression itself {100 * ns:.3f}%, vs {modes[0]} {100 * diff:+.2f}% (paired runs' median difference)")
    runs = base
    total = statistics.median(r["all"] for r in runs)
    vad = statistics.median(r["vad"] for r in runs)
    rest = statistics.median(r["all"] - r["vad"] - r["ns"] for r in runs)
    spread = ", ".join(f"{100 * r['all']:.2f}" for r in runs)
    print(f"gateway CPU per session, noise_reduction={modes[0]} (median of {len(runs)} runs: {spread}): {100 * total:.2f}% "
          f"of one core, of which Silero VAD {100 * vad:.2f}%")
    print(f"gateway CPU per session without the VAD and noise suppression (Opus/pcm16 codecs, resampling, framing, "
          f"JSON/base64, pacing): {100 * rest:.2f}% of one core (goal <= 2%)")


if __name__ == "__main__":
    main()
