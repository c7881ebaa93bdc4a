"""OpusLM as a vLLM model: Primary-Auxiliary Decomposition over vLLM's Llama backbone.

vLLM's sequence is stream 0. In every forward:
  1. the input embedding of each position is the sum of its 9 streams' embeddings: stream 0 from
     vLLM's input ids, streams 1-8 from a persistent device buffer the runner fills from the
     per-request history before the forward (aux_inputs.py, stream_state.py). The forward reads
     nothing else, so vLLM may capture it in a CUDA graph or compile it;
  2. `compute_logits` returns stream 0's logits, masked to what the delay pattern allows this
     step, for vLLM's own sampler; and in the same call samples streams 1-8 from
     lm_head(h + head_emb[k]) with the request's sampling parameters and records them, so they
     feed the next step's embedding and leave with this step's output. A row in a text phase
     (engine/modality.py) instead samples its stream-0 text token here (`step_text`, which the
     runner writes over vLLM's sample) and leaves streams 1-8 PAD.

The runner (runner.py) tells the model which request each row is before the forward.
Tensor parallelism is not supported (the heads slice the full lm_head).

What runs where, and why: `forward` is the part vLLM captures (CUDA graphs for decode batches,
torch.compile) -- pure tensor ops on its arguments and `aux_inputs.ids`. `compute_logits` is
called by vLLM's runner after the forward, eagerly, outside any graph (it is not part of the
captured callable in any cudagraph mode), and everything data-dependent stays there: the delay
rules and stop forcing (per request, per step), aux sampling (per-request temperature/top-k/
top-p and seeded generators, numpy on a CPU) and the CFG merge (which rows pair up changes every
step). Those are per-row, not per-token, costs, and the host needs the sampled aux ids anyway to
record history and return them; freezing them into a graph would buy nothing and replay stale
pairings.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm, dispatch_unquantized_gemm
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
from vllm.model_executor.models.utils import AutoWeightsLoader, maybe_prefix
from vllm.platforms import current_platform

from engine import guidance, heads, modality, vocab
from engine.checkpoint import NUM_HEAD_EMB
from engine.request import WorkerRequestSpec
from engine.sampling import SamplingConfig, sample_rows
from engine.vllm_plugin.aux_inputs import AuxInputs, opus_forward
from engine.vllm_plugin.backbones import make_backbone
from engine.vllm_plugin.stream_state import NO_PAIRS, CfgPairs, StepBatch, StreamStateStore


NO_TEXT = (np.empty(0, np.int64), np.empty(0, np.int64))


@dataclass
class _AudioHead:
    """The GEMM operands vLLM's dispatch reads (it adds `cpu_linear` on a CPU). Not an
    nn.Module: its weight is a view of lm_head's and must not be registered as a second one."""

    weight: torch.Tensor
    bias: torch.Tensor


