"""Delay-pattern bookkeeping for the 9 OpusLM streams: pure functions, no torch.

Step t of a delayed sequence carries stream k's code of frame t-k (stream k lags k steps).
A segment of T frames therefore occupies T + 8 steps, the missing corners filled with PAD.

Generation of an audio segment (step s counted from the segment's first generated step):

    s < F              stream 0: SSL of frame s (or EOS, which fixes F = s)
    s == F             stream 0: EOS                      streams k: frame s-k (if s-k >= 0)
    F < s < F+7        stream 0: PAD (flush)              streams k: frame s-k while s-k < F
    s == F+7           stream 0: ENGINE_STOP              stream 8: frame F-1, others PAD
    streams k at s < k (warm-up) and at s-k >= F (flush) are PAD.

So F frames take F + 8 steps, and the step that completes the last frame is the one that stops
the request. ESPnet's loop (ar_delay.py::ARDelayLM.inference, jctian98/espnet@42e484b6) runs to step
F+9 and starts its forced flush one step late; the PAD from step F+1 on is its training layout's
(engine/README.md, "Generation", has the comparison and the commits).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum

import numpy as np
import numpy.typing as npt

from engine import vocab

NUM_STREAMS = vocab.NUM_STREAMS
MAX_DELAY = NUM_STREAMS - 1  # stream 8 lags 8 steps
# Steps from the EOS step (inclusive) to the step that completes the last frame (inclusive).
FLUSH_STEPS = MAX_DELAY
_DELAYS = np.arange(NUM_STREAMS)


def interleave(frames: np.ndarray, pad: int = vocab.PAD) -> np.ndarray:
    """Frames [T, 9] -> delayed steps [T + 8, 9]: out[t, k] = frames[t - k, k], else `pad`."""
    frames = _check_frames(frames)
    num_frames = frames.shape[0]
    out = np.full((num_frames + MAX_DELAY, NUM_STREAMS), pad, dtype=frames.dtype)
    for k in range(NUM_STREAMS):
        out[k : k + num_frames, k] = frames[:, k]
    return out


def deinterleave(steps: np.ndarray) -> np.ndarray:
    """Delayed steps [S, 9] (S >= 8) -> frames [S - 8, 9]: out[t, k] = steps[t + k, k]."""
    steps = _check_frames(steps)
    num_frames = steps.shape[0] - MAX_DELAY
    if num_frames < 0:
        raise ValueError(f"{steps.shape[0]} steps hold no complete frame (need >= {MAX_DELAY})")
    out = np.empty((num_frames, NUM_STREAMS), dtype=steps.dtype)
    for k in range(NUM_STREAMS):
        out[:, k] = steps[k : k + num_frames, k]
    return out


def segment_frames(steps: np.ndarray) -> np.ndarray:
    """The frames of generated steps [S, 9]: de-interleaved, cut at stream 0's EOS (what a
    `FrameAssembler` fed the same steps has emitted, computed at once)."""
    steps = _check_frames(steps)
    if steps.shape[0] <= MAX_DELAY:
        return np.empty((0, NUM_STREAMS), dtype=np.int64)
    frames = deinterleave(steps.astype(np.int64, copy=False))
    eos = np.flatnonzero(steps[:, 0] == vocab.SOS_EOS)
    return frames[: eos[0]] if len(eos) else frames


def _check_frames(a: np.ndarray) -> np.ndarray:
    a = np.asarray(a)
    if a.ndim != 2 or a.shape[1] != NUM_STREAMS:
        raise ValueError(f"expected an array [T, {NUM_STREAMS}], got shape {a.shape}")
    return a


# --- what each stream may emit at a generated step -------------------------------------------


class Stream0Rule(IntEnum):
    """What stream 0 may emit at one step of an audio segment."""

    SSL = 0  # an SSL cluster only (EOS not yet allowed)
    SSL_OR_EOS = 1  # an SSL cluster or EOS
    FORCE_EOS = 2  # the frame cap is reached
    FORCE_PAD = 3  # delay flush
    FORCE_STOP = 4  # last flush step: ends the request


NO_EOS = -1  # eos_step value while stream 0 has not emitted EOS


def stream0_rules(
    steps: npt.ArrayLike, eos_steps: npt.ArrayLike, min_frames: npt.ArrayLike, max_frames: npt.ArrayLike
) -> np.ndarray:
    """Stream0Rule per row for generated steps `steps` (vectorised over a batch of rows).

    `eos_steps` is the step at which stream 0 emitted EOS, or NO_EOS; `min_frames` blocks EOS
    before that many frames, `max_frames` forces it at that many.
    """
    steps, eos_steps = np.asarray(steps), np.asarray(eos_steps)
    rules = np.where(steps >= np.asarray(min_frames), Stream0Rule.SSL_OR_EOS, Stream0Rule.SSL)
    rules = np.where(steps >= np.asarray(max_frames), Stream0Rule.FORCE_EOS, rules)
    ended = eos_steps != NO_EOS
    rules = np.where(ended & (steps > eos_steps), Stream0Rule.FORCE_PAD, rules)
    rules = np.where(ended & (steps >= eos_steps + FLUSH_STEPS - 1), Stream0Rule.FORCE_STOP, rules)
    return rules.astype(np.int8)


def aux_active(steps: np.ndarray, eos_steps: np.ndarray) -> np.ndarray:
    """[rows, 8] bool: stream k (1..8) samples its codebook at this step; False = forced PAD.

    Stream k is PAD during warm-up (step < k) and once its frame (step - k) is past the EOS frame.
    """
    steps = np.asarray(steps)[:, None]
    eos_steps = np.asarray(eos_steps)[:, None]
    k = _DELAYS[None, 1:]
    frame = steps - k
    return (frame >= 0) & ((eos_steps == NO_EOS) | (frame < eos_steps))


# --- incremental de-interleaving of a generated segment --------------------------------------


@dataclass
class FrameAssembler:
    """Turns generated steps (9 tokens each, in order) into complete frames as soon as they are.

    After step s arrives, frame s - 8 is complete. Frames past the EOS frame are never emitted,
    and the assembler reports `done` once the step that completes the last frame has arrived.
    """

    steps: list[np.ndarray] = field(default_factory=list)
    num_emitted: int = 0
    num_frames: int | None = None  # set when stream 0 emits EOS

    def push(self, step_tokens: np.ndarray) -> np.ndarray:
        """Add one step [9]; return the frames [n, 9] it completes (n is 0 or 1)."""
        step_tokens = np.asarray(step_tokens)
        if step_tokens.shape != (NUM_STREAMS,):
            raise ValueError(f"a step is {NUM_STREAMS} tokens, got shape {step_tokens.shape}")
        s = len(self.steps)
        self.steps.append(step_tokens)
        if self.num_frames is None and step_tokens[0] == vocab.SOS_EOS:
            self.num_frames = s
        frame = s - MAX_DELAY
        limit = self.num_frames if self.num_frames is not None else frame + 1
        if frame < 0 or frame >= limit:
            return np.empty((0, NUM_STREAMS), dtype=np.int64)
        out = np.array([self.steps[frame + k][k] for k in range(NUM_STREAMS)], dtype=np.int64)
        self.num_emitted += 1
        return out[None, :]

    @property
    def done(self) -> bool:
        return self.num_frames is not None and self.num_emitted >= self.num_frames

    def frames(self) -> np.ndarray:
        """All complete frames so far, [n, 9]."""
        if len(self.steps) <= MAX_DELAY:
            return np.empty((0, NUM_STREAMS), dtype=np.int64)
        out = deinterleave(np.stack(self.steps).astype(np.int64))
        return out[: self.num_emitted]
