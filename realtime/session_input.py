"""What a client asks of its session, as typed inputs: the wire protocols parse messages into these,
and only the session runner applies them (`apply_inputs`), so no protocol calls the session.

Each input carries the client event's id, so a `SessionError` it raises is answered by an `error`
event naming that client event, in the order the client sent them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from realtime.input_budget import InputBudget, InputLimits, Rejection
from realtime.item_audio import ItemAudio
from realtime.session import RATE_HZ, Session, SessionError
from realtime.vad import VadParams


@dataclass(frozen=True, slots=True)
class AudioIn:
    pcm: np.ndarray  # int16, 16 kHz
    client_frame: bool = True  # False: a decoder's tail, not one of the client's frames (not counted)
    event_id: str | None = None


@dataclass(frozen=True, slots=True)
class CommitInput:
    event_id: str | None = None


@dataclass(frozen=True, slots=True)
class ClearInput:
    event_id: str | None = None


@dataclass(frozen=True, slots=True)
class CreateResponse:
    event_id: str | None = None
    metadata: dict | None = None  # echoed in response.created / response.done
    output_modalities: tuple[str, ...] | None = None  # this answer's, when it differs from the session's
    instructions: str | None = None  # this answer's own system text (response.instructions); None: the session's
    max_output_tokens: int | str | None = None  # this answer's own bound (response.max_output_tokens); None: the session's


@dataclass(frozen=True, slots=True)
class AddUserItem:
    """conversation.item.create of a user message with audio or text: a user turn, no answer."""

    item_id: str
    audio: ItemAudio | None  # still encoded: decoded when applied, once the input budget has taken it; None: no audio
    text: str = ""  # its input_text parts (the model reads them after the audio)
    event_id: str | None = None


@dataclass(frozen=True, slots=True)
class CancelRequested:
    response_id: str | None = None  # None: whichever is in progress
    event_id: str | None = None


@dataclass(frozen=True, slots=True)
class ClearOutput:
    event_id: str | None = None


@dataclass(frozen=True, slots=True)
class TruncateItem:
    item_id: str
    audio_end_ms: float
    event_id: str | None = None


@dataclass(frozen=True, slots=True)
class DeleteItem:
    """conversation.item.delete of an item in the model's history (audio turns)."""

    item_id: str
    event_id: str | None = None


@dataclass(frozen=True, slots=True)
class Played:
    """The client (or its transport: Twilio marks) has played this much of a response."""

    played_ms: float
    underruns: int = 0
    response_id: str | None = None
    event_id: str | None = None


@dataclass(frozen=True, slots=True)
class SetTurnDetection:
    params: VadParams | None  # None: the client commits its turns
    event_id: str | None = None


@dataclass(frozen=True, slots=True)
class SetNoiseReduction:
    mode: str | None  # "near_field" / "far_field"; None: off (audio.input.noise_reduction)
    event_id: str | None = None


SessionInput = (AudioIn | CommitInput | ClearInput | CreateResponse | AddUserItem | CancelRequested | ClearOutput | TruncateItem
                | DeleteItem | Played | SetTurnDetection | SetNoiseReduction)


class InputSource(Protocol):
    """A wire protocol: it queues the inputs it parsed and answers the ones the session refused."""

    def inputs(self) -> list[SessionInput]: ...

    def input_refused(self, error: SessionError, event_id: str | None) -> None: ...


def apply(session: Session, inp: SessionInput, now: float) -> None:
    match inp:
        case AudioIn(pcm, client_frame):
            session.receive_audio(pcm, now, client_frame)
        case CommitInput():
            session.receive_commit(now)
        case ClearInput():
            session.receive_clear()
        case CreateResponse(metadata=metadata, output_modalities=modalities, instructions=instructions, max_output_tokens=tokens):
            session.receive_response_create(now, metadata, modalities, instructions, tokens)
        case AddUserItem(item_id, audio, text):
            session.receive_user_item(item_id, None if audio is None else audio.decode(), text)
        case CancelRequested(response_id):
            session.receive_response_cancel(now, response_id)
        case ClearOutput():
            session.receive_output_clear(now)
        case TruncateItem(item_id, audio_end_ms):
            session.receive_truncate(item_id, audio_end_ms, now)
        case DeleteItem(item_id):
            session.receive_delete(item_id)
        case Played(played_ms, underruns, response_id):
            session.receive_played(played_ms, underruns, response_id)
        case SetTurnDetection(params):
            session.set_turn_detection(params)
        case SetNoiseReduction(mode):
            session.set_noise_reduction(mode)


def apply_inputs(source: InputSource, session: Session, now: float, budget: InputBudget | None = None) -> int:
    """Everything `source` parsed since the last call, in order; refusals go back to it. Client audio
    beyond `budget` is dropped (reported at most once a second); an item whose audio it cannot take now
    is refused (each one reported) before its audio is decoded. Returns the audio frames dropped."""
    dropped = 0
    for inp in source.inputs():
        if budget is not None and isinstance(inp, AudioIn) and inp.client_frame:
            rejection = budget.audio(len(inp.pcm) / RATE_HZ, now)
            if rejection is not None:
                dropped += 1
                if rejection.report:
                    source.input_refused(rate_error(rejection, budget.limits), inp.event_id)
                continue
        if budget is not None and isinstance(inp, AddUserItem) and inp.audio is not None:
            if (refusal := item_audio_refusal(inp.audio, budget, now)) is not None:
                source.input_refused(refusal, inp.event_id)
                continue
        try:
            apply(session, inp, now)
        except SessionError as e:
            source.input_refused(e, inp.event_id)
    return dropped


def item_audio_refusal(audio: ItemAudio, budget: InputBudget, now: float) -> SessionError | None:
    """None: `budget` took the item's audio (decode it); else why the item is refused. Costed from its
    length before any decoding, so a refused item costs no more than its JSON did."""
    seconds, lim = audio.seconds, budget.limits
    most_s, key = lim.item_audio_limit()
    if seconds > most_s:  # never fits: not a matter of rate, and not counted as one
        return SessionError("audio_too_large", f"an item may hold at most {most_s:g} s of audio ({key}); "
                                               f"this one holds {seconds:.1f} s", audio.param)
    rejection = budget.item_audio(seconds, now)
    return None if rejection is None else rate_error(rejection, lim, seconds)


def rate_error(rejection: Rejection, limits: InputLimits, item_s: float = 0.0) -> SessionError:
    if rejection.what == "item_audio":
        return SessionError("input_rate_exceeded", f"the item's {item_s:.1f} s of audio is beyond the session's audio budget "
                                                   f"({limits.audio_rate:g}x real time after a {limits.audio_burst_s:g} s burst): "
                                                   f"not added; it would fit in {rejection.retry_after_s:.1f} s. The session is "
                                                   f"closed if input stays over budget for {limits.overrun_close_s:g} s", "item")
    if rejection.what == "audio":
        why = f"audio faster than {limits.audio_rate:g}x real time (beyond a {limits.audio_burst_s:g} s burst)"
    elif rejection.what == "bytes":
        why = (f"messages of more than {limits.message_bytes_per_s / (1 << 20):g} MiB a second (beyond a burst of "
               f"{limits.message_bytes_burst / (1 << 20):g} MiB)")
    else:
        why = f"more than {limits.messages_per_s:g} messages a second (beyond a burst of {limits.message_burst:g})"
    return SessionError("input_rate_exceeded", f"{why}: {rejection.since_report} dropped since the last such error; "
                                               f"the session is closed if this goes on for {limits.overrun_close_s:g} s")
