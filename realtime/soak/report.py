"""The soak report: figures per transport and overall, frame accounting, the timeline, a plot."""

from __future__ import annotations

import json
import time
from collections import Counter
from dataclasses import asdict
from pathlib import Path

import numpy as np

from realtime.soak.callers import CallerRecord
from realtime.soak.config import SoakConfig


def _pct(values: list[float]) -> dict | None:
    if not values:
        return None
    a = np.asarray(values, float)
    return {"n": int(a.size), "p50": round(float(np.percentile(a, 50)), 1), "p95": round(float(np.percentile(a, 95)), 1),
            "p99": round(float(np.percentile(a, 99)), 1), "max": round(float(a.max()), 1)}


def summarize(records: list[CallerRecord]) -> dict:
    answers = [a for r in records for a in r.answers]
    # (ttfa, mouth-to-ear) of the answers timed from the caller's speech end (both known together)
    timed = [(t, m) for a in answers
             if (t := a.playout.ttfa_ms) is not None and t >= 0 and (m := a.playout.mouth_to_ear_ms) is not None]
    lateness = [x for a in answers for x in a.playout.lateness_ms]
    chunks = len(lateness)
    on_time = sum(1 for x in lateness if x <= 0)
    barged = [a for a in answers if a.barge_in_at is not None]
    stop_ms = [1000.0 * (cleared - barge) for a in barged
               if (barge := a.barge_in_at) is not None and (cleared := a.cleared_at) is not None and cleared >= barge]
    return {
        "sessions": len(records),
        "admitted": sum(1 for r in records if r.refused is None),
        "refused": dict(Counter(r.refused for r in records if r.refused)),
        "shed": sum(1 for r in records if r.shed),  # admitted, then ended with server_overloaded (counted in admitted)
        "crashed": sum(1 for r in records if r.crashed),
        "closed_by_server": sum(1 for r in records if r.closed_by_server),
        "utterances": sum(r.utterances for r in records),
        "answers": len(answers),
        "completed": sum(1 for a in answers if a.status == "completed"),
        "cancelled": sum(1 for a in answers if a.status == "cancelled"),
        "failed": sum(1 for a in answers if a.status == "failed"),
        "barge_ins": len(barged),
        "ttfa_ms": _pct([t for t, _ in timed]),
        "mouth_to_ear_ms": _pct([m for _, m in timed]),
        "server_ttfa_ms": _pct([a.server_ttfa_ms for a in answers if a.server_ttfa_ms is not None]),
        "barge_in_to_cleared_ms": _pct(stop_ms),
        "chunks": chunks,
        "chunks_on_time": on_time,
        "chunks_on_time_share": round(on_time / chunks, 4) if chunks else None,
        "lateness_ms": _pct(lateness),
        "underruns": sum(a.playout.underruns for a in answers),
        "errors": dict(Counter(code for r in records for code in r.errors)),
        "frames_sent": sum(r.frames_sent for r in records),
    }


def frame_counts(before: dict, after: dict) -> dict[str, int]:
    """One server's frame counters over the run: consumed, dropped by a counted policy, rejected with an error."""
    def delta(prefix: str) -> int:
        keys = {k for k in (*before, *after) if k == prefix or k.startswith(prefix + "{")}
        return int(sum(after.get(k, 0.0) - before.get(k, 0.0) for k in keys))

    return {"consumed": delta("duplex_input_frames_total"), "dropped": delta("duplex_input_frames_dropped_total"),
            "rejected": delta("duplex_input_frames_rejected_total")}


