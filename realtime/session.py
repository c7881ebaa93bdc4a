"""One conversation's turn-taking, transport-agnostic and sans-I/O (docs/architecture.md, "The session").

Inputs arrive through `receive_*()` methods, always with the monotonic time `now` passed in; the
caller drains two outputs:

- `events()`: `SessionEvent`s for the transport to put on its wire (speech started/stopped, audio
  frames when they are due, response done, ...);
- `commands()`: `EngineCommand`s for the shell to run against the engine conversation
  (push audio, end the user turn, start/cancel a response).

Speculative response (VAD mode): when the user's speech pauses (`VadParams.speculate_after_ms` of
silence) the answer is started at once, but nothing of it reaches `events()`: its audio is held.
If the silence lasts to `silence_duration_ms`, the turn is confirmed and the answer goes out as any
other, its held audio first; if the user speaks again first, it is discarded (the engine takes it
back) and the turn goes on. The user's turn as the engine hears it ends at the pause either way: the
rest of the end-of-turn silence is held, and pushed only if the turn goes on.

Audio in and out is mono int16 at 16 kHz (the engine's rate); transports convert at the edge. With
`noise_reduction` on, user audio passes the session's noise suppressor first, so the VAD and the
engine both get the suppressed audio (realtime/noise_suppression.py).
Output audio is released by `poll_audio(now)` on the pacer's absolute schedule, so the session knows
what was sent and, from acknowledgements or the schedule, what was played (the playback cursor).

A client mistake raises `SessionError` (code, message, param); the session stays usable.
"""

from __future__ import annotations

import itertools
import secrets
from collections import deque
from dataclasses import dataclass, field
from enum import IntEnum

import numpy as np

from engine.service_api import SAMPLE_RATE_HZ, Role

from realtime.noise_suppression import NoiseSuppressor
from realtime.pacing import Pacer
from realtime.user_transcript import InputTranscriptDelta, InputTranscriptDone, InputTranscriptFailed, UserTranscript
from realtime.vad import ServerVad, SileroVad, VadParams, run_silero

RATE_HZ = SAMPLE_RATE_HZ  # the engine-side rate: user audio in, the answer out


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


# --- state ---------------------------------------------------------------------------------------


@dataclass
class SessionLimits:
    output_frame_ms: int = 40  # pacing granularity (transports with fixed frames pass theirs)
    lead_ms: float = 150.0  # audio sent ahead of real time
    max_turn_ms: float = 60_000.0  # a client-committed turn may hold at most this much audio
    max_response_buffer_ms: float = 120_000.0  # engine audio waiting for the pacer
    acked_playback: bool = False  # the transport acknowledges every played millisecond (Twilio marks): until it does, nothing has played


@dataclass
class Response:
    id: str
    item_id: str
    epoch: int
    status: ResponseStatus = ResponseStatus.IN_PROGRESS
    pending: deque = field(default_factory=deque)  # int16 arrays from the engine, not yet released
    pending_samples: int = 0
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
    user_transcript: UserTranscript = field(default_factory=UserTranscript)  # the user turn's, as the model writes it
    deadline_shift_s: float = 0.0  # a confirmed speculation plays from its confirmation, not its first chunk: the engine's deadlines move


@dataclass
class SessionStats:
    responses: int = 0
    barge_ins: int = 0
    underruns_reported: int = 0
    chunks: int = 0  # engine chunks received for the responses sent
    chunks_late: int = 0  # received after their playback deadline
    chunks_gap: int = 0  # so late that the lead the client holds ran out: a gap it hears (admission control's signal)
    input_frames: int = 0  # audio frames (messages, RTP frames) the session consumed
    ttfa_ms: list = field(default_factory=list)
    speculative_confirmed: int = 0
    speculative_discarded: int = 0
    exchanges_dropped: int = 0  # told to the client (conversation.item.deleted) after context management dropped them


_ids = itertools.count(1)


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(6)}{next(_ids):04x}"


