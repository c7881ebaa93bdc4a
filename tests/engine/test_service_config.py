"""The engine's settings (engine/service_config.py): the `engine:` section of the server config, one typed
dataclass whose fields carry their bounds; a bad value is an error naming the field, and `duplex serve`
exits 2 with it. Mapped onto vLLM's settings in one place, with one set of defaults."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from engine.service_config import ConfigFieldError, EngineServiceConfig
from realtime.config import ServerConfig, config_from_dict, load_config, with_overrides

REPO = Path(__file__).resolve().parents[2]

BAD = [
    ("max_num_seqs", 0, "an integer >= 1"),
    ("max_conversations", -3, "an integer >= 1"),
    ("data_parallel_size", 1.5, "an integer >= 1"),
    ("kv_cache_gib", 0, "a number > 0"),
    ("capacity_margin", 1.5, "a number > 0 and <= 1"),
    ("prefill_interval_ms", -1.0, "a number >= 0"),
    ("cpu_threads", 0, "an integer >= 1 or null"),
    ("cpu_threads", True, "an integer >= 1 or null"),
    ("max_model_len", 0, "an integer >= 1 or null"),
    ("capacity_override", "4", "an integer >= 1 or null"),
    ("seed", -1, "an integer >= 0 and <= 9223372036854775807"),
    ("dtype", "int8", "one of auto, half, float16, bfloat16, float, float32"),
    ("codec_device", "gpu", "auto, cpu, cuda or cuda:N"),
    ("warmup", "yes", "true or false"),
    ("model", 7, "a string or null"),
]


@pytest.mark.parametrize("name, value, expected", BAD, ids=[f"{n}={v!r}" for n, v, _ in BAD])
def test_a_value_out_of_its_fields_bounds_names_the_field(name, value, expected) -> None:
    with pytest.raises(ConfigFieldError) as direct:
        EngineServiceConfig(**{name: value})
    assert direct.value.key == f"engine.{name}" and direct.value.value == value
    assert str(direct.value) == f"config key 'engine.{name}': expected {expected}, got {value!r}"
    with pytest.raises(ValueError, match=f"'engine.{name}'"):  # the same from the server config
        config_from_dict({"engine": {name: value}})


def test_good_values_and_the_defaults() -> None:
    cfg = EngineServiceConfig(max_num_seqs=8, kv_cache_gib=2, codec_device="cuda:1", cpu_threads=None, dtype="bfloat16",
                              capacity_margin=1.0, seed=2**63 - 1)
    assert cfg.vllm_dtype == "bfloat16" and cfg.codec_device == "cuda:1"
    assert config_from_dict({"engine": {"kv_cache_gib": 2}}).engine.kv_cache_gib == 2.0
    assert config_from_dict({"engine": None}).engine == EngineServiceConfig() == ServerConfig().engine
    with pytest.raises(ValueError, match="'engine.max_num_seq'"):  # unknown keys, as in every section
        config_from_dict({"engine": {"max_num_seq": 8}})
    with pytest.raises(ValueError, match="'engine'"):
        config_from_dict({"engine": ["model"]})
    # --model is an override of engine.model, as --port of server.port
    assert with_overrides(ServerConfig(), **{"engine.model": "some/dir"}).engine == EngineServiceConfig(model="some/dir")


def test_one_set_of_defaults_mapped_in_one_place() -> None:
    """What vLLM gets (async_engine.EngineConfig) is the service's settings: the same defaults, and
    `for_service` carries every setting the two share."""
    from engine.async_engine import EngineConfig

    service, plain = EngineServiceConfig(), EngineConfig(model="m")
    shared = {f.name for f in dataclasses.fields(EngineConfig)} & {f.name for f in dataclasses.fields(EngineServiceConfig)}
    shared -= {"model", "cpu_threads"}  # resolved by the service: the checkpoint's directory, engine_cpu_threads
    assert shared >= {"max_num_seqs", "max_model_len", "max_num_batched_tokens", "kv_cache_gib", "enforce_eager",
                      "enable_chunked_prefill", "pacing_lead_ms", "first_chunk_frames", "seed", "dtype", "data_parallel_size"}
    assert {n: getattr(plain, n) for n in shared} == {n: getattr(service, n) for n in shared}
    custom = EngineServiceConfig(max_num_seqs=8, max_model_len=512, max_num_batched_tokens=1024, kv_cache_gib=2.0,
                                 enforce_eager=False, enable_chunked_prefill=False, pacing_lead_ms=300.0, first_chunk_frames=2,
                                 seed=7, dtype="bfloat16", data_parallel_size=2, kv_block_size=64)
    mapped = EngineConfig.for_service(custom, model="m", cpu_threads=3)
    assert {n: getattr(mapped, n) for n in shared} == {n: getattr(custom, n) for n in shared}
    assert (mapped.model, mapped.cpu_threads, mapped.block_size) == ("m", 3, 64)


def test_the_shipped_configs_load_as_the_typed_section() -> None:
    for path in sorted((REPO / "configs").glob("*.yaml")):
        assert isinstance(load_config(path).engine, EngineServiceConfig), path


def test_duplex_serve_exits_2_naming_the_field(tmp_path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("engine:\n  max_num_seqs: 0\n")
    r = subprocess.run([sys.executable, "-m", "realtime.cli", "serve", "--config", str(bad)], capture_output=True, text=True,
                       cwd=REPO, timeout=120)
    assert r.returncode == 2, r.stderr[-1500:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].endswith("config key 'engine.max_num_seqs': expected an integer >= 1, got 0"), r.stderr
