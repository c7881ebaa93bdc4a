"""SNR of streamed vs offline decode against left context / lookahead / chunk size, and the
first-chunk trade-off (time to first audio vs overhead). Prints markdown tables.

Codes come from encoding a speech-like signal with the same codec. `--real-size` uses the real
(uniform random codes, since a random encoder gives one code)
OpusLM codec architecture (hidden 512, 32 filters, 3 residual layers) with random weights:
its receptive field is the real one, so it shows what the real checkpoint will need.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import tempfile
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from engine.codec.config import DACConfig  # noqa: E402
from engine.codec.dac import DAC  # noqa: E402
from engine.codec.streaming import DecoderState, StreamConfig, StreamingDecoder, decode_streamed, snr_db  # noqa: E402
from engine.codec.synth import speech_like  # noqa: E402
from engine.codec.tiny import make_tiny_codec  # noqa: E402
from engine.vocab import FRAME_RATE_HZ  # noqa: E402


def _model(real_size: bool) -> DAC:
    if real_size:
        torch.manual_seed(0)
        dac = DAC(DACConfig()).eval()
        for layer in dac.quantizer.vq.layers:
            layer._codebook.embed.normal_(0.0, 0.05)
        return dac.fuse_weight_norm()
    with tempfile.TemporaryDirectory() as tmp:
        make_tiny_codec(pathlib.Path(tmp))
        return DAC.from_dir(pathlib.Path(tmp))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--real-size", action="store_true")
    p.add_argument("--seconds", type=float, default=3.0)
    args = p.parse_args()
    torch.set_num_threads(1)
    dac = _model(args.real_size)
    pcm = torch.from_numpy(speech_like(args.seconds, seed=3))[None, None]
    codes = dac.encode(pcm)[0].t().numpy()
    if args.real_size:  # a random encoder maps everything to one code: use uniform random codes
        codes = torch.randint(0, 1024, codes.shape, generator=torch.Generator().manual_seed(0)).numpy()
    offline = dac.decode(torch.from_numpy(codes).t()[None])[0, 0].numpy()
    print(f"codec: {'real-size random' if args.real_size else 'tiny'}; {len(codes)} frames\n")
    print("| chunk | context | lookahead | crossfade | SNR dB |\n|---|---|---|---|---|")
    grid = [(n, c, la, 0) for n in (4, 16) for c in (0, 2, 4) for la in (0, 1, 2, 4)]
    grid += [(16, 4, 2, 320), (16, 0, 2, 320)]
    for n, c, la, xf in grid:
        cfg = StreamConfig(first_chunk_frames=n, chunk_frames=n, context_frames=c,
                           lookahead_frames=la, crossfade_samples=xf)
        print(f"| {n} | {c} | {la} | {xf} | {snr_db(offline, decode_streamed(dac, codes, cfg)):.1f} |")
    print("\n| first chunk | frames before first audio | first-chunk decode ms | "
          "first-chunk frames decoded per frame out |\n|---|---|---|---|")
    for first in (1, 2, 4, 8, 16):
        cfg = StreamConfig(first_chunk_frames=first)
        decoder = StreamingDecoder(dac, cfg)
        times = []
        for _ in range(5):
            state = DecoderState.new()
            decoder.push(state, codes[: first + cfg.lookahead_frames])
            start = time.perf_counter()
            decoder.decode([state])
            times.append(time.perf_counter() - start)
        wait = first + cfg.lookahead_frames
        print(f"| {first} | {wait} ({1000 * wait / FRAME_RATE_HZ:.0f} ms of generation) | "
              f"{1000 * min(times):.1f} | {(first + cfg.lookahead_frames) / first:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
