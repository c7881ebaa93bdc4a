"""`--model` as a directory or a Hugging Face hub id, resolved from an offline HF cache (real processes)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from engine.model_source import ModelSourceError, check_checkpoint_dir

REVISION = "0123456789abcdef0123456789abcdef01234567"


def duplex(*args: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "engine.cli", *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def hf_cache_with(tmp_path: Path, repo: str, model_dir: Path) -> Path:
    """A Hugging Face hub cache (its on-disk layout) holding `model_dir` as `repo`'s main revision."""
    cache = tmp_path / "hf-cache"
    root = cache / ("models--" + repo.replace("/", "--"))
    shutil.copytree(model_dir, root / "snapshots" / REVISION)
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text(REVISION)
    return cache


def test_a_hub_id_serves_from_the_local_hf_cache_offline(tmp_path: Path, tiny_model: Path) -> None:
    cache = hf_cache_with(tmp_path, "acme/tiny-opuslm", tiny_model)
    env = {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache)}
    common = ["generate", "--engine", "reference", "--prompt-frames", "8", "--frames", "6", "--greedy"]
    by_id = duplex(*common, "--model", "acme/tiny-opuslm", "--out", str(tmp_path / "hub.npy"), env=env)
    assert by_id.returncode == 0, by_id.stderr[-2000:]
    by_dir = duplex(*common, "--model", str(tiny_model), "--out", str(tmp_path / "dir.npy"))
    assert by_dir.returncode == 0, by_dir.stderr[-2000:]
    np.testing.assert_array_equal(np.load(tmp_path / "hub.npy"), np.load(tmp_path / "dir.npy"))
    pinned = duplex(*common, "--model", f"acme/tiny-opuslm@{REVISION}", "--out", str(tmp_path / "pin.npy"), env=env)
    assert pinned.returncode == 0, pinned.stderr[-2000:]

    missing = duplex(*common, "--model", "acme/not-downloaded", "--out", str(tmp_path / "x.npy"), env=env)
    assert missing.returncode == 2
    assert "acme/not-downloaded" in missing.stderr and "as a hub id it could not be fetched" in missing.stderr
    assert "Traceback" not in missing.stderr


def test_serve_refuses_a_model_that_is_not_there_with_one_line(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "realtime.cli", "serve", "--model", str(tmp_path / "nope"), "--port", "0"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "no such directory" in r.stderr and "Traceback" not in r.stderr


def test_what_a_directory_holds_is_named(tmp_path: Path, tiny_model: Path) -> None:
    assert check_checkpoint_dir(tiny_model, "x") == tiny_model
    espnet = tmp_path / "espnet"
    (espnet / "exp").mkdir(parents=True)
    (espnet / "config.yaml").write_text("corelm: x\n")
    (espnet / "exp" / "2epoch.pth").write_bytes(b"")
    with pytest.raises(ModelSourceError, match="ESPnet experiment directory; convert it first: duplex convert espnet"):
        check_checkpoint_dir(espnet, "x")
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(ModelSourceError, match="no 'opuslm' block"):
        check_checkpoint_dir(hf, "x")
    (hf / "config.json").write_text("[1")
    with pytest.raises(ModelSourceError, match="not a JSON object"):
        check_checkpoint_dir(hf, "x")
