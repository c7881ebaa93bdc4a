"""ESPnet XEUS checkpoint + k-means model -> `OUT/ssl/{config.json, model.safetensors}` (kind "xeus").

Input is the `espnet/xeus` release layout (`model/xeus_checkpoint_new.pth`, `model/km_opus_lm.mdl`,
`model/config.yaml`) or explicit paths. The architecture is read from the tensors themselves
(depth, widths, kernel sizes, which optional norms and biases exist); only what tensors cannot
say comes from the ESPnet config when it is there (attention heads, default 8 as released) or
the command line (the output layer, default 18 as OpusLM uses).

Kept: `frontend.*`, `preencoder.*`, `encoder.*` up to the output layer; old-style weight norm
(`weight_g`/`weight_v`) becomes torch's parametrization names. Dropped (reported): everything
else at the top level (HuBERT targets, losses, `final_proj`, masking embeddings) and blocks past
the output layer. Anything else under the kept prefixes, a missing tensor or a wrong shape is
refused by name.

The k-means model is ESPnet's joblib-pickled scikit-learn `MiniBatchKMeans` (its
`cluster_centers_` are the centroids; assignment is the nearest centroid, as `predict` does), or
a `.npy` array of centroids. Reading the joblib file needs `joblib` and `scikit-learn`
(`pip install -e '.[convert]'`).
"""

from __future__ import annotations

import dataclasses
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine.codec.config import CONFIG_NAME, WEIGHTS_NAME, save_config
from engine.codec.ssl import SSL_SUBDIR
from engine.codec.xeus import XeusConfig, XeusTokenizer
from engine.convert.errors import ConversionError
from engine.convert.readers import load_state, read_yaml
from engine.convert.stream_write import PageDropper, write_safetensors
from engine.vocab import SSL_SIZE

RELEASE_CHECKPOINT = "model/xeus_checkpoint_new.pth"
RELEASE_KMEANS = "model/km_opus_lm.mdl"
RELEASE_CONFIG = "model/config.yaml"

_KEPT = ("frontend.", "preencoder.", "encoder.")
_BLOCK = re.compile(r"^encoder\.encoders\.(\d+)\.")
_POS_V = "encoder.embed.0.conv.parametrizations.weight.original1"
_WAV2VEC2_STRIDES: dict[tuple[int, ...], tuple[int, ...]] = {(10, 3, 3, 3, 3, 2, 2): (5, 2, 2, 2, 2, 2, 2)}


@dataclasses.dataclass
class XeusReport:
    out_dir: Path
    config: XeusConfig
    num_tensors: int
    bytes_written: int
    dropped: list[str]
    notes: list[str]


def convert_xeus(
    src: Path,
    out_model_dir: Path,
    *,
    checkpoint: Path | None = None,
    kmeans: Path | None = None,
    config_yaml: Path | None = None,
    output_layer: int = 18,
    left_context_frames: int = XeusConfig.left_context_frames,
    right_context_frames: int = XeusConfig.right_context_frames,
) -> XeusReport:
    """Write `out_model_dir/ssl/` from an `espnet/xeus` snapshot dir `src` (or explicit files)."""
    src = Path(src)
    ckpt, km = xeus_inputs(src, checkpoint, kmeans)
    yaml_path = Path(config_yaml) if config_yaml else (src / RELEASE_CONFIG if (src / RELEASE_CONFIG).is_file() else None)
    espnet_conf = read_yaml(yaml_path) if yaml_path else {}

    state = load_state(ckpt)
    notes: list[str] = []
    cfg = infer_config(
        state, espnet_conf, output_layer, left_context_frames, right_context_frames, str(ckpt), notes
    )
    sources, dropped = plan_tensors(state, cfg, str(ckpt))
    centroids = load_centroids(km, cfg.output_size)

    shapes = expected_shapes(cfg)
    out_model_dir = Path(out_model_dir)
    out_model_dir.mkdir(parents=True, exist_ok=True)
    final = out_model_dir / SSL_SUBDIR
    tmp = out_model_dir / (SSL_SUBDIR + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    names = sorted(sources)
    items = [(n, _getter(state, sources[n])) for n in names]
    items.append(("centroids", lambda: centroids))
    # fp32 always: the tokenizer runs in fp32 and a bf16 copy of the centroids would flip near-ties
    nbytes = write_safetensors(tmp / WEIGHTS_NAME, items, shapes, torch.float32, PageDropper(ckpt))
    save_config(cfg, tmp / CONFIG_NAME)
    del state
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)
    notes.append(f"k-means: {centroids.shape[0]} centroids of {centroids.shape[1]} from {km}")
    return XeusReport(final, cfg, len(items), nbytes, dropped, notes)


