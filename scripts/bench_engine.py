#!/usr/bin/env python
"""Engine decode throughput, side by side in one run:

  ours      OpusLM on vLLM with the plugin: 9 streams per step (stream 0 by vLLM, 1-8 in-model)
  bare      vLLM decoding the same backbone weights as a plain Llama on stream-0 tokens only:
            the floor of what vLLM itself costs for this backbone
  reference the plain-PyTorch loop, one request at a time

Throughput = generated steps per second summed over the batch, for OpusLM's serving sampling
(temperature 0.8, top-k 30) and for greedy decoding (a step is one 20 ms frame of every
stream for one request, or one text token). Both vLLM engines stay up and are measured alternately,
best of --repeats, so machine noise hits both alike. Last line:
overhead_vs_bare_vllm=X.XX speedup_vs_reference=Y.Y  (at the largest batch)

--task picks the requests (prompts: engine/tasks.py):
  continuation  audio after an audio prompt (the default)
  asr           text-phase steps: an audio clip's "transcript", --frames text tokens each
  tts           audio after a text prompt
and --mixed adds, at each batch size, the step cost of a 50/50 batch of text-phase (asr) and
audio-phase (continuation) rows against pure-text and pure-audio batches of the same size:
mixed_vs_pure=X.XX (the mixed step's time over the mean of the pure ones; 1.00 = no penalty).

All three run with the same CPU thread budget, by default the one the engine gets in the service
on this machine (engine.service.engine_cpu_threads: all cores but one, which the codec and the
tokenizer use). --threads N sets another, e.g. every core, to see how the engine alone scales.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine import checkpoint, tasks, vocab  # noqa: E402
from engine.prompt import random_frames, synthetic_prompt, synthetic_prompt_frames  # noqa: E402
from engine.request import AudioRequest  # noqa: E402
from engine.sampling import SamplingConfig  # noqa: E402

SAMPLINGS = {
    "topk": SamplingConfig(temperature=0.8, top_k=30),  # OpusLM's serving defaults
    "greedy": SamplingConfig(temperature=0.0),
}


def write_bare_llama(model_dir: Path, out: Path) -> Path:
    """The same backbone and lm_head as a stock LlamaForCausalLM checkpoint."""
    out.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg.pop("opuslm")
    cfg.update(architectures=["LlamaForCausalLM"], model_type="llama")
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    weights = load_file(str(checkpoint.weights_path(model_dir)))
    weights.pop("head_emb.weight")
    save_file(weights, str(out / "model.safetensors"))
    return out


def requests(batch: int, frames: int, prompt_frames: int, sampling: SamplingConfig,
             task: str = "continuation") -> list[AudioRequest]:
    """`batch` requests of `task`, each `frames` steps of output (frames, or text tokens for asr)."""
    out = []
    for i in range(batch):
        if task == "asr":
            clip = random_frames(np.random.default_rng(i), synthetic_prompt_frames(i, prompt_frames))
            out.append(AudioRequest(tasks.asr_prompt(clip).rows, max_frames=0, start_modality=vocab.TEXT_BPE,
                                    max_text_tokens=frames, min_text_tokens=frames, sampling=sampling))
        elif task == "tts":
            text = [vocab.TEXT_OFFSET + (7 * i + j) % 500 for j in range(synthetic_prompt_frames(i, prompt_frames) // 3 + 1)]
            out.append(AudioRequest(tasks.tts_prompt(text).rows, max_frames=frames, min_frames=frames, sampling=sampling))
        else:
            out.append(AudioRequest(synthetic_prompt(i, prompt_frames), max_frames=frames, min_frames=frames, sampling=sampling))
    return out


def mixed_requests(batch: int, frames: int, prompt_frames: int, sampling: SamplingConfig) -> list[AudioRequest]:
    """Half text-phase (asr), half audio-phase (continuation) rows, the same steps each."""
    text = requests(batch - batch // 2, frames + 8, prompt_frames, sampling, "asr")  # + the audio's flush steps
    return text + requests(batch // 2, frames, prompt_frames, sampling)


def sized_model(hidden: int, layers: int, out: Path) -> Path:
    """A random checkpoint of another size, for a backbone-to-heads ratio closer to real models."""
    from dataclasses import replace

    from engine.tiny import TINY_CONFIG, make_tiny

    heads = max(2, hidden // 64)
    cfg = replace(
        TINY_CONFIG,
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads // 2,
    )
    return make_tiny(out, seed=0, cfg=cfg)


async def time_ours(engine, reqs: list[AudioRequest]) -> float:
    t0 = time.perf_counter()
    gens = await asyncio.gather(*(engine.generate(r) for r in reqs))
    return sum(g.steps.shape[0] for g in gens) / (time.perf_counter() - t0)


async def time_bare(llm, reqs: list[AudioRequest], tag: str) -> float:
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    sampling = reqs[0].sampling
    params = SamplingParams(
        temperature=sampling.temperature,
        top_k=sampling.top_k if sampling.top_k > 0 else -1,
        max_tokens=reqs[0].max_steps,
        ignore_eos=True,
        output_kind=RequestOutputKind.DELTA,
        detokenize=False,
    )

    async def one(i: int, r: AudioRequest) -> int:
        n = 0
        prompt = {"prompt_token_ids": [int(t) for t in r.prompt[:, 0]]}
        async for out in llm.generate(prompt, params, f"{tag}-{i}"):
            n += len(out.outputs[0].token_ids)
        return n

    t0 = time.perf_counter()
    counts = await asyncio.gather(*(one(i, r) for i, r in enumerate(reqs)))
    return sum(counts) / (time.perf_counter() - t0)


def time_reference(ref, reqs: list[AudioRequest]) -> float:
    t0 = time.perf_counter()
    steps = sum(ref.generate(r).steps.shape[0] for r in reqs)
    return steps / (time.perf_counter() - t0)


async def main_async(args: argparse.Namespace) -> int:
    import torch

    from engine.async_engine import AsyncOpusEngine, EngineConfig, _set_vllm_env
    from engine.service import engine_cpu_threads
    from engine.tiny import ensure_tiny

    tmp = tempfile.TemporaryDirectory(prefix="bench-engine-")
    if args.model:
        model = Path(args.model)
    elif args.hidden:
        model = sized_model(args.hidden, args.layers, Path(tmp.name) / "model")
    else:
        model = ensure_tiny()
    print(f"model: {model} ({json.loads((model / 'config.json').read_text())['hidden_size']} hidden)", flush=True)
    threads = args.threads or engine_cpu_threads(None, "cpu")
    torch.set_num_threads(threads)  # the reference, in this process
    os.environ["OMP_NUM_THREADS"] = str(threads)  # bare vLLM's engine core reads it when it starts
    cfg = EngineConfig(model=str(model), max_num_seqs=max(args.batches), cpu_threads=threads)
    ours = await AsyncOpusEngine.start(cfg)
    print(f"cpu threads: {threads} for each engine core and the reference "
          f"(ours reports {await ours.engine_threads()}; {len(os.sched_getaffinity(0))} cores)", flush=True)
    _set_vllm_env(cfg)
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    bare_dir = write_bare_llama(model, Path(tmp.name) / "bare")
    bare = AsyncLLM.from_engine_args(
        AsyncEngineArgs(
            model=str(bare_dir),
            skip_tokenizer_init=True,
            dtype=cfg.dtype,
            enforce_eager=True,
            max_num_seqs=max(args.batches),
            enable_prefix_caching=False,
            async_scheduling=False,
            disable_log_stats=True,
        )
    )
    from engine.reference import ReferenceOpusLM

    ref = ReferenceOpusLM.from_dir(model)
    results: dict[str, list[tuple[int, float, float, float]]] = {}
    try:
        for name in args.sampling:
            rows = results[name] = []
            for b in args.batches:
                reqs = requests(b, args.frames, args.prompt_frames, SAMPLINGS[name], args.task)
                await time_ours(ours, reqs[:1])  # warm both engines at this shape
                await time_bare(bare, reqs[:1], f"warm{name}{b}")
                o, w, r = [], [], []
                for rep in range(args.repeats):
                    o.append(await time_ours(ours, reqs))
                    w.append(await time_bare(bare, reqs, f"{name}b{b}r{rep}"))
                    r.append(time_reference(ref, reqs[: min(b, args.reference_max_requests)]))
                rows.append((b, max(o), max(w), max(r)))
                print(
                    f"{name:6s} batch {b:3d}: ours {max(o):8.1f} steps/s   bare vLLM {max(w):8.1f}   "
                    f"reference {max(r):7.1f}   overhead {max(w) / max(o):.2f}   speedup {max(o) / max(r):.1f}",
                    flush=True,
                )
        if args.mixed:
            mixed = await mixed_step_cost(ours, args)
    finally:
        ours.shutdown()
        bare.shutdown()
        tmp.cleanup()
    b, o, w, r = results[args.sampling[0]][-1]
    print(f"task={args.task} overhead_vs_bare_vllm={w / o:.2f} speedup_vs_reference={o / r:.1f}"
          + (f" mixed_vs_pure={mixed:.2f}" if args.mixed else ""))
    return 0


async def mixed_step_cost(ours, args: argparse.Namespace) -> float:
    """ms per engine step of pure-audio, pure-text and 50/50 batches (best of --repeats, alternating);
    returns the largest batch's mixed / mean(pure) ratio."""
    sampling = SAMPLINGS[args.sampling[0]]
    ratio = 1.0
    for b in args.batches:
        if b < 2:
            continue
        kinds = {"audio": requests(b, args.frames, args.prompt_frames, sampling),
                 "text": requests(b, args.frames + 8, args.prompt_frames, sampling, "asr"),
                 "mixed": mixed_requests(b, args.frames, args.prompt_frames, sampling)}
        best = {k: float("inf") for k in kinds}
        for _ in range(args.repeats):
            for k, reqs in kinds.items():  # one step runs every row once: step ms = 1000 * batch / (steps/s)
                best[k] = min(best[k], 1000.0 * b / await time_ours(ours, reqs))
        ratio = best["mixed"] / ((best["audio"] + best["text"]) / 2)
        print(f"step cost, batch {b:3d}: pure audio {best['audio']:.2f} ms   pure text {best['text']:.2f} ms   "
              f"50/50 mixed {best['mixed']:.2f} ms   mixed/mean(pure) {ratio:.2f}", flush=True)
    return ratio


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="checkpoint dir (default: the tiny model)")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--frames", type=int, default=120)
    p.add_argument("--prompt-frames", type=int, default=25)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--sampling", nargs="+", choices=sorted(SAMPLINGS), default=["topk", "greedy"],
                   help="the first one gives the last line")
    p.add_argument("--task", choices=("continuation", "asr", "tts"), default="continuation")
    p.add_argument("--mixed", action="store_true", help="also the step cost of 50/50 text/audio batches")
    p.add_argument("--hidden", type=int, default=0, help="bench a random model of this hidden size")
    p.add_argument("--layers", type=int, default=8, help="with --hidden")
    p.add_argument("--threads", type=int, default=0,
                   help="CPU threads of each engine core and the reference (default: the service's engine budget)")
    p.add_argument("--reference-max-requests", type=int, default=8,
                   help="the reference runs one request at a time; its rate does not depend on the batch")
    args = p.parse_args()
    if args.threads < 0:
        p.error("--threads must be >= 1 (or 0: the service's engine budget)")
    return asyncio.run(main_async(args))


if __name__ == "__main__":
    sys.exit(main())
