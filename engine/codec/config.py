"""Codec and SSL-tokenizer configurations, stored as `config.json` next to the weights.

Field names follow ESPnet's `DACGenerator` arguments (`encdec_*`, `quantizer_*`) where one exists,
so a converter copies them from ESPnet's `config.yaml` without a translation table.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import typing
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from engine.units import HOP_SAMPLES, SAMPLE_RATE_HZ
from engine.vocab import CODEBOOK_SIZE, NUM_CODEBOOKS, SSL_SIZE

_C = TypeVar("_C")

if TYPE_CHECKING:  # torch only for the checker: configs load without it
    from torch import nn

_P = TypeVar("_P", bound="nn.Module")


@dataclasses.dataclass(frozen=True)
class DACConfig:
    """ESPnet-Codec DAC generator. Defaults are the OpusLM codec (`train_dac_large_v1.4.yaml`)."""

    sample_rate_hz: int = SAMPLE_RATE_HZ
    hidden_dim: int = 512  # encoder output / decoder input width
    codebook_dim: int = 512  # != hidden_dim adds project_in/project_out Linear layers per codebook
    encdec_channels: int = 1
    encdec_n_filters: int = 32
    encdec_n_residual_layers: int = 3
    encdec_ratios: tuple[int, ...] = (8, 5, 4, 2)  # decoder order; the encoder runs them reversed
    encdec_kernel_size: int = 7
    encdec_residual_kernel_size: int = 7
    encdec_last_kernel_size: int = 7
    encdec_dilation_base: int = 2
    encdec_compress: int = 2
    encdec_lstm: int = 2  # LSTM layers (0: none)
    encdec_true_skip: bool = False  # False: 1x1 conv shortcut in residual blocks (ESPnet's default)
    quantizer_n_q: int = NUM_CODEBOOKS
    quantizer_bins: int = CODEBOOK_SIZE

    def __post_init__(self) -> None:
        object.__setattr__(self, "encdec_ratios", tuple(int(r) for r in self.encdec_ratios))
        hop = 1
        for ratio in self.encdec_ratios:
            hop *= ratio
        if hop != HOP_SAMPLES or self.sample_rate_hz != SAMPLE_RATE_HZ:
            raise ValueError(
                f"encdec_ratios {list(self.encdec_ratios)} at {self.sample_rate_hz} Hz give hop {hop}; "
                f"the token layout needs hop {HOP_SAMPLES} at {SAMPLE_RATE_HZ} Hz"
            )
        if self.quantizer_n_q != NUM_CODEBOOKS or self.quantizer_bins != CODEBOOK_SIZE:
            raise ValueError(
                f"quantizer_n_q/quantizer_bins must be {NUM_CODEBOOKS}/{CODEBOOK_SIZE}, "
                f"got {self.quantizer_n_q}/{self.quantizer_bins}"
            )

    @property
    def hop_samples(self) -> int:
        return HOP_SAMPLES


@dataclasses.dataclass(frozen=True)
class SSLConfig:
    """The SSL tokenizer: a strided conv feature extractor and a k-means codebook.

    The tiny default is random; converted XEUS checkpoints have `kind: "xeus"` and their own
    config (engine/codec/xeus.py), chosen by `engine.codec.ssl.load_ssl`.
    """

    kind: str = "conv"  # the feature extractor family of this config
    sample_rate_hz: int = SAMPLE_RATE_HZ
    channels: int = 32
    feature_dim: int = 64
    strides: tuple[int, ...] = (5, 4, 4, 4)  # product must be the hop (320)
    num_clusters: int = SSL_SIZE

    def __post_init__(self) -> None:
        object.__setattr__(self, "strides", tuple(int(s) for s in self.strides))
        hop = 1
        for stride in self.strides:
            hop *= stride
        if hop != HOP_SAMPLES or self.sample_rate_hz != SAMPLE_RATE_HZ:
            raise ValueError(f"strides {list(self.strides)} give hop {hop}, need {HOP_SAMPLES}")
        if self.num_clusters != SSL_SIZE:
            raise ValueError(f"num_clusters must be {SSL_SIZE}, got {self.num_clusters}")
        if self.kind != "conv":
            raise ValueError(f"SSLConfig kind must be 'conv', got {self.kind!r}")


def load_config(cls: type[_C], path: pathlib.Path) -> _C:
    """Read a config dataclass from JSON; a missing, unknown or mistyped key raises ValueError."""
    path = pathlib.Path(path)
    if not path.is_file():
        raise ValueError(f"config file {path} does not exist")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"config file {path} is not valid JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"config file {path} must hold a JSON object")
    return config_from_dict(cls, raw, source=str(path))


def config_from_dict(cls: type[_C], raw: dict[str, Any], *, source: str = "config") -> _C:
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        raise ValueError(f"{source}: unknown key {unknown[0]!r} for {cls.__name__}")
    missing = sorted(set(fields) - set(raw))
    if missing:
        raise ValueError(f"{source}: missing key {missing[0]!r} for {cls.__name__}")
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    for name, value in raw.items():
        values[name] = _check_type(name, value, hints[name], source)
    try:
        return cls(**values)
    except ValueError as exc:
        raise ValueError(f"{source}: {exc}") from None


def _check_type(name: str, value: Any, hint: Any, source: str) -> Any:
    bad = ValueError(f"{source}: key {name!r} has bad value {value!r} (expected {hint})")
    if hint is bool:
        if not isinstance(value, bool):
            raise bad
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad
        return value
    if hint is str:
        if not isinstance(value, str):
            raise bad
        return value
    if typing.get_origin(hint) is tuple:
        if not isinstance(value, list) or not all(
            isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value
        ):
            raise bad
        return tuple(value)
    raise bad


def save_config(config: Any, path: pathlib.Path) -> None:
    data = dataclasses.asdict(config)
    data = {k: list(v) if isinstance(v, tuple) else v for k, v in data.items()}
    pathlib.Path(path).write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"


def load_part(
    module_cls: Callable[[_C], _P], config_cls: type[_C], part_dir: pathlib.Path, what: str, *, meta_init: bool = False
) -> _P:
    """Build `module_cls(config)` from `part_dir/config.json` and load `part_dir/model.safetensors`
    exactly (a missing or unexpected tensor is an error naming it). Returns the module in eval mode.

    `meta_init`: build the module without memory and take the loaded tensors as its parameters
    (for large parts; only for modules whose every tensor is in the state dict)."""
    import torch
    from safetensors.torch import load_file

    cfg = load_config(config_cls, part_dir / CONFIG_NAME)
    weights_path = part_dir / WEIGHTS_NAME
    if not weights_path.is_file():
        raise ValueError(f"{what} weights {weights_path} do not exist")
    if meta_init:
        with torch.device("meta"):
            model = module_cls(cfg)
    else:
        model = module_cls(cfg)
    missing, unexpected = model.load_state_dict(load_file(str(weights_path)), strict=False, assign=meta_init)
    if missing or unexpected:
        raise ValueError(f"{weights_path}: missing keys {missing[:3]}, unexpected keys {unexpected[:3]}")
    return model.eval()
