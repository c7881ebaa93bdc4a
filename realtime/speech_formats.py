"""The speech endpoint's `response_format`s: the engine's 16 kHz PCM out as OpenAI's formats, streamed.

    enc = SpeechEncoder("mp3", speed=1.0)      # blocking work: call encode/finish in a thread
    enc.encode(pcm_16k) -> bytes               # whatever is ready (may be b"": the codec holds a frame back)
    enc.finish() -> bytes                      # the rest, and the container's trailer

Every format is mono at 24 kHz, OpenAI's output rate (resampled from the engine's 16 kHz by soxr,
`realtime.audio.StreamResampler`):

    pcm    raw signed 16-bit little-endian samples, no header (OpenAI's "pcm")      audio/pcm
    wav    a 44-byte RIFF/WAVE header, then the same samples                          audio/wav
    mp3    MPEG-1 Layer III, libmp3lame, 64 kbit/s                                    audio/mpeg
    aac    AAC-LC in ADTS frames, FFmpeg's encoder, 64 kbit/s                         audio/aac
    opus   Opus (libopus, 32 kbit/s) in Ogg, a page every 100 ms                      audio/ogg
    flac   FLAC                                                                       audio/flac

`speed` other than 1.0 (OpenAI's [0.25, 4.0]) time-stretches the engine's audio before it is
resampled, keeping its pitch (`realtime.time_stretch`, FFmpeg's atempo).

Streamed means nothing is ever rewritten: the output is a pipe, not a file. WAV's header is written
before the length is known, so its two sizes (RIFF and data) hold 0xFFFFFFFF, the "length unknown,
read to the end" value streaming WAV writers use (FFmpeg, libsndfile and Python's `wave` read such a
file to its end). PyAV muxes the other four into a sink that cannot seek, so FLAC's STREAMINFO leaves
its total-samples field 0 ("unknown", as the format allows) and MP3 carries no seek table.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import av
import numpy as np

from engine.service_api import SAMPLE_RATE_HZ
from realtime.audio import StreamResampler
from realtime.time_stretch import TimeStretch

RATE_HZ = 24_000  # OpenAI's speech output rate, every format
UNKNOWN_SIZE = 0xFFFFFFFF  # a streamed WAV's RIFF and data sizes

CONTENT_TYPES = {"mp3": "audio/mpeg", "opus": "audio/ogg", "aac": "audio/aac", "flac": "audio/flac", "wav": "audio/wav",
                 "pcm": "audio/pcm"}
FORMATS = tuple(CONTENT_TYPES)
# format -> (FFmpeg muxer, encoder, bit rate or None, muxer options)
_CODECS = {
    "mp3": ("mp3", "libmp3lame", 64_000, {}),
    "aac": ("adts", "aac", 64_000, {}),
    "opus": ("ogg", "libopus", 32_000, {"page_duration": "100000"}),  # microseconds: a page (and bytes out) every 100 ms
    "flac": ("flac", "flac", None, {}),
}


def wav_header(rate_hz: int = RATE_HZ) -> bytes:
    """RIFF/WAVE, PCM 16-bit mono, both sizes UNKNOWN_SIZE (a stream)."""
    fmt = struct.pack("<HHIIHH", 1, 1, rate_hz, rate_hz * 2, 2, 16)
    return b"RIFF" + struct.pack("<I", UNKNOWN_SIZE) + b"WAVE" + b"fmt " + struct.pack("<I", len(fmt)) + fmt + b"data" + struct.pack("<I", UNKNOWN_SIZE)


class _Sink:
    """A write-only byte pipe for PyAV's muxer (no seek: nothing already sent is rewritten)."""

    def __init__(self) -> None:
        self._parts: list[bytes] = []

    def write(self, data: bytes | memoryview) -> int:
        self._parts.append(bytes(data))
        return len(data)

    def take(self) -> bytes:
        out = b"".join(self._parts)
        self._parts.clear()
        return out


@dataclass
class _Muxer:
    """PyAV's encoder and muxer of one compressed format, writing into `sink`."""

    container: av.container.OutputContainer
    stream: av.AudioStream
    sink: _Sink

    @classmethod
    def open(cls, fmt: str) -> _Muxer:
        muxer, codec, bit_rate, options = _CODECS[fmt]
        sink = _Sink()
        container = av.open(sink, mode="w", format=muxer, options=options)
        stream = container.add_stream(codec, rate=RATE_HZ, layout="mono")
        if not isinstance(stream, av.AudioStream):  # every codec in _CODECS is an audio one
            container.close()
            raise TypeError(f"{codec} did not make an audio stream")
        if bit_rate is not None:
            stream.bit_rate = bit_rate
        return cls(container, stream, sink)


class SpeechEncoder:
    """One reply's audio in `fmt` (one of FORMATS); `encode` then `finish`, from one thread at a time."""

    def __init__(self, fmt: str, speed: float = 1.0) -> None:
        if fmt not in CONTENT_TYPES:
            raise ValueError(f"unknown speech format {fmt!r}")
        self._stretch = None if speed == 1.0 else TimeStretch(speed, SAMPLE_RATE_HZ)
        self.fmt = fmt
        self.content_type = CONTENT_TYPES[fmt]
        self._resampler = StreamResampler(SAMPLE_RATE_HZ, RATE_HZ)
        self._header = wav_header() if fmt == "wav" else b""
        self._pts = 0
        self._finished = False
        self._muxer = _Muxer.open(fmt) if fmt in _CODECS else None  # None: pcm, wav

    def encode(self, pcm_16k: np.ndarray) -> bytes:
        pcm = np.asarray(pcm_16k, np.int16)
        if self._stretch is not None:
            pcm = self._stretch.process(pcm)
        return self._out(self._resampler.process(pcm), final=False)

    def finish(self) -> bytes:
        if self._stretch is None:
            return self._out(self._resampler.flush(), final=True)
        tail = self._resampler.process(self._stretch.flush())
        return self._out(np.concatenate([tail, self._resampler.flush()]), final=True)

    def _out(self, pcm: np.ndarray, final: bool) -> bytes:
        head, self._header = self._header, b""
        m = self._muxer
        if m is None:  # pcm, wav
            return head + pcm.astype("<i2").tobytes()
        if pcm.size:
            frame = av.AudioFrame.from_ndarray(pcm.astype(np.int16).reshape(1, -1), format="s16", layout="mono")
            frame.sample_rate, frame.pts = RATE_HZ, self._pts
            self._pts += pcm.size
            for packet in m.stream.encode(frame):
                m.container.mux(packet)
        if final:
            for packet in m.stream.encode(None):
                m.container.mux(packet)
            self._finished = True
            m.container.close()
        return m.sink.take()

    def close(self) -> None:
        """Free the codec without finishing (the reply was cut); no-op after `finish`."""
        if self._muxer is not None and not self._finished:
            self._finished = True
            try:
                self._muxer.container.close()
            except Exception:  # a muxer that never started may refuse to write its trailer
                pass
