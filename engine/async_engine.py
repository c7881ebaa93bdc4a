"""OpusLM on vLLM's AsyncLLM: submit AudioRequests, receive their 9-stream steps as produced.

This is the layer below the gateway's Engine (engine/service.py): it knows vLLM and the plugin,
nothing about conversations. Steps leave vLLM every engine step (DELTA outputs); the 8 aux ids of
each step travel in the per-token `sampling_mask` (see vllm_plugin/scheduler.py), which vLLM
concatenates when a slow consumer lets outputs pile up, so no step is ever lost.
"""

from __future__ import annotations

import asyncio
import itertools
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from engine import guidance, vocab
from engine.checkpoint import load_config
from engine.request import AudioRequest, Generation
from engine.service_config import DType, EngineServiceConfig
from engine.vllm_plugin import SETTINGS_KEY, urgent_tokens

if TYPE_CHECKING:
    from vllm.engine.arg_utils import AsyncEngineArgs


_SERVICE = EngineServiceConfig()  # the settings both configs share take the service's defaults: one set


@dataclass(frozen=True)
class EngineConfig:
    """vLLM settings for serving OpusLM. The engine service builds it from its own config
    (`for_service`); tests and benchmarks that drive this layer alone build it directly."""

    model: str
    max_num_seqs: int = _SERVICE.max_num_seqs
    max_model_len: int | None = _SERVICE.max_model_len
    max_num_batched_tokens: int | None = _SERVICE.max_num_batched_tokens
    kv_cache_gib: float = _SERVICE.kv_cache_gib  # CPU: VLLM_CPU_KVCACHE_SPACE; CUDA: kv_cache_memory_bytes
    num_kv_blocks: int | None = None  # overrides the KV size (tests force preemption with it)
    block_size: int | None = None  # None: vLLM's (the service sets its kv_block_size)
    enforce_eager: bool = _SERVICE.enforce_eager
    enable_chunked_prefill: bool = _SERVICE.enable_chunked_prefill
    enable_prefix_caching: bool = True
    log_stats: bool = False  # per-request vLLM stats (e.g. preemption counts)
    pacing_lead_ms: float = _SERVICE.pacing_lead_ms  # realtime requests run at most this far ahead of playback
    cpu_threads: int = 0  # CPU backend: the engine core's torch/OpenMP threads; 0 = vLLM's default (all cores)
    # the codec's first chunk: a realtime response is most urgent until it can be decoded
    first_chunk_frames: int = _SERVICE.first_chunk_frames
    seed: int = _SERVICE.seed
    dtype: DType = _SERVICE.vllm_dtype
    data_parallel_size: int = _SERVICE.data_parallel_size  # engine cores (vLLM data parallelism); a request names its rank

    @classmethod
    def for_service(cls, cfg: EngineServiceConfig, model: str, cpu_threads: int) -> EngineConfig:
        """The engine service's settings as vLLM's (the one place they are mapped): `model` is the
        resolved checkpoint directory, `cpu_threads` the engine core's (engine_cpu_threads)."""
        return cls(model=model, max_num_seqs=cfg.max_num_seqs, max_model_len=cfg.max_model_len,
                   max_num_batched_tokens=cfg.max_num_batched_tokens, kv_cache_gib=cfg.kv_cache_gib,
                   block_size=cfg.kv_block_size, enforce_eager=cfg.enforce_eager,
                   enable_chunked_prefill=cfg.enable_chunked_prefill, pacing_lead_ms=cfg.pacing_lead_ms,
                   cpu_threads=cpu_threads, first_chunk_frames=cfg.first_chunk_frames, seed=cfg.seed,
                   dtype=cfg.vllm_dtype, data_parallel_size=cfg.data_parallel_size)


@dataclass
class StepChunk:
    """Steps [n, 9] of one request, in order, as they left vLLM (n > 1 if the consumer lagged)."""

    first_step: int
    steps: np.ndarray
    finished: bool
    num_preemptions: int = 0  # so far; known only when EngineConfig.log_stats is on
    num_cached_tokens: int = 0  # prompt positions served from the prefix cache
    engine_step_ms: float = 0.0  # duration of the engine step that produced the latest step
    engine_batch: int = 0  # requests in that step
    engine_tokens: int = 0  # tokens in that step (> engine_batch when it carried a prefill)
    engine_cfg_pairs: int = 0  # CFG pairs in that step (each also counts once in engine_batch)


