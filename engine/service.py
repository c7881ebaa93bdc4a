"""The engine service: the one interface the gateway sees (engine/service_api.py's `EngineLike`).

    Engine ── open_conversation ─▶ Conversation (engine/conversation.py) ─▶ EngineResponse handles
       │                                  │ (engine/response.py)
       ├── transcribe / synthesize ─▶ one-shot requests (engine/oneshot.py)
       ├── Slots (engine/slots.py): which conversations hold a slot, on which rank; admission
       │     against CapacityModel + LatenessFeedback (engine/capacity.py)
       └── Pipeline (engine/pipeline.py): tokenizer thread, vLLM (AsyncOpusEngine), codec stage

The settings are engine/service_config.py's `EngineServiceConfig` (torch-free: the server config
holds it); this module re-exports it and `engine_cpu_threads` for the scripts and tests that start an
engine. Nothing here blocks the event loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

import numpy as np

from engine import oneshot
from engine.capacity import CapacityModel, LatenessFeedback
from engine.conversation import Conversation
from engine.host_meter import HostMeter
from engine.pipeline import Pipeline
from engine.service_api import (
    AtCapacity,
    AudioChunk,
    ConversationOptions,
    EngineHealth,
    EngineLoad,
    SpeechOptions,
    TextBudget,
    TranscriptionOptions,
)
from engine.service_config import EngineServiceConfig, engine_cpu_threads
from engine.slots import Slots

__all__ = ["Engine", "EngineServiceConfig", "engine_cpu_threads"]

log = logging.getLogger("duplex.engine")


class Engine:
    """vLLM engine + tokenizer + codec stage, shared by all conversations of a process; admission
    control over them. Its public members are the gateway contract (service_api.EngineLike) and
    `start`, `config`, `ready`, `capacity()`; `pipeline` is the model path, for tests and tools."""

    def __init__(self, config: EngineServiceConfig) -> None:
        self.config = config
        ranks = config.data_parallel_size
        capacity = CapacityModel(max_conversations=min(config.max_conversations, ranks * config.max_num_seqs),
                                 margin=config.capacity_margin, ranks=ranks, rank_max=config.max_num_seqs)
        self._capacity = capacity
        self._feedback = LatenessFeedback()
        self._slots = Slots(capacity, self._feedback, config.capacity_override)
        self.pipeline = Pipeline(config, capacity)
        self._stopped = False
        self._host_task: asyncio.Task[None] | None = None
        self._meter: HostMeter | None = None
        self._limited_by = ""

    @classmethod
    async def start(cls, config: EngineServiceConfig | None = None) -> Engine:
        self = cls(config or EngineServiceConfig())
        await self.pipeline.start()
        self._meter = HostMeter()
        self._host_task = asyncio.ensure_future(self._watch_host())
        return self

    @property
    def ready(self) -> bool:
        return self.pipeline.ready

    @property
    def supports_text(self) -> bool:
        return self.pipeline.text_tokenizer is not None

    # --- conversations -----------------------------------------------------------------------

    def open_conversation(self, session_id: str, options: ConversationOptions | None = None) -> Conversation:
        if not self.ready:
            raise AtCapacity("engine is not ready")
        opts = options or ConversationOptions()
        return self._slots.open(session_id, lambda rank: Conversation(self.pipeline, self._slots, session_id, opts, rank))

    def capacity(self) -> int:
        return self._slots.capacity()

    def health(self) -> EngineHealth:
        # (several engine ranks: load().extra["ranks"], and /healthz's `ranks`, tell them apart)
        if self.ready and self.pipeline.llm.errored:
            return EngineHealth(ready=False, detail="engine_failed")
        return EngineHealth(ready=self.ready, detail="ready" if self.ready else "stopped" if self._stopped else "starting")

    def load(self) -> EngineLoad:
        """The whole server's load; with several engine ranks the step time is the slowest rank's at its
        own batch, the batch size their mean, and `extra["ranks"]` has each rank's figures."""
        model = self._capacity
        active = self._slots.rank_active()
        responding = self._slots.rank_responding()
        extra: dict[str, object] = {
            "limited_by": "capacity_override" if self.config.capacity_override is not None
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
            conversations=self._slots.active(),
            responding=sum(responding),
            capacity=self.capacity(),
            step_ms=max(step_ms),
            batch_size=sum(responding) / model.ranks,
            chunks_late=self.pipeline.late_chunks if self.ready else 0,
            extra=extra,
        )

    def report_delivery(self, chunks: int, late_chunks: int, underruns: int) -> None:
        """What the gateway's sessions got since the last report: `chunks` audio chunks, `late_chunks` of
        them so late that the client's lead ran out, `underruns` reported by clients (each counts as late)."""
        self._feedback.record(self._slots.active(), time.monotonic(), chunks, late_chunks + underruns,
                              f"{underruns} underruns reported" if underruns else "")
        if self._feedback.reasons:  # (called several times a second per session: log only a change)
            self._log_capacity()

    async def shutdown(self) -> None:
        if self._host_task is not None:
            self._host_task.cancel()
        for conv in self._slots.holders():
            await conv.close()
        self._stopped = True
        self.pipeline.shutdown()

    # --- one-shot requests (engine/oneshot.py) -------------------------------------------------

    def transcribe(self, pcm_16k: np.ndarray, options: TranscriptionOptions | None = None) -> AsyncIterator[str]:
        return oneshot.transcribe(self.pipeline, self._slots.pick_rank, pcm_16k, options or TranscriptionOptions())

    def synthesize(self, text: str, options: SpeechOptions | None = None) -> AsyncIterator[AudioChunk]:
        return oneshot.synthesize(self.pipeline, self._slots.pick_rank, text, options or SpeechOptions())

    def text_budget(self) -> TextBudget:
        return self.pipeline.text_budget()

    def count_text_tokens(self, text: str) -> int:
        return self.pipeline.count_text_tokens(text)

    # --- admission control's measurements -------------------------------------------------------

    async def _watch_host(self, every_s: float = 1.0) -> None:
        """Once a second: the machine's CPU use into the capacity model; the feedback's ceiling recovers."""
        while True:
            await asyncio.sleep(every_s)
            try:
                self._observe_host(time.monotonic())
            except Exception:  # a measurement failure must not stop admission control
                log.exception("capacity: host measurement failed")

    def _observe_host(self, now: float) -> None:
        sample = self._meter.sample() if self._meter is not None else None
        if sample is not None:
            self._capacity.observe_host(now, sample.interval_s, self._slots.active(),
                                        sample.process_cpu + sample.children_cpu, sample.other_cpu)
        self._feedback.tick(now, self._capacity.capacity())
        self._log_capacity()

    def _log_capacity(self) -> None:
        for why in self._feedback.reasons:
            log.warning("capacity: %s", why)
        self._feedback.reasons.clear()
        limited = self._capacity.limited_by(self._feedback.ceiling)
        if limited != self._limited_by:
            self._limited_by = limited
            log.info("capacity %d, limited by %s (bounds %s)", self.capacity(), limited, self._capacity.bounds())
