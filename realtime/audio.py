"""Audio at the edge: wire formats <-> the engine's mono int16 PCM at 16 kHz.

Wire formats (OpenAI Realtime names, plus our Opus):

    audio/pcm   pcm16 little-endian mono 24 kHz   (beta spelling "pcm16")
    audio/pcmu  G.711 mu-law 8 kHz                 (beta "g711_ulaw")
    audio/pcma  G.711 A-law 8 kHz                  (beta "g711_alaw")
    audio/opus  one Opus packet per binary frame   (ours; 20 ms frames, decoded straight at 16 kHz)

Every converter is stateful per direction (resampler history, Opus state) and is owned by one
session. `InputDecoder.decode(payload) -> int16[16 kHz]` and `OutputEncoder.encode(pcm16k) ->
list[bytes]` (whole wire frames of `frame_ms`; the remainder waits for the next call or `flush`).
Costs measured on this project's 2-core CI machine (`scripts/bench_gateway.py`): soxr ~7 us per
20 ms, Opus decode ~30 us, Opus encode ~100-250 us per 20 ms frame (complexity dependent).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import numpy as np

from engine.service_api import SAMPLE_RATE_HZ as ENGINE_RATE_HZ

OPUS_FRAME_MS = 20


class AudioFormatError(ValueError):
    """Audio that cannot be decoded in the session's input format (odd byte count, corrupt Opus...)."""


class WireFormat(str, Enum):
    PCM16 = "audio/pcm"
    PCMU = "audio/pcmu"
    PCMA = "audio/pcma"
    OPUS = "audio/opus"

    @property
    def rate_hz(self) -> int:
        return {WireFormat.PCM16: 24_000, WireFormat.PCMU: 8_000, WireFormat.PCMA: 8_000, WireFormat.OPUS: 48_000}[self]

    @property
    def beta_name(self) -> str:
        return {WireFormat.PCM16: "pcm16", WireFormat.PCMU: "g711_ulaw", WireFormat.PCMA: "g711_alaw", WireFormat.OPUS: "opus"}[self]

    def to_wire(self) -> dict:
        """The GA format object, e.g. {"type": "audio/pcm", "rate": 24000}."""
        return {"type": self.value, "rate": self.rate_hz} if self is WireFormat.PCM16 else {"type": self.value}


_BETA_NAMES = {f.beta_name: f for f in WireFormat}


def parse_wire_format(value: object) -> WireFormat:
    """GA object {"type": ..., "rate": ...} or a beta string; raises ValueError naming what is wrong."""
    if isinstance(value, str):
        if value in _BETA_NAMES:
            return _BETA_NAMES[value]
        try:
            return WireFormat(value)
        except ValueError:
            raise ValueError(f"unknown audio format {value!r}") from None
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise ValueError("audio format must be an object with a string 'type'")
    try:
        fmt = WireFormat(value["type"])
    except ValueError:
        raise ValueError(f"unknown audio format type {value['type']!r}") from None
    rate = value.get("rate")
    if fmt is WireFormat.PCM16 and rate is not None and rate != 24_000:
        raise ValueError(f"audio/pcm rate must be 24000, got {rate!r}")
    return fmt


# --- G.711 -----------------------------------------------------------------------------------------

_ULAW_BIAS = 0x84


def _ulaw_decode_table() -> np.ndarray:
    u = ~np.arange(256, dtype=np.int32) & 0xFF
    sign = u & 0x80
    exponent = (u >> 4) & 0x07
    mantissa = u & 0x0F
    magnitude = (((mantissa << 3) + _ULAW_BIAS) << exponent) - _ULAW_BIAS
    return np.where(sign != 0, -magnitude, magnitude).astype(np.int16)


def _alaw_decode_table() -> np.ndarray:
    a = np.arange(256, dtype=np.int32) ^ 0x55
    sign = a & 0x80
    exponent = (a >> 4) & 0x07
    mantissa = a & 0x0F
    magnitude = np.where(exponent == 0, (mantissa << 4) + 8, ((mantissa << 4) + 0x108) << np.maximum(exponent - 1, 0))
    return np.where(sign != 0, magnitude, -magnitude).astype(np.int16)


def _ulaw_encode(x: np.ndarray) -> np.ndarray:
    # The classic Sun g711.c algorithm (as CPython's audioop): 14-bit magnitude, bias 0x21.
    v = x.astype(np.int32) >> 2
    mask = np.where(v < 0, 0x7F, 0xFF)
    v = np.minimum(np.abs(v), 8159) + 0x21
    segment = np.maximum(np.floor(np.log2(v)).astype(np.int32) - 5, 0)
    code = np.where(segment >= 8, 0x7F, (np.minimum(segment, 7) << 4) | ((v >> (np.minimum(segment, 7) + 1)) & 0x0F))
    return (code ^ mask).astype(np.uint8)


