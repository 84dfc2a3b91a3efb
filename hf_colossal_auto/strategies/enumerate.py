"""Per-node sharding strategies of a captured step: the candidate set the ILP chooses from.

For every node of the requested phases the enumerator asks, in order:

1. our own rule (:mod:`.custom_rules`) for the ops it names - ops DTensor lacks (CPU flash attention,
   factories) or describes unusably (the GPU attention kernels). They come first so that the answer does not
   depend on whether the runtime has already registered its equivalents into DTensor in this process;
2. DTensor's registered rule (single-dim or op-strategy, :mod:`.dtensor_rules`) - the rules that will run
   the plan;
3. DTensor's decomposition tracer - generic but slow, hence after our explicit rules;
4. otherwise the single all-replicate strategy, with one warning per op name per call, naming the op. The
   plan is still valid (replicated compute is always correct); it is only less parallel than it could be.

Results are filtered to evenly sharded strategies and deduplicated, and cached per call signature: the
blocks of a transformer repeat the same ops on the same shapes, so a 12-layer model costs about one layer.
The ops of an MoE experts module then get the strategy of the runtime's expert-parallel region
(:func:`.moe.add_expert_region_strategies`), which no per-op rule describes.
"""

from __future__ import annotations

import logging
import math
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any

from .._torch_compat import detached_device_mesh, fake_process_group
from ..capture.graph import OpNode, Phase, StepGraph, TensorRef, ValueKind
from .custom_rules import custom_strategies, extra_strategies
from .dtensor_rules import PARTIAL_VIEWS, dtensor_rule_kind, dtensor_strategies, resolve_op
from .moe import add_expert_region_strategies
from .placements import (
    LOOKUP_OPS,
    Strategy,
    evenly_sharded,
    is_partial,
    reduced_lookup,
    replicate_strategy,
)

logger = logging.getLogger(__name__)

_CACHE_SIZE = 16384
_cache: OrderedDict[tuple, tuple[tuple[Strategy, ...], bool]] = OrderedDict()
_meshes: dict[tuple, tuple[Any, Any]] = {}
"""(mesh shape, world size, backend) -> (the default group it was built for, mesh). The group is held, not
its id, so a group destroyed and re-created (tests do) can never be mistaken for the old one."""


# ---------------------------------------------------------------------------------------------- mesh
def _mesh_shape(mesh_shape: Sequence[int] | int) -> tuple[int, ...]:
    shape = (mesh_shape,) if isinstance(mesh_shape, int) else tuple(int(s) for s in mesh_shape)
    if not shape or any(s < 1 for s in shape):
        raise ValueError(f"mesh_shape must be a non-empty tuple of positive sizes, got {mesh_shape!r}")
    return shape


def _device_type(backend: str) -> str:
    backend = backend.lower()
    if "nccl" in backend:
        return "cuda"
    if "xccl" in backend:
        return "xpu"
    return "cpu"


