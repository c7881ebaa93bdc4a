"""An MP4/M4A/MOV upload's sample tables, read before FFmpeg opens it (issue 39).

    tables = read_tables(data)     # None: not an ISO BMFF file (then it must not reach FFmpeg's mov demuxer)
    tables.entries, tables.audio_s, tables.compressed_header

Why: FFmpeg's mov demuxer builds each track's index from its sample table while OPENING the file
(mov_read_header -> mov_build_index), before a single packet is read, about 12 bytes per declared
sample, and nothing in its options bounds that. A sample table costs the file 4 bytes however many
samples it declares (`stsz` with one size for all, `stts` with one run), so an 8 KB M4A declaring
85 million AAC frames made FFmpeg allocate ~1 GB (the gateway +2.9 GB) just to open it. Walking the
box tree here costs microseconds and no allocation beyond the counts: realtime/audio_upload.py
refuses a file whose tables declare more entries than its duration limit could need, before FFmpeg
sees it.

What is counted, per file: every sample-table entry count that FFmpeg allocates by (stsz/stz2
samples, stts, ctts, stsc, stco/co64, stss, elst entries, and movie fragments' `trun` samples). One
exception, measured: a track of constant-size samples of duration 1 (raw PCM in a MOV, one "sample"
per PCM sample) is indexed per chunk, not per sample (85 million such samples open in 53 MB), so its
samples are not counted as entries (its chunks are). `audio_s` is the longest duration a sound
track declares (mdhd, and the sum of its stts runs). A compressed movie header (`cmov`, zlib) would
hide the tables from this walk: it is reported so that the caller refuses it.

Box sizes are clamped to their parent, size 0 runs to the parent's end, size 1 is a 64-bit size:
as FFmpeg reads them, so this walk sees the tables FFmpeg will.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

# the boxes an ISO BMFF file starts with (FFmpeg's mov probe looks for these at offset 0)
TOP_LEVEL = frozenset({b"ftyp", b"moov", b"mdat", b"free", b"skip", b"wide", b"pdin", b"styp", b"sidx", b"moof", b"uuid", b"junk", b"pnot"})
_CONTAINERS = frozenset({b"moov", b"trak", b"mdia", b"minf", b"stbl", b"edts", b"moof", b"traf", b"mvex"})
_COUNTED = frozenset({b"stts", b"ctts", b"stsc", b"stco", b"co64", b"stss", b"elst"})  # full box, then a 32-bit entry count


@dataclass
class _Track:
    sound: bool = False
    timescale: int = 0
    mdhd_duration: int = 0
    samples: int = 0  # stsz/stz2
    constant_size: bool = False
    stts_runs: int = 0
    stts_first_delta: int = 0
    stts_samples: int = 0  # the sum of the runs' counts
    stts_ticks: int = 0
    entries: int = 0  # the other tables' entry counts


@dataclass(frozen=True)
class Mp4Tables:
    entries: int  # sample-table entries FFmpeg would allocate for, all tracks and fragments together
    audio_s: float  # the longest duration a sound track declares (0: none declared)
    compressed_header: bool  # a `cmov` box: tables this walk cannot see


def read_tables(data: bytes) -> Mp4Tables | None:
    """The file's sample-table counts; None when `data` does not start as an ISO BMFF file."""
    if len(data) < 8 or data[4:8] not in TOP_LEVEL:
        return None
    tracks: list[_Track] = []
    state = {"trun": 0, "cmov": False}
    _walk(data, 0, len(data), tracks, None, state)
    entries = state["trun"]
    audio_s = 0.0
    for t in tracks:
        pcm_like = t.constant_size and t.stts_runs == 1 and t.stts_first_delta == 1
        entries += t.entries + (0 if pcm_like else max(t.samples, t.stts_samples))
        if t.sound and t.timescale:
            audio_s = max(audio_s, t.mdhd_duration / t.timescale, t.stts_ticks / t.timescale)
    return Mp4Tables(entries, audio_s, bool(state["cmov"]))


def _walk(data: bytes, at: int, end: int, tracks: list[_Track], track: _Track | None, state: dict) -> None:
    while at + 8 <= end:
        size, kind = struct.unpack_from(">I4s", data, at)
        header = 8
        if size == 1:
            if at + 16 > end:
                return
            size, header = struct.unpack_from(">Q", data, at + 8)[0], 16
        elif size == 0:
            size = end - at
        if size < header:
            return  # FFmpeg stops reading this level here too
        box_end = min(at + size, end)
        body = at + header
        if kind == b"trak":
            track = _Track()
            tracks.append(track)
            _walk(data, body, box_end, tracks, track, state)
            track = None
        elif kind in _CONTAINERS:
            _walk(data, body, box_end, tracks, track, state)
        elif kind == b"cmov":
            state["cmov"] = True
        elif kind == b"trun" and body + 8 <= box_end:
            state["trun"] += struct.unpack_from(">I", data, body + 4)[0]
        elif track is not None:
            _leaf(data, kind, body, box_end, track)
        at = box_end


def _leaf(data: bytes, kind: bytes, body: int, end: int, track: _Track) -> None:
    def u32(offset: int) -> int:
        return struct.unpack_from(">I", data, body + offset)[0] if body + offset + 4 <= end else 0

    if kind == b"hdlr":
        # a QuickTime track has a second hdlr (in minf: the data handler), which must not undo the first
        track.sound = track.sound or data[body + 8:body + 12] == b"soun"
    elif kind == b"mdhd":
        if data[body:body + 1] == b"\x01" and body + 32 <= end:  # version 1: 64-bit times
            track.timescale, track.mdhd_duration = struct.unpack_from(">IQ", data, body + 20)
        else:
            track.timescale, track.mdhd_duration = u32(12), u32(16)
    elif kind == b"stsz":
        track.constant_size, track.samples = u32(4) != 0, u32(8)
    elif kind == b"stz2":
        track.samples = u32(8)
    elif kind in _COUNTED:
        n = u32(4)
        track.entries += n
        if kind == b"stts":
            # the runs stored in the file (bounded by its size): their sum is the declared sample count
            stored = min(n, max(0, (end - body - 8) // 8))
            runs = np.frombuffer(data, ">u4", 2 * stored, body + 8).reshape(-1, 2).astype(np.uint64)
            track.stts_ticks += int((runs[:, 0] * runs[:, 1]).sum())
            track.stts_samples += int(runs[:, 0].sum())
            if not track.stts_runs and stored:
                track.stts_first_delta = int(runs[0, 1])
            track.stts_runs += stored
