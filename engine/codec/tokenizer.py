"""Audio tokenizer: user speech at 16 kHz -> frames [T, 9] of global ids, incrementally.

Stream 0 is the SSL tokenizer's cluster, streams 1-8 the DAC encoder's codes. Audio arrives in
pieces of any size; it is processed in blocks of `block_frames` on a fixed frame grid, and each
block runs on a window cut from the audio with enough context for the encoders' receptive field
(measured at construction). The window of a block depends only on the block's position and, for
the last blocks, on the utterance's true end, never on how the audio was split into pieces; so
the tokens are identical however the audio arrives (tested exactly). Against one offline
encoder call over the whole WAV they agree up to float rounding flipping near-tied argmins
(measured: see `engine/codec/README.md`).

The DAC encoder's LSTM carries its state from block to block; its frame-rate output conv needs
3 frames of lookahead, so DAC codes lag the SSL clusters by 3 frames until the utterance ends.
Blocks of different sessions run as one batch when their windows have the same length.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict

import numpy as np
import torch

from engine.codec.cluster import ClusterTokenizer
from engine.codec.dac import DAC, SConv1d, child
from engine.codec.receptive import context_frames
from engine.units import HOP_SAMPLES
from engine.vocab import NUM_CODEBOOKS, frames_to_global

LstmState = tuple[torch.Tensor, torch.Tensor]


@dataclasses.dataclass
class TokenizerState:
    """One session's incremental tokenization."""

    audio: np.ndarray  # float32 samples [audio_base, samples_received)
    audio_base: int = 0
    samples_received: int = 0
    finished: bool = False
    next_block_frame: int = 0  # first frame of the next block to run
    lstm_state: LstmState | None = None
    lstm_out: torch.Tensor | None = None  # [C, m] encoder LSTM outputs of frames [post_base, ..)
    post_base: int = 0  # first frame whose DAC code is not out yet
    ssl: list[np.ndarray] = dataclasses.field(default_factory=list)  # cluster ids per block
    dac: list[np.ndarray] = dataclasses.field(default_factory=list)  # [n, 8] codes per block
    frames_out: int = 0  # frames already returned by `take`

    @classmethod
    def new(cls) -> TokenizerState:
        return cls(audio=np.zeros(0, dtype=np.float32))

    @property
    def total_frames(self) -> int:
        return -(-self.samples_received // HOP_SAMPLES)


class AudioTokenizer:
    def __init__(self, dac: DAC, ssl: ClusterTokenizer, block_frames: int = 10) -> None:
        self.dac = dac
        self.ssl = ssl
        self.hop = dac.hop_samples
        self.block_frames = block_frames
        device = dac.device
        enc = dac.encoder
        left_d, right_d = context_frames(enc.pre_lstm(), 1, self.hop, 1, device)
        left_s, right_s = ssl.context_frames(self.hop, device)
        self.left_frames = max(left_d, left_s)
        self.right_frames = max(right_d, right_s)
        post_width = child(enc.post_lstm(), -1, SConv1d).conv.conv.in_channels
        self.post_left, self.post_right = context_frames(enc.post_lstm(), post_width, 1, 1, device)

    def new_state(self) -> TokenizerState:
        return TokenizerState.new()

    def push(self, state: TokenizerState, pcm: np.ndarray) -> None:
        """Append float32 PCM at 16 kHz (cheap: no model work)."""
        if state.finished:
            raise ValueError("push after finish")
        pcm = np.asarray(pcm, dtype=np.float32).reshape(-1)
        state.audio = np.concatenate([state.audio, pcm])
        state.samples_received += len(pcm)

    def finish(self, state: TokenizerState) -> None:
        state.finished = True

    def ready(self, state: TokenizerState) -> bool:
        """Whether the next block has all the audio its window needs."""
        start = state.next_block_frame
        if state.finished:
            # a last block may be empty: it only flushes the DAC codes still held back
            return start < state.total_frames or state.post_base < state.total_frames
        if start >= state.total_frames:
            return False
        end = start + self.block_frames
        return state.samples_received >= (end + self.right_frames) * self.hop

    @torch.inference_mode()
    def step(self, states: list[TokenizerState]) -> None:
        """Run one ready block for every state that has one, batched."""
        todo = [s for s in states if self.ready(s)]
        if not todo:
            return
        blocks = [self._block_window(s) for s in todo]
        feats = self._batched(blocks)
        lstm_in = []
        for s, (win_lo, lo, hi, _), (pre, ssl_feat) in zip(todo, blocks, feats):
            clusters = self.ssl.quantize(ssl_feat[None, :, lo - win_lo : hi - win_lo])[0]
            s.ssl.append(clusters.cpu().numpy())
            lstm_in.append(pre[:, lo - win_lo : hi - win_lo])
        lstm_out = self._lstm(todo, lstm_in)
        post = [self._post(s, z, hi) for s, z, (_, _, hi, _) in zip(todo, lstm_out, blocks)]
        self._quantize(todo, post)
        for s, (_, _, hi, _) in zip(todo, blocks):
            s.next_block_frame = hi
            keep = max(0, hi - self.left_frames) * self.hop
            s.audio = s.audio[keep - s.audio_base :]
            s.audio_base = keep

    def _block_window(self, s: TokenizerState) -> tuple[int, int, int, torch.Tensor]:
        """(window first frame, block first frame, block end frame, audio [1, samples])."""
        lo = s.next_block_frame
        hi = min(lo + self.block_frames, s.total_frames)
        win_lo = max(0, lo - self.left_frames)
        win_hi_samples = min((hi + self.right_frames) * self.hop, s.samples_received)
        pcm = s.audio[win_lo * self.hop - s.audio_base : win_hi_samples - s.audio_base]
        return win_lo, lo, hi, torch.from_numpy(pcm.copy()).to(self.dac.device)[None]

    def _batched(self, blocks: list[tuple[int, int, int, torch.Tensor]]) -> list[tuple]:
        """DAC pre-LSTM features and SSL features per block; equal-length windows share a batch."""
        groups: dict[int, list[int]] = defaultdict(list)
        for i, b in enumerate(blocks):
            groups[b[3].shape[1]].append(i)
        out: list[tuple] = [None] * len(blocks)  # type: ignore[list-item]
        for idx in groups.values():
            audio = torch.stack([blocks[i][3] for i in idx])  # [B, 1, S]
            pre = self.dac.encoder.pre_lstm()(audio)
            ssl = self.ssl.features(audio)
            for j, i in enumerate(idx):
                out[i] = (pre[j], ssl[j])
        return out

    def _lstm(self, states: list[TokenizerState], xs: list[torch.Tensor]) -> list[torch.Tensor]:
        slstm = self.dac.encoder.lstm()
        if slstm is None:
            return xs
        # One call per block length (all equal except at utterance ends): same frames, same call
        # shape however the audio arrived.
        groups: dict[int, list[int]] = defaultdict(list)
        for i, x in enumerate(xs):
            groups[x.shape[1]].append(i)
        out: list[torch.Tensor] = [None] * len(xs)  # type: ignore[list-item]
        for idx in groups.values():
            if xs[idx[0]].shape[1] == 0:
                for i in idx:
                    out[i] = xs[i]
                continue
            for i in idx:  # per session: batch composition must not change a session's result
                y, new_state = slstm.forward_state(xs[i][None], states[i].lstm_state)
                states[i].lstm_state = new_state
                out[i] = y[0]
        return out

    def _post(self, s: TokenizerState, z: torch.Tensor, block_end: int) -> torch.Tensor:
        """Frame-rate output conv on LSTM outputs; returns latents for the frames now final."""
        s.lstm_out = z if s.lstm_out is None else torch.cat([s.lstm_out, z], dim=1)
        lstm_base = block_end - s.lstm_out.shape[1]
        final = s.finished and block_end >= s.total_frames
        ready_hi = block_end if final else block_end - self.post_right
        if ready_hi <= s.post_base:
            return z[:, :0].new_zeros(self.dac.cfg.hidden_dim, 0)
        lo = max(lstm_base, s.post_base - self.post_left)
        hi = block_end if final else min(block_end, ready_hi + self.post_right)
        y = self.dac.encoder.post_lstm()(s.lstm_out[None, :, lo - lstm_base : hi - lstm_base])[0]
        latents = y[:, s.post_base - lo : ready_hi - lo]
        s.post_base = ready_hi
        keep = max(0, ready_hi - self.post_left) - lstm_base
        s.lstm_out = s.lstm_out[:, keep:]
        return latents

    def _quantize(self, states: list[TokenizerState], latents: list[torch.Tensor]) -> None:
        for s, z in zip(states, latents):
            # per session and per block: the RVQ matmul shape then depends on the block only
            codes = self.dac.quantizer.encode(z[None])[0].t() if z.shape[1] else None
            s.dac.append(
                codes.cpu().numpy() if codes is not None else np.zeros((0, NUM_CODEBOOKS), np.int64)
            )

    def take(self, state: TokenizerState) -> np.ndarray:
        """New complete frames [n, 9] (global ids) since the last call."""
        ssl = np.concatenate(state.ssl) if state.ssl else np.zeros(0, np.int64)
        dac = np.concatenate(state.dac) if state.dac else np.zeros((0, NUM_CODEBOOKS), np.int64)
        n = min(len(ssl), len(dac))
        out = frames_to_global(ssl[state.frames_out : n], dac[state.frames_out : n])
        state.frames_out = n
        return out

    def tokenize(self, pcm: np.ndarray) -> np.ndarray:
        """Whole utterance in one piece -> frames [T, 9]; the same path as streaming."""
        state = self.new_state()
        self.push(state, pcm)
        self.finish(state)
        while self.ready(state):
            self.step([state])
        return self.take(state)
