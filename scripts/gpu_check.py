#!/usr/bin/env python
"""Everything about duplex's own torch code that a CUDA GPU can check, with torch alone.

vLLM's CUDA build may not be installable where a GPU is at hand, so this covers our code, not
vLLM's (docs/gpu.md lists what only a vLLM-on-GPU run can show). Nothing on its path imports
vLLM; it needs torch, numpy, safetensors and tokenizers (transformers' dependency) only.

  graph      CUDA graph capture + replay of the OpusLM forward contract (aux_inputs.opus_forward)
             on a plain-torch Llama backbone: replays with new buffer contents equal eager   [hard]
  codec      DAC decode on CUDA vs CPU: SNR (dB)                                             [hard: >= 30 dB]
  sampling   the torch aux-sampling path (GPU) vs the numpy path (CPU) on the same logits:
             greedy equal; top-k draws stay in the top-k set and match in distribution      [hard]
  reference  the reference OpusLM on CUDA in bf16 vs CPU fp32: greedy agreement over N steps
  stream     streaming decode real-time factor at batch 1..64 (sessions one GPU's codec feeds)
  xeus       XEUS tokenizer real-time factor (release-size, random weights unless --model)
  additions  per-step cost of our additions at the 1.7B and 7B shapes: aux embedding,
             audio-rows head, aux sampling, CFG merge (random bf16 weights)
  step       the decode step at the 1.7B and 7B shapes (backbone + our additions, CUDA-graphed,
             random bf16 weights) at batches 1-128 and contexts 1k-8k -> sessions per GPU with and
             without CFG per context length (scripts/decode_step.py says what it leaves out)
             [hard: finite outputs, graph replay equals eager]

`--device cpu` runs every check on the CPU at small shapes (tiny models, few steps): a smoke test
of this script, so a GPU visit is not spent on a crash; its numbers mean nothing. Without
`--device cpu` and without a CUDA device it prints that none was found and exits 0. Exit 1 if a
hard check fails or any check raises. `--budget-s` bounds the whole run: `step` starts no probe
past it (and says so) so the script ends in about that time.
Usage: python scripts/gpu_check.py [--device cpu] [--model DIR] [--only graph codec ...] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

_HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(_HERE.parent))
sys.path.insert(0, str(_HERE))  # decode_step.py, also when this file is loaded by path (tests)

import decode_step  # noqa: E402
from engine import guidance, heads, vocab  # noqa: E402
from engine.sampling import GREEDY, SamplingConfig, _sample_torch, row_limits, sample_rows  # noqa: E402

NO_GPU_MESSAGE = "gpu_check: no CUDA device found (torch.cuda.is_available() is False); nothing to check"
_START = time.perf_counter()


@dataclass(frozen=True)
class Sizes:
    """How big each check runs: the real thing on a GPU, a smoke test on a CPU."""

    shapes: tuple[decode_step.Shape, ...]
    sampling_rows: int
    sampling_draws: int
    reference_frames: int
    stream_seconds: float
    xeus_seconds: float
    xeus_iters: int
    additions_batches: tuple[int, ...]
    step_contexts: tuple[int, ...]
    step_max_rows: int
    step_iters: int


GPU_SIZES = Sizes(decode_step.RELEASED, 4, 400, 40, 4.0, 4.0, 3, (1, 32, 64, 128), (1024, 2048, 4096, 8192), 128, 10)
CPU_SIZES = Sizes(decode_step.TINY, 2, 150, 8, 0.5, 0.4, 1, (1, 4), (64, 256), 8, 3)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn: Callable[[], object], device: torch.device, iters: int = 20, warmup: int = 3) -> float:
    """Median wall time of fn in ms, synchronised (warm-up first)."""
    return decode_step.median_ms(fn, device, iters, warmup)


# --- graph: the forward contract under a CUDA graph ------------------------------------------------


def check_graph(model_dir: pathlib.Path, device: torch.device, padded: int = 64, replays: int = 4) -> dict:
    """Capture opus_forward once, replay with new input ids and aux buffer contents; each replay
    must equal an eager forward on the same contents, and differ from the previous replay."""
    from engine.prompt import synthetic_prompt
    from engine.reference import ReferenceBackbone, ReferenceOpusLM
    from engine.vllm_plugin.aux_inputs import AuxInputs, opus_forward

    backbone = ReferenceBackbone(ReferenceOpusLM.from_dir(model_dir, device=str(device)))
    aux = AuxInputs(2 * padded, device)
    input_ids = torch.zeros(padded, dtype=torch.int64, device=device)
    positions = torch.arange(padded, device=device)

    def stage(i: int) -> None:
        rows = synthetic_prompt(i, 30)[:padded]
        input_ids.zero_()
        input_ids[: len(rows)] = torch.from_numpy(rows[:, 0]).to(device)
        aux.write(rows[:, 1:], padded)

    def fwd() -> torch.Tensor:
        return opus_forward(backbone, aux, input_ids, positions)

    stage(0)
    with torch.inference_mode():
        replay = decode_step.capture(fwd, device)  # eager on a CPU: the staging path alone
        diffs, changed = [], []
        prev = None
        for i in range(1, replays + 1):
            stage(i)
            out = replay()
            want = fwd()
            diffs.append(float((out - want).abs().max()))
            changed.append(prev is None or not torch.equal(out, prev))
            prev = out.clone()
    # A stale buffer read would be off by O(1); the same kernels give exactly 0 (reported), and
    # a different cuBLAS algorithm under capture would give rounding-size differences only.
    ok = all(d <= 1e-4 for d in diffs) and all(changed)
    return {"ok": ok, "captured": device.type == "cuda", "exact": all(d == 0.0 for d in diffs),
            "max_abs_diff_per_replay": diffs, "outputs_changed": all(changed)}


# --- codec --------------------------------------------------------------------------------------


def _codec(model_dir: pathlib.Path | None, tmp: pathlib.Path, release_size: bool = False):
    """(DAC, what it is): the checkpoint's codec; else the release-size DAC with random weights
    (`release_size`: what a GPU's streaming-decode RTF should be measured on); else the tiny one."""
    from engine.codec.config import DACConfig
    from engine.codec.dac import DAC
    from engine.codec.tiny import make_tiny_codec

    if model_dir is not None and (model_dir / "codec").exists():
        return DAC.from_dir(model_dir), "checkpoint"
    if release_size:
        torch.manual_seed(0)
        return DAC(DACConfig()), "release-size, random weights"
    make_tiny_codec(tmp)
    return DAC.from_dir(tmp), "tiny"


def check_codec(dac, device: torch.device, seconds: float = 4.0) -> dict:
    from engine.codec.streaming import snr_db
    from engine.codec.synth import speech_like

    pcm = torch.from_numpy(speech_like(seconds, seed=1))[None, None]
    codes = dac.encode(pcm)
    cpu = dac.decode(codes)[0, 0].numpy()
    gpu_dac = dac.to(device)
    gpu = gpu_dac.decode(codes.to(device))[0, 0].float().cpu().numpy()
    dac.to("cpu")
    snr = float(snr_db(cpu, gpu))
    return {"ok": snr >= 30.0, "snr_db": snr}


def stream_rtf(dac, device: torch.device, batches: list[int], seconds: float = 4.0) -> dict:
    """Streaming decode RTF per session (compute s / audio s) with `batch` sessions in lockstep."""
    from engine.codec.streaming import StreamingDecoder, lockstep_decode_seconds
    from engine.codec.synth import speech_like

    dac = dac.to(device)
    codes = dac.encode(torch.from_numpy(speech_like(seconds, seed=1))[None, None].to(device))[0].t().cpu().numpy()
    audio_s = len(codes) * vocab.HOP_SAMPLES / vocab.SAMPLE_RATE_HZ
    decoder = StreamingDecoder(dac)
    out = {}
    for batch in batches:
        elapsed = lockstep_decode_seconds(decoder, codes, batch, sync=lambda: _sync(device))
        rtf = elapsed / (audio_s * batch)
        out[batch] = {"rtf_per_session": rtf, "batch_rtf": elapsed / audio_s}
    dac.to("cpu")
    return out


def xeus_rtf(model_dir: pathlib.Path | None, dac, device: torch.device, seconds: float = 4.0, iters: int = 3) -> dict:
    """One session of the audio tokenizer (DAC encoder + XEUS), 200 ms pieces, as the service runs it."""
    from engine.codec.ssl import load_ssl
    from engine.codec.synth import speech_like
    from engine.codec.tokenizer import AudioTokenizer
    from engine.codec.xeus import XeusConfig, XeusTokenizer

    if model_dir is not None and (model_dir / "ssl").exists():
        ssl, what = load_ssl(model_dir, device), "checkpoint"
    elif device.type == "cuda":
        ssl, what = XeusTokenizer(XeusConfig()).eval().to(device), "release-size, random weights"
    else:  # the same code at a few percent of the width and depth (the release is 7x real time here)
        small = XeusConfig(cnn_channels=32, output_size=32, attention_heads=2, linear_units=64,
                           cgmlp_linear_units=64, cgmlp_conv_kernel=7, merge_conv_kernel=7, num_blocks=2,
                           output_layer=1, pos_conv_kernel=16, pos_conv_groups=4)
        ssl, what = XeusTokenizer(small).eval().to(device), "small, random weights (CPU smoke test)"
    tok = AudioTokenizer(dac.to(device), ssl)
    pcm = speech_like(seconds, seed=2)
    piece = vocab.SAMPLE_RATE_HZ // 5

    def run() -> None:
        state = tok.new_state()
        for i in range(0, len(pcm), piece):
            tok.push(state, pcm[i : i + piece])
            while tok.ready(state):
                tok.step([state])
        tok.finish(state)
        while tok.ready(state):
            tok.step([state])

    with torch.inference_mode():
        ms = time_ms(run, device, iters=iters, warmup=min(iters, 3))
    dac.to("cpu")
    return {"ssl": what, "rtf": ms / 1e3 / seconds}


# --- sampling ------------------------------------------------------------------------------------


def check_sampling(device: torch.device, rows: int = 4, draws: int = 400, k: int = 30) -> dict:
    """The same logits through the torch path on `device` (what a GPU runs) and sample_rows on the
    CPU (its numpy path when every row has a top-k)."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(rows, vocab.NUM_CODEBOOKS, vocab.CODEBOOK_SIZE, generator=gen) * 3
    dev_logits = logits.to(device)
    greedy_equal = torch.equal(
        sample_rows(dev_logits, [GREEDY] * rows, [None] * rows).cpu(), sample_rows(logits, [GREEDY] * rows, [None] * rows)
    )
    cfg = SamplingConfig(temperature=0.8, top_k=k)
    top = logits.topk(k, dim=-1).values[..., -1:]
    allowed = logits >= top  # [rows, 8, 1024]
    counts = {"torch": np.zeros(logits.shape), "numpy": np.zeros(logits.shape)}
    greedy, top_ks = row_limits([cfg] * rows, vocab.CODEBOOK_SIZE)
    paths = {
        "torch": lambda: _sample_torch(dev_logits, [cfg] * rows, [None] * rows, greedy, top_ks),
        "numpy": lambda: sample_rows(logits, [cfg] * rows, [None] * rows),
    }
    for _ in range(draws):
        for name, draw in paths.items():
            ids = draw().cpu().numpy()
            r, s = np.meshgrid(np.arange(rows), np.arange(vocab.NUM_CODEBOOKS), indexing="ij")
            counts[name][r, s, ids] += 1
    outside = {n: int(c[~allowed.numpy()].sum()) for n, c in counts.items()}
    # total variation between the two empirical distributions, averaged over rows x streams
    tv = float(0.5 * np.abs(counts["torch"] - counts["numpy"]).sum(-1).mean() / draws)
    # two samples of `draws` from one distribution over k ids differ by about sqrt(k / draws) / 2 in TV
    bound = 1.5 * np.sqrt(k / draws)
    ok = greedy_equal and outside["torch"] == 0 and outside["numpy"] == 0 and tv < bound
    return {"ok": bool(ok), "greedy_equal": greedy_equal, "draws_outside_top_k": outside,
            "total_variation": tv, "tv_bound": bound}


# --- reference model -------------------------------------------------------------------------------


def check_reference(model_dir: pathlib.Path, device: torch.device, frames: int = 40) -> dict:
    """Greedy generation: CUDA bf16 against CPU fp32, the same prompt."""
    from engine.prompt import synthetic_prompt
    from engine.reference import ReferenceOpusLM
    from engine.request import AudioRequest

    req = AudioRequest(synthetic_prompt(0, 30), max_frames=frames, min_frames=frames, sampling=GREEDY)
    cpu = ReferenceOpusLM.from_dir(model_dir).generate(req).steps
    gpu = ReferenceOpusLM.from_dir(model_dir, device=str(device), dtype=torch.bfloat16).generate(req).steps
    n = min(len(cpu), len(gpu))
    same = np.all(cpu[:n] == gpu[:n], axis=1)
    first = int(np.argmin(same)) if not same.all() else n
    return {"steps": n, "steps_equal": int(same.sum()), "first_divergence": first,
            "stream0_agreement": float((cpu[:n, 0] == gpu[:n, 0]).mean())}


# --- per-step cost of our additions ------------------------------------------------------------------


def additions_cost(device: torch.device, shapes: tuple[decode_step.Shape, ...], batches: tuple[int, ...],
                   dtype: torch.dtype = torch.bfloat16) -> dict:
    """ms per step of what OpusLM adds to a plain Llama step, at the released models' shapes."""
    from engine.vllm_plugin.aux_inputs import aux_embedding_sum

    out = {}
    gen = torch.Generator(device=device).manual_seed(0)
    for shape in shapes:
        hidden, vsize = shape.hidden, shape.vocab_size
        table = torch.randn(vsize, hidden, device=device, dtype=dtype, generator=gen) * 0.02
        lm_head = torch.randn(vsize, hidden, device=device, dtype=dtype, generator=gen) * 0.02
        bias = torch.zeros(heads.AUDIO_END, device=device, dtype=torch.float32)
        rows = {}
        for b in batches:
            h = torch.randn(b, hidden, device=device, dtype=dtype, generator=gen)
            aux = torch.randint(vocab.DAC_OFFSET, heads.AUDIO_END, (b, vocab.NUM_CODEBOOKS), device=device, generator=gen)
            logits = heads.project(h, lm_head, bias)
            cfg = [SamplingConfig(temperature=0.8, top_k=30)] * b
            scale = torch.full((b,), 1.5, device=device)
            with torch.inference_mode():
                rows[b] = {
                    "aux_embedding": time_ms(lambda: aux_embedding_sum(table, aux), device),
                    "audio_rows_head": time_ms(lambda: heads.project(h, lm_head, bias), device),
                    "full_lm_head (for scale)": time_ms(lambda: torch.nn.functional.linear(h, lm_head), device),
                    "aux_sampling_topk30": time_ms(lambda: sample_rows(heads.aux_logits(logits), cfg, [None] * b), device),
                    "cfg_merge": time_ms(lambda: guidance.merge(h.float(), h.float(), scale), device),
                }
        out[shape.name] = rows
        table = lm_head = None  # free both before the next shape allocates its own
    return out


# --- driver --------------------------------------------------------------------------------------


CHECKS = ["graph", "codec", "sampling", "reference", "stream", "xeus", "additions", "step"]
HARD = {"graph", "codec", "sampling", "step"}


def run_checks(device: torch.device, model_dir: pathlib.Path | None, only: list[str], batches: list[int],
               sizes: Sizes, deadline: float = math.inf) -> dict:
    from engine.tiny import ensure_tiny

    lm_dir = model_dir or ensure_tiny(seed=0)
    results: dict = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else str(device),
                     "torch": torch.__version__, "cuda": torch.version.cuda, "date": time.strftime("%Y-%m-%d"),
                     "smoke_test": device.type != "cuda"}
    with tempfile.TemporaryDirectory() as tmp:
        dac, dac_what = _codec(model_dir, pathlib.Path(tmp), release_size=device.type == "cuda")
        dac.eval()
        for name in only:
            t0 = time.perf_counter()
            try:
                if name == "graph":
                    r = check_graph(lm_dir, device)
                elif name == "codec":
                    r = check_codec(dac, device, seconds=sizes.stream_seconds)
                elif name == "sampling":
                    r = check_sampling(device, rows=sizes.sampling_rows, draws=sizes.sampling_draws)
                elif name == "reference":
                    r = check_reference(lm_dir, device, frames=sizes.reference_frames)
                elif name == "stream":
                    r = {"codec": dac_what, "batches": stream_rtf(dac, device, batches, seconds=sizes.stream_seconds)}
                elif name == "xeus":
                    r = xeus_rtf(model_dir, dac, device, seconds=sizes.xeus_seconds, iters=sizes.xeus_iters)
                elif name == "additions":
                    r = additions_cost(device, sizes.shapes, sizes.additions_batches)
                elif name == "step":
                    r = decode_step.sweep(decode_step.SweepConfig(
                        sizes.shapes, sizes.step_contexts, sizes.step_max_rows, sizes.step_iters,
                        deadline=deadline), device)
                else:
                    raise ValueError(name)
            except Exception as e:  # one broken check must not hide the others' results
                r = {"ok": False, "error": f"{type(e).__name__}: {e}"}
            r["seconds"] = round(time.perf_counter() - t0, 2)
            results[name] = r
            print(f"{name}: {json.dumps(r, default=str)}", flush=True)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    results["vllm_imported"] = "vllm" in sys.modules and sys.modules["vllm"] is not None
    return results


