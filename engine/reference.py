"""A plain-PyTorch OpusLM: the correctness oracle for the vLLM plugin and the naive baseline.

It loads the same checkpoint (engine/checkpoint.py), runs its own Llama backbone with a KV cache,
and generates one request at a time with the same delay pattern, stream masks, sampling and
stopping rule. Nothing here imports vLLM.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from engine import checkpoint, delay, guidance, heads, modality, vocab
from engine.request import AudioRequest, Generation
from engine.sampling import sample_rows


class _KVCache:
    def __init__(self, num_layers: int) -> None:
        self.k: list[torch.Tensor | None] = [None] * num_layers
        self.v: list[torch.Tensor | None] = [None] * num_layers

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        past_k, past_v = self.k[layer], self.v[layer]
        if past_k is not None and past_v is not None:
            k = torch.cat([past_k, k], dim=0)
            v = torch.cat([past_v, v], dim=0)
        self.k[layer], self.v[layer] = k, v
        return k, v


class ReferenceOpusLM:
    def __init__(self, cfg: checkpoint.OpusLMConfig, weights: dict[str, torch.Tensor], device: str = "cpu",
                 dtype: torch.dtype = torch.float32):
        self.cfg = cfg
        self.device = torch.device(device)
        missing = set(checkpoint.expected_weight_shapes(cfg)) - set(weights)
        if missing:
            raise ValueError(f"checkpoint is missing tensors: {sorted(missing)[:5]}")
        # float32 is the oracle; another dtype (bf16 on a GPU: scripts/gpu_check.py) runs the
        # same ops in it, with RoPE angles and the heads' bias still computed in float
        self.w = {k: v.to(self.device, dtype) for k, v in weights.items()}
        d = cfg.head_dim
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
        self._inv_freq = inv_freq.to(self.device)
        self._head_bias = heads.stream_bias(self.w["lm_head.weight"], self.w["head_emb.weight"])
        self._text_bias: torch.Tensor | None = None  # built on the first text step

    @classmethod
    def from_dir(cls, model_dir: str | Path, device: str = "cpu", dtype: torch.dtype = torch.float32) -> "ReferenceOpusLM":
        cfg = checkpoint.load_config(model_dir)
        return cls(cfg, load_file(str(checkpoint.weights_path(model_dir))), device, dtype)

    # --- backbone ------------------------------------------------------------------------------

    def embed(self, tokens: np.ndarray) -> torch.Tensor:
        """[T, 9] global ids -> [T, H]: the sum of the 9 streams' embeddings."""
        ids = torch.from_numpy(np.asarray(tokens, dtype=np.int64)).to(self.device)
        return self.w["model.embed_tokens.weight"][ids].sum(dim=1)

    def _rms(self, x: torch.Tensor, name: str) -> torch.Tensor:
        var = x.pow(2).mean(-1, keepdim=True)
        return x * torch.rsqrt(var + self.cfg.rms_norm_eps) * self.w[name]

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # x [T, heads, d]; neox style (rotate halves), as HF Llama and vLLM do
        freqs = positions[:, None].double() * self._inv_freq[None, :]
        cos = freqs.cos().to(x.dtype)[:, None, :]
        sin = freqs.sin().to(x.dtype)[:, None, :]
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

    def _attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                positions: torch.Tensor, cache: _KVCache) -> torch.Tensor:
        """Causal GQA attention with RoPE and the KV cache: q [T, nh, d], k/v [T, nkv, d] -> [T, nh*d]."""
        nh = q.shape[1]
        q, k = self._rope(q, positions), self._rope(k, positions)
        k_all, v_all = cache.append(layer, k, v)  # [S, nkv, d]
        k_all = k_all.repeat_interleave(nh // k.shape[1], dim=1)
        v_all = v_all.repeat_interleave(nh // k.shape[1], dim=1)
        scores = torch.einsum("thd,shd->hts", q, k_all) / math.sqrt(q.shape[-1])
        causal = torch.arange(k_all.shape[0], device=self.device)[None, :] <= positions[:, None]
        scores = scores.masked_fill(~causal[None], float("-inf"))
        return torch.einsum("hts,shd->thd", scores.softmax(-1), v_all).reshape(q.shape[0], -1)

    def forward(self, x: torch.Tensor, start_pos: int, cache: _KVCache) -> torch.Tensor:
        """x [T, H] input embeddings at positions start_pos.. -> final hidden states [T, H]."""
        if self.cfg.backbone == "olmo2":
            return self._forward_olmo2(x, start_pos, cache)
        cfg, w = self.cfg, self.w
        t = x.shape[0]
        positions = torch.arange(start_pos, start_pos + t, device=self.device)
        nh, nkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        for i in range(cfg.num_hidden_layers):
            p = f"model.layers.{i}."
            hn = self._rms(x, p + "input_layernorm.weight")
            q = F.linear(hn, w[p + "self_attn.q_proj.weight"]).view(t, nh, d)
            k = F.linear(hn, w[p + "self_attn.k_proj.weight"]).view(t, nkv, d)
            v = F.linear(hn, w[p + "self_attn.v_proj.weight"]).view(t, nkv, d)
            attn = self._attend(i, q, k, v, positions, cache)
            x = x + F.linear(attn, w[p + "self_attn.o_proj.weight"])
            hn = self._rms(x, p + "post_attention_layernorm.weight")
            gate = F.linear(hn, w[p + "mlp.gate_proj.weight"])
            up = F.linear(hn, w[p + "mlp.up_proj.weight"])
            x = x + F.linear(F.silu(gate) * up, w[p + "mlp.down_proj.weight"])
        return self._rms(x, "model.norm.weight")

    def _forward_olmo2(self, x: torch.Tensor, start_pos: int, cache: _KVCache) -> torch.Tensor:
        """OLMo-2 layers (HF `Olmo2DecoderLayer`): q/k RMSNorm over the whole projection before
        RoPE, no input norm, and the residual adds the *normed* attention and MLP outputs:
            x = x + post_attention_layernorm(attn(x)); x = x + post_feedforward_layernorm(mlp(x))
        """
        cfg, w = self.cfg, self.w
        t = x.shape[0]
        positions = torch.arange(start_pos, start_pos + t, device=self.device)
        nh, nkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        for i in range(cfg.num_hidden_layers):
            p = f"model.layers.{i}."
            q = self._rms(F.linear(x, w[p + "self_attn.q_proj.weight"]), p + "self_attn.q_norm.weight")
            k = self._rms(F.linear(x, w[p + "self_attn.k_proj.weight"]), p + "self_attn.k_norm.weight")
            v = F.linear(x, w[p + "self_attn.v_proj.weight"]).view(t, nkv, d)
            attn = self._attend(i, q.view(t, nh, d), k.view(t, nkv, d), v, positions, cache)
            x = x + self._rms(F.linear(attn, w[p + "self_attn.o_proj.weight"]), p + "post_attention_layernorm.weight")
            gate = F.linear(x, w[p + "mlp.gate_proj.weight"])
            up = F.linear(x, w[p + "mlp.up_proj.weight"])
            mlp = F.linear(F.silu(gate) * up, w[p + "mlp.down_proj.weight"])
            x = x + self._rms(mlp, p + "post_feedforward_layernorm.weight")
        return self._rms(x, "model.norm.weight")

    # --- generation ----------------------------------------------------------------------------

    @torch.inference_mode()
    def generate(self, request: AudioRequest) -> Generation:
        """Generate one request, one step per forward, exactly as the engine does.

        With `cfg_scale` != 1 each step runs two forwards -- the prompt's and the unconditional
        prompt's (engine/guidance.py), each with its own KV cache -- merges their projections (in the
        audio phase; a text phase reads the conditional row alone), samples once, and feeds the same
        step to both. A text-first request samples stream 0 over the text candidates until it emits
        EOS or switches to audio (engine/modality.py); the audio segment then starts as at its opener.
        """
        cfg_ = self.cfg
        prompt = np.asarray(request.prompt, dtype=np.int64)
        if prompt.shape[0] + request.max_steps > cfg_.max_position_embeddings:
            raise ValueError("prompt + max_frames exceed the model's max_position_embeddings")
        guided = guidance.uses_cfg(request.cfg_scale)
        prompts = [prompt, guidance.unconditional_prompt(prompt)] if guided else [prompt]
        caches = [_KVCache(cfg_.num_hidden_layers) for _ in prompts]
        hs = [self.forward(self.embed(p), 0, c)[-1:] for p, c in zip(prompts, caches)]
        scale = torch.tensor([request.cfg_scale], device=self.device)
        lm_head = self.w["lm_head.weight"]
        samp, text_samp = request.sampling, request.text_config
        gen0 = None
        if samp.seed is not None and not samp.greedy:
            gen0 = torch.Generator(device=self.device).manual_seed(samp.seed)
        gen_aux = samp.aux_generator(self.device)
        gen_text = text_samp.text_generator(self.device)

        audio_start = modality.NOT_SWITCHED if request.text_first else 0
        eos_step, steps = delay.NO_EOS, []
        for s in range(request.max_steps):
            if audio_start == modality.NOT_SWITCHED:
                tok0 = self._text_token(hs[0], s, request, text_samp, gen_text)
                step = np.array([tok0] + [vocab.PAD] * vocab.NUM_CODEBOOKS, dtype=np.int64)
                if tok0 == modality.SWITCH_TOKEN:
                    audio_start = s + 1
            else:
                a, eos_a = modality.audio_steps(np.array([s]), np.array([audio_start]), np.array([eos_step]))
                rule = delay.stream0_rules(a, eos_a, request.min_frames, request.max_frames)
                # the heads are linear in h, so merging every stream's logits = projecting the merged
                # hidden state (the vLLM model does the same; engine/guidance.py)
                h = guidance.merge(hs[0], hs[1], scale) if guided else hs[0]
                logits = heads.project(h, lm_head, self._head_bias)
                codes = sample_rows(heads.aux_logits(logits), [samp], [gen_aux])
                logits0 = heads.stream0_logits_(logits, rule)
                active = delay.aux_active(a, eos_a)
                tok0 = int(sample_rows(logits0, [samp], [gen0])[0])
                fill = heads.carry_fill(request.carry, int(a[0]))
                step = np.concatenate([[tok0], heads.aux_ids(codes.cpu().numpy(), active, fill)[0]])
                if tok0 == vocab.SOS_EOS and eos_step == delay.NO_EOS:
                    eos_step = s
            steps.append(step)
            if tok0 == vocab.ENGINE_STOP:
                break
            x = self.embed(step[None])
            hs = [self.forward(x, prompt.shape[0] + s, c) for c in caches]
        return Generation.from_steps(np.stack(steps).astype(np.int64), request.start_modality)

    def _text_token(self, h: torch.Tensor, step: int, request: AudioRequest, samp, gen) -> int:
        """Stream 0's token at text-phase step `step`: a text id, the switch marker or ENGINE_STOP."""
        if self._text_bias is None:
            self._text_bias = heads.text_bias(self.w["lm_head.weight"], self.w["head_emb.weight"], self.text_end)
        rule = modality.text_rules(np.array([step]), request.min_text_tokens, request.max_text_tokens,
                                   request.switch_to_audio)
        logits = heads.text_logits(h, self.w["lm_head.weight"], self._text_bias, self.text_end)
        heads.mask_text_logits_(logits, rule, np.array([request.switch_to_audio]))
        return int(modality.column_token(sample_rows(logits, [samp], [gen]).cpu().numpy())[0])

    @property
    def text_end(self) -> int:
        return vocab.TEXT_OFFSET + self.cfg.text_size


class ReferenceBackbone(torch.nn.Module):
    """The reference's Llama layers behind vLLM's backbone interface (`aux_inputs.Backbone`):
    `(None, positions, None, inputs_embeds) -> hidden`, stateless (a fresh KV cache per call).

    A plain-torch stand-in for vLLM's LlamaModel, so the OpusLM forward contract
    (`vllm_plugin.aux_inputs.opus_forward`) can be compiled and CUDA-graph captured without vLLM
    (tests/engine/test_graph_safety.py, scripts/gpu_check.py). The tokens are one sequence at
    positions 0..T-1 (the causal mask is by index); trailing padding tokens change no real row.
    """

    def __init__(self, ref: ReferenceOpusLM) -> None:
        super().__init__()
        self.ref = ref
        self.embed_tokens = torch.nn.Embedding.from_pretrained(ref.w["model.embed_tokens.weight"], freeze=True)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(self, input_ids, positions: torch.Tensor, intermediate_tensors, inputs_embeds: torch.Tensor) -> torch.Tensor:
        return self.ref.forward(inputs_embeds, 0, _KVCache(self.ref.cfg.num_hidden_layers))

