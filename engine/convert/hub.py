"""Find a backbone's files (config.json, tokenizer files) without touching the network.

`transformer_conf.hf_model_tag` (and `subword_model`) name either a local directory — absolute,
or relative to the ESPnet checkpoint directory — or a Hugging Face hub id, which is looked up in
the local Hugging Face cache only (`huggingface_hub.try_to_load_from_cache`).
"""

from __future__ import annotations

from pathlib import Path

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
)


def find_file(
    tag: str, filename: str, base_dir: Path, revision: str | None = None, cache_dir: Path | None = None
) -> Path | None:
    """`filename` of `tag` (a local dir or a hub id in the local HF cache), or None."""
    local = Path(tag).expanduser()
    if not local.is_absolute():
        local = Path(base_dir) / local
    if local.is_dir():
        path = local / filename
        return path if path.is_file() else None
    if tag.startswith((".", "/", "~")) or tag.count("/") > 1:
        return None  # a path that does not exist, not a hub id
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:  # pragma: no cover - a dependency of transformers
        return None
    try:
        hit = try_to_load_from_cache(
            tag, filename, cache_dir=str(cache_dir) if cache_dir else None, revision=revision
        )
    except Exception:  # an invalid repo id, an unreadable cache
        return None
    return Path(hit) if isinstance(hit, str) and Path(hit).is_file() else None
