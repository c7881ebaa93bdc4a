"""A deterministic stand-in for `engine.service.Engine`, for gateway tests without vLLM or a model.

It implements the contract of engine/service_api.py (`EngineLike`, `Conversation`, `ResponseHandle`)
and records every call the gateway makes, so a test can assert on them. It imports only numpy,
asyncio and engine.service_api.

The answer's audio is a known function of (conversation index, response index, sample position):
`answer_pcm()`, a sawtooth ramp whose value at each of 65536 consecutive positions is distinct, so a
test can tell exactly which samples of which answer reached the client.

Pacing is a step clock: one asyncio task per response produces a chunk of `chunk_ms` every `step_s`
seconds of wall time (0: one event-loop turn per chunk), `answer_ms` in all; `fail_after_chunks=N`
makes the response fail (an `EngineError` from `chunks()`) after N chunks (`AnswerPlan`: the engine's,
copied by each conversation, fixed by each response at `respond()`).

Semantics, from the docstrings of service_api.py, plus the fake's own definite choices:
- `respond()` returns at once (call it on a running event loop: it starts the response's task);
  generation starts when the previous response has ended (a cancelled
  one winds down at its next step, i.e. within `step_s`).
- `respond()` while another response is generating (or waiting to) and not cancelled raises
  `ResponseInProgress`. It ends the user turn if it is open; with no user turn since the last
  answer it adds an empty one (as the engine does).
- `cancel(played_ms)` is idempotent; before the start the response never starts; after the end it
  cuts the history. The fake yields no chunk once `cancel()` has returned (chunks already queued
  are dropped), and `chunks()` then ends without `is_last`.
- The history: a user turn enters it at `end_user_turn()` with `samples // 320` frames; every
  `respond()` reserves the next assistant turn, which appears once the response has ended and keeps
  `min(generated frames, played_ms // 20)` frames (all generated frames if nothing cut it; 0 when
  it never started). Cuts (cancel after the end, `truncate`) only shorten: `min` of the cuts.
- Context: with `context_exchanges=N` (FakeEngine), `respond()` first drops the oldest exchanges
  (each response's user turn(s) and answer) so that at most N remain with the new one; the handle's
  `dropped_exchanges` names them (final at once: the fake knows at `respond()`).
- `truncate()` of an unknown or dropped response is ignored (recorded with `applied=False`); of an
  older one in the history it cuts that answer; of the latest one still running, it caps what the
  history will keep without stopping it.
- `delete_turn()` marks the exchange's user turn or answer deleted (out of `history`); raises
  `ResponseInProgress` while that response runs.
- `respond(id, speculative=True)` ends the open user turn into the history as `respond()` does, but
  keeps its audio; `discard()` takes the exchange (and any exchanges dropped for it) back out, reopens
  the turn with that audio, and the next answer gets the index this one had (its audio is what it
  would have been without the speculation). Pushing audio while undecided raises RuntimeError.

Text (engine/service.py's, with deterministic words; `FakeEngine(text_model=False)`: a model without a
text tokenizer, `supports_text` False, and the text options and `add_user_text` raise `NoTextModel`):
- `assistant_text`: the answer writes its text first, one word per step as chunks with `text_delta`,
  empty pcm and duration 0, then its audio (without text). The text is `AnswerPlan.text`, or
  `answer_text(conv_index, response_index)`. `output_audio=False`: no audio at all; the text, then
  a last chunk with empty pcm and `is_last`. Without `assistant_text` an answer carries no text.
- `transcribe_user`: `user_transcript()` yields `user_transcript_text(frames)` (the user audio the
  exchange's user turn holds, as the engine got it) one word per step, beside the answer; nothing when
  the turn holds no audio or transcription was not asked for. A cancel does not stop it (the engine's
  does not), a discard or a close ends it; `AnswerPlan.transcript_fail_after=N` raises an
  `EngineError` after N words.
- `add_user_text(text)` ends the open audio turn and joins it: the exchange's user turn holds both
  (its `HistoryTurn.text`). Empty text: ValueError.
- `respond(id, instructions=...)`: the answer's own system text, recorded as given on the handle
  (`handle.instructions`; None: the conversation's `options.system_prompt`). It changes nothing else:
  the fake's answers do not depend on any system text.
- Options are fixed per response at `respond()` (the engine reads them when the answer starts: the
  gateway sets them before `respond()`); `output_audio=False` without `assistant_text`: ValueError.
  An answer is at most `max_response_ms` long (`min` with the plan's `answer_ms`).
- `degrade(d)` (overload control): the next answers run with `d.apply(options)` (`handle.options`; the
  conversation's `options` stay the client's); every call is recorded (`conv.degradations`).

Load (overload tests): with `row_s` > 0 every step of an answer takes `step_s + row_s * rows` seconds,
`rows` being the answers generating at that step (two for an answer with CFG, `cfg_scale` != 1), times
`slowdown` (set it mid-test: the machine turns out slower). `load()` then reports the engine's live
bound as the engine does (`extra["bounds"]["engine"]`: the rows whose step fits `margin` of a chunk's
audio) and its capacity is the smaller of that and `capacity`.

One-shot requests (the /v1/audio endpoints), async generators: their errors come at the first
`anext`, and each is recorded as a `OneShot` (`engine.transcriptions`, `engine.syntheses`) whose
`status` goes running -> completed (its last item taken) | cancelled (closed before) | failed.
- `transcribe(pcm)` yields `fake_transcript(pcm)` ("i heard 1500 milliseconds of audio": the
  audio's length as the engine got it) word by word, one delta every `oneshot_step_s`.
- `synthesize(text)` yields `speech_ms(text)` (60 ms a character, capped by `SpeechOptions.max_ms`)
  of `speech_pcm(text, ...)`, a sine whose frequency is `speech_hz(text)`, in `chunk_ms` chunks,
  one every `oneshot_step_s`, the last with `is_last`. Empty text: ValueError.
- Text budget: `text_budget()` for a context of `text_context` positions (4096), and
  `count_text_tokens(text)` one token per UTF-8 byte (`engine.token_counts` records each call's length);
  `synthesize` beyond the budget's `speech_tokens` raises `TextTooLong` at its first `anext`.
- `text_model=False`: both raise `NoTextModel`. `oneshot_capacity=N`: a request beyond N running at
  once (or any while `ready` is False) raises `AtCapacity`. `oneshot_fail_after=N`: an
  `EngineError` after N deltas or chunks.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import numpy as np

from engine.service_api import (
    FRAME_MS,
    NO_DEGRADATION,
    SAMPLE_RATE_HZ,
    AtCapacity,
    AudioChunk,
    ConversationClosed,
    ConversationOptions,
    Degradation,
    EngineError,
    EngineHealth,
    EngineLoad,
    HistoryTurn,
    NoTextModel,
    ResponseInProgress,
    Role,
    SpeechOptions,
    TextBudget,
    TextTooLong,
    TranscriptionOptions,
    uses_guidance,
)

SAMPLES_PER_MS = SAMPLE_RATE_HZ // 1000  # 16
SAMPLES_PER_FRAME = int(SAMPLE_RATE_HZ * FRAME_MS / 1000)  # 320


def answer_pcm(conv_index: int, response_index: int, start_sample: int, n: int) -> np.ndarray:
    """Samples [start_sample, start_sample + n) of answer `response_index` of conversation `conv_index`.

    A ramp of step 7 (odd, so the period is the full 65536 samples = 4.096 s), offset per
    conversation and response: int16 in [-32768, 32767].
    """
    pos = np.arange(start_sample, start_sample + n, dtype=np.int64)
    v = (pos * 7 + 4099 * response_index + 613 * conv_index) % 65536 - 32768
    return v.astype(np.int16)


def _now() -> float:
    """The running loop's time: time.monotonic() on an ordinary loop, virtual on a test's virtual-time
    loop (virtual_time.py), where chunk deadlines must be on the runner's clock."""
    return asyncio.get_running_loop().time()


