"""Playing answers: the sink interface, a simulated speaker, and the player that acknowledges playback."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Protocol

import numpy as np

from realtime.audio import StreamResampler
from realtime.client.events import AudioChunk, Event, OutputCleared, ResponseCreated

WIRE_RATE_HZ = 24_000  # pcm16 on the wire, and the default output rate


# --- playback --------------------------------------------------------------------------------------


class AudioSink(Protocol):
    """Where answers are played: a sound device, or `SimulatedSpeaker`."""

    rate_hz: int

    async def write(self, pcm: np.ndarray) -> None:
        """Queue int16 mono audio at rate_hz for playback (may wait for room)."""

    def played_samples(self) -> int:
        """Samples played so far (cleared audio never counts)."""

    def queued_samples(self) -> int:
        """Samples written but not played yet."""

    def clear(self) -> None:
        """Drop what is queued and not played yet (barge-in)."""


class SimulatedSpeaker:
    """A speaker without a device: it plays in real time on the monotonic clock (restarting after an
    underrun, as a device does) and keeps what was heard: `heard()`. For files, tests and `duplex client`."""

    def __init__(self, rate_hz: int = WIRE_RATE_HZ, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate_hz = rate_hz
        self._clock = clock
        self._parts: list[np.ndarray] = []
        self._written = 0  # samples written and not cleared
        self._anchor_samples = 0  # sample that started playing at _anchor_time
        self._anchor_time: float | None = None

    def played_samples(self) -> int:
        if self._anchor_time is None:
            return 0
        return min(self._written, self._anchor_samples + int((self._clock() - self._anchor_time) * self.rate_hz))

    def queued_samples(self) -> int:
        return self._written - self.played_samples()

    async def write(self, pcm: np.ndarray) -> None:
        if pcm.size == 0:
            return
        if self.queued_samples() == 0:  # idle or underrun: this audio starts playing now
            self._anchor_samples, self._anchor_time = self._written, self._clock()
        self._parts.append(np.asarray(pcm, np.int16))
        self._written += pcm.size

    def clear(self) -> None:
        played = self.played_samples()
        if played < self._written:
            whole = self.heard()[:played]
            self._parts, self._written = [whole], played

    async def drain(self) -> None:
        """Wait until everything written has been played."""
        while (q := self.queued_samples()) > 0:
            await asyncio.sleep(q / self.rate_hz)

    def heard(self) -> np.ndarray:
        """Everything written and not cleared (all of it played once `drain()` returns)."""
        if len(self._parts) > 1:
            self._parts = [np.concatenate(self._parts)]
        return self._parts[0] if self._parts else np.zeros(0, np.int16)


class PlaybackClient(Protocol):
    """What `Player` needs of its client (`DuplexClient` is one): the rate its audio arrives at, and
    where to acknowledge playback."""

    output_rate_hz: int

    def played(self, played_ms: float, response_id: str | None = None) -> None:
        """Acknowledge `played_ms` of the response played (output_audio_buffer.played)."""


class Player:
    """Plays each answer's audio into a sink and acknowledges how much of it was played."""

    def __init__(self, client: PlaybackClient, sink: AudioSink) -> None:
        self.client, self.sink = client, sink
        self.response_id: str | None = None
        self._start: int | None = None  # sink position (played timeline) of the response's first sample
        self._written = 0  # samples of the response written to the sink
        self._resampler: StreamResampler | None = None
        self._stopped = False  # cleared: nothing more of this response is played

    def played_ms(self) -> float:
        """How much of the current response has been played."""
        if self._start is None:
            return 0.0
        return 1000.0 * min(self._written, max(0, self.sink.played_samples() - self._start)) / self.sink.rate_hz

    async def on_event(self, ev: Event) -> None:
        if isinstance(ev, ResponseCreated):
            self.response_id, self._start, self._written, self._stopped = ev.response_id, None, 0, False
            same_rate = self.client.output_rate_hz == self.sink.rate_hz
            self._resampler = None if same_rate else StreamResampler(self.client.output_rate_hz, self.sink.rate_hz)
        elif isinstance(ev, AudioChunk) and ev.response_id == self.response_id and not self._stopped:
            pcm = ev.pcm if self._resampler is None else self._resampler.process(ev.pcm)
            if self._start is None:
                self._start = self.sink.played_samples() + self.sink.queued_samples()
            await self.sink.write(pcm)
            self._written += pcm.size
        elif isinstance(ev, OutputCleared) and ev.response_id == self.response_id:
            self.sink.clear()
            self._stopped = True
            self.ack()

    def ack(self) -> None:
        if self.response_id is not None and self._start is not None:
            self.client.played(self.played_ms(), self.response_id)

    async def ack_every(self, interval_s: float) -> None:
        last = None
        while True:
            await asyncio.sleep(interval_s)
            now = (self.response_id, self.played_ms())
            if now != last and not self._stopped:
                self.ack()
                last = now
