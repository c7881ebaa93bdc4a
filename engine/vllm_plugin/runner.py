"""Model-runner and worker subclasses: tell the OpusLM model which request each row is.

Hooks into vLLM's V1 model runner (all listed in engine/README.md):
  _update_states   new requests -> model.add_request; finished -> model.remove_request
  _model_forward   publish the step's rows (request ids, positions, partial-prefill mask) and
                   write their aux ids into the model's persistent buffer (before the forward,
                   outside any CUDA graph: aux_inputs.py)
  _sample          before vLLM's sampler: top-k counted against stream 0's narrow logits; after
                   it: a text-phase row takes the token the model sampled for it, and a CFG
                   shadow row its main's stream-0 token (before vLLM books either as the row's
                   next input)
  sample_tokens    after vLLM sampled stream 0: record it, and attach each row's 8 aux ids to
                   ModelRunnerOutput.sampling_masks, which the scheduler slices per request and
                   vLLM's output path concatenates per token (lossless for a lagging consumer)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from vllm.v1.outputs import ModelRunnerOutput, SamplingMaskLists
from vllm.v1.worker.cpu_model_runner import CPUModelRunner
from vllm.v1.worker.cpu_worker import CPUWorker
from vllm.v1.worker.gpu_model_runner import GPUModelRunner
from vllm.v1.worker.gpu_worker import Worker as GPUWorker

from engine.sampling import SamplingConfig
from engine.vllm_plugin import plugin_settings
from engine.vllm_plugin.model import OpusLMForCausalLM
from engine.vllm_plugin.stream_state import StepBatch

if TYPE_CHECKING:
    from vllm.sampling_params import SamplingParams
    from vllm.sequence import IntermediateTensors
    from vllm.v1.core.sched.output import GrammarOutput, SchedulerOutput
    from vllm.v1.outputs import AsyncModelRunnerOutput, SamplerOutput

    # the checker sees the mixin as what it always runs as: part of a V1 runner (CPUModelRunner is one)
    _RunnerBase = GPUModelRunner
else:
    _RunnerBase = object


def sampling_config(params: SamplingParams) -> SamplingConfig:
    """vLLM SamplingParams -> the config the aux streams are sampled with."""
    top_k = params.top_k if params.top_k and params.top_k > 0 else 0
    return SamplingConfig(temperature=params.temperature, top_k=top_k, top_p=params.top_p, seed=params.seed)


class OpusRunnerMixin(_RunnerBase):
    """Mixed into vLLM's V1 runner (CPU or GPU); overrides as little as possible."""

    def opus_model(self) -> OpusLMForCausalLM:
        """The loaded model (vLLM's get_model() unwraps any CUDA-graph wrapper), as its class."""
        model = self.get_model()
        if not isinstance(model, OpusLMForCausalLM):
            raise TypeError(f"the OpusLM runner runs OpusLMForCausalLM, not {type(model).__name__}")
        return model

    def _update_states(self, scheduler_output: SchedulerOutput) -> Callable[..., Any] | None:
        model = self.opus_model()
        for req_id in scheduler_output.finished_req_ids:
            model.remove_request(req_id)
        result = super()._update_states(scheduler_output)
        for new in scheduler_output.scheduled_new_reqs:
            params, prompt = new.sampling_params, new.prompt_token_ids
            if params is None or prompt is None:  # a pooling request, or prompt embeddings
                raise ValueError(f"OpusLM request {new.req_id}: only generation from prompt token ids")
            model.add_request(new.req_id, params.extra_args, len(prompt), sampling_config(params))
        return result

    def _model_forward(
        self,
        input_ids: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        intermediate_tensors: IntermediateTensors | None = None,
        inputs_embeds: torch.Tensor | None = None,
        **model_kwargs: Any,
    ) -> Any:
        # Outside the model's (possibly captured) forward: write this step's aux ids into the
        # model's persistent buffer for all `positions` tokens, the CUDA-graph padding included.
        if positions is None:
            raise ValueError("the OpusLM forward needs positions")
        n = self.input_batch.num_reqs
        self.opus_model().begin_step(
            StepBatch(
                req_ids=list(self.input_batch.req_ids[:n]),
                query_start_loc=self.query_start_loc.np[: n + 1].astype(np.int64),
                start=self.input_batch.num_computed_tokens_cpu[:n].astype(np.int64),
                discard=self.discard_request_mask.np[:n].astype(bool),
            ),
            num_tokens=positions.shape[-1],
        )
        return super()._model_forward(input_ids, positions, intermediate_tensors, inputs_embeds, **model_kwargs)

    def _sample(self, logits: torch.Tensor | None, *args: Any, **kwargs: Any) -> SamplerOutput:
        md = self.input_batch.sampling_metadata
        if md.top_k is not None and logits is not None:
            # stream 0's logits are heads.STREAM0_WIDTH wide, not the vocabulary: vLLM marks rows
            # without top-k by k == vocab size, which must read k == width
            md.top_k = md.top_k.clamp(max=logits.shape[-1])
        out = super()._sample(logits, *args, **kwargs)
        model = self.opus_model()
        text_rows, text_tokens = model.step_text
        if len(text_rows):  # a text-phase row's stream 0 was sampled by the model (its logits: a placeholder)
            tok = out.sampled_token_ids
            tok[torch.from_numpy(text_rows).to(tok.device), 0] = torch.from_numpy(text_tokens).to(tok.device, tok.dtype)
        pairs = model.step_pairs
        if len(pairs):
            tok = out.sampled_token_ids
            main = torch.from_numpy(pairs.main_rows).to(tok.device)
            tok[torch.from_numpy(pairs.shadow_rows).to(tok.device)] = tok[main]
        return out

    # vLLM decorates its sample_tokens with a bare `@torch.inference_mode`, which torch's stubs type
    # as the context manager object, not the method it returns at run time: hence the two ignores
    def sample_tokens(  # type: ignore[override]  # see above: vLLM's method is typed as an inference_mode
        self, grammar_output: GrammarOutput | None
    ) -> ModelRunnerOutput | AsyncModelRunnerOutput | IntermediateTensors:
        out: ModelRunnerOutput | AsyncModelRunnerOutput | IntermediateTensors
        out = super().sample_tokens(grammar_output)  # type: ignore[type-var,assignment]  # see above
        if isinstance(out, ModelRunnerOutput) and out.req_ids:
            aux = self.opus_model().end_step(out.req_ids, out.sampled_token_ids)
            offsets = np.zeros(len(aux) + 1, dtype=np.int64)
            offsets[1:] = np.cumsum([len(a) for a in aux])
            out.sampling_masks = SamplingMaskLists(
                token_ids=np.concatenate(aux) if offsets[-1] else np.empty(0, dtype=np.int64),
                offsets=offsets,
            )
        return out


