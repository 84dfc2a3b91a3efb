"""SDPA's unfused math path in a traced step, found and made what a context-parallel rank runs.

Why: ``scaled_dot_product_attention`` picks its kernel when it runs. On a CPU target with attention dropout
(training with ``attention_dropout`` / ``attn_pdrop`` > 0, the default of many configs) no fused CPU kernel
takes dropout, so SDPA runs its math decomposition: ``bmm(q, kᵀ)`` -> (+ mask) -> softmax -> dropout
(``bernoulli_``, ``div_``, ``mul``) -> ``bmm(·, v)``, and the trace holds those aten ops, not one fused kernel.
The context-parallel runtime runs such a layer on its mask path (dropout is never blocked), where SDPA on the
same device again runs the math path, now with this rank's ``s`` queries against all ``S = cp x s`` keys.

Found by dataflow, not by shapes alone (a head dim equal to the chunk length must not pass for a score): from
each forward softmax of an attention module, the *score* values are those reached through that module's
non-matmul ops (adds, softmax and its backward, dropout's ops, views) with the softmax's element count, and the
matmuls that read or write one; the forward matmul that writes the softmax's input (through the add and scale)
is ``q @ kᵀ``, the one that reads the dropped-out probabilities is ``probs @ v``.

What one cp rank runs differs from the reshaped trace (``B x cp`` sequences of ``s`` tokens) exactly where a
dimension is the keys': every score tensor is ``[.., s, S]`` (``cp`` times its elements, FLOPs and bytes); every
attention matmul has one key-length dimension (``cp`` times its FLOPs) and, besides its score operand, one
``[.., S, d]`` operand of the keys' side and one ``[.., s, d]`` of the queries' side (the math path repeats
grouped K/V to the query heads, so the two have equal sizes: each priced at ``(cp + 1) / 2`` of its traced
bytes).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from ..capture.graph import OpNode, Phase, StepGraph
from ..capture.op_classes import MATMUL, op_base_name, op_class

SOFTMAX_OPS = ("_safe_softmax", "_softmax", "softmax")
DROPOUT_OPS = ("bernoulli_", "bernoulli", "native_dropout")


@dataclass(frozen=True)
class MathAttention:
    """One SDPA call traced as its math decomposition."""

    module: str
    softmax: int
    """Node index of the forward softmax (its output, the probabilities, is kept for its backward)."""
    scores_matmul: int
    """Node index of ``q @ kᵀ``: its inputs are (queries, keys) as the math path reads them."""
    values_matmul: int
    """Node index of ``probs @ v``: its second input is the values."""
    score_values: frozenset[int]
    """Value ids of every score-shaped tensor of the call, forward and backward."""
    score_nodes: tuple[int, ...]
    """Non-matmul nodes that write a score value (their FLOPs and bytes scale with the key length)."""
    matmuls: tuple[int, ...]
    """Forward and backward matmuls that read or write a score value."""
    dropout: bool
    """A dropout over the probabilities (``bernoulli_`` on a score value): the runtime runs the mask path."""
    outside_mask: bool
    """The scores get an additive mask from outside the attention module (a padding mask), not only the causal
    mask the math path builds itself."""


def operands(graph: StepGraph, call: MathAttention) -> tuple[int, int, int]:
    """(query, key, value) value ids of a math-path call: the inputs of ``q @ kᵀ`` and the second of
    ``probs @ v`` (at the query heads, flattened to ``[batch x heads, ...]``)."""
    scores = graph.nodes[call.scores_matmul]
    values = graph.nodes[call.values_matmul]
    return scores.inputs[0], scores.inputs[1], values.inputs[1]


def _numel(graph: StepGraph, value: int) -> int:
    return math.prod(graph.values[value].shape) if value in graph.values else -1


def math_attention_calls(graph: StepGraph) -> list[MathAttention]:
    """Every SDPA call of ``graph`` traced as the math path (see the module's docstring), in forward order."""
    calls = []
    by_module: dict[str, list[OpNode]] = {}
    for node in graph.nodes:
        by_module.setdefault(node.module, []).append(node)
    for node in graph.nodes:
        if node.phase != Phase.FORWARD or op_base_name(node.op) not in SOFTMAX_OPS or not node.outputs:
            continue
        call = _call_of(graph, node, by_module[node.module])
        if call is not None:
            calls.append(call)
    return calls


def _call_of(graph: StepGraph, softmax: OpNode, nodes: list[OpNode]) -> MathAttention | None:
    """The math-path call around forward ``softmax`` (None where no matmul writes its input and none reads
    its output: a softmax that is not attention's)."""
    size = _numel(graph, softmax.outputs[0])
    scores: set[int] = {softmax.outputs[0], *softmax.inputs[:1]}
    score_nodes: set[int] = set()
    changed = True
    while changed:  # the closure over the module's non-matmul ops; operands of score ops with the score size
        changed = False
        for node in nodes:
            if op_class(node.op) == MATMUL:
                continue
            touches = any(v in scores for v in node.inputs) or any(v in scores for v in node.outputs)
            if not touches:
                continue
            new = {v for v in (*node.inputs, *node.outputs) if _numel(graph, v) == size} - scores
            if node.index not in score_nodes:
                score_nodes.add(node.index)
                changed = True
            if new:
                scores |= new
                changed = True
    matmuls = [
        n.index
        for n in nodes
        if op_class(n.op) == MATMUL and any(v in scores for v in (*n.inputs, *n.outputs))
    ]
    forward = [graph.nodes[i] for i in matmuls if graph.nodes[i].phase == Phase.FORWARD]
    writes = [n for n in forward if any(v in scores for v in n.outputs) and n.index < softmax.index]
    reads = [n for n in forward if n.inputs and n.inputs[0] in scores and n.index > softmax.index]
    if not writes or not reads:
        return None
    score_nodes = {i for i in score_nodes if any(v in scores for v in graph.nodes[i].outputs)}
    dropout = any(
        op_base_name(graph.nodes[i].op) in DROPOUT_OPS and graph.nodes[i].phase == Phase.FORWARD
        for i in score_nodes
    )
    return MathAttention(
        module=softmax.module,
        softmax=softmax.index,
        scores_matmul=writes[-1].index,
        values_matmul=reads[0].index,
        score_values=frozenset(scores),
        score_nodes=tuple(sorted(score_nodes)),
        matmuls=tuple(matmuls),
        dropout=dropout,
        outside_mask=_outside_mask(graph, writes[-1], softmax, scores),
    )


def _outside_mask(graph: StepGraph, scores_matmul: OpNode, softmax: OpNode, scores: set[int]) -> bool:
    """Whether a tensor from outside the attention module is added to the scores between ``q @ kᵀ`` and the
    softmax (a caller's mask; the causal mask the math path builds comes from factory ops in the module)."""
    for node in graph.nodes[scores_matmul.index + 1 : softmax.index]:
        if node.module != softmax.module or not any(v in scores for v in node.inputs):
            continue
        for value in node.inputs:
            if (
                value not in scores
                and len(graph.values[value].shape) >= 2
                and _from_outside(graph, value, node.module)
            ):
                return True
    return False


def _from_outside(graph: StepGraph, value: int, module: str) -> bool:
    """Whether ``value`` depends on a value produced outside ``module`` (or an input of the step)."""
    seen, todo = set(), [value]
    while todo:
        current = todo.pop()
        if current in seen:
            continue
        seen.add(current)
        producer = graph.values[current].producer
        if producer is None or graph.nodes[producer].module != module:
            return True
        todo.extend(graph.nodes[producer].inputs)
    return False


def scale_math_attention(graph: StepGraph, call: MathAttention, cp: int, grown: dict[int, int]) -> None:
    """Make ``call`` what a cp rank runs, in place (see the module's docstring): FLOPs ``cp`` times on every
    score op and attention matmul, their bytes as the key length grows them, and each score tensor's storage
    ``cp`` times its size (recorded in ``grown`` by storage id, applied to storages and memory events by the
    caller)."""
    for index in call.score_nodes:
        node = graph.nodes[index]
        node.flops *= cp
        node.bytes_read *= cp
        node.bytes_written *= cp
    for index in call.matmuls:
        node = graph.nodes[index]
        node.flops *= cp
        read = sum(graph.values[v].nbytes for v in node.inputs if v in call.score_values)
        written = sum(graph.values[v].nbytes for v in node.outputs if v in call.score_values)
        node.bytes_read = round(cp * read + (node.bytes_read - read) * (cp + 1) / 2)
        node.bytes_written = round(cp * written + (node.bytes_written - written) * (cp + 1) / 2)
    storages = {graph.values[v].storage_id for v in call.score_values if graph.values[v].producer is not None}
    for sid in storages:
        grown[sid] = grown.get(sid, 0) + (cp - 1) * graph.storages[sid].nbytes
    for value in call.score_values:
        info = graph.values[value]
        if info.producer is not None:
            graph.values[value] = dataclasses.replace(info, nbytes=info.nbytes * cp)


def _kernel_dropout(node: OpNode) -> float:
    """The dropout probability a traced SDPA kernel ran with (the memory-efficient kernel takes a bias and a
    flag before it)."""
    args, kwargs = node.args if isinstance(node.args, tuple) and len(node.args) == 2 else ((), {})
    at = 5 if "efficient" in node.op else 3
    value = kwargs.get("dropout_p", args[at] if len(args) > at else 0.0)
    return float(value) if isinstance(value, int | float) else 0.0
