"""XEUS (ESPnet's multilingual SSL encoder) as the stream-0 tokenizer of the real OpusLM models.

OpusLM's stream 0 is the k-means cluster (5000 clusters) of XEUS features at layer 18. ESPnet's
SSL `encode(...)` returns the per-block outputs with the last one replaced by the final output
(after `after_norm`); the k-means recipes' reader takes entry `[layer]`, the espnet/vllm fork
`[18]` and ESPnet's speechlm tokenizer `[-1]`, which for the 19-block release are all the final
output. Module and parameter names follow ESPnet's checkpoint so the converter
(engine/convert/xeus.py) only strips prefixes and renames old-style weight norm.

The network, in ESPnet's order:
- waveform normalised to zero mean, unit variance (`F.layer_norm(wav, wav.shape)`; ESPnet does
  it over the whole batch tensor, which at batch 1, the way OpusLM calls it, is the utterance;
  here it is always per row so that batching never changes a session's tokens);
- wav2vec2 CNN: 7 unpadded convs (kernel/stride 10/5, 3/2 x4, 2/2 x2: 320 samples a frame,
  a 400-sample receptive field), each followed by LayerNorm over channels and GELU;
- Linear 512 -> 1024 (`preencoder`);
- a weight-normed grouped conv (kernel 128, 16 groups) + GELU as positional embedding;
- E-Branchformer blocks (macaron FFN, attention and cgMLP branches merged by a depthwise conv);
- `after_norm` on the final output when the checkpoint has one.

Streaming: attention is global, so a window's features depend on all of it. The tokenizer runs
XEUS on windows with `left_context_frames` of history and `right_context_frames` of lookahead
(config), and the frames at an utterance's end that the unpadded CNN cannot produce repeat the
last frame, as ESPnet's tokenizer pads them (`ensure_length`, mode "replicate").
"""

from __future__ import annotations

import dataclasses
import math
import pathlib

import torch
import torch.nn.functional as F
from torch import nn

from engine.codec.config import load_part
from engine.codec.cluster import ClusterTokenizer
from engine.units import HOP_SAMPLES, SAMPLE_RATE_HZ
from engine.vocab import SSL_SIZE

ESPNET_LAYER_NORM_EPS = 1e-12  # espnet.nets.pytorch_backend.transformer.layer_norm.LayerNorm


@dataclasses.dataclass(frozen=True)
class XeusConfig:
    """XEUS as released (`espnet/xeus`); the tiny test model shrinks the widths and depths."""

    kind: str = "xeus"
    sample_rate_hz: int = SAMPLE_RATE_HZ
    cnn_channels: int = 512
    cnn_kernels: tuple[int, ...] = (10, 3, 3, 3, 3, 2, 2)
    cnn_strides: tuple[int, ...] = (5, 2, 2, 2, 2, 2, 2)
    output_size: int = 1024
    attention_heads: int = 8
    linear_units: int = 4096  # macaron and final FFN
    cgmlp_linear_units: int = 4096
    cgmlp_conv_kernel: int = 31
    merge_conv_kernel: int = 31
    num_blocks: int = 19
    pos_conv_kernel: int = 128
    pos_conv_groups: int = 16
    after_norm: bool = True  # the encoder's final LayerNorm is in the checkpoint
    normalize_audio: bool = True
    output_layer: int = 18  # index into ESPnet's list of block outputs (last = final output)
    num_clusters: int = SSL_SIZE
    left_context_frames: int = 100  # streaming window history (2 s)
    right_context_frames: int = 10  # streaming lookahead (200 ms); >= 1 for the CNN's overlap

    def __post_init__(self) -> None:
        object.__setattr__(self, "cnn_kernels", tuple(int(k) for k in self.cnn_kernels))
        object.__setattr__(self, "cnn_strides", tuple(int(s) for s in self.cnn_strides))
        if self.kind != "xeus":
            raise ValueError(f"XeusConfig kind must be 'xeus', got {self.kind!r}")
        if len(self.cnn_kernels) != len(self.cnn_strides) or not self.cnn_kernels:
            raise ValueError("cnn_kernels and cnn_strides must be non-empty and of equal length")
        if math.prod(self.cnn_strides) != HOP_SAMPLES or self.sample_rate_hz != SAMPLE_RATE_HZ:
            raise ValueError(
                f"cnn_strides {list(self.cnn_strides)} give hop {math.prod(self.cnn_strides)}, "
                f"need {HOP_SAMPLES} at {SAMPLE_RATE_HZ} Hz"
            )
        if self.output_size % self.attention_heads:
            raise ValueError("output_size must be a multiple of attention_heads")
        if self.cgmlp_linear_units % 2:
            raise ValueError("cgmlp_linear_units must be even (the gate splits it in halves)")
        if not 0 <= self.output_layer < self.num_blocks:
            raise ValueError(f"output_layer {self.output_layer} is outside 0..{self.num_blocks - 1}")
        if self.num_clusters != SSL_SIZE:
            raise ValueError(f"num_clusters must be {SSL_SIZE}, got {self.num_clusters}")
        if self.right_context_frames < 1 or self.left_context_frames < 0:
            raise ValueError("right_context_frames must be >= 1 and left_context_frames >= 0")

    @property
    def receptive_samples(self) -> int:
        """Samples one CNN output frame reads (400 for the release)."""
        field, jump = 1, 1
        for k, s in zip(self.cnn_kernels, self.cnn_strides):
            field += (k - 1) * jump
            jump *= s
        return field


