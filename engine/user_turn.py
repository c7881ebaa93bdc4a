"""The user's open turn in a conversation: its tokenizer state, its frames so far, its prefill progress."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from engine import vocab

if TYPE_CHECKING:
    from engine.codec.tokenizer import TokenizerState


@dataclass
class UserTurn:
    tokenizer_state: TokenizerState | None  # the audio tokenizer's stream state; None: a speculative fork (frames given)
    frames: list[np.ndarray] = field(default_factory=list)
    prefilled_frames: int = 0
    drop: int = 0  # history turns the incremental prefill dropped: the response drops at least these
    flushed_from: int = 0  # a speculative fork: its frames from here on were flushed from a copy
    done: asyncio.Future[np.ndarray] | None = None  # resolves when the tokenizer has flushed the turn
    last_job: asyncio.Future[np.ndarray] | None = None
    text_ids: list[int] = field(default_factory=list)  # what the user typed (add_user_text), global ids

    def state(self) -> TokenizerState:
        if self.tokenizer_state is None:
            raise RuntimeError("a speculative fork of a user turn takes no audio")
        return self.tokenizer_state

    @property
    def num_frames(self) -> int:
        return sum(len(f) for f in self.frames)

    def all_frames(self) -> np.ndarray:
        if not self.frames:
            return np.zeros((0, vocab.NUM_STREAMS), dtype=np.int64)
        return np.concatenate(self.frames)
