"""A soak run: N callers over real sockets for a bounded time, then the report.

    python scripts/soak.py --sessions 8 --duration 60            # starts `duplex serve` (tiny model)
    python scripts/soak.py --url http://127.0.0.1:8000 --token T # against a running server
    python scripts/soak.py --sessions 16 --ramp 2 --neighbour 1  # a CPU hog starts halfway through
    duplex soak ...                                              # the same

Callers arrive spread over `--ramp` seconds, mix transports round-robin (`--mix`), converse until
`--duration` is over, let their last answer finish, hang up. The server's /metrics are read before
and after (frame accounting) and every second during the run with its RSS and open file
descriptors (when this run started it). The last line printed is the report's path.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import subprocess
import sys
import time
from pathlib import Path

from realtime.soak.callers import CALLERS, Script
from realtime.soak.config import SoakConfig  # re-exported: scripts build runs from here
from realtime.soak.report import frame_counts, write_report
from realtime.soak.server_process import ServerProcess, health, process_sample, read_metrics
from realtime.soak.speech import speech_sentences


async def _sampler(base: str, token: str, pid: int | None, t0: float, stop: asyncio.Event, out: list,
                   replicas: list[str], last_metrics: dict[str, dict]) -> None:
    while not stop.is_set():
        row = {"t": round(time.monotonic() - t0, 2), **(await asyncio.to_thread(health, base))}
        if len(replicas) > 1:  # behind a balancer: each replica's own count (/healthz through it is one replica's)
            row["replica_sessions"] = [(await asyncio.to_thread(health, u)).get("sessions") for u in replicas]
            for u in replicas:  # a replica that exits (drained, or killed) is accounted up to its last sample
                try:
                    last_metrics[u] = await asyncio.to_thread(read_metrics, u, token)
                except OSError:
                    pass
        if pid is not None:
            row.update(await asyncio.to_thread(process_sample, pid))
        out.append(row)
        try:
            await asyncio.wait_for(stop.wait(), 1.0)
        except asyncio.TimeoutError:
            pass


def _read_all_metrics(bases: list[str], token: str, last: dict[str, dict] | None = None,
                      each: dict[str, dict] | None = None) -> dict[str, float]:
    """Every server's counters, summed by name (replicas behind a balancer count their own sessions); one
    that has exited counts with its `last` sample (the frames of its last second are missing). `each`
    receives every server's own."""
    out: dict[str, float] = {}
    for base in bases:
        try:
            metrics = read_metrics(base, token)
        except OSError as e:
            if len(bases) == 1:
                raise
            metrics = (last or {}).get(base, {})
            print(f"soak: {base}/metrics unreadable ({e}): {'its last sample' if metrics else 'nothing'} counts", flush=True)
        if each is not None:
            each[base] = metrics
        for k, v in metrics.items():
            out[k] = out.get(k, 0.0) + v
    return out


async def _sessions_closed(bases: list[str], timeout_s: float = 15.0) -> None:
    """Until every server reports no session open (its /healthz), at most `timeout_s`; then a moment more
    for the last counters. A fixed pause was too short on a loaded machine: a frame counted by a session
    still closing was read as lost."""
    deadline = time.monotonic() + timeout_s
    await asyncio.sleep(0.5)
    while time.monotonic() < deadline:
        states = await asyncio.gather(*(asyncio.to_thread(health, b) for b in bases))
        if all(s.get("sessions", 0) == 0 for s in states):
            break
        await asyncio.sleep(0.25)
    await asyncio.sleep(0.25)


async def run_soak(cfg: SoakConfig) -> Path:
    token = cfg.token or secrets.token_urlsafe(12)
    server = None
    if cfg.url is None:
        server_cfg = {"vad": {"silence_duration_ms": 500}, "session": {"max_response_ms": 4000.0}, **cfg.server_config}
        if cfg.max_sessions is not None:
            server_cfg.setdefault("limits", {})["max_sessions"] = cfg.max_sessions
        if cfg.capacity is not None:
            server_cfg.setdefault("engine", {})["capacity_override"] = cfg.capacity
            server_cfg.setdefault("limits", {}).setdefault("overload", {"slow_start": False, "degrade": False})
        print(f"soak: starting duplex serve ({json.dumps(server_cfg)})", flush=True)
        server = await asyncio.to_thread(ServerProcess, server_cfg, token)
        base = server.base
    else:
        base = cfg.url.rstrip("/")
    script = Script(speech_sentences(cfg.seed), barge_in=cfg.barge_in)
    unknown = [m for m in cfg.mix if m not in CALLERS]
    if unknown:
        raise SystemExit(f"soak: unknown transport(s) {unknown} (known: {', '.join(CALLERS)})")
    counted = [u.rstrip("/") for u in cfg.metrics_urls] or [base]
    before_each: dict[str, dict] = {}
    before = await asyncio.to_thread(_read_all_metrics, counted, token, None, before_each)
    t0 = time.monotonic()
    stop = asyncio.Event()
    timeline: list[dict] = []
    last_metrics: dict[str, dict] = {}
    sampler = asyncio.create_task(_sampler(base, token, server.pid if server else None, t0, stop, timeline, counted, last_metrics))
    until = t0 + cfg.ramp_s + cfg.duration_s

    async def one(i: int) -> list:
        await asyncio.sleep(cfg.ramp_s * i / max(1, cfg.sessions))
        calls = []
        for attempt in range(1000):
            caller = CALLERS[cfg.mix[i % len(cfg.mix)]](i, base, token, script, seed=cfg.seed * 1000 + i + 100_000 * attempt)
            calls.append(await caller.run(until))
            # --retry: a refused caller calls again after the server's retry_after_s, as a client told so would
            if calls[-1].refused is None or cfg.retry_s is None or time.monotonic() + cfg.retry_s + 10.0 > until:
                break
            await asyncio.sleep(cfg.retry_s)
        return calls

    print(f"soak: {cfg.sessions} callers ({', '.join(cfg.mix)}) for {cfg.duration_s:.0f} s against {base}", flush=True)
    hogs = asyncio.create_task(_neighbour(cfg, t0 + cfg.ramp_s + cfg.duration_s / 2, until)) if cfg.neighbour else None
    try:
        calls = await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(cfg.sessions))), cfg.ramp_s + cfg.duration_s + 120)
        records = [r for rs in calls for r in rs]  # one record per call (with --retry, a caller's every attempt)
    finally:
        if hogs is not None:
            hogs.cancel()
            await asyncio.gather(hogs, return_exceptions=True)
    await _sessions_closed(counted)  # a session counts its last frames as it closes: read the counters after
    after_each: dict[str, dict] = {}
    after = await asyncio.to_thread(_read_all_metrics, counted, token, last_metrics, after_each)
    final_health = await asyncio.to_thread(health, base)
    stop.set()
    await sampler
    exit_code = server.stop() if server else None
    cfg.out_dir.mkdir(parents=True, exist_ok=True)
    frames_by_server = {u: frame_counts(before_each.get(u, {}), after_each.get(u, {})) for u in counted} if len(counted) > 1 else None
    return write_report(cfg, records, before, after, timeline, t0, final_health, exit_code,
                        server.log_path if server else None, frames_by_server)


