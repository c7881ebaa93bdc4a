"""A soak run: N callers over real sockets for a bounded time, then the report.

    python scripts/soak.py --sessions 8 --duration 60            # starts `duplex serve` (tiny model)
    python scripts/soak.py --url http://127.0.0.1:8000 --token T # against a running server
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
import os
import re
import secrets
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from realtime.soak.callers import CALLERS, Script, Utterance
from realtime.soak.report import write_report

SENTENCES = (
    "Hello, can you hear me?",
    "What is the weather like today?",
    "Tell me a short story about a lighthouse keeper.",
    "I would like to book a table for two at seven.",
    "Could you repeat that more slowly, please?",
    "Thanks, that is all for now.",
    "How far is the moon from the earth?",
    "Please remind me to call my sister tomorrow morning.",
)


@dataclass
class SoakConfig:
    sessions: int = 8
    duration_s: float = 60.0
    ramp_s: float = 5.0
    mix: tuple[str, ...] = ("ws-pcm16", "ws-opus", "webrtc", "twilio")
    barge_in: float = 0.2
    seed: int = 0
    url: str | None = None
    token: str | None = None
    out_dir: Path = Path("artifacts/soak")
    server_config: dict = field(default_factory=dict)  # for the server this run starts
    max_sessions: int | None = None  # server cap (overload runs)
    capacity: int | None = None  # the started server's engine capacity, instead of the measured one


def speech_sentences(seed: int) -> tuple[Utterance, ...]:
    """espeak-ng sentences at 16 kHz, trimmed to the speech (50 ms of lead-in kept)."""
    import shutil
    import wave

    import numpy as np
    import soxr

    if shutil.which("espeak-ng") is None:
        raise SystemExit("soak: espeak-ng is not installed (apt-get install espeak-ng)")
    out = []
    with tempfile.TemporaryDirectory() as d:
        for i, text in enumerate(SENTENCES):
            path = Path(d) / f"{i}.wav"
            speed = 150 + (seed + i) % 4 * 15
            subprocess.run(["espeak-ng", "-v", "en-us", "-s", str(speed), "-w", str(path), text], check=True, capture_output=True)
            with wave.open(str(path)) as w:
                pcm = np.frombuffer(w.readframes(w.getnframes()), "<i2")
                rate = w.getframerate()
            pcm = soxr.resample(pcm, rate, 16_000).astype(np.int16)
            loud = np.flatnonzero(np.abs(pcm.astype(np.int32)) > 500)
            # espeak pads its WAV with silence: cut it, so the end of the frames is the end of speech
            out.append(Utterance(text, pcm[max(0, loud[0] - 800): loud[-1] + 1]))
    return tuple(out)


class ServerProcess:
    """`duplex serve` started for this run (port chosen by the OS)."""

    def __init__(self, config: dict, token: str) -> None:
        import yaml

        self.dir = Path(tempfile.mkdtemp(prefix="duplex-soak-"))
        (self.dir / "server.yaml").write_text(yaml.safe_dump(config))
        duplex = Path(sys.executable).parent / "duplex"
        self.proc = subprocess.Popen([str(duplex), "serve", "--config", str(self.dir / "server.yaml"), "--port", "0", f"--token={token}"],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.log_path = self.dir / "server.log"
        self.base: str | None = None
        ready = threading.Event()

        def pump() -> None:
            with open(self.log_path, "w") as log:
                for line in self.proc.stdout:
                    log.write(line)
                    log.flush()
                    if "demo page:" in line and self.base is None:
                        self.base = line.split("demo page:")[1].strip().split("/?")[0]
                        ready.set()
            ready.set()

        threading.Thread(target=pump, daemon=True).start()
        if not ready.wait(300) or self.base is None:
            self.stop()
            raise RuntimeError(f"duplex serve did not start (log: {self.log_path}):\n{self.log_tail()}")

    def log_tail(self, lines: int = 40) -> str:
        return "".join(self.log_path.read_text().splitlines(keepends=True)[-lines:])

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self) -> int | None:
        self.proc.terminate()
        try:
            return self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return None


def _tree(pid: int) -> list[int]:
    """pid and its descendants (the gateway and vLLM's engine-core process)."""
    children: dict[int, list[int]] = {}
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                ppid = int(Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(p))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def process_sample(pid: int) -> dict:
    def rss_mib(p: int) -> float:
        for line in Path(f"/proc/{p}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
        return 0.0

    try:
        tree = _tree(pid)
        return {"rss_mib": rss_mib(pid), "rss_tree_mib": sum(rss_mib(p) for p in tree if Path(f"/proc/{p}").exists()),
                "fds": len(os.listdir(f"/proc/{pid}/fd"))}
    except OSError:
        return {}


def read_metrics(base: str, token: str) -> dict[str, float]:
    """Prometheus text -> {name{labels}: value} (our counters only)."""
    req = urllib.request.Request(base + "/metrics", headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(req, timeout=10) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("duplex_") and not line.startswith("#"):
            m = re.match(r"(\S+)\s+(\S+)$", line)
            if m:
                out[m.group(1)] = float(m.group(2))
    return out


def health(base: str) -> dict:
    try:
        with urllib.request.urlopen(base + "/healthz", timeout=5) as r:
            return json.loads(r.read())
    except Exception as e:  # the server may be down: that is the finding
        return {"ready": False, "detail": str(e)}


async def _sampler(base: str, token: str, pid: int | None, t0: float, stop: asyncio.Event, out: list) -> None:
    while not stop.is_set():
        row = {"t": round(time.monotonic() - t0, 2), **(await asyncio.to_thread(health, base))}
        if pid is not None:
            row.update(await asyncio.to_thread(process_sample, pid))
        out.append(row)
        try:
            await asyncio.wait_for(stop.wait(), 1.0)
        except asyncio.TimeoutError:
            pass


async def run_soak(cfg: SoakConfig) -> Path:
    token = cfg.token or secrets.token_urlsafe(12)
    server = None
    if cfg.url is None:
        server_cfg = {"vad": {"silence_duration_ms": 500}, "session": {"max_response_ms": 4000.0}, **cfg.server_config}
        if cfg.max_sessions is not None:
            server_cfg.setdefault("limits", {})["max_sessions"] = cfg.max_sessions
        if cfg.capacity is not None:
            server_cfg.setdefault("engine", {})["capacity_override"] = cfg.capacity
        print(f"soak: starting duplex serve ({json.dumps(server_cfg)})", flush=True)
        server = await asyncio.to_thread(ServerProcess, server_cfg, token)
        base = server.base
    else:
        base = cfg.url.rstrip("/")
    script = Script(speech_sentences(cfg.seed), barge_in=cfg.barge_in)
    unknown = [m for m in cfg.mix if m not in CALLERS]
    if unknown:
        raise SystemExit(f"soak: unknown transport(s) {unknown} (known: {', '.join(CALLERS)})")
    before = await asyncio.to_thread(read_metrics, base, token)
    t0 = time.monotonic()
    stop = asyncio.Event()
    timeline: list[dict] = []
    sampler = asyncio.create_task(_sampler(base, token, server.pid if server else None, t0, stop, timeline))
    until = t0 + cfg.ramp_s + cfg.duration_s

    async def one(i: int):
        await asyncio.sleep(cfg.ramp_s * i / max(1, cfg.sessions))
        caller = CALLERS[cfg.mix[i % len(cfg.mix)]](i, base, token, script, seed=cfg.seed * 1000 + i)
        return await caller.run(until)

    print(f"soak: {cfg.sessions} callers ({', '.join(cfg.mix)}) for {cfg.duration_s:.0f} s against {base}", flush=True)
    records = await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(cfg.sessions))), cfg.ramp_s + cfg.duration_s + 120)
    await asyncio.sleep(1.5)  # the server finishes closing the sessions before we read its counters
    after = await asyncio.to_thread(read_metrics, base, token)
    final_health = await asyncio.to_thread(health, base)
    stop.set()
    await sampler
    exit_code = server.stop() if server else None
    cfg.out_dir.mkdir(parents=True, exist_ok=True)
    return write_report(cfg, records, before, after, timeline, t0, final_health, exit_code,
                        server.log_path if server else None)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sessions", type=int, default=8, help="simulated callers (default 8)")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of conversation after the ramp (default 60)")
    p.add_argument("--ramp", type=float, default=5.0, help="callers arrive spread over this many seconds (default 5)")
    p.add_argument("--mix", default="ws-pcm16,ws-opus,webrtc,twilio", help=f"transports, round-robin (known: {', '.join(CALLERS)})")
    p.add_argument("--barge-in", type=float, default=0.2, help="share of answers the caller speaks over (default 0.2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--url", help="a running server (default: start `duplex serve` on the tiny model)")
    p.add_argument("--token", help="its token")
    p.add_argument("--max-sessions", type=int, help="server cap for the server this run starts (overload runs)")
    p.add_argument("--capacity", type=int, help="engine.capacity_override for the server this run starts "
                   "(default: the capacity the engine measures at warm-up)")
    p.add_argument("--faults", action="store_true", help="run the fault runs (realtime/soak/faults.py) instead of a soak")
    p.add_argument("--out", default="artifacts/soak", help="report directory (default artifacts/soak)")


def config_from_args(a: argparse.Namespace) -> SoakConfig:
    if a.sessions < 1 or a.sessions > 256:
        raise SystemExit("soak: --sessions must be within 1..256")
    if not 1 <= a.duration <= 3600:
        raise SystemExit("soak: --duration must be within 1..3600 s")
    if not 0.0 <= a.barge_in <= 1.0:
        raise SystemExit("soak: --barge-in must be within 0..1")
    return SoakConfig(sessions=a.sessions, duration_s=a.duration, ramp_s=a.ramp, mix=tuple(m.strip() for m in a.mix.split(",") if m.strip()),
                      barge_in=a.barge_in, seed=a.seed, url=a.url, token=a.token, out_dir=Path(a.out), max_sessions=a.max_sessions,
                      capacity=a.capacity)


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
