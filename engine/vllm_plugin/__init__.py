"""vLLM plugin: registers OpusLM with vLLM in every vLLM process (entry point
`vllm.general_plugins` -> `engine.vllm_plugin:register`).

Which vLLM hooks the plugin relies on, and why, is written in engine/README.md.
"""

from __future__ import annotations

from engine.delay import MAX_DELAY

_REGISTERED = False
SETTINGS_KEY = "opuslm"  # VllmConfig.additional_config[SETTINGS_KEY]: the plugin's settings
CODEC_LOOKAHEAD_FRAMES = 2  # StreamConfig.lookahead_frames (engine/codec/streaming.py), which the service keeps


def plugin_settings(vllm_config) -> dict:
    """What AsyncOpusEngine put in `additional_config` for the engine core (empty if nothing)."""
    return (vllm_config.additional_config or {}).get(SETTINGS_KEY, {})


def urgent_tokens(first_chunk_frames: int) -> int:
    """The `urgent_tokens` setting: output tokens before a realtime response's first audio chunk can
    be decoded (the delay, the codec's first chunk and its lookahead). Until then the scheduler
    treats the response as most urgent (time to first audio)."""
    return MAX_DELAY + first_chunk_frames + CODEC_LOOKAHEAD_FRAMES


def register() -> None:
    """Idempotent: vLLM calls it in the front-end, the engine core and every worker."""
    global _REGISTERED
    if _REGISTERED:
        return
    from transformers import AutoConfig
    from vllm import ModelRegistry

    from engine.checkpoint import ARCHITECTURE, MODEL_TYPE
    from engine.vllm_plugin.hf_config import OpusLMHFConfig

    try:
        AutoConfig.register(MODEL_TYPE, OpusLMHFConfig)
    except ValueError:  # already registered in this process
        pass
    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, "engine.vllm_plugin.model:OpusLMForCausalLM")
    _REGISTERED = True