def device_mesh(mesh_shape: Sequence[int] | int) -> Any:
    """A DeviceMesh of ``mesh_shape`` for asking sharding rules (which read only its shape).

    * torch.distributed not initialised: start the in-process fake backend with one rank per mesh device
      (no processes, no communication) and build the mesh over it.
    * A fake group of exactly the mesh's size: a mesh over it.
    * Any other group — a fake one of another size (an earlier enumeration for another mesh), or a real one
      (planning inside a training job, where only one rank plans): a mesh with no process groups behind it.
      Rules read only the mesh's shape, and building a real mesh would create sub-groups, a collective call
      the other ranks are not making.
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    shape = _mesh_shape(mesh_shape)
    n = math.prod(shape)
    if not dist.is_available():
        raise RuntimeError(
            "torch.distributed is not available in this torch build; strategies need DeviceMesh"
        )
    if not dist.is_initialized():
        fake_process_group(n)
    world = dist.get_world_size()
    backend = str(dist.get_backend())
    group = dist.group.WORLD
    key = (shape, world, backend)
    cached = _meshes.get(key)
    if cached is not None and cached[0] is group:
        return cached[1]
    if world == n and backend == "fake":
        mesh = init_device_mesh(_device_type(backend), shape)
    else:
        mesh = detached_device_mesh(shape, "cpu")
    _meshes[key] = (group, mesh)
    return mesh


# ---------------------------------------------------------------------------------------------- cache key
def _freeze(obj: Any, graph: StepGraph) -> Any:
    """A hashable stand-in for recorded arguments: tensors by shape and dtype, containers as tuples."""
    if isinstance(obj, TensorRef):
        v = graph.values[obj.value_id]
        return ("T", tuple(v.shape), v.dtype)
    if isinstance(obj, (list, tuple)):
        return (type(obj).__name__, *(_freeze(o, graph) for o in obj))
    if isinstance(obj, dict):
        return ("dict", *((k, _freeze(v, graph)) for k, v in obj.items()))
    try:
        hash(obj)
    except TypeError:
        return ("repr", repr(obj))
    if isinstance(obj, float) and obj != obj:  # NaN != NaN would defeat the cache
        return ("nan",)
    return (type(obj).__name__, obj)


def _signature(node: OpNode, graph: StepGraph, mesh_shape: tuple[int, ...], allow_partial: bool) -> tuple:
    outs = tuple((tuple(graph.values[v].shape), graph.values[v].dtype) for v in node.outputs)
    return (node.op, _freeze(node.args, graph), outs, mesh_shape, allow_partial)


# ---------------------------------------------------------------------------------------------- one node
def _usable(strategies: Iterable[Strategy], node: OpNode, graph: StepGraph, mesh_shape: tuple[int, ...]):
    """Evenly sharded strategies that line up with the node, first occurrence of each placement set."""
    in_shapes = [graph.values[v].shape for v in node.inputs]
    out_shapes = [graph.values[v].shape for v in node.outputs]
    seen: set[tuple] = set()
    out: list[Strategy] = []
    for s in strategies:
        if len(s.input_placements) != len(in_shapes) or len(s.output_placements) != len(out_shapes):
            continue
        if s.key in seen:
            continue
        if not all(
            evenly_sharded(sh, sp, mesh_shape) for sh, sp in zip(in_shapes, s.input_placements, strict=True)
        ):
            continue
        if not all(
            evenly_sharded(sh, sp, mesh_shape) for sh, sp in zip(out_shapes, s.output_placements, strict=True)
        ):
            continue
        seen.add(s.key)
        out.append(s)
    return out


def node_strategies(
    node: OpNode,
    graph: StepGraph,
    mesh: Any,
    *,
    allow_partial_inputs: bool = False,
) -> tuple[list[Strategy], bool]:
    """The strategies of one node on ``mesh`` (a DeviceMesh) and whether it fell back to replicate.

    Uncached; :func:`enumerate_strategies` is the cached entry point.
    """
    mesh_shape = tuple(mesh.shape)
    op = resolve_op(node.op)
    kind = dtensor_rule_kind(op) if op is not None else None

    def dtensor() -> list[Strategy] | None:
        return dtensor_strategies(node, graph, mesh, allow_partial_inputs=allow_partial_inputs)

    def custom() -> list[Strategy] | None:
        return custom_strategies(node, graph, mesh_shape)

    sources = [custom]
    if kind in ("single-dim", "op-strategy"):
        sources.append(dtensor)
    if kind == "decomposition":
        sources.append(dtensor)
    extra = extra_strategies(node, graph, mesh_shape)
    for source in sources:
        found = source()
        if found:
            usable = _usable([*found, *extra], node, graph, mesh_shape)
            if usable:
                return usable, False
    return [replicate_strategy(len(node.inputs), len(node.outputs), len(mesh_shape))], True


# ---------------------------------------------------------------------------------------------- graph
def runtime_plain_nodes(graph: StepGraph) -> set[int]:
    """Forward ops that run on ordinary tensors when the plan runs: those reading only buffers and what other
    such ops made (RoPE's cos/sin from ``inv_freq``, masks and position ids from constants). The runtime turns
    parameters and the model's inputs into DTensors and nothing else, so these ops compute the same replicated
    result on every rank, whatever a strategy would say."""
    plain_values = {v.id for v in graph.values.values() if v.kind is ValueKind.BUFFER}
    plain: set[int] = set()
    for node in graph.nodes:
        if node.phase is Phase.FORWARD and all(v in plain_values for v in node.inputs):
            plain.add(node.index)
            plain_values.update(node.outputs)
    return plain


def enumerate_strategies(
    graph: StepGraph,
    mesh_shape: Sequence[int] | int,
    *,
    phases: Iterable[Phase] = (Phase.FORWARD,),
    allow_partial_inputs: bool = False,
) -> dict[int, list[Strategy]]:
    """Candidate strategies for every node of ``phases``, keyed by node index.

    Every listed node gets at least one strategy. Strategies are deduplicated (the first rule to propose a
    placement set names its source) and those that shard a tensor dim unevenly are dropped: an uneven
    split has a largest shard that sets both the step time and the per-device memory, DTensor pads it in
    collectives, and the cost model prices even shards only, so offering it would let the solver believe
    in savings that do not exist. Nodes with no usable rule get the all-replicate strategy, and each such
    op name is logged once per call at WARNING. ``allow_partial_inputs`` keeps strategies that carry a
    partial sum through linear ops (see :func:`.dtensor_rules._keep`); off by default.

    Sets up a fake process group when torch.distributed is not initialised (see :func:`device_mesh`).
    """
    shape = _mesh_shape(mesh_shape)
    wanted = {Phase(p) for p in phases}
    mesh = device_mesh(shape)
    result: dict[int, list[Strategy]] = {}
    fell_back: dict[str, int] = {}
    plain = runtime_plain_nodes(graph)
    for node in graph.nodes:
        if node.phase not in wanted:
            continue
        if node.index in plain:
            result[node.index] = [
                replicate_strategy(len(node.inputs), len(node.outputs), len(shape), "plain-tensor")
            ]
            continue
        key = _signature(node, graph, shape, allow_partial_inputs)
        hit = _cache.get(key)
        if hit is None:
            found, fallback = node_strategies(node, graph, mesh, allow_partial_inputs=allow_partial_inputs)
            hit = (tuple(found), fallback)
            _cache[key] = hit
            if len(_cache) > _CACHE_SIZE:
                _cache.popitem(last=False)
        else:
            _cache.move_to_end(key)
        strategies, fallback = hit
        result[node.index] = list(strategies)
        if fallback:
            fell_back[node.op] = fell_back.get(node.op, 0) + 1
    for op, count in fell_back.items():
        logger.warning(
            "no sharding rule for %s (%d node%s): running it replicated on mesh %s",
            op,
            count,
            "" if count == 1 else "s",
            shape,
        )
    _partial_views_read_once(graph, result)
    _lookups_reduced(graph, result)
    if Phase.FORWARD in wanted:
        add_expert_region_strategies(graph, result, shape)
    return result


def _partial_views_read_once(graph: StepGraph, result: dict[int, list[Strategy]]) -> None:
    """Keep a view's ``(P) -> (P)`` strategies (:data:`.dtensor_rules.PARTIAL_VIEWS`) only where one forward op
    reads the view: the planner prices a reduction per reader, and a partial sum read by several (the gelu of a
    row-parallel ``c_fc``: five elementwise ops) is reduced once at run time, where it is made."""
    readers: dict[int, int] = {}
    for node in graph.nodes:
        if node.phase is Phase.FORWARD:
            for vid in set(node.inputs):
                readers[vid] = readers.get(vid, 0) + 1
    for index, strategies in result.items():
        node = graph.nodes[index]
        if node.op not in PARTIAL_VIEWS or not node.outputs or readers.get(node.outputs[0], 0) == 1:
            continue
        kept = [
            st for st in strategies if not any(spec and is_partial(spec[0]) for spec in st.input_placements)
        ]
        if kept:
            result[index] = kept


def _lookups_reduced(graph: StepGraph, result: dict[int, list[Strategy]]) -> None:
    """A lookup into a vocab-sharded table (:func:`.placements.reduced_lookup`) hands its readers a replicated
    value: the runtime all-reduces DTensor's masked partial sum where the lookup makes it. Left partial, the
    planner would price one reduction per reader, each to the placement that reader wants (a reduce-scatter to
    a norm read hidden-sharded, another to a residual add read batch-sharded, an all-reduce to a third), and
    let the readers run as DTensor would on a partial input, where the run gives them a replicated one (a
    norm that runs replicated, not split with a partial gradient to reduce for its inverse norm)."""
    for index, strategies in result.items():
        node = graph.nodes[index]
        if node.op not in LOOKUP_OPS:
            continue
        rewritten = []
        for st in strategies:
            outs = st.output_placements
            mesh_axes = len(outs[0]) if outs else 0
            reduced = [
                a for a in range(mesh_axes) if reduced_lookup(node.op, st, a) and is_partial(outs[0][a])
            ]
            if reduced:
                outs = tuple(
                    tuple("R" if a in reduced else p for a, p in enumerate(spec)) if k == 0 else spec
                    for k, spec in enumerate(outs)
                )
                st = Strategy(st.input_placements, outs, st.source)
            if st not in rewritten:
                rewritten.append(st)
        result[index] = rewritten


def fallback_ops(strategies: dict[int, list[Strategy]], graph: StepGraph) -> list[str]:
    """Op names whose nodes got only the replicate fallback, sorted; for reports."""
    by_index = {n.index: n for n in graph.nodes}
    return sorted(
        {by_index[i].op for i, ss in strategies.items() if all(s.source == "replicate-fallback" for s in ss)}
    )


def ops_without_dtensor_rule(graph: StepGraph) -> list[str]:
    """Op names of the step (forward and backward) on tensors that DTensor has no sharding rule for, sorted:
    the planner prices them replicated (or by a rule of ours); the runtime must run them replicated or by that
    rule (``Plan.replicated_ops``)."""
    return sorted(
        {
            n.op
            for n in graph.nodes
            if n.inputs and (op := resolve_op(n.op)) is not None and dtensor_rule_kind(op) is None
        }
    )


def clear_cache() -> None:
    """Forget cached strategies (e.g. after registering a custom rule)."""
    _cache.clear()
