"""scripts/gpu_check.py on a CPU: it says no GPU was found and exits 0; its device-generic checks
run here on the CPU at small sizes (the numbers that matter come from a GPU: docs/gpu.md)."""

from __future__ import annotations

import importlib.util
import os
import pathlib
import subprocess
import sys

import torch

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "gpu_check.py"


def _module():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_without_a_gpu_it_says_so_and_exits_0() -> None:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    r = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == _module().NO_GPU_MESSAGE


def test_sampling_check_torch_path_against_numpy_path_on_cpu() -> None:
    r = _module().check_sampling(torch.device("cpu"), rows=2, draws=150)
    assert r["greedy_equal"] and r["draws_outside_top_k"] == {"torch": 0, "numpy": 0}
    assert r["ok"], r


def test_streaming_rtf_and_codec_snr_run_on_cpu(tmp_path) -> None:
    mod = _module()
    dac, _ = mod._codec(None, tmp_path)
    r = mod.stream_rtf(dac.eval(), torch.device("cpu"), [1, 2], seconds=0.5)
    assert set(r) == {1, 2} and all(v["rtf_per_session"] > 0 for v in r.values())
    assert mod.check_codec(dac, torch.device("cpu"), seconds=0.5)["snr_db"] > 100  # CPU against itself
