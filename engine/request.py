"""A generation request as the engine sees it (audio, text, or text then audio), and how it travels
through vLLM.

vLLM's sequence (and KV cache) holds stream 0 only; the prompt's streams 1-8 and the request's
frame limits ride in `SamplingParams.extra_args["opuslm"]` to the worker, where the model reads
them (engine/vllm_plugin/stream_state.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from engine import modality, vocab
from engine.delay import FLUSH_STEPS, segment_frames
from engine.sampling import SamplingConfig

EXTRA_ARGS_KEY = "opuslm"
_AUX_DTYPE = np.dtype("<i2")  # every id of streams 1-8 is < 13448 < 2**15


@dataclass(frozen=True)
class AudioRequest:
    """Generate one segment after `prompt`: audio, text, or text that switches to audio
    (engine/modality.py).

    prompt          [P, 9] global ids, already delay-interleaved; its last row opens the segment
                    (e.g. `10 34`: assistant, audio; `10 35`: assistant, text)
    min_frames      EOS is blocked before this many frames
    max_frames      EOS is forced at this many frames
    start_modality  vocab.CODEC_SSL (audio) or vocab.TEXT_BPE (text first)
    min_text_tokens / max_text_tokens   the text phase's EOS block and cap
    switch_to_audio the text phase may switch to audio (stream 0 emits CODEC_SSL; forced at the cap)
    text_sampling   stream 0's sampling in the text phase (None: `sampling`); `sampling` is the audio's
    """

    prompt: np.ndarray
    max_frames: int
    min_frames: int = 0
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    start_modality: int = vocab.CODEC_SSL
    max_text_tokens: int = 0
    min_text_tokens: int = 0
    switch_to_audio: bool = False
    text_sampling: SamplingConfig | None = None
    # A continued segment (tasks.continuation_prompt): [8, 8] aux ids that streams 1-8 hold during the
    # audio's warm-up instead of PAD (the prompt's last frames, which the delay carries into the first
    # generated steps); None: a fresh segment.
    carry: np.ndarray | None = None
    # Requests with the same salt may share KV blocks of equal prompt prefixes (a conversation's
    # history across turns); None gives the request a salt of its own. vLLM's block hashes cover
    # stream 0 only, so sharing is safe only where equal stream-0 prefixes imply equal aux streams.
    cache_salt: str | None = None
    prefill_only: bool = False  # compute the prompt's KV (for later reuse) and stop
    # Played as it is generated: the scheduler orders it by playback deadline and keeps it a
    # bounded lead ahead of real time (vllm_plugin/scheduler.py). Offline requests run flat out.
    realtime: bool = False
    # Classifier-free guidance weight w (engine/guidance.py): 1 = none; otherwise the engine runs a
    # shadow request on the unconditional prompt beside this one and merges their logits.
    cfg_scale: float = 1.0

    def __post_init__(self) -> None:
        p = np.asarray(self.prompt)
        if p.ndim != 2 or p.shape[1] != vocab.NUM_STREAMS or p.shape[0] == 0:
            raise ValueError(f"prompt must be [P>0, {vocab.NUM_STREAMS}], got shape {p.shape}")
        if self.start_modality not in modality.TEXT_STARTS:
            raise ValueError(f"start_modality must be CODEC_SSL (34) or TEXT_BPE (35), got {self.start_modality}")
        if self.text_first:
            if self.max_text_tokens < 1:
                raise ValueError(f"a text-first request needs max_text_tokens >= 1, got {self.max_text_tokens}")
            if not 0 <= self.min_text_tokens <= self.max_text_tokens:
                raise ValueError(f"min_text_tokens must be in [0, max_text_tokens], got {self.min_text_tokens}")
        elif self.switch_to_audio:
            raise ValueError("switch_to_audio is for text-first requests")
        if self.max_frames < (1 if self.has_audio else 0):
            raise ValueError(f"max_frames must be >= 1, got {self.max_frames}")
        if not 0 <= self.min_frames <= self.max_frames:
            raise ValueError(f"min_frames must be in [0, max_frames], got {self.min_frames}")
        if p[:, 1:].min() < 0 or p[:, 1:].max() >= vocab.TEXT_OFFSET:
            raise ValueError("prompt streams 1-8 must hold PAD or DAC ids")
        if self.carry is not None:
            c = np.asarray(self.carry)
            if c.shape != (FLUSH_STEPS, vocab.NUM_CODEBOOKS) or c.min() < 0 or c.max() >= vocab.TEXT_OFFSET:
                raise ValueError(f"carry must be [{FLUSH_STEPS}, {vocab.NUM_CODEBOOKS}] PAD or DAC ids, got shape {c.shape}")
            if self.text_first:
                raise ValueError("carry continues an audio segment: it is for audio-first requests")
        if not (np.isfinite(self.cfg_scale) and self.cfg_scale >= 0):
            raise ValueError(f"cfg_scale must be finite and >= 0, got {self.cfg_scale}")

    @property
    def prompt_len(self) -> int:
        return int(np.asarray(self.prompt).shape[0])

    @property
    def text_first(self) -> bool:
        return self.start_modality == vocab.TEXT_BPE

    @property
    def has_audio(self) -> bool:
        """Whether the request may generate audio."""
        return not self.text_first or self.switch_to_audio

    @property
    def max_steps(self) -> int:
        """Generated steps (= vLLM output tokens) at most: the text cap and its end step (the switch,
        or EOS), then the audio's frames and flush."""
        text = self.max_text_tokens + 1 if self.text_first else 0
        return text + (self.max_frames + FLUSH_STEPS if self.has_audio else 0)

    @property
    def text_config(self) -> SamplingConfig:
        return self.text_sampling or self.sampling

    def extra_args(self) -> dict[str, Any]:
        aux = np.ascontiguousarray(np.asarray(self.prompt)[:, 1:], dtype=_AUX_DTYPE)
        return {
            EXTRA_ARGS_KEY: {
                "aux": aux.tobytes(),
                "min_frames": int(self.min_frames),
                "max_frames": int(self.max_frames),
                "realtime": bool(self.realtime),
                "cfg_scale": float(self.cfg_scale),
                **self._text_args(),
                **({} if self.carry is None else {"carry": np.ascontiguousarray(self.carry, dtype=_AUX_DTYPE).tobytes()}),
            }
        }

    def _text_args(self) -> dict[str, Any]:
        if not self.text_first:
            return {}
        t = self.text_config
        return {"start": int(self.start_modality), "min_text": int(self.min_text_tokens),
                "max_text": int(self.max_text_tokens), "switch": bool(self.switch_to_audio),
                "text_sampling": [float(t.temperature), int(t.top_k), float(t.top_p)]}


