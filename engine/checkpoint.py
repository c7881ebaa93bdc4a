"""The project's checkpoint format: a directory with `config.json` + `model.safetensors`.

The same format is written by `duplex model make-tiny` and by the ESPnet converter, and read by
both the vLLM plugin and the PyTorch reference:

    config.json         HF-style backbone fields + "architectures": ["OpusLMForCausalLM"],
                        "model_type": "opuslm" and an "opuslm" block (streams, text size)
    model.safetensors   model.embed_tokens.weight [V, H]     the one table all 9 streams share
                        model.layers.{i}.* / model.norm.*    the backbone, HF Llama or Olmo2 names
                        lm_head.weight [V, H]                untied output head
                        head_emb.weight [12, H]              per-stream vector, row k for stream k
    codec/, ssl/        the audio codec and SSL tokenizer (engine/codec)
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from engine import vocab
from engine.layout import DEFAULT_SPEAKER_PROMPT_LENGTH, PromptLayout

ARCHITECTURE = "OpusLMForCausalLM"
MODEL_TYPE = "opuslm"
FORMAT_VERSION = 1
NUM_HEAD_EMB = 12  # ESPnet allocates 12 rows; rows 9-11 are unused
# "llama": SmolLM2 / Llama layers (pre-norm). "olmo2": OLMo-2 layers (q/k RMSNorm over the whole
# projection, norms after attention and after the MLP, no input norm), as in HF `Olmo2Model`.
SUPPORTED_BACKBONES = ("llama", "olmo2")
# OpusLMConfig fields kept in config.json's "opuslm" block (a checkpoint written before the layout
# values were carried has none: the defaults, which are what it was served with)
_BLOCK_FIELDS = ("backbone", "num_streams", "text_size", "speaker_prompt_length", "pad_speaker_prompt")


@dataclass(frozen=True)
class OpusLMConfig:
    """What the engine needs to know about a checkpoint (a view of config.json)."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    text_size: int
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    backbone: str = "llama"
    torch_dtype: str = "float32"
    num_streams: int = vocab.NUM_STREAMS
    # the layout values of the checkpoint's training config (engine/layout.py), in the "opuslm" block
    speaker_prompt_length: int = DEFAULT_SPEAKER_PROMPT_LENGTH
    pad_speaker_prompt: bool = True
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if self.backbone not in SUPPORTED_BACKBONES:
            raise ValueError(f"unknown backbone {self.backbone!r}; supported: {SUPPORTED_BACKBONES}")
        if self.num_streams != vocab.NUM_STREAMS:
            raise ValueError(f"num_streams must be {vocab.NUM_STREAMS}, got {self.num_streams}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError("hidden_size must be a multiple of num_attention_heads")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        vocab.VocabLayout(text_size=self.text_size, vocab_size=self.vocab_size)
        PromptLayout(self.speaker_prompt_length, self.pad_speaker_prompt)  # ValueError on a bad value

    @property
    def prompt_layout(self) -> PromptLayout:
        return PromptLayout(self.speaker_prompt_length, self.pad_speaker_prompt)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def layout(self) -> vocab.VocabLayout:
        return vocab.VocabLayout(text_size=self.text_size, vocab_size=self.vocab_size)

    def to_hf_dict(self) -> dict[str, Any]:
        """config.json contents: HF Llama fields vLLM reads, plus our own block."""
        d = {
            "architectures": [ARCHITECTURE],
            "model_type": MODEL_TYPE,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab_size,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "hidden_act": "silu",
            "tie_word_embeddings": False,
            "attention_bias": False,
            "mlp_bias": False,
            "torch_dtype": self.torch_dtype,
            "bos_token_id": vocab.SOS_EOS,
            "eos_token_id": vocab.ENGINE_STOP,
            "pad_token_id": vocab.PAD,
            "opuslm": {
                "format_version": FORMAT_VERSION,
                "backbone": self.backbone,
                "num_streams": self.num_streams,
                "text_size": self.text_size,
                "speaker_prompt_length": self.speaker_prompt_length,
                "pad_speaker_prompt": self.pad_speaker_prompt,
                **self.extra,
            },
        }
        return d

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> "OpusLMConfig":
        if d.get("model_type") != MODEL_TYPE or ARCHITECTURE not in d.get("architectures", []):
            raise ValueError(
                f"not an OpusLM checkpoint: model_type={d.get('model_type')!r}, "
                f"architectures={d.get('architectures')!r} (expected {MODEL_TYPE!r}/{ARCHITECTURE!r})"
            )
        block = dict(d.get("opuslm") or {})
        if block.get("format_version") != FORMAT_VERSION:
            raise ValueError(f"unsupported opuslm.format_version {block.get('format_version')!r}")
        rope_theta = d.get("rope_theta")
        if rope_theta is None:  # transformers >= 5 writes rope_parameters
            rope_theta = (d.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        known = {f.name for f in fields(cls)}
        kwargs: dict[str, Any] = {k: d[k] for k in known if k in d and k != "extra"}
        kwargs["rope_theta"] = float(rope_theta)
        for key in _BLOCK_FIELDS:
            if key in block:
                kwargs[key] = block.pop(key)
        block.pop("format_version", None)
        kwargs["extra"] = block
        try:
            return cls(**kwargs)
        except TypeError as e:
            raise ValueError(f"config.json is missing a field: {e}") from None


def load_config(model_dir: str | Path) -> OpusLMConfig:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: is {model_dir} a converted OpusLM checkpoint?")
    return OpusLMConfig.from_hf_dict(json.loads(path.read_text()))


def save_config(cfg: OpusLMConfig, model_dir: str | Path) -> None:
    path = Path(model_dir) / "config.json"
    path.write_text(json.dumps(cfg.to_hf_dict(), indent=2, sort_keys=True) + "\n")


def weights_path(model_dir: str | Path) -> Path:
    return Path(model_dir) / "model.safetensors"


def expected_weight_shapes(cfg: OpusLMConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint must hold, with its shape (the converter checks against it)."""
    h, v, kv = cfg.hidden_size, cfg.vocab_size, cfg.num_key_value_heads * cfg.head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (v, h),
        "model.norm.weight": (h,),
        "lm_head.weight": (v, h),
        "head_emb.weight": (NUM_HEAD_EMB, h),
    }
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (h, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, h),
            p + "mlp.gate_proj.weight": (cfg.intermediate_size, h),
            p + "mlp.up_proj.weight": (cfg.intermediate_size, h),
            p + "mlp.down_proj.weight": (h, cfg.intermediate_size),
            p + "post_attention_layernorm.weight": (h,),
        }
        if cfg.backbone == "olmo2":
            shapes |= {
                p + "self_attn.q_norm.weight": (h,),
                p + "self_attn.k_norm.weight": (kv,),
                p + "post_feedforward_layernorm.weight": (h,),
            }
        else:
            shapes[p + "input_layernorm.weight"] = (h,)
    return shapes
