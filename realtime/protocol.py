"""The OpenAI-Realtime-style event machine for `WS /v1/realtime`, sans-I/O.

    proto = RealtimeProtocol(session, limits)
    proto.open()                                # -> session.created
    proto.receive_text(message, now)            # a client JSON event
    proto.receive_binary(message, now)          # our binary frame: 0x01 + one Opus packet
    proto.send_session_events(session.events()) # session events -> server events (audio encoded)
    for msg in proto.data_to_send(): ...        # str (JSON) or bytes (binary Opus) for the socket

It never touches a socket and never raises on client input: every mistake becomes an `error`
event naming it ({type, code, message, param, event_id}) and the session goes on. Wire shapes follow
the GA Realtime API; beta spellings are accepted on input. Our additions are documented in
docs/protocol.md: binary Opus frames, `output_audio_buffer.played`, `epoch` on response events,
`duplex.latency`, the `duplex` object in session config, and reconnect-and-resume (`resume_token` in
`session.created`, `session.resumed`).
"""

from __future__ import annotations

import base64
import binascii
import itertools
import json
import struct
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace
from typing import Any, ClassVar

from engine.service_api import ConversationOptions
from realtime import client_json
from realtime.config import ENGINE_KEYS, SessionSection
from realtime.audio import AudioFormatError, InputDecoder, OutputEncoder, WireFormat
from realtime.session import (
    InputCleared, InputCommitted, InputTranscriptDelta, InputTranscriptDone, InputTranscriptFailed, ItemDeleted, ItemTruncated,
    OutputCleared, ResponseAudio, ResponseCreated, ResponseDone, ResponseStatus, ResponseText, Session, SessionError, SessionEvent,
    SpeechStarted, SpeechStopped, UserItemAdded, new_id,
)
from realtime.session_input import (
    AddUserItem, AudioIn, CancelRequested, ClearInput, ClearOutput, CommitInput, CreateResponse, DeleteItem, Played,
    SessionInput, SetNoiseReduction, SetTurnDetection, TruncateItem,
)
from realtime.vad import VadParams
from realtime.conversation_items import ConversationItems, Item, parse_new_item
from realtime.response_request import parse_response_request
from realtime.session_update import TOKEN_MS, echo_turn_detection, parse_session_update
from realtime.text_limits import TextLimits, TokenMeter, check_string, context_exceeded, over_total
from realtime.tracing_config import TracingConfig
from realtime.wire_fields import ClientError, Notice, get_field as _get, number as _number

BINARY_OPUS = 0x01  # first byte of a binary frame carrying one Opus packet
_EPOCH = struct.Struct("<I")


@dataclass(frozen=True)
class ProtocolLimits:
    max_append_bytes: int = 1 << 20  # decoded audio bytes in one input_audio_buffer.append
    max_opus_packet_bytes: int = 4000


@dataclass(frozen=True)
class OpusOutput:
    """Encoder settings of binary Opus output (config `audio.opus_*`)."""

    bitrate: int = 24_000
    complexity: int = 5


@dataclass(frozen=True)
class ResumeOffer:
    """What `session.created` tells a client about resuming this session after a dropped connection."""

    token: str
    grace_s: float


