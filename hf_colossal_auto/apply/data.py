"""The batch rule, and what a training loop needs to feed a planned model.

**One rule for every entry point** (``autoparallelize``, ``AutoParallelAccelerator``, ``AutoParallelCallback``):
the example batch a process passes is *one process's batch as plain DDP would feed it*, and the global batch
of a step is that times the number of processes, whatever mesh the planner picks. The planner sees that
global batch; on a ``dp x tp`` mesh each data-parallel group — the ``tp`` ranks that compute together —
consumes ``tp`` processes' batches, and the ``dp`` groups consume disjoint parts. On a ``dp x cp x tp`` mesh
(context parallelism) a group is its ``cp x tp`` ranks: each holds the group's rows, whole sequences, and the
model keeps its part of each sequence (:mod:`.context_parallel`).

A torchrun script does not know the mesh before planning, so it asks the planned model:
:func:`data_parallel_info` (which group this rank is in, how many there are), :func:`shard_batch` (this
group's rows of a global batch) or ``hf_colossal_auto.data_parallel_loader`` (a ``DataLoader`` made with the
per-process batch size, re-cut for the group).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@dataclass(frozen=True)
class DataParallelInfo:
    """Where this process sits in a planned model's mesh, for feeding it data.

    Attributes:
        rank: index of this process's data-parallel group (``0 <= rank < size``); the ``tp_size`` processes
            of one group read the same batch.
        size: number of data-parallel groups (the mesh's ``dp``).
        tp_size: processes per group (the mesh's ``tp``): a group's batch is ``tp_size`` per-process batches.
        world_size: processes in the job (``size * tp_size * cp_size * pp_size``).
        pp_size: pipeline stages' ranks (the mesh's ``pp``): a group's batch is also shared by the ranks of its
            pipeline, so it is ``tp_size x pp_size`` per-process batches.
        cp_size: context-parallel ranks (the mesh's ``cp``): they too read the group's rows, whole sequences
            (the model keeps each rank's part of them), so a group's batch is ``tp_size x cp_size x pp_size``
            per-process batches.
    """

    rank: int
    size: int
    tp_size: int
    world_size: int
    pp_size: int = 1
    cp_size: int = 1

    @property
    def group_processes(self) -> int:
        """Processes that compute on one group's batch (``tp_size x cp_size x pp_size``)."""
        return self.tp_size * self.cp_size * self.pp_size

    def group_batch_size(self, per_process_batch_size: int) -> int:
        """Samples one group reads per step when each process was meant to read ``per_process_batch_size``."""
        return per_process_batch_size * self.group_processes


def global_batch(
    batch: Mapping[str, Any], processes: int, device: torch.device | None = None
) -> dict[str, Any]:
    """What one step consumes over all processes, from one per-process batch: every tensor repeated
    ``processes`` times along dim 0 (shapes matter, not values: the planner traces on fake tensors)."""

    def grow(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            value = value if device is None else value.to(device)
            return value.repeat((processes,) + (1,) * (value.dim() - 1))
        return value

    return {k: grow(v) for k, v in batch.items()}


def data_parallel_info(model: nn.Module) -> DataParallelInfo:
    """This process's data-parallel group in the plan applied to ``model`` (one group of everything for an
    unplanned model in a single process)."""
    plan = getattr(model, "_hf_colossal_auto_plan", None)
    mesh = getattr(model, "_hf_colossal_auto_mesh", None)
    if plan is None or mesh is None:
        raise ValueError(
            f"{type(model).__name__} has no plan applied: call hf_colossal_auto.autoparallelize(model, batch) "
            "(or apply_plan) first, then ask for its data-parallel layout"
        )
    names = tuple(mesh.mesh_dim_names or ())
    rank = mesh.get_local_rank("dp") if "dp" in names and mesh.ndim > 1 else 0
    return DataParallelInfo(
        rank=rank,
        size=plan.dp_size,
        tp_size=plan.tp_size,
        world_size=mesh.size(),
        pp_size=plan.pp_size,
        cp_size=plan.cp_size,
    )


def shard_batch(batch: Mapping[str, Any], model: nn.Module) -> dict[str, Any]:
    """This process's data-parallel group's rows of a *global* batch (every tensor split along dim 0 into
    ``dp`` equal parts). The global batch must be the same on every rank (same data, same order). Under context
    parallelism the rows keep their whole sequences: the model cuts this rank's part of them itself."""
    info = data_parallel_info(model)
    out: dict[str, Any] = {}
    for key, value in batch.items():
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            rows = value.shape[0]
            if rows % info.size:
                raise ValueError(
                    f"shard_batch: {key!r} has {rows} rows, which the {info.size} data-parallel groups of this "
                    f"plan cannot split evenly; make the global batch a multiple of {info.size}"
                )
            part = rows // info.size
            value = value[info.rank * part : (info.rank + 1) * part]
        out[key] = value
    return out
