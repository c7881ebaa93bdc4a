"""The engine's units of audio and time: the one definition, at the bottom of the import graph.

The codec fixes them (16 kHz audio, one frame per 320 samples), and every layer above agrees:
the token layout (vocab.py), the codec, the scheduler's deadlines, the service, and the gateway
contract (service_api.py re-exports the two it promises). This module imports nothing, so any of
them can use it without reaching a layer above (no torch, no vLLM, no contract).
"""

from __future__ import annotations

SAMPLE_RATE_HZ = 16_000  # engine-side audio: mono int16 at 16 kHz, in and out
FRAME_MS = 20.0  # one model frame: one token of each of the 9 streams
FRAME_RATE_HZ = round(1000.0 / FRAME_MS)  # 50
HOP_SAMPLES = SAMPLE_RATE_HZ // FRAME_RATE_HZ  # 320: audio samples per frame
