"""Streaming DAC decode: codes arrive frame by frame, audio leaves in chunks, batched across sessions.

The decoder is split where its state lives:
  front   RVQ lookup -> input conv (k7, needs 3 frames each side) -> LSTM. The LSTM state is
          carried exactly from chunk to chunk, so there is no warm-up error; only frames whose
          input-conv window is complete are committed. The last 3 frames before the lookahead
          edge run through the LSTM provisionally, from a copy of the state, and are recomputed
          next chunk.
  upsampler  transposed convs + residual blocks: non-causal with a finite receptive field. A
          chunk is decoded on a window with `context_frames` exact latents on the left and
          `lookahead_frames` (possibly provisional) latents on the right; only the chunk's own
          samples are kept. An optional cross-fade blends the first samples of a chunk with the
          previous chunk's tail decoded past its end.
At the end of the utterance (`finish`) the last chunk is decoded with the true right edge, as
offline decode does. A chunk larger than the whole utterance therefore decodes it exactly whole.

`engine/codec/README.md` has the measured SNR (streamed vs offline) behind the defaults.
"""

from __future__ import annotations

import dataclasses
import time
from collections import defaultdict

import numpy as np
import torch
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from engine.codec.dac import DAC
from engine.vocab import NUM_CODEBOOKS

LstmState = tuple[torch.Tensor, torch.Tensor]  # (h, c), each [layers, 1, C] for one session


@dataclasses.dataclass(frozen=True)
class StreamConfig:
    first_chunk_frames: int = 4  # small first chunk: time to first audio
    chunk_frames: int = 16  # later chunks: less window overhead per frame
    context_frames: int = 4  # exact left latents fed to the upsampler window
    lookahead_frames: int = 2  # frames after the chunk that must exist before it is decoded
    crossfade_samples: int = 0  # 0: boundaries are already seamless (see README)

    def __post_init__(self) -> None:
        if min(self.first_chunk_frames, self.chunk_frames) < 1:
            raise ValueError("chunk sizes must be >= 1 frame")
        if self.context_frames < 0 or self.lookahead_frames < 0 or self.crossfade_samples < 0:
            raise ValueError("context, lookahead and crossfade must be >= 0")


@dataclasses.dataclass
class DecoderState:
    """Everything one session's streaming decode carries between chunks."""

    codes: np.ndarray  # [n, 8] local codes of frames [codes_base, frames_received)
    codes_base: int = 0
    frames_received: int = 0
    finished: bool = False  # end of utterance: no more frames will come
    committed_frames: int = 0  # frames whose LSTM step is in lstm_state (exact)
    lstm_state: LstmState | None = None
    z_hist: torch.Tensor | None = None  # [C, m] exact LSTM outputs of frames [z_base, committed)
    z_base: int = 0
    emitted_frames: int = 0  # audio delivered up to this frame
    chunks_emitted: int = 0
    tail: np.ndarray | None = None  # decoded past the last chunk's end, for the cross-fade

    @classmethod
    def new(cls) -> DecoderState:
        return cls(codes=np.zeros((0, NUM_CODEBOOKS), dtype=np.int64))

    @property
    def done(self) -> bool:
        return self.finished and self.emitted_frames >= self.frames_received


@dataclasses.dataclass(frozen=True)
class _Plan:
    start: int  # first frame of the chunk
    end: int  # one past its last frame
    final: bool


