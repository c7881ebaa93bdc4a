"""`duplex encode`: a WAV -> audio frames [F, 9] of global ids (.npy), as the server tokenizes."""

from __future__ import annotations

import argparse
import pathlib
import sys

import numpy as np


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("encode", help="tokenize a WAV into audio frames (.npy, global ids)")
    p.add_argument("--model", required=True, type=pathlib.Path, help="model dir (has codec/, ssl/)")
    p.add_argument("--wav", required=True, type=pathlib.Path, help="16-bit PCM WAV, any rate")
    p.add_argument("--out", required=True, type=pathlib.Path, help="output .npy, [F, 9] int64")
    p.add_argument("--device", default="cpu")
    p.set_defaults(func=run)


def _fail(message: str) -> int:
    print(f"duplex encode: error: {message}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    from engine.codec.dac import DAC
    from engine.codec.ssl import load_ssl
    from engine.codec.tokenizer import AudioTokenizer
    from engine.codec.wavio import read_wav, resample

    if not args.wav.is_file():
        return _fail(f"WAV file {args.wav} does not exist")
    try:
        pcm, rate_hz = read_wav(args.wav)
        dac = DAC.from_dir(args.model, device=args.device)
        ssl = load_ssl(args.model, device=args.device)
    except ValueError as exc:
        return _fail(str(exc))
    frames = AudioTokenizer(dac, ssl).tokenize(resample(pcm, rate_hz))
    try:
        np.save(args.out, frames)
    except OSError as exc:
        return _fail(f"cannot write {args.out}: {exc}")
    return 0
