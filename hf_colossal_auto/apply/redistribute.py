"""Bringing an activation to the placement a plan gives it, for every runtime hook that does (the placement
hooks of :mod:`.enforce`, the exits of :mod:`.local_tensor_parallel`'s regions)."""

from __future__ import annotations

from typing import Any

from torch.distributed.tensor import DTensor, Placement, Replicate, Shard


def redistribute_as_planned(value: Any, placement: Placement) -> Any:
    """``value`` (a DTensor on a 1-D tensor-parallel mesh; anything else is returned as it is) brought to the
    plan's ``placement``, except a shard of a dim this batch does not split evenly: kept whole (replicated)
    instead, since DTensor refuses to flatten an uneven shard and a plan made for one batch shape meets others
    (the last, smaller batch of an epoch)."""
    if not isinstance(value, DTensor) or value.device_mesh.ndim != 1:
        return value
    current = value.placements[0]
    if current == placement:
        return value
    if isinstance(placement, Shard) and placement.dim >= value.dim():
        return value
    if isinstance(placement, Shard) and value.shape[placement.dim] % value.device_mesh.size(0):
        # a batch of another shape than the plan's (the last, smaller batch of an epoch): a dim the plan splits
        # evenly does not split here, and DTensor refuses to flatten an uneven shard; keep it whole
        placement = Replicate()
        if current == placement:
            return value
    return value.redistribute(value.device_mesh, [placement])
