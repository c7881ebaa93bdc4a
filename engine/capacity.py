"""Admission control: how many conversations the whole pipeline can serve on time, from measurements.

A conversation costs something on each resource it uses; each resource bounds the capacity, and the
smallest bound is the capacity (`limited_by` names it):

- **engine**: the engine core's threads. Every step makes one 20 ms frame for every answering
  conversation, so a batch of b is real time while step_time(b) <= the frame period. Step times
  per batch size are averaged (warm-up, then live decode steps), step_time(b) = a + c*b is fitted
  over the warm-up's, and the bound is the largest b whose step fits `margin` of the period. Once
  live steps exist the fit is scaled by how much slower the last `live_window_s` of live steps were
  than it at their batch sizes: the bound is re-measured under the real batch on this machine as it
  is now (a busy neighbour, a slower machine than the warm-up saw), the warm-up keeping the shape.
- **cpu**: the machine's cores (`cpu_cores`), which the OS shares among the gateway's process (the
  codec stage and the tokenizer when they run on the CPU, the VAD, the gateway, vLLM's front end),
  vLLM's engine-core process (its scheduler loop, and on a CPU engine its forward passes) and every
  other process on the machine. A session costs `codec_rtf * answer_share + tokenizer_rtf *
  talk_share + session_cpu + engine_cpu` core-seconds a second, besides what both processes burn with
  no session (`fixed_cpu`) and what other processes take (`other_cpu`, interference measured live).
  `codec_rtf` and `tokenizer_rtf` are measured at warm-up, `session_cpu` and `engine_cpu` start from
  priors (measured on a 2-core machine: docs/soak.md) until the whole cost per session is measured
  live (`observe_host`: both processes' CPU over the open sessions, a ratio over the last minute).
  (A partition, the engine's threads on their cores and the rest on the others, predicted 4 where 8
  callers are served on time on 2 cores: the engine core leaves much of its core idle between steps.)
- **gpu codec**: when the codec runs on a GPU, its real-time factor bounds the answering sessions.

Several engine cores (`engine.data_parallel_size` = N, engine/README.md "Several engines"): each rank
steps its own batch, so each has its own step times and its own engine bound (at most `rank_max`, its
`max_num_seqs`), and the engine bound is their sum. The cpu, gpu-codec and max_conversations bounds are
the machine's and the server's, counted once whatever N is. A new conversation goes to the rank with
the most headroom (`pick_rank`); with N = 1 everything reads as before.

Feedback (`LatenessFeedback`): when admitted sessions miss deadlines (late chunks, client-reported
underruns), a ceiling drops at once below the sessions then open and recovers one session at a time
(congestion control's treatment of loss), so interference that none of the measurements sees is
handled too. The capacity is the smallest bound and the ceiling.
"""

from __future__ import annotations

import math
import threading
from collections import deque
from dataclasses import dataclass, field

FRAME_PERIOD_MS = 20.0