class Session:
    def __init__(self, session_id: str | None = None, vad: VadParams | None = VadParams(), limits: SessionLimits | None = None,
                 vad_deferred: bool = False, noise_reduction: str | None = None) -> None:
        """`vad_deferred`: user audio waits for its speech probabilities until `settle_vad()` (the shell
        runs many sessions' VAD windows as one batch, then settles each); else they are computed at once.
        `noise_reduction`: "near_field" / "far_field" (realtime/noise_suppression.py) or None (off)."""
        self.id = session_id or new_id("sess")
        self._denoiser: NoiseSuppressor | None = None  # user audio passes it before the VAD and the engine
        self.set_noise_reduction(noise_reduction)
        self.vad_deferred = vad_deferred
        self._awaiting_vad: list[tuple[np.ndarray, float]] = []  # (pcm, arrival time), in order
        self.limits = limits or SessionLimits()
        self.vad_params = vad
        self.stats = SessionStats()
        self._silero: SileroVad | None = None
        self._vad: ServerVad | None = None
        self._events: list = []
        self._commands: list = []
        self._input_samples = 0  # total user audio received: the input timeline
        self._turn: list[np.ndarray] = []  # manual mode: the uncommitted buffer
        self._turn_samples = 0
        self._recent: deque = deque()  # VAD mode, not speaking: recent audio for prefix padding
        self._recent_samples = 0
        self._pushed_samples = 0  # audio of the current user turn already sent to the engine
        self._paused = False  # VAD mode: the user's speech paused (speculate_after_ms): audio is held
        self._held: list[np.ndarray] = []  # audio since the pause: pushed if the turn goes on, else not
        self.speculation: Response | None = None  # the answer started at the pause, not confirmed yet
        self._discarded: set[str] = set()  # speculations taken back: the engine restored what they dropped
        self._user_item: str | None = None  # the user item being spoken / buffered
        self._turn_audio_item: str | None = None  # the last audio item since the last response: its transcript's
        self._turn_audio_samples = 0  # the user audio of the items since the last response
        self._last_item: str | None = None
        self._speech_end_time: float | None = None  # monotonic end of the last committed user speech
        self._epoch = 0
        self.response: Response | None = None
        self._assistant_items: dict[str, Response] = {}
        self._turn_items: list[str] = []  # user items committed since the last response
        self._exchange_items: dict[str, list[str]] = {}  # response id -> the items of its exchange
        self._deleted_items: set[str] = set()  # dropped from the history (context management)
        self._pacer = Pacer(RATE_HZ, self.limits.lead_ms)
        self.set_turn_detection(vad)

    # ---- outputs ----
    def events(self) -> list:
        out, self._events = self._events, []
        return out

    def commands(self) -> list:
        out, self._commands = self._commands, []
        return out

    def response_statuses(self) -> list[ResponseStatus]:
        """The status of every response of this session, oldest first."""
        return [r.status for r in self._assistant_items.values()]

    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def input_ms(self) -> float:
        return 1000.0 * self._input_samples / RATE_HZ

    @property
    def vad_enabled(self) -> bool:
        return self.vad_params is not None

    def vad_stream(self) -> SileroVad | None:
        """The stream's Silero state, for a shell that batches `run_silero` over many sessions."""
        return self._silero

    @property
    def vad_pending(self) -> bool:
        """User audio is waiting for its speech probabilities (deferred VAD): `settle_vad()` is due."""
        return bool(self._awaiting_vad)

    def settle_vad(self, run: bool = True) -> None:
        """Process the waiting audio, in arrival order: all of it, running what is left of its VAD
        windows here; or with `run=False` (after a batch ran them) only audio whose windows were run."""
        if not self._awaiting_vad:
            return
        if run:
            run_silero([self._silero])
        while self._awaiting_vad and self._silero.can_take(self._awaiting_vad[0][0].size):
            pcm, arrived = self._awaiting_vad.pop(0)
            self._receive_speech_audio(pcm, arrived, self._silero.take(pcm.size))

    # ---- configuration ----
    def set_turn_detection(self, vad: VadParams | None) -> None:
        self.settle_vad()
        if vad is not None:
            vad.validate()
        self._resume_turn()  # the pause was decided under the old parameters
        self.vad_params = vad
        if vad is None:
            self._vad = None
            return
        if self._silero is None:
            self._silero = SileroVad()
        if self._vad is None or not self._vad.speaking:
            self._vad = ServerVad(vad, offset_ms=self.input_ms)
            self._silero.reset()
        else:
            self._vad.params = vad

    def set_noise_reduction(self, mode: str | None) -> None:
        """Suppress noise in the user audio from now on ("near_field" / "far_field"), or stop (None).
        A new type starts a fresh suppressor; the few samples the old one held are dropped (< 10 ms)."""
        if mode != (self._denoiser.mode if self._denoiser else None):
            self._denoiser = None if mode is None else NoiseSuppressor(mode)

    @property
    def noise_reduction(self) -> str | None:
        return None if self._denoiser is None else self._denoiser.mode

    # ---- user audio ----
    def receive_audio(self, pcm: np.ndarray, now: float, client_frame: bool = True) -> None:
        """User audio (int16, 16 kHz); `client_frame=False`: audio that is not one of the client's frames
        (a resampler's tail), not counted in `stats.input_frames`. With noise reduction on, what the VAD
        and the engine get is the suppressor's output (whole 10 ms frames: up to 10 ms waits for the next call)."""
        self.stats.input_frames += client_frame
        if self._denoiser is not None:
            pcm = self._denoiser.process(pcm)
        if pcm.size == 0:
            return
        if self._vad is None:
            if 1000.0 * (self._turn_samples + pcm.size) / RATE_HZ > self.limits.max_turn_ms:
                raise SessionError("input_audio_buffer_full", f"the input buffer holds at most {self.limits.max_turn_ms:.0f} ms; commit or clear it")
            self._turn.append(pcm)
            self._turn_samples += pcm.size
            self._input_samples += pcm.size
            return
        if self.vad_deferred:
            self._silero.feed(pcm)
            self._awaiting_vad.append((pcm, now))
            return
        self._receive_speech_audio(pcm, now, self._silero.process(pcm))

    def _receive_speech_audio(self, pcm: np.ndarray, now: float, probs: list[float]) -> None:
        """Server-VAD mode: user audio with the speech probabilities of the windows it completed. Each
        piece of it goes where the VAD's state was when it arrived: before an event, the old state."""
        start = self._input_samples
        chunk_end_ms = 1000.0 * (start + pcm.size) / RATE_HZ
        speaking = self._vad.speaking
        pos = 0
        for ev in self._vad.feed(probs):
            at = min(max(int(round(ev.at_ms * RATE_HZ / 1000.0)) - start, pos), pcm.size)
            self._route(pcm[pos:at], speaking)
            pos = at
            if ev.kind == "started":
                speaking = True
                self._on_speech_started(ev.audio_ms, now)
            elif ev.kind == "paused":
                self._on_paused(now)
            elif ev.kind == "resumed":
                self._resume_turn()
            else:
                speaking = False
                self._on_speech_stopped(ev.audio_ms, now, lag_ms=chunk_end_ms - ev.audio_ms)
        self._route(pcm[pos:], speaking)

    def _route(self, pcm: np.ndarray, speaking: bool) -> None:
        if not pcm.size:
            return
        self._input_samples += pcm.size  # the input timeline, up to this piece (what `_recent` ends with)
        if not speaking:
            self._remember(pcm)
        elif self._paused:
            self._held.append(pcm)
        else:
            self._push(pcm)

    def receive_commit(self, now: float) -> None:
        self.settle_vad()
        if self._vad is not None and self._vad.speaking:
            self.discard_speculation()
            self._end_pause()
            self._vad.reset(self.input_ms)
            self._commit(now)
            return
        if self._vad is None:
            if self._denoiser is not None and (tail := self._denoiser.flush()).size:  # the turn's last few ms
                self._turn.append(tail)
                self._turn_samples += tail.size
                self._input_samples += tail.size
            if self._turn_samples == 0:
                raise SessionError("input_audio_buffer_commit_empty", f"{COMMIT_EMPTY}: the input audio buffer is empty")
            self._user_item = new_id("item")
            self._push(np.concatenate(self._turn))
            self._turn, self._turn_samples = [], 0
            self._commit(now)
            return
        raise SessionError("input_audio_buffer_commit_empty", f"{COMMIT_EMPTY}: no speech in it to commit (server_vad commits turns itself)")

    def receive_clear(self) -> None:
        self.settle_vad()
        self.discard_speculation()
        self._paused, self._held = False, []
        self._turn, self._turn_samples = [], 0
        self._recent.clear()
        self._recent_samples = 0
        if self._denoiser is not None:
            self._denoiser.drop_held()
        if self._vad is not None:
            self._vad.reset(self.input_ms)
            self._silero.reset()
        # Audio already pushed to the engine for a turn in progress stays there (the engine has no
        # way to retract it); the turn is ended without a response.
        if self._pushed_samples:
            self._commands.append(EndTurn(self._user_item or ""))
            self._pushed_samples = 0
        self._user_item = None
        self._events.append(InputCleared())

    def _remember(self, pcm: np.ndarray) -> None:
        p = self.vad_params
        self._recent.append(pcm)
        self._recent_samples += pcm.size
        keep = int(RATE_HZ * (p.prefix_padding_ms + p.min_speech_ms + 64) / 1000)  # +2 windows of slack
        while self._recent and self._recent_samples - self._recent[0].size >= keep:
            self._recent_samples -= self._recent.popleft().size

    def _push(self, pcm: np.ndarray) -> None:
        self._commands.append(PushAudio(pcm))
        self._pushed_samples += pcm.size

    def _on_speech_started(self, audio_start_ms: float, now: float) -> None:
        # OpenAI's order: speech_started first, then the interrupted answer's cleared / response.done,
        # so a client's own interruption logic still finds that answer in progress.
        self._user_item = new_id("item")
        self._events.append(SpeechStarted(self._user_item, audio_start_ms))
        if self.response is not None and not self.response.status.finished and self.vad_params.interrupt_response:
            self._interrupt("turn_detected", now)
            self.stats.barge_ins += 1
        recent = np.concatenate(self._recent) if self._recent else np.zeros(0, np.int16)
        start_sample = int(audio_start_ms * RATE_HZ / 1000) - (self._input_samples - recent.size)
        self._push(recent[max(0, start_sample):])
        self._recent.clear()
        self._recent_samples = 0

    def _on_speech_stopped(self, audio_end_ms: float, now: float, lag_ms: float) -> None:
        self._events.append(SpeechStopped(self._user_item or "", audio_end_ms))
        self._end_pause()
        spec = self.speculation
        self._commit(now - max(0.0, lag_ms) / 1000.0, end_turn=spec is None)  # a speculation ended it at the pause
        if spec is not None:
            self._confirm(spec, now)
        elif self.vad_params.create_response and (self.response is None or self.response.status.finished):
            self.receive_response_create(now)

    def _on_paused(self, now: float) -> None:
        """The user's speech paused: their turn (as the engine hears it) ends here unless it goes on;
        start the answer now, unseen, so that it is ready if the silence does end the turn."""
        self._paused = True
        p = self.vad_params
        if (not p.speculative or not p.create_response or self.speculation is not None
                or (self.response is not None and not self.response.status.finished)):
            return
        r = Response(id=new_id("resp"), item_id=new_id("item"), epoch=self._epoch, speculative=True)
        self.speculation = r
        self._commands.append(StartResponse(r.id, speculative=True))

    def _resume_turn(self) -> None:
        """The user's turn goes on after a pause: a speculative answer is discarded, the held audio joins the turn."""
        self.discard_speculation()
        held, self._paused, self._held = self._held, False, []
        if held:
            self._push(np.concatenate(held))

    def _end_pause(self) -> None:
        """The turn ended: the audio held since the pause is not part of it (it is silence before what comes next)."""
        for pcm in self._held:
            self._remember(pcm)
        self._paused, self._held = False, []

    def discard_speculation(self) -> None:
        """Take back the speculative answer, if one runs: the engine forgets it, the client never knew of it."""
        r, self.speculation = self.speculation, None
        if r is not None:
            self._discarded.add(r.id)
            self._commands.append(DiscardResponse(r.id))
            self.stats.speculative_discarded += 1

    def _confirm(self, r: Response, now: float) -> None:
        """The silence ended the turn: the speculative answer becomes the response, its held audio paced out from now."""
        self.speculation = None
        r.speculative, r.epoch, r.confirmed_at = False, self._epoch, now
        if r.first_chunk_at is not None:  # the engine timed its deadlines from its first chunk; playback starts now
            r.deadline_shift_s = max(0.0, now - r.first_chunk_at)
        self._commands.append(ConfirmResponse(r.id))
        self.stats.speculative_confirmed += 1
        self._begin(r)
        if r.dropped:
            self.receive_history_dropped(r.dropped)

    def _commit(self, speech_end_time: float, end_turn: bool = True) -> None:
        item = self._user_item or new_id("item")
        if end_turn:
            self._commands.append(EndTurn(item))
        self._turn_items.append(item)
        self._turn_audio_item = item
        self._turn_audio_samples += self._pushed_samples
        self._events.append(InputCommitted(item, self._last_item))
        self._last_item, self._user_item, self._pushed_samples = item, None, 0
        self._speech_end_time = speech_end_time

    # ---- responses ----
    def receive_user_item(self, item_id: str, pcm: np.ndarray | None, text: str = "") -> None:
        """conversation.item.create of a user message: a whole user turn in the history (its audio, then
        its text), no answer (the client asks for one with response.create)."""
        self.settle_vad()
        if self.response is not None and not self.response.status.finished:
            raise SessionError("conversation_already_has_active_response",
                               f"{ACTIVE_RESPONSE} {self.response.id}. Add the item when it is done", "item")
        if self._pushed_samples or (self._vad is not None and self._vad.speaking):
            raise SessionError("user_turn_in_progress", "the user is speaking: add the item once the turn is committed", "item")
        if pcm is not None and pcm.size:
            self._commands.append(PushAudio(pcm))
            self._turn_audio_item = item_id
            self._turn_audio_samples += pcm.size
        self._commands.append(AddUserText(text) if text else EndTurn(item_id))
        self._turn_items.append(item_id)
        self._events.append(UserItemAdded(item_id, self._last_item))
        self._last_item = item_id

    def receive_response_create(self, now: float, metadata: dict | None = None, output_modalities: tuple[str, ...] | None = None,
                                instructions: str | None = None, max_output_tokens: int | str | None = None) -> str:
        self.settle_vad()
        if self.response is not None and not self.response.status.finished:
            raise SessionError("conversation_already_has_active_response", f"{ACTIVE_RESPONSE} {self.response.id}. "
                                                                           "Wait until the response is finished before creating a new one")
        self.discard_speculation()  # the client asks for an answer now, to the turn as it stands
        r = Response(id=new_id("resp"), item_id=new_id("item"), epoch=self._epoch, metadata=metadata,
                     output_modalities=output_modalities)
        self._commands.append(StartResponse(r.id, output_modalities=output_modalities, instructions=instructions,
                                            max_output_tokens=max_output_tokens))
        self._begin(r)
        return r.id

    def _begin(self, r: Response) -> None:
        """`r` becomes the session's response: announced, in the history, paced out from now."""
        r.turn_end_time = self._speech_end_time
        r.acked_ms = 0.0 if self.limits.acked_playback else None
        self._speech_end_time = None
        self.response = r
        self._assistant_items[r.item_id] = r
        # the engine's history gains one exchange per response: the user turn (what was committed
        # since the last response) and the answer; it drops them together
        self._exchange_items[r.id], self._turn_items = [*self._turn_items, r.item_id], []
        r.user_transcript.announce(self._turn_audio_item, 1000.0 * self._turn_audio_samples / RATE_HZ)
        self._turn_audio_item, self._turn_audio_samples = None, 0
        self._pacer.reset()
        self.stats.responses += 1
        self._events.append(ResponseCreated(r.id, r.item_id, r.epoch, r.metadata, r.output_modalities))
        self._last_item = r.item_id
        if r.transcript:  # a speculative answer's text, held until now
            self._events.append(ResponseText(r.id, r.item_id, r.epoch, r.transcript))
        self._events += r.user_transcript.due(self._deleted_items)

    def receive_response_cancel(self, now: float, response_id: str | None = None) -> None:
        r = self.response
        if r is None or r.status.finished:
            raise SessionError("response_cancel_not_active", NO_ACTIVE_RESPONSE)
        if response_id is not None and response_id != r.id:
            raise SessionError("response_cancel_not_active", f"{NO_ACTIVE_RESPONSE} with id {response_id!r}", "response_id")
        self._interrupt("client_cancelled", now)

    def receive_output_clear(self, now: float) -> None:
        """output_audio_buffer.clear: stop playback; cancels the response if one is running."""
        r = self.response
        if r is not None and not r.status.finished:
            self._interrupt("client_cancelled", now)

    def _engine_response(self, response_id: str) -> Response | None:
        """The running response (or the speculative one) the engine's output is for; None for output
        of a finished, cancelled or discarded one, which is never played."""
        for r in (self.response, self.speculation):
            if r is not None and r.id == response_id and not r.status.finished:
                return r
        return None

    def receive_engine_chunk(self, response_id: str, pcm: np.ndarray, text_delta: str, is_last: bool, deadline: float | None, now: float) -> None:
        r = self._engine_response(response_id)
        if r is None:
            return
        # Text comes first and without audio (assistant_text): it has no playback deadline, and the
        # engine's audio deadlines count from its first audio, so only audio chunks are accounted.
        audio = pcm.size > 0
        if audio and r.first_chunk_at is None:
            r.first_chunk_at = now
        if audio and not r.speculative:
            self.stats.chunks += 1
            if deadline is not None and now > deadline + r.deadline_shift_s:
                self.stats.chunks_late += 1
                if now > deadline + r.deadline_shift_s + self.limits.lead_ms / 1000.0:
                    self.stats.chunks_gap += 1
        if text_delta:
            r.transcript += text_delta
            if not r.speculative:
                self._events.append(ResponseText(r.id, r.item_id, r.epoch, text_delta))
        if pcm.size:
            if 1000.0 * (r.pending_samples + pcm.size) / RATE_HZ > self.limits.max_response_buffer_ms:
                pcm = pcm[: max(0, int(self.limits.max_response_buffer_ms * RATE_HZ / 1000) - r.pending_samples)]
            r.pending.append(pcm)
            r.pending_samples += pcm.size
        if is_last:
            r.status = ResponseStatus.GENERATED

    def receive_user_transcript(self, response_id: str, delta: str) -> None:
        """The engine wrote more of the user turn's transcript (transcribe_user) of this response's exchange."""
        if (r := self._announced_or_speculative(response_id)) is not None:
            r.user_transcript.add(delta)
            self._events += r.user_transcript.due(self._deleted_items)

    def receive_user_transcript_end(self, response_id: str, code: str | None = None, message: str = "") -> None:
        """The transcript is complete (`code` None) or failed (`code`, `message`)."""
        if (r := self._announced_or_speculative(response_id)) is not None:
            r.user_transcript.finish(code, message)
            self._events += r.user_transcript.due(self._deleted_items)

    def _announced_or_speculative(self, response_id: str) -> Response | None:
        """A response the client was told of (finished ones too: a transcript may outlast its answer), or
        the undecided speculation; None for a discarded one. The latest are looked at first."""
        if self.speculation is not None and self.speculation.id == response_id:
            return self.speculation
        return next((r for r in reversed(self._assistant_items.values()) if r.id == response_id), None)

    def receive_engine_error(self, response_id: str, now: float) -> bool:
        """The engine failed a response; True when the client is to be told (a speculative answer is
        instead discarded: the confirmed turn gets a plain response, which fails visibly if it must)."""
        r = self._engine_response(response_id)
        if r is None:
            return False
        if r.speculative:
            self.discard_speculation()
            return False
        self._finish(r, ResponseStatus.FAILED, "engine_error", played_ms=self._played_ms(r, now))
        return True

    def poll_audio(self, now: float) -> float | None:
        """Release the frames that are due; returns when the next one is due (None: nothing pending)."""
        r = self.response
        if r is None or r.status.finished:
            return None
        frame = RATE_HZ * self.limits.output_frame_ms // 1000
        while self._pacer.due(now) <= now:
            if r.pending_samples >= frame or (r.status is ResponseStatus.GENERATED and r.pending_samples):
                self._release(r, min(frame, r.pending_samples), now)
            elif r.status is ResponseStatus.GENERATED:
                self._finish(r, ResponseStatus.COMPLETED, None, played_ms=1000.0 * r.sent_samples / RATE_HZ)
                return None
            else:
                return None  # waiting for the engine
        return self._pacer.due(now)

    def _release(self, r: Response, n: int, now: float) -> None:
        parts, got = [], 0
        while got < n:
            head = r.pending[0]
            take = min(n - got, head.size)
            parts.append(head[:take])
            if take == head.size:
                r.pending.popleft()
            else:
                r.pending[0] = head[take:]
            got += take
        r.pending_samples -= n
        pcm = parts[0] if len(parts) == 1 else np.concatenate(parts)
        ttfa = after_confirm = None
        if r.first_audio_time is None:
            r.first_audio_time = now
            if r.turn_end_time is not None:
                ttfa = 1000.0 * (now - r.turn_end_time)
                self.stats.ttfa_ms.append(ttfa)
            if r.confirmed_at is not None:
                after_confirm = 1000.0 * (now - r.confirmed_at)
        self._events.append(ResponseAudio(r.id, r.item_id, r.epoch, pcm, 1000.0 * r.sent_samples / RATE_HZ, ttfa, after_confirm))
        r.sent_samples += n
        self._pacer.on_sent(n, now)

    # ---- playback cursor ----
    def receive_played(self, played_ms: float, underruns: int = 0, response_id: str | None = None) -> None:
        """output_audio_buffer.played: the client has played `played_ms` of the current response."""
        self.stats.underruns_reported += max(0, int(underruns))
        r = self.response
        if r is None or (response_id is not None and response_id != r.id):
            return  # stale: an older response
        r.acked_ms = min(max(0.0, float(played_ms)), 1000.0 * r.sent_samples / RATE_HZ)

    def receive_history_dropped(self, response_ids: tuple[str, ...], for_response: str | None = None) -> None:
        """The engine dropped these responses' exchanges from the conversation to fit its context (to make
        room for `for_response`: a speculative one tells the client once confirmed, a discarded one never)."""
        if self.speculation is not None and self.speculation.id == for_response:
            self.speculation.dropped = response_ids
            return
        if for_response in self._discarded:
            return  # the engine restored them
        self.stats.exchanges_dropped += len(response_ids)
        for rid in response_ids:
            for item_id in self._exchange_items.pop(rid, ()):
                self._deleted_items.add(item_id)
                self._events.append(ItemDeleted(item_id))

    def receive_truncate(self, item_id: str, audio_end_ms: float, now: float) -> None:
        """conversation.item.truncate: any assistant item still in the history keeps `audio_end_ms`."""
        r = None if item_id in self._deleted_items else self._assistant_items.get(item_id)
        if r is None:
            raise SessionError("item_truncate_invalid_item_id", f"no assistant item {item_id!r} in this conversation to truncate", "item_id")
        sent_ms = 1000.0 * r.sent_samples / RATE_HZ
        if audio_end_ms < 0 or audio_end_ms > sent_ms + 1e-6:
            raise SessionError("invalid_value", f"Audio content of {sent_ms:.0f}ms is already shorter than {audio_end_ms:.0f}ms "
                                                "(audio_end_ms is beyond the audio sent)", "audio_end_ms")
        self.discard_speculation()  # it answered the history before this edit
        if r is self.response:
            r.acked_ms = float(audio_end_ms)
        if not r.status.finished:
            self._interrupt("client_cancelled", now)
        else:
            self._commands.append(TruncateResponse(r.id, float(audio_end_ms)))
        self._events.append(ItemTruncated(item_id, float(audio_end_ms)))

    def receive_delete(self, item_id: str) -> None:
        """conversation.item.delete of an item in the model's history: a user turn or an answer of a
        finished response. (Items held only by the protocol, text and system messages, never get here.)"""
        rid = next((rid for rid, items in self._exchange_items.items() if item_id in items), None)
        if rid is None:
            raise SessionError("item_not_deletable", f"item {item_id!r} is a user turn with no response yet: it can be "
                                                     "deleted once answered (input_audio_buffer.clear drops audio before a commit)", "item_id")
        items = self._exchange_items[rid]
        answer = self._assistant_items[items[-1]]  # an exchange's items: its user items, then the answer
        if not answer.status.finished:
            raise SessionError("item_not_deletable", f"response {rid} is in progress: cancel it first", "item_id")
        if item_id != answer.item_id and len(items) > 2:
            raise SessionError("item_not_deletable", f"item {item_id!r} is one of {len(items) - 1} user items the model heard as "
                                                     "one turn: that turn cannot lose one of them", "item_id")
        self.discard_speculation()  # it answered the history before this edit
        items.remove(item_id)
        self._deleted_items.add(item_id)
        self._commands.append(DeleteTurn(rid, Role.ASSISTANT if item_id == answer.item_id else Role.USER))
        self._events.append(ItemDeleted(item_id))

    def played_ms(self, now: float) -> float:
        r = self.response
        return 0.0 if r is None else self._played_ms(r, now)

    def _played_ms(self, r: Response, now: float) -> float:
        if r.acked_ms is not None:
            return r.acked_ms
        return 1000.0 * min(self._pacer.played_samples(now), r.sent_samples) / RATE_HZ

    # ---- interruption ----
    def _interrupt(self, reason: str, now: float) -> None:
        """Barge-in / cancel: stop the engine, drop unsent audio, clear the client's buffer, new epoch."""
        r = self.response
        played = self._played_ms(r, now)
        self._commands.append(CancelResponse(r.id, played))
        if r.sent_samples:
            self._events.append(OutputCleared(r.id))
        self._finish(r, ResponseStatus.CANCELLED, reason, played_ms=played)

    def _finish(self, r: Response, status: ResponseStatus, reason: str | None, played_ms: float) -> None:
        r.status = status
        r.pending.clear()
        r.pending_samples = 0
        if status is not ResponseStatus.COMPLETED:
            self._epoch += 1
        ttfa = None if r.first_audio_time is None or r.turn_end_time is None else 1000.0 * (r.first_audio_time - r.turn_end_time)
        after_confirm = None if r.first_audio_time is None or r.confirmed_at is None else 1000.0 * (r.first_audio_time - r.confirmed_at)
        self._events.append(ResponseDone(r.id, r.item_id, r.epoch, status, reason, r.transcript, 1000.0 * r.sent_samples / RATE_HZ, played_ms, ttfa,
                                         r.metadata, after_confirm))
