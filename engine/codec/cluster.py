"""The stream-0 tokenizer's interface: features, then the nearest k-means centroid. Its kinds are
the tiny conv extractor (engine/codec/ssl.py) and XEUS (engine/codec/xeus.py)."""

from __future__ import annotations

import torch
from torch import nn


class ClusterTokenizer(nn.Module):
    """Stream 0: features -> the nearest k-means centroid. A kind gives `features`, `context_frames`
    and a `centroids` buffer [5000, D]."""

    centroids: torch.Tensor

    @property
    def device(self) -> torch.device:
        return self.centroids.device

    def features(self, audio: torch.Tensor) -> torch.Tensor:
        """audio [B, 1, S] -> [B, D, ceil(S / 320)]."""
        raise NotImplementedError

    def context_frames(self, hop: int, device: torch.device | str) -> tuple[int, int]:
        raise NotImplementedError

    def quantize(self, features: torch.Tensor) -> torch.Tensor:
        return nearest_centroid(features, self.centroids)

    @torch.inference_mode()
    def tokenize(self, audio: torch.Tensor) -> torch.Tensor:
        return self.quantize(self.features(audio))


def nearest_centroid(features: torch.Tensor, centroids: torch.Tensor) -> torch.Tensor:
    """features [B, D, T] -> index of the nearest centroid (Euclidean) [B, T]: the fork's cdist
    argmin and sklearn's `KMeans.predict`, as one matmul."""
    b, d, t = features.shape
    x = features.transpose(1, 2).reshape(b * t, d).to(centroids.dtype)
    dist = x.pow(2).sum(1, keepdim=True) - 2 * x @ centroids.t() + centroids.pow(2).sum(1)[None, :]
    return dist.argmin(dim=-1).view(b, t)
