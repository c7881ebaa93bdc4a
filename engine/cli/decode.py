"""`duplex decode`: audio frames [F, 9] (or generate's [N, F, 9]) -> a 16 kHz WAV, streamed."""

from __future__ import annotations

import argparse
import pathlib
import sys

import numpy as np

from engine.vocab import NUM_STREAMS, in_stream_range



def register(subparsers: argparse._SubParsersAction) -> None:
    from engine.codec.streaming import StreamConfig

    d = StreamConfig()
    p = subparsers.add_parser("decode", help="decode audio frames (.npy, global ids) to a WAV")
    p.add_argument("--model", required=True, type=pathlib.Path, help="model dir (has codec/)")
    p.add_argument("--codes", required=True, type=pathlib.Path, help="[F, 9] or [N, F, 9] .npy")
    p.add_argument("--out", required=True, type=pathlib.Path, help="output WAV (16 kHz)")
    p.add_argument("--index", type=int, default=0, help="request index in an [N, F, 9] array")
    p.add_argument("--chunk-frames", type=int, default=d.chunk_frames)
    p.add_argument("--first-chunk-frames", type=int, default=d.first_chunk_frames)
    p.add_argument("--context", type=int, default=d.context_frames, help="left context frames")
    p.add_argument("--lookahead", type=int, default=d.lookahead_frames)
    p.add_argument("--device", default="cpu")
    p.set_defaults(func=run)


def _fail(message: str) -> int:
    print(f"duplex decode: error: {message}", file=sys.stderr)
    return 2


def load_frames(path: pathlib.Path, index: int) -> np.ndarray:
    """The [F, 9] frames of one request; ValueError with a readable reason otherwise."""
    if not path.is_file():
        raise ValueError(f"codes file {path} does not exist")
    try:
        codes = np.load(path, allow_pickle=False)
    except (ValueError, OSError) as exc:
        raise ValueError(f"{path} is not a .npy array ({exc})") from None
    if not np.issubdtype(codes.dtype, np.integer):
        raise ValueError(f"{path} holds {codes.dtype}, need integer token ids")
    if codes.ndim == 3:
        if not 0 <= index < codes.shape[0]:
            raise ValueError(f"--index {index} out of range for {codes.shape[0]} requests")
        codes = codes[index]
        # `duplex generate` pads requests that ended early with rows of -1 (FRAME_PAD)
        codes = codes[~(codes == -1).all(axis=-1)]
    if codes.ndim != 2 or codes.shape[1] != NUM_STREAMS:
        raise ValueError(f"{path} has shape {list(codes.shape)}, need [F, 9] or [N, F, 9]")
    bad = ~in_stream_range(codes)
    if bad.any():
        frame, stream = np.argwhere(bad)[0]
        raise ValueError(
            f"id {codes[frame, stream]} at frame {frame}, stream {stream} is outside the stream's range"
        )
    return codes.astype(np.int64)


def run(args: argparse.Namespace) -> int:
    from engine.codec.dac import DAC
    from engine.codec.streaming import StreamConfig, decode_streamed
    from engine.codec.wavio import write_wav
    from engine.vocab import global_to_dac

    try:
        frames = load_frames(args.codes, args.index)
        config = StreamConfig(
            first_chunk_frames=args.first_chunk_frames,
            chunk_frames=args.chunk_frames,
            context_frames=args.context,
            lookahead_frames=args.lookahead,
        )
        dac = DAC.from_dir(args.model, device=args.device)
    except ValueError as exc:
        return _fail(str(exc))
    pcm = decode_streamed(dac, global_to_dac(frames[:, 1:]), config)
    try:
        write_wav(args.out, pcm)
    except OSError as exc:
        return _fail(f"cannot write {args.out}: {exc}")
    return 0
