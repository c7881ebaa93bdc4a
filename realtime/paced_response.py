"""One response as the session paces it out: its status, the engine's audio waiting and sent, the
client's playback of it, and what the client is told of the user turn it answers.

The gateway's record of an answer (the engine's is `engine/response.py`'s `ResponseRecord`, behind the
handle `EngineResponse`; all carry the same `resp_…` id). Its status moves only through `advance`,
along `RESPONSE_TRANSITIONS`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from engine.service_api import SAMPLE_RATE_HZ as RATE_HZ

from realtime.sample_queue import SampleQueue
from realtime.session_events import ResponseAudio, ResponseDone, ResponseStatus
from realtime.turn import IllegalTransition
from realtime.user_transcript import UserTranscriptRelay

# A response completes only once its audio is all out; it can be cancelled (barge-in, a client's
# cancel) or fail (an engine error) whether or not the engine is done. A finished one never moves.
RESPONSE_TRANSITIONS: dict[ResponseStatus, frozenset[ResponseStatus]] = {
    ResponseStatus.IN_PROGRESS: frozenset({ResponseStatus.GENERATED, ResponseStatus.CANCELLED, ResponseStatus.FAILED}),
    ResponseStatus.GENERATED: frozenset({ResponseStatus.COMPLETED, ResponseStatus.CANCELLED, ResponseStatus.FAILED}),
    ResponseStatus.COMPLETED: frozenset(),
    ResponseStatus.CANCELLED: frozenset(),
    ResponseStatus.FAILED: frozenset(),
}


@dataclass
class PacedResponse:
    id: str
    item_id: str
    epoch: int
    status: ResponseStatus = ResponseStatus.IN_PROGRESS  # moved only by `advance`
    pending: SampleQueue = field(default_factory=SampleQueue)  # the engine's int16 audio, not yet released
    sent_samples: int = 0
    acked_ms: float | None = None  # client playback acknowledgement (output_audio_buffer.played)
    transcript: str = ""
    turn_end_time: float | None = None  # monotonic end of the user speech this answers
    first_audio_time: float | None = None
    metadata: dict | None = None
    speculative: bool = False  # started at a pause, not yet confirmed: nothing of it is sent
    confirmed_at: float | None = None  # a speculative response: when the turn's end was confirmed
    dropped: tuple[str, ...] = ()  # context management's drops for a speculative response, told at confirmation
    first_chunk_at: float | None = None  # when the engine's first audio chunk arrived (its deadlines count from it)
    output_modalities: tuple[str, ...] | None = None  # response.create's; None: the session's
    user_transcript: UserTranscriptRelay = field(default_factory=UserTranscriptRelay)  # the user turn's, as the model writes it
    deadline_shift_s: float = 0.0  # a confirmed speculation plays from its confirmation, not its first chunk: the engine's deadlines move

    def advance(self, status: ResponseStatus) -> None:
        if status not in RESPONSE_TRANSITIONS[self.status]:
            raise IllegalTransition(f"response {self.id}: {self.status.name} -> {status.name}")
        self.status = status
        if status.finished:
            self.pending.clear()

    @property
    def sent_ms(self) -> float:
        return 1000.0 * self.sent_samples / RATE_HZ

    def buffer(self, pcm: np.ndarray, max_ms: float) -> None:
        """Engine audio waiting for the pacer; beyond `max_ms` of it, the excess is dropped."""
        room = max(0, int(max_ms * RATE_HZ / 1000) - self.pending.samples)
        self.pending.append(pcm[:room])

    def release(self, n: int, now: float) -> ResponseAudio:
        """The next `n` samples waiting (at most `pending.samples`) as the frame that goes out now."""
        parts = self.pending.take(n)
        first = self.first_audio_time is None
        if first:
            self.first_audio_time = now
        frame = ResponseAudio(self.id, self.item_id, self.epoch, parts[0] if len(parts) == 1 else np.concatenate(parts), self.sent_ms,
                              self.ttfa_ms() if first else None, self.after_confirm_ms() if first else None)
        self.sent_samples += n
        return frame

    def done(self, reason: str | None, played_ms: float) -> ResponseDone:
        """The event that tells the client how this (finished) response ended."""
        return ResponseDone(self.id, self.item_id, self.epoch, self.status, reason, self.transcript, self.sent_ms, played_ms, self.ttfa_ms(),
                            self.metadata, self.after_confirm_ms())

    def ttfa_ms(self) -> float | None:
        """End of the user's speech -> the first audio frame released."""
        if self.first_audio_time is None or self.turn_end_time is None:
            return None
        return 1000.0 * (self.first_audio_time - self.turn_end_time)

    def after_confirm_ms(self) -> float | None:
        """The turn's end confirmed (a speculation) -> the first audio frame released."""
        if self.first_audio_time is None or self.confirmed_at is None:
            return None
        return 1000.0 * (self.first_audio_time - self.confirmed_at)
