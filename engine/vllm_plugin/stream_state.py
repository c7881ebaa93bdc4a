"""Per-request state of the auxiliary streams (1-8), kept in the worker next to the model.

vLLM's sequence holds stream 0 only. For every position of a request we keep the 8 aux ids that
position carries, keyed by request id and position -- never by batch row, since rows move every
step. Prompt positions come from the request; position P+s gets the aux sampled at generated
step s. Because history is kept by position, a preempted request that vLLM recomputes from its
stream-0 tokens, or a prompt prefilled in chunks, reads back exactly what it had.

All of this is numpy on the host: it runs once per step for the whole batch, before the forward;
the forward itself reads only the device copy the runner makes of `gather_aux` (aux_inputs.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from engine import delay, guidance, heads, modality, vocab
from engine.request import WorkerRequestSpec
from engine.sampling import SamplingConfig


@dataclass
class RequestStreams:
    """One request's aux history and generation state."""

    prompt_len: int
    min_frames: int
    max_frames: int
    sampling: SamplingConfig
    generator: torch.Generator | None
    aux: np.ndarray  # [capacity, 8] aux ids by position; rows < num_positions are valid
    num_positions: int  # positions whose aux is known (prompt + generated steps)
    eos_step: int = delay.NO_EOS
    cfg_scale: float = 1.0  # CFG weight of a main request (1: no guidance)
    shadow_of: str | None = None  # a CFG shadow: its main's id (it samples nothing itself)
    # the text phase (engine/modality.py): the step the audio segment starts at (NOT_SWITCHED while a
    # text-first request writes text), the text's EOS block and cap, whether it may switch to audio,
    # and stream 0's text sampling (the engine draws text itself)
    audio_start: int = 0
    min_text: int = 0
    max_text: int = 0
    switch: bool = False
    text_sampling: SamplingConfig | None = None
    text_generator: torch.Generator | None = None
    carry: np.ndarray | None = None  # [8, 8]: a continued segment's warm-up (heads.carry_fill)

    def append(self, ids: np.ndarray) -> None:
        if self.num_positions == self.aux.shape[0]:
            grown = np.zeros((2 * self.aux.shape[0], vocab.NUM_CODEBOOKS), dtype=np.int64)
            grown[: self.num_positions] = self.aux
            self.aux = grown
        self.aux[self.num_positions] = ids
        self.num_positions += 1


@dataclass
class StepBatch:
    """The rows of one forward, published by the runner before the model runs.

    Row r covers positions [start[r], start[r] + num_tokens[r]) of request req_ids[r]; its logits
    are those of its last position. `discard[r]`: a partial prefill whose sample vLLM discards.
    """

    req_ids: list[str]
    query_start_loc: np.ndarray  # [rows + 1]
    start: np.ndarray  # [rows]
    discard: np.ndarray  # [rows] bool

    @property
    def num_rows(self) -> int:
        return len(self.req_ids)

    @property
    def num_tokens(self) -> np.ndarray:
        return np.diff(self.query_start_loc)


@dataclass
class StepPlan:
    """What the heads do for each row of a step (computed before the logits)."""

    rules: np.ndarray  # [rows] Stream0Rule (audio rows)
    active: np.ndarray  # [rows, 8] aux stream samples (else PAD)
    commit: np.ndarray  # [rows] bool: this row produces a new step
    audio_steps: np.ndarray | None = None  # [rows] generated steps counted from each row's audio start
    text: np.ndarray | None = None  # [rows] bool: in a text phase (None: no row is)
    text_rules: np.ndarray | None = None  # [rows] modality.TextRule (text rows)
    switch: np.ndarray | None = None  # [rows] bool: the text phase may switch to audio


@dataclass
class CfgPairs:
    """The CFG pairs of one step, by batch row: main_rows[i] is guided by shadow_rows[i]."""

    main_rows: np.ndarray  # [pairs] int64
    shadow_rows: np.ndarray  # [pairs] int64
    scales: np.ndarray  # [pairs] float32, w of each pair

    def __len__(self) -> int:
        return len(self.main_rows)


NO_PAIRS = CfgPairs(np.empty(0, np.int64), np.empty(0, np.int64), np.empty(0, np.float32))


