"""`duplex model make-tiny` and `duplex generate` as a user runs them (real processes)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from engine import vocab


def duplex(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "engine.cli", *args], capture_output=True, text=True, timeout=timeout
    )


def test_make_tiny_is_deterministic(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    assert duplex("model", "make-tiny", str(a), "--seed", "3").returncode == 0
    assert duplex("model", "make-tiny", str(b), "--seed", "3").returncode == 0
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    again = duplex("model", "make-tiny", str(a))
    assert again.returncode == 2 and "not empty" in again.stderr


@pytest.mark.vllm
def test_generate_vllm_equals_reference(tmp_path: Path, tiny_model: Path) -> None:
    common = ["--model", str(tiny_model), "--requests", "3", "--prompt-frames", "12", "--frames", "20", "--greedy"]
    v = duplex("generate", "--engine", "vllm", *common, "--out", str(tmp_path / "v.npy"))
    assert v.returncode == 0, v.stderr[-2000:]
    r = duplex("generate", "--engine", "reference", *common, "--out", str(tmp_path / "r.npy"))
    assert r.returncode == 0, r.stderr[-2000:]
    codes_v, codes_r = np.load(tmp_path / "v.npy"), np.load(tmp_path / "r.npy")
    assert codes_v.shape == (3, 20, 9)
    np.testing.assert_array_equal(codes_v, codes_r)
    assert vocab.in_stream_range(codes_v).all()


@pytest.mark.vllm
@pytest.mark.parametrize("task, extra", [("asr", []), ("tts", ["--text", "Hello, world."]), ("dialogue", [])])
def test_generate_task_json_vllm_equals_reference(tmp_path: Path, tiny_model: Path, task: str, extra: list[str]) -> None:
    common = ["--model", str(tiny_model), "--task", task, *extra, "--requests", "2", "--prompt-frames", "10",
              "--frames", "12", "--max-tokens", "9", "--greedy"]
    out = {}
    for engine in ("vllm", "reference"):
        p = duplex("generate", "--engine", engine, *common, "--out", str(tmp_path / f"{engine}.json"))
        assert p.returncode == 0, p.stderr[-2000:]
        out[engine] = json.loads((tmp_path / f"{engine}.json").read_text())
    assert out["vllm"] == out["reference"]
    for obj in out["vllm"]:
        assert set(obj) == {"text_ids", "text", "frames"}
        writes_text, speaks = task != "tts", task != "asr"
        assert len(obj["text_ids"]) == (9 if writes_text else 0) and bool(obj["text"]) == writes_text
        assert len(obj["frames"]) == (12 if speaks else 0)
        if speaks:
            assert vocab.in_stream_range(np.array(obj["frames"])).all()


def test_generate_seeded_sampling_is_reproducible(tmp_path: Path, tiny_model: Path) -> None:
    def run(seed: str, out: str) -> np.ndarray:
        p = duplex("generate", "--engine", "reference", "--model", str(tiny_model), "--requests", "2",
                   "--prompt-frames", "8", "--frames", "10", "--seed", seed, "--out", str(tmp_path / out))
        assert p.returncode == 0, p.stderr
        return np.load(tmp_path / out)

    a, b, c = run("5", "a.npy"), run("5", "b.npy"), run("6", "c.npy")
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model", "/nonexistent"], "no such directory"),
        (["--requests", "0"], "--requests must be >= 1"),
        (["--frames", "0"], ">= 1"),
        (["--task", "asr"], "use --out FILE.json"),
        (["--task", "tts"], "--text is for --task tts, which needs it"),
        (["--task", "tts", "--text", " "], "--text is empty"),
        (["--text", "hi"], "--text is for --task tts"),
        (["--task", "asr", "--max-tokens", "0"], "--max-tokens must be >= 1"),
    ],
)
def test_generate_bad_input_exits_2_with_a_message(tmp_path: Path, args: list[str], message: str) -> None:
    p = duplex("generate", "--engine", "reference", *args, "--out", str(tmp_path / "x.npy"))
    assert p.returncode == 2
    assert message in p.stderr and "Traceback" not in p.stderr


def test_duplex_runs_the_engine_and_the_gateway_commands_and_engine_cli_the_engine_ones() -> None:
    """The console script is the module above both packages; `python -m engine.cli` knows no gateway."""
    import tomllib

    scripts = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["duplex"] == "realtime.cli.main:main"
    engine_cmds, gateway_cmds = ["model", "generate", "decode", "encode", "convert"], ["serve", "client", "soak"]
    top = subprocess.run([sys.executable, "-m", "realtime.cli", "--help"], capture_output=True, text=True, timeout=120)
    assert top.returncode == 0 and all(f"    {c} " in top.stdout for c in engine_cmds + gateway_cmds), top.stdout
    alone = duplex("--help", timeout=120)
    assert alone.returncode == 0 and all(f"    {c} " in alone.stdout for c in engine_cmds), alone.stdout
    assert not any(f"    {c} " in alone.stdout for c in gateway_cmds)
    bad = duplex("serve", timeout=120)
    assert bad.returncode == 2 and "invalid choice: 'serve'" in bad.stderr