def _alaw_encode(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.int32)
    sign = np.where(x >= 0, 0x80, 0)
    magnitude = np.minimum(np.where(x >= 0, x, -x - 1), 32767) >> 3  # 13-bit magnitude
    exponent = np.clip(np.floor(np.log2(np.maximum(magnitude, 1))).astype(np.int32) - 4, 0, 7)
    mantissa = np.where(exponent == 0, magnitude >> 1, magnitude >> exponent) & 0x0F
    return ((sign | (exponent << 4) | mantissa) ^ 0x55).astype(np.uint8)


_ULAW_DECODE = _ulaw_decode_table()
_ALAW_DECODE = _alaw_decode_table()
# Encoding by table lookup on the int16 bit pattern: 64 KiB each, built once.
_ALL_INT16 = np.arange(-32768, 32768, dtype=np.int32)
_ULAW_ENCODE = np.roll(_ulaw_encode(_ALL_INT16), -32768)
_ALAW_ENCODE = np.roll(_alaw_encode(_ALL_INT16), -32768)


def ulaw_decode(data: bytes) -> np.ndarray:
    return _ULAW_DECODE[np.frombuffer(data, dtype=np.uint8)]


def alaw_decode(data: bytes) -> np.ndarray:
    return _ALAW_DECODE[np.frombuffer(data, dtype=np.uint8)]


def ulaw_encode(pcm: np.ndarray) -> bytes:
    return _ULAW_ENCODE[pcm.astype(np.int16).view(np.uint16)].tobytes()


def alaw_encode(pcm: np.ndarray) -> bytes:
    return _ALAW_ENCODE[pcm.astype(np.int16).view(np.uint16)].tobytes()


# --- resampling ------------------------------------------------------------------------------------


class StreamResampler:
    """soxr's streaming resampler for int16 mono; `flush()` returns the tail it holds back."""

    def __init__(self, in_rate_hz: int, out_rate_hz: int) -> None:
        import soxr

        self.in_rate_hz, self.out_rate_hz = in_rate_hz, out_rate_hz
        self._stream = None if in_rate_hz == out_rate_hz else soxr.ResampleStream(in_rate_hz, out_rate_hz, 1, dtype="int16", quality="HQ")

    def process(self, pcm: np.ndarray) -> np.ndarray:
        if self._stream is None:
            return pcm
        return self._stream.resample_chunk(pcm)

    def flush(self) -> np.ndarray:
        if self._stream is None:
            return np.zeros(0, np.int16)
        out = self._stream.resample_chunk(np.zeros(0, np.int16), last=True)
        self._stream.clear()
        return out


# --- per-direction converters ----------------------------------------------------------------------


def _int16_from_le_bytes(data: bytes) -> np.ndarray:
    if len(data) % 2:
        raise AudioFormatError(f"pcm16 audio must have an even number of bytes, got {len(data)}")
    return np.frombuffer(data, dtype="<i2").astype(np.int16)


class OpusDecoder:
    """One Opus stream -> int16 PCM at `rate_hz`, mono.

    opuslib's `Decoder.decode` turns every decoded sample into a Python int on the way out
    (`array('h', pointer[:n])`), which cost as much as the decoding itself in the gateway's
    profile; here libopus writes into one reused numpy buffer instead.
    """

    def __init__(self, rate_hz: int = ENGINE_RATE_HZ) -> None:
        import opuslib
        import opuslib.api.decoder

        self._state = opuslib.Decoder(rate_hz, 1)  # owns the libopus state (freed with it)
        self._max = rate_hz * 120 // 1000  # the longest Opus packet: 120 ms
        self._buf = np.empty(self._max, np.int16)
        self._ptr = self._buf.ctypes.data_as(opuslib.api.c_int16_pointer)
        self._decode = opuslib.api.decoder.libopus_decode

    def decode(self, payload: bytes) -> np.ndarray:
        if not payload:  # libopus would conceal a "lost" packet: up to 120 ms of audio from nothing
            raise AudioFormatError("empty Opus packet")
        n = self._decode(self._state.decoder_state, payload, len(payload), self._ptr, self._max, 0)
        if n < 0:
            import opuslib.api.info

            detail = opuslib.api.info.strerror(n)
            raise AudioFormatError(f"corrupt Opus packet ({detail.decode() if isinstance(detail, bytes) else detail})")
        return self._buf[:n].copy()


