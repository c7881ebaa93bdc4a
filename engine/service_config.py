"""The engine service's settings: the `engine:` section of the server config, as one typed dataclass.

Torch-free and vLLM-free, so the gateway's config loader (realtime/config.py) holds the section as
this type. Each field carries its bounds (`bounded`), and `EngineServiceConfig.__post_init__` checks
every field against its type and bounds in one place; a bad value raises `ConfigFieldError`, which
names the field (`duplex serve` exits 2 with its message). The mapping onto vLLM's settings is
`engine.async_engine.EngineConfig.for_service`, whose defaults come from here.
"""

from __future__ import annotations

import dataclasses
import os
import re
import types
import typing
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, TypeVar

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

# vLLM's model dtypes (vllm.config.model.ModelDType); `float32` for the tiny model on a CPU,
# `bfloat16` for the released models on a GPU.
DType = Literal["auto", "half", "float16", "bfloat16", "float", "float32"]
DTYPES: tuple[DType, ...] = typing.get_args(DType)

MAX_SEED = 2**63 - 1  # seeds travel as 64-bit integers to the engine core


class ConfigFieldError(ValueError):
    """A config value out of its field's type or bounds; `key` names it (e.g. `engine.cpu_threads`)."""

    def __init__(self, key: str, why: str, value: object) -> None:
        super().__init__(f"config key '{key}': {why}, got {value!r}")
        self.key, self.why, self.value = key, why, value


@dataclass(frozen=True)
class Bounds:
    """What a field accepts beyond its type: numbers within [min, max] (`above`: strictly greater),
    strings among `choices` or matching `pattern` (the whole string). `text` states them for errors."""

    min: float | None = None
    max: int | float | None = None
    above: float | None = None
    choices: tuple[str, ...] = ()
    pattern: str | None = None
    text: str = ""

    def ok(self, value: object) -> bool:
        if isinstance(value, str):
            return ((not self.choices or value in self.choices)
                    and (self.pattern is None or re.fullmatch(self.pattern, value) is not None))
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return True  # None (an optional field left unset)
        return ((self.min is None or value >= self.min) and (self.max is None or value <= self.max)
                and (self.above is None or value > self.above))

    def describe(self, type_name: str) -> str:
        if self.text:
            return self.text
        if self.choices:
            return f"one of {', '.join(self.choices)}"
        lo = f"> {self.above:g}" if self.above is not None else f">= {self.min:g}" if self.min is not None else ""
        hi = f"<= {self.max:d}" if isinstance(self.max, int) else f"<= {self.max:g}" if self.max is not None else ""
        return " ".join([type_name, " and ".join(p for p in (lo, hi) if p)])


T = TypeVar("T")
_BOUNDS = "bounds"


def bounded(default: T, bounds: Bounds) -> T:
    """A dataclass field with a default and its bounds (checked by `check_fields`)."""
    return dataclasses.field(default=default, metadata={_BOUNDS: bounds})


def _type_ok(value: object, annotation: object) -> bool:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return any(_type_ok(value, a) for a in typing.get_args(annotation))
    if annotation is type(None):
        return value is None
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(annotation, type) and isinstance(value, annotation)


_TYPE_NAMES: dict[object, str] = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


