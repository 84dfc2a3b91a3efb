"""Make the runtime follow the plan's placements where DTensor's own propagation would choose differently.

DTensor picks, per op, the strategy that is cheapest to reach from the placements its inputs happen to have.
The planner chose strategies for the whole step at once, so the two part ways: a weight the plan gathers for
use (cheaper than resharding activations around it) DTensor computes on in its stored, sharded form; and a
redistribution DTensor performs *inside* an op's dispatch is invisible to autograd — the op saves its
un-redistributed input, and its backward redistributes it again (a row-parallel output left partial is
all-reduced once before a layer norm in forward and once more in its backward).

Two hooks enforce the plan where it is decided, and do every redistribution above autograd, so that each
one's backward is the reverse redistribution of the gradient the planner's edges price:

* parameter uses (``Plan.param_use_placements``): a forward pre-hook on the using module swaps in the
  parameter redistributed to the plan's placement for that use, and the post-hook puts the parameter back;
  the gradient flows through the redistribution to the parameter;
* module outputs (``Plan.activation_placements``): a forward hook redistributes the output tensor (or the
  first tensor of a tuple / ModelOutput) to the plan's placement (a partial target is left to DTensor),
  and in backward reduces a partial gradient arriving there to the placement the planner prices for it
  (the gradient of a value made replicated is replicated; of a shard, that shard).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard

from ..plan import Plan

logger = logging.getLogger(__name__)


def _tp_placement(plan: Plan, placements: list[str]) -> Placement | None:
    """The tensor-parallel entry of a plan placement as a DTensor placement (None for a partial target)."""
    tp_axis = list(plan.mesh_axis_names).index("tp") if "tp" in plan.mesh_axis_names else -1
    p = placements[tp_axis]
    if p == "R":
        return Replicate()
    if p.startswith("S"):
        return Shard(int(p[1:]))
    return None


def _redistributed(value: Any, placement: Placement) -> Any:
    if not isinstance(value, DTensor) or value.device_mesh.ndim != 1:
        return value
    current = value.placements[0]
    if current == placement:
        return value
    if isinstance(placement, Shard) and placement.dim >= value.dim():
        return value
    return value.redistribute(value.device_mesh, [placement])


class _ReducePartialGradient(torch.autograd.Function):
    """Identity in forward; in backward a *partial* gradient is reduced to the placement the planner prices
    for the gradient of this output (replicated, or the output's shard). Without it a partial gradient flows
    on through every backward op that is linear in it (a Llama RMSNorm's muls) and is reduced late and
    piecemeal (once per parameter gradient it reaches) instead of once where the module's output was made."""

    @staticmethod
    def forward(ctx: Any, value: DTensor, target: Placement) -> DTensor:
        ctx.target = target
        return value.view_as(value)

    @staticmethod
    def backward(ctx: Any, grad: Any) -> tuple[Any, None]:
        if isinstance(grad, DTensor) and grad.device_mesh.ndim == 1 and grad.placements[0].is_partial():
            grad = grad.redistribute(grad.device_mesh, [ctx.target])
        return grad, None


def _enforced(value: Any, placement: Placement) -> Any:
    if not isinstance(value, DTensor) or value.device_mesh.ndim != 1:
        return value
    value = _redistributed(value, placement)
    if value.requires_grad:
        target = value.placements[0] if isinstance(value.placements[0], Shard) else Replicate()
        value = _ReducePartialGradient.apply(value, target)
    return value


def _output_hook(placement: Placement):
    def hook(module: nn.Module, args: Any, output: Any) -> Any:
        if isinstance(output, DTensor):
            return _enforced(output, placement)
        if isinstance(output, tuple) and output and isinstance(output[0], DTensor):
            return (_enforced(output[0], placement), *output[1:])
        if isinstance(output, Mapping) and output:
            key = next(iter(output.keys()))
            if isinstance(output[key], DTensor):
                output[key] = _enforced(output[key], placement)
        return output

    return hook


def _param_use_hooks(uses: dict[str, Placement]):
    """Pre-hook: swap each listed parameter for its redistributed use; post-hook: restore the parameters."""
    saved: list[dict[str, nn.Parameter]] = []

    def pre(module: nn.Module, args: Any) -> None:
        originals = {}
        for attr, placement in uses.items():
            param = module._parameters.get(attr)
            if isinstance(param, DTensor):
                originals[attr] = param
                # _parameters holds the non-leaf use for this call only (as FSDP swaps unsharded parameters)
                module._parameters[attr] = _redistributed(param, placement)
        saved.append(originals)

    def post(module: nn.Module, args: Any, output: Any) -> None:
        if saved:
            module._parameters.update(saved.pop())

    return pre, post


def enforce_plan(model: nn.Module, plan: Plan) -> int:
    """Register the hooks above on ``model`` (its parameters already DTensors). Returns the number of hooks."""
    modules = dict(model.named_modules())
    count = 0
    by_module: dict[str, dict[str, Placement]] = {}
    for key, placements in plan.param_use_placements.items():
        module_name, _, attr = key.rpartition(".")
        placement = _tp_placement(plan, placements)
        if placement is None or module_name not in modules:
            continue
        by_module.setdefault(module_name, {})[attr] = placement
    for module_name, uses in by_module.items():
        pre, post = _param_use_hooks(uses)
        modules[module_name].register_forward_pre_hook(pre)
        modules[module_name].register_forward_hook(post, always_call=True)
        count += 1
    for module_name, placements in plan.activation_placements.items():
        placement = _tp_placement(plan, placements)
        if not module_name or placement is None or module_name not in modules:
            continue
        modules[module_name].register_forward_hook(_output_hook(placement))
        count += 1
    logger.debug("plan enforced by %d module hooks", count)
    return count
