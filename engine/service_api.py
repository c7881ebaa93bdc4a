"""The engine's interface to the gateway (DESIGN.md §4): types only, no torch, no vLLM.

The gateway (realtime/) imports this module and nothing else from engine/ at import time;
`engine.service.Engine` implements it.

    engine = await Engine.start(config)                  # vLLM engine + codec stage, warm
    conv = engine.open_conversation(session_id, options) # raises AtCapacity beyond capacity
    conv.push_user_audio(pcm_16k)                        # tokenized + prefilled while the user talks
    conv.end_user_turn()
    async for chunk in conv.respond(): ...               # AudioChunk, in order, until is_last
    conv.cancel(played_ms)                               # barge-in: stop; history keeps what was played
    await conv.close()
    engine.health(), engine.load()
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Protocol

import numpy as np

SAMPLE_RATE_HZ = 16_000  # engine-side audio: mono int16 at 16 kHz, in and out
FRAME_MS = 20.0  # one model frame


class EngineError(Exception):
    """Base of the errors the engine raises to the gateway; `code` is the wire error code."""

    code = "engine_error"


class AtCapacity(EngineError):
    """open_conversation beyond the measured capacity: refuse the session, keep the others."""

    code = "server_at_capacity"


class ConversationClosed(EngineError):
    code = "conversation_closed"


class ResponseInProgress(EngineError):
    code = "conversation_already_has_active_response"


@dataclass(frozen=True)
class ConversationOptions:
    """Per-conversation settings (session.update maps onto these)."""

    system_prompt: str | None = None  # text; used when the model has a text tokenizer
    speaker_prompt_pcm: np.ndarray | None = None  # 16 kHz int16: the voice to imitate, if any
    temperature: float = 0.8
    top_k: int = 30
    top_p: float = 1.0
    seed: int | None = None
    cfg_scale: float = 1.0
    max_response_ms: float = 10_000.0


DEFAULT_OPTIONS = ConversationOptions()  # the gateway's config and session defaults derive from it


@dataclass(frozen=True)
class AudioChunk:
    """A piece of the assistant's answer, in order. `pcm` is mono int16 at 16 kHz."""

    response_id: str
    pcm: np.ndarray
    start_ms: float  # offset of this chunk from the start of the response audio
    duration_ms: float
    deadline: float  # time.monotonic() by which it must be playing for gap-free playback
    text_delta: str = ""  # assistant text the model emitted with this chunk, if any
    is_last: bool = False


class Role(IntEnum):
    SYSTEM = 0
    USER = 1
    ASSISTANT = 2


@dataclass(frozen=True)
class HistoryTurn:
    """One turn of the conversation as the model will see it in the next prompt."""

    role: Role
    audio_frames: int  # 50 Hz frames of audio in this turn (assistant: only what was played)
    text: str = ""


@dataclass(frozen=True)
class EngineHealth:
    ready: bool
    detail: str = ""


@dataclass(frozen=True)
class EngineLoad:
    """What admission control reads: measured, continuously updated."""

    conversations: int  # open
    responding: int  # generating right now
    capacity: int  # conversations that can respond at once in real time
    step_ms: float  # recent engine step time
    batch_size: float  # recent mean batch size
    chunks_late: int = 0  # chunks decoded after their deadline, since start
    extra: dict = field(default_factory=dict)


class Conversation(Protocol):
    id: str

    def update_options(self, options: ConversationOptions) -> None: ...

    def push_user_audio(self, pcm_16k: np.ndarray) -> None: ...

    def end_user_turn(self) -> None: ...

    def respond(self) -> AsyncIterator[AudioChunk]: ...

    def cancel(self, played_ms: float) -> None: ...

    async def close(self) -> None: ...

    @property
    def history(self) -> list[HistoryTurn]: ...


class EngineLike(Protocol):
    def open_conversation(self, session_id: str, options: ConversationOptions | None = None) -> Conversation: ...

    def health(self) -> EngineHealth: ...

    def load(self) -> EngineLoad: ...

    async def shutdown(self) -> None: ...