def accounting(records: list[CallerRecord], before: dict, after: dict) -> dict:
    """Every frame a caller sent: consumed by a session, dropped by policy (counted), rejected (an error),
    or sent to a call the server refused (a Twilio caller streams media right after `start`, before the
    refusal's close reaches it; no session exists to count those)."""
    sent = sum(r.frames_sent for r in records)
    if not any(k.startswith("duplex_input_frames_total") for k in after):
        return {"frames_sent": sent, "frames_unaccounted": None, "note": "the server does not export duplex_input_frames_total"}
    counts = frame_counts(before, after)
    consumed, dropped, rejected = counts["consumed"], counts["dropped"], counts["rejected"]
    refused = sum(r.frames_sent for r in records if r.refused)
    return {"frames_sent": sent, "frames_consumed": consumed, "frames_dropped_by_policy": dropped,
            "frames_rejected_with_error": rejected, "frames_to_refused_calls": refused,
            "frames_after_shed_not_counted": sum(r.frames_after_shed for r in records),
            # a call the server ended (server_overloaded) stops reading at its close: frames then in flight are counted by
            # nobody; this many were sent within 200 ms before those callers heard of it (an estimate, not subtracted)
            "frames_in_flight_at_shed": sum(r.frames_in_flight_at_shed for r in records),
            "frames_unaccounted": sent - consumed - dropped - rejected - refused}


def overload(delta: dict) -> dict:
    """What the server's overload control did over the run (realtime/overload.py), from its /metrics delta."""
    def total(prefix: str, label: str = "") -> int:
        return int(sum(v for k, v in delta.items() if k.startswith(prefix) and label in k))

    steps = {k.split('step="', 1)[1].split('"', 1)[0]: int(v) for k, v in delta.items()
             if k.startswith("duplex_overload_steps_total{") and v}
    return {"refused_slow_start": total("duplex_sessions_refused_total", 'reason="slow_start"'),
            "refused_capacity": total("duplex_sessions_refused_total", 'reason="capacity"'),
            "degradation_steps": steps, "shed": total("duplex_sessions_ended_total", 'reason="server_overloaded"')}