class OpusCPUModelRunner(OpusRunnerMixin, CPUModelRunner):
    pass


class OpusGPUModelRunner(OpusRunnerMixin, GPUModelRunner):
    pass


_V2_MESSAGE = "OpusLM needs vLLM's V1 model runner: set VLLM_USE_V2_MODEL_RUNNER=0"


class _ThreadsReport:
    def torch_threads(self) -> int:
        """The engine core's intra-op threads (collective_rpc("torch_threads"))."""
        return torch.get_num_threads()


class OpusCPUWorker(_ThreadsReport, CPUWorker):
    def init_device(self):
        # Before CPUWorker.init_device, which replaces torch.set_num_threads with a no-op. With
        # the codec and the gateway on the same CPU, an engine whose OpenMP team spans every core
        # has a thread descheduled at each barrier while the others spin: steps double in time.
        threads = int(plugin_settings(self.vllm_config).get("cpu_threads", 0))
        if threads > 0:
            torch.set_num_threads(threads)
        super().init_device()
        if self.use_v2_model_runner:
            raise RuntimeError(_V2_MESSAGE)
        # CPUWorker builds its runner inline; build ours instead (no weights are loaded yet)
        self.model_runner = OpusCPUModelRunner(self.vllm_config, torch.device("cpu"))


class OpusGPUWorker(_ThreadsReport, GPUWorker):
    def _make_model_runner(self):
        if self.use_v2_model_runner:
            raise RuntimeError(_V2_MESSAGE)
        return OpusGPUModelRunner(self.vllm_config, self.device)
