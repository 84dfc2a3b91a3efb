"""Queries on a captured step with its identical blocks tied: the canonical node each traced copy maps to and
the graph walks every part of the ILP shares (producers, readers, views, shared projection inputs)."""

from __future__ import annotations

import functools
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

from ..capture.graph import Phase, StepGraph, ValueKind
from ..capture.module_kinds import PROJECTION_TYPES


@dataclass
class TiedGraph:
    """Forward nodes of a step with every copy of a folded block mapped onto the representative."""

    graph: StepGraph
    canonical: dict[int, int]
    """Forward node index -> the node that decides for it."""
    weight: dict[int, int]
    """Forward node index -> how many real nodes of the full model it stands for (its copy's weight)."""
    multiplicity: dict[int, int]
    """Canonical node -> how many real nodes it decides for."""
    copy_prefix: dict[int, tuple[str, str]]
    """Forward node index inside a traced copy -> (copy block FQN, representative block FQN)."""
    _canonical_params: dict[str, str] = field(default_factory=dict, init=False, repr=False, compare=False)
    """:meth:`canonical_param`'s answers so far (each walks every block of every run)."""

    @classmethod
    def build(cls, graph: StepGraph) -> TiedGraph:
        fwd = [n.index for n in graph.nodes if n.phase is Phase.FORWARD]
        canonical = {i: i for i in fwd}
        weight = {i: 1 for i in fwd}
        copy_prefix: dict[int, tuple[str, str]] = {}
        for run in graph.block_runs:
            rep = run.representative
            rep_seg = graph.block_segments[rep][Phase.FORWARD]
            n_real = len(run.all_blocks)
            for block in run.traced:
                seg = graph.block_segments[block][Phase.FORWARD]
                w = n_real - (len(run.traced) - 1) if block == rep else 1
                for i in range(seg.start, seg.end):
                    canonical[i] = rep_seg.start + (i - seg.start)
                    weight[i] = w
                    copy_prefix[i] = (block, rep)
        multiplicity: dict[int, int] = defaultdict(int)
        for i in fwd:
            multiplicity[canonical[i]] += weight[i]
        return cls(graph, canonical, weight, dict(multiplicity), copy_prefix)

    def canonical_param(self, name: str) -> str:
        """The representative's parameter a (possibly folded or copied) parameter FQN is tied to."""
        known = self._canonical_params.get(name)
        if known is None:
            known = self._canonical_params[name] = self._find_canonical_param(name)
        return known

    def _find_canonical_param(self, name: str) -> str:
        for run in self.graph.block_runs:
            for block in run.all_blocks:
                if name.startswith(block + "."):
                    return run.representative + name[len(block) :]
        return name


def forward_producers(graph: StepGraph) -> dict[int, tuple[int, int]]:
    """Value id -> (forward node, output position) that made it."""
    return {
        vid: (n.index, pos)
        for n in graph.nodes
        if n.phase is Phase.FORWARD
        for pos, vid in enumerate(n.outputs)
    }


def shared_projection_inputs(graph: StepGraph, tied: TiedGraph) -> dict[tuple[int, int], str]:
    """(forward node, input position) of the uses whose forward resharding is shared: a value read as the
    module input of two or more sibling projections (q, k and v of one normed input, under one attention
    module) is redistributed once per target placement, by the runtime's projection hooks, and every sibling
    wanting that placement reads the copy. Maps each such use to the parent module its copy belongs to."""
    uses: dict[tuple[int, str], list[tuple[int, int]]] = defaultdict(list)
    for i in tied.canonical:
        node = graph.nodes[i]
        module = node.module
        if graph.module_types.get(module) not in PROJECTION_TYPES:
            continue
        for k, vid in enumerate(node.inputs):
            value = graph.values[vid]
            if value.kind is ValueKind.PARAM or value.producer is None:
                continue
            if graph.made_inside(vid, module):
                continue  # made inside the projection: not its module input
            uses[(vid, module.rpartition(".")[0])].append((i, k))
    shared: dict[tuple[int, int], str] = {}
    for (_, parent), found in uses.items():
        if len({graph.nodes[i].module for i, _ in found}) > 1:
            shared.update(dict.fromkeys(found, parent))
    return shared