def ms_to_samples(ms: float) -> int:
    return int(round(ms * SAMPLES_PER_MS))


def answer_text(conv_index: int, response_index: int) -> str:
    """The text an answer writes (assistant_text) when the plan names none."""
    return f"answer {response_index} of conversation {conv_index}"


def user_transcript_text(frames: int) -> str:
    """What the fake "hears" in a user turn of `frames` 20 ms frames: its length."""
    return f"you spoke for {frames * int(FRAME_MS)} milliseconds"


def fake_transcript(pcm: np.ndarray) -> str:
    """What the fake engine "hears" in 16 kHz `pcm`: its length."""
    return f"i heard {round(1000 * pcm.size / SAMPLE_RATE_HZ)} milliseconds of audio"


SPEECH_MS_PER_CHAR = 60.0


def speech_ms(text: str, max_ms: float = SpeechOptions().max_ms) -> float:
    return min(SPEECH_MS_PER_CHAR * len(text), max_ms)


def speech_hz(text: str) -> float:
    return 200.0 + 20.0 * (len(text) % 20)


def speech_pcm(text: str, start_sample: int, n: int) -> np.ndarray:
    """Samples [start_sample, start_sample + n) of the fake's speech for `text`: a sine at speech_hz(text)."""
    pos = np.arange(start_sample, start_sample + n, dtype=np.float64)
    return np.round(8000.0 * np.sin(2 * np.pi * speech_hz(text) * pos / SAMPLE_RATE_HZ)).astype(np.int16)


@dataclass
class OneShot:
    """One transcribe/synthesize call, as the fake saw it."""

    kind: str  # "transcribe" | "synthesize"
    options: TranscriptionOptions | SpeechOptions
    pcm: np.ndarray | None = None  # transcribe: the audio it was given
    text: str = ""  # synthesize: the text
    status: str = "pending"  # pending -> running -> completed | cancelled | failed (or pending -> refused)
    delivered: int = 0  # deltas or chunks yielded so far
    total: int = 0  # deltas or chunks it will yield when it runs to the end


