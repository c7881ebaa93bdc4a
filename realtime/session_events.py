"""What a session puts out (docs/architecture.md, "The session"): `SessionEvent`s for the transport's wire,
`EngineCommand`s for the shell to run against the engine conversation, its `SessionStats`, and
`SessionError`, a client's mistake (the session stays usable); and the `SessionLimits` it is made with.
"""

from __future__ import annotations

import itertools
import secrets
from dataclasses import dataclass, field
from enum import IntEnum

import numpy as np

from engine.service_api import Role

from realtime.user_transcript import InputTranscriptDelta, InputTranscriptDone, InputTranscriptFailed

# OpenAI's wording where clients match on it (docs/protocol.md, "Errors"): LiveKit ignores an error
# whose message starts "Cancellation failed", Pipecat's xAI client and others look for "no active
# response" / "already has an active response" / "buffer too small".
NO_ACTIVE_RESPONSE = "Cancellation failed: no active response found"
ACTIVE_RESPONSE = "Conversation already has an active response in progress:"
COMMIT_EMPTY = "Error committing input audio buffer: buffer too small"


class SessionError(Exception):
    def __init__(self, code: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.code, self.message, self.param = code, message, param


class ResponseStatus(IntEnum):
    """Ordered: every value from COMPLETED on means finished."""

    IN_PROGRESS = 0  # the engine is generating; audio is paced out as it comes
    GENERATED = 1  # the engine is done; the rest of the audio is still being paced out
    COMPLETED = 2
    CANCELLED = 3
    FAILED = 4

    @property
    def finished(self) -> bool:
        return self >= ResponseStatus.COMPLETED


# --- outputs ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SpeechStarted:
    item_id: str
    audio_start_ms: float


@dataclass(frozen=True)
class SpeechStopped:
    item_id: str
    audio_end_ms: float


@dataclass(frozen=True)
class InputCommitted:
    item_id: str
    previous_item_id: str | None


@dataclass(frozen=True)
class InputCleared:
    pass


@dataclass(frozen=True)
class UserItemAdded:
    """A user turn the client created as an item (its audio is now in the engine's history)."""

    item_id: str
    previous_item_id: str | None


@dataclass(frozen=True)
class ResponseCreated:
    response_id: str
    item_id: str
    epoch: int
    metadata: dict | None = None  # the client's tag of the response, echoed back (opaque here)
    output_modalities: tuple[str, ...] | None = None  # what response.create asked for this one; None: the session's


@dataclass(frozen=True)
class ResponseAudio:
    response_id: str
    item_id: str
    epoch: int
    pcm: np.ndarray  # int16, 16 kHz, one pacing frame
    start_ms: float  # offset in the response's audio
    ttfa_ms: float | None = None  # on the first frame only: end of user speech -> this frame
    after_confirm_ms: float | None = None  # on the first frame only: the turn's end confirmed -> this frame


@dataclass(frozen=True)
class ResponseText:
    response_id: str
    item_id: str
    epoch: int
    delta: str


@dataclass(frozen=True)
class ResponseDone:
    response_id: str
    item_id: str
    epoch: int
    status: ResponseStatus
    reason: str | None  # turn_detected | client_cancelled | engine_error | None (completed)
    transcript: str
    audio_ms: float  # audio sent to the client
    played_ms: float  # what the history keeps (cancelled) or all sent (completed)
    ttfa_ms: float | None  # end of user speech -> first audio frame released
    metadata: dict | None = None
    after_confirm_ms: float | None = None  # the turn's end confirmed -> first audio frame released


@dataclass(frozen=True)
class OutputCleared:
    response_id: str


@dataclass(frozen=True)
class ItemTruncated:
    item_id: str
    audio_end_ms: float


@dataclass(frozen=True)
class ItemDeleted:
    """The item left the conversation: the client deleted it, or the engine dropped its exchange to fit
    the model's context."""

    item_id: str


SessionEvent = (
    SpeechStarted | SpeechStopped | InputCommitted | InputCleared | UserItemAdded | ResponseCreated | ResponseAudio
    | ResponseText | ResponseDone | OutputCleared | ItemTruncated | ItemDeleted | InputTranscriptDelta | InputTranscriptDone
    | InputTranscriptFailed
)


# --- engine commands ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class PushAudio:
    pcm: np.ndarray  # int16 at 16 kHz


@dataclass(frozen=True)
class EndTurn:
    item_id: str


@dataclass(frozen=True)
class AddUserText:
    """A typed user turn (conv.add_user_text): it ends the open audio turn, if any, and joins it."""

    text: str


@dataclass(frozen=True)
class StartResponse:
    response_id: str
    speculative: bool = False  # the user's turn is still open: the engine forks it (conv.respond(speculative=True))
    output_modalities: tuple[str, ...] | None = None  # response.create's for this answer (the engine's options for it); None: the session's
    instructions: str | None = None  # response.create's: the system text of this answer alone (conv.respond's); None: the session's
    max_output_tokens: int | str | None = None  # response.create's bound for this answer (its engine options); None: the session's


@dataclass(frozen=True)
class ConfirmResponse:
    """The speculative response stands: the user's turn ended where it was forked."""

    response_id: str


@dataclass(frozen=True)
class DiscardResponse:
    """The speculative response never happened: the user's turn goes on."""

    response_id: str


@dataclass(frozen=True)
class CancelResponse:
    """Stop a response that is still running (barge-in, cancel)."""

    response_id: str
    played_ms: float  # the assistant turn keeps exactly this much audio


@dataclass(frozen=True)
class TruncateResponse:
    """Cut a finished response's turn in the history to what the client played."""

    response_id: str
    played_ms: float


@dataclass(frozen=True)
class DeleteTurn:
    """Take a finished response's user turn or answer out of what the model reads."""

    response_id: str
    role: Role


EngineCommand = (
    PushAudio | EndTurn | AddUserText | StartResponse | ConfirmResponse | DiscardResponse | CancelResponse | TruncateResponse | DeleteTurn
)


# --- limits, counters, ids ---------------------------------------------------------------------------


@dataclass
class SessionLimits:
    output_frame_ms: int = 40  # pacing granularity (transports with fixed frames pass theirs)
    lead_ms: float = 150.0  # audio sent ahead of real time
    max_turn_ms: float = 60_000.0  # a client-committed turn may hold at most this much audio
    max_response_buffer_ms: float = 120_000.0  # engine audio waiting for the pacer
    acked_playback: bool = False  # the transport acknowledges every played millisecond (Twilio marks): until it does, nothing has played


@dataclass
class SessionStats:
    responses: int = 0
    barge_ins: int = 0
    underruns_reported: int = 0
    chunks: int = 0  # engine chunks received for the responses sent
    chunks_late: int = 0  # received after their playback deadline
    chunks_gap: int = 0  # so late that the lead the client holds ran out: a gap it hears (admission control's signal)
    input_frames: int = 0  # audio frames (messages, RTP frames) the session consumed
    ttfa_ms: list[float] = field(default_factory=list)
    speculative_confirmed: int = 0
    speculative_discarded: int = 0
    exchanges_dropped: int = 0  # told to the client (conversation.item.deleted) after context management dropped them


_ids = itertools.count(1)


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(6)}{next(_ids):04x}"
