"""XEUS (stream-0 tokenizer of the real models): ESPnet layout -> `duplex convert xeus` -> tokens.

The checkpoint is written here in ESPnet's parameter names, from the published module structure
(`espnet2/asr/frontend/cnn.py` wav2vec2 CNN with a LayerNorm per block, `preencoder.linear_out`,
`espnet2/asr/encoder/e_branchformer_encoder.py` with `input_layer: wav2vec` — a weight-normed
positional conv kept as `embed.0.convs.0` with legacy `weight_g`/`weight_v` — and its
`after_norm`), plus training-only tensors the converter must drop. The k-means model is a real
scikit-learn `MiniBatchKMeans` pickled with joblib, as ESPnet's recipes write it.

`espnet_features` is the independent oracle: ESPnet's forward written out with torch functionals
from the state dict (no module of ours), and `KMeans.predict` assigns the clusters.
"""

from __future__ import annotations

import dataclasses
import math
import shutil
from pathlib import Path

import joblib
import numpy as np
import pytest
import torch
import torch.nn.functional as F
import yaml
from sklearn.cluster import MiniBatchKMeans

from engine import vocab
from engine.cli import main as cli_main
from engine.codec.dac import DAC
from engine.codec.ssl import load_ssl
from engine.codec.synth import speech_like
from engine.codec.tiny import make_tiny_codec
from engine.codec.tokenizer import AudioTokenizer
from engine.codec.xeus import XeusTokenizer
from engine.convert import ConversionError
from engine.convert.xeus import convert_xeus

C, D, HEADS, FFN, CGMLP, CG_K, MERGE_K, BLOCKS, POS_K, POS_G = 8, 16, 2, 32, 32, 5, 3, 3, 8, 2
KERNELS, STRIDES = (10, 3, 3, 3, 3, 2, 2), (5, 2, 2, 2, 2, 2, 2)


