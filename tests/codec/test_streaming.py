import numpy as np
import torch

from engine.codec.dac import DAC
from engine.codec.streaming import (
    DecoderState,
    StreamConfig,
    StreamingDecoder,
    decode_streamed,
    snr_db,
)

# The figure stated for the defaults in engine/codec/README.md (measured ~111 dB on the tiny
# codec; the floor is 30 dB).
DEFAULT_SNR_FLOOR_DB = 60.0


def _offline(dac: DAC, codes: np.ndarray) -> np.ndarray:
    return dac.decode(torch.from_numpy(codes).t()[None])[0, 0].numpy()


def test_default_streamed_equals_offline(dac: DAC, speech_codes: np.ndarray) -> None:
    offline = _offline(dac, speech_codes)
    streamed = decode_streamed(dac, speech_codes, StreamConfig())
    assert streamed.shape == offline.shape
    assert snr_db(offline, streamed) >= DEFAULT_SNR_FLOOR_DB


def test_streamed_in_bursts_equals_offline(dac: DAC, speech_codes: np.ndarray) -> None:
    offline = _offline(dac, speech_codes)
    streamed = decode_streamed(dac, speech_codes, StreamConfig(), arrive_frames=7)
    assert snr_db(offline, streamed) >= DEFAULT_SNR_FLOOR_DB


def test_without_context_or_lookahead_boundaries_show(dac: DAC, speech_codes: np.ndarray) -> None:
    # the measurement can fail: no context and no lookahead leaves errors at every boundary
    offline = _offline(dac, speech_codes)
    cfg = StreamConfig(context_frames=0, lookahead_frames=0)
    assert snr_db(offline, decode_streamed(dac, speech_codes, cfg)) < DEFAULT_SNR_FLOOR_DB


def test_chunk_larger_than_utterance_decodes_whole(dac: DAC, speech_codes: np.ndarray) -> None:
    cfg = StreamConfig(first_chunk_frames=10_000, chunk_frames=10_000)
    streamed = decode_streamed(dac, speech_codes, cfg)
    np.testing.assert_array_equal(streamed, _offline(dac, speech_codes))


def test_batched_sessions_match_single(dac: DAC, speech_codes: np.ndarray) -> None:
    decoder = StreamingDecoder(dac, StreamConfig())
    lengths = [len(speech_codes), 37, 90]
    states = [DecoderState.new() for _ in lengths]
    outs: list[list[np.ndarray]] = [[] for _ in lengths]
    for t in range(max(lengths)):
        for i, n in enumerate(lengths):
            if t < n:
                decoder.push(states[i], speech_codes[t : t + 1])
            if t == n - 1:
                decoder.finish(states[i])
        due = [i for i, s in enumerate(states) if decoder.due_frames(s) or (s.finished and not s.done)]
        for i, pcm in zip(due, decoder.decode([states[i] for i in due]) if due else []):
            outs[i].append(pcm)
    for i, n in enumerate(lengths):
        single = decode_streamed(dac, speech_codes[:n], StreamConfig())
        assert snr_db(single, np.concatenate(outs[i])) >= DEFAULT_SNR_FLOOR_DB
