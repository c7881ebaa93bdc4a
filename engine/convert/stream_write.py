"""Write one safetensors file tensor by tensor from an mmap-ed `torch.load`, in bounded memory.

`safetensors.torch.save_file` needs every tensor of the file in memory at once. Here the header
is written first (names, dtypes and shapes are known from the mmap-ed checkpoint without reading
any data), then each tensor's bytes are converted and appended in chunks of `CHUNK_BYTES`.

Pages of the source that were read stay resident (and counted in RSS) while the mapping lives, so
after each chunk the writer tells the kernel it may drop them (`madvise(MADV_DONTNEED)`). That is
done only for addresses inside a *file* mapping of the checkpoint (checked in /proc/self/maps):
on a private file mapping that nobody wrote to, dropped pages are simply re-read from the file if
touched again; on anonymous memory it would zero the data, so it is never done there.
"""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import struct
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

CHUNK_BYTES = 64 << 20
_ST_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
_MADV_DONTNEED = 4


class PageDropper:
    """Drops resident pages of `path`'s mappings in this process (Linux; a no-op elsewhere)."""

    def __init__(self, path: Path) -> None:
        self._ranges: list[tuple[int, int]] = []
        self._madvise: Callable | None = None
        maps = Path("/proc/self/maps")
        if not maps.is_file():
            return
        target = str(Path(path).resolve())
        for line in maps.read_text().splitlines():
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and parts[5] == target:
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                self._ranges.append((lo, hi))
        if self._ranges:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            self._madvise = libc.madvise

    @property
    def active(self) -> bool:
        return self._madvise is not None

    def drop(self, t: torch.Tensor) -> None:
        if self._madvise is None or t.numel() == 0:
            return
        start = t.data_ptr()
        end = start + t.numel() * t.element_size()
        for lo, hi in self._ranges:
            if lo <= start and end <= hi:
                page = mmap.PAGESIZE
                a, b = start - start % page, min(hi, -(-end // page) * page)
                self._madvise(a, b - a, _MADV_DONTNEED)
                return


def _header(entries: list[tuple[str, torch.dtype, tuple[int, ...]]], metadata: dict[str, str]) -> bytes:
    header: dict = {"__metadata__": metadata}
    offset = 0
    for name, dtype, shape in entries:
        n = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        header[name] = {"dtype": _ST_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(len(raw) + 8) % 8)  # data starts 8-byte aligned
    return struct.pack("<Q", len(raw)) + raw


def write_safetensors(
    path: Path,
    tensors: Iterable[tuple[str, Callable[[], torch.Tensor]]],
    shapes: dict[str, tuple[int, ...]],
    dtype: torch.dtype,
    dropper: PageDropper | None = None,
    metadata: dict[str, str] | None = None,
) -> int:
    """Write `path` holding `(name, get_tensor)` in the given order, every tensor cast to `dtype`.

    `shapes` gives each tensor's shape up front (for the header); a tensor that turns out
    different raises. Returns the number of bytes written.
    """
    items = list(tensors)
    entries = [(name, dtype, tuple(shapes[name])) for name, _ in items]
    tmp = Path(str(path) + ".partial")
    with open(tmp, "wb") as f:
        f.write(_header(entries, metadata or {"format": "pt"}))
        for name, get in items:
            t = get()
            if tuple(t.shape) != tuple(shapes[name]):
                raise ValueError(f"{name}: shape {tuple(t.shape)} != {tuple(shapes[name])}")
            if t.dtype not in _ST_DTYPES:
                raise ValueError(f"{name}: unsupported source dtype {t.dtype}")
            if not t.is_contiguous():
                t = t.contiguous()
            flat = t.reshape(-1)
            step = max(1, CHUNK_BYTES // max(1, t.element_size()))
            for chunk in flat.split(step):
                out = chunk.to(dtype)
                f.write(memoryview(out.view(torch.uint8).numpy()))
                del out
                if dropper is not None:
                    dropper.drop(chunk)
            del t, flat
        size = f.tell()
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)
    return size
