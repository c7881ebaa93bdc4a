"""Uploaded audio files (the transcription endpoint's `file`) -> the engine's mono int16 PCM at 16 kHz.

    audio = await decode_off_loop(data, limits)      # in a worker thread, under limits.decode_timeout_s
    audio = decode_upload(data, limits)              # the same, blocking (the worker's body)
    audio.pcm, audio.duration_s, audio.container

PyAV (FFmpeg, shipped in its wheel) demuxes, decodes, downmixes and resamples; nothing here parses a
format but the MP4 box tree (realtime/mp4_tables.py). Accepted: WAV, FLAC, MP3, Ogg (Opus, Vorbis,
FLAC), WebM/Matroska (Opus as browsers' MediaRecorder writes it: unknown element sizes, no cues),
MP4/M4A (AAC) and raw ADTS AAC; the first audio stream of the file is the one transcribed.

Only those demuxers may open an upload (FFmpeg's `format_whitelist`): handing user bytes to FFmpeg's
probe otherwise lets an HLS playlist or a concat list make it open other files or URLs.

A hostile file costs what an honest one does (issue 39: a 55-byte FLAC took 2.4 GB, an 8 KB M4A
2.9 GB, a 4 KB WAV stalled the server 7.5 s). Every cost is bounded before it is paid:
- before FFmpeg opens it: an MP4's sample tables (FFmpeg allocates its index from them when opening)
  hold at most `max_table_entries(max_duration_s)` entries; a file that is not MP4 by its first box
  may not reach FFmpeg's mov demuxer at all;
- before decoding: the stream's rate within [MIN_RATE_HZ, MAX_RATE_HZ], at most MAX_CHANNELS
  channels, a declared duration within the limit (with room for a container's estimate);
- while decoding, packet by packet: each frame's rate and channels again (a FLAC frame may declare
  its own), the decoded duration (stops as soon as `max_duration_s` is passed, so an hour-long file
  costs no more than the limit), the bytes held (the PCM so far and the frame in hand) within
  `max_decode_bytes`, and the wall clock within `decode_timeout_s`; each frame is resampled alone
  (bounded: its rate is, and so is its size);
- off the event loop: in a worker thread; PyAV releases the GIL while FFmpeg demuxes, decodes and
  resamples (measured: a live call beside a hostile upload keeps its audio pace), and the loop only
  awaits the thread.

Refused with `UploadError(code, message, status)`: an empty file (`empty_file`), bytes that are not
audio in an accepted container or fail to decode (`invalid_file_format`), a rate, channel count or
sample table out of bounds (`unsupported_audio`, naming which), less than one model frame of audio
(`audio_too_short`), more than `max_duration_s` declared or decoded (`audio_too_long`), decoding
that would hold more than `max_decode_bytes` (`audio_too_complex`) or take more than
`decode_timeout_s` (`decode_timeout`), more than `max_bytes` (`file_too_large`, 413).
"""

from __future__ import annotations

import asyncio
import io
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from http import HTTPStatus

import av
import numpy as np
from av.audio.stream import AudioStream
from av.container import InputContainer

from engine.service_api import FRAME_MS, SAMPLE_RATE_HZ
from realtime.mp4_tables import read_tables

RATE_HZ = SAMPLE_RATE_HZ
MIN_SAMPLES = int(SAMPLE_RATE_HZ * FRAME_MS / 1000)  # one model frame
# FFmpeg demuxer names (a demuxer named "mov,mp4,m4a,3gp,3g2,mj2" matches "mp4")
DEMUXERS = ("wav", "flac", "mp3", "ogg", "matroska", "webm", "mov", "mp4", "m4a", "aac")
MP4_DEMUXERS = ("mov", "mp4", "m4a")  # only for files whose sample tables were read first
ACCEPTED = "WAV, FLAC, MP3, Ogg (Opus, Vorbis), WebM (Opus), M4A/MP4 (AAC)"
_DECODE_ERRORS = (av.error.FFmpegError, ValueError, OSError, EOFError, IndexError)

# 8 kHz is the lowest rate speech is recorded at (telephony); below it there is no speech to hear, and
# upsampling to 16 kHz multiplies samples (8 Hz: x2000, the 55-byte FLAC's 2.4 GB). 192 kHz is the
# highest rate audio interfaces record at; above it FFmpeg's resampler builds a filter that takes
# seconds (a WAV claiming ~100 MHz: 2.5 s in one call) for a ratio no real recording has.
MIN_RATE_HZ = 8_000
MAX_RATE_HZ = 192_000
MAX_CHANNELS = 16  # 7.1 surround and small microphone arrays; decoded memory grows with each channel
# The duration a container declares may be an estimate (MP3 without a header: its first frame's
# bitrate): a file is refused before decoding only when it declares this much more than the limit.
DECLARED_SLACK = 1.25
# packets per second of audio no real codec exceeds (Opus's shortest frames, 2.5 ms, are 400/s):
# what an MP4's sample tables may declare for the duration limit
MAX_PACKETS_PER_S = 1000
# the PCM the engine needs (16 kHz mono int16) times this: the default decoding memory budget
DEFAULT_BUDGET_FACTOR = 4


