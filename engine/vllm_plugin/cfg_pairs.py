"""Paired Request Co-Scheduling: CFG pairs inside vLLM's scheduler (a mixin of OpusScheduler).

A request whose extra_args carry `cfg_scale` w != 1 (a "main") gets a shadow when it reaches the
scheduler: a vLLM request of its own, "<id>#uncond", on the unconditional prompt (engine/guidance.py),
created here in the engine core, so the front-end never knows it exists -- it has no output
stream, and its outputs are dropped before they leave the engine core.

Invariants, kept around vLLM's own `schedule()` (which schedules `running` in list order,
preempts from its end and admits `waiting` in queue order; we do not copy it):

1. Together in every batch, at the same position, with the same number of tokens. Before the
   call the running list is grouped into units (a pair, or a single request), and every unit is
   checked against the step's token budget; a pair that would not fit whole sits the step out.
2. KV for both. Before the call we compute each running request's new blocks for this step and,
   while they exceed the free blocks, preempt whole units from the end (lowest priority first) --
   so vLLM's own loop, which would preempt one request at a time, never has to. A waiting pair
   is left in the queue only if both prompts fit this step (tokens, KV blocks incl. vLLM's
   watermark, runner slots), with everything admitted before it counted at its worst case.
3. Finish together: an abort of the main aborts the shadow; a shadow never outlives its main.
4. After the call every pair is checked (`check_pairs`): a split pair raises, so a test fails
   on the step where it happens (the worker checks again before merging).

Prefix caching and chunked prefill, for pairs only:
- Prefix-cache *reading* is off for both rows of a pair (`skip_reading_prefix_cache`): the two
  rows would hit different lengths (the shadow's all-PAD prompt vs the main's history) and reach
  their first sampled position at different steps. Their blocks are still written to the cache.
  Cost: a CFG request recomputes its whole prompt twice, so a CFG conversation gains nothing from
  the incremental prefill and history reuse that plain conversations get.
- A pair's prefill is never chunked: it is admitted only in a step whose remaining token budget
  holds both whole prompts (a preempted pair: prompt + output). Cost: a long CFG prompt waits for
  such a step, and it needs max_num_batched_tokens >= 2 x (prompt + max_tokens), which the
  front-end checks (AsyncOpusEngine.cfg_max_steps; the service shortens a guided answer to fit). Non-CFG requests keep chunked prefill and prefix caching.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from vllm.utils.math_utils import cdiv
from vllm.v1.request import Request, RequestStatus

from engine import guidance
from engine.request import cfg_scale_of, shadow_request

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.engine import EngineCoreOutputs
    from vllm.v1.metrics.stats import SchedulerStats

    # the checker sees the mixin as what it always runs as: part of a Scheduler subclass
    from vllm.v1.core.sched.scheduler import Scheduler as _SchedulerBase
else:
    _SchedulerBase = object


class CfgPairsMixin(_SchedulerBase):
    """Mixed into vLLM's Scheduler subclass; call `_init_pairs()` from its __init__."""

    def _init_pairs(self) -> None:
        self.shadow_of_main: dict[str, str] = {}
        self.main_of_shadow: dict[str, str] = {}
        self.pair_steps = 0  # steps that scheduled at least one pair
        self._step_pairs = 0  # pairs in the step being run

    # --- lifecycle ---------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        super().add_request(request)
        params = request.sampling_params
        rid = request.request_id
        if params is None or not guidance.uses_cfg(cfg_scale_of(params.extra_args)) or rid in self.shadow_of_main:
            return
        shadow = self._make_shadow(request)
        request.skip_reading_prefix_cache = True
        self.shadow_of_main[rid] = shadow.request_id
        self.main_of_shadow[shadow.request_id] = rid
        super().add_request(shadow)  # right behind its main in the waiting queue

    def _make_shadow(self, main: Request) -> Request:
        """`main` has sampling params with a cfg_scale (add_request checked) and token ids (not embeds)."""
        if main.sampling_params is None or main.prompt_token_ids is None:
            raise ValueError(f"CFG request {main.request_id} needs sampling params and prompt token ids")
        extra = main.sampling_params.extra_args or {}
        ids, extra_args = shadow_request(extra, main.request_id, list(main.prompt_token_ids))
        params = main.sampling_params.clone()
        params.extra_args = extra_args
        params.skip_reading_prefix_cache = True
        return Request(
            request_id=guidance.shadow_id(main.request_id),
            prompt_token_ids=ids,
            sampling_params=params,
            pooling_params=None,
            client_index=main.client_index,
            arrival_time=main.arrival_time,
            cache_salt=f"{main.cache_salt or main.request_id}{guidance.SHADOW_SUFFIX}",
            priority=main.priority,
            block_hasher=main._block_hasher,
        )

    def finish_requests(self, request_ids: str | Iterable[str] | None, finished_status: RequestStatus) -> list[Request]:
        if request_ids is not None:
            ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
            request_ids = ids + [self.shadow_of_main[i] for i in ids if i in self.shadow_of_main]
        return super().finish_requests(request_ids, finished_status)

    def _reap_pairs(self) -> None:
        """After outputs: a shadow whose main finished goes too; forget finished pairs."""
        for mid, sid in list(self.shadow_of_main.items()):
            main, shadow = self.requests.get(mid), self.requests.get(sid)
            main_done = main is None or main.is_finished()
            shadow_done = shadow is None or shadow.is_finished()
            if main_done and not shadow_done:
                super().finish_requests(sid, RequestStatus.FINISHED_ABORTED)
            elif shadow_done and not main_done:
                raise RuntimeError(f"CFG shadow {sid} finished before its main {mid}")
            if main_done:
                del self.shadow_of_main[mid]
                self.main_of_shadow.pop(sid, None)

    def drop_shadow_outputs(self, outputs: dict[int, EngineCoreOutputs]) -> None:
        """Remove every shadow's EngineCoreOutput: nothing of a shadow leaves the engine core."""
        if not self.main_of_shadow:
            return
        for engine_outputs in outputs.values():
            engine_outputs.outputs = [o for o in engine_outputs.outputs if o.request_id not in self.main_of_shadow]

    def make_stats(self, *args: Any, **kwargs: Any) -> SchedulerStats | None:
        """vLLM's scheduler stats (log_stats), shadows not counted as requests."""
        stats = super().make_stats(*args, **kwargs)
        if stats is not None and self.main_of_shadow:
            running = sum(1 for r in self.running if r.request_id in self.main_of_shadow)
            waiting = sum(1 for r in self.waiting if r.request_id in self.main_of_shadow)
            stats.num_running_reqs -= running
            stats.num_waiting_reqs -= waiting
        return stats

    # --- before vLLM's schedule() ------------------------------------------------------------

    def units(self, running: list[Request]) -> list[list[Request]]:
        """`running` grouped into [main, shadow] pairs and single requests, in order."""
        if not self.shadow_of_main:
            return [[r] for r in running]
        by_id = {r.request_id: r for r in running}
        out = []
        for r in running:
            rid = r.request_id
            if self.main_of_shadow.get(rid) in by_id:
                continue  # placed with its main
            sid = self.shadow_of_main.get(rid)
            out.append([r, by_id[sid]] if sid in by_id else [r])
        return out

    def _tokens_needed(self, r: Request) -> int:
        return r.num_tokens_with_spec + r.num_output_placeholders - r.num_computed_tokens

    def _blocks_needed(self, r: Request, num_new_tokens: int) -> int:
        have = len(self.kv_cache_manager.coordinator.single_type_managers[0].req_to_blocks.get(r.request_id, ()))
        return max(0, cdiv(r.num_computed_tokens + num_new_tokens, self.block_size) - have)

    def fit_running(self, units: list[list[Request]], now: float) -> tuple[list[list[Request]], list[Request], int, int, bool]:
        """Pairs whole or not at all, and enough KV for every scheduled unit.

        Returns (units to schedule, requests held out this step, token budget left, free blocks
        left, whether anything was preempted). Preempted units leave `units` for the waiting
        queue, main ahead of its shadow.
        """
        units = list(units)
        preempted = False
        pool = self.kv_cache_manager.block_pool
        while True:
            budget = self.max_num_scheduled_tokens
            need_blocks, kept, held = 0, [], []
            for u in units:
                need = [self._tokens_needed(r) for r in u]
                if len(u) == 2:
                    if need[0] != need[1] or u[0].num_computed_tokens != u[1].num_computed_tokens:
                        raise RuntimeError(f"CFG pair {u[0].request_id} out of step: {need} tokens to go")
                    if sum(need) > budget:
                        held.extend(u)
                        continue
                else:
                    need = [min(need[0], budget)]
                budget -= sum(need)
                need_blocks += sum(self._blocks_needed(r, n) for r, n in zip(u, need) if n > 0)
                kept.append(u)
            free = pool.get_num_free_blocks()
            if need_blocks <= free or not units:
                return kept, held, budget, free - need_blocks, preempted
            for r in reversed(units.pop()):  # shadow first: the main ends up ahead of it
                self._preempt_request(r, now)
            preempted = True

    def pair_up_waiting(self) -> list[Request]:
        """The waiting queue in order, each shadow right behind its main (rebuilt if need be)."""
        queue = list(self.waiting)
        if not self.main_of_shadow:
            return queue
        ordered = []
        for r in queue:
            if r.request_id in self.main_of_shadow:
                continue
            ordered.append(r)
            sid = self.shadow_of_main.get(r.request_id)
            shadow = self.requests.get(sid) if sid is not None else None
            if shadow is not None and shadow.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
                ordered.append(shadow)
        if len(ordered) != len(queue) or any(a is not b for a, b in zip(ordered, queue)):
            self.waiting.remove_requests(queue)
            for r in ordered:
                self.waiting.add_request(r)
        return ordered

    def waiting_to_hide(self, budget: int, free_blocks: int, slots: int, any_running: bool) -> list[Request]:
        """The waiting requests to hide from vLLM this step: from the first pair that might not be
        admitted whole on, everything (FCFS order is kept); requests before it are counted at
        their worst case (whole prompt, no prefix hit)."""
        queue = self.pair_up_waiting()
        if not self.main_of_shadow:
            return []
        watermark = self.kv_cache_manager.watermark_blocks
        for i, r in enumerate(queue):
            rid = r.request_id
            if rid in self.main_of_shadow:
                continue  # counted with its main
            n = r.num_tokens - r.num_computed_tokens
            blocks = cdiv(r.num_tokens, self.block_size)
            if rid in self.shadow_of_main:
                fits = (
                    i + 1 < len(queue)
                    and queue[i + 1].request_id == self.shadow_of_main[rid]
                    and slots >= 2
                    and 2 * n <= budget
                    and 2 * blocks + (watermark if any_running else 0) <= free_blocks
                )
                if not fits:
                    return queue[i:]
                slots, budget, free_blocks = slots - 2, budget - 2 * n, free_blocks - 2 * blocks
            else:
                slots -= 1
                budget -= min(n, max(budget, 0))
                free_blocks -= blocks + (watermark if any_running else 0)
            any_running = True
        return []

    # --- after vLLM's schedule() -------------------------------------------------------------

    def check_pairs(self, scheduler_output: SchedulerOutput) -> int:
        """Raise unless every pair is scheduled whole, in step; return the number scheduled."""
        scheduled = scheduler_output.num_scheduled_tokens
        pairs = 0
        for mid, sid in self.shadow_of_main.items():
            a, b = scheduled.get(mid), scheduled.get(sid)
            if a is None and b is None:
                continue
            main, shadow = self.requests[mid], self.requests[sid]
            if a != b or main.num_computed_tokens != shadow.num_computed_tokens:
                raise RuntimeError(
                    f"CFG pair split: {mid} scheduled {a} tokens (at {main.num_computed_tokens}), "
                    f"its shadow {b} (at {shadow.num_computed_tokens})"
                )
            pairs += 1
        if pairs:
            self.pair_steps += 1
        return pairs
