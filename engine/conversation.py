"""One dialogue on OpusLM: the conversation the gateway holds (service_api.Conversation).

    push_user_audio ─▶ tokenizer thread ─▶ user frames ─▶ incremental prefill (prefix-cached KV of
        the stable part, while the user talks)
    respond ─▶ ResponseRecord ─▶ the pipeline (vLLM steps ─▶ frames ─▶ codec stage) ─▶ EngineResponse.chunks()
    cancel(played_ms) ─▶ abort in vLLM at the next step; history keeps the played frames only
    respond(speculative=True) ─▶ the same, on a fork of the user turn that `discard()` takes back

The history's KV is reused across turns by vLLM's prefix cache, salted per conversation (block
hashes cover stream 0 only; within one conversation equal stream-0 prefixes have equal aux
streams, across conversations they need not). The model work is engine/pipeline.py's; admission
(the slot this conversation holds) is engine/slots.py's.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import numpy as np

from engine import guidance, vocab
from engine.dialogue import (
    MIN_ANSWER_FRAMES,
    SEGMENT_ROWS,
    ContextFit,
    DialogueTurn,
    answer_audio_prompt,
    answer_rows,
    fit_context,
    history_rows,
    response_prompt,
    stable_user_prefix,
    turn_rows,
)
from engine.layout import PromptLayout
from engine.pipeline import Pipeline, as_float_pcm
from engine.prompt import special_rows
from engine.request import AudioRequest
from engine.response import EngineResponse, ResponseRecord, Speculation, played_frames
from engine.sampling import SamplingConfig
from engine.service_api import (
    FRAME_MS,
    NO_DEGRADATION,
    AudioChunk,
    ConversationClosed,
    ConversationOptions,
    ConversationTooLong,
    Degradation,
    HistoryTurn,
    ResponseInProgress,
    Role,
)
from engine.slots import Slots
from engine.user_turn import UserTurn

log = logging.getLogger("duplex.engine")

SAMPLES_PER_FRAME = vocab.HOP_SAMPLES


def _sampling_config(options: ConversationOptions) -> SamplingConfig:
    return SamplingConfig(temperature=options.temperature, top_k=options.top_k, top_p=options.top_p, seed=options.seed)


def _same_pcm(a: np.ndarray | None, b: np.ndarray | None) -> bool:
    if a is None or b is None:
        return a is b
    return bool(np.array_equal(a, b))


@dataclass(frozen=True)
class _Head:
    """What precedes the first turn of a prompt: the voice's frames (None: no voice, or not tokenized
    yet) and the system text, laid out as the checkpoint says."""

    speaker_frames: np.ndarray | None
    system_ids: tuple[int, ...]
    layout: PromptLayout


class Conversation:
    """One dialogue. Methods are called from the event loop; see engine/service_api.py."""

    def __init__(self, pipeline: Pipeline, slots: Slots, session_id: str, options: ConversationOptions, rank: int = 0) -> None:
        self.id = session_id
        self._pipeline = pipeline
        self._slots = slots  # the engine slot it holds (suspend, resume, close)
        self.rank = rank  # the engine rank (data parallelism) that runs all its requests: its prefix cache is there
        self._requested = options  # the client's (update_options); `_options` is what answers run with
        self._degradation = NO_DEGRADATION  # the gateway's overload control (degrade())
        self._options = options
        self._salt = pipeline.new_salt(session_id)
        self._turns: list[DialogueTurn] = []
        self._user: UserTurn | None = None
        self._response: ResponseRecord | None = None  # the latest, until it ended
        self._closed = False
        self._sampling = _sampling_config(options)
        self._prefill_task: asyncio.Task[None] | None = None
        self.prefilled_requests = 0  # incremental prefills issued while the user talked
        self.last_prompt: np.ndarray | None = None  # the prompt of the latest response
        self._last: ResponseRecord | None = None
        self.history_dropped = 0  # turns dropped from the head of the history (context management)
        self._exchanges: list[str] = []  # the response id of each exchange in `_turns` (2 turns each)
        # history edits that change the prefix-cache salt: turns the client deleted from the middle of
        # the history, and discarded speculative answers whose flushed user frames filled a cache block
        self._resalts = 0
        pipeline.check_text_options(options)
        self._speaker: asyncio.Future[np.ndarray] | None = self._tokenize_speaker(options.speaker_prompt_pcm)
        self._system_text: tuple[str, tuple[int, ...]] = ("", ())  # the system text and its ids, before the cap
        self._system_ids: tuple[int, ...] = self._tokenize_system(options.system_prompt)

    @property
    def responding(self) -> bool:
        return self._response is not None

    @property
    def cached_tokens_last_response(self) -> int:
        """Prompt positions of the latest response served from the prefix cache."""
        return 0 if self._last is None else self._last.cached_tokens

    def update_options(self, options: ConversationOptions) -> None:
        """New settings (session.update); they apply from the next response on."""
        self._check_open()
        self._pipeline.check_text_options(options)
        old = self._options.speaker_prompt_pcm
        new = options.speaker_prompt_pcm
        if not _same_pcm(old, new):
            self._speaker = self._tokenize_speaker(new)
            # the prompt's prefix changed: a new salt keeps the old prefix's KV out of reach
            self._salt = self._pipeline.new_salt(self.id)
        system = self._tokenize_system(options.system_prompt)
        if system != self._system_ids:
            self._system_ids = system
            self._salt = self._pipeline.new_salt(self.id)
        self._requested = options
        self._options = self._degradation.apply(options)
        self._sampling = _sampling_config(options)

    def _tokenize_system(self, text: str | None) -> tuple[int, ...]:
        """The system text's ids (capped); a text that extends the last one tokenizes only what it adds."""
        if text == self._system_text[0]:
            ids = self._system_text[1]
        else:
            ids = self._pipeline.tokenize_system(text, self._system_text)
            self._system_text = (text or "", ids)
        return self._pipeline.capped_system_ids(ids)

    def degrade(self, degradation: Degradation) -> None:
        """Overload: the next answers run with `degradation.apply(options)` (no CFG shadow, a shorter cap)."""
        self._degradation = degradation
        self._options = degradation.apply(self._requested)

    def _tokenize_speaker(self, pcm: np.ndarray | None) -> asyncio.Future[np.ndarray] | None:
        """The speaker prompt's frames (at most the checkpoint's speaker_prompt_length), tokenized off the loop."""
        if pcm is None:
            return None
        pcm = as_float_pcm(pcm, "the speaker prompt")
        if pcm.size == 0:
            return None
        pcm = pcm[: self._pipeline.prompt_layout.speaker_prompt_length * SAMPLES_PER_FRAME]
        return self._pipeline.tokenize(self._pipeline.new_tokenizer_state(), pcm, finish=True)

    def _head(self, system_ids: tuple[int, ...] | None = None) -> _Head:
        """What precedes the first turn, as the dialogue functions take it: the voice and the system text
        (`system_ids`: one answer's own; None: the conversation's)."""
        return _Head(speaker_frames=self._speaker_frames(), system_ids=self._system_ids if system_ids is None else system_ids,
                     layout=self._pipeline.prompt_layout)

    def _answer_system_ids(self, instructions: str | None) -> tuple[int, ...] | None:
        """One answer's own system text (respond(instructions=...)), or None when it reads the conversation's:
        none given, the same ids, or a model without text (which ignores them, logged as the session's are)."""
        if instructions is None:
            return None
        ids = self._pipeline.system_ids(instructions)  # () without text: the conversation's are () too
        return None if ids == self._system_ids else ids

    def _speaker_frames(self) -> np.ndarray | None:
        """The tokenized speaker prompt, or None (none given, or not tokenized yet)."""
        fut = self._speaker
        if fut is None or not fut.done() or fut.cancelled() or fut.exception() is not None:
            return None
        return fut.result()

    # --- user audio --------------------------------------------------------------------------

    def push_user_audio(self, pcm_16k: np.ndarray) -> None:
        """Mono int16 (or float in [-1, 1]) at 16 kHz; tokenized off the loop as it arrives."""
        self._check_open()
        self._check_decided()
        pcm = as_float_pcm(pcm_16k, "user audio")
        user = self._open_user_turn()
        job = self._pipeline.tokenize(user.state(), pcm, finish=False)
        user.last_job = job
        job.add_done_callback(lambda f: self._on_frames(user, f))

    def end_user_turn(self) -> None:
        """The user's turn is complete (VAD end of speech, or a client commit)."""
        self._check_open()
        self._check_decided()
        user = self._open_user_turn()
        if user.done is not None:
            return
        job = self._pipeline.tokenize(user.state(), None, finish=True)
        user.done = job
        job.add_done_callback(lambda f: self._on_frames(user, f))

    def _open_user_turn(self) -> UserTurn:
        """The open user turn, which audio and typed text join (a new one once an answer took the last)."""
        if self._user is None:
            self._user = UserTurn(tokenizer_state=self._pipeline.new_tokenizer_state())
        return self._user

    def add_user_text(self, text: str) -> None:
        """A typed user turn: it ends the open audio turn (if any) and joins it in the next exchange."""
        self._check_open()
        self._check_decided()
        if not text or not text.strip():
            raise ValueError("a user text turn needs non-empty text")
        tokenizer = self._pipeline.require_text()
        self.end_user_turn()
        self._open_user_turn().text_ids.extend(int(i) for i in tokenizer.encode(text))

    def _on_frames(self, user: UserTurn, fut: asyncio.Future[np.ndarray]) -> None:
        if fut.cancelled() or fut.exception() is not None:
            return
        frames = fut.result()
        if len(frames):
            user.frames.append(frames)
        self._maybe_prefill(user)

    def _maybe_prefill(self, user: UserTurn) -> None:
        conf = self._pipeline.config
        if not conf.incremental_prefill or user is not self._user or user.done is not None:
            return
        if self._response is not None:  # the history is not final until the answer is
            return
        if guidance.uses_cfg(self._options.cfg_scale):  # CFG pairs do not read the prefix cache
            return
        if self._prefill_task is not None and not self._prefill_task.done():
            return
        if (user.num_frames - user.prefilled_frames) * FRAME_MS < conf.prefill_interval_ms:
            return
        if self._speaker is not None and not self._speaker.done():
            return  # the prompt starts with the speaker prompt: prefill once it is tokenized
        # the history the response will read: the same drop, never a prompt past max_model_len
        fit = self._fit(user.num_frames, at_least=user.drop)
        if not fit.fits:
            return
        user.prefilled_frames, user.drop = user.num_frames, fit.drop
        head = self._head()
        prompt = stable_user_prefix(self._turns[fit.drop :], user.all_frames(), head.speaker_frames,
                                    system_ids=head.system_ids, layout=head.layout)
        salt = self._salt_at(self.history_dropped + fit.drop)
        self._prefill_task = asyncio.ensure_future(self._pipeline.prefill(prompt, salt, self.rank))
        self.prefilled_requests += 1

    # --- the answer --------------------------------------------------------------------------

    def respond(self, response_id: str, speculative: bool = False, instructions: str | None = None) -> EngineResponse:
        """Answer the user's turn: a handle whose `chunks()` yields the audio, in order.

        `instructions`: this answer's own system text (service_api). Its prompt has that text in the
        system segment; the history it leaves has the conversation's, and once it ended the history is
        prefilled in that layout (`_prefill_history`), so the next answer's prompt hits the cache.

        `speculative`: the user may not be done. The answer runs on a fork of the turn (its tokenizer
        state copied, then flushed), the turn itself stays open, and until `confirm()` or `discard()`
        no user audio may be pushed. A confirmed answer is exactly the one `end_user_turn()` then
        `respond()` would have given; a discarded one leaves the history as it was and the turn goes on."""
        self._check_open()
        prev = self._response
        if prev is not None and not prev.cancelled:
            raise ResponseInProgress(f"conversation {self.id} is already responding ({prev.id})")
        response = ResponseRecord(response_id)
        response.system_ids = self._answer_system_ids(instructions)
        on_discard = None
        if speculative and (self._user is None or self._user.done is None):
            open_turn = self._open_user_turn()
            user = self._fork_ended(open_turn)
            response.speculation = Speculation(user=open_turn, last=self._last)
            on_discard = self._discard
        else:
            if self._user is None or self._user.done is None:
                self.end_user_turn()
            user = self._open_user_turn()
        self._user = None
        self._response = self._last = response
        response.task = asyncio.ensure_future(self._generate(response, user, prev))
        return EngineResponse(response, on_discard)

    def _fork_ended(self, user: UserTurn) -> UserTurn:
        """A copy of the open turn `user`, ended: its frames so far, then what the tokenizer flushes from
        a copy of its state. `user` itself stays open (the tokenizer thread runs jobs in order, so the
        copy is taken after every push already queued, and its frames arrive after theirs)."""
        fork = UserTurn(tokenizer_state=None, prefilled_frames=user.prefilled_frames, drop=user.drop)
        fork.done = self._pipeline.tokenize(user.state(), None, finish=True, fork=True)

        def take(fut: asyncio.Future[np.ndarray]) -> None:
            fork.frames = list(user.frames)
            fork.flushed_from = user.num_frames
            if not fut.cancelled() and fut.exception() is None and len(fut.result()):
                fork.frames.append(fut.result())

        fork.done.add_done_callback(take)
        return fork

    def _discard(self, response: ResponseRecord) -> None:
        """A speculative answer never happened (its handle's `discard()`, or a suspend): generation stops,
        the user turn goes on, the history is restored when the answer's task ends."""
        spec = response.speculation
        if spec is None or response.discarded:
            return
        response.discarded = True
        response.stop(0)
        self._user, self._last = spec.user, spec.last
        if response.ended:
            self._undo_speculation(response)

    def _undo_speculation(self, response: ResponseRecord) -> None:
        spec = response.speculation
        if spec is None:
            return
        if spec.history is not None:
            self._turns, self._exchanges, self.history_dropped = spec.history
            spec.history = None
        if spec.flushed_rows is not None:
            # Block hashes cover stream 0 only: a cached block that ends among the fork's flushed frames
            # could serve the continued turn the fork's aux streams. Only then is a new salt needed.
            lo, hi = spec.flushed_rows
            block = self._pipeline.config.kv_block_size
            if (hi // block) * block > lo:
                self._resalts += 1
            spec.flushed_rows = None

    async def _generate(self, response: ResponseRecord, user: UserTurn, prev: ResponseRecord | None) -> None:
        """The response's whole life. The user turn always enters the history (a cancel stops only the
        generation, `response.pump`), so the next turn's prompt is right whatever was interrupted."""
        try:
            if prev is not None and prev.task is not None:
                await asyncio.wait([prev.task])  # its turn must be in the history before ours
            failure = await self._tokenized(user)
            user_turn = DialogueTurn(vocab.USER, user.all_frames(), list(user.text_ids))
            fit = self._fit(turn_rows(user_turn) - SEGMENT_ROWS, at_least=user.drop, system_ids=response.system_ids)
            if response.speculation is not None:
                spec = response.speculation
                spec.history = (list(self._turns), list(self._exchanges), self.history_dropped)
                # the user segment starts after the kept history and its two marker rows
                head = self._head(response.system_ids)
                first = len(history_rows(self._turns[fit.drop :], head.speaker_frames, system_ids=head.system_ids,
                                         layout=head.layout)) + 2
                spec.flushed_rows = (first + user.flushed_from, first + user.num_frames)
            self._drop_turns(fit.drop, response)
            # one exchange per response, whatever happens to it (service_api: the gateway counts on it)
            self._turns.append(user_turn)
            self._exchanges.append(response.id)
            response.turn = DialogueTurn(vocab.ASSISTANT, np.zeros((0, vocab.NUM_STREAMS), np.int64))
            if failure is not None:
                raise failure
            if self._options.transcribe_user and len(user_turn.frames):
                response.transcriber = asyncio.ensure_future(self._transcribe_user(response))
            else:
                response.end_transcript()
            if response.cancelled:
                return
            if not fit.fits:
                raise ConversationTooLong(self._too_long(fit))
            response.pump = asyncio.ensure_future(self._answer(response, fit))
            await asyncio.wait([response.pump])  # a cancel ends it early; its own failures it delivers
            if not response.pump.cancelled():
                await response.delivered.wait()  # the codec stage still decodes the last frames
        except ConversationTooLong as e:
            log.warning("response %s of conversation %s refused: %s", response.id, self.id, e)
            response.deliver(e)
        except Exception as e:  # the tokenizer or the request failed: the consumer learns it
            log.exception("response %s failed", response.id)
            response.deliver(e)
        finally:
            self._end_response(response)

    async def _answer(self, response: ResponseRecord, fit: ContextFit) -> None:
        """The answer's generation: its text first (assistant_text), then its audio (output_audio)."""
        head, opts = self._head(response.system_ids), self._options
        salt = self._salt_at(self.history_dropped)
        if opts.assistant_text:
            self.last_prompt = response_prompt(self._turns, head.speaker_frames, text_first=True,
                                               system_ids=head.system_ids, layout=head.layout)
            text = AudioRequest(prompt=self.last_prompt, max_frames=0, start_modality=vocab.TEXT_BPE,
                                max_text_tokens=opts.max_text_tokens, min_text_tokens=1, sampling=self._sampling,
                                cache_salt=salt, realtime=True)
            await self._pipeline.run_text(text, response, self.rank)
            if response.delivered.is_set():  # it failed
                return
            if not opts.output_audio:
                response.deliver(AudioChunk(response.id, np.zeros(0, np.int16), 0.0, 0.0, time.monotonic(), is_last=True))
                return
            self.last_prompt = answer_audio_prompt(self._turns, response.text_ids, head.speaker_frames,
                                                   system_ids=head.system_ids, layout=head.layout)
        else:
            self.last_prompt = response_prompt(self._turns, head.speaker_frames, system_ids=head.system_ids,
                                               layout=head.layout)
        max_frames = fit.max_frames
        if guidance.uses_cfg(opts.cfg_scale):
            max_frames = self._pipeline.guided_max_frames(len(self.last_prompt), max_frames)
        request = AudioRequest(prompt=self.last_prompt, max_frames=max_frames, min_frames=1, sampling=self._sampling,
                               cache_salt=salt, realtime=True, cfg_scale=opts.cfg_scale)
        await self._pipeline.run_response(request, response, self.rank)

    async def _transcribe_user(self, response: ResponseRecord) -> None:
        """The user turn's text as the dialogue model writes it (`9 35` after the user's audio: ESPnet's
        dialogue recipe trains the user text as a target), beside the answer: an offline request that
        shares the answer's prompt prefix in the cache. The history keeps the audio only."""
        try:
            prompt = np.concatenate([self._history_rows(), special_rows(vocab.USER, vocab.TEXT_BPE)])
            room = self._pipeline.max_model_len - len(prompt) - 4
            if room < 2:
                return
            request = AudioRequest(prompt=prompt, max_frames=0, start_modality=vocab.TEXT_BPE,
                                   max_text_tokens=min(self._options.max_text_tokens, room - 1), min_text_tokens=1,
                                   sampling=SamplingConfig(temperature=0.0), cache_salt=self._salt_at(self.history_dropped))
            async for delta in self._pipeline.text_deltas(request, f"{response.id}#user_text", self.rank):
                response.put_transcript(delta)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the transcript fails alone; the answer goes on
            log.exception("transcript of the user turn of %s failed", response.id)
            response.put_transcript(e)
        finally:
            response.end_transcript()

    async def _tokenized(self, user: UserTurn) -> BaseException | None:
        """Wait for the tokenizer to flush the turn (its frames are then in `user`) and for the speaker
        prompt (queued before it: already done); their failure, if any, is returned, not raised."""
        try:
            if user.done is not None:
                await user.done
            if self._speaker is not None:
                await self._speaker
        except Exception as e:  # the response fails with it, after its exchange entered the history
            return e
        return None

    # --- context management (engine.dialogue.fit_context) -------------------------------------

    def _max_frames(self) -> int:
        return max(1, int(self._options.max_response_ms / FRAME_MS))

    def _fit(self, user_frames: int, at_least: int = 0, system_ids: tuple[int, ...] | None = None) -> ContextFit:
        """Which leading turns the prompt for a user turn of `user_frames` drops, and its answer's cap
        (`system_ids`: the answer's own system text; None: the conversation's)."""
        speaker = self._speaker_frames()
        text = self._options.max_text_tokens if self._options.assistant_text else 0
        system = self._system_ids if system_ids is None else system_ids
        return fit_context(self._turns, user_frames, self._pipeline.max_model_len, self._max_frames(),
                           self._options.retention_ratio, speaker_frames=0 if speaker is None else len(speaker),
                           at_least=at_least, max_text_tokens=text, system_tokens=len(system),
                           layout=self._pipeline.prompt_layout)

    def _salt_at(self, first_turn: int) -> str:
        """The prefix-cache salt of prompts whose history starts at the conversation's turn `first_turn`.
        Within one salt equal stream-0 prefixes must have equal aux streams (block hashes cover stream 0
        only); a history starting at another turn could break that (two turns opening alike in stream 0
        alone, e.g. on silence), so each truncation point has its own salt; so does each deletion, which
        can bring two such turns together (a cut answer needs none: its end differs in stream 0)."""
        salt = self._salt if first_turn == 0 else f"{self._salt}@{first_turn}"
        return salt if not self._resalts else f"{salt}~{self._resalts}"

    def _drop_turns(self, n: int, response: ResponseRecord) -> None:
        """Drop the `n` oldest turns (whole exchanges: fit_context cuts before a user turn)."""
        if n:
            frames = sum(len(t.frames) for t in self._turns[:n])
            response.dropped_exchanges = tuple(self._exchanges[: n // 2])
            del self._turns[:n], self._exchanges[: n // 2]
            self.history_dropped += n
            log.info("conversation %s: context full, dropped the %d oldest turns (%.1f s of audio) before response %s; "
                     "%d turns kept, %d dropped in all (max_model_len %d)", self.id, n, frames * FRAME_MS / 1000.0,
                     response.id, len(self._turns), self.history_dropped, self._pipeline.max_model_len)

    def _too_long(self, fit: ContextFit) -> str:
        limit = self._pipeline.max_model_len
        audio_s = sum(len(t.frames) for t in self._turns) * FRAME_MS / 1000.0
        answer_s = self._max_frames() * FRAME_MS / 1000.0
        need = fit.prompt_rows + answer_rows(self._max_frames())
        if self._options.retention_ratio is None:
            return (f"the conversation ({audio_s:.1f} s of audio, {fit.prompt_rows} positions) and a {answer_s:g} s answer need "
                    f"{need} positions; the model's context is {limit} (truncation is disabled)")
        user_s = len(self._turns[-1].frames) * FRAME_MS / 1000.0
        return (f"the user's turn alone ({user_s:.1f} s, {fit.prompt_rows} positions with the prompt's head) leaves room for "
                f"less than {min(self._max_frames(), MIN_ANSWER_FRAMES) * FRAME_MS / 1000.0:g} s of answer in the model's "
                f"{limit} positions")

    def _end_response(self, response: ResponseRecord) -> None:
        self._pipeline.close_stream(response.id)
        if response.transcriber is None:  # never started (a failure, a cancel): the transcript is empty
            response.end_transcript()
        elif response.discarded:  # the exchange never happened
            response.transcriber.cancel()
        if response.discarded:
            self._undo_speculation(response)
        elif response.turn is not None:
            frames = np.concatenate(response.frames) if response.frames else response.turn.frames
            if response.keep_frames is not None:
                frames = frames[: response.keep_frames]
            response.turn.frames = frames
            response.turn.text_ids = list(response.text_ids)  # the text written (and shown) so far
            self._turns.append(response.turn)
        response.ended = True
        response.finish()
        if self._response is response:
            self._response = None
            if response.system_ids is not None and response.speculation is None and not response.discarded:
                self._prefill_history()

    def _prefill_history(self) -> None:
        """After an answer that read its own instructions: the history, laid out with the conversation's
        system text, into the prefix cache. That answer's prompt had another system segment, so none of
        the history's blocks past the speaker prompt are cached; without this the next answer would
        prefill it all (unless the user speaks long enough for the incremental prefill to do it)."""
        conf = self._pipeline.config
        if self._closed or not conf.incremental_prefill or guidance.uses_cfg(self._options.cfg_scale):
            return  # (CFG pairs do not read the prefix cache)
        if self._prefill_task is not None and not self._prefill_task.done():
            return
        if self._speaker is not None and not self._speaker.done():
            return  # a new voice, still being tokenized: the history's layout is not known yet
        prompt = self._history_rows()
        self._prefill_task = asyncio.ensure_future(self._pipeline.prefill(prompt, self._salt_at(self.history_dropped), self.rank))

    def truncate(self, response_id: str, played_ms: float) -> None:
        """The client played only `played_ms` of an answer still in the history (the latest may still
        have been playing, or generating, when the user interrupted): the history keeps that much."""
        if self._last is not None and self._last.id == response_id:
            self._last.stop(played_frames(played_ms))
            return
        _, answer = self._exchange(response_id)
        if answer is not None:
            answer.frames = answer.frames[: played_frames(played_ms)]

    def delete_turn(self, response_id: str, role: Role) -> None:
        """The client deleted the user turn or the answer of the exchange of `response_id`: the model
        no longer reads it (its place stays: see DialogueTurn.deleted)."""
        self._check_open()
        if self._response is not None and self._response.id == response_id:
            raise ResponseInProgress(f"response {response_id} is still in progress: cancel it first")
        user, answer = self._exchange(response_id)
        turn = user if role is Role.USER else answer
        if turn is not None and not turn.deleted:
            turn.deleted = True
            self._resalts += 1
            log.info("conversation %s: the client deleted the %s turn of response %s", self.id, role.name.lower(), response_id)

    def _exchange(self, response_id: str) -> tuple[DialogueTurn | None, DialogueTurn | None]:
        """The user turn and the answer of an exchange still in the history (None where there is none:
        dropped for the context, unknown, or the answer not yet ended)."""
        if response_id not in self._exchanges:
            return None, None
        i = 2 * self._exchanges.index(response_id)
        turns = self._turns[i : i + 2]
        return turns[0], turns[1] if len(turns) > 1 else None

    def suspend(self) -> None:
        self._check_open()
        r = self._response
        if r is not None and r.speculation is not None and not r.discarded:
            self._discard(r)  # the user's turn had not ended: it goes on if they come back
        elif r is not None:
            r.stop(keep=None)  # nobody hears the cut: the history keeps what was generated
        self._slots.set_suspended(self.id, True)

    def resume(self) -> None:
        self._check_open()
        self._slots.set_suspended(self.id, False)

    async def close(self) -> None:
        if self._closed:
            return
        if self._response is not None:
            self._response.stop(keep=None)
        if self._last is not None and self._last.transcriber is not None:
            self._last.transcriber.cancel()
        if self._prefill_task is not None:  # KV for a prompt no answer will read (vLLM aborts the request)
            self._prefill_task.cancel()
        self._closed = True
        self._slots.release(self.id)

    @property
    def history(self) -> list[HistoryTurn]:
        role = {vocab.USER: Role.USER, vocab.ASSISTANT: Role.ASSISTANT}
        return [HistoryTurn(role=role[t.role], audio_frames=len(t.frames)) for t in self._turns if not t.deleted]

    def next_prompt(self) -> np.ndarray:
        """The prompt the next response would start from (for tests and debugging)."""
        head = self._head()
        return response_prompt(self._turns, head.speaker_frames, system_ids=head.system_ids, layout=head.layout)

    def _history_rows(self) -> np.ndarray:
        """The history with the conversation's own head (no opener)."""
        head = self._head()
        return history_rows(self._turns, head.speaker_frames, system_ids=head.system_ids, layout=head.layout)

    def _check_open(self) -> None:
        if self._closed:
            raise ConversationClosed(f"conversation {self.id} is closed")

    def _check_decided(self) -> None:
        r = self._response
        if r is not None and r.speculation is not None and not r.discarded:
            raise RuntimeError(f"response {r.id} is speculative: confirm or discard it before the user turn changes")