def returned_through_hook(graph: StepGraph, tied: TiedGraph) -> dict[tuple[int, int], tuple[int, int]]:
    """(reader, input position) -> (node, output position) for each output the model returns (its logits) that
    is the output of its node's module (the node is the module's last forward op, :func:`last_forward_ops`)
    and that one op outside the module reads: the runtime gives a partial sum of it the placement that reader
    takes it in, at the module boundary (:func:`~.boundaries.reduced_where_read`), and returns *that* to the
    caller (gathered there), not the partial sum (all-reduced)."""
    returned = set(graph.output_values)
    last = last_forward_ops(graph, tied)
    made: dict[
        int, tuple[int, int]
    ] = {}  # returned value -> (node, output position), where a module returns it
    for i in tied.canonical:
        module = graph.nodes[i].module
        if last.get(module) == i:  # the root module ("") has no boundary before the caller: not in ``last``
            made.update({vid: (i, pos) for pos, vid in enumerate(graph.nodes[i].outputs) if vid in returned})
    outside: dict[int, list[tuple[int, int]]] = defaultdict(list)
    for j in sorted(tied.canonical):
        for k, vid in enumerate(graph.nodes[j].inputs):
            if vid in made:
                module, reader = graph.nodes[made[vid][0]].module, graph.nodes[j].module
                if not (reader == module or reader.startswith(module + ".")):
                    outside[vid].append((j, k))
    return {readers[0]: made[vid] for vid, readers in outside.items() if len(readers) == 1}


def last_forward_ops(graph: StepGraph, tied: TiedGraph) -> dict[str, int]:
    """Module FQN -> the last canonical forward op run inside it or its children: what the module returns, the
    output its plan placement (``Plan.activation_placements``) is read from. The root module ``""`` is not in
    it (its output is the model's output)."""
    last: dict[str, int] = {}
    for i in sorted(tied.canonical):
        if graph.nodes[i].outputs:
            parts = graph.nodes[i].module.split(".") if graph.nodes[i].module else []
            for n in range(len(parts), 0, -1):
                last[".".join(parts[:n])] = i
    return last


def view_root(graph: StepGraph, tied: TiedGraph, producer: dict[int, tuple[int, int]], vid: int) -> int:
    """The activation a chain of views starts from: a partial gradient passes back through views (a linear's
    flattening of its input) and is reduced once there, summed with the value's other uses."""
    return _walk_back(graph, tied, producer, vid, lambda node: node.is_view)


def viewed_param(
    graph: StepGraph, tied: TiedGraph, producer: dict[int, tuple[int, int]], root: int
) -> int | None:
    """The parameter a view chain's root is a view of (a linear weight's transpose), else None.

    :func:`view_root` stops at such a view, but its partial gradient is not reduced there: the runtime gathers
    a weight stored sharded for its use (``apply/enforce.py``), the view passes the partial gradient back, and
    the gather's backward reduces it straight to the weight's stored placement (a reduce-scatter to a shard,
    an all-reduce to a replica)."""
    return _param_behind(graph, tied, producer, root, lambda node: node.is_view)


def _passes_gradient(graph: StepGraph, node) -> bool:
    """Whether a partial gradient passes back through ``node`` unreduced: a view, or a cast from one floating
    dtype to another (autocast's ``_to_copy``): DTensor keeps a partial placement through such a cast (it
    commutes with the sum), and the runtime's gathered copies sit before it, so the partial gradient meets
    the other uses' at the value cast."""
    if node.is_view:
        return True
    if node.op != "aten._to_copy.default" or len(node.inputs) != 1 or len(node.outputs) != 1:
        return False
    src, out = graph.values[node.inputs[0]], graph.values[node.outputs[0]]
    return src.shape == out.shape and src.dtype.startswith(_FLOATING) and out.dtype.startswith(_FLOATING)


def gradient_root(graph: StepGraph, tied: TiedGraph, producer: dict[int, tuple[int, int]], vid: int) -> int:
    """Where a partial gradient arriving at ``vid`` is reduced: back through views and floating-point casts
    (:func:`_passes_gradient`) to the value they start from, summed there with that value's other uses (q, k
    and v each cast one normed input under autocast; the runtime reduces their summed gradient once, in the
    input's dtype). :func:`view_root` without the casts is what the memory and parameter-node rules read."""
    return _walk_back(graph, tied, producer, vid, functools.partial(_passes_gradient, graph))


