"""`duplex generate`: offline generation of N requests of one task, on vLLM or the reference.

Tasks (prompts: engine/tasks.py, engine/dialogue.py):
  continuation  a pseudo-random audio clip -> more of it (the default)
  asr           a pseudo-random audio clip -> its "transcript" (text)
  tts           --text -> speech
  dialogue      a pseudo-random user turn -> the assistant's text, then (a second request on the text
                the first wrote, as ESPnet's chat inference runs one segment per call) its speech

Request i's synthetic audio varies in length with i, so batches are ragged. `--out X.npy` writes the
frames as an int array [N, F, 9] of global ids (rows past a request's end are -1; audio tasks only);
`--out X.json` one object per request: {"text_ids": [...], "text": "...", "frames": [[9 ids], ...]}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from engine import tasks, vocab
from engine.cli.common import CliError
from engine.dialogue import DialogueTurn, answer_audio_prompt, response_prompt
from engine.prompt import random_frames, synthetic_prompt_frames
from engine.request import AudioRequest, Generation
from engine.sampling import SamplingConfig

FRAME_PAD = -1
TASKS = ("continuation", "asr", "tts", "dialogue")
TEXT_TASKS = ("asr", "dialogue")  # tasks that write text


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate audio codes offline (vLLM or the reference)")
    p.add_argument("--model", default=None, help="checkpoint dir or hub id owner/name[@rev] (default: the tiny model)")
    p.add_argument("--engine", choices=("vllm", "reference"), default="vllm")
    p.add_argument("--task", choices=TASKS, default="continuation")
    p.add_argument("--text", default=None, help="tts: the text to speak (required)")
    p.add_argument("--requests", type=int, default=1, help="number of concurrent requests")
    p.add_argument("--prompt-frames", type=int, default=50, help="typical prompt length in frames")
    length = p.add_mutually_exclusive_group()
    length.add_argument("--frames", type=int, help="frames per request (end-of-audio held until then)")
    length.add_argument("--max-frames", type=int, help="free generation: natural end-of-audio, capped")
    p.add_argument("--min-frames", type=int, default=1, help="with --max-frames: no end-of-audio before")
    p.add_argument("--max-tokens", type=int, default=50, help="asr/dialogue: text tokens at most")
    p.add_argument("--min-tokens", type=int, default=1, help="asr/dialogue: no end of text before this many tokens")
    p.add_argument("--greedy", action="store_true", help="temperature 0")
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-k", type=int, default=30)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None, help="request i uses seed + i")
    p.add_argument("--prompt-seed", type=int, default=0, help="seed of the synthetic prompts")
    p.add_argument("--cfg-scale", type=float, default=1.0,
                   help="classifier-free guidance weight w (1: none); engine/guidance.py")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--out", type=Path, required=True, help="output: .npy frames [N, F, 9] or .json text and frames")
    p.set_defaults(func=run)


@dataclass(frozen=True)
class Plan:
    """What each request runs: its first request, and for a dialogue the audio request that follows
    the text the first one wrote (`follow(text_ids)`)."""

    requests: list[AudioRequest]
    follow: list[Callable[[np.ndarray], AudioRequest]] | None = None


def build_plan(args: argparse.Namespace, text_tokenizer=None) -> Plan:
    if args.requests < 1:
        raise CliError("--requests must be >= 1")
    if args.prompt_frames < 1:
        raise CliError("--prompt-frames must be >= 1")
    if args.frames is not None:
        min_frames = max_frames = args.frames
    else:
        max_frames = args.max_frames if args.max_frames is not None else 100
        min_frames = min(args.min_frames, max_frames)
    if max_frames < 1:
        raise CliError("--frames/--max-frames must be >= 1")
    if not args.cfg_scale >= 0:
        raise CliError("--cfg-scale must be >= 0")
    if args.max_tokens < 1 or not 0 <= args.min_tokens <= args.max_tokens:
        raise CliError("--max-tokens must be >= 1 and --min-tokens in [0, --max-tokens]")
    if (args.task == "tts") != (args.text is not None):
        raise CliError("--text is for --task tts, which needs it")
    if args.task == "tts" and not args.text.strip():
        raise CliError("--text is empty")
    if args.task == "tts" and text_tokenizer is None:
        raise CliError("this model has no text tokenizer (tokenizer/tokenizer.json): it cannot read --text")
    if args.task in TEXT_TASKS and args.out.suffix != ".json":
        raise CliError(f"--task {args.task} writes text: use --out FILE.json")
    if args.out.suffix not in (".npy", ".json"):
        raise CliError("--out must end in .npy or .json")
    reqs: list[AudioRequest] = []
    follow: list[Callable[[np.ndarray], AudioRequest]] = []
    for i in range(args.requests):
        sampling = (
            SamplingConfig(temperature=0.0)
            if args.greedy
            else SamplingConfig(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                                seed=None if args.seed is None else args.seed + i)
        )
        audio = dict(max_frames=max_frames, min_frames=min_frames, sampling=sampling, cfg_scale=args.cfg_scale)
        text = dict(max_frames=0, start_modality=vocab.TEXT_BPE, max_text_tokens=args.max_tokens,
                    min_text_tokens=args.min_tokens, sampling=sampling)
        clip = lambda: random_frames(np.random.default_rng([args.prompt_seed, i]), synthetic_prompt_frames(i, args.prompt_frames))
        if args.task == "continuation":  # ESPnet's audiolm task: the prompt's segment goes on (its delay carry)
            prompt = tasks.continuation_prompt(clip())
            reqs.append(AudioRequest(prompt=prompt.rows, carry=prompt.carry[:, 1:], **audio))
        elif args.task == "asr":
            reqs.append(AudioRequest(prompt=tasks.asr_prompt(clip()).rows, **text))
        elif args.task == "tts":
            reqs.append(AudioRequest(prompt=tasks.tts_prompt(text_tokenizer.encode(args.text)).rows, **audio))
        else:
            turns = [DialogueTurn(vocab.USER, clip())]
            reqs.append(AudioRequest(prompt=response_prompt(turns, text_first=True), **text))
            follow.append(_answer_request(turns, audio))
    return Plan(reqs, follow or None)


def _answer_request(turns: list[DialogueTurn], audio: dict[str, Any]) -> Callable[[np.ndarray], AudioRequest]:
    """A dialogue's second request: the audio answer that speaks the text `ids` the first one wrote."""
    return lambda ids: AudioRequest(prompt=answer_audio_prompt(turns, ids.tolist()), **audio)


