"""Gradient accumulation in the integrations: the user's accumulation steps are the plan's micro-batches.

accelerate (``Accelerator(gradient_accumulation_steps=g)`` with ``accelerator.accumulate(model)``) and the Trainer
(``gradient_accumulation_steps=g``) feed a process g batches of its per-device size per optimizer step. The
global batch of a step is therefore ``per-device batch x processes x g``, and the plan is made for exactly that:
that global batch, in ``g`` micro-batches (memory at one of them, one gradient synchronisation per step — the
runtime's ``model.no_sync``, which accelerate looks up, defers it). When no plan fits those settings, the
planner is asked which micro-batch count would, and the error names the settings that give it, for the same
global batch.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

import torch

from ..plan import Plan
from ..solve.problem import InfeasibleError

logger = logging.getLogger(__name__)

PlanFor = Callable[[Mapping[str, Any], int | None, int | None], Plan]
"""``plan(batch, micro_batches, pipeline)``: the integration's ``plan_model`` call with its other settings."""


def plan_for_loop(
    plan: PlanFor,
    batch: Mapping[str, Any],
    steps: int,
    pipeline: int | None,
    per_device_batch: int,
    processes: int,
    settings: tuple[str, str],
) -> Plan:
    """The plan for a loop that runs each optimizer step as ``steps`` forwards over equal parts of ``batch`` (the
    global batch of a step), with pipeline stages searched (``pipeline`` None), fixed (>= 2) or not (1).

    A plan without stages runs the parts as its micro-batches (:func:`plan_for_accumulation`). A pipelined
    forward splits whatever batch it is given into its schedule's micro-batches, so a pipeline plan is made for
    one forward's part, its schedule's count searched, and the loop's ``steps`` forwards each run it. Stages
    are searched (``pipeline`` None) only without accumulation (``steps`` 1), where both kinds of plan are
    made for the same batch and their predicted steps compare; with accumulation the search keeps to plans
    without stages (a fixed pp degree still plans one forward's part)."""
    if pipeline is not None and pipeline > 1 and steps > 1:
        return plan(forward_part(batch, steps), 1, pipeline)
    if pipeline is None and steps > 1:
        logger.info(
            "pipeline stages not searched: the loop accumulates %s %d forwards a step, and a pipelined forward "
            "runs its own micro-batches (set %s=1 and a %d-times larger %s to let the planner weigh stages, or "
            "fix pipeline= to a pp degree)",
            settings[1], steps, settings[1], steps, settings[0],
        )  # fmt: skip
        pipeline = 1
    return plan_for_accumulation(
        lambda k: plan(batch, k, pipeline if k == steps else 1), steps, per_device_batch, processes, settings
    )


def forward_part(batch: Mapping[str, Any], steps: int) -> dict[str, Any]:
    """The first of ``steps`` equal parts of a global batch (its rows): what one forward of the loop gets."""
    rows = next(v.shape[0] for v in batch.values() if isinstance(v, torch.Tensor) and v.dim() > 0)
    if rows % steps:
        raise ValueError(f"the global batch of {rows} rows does not split into {steps} accumulation steps")
    return {
        k: v[: rows // steps] if isinstance(v, torch.Tensor) and v.dim() > 0 else v for k, v in batch.items()
    }


def plan_for_accumulation(
    plan: Callable[[int | None], Plan],
    steps: int,
    per_device_batch: int,
    processes: int,
    settings: tuple[str, str],
) -> Plan:
    """``plan(steps)``: the plan for the user's settings (``steps`` micro-batches). If none fits, ``plan(None)``
    searches the micro-batch count and the raised :class:`InfeasibleError` says which per-device batch and
    accumulation steps (``settings``: their names in the user's API) keep the global batch and fit — or, when
    no count fits either, is the search's own error."""
    try:
        return plan(steps)
    except InfeasibleError as exc:
        try:
            found = plan(None)
        except InfeasibleError as searched:  # nothing fits at any k: the search's error says how far it went
            raise searched from None
        raise InfeasibleError(
            _advice(exc, found, steps, per_device_batch, processes, settings),
            min_required=exc.min_required,
            exact=exc.exact,
            choice=None,
        ) from exc


def _advice(
    exc: InfeasibleError,
    found: Plan,
    steps: int,
    per_device_batch: int,
    processes: int,
    settings: tuple[str, str],
) -> str:
    """The error for settings no plan fits, with the settings of the plan the search found."""
    batch_name, steps_name = settings
    k = found.micro_batches
    rows = per_device_batch * steps  # a process's share of the global batch per optimizer step
    current = f"{batch_name}={per_device_batch}, {steps_name}={steps}"
    head = f"No plan fits these settings ({current}; global batch {rows * processes}): {exc}"
    if rows % k:
        return (
            f"{head} A plan that runs each replica's batch in {k} micro-batches fits (mesh "
            f"{'x'.join(map(str, found.mesh_shape))}), but {rows} rows per process do not split into {k}: use a "
            f"global batch that does."
        )
    return (
        f"{head} The same global batch fits as {k} micro-batches (mesh {'x'.join(map(str, found.mesh_shape))}, "
        f"{found.dp_mode}): set {batch_name}={rows // k}, {steps_name}={k}."
    )