def espnet_state(seed: int = 0) -> dict[str, torch.Tensor]:
    """Random XEUS-shaped weights under ESPnet's names (LayerNorm gains near 1)."""
    gen = torch.Generator().manual_seed(seed)
    shapes: dict[str, tuple[int, ...]] = {}
    cin = 1
    for i, k in enumerate(KERNELS):
        shapes[f"frontend.layers.{i}.conv.weight"] = (C, cin, k)
        shapes[f"frontend.layers.{i}.conv.bias"] = (C,)
        shapes[f"frontend.layers.{i}.layer_norm.weight"] = (C,)
        shapes[f"frontend.layers.{i}.layer_norm.bias"] = (C,)
        cin = C
    shapes["preencoder.linear_out.weight"] = (D, C)
    shapes["preencoder.linear_out.bias"] = (D,)
    shapes["encoder.embed.0.convs.0.weight_g"] = (1, 1, POS_K)
    shapes["encoder.embed.0.convs.0.weight_v"] = (D, D // POS_G, POS_K)
    shapes["encoder.embed.0.convs.0.bias"] = (D,)
    for n in range(BLOCKS):
        b = f"encoder.encoders.{n}."
        for lin in ("q", "k", "v", "out"):
            shapes[b + f"attn.linear_{lin}.weight"] = (D, D)
            shapes[b + f"attn.linear_{lin}.bias"] = (D,)
        shapes[b + "cgmlp.channel_proj1.0.weight"] = (CGMLP, D)
        shapes[b + "cgmlp.channel_proj1.0.bias"] = (CGMLP,)
        shapes[b + "cgmlp.csgu.norm.weight"] = (CGMLP // 2,)
        shapes[b + "cgmlp.csgu.norm.bias"] = (CGMLP // 2,)
        shapes[b + "cgmlp.csgu.conv.weight"] = (CGMLP // 2, 1, CG_K)
        shapes[b + "cgmlp.csgu.conv.bias"] = (CGMLP // 2,)
        shapes[b + "cgmlp.channel_proj2.weight"] = (D, CGMLP // 2)
        shapes[b + "cgmlp.channel_proj2.bias"] = (D,)
        for ff in ("feed_forward", "feed_forward_macaron"):
            shapes[b + f"{ff}.w_1.weight"] = (FFN, D)
            shapes[b + f"{ff}.w_1.bias"] = (FFN,)
            shapes[b + f"{ff}.w_2.weight"] = (D, FFN)
            shapes[b + f"{ff}.w_2.bias"] = (D,)
        for norm in ("norm_ff", "norm_ff_macaron", "norm_mha", "norm_mlp", "norm_final"):
            shapes[b + f"{norm}.weight"] = (D,)
            shapes[b + f"{norm}.bias"] = (D,)
        shapes[b + "depthwise_conv_fusion.weight"] = (2 * D, 1, MERGE_K)
        shapes[b + "depthwise_conv_fusion.bias"] = (2 * D,)
        shapes[b + "merge_proj.weight"] = (D, 2 * D)
        shapes[b + "merge_proj.bias"] = (D,)
    shapes["encoder.after_norm.weight"] = (D,)
    shapes["encoder.after_norm.bias"] = (D,)
    # training-only: HuBERT projection and targets, masking embedding
    shapes["final_proj.weight"] = (12, D)
    shapes["losses.0.decoder.label_embeddings"] = (100, 12)
    shapes["masker.mask_embedding"] = (C,)
    state = {}
    for name, shape in shapes.items():
        fan_in = math.prod(shape[1:]) if len(shape) > 1 else 1
        t = torch.randn(shape, generator=gen) / math.sqrt(max(fan_in, 1))
        if len(shape) == 1 and ("norm" in name) and name.endswith("weight"):
            t = 1.0 + 0.1 * torch.randn(shape, generator=gen)
        elif len(shape) == 1:
            t = 0.1 * torch.randn(shape, generator=gen)
        state[name] = t
    return state


def espnet_features(state: dict[str, torch.Tensor], wav: np.ndarray, layer: int) -> torch.Tensor:
    """ESPnet's `encode(wav, use_final_output=True)[0][layer]` for one utterance: [T, D]."""
    s = state
    x = torch.from_numpy(wav).float()[None]
    x = F.layer_norm(x, x.shape)  # CNNFrontend normalize_audio
    x = x[:, None]
    for i, stride in enumerate(STRIDES):
        p = f"frontend.layers.{i}."
        x = F.conv1d(x, s[p + "conv.weight"], s[p + "conv.bias"], stride=stride)
        x = F.layer_norm(x.transpose(1, 2), (C,), s[p + "layer_norm.weight"], s[p + "layer_norm.bias"]).transpose(1, 2)
        x = F.gelu(x)
    x = x.transpose(1, 2) @ s["preencoder.linear_out.weight"].t() + s["preencoder.linear_out.bias"]
    v, g = s["encoder.embed.0.convs.0.weight_v"], s["encoder.embed.0.convs.0.weight_g"]
    w = v * g / v.norm(dim=(0, 1), keepdim=True)  # weight_norm(dim=2)
    y = F.conv1d(x.transpose(1, 2), w, s["encoder.embed.0.convs.0.bias"], padding=POS_K // 2, groups=POS_G)
    x = F.gelu(y[..., :-1]).transpose(1, 2)  # even kernel: the extra last frame is removed

    def ln(t, name):
        return F.layer_norm(t, (t.shape[-1],), s[name + ".weight"], s[name + ".bias"], eps=1e-12)

    def lin(t, name):
        return t @ s[name + ".weight"].t() + s[name + ".bias"]

    outs = []
    for n in range(BLOCKS):
        b = f"encoder.encoders.{n}."
        h = ln(x, b + "norm_ff_macaron")
        x = x + 0.5 * lin(F.silu(lin(h, b + "feed_forward_macaron.w_1")), b + "feed_forward_macaron.w_2")
        h = ln(x, b + "norm_mha")
        t = h.shape[1]
        q, k, vv = (lin(h, b + f"attn.linear_{c}").view(1, t, HEADS, D // HEADS).transpose(1, 2) for c in "qkv")
        att = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(D // HEADS), dim=-1)
        x1 = lin((att @ vv).transpose(1, 2).reshape(1, t, D), b + "attn.linear_out")
        h = ln(x, b + "norm_mlp")
        h = F.gelu(lin(h, b + "cgmlp.channel_proj1.0"))
        h_r, h_g = h.chunk(2, dim=-1)
        h_g = ln(h_g, b + "cgmlp.csgu.norm")
        h_g = F.conv1d(
            h_g.transpose(1, 2), s[b + "cgmlp.csgu.conv.weight"], s[b + "cgmlp.csgu.conv.bias"],
            padding=(CG_K - 1) // 2, groups=CGMLP // 2,
        ).transpose(1, 2)
        x2 = lin(h_r * h_g, b + "cgmlp.channel_proj2")
        cat = torch.cat([x1, x2], dim=-1)
        fused = F.conv1d(
            cat.transpose(1, 2), s[b + "depthwise_conv_fusion.weight"], s[b + "depthwise_conv_fusion.bias"],
            padding=(MERGE_K - 1) // 2, groups=2 * D,
        ).transpose(1, 2)
        x = x + lin(cat + fused, b + "merge_proj")
        h = ln(x, b + "norm_ff")
        x = x + 0.5 * lin(F.silu(lin(h, b + "feed_forward.w_1")), b + "feed_forward.w_2")
        x = ln(x, b + "norm_final")
        outs.append(x)
    outs[-1] = ln(outs[-1], "encoder.after_norm")  # use_final_output=True
    return outs[layer][0]


def padded(feats: torch.Tensor, n_samples: int) -> torch.Tensor:
    """The unpadded CNN gives fewer frames than ceil(N/320); the last one repeats (ESPnet's
    `ensure_length`, mode replicate)."""
    want = -(-n_samples // vocab.HOP_SAMPLES)
    return torch.cat([feats, feats[-1:].expand(want - len(feats), -1)])[:want]


def assert_nearest(clusters: np.ndarray, feats: torch.Tensor, km: MiniBatchKMeans, tol: float = 1e-3) -> None:
    """Each cluster is the nearest centroid to the oracle's features, up to float rounding: a
    near-tie may flip (the fixture's k-means is dense), a different feature vector may not."""
    cent = torch.from_numpy(km.cluster_centers_).double()
    dist = torch.cdist(feats.double(), cent) ** 2  # [T, 5000]
    chosen = dist[torch.arange(len(clusters)), torch.from_numpy(clusters.astype(np.int64))]
    worst = (chosen - dist.min(dim=1).values).max().item()
    assert worst <= tol, f"a cluster is {worst:.4f} farther than the nearest centroid"
    assert (clusters == km.predict(feats.numpy())).mean() >= 0.9


def stream(tok: AudioTokenizer, pieces: list[np.ndarray]) -> np.ndarray:
    """Frames of one session fed piece by piece, tokenized as soon as each block is ready."""
    state = tok.new_state()
    for piece in pieces:
        tok.push(state, piece)
        while tok.ready(state):
            tok.step([state])
    tok.finish(state)
    while tok.ready(state):
        tok.step([state])
    return tok.take(state)


@pytest.fixture(scope="module")
def xeus_src(tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor], MiniBatchKMeans]:
    """An espnet/xeus-like snapshot: model/{xeus_checkpoint_new.pth, km_opus_lm.mdl, config.yaml}."""
    src = tmp_path_factory.mktemp("xeus_src")
    (src / "model").mkdir()
    state = espnet_state()
    torch.save(state, src / "model" / "xeus_checkpoint_new.pth")
    feats = espnet_features(state, speech_like(3.0, seed=5), BLOCKS - 1).numpy()
    rng = np.random.default_rng(0)
    data = np.concatenate([np.repeat(feats, 40, axis=0), rng.standard_normal((2000, D))]).astype(np.float32)
    km = MiniBatchKMeans(n_clusters=vocab.SSL_SIZE, init="random", n_init=1, max_iter=2, batch_size=2048, random_state=0)
    km.fit(data + 0.05 * rng.standard_normal(data.shape).astype(np.float32))
    joblib.dump(km, src / "model" / "km_opus_lm.mdl")
    conf = {
        "encoder": "e_branchformer",
        "encoder_conf": {"output_size": D, "attention_heads": HEADS, "num_blocks": BLOCKS},
        "frontend": "wav2vec_cnn",
        "frontend_conf": {"normalize_audio": True},
    }
    (src / "model" / "config.yaml").write_text(yaml.safe_dump(conf))
    return src, state, km


@pytest.fixture(scope="module")
def xeus_model(xeus_src, tmp_path_factory) -> Path:
    """A model dir with the tiny DAC and the converted XEUS as its stream-0 tokenizer."""
    src, _, _ = xeus_src
    out = tmp_path_factory.mktemp("xeus_model")
    make_tiny_codec(out, seed=0)
    assert cli_main(["convert", "xeus", str(src), str(out), "--layer", str(BLOCKS - 1)]) == 0
    return out


def test_converted_features_and_clusters_equal_espnet(xeus_src, xeus_model) -> None:
    _, state, km = xeus_src
    ssl = load_ssl(xeus_model)
    assert isinstance(ssl, XeusTokenizer)
    assert (ssl.cfg.num_blocks, ssl.cfg.attention_heads, ssl.cfg.after_norm) == (BLOCKS, HEADS, True)
    wav = speech_like(2.0, seed=9)
    want = padded(espnet_features(state, wav, BLOCKS - 1), len(wav))
    got = ssl.features(torch.from_numpy(wav)[None, None])[0].t()
    torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)
    clusters = ssl.tokenize(torch.from_numpy(wav)[None, None])[0].numpy()
    assert_nearest(clusters, want, km)
    assert len(np.unique(clusters)) > 5  # the test audio is not one cluster


def test_earlier_layer_drops_later_blocks(xeus_src, tmp_path, capsys) -> None:
    src, state, _ = xeus_src
    make_tiny_codec(tmp_path, seed=0)
    assert cli_main(["convert", "xeus", str(src), str(tmp_path), "--layer", "1"]) == 0
    out = capsys.readouterr().out
    past = [k for k in state if k.startswith(("encoder.encoders.2.", "encoder.after_norm."))]
    training = [k for k in state if not k.startswith(("frontend.", "preencoder.", "encoder."))]
    assert f"dropped {len(past) + len(training)}:" in out  # block 2, after_norm, training-only
    ssl = load_ssl(tmp_path)
    assert len(ssl.encoder.encoders) == 2 and ssl.encoder.after_norm is None
    wav = speech_like(1.0, seed=3)
    want = padded(espnet_features(state, wav, 1), len(wav))  # block 2's output, no after_norm
    got = ssl.features(torch.from_numpy(wav)[None, None])[0].t()
    torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)


def test_streaming_window_covering_the_turn_equals_offline_espnet(xeus_src, xeus_model) -> None:
    """With context reaching over the whole turn, streamed stream-0 tokens are ESPnet's offline ones."""
    _, state, km = xeus_src
    ssl = load_ssl(xeus_model)
    wide = XeusTokenizer(dataclasses.replace(ssl.cfg, left_context_frames=200, right_context_frames=200))
    wide.load_state_dict(ssl.state_dict())
    tok = AudioTokenizer(DAC.from_dir(xeus_model), wide.eval())
    wav = speech_like(1.5, seed=4)
    frames = stream(tok, np.array_split(wav, 7))
    ref = padded(espnet_features(state, wav, BLOCKS - 1), len(wav))
    assert len(frames) == len(ref)
    assert_nearest(frames[:, 0] - vocab.SSL_OFFSET, ref, km)


def test_streaming_is_independent_of_how_audio_arrives(xeus_model) -> None:
    ssl = load_ssl(xeus_model)
    assert ssl.context_frames(vocab.HOP_SAMPLES, "cpu") == (100, 10)
    tok = AudioTokenizer(DAC.from_dir(xeus_model), ssl)
    wav = speech_like(3.0, seed=6)
    whole = tok.tokenize(wav)
    rng = np.random.default_rng(1)
    cuts = np.sort(rng.choice(len(wav), 11, replace=False))
    np.testing.assert_array_equal(stream(tok, np.split(wav, cuts)), whole)
    assert len(whole) == -(-len(wav) // vocab.HOP_SAMPLES)


def test_duplex_encode_uses_xeus(xeus_model, tmp_path) -> None:
    from engine.codec.wavio import write_wav

    wav = speech_like(1.0, seed=8)
    write_wav(tmp_path / "in.wav", (wav * 32767).astype(np.int16), vocab.SAMPLE_RATE_HZ)
    assert cli_main(["encode", "--model", str(xeus_model), "--wav", str(tmp_path / "in.wav"), "--out", str(tmp_path / "f.npy")]) == 0
    frames = np.load(tmp_path / "f.npy")
    assert frames.shape == (50, vocab.NUM_STREAMS)
    assert ((frames[:, 0] >= vocab.SSL_OFFSET) & (frames[:, 0] < vocab.SSL_OFFSET + vocab.SSL_SIZE)).all()


def _copy_src(src: Path, dst: Path, state: dict[str, torch.Tensor] | None = None) -> Path:
    (dst / "model").mkdir(parents=True)
    for name in ("km_opus_lm.mdl", "config.yaml"):
        (dst / "model" / name).write_bytes((src / "model" / name).read_bytes())
    torch.save(state if state is not None else torch.load(src / "model" / "xeus_checkpoint_new.pth"), dst / "model" / "xeus_checkpoint_new.pth")
    return dst


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda s: s.pop("encoder.encoders.1.attn.linear_q.weight"), "missing tensor 'encoder.encoders.1.attn.linear_q.weight'"),
        (lambda s: s.__setitem__("encoder.encoders.0.merge_proj.weight", torch.zeros(D, D)), "has shape [16, 16], expected [16, 32]"),
        (lambda s: s.__setitem__("encoder.encoders.0.attn.pos_bias_u", torch.zeros(D)), "unexpected tensor 'encoder.encoders.0.attn.pos_bias_u'"),
        (lambda s: s.pop("preencoder.linear_out.weight"), "missing tensor 'preencoder.linear_out.weight'"),
    ],
)
def test_refuses_what_it_does_not_implement(xeus_src, tmp_path, edit, message) -> None:
    src, state, _ = xeus_src
    bad = dict(state)
    edit(bad)
    with pytest.raises(ConversionError) as e:
        convert_xeus(_copy_src(src, tmp_path / "src", bad), tmp_path / "out", output_layer=BLOCKS - 1)
    assert message in str(e.value)
    assert not (tmp_path / "out" / "ssl").exists()


def test_cli_bad_inputs_exit_2_with_one_line(xeus_src, tmp_path, capsys) -> None:
    src, _, _ = xeus_src
    assert cli_main(["convert", "xeus", str(tmp_path / "nope"), str(tmp_path / "out")]) == 2
    assert "XEUS checkpoint" in capsys.readouterr().err
    np.save(tmp_path / "km.npy", np.zeros((100, D), np.float32))
    assert cli_main(["convert", "xeus", str(src), str(tmp_path / "out"), "--kmeans", str(tmp_path / "km.npy"), "--layer", "2"]) == 2
    err = capsys.readouterr().err
    assert "centroids have shape [100, 16], expected [5000, 16]" in err and "Traceback" not in err
    (tmp_path / "junk.mdl").write_bytes(b"not a pickle")
    assert cli_main(["convert", "xeus", str(src), str(tmp_path / "out"), "--kmeans", str(tmp_path / "junk.mdl"), "--layer", "2"]) == 2
    assert "cannot load the k-means model" in capsys.readouterr().err
    assert cli_main(["convert", "xeus", str(src), str(tmp_path / "out"), "--layer", "7"]) == 2
    assert "output_layer 7 is outside 0..2" in capsys.readouterr().err


def test_npy_centroids_and_a_training_checkpoint_accepted(xeus_src, tmp_path) -> None:
    """k-means as a .npy of centroids; weights inside an ESPnet training checkpoint's "model"."""
    src, state, km = xeus_src
    np.save(tmp_path / "km.npy", km.cluster_centers_)
    torch.save({"model": state, "optimizers": [{}], "reporter": {}}, tmp_path / "checkpoint.pth")
    report = convert_xeus(
        src, tmp_path / "m", checkpoint=tmp_path / "checkpoint.pth", kmeans=tmp_path / "km.npy", output_layer=BLOCKS - 1
    )
    ssl = XeusTokenizer.from_dir(report.out_dir)
    np.testing.assert_array_equal(ssl.centroids.numpy(), km.cluster_centers_.astype(np.float32))


def test_espnet_conversion_takes_xeus_along(xeus_src, tmp_path, espnet_layout, capsys) -> None:
    """`duplex convert espnet EXP OUT` converts EXP/xeus/ too: a real checkpoint dir then holds
    everything audio input needs."""
    src, _, _ = xeus_src
    exp = tmp_path / "exp"
    espnet_layout.write_espnet_checkpoint(exp, "llama", seed=5)
    shutil.copytree(src, exp / "xeus")
    out = tmp_path / "out"
    assert cli_main(["convert", "espnet", str(exp), str(out), "--xeus-layer", "2"]) == 0
    assert "ssl: XEUS from" in capsys.readouterr().out
    assert isinstance(load_ssl(out), XeusTokenizer)
    assert cli_main(["convert", "espnet", str(exp), str(tmp_path / "out2"), "--xeus", str(tmp_path / "none")]) == 2
    assert "--xeus" in capsys.readouterr().err and not (tmp_path / "out2").exists()
    (exp / "xeus" / "model" / "km_opus_lm.mdl").unlink()  # refused before the LM is written
    assert cli_main(["convert", "espnet", str(exp), str(tmp_path / "out3"), "--xeus-layer", "2"]) == 2
    assert "km_opus_lm.mdl not found" in capsys.readouterr().err and not (tmp_path / "out3").exists()
