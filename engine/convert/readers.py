"""Reading a converter's inputs: an ESPnet `config.yaml` and a PyTorch state dict, each refused with a
`ConversionError` naming the file when it is not what a converter can use."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from engine.convert.errors import ConversionError


def read_yaml(path: Path) -> dict[str, Any]:
    import yaml

    if not path.is_file():
        raise ConversionError(f"{path} not found: is {path.parent} an ESPnet experiment directory?")
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # the token lists have ~100k entries
    try:
        data = yaml.load(path.read_text(), Loader=loader)
    except yaml.YAMLError as e:
        raise ConversionError(f"{path}: not valid YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(data, dict):
        raise ConversionError(f"{path}: expected a mapping at the top level")
    return data


def load_state(path: Path) -> dict[str, torch.Tensor]:
    """The state dict, memory-mapped: tensor data is read only when used."""
    try:
        obj = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except Exception as e:  # pickle / zip / weights_only refusals
        raise ConversionError(f"{path}: cannot load ({type(e).__name__}: {str(e).splitlines()[0][:200]})") from None
    if isinstance(obj, dict) and isinstance(obj.get("module"), dict):
        obj = obj["module"]  # DeepSpeed
    elif isinstance(obj, dict) and isinstance(obj.get("model"), dict):
        obj = obj["model"]  # an ESPnet training checkpoint (model, optimizers, reporter, ...)
    if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        keys = list(obj)[:5] if isinstance(obj, dict) else type(obj).__name__
        raise ConversionError(f"{path}: not a state dict of tensors (top level: {keys})")
    return obj
