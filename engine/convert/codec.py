"""ESPnet-Codec DAC checkpoint -> `OUT/codec/{config.json, model.safetensors}` (engine/codec).

The key rename is the one documented in engine/codec/README.md ("Mapping from ESPnet
checkpoints"): keep `codec.generator.*` without the prefix, rename old-style weight norm
(`weight_g`/`weight_v`) to torch's parametrization names, drop the quantizer's training-only EMA
state and everything else under `codec.` (discriminator, losses). The result must match our
`DAC`'s state dict exactly, name for name and shape for shape; anything else is refused.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from engine.codec import dac as dac_mod
from engine.codec.config import DACConfig, save_config
from engine.convert.errors import ConversionError

_GEN = "codec.generator."
_EMA = re.compile(r"^quantizer\.vq\.layers\.\d+\._codebook\.(inited|cluster_size|embed_avg)$")
# generator_params values our DAC implements; any other value is refused
_REQUIRED = {
    "encdec_activation": "Snake",
    "encdec_norm": "weight_norm",
    "encdec_causal": False,
    "encdec_pad_mode": "reflect",
    "decoder_final_activation": None,
}


def dac_config_from_yaml(conf: dict[str, Any], source: str) -> DACConfig:
    """DACConfig from an ESPnet codec `config.yaml` (`codec: dac`, `codec_conf.generator_params`)."""
    if conf.get("codec") != "dac":
        raise ConversionError(f"{source}: codec is {conf.get('codec')!r}, only 'dac' is supported")
    codec_conf = conf.get("codec_conf") or {}
    gen = dict(codec_conf.get("generator_params") or {})
    for key, want in _REQUIRED.items():
        if key in gen and gen[key] != want:
            raise ConversionError(f"{source}: generator_params.{key}={gen[key]!r} is not supported (need {want!r})")
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(DACConfig):
        if f.name in gen:
            kwargs[f.name] = gen[f.name]
    if "sampling_rate" in codec_conf:
        kwargs["sample_rate_hz"] = int(codec_conf["sampling_rate"])
    try:
        return DACConfig(**kwargs)
    except (TypeError, ValueError) as e:
        raise ConversionError(f"{source}: {e}") from None


def rename_codec_key(name: str) -> str | None:
    """ESPnet key -> ours, or None when the key is dropped. Raises on a key outside `codec.`."""
    if not name.startswith("codec."):
        raise ConversionError(f"unexpected codec checkpoint key {name!r} (not under 'codec.')")
    if not name.startswith(_GEN):
        return None  # discriminator, loss modules
    key = name[len(_GEN) :]
    if _EMA.match(key):
        return None
    if key.endswith(".weight_g"):
        return key[: -len("weight_g")] + "parametrizations.weight.original0"
    if key.endswith(".weight_v"):
        return key[: -len("weight_v")] + "parametrizations.weight.original1"
    return key


def prepare_codec(
    state: dict[str, torch.Tensor], conf: dict[str, Any], source: str
) -> tuple[DACConfig, dict[str, torch.Tensor]]:
    """(config, our tensors) after every check; nothing is written."""
    cfg = dac_config_from_yaml(conf, source)
    want = {k: tuple(v.shape) for k, v in dac_mod.DAC(cfg).state_dict().items()}
    renamed: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        key = rename_codec_key(name)
        if key is None:
            continue
        if key not in want:
            raise ConversionError(f"{source}: codec tensor {name!r} ({key!r}) has no place in our DAC")
        if key in renamed:
            raise ConversionError(f"{source}: two codec tensors map to {key!r}")
        if tuple(t.shape) != want[key]:
            raise ConversionError(f"{source}: codec tensor {name!r} has shape {tuple(t.shape)}, expected {want[key]}")
        renamed[key] = t.detach().to(torch.float32).contiguous()
    missing = sorted(set(want) - set(renamed))
    if missing:
        raise ConversionError(f"{source}: codec checkpoint is missing {missing[0]!r} ({len(missing)} missing)")
    return cfg, renamed


def write_codec(cfg: DACConfig, tensors: dict[str, torch.Tensor], out_dir: Path) -> None:
    """Write `out_dir/codec/{config.json, model.safetensors}`."""
    target = Path(out_dir) / dac_mod.CODEC_SUBDIR
    target.mkdir(parents=True, exist_ok=True)
    save_config(cfg, target / dac_mod.CONFIG_NAME)
    save_file(dict(sorted(tensors.items())), str(target / dac_mod.WEIGHTS_NAME))
