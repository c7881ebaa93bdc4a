"""The engine's interface to the gateway (docs/architecture.md, "The engine contract"): types only,
no torch, no vLLM.

The gateway (realtime/) imports this module and nothing else from engine/ at import time;
`engine.service.Engine` implements it, and tests/realtime/fake_engine.py fakes it.

    engine = await Engine.start(config)                  # vLLM engine + codec stage, warm
    conv = engine.open_conversation(session_id, options) # raises AtCapacity beyond capacity
    conv.push_user_audio(pcm_16k)                        # tokenized + prefilled while the user talks
    conv.end_user_turn()
    handle = conv.respond(response_id)                   # the gateway's id is the engine's request id
    handle = conv.respond(response_id, instructions="Greet the user.")  # this answer's own system text
    handle = conv.respond(response_id, speculative=True) # before the turn is sure to have ended:
    handle.confirm() / handle.discard()                  #   it stands / it never happened, the turn goes on
    async for chunk in handle.chunks(): ...              # AudioChunk, in order, until is_last
    handle.dropped_exchanges                             # context management: earlier responses dropped for it
    handle.cancel(played_ms)                             # barge-in: stop; history keeps what was played
    conv.truncate(response_id, played_ms)                # cut a finished answer (the client stopped playing it)
    conv.suspend(); conv.resume()                        # client away: its slot is free, its history kept
    conv.degrade(Degradation(cfg=False, max_response_ms=2000))  # overload: cheaper next answers (NO_DEGRADATION: back)
    await conv.close()
    engine.health(), engine.load(), engine.report_delivery(chunks, late, underruns)   # admission control

One-shot requests beside the conversations (the OpenAI-compatible /v1/audio endpoints), on the same
engine; realtime answers keep priority in its scheduler:

    async for delta in engine.transcribe(pcm_16k, TranscriptionOptions()): ...   # ASR: text deltas
    async for chunk in engine.synthesize("Hello.", SpeechOptions()): ...         # TTS: AudioChunks
    engine.count_text_tokens(text) <= engine.text_budget().speech_tokens         # text fits (checked up front)
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Protocol

import numpy as np

# the contract's audio: mono int16 at SAMPLE_RATE_HZ, in and out; defined in engine/units.py
from engine.units import FRAME_MS as FRAME_MS, SAMPLE_RATE_HZ as SAMPLE_RATE_HZ  # noqa: F401


class EngineError(Exception):
    """Base of the errors the engine raises to the gateway; `code` is the wire error code."""

    code = "engine_error"


class AtCapacity(EngineError):
    """open_conversation beyond the measured capacity: refuse the session, keep the others. The gateway
    tells the caller when to try again (`retry_after_s`, from its config)."""

    code = "server_at_capacity"
    retry_after_s: float = 5.0


class ConversationClosed(EngineError):
    code = "conversation_closed"


class ResponseInProgress(EngineError):
    code = "conversation_already_has_active_response"


class ConversationTooLong(EngineError):
    """The answer does not fit the model's context: truncation is disabled, or the user's turn alone
    leaves room for less than a second of answer. The response fails; the conversation goes on."""

    code = "conversation_too_long"


class TextTooLong(EngineError):
    """Text longer, in the model's tokens, than its context can hold for that use (`TextBudget`). The
    gateway refuses such text up front (`EngineLike.count_text_tokens`); the engine refuses it too."""

    code = "context_length_exceeded"  # OpenAI's code for a prompt beyond the model's context


@dataclass(frozen=True)
class TextBudget:
    """The most tokens of the model's text each use of text may hold: what the model's context
    (`context` positions) leaves it beside everything else the prompt must hold (`EngineLike.text_budget`).
    Text is measured with `EngineLike.count_text_tokens`."""

    context: int  # the model's positions
    system_tokens: int  # an answer's system text (instructions and system messages): the engine keeps at most this
    user_text_tokens: int  # one typed user turn, beside the longest speaker prompt and system text and a 1 s answer
    speech_tokens: int  # the text of one synthesize() in the model's own voice (its prompt fits the context)
    speech_tokens_with_voice: int  # ... with a speaker prompt (SpeechOptions.speaker_prompt_pcm)


# Context management (engine.dialogue.fit_context): when the next prompt and the longest answer would
# not fit the model's positions, the oldest exchanges are dropped until the conversation takes this
# share of the room. 0.75 keeps most of the context while dropping a quarter of the window at once,
# so the prefix cache, which a drop invalidates, is rebuilt once every several exchanges; the
# incremental prefill rebuilds it while the user speaks. (OpenAI Realtime's `truncation: "auto"`.)
DEFAULT_RETENTION_RATIO = 0.75


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
    retention_ratio: float | None = DEFAULT_RETENTION_RATIO  # context management; None: disabled (conversation_too_long)
    # Text (the model must have a text tokenizer: `EngineLike.supports_text`, else NoTextModel):
    # the model writes each answered user turn's transcript (`ResponseHandle.user_transcript()`)
    transcribe_user: bool = False
    # each answer first writes its text (AudioChunks with `text_delta` and no audio, before its audio), as
    # the dialogue model was trained (assistant text, then speech); costs the text's steps before the audio
    assistant_text: bool = False
    output_audio: bool = True  # False: text-only answers (needs assistant_text): no audio chunks at all
    max_text_tokens: int = 128  # an answer's text at most


DEFAULT_OPTIONS = ConversationOptions()  # the gateway's config and session defaults derive from it


def uses_guidance(cfg_scale: float) -> bool:
    """Whether answers with this `cfg_scale` run CFG's unconditional shadow (two rows each): w != 1."""
    return abs(float(cfg_scale) - 1.0) > 1e-6


