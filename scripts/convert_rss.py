"""Peak memory of `duplex convert espnet` on a synthetic ~2 GB ESPnet-layout checkpoint.

Builds (in a temp dir) an fp32 ESPnet OpusLM checkpoint with the dialogue model's vocabulary
(62,670 ids) and hidden size (2048) but only a few layers, converts it to bf16 in a child
process (the CLI, exactly as a user runs it), and prints the child's peak RSS next to the
checkpoint size. With --xeus: the same for `duplex convert xeus` on a random XEUS of the released
size (574 M parameters, 2.1 GiB fp32, ESPnet's names). Not a test: nothing is asserted.

    python scripts/convert_rss.py [--layers 4] [--xeus] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml

from engine import vocab

TEXT_SIZE = 49152  # SmolLM's tokenizer
EXTRA_IDS = 70  # the released vocabularies' ids above the text range
HIDDEN, HEADS, FFN = 2048, 32, 8192


def build(exp: Path, layers: int) -> int:
    exp.mkdir(parents=True)
    (exp / "backbone").mkdir()
    backbone = {
        "model_type": "llama", "hidden_size": HIDDEN, "intermediate_size": FFN,
        "num_hidden_layers": layers, "num_attention_heads": HEADS, "num_key_value_heads": HEADS,
        "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 130000.0,
        "hidden_act": "silu", "vocab_size": TEXT_SIZE, "tie_word_embeddings": True,
    }
    (exp / "backbone" / "config.json").write_text(json.dumps(backbone))
    v = vocab.TEXT_OFFSET + TEXT_SIZE + EXTRA_IDS
    names = {0: "<pad>", 1: "<unk>", 5: "<sos/eos>", 8: "<system_prompt>", 9: "<user_input>",
             10: "<assistant_output>", 11: "<eou>", 34: "<codec_ssl_start/end>",
             35: "<text_bpe_start/end>", 37: "<spk_start/end>", 64: "<textlm_task>",
             80: "<codec_ssl_asr_task>", 81: "<codec_ssl_tts_task>", 82: "<codec_ssl_plain_tts_task>",
             83: "<codec_ssl_audiolm_task>", 88: "<text_dialogue_task>", 89: "<audio_dialogue_task>"}
    conf = {
        "token_list": [names.get(i, f"<unused_token_{i}>") for i in range(256)] + [f"<t{i}>" for i in range(256, v)],
        "token_bias": {"ssl": [256, 5256], "codec": [5256, 13448], "text_bpe": [13448, 13448 + TEXT_SIZE]},
        "codec_token_per_frame": 9,
        "transformer_conf": {"hf_model_tag": "backbone", "n_ctx": 8192},
    }
    (exp / "config.yaml").write_text(yaml.safe_dump(conf))
    sd = {"corelm.emb.weight": torch.randn(v, HIDDEN), "corelm.lm_head.weight": torch.randn(v, HIDDEN),
          "corelm.head_emb.weight": torch.randn(12, HIDDEN), "criterion.dummy": torch.zeros(1)}
    for i in range(layers):
        p = f"corelm.decoders.model.layers.{i}."
        for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
            sd[p + f"self_attn.{n}.weight"] = torch.randn(HIDDEN, HIDDEN)
        sd[p + "mlp.gate_proj.weight"] = torch.randn(FFN, HIDDEN)
        sd[p + "mlp.up_proj.weight"] = torch.randn(FFN, HIDDEN)
        sd[p + "mlp.down_proj.weight"] = torch.randn(HIDDEN, FFN)
        sd[p + "input_layernorm.weight"] = torch.ones(HIDDEN)
        sd[p + "post_attention_layernorm.weight"] = torch.ones(HIDDEN)
    sd["corelm.decoders.model.norm.weight"] = torch.ones(HIDDEN)
    torch.save(sd, exp / "model.pth")
    return (exp / "model.pth").stat().st_size


def build_xeus(src: Path) -> int:
    """An espnet/xeus-like snapshot with random weights of the release's shapes."""
    import numpy as np

    from engine.codec.xeus import XeusConfig
    from engine.convert.xeus import RELEASE_CHECKPOINT, RELEASE_CONFIG, RELEASE_KMEANS, expected_shapes

    (src / "model").mkdir(parents=True)
    gen = torch.Generator().manual_seed(0)
    sd = {}
    for name, shape in expected_shapes(XeusConfig()).items():
        if name != "centroids":
            name = name.replace("parametrizations.weight.original0", "weight_g")
            sd[name.replace("parametrizations.weight.original1", "weight_v")] = 0.02 * torch.randn(shape, generator=gen)
    sd["final_proj.weight"] = 0.02 * torch.randn(768, 1024, generator=gen)  # training-only: dropped
    torch.save(sd, src / RELEASE_CHECKPOINT)
    del sd
    np.save(src / "km.npy", np.random.default_rng(0).standard_normal((vocab.SSL_SIZE, 1024)).astype(np.float32))
    (src / RELEASE_KMEANS).write_bytes(b"")  # present for the layout; --kmeans km.npy is used
    (src / RELEASE_CONFIG).write_text(yaml.safe_dump({"encoder": "e_branchformer", "encoder_conf": {"attention_heads": 8}}))
    return (src / RELEASE_CHECKPOINT).stat().st_size