_HOG = "while True: pass"


async def _neighbour(cfg: SoakConfig, start: float, until: float) -> None:
    """`cfg.neighbour` busy processes from `start` to `until` (a noisy neighbour: the machine turns out busier than
    the warm-up measured it); their start and end are on the report's timeline."""
    await asyncio.sleep(max(0.0, start - time.monotonic()))
    procs = [subprocess.Popen([sys.executable, "-c", _HOG]) for _ in range(cfg.neighbour)]
    cfg.events.append({"at": time.monotonic(), "event": f"neighbour: {cfg.neighbour} CPU hog(s) start"})
    print(f"soak: neighbour: {cfg.neighbour} CPU hog(s) started (pids {[p.pid for p in procs]})", flush=True)
    try:
        await asyncio.sleep(max(0.0, until - time.monotonic()))
    finally:
        for p in procs:
            p.kill()
            p.wait()
        cfg.events.append({"at": time.monotonic(), "event": "neighbour: CPU hogs stopped"})


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sessions", type=int, default=8, help="simulated callers (default 8)")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of conversation after the ramp (default 60)")
    p.add_argument("--ramp", type=float, default=5.0, help="callers arrive spread over this many seconds (default 5)")
    p.add_argument("--mix", default="ws-pcm16,ws-opus,webrtc,twilio", help=f"transports, round-robin (known: {', '.join(CALLERS)})")
    p.add_argument("--barge-in", type=float, default=0.2, help="share of answers the caller speaks over (default 0.2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--url", help="a running server (default: start `duplex serve` on the tiny model)")
    p.add_argument("--token", help="its token")
    p.add_argument("--metrics-url", action="append", default=[], help="a server whose /metrics account for the frames "
                   "(repeat for each replica behind a balancer; default: --url)")
    p.add_argument("--max-sessions", type=int, help="server cap for the server this run starts (overload runs)")
    p.add_argument("--capacity", type=int, help="engine.capacity_override for the server this run starts "
                   "(default: the capacity the engine measures at warm-up)")
    p.add_argument("--neighbour", type=int, nargs="?", const=1, default=0, help="start this many CPU hogs (busy "
                   "processes, default 1) halfway through the run: a neighbour the warm-up did not see")
    p.add_argument("--retry", type=float, nargs="?", const=5.0, default=None, help="a refused caller calls again after "
                   "this many seconds (default 5, the server's retry_after_s), as a client told to retry would")
    p.add_argument("--faults", action="store_true", help="run the fault runs (realtime/soak/faults.py) instead of a soak")
    p.add_argument("--out", default="artifacts/soak", help="report directory (default artifacts/soak)")


def config_from_args(a: argparse.Namespace) -> SoakConfig:
    if a.sessions < 1 or a.sessions > 256:
        raise SystemExit("soak: --sessions must be within 1..256")
    if not 1 <= a.duration <= 3600:
        raise SystemExit("soak: --duration must be within 1..3600 s")
    if not 0.0 <= a.barge_in <= 1.0:
        raise SystemExit("soak: --barge-in must be within 0..1")
    if not 0 <= a.neighbour <= 64:
        raise SystemExit("soak: --neighbour must be within 0..64")
    if a.retry is not None and not 0.1 <= a.retry <= 600:
        raise SystemExit("soak: --retry must be within 0.1..600 s")
    return SoakConfig(sessions=a.sessions, duration_s=a.duration, ramp_s=a.ramp, mix=tuple(m.strip() for m in a.mix.split(",") if m.strip()),
                      barge_in=a.barge_in, seed=a.seed, url=a.url, token=a.token, out_dir=Path(a.out), max_sessions=a.max_sessions,
                      capacity=a.capacity, metrics_urls=tuple(a.metrics_url), neighbour=a.neighbour, retry_s=a.retry)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="soak", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    args = p.parse_args(argv)
    return run_from_args(args)


def run_from_args(args: argparse.Namespace) -> int:
    try:
        if args.faults:
            from realtime.soak.faults import run_faults

            path = asyncio.run(run_faults(Path(args.out), args.seed))
        else:
            path = asyncio.run(run_soak(config_from_args(args)))
    except RuntimeError as e:
        raise SystemExit(f"soak: {e}") from None
    print(path)
    return 0
