"""The data-parallel gradient reduction of a pipelined model, deferred under ``no_sync`` (gradient accumulation).

Why: a pipelined training forward runs the whole schedule and, by default, sums the step's gradients over the
data-parallel replicas at once (:mod:`.pipeline_runner`). Under gradient accumulation that is one all-reduce of
every gradient per micro-step where DDP does one per optimizer step. The model gets DDP's ``no_sync`` (which
``accelerator.accumulate``, ``accelerator.no_sync`` and the Trainer's accumulation look up): a training forward
inside it keeps its step's gradients local, and its loss's backward adds them (times the gradient flowing into
the loss) to a pending sum per parameter instead of ``.grad``; the first synchronised step's backward adds its
own, all-reduces the pending sums over dp once (the mean for a caller with DDP's contract, the Trainer) and adds
them to ``.grad``. Like DDP's, the choice is made at the forward: run forward and backward in the same context.

Under FSDP nothing is deferred: FSDP reduce-scatters each step's gradients itself (the runner passes no dp group
here), which gives the same gradients with one reduce-scatter per micro-step.

Only the schedule's gradients are pending: ``.grad`` holds nothing of the unsynchronised steps until the
synchronised one (terms on the parameters outside the schedule, a penalty, go to ``.grad`` through ordinary
autograd and are not reduced, as without accumulation).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .micro_batch import GradientSyncControl, no_gradient_sync


class ReplicaSync:
    """The deferred dp reduction of one pipelined model (see the module docstring)."""

    def __init__(self, model: nn.Module, dp_group: dist.ProcessGroup | None, dp_size: int):
        self.group, self.size = dp_group, dp_size
        self.control = GradientSyncControl()
        self.pending: dict[nn.Parameter, torch.Tensor] = {}
        model._hf_colossal_auto_grad_sync = self.control  # micro_batch.set_gradient_sync turns it off
        model.no_sync = functools.partial(no_gradient_sync, model)

    def deferring(self) -> bool:
        """Whether a training forward now leaves the dp reduction to its backward: inside ``no_sync``, or the
        first synchronised step after it (its backward reduces the pending sums with its own)."""
        return self.group is not None and (not self.control.enabled or bool(self.pending))

    def receiver(self, average: bool) -> Any:
        """The backward's sink for a step run while :meth:`deferring`: pending, or reduced with the pending
        sums when the step synchronises."""
        return functools.partial(self._receive, sync=self.control.enabled, average=average)

    def _receive(self, grads: list, *, sync: bool, average: bool) -> None:
        """``grads``: the step's ``(parameter, gradient)``, already scaled by what flowed into the loss; the
        gradients are the step's own, so the first becomes the pending sum itself (no copy)."""
        for param, grad in grads:
            if param in self.pending:
                self.pending[param].add_(grad)
            else:
                self.pending[param] = grad
        if sync:
            self.flush(average)

    def flush(self, average: bool) -> None:
        """All-reduce the pending sums over dp (their mean with ``average``) and add them to ``.grad``."""
        for param, total in self.pending.items():
            dist.all_reduce(_local(total), group=self.group)  # a tensor-parallel DTensor: its shard, in place
            if average:
                total.div_(self.size)
            param.grad = total if param.grad is None else param.grad.add_(total)
        self.pending = {}


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (sharing its storage), a tensor itself."""
    from torch.distributed.tensor import DTensor

    if not isinstance(tensor, DTensor):
        return tensor
    with torch.no_grad():
        return tensor.to_local()
