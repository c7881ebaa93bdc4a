"""Uploaded audio files (the transcription endpoint's `file`) -> the engine's mono int16 PCM at 16 kHz.

    audio = decode_upload(data, UploadLimits(max_bytes, max_duration_s))   # blocking: call it in a thread
    audio.pcm, audio.duration_s, audio.container

PyAV (FFmpeg, shipped in its wheel) demuxes, decodes, downmixes and resamples; nothing here parses a
format. Accepted: WAV, FLAC, MP3, Ogg (Opus, Vorbis, FLAC), WebM/Matroska (Opus as browsers'
MediaRecorder writes it: unknown element sizes, no cues), MP4/M4A (AAC) and raw ADTS AAC; the first
audio stream of the file is the one transcribed.

Only those demuxers may open an upload (FFmpeg's `format_whitelist`): handing user bytes to FFmpeg's
probe otherwise lets an HLS playlist or a concat list make it open other files or URLs.

Refused with `UploadError(code, message, status)`: an empty file (`empty_file`), bytes that are not
audio in an accepted container or fail to decode (`invalid_file_format`), less than one model frame
of audio (`audio_too_short`), more than `max_duration_s` (`audio_too_long`: decoding stops as soon
as the limit is passed, so an hour-long file costs no more than the limit), more than `max_bytes`
(`file_too_large`, 413).
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from http import HTTPStatus

import av
import numpy as np

from engine.service_api import FRAME_MS, SAMPLE_RATE_HZ

RATE_HZ = SAMPLE_RATE_HZ
MIN_SAMPLES = int(SAMPLE_RATE_HZ * FRAME_MS / 1000)  # one model frame
# FFmpeg demuxer names (a demuxer named "mov,mp4,m4a,3gp,3g2,mj2" matches "mp4")
DEMUXERS = ("wav", "flac", "mp3", "ogg", "matroska", "webm", "mov", "mp4", "m4a", "aac")
ACCEPTED = "WAV, FLAC, MP3, Ogg (Opus, Vorbis), WebM (Opus), M4A/MP4 (AAC)"
_DECODE_ERRORS = (av.error.FFmpegError, ValueError, OSError, EOFError, IndexError)


class UploadError(Exception):
    """An upload the server will not transcribe; `code` and `status` go on the wire."""

    def __init__(self, code: str, message: str, status: HTTPStatus = HTTPStatus.BAD_REQUEST) -> None:
        super().__init__(message)
        self.code, self.message, self.status = code, message, status


@dataclass(frozen=True)
class UploadLimits:
    max_bytes: int
    max_duration_s: float


@dataclass(frozen=True)
class DecodedAudio:
    pcm: np.ndarray  # mono int16 at 16 kHz
    container: str  # the demuxer FFmpeg used, e.g. "matroska,webm"

    @property
    def duration_s(self) -> float:
        return self.pcm.size / RATE_HZ


def decode_upload(data: bytes, limits: UploadLimits) -> DecodedAudio:
    """`data` decoded to 16 kHz mono int16; raises UploadError (see the module docstring)."""
    if len(data) > limits.max_bytes:
        raise UploadError("file_too_large", f"the file is {len(data)} bytes; at most {limits.max_bytes} are accepted",
                          HTTPStatus.REQUEST_ENTITY_TOO_LARGE)
    if not data:
        raise UploadError("empty_file", "the uploaded file is empty")
    max_samples = int(limits.max_duration_s * RATE_HZ)
    try:
        with av.open(io.BytesIO(data), mode="r", options={"format_whitelist": ",".join(DEMUXERS)},
                     metadata_errors="ignore") as container:
            if not container.streams.audio:
                raise UploadError("invalid_file_format", f"the file ({container.format.name}) holds no audio stream")
            pcm = _decode(container, container.streams.audio[0], max_samples, limits.max_duration_s)
            name = container.format.name
    except _DECODE_ERRORS as e:
        raise UploadError("invalid_file_format", f"the file is not audio in a supported format ({ACCEPTED}), or it is "
                                                 f"corrupt: {_reason(e)}") from None
    if pcm.size < MIN_SAMPLES:
        raise UploadError("audio_too_short", f"the file holds {1000 * pcm.size / RATE_HZ:.0f} ms of audio; at least "
                                             f"{FRAME_MS:.0f} ms is needed")
    return DecodedAudio(pcm, name)


def _decode(container, stream, max_samples: int, max_duration_s: float) -> np.ndarray:
    resampler = av.AudioResampler(format="s16", layout="mono", rate=RATE_HZ)
    parts: list[np.ndarray] = []
    n = 0
    for frame in container.decode(stream):
        for out in resampler.resample(frame):
            parts.append(out.to_ndarray().reshape(-1))
            n += parts[-1].size
        if n > max_samples:
            raise UploadError("audio_too_long", f"the audio is longer than {max_duration_s:g} s, the most this server "
                                                "transcribes at once (audio_api.max_duration_s)")
    for out in resampler.resample(None):
        parts.append(out.to_ndarray().reshape(-1))
    pcm = np.concatenate(parts).astype(np.int16, copy=False) if parts else np.zeros(0, np.int16)
    if pcm.size > max_samples:
        raise UploadError("audio_too_long", f"the audio is longer than {max_duration_s:g} s, the most this server "
                                            "transcribes at once (audio_api.max_duration_s)")
    return pcm


def _reason(e: Exception) -> str:
    text = getattr(e, "strerror", None) or str(e) or type(e).__name__
    return text.split(": '")[0]  # PyAV appends the (meaningless) file name of an in-memory input
