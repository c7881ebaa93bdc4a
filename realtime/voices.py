"""Named voices: the server's speaker prompts, chosen by `voice` in session.update.

`session.voices` in the config maps a name to a WAV file (16-bit PCM, any rate, mono or averaged
to mono); the engine conditions every answer of a session on its voice's audio (OpusLM's speaker
prompt; the first 10 s are used). Any other voice name, OpenAI's `alloy` included, means the
model's own voice, so existing clients keep working.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from engine.codec.wavio import read_wav  # stdlib wave + numpy only: no torch in the gateway
from engine.service_api import SAMPLE_RATE_HZ
from realtime.audio import StreamResampler

RATE_HZ = SAMPLE_RATE_HZ  # speaker prompts go to the engine
MAX_SECONDS = 30.0  # the engine uses the first 10 s; longer files are a config mistake


def load_voices(paths: dict[str, str]) -> dict[str, np.ndarray]:
    """name -> int16 mono PCM at 16 kHz (relative paths: from the working directory); ValueError
    naming `session.voices.NAME` for a bad entry."""
    voices = {}
    for name, path in paths.items():
        try:
            voices[name] = read_voice(Path(path).expanduser())
        except ValueError as e:
            raise ValueError(f"config key 'session.voices.{name}': {e}") from None
    return voices


def read_voice(path: Path) -> np.ndarray:
    try:
        pcm, rate = read_wav(path)  # ValueError: not a 16-bit PCM WAV
    except OSError as e:
        raise ValueError(f"{path}: no such file" if isinstance(e, FileNotFoundError) else f"{path}: not a readable WAV file ({e})") from None
    if pcm.size == 0:
        raise ValueError(f"{path}: holds no audio")
    if pcm.size > MAX_SECONDS * rate:
        raise ValueError(f"{path}: {pcm.size / rate:.0f} s long; a voice prompt is at most {MAX_SECONDS:.0f} s")
    ints = np.round(np.clip(pcm, -1.0, 1.0) * 32767.0).astype(np.int16)
    resampler = StreamResampler(rate, RATE_HZ)
    return np.concatenate([resampler.process(ints), resampler.flush()]).astype(np.int16)