def _summary(name: str, r: dict) -> str:
    """One line of what a check found."""
    if "error" in r:
        return r["error"]
    if name == "graph":
        how = "CUDA graph" if r["captured"] else "eager (no capture on a CPU)"
        return f"{how}: replays equal eager {'exactly' if r['exact'] else max(r['max_abs_diff_per_replay'])}, outputs change"
    if name == "codec":
        return f"SNR {r['snr_db']:.1f} dB"
    if name == "sampling":
        return f"greedy equal {r['greedy_equal']}, outside top-k {r['draws_outside_top_k']}, TV {r['total_variation']:.3f} < {r['tv_bound']:.3f}"
    if name == "reference":
        return f"steps equal {r['steps_equal']}/{r['steps']}, first divergence {r['first_divergence']}"
    if name == "stream":
        rtf = ", ".join(f"{b}: {v['rtf_per_session']:.4f}" for b, v in r["batches"].items())
        return f"RTF per session at batch {rtf} ({r['codec']})"
    if name == "xeus":
        return f"RTF {r['rtf']:.3f} ({r['ssl']})"
    if name == "additions":
        parts = []
        for shape, rows in r.items():
            if isinstance(rows, dict):
                b = max(rows)
                v = rows[b]
                parts.append(f"{shape} b={b}: emb {v['aux_embedding']:.3f} head {v['audio_rows_head']:.3f} "
                             f"sample {v['aux_sampling_topk30']:.3f} cfg {v['cfg_merge']:.3f} ms")
        return "; ".join(parts)
    if name == "step":
        return "table below"
    return ""


