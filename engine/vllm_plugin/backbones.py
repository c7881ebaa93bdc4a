"""The transformer body behind `OpusLMForCausalLM`, chosen by the checkpoint's `opuslm.backbone`.

Both variants are vLLM's `LlamaModel` (embedding table, layer stack, final norm, weight loader
that stacks q/k/v and gate/up); only the decoder layer differs:

- "llama"  (SmolLM2, the dialogue model): vLLM's own `LlamaDecoderLayer`.
- "olmo2"  (OLMo-2, the 7B): `Olmo2DecoderLayer` below. vLLM 0.32 has no native OLMo-2 class
  (the registry sends `Olmo2ForCausalLM` to the generic Transformers backend, which cannot carry
  our summed embeddings and per-stream heads), so the layer is written here from vLLM's parts,
  following HF `Olmo2DecoderLayer`:
      q = q_norm(q_proj(x)); k = k_norm(k_proj(x))     RMSNorm over the whole projection, then RoPE
      x = x + post_attention_layernorm(attn(x))        no input norm
      x = x + post_feedforward_layernorm(mlp(x))

The layer keeps `LlamaModel`'s (hidden_states, residual) calling convention — the stream value is
`hidden_states + residual` — so the model's final fused add-and-norm stays correct.
"""

from __future__ import annotations

import torch
from vllm.config import VllmConfig
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaModel

from engine.checkpoint import SUPPORTED_BACKBONES


class Olmo2Attention(LlamaAttention):
    """Llama attention plus OLMo-2's q/k RMSNorm, applied before RoPE (tensor parallel 1 only)."""

    def __init__(self, config, **kwargs) -> None:
        super().__init__(config=config, **kwargs)
        eps = config.rms_norm_eps
        self.q_norm = RMSNorm(self.total_num_heads * self.head_dim, eps=eps)
        self.k_norm = RMSNorm(self.total_num_kv_heads * self.head_dim, eps=eps)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        qkv, _ = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.rotary_emb(positions, self.q_norm(q), self.k_norm(k))
        out, _ = self.o_proj(self.attn(q, k, v))
        return out


class Olmo2DecoderLayer(LlamaDecoderLayer):
    def __init__(self, vllm_config: VllmConfig, prefix: str = "", config=None) -> None:
        super().__init__(vllm_config, prefix, config, attn_layer_type=Olmo2Attention)
        config = config or vllm_config.model_config.hf_config
        del self.input_layernorm  # OLMo-2 normalises outputs, not inputs
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x = hidden_states if residual is None else hidden_states + residual
        x = x + self.post_attention_layernorm(self.self_attn(positions=positions, hidden_states=x))
        return self.post_feedforward_layernorm(self.mlp(x)), x


def make_backbone(vllm_config: VllmConfig, prefix: str, backbone_name: str) -> LlamaModel:
    """The backbone module for `backbone_name` (checkpoint.SUPPORTED_BACKBONES)."""
    if backbone_name == "llama":
        return LlamaModel(vllm_config=vllm_config, prefix=prefix)
    if backbone_name == "olmo2":
        return LlamaModel(vllm_config=vllm_config, prefix=prefix, layer_type=Olmo2DecoderLayer)
    raise ValueError(f"unknown backbone {backbone_name!r}; supported: {SUPPORTED_BACKBONES}")