@dataclass
class CapacityModel:
    max_conversations: int
    margin: float = 0.8  # keep 20 % of each resource as slack for jitter
    ema: float = 0.2
    cpu_cores: float = 0.0  # the machine's cores (0: not modelled)
    codec_on_host: bool = True  # the codec and tokenizer run on the CPU (else on a GPU)
    codec_rtf: float = 0.0  # codec seconds per second of answer audio, one session
    tokenizer_rtf: float = 0.0  # tokenizer seconds per second of user audio, one session
    answer_share: float = 0.5  # share of a session's time the model answers (prior; measured live)
    talk_share: float = 0.5  # share of a session's time the user's audio is tokenized
    session_cpu: float = 0.04  # gateway, transports, VAD, vLLM front end per session (prior; measured live)
    engine_cpu: float = 0.05  # the engine-core process per session beyond its forward passes' share (prior)
    fixed_cpu: float = 0.35  # both processes with no session (prior until measured idle)
    other_cpu: float = 0.0  # other processes' CPU rate
    per_session_measured: float | None = None  # the whole CPU cost per session, measured live
    ranks: int = 1  # engine cores, each stepping its own batch (engine.data_parallel_size)
    rank_max: int = 0  # conversations one rank can batch (its max_num_seqs); 0: max_conversations
    host_window_s: float = 60.0  # live host figures are over this much of the recent past
    min_session_s: float = 20.0  # session-seconds in the window before the measured cost is trusted
    live_window_s: float = 30.0  # live step times this recent replace the warm-up's (and older ones) in the fit
    step_ms: dict[int, float] = field(default_factory=dict)  # rank 0's: batch size -> averaged step time
    rank_step_ms: list[dict[int, float]] = field(init=False, repr=False)  # every rank's, step_ms first
    rank_live_at: list[dict[int, float]] = field(init=False, repr=False)  # every rank's: batch size -> last live step
    rank_prior: list[dict[int, float]] = field(init=False, repr=False)  # every rank's warm-up: batch size -> step time
    _host: deque = field(default_factory=deque, repr=False)  # (t, dt, sessions, ours_cpu, other_cpu)
    _idle_samples: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self) -> None:
        if self.ranks < 1:
            raise ValueError(f"ranks must be at least 1, got {self.ranks}")
        self.rank_step_ms = [self.step_ms] + [{} for _ in range(self.ranks - 1)]
        self.rank_live_at = [{} for _ in range(self.ranks)]
        self.rank_prior = [{} for _ in range(self.ranks)]

    def observe(self, batch: int, step_ms: float, rank: int = 0, now: float | None = None) -> None:
        """A step of `batch` requests took `step_ms` on engine rank `rank`: a live step of the real batch
        at `now`, or (None) a warm-up measurement, a prior that live steps replace."""
        if batch < 1 or step_ms <= 0:
            return
        with self._lock:
            times = self.rank_step_ms[rank]
            old = times.get(batch)
            times[batch] = step_ms if old is None else (1 - self.ema) * old + self.ema * step_ms
            if now is not None:
                self.rank_live_at[rank][batch] = now
            else:
                self.rank_prior[rank][batch] = times[batch]

    def _points(self, rank: int) -> list[tuple[int, float]]:
        """The step times the fit runs over: once live steps exist, only the batch sizes stepped live within
        `live_window_s` of the latest one, so the bound is re-measured under the real batch on this machine
        as it is now (a warm-up on an idle machine, or an hour-old figure, says nothing of a busy one)."""
        times, live = self.rank_step_ms[rank], self.rank_live_at[rank]
        if live:
            newest = max(live.values())
            fresh = [(b, times[b]) for b, t in live.items() if t >= newest - self.live_window_s and b in times]
            if fresh:
                return sorted(fresh)
        return sorted(times.items())

    def live_samples(self, rank: int = 0) -> int:
        """Batch sizes with a recent live step time (0: the warm-up's priors still decide)."""
        with self._lock:
            live = self.rank_live_at[rank]
            return sum(1 for t in live.values() if t >= max(live.values()) - self.live_window_s) if live else 0

    def observe_host(self, now: float, dt: float, sessions: int, ours_cpu: float, other_cpu: float) -> None:
        """One sample over the `dt` seconds before `now`: `ours_cpu` cores busy in the gateway's process and
        the engine core with `sessions` open, `other_cpu` cores busy in every other process. No session:
        the fixed cost (an average). Else the cost per session, a ratio over the window,
        Σ(ours - fixed)·dt / Σ sessions·dt: one noisy second (a connection's setup) moves it little."""
        if dt <= 0:
            return
        if sessions <= 0:
            self._idle_samples += 1
            a = max(self.ema, 1.0 / self._idle_samples)  # the first idle samples replace the prior
            self.fixed_cpu = (1 - a) * self.fixed_cpu + a * ours_cpu
        h = self._host
        h.append((now, dt, sessions, ours_cpu, max(0.0, other_cpu)))
        while h and h[0][0] < now - self.host_window_s:
            h.popleft()
        span = sum(x[1] for x in h)
        self.other_cpu = sum(x[1] * x[4] for x in h) / span
        session_s = sum(x[1] * x[2] for x in h)
        if session_s >= self.min_session_s:
            busy = sum(x[1] * max(0.0, x[3] - self.fixed_cpu) for x in h if x[2] > 0)
            self.per_session_measured = busy / session_s

    def predicted_step_ms(self, batch: int, rank: int = 0) -> float:
        """The step time of a batch of `batch` on rank `rank`. Once live steps exist, the warm-up's curve scaled
        by how much slower (or faster) the recent live steps were than it at their batch sizes (the median
        ratio): the live steps set the level on this machine now, the warm-up's measured batches the shape
        (a few live batch sizes near each other, each noisy, would make a wild slope of their own)."""
        with self._lock:
            live = self._points(rank) if self.rank_live_at[rank] else []
            prior = sorted(self.rank_prior[rank].items())
        if live and prior:
            ratios = sorted(t / max(self._fit(prior, b), 1e-6) for b, t in live)
            return ratios[len(ratios) // 2] * self._fit(prior, batch)
        with self._lock:
            points = self._points(rank)
        return self._fit(points, batch)

    @staticmethod
    def _fit(points: list[tuple[int, float]], batch: int) -> float:
        """step_time(b) = a + c*b fitted over `points` (one point: linear in batch above it, pessimistic)."""
        if not points:
            return 0.0
        if len(points) == 1:
            b0, t0 = points[0]
            return t0 * max(batch, 1) / b0 if batch > b0 else t0  # pessimistic: linear in batch
        n = len(points)
        mb = sum(b for b, _ in points) / n
        mt = sum(t for _, t in points) / n
        var = sum((b - mb) ** 2 for b, _ in points)
        slope = max(0.0, sum((b - mb) * (t - mt) for b, t in points) / var) if var else 0.0
        return max(mt + slope * (batch - mb), 0.0)

    def cpu_cost_per_session(self) -> float:
        """Core-seconds per second one session costs the machine: measured once sessions have run, else
        the sum of its parts (never less than the parts measured at warm-up)."""
        parts = self.session_cpu + self.engine_cpu
        if self.codec_on_host:
            parts += self.codec_rtf * self.answer_share + self.tokenizer_rtf * self.talk_share
        return parts if self.per_session_measured is None else max(self.per_session_measured, parts)

    def rank_bound(self, rank: int = 0) -> int:
        """The conversations engine rank `rank` steps on time: the largest batch whose predicted step fits
        `margin` of the frame period, at most what one rank holds."""
        budget = self.margin * FRAME_PERIOD_MS
        top = min(self.rank_max or self.max_conversations, self.max_conversations)
        cap = 0
        for b in range(1, top + 1):
            if self.predicted_step_ms(b, rank) > budget:
                break
            cap = b
        return cap

    def rank_bounds(self) -> list[int]:
        return [self.rank_bound(r) for r in range(self.ranks)]

    def pick_rank(self, active: list[int]) -> int:
        """The rank for a new conversation, given each rank's active conversations: the most headroom
        (its engine bound less its conversations), then the fewest conversations, then the lowest rank."""
        bounds = self.rank_bounds()
        return min(range(self.ranks), key=lambda r: (active[r] - bounds[r], active[r], r))

    def bounds(self) -> dict[str, int]:
        """Each resource's bound on the conversations served on time (the engine's: all ranks together)."""
        out: dict[str, int] = {"engine": sum(self.rank_bounds())}
        if self.cpu_cores > 0:
            room = self.margin * self.cpu_cores - self.fixed_cpu - self.other_cpu
            per = self.cpu_cost_per_session()
            out["cpu"] = max(0, math.floor(room / per)) if per > 0 else self.max_conversations
        if not self.codec_on_host and self.codec_rtf > 0:
            out["gpu_codec"] = math.floor(self.margin / (self.codec_rtf * max(self.answer_share, 1e-3)))
        out["max_conversations"] = self.max_conversations
        return out

    def capacity(self, ceiling: int | None = None) -> int:
        b = self.bounds()
        cap = min(b.values())
        return max(min(cap, ceiling) if ceiling is not None else cap, 0)

    def limited_by(self, ceiling: int | None = None) -> str:
        b = self.bounds()
        if ceiling is not None:
            b["feedback"] = ceiling
        first = {"feedback": 0, "max_conversations": 1}  # on a tie, the cut or the cap is what limits
        return min(b, key=lambda k: (b[k], first.get(k, 2)))


@dataclass
class LatenessFeedback:
    """The ceiling set by what admitted sessions get: missed deadlines lower it at once, time on time
    raises it slowly (multiplicative decrease, additive increase).

    `record(open_sessions, now, chunks, late)`: the sessions received `chunks` audio chunks, `late` of
    them after their playback deadline (a client's reported underrun counts as one). When more than
    `max_late_share` of the chunks of the last `window_s` were late (and at least `min_late`), the
    ceiling becomes `floor(open * decrease)` (at least `floor_sessions`), and the window starts anew.
    Every `recover_s` after the last change without a cut raises it by one; it disappears (None) once
    it reaches `top`, the measured bound.
    """

    decrease: float = 0.75
    recover_s: float = 30.0
    window_s: float = 10.0
    max_late_share: float = 0.005  # the goal: 99.5 % of chunks on time
    min_late: int = 3
    min_chunks: int = 50  # a share of fewer chunks says little (the first chunks of the first answers)
    floor_sessions: int = 1
    ceiling: int | None = None
    _window: deque = field(default_factory=deque, repr=False)  # (t, chunks, late)
    _total: int = 0  # chunks in the window
    _missed: int = 0  # late ones
    _last_change: float = -math.inf
    reasons: list[str] = field(default_factory=list)  # every change, for the log (drained by the caller)

    def record(self, open_sessions: int, now: float, chunks: int, late: int, why: str = "") -> None:
        w = self._window
        w.append((now, chunks, late))
        self._total, self._missed = self._total + chunks, self._missed + late
        while w and w[0][0] < now - self.window_s:
            _, c, m = w.popleft()
            self._total, self._missed = self._total - c, self._missed - m
        total, missed = self._total, self._missed
        if (missed < self.min_late or total < self.min_chunks or missed <= self.max_late_share * total
                or open_sessions <= self.floor_sessions):
            return
        new = max(self.floor_sessions, math.floor(open_sessions * self.decrease))
        w.clear()
        self._total = self._missed = 0
        if self.ceiling is not None and new >= self.ceiling:
            return
        self.ceiling, self._last_change = new, now
        self.reasons.append(f"{missed} of {total} chunks late in {self.window_s:g} s{' (' + why + ')' if why else ''} "
                            f"with {open_sessions} sessions open: capacity ceiling {new}")

    def tick(self, now: float, top: int) -> None:
        if self.ceiling is None or now - self._last_change < self.recover_s:
            return
        self._last_change = now
        if self.ceiling + 1 >= top:
            self.ceiling = None
            self.reasons.append(f"on time for {self.recover_s:g} s: ceiling lifted (the measured bound {top} applies)")
        else:
            self.ceiling += 1
            self.reasons.append(f"on time for {self.recover_s:g} s: capacity ceiling {self.ceiling}")
