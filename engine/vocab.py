"""The OpusLM token layout: every id and range the engine uses, and nowhere else.

One vocabulary table is shared by all 9 streams; each stream owns a range of global ids:

    [0, 256)             specials (general 0-31, modality 32-63, task 64-127)
    [256, 5256)          stream 0 in audio: SSL k-means clusters, id = cluster + 256
    [5256, 13448)        streams 1-8: DAC codebook k (0-based), code c -> 5256 + 1024*k + c
    [13448, 13448 + T)   stream 0 in text: the backbone tokenizer's id + 13448

Ids of the specials follow ESPnet's `espnet2/speechlm/definitions.py` as the released
`config.yaml` token lists name them (see `shared/research/opuslm.md` §1); the converter checks
them by name against a real checkpoint's token list.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# the layout's units, re-exported for the codec and tools that read them beside the ids
from engine.units import FRAME_MS as FRAME_MS, FRAME_RATE_HZ as FRAME_RATE_HZ  # noqa: F401
from engine.units import HOP_SAMPLES as HOP_SAMPLES, SAMPLE_RATE_HZ as SAMPLE_RATE_HZ  # noqa: F401

# --- general specials -------------------------------------------------------------------------
PAD = 0  # delay-pattern fill, streams 1-8 at text positions, stream 0 during the flush
UNK = 1
SOS_EOS = 5  # starts a sequence; on stream 0 it ends an audio/text segment
EOU = 11
SYSTEM = 8  # role markers (ESPnet's ChatOrientedWriter hard-codes 8/9/10)
USER = 9
ASSISTANT = 10
# Engine-internal sentinel, never part of a prompt and never embedded: stream 0 is forced to it on
# the step after the delay flush, and it is the request's only stop token, so vLLM finishes the
# request exactly when the last codebook of the last frame has been produced. ESPnet leaves the
# general ids 12-31 unnamed; 31 is the last of them.
ENGINE_STOP = 31

# --- modality markers -------------------------------------------------------------------------
CODEC_SSL = 34  # <codec_ssl_start/end>: an audio segment follows
TEXT_BPE = 35  # <text_bpe_start/end>: a text segment follows
SPEAKER = 37  # <spk_start/end>: a speaker-prompt audio segment follows

# --- tasks ------------------------------------------------------------------------------------
TASK_TEXTLM = 64
TASK_ASR = 80
TASK_TTS = 81
TASK_PLAIN_TTS = 82
TASK_AUDIOLM = 83
TASK_TEXT_DIALOGUE = 88
TASK_AUDIO_DIALOGUE = 89

NUM_SPECIALS = 256

# --- audio ranges -----------------------------------------------------------------------------
NUM_STREAMS = 9  # stream 0 = SSL (or text/specials), streams 1-8 = DAC codebooks 0-7
NUM_CODEBOOKS = NUM_STREAMS - 1
SSL_OFFSET = 256
SSL_SIZE = 5000
DAC_OFFSET = SSL_OFFSET + SSL_SIZE  # 5256
CODEBOOK_SIZE = 1024
TEXT_OFFSET = DAC_OFFSET + NUM_CODEBOOKS * CODEBOOK_SIZE  # 13448


@dataclass(frozen=True)
class VocabLayout:
    """The part of the layout that differs between models: the size of the text range.

    ``vocab_size`` may exceed ``TEXT_OFFSET + text_size`` (the released vocabularies have 70 ids
    above the text range whose purpose is unknown); those ids are never sampled.
    """

    text_size: int
    vocab_size: int

    def __post_init__(self) -> None:
        if self.text_size < 0 or self.vocab_size < TEXT_OFFSET + self.text_size:
            raise ValueError(
                f"vocab_size {self.vocab_size} is smaller than the audio ranges plus "
                f"{self.text_size} text ids ({TEXT_OFFSET + self.text_size})"
            )

    @property
    def text_end(self) -> int:
        return TEXT_OFFSET + self.text_size


def stream_range(stream: int) -> tuple[int, int]:
    """[start, end) of the audio ids stream `stream` carries (0: SSL, k>=1: codebook k-1)."""
    if stream == 0:
        return SSL_OFFSET, SSL_OFFSET + SSL_SIZE
    if 1 <= stream <= NUM_CODEBOOKS:
        start = DAC_OFFSET + (stream - 1) * CODEBOOK_SIZE
        return start, start + CODEBOOK_SIZE
    raise ValueError(f"stream {stream} out of range 0..{NUM_CODEBOOKS}")


def ssl_to_global(clusters: np.ndarray) -> np.ndarray:
    return np.asarray(clusters, dtype=np.int64) + SSL_OFFSET


def global_to_ssl(ids: np.ndarray) -> np.ndarray:
    return np.asarray(ids, dtype=np.int64) - SSL_OFFSET


def dac_to_global(codes: np.ndarray) -> np.ndarray:
    """Local DAC codes [..., 8] (0..1023 per codebook) -> global ids of streams 1-8."""
    codes = np.asarray(codes, dtype=np.int64)
    return codes + DAC_OFFSET + CODEBOOK_SIZE * np.arange(NUM_CODEBOOKS)


def global_to_dac(ids: np.ndarray) -> np.ndarray:
    """Global ids of streams 1-8 [..., 8] -> local DAC codes 0..1023."""
    ids = np.asarray(ids, dtype=np.int64)
    return ids - DAC_OFFSET - CODEBOOK_SIZE * np.arange(NUM_CODEBOOKS)


def frames_to_global(ssl: np.ndarray, dac: np.ndarray) -> np.ndarray:
    """SSL clusters [T] and DAC codes [T, 8] -> audio frames [T, 9] in global ids."""
    return np.concatenate([ssl_to_global(ssl)[:, None], dac_to_global(dac)], axis=1)


def in_stream_range(frames: np.ndarray) -> np.ndarray:
    """Boolean [..., 9]: whether each entry of audio frames lies in its stream's range."""
    frames = np.asarray(frames)
    lo = np.array([stream_range(k)[0] for k in range(NUM_STREAMS)])
    hi = np.array([stream_range(k)[1] for k in range(NUM_STREAMS)])
    return (frames >= lo) & (frames < hi)
