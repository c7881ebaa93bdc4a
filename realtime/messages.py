"""What a session's task receives, and why a session ends: typed, so the runner `match`es on them.

Two lanes feed a session's loop (realtime/runner.py): client input (`ClientMessage`,
`TransportAudio`, `LinkClosed`, `Attach`) is bounded — a client that floods waits or loses frames,
counted — while the engine's output (`EngineChunk`, `EngineFailed`, `EngineUserTranscript*`) and the server's own notices
(`VadReady`, `Shutdown`) never wait behind it.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from enum import Enum

import numpy as np

from engine.service_api import AudioChunk
from realtime.input_budget import Rejection
from realtime.link import Link


@dataclass(frozen=True, slots=True)
class ClientMessage:
    """One message from the client's link (JSON text or a binary frame)."""

    data: str | bytes


@dataclass(frozen=True, slots=True)
class TransportAudio:
    """Audio a transport decoded itself (WebRTC's microphone track): int16 at 16 kHz."""

    pcm: np.ndarray


@dataclass(frozen=True, slots=True)
class LinkClosed:
    link: Link


@dataclass(frozen=True, slots=True)
class Attach:
    """A resume: carry on over `link`; the client received messages 1..last_seq."""

    link: Link
    last_seq: int
    done: asyncio.Future


@dataclass(frozen=True, slots=True)
class EngineChunk:
    response_id: str
    chunk: AudioChunk


@dataclass(frozen=True, slots=True)
class EngineFailed:
    response_id: str
    error: BaseException


@dataclass(frozen=True, slots=True)
class EngineUserTranscript:
    """More of the user turn's transcript the engine writes beside the answer `response_id` (transcribe_user)."""

    response_id: str
    delta: str


@dataclass(frozen=True, slots=True)
class EngineUserTranscriptEnd:
    """The transcript is complete (`error` None) or failed."""

    response_id: str
    error: BaseException | None = None


@dataclass(frozen=True, slots=True)
class HistoryDropped:
    """The engine dropped these earlier responses' exchanges from the history to fit the model's context."""

    response_ids: tuple[str, ...]
    for_response: str  # the response that needed the room


@dataclass(frozen=True, slots=True)
class VadReady:
    """The VAD batch ran this session's windows: its waiting audio can be settled."""


@dataclass(frozen=True, slots=True)
class Throttled:
    """The reader is holding client messages back (over the message budget); `rejection` says whether to
    tell the client now."""

    rejection: Rejection


@dataclass(frozen=True, slots=True)
class Shutdown:
    """The server ends the session: an error event with `code`, then a close."""

    reason: CloseReason
    code: str
    message: str
    retry_after_s: float | None = None  # the error event tells the client when to call again


Inbound = (ClientMessage | TransportAudio | LinkClosed | Attach | EngineChunk | EngineFailed | EngineUserTranscript | EngineUserTranscriptEnd
           | HistoryDropped | VadReady | Throttled | Shutdown)


class CloseReason(Enum):
    """Why a session ended: its close code, and the label of `duplex_sessions_ended_total{reason}`."""

    CLIENT_CLOSED = ("client_closed", 1000)
    MESSAGE_TOO_BIG = ("message_too_big", 1009)
    PROTOCOL_END = ("protocol_end", 1000)  # the protocol ended it (Twilio `stop`, an end-call digit)
    IDLE_TIMEOUT = ("idle_timeout", 1000)
    SLOW_CLIENT = ("slow_client", 1008)
    CONNECTION_LOST = ("connection_lost", 1001)  # not resumed within the grace
    SERVER_SHUTDOWN = ("server_shutdown", 1001)
    SERVER_OVERLOADED = ("server_overloaded", 1013)  # the newest call, ended so the others stay on time (realtime/overload.py)
    POLICY = ("policy", 1008)

    def __init__(self, label: str, close_code: int) -> None:
        self.label, self.close_code = label, close_code


@dataclass(frozen=True, slots=True)
class Closing:
    """A session on its way out: why, and the close frame's code and text."""

    reason: CloseReason
    text: str = ""
    code: int | None = None  # None: the reason's own

    @property
    def close_code(self) -> int:
        return self.reason.close_code if self.code is None else self.code
