"""Admission control: how many conversations can respond at once in real time, from measurements.

Every engine step produces one 20 ms frame for every responding conversation, so a batch of b is
real time while step_time(b) <= frame period. We keep an exponential average of measured step
times per batch size (from warm-up, then from live traffic), fit step_time(b) = a + c*b over them,
and take the largest b whose predicted step fits `margin` of the frame period. The codec stage
adds its measured cost per second of audio on its own core: it bounds capacity separately.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

FRAME_PERIOD_MS = 20.0


@dataclass
class CapacityModel:
    max_conversations: int
    margin: float = 0.8  # keep 20 % of the frame period as slack for jitter
    ema: float = 0.2
    codec_rtf: float = 0.0  # codec seconds per second of audio per session (one core)
    step_ms: dict[int, float] = field(default_factory=dict)  # batch size -> averaged step time
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def observe(self, batch: int, step_ms: float) -> None:
        if batch < 1 or step_ms <= 0:
            return
        with self._lock:
            old = self.step_ms.get(batch)
            self.step_ms[batch] = step_ms if old is None else (1 - self.ema) * old + self.ema * step_ms

    def predicted_step_ms(self, batch: int) -> float:
        with self._lock:
            points = sorted(self.step_ms.items())
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

    def capacity(self) -> int:
        budget = self.margin * FRAME_PERIOD_MS
        engine_cap = 0
        for b in range(1, self.max_conversations + 1):
            if self.predicted_step_ms(b) > budget:
                break
            engine_cap = b
        if self.codec_rtf > 0:
            engine_cap = min(engine_cap, int(self.margin / self.codec_rtf))
        return max(engine_cap, 0)
