"""The codec stage: streaming DAC decode for all sessions, deadline-ordered, batched, in a thread.

Frames [T, 9] (global ids) leave the engine and enter `push` from any thread (the asyncio loop
included: it only appends to an inbox). The stage's own thread runs `tick` in a loop:
collect every session with a due chunk, order by playback deadline, decode the earliest
`max_batch` in one batched call, and hand each PCM chunk to its session's sink with its lateness.
Torch releases the GIL while decoding, so the loop and vLLM's step loop keep running.

A chunk's deadline is when playback reaches its first sample. The first chunk's is the session's
first deadline (its frames' arrival plus the first-audio budget, unless given). Playback starts
when the first chunk is delivered, early or late, so every later chunk's deadline is that delivery
time plus the audio before it: a first chunk decoded well inside its budget leaves the next one
less time, not more. `clock` is injectable so tests drive ordering in simulated time.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import threading
import time
from collections.abc import Callable

import numpy as np

from engine.codec.dac import DAC
from engine.codec.streaming import DecoderState, StreamConfig, StreamingDecoder
from engine.units import SAMPLE_RATE_HZ
from engine.vocab import NUM_STREAMS, global_to_dac, in_stream_range


@dataclasses.dataclass(frozen=True)
class PcmChunk:
    session_id: str
    pcm: np.ndarray  # float32 mono at 16 kHz
    start_sample: int  # position of pcm[0] in the session's response
    is_last: bool  # the utterance is complete after this chunk
    deadline_s: float  # when playback reaches pcm[0] (stage clock)
    done_s: float  # when the chunk was decoded (stage clock)

    @property
    def lateness_s(self) -> float:
        """Positive: the chunk missed its deadline by this much."""
        return self.done_s - self.deadline_s


@dataclasses.dataclass
class StageStats:
    chunks: int = 0
    late_chunks: int = 0
    max_lateness_s: float = float("-inf")
    batches: int = 0
    batch_sizes: collections.Counter = dataclasses.field(default_factory=collections.Counter)


@dataclasses.dataclass
class _Session:
    sink: Callable[[PcmChunk], None]
    state: DecoderState  # touched only by the stage thread
    inbox: collections.deque  # np.ndarray codes or _FINISH, appended by any thread
    first_deadline_s: float | None  # the first chunk's deadline; once it is out, when playback started
    samples_out: int = 0
    last_sent: bool = False


_FINISH = object()


class CodecStage:
    def __init__(
        self,
        dac: DAC,
        config: StreamConfig | None = None,
        *,
        max_batch: int = 16,
        first_audio_budget_s: float = 0.2,
        clock: Callable[[], float] = time.monotonic,
        idle_wait_s: float = 0.005,
    ) -> None:
        self.decoder = StreamingDecoder(dac, config)
        self.max_batch = max_batch
        self.first_audio_budget_s = first_audio_budget_s
        self.clock = clock
        self.idle_wait_s = idle_wait_s
        self.stats = StageStats()
        self._sessions: dict[str, _Session] = {}
        self._lock = threading.Lock()  # guards the session dict only
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # --- session API (any thread) -----------------------------------------------------------

    def open(
        self,
        session_id: str,
        sink: Callable[[PcmChunk], None],
        first_deadline_s: float | None = None,
    ) -> None:
        """Start a response. Without a first deadline, it is the first push + the budget."""
        with self._lock:
            if session_id in self._sessions:
                raise ValueError(f"session {session_id!r} is already open")
            self._sessions[session_id] = _Session(
                sink, DecoderState.new(), collections.deque(), first_deadline_s
            )

    def push(self, session_id: str, frames: np.ndarray) -> None:
        """Append complete frames [T, 9] of global ids (stream 0 is not needed for audio)."""
        frames = np.asarray(frames)
        if frames.ndim != 2 or frames.shape[1] != NUM_STREAMS:
            raise ValueError(f"frames must be [T, {NUM_STREAMS}], got {list(frames.shape)}")
        if not in_stream_range(frames)[:, 1:].all():
            raise ValueError("frames hold ids outside their stream's DAC range")
        session = self._session(session_id)
        if session.first_deadline_s is None:
            session.first_deadline_s = self.clock() + self.first_audio_budget_s
        session.inbox.append(global_to_dac(frames[:, 1:]))
        self._wake.set()

    def finish(self, session_id: str) -> None:
        """No more frames: the tail is decoded and the last chunk has is_last=True."""
        session = self._session(session_id)
        if session.first_deadline_s is None:
            session.first_deadline_s = self.clock() + self.first_audio_budget_s
        session.inbox.append(_FINISH)
        self._wake.set()

    def close(self, session_id: str) -> None:
        """Forget a session (after its last chunk, or to cancel it)."""
        with self._lock:
            self._sessions.pop(session_id, None)

    def _session(self, session_id: str) -> _Session:
        with self._lock:
            try:
                return self._sessions[session_id]
            except KeyError:
                raise ValueError(f"unknown session {session_id!r}") from None

    # --- the loop ---------------------------------------------------------------------------

    def tick(self) -> list[PcmChunk]:
        """One batch: the due chunks with the earliest deadlines, at most max_batch of them."""
        with self._lock:
            sessions = list(self._sessions.items())
        for _, session in sessions:
            self._drain(session)
        due = [(sid, s) for sid, s in sessions if self._is_due(s)]
        due.sort(key=lambda item: self._deadline(item[1]))
        batch = due[: self.max_batch]
        if not batch:
            return []
        pcms = self.decoder.decode([s.state for _, s in batch])
        done_s = self.clock()
        chunks = [self._deliver(sid, s, pcm, done_s) for (sid, s), pcm in zip(batch, pcms)]
        self.stats.batches += 1
        self.stats.batch_sizes[len(batch)] += 1
        return chunks

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("codec stage already started")
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="codec-stage", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self.tick():
                self._wake.wait(self.idle_wait_s)
                self._wake.clear()

    # --- helpers (stage thread) -------------------------------------------------------------

    def _drain(self, session: _Session) -> None:
        while session.inbox:
            item = session.inbox.popleft()
            if item is _FINISH:
                self.decoder.finish(session.state)
            else:
                self.decoder.push(session.state, item)

    def _is_due(self, session: _Session) -> bool:
        if session.last_sent:
            return False
        state = session.state
        return self.decoder.due_frames(state) > 0 or state.finished

    def _deadline(self, session: _Session) -> float:
        assert session.first_deadline_s is not None
        return session.first_deadline_s + session.samples_out / SAMPLE_RATE_HZ

    def _deliver(self, sid: str, session: _Session, pcm: np.ndarray, done_s: float) -> PcmChunk:
        chunk = PcmChunk(
            session_id=sid,
            pcm=pcm,
            start_sample=session.samples_out,
            is_last=session.state.done,
            deadline_s=self._deadline(session),
            done_s=done_s,
        )
        if session.samples_out == 0:
            session.first_deadline_s = done_s  # playback starts now: later deadlines count from here
        session.samples_out += len(pcm)
        session.last_sent = chunk.is_last
        self.stats.chunks += 1
        self.stats.max_lateness_s = max(self.stats.max_lateness_s, chunk.lateness_s)
        if chunk.lateness_s > 0:
            self.stats.late_chunks += 1
        session.sink(chunk)
        return chunk


class AsyncChunkQueue:
    """A sink that hands chunks to an asyncio loop: `async for chunk in queue` until is_last."""

    def __init__(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self._loop = loop or asyncio.get_running_loop()
        self._queue: asyncio.Queue[PcmChunk] = asyncio.Queue()
        self._ended = False  # the last chunk has been handed out

    def __call__(self, chunk: PcmChunk) -> None:  # called on the stage thread
        self._loop.call_soon_threadsafe(self._queue.put_nowait, chunk)

    async def get(self) -> PcmChunk:
        return await self._queue.get()

    def __aiter__(self) -> AsyncChunkQueue:
        return self

    async def __anext__(self) -> PcmChunk:
        if self._ended:
            raise StopAsyncIteration
        chunk = await self._queue.get()
        self._ended = chunk.is_last
        return chunk
