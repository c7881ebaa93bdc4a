"""The client SDK's errors and events (realtime/client): dataclasses, no I/O."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# --- errors ----------------------------------------------------------------------------------------


class DuplexError(Exception):
    """An error with a code: the server's error code where the server sent one."""

    def __init__(self, code: str, message: str, param: str | None = None) -> None:
        super().__init__(f"{message} ({code})")
        self.code, self.message, self.param = code, message, param


class ConnectError(DuplexError):
    """Could not open a session: bad URL, connection refused, HTTP error (code `invalid_url`,
    `connect_failed`, `http_<status>`)."""


class Unauthorized(ConnectError):
    """HTTP 401: a missing or wrong token (code `unauthorized`)."""


class ServerAtCapacity(DuplexError):
    """The server refused a new session (code `server_at_capacity`); try again later."""


class ProtocolError(DuplexError):
    """The server rejected an event this client sent (`invalid_value`, `invalid_type`, ...)."""


class SessionEnded(DuplexError):
    """The server ended the session (`idle_timeout`, `server_shutting_down`, a close code...)."""


class SessionLost(SessionEnded):
    """The connection dropped and the session could not be resumed (`resume_failed`, `reconnect_gave_up`...)."""


ERRORS_BY_CODE = {"server_at_capacity": ServerAtCapacity, "resume_failed": SessionLost, "invalid_last_seq": SessionLost}


# --- events ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SessionCreated:
    session_id: str
    session: dict  # the server's session object (GA shape, plus `duplex`)


@dataclass(frozen=True)
class SessionUpdated:
    session: dict


@dataclass(frozen=True)
class SpeechStarted:
    item_id: str
    audio_start_ms: float  # on the session's input timeline (includes prefix padding)


@dataclass(frozen=True)
class SpeechStopped:
    item_id: str
    audio_end_ms: float


@dataclass(frozen=True)
class InputCommitted:
    item_id: str


@dataclass(frozen=True)
class ResponseCreated:
    response_id: str
    epoch: int


@dataclass(frozen=True)
class FirstAudio:
    response_id: str
    epoch: int
    ttfa_ms: float | None  # server side: end of user speech -> first audio sent
    after_confirm_ms: float | None = None  # server side: end of the turn confirmed -> first audio sent (speculative answers)


@dataclass(frozen=True)
class AudioChunk:
    response_id: str
    epoch: int
    pcm: np.ndarray  # int16 mono at rate_hz
    rate_hz: int
    start_ms: float  # offset of this chunk in the response's audio

    @property
    def duration_ms(self) -> float:
        return 1000.0 * self.pcm.size / self.rate_hz


@dataclass(frozen=True)
class TranscriptDelta:
    """The model's text of an audio answer (the server writes it when its session.assistant_text is on)."""

    response_id: str
    delta: str


@dataclass(frozen=True)
class TextDelta:
    """A text-only answer's text (output_modalities ["text"])."""

    response_id: str
    delta: str


@dataclass(frozen=True)
class UserTranscriptDelta:
    """More of what the user said in an answered turn, as the model heard it (input transcription on)."""

    item_id: str
    delta: str


@dataclass(frozen=True)
class UserTranscript:
    """The whole transcript of the user's turn (its audio item)."""

    item_id: str
    transcript: str


@dataclass(frozen=True)
class UserTranscriptFailed:
    item_id: str
    code: str
    message: str


@dataclass(frozen=True)
class OutputCleared:
    """Stop playing this response now and drop what is buffered (barge-in or cancel)."""

    response_id: str


@dataclass(frozen=True)
class ResponseDone:
    response_id: str
    status: str  # completed | cancelled | failed
    reason: str | None  # turn_detected | client_cancelled | engine_error | None
    audio_ms: float  # audio the server sent
    played_ms: float  # audio the conversation history keeps
    ttfa_ms: float | None
    transcript: str  # the model's text: a text-only answer's, or an audio answer's (empty unless the server writes it)
    text_only: bool = False  # answered in text (output_modalities ["text"])


@dataclass(frozen=True)
class ErrorEvent:
    """An `error` event that did not end the session (a request's own error raises instead)."""

    code: str
    message: str
    param: str | None
    event_id: str | None  # the client event it answers, if any


@dataclass(frozen=True)
class Reconnecting:
    attempt: int
    delay_s: float
    reason: str


@dataclass(frozen=True)
class Resumed:
    session_id: str
    replayed: int  # messages the server sent again
    missed: int  # messages it no longer had (0: nothing was lost; else the answer was ended cleanly)


Event = (SessionCreated | SessionUpdated | SpeechStarted | SpeechStopped | InputCommitted | ResponseCreated | FirstAudio
         | AudioChunk | TranscriptDelta | TextDelta | UserTranscriptDelta | UserTranscript | UserTranscriptFailed | OutputCleared
         | ResponseDone | ErrorEvent | Reconnecting | Resumed)
