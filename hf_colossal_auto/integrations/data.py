"""``data_parallel_loader``: a torchrun script's ``DataLoader``, re-cut for the plan applied to its model.

The script builds its loader as for plain DDP (``batch_size`` = one process's batch); after
``autoparallelize`` this gives each data-parallel group its disjoint shard of the data, ``tp`` per-process
batches per step, the same rows for every rank of a tensor-parallel group — the batch rule of
:mod:`hf_colossal_auto.apply.data`, with accelerate's data-loader sharding as the accelerate integration uses it.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.utils.data import DataLoader

from ..apply.data import data_parallel_info
from .accelerator import shard_data_loader


def data_parallel_loader(loader: DataLoader, model: nn.Module, **prepare_kwargs: Any) -> DataLoader:
    """``loader`` (made with one process's batch size, not yet sharded: no ``DistributedSampler``) as this
    process's data-parallel group reads it under ``model``'s plan. Extra keyword arguments go to accelerate's
    ``prepare_data_loader`` (e.g. ``device``, ``even_batches``)."""
    info = data_parallel_info(model)
    return shard_data_loader(
        loader, dp_size=info.size, dp_rank=info.rank, tp_size=info.tp_size, **prepare_kwargs
    )