@dataclass(frozen=True)
class AnswerPlan:
    """How the fake generates an answer: its length, pacing and failure."""

    answer_ms: float = 1000.0
    chunk_ms: float = 80.0
    step_s: float = 0.0  # wall time per chunk (0: one event-loop turn)
    fail_after_chunks: int | None = None
    deadline_offset_s: float = 0.5  # chunk deadline = first step + start_ms + this
    text: str = ""  # assistant_text: the answers' text (""; answer_text()), one word per step before the audio
    transcript_fail_after: int | None = None  # transcribe_user: the transcript fails after this many words


class InjectedFailure(EngineError):
    """The failure `fail_after_chunks` injects (code: engine_error)."""


_END = object()  # queue sentinel: the response ended without a last chunk (cancel)


@dataclass
class TruncateCall:
    response_id: str
    played_ms: float
    applied: bool  # False: an unknown or older response, ignored


@dataclass
class _Turn:
    role: Role
    frames: int
    text: str = ""  # a user turn: what the user typed (add_user_text)
    done: bool = True  # assistant turns are reserved at respond() and done when the response ends
    deleted: bool = False  # delete_turn(): out of `history`


class FakeResponseHandle:
    """One answer. Status: pending -> generating -> completed | cancelled | failed (or pending -> cancelled)."""

    def __init__(self, conv: FakeConversation, response_id: str, index: int, previous: FakeResponseHandle | None) -> None:
        self.id = response_id
        self.index = index  # 0-based, per conversation
        self.conv = conv
        self.status = "pending"
        self.started = False
        self.cancelled = False
        self.cancels: list[float] = []  # played_ms of each cancel() call on this handle
        self.produced: list[AudioChunk] = []  # chunks generated, in order
        self.produced_at: list[float] = []  # _now() each was generated (against its deadline)
        self.delivered: list[AudioChunk] = []  # chunks `chunks()` yielded to the consumer
        self.generated_samples = 0
        self.error: EngineError | None = None
        self.started_at: float | None = None  # _now() of the first step
        self.dropped_exchanges: tuple[str, ...] = ()
        self.plan = conv.plan  # fixed at respond()
        self.options = conv.degradation.apply(conv.options)  # fixed at respond() (what the gateway set before it)
        self.instructions: str | None = None  # respond(instructions=...): its own system text; None: the session's
        self.text = ""  # the text it wrote (assistant_text)
        self.user_frames = 0  # audio frames of the user turn it answers (what transcribe_user transcribes)
        self.transcript: list[str] = []  # the transcript deltas yielded
        self.transcript_status = "pending"  # pending -> running -> completed | failed | ended (discard, close)
        self._transcript_iterated = False
        self.speculative = False  # undecided: confirm() or discard() is due
        self.discarded = False
        self._undo: tuple | None = None  # what discard() restores (set by the conversation)
        self._cap_frames: int | None = None  # the smallest cut so far (played_ms // 20)
        self._turn = _Turn(Role.ASSISTANT, 0, done=False)
        self._queue: asyncio.Queue = asyncio.Queue()
        self._ended = asyncio.Event()
        self._iterated = False
        self._task = asyncio.get_running_loop().create_task(self._produce(previous))

    # ---- ResponseHandle ----
    def chunks(self) -> AsyncIterator[AudioChunk]:
        if self._iterated:
            raise RuntimeError(f"chunks() of response {self.id} can be iterated once")
        self._iterated = True
        return self._chunks()

    async def _chunks(self) -> AsyncIterator[AudioChunk]:
        while not self.cancelled:
            item = await self._queue.get()
            if item is _END or self.cancelled:
                return
            if isinstance(item, BaseException):
                raise item
            self.delivered.append(item)
            yield item
            if item.is_last:
                return

    def user_transcript(self) -> AsyncIterator[str]:
        if self._transcript_iterated:
            raise RuntimeError(f"user_transcript() of response {self.id} can be iterated once")
        self._transcript_iterated = True
        return self._user_transcript()

    async def _user_transcript(self) -> AsyncIterator[str]:
        if not self.options.transcribe_user or self.user_frames == 0:
            self.transcript_status = "completed"
            return
        self.transcript_status = "running"
        for k, word in enumerate(user_transcript_text(self.user_frames).split()):
            await asyncio.sleep(self.plan.step_s)  # one engine step, beside the answer's
            if self.discarded or self.conv.closed:
                self.transcript_status = "ended"
                return
            if self.plan.transcript_fail_after is not None and k >= self.plan.transcript_fail_after:
                self.transcript_status = "failed"
                raise InjectedFailure(f"injected transcript failure after {k} words of response {self.id}")
            delta = word if k == 0 else " " + word
            self.transcript.append(delta)
            yield delta
        self.transcript_status = "completed"

    def cancel(self, played_ms: float) -> None:
        self.cancels.append(float(played_ms))
        self.conv.cancels.append((self.id, float(played_ms)))
        self.conv.calls.append(("cancel", self.id, float(played_ms)))
        self._stop(int(max(0.0, played_ms) // FRAME_MS))

    def _stop(self, keep_frames: int | None) -> None:
        """As the engine's record.stop: `keep_frames` None keeps all that was generated (a suspend)."""
        if self.ended:
            self.cancelled = True  # the consumer gets nothing more, even chunks still queued
            if self.conv._latest is self:  # only the latest answer can still be cut
                self._cap(keep_frames)
            return
        self._cap(keep_frames)
        if not self.cancelled:
            self.cancelled = True
            self._queue.put_nowait(_END)  # wake the consumer: it ends without is_last

    def confirm(self) -> None:
        self.conv.calls.append(("confirm", self.id))
        self.speculative = False

    def discard(self) -> None:
        if self.discarded:
            return
        if not self.speculative:
            raise RuntimeError(f"response {self.id} is not an undecided speculative answer")
        self.conv.calls.append(("discard", self.id))
        self.discarded = True
        if not self.cancelled:
            self.cancelled = True
            self._queue.put_nowait(_END)
        self.conv._undo_speculation(self)

    # ---- for tests ----
    @property
    def ended(self) -> bool:
        return self._ended.is_set()

    async def wait_ended(self) -> None:
        await self._ended.wait()

    @property
    def generated_ms(self) -> float:
        return self.generated_samples / SAMPLES_PER_MS

    def expected_pcm(self, start_ms: float = 0.0, duration_ms: float | None = None) -> np.ndarray:
        """The audio this answer has (or would have) at [start_ms, start_ms + duration_ms)."""
        start = ms_to_samples(start_ms)
        end = ms_to_samples(self.plan.answer_ms) if duration_ms is None else start + ms_to_samples(duration_ms)
        return answer_pcm(self.conv.index, self.index, start, end - start)

    # ---- internals ----
    async def _write_text(self) -> int:
        """The answer's text, one word a step, as chunks without audio; returns the steps taken."""
        words = (self.plan.text or answer_text(self.conv.index, self.index)).split()
        for k, word in enumerate(words):
            await asyncio.sleep(self.plan.step_s)
            if self.cancelled:
                return k
            self._check_failure(k)
            delta = word if k == 0 else " " + word
            self.text += delta
            self._deliver(AudioChunk(self.id, np.zeros(0, np.int16), 0.0, 0.0, _now(), text_delta=delta))
        return len(words)

    async def _speak(self, k: int) -> None:
        """The answer's audio, `chunk_ms` a step; deadlines count from its first audio step (as the codec stage's)."""
        total = ms_to_samples(min(self.plan.answer_ms, self.options.max_response_ms))
        per_chunk = max(1, ms_to_samples(self.plan.chunk_ms))
        audio_t0 = _now()
        while self.generated_samples < total:
            await asyncio.sleep(self.conv.engine.step_s(self.plan))  # one engine step (0: one loop turn)
            if self.cancelled:
                break
            self._check_failure(k)
            start = self.generated_samples
            n = min(per_chunk, total - start)
            self.generated_samples += n
            self._deliver(AudioChunk(
                response_id=self.id,
                pcm=answer_pcm(self.conv.index, self.index, start, n),
                start_ms=start / SAMPLES_PER_MS,
                duration_ms=n / SAMPLES_PER_MS,
                deadline=audio_t0 + start / SAMPLE_RATE_HZ + self.plan.deadline_offset_s,
                is_last=start + n >= total,
            ))
            k += 1

    def _check_failure(self, k: int) -> None:
        if self.plan.fail_after_chunks is not None and k >= self.plan.fail_after_chunks:
            raise InjectedFailure(f"injected failure after {k} chunks of response {self.id}")

    def _deliver(self, chunk: AudioChunk) -> None:
        self.produced.append(chunk)
        self.produced_at.append(_now())
        self._queue.put_nowait(chunk)

    def _cap(self, frames: int | None) -> None:
        if frames is not None:
            self._cap_frames = frames if self._cap_frames is None else min(self._cap_frames, frames)
        if self._cap_frames is not None:
            self._turn.frames = min(self._turn.frames, self._cap_frames)

    async def _produce(self, previous: FakeResponseHandle | None) -> None:
        try:
            if previous is not None:
                await previous._ended.wait()
            if self.cancelled or self.conv.closed:
                self.status = "cancelled"
                return
            self.started, self.status = True, "generating"
            self.started_at = _now()
            k = 0
            if self.options.assistant_text:
                k = await self._write_text()
            if self.cancelled:
                pass
            elif self.options.output_audio:
                await self._speak(k)
            else:
                self._deliver(AudioChunk(self.id, np.zeros(0, np.int16), 0.0, 0.0, _now(), is_last=True))
            self.status = "cancelled" if self.cancelled else "completed"
        except EngineError as e:
            self.status, self.error = "failed", e
            self._queue.put_nowait(e)
        finally:
            frames = self.generated_samples // SAMPLES_PER_FRAME
            if self._cap_frames is not None:
                frames = min(frames, self._cap_frames)
            self._turn.frames, self._turn.text, self._turn.done = frames, self.text, True
            self._ended.set()
            self._queue.put_nowait(_END)


class FakeConversation:
    def __init__(self, engine: FakeEngine, session_id: str, options: ConversationOptions, index: int) -> None:
        self.id = session_id
        self.index = index  # order of opening in its engine: part of the answers' audio
        self.engine = engine
        self.options = options
        self.plan = engine.plan  # replace it (dataclasses.replace) before respond() to change the next answer
        # records
        self.calls: list[tuple] = []  # every call, in order: ("push", n) ("end_turn",) ("respond", id) ...
        self.user_turns: list[list[np.ndarray]] = []  # audio pushed, per user turn
        self.end_turn_calls = 0
        self.respond_ids: list[str] = []
        self.handles: list[FakeResponseHandle] = []
        self.cancels: list[tuple[str, float]] = []
        self.truncates: list[TruncateCall] = []
        self.user_texts: list[str] = []  # add_user_text() calls, in order
        self.options_updates: list[ConversationOptions] = []
        self.degradation: Degradation = NO_DEGRADATION  # degrade(): what the next answers lose
        self.degradations: list[Degradation] = []  # every degrade() call, in order
        self.closed = False
        self.close_calls = 0
        self._turns: list[_Turn] = []
        self._exchanges: list[FakeResponseHandle] = []  # the responses whose exchanges are in `_turns`
        self._open_user: list[np.ndarray] | None = None  # the user turn being pushed
        self._user_since_answer = False  # a user turn ended since the last respond()
        self._latest: FakeResponseHandle | None = None

    # ---- Conversation ----
    def update_options(self, options: ConversationOptions) -> None:
        self._check_open()
        self.engine.check_text_options(options)
        self.calls.append(("update_options",))
        self.options_updates.append(options)
        self.options = options

    def degrade(self, degradation: Degradation) -> None:
        self.calls.append(("degrade", degradation))
        self.degradations.append(degradation)
        self.degradation = degradation

    def push_user_audio(self, pcm_16k: np.ndarray) -> None:
        self._check_open()
        self._check_decided()
        pcm = np.asarray(pcm_16k)
        if pcm.ndim != 1 or pcm.dtype != np.int16:
            raise ValueError(f"user audio must be mono int16, got {pcm.dtype} {pcm.shape}")
        self.calls.append(("push", pcm.size))
        if self._open_user is None:
            self._open_user = []
            self.user_turns.append(self._open_user)
        self._open_user.append(pcm.copy())

    def end_user_turn(self) -> None:
        self._check_open()
        self._check_decided()
        self.calls.append(("end_turn",))
        self.end_turn_calls += 1
        self._end_turn()

    def add_user_text(self, text: str) -> None:
        self._check_open()
        self._check_decided()
        if not self.engine.text_model:
            raise NoTextModel("this model has no text tokenizer: it reads and writes audio only")
        if not text or not text.strip():
            raise ValueError("a user text turn needs non-empty text")
        self.calls.append(("add_user_text", text))
        self.user_texts.append(text)
        if self._open_user is not None or not self._user_since_answer:
            self._end_turn()
        turn = self._turns[-1]  # the exchange's user turn: typed text joins its audio
        turn.text = f"{turn.text}\n{text}" if turn.text else text

    def _end_turn(self) -> None:
        if self._open_user is None:
            if self._user_since_answer:
                return  # already ended: nothing new
            self._open_user = []
            self.user_turns.append(self._open_user)
        samples = sum(p.size for p in self._open_user)
        self._turns.append(_Turn(Role.USER, samples // SAMPLES_PER_FRAME))
        self._open_user = None
        self._user_since_answer = True

    def respond(self, response_id: str, speculative: bool = False, instructions: str | None = None) -> FakeResponseHandle:
        self._check_open()
        prev = self._latest
        if prev is not None and not prev.ended and not prev.cancelled:
            raise ResponseInProgress(f"conversation {self.id} is already responding ({prev.id})")
        self.calls.append(("speculate" if speculative else "respond", response_id))
        self.respond_ids.append(response_id)
        undo = (list(self._turns), list(self._exchanges), self._open_user, self._user_since_answer, prev,
                len(self.user_turns))
        if self._open_user is not None or not self._user_since_answer:
            self._end_turn()
        self._user_since_answer = False
        index = sum(not x.discarded for x in self.handles)
        h = FakeResponseHandle(self, response_id, index, prev)
        h.speculative, h._undo, h.instructions = speculative, undo, instructions
        h.user_frames = self._exchange_user_frames()
        h.dropped_exchanges = self._drop_exchanges()
        self._turns.append(h._turn)
        self._exchanges.append(h)
        self.handles.append(h)
        self._latest = h
        return h

    def _exchange_user_frames(self) -> int:
        """Audio frames of the user turns since the last answer: what this exchange's transcript covers."""
        frames = 0
        for t in reversed(self._turns):
            if t.role is Role.ASSISTANT:
                break
            frames += t.frames
        return frames

    def _undo_speculation(self, h: FakeResponseHandle) -> None:
        turns, exchanges, open_user, since, prev, n_user_turns = h._undo
        self._turns, self._exchanges, self._user_since_answer, self._latest = turns, exchanges, since, prev
        del self.user_turns[n_user_turns:]  # an empty turn the fork may have opened and ended
        self._open_user = open_user

    def _check_decided(self) -> None:
        h = self._latest
        if h is not None and h.speculative and not h.discarded:
            raise RuntimeError(f"response {h.id} is speculative: confirm or discard it before the user turn changes")

    def _drop_exchanges(self) -> tuple[str, ...]:
        limit = self.engine.context_exchanges
        if limit is None or len(self._exchanges) < limit:
            return ()
        gone, self._exchanges = self._exchanges[: len(self._exchanges) - limit + 1], self._exchanges[len(self._exchanges) - limit + 1 :]
        last = gone[-1]._turn
        cut = next(k for k, t in enumerate(self._turns) if t is last) + 1  # the turns up to its answer
        del self._turns[:cut]
        return tuple(h.id for h in gone)

    def truncate(self, response_id: str, played_ms: float) -> None:
        self.calls.append(("truncate", response_id, float(played_ms)))
        h = self._latest
        applied = h is not None and h.id == response_id and not self.closed
        older = None if applied or self.closed else next((x for x in self._exchanges if x.id == response_id and x.ended), None)
        self.truncates.append(TruncateCall(response_id, float(played_ms), applied or older is not None))
        frames = int(max(0.0, played_ms) // FRAME_MS)
        if older is not None:
            older._cap(frames)
        elif applied:
            h._cap(frames)

    def delete_turn(self, response_id: str, role: Role) -> None:
        self._check_open()
        self.calls.append(("delete_turn", response_id, role))
        h = next((x for x in self._exchanges if x.id == response_id), None)
        if h is None:
            return
        if h.started and not h.ended:
            raise ResponseInProgress(f"response {response_id} is still in progress: cancel it first")
        k = next(k for k, t in enumerate(self._turns) if t is h._turn)
        (self._turns[k - 1] if role is Role.USER else h._turn).deleted = True

    def suspend(self) -> None:
        self._check_open()
        self.calls.append(("suspend",))
        h = self._latest
        if h is not None and h.speculative and not h.discarded:
            h.discard()
        elif h is not None and not h.ended and not h.cancelled:
            h._stop(None)  # nobody hears the cut: the history keeps what was generated
        self.engine.suspended.add(self.id)

    def resume(self) -> None:
        self._check_open()
        self.calls.append(("resume",))
        if self.id in self.engine.suspended:
            self.engine.check_room()
            self.engine.suspended.discard(self.id)

    @property
    def suspended(self) -> bool:
        return self.id in self.engine.suspended

    async def close(self) -> None:
        self.close_calls += 1
        self.calls.append(("close",))
        if self.closed:
            return
        self.closed = True
        h = self._latest
        if h is not None and not h.ended:
            if not h.cancelled:
                h.cancelled = True  # keeps what was generated (the engine's stop(keep=None))
                h._queue.put_nowait(_END)
            await h.wait_ended()
        self.engine._release(self)

    @property
    def history(self) -> list[HistoryTurn]:
        return [HistoryTurn(role=t.role, audio_frames=t.frames, text=t.text) for t in self._turns if t.done and not t.deleted]

    # ---- for tests ----
    @property
    def responding(self) -> bool:
        h = self._latest
        return h is not None and h.started and not h.ended

    @property
    def rows(self) -> int:
        """Engine rows its answer steps now: 0 idle, 1, or 2 with CFG's shadow."""
        return (2 if uses_guidance(self._latest.options.cfg_scale) else 1) if self.responding else 0

    def user_audio(self, turn: int = -1) -> np.ndarray:
        parts = self.user_turns[turn]
        return np.concatenate(parts) if parts else np.zeros(0, np.int16)

    @property
    def user_samples(self) -> list[int]:
        return [sum(p.size for p in t) for t in self.user_turns]

    def _check_open(self) -> None:
        if self.closed:
            raise ConversationClosed(f"conversation {self.id} is closed")


class FakeEngine:
    """`EngineLike` with a fixed `capacity` of open conversations; see the module docstring."""

    def __init__(self, capacity: int = 4, *, answer_ms: float = 1000.0, chunk_ms: float = 80.0, step_s: float = 0.0,
                 fail_after_chunks: int | None = None, deadline_offset_s: float = 0.5, text: str = "",
                 context_exchanges: int | None = None, text_model: bool = True, oneshot_step_s: float = 0.005,
                 oneshot_capacity: int | None = None, oneshot_fail_after: int | None = None, row_s: float = 0.0,
                 text_context: int = 4096) -> None:
        self.capacity = capacity
        self.row_s = row_s  # wall time per row of a step (module docstring, "Load"); 0: steps cost `step_s` alone
        self.slowdown = 1.0  # every step's time is multiplied by this (the machine turns out slower)
        self.margin = 0.8  # the live bound keeps this share of a chunk's audio as the step budget (as engine/capacity.py)
        # False: a model without a text tokenizer (supports_text False): text options, typed turns,
        # transcribe and synthesize raise NoTextModel
        self.text_model = text_model
        self.text_context = text_context  # the model's positions, for text_budget()
        self.token_counts: list[int] = []  # count_text_tokens() calls: the length (characters) of each text counted
        self.oneshot_step_s = oneshot_step_s  # wall time per transcript delta or speech chunk
        self.oneshot_capacity = oneshot_capacity  # one-shot requests running at once; None: no bound
        self.oneshot_fail_after = oneshot_fail_after  # EngineError after this many deltas/chunks
        self.transcriptions: list[OneShot] = []
        self.syntheses: list[OneShot] = []
        self.oneshots_running = 0
        self.context_exchanges = context_exchanges  # None: the history grows without bound
        self.plan = AnswerPlan(answer_ms, chunk_ms, step_s, fail_after_chunks, deadline_offset_s, text)
        self.ready = True
        self.conversations: dict[str, FakeConversation] = {}  # open
        self.suspended: set[str] = set()  # open, their clients away: no slot held
        self.opened: list[FakeConversation] = []  # every conversation ever opened, in order
        self.refused: list[str] = []  # session ids refused with AtCapacity
        self.shutdown_calls = 0
        self.deliveries: list[tuple[int, int, int]] = []  # report_delivery() calls: (chunks, late chunks, underruns)

    def open_conversation(self, session_id: str, options: ConversationOptions | None = None) -> FakeConversation:
        if not self.ready:
            self.refused.append(session_id)
            raise AtCapacity("engine is not ready")
        if session_id in self.conversations:
            raise ValueError(f"conversation {session_id!r} is already open")
        try:
            self.check_room()
        except AtCapacity:
            self.refused.append(session_id)
            raise
        options = options or ConversationOptions()
        self.check_text_options(options)
        conv = FakeConversation(self, session_id, options, len(self.opened))
        self.conversations[session_id] = conv
        self.opened.append(conv)
        return conv

    @property
    def supports_text(self) -> bool:
        return self.text_model

    def check_text_options(self, options: ConversationOptions) -> None:
        """As the engine's: NoTextModel / ValueError for text options it cannot honour."""
        if (options.transcribe_user or options.assistant_text) and not self.text_model:
            raise NoTextModel("this model has no text tokenizer: it reads and writes audio only")
        if not options.output_audio and not options.assistant_text:
            raise ValueError("a text-only answer (output_audio False) needs assistant_text")

    def check_room(self) -> None:
        active = len(self.conversations) - len(self.suspended)
        if active >= self.current_capacity():
            raise AtCapacity(f"server at capacity: {active} conversations active, capacity {self.current_capacity()}")

    def step_s(self, plan: AnswerPlan) -> float:
        """One step's wall time now (module docstring, "Load")."""
        if not self.row_s:
            return plan.step_s
        return (plan.step_s + self.row_s * sum(c.rows for c in self.conversations.values())) * self.slowdown

    def live_bound(self) -> int | None:
        """The rows whose step fits `margin` of a chunk's audio at the current speed (None: no load model)."""
        if not self.row_s:
            return None
        budget = self.margin * self.plan.chunk_ms / 1000.0 / self.slowdown - self.plan.step_s
        return max(0, int(budget / self.row_s))

    def current_capacity(self) -> int:
        bound = self.live_bound()
        return self.capacity if bound is None else max(1, min(self.capacity, bound))

    def _release(self, conv: FakeConversation) -> None:
        if self.conversations.get(conv.id) is conv:
            del self.conversations[conv.id]
            self.suspended.discard(conv.id)

    def health(self) -> EngineHealth:
        return EngineHealth(ready=self.ready, detail="ready" if self.ready else "stopped")

    def report_delivery(self, chunks: int, late_chunks: int, underruns: int) -> None:
        self.deliveries.append((chunks, late_chunks, underruns))

    def load(self) -> EngineLoad:
        responding = sum(c.responding for c in self.conversations.values())
        bound = self.live_bound()
        extra = {} if bound is None else {"bounds": {"engine": bound, "max_conversations": self.capacity}}
        return EngineLoad(conversations=len(self.conversations) - len(self.suspended), responding=responding,
                          capacity=self.current_capacity(), step_ms=1000.0 * self.step_s(self.plan), batch_size=float(responding),
                          extra=extra)

    async def shutdown(self) -> None:
        self.shutdown_calls += 1
        for conv in list(self.conversations.values()):
            await conv.close()
        self.ready = False

    def conversation(self, session_id: str) -> FakeConversation:
        """The last conversation opened under this id (open or closed)."""
        return next(c for c in reversed(self.opened) if c.id == session_id)

    # ---- one-shot requests ----
    def transcribe(self, pcm_16k: np.ndarray, options: TranscriptionOptions | None = None) -> AsyncIterator[str]:
        pcm = np.asarray(pcm_16k)
        shot = OneShot("transcribe", options or TranscriptionOptions(), pcm=pcm.copy())
        self.transcriptions.append(shot)
        words = fake_transcript(pcm).split()
        shot.total = len(words)

        async def deltas() -> AsyncIterator[str]:
            if pcm.ndim != 1 or pcm.dtype != np.int16:
                raise ValueError(f"audio must be mono int16, got {pcm.dtype} {pcm.shape}")
            async with self._running(shot):
                for k, word in enumerate(words):
                    await self._step(shot, k)
                    shot.delivered += 1
                    yield word if k == 0 else " " + word

        return deltas()

    def synthesize(self, text: str, options: SpeechOptions | None = None) -> AsyncIterator[AudioChunk]:
        options = options or SpeechOptions()
        shot = OneShot("synthesize", options, text=text)
        self.syntheses.append(shot)
        total = ms_to_samples(speech_ms(text, options.max_ms))
        per_chunk = max(1, ms_to_samples(self.plan.chunk_ms))
        shot.total = -(-total // per_chunk)
        rid = f"speech_{len(self.syntheses)}"

        async def chunks() -> AsyncIterator[AudioChunk]:
            if not text.strip():
                raise ValueError("nothing to say: the text is empty")
            budget = self.text_budget()
            if self.text_model and self.count_text_tokens(text) > budget.speech_tokens:
                shot.status = "refused"
                raise TextTooLong(f"the text is too long for the model's context ({self.count_text_tokens(text)} tokens)")
            async with self._running(shot):
                start_time = time.monotonic()
                for k, start in enumerate(range(0, total, per_chunk)):
                    await self._step(shot, k)
                    n = min(per_chunk, total - start)
                    shot.delivered += 1
                    yield AudioChunk(response_id=rid, pcm=speech_pcm(text, start, n), start_ms=start / SAMPLES_PER_MS,
                                     duration_ms=n / SAMPLES_PER_MS, deadline=start_time + start / SAMPLE_RATE_HZ + 0.5,
                                     is_last=start + n >= total)

        return chunks()

    def text_budget(self) -> TextBudget:
        """As the engine's (engine/text_budget.py), for a context of `text_context` positions."""
        if not self.text_model:
            raise NoTextModel("the model has no text tokenizer")
        n = self.text_context
        return TextBudget(context=n, system_tokens=n // 4, user_text_tokens=n // 2, speech_tokens=n - 24,
                          speech_tokens_with_voice=n - 524)

    def count_text_tokens(self, text: str) -> int:
        """One token per UTF-8 byte (a byte-level BPE's count for text it has no merges for)."""
        if not self.text_model:
            raise NoTextModel("the model has no text tokenizer")
        self.token_counts.append(len(text))
        return len(text.encode("utf-8", "surrogatepass"))

    @contextlib.asynccontextmanager
    async def _running(self, shot: OneShot):
        """Admit a one-shot request (NoTextModel, AtCapacity), count it while it runs, record how it ends."""
        if not self.text_model:
            shot.status = "refused"
            raise NoTextModel("the model has no text tokenizer")
        if not self.ready or (self.oneshot_capacity is not None and self.oneshots_running >= self.oneshot_capacity):
            shot.status = "refused"
            raise AtCapacity("engine is not ready" if not self.ready else
                             f"server at capacity: {self.oneshots_running} one-shot requests running")
        self.oneshots_running += 1
        shot.status = "running"
        try:
            yield
            shot.status = "completed"
        except EngineError:
            shot.status = "failed"
            raise
        except (GeneratorExit, asyncio.CancelledError):
            # closed (or cancelled) by the consumer: before the last item, the request is cancelled
            shot.status = "completed" if shot.delivered == shot.total else "cancelled"
            raise
        finally:
            self.oneshots_running -= 1

    async def _step(self, shot: OneShot, k: int) -> None:
        await asyncio.sleep(self.oneshot_step_s)  # one engine step (0: one loop turn)
        if self.oneshot_fail_after is not None and k >= self.oneshot_fail_after:
            raise InjectedFailure(f"injected failure after {k} of {shot.total} ({shot.kind})")
