"""Build the tiny random codec and SSL tokenizer that tests and the CPU default use.

Tiny widths keep CPU fast; the layout is the real one (16 kHz, hop 320, 8 x 1024 codebooks,
5000 SSL clusters). Codebooks and centroids are not left random: like ESPnet's k-means init they
are drawn from the encoders' outputs on a synthetic speech-like signal, so different sounds map to
different codes. A fixed seed gives byte-identical files.
"""

from __future__ import annotations

import pathlib

import torch
from safetensors.torch import save_file

from engine.codec import dac as dac_mod
from engine.codec import ssl as ssl_mod
from engine.codec.config import DACConfig, SSLConfig, save_config
from engine.codec.dac import DAC
from engine.codec.ssl import SSLTokenizer
from engine.codec.synth import speech_like

TINY_DAC = DACConfig(
    hidden_dim=64,
    codebook_dim=64,
    encdec_n_filters=8,
    encdec_n_residual_layers=1,
)
TINY_SSL = SSLConfig(channels=32, feature_dim=64)
_INIT_AUDIO_S = 8.0
_TARGET_RMS = 0.1  # scale the random decoder so its output sits well inside int16


def _sample_rows(data: torch.Tensor, n: int, gen: torch.Generator, noise: float) -> torch.Tensor:
    """n rows drawn from data [N, D] with replacement, plus noise so duplicates differ."""
    idx = torch.randint(0, data.shape[0], (n,), generator=gen)
    scale = data.std(dim=0, keepdim=True) * noise
    return data[idx] + torch.randn(n, data.shape[1], generator=gen) * scale


@torch.inference_mode()
def _init_codebooks(model: DAC, audio: torch.Tensor, gen: torch.Generator) -> None:
    # Latents of O(1), as a trained codec has: tiny random ones make the nearest-code distances
    # so small that float rounding decides near-ties.
    out_conv = dac_mod.child(model.encoder.model, -1, dac_mod.SConv1d).conv.conv
    _scale_conv(out_conv, 1.0 / float(model.encoder(audio).std()))
    residual = model.encoder(audio)  # [1, D, T]
    for k in range(model.quantizer.vq.num_layers):
        layer = model.quantizer.vq.layer(k)
        rows = residual[0].t()
        layer._codebook.embed.copy_(_sample_rows(rows, layer._codebook.embed.shape[0], gen, 1.0))
        residual = residual - layer.decode(layer.encode(residual))
    codes = model.quantizer.encode(model.encoder(audio))
    rms = model.decode(codes).pow(2).mean().sqrt()
    _scale_conv(dac_mod.child(model.decoder.model, -1, dac_mod.SConv1d).conv.conv, _TARGET_RMS / float(rms))


def _scale_conv(conv: torch.nn.Conv1d, factor: float) -> None:
    # weight norm: the output scales with g (original0) and the bias
    conv.get_parameter("parametrizations.weight.original0").mul_(factor)
    conv.get_parameter("bias").mul_(factor)


@torch.inference_mode()
def _init_centroids(model: SSLTokenizer, audio: torch.Tensor, gen: torch.Generator) -> None:
    last = dac_mod.child(model.extractor, -1, ssl_mod.PaddedConv1d)
    factor = 1.0 / float(model.features(audio).std())
    last.weight.mul_(factor)
    last.get_parameter("bias").mul_(factor)
    feats = model.features(audio)[0].t()
    model.centroids.copy_(_sample_rows(feats, model.centroids.shape[0], gen, 1.0))


def _save(module: torch.nn.Module, path: pathlib.Path) -> None:
    state = {k: v.detach().contiguous().clone() for k, v in sorted(module.state_dict().items())}
    save_file(state, str(path))


def make_tiny_codec(out_dir: pathlib.Path, seed: int = 0) -> None:
    """Write out_dir/codec/{config.json, model.safetensors} and out_dir/ssl/{...}."""
    out_dir = pathlib.Path(out_dir)
    gen = torch.Generator().manual_seed(seed)
    audio = torch.from_numpy(speech_like(_INIT_AUDIO_S, seed=seed))[None, None]
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        codec = DAC(TINY_DAC).eval()
        ssl = SSLTokenizer(TINY_SSL).eval()
    _init_codebooks(codec, audio, gen)
    _init_centroids(ssl, audio, gen)
    for sub, cfg, module in (
        (dac_mod.CODEC_SUBDIR, TINY_DAC, codec),
        (ssl_mod.SSL_SUBDIR, TINY_SSL, ssl),
    ):
        target = out_dir / sub
        target.mkdir(parents=True, exist_ok=True)
        save_config(cfg, target / dac_mod.CONFIG_NAME)
        _save(module, target / dac_mod.WEIGHTS_NAME)
