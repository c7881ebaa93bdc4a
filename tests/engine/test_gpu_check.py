"""scripts/gpu_check.py on a CPU: without `--device cpu` it says no GPU was found and exits 0; with
it, every check (the decode-step capacity check included) runs here at small shapes with vLLM
unimportable, as on the GPU machine (torch, no vLLM). The numbers that matter come from a GPU:
docs/gpu.md."""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import torch

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "gpu_check.py"

# Runs the script with every import of vllm (or a submodule) refused, and says on stderr whether
# anything tried: the GPU machine has no vLLM, so not even a guarded attempt is expected.
_NO_VLLM = """
import atexit, runpy, sys
tried = []
class NoVllm:
    def find_spec(self, name, path=None, target=None):
        if name == "vllm" or name.startswith("vllm."):
            tried.append(name)
            raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)")
        return None
sys.meta_path.insert(0, NoVllm())
atexit.register(lambda: tried and print("VLLM IMPORT ATTEMPTED:", tried, file=sys.stderr))
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def _module():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up there
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


def test_every_check_runs_on_cpu_without_vllm(tmp_path) -> None:
    out = tmp_path / "x.json"
    r = subprocess.run([sys.executable, "-c", _NO_VLLM, str(SCRIPT), "--device", "cpu", "--json", str(out)],
                       capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert "VLLM IMPORT ATTEMPTED" not in r.stderr, r.stderr
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads(out.read_text())
    mod = _module()
    assert res["smoke_test"] and res["failed"] == [] and not res["vllm_imported"]
    for name in mod.CHECKS:
        assert "error" not in res[name], (name, res[name])
        if name in mod.HARD:
            assert res[name]["ok"] is True, (name, res[name])
    step = res["step"]
    assert set(step["models"]) == {s.name for s in mod.CPU_SIZES.shapes}
    for entry in step["models"].values():
        assert entry["aux_embedding"].startswith("embedding_bag")
        assert entry["contexts"][0]["points"][0]["replay_rel_diff"] == 0.0  # eager against eager on a CPU
        assert [c["context"] for c in entry["contexts"]] == list(mod.CPU_SIZES.step_contexts)
        for c in entry["contexts"]:
            assert c["points"] and all(p["finite"] and p["step_ms"] > 0 for p in c["points"])
            assert all(p["step_cfg_ms"] > 0 for p in c["points"] if p["rows"] >= 2)
            assert c["sessions"] in (0, *mod.decode_step.CAPTURE_SIZES) and c["sessions_cfg"] * 2 <= c["rows_in_memory"]
    # the printed table: one line per check, then the step table's rows
    for name in mod.CHECKS:
        assert any(line.split()[:1] == [name] for line in r.stdout.splitlines()), name
    assert "NOT included" in r.stdout and "CPU SMOKE TEST" in r.stdout
    assert sum(line.split()[:2] == ["tiny-llama", "64"] for line in r.stdout.splitlines()) == 1


def test_batch_search_finds_the_largest_fitting_size_with_few_probes() -> None:
    largest_fitting = _module().decode_step.largest_fitting
    sizes = [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    for limit in (0, 1, 3, 8, 20, 41, 64, 100):
        probed = []
        got = largest_fitting(sizes, lambda b: probed.append(b) or b <= limit)
        assert got == max([b for b in sizes if b <= limit], default=0)
        assert len(probed) <= 2 + 4  # both ends, then a bisection of 11 sizes
    assert largest_fitting([], lambda b: True) == 0


def test_step_fallback_embedding_equals_opus_forward() -> None:
    """The gather-sum the step check falls back to, should opus_forward's embedding_bag not
    capture on a GPU, gives the same step as opus_forward."""
    ds = _module().decode_step
    shape = ds.TINY[0]
    model = ds.StaticCacheBackbone(shape, torch.device("cpu"), dtype=torch.float32)
    kv = torch.randn(shape.layers, 2, 4, shape.kv_heads, 32, shape.head_dim)
    with torch.inference_mode():
        step = ds.DecodeStep(model, kv, 32, 4, torch.device("cpu"))
        want = step.eager_forward().clone()
        model.aux_fallback = "forced by the test"
        got = step.eager_forward()
        assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()
        ids = step()  # the whole step: stream 0 + 8 aux ids per row, within their streams' ranges
    assert ids.shape == (4, 9) and (ids[:, 1:] >= 5256).all() and (ids[:, 1:] < 13448).all()