class InputDecoder:
    """Wire payloads of one format -> int16 PCM at 16 kHz."""

    def __init__(self, fmt: WireFormat) -> None:
        self.format = fmt
        # Opus decodes straight to 16 kHz; the PCM formats are resampled from their wire rate
        self._codec = OpusDecoder(ENGINE_RATE_HZ) if fmt is WireFormat.OPUS else StreamResampler(fmt.rate_hz, ENGINE_RATE_HZ)

    def decode(self, payload: bytes) -> np.ndarray:
        if isinstance(self._codec, OpusDecoder):
            return self._codec.decode(payload)
        if self.format is WireFormat.PCM16:
            pcm = _int16_from_le_bytes(payload)
        elif self.format is WireFormat.PCMU:
            pcm = ulaw_decode(payload)
        else:
            pcm = alaw_decode(payload)
        return self._codec.process(pcm)

    def flush(self) -> np.ndarray:
        """What the resampler still holds of the audio decoded so far (a turn ends: it belongs to it)."""
        return self._codec.flush() if isinstance(self._codec, StreamResampler) else np.zeros(0, np.int16)


class OutputEncoder:
    """int16 PCM at 16 kHz -> whole wire frames of `frame_ms` (Opus: always 20 ms)."""

    def __init__(self, fmt: WireFormat, frame_ms: int = 40, opus_bitrate: int = 24_000, opus_complexity: int = 5) -> None:
        self.format = fmt
        self.frame_ms = OPUS_FRAME_MS if fmt is WireFormat.OPUS else frame_ms
        self._opus = None
        if fmt is WireFormat.OPUS:
            import opuslib

            self._opus = opuslib.Encoder(ENGINE_RATE_HZ, 1, opuslib.APPLICATION_VOIP)
            self._opus.bitrate = opus_bitrate
            self._opus.complexity = opus_complexity
            self._resampler = None
            self._frame_samples = ENGINE_RATE_HZ * OPUS_FRAME_MS // 1000
        else:
            self._resampler = StreamResampler(ENGINE_RATE_HZ, fmt.rate_hz)
            self._frame_samples = fmt.rate_hz * self.frame_ms // 1000
        self._pending = np.zeros(0, np.int16)  # wire-rate samples not yet a whole frame

    def encode(self, pcm16k: np.ndarray) -> list[bytes]:
        pcm = pcm16k if self._resampler is None else self._resampler.process(pcm16k)
        return self._frames(np.concatenate([self._pending, pcm]) if self._pending.size else pcm, final=False)

    def flush(self) -> list[bytes]:
        """End of a response: the resampler tail and the last partial frame (Opus pads it with silence)."""
        tail = np.zeros(0, np.int16) if self._resampler is None else self._resampler.flush()
        return self._frames(np.concatenate([self._pending, tail]), final=True)

    def reset(self) -> None:
        """Barge-in: drop what is pending, keep the codec (a new response starts clean)."""
        self._pending = np.zeros(0, np.int16)
        if self._resampler is not None:
            self._resampler.flush()

    def _frames(self, pcm: np.ndarray, final: bool) -> list[bytes]:
        n = self._frame_samples
        whole = pcm.size // n
        out = [self._pack(pcm[i * n : (i + 1) * n]) for i in range(whole)]
        rest = pcm[whole * n :]
        if final and rest.size:
            out.append(self._pack(np.concatenate([rest, np.zeros(n - rest.size, np.int16)]) if self._opus else rest))
            rest = rest[:0]
        self._pending = rest.copy()
        return out

    def _pack(self, frame: np.ndarray) -> bytes:
        if self._opus is not None:
            return self._opus.encode(frame.astype("<i2").tobytes(), self._frame_samples)
        if self.format is WireFormat.PCM16:
            return frame.astype("<i2").tobytes()
        return ulaw_encode(frame) if self.format is WireFormat.PCMU else alaw_encode(frame)


@dataclass(frozen=True)
class AudioFrame:
    """PCM crossing a transport boundary: mono int16 at `sample_rate_hz`, `pts_samples` from stream start."""

    pcm: np.ndarray
    sample_rate_hz: int = ENGINE_RATE_HZ
    pts_samples: int = 0  # position of the first sample on the stream's timeline

    @property
    def duration_ms(self) -> float:
        return 1000.0 * self.pcm.size / self.sample_rate_hz
