"""The transformers config class for `model_type: opuslm` (a Llama config plus our block)."""

from __future__ import annotations

from transformers import LlamaConfig

from engine.checkpoint import MODEL_TYPE


class OpusLMHFConfig(LlamaConfig):
    model_type = MODEL_TYPE
