"""ESPnet-Codec DAC (SEANet encoder/decoder, Snake, weight norm, LSTM, residual VQ) in PyTorch.

The module tree mirrors ESPnet's `DACGenerator` (`espnet2/gan_codec/dac/dac.py`, with
`shared/encoder/seanet.py`, `shared/decoder/seanet.py`, `shared/quantizer/residual_vq.py`,
`shared/quantizer/modules/core_vq.py`), so ESPnet state-dict keys map onto ours by stripping the
`codec.generator.` prefix; `engine/codec/README.md` has the mapping. Only inference is implemented.

Shapes: audio [B, 1, samples], latents [B, hidden_dim, frames], codes [B, 8, frames] (local 0..1023).
"""

from __future__ import annotations

import math
import pathlib
from typing import TypeVar

import torch
from torch import nn
from torch.nn import functional as F
from torch.nn.utils import parametrize
from torch.nn.utils.parametrizations import weight_norm

from engine.codec.config import CONFIG_NAME, WEIGHTS_NAME, DACConfig, load_part  # noqa: F401 (re-exported)

CODEC_SUBDIR = "codec"

_M = TypeVar("_M", bound=nn.Module)


def child(container: nn.Sequential | nn.ModuleList, index: int, kind: type[_M]) -> _M:
    """container[index], checked to be a `kind`: torch types a container's items as plain Modules,
    and the layout (which the checkpoint's keys fix) is what says which one it is."""
    layer = container[index]
    if not isinstance(layer, kind):
        raise TypeError(f"layer {index} is a {type(layer).__name__}, not a {kind.__name__}")
    return layer


