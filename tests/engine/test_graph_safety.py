"""The OpusLM forward is graph-safe: a pure function of its arguments and the persistent aux-id
buffer (engine/vllm_plugin/aux_inputs.py), so a captured graph replayed with new buffer contents
computes this step, not the captured one.

CPU has no CUDA graphs; what it can show is the same property through torch.compile: one graph
(fullgraph=True: no break), traced once, replayed with new buffer contents (and new input ids in
the same tensor, as vLLM's persistent input_ids buffer does), equal to eager every time. And the
real engine with `enforce_eager=False` (vLLM compiles the backbone) equals the reference, which
the eager engine equals (test_vllm_engine.py), token for token.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch
from torch._dynamo.backends.registry import lookup_backend

from engine import vocab
from engine.prompt import synthetic_prompt
from engine.reference import ReferenceBackbone, ReferenceOpusLM, _KVCache
from engine.request import AudioRequest
from engine.sampling import GREEDY
from engine.vllm_plugin.aux_inputs import AuxInputs, opus_forward
from engine.vllm_plugin.stream_state import StepBatch, StreamStateStore

PADDED = 64  # a CUDA-graph batch size: every replay runs at this shape


@pytest.fixture(scope="module")
def ref(tiny_model):
    return ReferenceOpusLM.from_dir(tiny_model)


class _Forward(torch.nn.Module):
    """opus_forward over the reference's Llama layers, bound to one buffer (as the model is)."""

    def __init__(self, ref: ReferenceOpusLM, aux: AuxInputs) -> None:
        super().__init__()
        self.backbone = ReferenceBackbone(ref)
        self.aux = aux

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return opus_forward(self.backbone, self.aux, input_ids, positions)


def _stage(rows: np.ndarray, input_ids: torch.Tensor, aux: AuxInputs) -> int:
    """What the runner does before a step: stream 0 into the (persistent) input ids, streams 1-8
    into the aux buffer, PAD in the padding. Returns the number of real tokens."""
    n = len(rows)
    input_ids.zero_()
    input_ids[:n] = torch.from_numpy(rows[:, 0])
    aux.write(rows[:, 1:], PADDED)
    return n


class _Recorder:
    """A torch.compile backend (aot_eager underneath: exact) that keeps each graph's inputs."""

    def __init__(self) -> None:
        self.graphs = 0
        self.inputs: list[torch.Tensor] = []

    def __call__(self, gm, example_inputs):
        self.graphs += 1
        self.inputs += [t for t in example_inputs if isinstance(t, torch.Tensor)]
        return lookup_backend("aot_eager")(gm, example_inputs)


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


@torch.inference_mode()
def test_compiled_forward_is_one_graph_and_replays_new_buffer_contents(ref) -> None:
    aux = AuxInputs(128, "cpu")
    fwd = _Forward(ref, aux)
    recorder = _Recorder()
    compiled = torch.compile(fwd, backend=recorder, fullgraph=True)
    input_ids = torch.zeros(PADDED, dtype=torch.int64)  # persistent, like vLLM's
    positions = torch.arange(PADDED)

    previous = None
    for i in range(4):  # trace at i = 0, then three replays with new contents and lengths
        rows = synthetic_prompt(i, 30)[:PADDED]
        n = _stage(rows, input_ids, aux)
        got = compiled(input_ids, positions)
        want = fwd(input_ids, positions)  # eager
        assert torch.equal(got, want), f"replay {i}: compiled != eager"
        # the meaning of the contract: the summed 9-stream embedding of the rows, then the layers
        oracle = ref.forward(ref.embed(rows), 0, _KVCache(ref.cfg.num_hidden_layers))
        torch.testing.assert_close(got[:n], oracle, rtol=1e-4, atol=1e-4)
        if previous is not None:  # it read the new buffer, not the one it was traced with
            assert not torch.equal(got[:n], previous[:n])
        previous = got
    assert recorder.graphs == 1, "the forward was traced more than once (or broke)"
    # What a CUDA graph would read at replay: the arguments, the weights and the aux buffer --
    # nothing made from host state during the trace (that would be a frozen copy on a GPU).
    allowed = {_storage(t) for t in [input_ids, positions, aux.ids, ref._inv_freq, *ref.w.values()]}
    read = {_storage(t) for t in recorder.inputs}
    assert _storage(aux.ids) in read
    assert read <= allowed, f"{len(read - allowed)} graph input(s) besides arguments, weights and buffer"


