"""Named voices: the server's speaker prompts, chosen by `voice` in session.update.

`session.voices` in the config maps a name to a WAV file (16-bit PCM, any rate, mono or averaged
to mono); the engine conditions every answer of a session on its voice's audio (OpusLM's speaker
prompt; the first 10 s are used). Any other voice name, OpenAI's `alloy` included, means the
model's own voice, so existing clients keep working.
"""

from __future__ import annotations

import wave
from pathlib import Path

import numpy as np

from realtime.audio import StreamResampler

RATE_HZ = 16_000
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
        with wave.open(str(path), "rb") as f:
            if f.getcomptype() != "NONE" or f.getsampwidth() != 2:
                raise ValueError(f"{path}: need a 16-bit PCM WAV file")
            channels, rate, n = f.getnchannels(), f.getframerate(), f.getnframes()
            if n > MAX_SECONDS * rate:
                raise ValueError(f"{path}: {n / rate:.0f} s long; a voice prompt is at most {MAX_SECONDS:.0f} s")
            data = f.readframes(n)
    except FileNotFoundError:
        raise ValueError(f"{path}: no such file") from None
    except (wave.Error, EOFError, OSError) as e:
        raise ValueError(f"{path}: not a readable WAV file ({e})") from None
    pcm = np.frombuffer(data, dtype="<i2").reshape(-1, channels).mean(axis=1).astype(np.int16)
    if pcm.size == 0:
        raise ValueError(f"{path}: holds no audio")
    resampler = StreamResampler(rate, RATE_HZ)
    return np.concatenate([resampler.process(pcm), resampler.flush()]).astype(np.int16)
