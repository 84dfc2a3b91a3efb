"""Compute pricing: an op's device and host seconds on its local shapes under a strategy, how its backward
splits off its forward, the optimizer step, and the busiest rank's share of an expert-parallel GEMM."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from ...capture.graph import OpNode, Phase, StepGraph
from ...capture.moe import RoutingLoad
from ...capture.op_classes import MATMUL, op_class
from ...hardware.catalog import DeviceSpec
from ...hardware.roofline import host_time, join_host, kernel_time
from ...profile.profiler import (
    is_attention_kernel,
    node_dtype,
    node_kernel_time,
    node_times,
    transcendental_elements,
)
from ...strategies.moe import EXPERT_REGION
from ...strategies.placements import Strategy
from ..problem import DecisionNode, Overlap, Problem
from ..tied import TiedGraph, _real_modules_of
from .comm import shard_factor, splits_work

DEFAULT_BACKWARD_RATIO = 2.0
"""Backward/forward time of a module we saw no forward time for (a matmul's backward is two matmuls)."""


@dataclass(frozen=True)
class BackwardRatios:
    """Per module, what its backward costs for one unit of its forward: device time (a matmul's backward is
    two matmuls) and op count (each op costs the host its per-op overhead)."""

    device: dict[str, float]
    ops: dict[str, float]

    def of(self, module: str) -> tuple[float, float]:
        return self.device.get(module, DEFAULT_BACKWARD_RATIO), self.ops.get(module, DEFAULT_BACKWARD_RATIO)

    def backward_share(self, module: str) -> float:
        """The share of an op's device time (its forward and backward priced together) that its backward runs."""
        device_ratio = self.of(module)[0]
        return device_ratio / (1.0 + device_ratio)


def _backward_ratios(graph: StepGraph, spec: DeviceSpec) -> BackwardRatios:
    fwd: dict[str, float] = defaultdict(float)
    bwd: dict[str, float] = defaultdict(float)
    fwd_ops: dict[str, int] = defaultdict(int)
    bwd_ops: dict[str, int] = defaultdict(int)
    for n in graph.nodes:
        if n.phase is Phase.FORWARD:
            fwd_ops[n.module] += 1
        elif n.phase is Phase.BACKWARD:
            bwd_ops[n.module] += 1
        if not n.launches_kernel:
            continue
        t = node_kernel_time(graph, n, spec)
        if n.phase is Phase.FORWARD:
            fwd[n.module] += t
        elif n.phase is Phase.BACKWARD:
            bwd[n.module] += t
    return BackwardRatios(
        device={m: bwd.get(m, 0.0) / t for m, t in fwd.items() if t > 0},
        ops={m: bwd_ops.get(m, 0) / k for m, k in fwd_ops.items() if k},
    )


GROUPED_MM = "aten._grouped_mm.default"


def is_expert_parallel(graph: StepGraph, node: OpNode, strat: Strategy, axis: int) -> bool:
    """Whether ``strat`` runs a forward grouped GEMM (rows x stacked expert weights) expert-parallel: the
    weights split on the expert dim and the rows (sorted by expert) with them
    (``strategies.custom_rules.grouped_mm_expert_parallel_rule``), so a rank's rows are the ones routed to its
    experts."""
    if node.op != GROUPED_MM or len(node.inputs) < 2 or len(strat.input_placements) < 2:
        return False
    if len(graph.values[node.inputs[0]].shape) != 2 or len(graph.values[node.inputs[1]].shape) != 3:
        return False
    weight = strat.input_placements[1]
    out = strat.output_placements[0] if strat.output_placements else None
    return weight is not None and weight[axis] == "S0" and out is not None and out[axis] in ("S0", "P")


def _work_strategy(graph: StepGraph, node: OpNode, strat: Strategy, axis: int) -> Strategy:
    """The placements an op's local work is priced by. An op of the runtime's expert-parallel region
    (``"expert-region"``) computes on every row, replicated, however its values are placed (partial: zero
    outside the rank's experts), except a grouped GEMM: it runs the rows routed to the rank's ``E/n`` experts
    only (the kernel skips the sentinel rows past its offsets), ``S/n`` under uniform load, as rows and
    weights split on dim 0 would."""
    if strat.source != EXPERT_REGION:
        return strat
    if node.op == "aten._grouped_mm.default" and len(strat.input_placements) >= 2:
        split = tuple("S0" if d == axis else "R" for d in range(len(strat.output_placements[0])))
        ins = tuple(split if k < 2 else p for k, p in enumerate(strat.input_placements))
        return Strategy(ins, (split,), "custom")
    return _replicated(node)


def _local_device_time(
    graph: StepGraph,
    node: OpNode,
    strat: Strategy,
    axis: int,
    size: int,
    spec: DeviceSpec,
    row_skew: float = 1.0,
) -> float:
    """Device seconds of one forward op under ``strat`` on local shapes (no host overhead).

    ``row_skew`` (an expert-parallel grouped GEMM under a measured routing load, :func:`is_expert_parallel`):
    the busiest rank's rows over the mean rank's; its FLOPs and the bytes of its rows (input and output) scale
    with it, the expert weights (``E/n`` whole experts per rank) do not."""
    if not node.launches_kernel:
        return 0.0
    strat = _work_strategy(graph, node, strat, axis)
    ins = tuple(p[axis] if p is not None else None for p in strat.input_placements)
    outs = tuple(p[axis] for p in strat.output_placements)
    split = splits_work(ins, outs)
    flops = node.flops / size if split else node.flops
    if row_skew != 1.0:
        flops *= row_skew
    nbytes = 0.0
    seen = set()
    for pos, (vid, p) in enumerate(zip(node.inputs, ins, strict=False)):
        if vid in seen:
            continue
        seen.add(vid)
        nbytes += graph.values[vid].nbytes / shard_factor(p, size) * (row_skew if pos == 0 else 1.0)
    for pos, (vid, p) in enumerate(zip(node.outputs, outs, strict=False)):
        nbytes += graph.values[vid].nbytes / shard_factor(p, size) * (row_skew if pos == 0 else 1.0)
    return kernel_time(
        flops,
        nbytes,
        node_dtype(graph, node),
        spec,
        attention=is_attention_kernel(node.op),
        matmul=op_class(node.op) == MATMUL,
        transcendental_elements=transcendental_elements(graph, node) / (size if split else 1),
        op=node.op,
    )


def _local_node_time(
    graph: StepGraph,
    node: OpNode,
    strat: Strategy,
    axis: int,
    size: int,
    spec: DeviceSpec,
    row_skew: float = 1.0,
    dtensor: bool = True,
) -> float:
    """Seconds of one forward op under ``strat``, host included (what recomputing it costs; ``dtensor``: see
    :func:`_with_host`)."""
    device = _local_device_time(graph, node, strat, axis, size, spec, row_skew)
    return _with_host(device, node, 1.0, spec, dtensor)


def _with_host(device: float, node: OpNode, ops: float, spec: DeviceSpec, dtensor: bool = True) -> float:
    """Device seconds joined with the host's for ``ops`` ops run on DTensors (every op of a planned model is, but
    those of a module run on local shards, ``dtensor=False``: :mod:`..local_tensor_parallel`)."""
    return join_host(device, host_time(spec, dtensor=dtensor) * ops, spec, view=not node.launches_kernel)


def host_runs_ahead(spec: DeviceSpec) -> bool:
    """Whether the host enqueues work ahead of the device (a GPU: kernel launches and NCCL collectives are
    asynchronous, so the host's per-op cost runs while earlier kernels execute) rather than running it itself
    (a CPU: the host *is* the device, one op after the other)."""
    return spec.kind != "cpu"


def _node_step_time(
    graph: StepGraph,
    node: OpNode,
    strat: Strategy,
    axis: int,
    size: int,
    spec: DeviceSpec,
    ratios: BackwardRatios,
    row_skew: float = 1.0,
    dtensor: bool = True,
) -> float:
    """Seconds one forward op and its share of backward add to a step under ``strat`` (``row_skew``: see
    :func:`_local_device_time`; the backward of an expert-parallel grouped GEMM waits on the same rank;
    ``dtensor``: False for an op of a module run on local shards, priced as an eager op).

    On a CPU the op's host cost is added here. Where the host runs ahead of the device
    (:func:`host_runs_ahead`) this is the device's seconds alone: the host's are priced per block as a stream
    (:func:`_node_host_time`, :func:`host_stream_overlaps`), since host time one op does not use (a large
    GEMM's) is time the host runs ahead into the next ops, not time lost."""
    device_ratio, ops_ratio = ratios.of(node.module)
    device = _local_device_time(graph, node, strat, axis, size, spec, row_skew) * (1.0 + device_ratio)
    if host_runs_ahead(spec):
        return device
    return _with_host(device, node, 1.0 + ops_ratio, spec, dtensor)


def _node_host_time(node: OpNode, spec: DeviceSpec, ratios: BackwardRatios, dtensor: bool = True) -> float:
    """Host seconds one forward op and its backward ops cost a step, whatever their strategy: every op of a
    planned model runs on DTensors (``spec`` without DTensor cost for a plan on ordinary tensors), a view too —
    it launches nothing, but its dispatch, autograd record and DTensor propagation run on the host like any
    op's (the calibrated per-op figure is a step's host seconds over all its ops, views included). ``dtensor``:
    False for an op of a module the runtime runs on local shards (:mod:`..local_tensor_parallel`), forward and
    backward eager ops."""
    return host_time(spec, dtensor=dtensor) * (1.0 + ratios.of(node.module)[1])


HOST_STREAM = "host-stream"
"""Name prefix of the :class:`Overlap` s that price the host's per-op cost as a stream ahead of the device."""


def host_stream_overlaps(
    nodes: list[DecisionNode],
    edges: dict[tuple[str, str], list[list[float]]],
    host_terms: dict[str, float],
    segment_of: dict[str, str],
    edge_host: dict[tuple[str, str], list[list[float]]] | None = None,
) -> list[Overlap]:
    """The host's per-op seconds as a stream ahead of the device, one segment per block: the segment costs
    ``max(host, device)``, as ``device + max(host - device, 0)`` — the device's seconds are the op nodes' own
    costs and the tensor-parallel reshardings into them (``edges`` whose reader is one of the segment's ops:
    the device waits for a collective as for a kernel, and the host enqueues both; recompute's reruns are not
    among them), the host's the constant
    :func:`_node_host_time` of each op and, ``edge_host``, the DTensor op each redistribution of an edge costs
    the host (the edge's own cost is then its device seconds alone), and an :class:`Overlap` of efficiency 1
    prices the excess (``C - min(C, K)``).

    Why a stream and not each op apart: CUDA launches are asynchronous, so while a large GEMM runs the host
    enqueues the ops after it, and a run of small ops whose host cost exceeds their kernels' is paid only
    beyond the lead the host gained (up to the launch queue's depth, about a thousand kernels). Pricing each op
    at ``max(host, device)`` charges every small op's host excess in full, however far ahead the host is (a
    Llama-3-70B block at tp 8 and one 4096-token sequence: 1.5 s of a 13.4 s step), and leaves a view's host
    cost out altogether. Why per block: the blocks repeat, so the step's stream is the blocks' in turn, and
    ``max`` per block equals ``max`` over the step for identical blocks while keeping a block's host excess
    from hiding behind another block's device time across the whole step (the forward and the backward of one
    block run far apart). What the stream does not cover: the host side of a tensor-parallel collective
    (priced with its alpha-beta time, :meth:`~..candidates._Planner.axis_comm`) and of recompute's reruns
    (priced per op, :func:`_local_node_time`)."""
    by_segment: dict[str, list[DecisionNode]] = defaultdict(list)
    for node in nodes:
        if node.name in host_terms:
            by_segment[segment_of.get(node.name, "")].append(node)
    edges_of: dict[str, dict[tuple[str, str], list[list[float]]]] = defaultdict(dict)
    host_of: dict[str, dict[tuple[str, str], list[list[float]]]] = defaultdict(dict)
    for (src, dst), matrix in sorted(edges.items()):
        if dst in host_terms and any(any(row) for row in matrix):
            edges_of[segment_of.get(dst, "")][(src, dst)] = matrix
    for (src, dst), matrix in sorted((edge_host or {}).items()):
        if dst in host_terms and any(any(row) for row in matrix):
            host_of[segment_of.get(dst, "")][(src, dst)] = matrix
    return [
        Overlap(
            f"{HOST_STREAM}:{segment}",
            {n.name: [host_terms[n.name]] * len(n.costs) for n in members},
            {n.name: list(n.costs) for n in members if any(n.costs)},
            1.0,
            edges_of.get(segment, {}),
            host_of.get(segment, {}),
        )
        for segment, members in sorted(by_segment.items())
    ]


def overlap_parts(problem: Problem, overlap: Overlap, choice: dict[str, int]) -> list[tuple[str, float]]:
    """An overlap's communication under ``choice``, part by part: ``(node, seconds)`` for each node's, and for
    each edge's under the node it feeds (where a report spreads what the overlap exposes)."""
    parts = [(k, problem.node(k).multiplicity * v[choice[k]]) for k, v in overlap.comm.items()]
    parts += [
        (dst, problem.edge(src, dst).multiplicity * m[choice[src]][choice[dst]])
        for (src, dst), m in overlap.comm_edges.items()
    ]
    return parts


def _optimizer_time(graph: StepGraph, spec: DeviceSpec) -> float:
    """Roofline seconds of the whole optimizer step on one device, unsharded (folded blocks included: the
    profiler's node times count each foreach kernel's bytes for every twin parameter)."""
    times = node_times(graph, spec, dtensor=True)
    return sum(times[n.index] for n in graph.nodes if n.phase is Phase.OPTIMIZER)


def _expert_skews(
    graph: StepGraph, tied: TiedGraph, routing: RoutingLoad | None, tp: int
) -> dict[int, tuple[tuple[float, int], ...]]:
    """Canonical forward grouped GEMM -> (skew, real layers) pairs: how many times the mean rank's rows the
    busiest of ``tp`` expert-parallel ranks computes in each MoE layer the node stands for
    (:meth:`RoutingLoad.skew`). Empty without a routing load, on one rank, or when every layer is uniform."""
    if routing is None or tp <= 1:
        return {}
    rows = routing.rows_per_expert
    counted: dict[int, dict[float, int]] = defaultdict(lambda: defaultdict(int))
    for i, c in tied.canonical.items():
        if graph.nodes[i].op != GROUPED_MM:
            continue
        for module in _real_modules_of(graph, tied, i):
            layer = module
            while layer and layer not in rows:  # the experts module the grouped GEMM runs in
                layer = layer.rsplit(".", 1)[0] if "." in layer else ""
            counted[c][routing.skew(layer, tp) if layer else 1.0] += 1
    return {c: tuple(sorted(by.items())) for c, by in counted.items() if any(skew != 1.0 for skew in by)}


def _replicated(node: OpNode) -> Strategy:
    return Strategy(
        tuple(("R",) for _ in node.inputs), tuple(("R",) for _ in node.outputs), "replicate-fallback"
    )