class Snake1d(nn.Module):
    """x + sin²(αx)/α with α fixed at 1: ESPnet's Snake1d holds α as a plain tensor, not a weight."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        alpha = 1.0
        return x + (1.0 / (alpha + 1e-9)) * torch.sin(alpha * x).pow(2)


def pad1d_reflect(x: torch.Tensor, left: int, right: int) -> torch.Tensor:
    # ESPnet's pad1d: reflect needs length > pad, so short inputs get zeros first.
    length = x.shape[-1]
    extra = 0
    if length <= max(left, right):
        extra = max(left, right) - length + 1
        x = F.pad(x, (0, extra))
    padded = F.pad(x, (left, right), mode="reflect")
    return padded[..., : padded.shape[-1] - extra]


class NormConv1d(nn.Module):
    def __init__(self, in_ch: int, out_ch: int, kernel_size: int, stride: int = 1, dilation: int = 1) -> None:
        super().__init__()
        self.conv = weight_norm(nn.Conv1d(in_ch, out_ch, kernel_size, stride, dilation=dilation))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x)


class SConv1d(nn.Module):
    """Non-causal conv with ESPnet's padding: reflect, left-heavy split, and extra right padding
    so the last window is full (so an input of n·stride samples gives n outputs)."""

    def __init__(
        self, in_ch: int, out_ch: int, kernel_size: int, stride: int = 1, dilation: int = 1
    ) -> None:
        super().__init__()
        self.conv = NormConv1d(in_ch, out_ch, kernel_size, stride, dilation=dilation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        conv = self.conv.conv
        stride = conv.stride[0]
        kernel_eff = (conv.kernel_size[0] - 1) * conv.dilation[0] + 1
        padding_total = kernel_eff - stride
        length = x.shape[-1]
        n_frames = (length - kernel_eff + padding_total) / stride + 1
        ideal_length = (math.ceil(n_frames) - 1) * stride + (kernel_eff - padding_total)
        extra = ideal_length - length
        right = padding_total // 2
        left = padding_total - right
        return self.conv(pad1d_reflect(x, left, right + extra))


class NormConvTranspose1d(nn.Module):
    def __init__(self, in_ch: int, out_ch: int, kernel_size: int, stride: int) -> None:
        super().__init__()
        self.convtr = weight_norm(nn.ConvTranspose1d(in_ch, out_ch, kernel_size, stride))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.convtr(x)


class SConvTranspose1d(nn.Module):
    def __init__(self, in_ch: int, out_ch: int, kernel_size: int, stride: int) -> None:
        super().__init__()
        self.convtr = NormConvTranspose1d(in_ch, out_ch, kernel_size, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        convtr = self.convtr.convtr
        padding_total = convtr.kernel_size[0] - convtr.stride[0]
        right = padding_total // 2
        left = padding_total - right
        y = self.convtr(x)
        return y[..., left : y.shape[-1] - right]


class SLSTM(nn.Module):
    """LSTM over [B, C, T] with a skip connection; `forward_state` carries (h, c) for streaming."""

    def __init__(self, dim: int, num_layers: int) -> None:
        super().__init__()
        self.lstm = nn.LSTM(dim, dim, num_layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, _ = self.forward_state(x, None)
        return y

    def forward_state(
        self, x: torch.Tensor, state: tuple[torch.Tensor, torch.Tensor] | None
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        seq = x.permute(2, 0, 1)  # [T, B, C]
        y, new_state = self.lstm(seq, state)
        return (y + seq).permute(1, 2, 0), new_state


class SEANetResnetBlock(nn.Module):
    def __init__(self, dim: int, kernel_size: int, dilation: int, compress: int, true_skip: bool):
        super().__init__()
        hidden = dim // compress
        self.block = nn.Sequential(
            Snake1d(),
            SConv1d(dim, hidden, kernel_size, dilation=dilation),
            Snake1d(),
            SConv1d(hidden, dim, 1),
        )
        self.shortcut: nn.Module = nn.Identity() if true_skip else SConv1d(dim, dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.shortcut(x) + self.block(x)


def _res_blocks(cfg: DACConfig, dim: int) -> list[nn.Module]:
    return [
        SEANetResnetBlock(
            dim,
            cfg.encdec_residual_kernel_size,
            cfg.encdec_dilation_base**j,
            cfg.encdec_compress,
            cfg.encdec_true_skip,
        )
        for j in range(cfg.encdec_n_residual_layers)
    ]


class SEANetEncoder(nn.Module):
    """audio [B, 1, S] -> latents [B, hidden_dim, ceil(S / hop)]."""

    def __init__(self, cfg: DACConfig) -> None:
        super().__init__()
        nf = cfg.encdec_n_filters
        mult = 1
        layers: list[nn.Module] = [SConv1d(cfg.encdec_channels, nf, cfg.encdec_kernel_size)]
        for ratio in reversed(cfg.encdec_ratios):
            layers += _res_blocks(cfg, mult * nf)
            layers += [Snake1d(), SConv1d(mult * nf, mult * nf * 2, ratio * 2, stride=ratio)]
            mult *= 2
        if cfg.encdec_lstm:
            layers.append(SLSTM(mult * nf, cfg.encdec_lstm))
        layers += [Snake1d(), SConv1d(mult * nf, cfg.hidden_dim, cfg.encdec_last_kernel_size)]
        self.model = nn.Sequential(*layers)
        self.has_lstm = bool(cfg.encdec_lstm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    # Streaming splits the stack at the LSTM: a conv part with a finite receptive field, the
    # stateful LSTM, and a short conv tail at frame rate.
    def pre_lstm(self) -> nn.Sequential:
        return self.model[: -3 if self.has_lstm else -2]  # type: ignore[return-value]  # torch's Sequential.__getitem__ has no overloads: a slice is a Sequential

    def lstm(self) -> SLSTM | None:
        return child(self.model, -3, SLSTM) if self.has_lstm else None

    def post_lstm(self) -> nn.Sequential:
        return self.model[-2:]  # type: ignore[return-value]  # as in pre_lstm


class SEANetDecoder(nn.Module):
    """latents [B, hidden_dim, T] -> audio [B, 1, T * hop]."""

    def __init__(self, cfg: DACConfig) -> None:
        super().__init__()
        nf = cfg.encdec_n_filters
        mult = 2 ** len(cfg.encdec_ratios)
        layers: list[nn.Module] = [SConv1d(cfg.hidden_dim, mult * nf, cfg.encdec_kernel_size)]
        if cfg.encdec_lstm:
            layers.append(SLSTM(mult * nf, cfg.encdec_lstm))
        for ratio in cfg.encdec_ratios:
            layers += [
                Snake1d(),
                SConvTranspose1d(mult * nf, mult * nf // 2, ratio * 2, ratio),
            ]
            layers += _res_blocks(cfg, mult * nf // 2)
            mult //= 2
        layers += [Snake1d(), SConv1d(nf, cfg.encdec_channels, cfg.encdec_last_kernel_size)]
        self.model = nn.Sequential(*layers)
        self.has_lstm = bool(cfg.encdec_lstm)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.model(z)

    def in_conv(self) -> SConv1d:
        return child(self.model, 0, SConv1d)

    def lstm(self) -> SLSTM | None:
        return child(self.model, 1, SLSTM) if self.has_lstm else None

    def upsampler(self) -> nn.Sequential:
        return self.model[2 if self.has_lstm else 1 :]  # type: ignore[return-value]  # torch's Sequential.__getitem__ has no overloads: a slice is a Sequential


class EuclideanCodebook(nn.Module):
    embed: torch.Tensor  # [codebook_size, dim], a buffer

    def __init__(self, dim: int, codebook_size: int) -> None:
        super().__init__()
        self.register_buffer("embed", torch.zeros(codebook_size, dim))

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, D] -> nearest code [N] (ESPnet's -(|x|² - 2x·e + |e|²) argmax)."""
        embed = self.embed.t()
        dist = -(x.pow(2).sum(1, keepdim=True) - 2 * x @ embed + embed.pow(2).sum(0, keepdim=True))
        return dist.max(dim=-1).indices