def predicted_capacity(timeline: list[dict], ramp_s: float) -> dict | None:
    """What the server's capacity model predicted while the callers talked (its bounds from /healthz,
    whatever cap the run forced): the median over the run after the ramp, and the resource that set it."""
    rows = [r for r in timeline if r.get("t", 0) > ramp_s + 5 and isinstance(r.get("bounds"), dict) and r["bounds"]]
    if not rows:
        return None
    predicted = sorted(min(r["bounds"].values()) for r in rows)
    limits = Counter(min(r["bounds"], key=r["bounds"].get) for r in rows)
    return {"predicted_p50": predicted[len(predicted) // 2], "predicted_min": predicted[0], "predicted_max": predicted[-1],
            "limited_by": limits.most_common(1)[0][0], "samples": len(rows)}


def memory_growth(timeline: list[dict], baseline_s: float = 300.0) -> dict | None:
    """The server's resident memory at `baseline_s` into the run (after the first 5 minutes: caches and
    pools have filled) and at its end, the gateway and the engine core apart (rss_tree - rss: vLLM's
    engine-core process), and the growth between. None for a run shorter than twice the baseline."""
    rows = [r for r in timeline if "rss_mib" in r and "rss_tree_mib" in r]
    if not rows or rows[-1]["t"] < 2 * baseline_s:
        return None
    base = min(rows, key=lambda r: abs(r["t"] - baseline_s))
    end = rows[-1]

    def part(r: dict) -> dict:
        return {"t": r["t"], "gateway_mib": round(r["rss_mib"], 1), "engine_mib": round(r["rss_tree_mib"] - r["rss_mib"], 1)}

    b, e = part(base), part(end)
    return {"baseline": b, "end": e, "gateway_growth": round(e["gateway_mib"] / b["gateway_mib"] - 1, 4),
            "engine_growth": round(e["engine_mib"] / b["engine_mib"] - 1, 4) if b["engine_mib"] > 0 else None}


def write_report(cfg: SoakConfig, records: list[CallerRecord], before: dict, after: dict, timeline: list[dict], t0: float,
                 final_health: dict, server_exit: int | None, server_log: Path | None,
                 frames_by_server: dict[str, dict] | None = None) -> Path:
    by_transport = {}
    for t in sorted({r.transport for r in records}):
        by_transport[t] = summarize([r for r in records if r.transport == t])
    overall = summarize(records)
    acct = accounting(records, before, after)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = Path(cfg.out_dir)
    report = {
        "config": {"sessions": cfg.sessions, "duration_s": cfg.duration_s, "ramp_s": cfg.ramp_s, "mix": list(cfg.mix),
                   "barge_in": cfg.barge_in, "seed": cfg.seed, "url": cfg.url or "started by the run", "max_sessions": cfg.max_sessions,
                   "capacity": cfg.capacity, "neighbour": getattr(cfg, "neighbour", 0), "retry_s": getattr(cfg, "retry_s", None)},
        "frames_unaccounted": acct["frames_unaccounted"],
        "sessions_crashed": overall["crashed"],
        "chunks_on_time_share": overall["chunks_on_time_share"],
        "overall": overall,
        "by_transport": by_transport,
        "accounting": acct,
        "frames_by_server": frames_by_server,  # behind a balancer: each replica's own counts (by its /metrics URL)
        "server": {"metrics_delta": {k: round(after.get(k, 0) - before.get(k, 0), 3) for k in sorted(set(after) | set(before))
                                     if k.split("{")[0].endswith("_total") or "_refused" in k},
                   "healthy_after": bool(final_health.get("ready")), "exit_code": server_exit,
                   "log": str(server_log) if server_log else None},
        "overload": None,
        "memory": memory_growth(timeline),
        "capacity": predicted_capacity(timeline, cfg.ramp_s),
        "timeline": timeline,
        "events": [{"t": round(e["at"] - t0, 2), "event": e["event"]} for e in getattr(cfg, "events", [])],
        "late_chunks": [(round(t - t0, 3), round(late, 1)) for r in records for a in r.answers for t, late in a.playout.late_at],
        "callers": [{k: v for k, v in asdict(r).items() if k != "answers"} | {"answers": len(r.answers)} for r in records],
    }
    report["overload"] = overload(report["server"]["metrics_delta"])
    path = out / f"soak-{stamp}.json"
    try:
        report["plot"] = str(plot(report, records, t0, out / f"soak-{stamp}.png"))
    except ImportError:
        report["plot"] = None  # matplotlib is optional (pip install matplotlib)
    path.write_text(json.dumps(report, indent=1, default=str))
    print(summary_lines(report), flush=True)
    return path


def summary_lines(report: dict) -> str:
    o = report["overall"]
    lines = [f"sessions {o['sessions']} (admitted {o['admitted']}, refused {o['refused'] or 0}, shed {o.get('shed', 0)}, "
             f"crashed {o['crashed']}); "
             f"answers {o['answers']} (completed {o['completed']}, cancelled {o['cancelled']}, failed {o['failed']}), barge-ins {o['barge_ins']}"]
    for name, s in [("all", o), *report["by_transport"].items()]:
        def f(x):
            return "-" if x is None else f"{x['p50']:.0f}/{x['p95']:.0f}/{x['p99']:.0f}"
        share = "-" if s["chunks_on_time_share"] is None else f"{100 * s['chunks_on_time_share']:.1f}%"
        lines.append(f"  {name:9s} ttfa p50/95/99 {f(s['ttfa_ms'])} ms  mouth-to-ear {f(s['mouth_to_ear_ms'])} ms  "
                     f"chunks on time {share} of {s['chunks']}  underruns {s['underruns']}  errors {s['errors'] or 0}")
    if (m := report.get("memory")) is not None:
        b, e = m["baseline"], m["end"]
        eng = "-" if m["engine_growth"] is None else f"{100 * m['engine_growth']:+.1f}%"
        lines.append(f"RSS at {b['t']:.0f} s -> {e['t']:.0f} s: gateway {b['gateway_mib']:.0f} -> {e['gateway_mib']:.0f} MiB "
                     f"({100 * m['gateway_growth']:+.1f}%), engine {b['engine_mib']:.0f} -> {e['engine_mib']:.0f} MiB ({eng})")
    if (c := report.get("capacity")) is not None:
        lines.append(f"the server's capacity model predicted {c['predicted_p50']} sessions (p50 over the run, "
                     f"{c['predicted_min']}-{c['predicted_max']}; limited by {c['limited_by']})")
    if (ov := report.get("overload")) is not None:
        lines.append(f"overload control: refused by slow start {ov['refused_slow_start']}, by capacity {ov['refused_capacity']}; "
                     f"degradation steps {ov['degradation_steps'] or 'none'}; sessions ended overloaded {ov['shed']}")
    a = report["accounting"]
    lines.append(f"frames sent {a['frames_sent']}, unaccounted {a['frames_unaccounted']}; server healthy after: {report['server']['healthy_after']}")
    return "\n".join(lines)


def plot(report: dict, records: list[CallerRecord], t0: float, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(2, 2, figsize=(12, 8))
    transports = sorted({r.transport for r in records})
    data, labels = [], []
    for t in transports:
        answers = [a for r in records if r.transport == t for a in r.answers if a.playout.ttfa_ms is not None and a.playout.ttfa_ms >= 0]
        data += [[a.playout.ttfa_ms for a in answers] or [0], [a.playout.mouth_to_ear_ms for a in answers] or [0]]
        labels += [f"{t}\nTTFA", f"{t}\nmouth-to-ear"]
    ax[0, 0].boxplot(data, tick_labels=labels, showfliers=True)
    ax[0, 0].set_ylabel("ms")
    ax[0, 0].set_title("latency per answer")
    ax[0, 0].tick_params(axis="x", labelsize=7)
    for t in transports:
        pts = [(tt - t0, late) for r in records if r.transport == t for a in r.answers
               for tt, late in zip(a.playout.arrivals, a.playout.lateness_ms)]
        if pts:
            xs, ys = zip(*pts)
            ax[0, 1].scatter(xs, ys, s=2, label=t)
    ax[0, 1].axhline(0, color="k", lw=0.8)
    ax[0, 1].set_title("chunk lateness vs playback deadline (>0 late)")
    ax[0, 1].set_xlabel("s")
    ax[0, 1].set_ylabel("ms")
    ax[0, 1].legend(fontsize=7)
    tl = report["timeline"]
    per_replica = [r for r in tl if r.get("replica_sessions")]
    if per_replica:
        for i in range(len(per_replica[0]["replica_sessions"])):
            ax[1, 0].plot([r["t"] for r in per_replica], [r["replica_sessions"][i] or 0 for r in per_replica], label=f"replica {i}")
        ax[1, 0].legend(fontsize=7)
        ax[1, 0].set_title("sessions open on each replica")
    else:
        ax[1, 0].plot([r["t"] for r in tl], [r.get("sessions", 0) for r in tl])
        ax[1, 0].set_title("sessions open on the server")
    ax[1, 0].set_xlabel("s")
    for e in report.get("events", []):  # a kill, a drain: on every time axis
        for a in (ax[0, 1], ax[1, 0], *([ax[1, 1]] if tl and "rss_mib" in tl[0] else [])):
            a.axvline(e["t"], color="red", ls=":", lw=1)
        ax[1, 0].annotate(e["event"], (e["t"], 0), rotation=90, fontsize=7, color="red", va="bottom")
    if tl and "rss_mib" in tl[0]:
        ax[1, 1].plot([r["t"] for r in tl], [r.get("rss_mib", 0) for r in tl], label="gateway RSS")
        ax[1, 1].plot([r["t"] for r in tl], [r.get("rss_tree_mib", 0) for r in tl], label="gateway + engine RSS")
        ax2 = ax[1, 1].twinx()
        ax2.plot([r["t"] for r in tl], [r.get("fds", 0) for r in tl], color="grey", ls="--", label="open fds")
        ax2.set_ylabel("fds")
        ax[1, 1].legend(fontsize=7)
    ax[1, 1].set_title("server memory (MiB) and open fds")
    ax[1, 1].set_xlabel("s")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path