def reduced_param(
    graph: StepGraph, tied: TiedGraph, producer: dict[int, tuple[int, int]], root: int
) -> int | None:
    """The parameter a :func:`gradient_root` is a view or a cast of (a weight's low-precision copy under
    autocast, gathered for use before it is cast), else None: the partial gradient is reduced straight to the
    parameter's storage placement, in the parameter's dtype (:func:`viewed_param` for casts too)."""
    return _param_behind(graph, tied, producer, root, functools.partial(_passes_gradient, graph))


def _walk_back(
    graph: StepGraph, tied: TiedGraph, producer: dict[int, tuple[int, int]], vid: int, passes: Callable
) -> int:
    """Back from ``vid`` through the single-input forward ops ``passes`` lets a gradient through."""
    while vid in producer and producer[vid][0] in tied.canonical:
        node = graph.nodes[producer[vid][0]]
        ins = [v for v in node.inputs if graph.values[v].kind is not ValueKind.PARAM]
        if not passes(node) or len(ins) != 1 or ins[0] not in producer:
            break
        if producer[ins[0]][0] not in tied.canonical:
            break
        vid = ins[0]
    return vid


def _param_behind(
    graph: StepGraph, tied: TiedGraph, producer: dict[int, tuple[int, int]], root: int, passes: Callable
) -> int | None:
    """The parameter ``root`` is made from by one op ``passes`` lets a gradient through, else None."""
    src = producer.get(root)
    if src is None or src[0] not in tied.canonical:
        return None
    node = graph.nodes[src[0]]
    if not passes(node):
        return None
    params = [v for v in node.inputs if graph.values[v].kind is ValueKind.PARAM and graph.values[v].name]
    return params[0] if len(params) == len(node.inputs) == 1 else None


_FLOATING = ("float", "bfloat", "half", "complex")


def differentiable_values(graph: StepGraph) -> set[int]:
    """Values a gradient flows back to: trained parameters, and floating-point outputs of forward ops that read
    one.

    (The tracer records below autograd, where no tensor has ``requires_grad`` yet, so it is derived here.)
    RoPE's cos/sin tables, masks and position ids come out of this empty: no gradient is reduced for them; nor
    for a frozen embedding's output (no gradient reaches a frozen parameter, so none is computed for it)."""
    needs = {
        v.id
        for v in graph.values.values()
        if v.kind is ValueKind.PARAM and (v.name is None or graph.is_trainable(v.name))
    }
    for node in graph.nodes:
        if node.phase is not Phase.FORWARD or not any(v in needs for v in node.inputs):
            continue
        for vid in node.outputs:
            if graph.values[vid].dtype.startswith(_FLOATING):
                needs.add(vid)
    return needs


def value_readers(graph: StepGraph, tied: TiedGraph) -> dict[int, int]:
    """Value id -> number of forward nodes that read it (the gradient contributions autograd sums)."""
    readers: dict[int, int] = defaultdict(int)
    for i in tied.canonical:
        for vid in set(graph.nodes[i].inputs):
            readers[vid] += 1
    return readers


def _real_modules_of(graph: StepGraph, tied: TiedGraph, i: int) -> list[str]:
    """The module of forward node ``i`` in every real block it stands for (a folded run's representative
    stands for itself and every block not traced)."""
    module = graph.nodes[i].module
    prefix = tied.copy_prefix.get(i)
    if prefix is None or prefix[0] != prefix[1]:
        return [module]
    rep = prefix[1]
    run = next(r for r in graph.block_runs if r.representative == rep)
    blocks = [b for b in run.all_blocks if b == rep or b not in run.traced]
    return [b + module[len(rep) :] for b in blocks]


def _weighted(tied: TiedGraph, by_node: dict[int, int]) -> dict[int, float]:
    """Bytes per canonical node: every copy's allocations land on the node that decides for it."""
    out: dict[int, float] = defaultdict(float)
    for i, c in tied.canonical.items():
        out[c] += by_node.get(i, 0)
    return out