@torch.inference_mode()
def test_only_the_aux_buffer_changes_and_the_output_follows(ref) -> None:
    """Same stream-0 ids, a new aux buffer: the compiled output changes exactly as eager's --
    the aux ids enter through the buffer alone (nothing captured at trace time)."""
    aux = AuxInputs(128, "cpu")
    fwd = _Forward(ref, aux)
    compiled = torch.compile(fwd, backend="aot_eager", fullgraph=True)
    input_ids = torch.zeros(PADDED, dtype=torch.int64)
    positions = torch.arange(PADDED)
    rows = synthetic_prompt(0, 30)[:PADDED]
    n = _stage(rows, input_ids, aux)
    first = compiled(input_ids, positions)
    rng = np.random.default_rng(0)
    rows2 = rows.copy()
    rows2[:, 1:] = vocab.DAC_OFFSET + rng.integers(0, vocab.CODEBOOK_SIZE, size=rows2[:, 1:].shape)
    aux.write(rows2[:, 1:], PADDED)
    second = compiled(input_ids, positions)
    assert not torch.equal(first[:n], second[:n])
    assert torch.equal(second, fwd(input_ids, positions))


def test_gather_aux_writes_rows_by_position_and_pads_the_rest() -> None:
    from engine.request import WorkerRequestSpec

    store = StreamStateStore()
    prompts = {"a": synthetic_prompt(0, 6), "b": synthetic_prompt(1, 6)}
    for rid, p in prompts.items():
        store.add(rid, WorkerRequestSpec(prompt_aux=p[:, 1:], min_frames=1, max_frames=4), GREEDY, torch.device("cpu"))
    # b: a 3-token chunk from position 2; a: one decode-like token at its last prompt position
    la = len(prompts["a"])
    batch = StepBatch(["b", "a"], np.array([0, 3, 4]), np.array([2, la - 1]), np.zeros(2, bool))
    out = np.full((8, vocab.NUM_CODEBOOKS), 777, dtype=np.int64)
    store.gather_aux(batch, out)
    np.testing.assert_array_equal(out[:3], prompts["b"][2:5, 1:])
    np.testing.assert_array_equal(out[3], prompts["a"][la - 1, 1:])
    assert (out[4:] == vocab.PAD).all()


@pytest.mark.vllm
def test_compiled_engine_equals_eager_token_for_token(loop_thread, engine_factory, tiny_model, ref) -> None:
    """enforce_eager=False on a CPU: ragged prompts, a late arrival (prefill beside decodes) and
    KV pressure that preempts and recomputes, greedy; every request equals the reference."""
    from vllm.config import CompilationMode

    engine = engine_factory(
        model=str(tiny_model), enforce_eager=False, block_size=128, max_num_seqs=8, num_kv_blocks=5,
        max_model_len=512, log_stats=True,
    )
    try:
        assert engine._llm.vllm_config.compilation_config.mode != CompilationMode.NONE
        reqs = [
            AudioRequest(synthetic_prompt(i, 100), max_frames=40 + 9 * i, min_frames=40 + 9 * i if i % 2 else 1,
                         sampling=GREEDY)
            for i in range(7)
        ]

        async def run():
            first = [asyncio.ensure_future(engine.generate(r)) for r in reqs[:6]]
            await asyncio.sleep(0.3)  # the last arrives while the others decode
            return await asyncio.gather(*first, engine.generate(reqs[6]))

        gens = loop_thread.run(run())
    finally:
        engine.shutdown()
    assert sum(g.num_preemptions for g in gens) > 0, "KV pressure did not preempt anything"
    assert len({g.steps.shape[0] for g in gens}) >= 3, "the batch should be ragged"
    for i, (req, gen) in enumerate(zip(reqs, gens)):
        want = ref.generate(req).steps
        assert np.array_equal(gen.steps, want), f"request {i}: compiled engine != reference"
