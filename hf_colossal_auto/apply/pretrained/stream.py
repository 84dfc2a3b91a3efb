"""The streamed gather of a save: each full tensor reaches the writing rank, one at a time, in blocks.

Why: the writer of a ``from_pretrained`` directory needs every tensor whole, but no rank may hold the full
model. A tensor split over one mesh dim comes to the writer in blocks of :data:`STREAM_BLOCK_BYTES` (another
rank's rows, or full rows assembled from every rank's columns) and is written as it arrives; any other layout
is gathered whole by DTensor (:func:`_gathered` picks). Used by :mod:`.save` and :mod:`.collective`.
"""

from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Iterator
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from ..safetensors_io import bytes_of

STREAM_BLOCK_BYTES = 16 * 2**20
"""Most bytes of a sharded tensor the writer receives at once: one block of another rank's rows, or one block of
full rows assembled from every rank's columns."""


def _row_blocks(local: torch.Tensor, ranks: int, dim: int) -> list[torch.Tensor]:
    """A contiguous shard cut on dim 0 into views (one row at least), the same cut on every rank: blocks of at
    most :data:`STREAM_BLOCK_BYTES`, or for a shard on another dim (whose ``ranks`` blocks side by side make
    full rows) at most that divided among the ranks."""
    if local.shape[0] == 0:
        return []
    row_bytes = max(1, local[0].numel() * local.element_size())
    budget = STREAM_BLOCK_BYTES if dim == 0 else STREAM_BLOCK_BYTES // ranks
    step = max(1, budget // row_bytes)
    return [local[i : i + step] for i in range(0, local.shape[0], step)]


class _StreamedTensor:
    """A tensor split evenly on tensor dim ``dim`` over ``ranks``, as the writer receives it, in row order: for
    a row split, each rank's rows in turn; for a split of another dim, each block of rows assembled from every
    rank's columns of it. The writer's own part is a view of its shard; every other rank's comes in blocks
    (:data:`STREAM_BLOCK_BYTES`), received when the writer asks for it and dropped once written — the writer
    never holds another rank's whole shard, let alone the full tensor. Iterate it exactly once, on the writer,
    before the next collective; the other ranks call :func:`_send_blocks`."""

    def __init__(self, local: torch.Tensor, ranks: list[int], writer: int, dim: int) -> None:
        self.local, self.ranks, self.writer, self.dim = local, ranks, writer, dim
        self.blocks = _row_blocks(local, len(ranks), dim)

    def _from(self, rank: int, block: torch.Tensor) -> torch.Tensor:
        if rank == self.writer:
            return block
        import torch.distributed as dist

        received = torch.empty_like(block)
        dist.recv(_as_bytes(received), src=rank)
        return received

    def __iter__(self) -> Iterator[torch.Tensor]:
        if self.dim == 0:
            for rank in self.ranks:
                for block in self.blocks:
                    yield self._from(rank, block)
        else:
            for block in self.blocks:
                yield torch.cat([self._from(rank, block) for rank in self.ranks], dim=self.dim)

    def held_bytes(self) -> int:
        """The most bytes of this tensor in hand at once beyond the writer's own shard: one block received,
        or for an assembled row block the other ranks' parts and the assembled rows."""
        largest = max((b.numel() * b.element_size() for b in self.blocks), default=0)
        return largest if self.dim == 0 else largest * (2 * len(self.ranks) - 1)

    def joined(self) -> torch.Tensor:
        """The whole tensor (for a file written whole): the blocks concatenated."""
        return torch.cat(list(self), dim=0)


def _split_group(value: DTensor, writer: int) -> tuple[list[int], int] | None:
    """The ranks holding ``value``'s parts beside the writer, in order, and the tensor dim they split — when
    ``value`` is split evenly over one mesh dim and replicated over any other (Megatron's column and row
    splits, FSDP's shards, a ``dp x 1`` mesh); None for any other layout."""
    placements = value.placements
    split = [d for d, p in enumerate(placements) if not p.is_replicate()]
    if len(split) != 1 or not placements[split[0]].is_shard() or value.ndim == 0:
        return None
    mesh, (mesh_dim,) = value.device_mesh, split
    dim = placements[mesh_dim].dim % value.ndim
    if value.shape[dim] % mesh.size(mesh_dim) != 0:
        return None
    coordinate = (mesh.mesh == writer).nonzero()[0].tolist()
    coordinate[mesh_dim] = slice(None)
    return mesh.mesh[tuple(coordinate)].tolist(), dim


def _send_blocks(local: torch.Tensor, ranks: int, dim: int, writer: int) -> None:
    """The other side of :class:`_StreamedTensor`: this rank's shard to the writer, block by block."""
    import torch.distributed as dist

    for block in _row_blocks(local, ranks, dim):
        dist.send(_as_bytes(block), dst=writer)


def _as_bytes(block: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's memory as uint8 (no copy): point-to-point sends move bytes of any dtype alike."""
    return block.reshape(-1).view(torch.uint8)


def _held_bytes(value: torch.Tensor | _StreamedTensor) -> int:
    """The most bytes of one gathered tensor in hand at once while it is written."""
    return value.held_bytes() if isinstance(value, _StreamedTensor) else value.numel() * value.element_size()


def _write_bytes(out: Any, value: torch.Tensor | _StreamedTensor) -> None:
    """A gathered tensor's bytes (row-major, little-endian as the host) appended to an open file; with no file
    (a writer told not to write), a streamed tensor is still received in full, which its senders wait for."""
    for piece in value if isinstance(value, _StreamedTensor) else [value]:
        if out is None:
            continue
        out.write(bytes_of(piece.detach().cpu().contiguous()))


def _return_freed_pages() -> None:
    """glibc's ``malloc_trim``: the gathered tensors, freed one after the other, would otherwise stay in the
    heap (glibc raises its mmap threshold after each large free) and the writer's resident memory would grow by
    a file's worth (measured: +0.2 GiB on the 1.1B benchmark; +0.09 GiB with this). No-op without glibc."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).malloc_trim(0)


def _gathered(live: torch.Tensor, writer: int) -> torch.Tensor | _StreamedTensor | None:
    """The full tensor on CPU on rank ``writer``, None elsewhere (collective over the tensor's mesh).

    The writer alone needs it, so the cheapest collective that brings it there is used: none for a replicated
    tensor (the writer has it) or on a mesh without the writer (another replica group's copy); a tensor split
    evenly over one mesh dim streamed to the writer in blocks (:class:`_StreamedTensor`); DTensor's all-gather
    (``full_tensor``) for any other layout."""
    import torch.distributed as dist

    value = live.detach()
    rank = dist.get_rank() if dist.is_initialized() else writer
    if not isinstance(value, DTensor):
        return value.cpu().contiguous() if rank == writer else None
    mesh = value.device_mesh
    if writer not in mesh.mesh.flatten().tolist():
        return None
    placements = value.placements
    if all(p.is_replicate() for p in placements):
        return value.to_local().cpu().contiguous() if rank == writer else None
    group = _split_group(value, writer)
    if group is not None:  # streamed to the writer block by block
        ranks, dim = group
        if rank not in ranks:
            return None
        local = value.to_local().contiguous()
        if rank != writer:
            _send_blocks(local, len(ranks), dim, writer)
            return None
        return _StreamedTensor(local, ranks, writer, dim)
    full = value.full_tensor()
    return full.cpu().contiguous() if rank == writer else None
