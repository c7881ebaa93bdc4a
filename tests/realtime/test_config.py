"""Server config: YAML into dataclasses, errors naming the key, `duplex serve` exit code 2."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from realtime.config import ServerConfig, config_from_dict, load_config, with_overrides

REPO = Path(__file__).resolve().parents[2]


def test_shipped_yaml_equals_the_defaults():
    cfg = load_config(REPO / "configs" / "server.yaml")
    assert cfg == ServerConfig()


@pytest.mark.parametrize("data, key", [
    ({"server": {"prot": 1}}, "server.prot"),
    ({"limits": {"idle_timeout_s": "long"}}, "limits.idle_timeout_s"),
    ({"vad": {"threshold": 2.0}}, "vad.threshold"),
    ({"audio": {"output_frame_ms": 33}}, "audio.output_frame_ms"),
    ({"nonsense": {}}, "nonsense"),
    ({"server": {"port": True}}, "server.port"),
    ({"session": {"voice": "narrator"}}, "session.voice"),
    ({"session": {"voices": {"default": "a.wav"}}}, "session.voices.default"),
    ({"session": {"voices": {"x": 3}}}, "session.voices.x"),
    ({"session": {"voices": ["a.wav"]}}, "session.voices"),
])
def test_bad_keys_and_values_name_the_key(data, key):
    with pytest.raises(ValueError, match=f"'{key}'"):
        config_from_dict(data)


def test_overrides_and_ints_as_floats():
    cfg = with_overrides(config_from_dict({"limits": {"idle_timeout_s": 5}}), **{"server.port": 9001, "server.host": None})
    assert cfg.limits.idle_timeout_s == 5.0 and cfg.server.port == 9001 and cfg.server.host == "127.0.0.1"


def test_duplex_serve_bad_config_exits_2_naming_the_key(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("limits:\n  max_sesions: 3\n")
    r = subprocess.run([sys.executable, "-m", "realtime.cli", "serve", "--config", str(bad)], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert r.returncode == 2
    assert "limits.max_sesions" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    bad.write_text("engine:\n  max_conversation: 3\n")
    r = subprocess.run([sys.executable, "-m", "realtime.cli", "serve", "--config", str(bad)], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert r.returncode == 2 and "engine.max_conversation" in r.stderr
    bad.write_text("engine:\n  codec_device: gpu\n")
    r = subprocess.run([sys.executable, "-m", "realtime.cli", "serve", "--config", str(bad)], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert r.returncode == 2 and "engine.codec_device" in r.stderr and "'gpu'" in r.stderr
    # a voice file that is not there, or not a WAV: named before the engine starts
    bad.write_text(f"session:\n  voices:\n    narrator: {tmp_path / 'missing.wav'}\n")
    r = subprocess.run([sys.executable, "-m", "realtime.cli", "serve", "--config", str(bad)], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert r.returncode == 2 and "session.voices.narrator" in r.stderr and "no such file" in r.stderr
    (tmp_path / "text.wav").write_text("not audio")
    bad.write_text(f"session:\n  voices:\n    narrator: {tmp_path / 'text.wav'}\n")
    r = subprocess.run([sys.executable, "-m", "realtime.cli", "serve", "--config", str(bad)], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert r.returncode == 2 and "session.voices.narrator" in r.stderr and "not a readable WAV" in r.stderr


def test_realtime_imports_no_torch_or_vllm():
    code = "import sys, realtime.server, realtime.cli.serve; print('torch' in sys.modules, 'vllm' in sys.modules)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert r.stdout.split() == ["False", "False"], r.stderr


@pytest.mark.parametrize("name", sorted(p.name for p in (REPO / "configs").glob("*.yaml")))
def test_every_shipped_config_is_accepted_by_duplex_serve(name):
    """The real-model configs get past the config check to the model (not in this checkout): one line, exit 2."""
    cfg = load_config(REPO / "configs" / name)
    ecfg = cfg.engine
    if ecfg.model is None:
        return  # server.yaml: the tiny default
    r = subprocess.run([sys.executable, "-m", "realtime.cli", "serve", "--config", str(REPO / "configs" / name), "--port", "0"],
                       capture_output=True, text=True, cwd=REPO, timeout=120, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    last = r.stderr.strip().splitlines()[-1]
    assert r.returncode == 2 and ecfg.model in last and "no such directory" in last, r.stderr[-1500:]
    assert "Traceback" not in r.stderr
