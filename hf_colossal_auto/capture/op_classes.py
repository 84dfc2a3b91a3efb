"""Classes of aten ops that activation recompute decides about together.

The planner prices recompute options per class (keep the outputs of one class, recompute the others) and the
runtime's selective-checkpoint policy decides per op by the same function, so that what was planned is what
runs. Classes follow the cost of recomputing an op against the memory its output holds:

* ``matmul``: GEMMs (``mm``, ``addmm``, ``bmm``, ...): most of the FLOPs, worth keeping;
* ``attention``: the attention core (fused SDPA kernels, softmax): FLOPs that grow with sequence length;
* ``pointwise``: everything else that allocates (norms, activations, dropout, residual adds, casts): cheap to
  recompute, often a large share of the bytes.

Views and in-place ops allocate nothing; a policy never keeps them (keeping a view would pin its base).
"""

from __future__ import annotations

WEIGHT_COPIES = ("aten._to_copy.default", "aten.clone.default", "aten.contiguous.default")
"""Ops that copy a weight on its way to the op that reads it (a cast for mixed precision), giving the same
values and split: a walk from a parameter to its readers goes through them, as through views."""

MATMUL = "matmul"
ATTENTION = "attention"
POINTWISE = "pointwise"
CLASSES = (MATMUL, ATTENTION, POINTWISE)

_MATMUL_OPS = frozenset(
    {"mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "convolution", "_convolution", "addbmm", "_int_mm"}
)
_ATTENTION_OPS = frozenset(
    {
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_attention_math",
        "_flash_attention_forward",
        "_efficient_attention_forward",
        "_softmax",
        "_safe_softmax",
        "softmax",
    }
)


def op_base_name(op: str) -> str:
    """``"aten.mm.default"`` (or an OpOverload's ``str``) -> ``"mm"``."""
    parts = str(op).split(".")
    return parts[1] if len(parts) >= 2 and parts[0] == "aten" else parts[0]


def op_class(op: str) -> str:
    """The recompute class of an aten op (by its overload name, e.g. ``"aten.addmm.default"``)."""
    base = op_base_name(op)
    if base in _MATMUL_OPS:
        return MATMUL
    if base in _ATTENTION_OPS:
        return ATTENTION
    return POINTWISE


_TRANSCENDENTAL_OPS = frozenset(
    {
        "exp",
        "log",
        "tanh",
        "sigmoid",
        "silu",
        "gelu",
        "erf",
        "sin",
        "cos",
        "sqrt",
        "rsqrt",
        "_softmax",
        "_safe_softmax",
        "_log_softmax",
        "_softmax_backward_data",
        "_log_softmax_backward_data",
        "tanh_backward",
        "sigmoid_backward",
        "silu_backward",
        "gelu_backward",
    }
)


def is_transcendental(op: str) -> bool:
    """An elementwise op that evaluates a transcendental function per element (exp, tanh, softmax...): on a CPU
    it is bound by that arithmetic, not by memory bandwidth (FlopCounterMode counts it as 0 FLOPs)."""
    return op_base_name(op) in _TRANSCENDENTAL_OPS
