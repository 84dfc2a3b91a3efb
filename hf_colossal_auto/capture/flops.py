"""FLOPs of one aten op, counted exactly as ``torch.utils.flop_counter.FlopCounterMode`` counts them.

We read FlopCounterMode's own registry, so a matmul costs here what it costs there. FlopCounterMode has no
formula for the CPU flash-attention kernels that ``scaled_dot_product_attention`` dispatches to on CPU (it
counts them as 0), which would make attention free in every plan made on a CPU host. We add the same
formula torch uses for the CUDA flash kernels, and one for ``aten._grouped_mm`` (MoE experts; torch counts
it as 0 too, see :mod:`hf_colossal_auto.capture.moe`). :data:`EXTRA_FLOP_FORMULAS` is public so that a
measurement can pass it to ``FlopCounterMode(custom_mapping=...)`` and count the same way.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count, shape_wrapper

from .._torch_compat import flop_registry
from .moe import grouped_mm_flop

aten = torch.ops.aten


# Formulas take shapes, like torch's own before its ``shape_wrapper`` (FlopCounterMode wraps a custom mapping
# the same way).
def _cpu_flash_attention_flop(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(query_shape, key_shape, value_shape)


def _cpu_flash_attention_backward_flop(
    grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs
) -> int:
    return sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)


EXTRA_FLOP_FORMULAS: dict[Any, Callable[..., int]] = {
    aten._scaled_dot_product_flash_attention_for_cpu: _cpu_flash_attention_flop,
    aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_flash_attention_backward_flop,
    aten._grouped_mm: grouped_mm_flop,
}

_EXTRA_WRAPPED = {k: shape_wrapper(v) for k, v in EXTRA_FLOP_FORMULAS.items()}


def flop_formula(func: torch._ops.OpOverload) -> Callable[..., int] | None:
    """The formula for ``func`` (an OpOverload), or None when the op costs no FLOPs in torch's accounting."""
    packet = func._overloadpacket
    formula = flop_registry.get(packet)
    if formula is None:
        formula = _EXTRA_WRAPPED.get(packet)
    return formula


def has_flop_formula(func: torch._ops.OpOverload) -> bool:
    return flop_formula(func) is not None


def op_flops(func: torch._ops.OpOverload, args: tuple, kwargs: dict, out: Any) -> int:
    """FLOPs of one call, using torch's convention (a multiply-add counts 2)."""
    formula = flop_formula(func)
    if formula is None:
        return 0
    return int(formula(*args, **kwargs, out_val=out))