def _type_name(annotation: object) -> str:
    """The annotation's type in words, without its None (`_optional`)."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(annotation) if a is not type(None))
    return _TYPE_NAMES.get(annotation, str(annotation))


def _optional(annotation: object) -> bool:
    return type(None) in typing.get_args(annotation)


def check_fields(obj: DataclassInstance, section: str) -> None:
    """Every field of the dataclass `obj` against its annotated type and its `bounded` bounds; the
    first that fails raises ConfigFieldError naming `section.field`."""
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        value, annotation = getattr(obj, f.name), hints[f.name]
        bounds: Bounds | None = f.metadata.get(_BOUNDS)
        expected = _type_name(annotation) if bounds is None else bounds.describe(_type_name(annotation))
        expected += " or null" if _optional(annotation) else ""
        if not _type_ok(value, annotation) or (bounds is not None and not bounds.ok(value)):
            raise ConfigFieldError(f"{section}.{f.name}", f"expected {expected}", value)


_POSITIVE = Bounds(min=1)
_NON_NEGATIVE = Bounds(min=0)


@dataclass(frozen=True)
class EngineServiceConfig:
    """Engine settings (the `engine:` section of the server config)."""

    model: str | None = None  # checkpoint dir or hub id; None = the cached tiny model
    max_conversations: int = bounded(16, _POSITIVE)  # hard cap, whatever the measurements say (all engine ranks together)
    # vLLM's running requests per engine rank. Not the conversations: an answer with guidance is two
    # (its CFG shadow), a transcript of the user's turn, an incremental prefill and a one-shot request
    # (audio_api.max_concurrent) are one each. 64 leaves that room beside max_conversations answers.
    max_num_seqs: int = bounded(64, _POSITIVE)
    data_parallel_size: int = bounded(1, _POSITIVE)  # engine cores (vLLM data parallelism); a conversation stays on one
    dtype: str = bounded("float32", Bounds(choices=DTYPES))
    max_model_len: int | None = bounded(None, _POSITIVE)  # None: the backbone's context
    max_num_batched_tokens: int | None = bounded(None, _POSITIVE)  # None: vLLM's default
    enable_chunked_prefill: bool = True
    kv_cache_gib: float = bounded(1.0, Bounds(above=0))
    kv_block_size: int = bounded(32, _POSITIVE)  # prefix-cache granularity (vLLM's CPU backend needs multiples of 32)
    enforce_eager: bool = True
    incremental_prefill: bool = True
    prefill_interval_ms: float = bounded(200.0, _NON_NEGATIVE)  # prefill the user's audio every this much of new speech
    first_chunk_frames: int = bounded(4, _POSITIVE)  # codec: small first chunk for time to first audio
    chunk_frames: int = bounded(16, _POSITIVE)
    codec_max_batch: int = bounded(16, _POSITIVE)
    # DAC decoder + audio tokenizer: auto = the engine's GPU when torch sees one, else cpu
    codec_device: str = bounded("auto", Bounds(pattern=r"auto|cpu|cuda(:\d+)?", text="auto, cpu, cuda or cuda:N"))
    # CPU engine's OpenMP threads (per rank); None = all cores but one when the codec shares the CPU
    cpu_threads: int | None = bounded(None, _POSITIVE)
    first_audio_budget_ms: float = bounded(60.0, _NON_NEGATIVE)  # the first chunk's deadline after its frames exist
    pacing_lead_ms: float = bounded(500.0, _NON_NEGATIVE)  # generation runs at most this far ahead of playback
    capacity_margin: float = bounded(0.8, Bounds(above=0, max=1))
    capacity_override: int | None = bounded(None, _POSITIVE)  # a fixed capacity instead of the measured one
    warmup: bool = True
    seed: int = bounded(0, Bounds(min=0, max=MAX_SEED))

    def __post_init__(self) -> None:
        check_fields(self, "engine")

    @property
    def vllm_dtype(self) -> DType:
        """`dtype` as vLLM's type spells it (checked against DTYPES when the config was built)."""
        return next(d for d in DTYPES if d == self.dtype)


def engine_cpu_threads(configured: int | None, codec_device: str, ranks: int = 1) -> int:
    """Each CPU engine rank's OpenMP threads (0: vLLM's default, every core).

    When the codec and tokenizer share the CPU with the engine, an OpenMP team over every core
    has one thread descheduled whenever they run, and the rest spin at the next barrier: measured
    on 2 cores, 8 conversations at once took 18 ms steps with 2 engine threads and 8.7 ms with one
    (scripts/bench_streaming.py). So the engine leaves them a core, and `ranks` engine cores share
    the others (at least one thread each).
    """
    if configured is not None:
        return configured
    if codec_device != "cpu":
        return 0
    return max(1, (len(os.sched_getaffinity(0)) - 1) // ranks)