class UploadError(Exception):
    """An upload the server will not transcribe; `code` and `status` go on the wire."""

    def __init__(self, code: str, message: str, status: HTTPStatus = HTTPStatus.BAD_REQUEST) -> None:
        super().__init__(message)
        self.code, self.message, self.status = code, message, status


@dataclass(frozen=True)
class UploadLimits:
    max_bytes: int
    max_duration_s: float
    max_decode_bytes: int | None = None  # None: DEFAULT_BUDGET_FACTOR x the PCM of max_duration_s
    decode_timeout_s: float = 10.0

    @property
    def decode_budget(self) -> int:
        if self.max_decode_bytes is not None:
            return self.max_decode_bytes
        return int(DEFAULT_BUDGET_FACTOR * self.max_duration_s * RATE_HZ * 2)


@dataclass(frozen=True)
class DecodedAudio:
    pcm: np.ndarray  # mono int16 at 16 kHz
    container: str  # the demuxer FFmpeg used, e.g. "matroska,webm"

    @property
    def duration_s(self) -> float:
        return self.pcm.size / RATE_HZ


async def decode_off_loop(data: bytes, limits: UploadLimits) -> DecodedAudio:
    """decode_upload on a decoder thread; the loop only awaits it. The worker keeps its own wall clock
    (`limits.decode_timeout_s` from when it starts, checked between packets, each of bounded cost);
    when the caller is cancelled (the client left) the worker is told to stop and is waited for, so
    the caller's concurrency slot is held until the memory is let go."""
    cancel = threading.Event()
    work = asyncio.get_running_loop().run_in_executor(_decoders(), decode_upload, data, limits, cancel)
    try:
        return await asyncio.shield(work)
    except asyncio.CancelledError:
        cancel.set()
        await asyncio.wait({work})
        raise


# Uploads are decoded on their own threads, not asyncio's default pool, so that slow decoding cannot
# hold the threads that parse forms or encode speech. As many as audio_api.max_concurrent's default:
# its slots bound how many run. Measured (4 uploads of 110 s Opus at once beside a live answer): 1, 2
# or 4 decoder threads give the same loop gaps; a niced decoder made them worse (the GIL held while
# it waits for a CPU).
DECODE_THREADS = 4
_pool: ThreadPoolExecutor | None = None


def _decoders() -> ThreadPoolExecutor:
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(DECODE_THREADS, "upload-decoder")
    return _pool


def decode_upload(data: bytes, limits: UploadLimits, cancel: threading.Event | None = None) -> DecodedAudio:
    """`data` decoded to 16 kHz mono int16; raises UploadError (see the module docstring). Blocking;
    stops early when `cancel` is set or `limits.decode_timeout_s` has passed."""
    deadline = time.monotonic() + limits.decode_timeout_s
    if len(data) > limits.max_bytes:
        raise UploadError("file_too_large", f"the file is {len(data)} bytes; at most {limits.max_bytes} are accepted",
                          HTTPStatus.REQUEST_ENTITY_TOO_LARGE)
    if not data:
        raise UploadError("empty_file", "the uploaded file is empty")
    demuxers = DEMUXERS if _mp4_checked(data, limits) else tuple(d for d in DEMUXERS if d not in MP4_DEMUXERS)
    try:
        with av.open(io.BytesIO(data), mode="r", options={"format_whitelist": ",".join(demuxers)},
                     metadata_errors="ignore") as container:
            if not container.streams.audio:
                raise UploadError("invalid_file_format", f"the file ({container.format.name}) holds no audio stream")
            stream = container.streams.audio[0]
            _check_stream(container, stream, limits)
            pcm = _decode(container, stream, limits, deadline, cancel)
            name = container.format.name
    except _DECODE_ERRORS as e:
        raise UploadError("invalid_file_format", f"the file is not audio in a supported format ({ACCEPTED}), or it is "
                                                 f"corrupt: {_reason(e)}") from None
    if pcm.size < MIN_SAMPLES:
        raise UploadError("audio_too_short", f"the file holds {1000 * pcm.size / RATE_HZ:.0f} ms of audio; at least "
                                             f"{FRAME_MS:.0f} ms is needed")
    return DecodedAudio(pcm, name)


