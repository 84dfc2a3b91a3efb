"""The runtime's DTensor rules (:mod:`hf_colossal_auto.dtensor_registration`, re-exported here) and the
replicated fallback for ops DTensor still has no rule for after them."""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.experimental import register_sharding

from .._torch_compat import DTensorSpec, dtensor_op_has_handler
from ..dtensor_registration import register_runtime_rules  # noqa: F401 (re-exported: the runtime registers them)

logger = logging.getLogger(__name__)


def _replicate_everything(op: torch._ops.OpOverload):
    """A DTensor sharding function for ``op`` whose one strategy is: every tensor argument replicated, every
    output replicated (DTensor gathers the inputs, each rank runs the op on whole tensors)."""
    outputs = len(op._schema.returns)

    def strategy(*args: Any, **kwargs: Any) -> list[tuple[list[Any], list[Any]]]:
        inputs = [Replicate() if isinstance(a, DTensorSpec) else None for a in args]
        return [([Replicate()] * outputs, inputs)]

    return strategy


def register_replicated_fallbacks(op_names: list[str]) -> list[str]:
    """Run each op of ``op_names`` that DTensor still has no rule for (after ours) replicated, as the planner
    priced it, instead of DTensor refusing it ("does not have a sharding strategy registered") in the middle of
    a step. Returns the ops registered (each named in one warning)."""
    from ..strategies.dtensor_rules import dtensor_rule_kind, resolve_op

    registered = []
    for name in op_names:
        op = resolve_op(name)
        if op is None or dtensor_rule_kind(op) is not None or dtensor_op_has_handler(op):
            continue
        register_sharding(op)(_replicate_everything(op))
        registered.append(name)
        logger.warning("no sharding rule for %s: the plan runs it replicated (its inputs gathered)", name)
    return registered
