import pathlib

import numpy as np
import pytest
import torch

from engine.codec.dac import DAC
from engine.codec.ssl import SSLTokenizer
from engine.codec.synth import speech_like
from engine.codec.tiny import make_tiny_codec


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    # One thread: the CI machine has 2 shared cores and oversubscribed conv threads run ~50x slower.
    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("tiny_model")
    make_tiny_codec(out, seed=0)
    return out


@pytest.fixture(scope="session")
def dac(tiny_dir: pathlib.Path) -> DAC:
    return DAC.from_dir(tiny_dir)


@pytest.fixture(scope="session")
def ssl(tiny_dir: pathlib.Path) -> SSLTokenizer:
    return SSLTokenizer.from_dir(tiny_dir)


@pytest.fixture(scope="session")
def speech() -> np.ndarray:
    return speech_like(3.3, seed=11)


@pytest.fixture(scope="session")
def speech_codes(dac: DAC, speech: np.ndarray) -> np.ndarray:
    """Local codes [T, 8] of the speech-like signal: what the decoder sees in practice."""
    return dac.encode(torch.from_numpy(speech)[None, None])[0].t().numpy()
