"""``autoparallelize(model, batch)``: the entry point of a plain ``torch.distributed`` loop (torchrun).

Why here and not in ``apply/``: it plans (``solve/``) and may calibrate the running job (``device="calibrate"``),
and the runtime (``apply/``) never imports the planner or the integrations; it hands the plan to
:func:`~hf_colossal_auto.apply.runtime.apply_plan`. Public as ``hf_colossal_auto.autoparallelize``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ..apply.agree import DEFAULT_TIMEOUT_S, as_timedelta
from ..apply.data import global_batch
from ..apply.runtime import apply_plan, plan_on_one_rank
from ..plan import Plan

__all__ = ["autoparallelize"]

logger = logging.getLogger(__name__)


def autoparallelize(
    model: nn.Module,
    example_inputs: Mapping[str, Any] | None = None,
    *,
    plan: Plan | None = None,
    device_mesh: DeviceMesh | None = None,
    optimizers: tuple[torch.optim.Optimizer, ...] | list[torch.optim.Optimizer] = (),
    timeout: float | timedelta = DEFAULT_TIMEOUT_S,
    pretrained: str | os.PathLike | None = None,
    micro_batches: int | None = 1,
    **plan_model_kwargs: Any,
) -> nn.Module:
    """Plan (on rank 0, broadcast to all) and apply it, inside a running ``torch.distributed`` job.

    ``example_inputs`` is *this process's batch as plain DDP would feed it* (the batch rule of every entry
    point): the planner plans a step of ``example_inputs x world size`` samples. After this call,
    ``hf_colossal_auto.data_parallel_info(model)`` says which rows of each global batch this process's
    data-parallel group reads (``data_parallel_loader`` / ``shard_batch`` cut them). ``num_devices``
    defaults to the world size and ``device`` to the running device kind ("cpu" under gloo); other keyword
    arguments go to :func:`~hf_colossal_auto.solve.planner.plan_model`. Optimizers created before this call go
    in ``optimizers``. If planning fails (an impossible budget, a model that cannot be captured), every rank
    raises the same error. ``timeout`` (seconds) bounds how long a rank waits for a peer that stopped answering,
    and how long planning may take (past it every rank raises ``TookTooLongError`` naming where planning was).
    ``pretrained`` (a HF safetensors checkpoint directory) fills the sharded model from it, each rank reading its
    own slices: build the model on ``meta`` (``with torch.device("meta"): AutoModel...from_config(config)``) to
    never hold the full model in any process.

    Pipeline stages are planned when asked: ``pipeline=None`` (or ``"auto"``) searches them with the rest
    (``HF_COLOSSAL_AUTO_PIPELINE=auto`` likewise), an int >= 2 fixes the pp degree; the default is 1 (none). So
    is context parallelism: ``context_parallel=2`` (or ``HF_COLOSSAL_AUTO_CONTEXT_PARALLEL=2``) splits each
    sequence over 2 ranks of a replica, ``None`` (``auto``) searches the cp degrees; the default is 1 (none). An
    argument wins over its variable, which is then not read. Under a cp plan
    the ``cp`` ranks of a replica are fed the same rows, whole sequences (``data_parallel_info(model).cp_size``;
    ``shard_batch`` and ``data_parallel_loader`` give them the same rows), and the model keeps each rank's part
    of every sequence; a sequence length that ``2 x cp`` does not divide raises on every rank.

    ``micro_batches`` is 1 by default: the plan fits its budget with each data-parallel group's batch in one
    piece, as the plain loop (one forward, one backward per batch) runs it. An int k > 1 fixes k pieces and
    None searches k (what the accelerate and Trainer integrations do for their accumulation steps); a plan with
    k > 1 must be trained with :func:`hf_colossal_auto.accumulate`, and a training forward fed the whole batch
    raises :class:`~hf_colossal_auto.apply.micro_batch.WholeBatchError` instead of running over the budget.
    """
    if not dist.is_initialized():
        raise RuntimeError(
            "autoparallelize needs a running torch.distributed job (torchrun / accelerate launch); for planning "
            "without processes use hf_colossal_auto.plan_model"
        )
    if plan is None:
        if example_inputs is None:
            raise ValueError("autoparallelize needs example_inputs (one process's batch) or a plan")
        world = dist.get_world_size()
        if isinstance(plan_model_kwargs.get("device"), str):  # "calibrate": every rank measures the job once
            from ..calibration.job import resolve_device

            kind = "cpu" if dist.get_backend() != "nccl" else "cuda"
            plan_model_kwargs["device"] = resolve_device(plan_model_kwargs["device"], kind)

        def make() -> Plan:
            from ..hardware.cluster import launcher_devices_per_node
            from ..solve.planner import plan_model
            from .plugin import (
                context_parallel_from_env,
                context_parallel_setting,
                parse_context_parallel,
                parse_pipeline,
                pipeline_from_env,
                pipeline_setting,
                stages_and_context_parallel,
            )

            kwargs = dict(plan_model_kwargs, micro_batches=micro_batches)
            # stages and cp when asked (pipeline= / context_parallel=, else their variables, read only then);
            # a fixed degree of one keeps the other off, as the runtime runs them apart
            kwargs["pipeline"], kwargs["context_parallel"] = stages_and_context_parallel(
                _argument(kwargs, "pipeline", parse_pipeline, pipeline_setting)
                if "pipeline" in kwargs
                else pipeline_from_env(1),
                _argument(kwargs, "context_parallel", parse_context_parallel, context_parallel_setting)
                if "context_parallel" in kwargs
                else context_parallel_from_env(1),
            )
            kwargs.setdefault("num_devices", world)
            kwargs.setdefault("device", "cpu" if dist.get_backend() != "nccl" else _cuda_kind())
            kwargs.setdefault("devices_per_node", launcher_devices_per_node(world))
            return plan_model(model, global_batch(example_inputs, world), **kwargs)

        limit = as_timedelta(timeout).total_seconds()
        plan = plan_on_one_rank(make, limit_s=limit, what=f"planning {type(model).__name__}")
    if (
        plan.micro_batches > 1 and plan.pp_size == 1 and dist.get_rank() == 0
    ):  # a pipeline's are the schedule's
        logger.warning(
            "the plan runs each data-parallel group's batch as %d micro-batches: train with `for micro in "
            "hf_colossal_auto.accumulate(model, batch)` (README, 'Micro-batches'); a training forward of the "
            "whole batch raises, since it needs more memory than planned.",
            plan.micro_batches,
        )
    return apply_plan(model, plan, device_mesh, optimizers, timeout=timeout, pretrained=pretrained)


def _argument(kwargs: dict[str, Any], name: str, parse: Any, to_setting: Any) -> int | None:
    """The ``pipeline`` / ``context_parallel`` argument as ``plan_model`` takes it: None or ``"auto"`` searched,
    else a degree, parsed as the plugin and the callback parse it (a bad value refused by name). The argument
    wins over its ``HF_COLOSSAL_AUTO_<NAME>`` variable, which is then not read: a bad variable it overrides is
    no error (as under the plugin's constructor)."""
    value = kwargs[name]
    return None if value is None else to_setting(parse(value, name, "autoparallelize"))


def _cuda_kind() -> Any:
    from ..hardware import detect_device

    return detect_device()
