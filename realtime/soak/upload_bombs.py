"""Hostile audio uploads, generated (nothing large is stored): each is a few bytes or KB that asks a
decoder for far more memory or time than its size suggests (issue 39).

    flac_rate_bomb()      one FLAC frame of 65535 samples declared at 8 Hz: 2.3 hours of audio
    wav_rate_bomb()       a WAV whose header claims ~100 MHz: building a resampler for it takes seconds
    m4a_table_bomb()      an M4A whose sample table declares 85 million AAC frames

The tests (tests/realtime/test_upload_bombs.py) and the soak's upload-bomb fault send them to
`POST /v1/audio/transcriptions`; the server must refuse each with a fast 400.
"""

from __future__ import annotations

import io
import struct

import numpy as np

BOMB_SAMPLES = 85_000_000


def _crc(data: bytes, poly: int, bits: int) -> int:
    crc, top, mask = 0, 1 << (bits - 1), (1 << bits) - 1
    for byte in data:
        crc ^= byte << (bits - 8)
        for _ in range(8):
            crc = ((crc << 1) ^ poly) & mask if crc & top else (crc << 1) & mask
    return crc


def flac_rate_bomb(rate_hz: int = 8, block: int = 65535, frames: int = 1, total_samples: int | None = None) -> bytes:
    """STREAMINFO declaring `rate_hz` (and `total_samples`, default: what the frames hold; 0: unknown),
    then `frames` frames of `block` samples of one constant value, 13 bytes each (55 bytes in all for one)."""
    total = block * frames if total_samples is None else total_samples
    info = struct.pack(">HH", block, block) + b"\0\0\0" + b"\0\0\0"
    # 20 bits rate, 3 bits channels-1 (mono), 5 bits bps-1 (16), 36 bits total samples
    packed = (rate_hz << 44) | (0 << 41) | (15 << 36) | total
    info += packed.to_bytes(8, "big") + bytes(16)  # MD5 unknown
    out = [b"fLaC" + bytes([0x80]) + len(info).to_bytes(3, "big") + info]  # the last metadata block
    for number in range(frames):
        # sync, fixed blocksize; block code 0111 (16-bit size-1 at end), rate 0000 (STREAMINFO's); mono, 16 bit;
        # the frame number UTF-8 coded (one byte below 128)
        assert number < 128, "frame numbers above 127 take more UTF-8 bytes"
        frame = bytes([0xFF, 0xF8, 0x70, 0x08, number]) + (block - 1).to_bytes(2, "big")
        frame += bytes([_crc(frame, 0x07, 8)])
        frame += bytes([0x00]) + (1000).to_bytes(2, "big", signed=True)  # CONSTANT subframe, value 1000
        out.append(frame + _crc(frame, 0x8005, 16).to_bytes(2, "big"))
    return b"".join(out)


def wav_rate_bomb(rate_hz: int = 99_999_999, channels: int = 1, data_bytes: int = 4096) -> bytes:
    """A 16-bit WAV of `data_bytes` of noise whose header claims `rate_hz` and `channels`."""
    pcm = np.random.default_rng(0).integers(-3000, 3000, data_bytes // 2, dtype=np.int16).astype("<i2").tobytes()
    fmt = struct.pack("<HHIIHH", 1, channels, rate_hz, rate_hz * 2 * channels & 0xFFFFFFFF, 2 * channels, 16)
    body = b"WAVE" + b"fmt " + struct.pack("<I", len(fmt)) + fmt + b"data" + struct.pack("<I", len(pcm)) + pcm
    return b"RIFF" + struct.pack("<I", len(body)) + body


def _boxes(data: bytes, start: int, end: int) -> list[tuple[bytes, bytes]]:
    out, at = [], start
    while at + 8 <= end:
        size, kind = struct.unpack(">I4s", data[at:at + 8])
        out.append((kind, data[at + 8:at + size]))
        at += size
    return out


def mp4_box(kind: bytes, payload: bytes) -> bytes:
    return struct.pack(">I4s", 8 + len(payload), kind) + payload


_CONTAINERS = (b"moov", b"trak", b"mdia", b"minf", b"stbl")


def _rewrite(kind: bytes, payload: bytes, samples: int, frame: int) -> bytes:
    if kind in _CONTAINERS:
        return mp4_box(kind, b"".join(_rewrite(k, p, samples, frame) for k, p in _boxes(payload, 0, len(payload))))
    if kind == b"stsz":  # one size for every sample: the count costs the file 4 bytes
        size = struct.unpack(">I", payload[8:12])[0] or struct.unpack(">I", payload[12:16])[0]
        return mp4_box(kind, bytes(4) + struct.pack(">II", size, samples))
    if kind == b"stts":
        return mp4_box(kind, bytes(4) + struct.pack(">III", 1, samples, frame))
    return mp4_box(kind, payload)


def m4a_table_bomb(samples: int = BOMB_SAMPLES) -> bytes:
    """A real one-second AAC M4A whose sample table is rewritten to declare `samples` frames of 1024."""
    import av

    buf = io.BytesIO()
    with av.open(buf, "w", format="ipod") as out:
        stream = out.add_stream("aac", rate=16000, layout="mono")
        t = np.arange(16000) / 16000
        frame = av.AudioFrame.from_ndarray((0.3 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)[None, :], format="fltp", layout="mono")
        frame.sample_rate = 16000
        for packet in [*stream.encode(frame), *stream.encode(None)]:
            out.mux(packet)
    data = buf.getvalue()
    # the muxer writes mdat before moov: rewriting moov moves no sample offset
    return b"".join(_rewrite(kind, payload, samples, 1024) for kind, payload in _boxes(data, 0, len(data)))


def hostile_uploads() -> dict[str, bytes]:
    """Every bomb above, by name (the soak's upload-bomb fault sends each; each must be a 400)."""
    return {"flac_at_8_hz": flac_rate_bomb(), "wav_at_100_mhz": wav_rate_bomb(), "wav_of_64_channels": wav_rate_bomb(16_000, 64),
            "m4a_of_85m_frames": m4a_table_bomb(), "flac_declaring_10_hours": flac_rate_bomb(8_000, total_samples=8_000 * 36_000),
            "flac_of_13_minutes_undeclared": flac_rate_bomb(8_000, frames=100, total_samples=0)}
