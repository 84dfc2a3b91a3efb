"""Mixture-of-experts models under a plan: the parts of an MoE step that run as one local region.

Everything of an MoE layer that DTensor can shard op by op runs op by op: the router (a ``Linear``), the
routing (``topk``, ``softmax``, ``sort``, ``histc``: replicated like their inputs) and the experts' grouped
GEMMs (DTensor's ``_grouped_mm`` rule: replicated, or stacked weights split on their hidden or intermediate
dim; its Meta kernel is relaxed for fp32 in :mod:`hf_colossal_auto.capture.moe`).

The load-balancing auxiliary loss (``load_balancing_loss_func`` of each MoE family) cannot: with a padding
mask it accumulates into a plain ``torch.zeros`` buffer in place (``scatter_add_``) from DTensor routing
tensors, which DTensor refuses. It is a few hundred FLOPs on ``num_experts``-long vectors, so it runs as a
*local region* (what ``local_map`` does): its DTensor arguments enter as full tensors, the result leaves as
a replicated DTensor, and autograd runs through both conversions, so the router's gradient from the aux loss
is the one-process gradient. The router logits it reads are replicated in every plan the planner makes for
them (their dim is ``num_experts``), so entering the region moves no data.
"""

from __future__ import annotations

import functools
import logging
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

from .._torch_compat import tree_flatten, tree_map

logger = logging.getLogger(__name__)

AUX_LOSS_FUNCTION = "load_balancing_loss_func"
_LOCAL_REGION_MARK = "_hf_colossal_auto_local_region"


def _full(value: Any) -> Any:
    """A DTensor as the full tensor every rank holds (differentiable); anything else as it is."""
    if not isinstance(value, DTensor):
        return value
    if all(isinstance(p, Replicate) for p in value.placements):
        return value.to_local()
    return value.full_tensor()


def local_region(function: Callable[..., Any]) -> Callable[..., Any]:
    """``function`` run on full local tensors when it is given DTensors; its tensor results come back as
    replicated DTensors on the mesh of its first DTensor argument. Calls without DTensors pass through."""
    if getattr(function, _LOCAL_REGION_MARK, False):
        return function

    @functools.wraps(function)
    def region(*args: Any, **kwargs: Any) -> Any:
        dtensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, DTensor)]
        if not dtensors:
            return function(*args, **kwargs)
        mesh = dtensors[0].device_mesh
        result = function(*tree_map(_full, args), **tree_map(_full, kwargs))
        placements = [Replicate()] * mesh.ndim
        return tree_map(
            lambda t: DTensor.from_local(t, mesh, placements, run_check=False)
            if isinstance(t, torch.Tensor) and not isinstance(t, DTensor)
            else t,
            result,
        )

    setattr(region, _LOCAL_REGION_MARK, True)
    return region


def install_aux_loss_region(model: nn.Module) -> bool:
    """Run the load-balancing loss of ``model``'s family as a local region (see the module docstring).

    Patches the function in the model class's own module (where its forward looks the name up), for the
    whole process like the SDPA mask placement: every model of that family is then safe under a plan, and
    unplanned calls (plain tensors) run unchanged. Returns whether the family has such a function.
    """
    module = sys.modules.get(type(model).__module__)
    function = getattr(module, AUX_LOSS_FUNCTION, None) if module is not None else None
    if function is None:
        return False
    if not getattr(function, _LOCAL_REGION_MARK, False):
        setattr(module, AUX_LOSS_FUNCTION, local_region(function))
        logger.debug("%s.%s runs as a local region under plans", module.__name__, AUX_LOSS_FUNCTION)
    return True
