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
  first tensor of a tuple / ModelOutput) to the plan's placement. A partial target is left to DTensor.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

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


def _output_hook(placement: Placement):
    def hook(module: nn.Module, args: Any, output: Any) -> Any:
        if isinstance(output, DTensor):
            return _redistributed(output, placement)
        if isinstance(output, tuple) and output and isinstance(output[0], DTensor):
            return (_redistributed(output[0], placement), *output[1:])
        if isinstance(output, Mapping) and output:
            key = next(iter(output.keys()))
            if isinstance(output[key], DTensor):
                output[key] = _redistributed(output[key], placement)
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