class VectorQuantization(nn.Module):
    def __init__(self, dim: int, codebook_dim: int, codebook_size: int) -> None:
        super().__init__()
        projected = codebook_dim != dim
        self.project_in: nn.Module = nn.Linear(dim, codebook_dim) if projected else nn.Identity()
        self.project_out: nn.Module = nn.Linear(codebook_dim, dim) if projected else nn.Identity()
        self._codebook = EuclideanCodebook(codebook_dim, codebook_size)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, D, T] -> codes [B, T]."""
        b, _, t = x.shape
        x = self.project_in(x.transpose(1, 2)).reshape(b * t, -1)
        return self._codebook.encode(x).view(b, t)

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """codes [B, T] -> [B, D, T]."""
        return self.project_out(F.embedding(codes, self._codebook.embed)).transpose(1, 2)


class ResidualVectorQuantization(nn.Module):
    def __init__(self, cfg: DACConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            VectorQuantization(cfg.hidden_dim, cfg.codebook_dim, cfg.quantizer_bins)
            for _ in range(cfg.quantizer_n_q)
        )

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def layer(self, k: int) -> VectorQuantization:
        return child(self.layers, k, VectorQuantization)


class ResidualVectorQuantizer(nn.Module):
    def __init__(self, cfg: DACConfig) -> None:
        super().__init__()
        self.vq = ResidualVectorQuantization(cfg)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """latents [B, D, T] -> codes [B, n_q, T]."""
        residual = x
        codes = []
        for k in range(self.vq.num_layers):
            layer = self.vq.layer(k)
            idx = layer.encode(residual)
            residual = residual - layer.decode(idx)
            codes.append(idx)
        return torch.stack(codes, dim=1)

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """codes [B, n_q, T] -> latents [B, D, T] (sum of the codebooks' vectors)."""
        out = self.vq.layer(0).decode(codes[:, 0])
        for k in range(1, codes.shape[1]):
            out = out + self.vq.layer(k).decode(codes[:, k])
        return out


class DAC(nn.Module):
    """The generator: `encode` audio -> codes, `decode` codes -> audio, offline (whole utterance)."""

    def __init__(self, cfg: DACConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.encoder = SEANetEncoder(cfg)
        self.quantizer = ResidualVectorQuantizer(cfg)
        self.decoder = SEANetDecoder(cfg)

    @property
    def hop_samples(self) -> int:
        return self.cfg.hop_samples

    @property
    def device(self) -> torch.device:
        return self.quantizer.vq.layer(0)._codebook.embed.device

    @torch.inference_mode()
    def encode(self, audio: torch.Tensor) -> torch.Tensor:
        """audio [B, 1, S] float in [-1, 1] -> codes [B, 8, ceil(S / 320)] int64."""
        return self.quantizer.encode(self.encoder(audio))

    @torch.inference_mode()
    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """codes [B, 8, T] -> audio [B, 1, T * 320]."""
        return self.decoder(self.quantizer.decode(codes))

    def fuse_weight_norm(self) -> DAC:
        """Fold weight norm into plain weights: same outputs, no per-call norm recomputation.
        Do this after loading; the state-dict keys lose their `parametrizations.` form."""
        for module in self.modules():
            if isinstance(module, (nn.Conv1d, nn.ConvTranspose1d)) and parametrize.is_parametrized(
                module, "weight"
            ):
                parametrize.remove_parametrizations(module, "weight", leave_parametrized=True)
        return self

    @classmethod
    def from_dir(
        cls, model_dir: pathlib.Path, device: torch.device | str = "cpu", fuse: bool = True
    ) -> DAC:
        """Load `model_dir/codec/{config.json, model.safetensors}` (model_dir: the LM checkpoint)."""
        model = load_part(cls, DACConfig, pathlib.Path(model_dir) / CODEC_SUBDIR, "codec")
        if fuse:
            model.fuse_weight_norm()
        return model.to(device)