def shadow_request(main_extra_args: dict[str, Any], main_id: str, main_prompt_ids: list[int]) -> tuple[list[int], dict[str, Any]]:
    """The CFG shadow of a request, built in the engine core: (stream-0 prompt ids, extra_args).

    Its prompt is `guidance.unconditional_prompt` of the main's; its extra_args are the main's with
    that prompt's aux and a link back to the main."""
    from engine import guidance

    spec = WorkerRequestSpec.from_extra_args(main_extra_args, len(main_prompt_ids))
    main_prompt = np.concatenate([np.asarray(main_prompt_ids, dtype=np.int64)[:, None], spec.prompt_aux], axis=1)
    uncond = guidance.unconditional_prompt(main_prompt)
    block = dict(main_extra_args[EXTRA_ARGS_KEY])
    block["aux"] = np.ascontiguousarray(uncond[:, 1:], dtype=_AUX_DTYPE).tobytes()
    block["shadow_of"] = main_id
    return [int(t) for t in uncond[:, 0]], {**main_extra_args, EXTRA_ARGS_KEY: block}


def cfg_scale_of(extra_args: dict[str, Any] | None) -> float:
    """The request's CFG weight (1.0 when it has none)."""
    return float(((extra_args or {}).get(EXTRA_ARGS_KEY) or {}).get("cfg_scale", 1.0))


@dataclass(frozen=True)
class WorkerRequestSpec:
    """What the worker-side model needs about a request (decoded from extra_args)."""

    prompt_aux: np.ndarray  # [P, 8] int64
    min_frames: int
    max_frames: int
    cfg_scale: float = 1.0
    shadow_of: str | None = None  # set on a CFG shadow: its main's request id
    start_modality: int = vocab.CODEC_SSL
    min_text: int = 0
    max_text: int = 0
    switch: bool = False
    text_sampling: tuple[float, int, float] | None = None  # (temperature, top_k, top_p); seed: the request's
    carry: np.ndarray | None = None  # [8, 8] int64

    @classmethod
    def from_extra_args(cls, extra_args: dict[str, Any] | None, prompt_len: int) -> "WorkerRequestSpec":
        block = (extra_args or {}).get(EXTRA_ARGS_KEY)
        if block is None:
            raise ValueError(
                f"request has no SamplingParams.extra_args[{EXTRA_ARGS_KEY!r}]: "
                "OpusLM requests must be built with engine.request.AudioRequest"
            )
        aux = np.frombuffer(block["aux"], dtype=_AUX_DTYPE).reshape(-1, vocab.NUM_CODEBOOKS)
        if aux.shape[0] != prompt_len:
            raise ValueError(f"prompt has {prompt_len} positions but {aux.shape[0]} aux rows")
        return cls(
            aux.astype(np.int64),
            int(block["min_frames"]),
            int(block["max_frames"]),
            float(block.get("cfg_scale", 1.0)),
            block.get("shadow_of"),
            int(block.get("start", vocab.CODEC_SSL)),
            int(block.get("min_text", 0)),
            int(block.get("max_text", 0)),
            bool(block.get("switch", False)),
            tuple(block["text_sampling"]) if "text_sampling" in block else None,
            np.frombuffer(block["carry"], dtype=_AUX_DTYPE).reshape(FLUSH_STEPS, vocab.NUM_CODEBOOKS).astype(np.int64)
            if "carry" in block else None,
        )


@dataclass
class Generation:
    """The result of one request: generated steps [S, 9], the de-interleaved frames [F, 9] of its
    audio, and its text (global text ids; empty for an audio-first request)."""

    steps: np.ndarray
    frames: np.ndarray
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt positions whose KV came from the prefix cache
    text_ids: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int64))

    @classmethod
    def from_steps(cls, steps: np.ndarray, start_modality: int = vocab.CODEC_SSL, **stats: int) -> "Generation":
        text_ids, audio = modality.split_steps(steps, start_modality)
        return cls(steps=steps, frames=segment_frames(audio), text_ids=text_ids, **stats)
