import hashlib
import json
import pathlib

import numpy as np
import pytest
import torch

from engine.codec.config import DACConfig, SSLConfig, load_config
from engine.codec.dac import DAC
from engine.codec.tiny import make_tiny_codec
from engine.vocab import CODEBOOK_SIZE, HOP_SAMPLES, NUM_CODEBOOKS


@pytest.mark.parametrize("n_samples", [HOP_SAMPLES * 50, HOP_SAMPLES * 50 + 1, 4321])
def test_round_trip_shapes_and_rates(dac: DAC, speech: np.ndarray, n_samples: int) -> None:
    audio = torch.from_numpy(speech[:n_samples])[None, None]
    codes = dac.encode(audio)
    n_frames = -(-n_samples // HOP_SAMPLES)  # 50 frames per second at 16 kHz
    assert codes.shape == (1, NUM_CODEBOOKS, n_frames)
    assert codes.min() >= 0 and codes.max() < CODEBOOK_SIZE
    out = dac.decode(codes)
    assert out.shape == (1, 1, n_frames * HOP_SAMPLES)
    assert torch.isfinite(out).all() and out.abs().max() > 0


def test_codes_follow_the_signal(dac: DAC, speech: np.ndarray) -> None:
    codes = dac.encode(torch.from_numpy(speech)[None, None])[0]
    # a codec that ignored its input would repeat one code
    assert all(len(set(codes[k].tolist())) > 10 for k in range(NUM_CODEBOOKS))


def test_tiny_build_is_byte_identical(tmp_path: pathlib.Path, tiny_dir: pathlib.Path) -> None:
    make_tiny_codec(tmp_path, seed=0)
    for rel in ["codec/config.json", "codec/model.safetensors", "ssl/config.json", "ssl/model.safetensors"]:
        a = hashlib.sha256((tmp_path / rel).read_bytes()).hexdigest()
        b = hashlib.sha256((tiny_dir / rel).read_bytes()).hexdigest()
        assert a == b, rel


def test_state_dict_uses_espnet_names() -> None:
    keys = set(DAC(DACConfig(hidden_dim=16, codebook_dim=16, encdec_n_filters=4)).state_dict())
    # ESPnet key = "codec.generator." + ours (README has the full mapping)
    for key in [
        "encoder.model.0.conv.conv.parametrizations.weight.original0",
        "encoder.model.0.conv.conv.parametrizations.weight.original1",
        "encoder.model.1.block.1.conv.conv.bias",
        "encoder.model.1.shortcut.conv.conv.parametrizations.weight.original1",
        "encoder.model.21.lstm.weight_ih_l1",
        "quantizer.vq.layers.7._codebook.embed",
        "decoder.model.1.lstm.weight_hh_l0",
        "decoder.model.3.convtr.convtr.parametrizations.weight.original0",
    ]:
        assert key in keys, key


def test_config_errors_name_the_key(tmp_path: pathlib.Path, tiny_dir: pathlib.Path) -> None:
    good = json.loads((tiny_dir / "codec" / "config.json").read_text())
    path = tmp_path / "config.json"
    for broken, key in [
        ({k: v for k, v in good.items() if k != "hidden_dim"}, "hidden_dim"),
        ({**good, "hidden_dim": "big"}, "hidden_dim"),
        ({**good, "surprise": 1}, "surprise"),
        ({**good, "encdec_ratios": [8, 5, 4, 4]}, "hop"),
    ]:
        path.write_text(json.dumps(broken))
        with pytest.raises(ValueError, match=key):
            load_config(DACConfig, path)
    with pytest.raises(ValueError, match="does not exist"):
        load_config(SSLConfig, tmp_path / "nope.json")
    with pytest.raises(ValueError, match="does not exist"):
        DAC.from_dir(tmp_path)
