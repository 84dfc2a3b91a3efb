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

Registration is process-wide and idempotent. This module imports nothing of the project but the private-API
gateway (:mod:`hf_colossal_auto._torch_compat`) and the grouped GEMM's Meta kernel
(:func:`hf_colossal_auto.capture.moe.enable_grouped_mm_tracing`), so that the planner's strategies
(:mod:`hf_colossal_auto.strategies.dtensor_rules`) and the runtime (:mod:`hf_colossal_auto.apply`) both register
the same rules without importing each other.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.experimental import register_sharding

from ._torch_compat import (
    default_dtensor_dispatch,
    register_dtensor_op_handler,
)
from .capture.moe import enable_grouped_mm_tracing

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
        except (RuntimeError, ValueError) as error:  # eager says RuntimeError, fake tensors ValueError
            if "view size is not compatible" not in str(error) and "Cannot view a tensor" not in str(error):
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
    _registered = True
