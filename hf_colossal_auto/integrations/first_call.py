"""Plan from the model's first training call, for training loops whose batches are not keyword arguments.

Why: the planner traces ``model(**batch)``, so it needs the step's keyword arguments. A loader that yields
tuples (``TensorDataset``) does not say which tensor is which argument, but the training loop does when it
calls ``model(input_ids=x, labels=x)``: the arguments of that call are exactly what the step needs. So the
model is wrapped to plan on its first call that records gradients (every rank: rank 0 plans from that call's
arguments, the plan is broadcast and applied), and then runs the call on the planned model. Calls without
gradients before it (an evaluation first) run on the unplanned model, which every rank holds whole.

The data follow the one batch rule of :mod:`.data`: a tensor-parallel group computes on the union of the
batches plain accelerate gives its processes. Loaders are prepared as plain accelerate prepares them, and the
plan re-cuts them when it is made, which takes effect from each loader's next epoch; the epoch in flight at the
first call (that call's batch included) still yields per-process batches. While a call's batch is per-process
(:func:`.data.batch_is_per_process`), the call gathers the per-process batches of its ``tp`` ranks along dim 0
(in rank order: the rows plain accelerate gives ranks ``d·tp … d·tp+tp−1``, exactly the group batch of the
re-cut loaders) and hands each rank back its own rows of every per-sample output; per-process batches of one
group must then have the same shapes (a collator that pads to one length). The loss is the group's mean, and
gradients and losses over the job equal DDP's (and one process's on the global batch).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .._torch_compat import tree_map
from ..apply.context_parallel_outputs import defer_now, transform_fields
from ..apply.micro_batch import set_gradient_sync
from ..apply.runtime import batch_group_mesh
from .data import batch_is_per_process

NOT_PER_SAMPLE = frozenset({"cache_position"})
"""Arguments whose dim 0 is not the batch even when its length happens to equal the batch's."""


