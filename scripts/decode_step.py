"""The decode step that decides how many sessions one GPU serves: `scripts/gpu_check.py step`.

Every running session needs one decode step per 20 ms frame, so the capacity of a GPU is the
largest batch whose full-batch step fits the frame with docs/gpu.md's margin (15 ms of 20: 25 %
left for prefill chunks and jitter). This module times that step at the released models' shapes
without vLLM (the GPU machine we get has torch but no vLLM):

  measured   the decode step of a plain-torch Llama / OLMo-2 backbone (random bf16 weights,
             vLLM's fused qkv and gate_up GEMMs) over a static KV cache, attention by torch's
             SDPA, CUDA-graphed per batch size as vLLM's FULL decode graphs are (eager on a CPU);
             our additions around it, with the engine's own code: the aux-id upload
             (`AuxInputs.write`), the 9-stream input embedding (`opus_forward`), the CFG merge
             (`guidance.merge`, when CFG), the audio-rows head (`heads.project`), aux sampling of
             streams 1-8 and the stream-0 mask (`sample_rows`, `heads.stream0_logits_`), the host
             read-back of the sampled ids.
  not        vLLM's scheduler and input preparation (host time per step, grows with the batch),
             its attention kernels over a paged KV cache (FlashAttention / FlashInfer with block
             tables instead of SDPA over one dense cache), its sampler for stream 0 (stood in for
             by `sample_rows` at the same width), the codec stage (DAC decode, XEUS) sharing the
             GPU, prefill chunks of arriving sessions. So the step here is a lower bound on
             vLLM's and the sessions an upper bound.

Every session in a batch is at the same context length (the worst case of that length: each
row attends over all of it). Nothing here imports vLLM.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from engine import guidance, heads, vocab
from engine.delay import Stream0Rule
from engine.sampling import SamplingConfig, sample_rows
from engine.service_api import FRAME_MS
from engine.vllm_plugin.aux_inputs import AuxInputs, opus_forward

STEP_BUDGET_MS = 0.75 * FRAME_MS  # docs/gpu.md: full-batch step under ~15 ms, 25 % left for prefill and jitter
# vLLM's default CUDA-graph capture sizes up to 128: a decode batch is padded up to one of these,
# so these are the batch sizes a deployment actually runs at.
CAPTURE_SIZES = (1, 2, 4) + tuple(range(8, 129, 8))
# FlashAttention first (what vLLM's decode runs on a GPU, in its paged form); cuDNN's SDPA is left
# out, memory-efficient and math are fallbacks for shapes flash does not take.
SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
GIB = 1 << 30


@dataclass(frozen=True)
class Shape:
    """A backbone's shape (configs/*.yaml; intermediate sizes from the backbones' HF configs)."""

    name: str
    backbone: str  # "llama" (pre-norm) or "olmo2" (q/k norm, norms after attention and MLP)
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab_size: int
    rope_theta: float = 10000.0

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * dtype_bytes

    def params(self) -> int:
        h, d = self.hidden, self.head_dim
        layer = h * (self.heads + 2 * self.kv_heads) * d + self.heads * d * h + 3 * h * self.intermediate
        return self.layers * layer + 2 * self.vocab_size * h  # + embedding table and lm_head


RELEASED = (
    # SmolLM2-1.7B: 24 layers, 2048 hidden, 32/32 heads, intermediate 8192 (1.87 B with our vocab)
    Shape("dialogue-1.7b", "llama", 2048, 24, 32, 32, 8192, 62670, 130000.0),
    # OLMo-2-1124-7B: 32 layers, 4096 hidden, 32/32 heads, intermediate 11008 (7.41 B)
    Shape("7b", "olmo2", 4096, 32, 32, 32, 11008, 113870, 500000.0),
)
# CPU smoke test: both layer kinds, grouped-query attention on one, the real vocabulary layout.
TINY = (
    Shape("tiny-llama", "llama", 64, 2, 4, 2, 128, vocab.TEXT_OFFSET + 64),
    Shape("tiny-olmo2", "olmo2", 64, 2, 4, 4, 128, vocab.TEXT_OFFSET + 64),
)


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


class StaticCacheBackbone(nn.Module):
    """A decode-only Llama / OLMo-2 body behind vLLM's backbone interface (`aux_inputs.Backbone`):
    one new token per row, at `slot` of a dense KV cache [layers, 2, rows, kv_heads, S, d] bound
    with `bind`. The write position is a device tensor, so a captured graph can be replayed."""

    def __init__(self, shape: Shape, device: torch.device, dtype: torch.dtype = torch.bfloat16, seed: int = 0):
        super().__init__()
        self.shape = shape
        gen = torch.Generator(device=device).manual_seed(seed)

        def rand(*size: int) -> torch.Tensor:
            # std 0.02 with RMS-normed inputs keeps every activation O(1): finite logits, no NaN
            return torch.empty(size, device=device, dtype=dtype).normal_(0.0, 0.02, generator=gen)

        def ones(n: int) -> torch.Tensor:
            return torch.ones(n, device=device, dtype=dtype)

        h, d, nh, nkv = shape.hidden, shape.head_dim, shape.heads, shape.kv_heads
        self.embed_tokens = nn.Embedding(shape.vocab_size, h, device=device, dtype=dtype)
        self.embed_tokens.weight.requires_grad_(False)
        with torch.no_grad():
            self.embed_tokens.weight.normal_(0.0, 0.02, generator=gen)
        self.layers = []
        for _ in range(shape.layers):
            w = {"qkv": rand((nh + 2 * nkv) * d, h), "o": rand(h, nh * d),
                 "gate_up": rand(2 * shape.intermediate, h), "down": rand(h, shape.intermediate),
                 "norm1": ones(h), "norm2": ones(h)}
            if shape.backbone == "olmo2":
                w["q_norm"], w["k_norm"] = ones(nh * d), ones(nkv * d)
            self.layers.append(w)
        self.norm = ones(h)
        self.lm_head = rand(shape.vocab_size, h)
        head_emb = rand(vocab.NUM_STREAMS, h)
        self.head_bias = heads.stream_bias(self.lm_head, head_emb)
        inv_freq = 1.0 / (shape.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64, device=device) / d))
        self._inv_freq = inv_freq.float()
        self.kv: torch.Tensor | None = None
        self.aux_fallback: str | None = None  # why opus_forward's embedding_bag did not capture, if it did not
        self.slot = torch.zeros(1, dtype=torch.int64, device=device)

    def bind(self, kv: torch.Tensor, position: int) -> None:
        """Decode into `kv` [layers, 2, rows, kv_heads, S, d] at `position` (< S) for every row."""
        self.kv = kv
        self.slot.fill_(position)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # neox style (rotate halves), as vLLM's Llama; x [rows, heads, d]
        freqs = positions[:, None].float() * self._inv_freq[None, :]
        cos, sin = freqs.cos()[:, None, :], freqs.sin()[:, None, :]
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)

    def _attention(self, i: int, w: dict, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        s = self.shape
        rows, d = x.shape[0], s.head_dim
        q, k, v = F.linear(x, w["qkv"]).split([s.heads * d, s.kv_heads * d, s.kv_heads * d], dim=-1)
        if s.backbone == "olmo2":
            q, k = _rms(q, w["q_norm"]), _rms(k, w["k_norm"])
        q = self._rope(q.reshape(rows, s.heads, d), positions)
        k = self._rope(k.reshape(rows, s.kv_heads, d), positions)
        k_cache, v_cache = self.kv[i, 0], self.kv[i, 1]  # [rows, kv_heads, S, d]
        k_cache.index_copy_(2, self.slot, k[:, :, None, :])
        v_cache.index_copy_(2, self.slot, v.reshape(rows, s.kv_heads, 1, d))
        out = F.scaled_dot_product_attention(q[:, :, None, :], k_cache, v_cache, enable_gqa=s.heads != s.kv_heads)
        return F.linear(out.reshape(rows, s.heads * d), w["o"])

    def _mlp(self, w: dict, x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x, w["gate_up"]).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, w["down"])

    def forward(self, input_ids, positions: torch.Tensor, intermediate_tensors, inputs_embeds: torch.Tensor) -> torch.Tensor:
        x = inputs_embeds
        for i, w in enumerate(self.layers):
            if self.shape.backbone == "olmo2":
                x = x + _rms(self._attention(i, w, x, positions), w["norm1"])
                x = x + _rms(self._mlp(w, x), w["norm2"])
            else:
                x = x + self._attention(i, w, _rms(x, w["norm1"]), positions)
                x = x + self._mlp(w, _rms(x, w["norm2"]))
        return _rms(x, self.norm)


def capture(fn: Callable[[], torch.Tensor], device: torch.device) -> Callable[[], torch.Tensor]:
    """`fn` captured in a CUDA graph: the returned callable replays it and returns its static output.
    Warm-up on a side stream first, as torch's docs and vLLM do. On a CPU: `fn` itself (eager)."""
    if device.type != "cuda":
        return fn
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()

    def replay() -> torch.Tensor:
        graph.replay()
        return out

    replay.graph = graph  # keeps the graph (and its memory pool) alive with the callable
    return replay


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_ms(fn: Callable[[], object], device: torch.device, iters: int, warmup: int = 2) -> float:
    """Median wall time of fn in ms, synchronised (warm-up first)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return float(np.median(times) * 1e3)


class DecodeStep:
    """One model's full decode step at `rows` rows: what the engine does per frame, minus vLLM."""

    SAMPLING = SamplingConfig(temperature=0.8, top_k=30)

    def __init__(self, model: StaticCacheBackbone, kv: torch.Tensor, context: int, rows: int, device: torch.device):
        self.model, self.rows, self.device = model, rows, device
        gen = np.random.default_rng(rows)
        self.aux = AuxInputs(rows, device)
        # the next step's aux ids (what stream_state gathers on the host) and stream-0 ids
        self.host_ids = gen.integers(vocab.DAC_OFFSET, heads.AUDIO_END, (rows, vocab.NUM_CODEBOOKS))
        self.input_ids = torch.from_numpy(gen.integers(vocab.SSL_OFFSET, vocab.DAC_OFFSET, rows)).to(device)
        self.positions = torch.full((rows,), context - 1, dtype=torch.int64, device=device)
        model.bind(kv[:, :, :rows], context - 1)
        self.aux.write(self.host_ids, rows)
        try:
            self.forward = capture(self._forward, device)
        except RuntimeError as e:
            # A capture failure is a finding about our forward (vLLM's FULL graphs would hit it
            # too): recorded, and the capacity numbers still measured with a plain gather-sum.
            if device.type != "cuda" or model.aux_fallback is not None or isinstance(e, torch.cuda.OutOfMemoryError):
                raise
            model.aux_fallback = f"{type(e).__name__}: {e}"
            self.forward = capture(self._forward, device)
        self.rules = np.full(rows, Stream0Rule.SSL_OR_EOS, dtype=np.int64)
        self.active = np.ones((rows, vocab.NUM_CODEBOOKS), dtype=bool)
        self.configs = [self.SAMPLING] * rows
        # CFG: rows 2j / 2j+1 are session j's conditional / unconditional rows
        self.mains, self.shadows = np.arange(0, rows - 1, 2), np.arange(1, rows, 2)
        self.scales = np.full(len(self.mains), 1.5, dtype=np.float32)

    def _forward(self) -> torch.Tensor:
        if self.model.aux_fallback is None:
            return opus_forward(self.model, self.aux, self.input_ids, self.positions)
        m = self.model
        embeds = m.embed_input_ids(self.input_ids) + m.embed_tokens.weight[self.aux.ids[: self.rows]].sum(dim=1)
        return m(None, self.positions, None, embeds)

    def eager_forward(self) -> torch.Tensor:
        return self._forward()

    def __call__(self, cfg: bool = False) -> np.ndarray:
        """aux upload -> forward (graph replay) -> compute_logits' work -> ids on the host."""
        self.aux.write(self.host_ids, self.rows)
        hidden = self.forward()
        rows = self.rows
        if cfg:  # as OpusLMForCausalLM._merge_pairs: the merge in hidden space, shadows not projected
            dev = hidden.device
            hidden = guidance.merge(
                hidden.index_select(0, torch.from_numpy(self.mains).to(dev)).float(),
                hidden.index_select(0, torch.from_numpy(self.shadows).to(dev)).float(),
                torch.from_numpy(self.scales).to(dev),
            ).to(hidden.dtype)
            rows = len(self.mains)
        logits = heads.project(hidden, self.model.lm_head, self.model.head_bias)
        codes = sample_rows(heads.aux_logits(logits), self.configs[:rows], [None] * rows)
        aux = heads.aux_ids(codes.cpu().numpy(), self.active[:rows])
        tok0 = sample_rows(heads.stream0_logits_(logits, self.rules[:rows]), self.configs[:rows], [None] * rows)
        return np.concatenate([tok0.cpu().numpy()[:, None], aux], axis=1)