@dataclass
class StreamStateStore:
    requests: dict[str, RequestStreams] = field(default_factory=dict)
    step_aux: dict[str, np.ndarray] = field(default_factory=dict)  # aux committed this step
    num_cfg: int = 0  # live CFG mains and shadows (0: a step needs no pair lookup)
    num_text_first: int = 0  # live text-first requests (0: every step is the audio segments' own)
    num_carry: int = 0  # live continued segments (0: inactive aux streams are PAD)

    def add(self, req_id: str, spec: WorkerRequestSpec, sampling: SamplingConfig, device: torch.device) -> None:
        if req_id in self.requests:  # resumed after preemption: history is by position, keep it
            return
        prompt_len = spec.prompt_aux.shape[0]
        aux = np.zeros((max(64, 2 * (prompt_len + spec.max_frames)), vocab.NUM_CODEBOOKS), dtype=np.int64)
        aux[:prompt_len] = spec.prompt_aux
        text_first = spec.start_modality == vocab.TEXT_BPE
        text_sampling = None
        if text_first:
            t, k, p = spec.text_sampling or (sampling.temperature, sampling.top_k, sampling.top_p)
            text_sampling = SamplingConfig(temperature=t, top_k=k, top_p=p, seed=sampling.seed)
        self.requests[req_id] = RequestStreams(
            prompt_len=prompt_len,
            min_frames=spec.min_frames,
            max_frames=spec.max_frames,
            sampling=sampling,
            generator=sampling.aux_generator(device),
            aux=aux,
            num_positions=prompt_len,
            cfg_scale=spec.cfg_scale,
            shadow_of=spec.shadow_of,
            audio_start=modality.NOT_SWITCHED if text_first else 0,
            min_text=spec.min_text,
            max_text=spec.max_text,
            switch=spec.switch,
            text_sampling=text_sampling,
            text_generator=text_sampling.text_generator(device) if text_sampling else None,
            carry=spec.carry,
        )
        if spec.shadow_of is not None or guidance.uses_cfg(spec.cfg_scale):
            self.num_cfg += 1
        self.num_text_first += text_first
        self.num_carry += spec.carry is not None

    def remove(self, req_id: str) -> None:
        st = self.requests.pop(req_id, None)
        if st is None:
            return
        if st.shadow_of is not None or guidance.uses_cfg(st.cfg_scale):
            self.num_cfg -= 1
        self.num_text_first -= st.text_sampling is not None
        self.num_carry -= st.carry is not None

    def cfg_pairs(self, batch: StepBatch, plan: StepPlan) -> CfgPairs:
        """This step's pairs; raises if a pair is split or its rows are not at the same position
        (the scheduler's pair invariants, checked again where a violation would do harm)."""
        if not self.num_cfg:
            return NO_PAIRS
        row_of = {rid: r for r, rid in enumerate(batch.req_ids)}
        next_pos = batch.start + batch.num_tokens
        mains, shadows, scales = [], [], []
        for r, rid in enumerate(batch.req_ids):
            st = self.requests[rid]
            if st.shadow_of is not None:
                m = row_of.get(st.shadow_of)
                if m is None:
                    raise RuntimeError(f"CFG pair split: shadow {rid} scheduled without its main")
                if next_pos[m] != next_pos[r] or plan.commit[m] != plan.commit[r]:
                    raise RuntimeError(
                        f"CFG pair {st.shadow_of}: main at position {next_pos[m]}, shadow at {next_pos[r]}"
                    )
                mains.append(m)
                shadows.append(r)
                scales.append(self.requests[st.shadow_of].cfg_scale)
            elif guidance.uses_cfg(st.cfg_scale) and guidance.shadow_id(rid) not in row_of:
                raise RuntimeError(f"CFG pair split: main {rid} scheduled without its shadow")
        if not mains:
            return NO_PAIRS
        return CfgPairs(np.array(mains, np.int64), np.array(shadows, np.int64), np.array(scales, np.float32))

    def gather_aux(self, batch: StepBatch, out: np.ndarray) -> None:
        """Write every scheduled token's 8 aux ids into `out` [padded tokens, 8] (the runner's
        view of the model's persistent buffer, aux_inputs.py); tokens past the batch's (a CUDA
        graph's padding) get PAD."""
        qsl = batch.query_start_loc
        for r, req_id in enumerate(batch.req_ids):
            st = self.requests[req_id]
            a, n = int(batch.start[r]), int(qsl[r + 1] - qsl[r])
            if a + n > st.num_positions:
                raise RuntimeError(
                    f"request {req_id}: positions [{a}, {a + n}) scheduled but aux known for "
                    f"{st.num_positions} only"
                )
            out[qsl[r] : qsl[r + 1]] = st.aux[a : a + n]
        out[int(qsl[-1]) :] = vocab.PAD

    def plan(self, batch: StepBatch) -> StepPlan:
        states = [self.requests[r] for r in batch.req_ids]
        next_pos = batch.start + batch.num_tokens  # position whose tokens this step samples
        prompt_len = np.array([s.prompt_len for s in states], dtype=np.int64)
        known = np.array([s.num_positions for s in states], dtype=np.int64)
        eos = np.array([s.eos_step for s in states], dtype=np.int64)
        steps = next_pos - prompt_len
        commit = ~batch.discard & (steps >= 0) & (next_pos == known)
        min_frames, max_frames = np.array([s.min_frames for s in states]), np.array([s.max_frames for s in states])
        if not self.num_text_first:  # every row's audio started with its generation: the steps are the segment's
            rules = delay.stream0_rules(steps, eos, min_frames, max_frames)
            return StepPlan(rules=rules, active=delay.aux_active(steps, eos), commit=commit, audio_steps=steps)
        audio_start = np.array([s.audio_start for s in states], dtype=np.int64)
        text = audio_start == modality.NOT_SWITCHED
        a_steps, a_eos = modality.audio_steps(steps, audio_start, eos)
        rules = delay.stream0_rules(a_steps, a_eos, min_frames, max_frames)
        active = delay.aux_active(a_steps, a_eos) & ~text[:, None]
        if not text.any():
            return StepPlan(rules=rules, active=active, commit=commit, audio_steps=a_steps)
        switch = np.array([s.switch for s in states], dtype=bool)
        text_rules = modality.text_rules(steps, np.array([s.min_text for s in states]),
                                         np.array([s.max_text for s in states]), switch)
        return StepPlan(rules=rules, active=active, commit=commit, audio_steps=a_steps, text=text,
                        text_rules=text_rules, switch=switch)

    def commit(self, batch: StepBatch, plan: StepPlan, ids: np.ndarray) -> None:
        """Record the aux ids [n_commit, 8] sampled for the committing rows of this step."""
        self.step_aux = {}
        for j, r in enumerate(np.nonzero(plan.commit)[0]):
            req_id = batch.req_ids[r]
            self.requests[req_id].append(ids[j])
            self.step_aux[req_id] = ids[j]

    def record_stream0(self, req_id: str, token: int) -> None:
        """Stream 0's sampled token of this step (known only after vLLM's sampler ran)."""
        st = self.requests.get(req_id)
        if st is None or req_id not in self.step_aux:
            return
        step = st.num_positions - 1 - st.prompt_len
        if st.audio_start == modality.NOT_SWITCHED:
            if token == modality.SWITCH_TOKEN:
                st.audio_start = step + 1
        elif token == vocab.SOS_EOS and st.eos_step == delay.NO_EOS:
            st.eos_step = step

    def text_sampling_rows(self, batch: StepBatch, rows: np.ndarray) -> tuple[list[SamplingConfig], list[torch.Generator | None]]:
        states = [self.requests[batch.req_ids[r]] for r in rows]
        configs = [s.text_sampling for s in states if s.text_sampling is not None]
        if len(configs) != len(states):  # only a text-first request has a text phase
            raise RuntimeError("a text-phase row of a request that does not start with text")
        return configs, [s.text_generator for s in states]

    def aux_fill(self, batch: StepBatch, rows: np.ndarray, audio_steps: np.ndarray) -> np.ndarray | int:
        """What the inactive aux streams of `rows` hold this step (heads.carry_fill): PAD unless a row
        continues a segment and is in its warm-up."""
        if not self.num_carry:
            return vocab.PAD
        states = [self.requests[batch.req_ids[r]] for r in rows]
        return np.stack([np.broadcast_to(heads.carry_fill(s.carry, int(a)), (vocab.NUM_CODEBOOKS,))
                         for s, a in zip(states, audio_steps)])

    def sampling_rows(self, batch: StepBatch, rows: np.ndarray) -> tuple[list[SamplingConfig], list[torch.Generator | None]]:
        states = [self.requests[batch.req_ids[r]] for r in rows]
        return [s.sampling for s in states], [s.generator for s in states]