def format_table(results: dict, only: list[str]) -> list[str]:
    """The printed report: one line per check, then the step check's table."""
    lines = [f"gpu_check on {results['device']} (torch {results['torch']}, {results['date']})"
             + (": CPU SMOKE TEST at tiny shapes, the numbers mean nothing" if results["smoke_test"] else ""),
             f"  {'check':<10} {'status':<6} {'s':>6}  result"]
    for name in only:
        r = results[name]
        status = "ERROR" if "error" in r else ("pass" if r.get("ok") else "FAIL") if name in HARD else "ran"
        lines.append(f"  {name:<10} {status:<6} {r['seconds']:>6.1f}  {_summary(name, r)}")
    if "step" in only and "error" not in results["step"]:
        lines += decode_step.format_table(results["step"])
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                   help="cpu: every check on the CPU at small shapes (a smoke test of this script)")
    p.add_argument("--model", type=pathlib.Path, default=None, help="converted checkpoint (default: tiny random models)")
    p.add_argument("--only", nargs="+", choices=CHECKS, default=CHECKS)
    p.add_argument("--batches", type=int, nargs="+", default=None,
                   help="streaming decode batches (default 1 8 16 32 64; 1 2 on a CPU)")
    p.add_argument("--budget-s", type=float, default=420.0,
                   help="no step probe starts after this many seconds from the start (default 420)")
    p.add_argument("--json", type=pathlib.Path, default=None, help="also write the results here")
    args = p.parse_args(argv)
    if args.device == "cpu":
        device, sizes = torch.device("cpu"), CPU_SIZES
    elif not torch.cuda.is_available():
        print(NO_GPU_MESSAGE)
        return 0
    else:
        device, sizes = torch.device("cuda", torch.cuda.current_device()), GPU_SIZES
    batches = args.batches or ([1, 8, 16, 32, 64] if device.type == "cuda" else [1, 2])
    results = run_checks(device, args.model, args.only, batches, sizes, deadline=_START + args.budget_s)
    results["seconds"] = round(time.perf_counter() - _START, 1)
    failed = [n for n in args.only if results[n].get("ok") is False]
    results["failed"] = failed
    if args.json:
        args.json.write_text(json.dumps(results, indent=2, default=str))
    print("\n".join(format_table(results, args.only)))
    print(f"gpu_check: {results['seconds']} s; " + ("FAILED: " + " ".join(failed) if failed else "all hard checks passed"))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