def largest_fitting(candidates: list[int], fits: Callable[[int], bool]) -> int:
    """The largest candidate (ascending list) for which `fits` holds, assuming fits is monotone
    (true up to some size, false after); 0 if none. Probes the ends first, then bisects."""
    if not candidates or not fits(candidates[0]):
        return 0
    if fits(candidates[-1]):
        return candidates[-1]
    lo, hi = 0, len(candidates) - 1  # fits(lo), not fits(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(candidates[mid]):
            lo = mid
        else:
            hi = mid
    return candidates[lo]


@dataclass
class SweepConfig:
    shapes: tuple[Shape, ...]
    contexts: tuple[int, ...]
    max_rows: int
    iters: int
    budget_ms: float = STEP_BUDGET_MS
    reserve_gib: float = 6.0  # left free on a GPU: the codec (DAC + XEUS), activations, graphs
    deadline: float = math.inf  # time.perf_counter() after which no new probe starts


def _rows_in_memory(shape: Shape, context: int, cfg: SweepConfig, device: torch.device) -> int:
    if device.type != "cuda":
        return cfg.max_rows
    free, _ = torch.cuda.mem_get_info(device)
    per_row = shape.kv_bytes_per_token() * context
    return max(0, min(cfg.max_rows, int((free - cfg.reserve_gib * GIB) // per_row)))


def _probe(model: StaticCacheBackbone, kv: torch.Tensor, context: int, rows: int, device: torch.device,
           iters: int, check_replay: bool) -> dict:
    """One batch size: the step's median ms without and with CFG (its graph is freed on return)."""
    step = DecodeStep(model, kv, context, rows, device)
    point: dict = {"rows": rows, "step_ms": median_ms(step, device, iters)}
    if rows >= 2:
        point["step_cfg_ms"] = median_ms(lambda: step(cfg=True), device, iters)
    point["finite"] = bool(torch.isfinite(step.forward()).all())
    if check_replay:
        # the captured step against the same step run eagerly (same inputs, same cache): the same
        # kernels give 0; a different GEMM algorithm under capture, bf16 rounding only
        want = step.eager_forward()
        diff = float((step.forward() - want).abs().max())
        point["replay_rel_diff"] = diff / max(float(want.abs().max()), 1e-6)
    return point


def _context_sweep(model: StaticCacheBackbone, context: int, cfg: SweepConfig, device: torch.device,
                   check_replay: bool) -> dict:
    shape = model.shape
    in_memory = _rows_in_memory(shape, context, cfg, device)
    candidates = [b for b in CAPTURE_SIZES if b <= in_memory]
    out: dict = {"context": context, "kv_gib_per_session": shape.kv_bytes_per_token() * context / GIB,
                 "rows_in_memory": in_memory, "points": []}
    if not candidates:
        out.update(rows=0, sessions=0, sessions_cfg=0, limited_by="memory")
        return out
    kv = None
    while candidates and kv is None:
        try:
            kv = torch.empty((shape.layers, 2, candidates[-1], shape.kv_heads, context, shape.head_dim),
                             device=device, dtype=model.lm_head.dtype)
        except torch.cuda.OutOfMemoryError:  # fragmentation: the arithmetic said it would fit
            candidates.pop()
    if kv is None:
        out.update(rows=0, sessions=0, sessions_cfg=0, limited_by="memory")
        return out
    kv.normal_()  # keys and values of O(1), as RMS-normed projections give
    measured: dict[int, dict] = {}

    def measure(rows: int) -> dict:
        if rows in measured:
            return measured[rows]
        if time.perf_counter() > cfg.deadline:
            raise TimeoutError("the time budget ran out")
        try:
            point = _probe(model, kv, context, rows, device, cfg.iters, check_replay and not measured)
        except torch.cuda.OutOfMemoryError:  # activations or graph pool: this many rows do not fit
            point = {"rows": rows, "step_ms": math.inf, "step_cfg_ms": math.inf, "finite": True, "oom": True}
            if device.type == "cuda":
                torch.cuda.empty_cache()
        measured[rows] = point
        out["points"].append(point)
        return point

    try:
        rows = largest_fitting(candidates, lambda b: measure(b)["step_ms"] <= cfg.budget_ms)
        even = [b for b in candidates if b >= 2]
        rows_cfg = largest_fitting(even, lambda b: measure(b)["step_cfg_ms"] <= cfg.budget_ms)
    except TimeoutError as e:
        out.update(rows=None, sessions=None, sessions_cfg=None, limited_by=f"not measured: {e}")
        return out
    finally:
        model.kv = kv = None  # the last step's view and the cache: freed here
        if device.type == "cuda":
            torch.cuda.empty_cache()
    limited = "step time" if rows < candidates[-1] else ("memory" if candidates[-1] < cfg.max_rows else "batch cap")
    out.update(rows=rows, sessions=rows, sessions_cfg=rows_cfg // 2, limited_by=limited)
    return out


def sweep(cfg: SweepConfig, device: torch.device) -> dict:
    """Per shape and context: the probed step times and the sessions that fit the step budget."""
    result: dict = {
        "measured": "backbone decode step (plain torch, SDPA over a static KV cache, CUDA-graphed on CUDA) "
                    "+ our additions (aux upload, 9-stream embedding, CFG merge, audio-rows head, aux and "
                    "stream-0 sampling, host read-back)",
        "not_included": "vLLM's scheduler and input preparation, its paged-attention kernels, its stream-0 "
                        "sampler, the codec stage on the same GPU, prefill of arriving sessions: the step is a "
                        "lower bound on vLLM's, the sessions an upper bound",
        "budget_ms": cfg.budget_ms, "frame_ms": FRAME_MS, "batch_sizes": list(CAPTURE_SIZES),
        "reserve_gib": cfg.reserve_gib if device.type == "cuda" else None,
        "sdpa_backends": [b.name for b in SDPA_BACKENDS], "models": {},
    }
    ok = True
    with torch.inference_mode(), sdpa_kernel(SDPA_BACKENDS):
        for shape in cfg.shapes:
            if time.perf_counter() > cfg.deadline:
                result["models"][shape.name] = {"skipped": "the time budget ran out"}
                continue
            t0 = time.perf_counter()
            model = StaticCacheBackbone(shape, device)
            entry: dict = {"backbone": shape.backbone, "params_b": shape.params() / 1e9,
                           "kv_kib_per_token": shape.kv_bytes_per_token() / 1024, "contexts": []}
            for i, context in enumerate(cfg.contexts):
                try:
                    c = _context_sweep(model, context, cfg, device, check_replay=i == 0)
                except Exception as e:  # keep the other contexts' numbers from a scarce GPU run
                    c = {"context": context, "error": f"{type(e).__name__}: {e}", "points": [],
                         "rows_in_memory": None, "sessions": None, "sessions_cfg": None, "limited_by": "error"}
                    ok = False
                entry["contexts"].append(c)
                ok &= all(p["finite"] for p in c["points"])
                ok &= all(p.get("replay_rel_diff", 0.0) <= 2e-2 for p in c["points"])
            entry["aux_embedding"] = ("embedding_bag (opus_forward)" if model.aux_fallback is None
                                      else f"gather-sum: opus_forward did not capture ({model.aux_fallback})")
            ok &= model.aux_fallback is None
            entry["seconds"] = round(time.perf_counter() - t0, 1)
            result["models"][shape.name] = entry
            del model
            if device.type == "cuda":
                torch.cuda.empty_cache()
    result["ok"] = bool(ok)
    return result


def format_table(result: dict) -> list[str]:
    """The step check as printed lines: one per model and context."""
    lines = [f"step: sessions per GPU whose decode step fits {result['budget_ms']:.0f} ms of the "
             f"{result['frame_ms']:.0f} ms frame",
             f"  measured: {result['measured']}",
             f"  NOT included: {result['not_included']}",
             f"  {'model':<14} {'context':>7} {'rows in mem':>11} {'sessions':>8} {'with CFG':>8}  "
             f"{'limited by':<11} step ms at rows (CFG)"]
    for name, entry in result["models"].items():
        if "skipped" in entry:
            lines.append(f"  {name:<14} skipped: {entry['skipped']}")
            continue
        lines.append(f"  {name:<14} {entry['backbone']}, {entry['params_b']:.2f} B params, KV "
                     f"{entry['kv_kib_per_token']:.0f} KiB/token, aux embedding {entry['aux_embedding']}, "
                     f"{entry['seconds']} s")
        for c in entry["contexts"]:
            probes = " ".join(
                f"{p['rows']}:{p['step_ms']:.2f}" + (f"({p['step_cfg_ms']:.2f})" if "step_cfg_ms" in p else "")
                for p in sorted(c["points"], key=lambda p: p["rows"]))
            lines.append(f"  {name:<14} {c['context']:>7} {_n(c['rows_in_memory']):>11} {_n(c['sessions']):>8} "
                         f"{_n(c['sessions_cfg']):>8}  {c['limited_by']:<11} {c.get('error', probes)}")
    return lines


def _n(v) -> str:
    return "-" if v is None else str(v)
