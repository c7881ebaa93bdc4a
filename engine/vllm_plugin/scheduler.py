"""Scheduler subclass: aux-id export, and streaming-aware ordering of realtime requests.

1. Aux ids. vLLM's scheduler already slices `ModelRunnerOutput.sampling_masks` per request into
   `EngineCoreOutput.new_sampling_mask` when `return_sampling_mask` is on, and the output path
   concatenates those per token -- also when it merges deltas for a consumer that lags. We turn
   the slicing on here only, in the engine core; the front-end's model config keeps it off, so
   its request validation for sampling-mask replay does not apply to our requests.

2. Deadlines (VoxServe's idea: a chunk is either in time or not, so slack is spent on others).
   A realtime request's audio plays from the moment its first frame exists; its slack is how far
   the audio generated so far runs ahead of the wall clock. Each step the running queue is
   ordered by slack, least first, so when the token budget or the KV cache runs short the
   tightest deadlines are served and the most comfortable request is the one preempted; a
   response's first frames count as most urgent (time to first audio). Requests further ahead
   than `pacing_lead_ms` sit the step out: generation stays a bounded lead ahead of playback, the
   others get a smaller, faster batch, and a barge-in throws little away.

3. CFG pairs (cfg_pairs.py): a request with cfg_scale != 1 runs beside a shadow request on the
   unconditional prompt; pairs are scheduled, preempted and finished whole, and the shadow's
   outputs never leave the engine core.

4. Step timing. Each step's duration (schedule to outputs) and batch size ride on one output's
   `kv_transfer_params` (unused without a KV connector) so the service's admission control
   measures the engine itself, not the gaps that pacing puts between a request's steps.
"""

from __future__ import annotations

import math
import time

from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request

from engine import vocab
from engine.delay import MAX_DELAY
from engine.modality import SWITCH_TOKEN
from engine.request import EXTRA_ARGS_KEY
from engine.units import FRAME_MS
from engine.vllm_plugin import plugin_settings, urgent_tokens
from engine.vllm_plugin.cfg_pairs import CfgPairsMixin

FRAME_S = FRAME_MS / 1000.0
DEFAULT_PACING_LEAD_MS = 500.0
DEFAULT_URGENT_TOKENS = urgent_tokens(4)  # when the settings do not say: the codec's default 4-frame first chunk
STEP_TIMING_KEY = "opuslm_step"


def order_by_slack(slacks: list[float], lead_s: float) -> tuple[list[int], list[int]]:
    """Indices to schedule (least slack first, stable) and indices to hold (slack > lead_s)."""
    held = [i for i, s in enumerate(slacks) if s > lead_s]
    held_set = set(held)
    active = sorted((i for i in range(len(slacks)) if i not in held_set), key=lambda i: slacks[i])
    return active, held


