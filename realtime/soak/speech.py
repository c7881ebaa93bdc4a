"""The callers' speech: espeak-ng sentences at 16 kHz, the same for every soak and fault run."""

from __future__ import annotations

import subprocess
import tempfile
from pathlib import Path

from realtime.soak.callers import Utterance

SENTENCES = (
    "Hello, can you hear me?",
    "What is the weather like today?",
    "Tell me a short story about a lighthouse keeper.",
    "I would like to book a table for two at seven.",
    "Could you repeat that more slowly, please?",
    "Thanks, that is all for now.",
    "How far is the moon from the earth?",
    "Please remind me to call my sister tomorrow morning.",
)


def speech_sentences(seed: int) -> tuple[Utterance, ...]:
    """espeak-ng sentences at 16 kHz, trimmed to the speech (50 ms of lead-in kept)."""
    import shutil
    import wave

    import numpy as np
    import soxr

    if shutil.which("espeak-ng") is None:
        raise SystemExit("soak: espeak-ng is not installed (apt-get install espeak-ng)")
    out = []
    with tempfile.TemporaryDirectory() as d:
        for i, text in enumerate(SENTENCES):
            path = Path(d) / f"{i}.wav"
            speed = 150 + (seed + i) % 4 * 15
            subprocess.run(["espeak-ng", "-v", "en-us", "-s", str(speed), "-w", str(path), text], check=True, capture_output=True)
            with wave.open(str(path)) as w:
                pcm = np.frombuffer(w.readframes(w.getnframes()), "<i2")
                rate = w.getframerate()
            pcm = soxr.resample(pcm, rate, 16_000).astype(np.int16)
            loud = np.flatnonzero(np.abs(pcm.astype(np.int32)) > 500)
            # espeak pads its WAV with silence: cut it, so the end of the frames is the end of speech
            out.append(Utterance(text, pcm[max(0, loud[0] - 800): loud[-1] + 1]))
    return tuple(out)
