"""Codec benchmark: decode RTF (streamed vs offline) at batch 1/8/32 and the tokenizer's RTF.

RTF = compute seconds / audio seconds (lower is better). Everything is measured side by side in
one run on the tiny random codec (or --model DIR). The last line is the number of sessions one
core keeps fed in real time: 1 / (streamed RTF per session at the largest batch + tokenizer RTF),
with torch limited to one thread.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import tempfile
import time

import numpy as np
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from engine.codec.dac import DAC  # noqa: E402
from engine.codec.ssl import load_ssl  # noqa: E402
from engine.codec.streaming import StreamConfig, StreamingDecoder, lockstep_decode_seconds  # noqa: E402
from engine.codec.synth import speech_like  # noqa: E402
from engine.codec.tiny import make_tiny_codec  # noqa: E402
from engine.codec.tokenizer import AudioTokenizer  # noqa: E402
from engine.vocab import HOP_SAMPLES, SAMPLE_RATE_HZ  # noqa: E402


def _offline_s(dac: DAC, codes: np.ndarray, batch: int) -> float:
    x = torch.from_numpy(codes).t()[None].repeat(batch, 1, 1)
    start = time.perf_counter()
    dac.decode(x)
    return time.perf_counter() - start


def _tokenizer_s(tok: AudioTokenizer, pcm: np.ndarray) -> float:
    state = tok.new_state()
    piece = SAMPLE_RATE_HZ // 5  # 200 ms pieces, as a client sends them
    start = time.perf_counter()
    for i in range(0, len(pcm), piece):
        tok.push(state, pcm[i : i + piece])
        while tok.ready(state):
            tok.step([state])
    tok.finish(state)
    while tok.ready(state):
        tok.step([state])
    return time.perf_counter() - start


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", type=pathlib.Path, help="model dir (default: build the tiny one)")
    p.add_argument("--seconds", type=float, default=4.0, help="audio per session")
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model or pathlib.Path(tmp)
        if args.model is None:
            make_tiny_codec(model_dir)
        dac, ssl = DAC.from_dir(model_dir), load_ssl(model_dir)
    pcm = speech_like(args.seconds, seed=1)
    codes = dac.encode(torch.from_numpy(pcm)[None, None])[0].t().numpy()
    audio_s = len(codes) * HOP_SAMPLES / SAMPLE_RATE_HZ
    cfg = StreamConfig()
    decoder = StreamingDecoder(dac, cfg)
    print(f"codec {dac.cfg.encdec_n_filters} filters, hidden {dac.cfg.hidden_dim}; {audio_s:.2f} s per "
          f"session; threads={args.threads}; stream {cfg}")
    print(f"{'batch':>5} {'streamed RTF/session':>21} {'offline RTF/session':>20} {'overhead':>9}")
    lockstep_decode_seconds(decoder, codes[:20], 1)  # warm-up
    streamed_rtf = 0.0
    for batch in [int(b) for b in args.batches.split(",")]:
        streamed_rtf = lockstep_decode_seconds(decoder, codes, batch) / (audio_s * batch)
        offline_rtf = _offline_s(dac, codes, batch) / (audio_s * batch)
        print(f"{batch:>5} {streamed_rtf:>21.4f} {offline_rtf:>20.4f} {streamed_rtf / offline_rtf:>8.2f}x")
    tok = AudioTokenizer(dac, ssl)
    _tokenizer_s(tok, pcm[:SAMPLE_RATE_HZ])
    tok_rtf = _tokenizer_s(tok, pcm) / (len(pcm) / SAMPLE_RATE_HZ)
    print(f"tokenizer RTF (one session, 200 ms pieces): {tok_rtf:.4f}")
    print(f"sessions_per_core={int(1.0 / (streamed_rtf + tok_rtf))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
