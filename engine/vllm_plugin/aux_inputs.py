"""The forward contract that makes the OpusLM forward capturable by CUDA graphs and torch.compile.

A step's input embedding is stream 0's embedding plus the sum of the 8 aux streams' embeddings
(Primary-Auxiliary Decomposition, engine/README.md). The aux ids live on the host, per request and
position (stream_state.py). A CUDA graph replays the kernels and addresses it recorded, never the
Python around them, so a host→device copy or a numpy gather inside the forward would be replayed
with the captured step's data: wrong audio, no error. Hence the split:

- **the runner writes** (before the forward, outside any graph): each scheduled token's 8 aux ids
  into `AuxInputs.ids`, a persistent [max_num_batched_tokens, 8] device buffer whose address never
  changes -- as vLLM does for `input_ids` and `positions` -- and PAD (0) into the padding tokens a
  CUDA-graph batch size adds;
- **the forward reads** only its arguments and that buffer (`opus_forward`): a gather-and-sum on
  the device, then the backbone. Same address, new contents: a replay sees this step's ids.

Nothing here imports vLLM: `scripts/gpu_check.py` and the graph-safety tests run this same code on
a plain-torch backbone.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import torch
from torch import nn

from engine import vocab


class EmbeddingTable(Protocol):
    @property
    def weight(self) -> torch.Tensor: ...  # [V, H]: the table all 9 streams share


class Backbone(Protocol):
    """The part of vLLM's LlamaModel the forward uses (a plain-torch stand-in has the same)."""

    @property
    def embed_tokens(self) -> EmbeddingTable: ...

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor: ...

    def __call__(self, input_ids, positions, intermediate_tensors, inputs_embeds) -> torch.Tensor: ...


class AuxInputs:
    """The persistent aux-id buffer of one model: host staging + device copy.

    On a CPU both are one tensor (nothing to copy). On a GPU the host side is pinned, so the
    upload is an async copy on the current stream, ordered before the forward that reads it; the
    next step's write into the host side happens only after this step's results were read back
    (the sampled tokens, synchronously: async scheduling is off), so it never races the copy.
    """

    def __init__(self, max_tokens: int, device: torch.device | str) -> None:
        device = torch.device(device)
        with torch.inference_mode(False):  # mutable runtime state, not an inference tensor
            self.ids = torch.zeros(max_tokens, vocab.NUM_CODEBOOKS, dtype=torch.int64, device=device)
            if device.type == "cpu":
                self._host = self.ids
            else:
                pin = torch.cuda.is_available()
                self._host = torch.zeros(max_tokens, vocab.NUM_CODEBOOKS, dtype=torch.int64, pin_memory=pin)
        self.host: np.ndarray = self._host.numpy()  # the runner's write view

    @property
    def max_tokens(self) -> int:
        return self.ids.shape[0]

    def upload(self, num_tokens: int) -> None:
        """Make host rows [0, num_tokens) visible to the forward (a no-op on a CPU)."""
        if self._host is not self.ids:
            self.ids[:num_tokens].copy_(self._host[:num_tokens], non_blocking=True)

    def write(self, ids: np.ndarray, num_padded: int) -> None:
        """Rows [0, len(ids)) = ids, rows [len(ids), num_padded) = PAD; then upload. (Tests and
        scripts; the runner has stream_state gather straight into `host`.)"""
        n = len(ids)
        self.host[:n] = ids
        self.host[n:num_padded] = vocab.PAD
        self.upload(num_padded)


def aux_embedding_sum(table: torch.Tensor, aux_ids: torch.Tensor) -> torch.Tensor:
    """[tokens, H]: the sum of each token's 8 aux-stream embeddings, aux_ids [tokens, 8]: one
    fused gather-and-sum, the same op eager, compiled and in a CUDA graph, on any device.

    The CPU used to do this in numpy (to dodge an OpenMP hand-off on a busy 2-core engine). It no
    longer measurably wins: bench_engine at batch 32 top-k read overhead 1.14/1.19/1.17 with
    embedding_bag against 1.21/1.17/1.19 with numpy (1 engine thread, alternating runs) and
    1.35/1.35/1.35 against 1.36/1.45/1.32 (2 threads); alone, embedding_bag is 2x faster at 32
    tokens and 6x at 2048 (a prefill chunk). Both add the 8 rows in stream order: bit-identical.
    """
    return nn.functional.embedding_bag(aux_ids, table, mode="sum")


def opus_forward(
    backbone: Backbone,
    aux: AuxInputs,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    intermediate_tensors=None,
) -> torch.Tensor:
    """The OpusLM forward: a pure function of (input_ids, positions) and `aux.ids[:tokens]`.

    `aux.ids[:n]` is a view at a fixed address for a fixed n: what a captured graph reads again
    at replay. The backbone always gets embeddings, never ids: a backbone that sometimes sees ids
    and sometimes embeddings cannot be traced once by torch.compile.
    """
    n = input_ids.shape[0]
    embeds = backbone.embed_input_ids(input_ids) + aux_embedding_sum(backbone.embed_tokens.weight, aux.ids[:n])
    return backbone(None, positions, intermediate_tensors, embeds)
