"""The runtime's DTensor rules: the ones planner and runtime share (:mod:`hf_colossal_auto.dtensor_registration`),
the runtime's guards around DTensor's dispatch (split convolution weights gathered, decompositions that fail
run replicated) and the replicated fallback for ops DTensor still has no rule for after them."""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.experimental import register_sharding

from .._torch_compat import (
    DTensorSpec,
    default_dtensor_dispatch,
    dtensor_op_handler,
    dtensor_op_has_handler,
    register_dtensor_op_handler,
    tree_map,
)
from ..dtensor_registration import register_runtime_rules as register_shared_rules

logger = logging.getLogger(__name__)
aten = torch.ops.aten


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
        # a decomposition DTensor claims is no rule when the planner's attempt at it failed (why the op is here)
        if op is None or dtensor_rule_kind(op) in ("single-dim", "op-strategy") or dtensor_op_has_handler(op):
            continue
        register_sharding(op)(_replicate_everything(op))
        registered.append(name)
        logger.warning("no sharding rule for %s: the plan runs it replicated (its inputs gathered)", name)
    return registered


_FAILED_DECOMPOSITIONS: set[str] = set()
"""Ops whose DTensor decomposition failed at run time in this process (each warned about once)."""


def _full_values(args: tuple, kwargs: dict | None) -> tuple[tuple, dict]:
    """``args`` and ``kwargs`` with every DTensor gathered into its full value (collective on its mesh)."""
    return tree_map(lambda a: a.full_tensor() if isinstance(a, DTensor) else a, (args, kwargs or {}))


def _on_full_tensors(op: Any, args: tuple, kwargs: dict) -> Any:
    """``op`` on whole tensors: every DTensor argument gathered (a partial one reduced), the outputs replicated
    DTensors on the first argument's mesh. The same value on every rank, as one process computes it."""
    mesh = next(a.device_mesh for a in tree_flatten_dtensors((args, kwargs)))
    whole_args, whole_kwargs = _full_values(args, kwargs)
    out = op(*whole_args, **whole_kwargs)
    replicated = [Replicate()] * mesh.ndim
    return tree_map(
        lambda t: (
            DTensor.from_local(t, mesh, replicated, run_check=False) if isinstance(t, torch.Tensor) else t
        ),
        out,
    )


def tree_flatten_dtensors(tree: Any) -> list[DTensor]:
    found: list[DTensor] = []
    tree_map(lambda a: found.append(a) if isinstance(a, DTensor) else None, tree)
    return found


def _replicated_when_decomposition_fails(op: Any, args: tuple, kwargs: dict) -> Any:
    """DTensor's dispatch of an op it has no rule for but a decomposition it traces into ops that have rules;
    when that tracing fails ("does not have a sharding strategy registered": ``aten.col2im``, the backward of
    ConvBERT's ``nn.Unfold``, on the placements its gradient arrives in), the op runs on whole tensors instead
    (inputs gathered, output replicated): slower than planned, never a step that stops halfway."""
    try:
        return default_dtensor_dispatch(op, args, kwargs)
    except NotImplementedError as exc:
        if "does not have a sharding strategy" not in str(exc):
            raise
    if str(op) not in _FAILED_DECOMPOSITIONS:
        _FAILED_DECOMPOSITIONS.add(str(op))
        logger.warning("DTensor could not decompose %s here: it runs replicated (its inputs gathered)", op)
    return _on_full_tensors(op, args, kwargs)


def register_decomposition_fallbacks() -> int:
    """Route every aten op DTensor would run by decomposition through
    :func:`_replicated_when_decomposition_fails`. Returns the number of ops routed."""
    from torch._decomp import decomposition_table

    from ..strategies.dtensor_rules import dtensor_rule_kind

    count = 0
    for op in list(decomposition_table):
        if not isinstance(op, torch._ops.OpOverload) or dtensor_op_has_handler(op):
            continue
        try:
            kind = dtensor_rule_kind(op)
        except Exception:  # noqa: BLE001 - an op the propagator cannot look up is left alone
            continue
        if kind == "decomposition":
            register_dtensor_op_handler(op, _replicated_when_decomposition_fails)
            count += 1
    return count


_CONV_WEIGHT_ARG = {aten.convolution.default: 1, aten.convolution_backward.default: 2}
"""Position of the weight among the arguments of DTensor's convolution ops."""


def _with_whole_conv_weight(handler: Any):
    """DTensor's convolution handler (``_tp_conv``) runs the local op on the weight as it is, assuming it
    replicated (its rule says so, its handler does not check): a weight stored split on its output channels and
    read by a module other than its owner (Kimi-Linear's depthwise short convolution: ``groups`` = channels)
    reached it sharded and the local op failed. Gather a split weight (and bias) first, as the rule has it."""

    def wrapped(op: Any, args: tuple, kwargs: dict) -> Any:
        position = _CONV_WEIGHT_ARG[op]
        args = list(args)
        for i in (position, position + 1) if op is aten.convolution.default else (position,):
            value = args[i] if i < len(args) else None
            if isinstance(value, DTensor) and not all(p.is_replicate() for p in value.placements):
                args[i] = value.redistribute(value.device_mesh, [Replicate()] * value.device_mesh.ndim)
        return handler(op, tuple(args), kwargs)

    return wrapped


def _guard_convolution_weights() -> None:
    for op in _CONV_WEIGHT_ARG:
        handler = dtensor_op_handler(op)
        if handler is not None:
            register_dtensor_op_handler(op, _with_whole_conv_weight(handler))


_COMPARISONS = (aten.allclose.default,)
"""Ops that read values and answer one Python value (a ``bool``): DTensor has no rule for them, and scripts
call them on a planned model's parameters and gradients beside ordinary tensors (``torch.allclose(param.grad,
reference.grad)`` in accelerate's own test scripts)."""


def _compared_as_whole_tensors(op: Any, args: tuple, kwargs: dict) -> Any:
    """``op`` on the full values: every DTensor argument gathered (every rank must call it, as any collective),
    plain arguments as they are. The answer one process would give on the same values."""
    whole_args, whole_kwargs = _full_values(args, kwargs)
    return op(*whole_args, **whole_kwargs)


_runtime_guards_installed = False


def register_runtime_rules() -> None:
    """The rules planner and runtime share (:mod:`hf_colossal_auto.dtensor_registration`), then the runtime's
    own guards around DTensor's dispatch: convolution weights gathered, decompositions that fail run
    replicated (once per process; after the shared rules, so ops with a rule or handler of ours keep it)."""
    global _runtime_guards_installed
    register_shared_rules()
    if _runtime_guards_installed:
        return
    _guard_convolution_weights()
    register_decomposition_fallbacks()
    for op in _COMPARISONS:
        register_dtensor_op_handler(op, _compared_as_whole_tensors)
    _runtime_guards_installed = True
