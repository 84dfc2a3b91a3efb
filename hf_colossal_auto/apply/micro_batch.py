"""Micro-batches with gradient accumulation, as a plan with ``micro_batches = k > 1`` runs a step.

The planner may split each data-parallel group's batch into k micro-batches (``Plan.micro_batches``): activation
memory is one micro-batch's, compute is k micro-batches', and the gradients are synchronised over the
data-parallel axis **once**, after the last one. A torchrun loop does it with :func:`accumulate`::

    for batch in data_parallel_loader(loader, model):
        for micro in accumulate(model, batch):  # k pieces; gradient sync deferred to the last
            loss = model(**micro.inputs).loss * micro.weight
            loss.backward()
        optimizer.step()
        optimizer.zero_grad()

``micro.weight`` is the micro-batch's share of the loss items of the whole batch (label tokens that are not
-100, counted as transformers' Trainer counts ``num_items_in_batch``: after the shift for causal LM losses), so
the summed losses and the accumulated gradients equal the step on the batch in one piece, to fp32 rounding —
also when padding makes the micro-batches' token counts differ.

Deferring the synchronisation: under DDP the runtime's own gradient hooks (``runtime._make_sync_hook``) skip
the all-reduce while :func:`no_gradient_sync` is active, so the gradients accumulate locally and the last
micro-batch's backward all-reduces their sum; under FSDP2 it is ``set_requires_gradient_sync(False)`` (the
unsharded gradients accumulate, and the last backward reduce-scatters them).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..plan import Plan

logger = logging.getLogger(__name__)

IGNORE_INDEX = -100
"""Label value the HF losses skip."""


@dataclass
class GradientSyncControl:
    """Whether the runtime's data-parallel gradient hooks synchronise now (off between micro-batches)."""

    enabled: bool = True


@dataclass(frozen=True)
class MicroBatch:
    """One piece of a data-parallel group's batch.

    Attributes:
        inputs: the ``model(**inputs)`` keyword arguments of this piece (every batched tensor's rows
            ``[start, start + size)``; other values as given).
        weight: what to multiply the piece's mean loss by so that the pieces' sum is the whole batch's mean
            loss (its loss items over the batch's; ``size / rows`` without labels).
        num_items_in_batch: loss items in the whole batch (transformers' name), for losses that take it.
        index: position of the piece, from 0.
        last: whether it is the last piece (its backward synchronises the gradients).
    """

    inputs: dict[str, Any]
    weight: float
    num_items_in_batch: int | None
    index: int
    last: bool


def plan_of(model_or_plan: nn.Module | Plan) -> Plan:
    """The plan applied to a model (or the plan itself): where the micro-batch count comes from."""
    if isinstance(model_or_plan, Plan):
        return model_or_plan
    plan = getattr(model_or_plan, "_hf_colossal_auto_plan", None)
    if plan is None:
        raise ValueError(
            f"{type(model_or_plan).__name__} has no plan applied: call hf_colossal_auto.autoparallelize(model, "
            "batch) first, or pass the Plan"
        )
    return plan


def _batch_rows(batch: Mapping[str, Any]) -> int:
    """The batch dimension every batched tensor shares."""
    rows = {v.shape[0] for v in batch.values() if isinstance(v, torch.Tensor) and v.dim() > 0}
    if len(rows) != 1:
        raise ValueError(f"a batch's tensors must share one batch dimension to split it; got {sorted(rows)}")
    return rows.pop()


def split_batch(batch: Mapping[str, Any], pieces: int) -> list[dict[str, Any]]:
    """``batch`` cut into ``pieces`` equal runs of rows along dim 0 (values that are not batched tensors are
    repeated in every piece)."""
    rows = _batch_rows(batch)
    if pieces < 1 or rows % pieces:
        raise ValueError(
            f"a batch of {rows} rows does not split into {pieces} equal micro-batches; make the batch a "
            f"multiple of {pieces} (the plan's micro_batches) or re-plan for this batch"
        )
    size = rows // pieces
    return [
        {
            k: v[i * size : (i + 1) * size] if isinstance(v, torch.Tensor) and v.dim() > 0 else v
            for k, v in batch.items()
        }
        for i in range(pieces)
    ]


def micro_batches(batch: Mapping[str, Any], model_or_plan: nn.Module | Plan) -> list[dict[str, Any]]:
    """A data-parallel group's batch cut into the plan's ``micro_batches`` pieces (one piece when 1)."""
    return split_batch(batch, plan_of(model_or_plan).micro_batches)


_ACCUMULATING = "_hf_colossal_auto_accumulating"
"""Attribute of a model: how many :func:`accumulate` loops are running over it (their pieces are chosen)."""


class WholeBatchError(ValueError):
    """A training forward got more rows than one micro-batch of a plan with ``micro_batches`` > 1."""


def _rows_of(args: tuple, kwargs: Mapping[str, Any]) -> int | None:
    """The batch dimension of the first batched tensor among a forward's arguments (keywords first)."""
    for value in (*kwargs.values(), *args):
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return value.shape[0]
    return None


