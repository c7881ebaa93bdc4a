"""The whole pipeline's edge against the capacity model's prediction, side by side in one run.

    python scripts/capacity_sweep.py                        # N = 6, 8, 10, 12 callers, 30 s each
    python scripts/capacity_sweep.py --sessions 4,6,8 --cpu-threads 2

For each N a soak (scripts/soak.py) of N callers on every transport with the capacity forced to N
(`engine.capacity_override`, so all are admitted whatever the model says), measuring the share of
chunks on time, while the server's capacity model (engine/capacity.py) keeps predicting from what it
measures (its bounds, read from /healthz every second). The edge is the largest N whose callers keep
at least --goal of their chunks on time; the prediction is the model's median over the runs at the
edge and up to two callers below it (beyond the edge the machine is overloaded: the engine's steps
slow down and the model rightly reports that it can serve fewer, which is no prediction of the edge).
Last line: edge=E predicted=P error=X% (|P - E| / E).

Soak callers run on this machine: they are other processes to the server, as interference from
outside would be, and the model counts them (its `other_cpu`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from realtime.soak.run import SoakConfig, run_soak  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sessions", default="6,8,10,12", help="caller counts to try (default 6,8,10,12)")
    p.add_argument("--duration", type=float, default=30.0, help="seconds of each soak (default 30)")
    p.add_argument("--cpu-threads", type=int, help="engine.cpu_threads for the servers (default: the server's)")
    p.add_argument("--goal", type=float, default=0.995, help="share of chunks on time that counts as served (default 0.995)")
    p.add_argument("--out", default="artifacts/capacity_sweep")
    args = p.parse_args()
    counts = sorted({int(x) for x in args.sessions.split(",")})
    engine = {} if args.cpu_threads is None else {"cpu_threads": args.cpu_threads}
    rows = []
    for n in counts:
        server_config = {"vad": {"silence_duration_ms": 500}, "session": {"max_response_ms": 4000.0}, "engine": engine}
        path = asyncio.run(run_soak(SoakConfig(sessions=n, duration_s=args.duration, ramp_s=2.0, capacity=n,
                                               server_config=server_config, out_dir=Path(args.out) / f"n{n}")))
        report = json.loads(Path(path).read_text())
        share = report["overall"]["chunks_on_time_share"] or 0.0
        cap = report.get("capacity") or {}
        rows.append({"sessions": n, "on_time": share, "underruns": report["overall"]["underruns"],
                     "predicted": cap.get("predicted_p50"), "limited_by": cap.get("limited_by"),
                     "unaccounted": report["frames_unaccounted"], "report": str(path)})
    print(f"{'callers':>8s} {'on time':>8s} {'underruns':>10s} {'predicted':>10s}  limited by")
    for r in rows:
        print(f"{r['sessions']:>8d} {100 * r['on_time']:7.1f}% {r['underruns']:>10d} {r['predicted'] if r['predicted'] is not None else '-':>10}"
              f"  {r['limited_by'] or '-'}")
    served = [r["sessions"] for r in rows if r["on_time"] >= args.goal]
    edge = max(served) if served else 0
    near = [r["predicted"] for r in rows if r["predicted"] is not None and edge - 2 <= r["sessions"] <= edge]
    predicted = statistics.median(near) if near else None
    err = None if predicted is None or not edge else abs(predicted - edge) / edge
    summary = {"edge": edge, "predicted": predicted, "error": err, "goal": args.goal, "cpu_threads": args.cpu_threads, "runs": rows}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(f"edge={edge} predicted={predicted} error={'-' if err is None else f'{100 * err:.0f}%'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
