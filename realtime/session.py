"""One conversation's turn-taking, transport-agnostic and sans-I/O (docs/architecture.md, "The session").

Inputs arrive through `receive_*()` methods, always with the monotonic time `now` passed in; the
caller drains two outputs:

- `events()`: `SessionEvent`s for the transport to put on its wire (speech started/stopped, audio
  frames when they are due, response done, ...);
- `commands()`: `EngineCommand`s for the shell to run against the engine conversation
  (push audio, end the user turn, start/cancel a response).

Both are defined in realtime/session_events.py (and importable from here).

Two state machines run side by side, as the call is full duplex: the user's turn (`TurnPhase`:
MANUAL, LISTENING, SPEAKING, PAUSED, SPECULATING; realtime/turn.py), moved only by `_fire` through
its transition table, decides where user audio goes; each answer (`PacedResponse`,
realtime/paced_response.py) moves through `ResponseStatus` while its audio is paced out. The
conversation's items, grouped by exchange, are kept by `ExchangeLedger` (realtime/exchanges.py).

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

from typing import assert_never

import numpy as np

from engine.service_api import SAMPLE_RATE_HZ

from realtime.exchanges import ExchangeLedger
from realtime.noise_suppression import NoiseSuppressor
from realtime.paced_response import PacedResponse
from realtime.pacing import Pacer
from realtime.session_events import (  # the session's API is one import: these are re-exported here
    ACTIVE_RESPONSE, COMMIT_EMPTY, NO_ACTIVE_RESPONSE, AddUserText, CancelResponse, ConfirmResponse, DeleteTurn, DiscardResponse,
    EndTurn, EngineCommand, InputCleared, InputCommitted, ItemDeleted, ItemTruncated, OutputCleared, PushAudio, ResponseAudio,
    ResponseCreated, ResponseDone, ResponseStatus, ResponseText, SessionError, SessionEvent, SessionLimits, SessionStats,
    SpeechStarted, SpeechStopped, StartResponse, TruncateResponse, UserItemAdded, new_id,
)
from realtime.turn import TurnAudio, TurnDetection, TurnEvent, TurnPhase, next_phase
from realtime.user_transcript import InputTranscriptDelta, InputTranscriptDone, InputTranscriptFailed  # re-exported
from realtime.vad import ServerVad, SileroVad, VadParams, VoicePaused, VoiceResumed, VoiceStarted, VoiceStopped, run_silero

RATE_HZ = SAMPLE_RATE_HZ  # the engine-side rate: user audio in, the answer out


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
        self.limits = limits or SessionLimits()
        self.stats = SessionStats()
        self._events: list[SessionEvent] = []
        self._commands: list[EngineCommand] = []
        # the user's turn: its state (moved only by `_fire`) and the audio each state keeps
        self._phase = TurnPhase.MANUAL
        self._detection: TurnDetection | None = None
        self._silero: SileroVad | None = None  # made when detection is first turned on
        self._awaiting_vad: list[tuple[np.ndarray, float]] = []  # (pcm, arrival time), in order: deferred VAD
        self._audio = TurnAudio()
        self._pushed_samples = 0  # audio of the current user turn already sent to the engine
        self._user_item: str | None = None  # the user item being spoken / buffered
        self._speech_end_time: float | None = None  # monotonic end of the last committed user speech
        # the answers
        self.response: PacedResponse | None = None  # the latest announced answer
        self.speculation: PacedResponse | None = None  # SPECULATING: the answer started at the pause, unseen
        self._discarded: set[str] = set()  # speculations taken back: the engine restored what they dropped
        self._epoch = 0
        self._exchanges = ExchangeLedger()
        self._pacer = Pacer(RATE_HZ, self.limits.lead_ms)
        self.set_turn_detection(vad)

    # ---- outputs and state ----
    def events(self) -> list[SessionEvent]:
        out, self._events = self._events, []
        return out

    def commands(self) -> list[EngineCommand]:
        out, self._commands = self._commands, []
        return out

    def response_statuses(self) -> list[ResponseStatus]:
        """The status of every response of this session, oldest first."""
        return self._exchanges.statuses()

    @property
    def phase(self) -> TurnPhase:
        return self._phase

    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def input_ms(self) -> float:
        return 1000.0 * self._audio.input_samples / RATE_HZ

    @property
    def vad_params(self) -> VadParams | None:
        return None if self._detection is None else self._detection.endpoint.params

    @property
    def vad_enabled(self) -> bool:
        return self._detection is not None

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
        if not self._awaiting_vad or (d := self._detection) is None:
            return
        if run:
            run_silero([d.silero])
        while self._awaiting_vad and d.silero.can_take(self._awaiting_vad[0][0].size):
            pcm, arrived = self._awaiting_vad.pop(0)
            self._receive_speech_audio(d, pcm, arrived, d.silero.take(pcm.size))

    def _fire(self, event: TurnEvent) -> None:
        """Every change of the user turn's state goes through here (realtime/turn.py's table: a move
        it does not list raises IllegalTransition)."""
        self._phase = next_phase(self._phase, event)

    def _running(self) -> PacedResponse | None:
        """The answer being generated or paced out, if any."""
        r = self.response
        return r if r is not None and not r.status.finished else None

    # ---- configuration ----
    def set_turn_detection(self, vad: VadParams | None) -> None:
        self.settle_vad()
        if vad is not None:
            vad.validate()
        self._resume_turn()  # the pause was decided under the old parameters
        if vad is None:
            self._detection = None
            self._fire(TurnEvent.DETECTION_OFF)
            return
        silero = self._silero = self._silero or SileroVad()
        if self._detection is not None and self._phase is TurnPhase.SPEAKING:
            self._detection.endpoint.params = vad  # the turn goes on under the new parameters
        else:
            self._detection = TurnDetection(ServerVad(vad, offset_ms=self.input_ms), silero)
            silero.reset()
        self._fire(TurnEvent.DETECTION_ON)

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
        if (d := self._detection) is None:
            if 1000.0 * (self._audio.buffer_samples + pcm.size) / RATE_HZ > self.limits.max_turn_ms:
                raise SessionError("input_audio_buffer_full", f"the input buffer holds at most {self.limits.max_turn_ms:.0f} ms; commit or clear it")
            self._audio.add_to_buffer(pcm)
        elif self.vad_deferred:
            d.silero.feed(pcm)
            self._awaiting_vad.append((pcm, now))
        else:
            self._receive_speech_audio(d, pcm, now, d.silero.process(pcm))

    def _receive_speech_audio(self, d: TurnDetection, pcm: np.ndarray, now: float, probs: list[float]) -> None:
        """Server-VAD mode: user audio with the speech probabilities of the windows it completed. Each
        piece of it goes where the turn's state was when it arrived: before an event, the old state."""
        start = self._audio.input_samples
        chunk_end_ms = 1000.0 * (start + pcm.size) / RATE_HZ
        p, pos = d.endpoint.params, 0
        for ev in d.endpoint.feed(probs):
            at = min(max(int(round(ev.at_ms * RATE_HZ / 1000.0)) - start, pos), pcm.size)
            self._route(p, pcm[pos:at])
            pos = at
            match ev:
                case VoiceStarted(audio_start_ms):
                    self._on_speech_started(p, audio_start_ms, now)
                case VoicePaused():
                    self._on_paused(p)
                case VoiceResumed():
                    self._resume_turn()
                case VoiceStopped(audio_end_ms):
                    self._on_speech_stopped(p, audio_end_ms, now, lag_ms=chunk_end_ms - audio_end_ms)
                case _:
                    assert_never(ev)
        self._route(p, pcm[pos:])

    def _route(self, p: VadParams, pcm: np.ndarray) -> None:
        if not pcm.size:
            return
        self._audio.input_samples += pcm.size  # the input timeline, up to this piece (what `recent` ends with)
        if self._phase is TurnPhase.LISTENING:
            self._audio.remember(pcm, p)
        elif self._phase is TurnPhase.SPEAKING:
            self._push(pcm)
        else:  # PAUSED, SPECULATING: pushed only if the turn goes on
            self._audio.held.append(pcm)

    def receive_commit(self, now: float) -> None:
        self.settle_vad()
        if (d := self._detection) is None:
            if self._denoiser is not None and (tail := self._denoiser.flush()).size:  # the turn's last few ms
                self._audio.add_to_buffer(tail)
            if self._audio.buffer_samples == 0:
                raise SessionError("input_audio_buffer_commit_empty", f"{COMMIT_EMPTY}: the input audio buffer is empty")
            self._user_item = new_id("item")
            self._push(self._audio.take_buffer())
            self._fire(TurnEvent.COMMITTED)
            self._commit(now)
            return
        if not self._phase.in_speech:
            raise SessionError("input_audio_buffer_commit_empty", f"{COMMIT_EMPTY}: no speech in it to commit (server_vad commits turns itself)")
        self.discard_speculation()
        self._end_pause(d.endpoint.params)
        self._fire(TurnEvent.COMMITTED)
        d.endpoint.reset(self.input_ms)
        self._commit(now)

    def receive_clear(self) -> None:
        self.settle_vad()
        self.discard_speculation()
        self._audio.clear()
        if self._denoiser is not None:
            self._denoiser.drop_held()
        if (d := self._detection) is not None:
            d.endpoint.reset(self.input_ms)
            d.silero.reset()
        self._fire(TurnEvent.CLEARED)
        # Audio already pushed to the engine for a turn in progress stays there (the engine has no
        # way to retract it); the turn is ended without a response.
        if self._pushed_samples:
            self._commands.append(EndTurn(self._user_item or ""))
            self._pushed_samples = 0
        self._user_item = None
        self._events.append(InputCleared())

    def _push(self, pcm: np.ndarray) -> None:
        self._commands.append(PushAudio(pcm))
        self._pushed_samples += pcm.size

    def _on_speech_started(self, p: VadParams, audio_start_ms: float, now: float) -> None:
        # OpenAI's order: speech_started first, then the interrupted answer's cleared / response.done,
        # so a client's own interruption logic still finds that answer in progress.
        self._fire(TurnEvent.SPEECH_STARTED)
        self._user_item = new_id("item")
        self._events.append(SpeechStarted(self._user_item, audio_start_ms))
        if (r := self._running()) is not None and p.interrupt_response:
            self._interrupt(r, "turn_detected", now)
            self.stats.barge_ins += 1
        self._push(self._audio.take_recent_from(audio_start_ms))

    def _on_speech_stopped(self, p: VadParams, audio_end_ms: float, now: float, lag_ms: float) -> None:
        self._events.append(SpeechStopped(self._user_item or "", audio_end_ms))
        self._end_pause(p)
        spec = self.speculation
        self._fire(TurnEvent.SPEECH_STOPPED)
        self._commit(now - max(0.0, lag_ms) / 1000.0, end_turn=spec is None)  # a speculation ended it at the pause
        if spec is not None:
            self._confirm(spec, now)
        elif p.create_response and self._running() is None:
            self._create_response()

    def _on_paused(self, p: VadParams) -> None:
        """The user's speech paused: their turn (as the engine hears it) ends here unless it goes on;
        start the answer now, unseen, so that it is ready if the silence does end the turn."""
        self._fire(TurnEvent.SPEECH_PAUSED)
        if not p.speculative or not p.create_response or self._running() is not None:
            return
        r = PacedResponse(id=new_id("resp"), item_id=new_id("item"), epoch=self._epoch, speculative=True)
        self.speculation = r
        self._fire(TurnEvent.SPECULATION_STARTED)
        self._commands.append(StartResponse(r.id, speculative=True))

    def _resume_turn(self) -> None:
        """The user's turn goes on after a pause: a speculative answer is discarded, the held audio joins the turn."""
        if not self._phase.paused:
            return
        self.discard_speculation()
        held = self._audio.take_held()
        self._fire(TurnEvent.SPEECH_RESUMED)
        if held:
            self._push(np.concatenate(held))

    def _end_pause(self, p: VadParams) -> None:
        """The turn ended: the audio held since the pause is not part of it (it is silence before what comes next)."""
        for pcm in self._audio.take_held():
            self._audio.remember(pcm, p)

    def discard_speculation(self) -> None:
        """Take back the speculative answer, if one runs: the engine forgets it, the client never knew of it."""
        r, self.speculation = self.speculation, None
        if r is None:
            return
        self._fire(TurnEvent.SPECULATION_DISCARDED)
        self._discarded.add(r.id)
        self._commands.append(DiscardResponse(r.id))
        self.stats.speculative_discarded += 1

    def _confirm(self, r: PacedResponse, now: float) -> None:
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
        previous = self._exchanges.add_user(item, self._pushed_samples)
        self._events.append(InputCommitted(item, previous))
        self._user_item, self._pushed_samples = None, 0
        self._speech_end_time = speech_end_time

    # ---- responses ----
    def receive_user_item(self, item_id: str, pcm: np.ndarray | None, text: str = "") -> None:
        """conversation.item.create of a user message: a whole user turn in the history (its audio, then
        its text), no answer (the client asks for one with response.create)."""
        self.settle_vad()
        if (r := self._running()) is not None:
            raise SessionError("conversation_already_has_active_response", f"{ACTIVE_RESPONSE} {r.id}. Add the item when it is done", "item")
        if self._pushed_samples or self._phase.in_speech:
            raise SessionError("user_turn_in_progress", "the user is speaking: add the item once the turn is committed", "item")
        audio_samples = None
        if pcm is not None and pcm.size:
            self._commands.append(PushAudio(pcm))
            audio_samples = pcm.size
        self._commands.append(AddUserText(text) if text else EndTurn(item_id))
        self._events.append(UserItemAdded(item_id, self._exchanges.add_user(item_id, audio_samples)))

    def receive_response_create(self, now: float, metadata: dict | None = None, output_modalities: tuple[str, ...] | None = None,
                                instructions: str | None = None, max_output_tokens: int | str | None = None) -> str:
        self.settle_vad()
        return self._create_response(metadata, output_modalities, instructions, max_output_tokens)

    def _create_response(self, metadata: dict | None = None, output_modalities: tuple[str, ...] | None = None,
                         instructions: str | None = None, max_output_tokens: int | str | None = None) -> str:
        """(`receive_response_create` without settling the VAD: the turn's end, found while settling, calls it)"""
        if (running := self._running()) is not None:
            raise SessionError("conversation_already_has_active_response", f"{ACTIVE_RESPONSE} {running.id}. "
                                                                           "Wait until the response is finished before creating a new one")
        self.discard_speculation()  # the client asks for an answer now, to the turn as it stands
        r = PacedResponse(id=new_id("resp"), item_id=new_id("item"), epoch=self._epoch, metadata=metadata,
                          output_modalities=output_modalities)
        self._commands.append(StartResponse(r.id, output_modalities=output_modalities, instructions=instructions,
                                            max_output_tokens=max_output_tokens))
        self._begin(r)
        return r.id

    def _begin(self, r: PacedResponse) -> None:
        """`r` becomes the session's response: announced, in the history, paced out from now."""
        r.turn_end_time = self._speech_end_time
        r.acked_ms = 0.0 if self.limits.acked_playback else None
        self._speech_end_time = None
        self.response = r
        self._exchanges.add_answer(r)
        self._pacer.reset()
        self.stats.responses += 1
        self._events.append(ResponseCreated(r.id, r.item_id, r.epoch, r.metadata, r.output_modalities))
        if r.transcript:  # a speculative answer's text, held until now
            self._events.append(ResponseText(r.id, r.item_id, r.epoch, r.transcript))
        self._events += r.user_transcript.due(self._exchanges.deleted)

    def receive_response_cancel(self, now: float, response_id: str | None = None) -> None:
        if (r := self._running()) is None:
            raise SessionError("response_cancel_not_active", NO_ACTIVE_RESPONSE)
        if response_id is not None and response_id != r.id:
            raise SessionError("response_cancel_not_active", f"{NO_ACTIVE_RESPONSE} with id {response_id!r}", "response_id")
        self._interrupt(r, "client_cancelled", now)

    def receive_output_clear(self, now: float) -> None:
        """output_audio_buffer.clear: stop playback; cancels the response if one is running."""
        if (r := self._running()) is not None:
            self._interrupt(r, "client_cancelled", now)

    def _engine_response(self, response_id: str) -> PacedResponse | None:
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
        if audio:
            r.buffer(pcm, self.limits.max_response_buffer_ms)
        if is_last and r.status is ResponseStatus.IN_PROGRESS:
            r.advance(ResponseStatus.GENERATED)

    def receive_user_transcript(self, response_id: str, delta: str) -> None:
        """The engine wrote more of the user turn's transcript (transcribe_user) of this response's exchange."""
        if (r := self._announced_or_speculative(response_id)) is not None:
            r.user_transcript.add(delta)
            self._events += r.user_transcript.due(self._exchanges.deleted)

    def receive_user_transcript_end(self, response_id: str, code: str | None = None, message: str = "") -> None:
        """The transcript is complete (`code` None) or failed (`code`, `message`)."""
        if (r := self._announced_or_speculative(response_id)) is not None:
            r.user_transcript.finish(code, message)
            self._events += r.user_transcript.due(self._exchanges.deleted)

    def _announced_or_speculative(self, response_id: str) -> PacedResponse | None:
        """A response the client was told of (finished ones too: a transcript may outlast its answer), or
        the undecided speculation; None for a discarded one."""
        if self.speculation is not None and self.speculation.id == response_id:
            return self.speculation
        return self._exchanges.response(response_id)

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
        if (r := self._running()) is None:
            return None
        frame = RATE_HZ * self.limits.output_frame_ms // 1000
        while self._pacer.due(now) <= now:
            if r.pending.samples >= frame or (r.status is ResponseStatus.GENERATED and r.pending.samples):
                self._release(r, min(frame, r.pending.samples), now)
            elif r.status is ResponseStatus.GENERATED:
                self._finish(r, ResponseStatus.COMPLETED, None, played_ms=r.sent_ms)
                return None
            else:
                return None  # waiting for the engine
        return self._pacer.due(now)

    def _release(self, r: PacedResponse, n: int, now: float) -> None:
        self._events.append(frame := r.release(n, now))
        if frame.ttfa_ms is not None:
            self.stats.ttfa_ms.append(frame.ttfa_ms)
        self._pacer.on_sent(n, now)

    # ---- playback cursor and history edits ----
    def receive_played(self, played_ms: float, underruns: int = 0, response_id: str | None = None) -> None:
        """output_audio_buffer.played: the client has played `played_ms` of the current response."""
        self.stats.underruns_reported += max(0, int(underruns))
        r = self.response
        if r is None or (response_id is not None and response_id != r.id):
            return  # stale: an older response
        r.acked_ms = min(max(0.0, float(played_ms)), r.sent_ms)

    def receive_history_dropped(self, response_ids: tuple[str, ...], for_response: str | None = None) -> None:
        """The engine dropped these responses' exchanges from the conversation to fit its context (to make
        room for `for_response`: a speculative one tells the client once confirmed, a discarded one never)."""
        if self.speculation is not None and self.speculation.id == for_response:
            self.speculation.dropped = response_ids
            return
        if for_response in self._discarded:
            return  # the engine restored them
        self.stats.exchanges_dropped += len(response_ids)
        self._events += [ItemDeleted(item_id) for item_id in self._exchanges.drop(response_ids)]

    def receive_truncate(self, item_id: str, audio_end_ms: float, now: float) -> None:
        """conversation.item.truncate: any assistant item still in the history keeps `audio_end_ms`."""
        if (r := self._exchanges.answer(item_id)) is None:
            raise SessionError("item_truncate_invalid_item_id", f"no assistant item {item_id!r} in this conversation to truncate", "item_id")
        if audio_end_ms < 0 or audio_end_ms > r.sent_ms + 1e-6:
            raise SessionError("invalid_value", f"Audio content of {r.sent_ms:.0f}ms is already shorter than {audio_end_ms:.0f}ms "
                                                "(audio_end_ms is beyond the audio sent)", "audio_end_ms")
        self.discard_speculation()  # it answered the history before this edit
        if r is self.response:
            r.acked_ms = float(audio_end_ms)
        if not r.status.finished:
            self._interrupt(r, "client_cancelled", now)
        else:
            self._commands.append(TruncateResponse(r.id, float(audio_end_ms)))
        self._events.append(ItemTruncated(item_id, float(audio_end_ms)))

    def receive_delete(self, item_id: str) -> None:
        """conversation.item.delete of an item in the model's history: a user turn or an answer of a
        finished response. (Items held only by the protocol, text and system messages, never get here.)"""
        response_id, role = self._exchanges.deletion(item_id)
        self.discard_speculation()  # it answered the history before this edit
        self._exchanges.delete(response_id, item_id)
        self._commands.append(DeleteTurn(response_id, role))
        self._events.append(ItemDeleted(item_id))

    def played_ms(self, now: float) -> float:
        r = self.response
        return 0.0 if r is None else self._played_ms(r, now)

    def _played_ms(self, r: PacedResponse, now: float) -> float:
        if r.acked_ms is not None:
            return r.acked_ms
        return 1000.0 * min(self._pacer.played_samples(now), r.sent_samples) / RATE_HZ

    # ---- interruption and the end of an answer ----
    def _interrupt(self, r: PacedResponse, reason: str, now: float) -> None:
        """Barge-in / cancel: stop the engine, drop unsent audio, clear the client's buffer, new epoch."""
        played = self._played_ms(r, now)
        self._commands.append(CancelResponse(r.id, played))
        if r.sent_samples:
            self._events.append(OutputCleared(r.id))
        self._finish(r, ResponseStatus.CANCELLED, reason, played_ms=played)

    def _finish(self, r: PacedResponse, status: ResponseStatus, reason: str | None, played_ms: float) -> None:
        r.advance(status)
        if status is not ResponseStatus.COMPLETED:
            self._epoch += 1
        self._events.append(r.done(reason, played_ms))
