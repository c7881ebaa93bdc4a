"""The engine service: conversations on OpusLM, the one interface the gateway sees.

Implements engine/service_api.py. Data flows one way:

    push_user_audio ─▶ tokenizer thread (DAC encoder + SSL, incremental) ─▶ user frames
        ─▶ incremental prefill (prefix-cached KV of the stable part, while the user talks)
    respond ─▶ vLLM (AsyncOpusEngine) steps ─▶ frame assembly ─▶ codec stage thread ─▶ AudioChunk
    cancel(played_ms) ─▶ abort in vLLM at the next step; history keeps the played frames only
    respond(speculative=True) ─▶ the same, on a fork of the user turn that `discard()` takes back

The history's KV is reused across turns by vLLM's prefix cache, salted per conversation (block
hashes cover stream 0 only; within one conversation equal stream-0 prefixes have equal aux
streams, across conversations they need not). Nothing here blocks the event loop: model work
runs in the engine-core process, the tokenizer thread and the codec-stage thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import itertools
import logging
import os
import re
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from engine import guidance, vocab
from engine.capacity import CapacityModel, LatenessFeedback
from engine.checkpoint import load_config
from engine.host_meter import HostMeter
from engine.delay import MAX_DELAY, FrameAssembler
from engine.dialogue import (
    SEGMENT_ROWS,
    ContextFit,
    DialogueTurn,
    MIN_ANSWER_FRAMES,
    answer_audio_prompt,
    answer_rows,
    fit_context,
    history_rows,
    response_prompt,
    stable_user_prefix,
    turn_rows,
)
from engine.layout import DEFAULT_LAYOUT, PromptLayout
from engine.modality import ModalitySplitter
from engine.prompt import special_rows
from engine.request import AudioRequest
from engine.sampling import SamplingConfig
from engine.text import NoTextTokenizerError, TextDeltas, TextTokenizer
from engine.service_api import (
    FRAME_MS,
    NO_DEGRADATION,
    AtCapacity,
    AudioChunk,
    ConversationClosed,
    ConversationOptions,
    ConversationTooLong,
    Degradation,
    EngineError,
    EngineHealth,
    EngineLoad,
    HistoryTurn,
    NoTextModel,
    ResponseInProgress,
    Role,
    SpeechOptions,
    TranscriptionOptions,
)

log = logging.getLogger("duplex.engine")

SAMPLES_PER_FRAME = vocab.HOP_SAMPLES


@dataclass(frozen=True)
class EngineServiceConfig:
    """Engine settings (the `engine:` section of the server config)."""

    model: str | None = None  # checkpoint dir; None = the cached tiny model
    max_conversations: int = 16  # hard cap, whatever the measurements say (all engine ranks together)
    max_num_seqs: int = 32  # per engine rank
    data_parallel_size: int = 1  # engine cores (vLLM data parallelism); a conversation stays on one
    dtype: str = "float32"  # bfloat16 for the released models on a GPU
    max_model_len: int | None = None  # None: the backbone's context
    max_num_batched_tokens: int | None = None  # None: vLLM's default
    enable_chunked_prefill: bool = True
    kv_cache_gib: float = 1.0
    kv_block_size: int = 32  # prefix-cache granularity (vLLM's CPU backend needs multiples of 32)
    enforce_eager: bool = True
    incremental_prefill: bool = True
    prefill_interval_ms: float = 200.0  # prefill the user's audio every this much of new speech
    first_chunk_frames: int = 4  # codec: small first chunk for time to first audio
    chunk_frames: int = 16
    codec_max_batch: int = 16
    codec_device: str = "auto"  # DAC decoder + audio tokenizer: auto = the engine's GPU when torch sees one, else cpu
    cpu_threads: int | None = None  # CPU engine's OpenMP threads; None = all cores but one when the codec shares the CPU
    first_audio_budget_ms: float = 60.0  # the first chunk's deadline after its frames exist
    pacing_lead_ms: float = 500.0  # generation runs at most this far ahead of playback
    capacity_margin: float = 0.8
    capacity_override: int | None = None  # a fixed capacity instead of the measured one
    warmup: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.codec_device):
            raise ValueError(
                f"config key 'engine.codec_device': expected auto, cpu, cuda or cuda:N, got {self.codec_device!r}"
            )
        if self.cpu_threads is not None and (isinstance(self.cpu_threads, bool) or not isinstance(self.cpu_threads, int)
                                             or self.cpu_threads < 1):
            raise ValueError(f"config key 'engine.cpu_threads': expected a positive integer or null, got {self.cpu_threads!r}")
        if isinstance(self.data_parallel_size, bool) or not isinstance(self.data_parallel_size, int) or self.data_parallel_size < 1:
            raise ValueError(f"config key 'engine.data_parallel_size': expected a positive integer, got {self.data_parallel_size!r}")


def engine_cpu_threads(configured: int | None, codec_device: str, ranks: int = 1) -> int:
    """Each CPU engine rank's OpenMP threads (0: vLLM's default, every core).

    When the codec and tokenizer share the CPU with the engine, an OpenMP team over every core
    has one thread descheduled whenever they run, and the rest spin at the next barrier: measured
    on 2 cores, 8 conversations at once took 18 ms steps with 2 engine threads and 8.7 ms with one
    (scripts/bench_streaming.py). So the engine leaves them a core, and `ranks` engine cores share
    the others (at least one thread each).
    """
    if configured is not None:
        return configured
    if codec_device != "cpu":
        return 0
    return max(1, (len(os.sched_getaffinity(0)) - 1) // ranks)


@dataclass
class _UserTurn:
    tokenizer_state: object
    frames: list[np.ndarray] = field(default_factory=list)
    prefilled_frames: int = 0
    drop: int = 0  # history turns the incremental prefill dropped: the response drops at least these
    flushed_from: int = 0  # a speculative fork: its frames from here on were flushed from a copy
    done: asyncio.Future | None = None  # resolves when the tokenizer has flushed the turn
    last_job: asyncio.Future | None = None
    text_ids: list[int] = field(default_factory=list)  # what the user typed (add_user_text), global ids

    @property
    def num_frames(self) -> int:
        return sum(len(f) for f in self.frames)

    def all_frames(self) -> np.ndarray:
        if not self.frames:
            return np.zeros((0, vocab.NUM_STREAMS), dtype=np.int64)
        return np.concatenate(self.frames)


_END = object()  # chunk-queue sentinel: the response ended without a last chunk (cancel)


@dataclass
class _Speculation:
    """What a speculative answer's `discard()` needs to take it back."""

    user: _UserTurn  # the user turn as it was, still open: it goes on after a discard
    last: "Response | None"  # the conversation's latest answer before this one
    # the history before the answer touched it (context management may drop turns, the user turn is
    # appended): (turns, exchanges, history_dropped), taken when generation starts
    history: tuple | None = None
    # prompt positions [lo, hi) holding the fork's flushed frames: tokenized without the audio that
    # follows, they may match the continued turn in stream 0 but not in the aux streams
    flushed_rows: tuple[int, int] | None = None


