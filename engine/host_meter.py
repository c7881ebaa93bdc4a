"""CPU use on this machine, by who uses it: the gateway's process (codec stage, tokenizer, VAD, the
gateway, vLLM's front end: the host resource of engine/capacity.py), its child processes (vLLM's engine
core), and everything else (other processes on the machine: interference the capacity model must
leave room for). Linux /proc only; elsewhere `sample()` returns None.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


@dataclass(frozen=True)
class HostSample:
    process_cpu: float  # cores busy in this process over the interval
    children_cpu: float  # cores busy in its child processes (the engine core)
    other_cpu: float  # cores busy in every other process
    interval_s: float


def _machine_busy_s() -> float:
    with open("/proc/stat") as f:
        fields = f.readline().split()[1:]
    user, nice, system, idle, iowait, irq, softirq, steal = (int(x) for x in fields[:8])
    return (user + nice + system + irq + softirq + steal) / _TICK


def _proc_cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        parts = f.read().rsplit(")", 1)[1].split()
    return (int(parts[11]) + int(parts[12])) / _TICK  # utime, stime


def _children(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    kids = [int(x) for x in f.read().split()]
                out += kids
                todo += kids
        except OSError:
            continue
    return out


class HostMeter:
    def __init__(self) -> None:
        self._pid = os.getpid()
        self._last = self._read()

    def _read(self) -> tuple[float, float, float, float] | None:
        try:
            kids = 0.0
            for c in _children(self._pid):
                try:
                    kids += _proc_cpu_s(c)
                except OSError:
                    pass
            return time.monotonic(), time.process_time(), kids, _machine_busy_s()
        except OSError:
            return None

    def sample(self) -> HostSample | None:
        """CPU use since the last call (None where /proc is missing or on the first call)."""
        now, last = self._read(), self._last
        self._last = now
        if now is None or last is None or now[0] - last[0] <= 0:
            return None
        dt = now[0] - last[0]
        proc = (now[1] - last[1]) / dt
        kids = max(0.0, (now[2] - last[2]) / dt)  # a child that exited takes its time with it
        other = max(0.0, (now[3] - last[3]) / dt - proc - kids)
        return HostSample(proc, kids, other, dt)
