"""One answer of a conversation: the engine's mutable record of it, and the handle the gateway holds.

`ResponseRecord` is the engine's: the conversation and the model path write it (frames, the chunks
and transcript deltas they deliver, its history turn, its speculation). `EngineResponse` is the
gateway's `service_api.ResponseHandle`: it reads the record's chunks and transcript and acts on it
through `cancel`, `confirm` and `discard`, and has no other way in.

A record's life: waiting (for the previous answer to wind down and the user turn's last frames) ->
generating (vLLM steps -> frames -> codec stage -> `chunks()`) -> ended, when its assistant turn (cut
to what was played) is in the history. `stop()` at any point stops it; after the end it cuts that
history turn.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import numpy as np

from engine.dialogue import DialogueTurn
from engine.service_api import FRAME_MS, AudioChunk
from engine.user_turn import UserTurn


class _End:
    """Queue sentinel: the chunks (or the transcript) ended without a last chunk (a cancel)."""


_END = _End()


def played_frames(played_ms: float) -> int:
    """The whole frames in `played_ms` of answer audio: what the history keeps of a cut answer."""
    return max(0, int(played_ms // FRAME_MS))


@dataclass
class Speculation:
    """What a speculative answer's `discard()` needs to take it back."""

    user: UserTurn  # the user turn as it was, still open: it goes on after a discard
    last: ResponseRecord | None  # the conversation's latest answer before this one
    # the history before the answer touched it (context management may drop turns, the user turn is
    # appended): (turns, exchanges, history_dropped), taken when generation starts
    history: tuple[list[DialogueTurn], list[str], int] | None = None
    # prompt positions [lo, hi) holding the fork's flushed frames: tokenized without the audio that
    # follows, they may match the continued turn in stream 0 but not in the aux streams
    flushed_rows: tuple[int, int] | None = None


class ResponseRecord:
    """The engine's record of one answer (see the module docstring for its life)."""

    def __init__(self, response_id: str) -> None:
        self.id = response_id
        self._chunks: asyncio.Queue[AudioChunk | BaseException | _End] = asyncio.Queue()
        self._transcript: asyncio.Queue[str | BaseException | _End] = asyncio.Queue()  # the user turn's text deltas
        self.frames: list[np.ndarray] = []  # generated so far
        self.keep_frames: int | None = None  # set by a cut: the history keeps this many; None: all generated
        self.cancelled = False
        self.ended = False
        self.task: asyncio.Task[None] | None = None  # the whole life (see `Conversation._generate`)
        self.pump: asyncio.Task[None] | None = None  # the generation alone: what a stop cancels
        self.turn: DialogueTurn | None = None  # the assistant turn in the history, once ended
        self.cached_tokens = 0  # prompt positions served from the prefix cache
        # context management: the earlier responses whose exchanges (user turn and answer) left the
        # history to make room for this one, oldest first
        self.dropped_exchanges: tuple[str, ...] = ()
        self.delivered = asyncio.Event()  # the last chunk, the failure or the stop reached the queue
        self.speculation: Speculation | None = None  # set while a speculative answer is undecided
        self.discarded = False
        self.transcriber: asyncio.Task[None] | None = None  # writes the transcript (transcribe_user)
        self.text_ids: list[int] = []  # the answer's text so far (assistant_text)
        # the system text this answer alone reads (respond(instructions=...)); None: the conversation's
        self.system_ids: tuple[int, ...] | None = None

    # --- what the handle reads ---
    async def chunks(self) -> AsyncIterator[AudioChunk]:
        """Ends once the answer's turn is in the history, so the next prompt is known when it does."""
        while True:
            item = await self._chunks.get()
            if isinstance(item, _End):
                break
            if isinstance(item, BaseException):
                await self._ended()
                raise item
            yield item
            if item.is_last:
                break
        await self._ended()

    async def transcript(self) -> AsyncIterator[str]:
        while True:
            item = await self._transcript.get()
            if isinstance(item, _End):
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    async def _ended(self) -> None:
        if self.task is not None and not self.task.done():
            await asyncio.wait([self.task])

    def stop(self, keep: int | None) -> None:
        """Stop generating at the next step; idempotent, valid before generation started (it then never
        starts) and after the end (it cuts the history turn). `keep`: the frames the history keeps (what
        was played); None: all that was generated (the conversation is suspended or closed: nobody heard
        a cut)."""
        if self.ended:
            if self.turn is not None and keep is not None:
                self.turn.frames = self.turn.frames[:keep]
            return
        if keep is not None:
            self.keep_frames = keep if self.keep_frames is None else min(keep, self.keep_frames)
        if self.cancelled:
            return
        self.cancelled = True
        if self.pump is not None:
            self.pump.cancel()  # the codec stream closes when the pump has stopped (Conversation._end_response)
        while not self._chunks.empty():  # chunks not yet taken are never played: none after a stop
            self._chunks.get_nowait()
        self._chunks.put_nowait(_END)
        self.delivered.set()

    # --- what the engine writes ---
    def deliver(self, item: AudioChunk | BaseException) -> None:
        """A chunk, or the failure that ends the answer."""
        if self.cancelled or self.delivered.is_set():  # late output of a stopped answer is never played
            return
        self._chunks.put_nowait(item)
        if not isinstance(item, AudioChunk) or item.is_last:
            self.delivered.set()

    def finish(self) -> None:
        """No more chunks (the answer ended without a last chunk: a stop, a failure already delivered)."""
        if self.cancelled or self.delivered.is_set():
            return
        self._chunks.put_nowait(_END)
        self.delivered.set()

    def put_transcript(self, item: str | BaseException) -> None:
        """A delta of the user turn's transcript, or its failure."""
        self._transcript.put_nowait(item)

    def end_transcript(self) -> None:
        self._transcript.put_nowait(_END)


class EngineResponse:
    """One answer as the gateway holds it (service_api.ResponseHandle): reads and acts on its record."""

    def __init__(self, record: ResponseRecord, on_discard: Callable[[ResponseRecord], None] | None = None) -> None:
        self._record = record
        self._on_discard = on_discard  # the conversation's undo of a speculative answer

    @property
    def id(self) -> str:
        return self._record.id

    @property
    def dropped_exchanges(self) -> tuple[str, ...]:
        return self._record.dropped_exchanges

    def chunks(self) -> AsyncIterator[AudioChunk]:
        return self._record.chunks()

    def user_transcript(self) -> AsyncIterator[str]:
        return self._record.transcript()

    def cancel(self, played_ms: float) -> None:
        self._record.stop(played_frames(played_ms))

    def confirm(self) -> None:
        """The speculative answer stands (the user's turn did end): from now on it is a plain answer."""
        self._record.speculation = None

    def discard(self) -> None:
        """The speculative answer never happened: generation stops, the history is restored as it was
        before it, and the user turn it answered goes on (its frames and prefill kept). Idempotent."""
        record = self._record
        if record.discarded:
            return
        if record.speculation is None or self._on_discard is None:
            raise RuntimeError(f"response {record.id} is not an undecided speculative answer: cancel it instead")
        self._on_discard(record)  # marks it discarded, stops it, restores the conversation