def stack_frames(gens: list[Generation]) -> np.ndarray:
    longest = max(g.frames.shape[0] for g in gens)
    out = np.full((len(gens), longest, gens[0].frames.shape[1]), FRAME_PAD, dtype=np.int64)
    for i, g in enumerate(gens):
        out[i, : g.frames.shape[0]] = g.frames
    return out


async def _run_vllm(model: Path, plan: Plan, max_num_seqs: int) -> list[Generation]:
    from engine.async_engine import AsyncOpusEngine, EngineConfig

    engine = await AsyncOpusEngine.start(EngineConfig(model=str(model), max_num_seqs=max_num_seqs))

    async def one(i: int) -> Generation:
        gen = await engine.generate(plan.requests[i])
        return gen if plan.follow is None else _joined(gen, await engine.generate(plan.follow[i](gen.text_ids)))

    try:
        return list(await asyncio.gather(*(one(i) for i in range(len(plan.requests)))))
    finally:
        engine.shutdown()


def _run_reference(model: Path, plan: Plan) -> list[Generation]:
    from engine.reference import ReferenceOpusLM

    ref = ReferenceOpusLM.from_dir(model)
    gens = [ref.generate(r) for r in plan.requests]
    if plan.follow is not None:
        gens = [_joined(g, ref.generate(f(g.text_ids))) for g, f in zip(gens, plan.follow)]
    return gens


def _joined(text: Generation, audio: Generation) -> Generation:
    """A dialogue answer: the text request's text, the audio request's frames, both requests' steps."""
    return Generation(steps=np.concatenate([text.steps, audio.steps]), frames=audio.frames, text_ids=text.text_ids,
                      num_preemptions=text.num_preemptions + audio.num_preemptions)


def write_json(path: Path, gens: list[Generation], text_tokenizer) -> None:
    rows = []
    for g in gens:
        ids = [int(t) for t in g.text_ids]
        rows.append({"text_ids": ids, "text": text_tokenizer.decode(ids) if text_tokenizer is not None and ids else "",
                     "frames": g.frames.astype(int).tolist()})
    path.write_text(json.dumps(rows) + "\n")


def run(args: argparse.Namespace) -> int:
    from engine.checkpoint import load_config
    from engine.model_source import resolve_model
    from engine.text import NoTextTokenizerError, TextTokenizer
    from engine.tiny import ensure_tiny

    model = resolve_model(args.model) if args.model is not None else ensure_tiny()
    load_config(model)  # a clear error for a wrong directory, before starting anything
    try:
        text_tokenizer = TextTokenizer.from_dir(model)
    except NoTextTokenizerError:
        text_tokenizer = None
    plan = build_plan(args, text_tokenizer)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    gens = _run_reference(model, plan) if args.engine == "reference" else asyncio.run(_run_vllm(model, plan, args.max_num_seqs))
    elapsed = time.perf_counter() - t0
    if args.out.suffix == ".json":
        write_json(args.out, gens, text_tokenizer)
        shape = f"{len(gens)} objects"
    else:
        frames = stack_frames(gens)
        np.save(args.out, frames)
        shape = str(tuple(frames.shape))
    steps = sum(g.steps.shape[0] for g in gens)
    lengths = [g.frames.shape[0] for g in gens]
    tokens = [len(g.text_ids) for g in gens]
    print(
        f"{args.engine} {args.task}: {len(gens)} requests, frames per request {min(lengths)}..{max(lengths)}, "
        f"text tokens {min(tokens)}..{max(tokens)}, {steps} steps in {elapsed:.2f}s -> {args.out} {shape}"
    )
    return 0
