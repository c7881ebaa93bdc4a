"""Where `--model` points: a converted checkpoint directory, or a Hugging Face hub id of one.

    duplex serve --model models/opuslm-7b            a local directory in our format
    duplex serve --model owner/name[@revision]       a hub repo in our format (huggingface_hub)

A hub id is fetched with `huggingface_hub.snapshot_download`, which reads the local Hugging Face
cache first and honours `HF_HUB_OFFLINE=1` / `HF_HUB_CACHE`: a repo downloaded once serves without
network. The repo must hold a converted checkpoint (config.json with an "opuslm" block); an ESPnet
experiment directory (config.yaml + *.pth) is recognised and refused with the conversion command.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+(@[\w./-]+)?$")


class ModelSourceError(ValueError):
    """`--model` names nothing servable; the message says what was found and what to do."""


def resolve_model(spec: str, cache_dir: str | Path | None = None) -> Path:
    """The local checkpoint directory for `spec` (a directory, or a hub id `owner/name[@revision]`)."""
    local = Path(spec).expanduser()
    if local.exists() or not _HUB_ID.match(spec):
        if not local.exists():
            raise ModelSourceError(f"model {spec!r}: no such directory (and not a hub id owner/name)")
        return check_checkpoint_dir(local, spec)
    repo, _, revision = spec.partition("@")
    try:
        from huggingface_hub import snapshot_download
    except ImportError:  # pragma: no cover - installed with transformers
        raise ModelSourceError(f"model {spec!r}: not a local directory, and huggingface_hub is not installed") from None
    try:
        path = snapshot_download(repo, revision=revision or None, cache_dir=str(cache_dir) if cache_dir else None)
    except Exception as e:  # offline and not cached, unknown repo, no network, gated repo
        raise ModelSourceError(
            f"model {spec!r}: no such directory, and as a hub id it could not be fetched "
            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else 'no detail'}). Download it first "
            f"(huggingface-cli download {repo}) or pass a converted directory"
        ) from None
    return check_checkpoint_dir(Path(path), spec)


def check_checkpoint_dir(path: Path, spec: str) -> Path:
    """`path` if it holds a converted OpusLM checkpoint, else a ModelSourceError saying what it is."""
    if not path.is_dir():
        raise ModelSourceError(f"model {spec!r}: {path} is not a directory")
    config = path / "config.json"
    if config.is_file():
        try:
            opuslm = json.loads(config.read_text()).get("opuslm")
        except (ValueError, AttributeError):
            raise ModelSourceError(f"model {spec!r}: {config} is not a JSON object") from None
        if opuslm is not None:
            return path
        raise ModelSourceError(f"model {spec!r}: {config} has no 'opuslm' block: not a checkpoint in the engine's format "
                               "(engine/README.md, 'Checkpoint format')")
    if (path / "config.yaml").is_file() and (any(path.glob("*.pth")) or any(path.glob("**/*.pth"))):
        raise ModelSourceError(f"model {spec!r}: {path} is an ESPnet experiment directory; convert it first: "
                               f"duplex convert espnet {path} OUT_DIR (docs/real-checkpoints.md)")
    raise ModelSourceError(f"model {spec!r}: {path} has no config.json: not a checkpoint in the engine's format")