def named_arguments(
    forward: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> dict[str, Any]:
    """The call ``forward(*args, **kwargs)`` as keyword arguments only (what the planner's ``model(**batch)``
    takes): positional arguments get their parameter names, ``**kwargs`` entries are spread out."""
    signature = inspect.signature(forward)
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError as exc:
        raise TypeError(
            f"cannot read the model call's arguments as {forward.__qualname__} takes them: {exc}"
        ) from exc
    named: dict[str, Any] = {}
    for name, value in bound.arguments.items():
        kind = signature.parameters[name].kind
        if kind is inspect.Parameter.VAR_KEYWORD:
            named.update(value)
        elif kind is inspect.Parameter.VAR_POSITIONAL:
            if value:
                raise TypeError(
                    f"{forward.__qualname__} got {len(value)} extra positional arguments (*{name}), which have no "
                    "names to plan with; pass them as keyword arguments"
                )
        else:
            named[name] = value
    return named


class TensorParallelBatch:
    """Gathers a tensor-parallel group's per-process batches into the group's batch, and cuts outputs back.

    Per-sample tensors are those with the batch's row count on dim 0 (the rows of the first tensor argument:
    ``input_ids`` for transformers models); other arguments must already be the same on every rank (they are
    passed on as they are)."""

    def __init__(self, model: nn.Module) -> None:
        mesh = batch_group_mesh(
            model._hf_colossal_auto_mesh
        )  # tp ranks, or cp x tp under context parallelism
        self.group = mesh.get_group()
        self.size = mesh.size()
        self.rank = mesh.get_local_rank()

    def gather(self, named: dict[str, Any]) -> tuple[dict[str, Any], int]:
        """``named`` with every per-sample tensor replaced by the group's rows; returns it and this rank's rows."""
        tensors = [(k, v) for k, v in named.items() if isinstance(v, torch.Tensor) and v.dim() > 0]
        rows = tensors[0][1].shape[0] if tensors else 0
        per_sample = [(k, v) for k, v in tensors if v.shape[0] == rows and k not in NOT_PER_SAMPLE]
        layout = [(k, tuple(v.shape), str(v.dtype)) for k, v in per_sample]
        layouts: list[Any] = [None] * self.size
        dist.all_gather_object(layouts, layout, group=self.group)
        if any(other != layout for other in layouts):
            raise ValueError(
                "the processes of one tensor-parallel group called the model with batches of different shapes "
                f"({layouts}); with a plan made from the model's first call their batches are computed together, "
                "so they must have the same shapes: pad every batch to one length (e.g. the collator's "
                "padding='max_length'), or make the DataLoader yield dicts so that the plan is made at prepare()"
            )
        out = dict(named)
        for key, value in per_sample:
            if value.requires_grad:
                from torch.distributed.nn.functional import all_gather as differentiable_all_gather

                parts = differentiable_all_gather(value.contiguous(), group=self.group)
            else:
                parts = [torch.empty_like(value) for _ in range(self.size)]
                dist.all_gather(parts, value.contiguous(), group=self.group)
            out[key] = torch.cat(parts)
        return out, rows

    def own_rows(self, output: Any, rows: int) -> Any:
        """This rank's rows of every per-sample output tensor (dim 0 of the group's row count)."""
        total = rows * self.size

        def cut(value: Any) -> Any:
            if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == total and rows:
                if value.requires_grad:
                    return _OwnRows.apply(value, self.rank, rows, self.size, self.group)
                return value[self.rank * rows : (self.rank + 1) * rows]
            return value

        # a HF ModelOutput keeps its class; a context-parallel one its fields' lazy gather (cut after it)
        return transform_fields(output, functools.partial(tree_map, cut))


class _OwnRows(torch.autograd.Function):
    """This rank's rows of a group output; backward hands every rank the group's gradient: the gradients of
    every rank's rows, all-gathered in rank order, divided by the group's size.

    Why: a loss the loop computes from its own rows (``mse_loss(model(x), y)`` on this process's batch) differs
    per rank, and so would the replicated parameters' gradients (each only its rows'), parting the group's
    copies of the model. With the gathered gradient every rank of the group gets the mean over its ranks of their
    losses' gradients — what DDP's average over those processes is; the data-parallel average then completes
    DDP's over the job."""

    @staticmethod
    def forward(ctx: Any, value: torch.Tensor, rank: int, rows: int, size: int, group: Any) -> torch.Tensor:
        ctx.size, ctx.group = size, group
        return value[rank * rows : (rank + 1) * rows].clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        parts = [torch.empty_like(grad) for _ in range(ctx.size)]
        dist.all_gather(parts, grad.contiguous(), group=ctx.group)
        return torch.cat(parts).div_(ctx.size), None, None, None, None


def plan_on_first_call(model: nn.Module, parallelize: Callable[[nn.Module, dict[str, Any]], None]) -> None:
    """Wrap ``model.forward`` so that its first call with gradients enabled runs ``parallelize(model, batch)``
    (``batch``: that call's keyword arguments; it must apply a plan with ``apply_plan``) and then the call on the
    planned model; with a tensor-parallel plan, calls on per-process batches gather their group's (module doc).

    The wrapper stays ``model.forward`` (accelerate's autocast wraps it, ``unwrap_model`` finds it), and the
    runtime's own forward wrapper is installed around the original forward behind it."""
    inner = model.forward
    state: dict[str, Any] = {"planned": None, "batch": None, "no_sync": 0}

    @functools.wraps(inner)
    def forward(*args: Any, **kwargs: Any) -> Any:
        planned = state["planned"]
        if planned is None:
            if not torch.is_grad_enabled():  # evaluation before training: the whole model, on every rank
                return inner(*args, **kwargs)
            named = named_arguments(inner, args, kwargs)
            outer = model.__dict__["forward"]  # this wrapper, or accelerate's autocast around it
            model.forward = inner  # the runtime wraps the model's own forward
            try:
                # traced as the model is (the planner models mixed precision itself), not under the caller's autocast
                with torch.autocast(next(model.parameters()).device.type, enabled=False):
                    parallelize(model, named)
                state["planned"] = model.forward
                plan = model._hf_colossal_auto_plan
                state["batch"] = TensorParallelBatch(model) if plan.batch_group_size > 1 else None
                if state["no_sync"]:  # planned inside no_sync(): this backward accumulates locally too
                    set_gradient_sync(model, False)
            finally:
                model.forward = outer
            # again through the module's __call__: the hooks the plan registered on the root (FSDP's) must run
            return model(*args, **kwargs)
        batch: TensorParallelBatch | None = state["batch"]
        if batch is None or not batch_is_per_process():  # a re-cut loader's batch is already the group's
            return planned(*args, **kwargs)
        gathered, rows = batch.gather(named_arguments(inner, args, kwargs))
        # context parallelism: this rank's rows cut after the sequence's gather (cp ranks cut different rows)
        return batch.own_rows(defer_now(model, planned(**gathered)), rows)

    @contextlib.contextmanager
    def no_sync_until_planned() -> Any:
        """DDP's ``no_sync`` before the plan exists (accelerate looks it up when its context is entered, so a
        first call inside ``accelerator.no_sync(model)`` would otherwise synchronise): a plan made inside
        turns the synchronisation off for that call's backward, and on again at the context's end."""
        state["no_sync"] += 1
        try:
            yield
        finally:
            state["no_sync"] -= 1
            if state["planned"] is not None and not state["no_sync"]:
                set_gradient_sync(model, True)

    model.forward = forward
    model.no_sync = no_sync_until_planned  # the plan's runtime puts its own in place when it is applied
    model._hf_colossal_auto_plans_on_first_call = True