class StreamingDecoder:
    """Decodes due chunks of many sessions; holds no per-session state itself (see DecoderState)."""

    def __init__(self, dac: DAC, config: StreamConfig | None = None) -> None:
        self.dac = dac
        self.config = config or StreamConfig()
        self.hop = dac.hop_samples
        conv = dac.decoder.in_conv().conv.conv
        pad_total = conv.kernel_size[0] - 1
        self._in_right = pad_total // 2
        self._in_left = pad_total - self._in_right
        if self.config.crossfade_samples > self.config.lookahead_frames * self.hop:
            raise ValueError("crossfade_samples needs that many samples of lookahead")

    # --- per-session bookkeeping (cheap; callable from any thread that owns the state) -------

    def push(self, state: DecoderState, codes: np.ndarray) -> None:
        """Append complete frames' local codes [n, 8]."""
        if state.finished:
            raise ValueError("push after finish")
        codes = np.asarray(codes, dtype=np.int64).reshape(-1, NUM_CODEBOOKS)
        state.codes = np.concatenate([state.codes, codes])
        state.frames_received += len(codes)

    def finish(self, state: DecoderState) -> None:
        state.finished = True

    def due_frames(self, state: DecoderState) -> int:
        """Frames the next chunk would cover now; 0 when it is not ready."""
        remaining = state.frames_received - state.emitted_frames
        if state.finished:
            return remaining
        size = self.next_chunk_frames(state)
        return size if remaining - self.config.lookahead_frames >= size else 0

    def next_chunk_frames(self, state: DecoderState) -> int:
        """Size of the next chunk: the first chunk's size twice, then doubling up to chunk_frames.

        A chunk must be generated (and decoded) while the audio already delivered plays: a
        16-frame chunk right after a 4-frame one would need 16 frames generated within 80 ms.
        With 4, 4, 8, 16, ... each chunk needs at most half the audio before it, so generation at
        2x real time still leaves half the margin for decoding and delivery.
        """
        cfg = self.config
        return min(cfg.chunk_frames, cfg.first_chunk_frames << min(max(state.chunks_emitted - 1, 0), 16))

    # --- batched decode ---------------------------------------------------------------------

    @torch.inference_mode()
    def decode(self, states: list[DecoderState]) -> list[np.ndarray]:
        """Decode the due chunk of every state in one batched pass; float32 PCM per state.

        Steps: plan each chunk; run the input conv per session; advance all LSTMs in one packed
        call (exact frames, committed) and once more (provisional frames, not committed);
        group upsampler windows by length and run each group as one batch; cut and cross-fade.
        """
        plans = [self._plan(s) for s in states]
        fronts = [self._in_conv(s, p) for s, p in zip(states, plans)]
        exact_z = self._lstm([f[0] for f in fronts], [s.lstm_state for s in states], commit=True)
        for s, (_, _, exact_hi), (z, new_state) in zip(states, fronts, exact_z):
            self._commit(s, z, new_state, exact_hi)
        prov_z = self._lstm([f[1] for f in fronts], [s.lstm_state for s in states], commit=False)
        windows = [self._window(s, p, z) for s, p, (z, _) in zip(states, plans, prov_z)]
        audio = self._upsample([w for w, _ in windows])
        return [
            self._cut(s, p, a, win_start)
            for s, p, a, (_, win_start) in zip(states, plans, audio, windows)
        ]

    def _plan(self, s: DecoderState) -> _Plan:
        n = self.due_frames(s)
        if n == 0 and not s.finished:
            raise ValueError("decode() called for a session with no due chunk")
        final = s.finished and s.emitted_frames + n >= s.frames_received
        return _Plan(s.emitted_frames, s.emitted_frames + n, final)

    def _in_conv(self, s: DecoderState, p: _Plan) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Input-conv outputs [C, k] for the exact frames [committed, exact_hi) and the
        provisional frames [exact_hi, need_hi); returns (exact, provisional, exact_hi)."""
        avail = s.frames_received
        exact_hi = avail if p.final else max(s.committed_frames, avail - self._in_right)
        need_hi = avail if p.final else min(avail, p.end + self.config.lookahead_frames)
        lo = max(0, s.committed_frames - self._in_left)
        hi = max(exact_hi, need_hi)
        device = self.dac.device
        if hi <= s.committed_frames:
            empty = torch.zeros(self._lstm_width(), 0, device=device)
            return empty, empty, exact_hi
        codes = torch.from_numpy(s.codes[lo - s.codes_base : hi - s.codes_base]).to(device)
        latents = self.dac.quantizer.decode(codes.t()[None])
        x = self.dac.decoder.in_conv()(latents)[0]
        exact = x[:, s.committed_frames - lo : exact_hi - lo]
        prov = x[:, exact_hi - lo : need_hi - lo] if need_hi > exact_hi else x[:, :0]
        return exact, prov, exact_hi

    def _lstm_width(self) -> int:
        return self.dac.decoder.in_conv().conv.conv.out_channels

    def _lstm(
        self, xs: list[torch.Tensor], states: list[LstmState | None], commit: bool
    ) -> list[tuple[torch.Tensor, LstmState | None]]:
        """Run each [C, k] sequence from its state in one packed LSTM call (skip added)."""
        slstm = self.dac.decoder.lstm()
        if slstm is None:
            return [(x, None) for x in xs]
        rows = [i for i, x in enumerate(xs) if x.shape[1] > 0]
        out: list[tuple[torch.Tensor, LstmState | None]] = [(x, st) for x, st in zip(xs, states)]
        if not rows:
            return out
        lstm = slstm.lstm
        layers, width = lstm.num_layers, lstm.hidden_size
        device = xs[rows[0]].device
        zeros = torch.zeros(layers, 1, width, device=device)
        h0 = torch.cat([(states[i] or (zeros, zeros))[0] for i in rows], dim=1)
        c0 = torch.cat([(states[i] or (zeros, zeros))[1] for i in rows], dim=1)
        lengths = torch.tensor([xs[i].shape[1] for i in rows])
        padded = torch.nn.utils.rnn.pad_sequence([xs[i].t() for i in rows])  # [T, B, C]
        packed = pack_padded_sequence(padded, lengths, enforce_sorted=False)
        y, (h, c) = lstm(packed, (h0, c0))
        y, _ = pad_packed_sequence(y)
        for j, i in enumerate(rows):
            n = int(lengths[j])
            z = (y[:n, j] + padded[:n, j]).t()
            out[i] = (z, (h[:, j : j + 1].contiguous(), c[:, j : j + 1].contiguous()) if commit else states[i])
        return out

    def _commit(
        self, s: DecoderState, z: torch.Tensor, new_state: LstmState | None, exact_hi: int
    ) -> None:
        s.lstm_state = new_state
        s.z_hist = z if s.z_hist is None else torch.cat([s.z_hist, z], dim=1)
        s.committed_frames = exact_hi
        # drop what no later chunk can need: codes before the input conv's left edge, latents
        # before the next chunk's left context
        keep_codes = max(0, s.committed_frames - self._in_left)
        s.codes = s.codes[keep_codes - s.codes_base :]
        s.codes_base = keep_codes

    def _window(self, s: DecoderState, p: _Plan, prov: torch.Tensor) -> tuple[torch.Tensor, int]:
        """Upsampler input [C, frames] for this chunk and the frame it starts at."""
        start = max(0, p.start - self.config.context_frames)
        assert s.z_hist is not None
        z = torch.cat([s.z_hist[:, start - s.z_base :], prov], dim=1)
        # after this chunk only the next chunk's left context is needed
        next_start = max(0, p.end - self.config.context_frames)
        drop = max(0, min(next_start, s.committed_frames) - s.z_base)
        s.z_hist = s.z_hist[:, drop:]
        s.z_base += drop
        return z, start

    def _upsample(self, windows: list[torch.Tensor]) -> list[torch.Tensor]:
        """Batch windows of equal length together (different lengths change reflect padding)."""
        groups: dict[int, list[int]] = defaultdict(list)
        for i, w in enumerate(windows):
            groups[w.shape[1]].append(i)
        out: list[torch.Tensor] = [torch.zeros(0)] * len(windows)
        upsampler = self.dac.decoder.upsampler()
        for idx in groups.values():
            audio = upsampler(torch.stack([windows[i] for i in idx]))
            for j, i in enumerate(idx):
                out[i] = audio[j, 0]
        return out

    def _cut(self, s: DecoderState, p: _Plan, audio: torch.Tensor, win_start: int) -> np.ndarray:
        fade = self.config.crossfade_samples if not p.final else 0
        lo = (p.start - win_start) * self.hop
        hi = (p.end - win_start) * self.hop
        pcm = audio[lo:hi].float().cpu().numpy().copy()
        if s.tail is not None and len(s.tail) and len(pcm):
            n = min(len(s.tail), len(pcm))
            ramp = 0.5 - 0.5 * np.cos(np.pi * (np.arange(n) + 0.5) / n)  # 0 -> 1
            pcm[:n] = ramp * pcm[:n] + (1 - ramp) * s.tail[:n]
        s.tail = audio[hi : hi + fade].float().cpu().numpy().copy() if fade else None
        s.emitted_frames = p.end
        s.chunks_emitted += 1
        return pcm


def decode_streamed(
    dac: DAC, codes: np.ndarray, config: StreamConfig | None = None, arrive_frames: int = 1
) -> np.ndarray:
    """Decode one utterance's local codes [T, 8] the way the server streams: frames arrive
    `arrive_frames` at a time and every due chunk is decoded at once. Returns float32 PCM."""
    decoder = StreamingDecoder(dac, config)
    state = DecoderState.new()
    pieces: list[np.ndarray] = []
    for i in range(0, len(codes), arrive_frames):
        decoder.push(state, codes[i : i + arrive_frames])
        while decoder.due_frames(state):
            pieces += decoder.decode([state])
    decoder.finish(state)
    while not state.done:
        pieces += decoder.decode([state])
    return np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.float32)


def lockstep_decode_seconds(decoder: StreamingDecoder, codes: np.ndarray, batch: int, sync=None) -> float:
    """Decode `batch` sessions of the same local codes [T, 8] in lockstep, frame by frame, as the
    codec stage batches them; returns the seconds spent in `decode` (benchmarks). `sync()` runs
    around each timed call (a CUDA device: torch.cuda.synchronize, so queued kernels are counted)."""
    states = [DecoderState.new() for _ in range(batch)]
    elapsed = 0.0
    for t in range(len(codes)):
        for s in states:
            decoder.push(s, codes[t : t + 1])
            if t == len(codes) - 1:
                decoder.finish(s)
        while due := [s for s in states if decoder.due_frames(s) or (s.finished and not s.done)]:
            if sync is not None:
                sync()
            start = time.perf_counter()
            decoder.decode(due)
            if sync is not None:
                sync()
            elapsed += time.perf_counter() - start
    return elapsed


def snr_db(reference: np.ndarray, estimate: np.ndarray) -> float:
    """10·log10(|ref|² / |ref - est|²); inf when identical."""
    if reference.shape != estimate.shape:
        raise ValueError(f"shape mismatch {reference.shape} vs {estimate.shape}")
    err = float(np.sum((reference.astype(np.float64) - estimate) ** 2))
    sig = float(np.sum(reference.astype(np.float64) ** 2))
    return float("inf") if err == 0 else 10 * np.log10(sig / err)
