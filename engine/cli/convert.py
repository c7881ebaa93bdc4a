"""`duplex convert espnet SRC_DIR OUT_DIR [--dtype bf16|fp32] [--backbone-config PATH] [--codec DIR]`:
convert an ESPnet OpusLM checkpoint into our format (engine/convert/espnet.py)."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from engine.cli import CliError


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
    e.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from engine.convert import ConversionError, convert_espnet
    from engine.convert.espnet import human_bytes

    t0 = time.monotonic()
    try:
        report = convert_espnet(
            args.src_dir, args.out_dir, dtype=args.dtype, backbone_config=args.backbone_config, codec_dir=args.codec
        )
    except ConversionError as e:
        raise CliError(str(e)) from None
    print(
        f"converted {args.src_dir} -> {report.out_dir}: {report.backbone} backbone "
        f"(config {report.backbone_source}), {report.num_tensors} tensors, {report.dtype}, "
        f"{human_bytes(report.bytes_written)} in {time.monotonic() - t0:.1f} s"
    )
    if report.dropped:
        shown = ", ".join(report.dropped[:4]) + (" …" if len(report.dropped) > 4 else "")
        print(f"dropped {len(report.dropped)}: {shown}")
    for note in report.notes:
        print(f"  {note}")
    return 0