class _EspnetLayerNorm(nn.LayerNorm):
    def __init__(self, size: int) -> None:
        super().__init__(size, eps=ESPNET_LAYER_NORM_EPS)


class _ConvBlock(nn.Module):
    def __init__(self, cin: int, cout: int, kernel: int, stride: int) -> None:
        super().__init__()
        self.conv = nn.Conv1d(cin, cout, kernel, stride)
        self.layer_norm = nn.LayerNorm(cout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv(x)
        x = self.layer_norm(x.transpose(1, 2)).transpose(1, 2)
        return F.gelu(x)


class _Frontend(nn.Module):
    def __init__(self, cfg: XeusConfig) -> None:
        super().__init__()
        chans = [1] + [cfg.cnn_channels] * len(cfg.cnn_kernels)
        self.layers = nn.ModuleList(
            _ConvBlock(chans[i], chans[i + 1], k, s)
            for i, (k, s) in enumerate(zip(cfg.cnn_kernels, cfg.cnn_strides))
        )

    def forward(self, wav: torch.Tensor) -> torch.Tensor:
        """[B, S] -> [B, T, C]."""
        x = wav[:, None]
        for layer in self.layers:
            x = layer(x)
        return x.transpose(1, 2)


class _Preencoder(nn.Module):
    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.linear_out = nn.Linear(cin, cout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_out(x)


class _ConvPositionalEmbedding(nn.Module):
    def __init__(self, size: int, kernel: int, groups: int) -> None:
        super().__init__()
        conv = nn.Conv1d(size, size, kernel, padding=kernel // 2, groups=groups)
        self.conv = nn.utils.parametrizations.weight_norm(conv, name="weight", dim=2)
        self.remove = 1 if kernel % 2 == 0 else 0  # an even kernel with padding k/2 adds a frame

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x.transpose(1, 2))
        if self.remove:
            y = y[..., : -self.remove]
        return F.gelu(y).transpose(1, 2)


class _FeedForward(nn.Module):
    def __init__(self, size: int, units: int) -> None:
        super().__init__()
        self.w_1 = nn.Linear(size, units)
        self.w_2 = nn.Linear(units, size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_2(F.silu(self.w_1(x)))


class _SelfAttention(nn.Module):
    def __init__(self, size: int, heads: int) -> None:
        super().__init__()
        self.h = heads
        self.linear_q = nn.Linear(size, size)
        self.linear_k = nn.Linear(size, size)
        self.linear_v = nn.Linear(size, size)
        self.linear_out = nn.Linear(size, size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape

        def heads(lin: nn.Linear) -> torch.Tensor:
            return lin(x).view(b, t, self.h, d // self.h).transpose(1, 2)

        # unmasked: the tokenizer batches only windows of equal length
        y = F.scaled_dot_product_attention(heads(self.linear_q), heads(self.linear_k), heads(self.linear_v))
        return self.linear_out(y.transpose(1, 2).reshape(b, t, d))


class _SpatialGatingUnit(nn.Module):
    def __init__(self, units: int, kernel: int) -> None:
        super().__init__()
        half = units // 2
        self.norm = _EspnetLayerNorm(half)
        self.conv = nn.Conv1d(half, half, kernel, 1, (kernel - 1) // 2, groups=half)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_r, x_g = x.chunk(2, dim=-1)
        x_g = self.conv(self.norm(x_g).transpose(1, 2)).transpose(1, 2)
        return x_r * x_g  # ESPnet's default gate activation is the identity


class _ConvGatingMLP(nn.Module):
    def __init__(self, size: int, units: int, kernel: int) -> None:
        super().__init__()
        self.channel_proj1 = nn.Sequential(nn.Linear(size, units), nn.GELU())
        self.csgu = _SpatialGatingUnit(units, kernel)
        self.channel_proj2 = nn.Linear(units // 2, size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.channel_proj2(self.csgu(self.channel_proj1(x)))


class _EBranchformerBlock(nn.Module):
    def __init__(self, cfg: XeusConfig) -> None:
        super().__init__()
        size = cfg.output_size
        self.attn = _SelfAttention(size, cfg.attention_heads)
        self.cgmlp = _ConvGatingMLP(size, cfg.cgmlp_linear_units, cfg.cgmlp_conv_kernel)
        self.feed_forward = _FeedForward(size, cfg.linear_units)
        self.feed_forward_macaron = _FeedForward(size, cfg.linear_units)
        self.norm_ff = _EspnetLayerNorm(size)
        self.norm_ff_macaron = _EspnetLayerNorm(size)
        self.norm_mha = _EspnetLayerNorm(size)
        self.norm_mlp = _EspnetLayerNorm(size)
        self.norm_final = _EspnetLayerNorm(size)
        k = cfg.merge_conv_kernel
        self.depthwise_conv_fusion = nn.Conv1d(2 * size, 2 * size, k, 1, (k - 1) // 2, groups=2 * size)
        self.merge_proj = nn.Linear(2 * size, size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + 0.5 * self.feed_forward_macaron(self.norm_ff_macaron(x))
        both = torch.cat([self.attn(self.norm_mha(x)), self.cgmlp(self.norm_mlp(x))], dim=-1)
        fused = self.depthwise_conv_fusion(both.transpose(1, 2)).transpose(1, 2)
        x = x + self.merge_proj(both + fused)
        x = x + 0.5 * self.feed_forward(self.norm_ff(x))
        return self.norm_final(x)


class _Encoder(nn.Module):
    def __init__(self, cfg: XeusConfig) -> None:
        super().__init__()
        self.embed = nn.Sequential(_ConvPositionalEmbedding(cfg.output_size, cfg.pos_conv_kernel, cfg.pos_conv_groups))
        # blocks past the output layer are never run, so they are not built (the converter drops them)
        self.encoders = nn.ModuleList(_EBranchformerBlock(cfg) for _ in range(cfg.output_layer + 1))
        final = cfg.output_layer == cfg.num_blocks - 1  # after_norm belongs to the final output only
        self.after_norm = _EspnetLayerNorm(cfg.output_size) if cfg.after_norm and final else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.encoders:
            x = block(x)
        return self.after_norm(x) if self.after_norm is not None else x


class XeusTokenizer(ClusterTokenizer):
    """audio [B, 1, S] -> features [B, output_size, ceil(S / 320)] -> clusters [B, T]."""

    def __init__(self, cfg: XeusConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.frontend = _Frontend(cfg)
        self.preencoder = _Preencoder(cfg.cnn_channels, cfg.output_size)
        self.encoder = _Encoder(cfg)
        self.register_buffer("centroids", torch.zeros(cfg.num_clusters, cfg.output_size))

    def context_frames(self, hop: int, device: torch.device | str) -> tuple[int, int]:
        """(left, right) frames a streaming window needs around a block: configured, since
        attention makes the receptive field the whole window."""
        return self.cfg.left_context_frames, self.cfg.right_context_frames

    def features(self, audio: torch.Tensor) -> torch.Tensor:
        wav = audio[:, 0]
        want = -(-wav.shape[-1] // HOP_SAMPLES)
        if wav.shape[-1] < self.cfg.receptive_samples:  # too short for one CNN frame
            wav = F.pad(wav, (0, self.cfg.receptive_samples - wav.shape[-1]))
        if self.cfg.normalize_audio:
            wav = F.layer_norm(wav, wav.shape[-1:])
        x = self.encoder(self.preencoder(self.frontend(wav)))[:, :want]
        if x.shape[1] < want:
            x = torch.cat([x, x[:, -1:].expand(-1, want - x.shape[1], -1)], dim=1)
        return x.transpose(1, 2)

    @classmethod
    def from_dir(cls, part_dir: pathlib.Path, device: torch.device | str = "cpu") -> XeusTokenizer:
        # meta init: the release's 574 M random parameters would double the load's memory and time
        return load_part(cls, XeusConfig, pathlib.Path(part_dir), "SSL (XEUS)", meta_init=True).to(device)