class OpusLMForCausalLM(nn.Module):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        config = vllm_config.model_config.hf_config
        if vllm_config.parallel_config.tensor_parallel_size != 1:
            raise ValueError("OpusLM runs with tensor_parallel_size=1")
        self.config = config
        self.vocab_size = config.vocab_size
        self.model = make_backbone(vllm_config, maybe_prefix(prefix, "model"), config.opuslm["backbone"])
        self.lm_head = ParallelLMHead(
            config.vocab_size, config.hidden_size, prefix=maybe_prefix(prefix, "lm_head")
        )
        self.head_emb = nn.Embedding(NUM_HEAD_EMB, config.hidden_size)
        # sized like vLLM's input_ids buffer: no step (or CUDA-graph batch size) exceeds it
        self.aux_inputs = AuxInputs(
            vllm_config.scheduler_config.max_num_batched_tokens, self.head_emb.weight.device
        )
        self.streams = StreamStateStore()
        self._audio_head: _AudioHead | None = None  # built once the weights are loaded
        self._text_head: tuple[_AudioHead, _AudioHead] | None = None  # built on the first text step
        self.step_text: tuple[np.ndarray, np.ndarray] = NO_TEXT  # this step's text rows and tokens (runner)
        self._batch: StepBatch | None = None  # set by the runner for one forward
        self.step_pairs: CfgPairs = NO_PAIRS  # this step's CFG pairs (the runner copies stream 0)

    # --- request lifecycle (called by the runner) ------------------------------------------------

    def add_request(self, req_id: str, extra_args: dict | None, prompt_len: int, sampling: SamplingConfig) -> None:
        spec = WorkerRequestSpec.from_extra_args(extra_args, prompt_len)
        self.streams.add(req_id, spec, sampling, self.head_emb.weight.device)

    def remove_request(self, req_id: str) -> None:
        self.streams.remove(req_id)

    def begin_step(self, batch: StepBatch, num_tokens: int) -> None:
        """Before the forward, outside any graph: this step's rows, and the aux ids of its
        `num_tokens` (padded) tokens into the persistent buffer the forward reads."""
        self._batch = batch
        self.step_pairs = NO_PAIRS
        self.streams.gather_aux(batch, self.aux_inputs.host[:num_tokens])
        self.aux_inputs.upload(num_tokens)

    def end_step(self, req_ids: list[str], sampled: list[list[int]]) -> list[np.ndarray]:
        """Record stream 0's samples; return each output row's aux ids (empty if none)."""
        empty = np.empty(0, dtype=np.int64)
        out = []
        for req_id, toks in zip(req_ids, sampled):
            if toks:
                self.streams.record_stream0(req_id, toks[-1])
            out.append(self.streams.step_aux.get(req_id, empty))
        self.streams.step_aux = {}
        return out

    # --- vLLM model interface --------------------------------------------------------------------

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_input_ids(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors=None,
        inputs_embeds: torch.Tensor | None = None,
        **kwargs,
    ) -> torch.Tensor:
        if inputs_embeds is not None:  # vLLM passes embeddings only for prompt-embeds inputs
            return self.model(None, positions, intermediate_tensors, inputs_embeds)
        if input_ids is None:
            raise ValueError("the OpusLM forward needs input ids or input embeddings")
        # profiling and capture runs read whatever the buffer holds (valid ids); their output is
        # thrown away
        return opus_forward(
            self.model,  # type: ignore[arg-type]  # VocabParallelEmbedding's .weight is registered by its quant method: torch types it Tensor | Module
            self.aux_inputs, input_ids, positions, intermediate_tensors,
        )

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        batch, self._batch = self._batch, None
        self.step_text = NO_TEXT
        if batch is None or hidden_states.shape[0] != batch.num_rows:
            # profiling / dummy runs: plain logits, nothing recorded
            return self.lm_head.quant_method.apply(self.lm_head, hidden_states)[:, : self.vocab_size].float()
        plan = self.streams.plan(batch)
        pairs = self.step_pairs = self.streams.cfg_pairs(batch, plan)
        rows_of, rules, text = None, plan.rules, plan.text  # rows_of: batch row -> row of `hidden_states`
        if len(pairs):
            # CFG merges in the audio phase only (as the espnet/vllm fork): a text-phase main keeps its
            # own hidden state, its shadow's is dropped all the same
            merge = None if text is None else ~text[pairs.main_rows]
            hidden_states, kept, rows_of = self._merge_pairs(hidden_states, pairs, merge)
            rules = plan.rules[kept]
            text = None if text is None else text[kept]
        commit = np.nonzero(plan.commit)[0]
        if text is None:  # no row writes text: every row is projected over the audio ids alone
            projected = self._project(hidden_states).float()
            if len(commit):
                self.streams.commit(batch, plan, self._sample_aux(batch, plan, projected, commit, pairs, rows_of))
            else:
                self.streams.step_aux = {}
            logits0 = heads.stream0_logits_(projected, rules)
        else:
            logits0 = self._mixed_step(batch, plan, hidden_states, rules, text, commit, pairs, rows_of)
        if rows_of is None:
            return logits0.contiguous()  # vLLM's CPU sampling kernels read rows densely
        # one row per batch row again: a shadow's is its main's (the runner overwrites its sample)
        return logits0.index_select(0, torch.from_numpy(rows_of).to(logits0.device))

    def _mixed_step(self, batch: StepBatch, plan, hidden: torch.Tensor, rules: np.ndarray, text: np.ndarray,
                    commit: np.ndarray, pairs: CfgPairs, rows_of: np.ndarray | None) -> torch.Tensor:
        """A step with text-phase rows: audio rows are projected over the audio ids and sampled as
        always; text rows over the text candidates alone, and their stream 0 is sampled here with the
        request's text sampling (`step_text`, which the runner writes over vLLM's sample: their
        logits row is a placeholder). Returns stream 0's logits, one row per row of `hidden`."""
        dev = hidden.device
        audio_rows = np.nonzero(~text)[0]
        logits0 = torch.full((hidden.shape[0], heads.STREAM0_WIDTH), float("-inf"), device=dev)
        logits0[:, vocab.PAD] = 0.0  # the text rows' placeholder
        of_row = np.arange(hidden.shape[0]) if rows_of is None else rows_of  # batch row -> row of `hidden`
        aux = np.full((len(commit), vocab.NUM_CODEBOOKS), vocab.PAD, dtype=np.int64)
        if len(audio_rows):
            projected = self._project(hidden.index_select(0, torch.from_numpy(audio_rows).to(dev))).float()
            to_projected = np.full(hidden.shape[0], -1, dtype=np.int64)
            to_projected[audio_rows] = np.arange(len(audio_rows))
            audio_commit = ~text[of_row[commit]]
            if audio_commit.any():
                aux[audio_commit] = self._sample_aux(batch, plan, projected, commit[audio_commit], pairs,
                                                     to_projected[of_row])
            logits0[torch.from_numpy(audio_rows).to(dev)] = heads.stream0_logits_(projected, rules[audio_rows])
        # text rows: the committing mains sample (a shadow takes its main's token in the runner)
        shadows = pairs.shadow_rows if len(pairs) else np.empty(0, np.int64)
        writers = commit[text[of_row[commit]] & ~np.isin(commit, shadows)]
        if len(writers):
            h = hidden.index_select(0, torch.from_numpy(of_row[writers]).to(dev))
            logits = self._text_logits(h)
            heads.mask_text_logits_(logits, plan.text_rules[writers], plan.switch[writers])
            configs, gens = self.streams.text_sampling_rows(batch, writers)
            self.step_text = (writers, modality.column_token(sample_rows(logits, configs, gens).cpu().numpy()))
        if len(commit):
            self.streams.commit(batch, plan, aux)
        else:
            self.streams.step_aux = {}
        return logits0

    def _text_logits(self, h: torch.Tensor) -> torch.Tensor:
        """heads.text_logits, with vLLM's GEMM kernel for the text block."""
        if self._text_head is None:
            self._text_head = self._make_text_head()
        head, markers = self._text_head
        marker_logits = torch.nn.functional.linear(h, markers.weight, markers.bias)
        text = dispatch_unquantized_gemm()(head, h, head.weight, head.bias)
        return torch.cat([marker_logits, text], dim=-1).float()

    def _make_text_head(self) -> tuple["_AudioHead", "_AudioHead"]:
        """lm_head's text rows (a view) with stream 0's bias, prepacked like the audio head; and the
        two marker rows (EOS, the switch marker) with theirs."""
        text_end = vocab.TEXT_OFFSET + int(self.config.opuslm["text_size"])
        table = self._lm_head_weight()
        weight = table.data[vocab.TEXT_OFFSET : text_end]
        bias = heads.text_bias(table, self.head_emb.weight, text_end).to(weight.dtype)
        head = _AudioHead(weight, bias[modality.TEXT_COLUMN0 :].contiguous())
        if current_platform.is_cpu():
            dispatch_cpu_unquantized_gemm(head, remove_weight=False)  # type: ignore[arg-type]  # duck-typed: vLLM reads .weight/.bias and sets .cpu_linear
        markers = _AudioHead(table.data[list(modality.MARKER_IDS)], bias[: modality.TEXT_COLUMN0].contiguous())
        return head, markers

    def _project(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Every stream's logits [rows, AUDIO_END] (heads.project), with vLLM's GEMM kernel."""
        if self._audio_head is None:
            self._audio_head = self._make_audio_head()
        head = self._audio_head
        return dispatch_unquantized_gemm()(head, hidden_states, head.weight, head.bias)

    def _make_audio_head(self) -> "_AudioHead":
        """lm_head's audio rows with the per-stream bias fused (heads.py), in vLLM's GEMM.

        On a CPU, vLLM prepacks a weight into a oneDNN handle when the model is loaded; this
        narrower weight gets its own handle here, the same way. The rows are a view: no copy.
        """
        table = self._lm_head_weight()
        weight = table.data[: heads.AUDIO_END]
        head = _AudioHead(weight, heads.stream_bias(table, self.head_emb.weight).to(weight.dtype))
        if current_platform.is_cpu():
            dispatch_cpu_unquantized_gemm(head, remove_weight=False)  # type: ignore[arg-type]  # duck-typed: vLLM reads .weight/.bias and sets .cpu_linear
        return head

    def _lm_head_weight(self) -> torch.Tensor:
        """lm_head's [V, H] table. vLLM's quant method registers it, so torch types the attribute
        Tensor | Module; it is a Parameter."""
        weight = self.lm_head.weight
        if not isinstance(weight, torch.Tensor):
            raise TypeError(f"lm_head.weight is a {type(weight).__name__}, not a tensor")
        return weight

    @staticmethod
    def _merge_pairs(hidden: torch.Tensor, pairs: CfgPairs, merge: np.ndarray | None = None) -> tuple[torch.Tensor, np.ndarray, np.ndarray]:
        """CFG merge, for all 9 streams at once, in hidden space.

        Every stream's logits are lm_head(h) + a constant bias (heads.py), linear in h, so
        guidance.merge of the logits equals lm_head(guidance.merge(h_cond, h_uncond)) + bias: the merge
        costs H per pair instead of V, and the shadow rows, which sample nothing themselves
        (they copy their main's tokens: streams 1-8 in `_sample_aux`, stream 0 in the runner),
        are not projected at all. `merge` [pairs] bool: which pairs merge (None: all); the others keep
        their main's own state. Returns (hidden of the projected rows, their batch rows,
        batch row -> projected row, a shadow mapped to its main's).
        """
        dev = hidden.device
        mains, shadows, scales = pairs.main_rows, pairs.shadow_rows, pairs.scales
        if merge is not None:
            mains, shadows, scales = mains[merge], shadows[merge], scales[merge]
        merged = guidance.merge(
            hidden.index_select(0, torch.from_numpy(mains).to(dev)).float(),
            hidden.index_select(0, torch.from_numpy(shadows).to(dev)).float(),
            torch.from_numpy(scales).to(dev),
        ).to(hidden.dtype)
        keep = np.ones(hidden.shape[0], dtype=bool)
        keep[pairs.shadow_rows] = False
        kept = np.nonzero(keep)[0]
        compact = np.cumsum(keep) - 1
        rows_of = compact.copy()
        rows_of[pairs.shadow_rows] = compact[pairs.main_rows]
        out = hidden.index_select(0, torch.from_numpy(kept).to(dev))
        out.index_copy_(0, torch.from_numpy(compact[mains]).to(dev), merged)
        return out, kept, rows_of

    def _sample_aux(self, batch: StepBatch, plan, projected: torch.Tensor, rows: np.ndarray, pairs: CfgPairs,
                    rows_of: np.ndarray | None) -> np.ndarray:
        """Aux ids [len(rows), 8] of the committing batch rows; a CFG shadow gets its main's."""
        sampled = rows
        if len(pairs):
            sampled = rows[~np.isin(rows, pairs.shadow_rows)]
        src = sampled if rows_of is None else rows_of[sampled]
        aux = heads.aux_logits(projected)  # the DAC columns only, then the rows
        if len(src) != aux.shape[0] or (src != np.arange(len(src))).any():
            aux = aux[torch.from_numpy(src).to(projected.device)]
        configs, gens = self.streams.sampling_rows(batch, sampled)
        codes = sample_rows(aux, configs, gens)
        ids = heads.aux_ids(codes.cpu().numpy(), plan.active[sampled],
                            self.streams.aux_fill(batch, sampled, plan.audio_steps[sampled]))
        if len(sampled) == len(rows):
            return ids
        out = np.empty((len(rows), ids.shape[1]), dtype=ids.dtype)
        pos = {int(r): j for j, r in enumerate(rows)}
        out[[pos[int(r)] for r in sampled]] = ids
        for m, s in zip(pairs.main_rows, pairs.shadow_rows):
            if int(s) in pos:
                out[pos[int(s)]] = out[pos[int(m)]]
        return out

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loader = AutoWeightsLoader(self)
        return loader.load_weights(weights)