def max_table_entries(max_duration_s: float) -> int:
    return int(MAX_PACKETS_PER_S * max_duration_s * DECLARED_SLACK) + 1000


def _mp4_checked(data: bytes, limits: UploadLimits) -> bool:
    """True: an MP4 whose sample tables FFmpeg may build its index from; False: not an MP4."""
    tables = read_tables(data)
    if tables is None:
        return False
    if tables.compressed_header:
        raise UploadError("unsupported_audio", "the file's movie header is compressed (cmov), which this server does not open")
    if tables.entries > max_table_entries(limits.max_duration_s):
        raise UploadError("unsupported_audio", f"the file's sample tables declare {tables.entries} entries; at most "
                                               f"{max_table_entries(limits.max_duration_s)} for {limits.max_duration_s:g} s "
                                               "of audio (audio_api.max_duration_s)")
    if tables.audio_s > limits.max_duration_s * DECLARED_SLACK:
        raise _too_long(limits, tables.audio_s)
    return True


def _check_stream(container: InputContainer, stream: AudioStream, limits: UploadLimits) -> None:
    """The stream's parameters, as its container declares them, before anything is decoded."""
    _check_format(stream.sample_rate, stream.channels)
    declared = [float(stream.duration * stream.time_base)] if stream.duration and stream.time_base else []
    if container.duration:
        declared.append(container.duration / av.time_base)
    if declared and min(declared) > limits.max_duration_s * DECLARED_SLACK:
        raise _too_long(limits, min(declared))


def _check_format(rate_hz: int, channels: int) -> None:
    if not MIN_RATE_HZ <= rate_hz <= MAX_RATE_HZ:
        raise UploadError("unsupported_audio", f"the audio's sample rate is {rate_hz} Hz; it must be within "
                                               f"{MIN_RATE_HZ}..{MAX_RATE_HZ} Hz")
    if not 1 <= channels <= MAX_CHANNELS:
        raise UploadError("unsupported_audio", f"the audio has {channels} channels; at most {MAX_CHANNELS} are accepted")


def _decode(container: InputContainer, stream: AudioStream, limits: UploadLimits, deadline: float,
            cancel: threading.Event | None) -> np.ndarray:
    """Packet by packet, each frame checked, then resampled alone; the PCM kept as int16 16 kHz parts."""
    resampler = av.AudioResampler(format="s16", layout="mono", rate=RATE_HZ)
    budget = limits.decode_budget
    parts: list[np.ndarray] = []
    held = 0  # bytes of the parts
    decoded_s = 0.0
    for packet in container.demux(stream):
        if cancel is not None and cancel.is_set():
            raise UploadError("decode_cancelled", "the request was cancelled while its file was decoded")
        if time.monotonic() > deadline:
            raise _timeout(limits)
        for frame in packet.decode():
            _check_format(frame.sample_rate, len(frame.layout.channels))
            frame_bytes = frame.samples * len(frame.layout.channels) * frame.format.bytes
            if held + frame_bytes + 2 * frame.samples * RATE_HZ // frame.sample_rate > budget:
                raise UploadError("audio_too_complex", f"decoding the file would hold more than {budget / 2**20:.1f} MiB "
                                                       "(audio_api.max_decode_mb)")
            for out in resampler.resample(frame):
                parts.append(out.to_ndarray().reshape(-1))
                held += parts[-1].nbytes
            decoded_s += frame.samples / frame.sample_rate
            if decoded_s > limits.max_duration_s:
                raise _too_long(limits)
    for out in resampler.resample(None):
        parts.append(out.to_ndarray().reshape(-1))
    pcm = np.concatenate(parts).astype(np.int16, copy=False) if parts else np.zeros(0, np.int16)
    if pcm.size > limits.max_duration_s * RATE_HZ:
        raise _too_long(limits)
    return pcm


def _too_long(limits: UploadLimits, declared_s: float | None = None) -> UploadError:
    what = "the audio is longer" if declared_s is None else f"the file declares {declared_s:.0f} s of audio, more"
    return UploadError("audio_too_long", f"{what} than {limits.max_duration_s:g} s, the most this server "
                                         "transcribes at once (audio_api.max_duration_s)")


def _timeout(limits: UploadLimits) -> UploadError:
    return UploadError("decode_timeout", f"decoding the file took longer than {limits.decode_timeout_s:g} s "
                                         "(audio_api.decode_timeout_s)")


def _reason(e: Exception) -> str:
    text = getattr(e, "strerror", None) or str(e) or type(e).__name__
    return text.split(": '")[0]  # PyAV appends the (meaningless) file name of an in-memory input