@dataclass(frozen=True)
class Degradation:
    """What the gateway's overload control (realtime/overload.py) takes from a conversation's next answers
    while the engine falls behind, cheapest for quality first: `cfg` False runs them without CFG's
    unconditional shadow (one row instead of two; cfg_scale 1), `max_response_ms` caps their length below
    the options' own. An answer already generating keeps what it started with. `Degradation()` is none:
    the options apply as given (session.update's still do, under any degradation)."""

    cfg: bool = True
    max_response_ms: float | None = None

    def apply(self, options: ConversationOptions) -> ConversationOptions:
        """The options the next answer runs with."""
        cfg = options.cfg_scale if self.cfg else 1.0
        ms = options.max_response_ms if self.max_response_ms is None else min(options.max_response_ms, self.max_response_ms)
        if (cfg, ms) == (options.cfg_scale, options.max_response_ms):
            return options
        return dataclasses.replace(options, cfg_scale=cfg, max_response_ms=ms)


NO_DEGRADATION = Degradation()


@dataclass(frozen=True)
class AudioChunk:
    """A piece of the assistant's answer, in order. `pcm` is mono int16 at 16 kHz."""

    response_id: str
    pcm: np.ndarray
    start_ms: float  # offset of this chunk from the start of the response audio
    duration_ms: float
    deadline: float  # time.monotonic() by which it must be playing for gap-free playback
    # assistant text the model wrote (ConversationOptions.assistant_text): such chunks come before the
    # answer's audio and carry no audio (pcm empty, duration_ms 0)
    text_delta: str = ""
    is_last: bool = False


class NoTextModel(EngineError):
    """The model has no text tokenizer, so it can neither read nor write text (ASR, TTS, transcripts)."""

    code = "model_has_no_text"


@dataclass(frozen=True)
class TranscriptionOptions:
    """One ASR request (`Engine.transcribe`). Greedy by default, as transcription should be."""

    max_tokens: int = 448  # text tokens at most (Whisper's decoder limit; an answer past it is cut)
    min_tokens: int = 1  # no end of text before this many tokens (benchmarks hold the length fixed with it)
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    prompt: str = ""  # reserved: OpusLM's ASR task takes no text prompt (the gateway refuses a non-empty one)