def _set_vllm_env(cfg: EngineConfig) -> None:
    # The V1 runner is where our hooks live; the V2 runner has none of them.
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, int(round(cfg.kv_cache_gib)))))
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    # One engine-core process holding the worker, instead of two: half the start-up time, and
    # the gateway's process stays free of model work either way.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm.platforms import current_platform

    if current_platform.is_cpu() and cfg.cpu_threads != 1:
        # A CPU engine's OpenMP team shares the cores with the gateway's process (codec, tokenizer,
        # VAD, transports). libgomp's default keeps a team's threads spinning after every parallel
        # region, on cores those need: with 2 threads on 2 cores, 8 callers kept 89.5-98.8 % of chunks
        # on time spinning and 99.3 % sleeping at once, 7 callers 99.9 % (scripts/capacity_sweep.py,
        # docs/soak.md). The engine core is spawned after this, so it alone reads it; an operator's
        # own setting wins.
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def engine_args(cfg: EngineConfig) -> AsyncEngineArgs:
    """AsyncEngineArgs wiring the plugin's worker and scheduler into vLLM."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.platforms import current_platform

    worker = "OpusCPUWorker" if current_platform.is_cpu() else "OpusGPUWorker"
    model_cfg = load_config(cfg.model)
    # vLLM's data parallelism: one engine core per rank, all on this machine (loopback). A dense
    # model's ranks are independent engines (EngineCoreProc, no DP group, no dummy batches); the
    # uni executor keeps each rank's worker inside its engine core, as with one engine (vLLM
    # would pick the mp executor for DP: a worker process more per rank).
    several = cfg.data_parallel_size > 1
    return AsyncEngineArgs(
        model=str(Path(cfg.model).resolve()),
        skip_tokenizer_init=True,
        dtype=cfg.dtype,
        enforce_eager=cfg.enforce_eager,
        max_num_seqs=cfg.max_num_seqs,
        max_model_len=cfg.max_model_len or model_cfg.max_position_embeddings,
        max_num_batched_tokens=cfg.max_num_batched_tokens or None,  # None: vLLM's default
        num_gpu_blocks_override=cfg.num_kv_blocks or None,
        block_size=cfg.block_size or None,
        seed=cfg.seed,
        worker_cls=f"engine.vllm_plugin.runner.{worker}",
        scheduler_cls="engine.vllm_plugin.scheduler.OpusScheduler",
        # Block hashes cover stream 0 only, so every request carries a cache salt: its own, or
        # its conversation's, within which equal stream-0 prefixes imply equal aux streams.
        enable_prefix_caching=cfg.enable_prefix_caching,
        enable_chunked_prefill=cfg.enable_chunked_prefill,
        async_scheduling=False,  # the runner's hooks read each step's rows synchronously
        disable_log_stats=not cfg.log_stats,
        additional_config={SETTINGS_KEY: {"pacing_lead_ms": cfg.pacing_lead_ms, "cpu_threads": cfg.cpu_threads,
                                          "urgent_tokens": urgent_tokens(cfg.first_chunk_frames)}},
        data_parallel_size=cfg.data_parallel_size,
        data_parallel_address="127.0.0.1" if several else None,
        distributed_executor_backend="uni" if several else None,
        kv_cache_memory_bytes=None if current_platform.is_cpu() else int(cfg.kv_cache_gib * 2**30),
    )


def sampling_params(request: AudioRequest):
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    s = request.sampling
    return SamplingParams(
        temperature=s.temperature,
        top_k=s.top_k if s.top_k > 0 else -1,
        top_p=s.top_p,
        seed=s.seed,
        max_tokens=1 if request.prefill_only else request.max_steps,
        stop_token_ids=[vocab.ENGINE_STOP],
        output_kind=RequestOutputKind.DELTA,
        detokenize=False,
        extra_args=request.extra_args(),
    )


class AsyncOpusEngine:
    """vLLM AsyncLLM running OpusLM; many requests stream concurrently through one engine."""

    def __init__(self, llm, cfg: EngineConfig) -> None:
        self._llm = llm
        self.cfg = cfg
        self._ids = itertools.count()

    @classmethod
    async def start(cls, cfg: EngineConfig) -> "AsyncOpusEngine":
        _set_vllm_env(cfg)
        from engine.vllm_plugin import register

        register()
        from vllm.v1.engine.async_llm import AsyncLLM

        llm = AsyncLLM.from_engine_args(engine_args(cfg))
        return cls(llm, cfg)

    @property
    def errored(self) -> bool:
        """The engine core died (vLLM's own flag): nothing it holds can go on."""
        return self._llm.errored

    def new_request_id(self, prefix: str = "req") -> str:
        return f"{prefix}-{next(self._ids)}"

    @property
    def data_parallel_size(self) -> int:
        """Engine cores (ranks); each request runs on one, `stream_steps(rank=...)`."""
        return self.cfg.data_parallel_size

    async def stream_steps(self, request: AudioRequest, request_id: str | None = None,
                           rank: int | None = None) -> AsyncIterator[StepChunk]:
        """Yield the request's generated steps in order until the segment is complete.

        `rank`: the engine core that runs it (data parallelism; None: vLLM's load balancer picks one).
        A CFG pair's shadow is created in the engine core of its main, so pairs never span ranks.
        Closing the iterator early aborts the request in vLLM.
        """
        rid = request_id or self.new_request_id()
        self._check_request(request, rid)
        if rank is not None and not 0 <= rank < self.data_parallel_size:
            raise ValueError(f"request {rid}: rank {rank} is not one of the {self.data_parallel_size} engine ranks")
        route = {"data_parallel_rank": rank} if rank is not None and self.data_parallel_size > 1 else {}
        prompt = {
            "prompt_token_ids": [int(t) for t in np.asarray(request.prompt)[:, 0]],
            "cache_salt": request.cache_salt or f"req:{rid}",
        }
        num_steps = 0
        async for out in self._llm.generate(prompt, sampling_params(request), rid, **route):
            comp = out.outputs[0]
            toks = comp.token_ids
            aux = comp.sampling_mask.token_ids if comp.sampling_mask is not None else []
            try:
                aux_arr = np.asarray(aux, dtype=np.int64).reshape(len(aux), vocab.NUM_CODEBOOKS)
            except ValueError:  # ragged rows, or not 8 per row
                aux_arr = np.empty((len(aux), 0), dtype=np.int64)
            if aux_arr.shape != (len(toks), vocab.NUM_CODEBOOKS):
                raise RuntimeError(
                    f"request {rid}: {len(toks)} stream-0 tokens arrived with aux rows of shape {aux_arr.shape}; "
                    "the plugin's output path is broken (see engine/README.md)"
                )
            steps = np.empty((len(toks), vocab.NUM_STREAMS), dtype=np.int64)
            steps[:, 0] = toks
            steps[:, 1:] = aux_arr
            preempted = getattr(out.metrics, "num_preemptions", 0) if out.metrics is not None else 0
            timing = (out.kv_transfer_params or {}).get("opuslm_step") or {}
            yield StepChunk(
                first_step=num_steps,
                steps=steps,
                finished=out.finished,
                num_preemptions=preempted,
                num_cached_tokens=out.num_cached_tokens or 0,
                engine_step_ms=float(timing.get("ms", 0.0)),
                engine_batch=int(timing.get("batch", 0)),
                engine_tokens=int(timing.get("tokens", 0)),
                engine_cfg_pairs=int(timing.get("cfg_pairs", 0)),
            )
            num_steps += len(toks)

    @property
    def max_model_len(self) -> int:
        """The positions a request may take, prompt and output together (EngineConfig.max_model_len,
        else the backbone's context): what vLLM enforces."""
        return int(self._llm.vllm_config.model_config.max_model_len)

    @property
    def max_batched_tokens(self) -> int:
        return int(self._llm.vllm_config.scheduler_config.max_num_batched_tokens)

    def cfg_max_steps(self, prompt_len: int) -> int:
        """The most steps a CFG request with this prompt may ask for: both rows prefill (again,
        after a preemption) in one step, so 2 x (prompt + steps) <= max_num_batched_tokens."""
        return self.max_batched_tokens // 2 - prompt_len

    def _check_request(self, request: AudioRequest, rid: str) -> None:
        if guidance.SHADOW_SUFFIX in rid:
            raise ValueError(f"request id {rid!r}: {guidance.SHADOW_SUFFIX!r} is reserved for CFG shadows")
        if guidance.uses_cfg(request.cfg_scale):
            budget = self.max_batched_tokens
            if request.max_steps > self.cfg_max_steps(request.prompt_len):
                raise ValueError(
                    f"a CFG request's two rows prefill in one step: 2 x (prompt {request.prompt_len} + "
                    f"{request.max_steps} steps) exceeds max_num_batched_tokens={budget}"
                )

    async def generate(self, request: AudioRequest, request_id: str | None = None, rank: int | None = None) -> Generation:
        """Run a request to completion."""
        parts, preemptions, cached = [], 0, 0
        async for chunk in self.stream_steps(request, request_id, rank):
            parts.append(chunk.steps)
            preemptions = max(preemptions, chunk.num_preemptions)
            cached = max(cached, chunk.num_cached_tokens)
        steps = np.concatenate(parts).astype(np.int64) if parts else np.empty((0, vocab.NUM_STREAMS), np.int64)
        return Generation.from_steps(steps, request.start_modality, num_preemptions=preemptions, num_cached_tokens=cached)

    async def engine_threads(self) -> int:
        """The engine core's torch intra-op threads, as its worker reports them (rank 0's)."""
        return (await self.rank_threads())[0]

    async def rank_threads(self) -> list[int]:
        """Each engine rank's torch intra-op threads. (vLLM's `collective_rpc` answers with rank 0's
        workers only under data parallelism; its client's `call_utility_all_async` asks every rank.)"""
        if self.data_parallel_size == 1:
            return [int(t) for t in await self._llm.collective_rpc("torch_threads")]
        per_rank = await self._llm.engine_core.call_utility_all_async("collective_rpc", "torch_threads", None, (), {})
        return [int(workers[0]) for workers in per_rank]

    async def abort(self, request_id: str) -> None:
        await self._llm.abort(request_id)

    def shutdown(self) -> None:
        if self._llm is not None:
            llm, self._llm = self._llm, None
            llm.shutdown()
            # AsyncLLM.__del__ shuts down again, and at interpreter exit (modules half torn down)
            # that prints a TypeError traceback: make the second call a no-op
            llm.shutdown = lambda *args, **kwargs: None

    async def __aenter__(self) -> "AsyncOpusEngine":
        return self

    async def __aexit__(self, *exc) -> None:
        self.shutdown()
        await asyncio.sleep(0)