def check_micro_batch_rows(model: nn.Module, args: tuple, kwargs: Mapping[str, Any]) -> None:
    """Refuse a training forward (gradients on) of a k > 1 plan fed more rows than one micro-batch.

    Why: the plan fits its memory budget only with each data-parallel group's batch run in k pieces; the batch
    in one piece keeps k times the activations for backward and runs over the budget the caller set (silently,
    until the device runs out). No-op for k = 1, under ``torch.no_grad()`` (evaluation, generation) and for a
    model without a plan, and inside :func:`accumulate` (whose ``micro_batches`` argument chooses the pieces)."""
    plan = getattr(model, "_hf_colossal_auto_plan", None)
    if plan is None or plan.micro_batches <= 1 or not torch.is_grad_enabled():
        return
    if getattr(model, _ACCUMULATING, 0):
        return
    k = plan.micro_batches
    group_rows = plan.global_batch_size // max(1, plan.dp_size)
    micro_rows = max(1, group_rows // k)
    rows = _rows_of(args, kwargs)
    if rows is not None and rows > micro_rows:
        raise WholeBatchError(
            f"the {plan.model_class}'s plan runs each data-parallel group's batch of {group_rows} rows as {k} "
            f"micro-batches of {micro_rows} (Plan.micro_batches), but this training forward got {rows} rows in "
            f"one piece, which needs more memory than the plan fits in its budget. Train with `for micro in "
            f"hf_colossal_auto.accumulate(model, batch): (model(**micro.inputs).loss * micro.weight).backward()` "
            f"(README, 'Micro-batches'), or re-plan with micro_batches=1 (then the budget must hold the batch in "
            f"one piece)."
        )


def loss_shifts_labels(model: nn.Module) -> bool:
    """Whether the model's loss compares position t with label t + 1 (causal LM): then position 0's label is
    never a loss item. Read from the loss the model really calls (``model.loss_function``), not its
    ``loss_type``, which is None for models whose config leaves it unset (GPT-2) though they shift;
    encoder-decoder models compute their own unshifted loss."""
    name = type(model).__name__
    try:
        from transformers.loss.loss_utils import ForCausalLMLoss
    except ImportError:  # an old transformers: by class name
        return name.endswith(("ForCausalLM", "LMHeadModel"))
    if getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        return False
    try:
        return getattr(model, "loss_function", None) is ForCausalLMLoss
    except (AttributeError, KeyError, ValueError):  # a model without transformers' loss mapping
        return name.endswith(("ForCausalLM", "LMHeadModel"))


def count_loss_items(batch: Mapping[str, Any], shift: bool) -> int | None:
    """Label tokens that count in the mean loss (not -100; after the causal shift when ``shift``); None when
    the batch has no ``labels`` (``shift_labels`` taken as given, as the Trainer does)."""
    if "shift_labels" in batch and isinstance(batch["shift_labels"], torch.Tensor):
        labels = batch["shift_labels"]
    elif isinstance(batch.get("labels"), torch.Tensor):
        labels = batch["labels"][..., 1:] if shift else batch["labels"]
    else:
        return None
    return int(labels.ne(IGNORE_INDEX).sum())


def set_gradient_sync(model: nn.Module, enabled: bool) -> None:
    """Turn the data-parallel gradient synchronisation of a planned model on or off (off: the next backwards
    accumulate gradients locally; the first backward with it on synchronises their sum)."""
    control = getattr(model, "_hf_colossal_auto_grad_sync", None)
    if control is not None:
        control.enabled = enabled
    setter = getattr(model, "set_requires_gradient_sync", None)  # FSDP2's root module
    if setter is not None:
        setter(enabled)


@contextlib.contextmanager
def no_gradient_sync(model: nn.Module) -> Iterator[None]:
    """Backwards inside accumulate gradients without synchronising them over the data-parallel axis (DDP's
    ``no_sync``); the first backward after it synchronises everything accumulated."""
    set_gradient_sync(model, False)
    try:
        yield
    finally:
        set_gradient_sync(model, True)


def accumulate(
    model: nn.Module, batch: Mapping[str, Any], micro_batches: int | None = None
) -> Iterator[MicroBatch]:
    """Iterate over a data-parallel group's batch in ``micro_batches`` pieces (default: the applied plan's),
    with the gradient synchronisation deferred until the last piece's backward; see the module docstring for
    the loop. Each piece's ``weight`` makes the summed losses — and so the gradients — the whole batch's."""
    k = plan_of(model).micro_batches if micro_batches is None else micro_batches
    pieces = split_batch(batch, k)
    shift = loss_shifts_labels(model)
    counts = [count_loss_items(p, shift) for p in pieces]
    total = sum(c for c in counts if c is not None) if all(c is not None for c in counts) else None
    if total == 0:
        logger.warning("accumulate: the batch has no label that counts (all -100); the pieces weigh equally")
        total = None
    setattr(model, _ACCUMULATING, getattr(model, _ACCUMULATING, 0) + 1)
    try:
        for i, piece in enumerate(pieces):
            last = i == k - 1
            weight = counts[i] / total if total is not None else 1.0 / k
            item = MicroBatch(piece, weight, total, i, last)
            if last:
                yield item
            else:
                with no_gradient_sync(model):
                    yield item
    finally:
        setattr(model, _ACCUMULATING, getattr(model, _ACCUMULATING, 1) - 1)
