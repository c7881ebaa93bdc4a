"""SSL tokenizer for stream 0: a feature extractor at 50 Hz and a k-means codebook (argmin distance).

The tiny default is a random strided conv stack with a random codebook (`kind: "conv"`); real
checkpoints ship XEUS plus k-means 5000 (`kind: "xeus"`, engine/codec/xeus.py). `load_ssl(model_dir)`
picks the class from `ssl/config.json`; both give `features()` / `quantize()` / `tokenize()` and
`context_frames()` for the streaming tokenizer's windows.
"""

from __future__ import annotations

import json
import math
import pathlib

import torch
from torch import nn

from engine.codec.cluster import ClusterTokenizer
from engine.codec.config import CONFIG_NAME, SSLConfig, load_part
from engine.codec.dac import pad1d_reflect
from engine.codec.receptive import context_frames
from engine.codec.xeus import XeusTokenizer

SSL_SUBDIR = "ssl"


class PaddedConv1d(nn.Conv1d):
    """Conv1d with the codec's padding rule (reflect, left-heavy, last window full), so an input
    of n·hop samples gives exactly n frames and windows cut on the frame grid line up."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        stride = self.stride[0]
        kernel = self.kernel_size[0]
        padding_total = kernel - stride
        n_frames = (x.shape[-1] - kernel + padding_total) / stride + 1
        extra = (math.ceil(n_frames) - 1) * stride + (kernel - padding_total) - x.shape[-1]
        right = padding_total // 2
        return super().forward(pad1d_reflect(x, padding_total - right, right + extra))


class SSLTokenizer(ClusterTokenizer):
    """audio [B, 1, S] -> features [B, feature_dim, ceil(S / 320)] -> clusters [B, T] in 0..4999."""

    def __init__(self, cfg: SSLConfig) -> None:
        super().__init__()
        self.cfg = cfg
        layers: list[nn.Module] = []
        in_ch = 1
        for stride in cfg.strides:
            layers += [PaddedConv1d(in_ch, cfg.channels, 2 * stride, stride), nn.GELU()]
            in_ch = cfg.channels
        layers.append(PaddedConv1d(cfg.channels, cfg.feature_dim, 3))
        self.extractor = nn.Sequential(*layers)
        self.register_buffer("centroids", torch.zeros(cfg.num_clusters, cfg.feature_dim))

    def context_frames(self, hop: int, device: torch.device | str) -> tuple[int, int]:
        """(left, right) frames a streaming window needs around a block: the conv stack's
        receptive field, measured."""
        return context_frames(self.extractor, 1, hop, 1, device)

    def features(self, audio: torch.Tensor) -> torch.Tensor:
        return self.extractor(audio)

    @classmethod
    def from_dir(cls, model_dir: pathlib.Path, device: torch.device | str = "cpu") -> SSLTokenizer:
        """Load `model_dir/ssl/{config.json, model.safetensors}`."""
        return load_part(cls, SSLConfig, pathlib.Path(model_dir) / SSL_SUBDIR, "SSL").to(device)


def ssl_kind(model_dir: pathlib.Path) -> str:
    """The `kind` in `model_dir/ssl/config.json` ("conv" when the file says nothing)."""
    path = pathlib.Path(model_dir) / SSL_SUBDIR / CONFIG_NAME
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"SSL config {path} does not exist") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"SSL config {path} is not valid JSON: {exc}") from None
    kind = raw.get("kind", "conv") if isinstance(raw, dict) else None
    if kind not in ("conv", "xeus"):
        raise ValueError(f"{path}: unknown SSL kind {kind!r} (known: 'conv', 'xeus')")
    return kind


def load_ssl(model_dir: pathlib.Path, device: torch.device | str = "cpu") -> ClusterTokenizer:
    """The stream-0 tokenizer of a model directory, whichever kind it ships."""
    if ssl_kind(model_dir) == "xeus":
        return XeusTokenizer.from_dir(pathlib.Path(model_dir) / SSL_SUBDIR, device=device)
    return SSLTokenizer.from_dir(model_dir, device=device)