def xeus_inputs(src: Path, checkpoint: Path | None = None, kmeans: Path | None = None) -> tuple[Path, Path]:
    """The XEUS checkpoint and k-means files (explicit, else the espnet/xeus layout under `src`);
    refused when either is missing."""
    ckpt = Path(checkpoint) if checkpoint else Path(src) / RELEASE_CHECKPOINT
    km = Path(kmeans) if kmeans else Path(src) / RELEASE_KMEANS
    for path, what in ((ckpt, "XEUS checkpoint"), (km, "k-means model")):
        if not path.is_file():
            raise ConversionError(f"{what} {path} not found (expected the espnet/xeus layout or an explicit path)")
    return ckpt, km


def expected_shapes(cfg: XeusConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of our module, by name: built on the meta device, so the 574 M-parameter
    release costs no memory here."""
    with torch.device("meta"):
        module = XeusTokenizer(cfg)
    return {name: tuple(t.shape) for name, t in module.state_dict().items()}


def _getter(state: dict[str, torch.Tensor], key: str):
    return lambda: state[key]


def infer_config(
    state: dict[str, torch.Tensor],
    espnet_conf: dict[str, Any],
    output_layer: int,
    left: int,
    right: int,
    source: str,
    notes: list[str],
) -> XeusConfig:
    """XeusConfig from tensor shapes (+ the ESPnet config for the head count)."""

    def need(key: str) -> torch.Tensor:
        if key not in state:
            raise ConversionError(f"{source}: missing tensor {key!r}: not an XEUS / E-Branchformer SSL checkpoint")
        return state[key]

    kernels, channels = [], set()
    i = 0
    while f"frontend.layers.{i}.conv.weight" in state:
        w = state[f"frontend.layers.{i}.conv.weight"]
        kernels.append(int(w.shape[-1]))
        channels.add(int(w.shape[0]))
        i += 1
    if not kernels:
        need("frontend.layers.0.conv.weight")
    if len(channels) != 1:
        raise ConversionError(f"{source}: CNN frontend layers have different widths {sorted(channels)}")
    strides = _WAV2VEC2_STRIDES.get(tuple(kernels))
    if strides is None:
        raise ConversionError(f"{source}: CNN kernels {kernels} are not wav2vec2's; cannot tell the strides")
    if "frontend.layers.0.conv.bias" not in state:
        raise ConversionError(f"{source}: CNN convs without bias are not supported")
    blocks = sorted({int(m.group(1)) for k in state if (m := _BLOCK.match(k))})
    if not blocks or blocks != list(range(len(blocks))):
        raise ConversionError(f"{source}: encoder blocks {blocks[:4]}… are not numbered 0..N-1")
    enc_conf = espnet_conf.get("encoder_conf") or {}
    if espnet_conf and espnet_conf.get("encoder") not in (None, "e_branchformer"):
        raise ConversionError(f"{source}: encoder is {espnet_conf.get('encoder')!r}, only e_branchformer is supported")
    heads = int(enc_conf.get("attention_heads", 8))
    if "attention_heads" not in enc_conf:
        notes.append("attention heads: 8 (XEUS's; no encoder_conf.attention_heads in a config.yaml)")
    pos_v = next((state[k] for k in state if map_key(k, None) == _POS_V), None)
    if pos_v is None:
        pos_v = need("encoder.embed.0.conv.weight_v")  # raises: that key would have been found
    front_conf = espnet_conf.get("frontend_conf") or {}
    normalize_audio = bool(front_conf.get("normalize_audio", True))
    if "normalize_audio" not in front_conf:
        notes.append("normalize_audio: assumed true (no frontend_conf.normalize_audio in a config.yaml)")
    if any(k.startswith("frontend.final_norm.") for k in state):
        raise ConversionError(f"{source}: a CNN frontend with normalize_output (final_norm) is not supported")
    size = int(need("preencoder.linear_out.weight").shape[0])
    b0 = "encoder.encoders.0."
    try:
        cfg = XeusConfig(
            cnn_channels=channels.pop(),
            cnn_kernels=tuple(kernels),
            cnn_strides=strides,
            output_size=size,
            attention_heads=heads,
            linear_units=int(need(b0 + "feed_forward.w_1.weight").shape[0]),
            cgmlp_linear_units=int(need(b0 + "cgmlp.channel_proj1.0.weight").shape[0]),
            cgmlp_conv_kernel=int(need(b0 + "cgmlp.csgu.conv.weight").shape[-1]),
            merge_conv_kernel=int(need(b0 + "depthwise_conv_fusion.weight").shape[-1]),
            num_blocks=len(blocks),
            pos_conv_kernel=int(pos_v.shape[-1]),
            pos_conv_groups=size // int(pos_v.shape[1]),
            after_norm="encoder.after_norm.weight" in state,
            normalize_audio=normalize_audio,
            output_layer=output_layer,
            num_clusters=SSL_SIZE,
            left_context_frames=left,
            right_context_frames=right,
        )
    except ValueError as e:
        raise ConversionError(f"{source}: {e}") from None
    return cfg


def map_key(name: str, cfg: XeusConfig | None) -> str | None:
    """ESPnet key -> ours; None when dropped (with `cfg` None, nothing is dropped by depth)."""
    if not name.startswith(_KEPT):
        return None
    m = _BLOCK.match(name)
    if cfg is not None and m and int(m.group(1)) > cfg.output_layer:
        return None
    if cfg is not None and name.startswith("encoder.after_norm.") and cfg.output_layer != cfg.num_blocks - 1:
        return None
    # newer ESPnet keeps the positional conv in a ModuleList (`convs.0`), older ones as `conv`
    name = name.replace("encoder.embed.0.convs.0.", "encoder.embed.0.conv.")
    if name.endswith(".weight_g"):
        return name[: -len("weight_g")] + "parametrizations.weight.original0"
    if name.endswith(".weight_v"):
        return name[: -len("weight_v")] + "parametrizations.weight.original1"
    return name


def plan_tensors(state: dict[str, torch.Tensor], cfg: XeusConfig, source: str) -> tuple[dict[str, str], list[str]]:
    """{our name: checkpoint key} covering our module exactly, and the dropped keys."""
    want = {n: shape for n, shape in expected_shapes(cfg).items() if n != "centroids"}
    sources: dict[str, str] = {}
    dropped: list[str] = []
    for key, tensor in state.items():
        ours = map_key(key, cfg)
        if ours is None:
            dropped.append(key)
            continue
        if ours not in want:
            raise ConversionError(f"{source}: unexpected tensor {key!r} (not part of the XEUS encoder we implement)")
        if tuple(tensor.shape) != want[ours]:
            raise ConversionError(f"{source}: tensor {key!r} has shape {list(tensor.shape)}, expected {list(want[ours])}")
        sources[ours] = key
    missing = sorted(set(want) - set(sources))
    if missing:
        raise ConversionError(f"{source}: missing tensor {missing[0]!r} ({len(missing)} missing)")
    return sources, dropped


def load_centroids(path: Path, dim: int) -> torch.Tensor:
    """[5000, dim] float32 centroids from a joblib-pickled sklearn k-means or a .npy array."""
    path = Path(path)
    if path.suffix == ".npy":
        try:
            arr = np.load(path, allow_pickle=False)
        except (OSError, ValueError) as e:
            raise ConversionError(f"{path}: not a .npy array ({e})") from None
    else:
        try:
            import joblib
        except ImportError:
            raise ConversionError(
                f"{path}: reading ESPnet's k-means model needs joblib and scikit-learn "
                "(pip install -e '.[convert]'), or pass the centroids as a .npy file"
            ) from None
        try:
            km = joblib.load(path)
        except ModuleNotFoundError as e:
            raise ConversionError(f"{path}: unpickling needs {e.name!r} (pip install -e '.[convert]')") from None
        except Exception as e:  # not a joblib/pickle file
            raise ConversionError(f"{path}: cannot load the k-means model ({type(e).__name__}: {e})") from None
        arr = getattr(km, "cluster_centers_", None)
        if arr is None:
            raise ConversionError(f"{path}: {type(km).__name__} has no cluster_centers_ (not a k-means model)")
    arr = np.asarray(arr)
    if arr.ndim != 2 or arr.shape != (SSL_SIZE, dim):
        raise ConversionError(f"{path}: centroids have shape {list(arr.shape)}, expected [{SSL_SIZE}, {dim}]")
    return torch.from_numpy(arr.astype(np.float32))
