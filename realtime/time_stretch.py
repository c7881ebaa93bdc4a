"""Changing speech's pace without changing its pitch: FFmpeg's `atempo` filter (WSOLA), through PyAV.

    ts = TimeStretch(1.5, rate_hz=16_000)    # blocking work: call from one thread at a time
    ts.process(pcm) -> np.ndarray            # int16 out, whatever the filter has ready
    ts.flush() -> np.ndarray                 # the rest, once the input has ended

`speed` is OpenAI's: the speech plays `speed` times as fast (1.5: 2/3 of the duration). atempo takes
[0.5, 100] per instance; a speed below 0.5 is a chain of two (0.25 = 0.5 × 0.5), so OpenAI's whole
range [0.25, 4.0] is served. Streamed: audio goes out as the engine decodes it, never held whole.
"""

from __future__ import annotations

from fractions import Fraction

import av
import numpy as np

MIN_SPEED, MAX_SPEED = 0.25, 4.0  # OpenAI's range for /v1/audio/speech


def _stages(speed: float) -> list[float]:
    """atempo factors whose product is `speed`, each within the filter's [0.5, 100]."""
    if speed >= 0.5:
        return [speed]
    return [0.5, speed / 0.5]


class TimeStretch:
    def __init__(self, speed: float, rate_hz: int) -> None:
        if not MIN_SPEED <= speed <= MAX_SPEED:
            raise ValueError(f"speed must be within [{MIN_SPEED}, {MAX_SPEED}], got {speed}")
        self.rate_hz = rate_hz
        self._graph = av.filter.Graph()
        node = self._graph.add_abuffer(format="s16", sample_rate=rate_hz, layout="mono", time_base=Fraction(1, rate_hz))
        for factor in _stages(speed):
            stage = self._graph.add("atempo", f"{factor:.6f}")
            node.link_to(stage)
            node = stage
        node.link_to(self._graph.add("abuffersink"))
        self._graph.configure()
        self._pts = 0
        self._done = False

    def process(self, pcm: np.ndarray) -> np.ndarray:
        pcm = np.asarray(pcm, np.int16)
        if pcm.size:
            frame = av.AudioFrame.from_ndarray(pcm.reshape(1, -1), format="s16", layout="mono")
            frame.sample_rate, frame.pts, frame.time_base = self.rate_hz, self._pts, Fraction(1, self.rate_hz)
            self._pts += pcm.size
            self._graph.push(frame)
        return self._pull()

    def flush(self) -> np.ndarray:
        if self._done:
            return np.zeros(0, np.int16)
        self._done = True
        self._graph.push(None)
        return self._pull()

    def _pull(self) -> np.ndarray:
        out = []
        while True:
            try:
                frame = self._graph.pull()
            except (av.BlockingIOError, av.EOFError):
                break
            out.append(frame.to_ndarray().reshape(-1).astype(np.int16, copy=False))
        return np.concatenate(out) if out else np.zeros(0, np.int16)
