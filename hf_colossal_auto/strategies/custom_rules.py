"""Sharding rules for ops that DTensor has no (usable) rule for but transformer training steps run.

Checked on the four tiny families (GPT-2, BERT, T5, Llama; forward and backward, torch 2.13):

* ``aten._scaled_dot_product_flash_attention_for_cpu`` (and ``_backward``): the CPU SDPA kernel that
  Llama-style models hit when attention has no dropout. DTensor has no rule for the backward at all, and for
  the forward only its decomposition tracer, which is slow (every input placement combination is traced)
  and does not know that attention is independent per batch row and per head.
* factory ops with no tensor input (``arange`` for position ids, ``zeros``, ``scalar_tensor`` for masking
  constants): DTensor has nothing to follow. They are created replicated; any shard a consumer wants is a
  free local slice of a replicated tensor, so no other placement is worth a candidate.
* the GPU SDPA kernels (``_scaled_dot_product_{flash,efficient}_attention`` and backwards) that the tracer
  records for GPU targets (:mod:`hf_colossal_auto.capture.attention`): DTensor's rules do not describe the
  kernels' RNG-state outputs.
* ``aten.fill_.Tensor`` (T5's decoder-input shift): no DTensor rule, and the decomposition tracer reaches
  the equally unregistered ``fill.Tensor``.

Rules are written for one mesh dim as ``(input placements, output placements)`` lists and expanded to the
mesh by :func:`~hf_colossal_auto.strategies.placements.expand_single_dim_rules`. The registry maps the
recorded op name to its rule so that others can be added next to these.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ..capture.graph import OpNode, StepGraph
from .placements import (
    REPLICATE,
    Placement,
    Strategy,
    expand_single_dim_rules,
    replicate_spec,
    shard,
)

SingleDimRule = tuple[list[Placement | None], list[Placement | None]]
CustomRule = Callable[[OpNode, StepGraph, tuple[int, ...]], list[Strategy]]
"""``rule(node, graph, mesh_shape) -> strategies``; an empty list means "no opinion here"."""


def _shape(graph: StepGraph, vid: int) -> tuple[int, ...]:
    return tuple(graph.values[vid].shape)


def _independent_dims_rules(
    node: OpNode, graph: StepGraph, n_attention_inputs: int, dims: Sequence[int]
) -> list[SingleDimRule]:
    """Rules for an attention kernel that is independent along each of ``dims`` (batch 0, heads 1).

    The first ``n_attention_inputs`` inputs and every output carry that dim (q/k/v/out/grads are
    ``(B, H, L, E)``, logsumexp is ``(B, H, L)``) and are split along it together. Any further input is the
    attention mask ``(B|1, H|1, L, S)``: split along the dim when it has it, replicated when it broadcasts.
    """
    rules: list[SingleDimRule] = [
        ([REPLICATE] * len(node.inputs), [REPLICATE] * len(node.outputs)),
    ]
    for d in dims:
        ins: list[Placement | None] = [shard(d)] * n_attention_inputs
        for vid in node.inputs[n_attention_inputs:]:
            shape = _shape(graph, vid)
            ins.append(shard(d) if len(shape) == 4 and shape[d] > 1 else REPLICATE)
        rules.append((ins, [shard(d)] * len(node.outputs)))
    return rules


def flash_attention_cpu_rule(node: OpNode, graph: StepGraph, mesh_shape: tuple[int, ...]) -> list[Strategy]:
    """``_scaled_dot_product_flash_attention_for_cpu(q, k, v, dropout_p, is_causal, *, attn_mask, scale)
    -> (out, logsumexp)``: shard batch (dim 0) or heads (dim 1) of q, k, v and both outputs together.

    Heads are independent (Megatron's attention TP); so are batch rows (data parallel). The sequence dims
    are not offered: queries could be split, but a causal mask would then need per-shard offsets the kernel
    does not take. Grouped-query k/v with fewer heads than q split consistently because HF repeats k/v to
    q's head count before the kernel, and uneven head counts are filtered by the enumerator.
    """
    rules = _independent_dims_rules(node, graph, 3, dims=(0, 1))
    return expand_single_dim_rules(rules, len(mesh_shape), "custom")


def flash_attention_cpu_backward_rule(
    node: OpNode, graph: StepGraph, mesh_shape: tuple[int, ...]
) -> list[Strategy]:
    """``..._for_cpu_backward(grad_out, q, k, v, out, logsumexp, dropout_p, is_causal, *, attn_mask, scale)
    -> (grad_q, grad_k, grad_v)``: the forward's batch/heads split, applied to the saved tensors and the
    gradients alike."""
    rules = _independent_dims_rules(node, graph, 6, dims=(0, 1))
    return expand_single_dim_rules(rules, len(mesh_shape), "custom")


def _follows_dim(shape: tuple[int, ...], d: int) -> bool:
    """An attention tensor carries the batch/head dim ``d`` when it has rank >= 3 and does not broadcast on it."""
    return len(shape) >= 3 and shape[d] > 1


def cuda_attention_rule(node: OpNode, graph: StepGraph, mesh_shape: tuple[int, ...]) -> list[Strategy]:
    """The GPU SDPA kernels (flash, memory-efficient; forward and backward) that the tracer records when the
    target is a GPU. q/k/v/out/lse/grads and a full-rank bias split together along batch (dim 0) or heads
    (dim 1); a bias that broadcasts on that dim and the 0-dim RNG seed/offset stay replicated.

    DTensor registers rules for the forward kernels, but they describe fewer outputs than the kernels return
    (the RNG state), so they cannot be matched to the recorded node.
    """
    rules: list[SingleDimRule] = [([REPLICATE] * len(node.inputs), [REPLICATE] * len(node.outputs))]
    for d in (0, 1):
        ins = [shard(d) if _follows_dim(_shape(graph, v), d) else REPLICATE for v in node.inputs]
        outs = [shard(d) if _follows_dim(_shape(graph, v), d) else REPLICATE for v in node.outputs]
        rules.append((ins, outs))
    return expand_single_dim_rules(rules, len(mesh_shape), "custom")


def fill_tensor_rule(node: OpNode, graph: StepGraph, mesh_shape: tuple[int, ...]) -> list[Strategy]:
    """``fill_(self, value: 0-dim Tensor)`` (T5 builds its decoder start tokens with it): every element of
    ``self`` gets the replicated scalar, so ``self`` may be replicated or sharded on any dim and the output
    (which *is* ``self``) keeps that placement. A partial ``self`` is not offered: filling does not commute
    with the pending sum. DTensor 2.13 registers no rule for ``fill.Tensor``, and its decomposition tracer
    stops there."""
    if len(node.inputs) != 2 or len(node.outputs) != 1:
        return []
    ndim = len(_shape(graph, node.inputs[0]))
    rules: list[SingleDimRule] = [([REPLICATE, REPLICATE], [REPLICATE])]
    rules += [([shard(d), REPLICATE], [shard(d)]) for d in range(ndim)]
    return expand_single_dim_rules(rules, len(mesh_shape), "custom")


def factory_rule(node: OpNode, graph: StepGraph, mesh_shape: tuple[int, ...]) -> list[Strategy]:
    """An op with no tensor input: every output replicated (see module docstring). Covers tensor factories
    and also bookkeeping calls with no tensors at all (the optimizer's ``profiler._record_function_*``),
    whose only strategy is the empty one."""
    if node.inputs:
        return []
    r = replicate_spec(len(mesh_shape))
    return [Strategy((), (r,) * len(node.outputs), "custom")]


EXTRA_RULES: dict[str, CustomRule] = {}
"""Op name -> rule whose strategies are offered *in addition to* DTensor's registered rule for the op (where
DTensor's rule is right but lacks a strategy the runtime can run another way). Expert parallelism, which no
per-op rule describes (the runtime runs a whole experts module as one region), is offered per module by
:func:`hf_colossal_auto.strategies.moe.add_expert_region_strategies`."""


def extra_strategies(node: OpNode, graph: StepGraph, mesh_shape: tuple[int, ...]) -> list[Strategy]:
    """Strategies of :data:`EXTRA_RULES` for ``node`` (empty when none applies)."""
    rule = EXTRA_RULES.get(node.op)
    return rule(node, graph, tuple(mesh_shape)) if rule is not None else []


CUSTOM_RULES: dict[str, CustomRule] = {
    "aten._scaled_dot_product_flash_attention_for_cpu.default": flash_attention_cpu_rule,
    "aten._scaled_dot_product_flash_attention_for_cpu_backward.default": flash_attention_cpu_backward_rule,
    "aten._scaled_dot_product_efficient_attention.default": cuda_attention_rule,
    "aten._scaled_dot_product_efficient_attention_backward.default": cuda_attention_rule,
    "aten._scaled_dot_product_flash_attention.default": cuda_attention_rule,
    "aten._scaled_dot_product_flash_attention_backward.default": cuda_attention_rule,
    "aten.fill_.Tensor": fill_tensor_rule,
    "aten.fill.Tensor": fill_tensor_rule,
}
"""Op name (as recorded, ``"aten.<op>.<overload>"``) -> rule. Consulted before DTensor's decomposition
tracer and after DTensor's registered rules."""


def custom_strategies(node: OpNode, graph: StepGraph, mesh_shape: tuple[int, ...]) -> list[Strategy] | None:
    """Our rule's strategies for ``node``, or None when we have no rule for it.

    Registered rules come first; any op without tensor inputs gets :func:`factory_rule`.
    """
    rule = CUSTOM_RULES.get(node.op)
    if rule is not None:
        return rule(node, graph, tuple(mesh_shape)) or None
    if not node.inputs:
        return factory_rule(node, graph, tuple(mesh_shape))
    return None