@dataclass(frozen=True)
class SessionSettings(SessionSection):
    """A session's settings: the server's defaults (config `session`), changed by session.update."""

    model: str = "duplex-opuslm"
    input_format: WireFormat = WireFormat.PCM16
    output_format: WireFormat = WireFormat.PCM16
    output_modalities: tuple[str, ...] = ("audio",)  # ("text",): text-only answers
    tools: tuple[dict, ...] = ()  # session.tools as echoed: listed, never offered to the model (realtime/tools.py)
    tool_choice: str = "auto"  # "auto" | "none": OpusLM calls no tool either way
    max_output_tokens: int | str = "inf"  # N: each answer at most N steps (N × 20 ms of audio, N text tokens)
    transcription: dict | None = None  # input transcription as echoed ({"model": ...}); None: off
    tracing: TracingConfig | None = None  # session.tracing; None: off (realtime/tracing.py records the on ones)
    voice_pcm: dict = field(default_factory=dict, compare=False, repr=False)  # the server's voices, loaded: name -> 16 kHz PCM

    @classmethod
    def of(cls, defaults: SessionSection, voice_pcm: dict) -> SessionSettings:
        return cls(**{f.name: getattr(defaults, f.name) for f in fields(SessionSection)}, voice_pcm=voice_pcm)

    def answer_options(self, output_modalities: tuple[str, ...] | None = None) -> ConversationOptions:
        """The engine options of these settings (the server's `engine_options` with the voices and what the
        client set); `output_modalities`: one answer's own (response.create), else the session's."""
        text_only = (output_modalities or self.output_modalities) == ("text",)
        opts = replace(self.engine_options(self.voice_pcm), transcribe_user=self.transcription is not None,
                       assistant_text=self.assistant_text or text_only, output_audio=not text_only)
        if isinstance(n := self.max_output_tokens, int):  # (else "inf") N steps of the model: the answer's audio frames and its text tokens
            opts = replace(opts, max_response_ms=min(opts.max_response_ms, n * TOKEN_MS), max_text_tokens=min(opts.max_text_tokens, n))
        return opts

    def effective_max_output_tokens(self) -> int | str:
        """What session.updated echoes: the bound in force, in steps (`max_response_ms` may be the smaller)."""
        if self.max_output_tokens == "inf":
            return "inf"
        return min(self.max_output_tokens, max(1, int(self.max_response_ms // TOKEN_MS)))


# the settings the engine's options are made of: a change to one must reach the conversation
_ENGINE_KEYS = (*ENGINE_KEYS, "output_modalities", "transcription", "max_output_tokens")

_MAX_MS = 24 * 3600 * 1000.0  # a day of audio: beyond any answer's or turn's length


class RealtimeProtocol:
    def __init__(self, session: Session, limits: ProtocolLimits | None = None, settings: SessionSettings | None = None,
                 opus: OpusOutput | None = None, resume: ResumeOffer | None = None, audio_out_of_band: bool = False,
                 extensions: bool = False, text_model: bool = False, text_limits: TextLimits | None = None,
                 tokens: TokenMeter | None = None) -> None:
        """`audio_out_of_band`: the answer's audio does not travel in events (WebRTC: the transport plays it
        on its media track); each answer's audio is bracketed by output_audio_buffer.started/stopped.
        `extensions`: the client opted in to our additions from the start (`?duplex=1`); else a
        `duplex` field in session.update opts in. Until then it sees only Realtime API events and fields.
        `text_model`: the engine's model reads and writes text (EngineLike.supports_text): input transcription,
        text-only answers and typed user turns are honoured; without it they are refused by name.
        `text_limits`: what text the client may make the session hold (config `limits.text`); `tokens`: the
        model's token counts and budget, so that text the model cannot read is refused (None: not checked)."""
        self.extensions = extensions
        self.text_model = text_model
        self._text_answers: set[str] = set()  # responses answering in text only (output_text events)
        self.opus = opus or OpusOutput()
        self.resume = resume
        self.audio_out_of_band = audio_out_of_band
        self._audio_started_for: str | None = None  # out of band: the response whose output_audio_buffer.started went out
        self.session = session  # the runner's: this machine reads only its id, pacing lead and first turn detection
        self.session_id, self.lead_ms, self.frame_ms = session.id, session.limits.lead_ms, session.limits.output_frame_ms
        self.turn_detection: VadParams | None = session.vad_params  # as the client last set it
        self._turn_detection_wire: dict | None = None  # semantic_vad as the client asked it (echoed back)
        self.limits = limits or ProtocolLimits()
        self.settings = settings or SessionSettings()
        self.settings_changed = False  # set by session.update when the engine's options changed
        self.client_errors = 0  # error events answering bad client input (the gateway counts them)
        self.offered_tools = False  # the client listed function tools (duplex_sessions_with_tools counts such sessions)
        self._notices: list[Notice] = []  # fields accepted as hints by the last update: duplex.notice (opted-in clients)
        self.closing: tuple[int, str] | None = None  # this protocol never ends a session by itself
        self._out: list[str | bytes] = []
        self._inputs: list[SessionInput] = []
        self._event_ids = itertools.count(1)
        self._decoder = InputDecoder(self.settings.input_format)
        self._opus_decoder: InputDecoder | None = None
        self._encoder = self._make_encoder()
        self._audio_started = False  # output audio was sent: the voice is now fixed
        self._items = ConversationItems()  # for conversation.item.retrieve / delete
        self.text_limits = text_limits or TextLimits()
        self.tokens = tokens
        self._pending_items: dict[str, Item] = {}  # user audio items waiting for the session to take them
        self._last_item_id: str | None = None
        self._initial_config: dict | None = None

    # ---- outputs ----
    def data_to_send(self) -> list[str | bytes]:
        out, self._out = self._out, []
        return out

    def inputs(self) -> list[SessionInput]:
        """What the client asked of the session since the last call, in order (the runner applies them)."""
        out, self._inputs = self._inputs, []
        return out

    def input_refused(self, error: SessionError, event_id: str | None) -> None:
        self._pending_items.clear()  # a refused user item is not in the conversation
        self._error(error, event_id)

    def _emit(self, event_type: str, **fields) -> None:
        self._out.append(json.dumps({"type": event_type, "event_id": f"event_{next(self._event_ids)}", **fields}, separators=(",", ":")))

    def _error(self, e: ClientError | SessionError, client_event_id: str | None, retry_after_s: float | None = None) -> None:
        error_type = getattr(e, "error_type", "invalid_request_error")  # SessionError: always the client's
        if error_type != "server_error":
            self.client_errors += 1
        error = {"type": error_type, "code": e.code, "message": e.message, "param": e.param, "event_id": client_event_id}
        if retry_after_s is not None:  # as the capacity refusal's error event (server_overloaded)
            error["retry_after_s"] = retry_after_s
        self._emit("error", error=error)

    def error(self, code: str, message: str, retry_after_s: float | None = None, *, error_type: str = "server_error") -> None:
        """A server-side error event (capacity, slow client, idle timeout, overload: with `retry_after_s`)."""
        self._error(ClientError(code, message, None, error_type), None, retry_after_s)

    def open(self) -> None:
        refused: list[ClientError] = []
        if self._initial_config is not None:
            refused, _ = self._apply_update(self._initial_config, None)
        self._emit("session.created", session=self._session_object(), **(self._resume_fields() if self.extensions else {}))
        if refused:
            self._error(_one_error(refused), None)
        self._send_notices(None)

    def _resume_fields(self) -> dict:
        return {} if self.resume is None else {"resume_token": self.resume.token, "resume_grace_s": self.resume.grace_s}

    @property
    def tracing(self) -> TracingConfig | None:
        """The client's session.tracing: the runner records the session's spans while it is on."""
        return self.settings.tracing

    @property
    def model(self) -> str:
        return self.settings.model

    @property
    def resumable(self) -> bool:
        """The client was given a resume token: a lost connection is worth keeping the session for."""
        return self.resume is not None and self.extensions

    def playback_stopped(self, response_id: str) -> None:
        """Out of band: the transport has played all of this answer's audio."""
        self._emit("output_audio_buffer.stopped", response_id=response_id)

    def resumed_message(self, last_seq: int, replayed: int, missed: int) -> str:
        """`session.resumed`, the first message on a resumed connection. It is outside the numbered
        stream (the runner sends it before the replay; clients do not count it)."""
        return json.dumps({"type": "session.resumed", "event_id": f"event_{next(self._event_ids)}", "session": self._session_object(),
                           "last_seq": last_seq, "replayed": replayed, "missed": missed}, separators=(",", ":"))

    def engine_options(self, output_modalities: tuple[str, ...] | None = None,
                       max_output_tokens: int | str | None = None) -> ConversationOptions:
        """The session's options, or one answer's: its own output modalities and max_output_tokens (response.create)."""
        settings = replace(self.settings, instructions=self._instructions())
        if max_output_tokens is not None:
            settings = replace(settings, max_output_tokens=max_output_tokens)
        return settings.answer_options(output_modalities)

    def take_engine_options(self) -> ConversationOptions | None:
        if not self.settings_changed:
            return None
        self.settings_changed = False
        return self.engine_options()

    # ---- client input ----
    def receive(self, message: str | bytes, now: float) -> None:
        if isinstance(message, bytes):
            self.receive_binary(message, now)
        else:
            self.receive_text(message, now)

    def receive_audio(self, pcm, now: float) -> None:
        """Audio the transport decoded itself (WebRTC's track), int16 at 16 kHz."""
        self._inputs.append(AudioIn(pcm))

    def receive_text(self, text: str, now: float) -> None:
        event_id = None
        try:
            try:
                ev = client_json.loads(text)
            except client_json.BadJson as e:
                raise ClientError("invalid_json", f"message is not valid JSON: {e}") from None
            if not isinstance(ev, dict):
                raise ClientError("invalid_json", "an event must be a JSON object")
            event_id = ev.get("event_id") if isinstance(ev.get("event_id"), str) else None
            kind = _get(ev, "type", str, required=True)
            handler = self._HANDLERS.get(kind)
            if handler is None:
                raise ClientError("unknown_event_type", f"unknown or unsupported event type {kind!r}", "type")
            handler(self, ev, now)
        except (ClientError, SessionError) as e:
            self._error(e, event_id)

    def receive_binary(self, data: bytes, now: float) -> None:
        try:
            if not data or data[0] != BINARY_OPUS:
                raise ClientError("invalid_binary_frame", "a binary frame must start with 0x01 followed by one Opus packet")
            if len(data) - 1 > self.limits.max_opus_packet_bytes:
                raise ClientError("invalid_binary_frame", f"Opus packet larger than {self.limits.max_opus_packet_bytes} bytes")
            if self._opus_decoder is None:
                self._opus_decoder = InputDecoder(WireFormat.OPUS)
            try:
                pcm = self._opus_decoder.decode(bytes(data[1:]))
            except AudioFormatError as e:
                raise ClientError("invalid_audio", str(e)) from None
            self._inputs.append(AudioIn(pcm))
        except ClientError as e:
            self._error(e, None)

    def _on_append(self, ev: dict, now: float) -> None:
        audio = _get(ev, "audio", str, required=True)
        if len(audio) * 3 // 4 > self.limits.max_append_bytes:
            raise ClientError("audio_too_large", f"one append may carry at most {self.limits.max_append_bytes} bytes of audio", "audio")
        try:
            payload = base64.b64decode(audio, validate=True)
        except (binascii.Error, ValueError):
            raise ClientError("invalid_base64", "'audio' is not valid base64", "audio") from None
        try:
            pcm = self._decoder.decode(payload)
        except AudioFormatError as e:
            raise ClientError("invalid_audio", f"{e} (input format {self.settings.input_format.value})", "audio") from None
        self._inputs.append(AudioIn(pcm, event_id=_event_id(ev)))

    def _on_commit(self, ev: dict, now: float) -> None:
        if self.turn_detection is None:  # the client ends the turn: its last milliseconds are in it
            tail = self._decoder.flush()
            if tail.size:
                self._inputs.append(AudioIn(tail, client_frame=False, event_id=_event_id(ev)))
        self._inputs.append(CommitInput(_event_id(ev)))

    def _on_clear(self, ev: dict, now: float) -> None:
        self._inputs.append(ClearInput(_event_id(ev)))

    def _on_response_create(self, ev: dict, now: float) -> None:
        req = parse_response_request(_get(ev, "response", dict), self._instructions(), self.settings.voice, self.settings.temperature,
                                     self.text_model)
        if req.instructions is not None:
            self._check_system_text(req.instructions, "response.instructions", now)
        own = req.output_modalities if req.output_modalities not in (None, self.settings.output_modalities) else None
        system = None if req.instructions is None else self._instructions(req.instructions)  # this answer's system text
        tokens = req.max_output_tokens if req.max_output_tokens != self.settings.max_output_tokens else None
        self.offered_tools |= bool(req.tools)
        self._inputs.append(CreateResponse(_event_id(ev), req.metadata, own, system, tokens))
        self._notices.extend(req.notices)
        self._send_notices(_event_id(ev))

    # ---- conversation items ----
    def _on_item_create(self, ev: dict, now: float) -> None:
        limits = self.text_limits
        if (held := len(self._items) + len(self._pending_items)) >= limits.max_items:
            raise ClientError("conversation_limit_exceeded", f"the conversation holds {held} items, the most a session may "
                                                             f"(limits.text.max_items); delete items first", "item")
        new = parse_new_item(ev, self.settings.input_format, new_id, self.text_model, limits)
        if new.item.id in self._items or new.item.id in self._pending_items:
            raise ClientError("item_create_duplicate_item_id", f"an item with id {new.item.id!r} already exists", "item.id")
        self._check_item_text(new.item, new.user_text, now)
        if new.user_turn:  # audio or typed text: the session adds it (or refuses it: a turn or answer in progress)
            self._pending_items[new.item.id] = new.item
            self._inputs.append(AddUserItem(new.item.id, new.audio, new.user_text, _event_id(ev)))
            return
        self._items.put(new.item)  # system messages, assistant text: kept here (the engine takes user turns only)
        if new.item.role == "system":
            self.settings_changed = True  # its text joins the instructions
        prev = new.previous_item_id or self._last_item_id
        self._last_item_id = new.item.id
        self._emit("conversation.item.added", previous_item_id=prev, item=new.item.wire())
        self._emit("conversation.item.done", previous_item_id=prev, item=new.item.wire())

    def _on_item_retrieve(self, ev: dict, now: float) -> None:
        item = self._items.get(_get(ev, "item_id", str, required=True))
        self._emit("conversation.item.retrieved", item=item.wire())

    def _on_item_delete(self, ev: dict, now: float) -> None:
        item_id = _get(ev, "item_id", str, required=True)
        if self._items.get(item_id, "item_delete_invalid_item_id").in_engine:  # an audio turn: the session takes it out of the model's history
            self._inputs.append(DeleteItem(item_id, _event_id(ev)))
            return
        item = self._items.delete(item_id)
        if item.role == "system":
            self.settings_changed = True
        self._emit("conversation.item.deleted", item_id=item.id)

    def _check_item_text(self, item: Item, user_text: str, now: float) -> None:
        """A new item's text within the session's totals and, when the model reads it, the model's context
        (a system message's token count is kept on the item: each is counted once)."""
        limits = self.text_limits
        total = self._items.text_bytes + sum(i.text_bytes for i in self._pending_items.values()) + item.text_bytes
        if total > limits.max_conversation_text_bytes:
            raise over_total("item", "the text of the conversation's items", total, limits.max_conversation_text_bytes,
                             "max_conversation_text_bytes")
        if item.role == "system" and item.text_bytes:
            system = self._instructions_size()[0] + self._items.system_bytes + item.text_bytes + 1
            if system > limits.max_system_text_bytes:
                raise over_total("item", "the system text (instructions and system messages)", system,
                                 limits.max_system_text_bytes, "max_system_text_bytes")
            if self.tokens is not None:
                item.system_tokens = self.tokens.tokens(item.text(), now, "item")
                n = self._instructions_size()[1] + self._items.system_tokens + item.system_tokens + 1
                if n > (limit := self.tokens.budget.system_tokens):
                    raise context_exceeded("item", "the system text (instructions and system messages)", n, limit, self.tokens.budget)
        if user_text and self.tokens is not None:
            if (n := self.tokens.tokens(user_text, now, "item.content")) > (limit := self.tokens.budget.user_text_tokens):
                raise context_exceeded("item.content", "the typed user turn", n, limit, self.tokens.budget)

    def _check_system_text(self, instructions: str, param: str, now: float | None) -> None:
        """Instructions (the session's, or one response's) within their bound and, with the system messages,
        within the system text's bound and the model's share of its context for it. `now`: when the client
        sent them (None: a config given with the connection, not taken from the tokenizing budget)."""
        limits = self.text_limits
        size = check_string(instructions, param, limits, "max_instructions_bytes")
        if (system := size + self._items.system_bytes) > limits.max_system_text_bytes:
            raise over_total(param, "the system text (instructions and system messages)", system, limits.max_system_text_bytes,
                             "max_system_text_bytes")
        if self.tokens is not None:
            n = self.tokens.tokens(instructions, now, param) + self._items.system_tokens
            if n > (limit := self.tokens.budget.system_tokens):
                raise context_exceeded(param, "the system text (instructions and system messages)", n, limit, self.tokens.budget)

    def _instructions_size(self) -> tuple[int, int]:
        """The session's instructions in bytes and (with a token meter) tokens."""
        text = self.settings.instructions
        return len(text.encode("utf-8", "surrogatepass")), 0 if self.tokens is None else self.tokens.tokens(text)

    def _instructions(self, own: str | None = None) -> str:
        """The session's instructions (`own`: one answer's, in their place) with the system messages' text after them."""
        return "\n".join(t for t in (self.settings.instructions if own is None else own, self._items.system_text()) if t)

    def _on_response_cancel(self, ev: dict, now: float) -> None:
        self._inputs.append(CancelRequested(_get(ev, "response_id", str), _event_id(ev)))

    def _on_truncate(self, ev: dict, now: float) -> None:
        item_id = _get(ev, "item_id", str, required=True)
        content_index = _get(ev, "content_index", int)
        if content_index not in (None, 0):
            raise ClientError("invalid_value", "content_index must be 0", "content_index")
        audio_end_ms = _number(ev, "audio_end_ms", 0, _MAX_MS, required=True) or 0  # (required: never None)
        self._inputs.append(TruncateItem(item_id, float(audio_end_ms), _event_id(ev)))

    def _on_output_clear(self, ev: dict, now: float) -> None:
        self._inputs.append(ClearOutput(_event_id(ev)))

    def _on_played(self, ev: dict, now: float) -> None:
        played_ms = _number(ev, "played_ms", 0, _MAX_MS, required=True) or 0  # (required: never None)
        underruns = int(_number(ev, "underruns", 0, 1_000_000, integer=True) or 0)
        self._inputs.append(Played(float(played_ms), underruns, _get(ev, "response_id", str), _event_id(ev)))

    def _on_session_update(self, ev: dict, now: float) -> None:
        cfg = _get(ev, "session", dict, required=True)
        refused, opted_in_now = self._apply_update(cfg, _event_id(ev), now)
        if refused:  # one error naming every refused field (bad input gets one error); the valid fields still apply
            self._error(_one_error(refused), _event_id(ev))
        # A client that opts in after session.created learns its resume token here.
        self._emit("session.updated", session=self._session_object(), **(self._resume_fields() if opted_in_now else {}))
        self._send_notices(_event_id(ev))

    def _send_notices(self, event_id: str | None) -> None:
        """duplex.notice (ours): each field just accepted as a hint, for clients that opted in to our additions."""
        notices, self._notices = self._notices, []
        if self.extensions:
            for n in notices:
                self._emit("duplex.notice", notice={"param": n.param, "message": n.message, "event_id": event_id})

    def preconfigure(self, cfg: dict) -> None:
        """A session config given with the connection (WebRTC's `calls.create(session=...)`): applied like a
        session.update when the session opens; session.created shows it, its refused fields follow as errors."""
        self._initial_config = cfg

    def _apply_update(self, cfg: dict, event_id: str | None, now: float | None = None) -> tuple[list[ClientError], bool]:
        upd = parse_session_update(cfg, self.settings, self.turn_detection, self._audio_started, self.text_model)
        if "instructions" in upd.changes:  # bounded before it is tokenized (or copied into the engine's options)
            try:
                self._check_system_text(upd.changes["instructions"], "session.instructions", now)
            except ClientError as e:
                del upd.changes["instructions"]
                upd.refused.append(e)
        self._notices.extend(upd.notices)
        self.offered_tools |= bool(upd.changes.get("tools"))
        opted_in_now = upd.opted_in and not self.extensions
        self.extensions |= upd.opted_in
        if upd.turn_detection_changed:
            self.turn_detection, self._turn_detection_wire = upd.turn_detection, upd.turn_detection_wire
            self._inputs.append(SetTurnDetection(upd.turn_detection, event_id))
        s = replace(self.settings, **upd.changes)
        if s.input_format != self.settings.input_format:
            self._decoder = InputDecoder(s.input_format)
        if s.noise_reduction != self.settings.noise_reduction:  # the gateway's own: the session suppresses, not the engine
            self._inputs.append(SetNoiseReduction(s.noise_reduction, event_id))
        self.settings_changed |= any(getattr(s, k) != getattr(self.settings, k) for k in _ENGINE_KEYS)
        output_changed = s.output_format != self.settings.output_format
        self.settings = s
        if output_changed:
            self._encoder = self._make_encoder()
        return upd.refused, opted_in_now

    # ---- session events -> server events ----
    def send_session_events(self, events: list[SessionEvent]) -> None:
        for ev in events:
            self._SENDERS[type(ev)](self, ev)

    def _make_encoder(self) -> OutputEncoder | _NoWireAudio:
        if self.audio_out_of_band:
            return _NoWireAudio()
        return OutputEncoder(self.settings.output_format, frame_ms=self.frame_ms,
                             opus_bitrate=self.opus.bitrate, opus_complexity=self.opus.complexity)

    def _send_speech_started(self, ev: SpeechStarted) -> None:
        self._emit("input_audio_buffer.speech_started", audio_start_ms=int(ev.audio_start_ms), item_id=ev.item_id)

    def _send_speech_stopped(self, ev: SpeechStopped) -> None:
        self._emit("input_audio_buffer.speech_stopped", audio_end_ms=int(ev.audio_end_ms), item_id=ev.item_id)

    def _send_committed(self, ev: InputCommitted) -> None:
        self._emit("input_audio_buffer.committed", previous_item_id=ev.previous_item_id, item_id=ev.item_id)
        item = Item(ev.item_id, "user", [{"type": "input_audio", "transcript": None}], in_engine=True)
        self._add_item(item, ev.previous_item_id)

    def _send_user_item(self, ev: UserItemAdded) -> None:
        self._add_item(self._pending_items.pop(ev.item_id), ev.previous_item_id)

    def _add_item(self, item: Item, previous_item_id: str | None) -> None:
        self._items.put(item)
        self._last_item_id = item.id
        self._emit("conversation.item.added", previous_item_id=previous_item_id, item=item.wire())
        self._emit("conversation.item.done", previous_item_id=previous_item_id, item=item.wire())

    def _send_cleared(self, ev: InputCleared) -> None:
        self._emit("input_audio_buffer.cleared")

    def _send_response_created(self, ev: ResponseCreated) -> None:
        self._encoder.reset()
        text = (ev.output_modalities or self.settings.output_modalities) == ("text",)
        if text:
            self._text_answers.add(ev.response_id)
        self._emit("response.created", response=self._response_object(ev.response_id, "in_progress", None, [], ev.metadata),
                   **self._ours(epoch=ev.epoch))
        item = self._assistant_item(ev.item_id, "in_progress", "", text)
        self._items.put(Item(ev.item_id, "assistant", item["content"], in_engine=True, status="in_progress"))
        self._last_item_id = ev.item_id
        self._emit("response.output_item.added", response_id=ev.response_id, output_index=0, item=item)
        self._emit("conversation.item.added", previous_item_id=None, item=item)
        self._emit("response.content_part.added", response_id=ev.response_id, item_id=ev.item_id, output_index=0,
                   content_index=0, part=_part(text, ""))

    def _send_audio(self, ev: ResponseAudio) -> None:
        self._audio_started = True
        if self.audio_out_of_band and self._audio_started_for != ev.response_id:
            self._audio_started_for = ev.response_id
            self._emit("output_audio_buffer.started", response_id=ev.response_id)
        if self.extensions and (ev.ttfa_ms is not None or ev.start_ms == 0):
            self._emit("duplex.latency", response_id=ev.response_id, epoch=ev.epoch, mark="first_audio",
                       ttfa_ms=None if ev.ttfa_ms is None else round(ev.ttfa_ms, 1),
                       after_confirm_ms=None if ev.after_confirm_ms is None else round(ev.after_confirm_ms, 1))
        self._send_frames(ev.response_id, ev.item_id, ev.epoch, self._encoder.encode(ev.pcm))

    def _send_frames(self, response_id: str, item_id: str, epoch: int, frames: list[bytes]) -> None:
        if self.settings.output_format is WireFormat.OPUS:
            head = bytes([BINARY_OPUS]) + _EPOCH.pack(epoch & 0xFFFFFFFF)
            self._out.extend(head + f for f in frames)
            return
        for f in frames:
            self._emit("response.output_audio.delta", response_id=response_id, item_id=item_id, output_index=0,
                       content_index=0, delta=base64.b64encode(f).decode("ascii"), **self._ours(epoch=epoch))

    def _send_text(self, ev: ResponseText) -> None:
        kind = "response.output_text.delta" if ev.response_id in self._text_answers else "response.output_audio_transcript.delta"
        self._emit(kind, response_id=ev.response_id, item_id=ev.item_id, output_index=0, content_index=0, delta=ev.delta)

    def _send_transcript_delta(self, ev: InputTranscriptDelta) -> None:
        self._emit("conversation.item.input_audio_transcription.delta", item_id=ev.item_id,
                   content_index=self._audio_part(ev.item_id), delta=ev.delta)

    def _send_transcript_done(self, ev: InputTranscriptDone) -> None:
        index = self._audio_part(ev.item_id)
        if ev.item_id in self._items:  # conversation.item.retrieve shows it from now on
            self._items.get(ev.item_id).content[index]["transcript"] = ev.transcript
        # usage: the audio the model heard (no tokens are billed here)
        self._emit("conversation.item.input_audio_transcription.completed", item_id=ev.item_id, content_index=index,
                   transcript=ev.transcript, usage={"type": "duration", "seconds": round(ev.audio_ms / 1000.0, 3)})

    def _send_transcript_failed(self, ev: InputTranscriptFailed) -> None:
        self._emit("conversation.item.input_audio_transcription.failed", item_id=ev.item_id,
                   content_index=self._audio_part(ev.item_id),
                   error={"type": "server_error", "code": ev.code, "message": ev.message, "param": None})

    def _audio_part(self, item_id: str) -> int:
        """The index of the item's (last) input_audio part: what its transcript belongs to."""
        if item_id not in self._items:
            return 0
        content = self._items.get(item_id).content
        return max((i for i, c in enumerate(content) if c.get("type") == "input_audio"), default=0)

    def _send_output_cleared(self, ev: OutputCleared) -> None:
        self._encoder.reset()
        self._emit("output_audio_buffer.cleared", response_id=ev.response_id)

    def _send_truncated(self, ev: ItemTruncated) -> None:
        self._emit("conversation.item.truncated", item_id=ev.item_id, content_index=0, audio_end_ms=int(ev.audio_end_ms))

    def _send_deleted(self, ev: ItemDeleted) -> None:
        self._items.forget(ev.item_id)
        self._emit("conversation.item.deleted", item_id=ev.item_id)

    def _send_done(self, ev: ResponseDone) -> None:
        status = {ResponseStatus.COMPLETED: "completed", ResponseStatus.CANCELLED: "cancelled", ResponseStatus.FAILED: "failed"}[ev.status]
        text = ev.response_id in self._text_answers
        self._text_answers.discard(ev.response_id)
        ids = {"response_id": ev.response_id, "item_id": ev.item_id, "output_index": 0, "content_index": 0}
        if ev.status is ResponseStatus.COMPLETED and text:
            self._emit("response.output_text.done", **ids, text=ev.transcript)
        elif ev.status is ResponseStatus.COMPLETED:
            self._send_frames(ev.response_id, ev.item_id, ev.epoch, self._encoder.flush())
            self._emit("response.output_audio.done", **ids)
            self._emit("response.output_audio_transcript.done", **ids, transcript=ev.transcript)
        if ev.status is ResponseStatus.COMPLETED:
            self._emit("response.content_part.done", **ids, part=_part(text, ev.transcript))
        item_status = "completed" if ev.status is ResponseStatus.COMPLETED else "incomplete"
        item = self._assistant_item(ev.item_id, item_status, ev.transcript, text)
        self._items.put(Item(ev.item_id, "assistant", item["content"], in_engine=True, status=item_status))
        self._emit("response.output_item.done", response_id=ev.response_id, output_index=0, item=item)
        self._emit("conversation.item.done", previous_item_id=None, item=item)
        details = None if ev.reason is None else {"type": status, "reason": ev.reason}
        resp = self._response_object(ev.response_id, status, details, [item], ev.metadata, text)
        if self.extensions:
            resp["duplex"] = {"epoch": ev.epoch, "audio_ms": round(ev.audio_ms, 1), "played_ms": round(ev.played_ms, 1),
                              "ttfa_ms": None if ev.ttfa_ms is None else round(ev.ttfa_ms, 1),
                              "after_confirm_ms": None if ev.after_confirm_ms is None else round(ev.after_confirm_ms, 1)}
        self._emit("response.done", response=resp)

    # keyed by the event's class; each sender takes an event of its key's class
    _SENDERS: ClassVar[dict[type, Callable[[RealtimeProtocol, Any], None]]] = {
        SpeechStarted: _send_speech_started, SpeechStopped: _send_speech_stopped, InputCommitted: _send_committed,
        InputCleared: _send_cleared, UserItemAdded: _send_user_item, ResponseCreated: _send_response_created, ResponseAudio: _send_audio,
        ResponseText: _send_text, OutputCleared: _send_output_cleared, ItemTruncated: _send_truncated, ItemDeleted: _send_deleted,
        ResponseDone: _send_done, InputTranscriptDelta: _send_transcript_delta, InputTranscriptDone: _send_transcript_done,
        InputTranscriptFailed: _send_transcript_failed,
    }
    _HANDLERS = {
        "session.update": _on_session_update,
        "input_audio_buffer.append": _on_append,
        "input_audio_buffer.commit": _on_commit,
        "input_audio_buffer.clear": _on_clear,
        "response.create": _on_response_create,
        "response.cancel": _on_response_cancel,
        "conversation.item.truncate": _on_truncate,
        "conversation.item.create": _on_item_create,
        "conversation.item.retrieve": _on_item_retrieve,
        "conversation.item.delete": _on_item_delete,
        "output_audio_buffer.clear": _on_output_clear,
        "output_audio_buffer.played": _on_played,
    }

    # ---- wire objects ----
    def _session_object(self) -> dict:
        s = self.settings
        obj = {
            "type": "realtime", "object": "realtime.session", "id": self.session_id, "model": s.model,
            "output_modalities": list(s.output_modalities), "instructions": s.instructions,
            "audio": {"input": {"format": s.input_format.to_wire(), "transcription": s.transcription,
                                "noise_reduction": None if s.noise_reduction is None else {"type": s.noise_reduction},
                                "turn_detection": echo_turn_detection(self.turn_detection, self._turn_detection_wire, self.extensions)},
                      "output": {"format": s.output_format.to_wire(), "voice": s.voice, "speed": 1.0}},
            "tools": [dict(t) for t in s.tools], "tool_choice": s.tool_choice, "max_output_tokens": s.effective_max_output_tokens(),
            "truncation": self._truncation_wire(),
            "tracing": None if s.tracing is None else s.tracing.wire(),
            "prompt": None, "include": None,
        }
        if self.extensions:
            obj["duplex"] = {"top_k": s.top_k, "top_p": s.top_p, "seed": s.seed, "cfg_scale": s.cfg_scale,
                             "temperature": s.temperature, "max_response_ms": s.max_response_ms,
                             "lead_ms": self.lead_ms, "binary_opus": True, "voices": ["default", *s.voice_pcm],
                             # the model reads and writes text (transcription, text answers, typed turns);
                             # audio answers carry the model's text (the server's session.assistant_text)
                             "text": self.text_model, "assistant_text": s.assistant_text}
        return obj

    def _truncation_wire(self) -> str | dict:
        s = self.settings
        if s.truncation == "retention_ratio":
            return {"type": "retention_ratio", "retention_ratio": s.retention_ratio}
        return s.truncation

    @staticmethod
    def _assistant_item(item_id: str, status: str, transcript: str, text: bool = False) -> dict:
        content = {"type": "output_text", "text": transcript} if text else {"type": "output_audio", "transcript": transcript}
        return {"id": item_id, "object": "realtime.item", "type": "message", "status": status, "role": "assistant",
                "content": [content]}

    def _ours(self, **fields) -> dict:
        """Fields of ours on a standard event: only for clients that opted in (strict clients reject them)."""
        return fields if self.extensions else {}

    def _response_object(self, response_id: str, status: str, details: dict | None, output: list, metadata: dict | None = None,
                         text: bool | None = None) -> dict:
        text = response_id in self._text_answers if text is None else text
        return {"id": response_id, "object": "realtime.response", "status": status, "status_details": details,
                "output": output, "output_modalities": ["text" if text else "audio"], "conversation_id": self.session_id,
                "audio": {"output": {"format": self.settings.output_format.to_wire(), "voice": self.settings.voice}},
                "usage": None, "metadata": metadata}


class _NoWireAudio:
    """The output encoder of a protocol whose audio never travels in events."""

    def encode(self, pcm) -> list[bytes]:
        return []

    def flush(self) -> list[bytes]:
        return []

    def reset(self) -> None:
        pass


def _part(text: bool, content: str) -> dict:
    """The content part of response.content_part.added/done: the SDK's Part types them "text" and "audio"
    (the item's content says output_text / output_audio)."""
    return {"type": "text", "text": content} if text else {"type": "audio", "transcript": content}


def _one_error(errors: list[ClientError]) -> ClientError:
    """Several refused fields as one error: the first's code and param, every field named in the message."""
    if len(errors) == 1:
        return errors[0]
    first = errors[0]
    return ClientError(first.code, f"{len(errors)} fields refused (the others applied): " + "; ".join(e.message for e in errors),
                       first.param)


def _event_id(ev: dict) -> str | None:
    return ev.get("event_id") if isinstance(ev.get("event_id"), str) else None