@dataclass(frozen=True)
class SpeechOptions:
    """One TTS request (`Engine.synthesize`)."""

    speaker_prompt_pcm: np.ndarray | None = None  # 16 kHz int16: the voice to imitate, if any
    temperature: float = 0.8
    top_k: int = 30
    top_p: float = 1.0
    seed: int | None = None
    max_ms: float = 30_000.0  # audio cap


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


class ResponseHandle(Protocol):
    """One answer being generated. Its `id` is the gateway's response id, the engine's request id and
    the codec stage's stream id: one name for one response everywhere."""

    @property
    def id(self) -> str: ...

    @property
    def dropped_exchanges(self) -> tuple[str, ...]:
        """Context management, final before the first chunk and before `chunks()` ends or raises: the ids
        of the earlier responses whose exchanges (the user turn each answered, and the answer) were
        dropped from the history to fit this one, oldest first; () when nothing was dropped."""

    def chunks(self) -> AsyncIterator[AudioChunk]:
        """The answer's audio, in order, until a chunk with `is_last`; ends early (without `is_last`)
        once cancelled; raises `EngineError` when the engine fails the response. Iterate it once."""

    def user_transcript(self) -> AsyncIterator[str]:
        """The text of the user turn this answer answers, as the model writes it (ConversationOptions.
        transcribe_user): deltas that concatenate to the transcript, then the end; nothing at all when not
        asked for. Written beside the answer (it does not delay it); the history keeps the audio only.
        Raises `EngineError` when the engine fails it. Iterate it once."""

    def cancel(self, played_ms: float) -> None:
        """Stop generating at the next step; the history keeps `played_ms` of this answer (and the text
        it wrote so far). Idempotent,
        and valid before generation started (it then never starts) and after it ended (it cuts)."""

    def confirm(self) -> None:
        """A speculative answer stands: the user's turn did end where it was forked. It is a plain
        answer from now on (cancel, truncate as any). No-op for an answer that was not speculative."""

    def discard(self) -> None:
        """A speculative answer never happened (the user went on speaking): generation stops, no more
        chunks, the history is as if it had never started (its exchange, and any exchange context
        management dropped for it, restored), and the user turn goes on from where it was forked,
        its frames and prefill kept. Idempotent; raises RuntimeError once confirmed."""


