"""Sharding rules registered into DTensor for ops it cannot run sharded on its own.

The runtime runs the model's own forward on DTensor parameters, so every op the step reaches must have a
DTensor sharding rule. These are the ones transformer training steps hit that torch 2.13 lacks; they match
the planner's custom rules (:mod:`hf_colossal_auto.strategies.custom_rules`), so that what is planned can run:

* ``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward (the SDPA kernel on CPU): attention is
  independent per batch row and per head, so q/k/v/out/logsumexp (and the gradients) split together along
  dim 0 or dim 1; a mask splits with them unless it broadcasts on that dim;
* ``aten.fill_.Tensor`` / ``aten.fill.Tensor`` (T5 shifts its labels into decoder inputs with it): the output
  keeps the input's placement; the scalar value is replicated.

And one dispatch fix: ``aten.view`` on a DTensor whose *local* shard is not contiguous. After
``transpose(1, 2)`` of a head-sharded attention output the global tensor's ``.contiguous()`` is a no-op when
DTensor's global strides say contiguous, so the local shard stays strided and the following ``reshape`` ->
``view`` fails ("view size is not compatible with input tensor's size and stride"). The handler makes the
local shard contiguous first. DTensor wrappers never share storage with their inputs, so autograd is not
affected; what is lost is only the aliasing of an in-place write through that view, which transformer
forwards do not do.

And one for ``aten.cat`` with *legacy empty* inputs: plain ``torch.cat`` skips 1-D tensors of shape ``(0,)``
whatever the other inputs' rank, and transformers' KV cache relies on it (``DynamicLayer`` starts from
``torch.tensor([])`` and concatenates each step's keys onto it). DTensor instead treats the empty plain tensor
as replicated (implicit replication) and redistributes it to the keys' placement, which fails for a
head-sharded key ("IndexError: Dimension out of range") — any forward with ``use_cache=True`` under a
tensor-parallel plan: ``generate()``, an eval step, a training step of a config with ``use_cache`` on. The
handler drops such plain inputs before DTensor's dispatch, as torch's own kernel would.

Registration is process-wide and idempotent.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.experimental import register_sharding

from .._torch_compat import (
    DTensorSpec,
    default_dtensor_dispatch,
    dtensor_op_handler,
    dtensor_op_has_handler,
    register_dtensor_op_handler,
    tree_map,
)
from ..capture.moe import enable_grouped_mm_tracing

logger = logging.getLogger(__name__)
aten = torch.ops.aten
_registered = False


def _mask_placement(mask, d: int):
    if mask is None:
        return None
    return Shard(d) if mask.shape[d] > 1 else Replicate()


def _flash_cpu(query, key, value, dropout_p=0.0, is_causal=False, *, attn_mask=None, scale=None):
    rules = [
        (
            [Replicate(), Replicate()],
            [Replicate()] * 3 + [None, None, None if attn_mask is None else Replicate(), None],
        )
    ]
    for d in (0, 1):
        rules.append(
            ([Shard(d), Shard(d)], [Shard(d)] * 3 + [None, None, _mask_placement(attn_mask, d), None])
        )
    return rules


def _flash_cpu_backward(
    grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, *, attn_mask=None, scale=None
):
    rules = [
        (
            [Replicate()] * 3,
            [Replicate()] * 6 + [None, None, None if attn_mask is None else Replicate(), None],
        )
    ]
    for d in (0, 1):
        rules.append(([Shard(d)] * 3, [Shard(d)] * 6 + [None, None, _mask_placement(attn_mask, d), None]))
    return rules


def _fill_tensor(self, value):
    rules = [([Replicate()], [Replicate(), Replicate()])]
    rules += [([Shard(d)], [Shard(d), Replicate()]) for d in range(len(self.shape))]
    return rules


def _view_of_contiguous_shard(op, args, kwargs):
    x = args[0]
    if isinstance(x, DTensor) and not x._local_tensor.is_contiguous():
        try:  # most strided shards still view fine; a copy here would be saved for backward next to its base
            return default_dtensor_dispatch(op, args, kwargs)
        except RuntimeError as error:
            if "view size is not compatible" not in str(error):
                raise
        x = DTensor.from_local(
            x._local_tensor.contiguous(),
            x.device_mesh,
            x.placements,
            run_check=False,
            shape=x.shape,
            stride=x.stride(),
        )
        args = (x, *args[1:])
    return default_dtensor_dispatch(op, args, kwargs)


def _is_legacy_empty(value: object) -> bool:
    return isinstance(value, torch.Tensor) and not isinstance(value, DTensor) and value.shape == (0,)


def _cat_skipping_legacy_empty(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any] | None) -> Any:
    """``aten.cat`` on DTensors with plain ``(0,)``-shaped inputs skipped, as torch's kernel skips them."""
    tensors = args[0]
    kept = [t for t in tensors if not _is_legacy_empty(t)]
    if len(kept) < len(tensors) and any(isinstance(t, DTensor) for t in kept):
        args = (kept, *args[1:])
    return default_dtensor_dispatch(op, args, kwargs)


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


def _on_full_tensors(op: Any, args: tuple, kwargs: dict) -> Any:
    """``op`` on whole tensors: every DTensor argument gathered (a partial one reduced), the outputs replicated
    DTensors on the first argument's mesh. The same value on every rank, as one process computes it."""
    mesh = next(a.device_mesh for a in tree_flatten_dtensors((args, kwargs)))
    whole = tree_map(lambda a: a.full_tensor() if isinstance(a, DTensor) else a, (args, kwargs or {}))
    out = op(*whole[0], **whole[1])
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


def register_runtime_rules() -> None:
    """Register the rules above into DTensor's sharding propagator (once per process)."""
    global _registered
    if _registered:
        return
    register_sharding(aten._scaled_dot_product_flash_attention_for_cpu.default)(_flash_cpu)
    register_sharding(aten._scaled_dot_product_flash_attention_for_cpu_backward.default)(_flash_cpu_backward)
    register_sharding([aten.fill_.Tensor, aten.fill.Tensor])(_fill_tensor)
    register_dtensor_op_handler(aten.view.default, _view_of_contiguous_shard)
    register_dtensor_op_handler(aten.cat.default, _cat_skipping_legacy_empty)
    enable_grouped_mm_tracing()  # MoE experts in fp32: DTensor takes output shapes from the Meta kernel
    _guard_convolution_weights()
    register_decomposition_fallbacks()  # after ours: ops with a rule or handler of ours keep it
    _registered = True