class OpusScheduler(CfgPairsMixin, Scheduler):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._init_pairs()
        self.return_sampling_mask = True
        extra = plugin_settings(self.vllm_config)
        self.pacing_lead_s = float(extra.get("pacing_lead_ms", DEFAULT_PACING_LEAD_MS)) / 1000.0
        # output tokens before a response's first audio chunk can be decoded: until then it is most urgent
        self.urgent_tokens = int(extra.get("urgent_tokens", DEFAULT_URGENT_TOKENS))
        self._first_frame_at: dict[str, float] = {}  # realtime request -> when frame 0 existed
        self._step_started = time.monotonic()
        self._realtime: dict[str, bool] = {}
        self._text_first: dict[str, int | None] = {}  # text-first requests: output tokens before their audio

    def _is_realtime(self, request) -> bool:
        rid = request.request_id
        if rid not in self._realtime:
            block = ((request.sampling_params.extra_args or {}) if request.sampling_params else {}).get(EXTRA_ARGS_KEY) or {}
            self._realtime[rid] = bool(block.get("realtime"))
            if block.get("start", vocab.CODEC_SSL) == vocab.TEXT_BPE:
                self._text_first[rid] = None  # its audio's first output token, once it switched
        return self._realtime[rid]

    def _audio_tokens(self, request) -> int | None:
        """Output tokens of the request's audio segment; None while it writes text (engine/modality.py).
        Text plays nothing, and a realtime answer's audio waits for it: it is as urgent as a first frame."""
        rid = request.request_id
        if rid not in self._text_first:
            return request.num_output_tokens
        start = self._text_first[rid]
        if start is None:
            out = list(request.output_token_ids)  # a text phase is short (max_text_tokens); 34 only ever ends it
            if SWITCH_TOKEN not in out:
                return None
            start = self._text_first[rid] = out.index(SWITCH_TOKEN) + 1
        return request.num_output_tokens - start

    def slack_s(self, request, now: float) -> float:
        """Seconds of generated audio ahead of playback. An offline request (a one-shot ASR or TTS, a
        benchmark) counts as `pacing_lead_s` ahead: never held, but served after every realtime
        answer that is not ahead by more, and the first preempted when the KV cache runs short."""
        if not self._is_realtime(request):
            return self.pacing_lead_s
        started = self._first_frame_at.get(request.request_id)
        audio = self._audio_tokens(request)
        if started is None or audio is None or audio < self.urgent_tokens:
            return -math.inf
        return started + (audio - MAX_DELAY) * FRAME_S - now

    def schedule(self, *args, **kwargs):
        now = self._step_started = time.monotonic()
        units = self.units(self.running)  # a CFG pair is one unit: ordered, held, preempted whole
        active, held = order_by_slack([self.slack_s(u[0], now) for u in units], self.pacing_lead_s)
        held_reqs = [r for i in held for r in units[i]]
        active_units = [units[i] for i in active]
        hidden: list[Request] = []
        budget, free, preempted = 0, 0, False  # what fit_running leaves, when there are pairs
        if self.shadow_of_main:
            active_units, budget_held, budget, free, preempted = self.fit_running(active_units, now)
            held_reqs += budget_held
        self.running = [r for u in active_units for r in u]
        # held requests keep their runner slots: admit fewer new ones meanwhile
        saved_active = self.max_num_active_reqs
        self.max_num_active_reqs = max(saved_active - len(held_reqs), 0)
        if self.shadow_of_main:
            # like vLLM: nothing is admitted in a step that preempted
            hidden = list(self.waiting) if preempted else self.waiting_to_hide(
                budget, free, self.max_num_active_reqs - len(self.running), bool(self.running)
            )
            if hidden:
                self.waiting.remove_requests(hidden)
        try:
            out = super().schedule(*args, **kwargs)
        finally:
            self.max_num_active_reqs = saved_active
            self.running = self.running + held_reqs
            for r in hidden:
                self.waiting.add_request(r)
        self._step_pairs = self.check_pairs(out)
        return out

    def update_from_output(self, scheduler_output, model_runner_output):
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        self._reap_pairs()
        self.drop_shadow_outputs(outputs)
        now = time.monotonic()
        pairs = self._step_pairs
        timing = {STEP_TIMING_KEY: {"ms": 1000.0 * (now - self._step_started),
                                    "batch": len(scheduler_output.num_scheduled_tokens) - pairs,
                                    "tokens": scheduler_output.total_num_scheduled_tokens,
                                    "cfg_pairs": pairs}}
        for engine_outputs in outputs.values():
            # one output per client and step is enough: every consumer sees the engine's steps
            # through whichever request it follows, and each dict costs serialization time
            if engine_outputs.outputs:
                engine_outputs.outputs[0].kv_transfer_params = timing
        for rid in scheduler_output.num_scheduled_tokens:
            req = self.requests.get(rid)
            if req is not None and rid not in self._first_frame_at and req.num_output_tokens > MAX_DELAY:
                if self._is_realtime(req) and (self._audio_tokens(req) or 0) > MAX_DELAY:
                    self._first_frame_at[rid] = now
        if len(self._realtime) > 2 * max(len(self.requests), 64):
            self._first_frame_at = {k: v for k, v in self._first_frame_at.items() if k in self.requests}
            self._realtime = {k: v for k, v in self._realtime.items() if k in self.requests}
            self._text_first = {k: v for k, v in self._text_first.items() if k in self.requests}
        return outputs