class Conversation(Protocol):
    id: str

    def update_options(self, options: ConversationOptions) -> None: ...

    def degrade(self, degradation: Degradation) -> None:
        """Overload (realtime/overload.py): the next answers run with `degradation.apply(options)`, whatever
        options `update_options` sets meanwhile; `NO_DEGRADATION` gives them back. Never blocks."""

    def push_user_audio(self, pcm_16k: np.ndarray) -> None: ...

    def end_user_turn(self) -> None: ...

    def respond(self, response_id: str, speculative: bool = False, instructions: str | None = None) -> ResponseHandle:
        """Answer the user's turn (ending it if it is still open; with no user turn since the last
        answer, or none at all, an empty one: the model speaks first, e.g. a greeting). Returns at once;
        generation starts when the previous response, if cancelled and still winding down, has ended.
        Raises `ResponseInProgress` while another response is generating and not cancelled.

        `instructions`: the system text the model reads for this answer alone, in place of
        `ConversationOptions.system_prompt` (None: the session's). The history, and the answers after
        this one, keep the session's. A prompt with another system text is a prefix the cache does not
        hold past the speaker prompt, so this answer prefills the whole history (engine/README.md,
        "Per-response instructions"). A model without text ignores them, as it does the session's (logged).

        `speculative` (the turn is open: the user paused, the VAD has not decided): answer the turn as
        it is now while keeping it open, so that `handle.discard()` can take the answer back and the
        turn go on. Until the handle is confirmed or discarded no user audio may be pushed. A confirmed
        answer is exactly what `end_user_turn()` and `respond()` at the same point would have given.

        Every response adds one exchange to the history, its user turn then its answer (cut, empty
        or failed as it may be), known by the response's id (`dropped_exchanges`).
        When the prompt and the longest answer would not fit the model's context, the oldest
        exchanges are dropped first (`ConversationOptions.retention_ratio`); when they cannot be
        made to fit, the response fails with `ConversationTooLong`."""

    def truncate(self, response_id: str, played_ms: float) -> None:
        """The client played only `played_ms` of an answer: the history keeps that much. Any answer
        still in the history can be cut (never lengthened); unknown or dropped responses are ignored."""

    def add_user_text(self, text: str) -> None:
        """A user turn in text (conversation.item.create with input_text): it ends any open audio turn and
        is what the next `respond()` answers (with the audio turn before it, if any, in the same exchange).
        Raises NoTextModel without a text tokenizer, ValueError for empty text."""

    def delete_turn(self, response_id: str, role: Role) -> None:
        """The client deleted the user turn (`Role.USER`) or the answer of `response_id`'s exchange:
        the model no longer reads it, and `history` no longer lists it. Raises `ResponseInProgress`
        while that response runs; ignores unknown or dropped responses and repeated deletions."""

    def suspend(self) -> None:
        """The client is away (its connection dropped; it may resume): free the engine slot, keep the
        history and the conversation. A running answer is cancelled (keeping what it generated); the
        gateway suspends only between answers. Idempotent."""

    def resume(self) -> None:
        """Take an engine slot again after `suspend()`; raises `AtCapacity` (and stays suspended)
        when the engine is full. Idempotent."""

    async def close(self) -> None:
        """End the conversation: cancel what runs, free its engine slot. Idempotent."""

    @property
    def history(self) -> list[HistoryTurn]:
        """The turns the next prompt holds (dropped ones are gone), oldest first."""


class EngineLike(Protocol):
    @property
    def supports_text(self) -> bool:
        """The model has a text tokenizer: it can transcribe, write answers' text, read text turns, and serve
        transcribe/synthesize; without one those raise NoTextModel and the gateway refuses them up front."""

    def open_conversation(self, session_id: str, options: ConversationOptions | None = None) -> Conversation: ...

    def health(self) -> EngineHealth: ...

    def load(self) -> EngineLoad: ...

    def report_delivery(self, chunks: int, late_chunks: int, underruns: int) -> None:
        """What the gateway's sessions got since its last report: `chunks` audio chunks from the engine,
        `late_chunks` of them so late that the client's lead ran out (a gap it hears), `underruns`
        clients reported. Admission control lowers its capacity when too many were late."""

    def transcribe(self, pcm_16k: np.ndarray, options: TranscriptionOptions | None = None) -> AsyncIterator[str]:
        """The text of `pcm_16k` (mono int16, 16 kHz) as the model writes it: deltas, in order, which
        concatenate to the transcript. Raises `AtCapacity` when the engine has no room, `NoTextModel`
        when the model has no text tokenizer, `EngineError` when the engine fails it. Closing the
        iterator early cancels the request."""

    def synthesize(self, text: str, options: SpeechOptions | None = None) -> AsyncIterator[AudioChunk]:
        """`text` spoken: AudioChunks (16 kHz int16) in order as they are decoded, the last with
        `is_last`. Raises as `transcribe`; ValueError for empty text; `TextTooLong` for text beyond
        `text_budget()`'s speech tokens. Closing early cancels it."""

    def text_budget(self) -> TextBudget:
        """How many tokens of text each use may hold (fixed once the engine runs). Raises NoTextModel
        without a text tokenizer."""

    def count_text_tokens(self, text: str) -> int:
        """`text`'s length in the model's tokens, as the engine reads it. Its cost grows with the text
        (about 0.3 ms a KB) and it releases the GIL: long text is counted off the event loop. Raises
        NoTextModel without a text tokenizer."""

    async def shutdown(self) -> None: ...
