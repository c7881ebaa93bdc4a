"""What one soak run does: how many callers of which kinds, for how long, against which server."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


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
    capacity: int | None = None  # the started server's engine capacity, instead of the measured one (its slow start and
    # degradation off: a forced capacity admits every caller up to it, as capacity_sweep.py needs)
    neighbour: int = 0  # CPU hogs (busy processes, one core each) started halfway through the run, until its end
    retry_s: float | None = None  # a refused caller calls again after this long (None: it gives up), until 10 s before the end
    metrics_urls: tuple[str, ...] = ()  # servers whose counters account for the frames (default: `url`); behind a
    # balancer, every replica's own address: /metrics through the balancer is one replica's
    events: list = field(default_factory=list)  # {"at": time.monotonic(), "event": str} added during the run (a kill, a
    # drain): on the report's timeline and its plot
