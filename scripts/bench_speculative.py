"""Speculative response: time to first audio after the end-of-turn silence, speculation off and on,
side by side in one run (docs/soak.md, "Speculative response").

    python scripts/bench_speculative.py                      # both parts (about 6 minutes here)
    python scripts/bench_speculative.py --turns 6 --skip-soak

1. One session through the official `openai` SDK's realtime client against `duplex serve` (tiny
   model): the same espeak-ng sentences, turns alternating speculation off / on
   (`turn_detection.speculative` in `session.update`), each followed by silence. The server's time to
   first audio (end of speech -> first audio sent; `response.done`'s `duplex` figures, opted in with
   `?duplex=1`) minus `silence_duration_ms` is what the caller waits beyond the silence itself.
2. The capacity edge: a soak of `--sessions` callers on every transport (scripts/soak.py), once with
   speculation off, once on (`vad.speculative` and `telephony.vad.speculative` in the server config;
   the phone line's silence set to the WebSocket's, so one silence applies to every answer).
   Server TTFA p50 minus the silence, chunks on time, and the speculations the server counted.

No timing is asserted anywhere: these are figures to read (the machine is noisy; both modes run in
the same process tree, interleaved in part 1).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import secrets
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from realtime.soak.run import SoakConfig, run_soak  # noqa: E402
from realtime.soak.server_process import ServerProcess, read_metrics  # noqa: E402
from realtime.soak.speech import speech_sentences  # noqa: E402

SILENCE_MS = 500


def _pcm24(pcm16: np.ndarray) -> np.ndarray:
    import soxr

    return soxr.resample(pcm16.astype(np.float32) / 32768.0, 16_000, 24_000)


async def _sdk_turns(base: str, token: str, turns: int) -> dict[bool, list[dict]]:
    """Turns alternating speculation off / on in one session of the official SDK; per mode the server's
    figures for each answer."""
    from openai import AsyncOpenAI

    ws_base = base.replace("http://", "ws://") + "/v1"
    client = AsyncOpenAI(api_key=token, websocket_base_url=ws_base)
    sentences = speech_sentences(0)
    out: dict[bool, list[dict]] = {False: [], True: []}
    async with client.realtime.connect(model="duplex-opuslm", extra_query={"duplex": "1"}) as conn:

        async def until(kind: str) -> dict:
            while True:
                ev = json.loads(await conn.recv_bytes())  # raw: our events are not in the SDK's union
                if ev["type"] == "error":
                    raise RuntimeError(f"server error: {ev['error']}")
                if ev["type"] == kind:
                    return ev

        await until("session.created")
        for k in range(2 * turns):
            speculative = k % 4 in (1, 2)  # off, on, on, off, ...: each mode as often first
            await conn.session.update(session={"type": "realtime", "audio": {"input": {"transcription": None, "turn_detection": {
                "type": "server_vad", "silence_duration_ms": SILENCE_MS, "speculative": speculative}}}})
            await until("session.updated")
            speech = _pcm24(sentences[k % len(sentences)].pcm16k)
            audio = np.concatenate([speech, np.zeros(24 * (SILENCE_MS + 1500))])
            pcm = (np.clip(audio, -1, 1) * 32767).astype("<i2")
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            sender = asyncio.create_task(_stream(conn, pcm, t0))
            done = await until("response.done")
            await sender
            if done["response"]["status"] != "completed":
                raise RuntimeError(f"turn {k}: answer {done['response']['status']}")
            figures = done["response"].get("duplex") or {}
            out[speculative].append({"ttfa_ms": figures.get("ttfa_ms"), "after_confirm_ms": figures.get("after_confirm_ms")})
            print(f"  turn {k + 1:2d} speculative={'on ' if speculative else 'off'}  server ttfa {figures.get('ttfa_ms')} ms"
                  f"  (after confirmation: {figures.get('after_confirm_ms')} ms)", flush=True)
    return out


async def _stream(conn, pcm: np.ndarray, t0: float) -> None:
    """20 ms appends on an absolute real-time schedule (a microphone)."""
    loop = asyncio.get_running_loop()
    n = 24 * 20
    for i, start in enumerate(range(0, pcm.size, n)):
        await conn.input_audio_buffer.append(audio=base64.b64encode(pcm[start : start + n].tobytes()).decode())
        await asyncio.sleep(max(0.0, t0 + (i + 1) * 0.02 - loop.time()))


def _median(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:7.1f}"


def part_one(turns: int) -> dict:
    token = secrets.token_urlsafe(12)
    print(f"1) one session, official openai SDK, {turns} turns per mode, silence_duration_ms {SILENCE_MS}", flush=True)
    server = ServerProcess({"vad": {"silence_duration_ms": SILENCE_MS}, "session": {"max_response_ms": 3000.0}}, token)
    try:
        res = asyncio.run(asyncio.wait_for(_sdk_turns(server.base, token, turns), 60 + 30 * turns))
        metrics = read_metrics(server.base, token)
    finally:
        server.stop()
    rows = {}
    for mode in (False, True):
        ttfa = _median([r["ttfa_ms"] for r in res[mode]])
        rows[mode] = {"turns": len(res[mode]), "server_ttfa_p50_ms": ttfa,
                      "after_silence_p50_ms": None if ttfa is None else ttfa - SILENCE_MS,
                      "after_confirm_p50_ms": _median([r["after_confirm_ms"] for r in res[mode]])}
    spec = {k.split('"')[1]: v for k, v in metrics.items() if k.startswith("duplex_speculative_responses_total{")}
    print(f"   {'speculation':12s} {'server TTFA p50':>16s} {'TTFA - silence':>15s} {'after confirm':>14s}")
    for mode in (False, True):
        r = rows[mode]
        print(f"   {'on' if mode else 'off':12s} {_fmt(r['server_ttfa_p50_ms']):>13s} ms {_fmt(r['after_silence_p50_ms']):>12s} ms"
              f" {_fmt(r['after_confirm_p50_ms']):>11s} ms")
    print(f"   speculations counted by the server: {spec}", flush=True)
    return {"silence_ms": SILENCE_MS, "off": rows[False], "on": rows[True], "speculations": spec}


def part_two(sessions: int, duration: float, out_dir: Path) -> dict:
    print(f"2) the capacity edge: {sessions} callers, {duration:.0f} s, speculation off then on", flush=True)
    result = {}
    for mode in (False, True):
        vad = {"silence_duration_ms": SILENCE_MS, "speculative": mode}
        server_config = {"vad": vad, "telephony": {"vad": vad}, "session": {"max_response_ms": 4000.0}}
        path = asyncio.run(run_soak(SoakConfig(sessions=sessions, duration_s=duration, ramp_s=5.0, server_config=server_config,
                                               out_dir=out_dir / ("on" if mode else "off"))))
        report = json.loads(Path(path).read_text())
        overall = report["overall"]
        ttfa = (overall.get("server_ttfa_ms") or {}).get("p50")
        acct = report.get("accounting", {})
        result["on" if mode else "off"] = {
            "report": str(path), "admitted": overall["admitted"], "answers": overall["answers"],
            "server_ttfa_p50_ms": ttfa, "after_silence_p50_ms": None if ttfa is None else round(ttfa - SILENCE_MS, 1),
            "chunks_on_time_share": overall["chunks_on_time_share"], "underruns": overall["underruns"],
            "frames_unaccounted": acct.get("frames_unaccounted"),
            "speculations": {k.split('"')[1]: v for k, v in report["server"]["metrics_delta"].items()
                             if k.startswith("duplex_speculative_responses_total{")},
        }
    print(f"   {'speculation':12s} {'server TTFA p50':>16s} {'TTFA - silence':>15s} {'on time':>8s} {'underruns':>10s}")
    for key in ("off", "on"):
        r = result[key]
        share = r["chunks_on_time_share"]
        print(f"   {key:12s} {_fmt(r['server_ttfa_p50_ms']):>13s} ms {_fmt(r['after_silence_p50_ms']):>12s} ms"
              f" {'-' if share is None else f'{100 * share:6.1f} %':>8s} {r['underruns']:>10d}   ({r['answers']} answers, {r['report']})")
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--turns", type=int, default=4, help="turns per mode in part 1 (default 4)")
    p.add_argument("--sessions", type=int, default=8, help="callers in part 2 (default 8: this machine's edge, docs/soak.md)")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of each soak in part 2 (default 60)")
    p.add_argument("--skip-soak", action="store_true", help="part 1 only")
    p.add_argument("--out", default="artifacts/bench_speculative", help="where the reports go")
    args = p.parse_args()
    if args.turns < 3:
        p.error("--turns: at least 3 (medians)")
    out = Path(args.out)
    summary = {"one_session_sdk": part_one(args.turns)}
    if not args.skip_soak:
        summary["capacity_edge"] = part_two(args.sessions, args.duration, out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(out / "summary.json")


if __name__ == "__main__":
    main()
