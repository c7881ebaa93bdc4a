"""Two replicas behind HAProxy on this machine, a soak through the balancer, a crash and a drain on its
timeline (docs/scaling.md).

    python scripts/scale_run.py                                  # 2 replicas, callers = both capacities, 60 s
    python scripts/scale_run.py --extra 2 --kill-at 20 --drain-at 40

Starts `duplex serve --replica-id duplex-0|1` (tiny model) and `haproxy -f deploy/haproxy.cfg`, reads
each replica's capacity from its /healthz, and runs `scripts/soak.py --url <balancer>` (unchanged; its
frames are accounted on both replicas' /metrics) with as many callers as both hold plus --extra. At
--kill-at seconds SIGKILL hits duplex-0 (its callers' calls end; the others must lose nothing); at
--drain-at SIGTERM drains duplex-1 (no new sessions; running calls go on). Both events are printed
with their time on the soak's clock (the timeline's t) and written to the report directory.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from realtime.soak.balancer import Balancer  # noqa: E402
from realtime.soak.run import SoakConfig, run_soak  # noqa: E402
from realtime.soak.server_process import ServerProcess, health  # noqa: E402


async def _events(replicas, kill_at: float | None, drain_at: float | None, t0: float, out: list) -> None:
    plan = sorted([(t, "kill", 0) for t in [kill_at] if t is not None] + [(t, "drain", 1) for t in [drain_at] if t is not None])
    for at, what, i in plan:
        await asyncio.sleep(max(0.0, t0 + at - time.monotonic()))
        r = replicas[i]
        if what == "kill":
            await asyncio.to_thread(r.kill)
        else:
            r.proc.terminate()
        out.append({"at": time.monotonic(), "event": f"{what} duplex-{i}"})
        print(f"scale_run: {time.monotonic() - t0:.1f} s into the run: {what} duplex-{i}", flush=True)


async def main_async(a: argparse.Namespace) -> int:
    token = secrets.token_urlsafe(12)
    config = {"vad": {"silence_duration_ms": 500}, "session": {"max_response_ms": 4000.0},
              "limits": {"drain_timeout_s": float(a.drain_timeout)}}
    if a.capacity:
        config["engine"] = {"capacity_override": a.capacity}
    with ThreadPoolExecutor(2) as pool:
        # ports of the OS's choosing: one picked free beforehand could be taken by the other replica's engine core
        replicas = [f.result() for f in [pool.submit(ServerProcess, config, token, 0, f"duplex-{i}") for i in range(2)]]
    ports = [r.port for r in replicas]
    lb = Balancer(ports)
    events: list[dict] = []
    try:
        lb.wait_routable()
        await asyncio.sleep(3.0)
        caps = [health(r.base).get("capacity") or 0 for r in replicas]
        sessions = sum(caps) + a.extra
        print(f"scale_run: replicas' capacity {caps}; {sessions} callers through {lb.base}", flush=True)
        cfg = SoakConfig(sessions=sessions, duration_s=a.duration, ramp_s=a.ramp, url=lb.base, token=token,
                         out_dir=Path(a.out), metrics_urls=tuple(r.base for r in replicas), events=events)
        t0 = time.monotonic()
        ev = asyncio.create_task(_events(replicas, a.kill_at, a.drain_at, t0, events))
        path = await run_soak(cfg)
        ev.cancel()
        report = json.loads(Path(path).read_text())
        names = {r.base: f"duplex-{i}" for i, r in enumerate(replicas)}
        frames = {names[u]: c for u, c in (report.get("frames_by_server") or {}).items()}
        print(f"scale_run: frames counted by each replica {frames}", flush=True)
        report["scale_run"] = {"capacities": caps, "exit_codes": [r.proc.poll() for r in replicas], "frames_by_replica": frames,
                               "logs": [str(r.log_path) for r in replicas], "haproxy_log": str(lb.log_path)}
        Path(path).write_text(json.dumps(report, indent=1))
        print(f"scale_run: events {report['events']}; replicas' exit codes {report['scale_run']['exit_codes']}; report {path}", flush=True)
    finally:
        lb.stop()
        for r in replicas:
            if r.proc.poll() is None:
                r.stop()
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration", type=float, default=60.0)
    p.add_argument("--ramp", type=float, default=4.0)
    p.add_argument("--extra", type=int, default=0, help="callers beyond both replicas' capacity (refused)")
    p.add_argument("--capacity", type=int, help="engine.capacity_override for both replicas (default: measured)")
    p.add_argument("--kill-at", type=float, help="SIGKILL duplex-0 this many seconds into the soak")
    p.add_argument("--drain-at", type=float, help="SIGTERM (drain) duplex-1 this many seconds into the soak")
    p.add_argument("--drain-timeout", type=float, default=300.0, help="limits.drain_timeout_s of the replicas")
    p.add_argument("--out", default="artifacts/scale_run")
    a = p.parse_args()
    if a.duration <= 0 or a.extra < 0:
        raise SystemExit("scale_run: --duration must be > 0 and --extra >= 0")
    return asyncio.run(main_async(a))


if __name__ == "__main__":
    sys.exit(main())