def run_child(argv: list[str]) -> tuple[list[str], int]:
    """The CLI in a child process: its output lines and its own peak RSS (KiB).

    The child reports its own VmHWM: getrusage's maxrss would include this (large) parent's
    pages, which a vfork-ed child carries until exec."""
    child = (
        "import sys; from engine.cli import main; rc = main(sys.argv[1:]); "
        "hwm = [l for l in open('/proc/self/status') if l.startswith('VmHWM')][0]; "
        "print('VMHWM_KIB', hwm.split()[1]); sys.exit(rc)"
    )
    res = subprocess.run([sys.executable, "-c", child, *argv], check=True, capture_output=True, text=True)
    lines = res.stdout.splitlines()
    peak_kib = int(next(line.split()[1] for line in lines if line.startswith("VMHWM_KIB")))
    return [line for line in lines if not line.startswith("VMHWM_KIB")], peak_kib


def main_xeus(root: Path) -> None:
    t0 = time.monotonic()
    size = build_xeus(root / "xeus")
    print(f"built {size / 2**30:.2f} GiB fp32 XEUS checkpoint in {time.monotonic() - t0:.1f} s")
    t0 = time.monotonic()
    lines, peak_kib = run_child(["convert", "xeus", str(root / "xeus"), str(root / "out"), "--kmeans", str(root / "xeus" / "km.npy")])
    print("\n".join(lines))
    print(f"converted in {time.monotonic() - t0:.1f} s")
    print(f"converter peak RSS: {peak_kib / 2**20:.2f} GiB ({peak_kib / 1024:.0f} MiB) "
          f"for a {size / 2**30:.2f} GiB checkpoint")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4, help="4 layers: ~2.1 GB fp32")
    ap.add_argument("--keep", type=Path, help="build here instead of a temp dir (kept)")
    ap.add_argument("--xeus", action="store_true", help="measure `duplex convert xeus` on a release-sized XEUS instead")
    args = ap.parse_args()
    root = args.keep or Path(tempfile.mkdtemp(prefix="convert-rss-"))
    try:
        if args.xeus:
            main_xeus(root)
            return 0
        t0 = time.monotonic()
        size = build(root / "exp", args.layers)
        print(f"built {size / 2**30:.2f} GiB fp32 ESPnet checkpoint in {time.monotonic() - t0:.1f} s")
        t0 = time.monotonic()
        lines, peak_kib = run_child(["convert", "espnet", str(root / "exp"), str(root / "out"), "--dtype", "bf16"])
        print("\n".join(lines))
        out = (root / "out" / "model.safetensors").stat().st_size
        print(f"converted to {out / 2**30:.2f} GiB bf16 in {time.monotonic() - t0:.1f} s")
        print(f"converter peak RSS: {peak_kib / 2**20:.2f} GiB ({peak_kib / 1024:.0f} MiB) "
              f"for a {size / 2**30:.2f} GiB checkpoint")
    finally:
        if args.keep is None:
            import shutil

            shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
