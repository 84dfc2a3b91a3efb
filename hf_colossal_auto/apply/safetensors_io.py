"""Read slices of safetensors files with ``pread`` instead of a memory map.

Why: ``safetensors.safe_open`` maps the whole file, and every page a slice read touches stays resident in the
process (it counts in its RSS) until the file is closed; a slice across rows (a column shard) touches every
page of the tensor. Reading the slice's byte runs with ``os.preadv`` straight into the result tensor's memory
keeps a rank's resident memory at its shards plus the tensor being read: the file's pages stay in the
kernel's page cache, shared and reclaimable, not mapped into the process.

The format is safetensors' own: an 8-byte little-endian header length, a JSON header
(``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``), then the tensors' bytes,
little-endian and row-major. :class:`TensorSlice` offers what ``safe_open(...).get_slice(key)`` offers and
transformers' shard-on-read uses: ``get_shape()``, ``get_dtype()`` and indexing by a tuple of slices.
"""

from __future__ import annotations

import ctypes
import json
import math
import os
import struct
from itertools import product
from pathlib import Path
from typing import Any

import torch

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}  # fmt: skip
CODES: dict[torch.dtype, str] = {dtype: code for code, dtype in DTYPES.items()}


def read_header(path: str | Path) -> tuple[int, dict[str, Any]]:
    """(byte offset where the tensors' data starts, the JSON header without ``__metadata__``)."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    header.pop("__metadata__", None)
    return 8 + length, header


class SafetensorsFile:
    """An open safetensors file whose tensors are read slice by slice with ``pread``."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.data_start, self.header = read_header(self.path)
        self.fd = os.open(self.path, os.O_RDONLY)

    def __enter__(self) -> SafetensorsFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def keys(self) -> list[str]:
        return list(self.header)

    def get_slice(self, key: str) -> TensorSlice:
        entry = self.header[key]
        if entry["dtype"] not in DTYPES:
            raise ValueError(
                f"{self.path}: tensor {key!r} has dtype {entry['dtype']}, which torch cannot hold"
            )
        begin, _ = entry["data_offsets"]
        return TensorSlice(self.fd, self.data_start + begin, tuple(entry["shape"]), entry["dtype"])


class TensorSlice:
    """One tensor of an open file; indexing reads only the requested slice."""

    def __init__(self, fd: int, offset: int, shape: tuple[int, ...], dtype: str):
        self.fd, self.offset, self.shape, self.dtype = fd, offset, shape, dtype

    def get_shape(self) -> list[int]:
        return list(self.shape)

    def get_dtype(self) -> str:
        return self.dtype

    def __getitem__(self, index: Any) -> torch.Tensor:
        return self.read(_normalise(index, self.shape))

    def read(self, ranges: list[tuple[int, int]], out: torch.Tensor | None = None) -> torch.Tensor:
        """The block ``[start, stop)`` per dim, read as runs of contiguous bytes (one run per index of the dims
        before the last partial one; a block of whole rows is one run), into ``out`` when given (contiguous, of
        the file's dtype and the block's shape: a shard read in place, without a temporary).

        Many small runs (a column shard: one run per row) cost a system call each; then the rows are read
        whole in one call and the columns copied out — a temporary of the tensor's size instead of thousands
        of calls."""
        shape = [stop - start for start, stop in ranges]
        if out is None:
            out = torch.empty(shape, dtype=DTYPES[self.dtype])
        if out.numel() == 0:
            return out
        itemsize = out.element_size()
        if not ranges:  # a 0-d tensor: one element
            _pread_exactly(self.fd, bytes_of(out), self.offset)
            return out
        # the dims from ``inner`` on are read whole within each run: every dim after the last partial one,
        # plus that partial one itself
        partial = [d for d, (start, stop) in enumerate(ranges) if (start, stop) != (0, self.shape[d])]
        inner = partial[-1] if partial else 0
        runs = math.prod(stop - start for start, stop in ranges[:inner])
        run_bytes = math.prod(shape[inner:]) * itemsize
        if runs > _MANY_RUNS and run_bytes < _SMALL_RUN:
            wide = ranges[:inner] + [(0, n) for n in self.shape[inner:]]
            block = self.read(wide)
            out.copy_(block[(slice(None),) * inner + tuple(slice(a, b) for a, b in ranges[inner:])])
            return out
        strides = [math.prod(self.shape[d + 1 :]) for d in range(len(self.shape))]
        buffer = bytes_of(out)
        position = 0
        for outer in product(*(range(start, stop) for start, stop in ranges[:inner])):
            element = sum(i * strides[d] for d, i in enumerate(outer)) + ranges[inner][0] * strides[inner]
            _pread_exactly(self.fd, buffer[position : position + run_bytes], self.offset + element * itemsize)
            position += run_bytes
        return out


_MANY_RUNS = 64
_SMALL_RUN = 1 << 18  # bytes


def bytes_of(tensor: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory (valid while the tensor lives).

    Not through ``Tensor.numpy()``: that marks the tensor's storage as not resizable for good, and FSDP2 frees
    and re-allocates its unsharded parameters by resizing their storage — a parameter once written to a file
    that way fails the next reshard ("Trying to resize storage that is not resizable")."""
    size = tensor.numel() * tensor.element_size()
    if size == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_ubyte * size).from_address(tensor.data_ptr())).cast("B")


def _normalise(index: Any, shape: tuple[int, ...]) -> list[tuple[int, int]]:
    """``[start, stop)`` per dim from ``...``, a slice or a tuple of slices (steps of 1, as shard-on-read uses)."""
    if index is Ellipsis:
        index = ()
    if not isinstance(index, tuple):
        index = (index,)
    index = tuple(i for i in index if i is not Ellipsis)
    if len(index) > len(shape):
        raise IndexError(f"{len(index)} indices for a tensor of {len(shape)} dims")
    ranges = []
    for d, size in enumerate(shape):
        item = index[d] if d < len(index) else slice(None)
        if not isinstance(item, slice) or item.step not in (None, 1):
            raise IndexError(f"only contiguous slices can be read, got {item!r} on dim {d}")
        start, stop, _ = item.indices(size)
        ranges.append((start, max(start, stop)))
    return ranges


def _pread_exactly(fd: int, target: memoryview, offset: int) -> None:
    """Fill ``target`` from ``offset`` (``preadv`` may return fewer bytes than asked)."""
    done = 0
    while done < len(target):
        got = os.preadv(fd, [target[done:]], offset + done)
        if got <= 0:
            raise OSError(f"unexpected end of file reading {len(target)} bytes at offset {offset}")
        done += got
