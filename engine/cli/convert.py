"""`duplex convert espnet SRC_DIR OUT_DIR [--dtype bf16|fp32] [--backbone-config PATH] [--codec DIR] [--xeus DIR]`:
convert an ESPnet OpusLM checkpoint into our format (engine/convert/espnet.py).

`duplex convert xeus XEUS_DIR MODEL_DIR [--checkpoint PTH] [--kmeans MDL] [--layer N]`: write the
stream-0 tokenizer (XEUS + k-means) into a converted model directory (engine/convert/xeus.py)."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from engine.cli.common import CliError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("convert", help="convert checkpoints into the engine's format")
    csub = p.add_subparsers(dest="convert_command", required=True, metavar="SOURCE")
    e = csub.add_parser("espnet", help="an ESPnet OpusLM experiment dir (config.yaml + model.pth)")
    e.add_argument("src_dir", type=Path, help="holds config.yaml and model.pth (or one *epoch.pth)")
    e.add_argument("out_dir", type=Path, help="new (or empty) output directory")
    e.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16", help="output weights (default bf16)")
    e.add_argument(
        "--backbone-config",
        type=Path,
        help="the backbone's HF config.json (or its dir); default: transformer_conf.hf_model_tag "
        "as a local dir (relative to SRC_DIR) or from the local Hugging Face cache",
    )
    e.add_argument("--codec", type=Path, help="ESPnet codec dir (config.yaml + *.pth); default SRC_DIR/codec")
    e.add_argument(
        "--xeus",
        type=Path,
        help="the espnet/xeus snapshot dir (model/xeus_checkpoint_new.pth, model/km_opus_lm.mdl) for "
        "the stream-0 tokenizer; default SRC_DIR/xeus when present",
    )
    e.add_argument("--xeus-layer", type=int, default=18, help="XEUS output layer (default 18, as OpusLM)")
    e.set_defaults(func=run)

    x = csub.add_parser("xeus", help="ESPnet's XEUS SSL encoder + k-means -> MODEL_DIR/ssl/")
    x.add_argument("src_dir", type=Path, help="the espnet/xeus snapshot dir (model/xeus_checkpoint_new.pth, ...)")
    x.add_argument("model_dir", type=Path, help="a converted model dir; its ssl/ is (re)written")
    x.add_argument("--checkpoint", type=Path, help="XEUS weights (default SRC_DIR/model/xeus_checkpoint_new.pth)")
    x.add_argument("--kmeans", type=Path, help="k-means model, joblib or .npy (default SRC_DIR/model/km_opus_lm.mdl)")
    x.add_argument("--config", type=Path, help="XEUS config.yaml (default SRC_DIR/model/config.yaml when present)")
    x.add_argument("--layer", type=int, default=18, help="output layer index, as OpusLM's xeus_layer (default 18)")
    x.add_argument("--left-context-frames", type=int, default=100, help="streaming history per window (default 100 = 2 s)")
    x.add_argument("--right-context-frames", type=int, default=10, help="streaming lookahead (default 10 = 200 ms)")
    x.set_defaults(func=run_xeus)


def run(args: argparse.Namespace) -> int:
    from engine.convert import ConversionError, convert_espnet
    from engine.convert.espnet import human_bytes

    t0 = time.monotonic()
    try:
        report = convert_espnet(
            args.src_dir,
            args.out_dir,
            dtype=args.dtype,
            backbone_config=args.backbone_config,
            codec_dir=args.codec,
            xeus_dir=args.xeus,
            xeus_layer=args.xeus_layer,
        )
    except ConversionError as e:
        raise CliError(str(e)) from None
    print(
        f"converted {args.src_dir} -> {report.out_dir}: {report.backbone} backbone "
        f"(config {report.backbone_source}), {report.num_tensors} tensors, {report.dtype}, "
        f"{human_bytes(report.bytes_written)} in {time.monotonic() - t0:.1f} s"
    )
    _print_dropped_and_notes(report.dropped, report.notes)
    return 0


def run_xeus(args: argparse.Namespace) -> int:
    from engine.convert import ConversionError
    from engine.convert.espnet import human_bytes
    from engine.convert.xeus import convert_xeus

    t0 = time.monotonic()
    try:
        report = convert_xeus(
            args.src_dir,
            args.model_dir,
            checkpoint=args.checkpoint,
            kmeans=args.kmeans,
            config_yaml=args.config,
            output_layer=args.layer,
            left_context_frames=args.left_context_frames,
            right_context_frames=args.right_context_frames,
        )
    except ConversionError as e:
        raise CliError(str(e)) from None
    cfg = report.config
    print(
        f"converted XEUS {args.src_dir} -> {report.out_dir}: {cfg.num_blocks} blocks of {cfg.output_size}, "
        f"features from layer {cfg.output_layer}, {report.num_tensors} tensors, "
        f"{human_bytes(report.bytes_written)} in {time.monotonic() - t0:.1f} s"
    )
    _print_dropped_and_notes(report.dropped, report.notes)
    return 0


def _print_dropped_and_notes(dropped: list[str], notes: list[str]) -> None:
    if dropped:
        shown = ", ".join(dropped[:4]) + (" …" if len(dropped) > 4 else "")
        print(f"dropped {len(dropped)}: {shown}")
    for note in notes:
        print(f"  {note}")
