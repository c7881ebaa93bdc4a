"""The model path every conversation and one-shot request shares: the audio tokenizer thread, vLLM
(AsyncOpusEngine) and the codec stage, started and warmed up together.

    pcm ─▶ tokenizer thread (DAC encoder + SSL, incremental) ─▶ frames
    AudioRequest ─▶ vLLM steps ─▶ frame assembly ─▶ codec stage thread ─▶ AudioChunk ─▶ ResponseRecord
    AudioRequest (text first) ─▶ vLLM steps ─▶ text ids ─▶ TextDeltas ─▶ str deltas

`Pipeline` is internal to the engine service: its methods are what engine/conversation.py and
engine/oneshot.py use; the gateway sees engine/service.py's `Engine` only. Nothing here blocks the
event loop: model work runs in the engine-core process, the tokenizer thread and the codec stage.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import itertools
import logging
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from engine import vocab
from engine.capacity import CapacityModel
from engine.checkpoint import load_config
from engine.delay import MAX_DELAY, FrameAssembler
from engine.layout import DEFAULT_LAYOUT, PromptLayout
from engine.modality import ModalitySplitter
from engine.request import AudioRequest
from engine.response import ResponseRecord
from engine.sampling import SamplingConfig
from engine.service_api import DEFAULT_OPTIONS, FRAME_MS, AudioChunk, ConversationOptions, EngineError, NoTextModel, TextBudget
from engine.service_config import EngineServiceConfig, engine_cpu_threads
from engine.text import NoTextTokenizerError, TextDeltas, TextTokenizer
from engine.text_budget import system_tokens, text_budget

if TYPE_CHECKING:
    from engine.async_engine import AsyncOpusEngine
    from engine.codec.dac import DAC
    from engine.codec.stage import CodecStage, PcmChunk
    from engine.codec.tokenizer import AudioTokenizer, TokenizerState

log = logging.getLogger("duplex.engine")


def as_float_pcm(pcm: np.ndarray, what: str) -> np.ndarray:
    """Mono int16 or float in [-1, 1] -> float32."""
    pcm = np.asarray(pcm)
    if pcm.ndim != 1:
        raise ValueError(f"{what} must be mono 1-D samples, got shape {pcm.shape}")
    if pcm.dtype == np.int16:
        pcm = pcm.astype(np.float32) / 32768.0
    return pcm.astype(np.float32, copy=False)


class Pipeline:
    """Tokenizer thread + vLLM engine + codec stage, shared by all conversations of a process.
    `capacity` is admission control's model: the warm-up and every pure decode step feed it."""

    def __init__(self, config: EngineServiceConfig, capacity: CapacityModel) -> None:
        self.config = config
        self._capacity = capacity
        self._salt_ids = itertools.count()
        self._tok_pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenizer")
        self.ready = False
        self.model_dir: Path | None = None
        self.text_tokenizer: TextTokenizer | None = None  # None: the model reads and writes no text
        self.prompt_layout: PromptLayout = DEFAULT_LAYOUT  # the checkpoint's (engine/layout.py), read at start
        self._llm: AsyncOpusEngine | None = None
        self._codec: CodecStage | None = None
        self._tokenizer: AudioTokenizer | None = None

    async def start(self) -> None:
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

        def load_audio() -> tuple[DAC, AudioTokenizer]:
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
        threads = engine_cpu_threads(cfg.cpu_threads, dac.device.type, cfg.data_parallel_size)
        self._llm = await AsyncOpusEngine.start(EngineConfig.for_service(cfg, str(model), threads))
        ranks = await self._llm.rank_threads()
        if len(ranks) == 1:
            log.info("engine core torch threads: %d (engine.cpu_threads); codec and tokenizer on %s", ranks[0], dac.device.type)
        else:
            log.info("%d engine ranks (engine.data_parallel_size), torch threads each: %s (engine.cpu_threads); codec and "
                     "tokenizer on %s", len(ranks), ranks, dac.device.type)
        # the cpu resource: the machine's cores, shared by this process, the engine core and everything else
        self._capacity.cpu_cores = float(len(os.sched_getaffinity(0)))
        self._capacity.codec_on_host = dac.device.type == "cpu"
        if cfg.warmup:
            await loop.run_in_executor(self._tok_pool, self._warm_audio_path, dac)
            await self._warmup()
        self.ready = True

    @property
    def llm(self) -> AsyncOpusEngine:
        """vLLM running OpusLM (once started)."""
        if self._llm is None:
            raise RuntimeError("the engine has not started")
        return self._llm

    @property
    def codec(self) -> CodecStage:
        if self._codec is None:
            raise RuntimeError("the engine has not started")
        return self._codec

    @property
    def late_chunks(self) -> int:
        """Chunks the codec stage decoded after their deadline, since start."""
        return self._codec.stats.late_chunks if self._codec is not None else 0

    def shutdown(self) -> None:
        self.ready = False
        if self._codec is not None:
            self._codec.stop()
        if self._llm is not None:
            self._llm.shutdown()
        self._tok_pool.shutdown(wait=False, cancel_futures=True)

    # --- warm-up ---------------------------------------------------------------------------------

    def _warm_audio_path(self, dac: DAC) -> None:
        """First calls into torch kernels are slow: run the tokenizer and a codec decode once, and
        measure the codec's real-time factor for admission control."""
        import torch

        from engine.codec.synth import speech_like

        tokenizer = self._audio_tokenizer()
        tokenizer.tokenize(speech_like(0.5, seed=0))
        t0 = time.perf_counter()
        tokenizer.tokenize(speech_like(2.0, seed=1))
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

    # --- text --------------------------------------------------------------------------------------

    def require_text(self) -> TextTokenizer:
        if self.text_tokenizer is None:
            raise NoTextModel("this model has no text tokenizer: it reads and writes audio only")
        return self.text_tokenizer

    def system_ids(self, system_prompt: str | None) -> tuple[int, ...]:
        """The system text's global ids (at most its share of the context); () when there is none, or when
        the model reads no text (a client's instructions are then not honoured: logged, not refused, since
        most clients send some)."""
        return self.capped_system_ids(self.tokenize_system(system_prompt))

    def tokenize_system(self, system_prompt: str | None, known: tuple[str, tuple[int, ...]] | None = None) -> tuple[int, ...]:
        """`system_ids` before the cap. `known`: an earlier system text and its ids; a text that extends it
        at a line break (a system message added: the gateway joins them with "\n") tokenizes only what was
        added, so n system messages cost n tokenizations, not n² (issue 39: 4 messages of 2 MB took 3.3,
        8.8, 14.8 and 16.5 s). A line break starts a pre-token in byte-level BPE, so the ids are the same."""
        if not system_prompt or not system_prompt.strip():
            return ()
        if self.text_tokenizer is None:
            log.info("instructions ignored: the model reads no text")
            return ()
        if known is not None and known[0].strip() and system_prompt.startswith(known[0] + "\n"):
            return known[1] + tuple(int(i) for i in self.text_tokenizer.encode(system_prompt[len(known[0]):]))
        return tuple(int(i) for i in self.text_tokenizer.encode(system_prompt))

    def capped_system_ids(self, ids: tuple[int, ...]) -> tuple[int, ...]:
        """At most the system text's share of the context (engine/text_budget.py; the gateway refuses longer)."""
        cap = system_tokens(self.max_model_len)  # the conversation keeps most of the context
        if len(ids) > cap:
            log.warning("instructions cut to their first %d of %d tokens (a quarter of the context)", cap, len(ids))
        return ids[:cap]

    def text_budget(self) -> TextBudget:
        """How many tokens each use of text may hold in this model's context (engine/text_budget.py)."""
        self.require_text()
        return text_budget(self.max_model_len, self.prompt_layout, DEFAULT_OPTIONS.max_text_tokens)

    def count_text_tokens(self, text: str) -> int:
        return self.require_text().count(text)

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

    async def run_text(self, request: AudioRequest, response: ResponseRecord, rank: int = 0) -> None:
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

    # --- audio in ----------------------------------------------------------------------------------

    def _audio_tokenizer(self) -> AudioTokenizer:
        if self._tokenizer is None:
            raise RuntimeError("the engine has not started")
        return self._tokenizer

    def new_tokenizer_state(self) -> TokenizerState:
        return self._audio_tokenizer().new_state()

    def tokenize(self, state: TokenizerState, pcm: np.ndarray | None, finish: bool, fork: bool = False) -> asyncio.Future[np.ndarray]:
        """Feed audio (or the end of the turn) to the tokenizer thread; resolves to new frames.
        `fork`: work on a copy of `state` (taken in the thread, after the jobs queued before), which
        is left as it was."""
        tok = self._audio_tokenizer()

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

    async def tokenize_clip(self, pcm: np.ndarray) -> np.ndarray:
        """A whole clip (16 kHz mono) -> its frames [T, 9], in the tokenizer thread."""
        return await self.tokenize(self.new_tokenizer_state(), as_float_pcm(pcm, "audio"), finish=True)

    # --- requests ----------------------------------------------------------------------------------

    def new_salt(self, session_id: str) -> str:
        """A prefix-cache salt no other conversation (or earlier prompt prefix) has used."""
        return f"conv:{session_id}:{next(self._salt_ids)}"

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

    async def run_response(self, request: AudioRequest, response: ResponseRecord, rank: int = 0) -> None:
        """vLLM steps (on engine rank `rank`) -> complete frames -> codec stage; PCM chunks come back via
        the sink. The response's id is the vLLM request id and the codec stream id."""
        loop = asyncio.get_running_loop()
        codec = self.codec

        def sink(pcm_chunk: PcmChunk) -> None:  # codec-stage thread
            loop.call_soon_threadsafe(response.deliver, self._audio_chunk(response.id, pcm_chunk))

        codec.open(response.id, sink)
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
                    codec.push(response.id, frames)
            codec.finish(response.id)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # surface engine failures to the consumer, not just the log
            log.exception("response %s failed", response.id)
            response.deliver(e)

    def close_stream(self, response_id: str) -> None:
        self.codec.close(response_id)

    async def stream_audio(self, request: AudioRequest, response_id: str, rank: int) -> AsyncIterator[AudioChunk]:
        """An audio request outside any conversation, decoded by the codec stage: its chunks in order.
        Closing the iterator early aborts it."""
        response = ResponseRecord(response_id)
        pump = response.pump = asyncio.ensure_future(self.run_response(request, response, rank))
        try:
            async for chunk in response.chunks():
                yield chunk
        finally:
            if not pump.done():
                pump.cancel()
                await asyncio.wait([pump])
            self.close_stream(response_id)

    @staticmethod
    def _audio_chunk(response_id: str, pcm_chunk: PcmChunk) -> AudioChunk:
        pcm = np.clip(np.round(pcm_chunk.pcm * 32767.0), -32768, 32767).astype(np.int16)
        return AudioChunk(
            response_id=response_id,
            pcm=pcm,
            start_ms=1000.0 * pcm_chunk.start_sample / vocab.SAMPLE_RATE_HZ,
            duration_ms=1000.0 * len(pcm) / vocab.SAMPLE_RATE_HZ,
            deadline=pcm_chunk.deadline_s,
            is_last=pcm_chunk.is_last,
        )
