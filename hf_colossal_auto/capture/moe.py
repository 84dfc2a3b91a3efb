"""Mixture-of-experts layers: what capture needs to trace them with static shapes, and how they are priced.

transformers 5 runs MoE experts (Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek-V3, ...) through
``transformers.integrations.moe``: tokens are sorted by expert and multiplied by the stacked expert weights
with one ``aten._grouped_mm`` per projection (``config._experts_implementation == "grouped_mm"``, the default
where the kernel exists). Every shape in that path is static — ``S = tokens x top_k`` rows, whatever the
routing — so a fake-tensor trace records exactly the ops and allocations of a real step. Two things stood in
the way, both handled here:

* torch 2.13's Meta kernel for ``_grouped_mm`` accepts bf16 only (the CUDA kernel's contract) while the CPU
  kernel runs any float dtype; :func:`enable_grouped_mm_tracing` registers a Meta kernel that allocates what
  the CPU kernel allocates (``_torch_compat.relax_grouped_mm_meta``).
* ``FlopCounterMode`` has no formula for ``_grouped_mm`` (it counts it as 0, which would make experts free in
  every plan). :func:`grouped_mm_flop` is the formula, added to ``EXTRA_FLOP_FORMULAS``.

The ``"eager"`` experts implementation loops over the experts that received tokens (``nonzero``): its shapes
depend on the routing and cannot be traced; :func:`static_experts_implementation` switches such a model to
``"grouped_mm"`` for the capture (same math, same parameters).

**Load assumption.** The grouped GEMMs' FLOPs and bytes do not depend on the routing (every one of the ``S``
rows is multiplied by exactly one expert), so capture needs none. Where a cost does depend on it — the share
of the ``S`` rows one expert-parallel rank computes — routing is assumed uniform over experts (each expert
gets ``S / num_experts`` rows); :data:`UNIFORM_LOAD` names that assumption in plans and summaries.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch
from torch import nn

from .._torch_compat import relax_grouped_mm_meta

logger = logging.getLogger(__name__)

UNIFORM_LOAD = "uniform"
"""The routing assumption of every MoE cost: each expert receives ``tokens * top_k / num_experts`` rows."""

# The CPU and CUDA kernels pad each output row to 16 bytes.
_ROW_ALIGNMENT_BYTES = 16


def grouped_mm_output_layout(
    mat_a: torch.Tensor, mat_b: torch.Tensor, offs: torch.Tensor | None, dtype: torch.dtype
) -> tuple[list[int], list[int]]:
    """``(shape, stride)`` of ``_grouped_mm(mat_a, mat_b, offs)``'s output as the kernels allocate it.

    2d x 3d (forward: tokens sorted by expert times stacked weights) -> ``(S, N)``; 2d x 2d (weight gradient,
    grouped over the shared dim) -> ``(G, M, N)``; 3d x 2d -> ``(M, N)``; 3d x 3d is a batched matmul.
    Rows are padded to 16 bytes, as the real CPU kernel pads them (a ``(6, 5)`` fp32 output has stride
    ``(8, 1)``), so the traced allocation is the real one.
    """
    a2, b2 = mat_a.dim() == 2, mat_b.dim() == 2
    if a2 and b2:
        groups = offs.size(0) if offs is not None else 1
        shape = [groups, mat_a.size(0), mat_b.size(1)]
    elif a2:
        shape = [mat_a.size(0), mat_b.size(-1)]
    elif b2:
        shape = [mat_a.size(1), mat_b.size(1)]
    else:
        shape = [mat_a.size(0), mat_a.size(1), mat_b.size(-1)]
    alignment = max(1, _ROW_ALIGNMENT_BYTES // dtype.itemsize)
    padded = -(-shape[-1] // alignment) * alignment
    stride = [shape[1] * padded, padded, 1] if len(shape) == 3 else [padded, 1]
    return shape, stride


def grouped_mm_flop(mat_a_shape, mat_b_shape, *args, out_shape=None, **kwargs) -> int:
    """FLOPs of one ``_grouped_mm`` (a multiply-add counts 2, as in ``FlopCounterMode``), from shapes.

    Every output element is one dot product over ``mat_a``'s last dim, except for 2d x 2d (the weight
    gradient), where each group's outputs sum over that group's slice of the shared dim only: all groups
    together cover it once, so the total is ``2 * M * N * K``. None of this depends on the routing.
    """
    if len(mat_a_shape) == 2 and len(mat_b_shape) == 2:
        return 2 * mat_a_shape[0] * mat_b_shape[1] * mat_a_shape[1]
    numel = 1
    for d in out_shape:
        numel *= d
    return 2 * numel * mat_a_shape[-1]


def enable_grouped_mm_tracing() -> None:
    """Make ``_grouped_mm`` traceable under fake tensors and DTensor in any float dtype (see module doc)."""
    relax_grouped_mm_meta(grouped_mm_output_layout)


def experts_modules(model: nn.Module) -> dict[str, nn.Module]:
    """FQN -> transformers MoE experts module (stacked 3-D expert weights behind a router)."""
    return {
        fqn: m
        for fqn, m in model.named_modules()
        if hasattr(m, "_is_expert_parallel") and hasattr(m, "num_experts")
    }


def expert_weight_dims(module: nn.Module, param_name: str) -> tuple[int, int] | None:
    """(output dim, input dim) of one stacked expert weight (``gate_up_proj``, ``up_proj``, ``down_proj``;
    dim 0 is the expert). transformers stores them ``(E, out, in)``, or ``(E, in, out)`` for families that
    set ``is_transposed`` (GPT-OSS). None for anything else (biases, norms)."""
    if param_name not in ("gate_up_proj", "up_proj", "down_proj"):
        return None
    param = getattr(module, param_name, None)
    if not isinstance(param, nn.Parameter) or param.dim() != 3:
        return None
    return (2, 1) if getattr(module, "is_transposed", False) else (1, 2)


def is_moe_model(model: nn.Module) -> bool:
    """True when ``model`` holds transformers MoE experts (stacked expert weights behind a router)."""
    return bool(experts_modules(model))


@contextlib.contextmanager
def static_experts_implementation(model: nn.Module) -> Iterator[None]:
    """Run the experts of ``model`` through ``grouped_mm`` while the context is open.

    ``"eager"`` experts loop over the experts the routing hit (``nonzero``), a data-dependent shape no fake
    trace can follow; ``grouped_mm`` computes the same function of the same parameters with static shapes.
    Other implementations (``batched_mm`` is static too) are left alone.
    """
    configs = {id(m.config): m.config for m in experts_modules(model).values() if getattr(m, "config", None)}
    changed = []
    for config in configs.values():
        if getattr(config, "_experts_implementation", None) in (None, "eager"):
            changed.append((config, config._experts_implementation))
            config._experts_implementation = "grouped_mm"
    if changed:
        logger.info(
            "%s: experts traced through 'grouped_mm' (the 'eager' loop has routing-dependent shapes)",
            type(model).__name__,
        )
    try:
        yield
    finally:
        for config, value in changed:
            config._experts_implementation = value