def _played_frames(played_ms: float) -> int:
    return max(0, int(played_ms // FRAME_MS)) if played_ms != float("inf") else 1 << 40


class Response:
    """One answer: the `ResponseHandle` the gateway holds, and the engine's only record of it.

    Its life: waiting (for the previous answer to wind down and the user turn's last frames) ->
    generating (vLLM steps -> frames -> codec stage -> `chunks()`) -> ended, when its assistant turn
    (cut to what was played) is in the history. `cancel()` at any point stops it; after the end it
    cuts that history turn.
    """

    def __init__(self, response_id: str) -> None:
        self.id = response_id
        self._queue: asyncio.Queue = asyncio.Queue()
        self.frames: list[np.ndarray] = []
        self.played_frames: int | None = None  # set by cancel: the history keeps this many
        self.cancelled = False
        self.ended = False
        self.task: asyncio.Task | None = None  # the whole life (see `Conversation._generate`)
        self.pump: asyncio.Task | None = None  # the generation alone: what cancel stops
        self.turn: DialogueTurn | None = None  # the assistant turn in the history, once ended
        self.cached_tokens = 0  # prompt positions served from the prefix cache
        # context management: the earlier responses whose exchanges (user turn and answer) left the
        # history to make room for this one, oldest first
        self.dropped_exchanges: tuple[str, ...] = ()
        self.delivered = asyncio.Event()  # the last chunk, the failure or the cancel reached the queue
        self.speculation: _Speculation | None = None  # set while a speculative answer is undecided
        self.discarded = False
        self._on_discard = None  # the conversation's undo, set by `respond(speculative=True)`
        self._transcript: asyncio.Queue = asyncio.Queue()  # the user turn's transcript deltas, then _END
        self.transcriber: asyncio.Task | None = None  # writes them (transcribe_user)
        self.text_ids: list[int] = []  # the answer's text so far (assistant_text)
        # the system text this answer alone reads (respond(instructions=...)); None: the conversation's
        self.system_ids: tuple[int, ...] | None = None

    async def user_transcript(self) -> AsyncIterator[str]:
        while True:
            item = await self._transcript.get()
            if item is _END:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    async def chunks(self) -> AsyncIterator[AudioChunk]:
        """Ends once the answer's turn is in the history, so the next prompt is known when it does."""
        while True:
            item = await self._queue.get()
            if item is _END:
                break
            if isinstance(item, BaseException):
                await self._ended()
                raise item
            yield item
            if item.is_last:
                break
        await self._ended()

    async def _ended(self) -> None:
        if self.task is not None and not self.task.done():
            await asyncio.wait([self.task])

    def cancel(self, played_ms: float) -> None:
        played = _played_frames(played_ms)
        if self.ended:
            if self.turn is not None:
                self.turn.frames = self.turn.frames[:played]
            return
        self.played_frames = played if self.played_frames is None else min(played, self.played_frames)
        if self.cancelled:
            return
        self.cancelled = True
        if self.pump is not None:
            self.pump.cancel()  # the codec stream closes when the pump has stopped (_end_response)
        while not self._queue.empty():  # chunks not yet taken are never played: none after a cancel
            self._queue.get_nowait()
        self._queue.put_nowait(_END)
        self.delivered.set()

    def confirm(self) -> None:
        """The speculative answer stands (the user's turn did end): from now on it is a plain answer."""
        self.speculation = None

    def discard(self) -> None:
        """The speculative answer never happened: generation stops, the history is restored as it was
        before it, and the user turn it answered goes on (its frames and prefill kept). Idempotent."""
        if self.discarded:
            return
        if self.speculation is None:
            raise RuntimeError(f"response {self.id} is not an undecided speculative answer: cancel it instead")
        self.discarded = True
        self.cancel(0.0)
        self._on_discard(self)

    # --- the engine's side ---
    def deliver(self, item: AudioChunk | BaseException | object) -> None:
        if self.cancelled or self.delivered.is_set():  # late output of a cancelled answer is never played
            return
        self._queue.put_nowait(item)
        if not isinstance(item, AudioChunk) or item.is_last:
            self.delivered.set()


def _as_float_pcm(pcm, what: str) -> np.ndarray:
    """Mono int16 or float in [-1, 1] -> float32."""
    pcm = np.asarray(pcm)
    if pcm.ndim != 1:
        raise ValueError(f"{what} must be mono 1-D samples, got shape {pcm.shape}")
    if pcm.dtype == np.int16:
        pcm = pcm.astype(np.float32) / 32768.0
    return pcm.astype(np.float32, copy=False)


def _sampling_config(options: ConversationOptions) -> SamplingConfig:
    return SamplingConfig(temperature=options.temperature, top_k=options.top_k, top_p=options.top_p, seed=options.seed)


class Conversation:
    """One dialogue. Methods are called from the event loop; see engine/service_api.py."""

    def __init__(self, engine: "Engine", session_id: str, options: ConversationOptions, rank: int = 0) -> None:
        self.id = session_id
        self._engine = engine
        self.rank = rank  # the engine rank (data parallelism) that runs all its requests: its prefix cache is there
        self._requested = options  # the client's (update_options); `_options` is what answers run with
        self._degradation = NO_DEGRADATION  # the gateway's overload control (degrade())
        self._options = options
        self._salt = engine.new_salt(session_id)
        self._turns: list[DialogueTurn] = []
        self._user: _UserTurn | None = None
        self._response: Response | None = None  # the latest, until it ended
        self._closed = False
        self._sampling = _sampling_config(options)
        self._prefill_task: asyncio.Task | None = None
        self.prefilled_requests = 0  # incremental prefills issued while the user talked
        self.last_prompt: np.ndarray | None = None  # the prompt of the latest response
        self._last: Response | None = None
        self.history_dropped = 0  # turns dropped from the head of the history (context management)
        self._exchanges: list[str] = []  # the response id of each exchange in `_turns` (2 turns each)
        # history edits that change the prefix-cache salt: turns the client deleted from the middle of
        # the history, and discarded speculative answers whose flushed user frames filled a cache block
        self._resalts = 0
        engine.check_text_options(options)
        self._speaker: asyncio.Future | None = self._tokenize_speaker(options.speaker_prompt_pcm)
        self._system_ids: tuple[int, ...] = engine.system_ids(options.system_prompt)

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
        self._engine.check_text_options(options)
        old = self._options.speaker_prompt_pcm
        new = options.speaker_prompt_pcm
        if (old is None) != (new is None) or (new is not None and not np.array_equal(old, new)):
            self._speaker = self._tokenize_speaker(new)
            # the prompt's prefix changed: a new salt keeps the old prefix's KV out of reach
            self._salt = self._engine.new_salt(self.id)
        system = self._engine.system_ids(options.system_prompt)
        if system != self._system_ids:
            self._system_ids = system
            self._salt = self._engine.new_salt(self.id)
        self._requested = options
        self._options = self._degradation.apply(options)
        self._sampling = _sampling_config(options)

    def degrade(self, degradation: Degradation) -> None:
        """Overload: the next answers run with `degradation.apply(options)` (no CFG shadow, a shorter cap)."""
        self._degradation = degradation
        self._options = degradation.apply(self._requested)

    def _tokenize_speaker(self, pcm: np.ndarray | None) -> asyncio.Future | None:
        """The speaker prompt's frames (at most the checkpoint's speaker_prompt_length), tokenized off the loop."""
        if pcm is None:
            return None
        pcm = _as_float_pcm(pcm, "the speaker prompt")
        if pcm.size == 0:
            return None
        pcm = pcm[: self._engine.prompt_layout.speaker_prompt_length * SAMPLES_PER_FRAME]
        return self._engine.tokenize(self._engine.new_tokenizer_state(), pcm, finish=True)

    def _head(self, system_ids: tuple[int, ...] | None = None) -> dict:
        """What precedes the first turn, as the dialogue functions take it: the voice and the system text
        (`system_ids`: one answer's own; None: the conversation's)."""
        return {"speaker_frames": self._speaker_frames(), "system_ids": self._system_ids if system_ids is None else system_ids,
                "layout": self._engine.prompt_layout}

    def _answer_system_ids(self, instructions: str | None) -> tuple[int, ...] | None:
        """One answer's own system text (respond(instructions=...)), or None when it reads the conversation's:
        none given, the same ids, or a model without text (which ignores them, logged as the session's are)."""
        if instructions is None:
            return None
        ids = self._engine.system_ids(instructions)  # () without text: the conversation's are () too
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
        pcm = _as_float_pcm(pcm_16k, "user audio")
        if self._user is None:
            self._user = _UserTurn(tokenizer_state=self._engine.new_tokenizer_state())
        user = self._user
        job = self._engine.tokenize(user.tokenizer_state, pcm, finish=False)
        user.last_job = job
        job.add_done_callback(lambda f, u=user: self._on_frames(u, f))

    def end_user_turn(self) -> None:
        """The user's turn is complete (VAD end of speech, or a client commit)."""
        self._check_open()
        self._check_decided()
        if self._user is None:
            self._user = _UserTurn(tokenizer_state=self._engine.new_tokenizer_state())
        user = self._user
        if user.done is not None:
            return
        job = self._engine.tokenize(user.tokenizer_state, None, finish=True)
        user.done = job
        job.add_done_callback(lambda f, u=user: self._on_frames(u, f))

    def add_user_text(self, text: str) -> None:
        """A typed user turn: it ends the open audio turn (if any) and joins it in the next exchange."""
        self._check_open()
        self._check_decided()
        if not text or not text.strip():
            raise ValueError("a user text turn needs non-empty text")
        tokenizer = self._engine.require_text()
        self.end_user_turn()
        self._user.text_ids.extend(int(i) for i in tokenizer.encode(text))

    def _on_frames(self, user: _UserTurn, fut: concurrent.futures.Future | asyncio.Future) -> None:
        if fut.cancelled() or fut.exception() is not None:
            return
        frames = fut.result()
        if len(frames):
            user.frames.append(frames)
        self._maybe_prefill(user)

    def _maybe_prefill(self, user: _UserTurn) -> None:
        conf = self._engine.config
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
        prompt = stable_user_prefix(self._turns[fit.drop :], user.all_frames(), **self._head())
        salt = self._salt_at(self.history_dropped + fit.drop)
        self._prefill_task = asyncio.ensure_future(self._engine.prefill(prompt, salt, self.rank))
        self.prefilled_requests += 1

    # --- the answer --------------------------------------------------------------------------

    def respond(self, response_id: str, speculative: bool = False, instructions: str | None = None) -> Response:
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
        response = Response(response_id)
        response.system_ids = self._answer_system_ids(instructions)
        if speculative and (self._user is None or self._user.done is None):
            open_turn = self._user or _UserTurn(tokenizer_state=self._engine.new_tokenizer_state())
            user = self._fork_ended(open_turn)
            response.speculation = _Speculation(user=open_turn, last=self._last)
            response._on_discard = self._discarded
        else:
            if self._user is None or self._user.done is None:
                self.end_user_turn()
            user = self._user
        self._user = None
        self._response = self._last = response
        response.task = asyncio.ensure_future(self._generate(response, user, prev))
        return response

    def _fork_ended(self, user: _UserTurn) -> _UserTurn:
        """A copy of the open turn `user`, ended: its frames so far, then what the tokenizer flushes from
        a copy of its state. `user` itself stays open (the tokenizer thread runs jobs in order, so the
        copy is taken after every push already queued, and its frames arrive after theirs)."""
        fork = _UserTurn(tokenizer_state=None, prefilled_frames=user.prefilled_frames, drop=user.drop)
        fork.done = self._engine.tokenize(user.tokenizer_state, None, finish=True, fork=True)

        def take(fut: asyncio.Future) -> None:
            fork.frames = list(user.frames)
            fork.flushed_from = user.num_frames
            if not fut.cancelled() and fut.exception() is None and len(fut.result()):
                fork.frames.append(fut.result())

        fork.done.add_done_callback(take)
        return fork

    def _discarded(self, response: Response) -> None:
        """`response.discard()`: the user turn goes on; the history is restored when its task ends."""
        spec = response.speculation
        self._user, self._last = spec.user, spec.last
        if response.ended:
            self._undo_speculation(response)

    def _undo_speculation(self, response: Response) -> None:
        spec = response.speculation
        if spec.history is not None:
            self._turns, self._exchanges, self.history_dropped = spec.history
            spec.history = None
        if spec.flushed_rows is not None:
            # Block hashes cover stream 0 only: a cached block that ends among the fork's flushed frames
            # could serve the continued turn the fork's aux streams. Only then is a new salt needed.
            lo, hi = spec.flushed_rows
            block = self._engine.config.kv_block_size
            if (hi // block) * block > lo:
                self._resalts += 1
            spec.flushed_rows = None

    async def _generate(self, response: Response, user: _UserTurn, prev: Response | None) -> None:
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
                first = len(history_rows(self._turns[fit.drop :], **self._head(response.system_ids))) + 2
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
                response._transcript.put_nowait(_END)
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

    async def _answer(self, response: Response, fit: ContextFit) -> None:
        """The answer's generation: its text first (assistant_text), then its audio (output_audio)."""
        head, opts = self._head(response.system_ids), self._options
        salt = self._salt_at(self.history_dropped)
        if opts.assistant_text:
            self.last_prompt = response_prompt(self._turns, text_first=True, **head)
            text = AudioRequest(prompt=self.last_prompt, max_frames=0, start_modality=vocab.TEXT_BPE,
                                max_text_tokens=opts.max_text_tokens, min_text_tokens=1, sampling=self._sampling,
                                cache_salt=salt, realtime=True)
            await self._engine.run_text(text, response, self.rank)
            if response.delivered.is_set():  # it failed
                return
            if not opts.output_audio:
                response.deliver(AudioChunk(response.id, np.zeros(0, np.int16), 0.0, 0.0, time.monotonic(), is_last=True))
                return
            self.last_prompt = answer_audio_prompt(self._turns, response.text_ids, **head)
        else:
            self.last_prompt = response_prompt(self._turns, **head)
        max_frames = fit.max_frames
        if guidance.uses_cfg(opts.cfg_scale):
            max_frames = self._engine.guided_max_frames(len(self.last_prompt), max_frames)
        request = AudioRequest(prompt=self.last_prompt, max_frames=max_frames, min_frames=1, sampling=self._sampling,
                               cache_salt=salt, realtime=True, cfg_scale=opts.cfg_scale)
        await self._engine.run_response(request, response, self.rank)

    async def _transcribe_user(self, response: Response) -> None:
        """The user turn's text as the dialogue model writes it (`9 35` after the user's audio: ESPnet's
        dialogue recipe trains the user text as a target), beside the answer: an offline request that
        shares the answer's prompt prefix in the cache. The history keeps the audio only."""
        try:
            prompt = np.concatenate([history_rows(self._turns, **self._head()),
                                     special_rows(vocab.USER, vocab.TEXT_BPE)])
            room = self._engine.max_model_len - len(prompt) - 4
            if room < 2:
                return
            request = AudioRequest(prompt=prompt, max_frames=0, start_modality=vocab.TEXT_BPE,
                                   max_text_tokens=min(self._options.max_text_tokens, room - 1), min_text_tokens=1,
                                   sampling=SamplingConfig(temperature=0.0), cache_salt=self._salt_at(self.history_dropped))
            async for delta in self._engine.text_deltas(request, f"{response.id}#user_text", self.rank):
                response._transcript.put_nowait(delta)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the transcript fails alone; the answer goes on
            log.exception("transcript of the user turn of %s failed", response.id)
            response._transcript.put_nowait(e)
        finally:
            response._transcript.put_nowait(_END)

    async def _tokenized(self, user: _UserTurn) -> BaseException | None:
        """Wait for the tokenizer to flush the turn (its frames are then in `user`) and for the speaker
        prompt (queued before it: already done); their failure, if any, is returned, not raised."""
        try:
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
        return fit_context(self._turns, user_frames, self._engine.max_model_len, self._max_frames(),
                           self._options.retention_ratio, speaker_frames=0 if speaker is None else len(speaker),
                           at_least=at_least, max_text_tokens=text, system_tokens=len(system),
                           layout=self._engine.prompt_layout)

    def _salt_at(self, first_turn: int) -> str:
        """The prefix-cache salt of prompts whose history starts at the conversation's turn `first_turn`.
        Within one salt equal stream-0 prefixes must have equal aux streams (block hashes cover stream 0
        only); a history starting at another turn could break that (two turns opening alike in stream 0
        alone, e.g. on silence), so each truncation point has its own salt; so does each deletion, which
        can bring two such turns together (a cut answer needs none: its end differs in stream 0)."""
        salt = self._salt if first_turn == 0 else f"{self._salt}@{first_turn}"
        return salt if not self._resalts else f"{salt}~{self._resalts}"

    def _drop_turns(self, n: int, response: Response) -> None:
        """Drop the `n` oldest turns (whole exchanges: fit_context cuts before a user turn)."""
        if n:
            frames = sum(len(t.frames) for t in self._turns[:n])
            response.dropped_exchanges = tuple(self._exchanges[: n // 2])
            del self._turns[:n], self._exchanges[: n // 2]
            self.history_dropped += n
            log.info("conversation %s: context full, dropped the %d oldest turns (%.1f s of audio) before response %s; "
                     "%d turns kept, %d dropped in all (max_model_len %d)", self.id, n, frames * FRAME_MS / 1000.0,
                     response.id, len(self._turns), self.history_dropped, self._engine.max_model_len)

    def _too_long(self, fit: ContextFit) -> str:
        limit = self._engine.max_model_len
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

    def _end_response(self, response: Response) -> None:
        self._engine.close_stream(response.id)
        if response.transcriber is None:  # never started (a failure, a cancel): the transcript is empty
            response._transcript.put_nowait(_END)
        elif response.discarded:  # the exchange never happened
            response.transcriber.cancel()
        if response.discarded:
            self._undo_speculation(response)
        elif response.turn is not None:
            frames = np.concatenate(response.frames) if response.frames else response.turn.frames
            if response.played_frames is not None:
                frames = frames[: response.played_frames]
            response.turn.frames = frames
            response.turn.text_ids = list(response.text_ids)  # the text written (and shown) so far
            self._turns.append(response.turn)
        response.ended = True
        response.deliver(_END)
        if self._response is response:
            self._response = None
            if response.system_ids is not None and response.speculation is None and not response.discarded:
                self._prefill_history()

    def _prefill_history(self) -> None:
        """After an answer that read its own instructions: the history, laid out with the conversation's
        system text, into the prefix cache. That answer's prompt had another system segment, so none of
        the history's blocks past the speaker prompt are cached; without this the next answer would
        prefill it all (unless the user speaks long enough for the incremental prefill to do it)."""
        conf = self._engine.config
        if self._closed or not conf.incremental_prefill or guidance.uses_cfg(self._options.cfg_scale):
            return  # (CFG pairs do not read the prefix cache)
        if self._prefill_task is not None and not self._prefill_task.done():
            return
        if self._speaker is not None and not self._speaker.done():
            return  # a new voice, still being tokenized: the history's layout is not known yet
        prompt = history_rows(self._turns, **self._head())
        self._prefill_task = asyncio.ensure_future(self._engine.prefill(prompt, self._salt_at(self.history_dropped), self.rank))

    def truncate(self, response_id: str, played_ms: float) -> None:
        """The client played only `played_ms` of an answer still in the history (the latest may still
        have been playing, or generating, when the user interrupted): the history keeps that much."""
        if self._last is not None and self._last.id == response_id:
            self._last.cancel(played_ms)
            return
        _, answer = self._exchange(response_id)
        if answer is not None:
            answer.frames = answer.frames[: _played_frames(played_ms)]

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
            r.discard()  # the user's turn had not ended: it goes on if they come back
        elif r is not None:
            r.cancel(float("inf"))
        self._engine.set_suspended(self.id, True)

    def resume(self) -> None:
        self._check_open()
        self._engine.set_suspended(self.id, False)

    async def close(self) -> None:
        if self._closed:
            return
        if self._response is not None:
            self._response.cancel(float("inf"))
        if self._last is not None and self._last.transcriber is not None:
            self._last.transcriber.cancel()
        if self._prefill_task is not None:  # KV for a prompt no answer will read (vLLM aborts the request)
            self._prefill_task.cancel()
        self._closed = True
        self._engine.forget(self.id)

    @property
    def history(self) -> list[HistoryTurn]:
        role = {vocab.USER: Role.USER, vocab.ASSISTANT: Role.ASSISTANT}
        return [HistoryTurn(role=role[t.role], audio_frames=len(t.frames)) for t in self._turns if not t.deleted]

    def next_prompt(self) -> np.ndarray:
        """The prompt the next response would start from (for tests and debugging)."""
        return response_prompt(self._turns, **self._head())

    def _check_open(self) -> None:
        if self._closed:
            raise ConversationClosed(f"conversation {self.id} is closed")

    def _check_decided(self) -> None:
        r = self._response
        if r is not None and r.speculation is not None and not r.discarded:
            raise RuntimeError(f"response {r.id} is speculative: confirm or discard it before the user turn changes")


class Engine:
    """vLLM engine + tokenizer + codec stage, shared by all conversations of a process."""

    def __init__(self, config: EngineServiceConfig) -> None:
        self.config = config
        self._conversations: dict[str, Conversation] = {}
        self._suspended: set[str] = set()  # open, but their clients are away: no slot held
        self._salt_ids = itertools.count()
        self._ready = False
        self._stopped = False
        ranks = config.data_parallel_size
        self._capacity = CapacityModel(max_conversations=min(config.max_conversations, ranks * config.max_num_seqs),
                                       margin=config.capacity_margin, ranks=ranks, rank_max=config.max_num_seqs)
        self._feedback = LatenessFeedback()
        self._host_task: asyncio.Task | None = None
        self._limited_by = ""
        self._tok_pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenizer")
        self.model_dir: Path | None = None
        self.text_tokenizer: TextTokenizer | None = None  # None: the model reads and writes no text
        self.prompt_layout: PromptLayout = DEFAULT_LAYOUT  # the checkpoint's (engine/layout.py), read at start

    @classmethod
    async def start(cls, config: EngineServiceConfig | None = None) -> "Engine":
        self = cls(config or EngineServiceConfig())
        await self._start()
        return self

    async def _start(self) -> None:
        from engine.async_engine import AsyncOpusEngine, EngineConfig
        from engine.codec.dac import DAC
        from engine.codec.ssl import load_ssl
        from engine.codec.stage import CodecStage
        from engine.codec.streaming import StreamConfig
        from engine.codec.tokenizer import AudioTokenizer
        from engine.model_source import resolve_model
        from engine.tiny import ensure_tiny

        cfg = self.config
        loop = asyncio.get_running_loop()
        # a hub id may download: off the loop
        model = await loop.run_in_executor(None, resolve_model, cfg.model) if cfg.model else await loop.run_in_executor(None, ensure_tiny)
        self.model_dir = model
        self.prompt_layout = load_config(model).prompt_layout  # the speaker prompt's length, as trained

        def load_audio():
            import torch

            torch.set_num_threads(1)  # codec and tokenizer threads: one core each, no oversubscription
            device = cfg.codec_device
            if device == "auto":  # the codec runs on the engine's device (docs/architecture.md)
                device = "cuda" if torch.cuda.is_available() else "cpu"
            dac = DAC.from_dir(model, device=device)
            return dac, AudioTokenizer(dac, load_ssl(model, device=device))

        dac, self._tokenizer = await loop.run_in_executor(self._tok_pool, load_audio)
        try:
            self.text_tokenizer = await loop.run_in_executor(self._tok_pool, TextTokenizer.from_dir, model)
        except NoTextTokenizerError:
            log.warning("the model has no text tokenizer: no ASR, TTS or transcripts")
        self._codec = CodecStage(
            dac,
            StreamConfig(first_chunk_frames=cfg.first_chunk_frames, chunk_frames=cfg.chunk_frames),
            max_batch=cfg.codec_max_batch,
            first_audio_budget_s=cfg.first_audio_budget_ms / 1000.0,
        )
        self._codec.start()
        self.llm = await AsyncOpusEngine.start(
            EngineConfig(
                model=str(model),
                max_num_seqs=cfg.max_num_seqs,
                dtype=cfg.dtype,
                max_model_len=cfg.max_model_len,
                max_num_batched_tokens=cfg.max_num_batched_tokens,
                enable_chunked_prefill=cfg.enable_chunked_prefill,
                kv_cache_gib=cfg.kv_cache_gib,
                block_size=cfg.kv_block_size,
                pacing_lead_ms=cfg.pacing_lead_ms,
                cpu_threads=engine_cpu_threads(cfg.cpu_threads, dac.device.type, cfg.data_parallel_size),
                first_chunk_frames=cfg.first_chunk_frames,
                enforce_eager=cfg.enforce_eager,
                seed=cfg.seed,
                data_parallel_size=cfg.data_parallel_size,
            )
        )
        threads = await self.llm.rank_threads()
        if len(threads) == 1:
            log.info("engine core torch threads: %d (engine.cpu_threads); codec and tokenizer on %s", threads[0], dac.device.type)
        else:
            log.info("%d engine ranks (engine.data_parallel_size), torch threads each: %s (engine.cpu_threads); codec and "
                     "tokenizer on %s", len(threads), threads, dac.device.type)
        # the cpu resource: the machine's cores, shared by this process, the engine core and everything else
        self._capacity.cpu_cores = float(len(os.sched_getaffinity(0)))
        self._capacity.codec_on_host = dac.device.type == "cpu"
        if cfg.warmup:
            await loop.run_in_executor(self._tok_pool, self._warm_audio_path, dac)
            await self._warmup()
        self._meter = HostMeter()
        self._host_task = asyncio.ensure_future(self._watch_host())
        self._ready = True

    async def _watch_host(self, every_s: float = 1.0) -> None:
        """Once a second: the machine's CPU use into the capacity model; the feedback's ceiling recovers."""
        while True:
            await asyncio.sleep(every_s)
            try:
                self._observe_host(time.monotonic())
            except Exception:  # a measurement failure must not stop admission control
                log.exception("capacity: host measurement failed")

    def _observe_host(self, now: float) -> None:
        sample = self._meter.sample()
        if sample is not None:
            self._capacity.observe_host(now, sample.interval_s, self._active(), sample.process_cpu + sample.children_cpu,
                                        sample.other_cpu)
        self._feedback.tick(now, self._capacity.capacity())
        self._log_capacity()

    def report_delivery(self, chunks: int, late_chunks: int, underruns: int) -> None:
        """What the gateway's sessions got since the last report: `chunks` audio chunks, `late_chunks` of
        them so late that the client's lead ran out, `underruns` reported by clients (each counts as late)."""
        self._feedback.record(self._active(), time.monotonic(), chunks, late_chunks + underruns,
                              f"{underruns} underruns reported" if underruns else "")
        if self._feedback.reasons:  # (called several times a second per session: log only a change)
            self._log_capacity()

    def _log_capacity(self) -> None:
        for why in self._feedback.reasons:
            log.warning("capacity: %s", why)
        self._feedback.reasons.clear()
        limited = self._capacity.limited_by(self._feedback.ceiling)
        if limited != self._limited_by:
            self._limited_by = limited
            log.info("capacity %d, limited by %s (bounds %s)", self.capacity(), limited, self._capacity.bounds())

    def _warm_audio_path(self, dac) -> None:
        """First calls into torch kernels are slow: run the tokenizer and a codec decode once, and
        measure the codec's real-time factor for admission control."""
        import torch

        from engine.codec.synth import speech_like

        self._tokenizer.tokenize(speech_like(0.5, seed=0))
        t0 = time.perf_counter()
        self._tokenizer.tokenize(speech_like(2.0, seed=1))
        self._capacity.tokenizer_rtf = (time.perf_counter() - t0) / 2.0
        codes = torch.zeros(1, vocab.NUM_CODEBOOKS, 16, dtype=torch.long)
        dac.decode(codes)
        t0 = time.perf_counter()
        dac.decode(torch.zeros(4, vocab.NUM_CODEBOOKS, 16, dtype=torch.long))
        self._capacity.codec_rtf = (time.perf_counter() - t0) / (4 * 16 * FRAME_MS / 1000.0)

    async def _warmup(self) -> None:
        """Measure step time at a few batch sizes on every engine rank (admission control starts from
        these). The ranks warm up at once: each measures its steps with the others busy, as in service."""
        await asyncio.gather(*(self._warmup_rank(rank) for rank in range(self._capacity.ranks)))
        by_rank = [{b: round(ms, 2) for b, ms in sorted(times.items())} for times in self._capacity.rank_step_ms]
        log.info("engine warm: step ms by batch %s, codec rtf %.4f, tokenizer rtf %.4f, capacity %d (bounds %s)",
                 by_rank[0] if len(by_rank) == 1 else by_rank, self._capacity.codec_rtf,
                 self._capacity.tokenizer_rtf, self._capacity.capacity(), self._capacity.bounds())

    async def _warmup_rank(self, rank: int) -> None:
        from engine.prompt import synthetic_prompt

        top = min(self._capacity.max_conversations, self.config.max_num_seqs)
        for batch in sorted({1, min(4, top), min(8, top)}):
            reqs = [AudioRequest(synthetic_prompt(i, 10), 24, 24, SamplingConfig(temperature=0.0)) for i in range(batch)]
            step_ms: list[float] = []

            async def run(r: AudioRequest) -> None:
                async for chunk in self.llm.stream_steps(r, rank=rank):
                    if chunk.engine_batch == batch == chunk.engine_tokens:
                        step_ms.append(chunk.engine_step_ms)

            await asyncio.gather(*(run(r) for r in reqs))
            if step_ms:
                self._capacity.observe(batch, float(np.median(step_ms)), rank)

    # --- conversations -----------------------------------------------------------------------

    def open_conversation(self, session_id: str, options: ConversationOptions | None = None) -> Conversation:
        if not self._ready:
            raise AtCapacity("engine is not ready")
        if session_id in self._conversations:
            raise ValueError(f"conversation {session_id!r} is already open")
        self._check_room()
        rank = self._capacity.pick_rank(self._rank_active())
        self._check_rank_room(rank)
        conv = Conversation(self, session_id, options or ConversationOptions(), rank)
        self._conversations[session_id] = conv
        return conv

    def _check_room(self) -> None:
        cap, active = self.capacity(), self._active()
        if active >= cap:
            raise AtCapacity(f"server at capacity: {active} conversations active, {cap} can respond in real time")

    def _check_rank_room(self, rank: int) -> None:
        """Admission per engine rank (data parallelism): a conversation is served by its rank alone.
        With one rank the server's check says it all; a fixed capacity_override has no per-rank part."""
        if self._capacity.ranks == 1 or self.config.capacity_override is not None:
            return
        active, cap = self._rank_active()[rank], max(1, self._capacity.rank_bound(rank))
        if active >= cap:
            raise AtCapacity(f"engine rank {rank} at capacity: {active} conversations active, {cap} can respond in real time")

    def _active(self) -> int:
        return len(self._conversations) - len(self._suspended)

    def _rank_active(self) -> list[int]:
        """Active (not suspended) conversations on each engine rank."""
        counts = [0] * self._capacity.ranks
        for sid, conv in self._conversations.items():
            if sid not in self._suspended:
                counts[conv.rank] += 1
        return counts

    def set_suspended(self, session_id: str, suspended: bool) -> None:
        """A conversation's slot freed (its client is away) or taken again (AtCapacity when none is free)."""
        if suspended:
            if session_id in self._conversations:
                self._suspended.add(session_id)
        elif session_id in self._suspended:
            self._check_room()
            self._check_rank_room(self._conversations[session_id].rank)  # it comes back to its own rank
            self._suspended.discard(session_id)

    def capacity(self) -> int:
        if self.config.capacity_override is not None:
            return self.config.capacity_override
        # never refuse everyone: one conversation is served even on an overloaded box
        return max(1, self._capacity.capacity(self._feedback.ceiling))

    def health(self) -> EngineHealth:
        # (several engine ranks: load().extra["ranks"], and /healthz's `ranks`, tell them apart)
        if self._ready and self.llm.errored:
            return EngineHealth(ready=False, detail="engine_failed")
        return EngineHealth(ready=self._ready, detail="ready" if self._ready else "stopped" if self._stopped else "starting")

    def load(self) -> EngineLoad:
        """The whole server's load; with several engine ranks the step time is the slowest rank's at its
        own batch, the batch size their mean, and `extra["ranks"]` has each rank's figures."""
        model = self._capacity
        active = self._rank_active()
        responding = [0] * model.ranks
        for conv in self._conversations.values():
            if conv.responding:
                responding[conv.rank] += 1
        extra = {"limited_by": "capacity_override" if self.config.capacity_override is not None
                 else model.limited_by(self._feedback.ceiling), "bounds": model.bounds(),
                 "feedback_ceiling": self._feedback.ceiling,
                 "live_step_batches": model.live_samples(),  # 0: the engine bound is still the warm-up's
                 "cpu_per_session": round(model.cpu_cost_per_session(), 4),
                 "other_cpu": round(model.other_cpu, 3), "fixed_cpu": round(model.fixed_cpu, 3)}
        step_ms = [model.predicted_step_ms(max(n, 1), r) for r, n in enumerate(responding)]
        if model.ranks > 1:
            extra["ranks"] = [{"rank": r, "conversations": active[r], "responding": responding[r], "engine_bound": bound,
                               "step_ms": round(step_ms[r], 3)} for r, bound in enumerate(model.rank_bounds())]
        return EngineLoad(
            conversations=self._active(),
            responding=sum(responding),
            capacity=self.capacity(),
            step_ms=max(step_ms),
            batch_size=sum(responding) / model.ranks,
            chunks_late=self._codec.stats.late_chunks if self._ready else 0,
            extra=extra,
        )

    async def shutdown(self) -> None:
        if self._host_task is not None:
            self._host_task.cancel()
        for conv in list(self._conversations.values()):
            await conv.close()
        self._ready, self._stopped = False, True
        if hasattr(self, "_codec"):
            self._codec.stop()
        if hasattr(self, "llm"):
            self.llm.shutdown()
        self._tok_pool.shutdown(wait=False, cancel_futures=True)

    # --- one-shot requests (engine/oneshot.py) -------------------------------------------------

    def transcribe(self, pcm_16k: np.ndarray, options: TranscriptionOptions | None = None) -> AsyncIterator[str]:
        from engine import oneshot

        return oneshot.transcribe(self, pcm_16k, options or TranscriptionOptions())

    def synthesize(self, text: str, options: SpeechOptions | None = None) -> AsyncIterator[AudioChunk]:
        from engine import oneshot

        return oneshot.synthesize(self, text, options or SpeechOptions())

    @property
    def ready(self) -> bool:
        return self._ready

    @property
    def supports_text(self) -> bool:
        return self.text_tokenizer is not None

    def require_text(self) -> TextTokenizer:
        if self.text_tokenizer is None:
            raise NoTextModel("this model has no text tokenizer: it reads and writes audio only")
        return self.text_tokenizer

    def system_ids(self, system_prompt: str | None) -> tuple[int, ...]:
        """The system text's global ids; () when there is none, or when the model reads no text (a client's
        instructions are then not honoured: logged, not refused, since most clients send some)."""
        if not system_prompt or not system_prompt.strip():
            return ()
        if self.text_tokenizer is None:
            log.info("instructions ignored: the model reads no text")
            return ()
        ids = tuple(int(i) for i in self.text_tokenizer.encode(system_prompt))
        cap = self.max_model_len // 4  # the conversation keeps most of the context
        if len(ids) > cap:
            log.warning("instructions cut to their first %d of %d tokens (a quarter of the context)", cap, len(ids))
        return ids[:cap]

    def check_text_options(self, options: ConversationOptions) -> None:
        """NoTextModel / ValueError for text options this engine cannot honour."""
        if options.transcribe_user or options.assistant_text:
            self.require_text()
        if not options.output_audio and not options.assistant_text:
            raise ValueError("a text-only answer (output_audio False) needs assistant_text")
        if options.max_text_tokens < 1:
            raise ValueError(f"max_text_tokens must be >= 1, got {options.max_text_tokens}")

    async def text_deltas(self, request: AudioRequest, request_id: str, rank: int = 0,
                          ids: list[int] | None = None) -> AsyncIterator[str]:
        """A text-first request's text as it is written: decoded deltas (engine.text.TextDeltas); the
        text ids themselves are appended to `ids` as they arrive, if given."""
        splitter, deltas = ModalitySplitter(request.start_modality), TextDeltas(self.require_text())
        async for chunk in self.llm.stream_steps(request, request_id, rank):
            new = splitter.push(chunk.steps)[0]
            if ids is not None:
                ids.extend(new)
            delta = deltas.push(new)
            if delta:
                yield delta
        tail = deltas.flush()
        if tail:
            yield tail

    async def run_text(self, request: AudioRequest, response: Response, rank: int = 0) -> None:
        """An answer's text (text-first, no switch): each delta delivered as a chunk without audio, the
        ids kept on the response (the history's assistant text)."""
        try:
            async for delta in self.text_deltas(request, f"{response.id}#text", rank, ids=response.text_ids):
                response.deliver(AudioChunk(response.id, np.zeros(0, np.int16), 0.0, 0.0, time.monotonic(), text_delta=delta))
        except asyncio.CancelledError:
            raise
        except Exception as e:
            log.exception("response %s failed while writing its text", response.id)
            response.deliver(e)

    def pick_rank(self) -> int:
        """The engine rank with the most headroom now (data parallelism)."""
        return self._capacity.pick_rank(self._rank_active())

    async def tokenize_clip(self, pcm: np.ndarray) -> np.ndarray:
        """A whole clip (16 kHz mono) -> its frames [T, 9], in the tokenizer thread."""
        return await self.tokenize(self.new_tokenizer_state(), _as_float_pcm(pcm, "audio"), finish=True)

    async def stream_audio(self, request: AudioRequest, response_id: str) -> AsyncIterator[AudioChunk]:
        """An audio request outside any conversation, decoded by the codec stage: its chunks in order.
        Closing the iterator early aborts it."""
        response = Response(response_id)
        response.pump = asyncio.ensure_future(self.run_response(request, response, self.pick_rank()))
        try:
            async for chunk in response.chunks():
                yield chunk
        finally:
            if not response.pump.done():
                response.pump.cancel()
                await asyncio.wait([response.pump])
            self.close_stream(response_id)

    # --- work for conversations ----------------------------------------------------------------

    def new_salt(self, session_id: str) -> str:
        """A prefix-cache salt no other conversation (or earlier prompt prefix) has used."""
        return f"conv:{session_id}:{next(self._salt_ids)}"

    def new_tokenizer_state(self):
        return self._tokenizer.new_state()

    def forget(self, session_id: str) -> None:
        """A closed conversation no longer counts for capacity."""
        self._conversations.pop(session_id, None)
        self._suspended.discard(session_id)

    def close_stream(self, response_id: str) -> None:
        self._codec.close(response_id)

    def tokenize(self, state, pcm: np.ndarray | None, finish: bool, fork: bool = False) -> asyncio.Future:
        """Feed audio (or the end of the turn) to the tokenizer thread; resolves to new frames.
        `fork`: work on a copy of `state` (taken in the thread, after the jobs queued before), which
        is left as it was."""
        tok = self._tokenizer

        def job() -> np.ndarray:
            nonlocal state
            if fork:
                state = copy.deepcopy(state)
            if pcm is not None:
                tok.push(state, pcm)
            if finish:
                tok.finish(state)
            while tok.ready(state):
                tok.step([state])
            return tok.take(state)

        return asyncio.wrap_future(self._tok_pool.submit(job))

    @property
    def max_model_len(self) -> int:
        """The model's context in positions (prompt and answer together): what a prompt must fit."""
        return self.llm.max_model_len

    def guided_max_frames(self, prompt_len: int, wanted: int) -> int:
        """A guided answer's frame cap: a CFG pair prefills whole (engine/README.md), so the
        prompt and the answer, twice, must fit one step's token budget."""
        fits = self.llm.cfg_max_steps(prompt_len) - MAX_DELAY
        if fits < 1:
            raise EngineError(
                f"the conversation ({prompt_len} positions) is too long for guidance (cfg_scale) with "
                f"max_num_batched_tokens={self.llm.max_batched_tokens}; use cfg_scale 1"
            )
        return min(wanted, fits)

    async def prefill(self, prompt: np.ndarray, salt: str, rank: int = 0) -> None:
        req = AudioRequest(prompt=prompt, max_frames=1, sampling=SamplingConfig(temperature=0.0),
                           cache_salt=salt, prefill_only=True)
        try:
            async for _ in self.llm.stream_steps(req, rank=rank):
                pass
        except Exception:  # a failed prefill only costs time at the end of the turn
            log.exception("incremental prefill failed")

    async def run_response(self, request: AudioRequest, response: Response, rank: int = 0) -> None:
        """vLLM steps (on engine rank `rank`) -> complete frames -> codec stage; PCM chunks come back via
        the sink. The response's id is the vLLM request id and the codec stream id."""
        loop = asyncio.get_running_loop()

        def sink(pcm_chunk) -> None:  # codec-stage thread
            loop.call_soon_threadsafe(response.deliver, self._audio_chunk(response.id, pcm_chunk))

        self._codec.open(response.id, sink)
        assembler = FrameAssembler()
        try:
            async for step_chunk in self.llm.stream_steps(request, response.id, rank):
                response.cached_tokens = max(response.cached_tokens, step_chunk.num_cached_tokens)
                if step_chunk.engine_tokens == step_chunk.engine_batch:  # pure decode steps only
                    self._capacity.observe(step_chunk.engine_batch, step_chunk.engine_step_ms, rank, time.monotonic())
                new = [assembler.push(row) for row in step_chunk.steps]
                frames = np.concatenate(new) if new else np.zeros((0, vocab.NUM_STREAMS), np.int64)
                if len(frames):
                    response.frames.append(frames)
                    self._codec.push(response.id, frames)
            self._codec.finish(response.id)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # surface engine failures to the consumer, not just the log
            log.exception("response %s failed", response.id)
            response.deliver(e)

    @staticmethod
    def _audio_chunk(response_id: str, pcm_chunk) -> AudioChunk:
        pcm = np.clip(np.round(pcm_chunk.pcm * 32767.0), -32768, 32767).astype(np.int16)
        return AudioChunk(
            response_id=response_id,
            pcm=pcm,
            start_ms=1000.0 * pcm_chunk.start_sample / vocab.SAMPLE_RATE_HZ,
            duration_ms=1000.0 * len(pcm) / vocab.SAMPLE_RATE_HZ,
            deadline=pcm_chunk.deadline_s,
            is_last=pcm_chunk.is_last,
        )
