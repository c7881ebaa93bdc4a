"""PCM waiting to be played, kept in the chunks it arrived in: appended whole, taken by the sample."""

from __future__ import annotations

from collections import deque

import numpy as np


class SampleQueue:
    def __init__(self) -> None:
        self._chunks: deque[np.ndarray] = deque()
        self.samples = 0  # waiting, over all chunks

    def append(self, pcm: np.ndarray) -> None:
        if pcm.size:
            self._chunks.append(pcm)
            self.samples += pcm.size

    def take(self, n: int) -> list[np.ndarray]:
        """The next `n` samples (fewer when fewer wait), as views of the chunks they span."""
        parts: list[np.ndarray] = []
        got = 0
        while got < n and self._chunks:
            head = self._chunks[0]
            part = min(n - got, head.size)
            parts.append(head[:part])
            if part == head.size:
                self._chunks.popleft()
            else:
                self._chunks[0] = head[part:]
            got += part
        self.samples -= got
        return parts

    def clear(self) -> None:
        self._chunks.clear()
        self.samples = 0
