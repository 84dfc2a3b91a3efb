"""Turn a captured step + per-node strategies into the ILP of :mod:`hf_colossal_auto.solve.problem`.

One ILP per (mesh, data-parallel mode). The tensor-parallel axis is decided per node; the data-parallel axis
splits the batch of every activation (the graph is traced at the per-replica batch) and is priced per
parameter (DDP all-reduce, or FSDP all-gather + reduce-scatter).

:func:`build_problem` is the entry point; :class:`_ProblemBuilder` prices one part of the ILP per method
(``_add_op_nodes``, ``_add_param_nodes``, ``_add_edges``, ``_add_recompute_decisions``,
``_memory_constraints``) and ``build`` assembles them. Decision variables:

* one node per forward op, with the strategies DTensor's rules allow (:mod:`hf_colossal_auto.strategies`);
  cost = roofline time of forward + backward on local shapes (host overhead included), plus the collectives
  the strategy needs outside the edges (returned outputs gathered, a partial loss weight reduced);
* one node per parameter (``p:<fqn>``) whose strategies are its storage placements (replicated, or sharded
  along a dim the axis divides); cost = the optimizer update on the local shard; its gradient
  synchronisation over the data-parallel axis is priced as communication behind the step's compute
  (an :class:`~hf_colossal_auto.solve.problem.Overlap`); memory = parameter + gradient + optimizer state on
  the device (and, under FSDP, what a gathered block adds);
* edges producer -> consumer with the forward resharding of the value and the backward resharding of its
  gradient (:mod:`hf_colossal_auto.solve.cost_model`); a module input shared by sibling projections is
  redistributed once for all of them (a :class:`~hf_colossal_auto.solve.problem.SharedCost`);
* with recompute layers, one node per recompute unit (``rc:<unit>``) whose strategies are its recompute
  options (:mod:`hf_colossal_auto.solve.recompute`): edges to the unit's ops price rerunning them, and
  conditional costs the forward reshardings a rerun repeats.

Identical blocks are tied: every traced copy of a folded run maps onto the representative's nodes, so the
ILP has one set of variables per distinct block and its size grows with distinct blocks, not depth. Each
traced copy's edges and costs are weighted by how many real blocks it stands for (first: 1, second: 1,
representative: N - 3, last: 1).

Memory (per device) is constrained at moments of the liveness timeline, as in Alpa's per-time-step
constraint rather than a sum over all nodes: the activation peak (saved activations of every block, sharded
by the producing node's output placement and kept per the recompute choice, plus parameters, optimizer
state, the gradients alive then and the transient of that moment); the optimizer step (parameters,
gradients, optimizer state and the optimizer's temporaries, all by parameter placement); and, per recompute
unit, the highest point of its backward and its rerun as its backward starts.
"""

from __future__ import annotations

import functools
import logging
import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from ..capture.graph import OpNode, Phase, StepGraph, ValueKind
from ..capture.moe import RoutingLoad
from ..capture.op_classes import MATMUL, op_class
from ..hardware.catalog import DeviceSpec
from ..hardware.roofline import host_time, join_host, kernel_time
from ..profile.memory import UnrolledStep, saved_bytes_per_node, unroll
from ..profile.profiler import (
    is_attention_kernel,
    node_dtype,
    node_kernel_time,
    node_times,
    transcendental_elements,
)
from ..strategies.moe import EXPERT_REGION, expert_regions
from ..strategies.placements import Strategy, is_partial, is_shard
from .cost_model import (
    SHARDED_DP_MODES,
    AxisComm,
    HybridComm,
    data_parallel_shard_size,
    gradient_at_consumer,
    gradient_at_producer,
    hybrid_comm,
    redistribute,
    shard_factor,
    splits_work,
)
from .problem import (
    ConditionalCost,
    DecisionEdge,
    DecisionNode,
    FollowsInputs,
    MemoryConstraint,
    Overlap,
    Problem,
    SharedCost,
)
from .recompute import RecomputeOption, RecomputeUnit, find_units, parse_option, unit_options

logger = logging.getLogger(__name__)

DEFAULT_BACKWARD_RATIO = 2.0
"""Backward/forward time of a module we saw no forward time for (a matmul's backward is two matmuls)."""


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
        for run in self.graph.block_runs:
            for block in run.all_blocks:
                if name.startswith(block + "."):
                    return run.representative + name[len(block) :]
        return name


@dataclass
class BuiltProblem:
    """The ILP and what is needed to read its solution back into a plan."""

    problem: Problem
    strategies: dict[str, list[Strategy]]
    """ILP node name -> strategies of a graph node (empty for parameter nodes)."""
    param_options: dict[str, list[str]]
    """ILP node name of a parameter -> its storage placements on the tensor-parallel axis."""
    param_of_node: dict[str, str]
    """ILP node name -> canonical parameter FQN."""
    node_of_name: dict[str, int]
    """ILP node name -> canonical graph node index."""
    block_of: dict[str, str] = field(default_factory=dict)
    """ILP node name -> module FQN it belongs to (for per-block costs)."""
    recompute_units: dict[str, RecomputeUnit] = field(default_factory=dict)
    """ILP node name of a recompute decision (``rc:<unit>``) -> the blocks it decides for."""
    recompute_options: dict[str, list[RecomputeOption]] = field(default_factory=dict)
    """ILP node name of a recompute decision -> its options, in the node's strategy order."""
    hold_nodes: frozenset[str] = frozenset()
    """ILP nodes whose choice follows the recompute decisions (a storage a checkpoint holds or not)."""
    micro_batches: int = 1
    """Micro-batches per step the problem was priced for (its graph is traced at one micro-batch)."""
    dp_shard_size: int = 1
    """Ranks a parameter's data-parallel copy is split over (1: DDP, dp: FSDP, the shard group: HSDP)."""
    host_floor_s: float = 0.0
    """Host seconds of one micro-batch's ops (forward and backward) whatever their strategies: k micro-batches
    cost at least k times it, which bounds micro-batching from below without tracing it."""
    backward_ratios: BackwardRatios = field(default_factory=lambda: BackwardRatios({}, {}))
    """Per module, backward over forward (device time, op count): how a node's cost splits into its forward
    and its backward (where in the step the ranks synchronise, :mod:`.prediction`)."""
    expert_data_parallel: dict[str, ExpertExchange] = field(default_factory=dict)
    """Experts modules (canonical FQN) run expert-parallel over the data-parallel axis, with the collectives
    each runs per micro-batch (:func:`expert_exchanges`); empty unless the problem was built with
    ``expert_dp``."""
    expert_dp_params: frozenset[str] = frozenset()
    """Canonical FQNs of the per-expert weights stored ``E/dp`` experts per data-parallel rank then."""


EXPERT_DP_NODE = "expert-dp"
"""ILP node (one option) holding the collectives of expert parallelism over the data-parallel axis."""


@dataclass
class ExpertExchange:
    """The all-to-all exchange of one experts module run expert-parallel over the data-parallel axis
    (``apply/moe.py::expert_data_parallel_forward``): ``collectives`` are ``(kind, bytes one rank hands it,
    bytes the alpha-beta model prices)`` in step order — forward: the per-expert counts, the (token, expert)
    pairs' rows out (dispatch) and their results back (combine); backward: the combine's and the dispatch's
    gradients, where a gradient flows. The bytes one rank hands in are the mean rank's (``T·k`` rows each
    way: exact summed over the ranks, whatever the routing); the priced ones the busiest rank's (``skew``
    times them). ``sender_kernels``: the bytes each of the sender's own kernels moves (sorting the pairs'
    rows out, putting the results back in token order, weighting and summing them; forward and backward),
    which the traced experts forward has no counterpart of. ``layers``: real MoE layers it stands for."""

    num_experts: int
    layers: int
    collectives: list[tuple[str, float, float]]
    skew: float = 1.0
    sender_kernels: tuple[float, ...] = ()
    dtype: str = "float32"


def expert_exchanges(
    graph: StepGraph, tied: TiedGraph, dp: int, routing: RoutingLoad | None = None
) -> dict[str, ExpertExchange]:
    """Canonical experts module -> its :class:`ExpertExchange` on ``dp`` data-parallel ranks. The region's
    inputs are read off the graph: the tokens (floating point, the shape of the module's output), the routing
    weights (the other floating-point input) and the routing indices (integers, ``T·k`` of them), each ``T``
    rows of one replica's tokens. ``routing``: a measured load, whose busiest rank (mean over the layers the
    module stands for) prices the row exchanges; None: uniform."""
    out: dict[str, ExpertExchange] = {}
    grads = differentiable_values(graph)
    skews = _expert_skews(graph, tied, routing, dp)
    for module, (num_experts, first) in expert_regions(graph).items():
        if tied.canonical.get(first, first) != first:
            continue
        nodes = [
            n
            for n in graph.nodes
            if n.phase is Phase.FORWARD and (n.module == module or n.module.startswith(module + "."))
        ]
        inside = {v for n in nodes for v in n.outputs}
        inputs: list[int] = []
        for n in nodes:
            for v in n.inputs:
                if v not in inside and graph.values[v].kind is not ValueKind.PARAM and v not in inputs:
                    inputs.append(v)
        used_after = {v for n in graph.nodes if n.phase is Phase.FORWARD and n not in nodes for v in n.inputs}
        outputs = [v for v in inside if v in used_after]
        if len(outputs) != 1 or len(inputs) != 3:
            raise ValueError(
                f"expert parallelism over the data-parallel axis: {module} takes {len(inputs)} tensors and gives "
                f"{len(outputs)} (expected tokens, routing weights and indices in, tokens out)"
            )
        out_value = graph.values[outputs[0]]
        floats = [v for v in inputs if graph.values[v].dtype.startswith(("float", "bfloat", "half"))]
        hidden = next((v for v in floats if graph.values[v].shape == out_value.shape), None)
        weights = next((v for v in floats if v != hidden), None)
        index = next((v for v in inputs if v not in floats), None)
        if hidden is None or weights is None or index is None or not graph.values[hidden].shape:
            raise ValueError(f"expert parallelism over the data-parallel axis: cannot read {module}'s inputs")
        tokens = graph.values[hidden].shape[0]
        pairs = math.prod(graph.values[index].shape)
        rows = float(graph.values[hidden].nbytes) / tokens * pairs  # the (token, expert) pairs' rows
        o = float(out_value.nbytes)
        by_skew = skews.get(first, ())  # the module's grouped GEMM: (skew, real layers) pairs
        skew = sum(k * n for k, n in by_skew) / sum(n for _, n in by_skew) if by_skew else 1.0
        counts = 8.0 * num_experts  # int64 per-expert counts
        collectives = [
            ("all_to_all", counts, counts),
            ("all_to_all", rows, skew * rows),
            ("all_to_all", rows, skew * rows),
        ]
        # backward, where a gradient flows: the combine's always with the output's, the dispatch's with the
        # tokens' (the routing weights stay on their rank)
        if outputs[0] in grads:
            collectives.append(("all_to_all", rows, skew * rows))
        if hidden in grads:
            collectives.append(("all_to_all", rows, skew * rows))
        # the sender's kernels: forward the gather of the pairs' rows, their results put back in token order,
        # weighted, summed over k; backward the sum's expansion, the weighting's two products, the reorder's
        # and the gather's scatters
        sender = (2 * rows, 2 * rows, 2 * rows, rows + o)
        if outputs[0] in grads:
            sender += (rows + o, 2 * rows, 2 * rows, 2 * rows, 2 * rows + o)
        out[module] = ExpertExchange(
            num_experts,
            tied.multiplicity.get(first, 1),
            collectives,
            skew,
            sender,
            graph.values[hidden].dtype,
        )
    return out


def _node_name(i: int) -> str:
    return f"n{i}"


def _param_node_name(fqn: str) -> str:
    return f"p:{fqn}"


def _recompute_node_name(unit: str) -> str:
    return f"rc:{unit}"


def forward_producers(graph: StepGraph) -> dict[int, tuple[int, int]]:
    """Value id -> (forward node, output position) that made it."""
    return {
        vid: (n.index, pos)
        for n in graph.nodes
        if n.phase is Phase.FORWARD
        for pos, vid in enumerate(n.outputs)
    }


PROJECTION_TYPES = ("Linear", "Conv1D")
"""Module classes whose input the runtime redistributes in a pre-hook and shares between them
(:func:`hf_colossal_auto.apply.enforce.enforce_projection_inputs`)."""


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
            made_in = graph.nodes[value.producer].module
            if made_in == module or made_in.startswith(module + "."):
                continue  # made inside the projection: not its module input
            uses[(vid, module.rpartition(".")[0])].append((i, k))
    shared: dict[tuple[int, int], str] = {}
    for (_, parent), found in uses.items():
        if len({graph.nodes[i].module for i, _ in found}) > 1:
            shared.update(dict.fromkeys(found, parent))
    return shared


def view_root(graph: StepGraph, tied: TiedGraph, producer: dict[int, tuple[int, int]], vid: int) -> int:
    """The activation a chain of views starts from: a partial gradient passes back through views (a linear's
    flattening of its input) and is reduced once there, summed with the value's other uses."""
    while vid in producer and producer[vid][0] in tied.canonical:
        node = graph.nodes[producer[vid][0]]
        ins = [v for v in node.inputs if graph.values[v].kind is not ValueKind.PARAM]
        if not node.is_view or len(ins) != 1 or ins[0] not in producer:
            break
        if producer[ins[0]][0] not in tied.canonical:
            break
        vid = ins[0]
    return vid


def viewed_param(
    graph: StepGraph, tied: TiedGraph, producer: dict[int, tuple[int, int]], root: int
) -> int | None:
    """The parameter a view chain's root is a view of (a linear weight's transpose), else None.

    :func:`view_root` stops at such a view, but its partial gradient is not reduced there: the runtime gathers
    a weight stored sharded for its use (``apply/enforce.py``), the view passes the partial gradient back, and
    the gather's backward reduces it straight to the weight's stored placement (a reduce-scatter to a shard,
    an all-reduce to a replica)."""
    src = producer.get(root)
    if src is None or src[0] not in tied.canonical:
        return None
    node = graph.nodes[src[0]]
    if not node.is_view:
        return None
    params = [v for v in node.inputs if graph.values[v].kind is ValueKind.PARAM and graph.values[v].name]
    return params[0] if len(params) == len(node.inputs) == 1 else None


def unenforced_split_rules(
    graph: StepGraph,
    tied: TiedGraph,
    strategies: dict[str, list[Strategy]],
    node_of_name: dict[str, int],
    axis: int,
) -> list[FollowsInputs]:
    """Ops of the model's own top-level code (its loss) run as DTensor decides: the runtime enforces the plan
    at module outputs and projection inputs only, and DTensor never splits an op whose inputs are all
    replicated. One :class:`FollowsInputs` rule per such op: its splitting strategies need a non-replicated
    input. (:func:`dtensor_choice_rules` says the same and more wherever DTensor's propagator answers; this
    rule still holds where it does not.)"""
    producer = forward_producers(graph)
    rules = []
    for name, strats in sorted(strategies.items()):
        node = graph.nodes[node_of_name[name]]
        if node.module:
            continue  # inside a module: :func:`dtensor_choice_rules`
        if not strats:
            continue
        acts = [k for k, vid in enumerate(node.inputs) if graph.values[vid].kind is not ValueKind.PARAM]
        if len(acts) != len(node.inputs) or not acts:
            continue  # reads a parameter (its use placement is enforced) or nothing
        sharding = tuple(
            j
            for j, st in enumerate(strats)
            if any(
                k < len(st.input_placements)
                and st.input_placements[k] is not None
                and st.input_placements[k][axis] != "R"
                for k in acts
            )
        )
        if not sharding:
            continue
        inputs: list[tuple[str | None, tuple[int, ...]]] = []
        for k in acts:
            made = producer.get(node.inputs[k])
            if made is None or made[0] not in tied.canonical:
                inputs.append((None, ()))  # a model input or buffer: replicated at run time
                continue
            src = _node_name(tied.canonical[made[0]])
            src_strats = strategies.get(src, [])
            inputs.append(
                (
                    src,
                    tuple(i for i, st in enumerate(src_strats) if st.output_placements[made[1]][axis] == "R"),
                )
            )
        rules.append(FollowsInputs(name, sharding, tuple(inputs)))
    return rules


def _enforced_input(graph: StepGraph, node: OpNode, vid: int) -> bool:
    """True when the runtime redistributes this input above autograd before the op sees it: the module input of
    a projection (``enforce_projection_inputs``) or of an ``nn.LayerNorm``."""
    if graph.module_types.get(node.module) not in (*PROJECTION_TYPES, "LayerNorm"):
        return False
    made = graph.values[vid].producer
    made_in = graph.nodes[made].module if made is not None else ""
    return not (made_in == node.module or made_in.startswith(node.module + "."))


_MAX_ARRIVALS = 32
"""Combinations of arriving placements asked of DTensor per op at most. Of an op with more (an attention kernel
reading q, k and v from three producers) only the combinations where its inputs arrive alike (all replicated,
all split on one dim) are asked, each a question that costs DTensor milliseconds; mixed ones are left to the
solver."""


@dataclass(frozen=True)
class _Arrival:
    """One dimension of the placements an op's inputs can arrive in: the node whose choice decides it, and per
    distinct outcome the placements it gives the op's inputs (input position -> spec) and the choices that
    give it."""

    src: str
    outcomes: tuple[tuple[tuple[tuple[int, tuple[str, ...]], ...], tuple[int, ...]], ...]


def _projection_weight_reader(graph: StepGraph, tied: TiedGraph, node: OpNode) -> tuple[int, int] | None:
    """(canonical node, input position) of the op reading the ``weight`` of ``node``'s projection module:
    its use placement decides whether the runtime redistributes the module input (a sharded use) or leaves it
    to DTensor (a replicated one)."""
    for i in sorted(tied.canonical):
        other = graph.nodes[i]
        if other.module != node.module or tied.canonical[i] != i:
            continue
        for k, vid in enumerate(other.inputs):
            value = graph.values[vid]
            if value.kind is ValueKind.PARAM and value.name is not None and value.name.endswith(".weight"):
                return i, k
    return None


def _enforced_to(graph: StepGraph, node: OpNode, k: int, arriving: str, weight_use: str | None) -> str:
    """Where the runtime's pre-hooks put input ``k`` of ``node`` (arriving in ``arriving``) before the op sees
    it: a projection's module input to what its sharded weight use needs (replicated for a column-parallel
    weight, sharded on its last dim for a row-parallel one), an ``nn.LayerNorm`` input sharded on a normalised
    dim gathered; anything else as it arrives."""
    kind = graph.module_types.get(node.module)
    ndim = len(graph.values[node.inputs[k]].shape)
    if kind in PROJECTION_TYPES:
        if weight_use is None or not is_shard(weight_use):
            return arriving
        rows_are_outputs = kind == "Linear"
        out_dim = 0 if rows_are_outputs else 1
        return "R" if int(weight_use[1:]) == out_dim else f"S{ndim - 1}"
    if kind == "LayerNorm" and is_shard(arriving):
        args = node.args[0] if node.args is not None else ()
        normalized = args[1] if len(args) > 1 and isinstance(args[1], (list, tuple)) else ()
        if normalized and int(arriving[1:]) >= ndim - len(normalized):
            return "R"
    return arriving


def dtensor_choice_rules(
    graph: StepGraph,
    tied: TiedGraph,
    strategies: dict[str, list[Strategy]],
    param_options: dict[str, list[str]],
    axis: int,
    mesh_shape: tuple[int, ...],
) -> list[FollowsInputs]:
    """Every op runs as DTensor's sharding propagation picks, given the placements its inputs arrive in: the
    runtime enforces the plan only at parameter uses, module outputs and the inputs of projections and layer
    norms (the model's top-level code, its loss, not at all). For every combination of arriving placements (each producer's possible
    output placements; parameters at the use the strategy names, as the runtime's hooks make them; module
    inputs where the hooks put them; a parameter the strategy wants partial, which no hook makes, at its
    storage placement), DTensor's own propagator is asked which strategy it runs
    (:func:`~hf_colossal_auto.strategies.dtensor_rules.dtensor_choice`), and one :class:`FollowsInputs` rule
    bars every other strategy under that combination.

    Why: left free, the solver prices strategies DTensor never runs (a replicated LM head split over the batch
    because its input is replicated and slicing is free), and the collectives it predicts part from the run.
    Where DTensor's pick is not among the node's strategies (a partial sum carried through a view), the node
    is left to the solver: the plan redistributes the same value one op earlier or later. Traced copies of a
    folded block whose inputs come from the same producers as the representative's add nothing.
    """
    from ..strategies.dtensor_rules import dtensor_choice
    from ..strategies.enumerate import device_mesh

    if all(size == 1 for size in mesh_shape):
        return []  # one device: every strategy runs alike
    mesh = device_mesh(mesh_shape)
    producer = forward_producers(graph)
    rules: dict[tuple, FollowsInputs] = {}
    seen: set[tuple] = set()
    for i in sorted(tied.canonical):
        node = graph.nodes[i]
        name = _node_name(tied.canonical[i])
        strats = strategies.get(name)
        if not strats or len(strats) < 2 or all(s.source == "plain-tensor" for s in strats):
            continue
        arrivals = _arrivals(graph, tied, strategies, param_options, producer, name, node, axis)
        if arrivals is None or (name, tuple(arrivals)) in seen:
            continue
        seen.add((name, tuple(arrivals)))
        combos = 1
        for arrival in arrivals:
            combos *= len(arrival.outcomes)
        alike_only = combos > _MAX_ARRIVALS
        if alike_only:
            logger.debug("%s: %d combinations of arriving placements, alike ones asked", name, combos)
        for rule in _choice_rules(
            graph, node, name, strats, arrivals, axis, mesh, dtensor_choice, alike_only
        ):
            rules.setdefault((rule.dst, rule.sharding, rule.inputs), rule)
    return list(rules.values())


def _arrivals(graph, tied, strategies, param_options, producer, name, node, axis) -> list[_Arrival] | None:
    """The dimensions of :func:`dtensor_choice_rules` for one node: per producer node, the distinct placements
    its choices give the node's inputs; per parameter some strategy wants partial, its storage options (other
    parameter uses follow the strategy: the runtime's hooks make them). None when the node reads its own
    output (a tied copy's input made by the copy it stands for)."""
    out: list[_Arrival] = []
    strats = strategies[name]
    for k, vid in enumerate(node.inputs):
        value = graph.values[vid]
        if value.kind is not ValueKind.PARAM or value.name is None:
            continue
        wanted = {st.input_placements[k][axis] for st in strats if st.input_placements[k] is not None}
        pname = _param_node_name(tied.canonical_param(value.name))
        if not any(is_partial(p) for p in wanted) or pname not in param_options:
            continue
        stored: dict[str, list[int]] = defaultdict(list)
        for j, option in enumerate(param_options[pname]):
            stored[option].append(j)
        out.append(
            _Arrival(pname, tuple(((("param", k, option),), tuple(ids)) for option, ids in stored.items()))
        )
    positions: dict[str, list[tuple[int, int]]] = defaultdict(list)
    weight = None
    for k, vid in enumerate(node.inputs):
        if graph.values[vid].kind is ValueKind.PARAM:
            continue
        made = producer.get(vid)
        if made is None or made[0] not in tied.canonical:
            continue  # a model input or buffer: replicated
        src = _node_name(tied.canonical[made[0]])
        if src == name or src not in strategies:
            return None
        positions[src].append((k, made[1]))
        if graph.module_types.get(node.module) in PROJECTION_TYPES and _enforced_input(graph, node, vid):
            weight = _projection_weight_reader(graph, tied, node)
    for src, ks in positions.items():
        outcomes: dict[tuple, list[int]] = defaultdict(list)
        for j, st in enumerate(strategies[src]):
            outcomes[tuple((k, st.output_placements[pos]) for k, pos in ks)].append(j)
        out.append(_Arrival(src, tuple((key, tuple(ids)) for key, ids in outcomes.items())))
    if weight is not None:
        w_name = _node_name(weight[0])
        outcomes = defaultdict(list)
        for j, st in enumerate(strategies[w_name]):
            spec = st.input_placements[weight[1]] if weight[1] < len(st.input_placements) else None
            outcomes[(("weight", spec),)].append(j)
        out.append(_Arrival(w_name, tuple((key, tuple(ids)) for key, ids in outcomes.items())))
    return out


def _choice_rules(graph, node, name, strats, arrivals, axis, mesh, choose, alike_only) -> list[FollowsInputs]:
    """One rule per combination of arrival outcomes (``alike_only``: those where every activation input
    arrives in one placement) and per group of strategies that use the node's parameters alike: every
    strategy of the group DTensor would not run is barred under that combination."""
    import itertools

    from ..strategies.enumerate import _signature

    params = [k for k, vid in enumerate(node.inputs) if graph.values[vid].kind is ValueKind.PARAM]
    groups: dict[tuple, list[int]] = defaultdict(list)
    for j, st in enumerate(strats):
        groups[
            tuple(st.input_placements[k] if k < len(st.input_placements) else None for k in params)
        ].append(j)
    replicated = tuple("R" for _ in strats[0].output_placements[0])
    signature = _signature(node, graph, tuple(mesh.shape), False)
    hooked = {k for k, vid in enumerate(node.inputs) if k not in params and _enforced_input(graph, node, vid)}
    rules: list[FollowsInputs] = []
    for combo in itertools.product(*(a.outcomes for a in arrivals)):
        if alike_only and len({e[1] for placed, _ in combo for e in placed if isinstance(e[0], int)}) > 1:
            continue
        given: dict[int, tuple[str, ...]] = {}
        stored: dict[int, str] = {}
        weight_use: tuple[str, ...] | None = None
        for placed, _ids in combo:
            for entry in placed:
                if entry[0] == "weight":
                    weight_use = entry[1]
                elif entry[0] == "param":
                    stored[entry[1]] = entry[2]
                else:
                    given[entry[0]] = entry[1]
        use = weight_use[axis] if weight_use is not None else None
        for uses, members in groups.items():
            placements = []
            relevant = set()
            for k in range(len(node.inputs)):
                if k in params:
                    spec = uses[params.index(k)] or replicated
                    if is_partial(spec[axis]) and k in stored:  # no hook makes a parameter partial
                        spec = tuple(stored[k] if d == axis else p for d, p in enumerate(spec))
                        relevant.add(("param", k))
                    placements.append(spec)
                    continue
                arriving = given.get(k, replicated)
                if k in hooked:  # a module input the runtime's pre-hooks see first
                    arriving = tuple(
                        _enforced_to(graph, node, k, p, use) if d == axis else p
                        for d, p in enumerate(arriving)
                    )
                placements.append(arriving)
            chosen = choose(node, graph, mesh, placements, strats, signature)
            if chosen is None:
                continue
            if not any(_same_strategy(st, chosen) for st in strats):
                continue  # DTensor's pick is not a strategy of the node: left to the solver
            barred = tuple(
                j
                for j in members
                if not _same_strategy(strats[j], chosen)
                and strats[j].source != EXPERT_REGION  # a local region
            )
            if not barred:
                continue
            conditions = tuple(
                (a.src, ids)
                for a, (placed, ids) in zip(arrivals, combo, strict=True)
                if placed[0][0] != "param" or ("param", placed[0][1]) in relevant
            )
            rules.append(FollowsInputs(name, barred, conditions))
    return rules


def _same_strategy(planned: Strategy, chosen: Strategy) -> bool:
    """Whether DTensor's pick is the planned strategy (an input the plan does not care about matches any)."""
    if planned.output_placements != chosen.output_placements:
        return False
    return all(
        p is None or p == c for p, c in zip(planned.input_placements, chosen.input_placements, strict=True)
    )


def _view_partial_to(view: Strategy, axis: int) -> str | None:
    """Where a partial gradient arriving at a view's output is reduced to: its input's gradient placement."""
    if not view.input_placements or view.input_placements[0] is None:
        return None
    return gradient_at_producer(view.input_placements[0][axis])


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
) -> float:
    """Seconds of one forward op under ``strat``, host included (what recomputing it costs)."""
    return _with_host(_local_device_time(graph, node, strat, axis, size, spec, row_skew), node, 1.0, spec)


def _with_host(device: float, node: OpNode, ops: float, spec: DeviceSpec) -> float:
    """Device seconds joined with the host's for ``ops`` ops run on DTensors (every op of a planned model is)."""
    return join_host(device, host_time(spec, dtensor=True) * ops, spec, view=not node.launches_kernel)


def _node_step_time(
    graph: StepGraph,
    node: OpNode,
    strat: Strategy,
    axis: int,
    size: int,
    spec: DeviceSpec,
    ratios: BackwardRatios,
    row_skew: float = 1.0,
) -> float:
    """Seconds one forward op and its share of backward add to a step under ``strat`` (``row_skew``: see
    :func:`_local_device_time`; the backward of an expert-parallel grouped GEMM waits on the same rank)."""
    device_ratio, ops_ratio = ratios.of(node.module)
    device = _local_device_time(graph, node, strat, axis, size, spec, row_skew) * (1.0 + device_ratio)
    return _with_host(device, node, 1.0 + ops_ratio, spec)


_MEAN_REDUCTION = 1  # torch's Reduction.MEAN


def boundary_reshardings(
    graph: StepGraph, node: OpNode, strat: Strategy, axis: int, comm: AxisComm
) -> list[tuple[float, str, float]]:
    """Collectives an op's strategy costs outside the edges between ops: ``(seconds, kind, bytes)`` each.

    * An output the model returns (its loss, its logits) is handed to the caller as an ordinary tensor, so a
      sharded or partial one is gathered or reduced in forward (the runtime's ``wrap_forward``).
    * ``nll_loss`` with mean reduction: DTensor's backward kernel needs the total weight replicated, so a
      partial total weight (a batch- or class-sharded loss) is all-reduced in backward.
    """
    out: list[tuple[float, str, float]] = []
    returned = set(graph.output_values)
    for pos, vid in enumerate(node.outputs):
        if vid in returned and pos < len(strat.output_placements):
            nbytes = float(graph.values[vid].nbytes)
            seconds, kind = redistribute(strat.output_placements[pos][axis], "R", nbytes, comm)
            if kind:
                out.append((seconds, kind, nbytes))
    if node.op.startswith("aten.nll_loss") and "forward" in node.op and len(strat.output_placements) > 1:
        args = node.args[0] if isinstance(node.args, tuple) and node.args else ()
        reduction = args[3] if len(args) > 3 else _MEAN_REDUCTION
        if reduction == _MEAN_REDUCTION:
            nbytes = float(graph.values[node.outputs[1]].nbytes)
            seconds, kind = redistribute(strat.output_placements[1][axis], "R", nbytes, comm)
            if kind:
                out.append((seconds, kind, nbytes))
    return out


def param_storage_options(shape: tuple[int, ...], tp: int) -> list[str]:
    """Replicated, or sharded along any dim the tensor-parallel axis divides."""
    options = ["R"]
    if tp > 1:
        options += [f"S{d}" for d, size in enumerate(shape) if size % tp == 0 and size >= tp]
    return options


def build_problem(
    graph: StepGraph,
    strategies: dict[int, list[Strategy]],
    *,
    spec: DeviceSpec,
    mesh_shape: tuple[int, int],
    tp_comm: AxisComm,
    dp_comm: AxisComm | HybridComm,
    dp_mode: str,
    budget: float,
    fixed_params: dict[str, str] | None = None,
    pin_unlisted: bool = False,
    recompute_layers: Sequence[str] | None = None,
    recompute_pin: str | Mapping[str, str] | None = None,
    micro_batches: int = 1,
    dtensor_rules: bool = True,
    routing: RoutingLoad | None = None,
    expert_dp: bool = False,
) -> BuiltProblem:
    """The ILP for one mesh ``(dp, tp)`` and data-parallel mode ("ddp", "fsdp", or "hsdp" with ``dp_comm`` a
    :class:`HybridComm`: FSDP inside its shard group, the shards all-reduced over its replicate group).

    ``fixed_params`` pins parameter placements (canonical FQN -> tensor-parallel placement) for baselines and
    user plans; with ``pin_unlisted`` every parameter it does not name is pinned replicated.
    ``recompute_layers`` (the model's ``ModuleList`` children) makes activation recompute a decision per
    block (:mod:`hf_colossal_auto.solve.recompute`); None leaves it out. ``recompute_pin`` fixes it: one
    option name for every unit ("none", "full"), or unit name -> option name.

    ``micro_batches`` (k): ``graph`` is one micro-batch of a step that runs k of them with gradient accumulation
    (:func:`hf_colossal_auto.accumulate`). Everything a micro-batch runs — ops, tensor-parallel reshardings,
    recompute, FSDP's parameter all-gathers — is paid k times; the gradient synchronisation and the optimizer
    step once; memory is one micro-batch's activations on top of the gradients accumulated so far (all of them,
    unsharded under FSDP until the last micro-batch reduce-scatters them).

    ``dtensor_rules=False`` leaves out the rules that make ops follow DTensor's own choices
    (:func:`dtensor_choice_rules`, the costliest part to build): a relaxation, whose optimum is a lower bound on
    the full problem's (the planner prunes candidates with it).

    ``routing``: a measured routing load (:class:`~hf_colossal_auto.capture.moe.RoutingLoad`, checked against
    the model by the caller). An expert-parallel grouped GEMM then costs, in time and in the bytes of its rows,
    what the busiest rank's rows cost (the step waits on the slowest rank); None prices uniform routing
    (``capture.moe.UNIFORM_LOAD``), as does a histogram whose ranks all get the same rows.

    ``expert_dp``: every MoE layer runs expert-parallel over the data-parallel axis (DDP or FSDP,
    tensor-parallel axis of 1, ``dp`` dividing every layer's experts;
    ``apply/moe.py::expert_data_parallel_forward``): the per-expert weights stored ``E/dp`` experts per rank
    (their memory, optimizer state and step divided by dp, no gradient all-reduce; under FSDP left out of its
    units: no all-gather, reduce-scatter or gathered bytes), the ops of each experts module priced on the rows
    the rank receives (``T·k`` under uniform load, the busiest rank's under a measured one; a grouped GEMM
    with ``E/dp`` experts' weights), and the all-to-alls of the exchange and the sender's own kernels
    (:func:`expert_exchanges`) on the data-parallel link, exposed (the region waits for them).

    The parts of the ILP are priced by the methods of :class:`_ProblemBuilder`.
    """
    return _ProblemBuilder(
        graph,
        strategies,
        spec=spec,
        mesh_shape=mesh_shape,
        tp_comm=tp_comm,
        dp_comm=dp_comm,
        dp_mode=dp_mode,
        budget=budget,
        fixed_params=fixed_params,
        pin_unlisted=pin_unlisted,
        recompute_layers=recompute_layers,
        recompute_pin=recompute_pin,
        micro_batches=micro_batches,
        dtensor_rules=dtensor_rules,
        routing=routing,
        expert_dp=expert_dp,
    ).build()


class _ProblemBuilder:
    """Builds the ILP of :func:`build_problem` for one mesh and data-parallel mode, one part per method.

    ``__init__`` holds what every part reads (the graph and its tied copies, the strategies, device and
    communication models, backward ratios, recompute units and the liveness snapshots); :meth:`build` runs the
    parts in order, each adding to the decision nodes, edges and the state the later parts read:

    1. :meth:`_add_op_nodes`: one node per canonical forward op (its compute time);
    2. :meth:`_add_param_nodes`: one node per parameter (optimizer update, data-parallel sync, memory);
    3. :meth:`_add_edges`: producer -> consumer reshardings of every use (forward and gradient);
    4. :meth:`_add_recompute_decisions`: one node per recompute unit and the rerun costs it implies;
    5. :meth:`_memory_constraints`: per-device memory at the activation peak, the optimizer step and each
       unit's recompute and rerun moments.
    """

    def __init__(
        self,
        graph: StepGraph,
        strategies: dict[int, list[Strategy]],
        *,
        spec: DeviceSpec,
        mesh_shape: tuple[int, int],
        tp_comm: AxisComm,
        dp_comm: AxisComm | HybridComm,
        dp_mode: str,
        budget: float,
        fixed_params: dict[str, str] | None,
        pin_unlisted: bool,
        recompute_layers: Sequence[str] | None,
        recompute_pin: str | Mapping[str, str] | None,
        micro_batches: int = 1,
        dtensor_rules: bool = True,
        routing: RoutingLoad | None = None,
        expert_dp: bool = False,
    ) -> None:
        # ------------------------------------------------------------ inputs
        self.graph = graph
        self.strategies = strategies
        """Graph node index -> its strategies (a node without any runs replicated)."""
        self.spec = spec
        self.mesh_shape = mesh_shape
        self.dp, self.tp = mesh_shape
        self.axis = 0  # strategies are enumerated on the 1-D tensor-parallel mesh
        self.tp_comm = tp_comm
        self.dp_comm = dp_comm
        self.dp_mode = dp_mode
        self.dp_shard = data_parallel_shard_size(dp_mode, self.dp, dp_comm) if self.dp > 1 else 1
        """Ranks a parameter's data-parallel copy is split over (1 under DDP)."""
        self.budget = budget
        self.fixed_params = fixed_params
        self.pin_unlisted = pin_unlisted
        self.recompute_pin = recompute_pin
        if micro_batches < 1:
            raise ValueError(f"micro_batches must be >= 1, got {micro_batches}")
        self.micro_batches = micro_batches
        self.dtensor_rules = dtensor_rules
        self.routing = routing

        # ------------------------------------------------------------ derived from the graph
        self.tied = TiedGraph.build(graph)
        self.expert_skews = _expert_skews(graph, self.tied, routing, self.tp)
        """Canonical grouped GEMM -> ((busiest rank's rows / mean rank's, real layers with it), ...) over the MoE
        layers it stands for; empty without a measured routing load."""
        self.expert_dp: dict[str, ExpertExchange] = {}
        """Experts modules run expert-parallel over the data-parallel axis (``expert_dp``)."""
        self.expert_dp_nodes: dict[int, float] = {}
        """Canonical node of such a module -> its rows over the traced ones (the busiest rank's skew; 1 uniform)."""
        self.expert_dp_params: set[str] = set()
        """Canonical per-expert weights stored E/dp experts per data-parallel rank."""
        if expert_dp:
            self._setup_expert_dp()
        self.ratios = _backward_ratios(graph, spec)
        self.producer = forward_producers(graph)
        self.canon_nodes = sorted({self.tied.canonical[i] for i in self.tied.canonical})
        self.readers = value_readers(graph, self.tied)
        self.grads = differentiable_values(graph)
        self.shared_uses = shared_projection_inputs(graph, self.tied)
        self.units = (
            find_units(graph, self.tied.canonical, recompute_layers) if recompute_layers is not None else []
        )
        self.unit_index_of = {c: u for u, unit in enumerate(self.units) for c in unit.nodes}
        """Canonical node -> index of the recompute unit it belongs to."""
        self.checkpoint_args = _checkpoint_args(graph, self.tied, self.units, self.unit_index_of)
        """Storage made outside every unit -> units whose blocks get it as an argument (a recomputed block's
        checkpoint holds it)."""
        self.hold_nodes: dict[tuple[int, tuple[int, ...]], str] = {}
        self.hold_rules: list[FollowsInputs] = []
        self.peak_snapshot, self.unit_snapshots, self.start_snapshots, self.forward_snapshots = (
            self._snapshots()
        )
        self.weighted_saved = _weighted(self.tied, self.peak_snapshot.by_node)
        """Canonical node -> bytes it holds at the activation peak, over every copy it stands for."""
        self.saved_for_backward = _weighted(self.tied, saved_bytes_per_node(graph))
        """Canonical node -> bytes its outputs keep into backward, wherever the peak falls (a T5 decoder block's
        activations are all freed by the time of its step's peak, yet its backward needs them)."""

        # ------------------------------------------------------------ the problem, filled in by the parts
        self.nodes: list[DecisionNode] = []
        self.fixed: dict[str, int] = {}
        self.block_of: dict[str, str] = {}
        self.edge_cost: dict[tuple[str, str], list[list[float]]] = {}
        """(source node, destination node) -> cost matrix, summed over every use between them."""
        self.fwd_into: dict[tuple[str, str], list[list[float]]] = {}
        """(source node, recomputable consumer) -> the forward resharding a recompute of the consumer repeats."""
        # op nodes
        self.strat_of: dict[str, list[Strategy]] = {}
        self.node_of_name: dict[str, int] = {}
        # parameter nodes
        self.param_options: dict[str, list[str]] = {}
        self.param_of_node: dict[str, str] = {}
        self.param_mem_terms: dict[str, list[float]] = {}
        """Parameter node -> bytes of parameter + optimizer state on the device, per storage option."""
        self.grad_terms: dict[str, list[float]] = {}
        """Parameter node -> bytes of its gradient on the device, per storage option."""
        self.accumulated_grad_terms: dict[str, list[float]] = {}
        """Parameter node -> bytes of its gradient accumulated over micro-batches (never sharded over the
        data-parallel axis: FSDP2 keeps unsynchronised gradients unsharded), per storage option."""
        self.opt_temp_terms: dict[str, list[float]] = {}
        """Parameter node -> the optimizer step's temporary bytes for it, per storage option."""
        self.sync_terms: dict[str, list[float]] = {}
        """Parameter node -> seconds of its data-parallel gradient synchronisation per storage option (priced by
        the :class:`Overlap` of :meth:`build`, not in the node's cost)."""
        self.gathered_terms: dict[str, list[float]] = {}
        """FSDP: bytes a parameter adds while gathered (unsharded parameter and gradient) at the activation peak."""
        # shared projection copies
        self.shared_members: dict[tuple[int, str, str, int, str], list[tuple[str, tuple[int, ...]]]] = {}
        self.shared_price: dict[tuple[int, str, str, int, str], list[float]] = {}
        """(value, parent module, target placement, copy weight, producer node) -> members / price per producer
        strategy"""
        # recompute decisions
        self.unit_options_of: list[list[RecomputeOption]] = []
        self.rc_names: list[str] = []
        self.conditional: list[ConditionalCost] = []
        self.host_floor_s = 0.0

    # ---------------------------------------------------------------- the whole problem
    def build(self) -> BuiltProblem:
        """Runs every part and assembles the :class:`Problem`, with the data-parallel synchronisation as an
        :class:`Overlap`, DTensor's own choices as :class:`FollowsInputs` rules and the shared projection copies
        as :class:`SharedCost` terms."""
        self._add_op_nodes()
        self._add_param_nodes()
        self._add_edges()
        self._add_recompute_decisions()
        if self.micro_batches > 1:
            self._repeat_per_micro_batch()
        if self.expert_dp:
            self._add_expert_dp_exchange()
        edges = [DecisionEdge(s, d, m) for (s, d), m in sorted(self.edge_cost.items())]
        constraints = self._memory_constraints()
        problem = Problem(
            nodes=self.nodes,
            edges=edges,
            memory_constraints=constraints,
            overlaps=data_parallel_overlap(
                self.nodes,
                self.sync_terms,
                self.dp_mode,
                self.ratios,
                self.block_of,
                self.spec,
                self.micro_batches,
            ),
            name=f"mesh{self.mesh_shape}-{self.dp_mode}",
            fixed=self.fixed,
            conditional_costs=self.conditional,
            follows_inputs=unenforced_split_rules(
                self.graph, self.tied, self.strat_of, self.node_of_name, self.axis
            )
            + (
                dtensor_choice_rules(
                    self.graph, self.tied, self.strat_of, self.param_options, self.axis, (self.tp,)
                )
                if self.dtensor_rules
                else []
            )
            + self.hold_rules
            + self._expert_parallel_rules(),
            shared_costs=[
                SharedCost(key[4], tuple(members), self.shared_price[key])
                for key, members in sorted(self.shared_members.items())
                if any(self.shared_price[key])
            ],
        )
        return BuiltProblem(
            problem=problem,
            strategies=self.strat_of,
            param_options=self.param_options,
            param_of_node=self.param_of_node,
            node_of_name=self.node_of_name,
            block_of=self.block_of,
            recompute_units={rc: unit for rc, unit in zip(self.rc_names, self.units, strict=True)},
            recompute_options={
                rc: opts for rc, opts in zip(self.rc_names, self.unit_options_of, strict=True)
            },
            hold_nodes=frozenset(self.hold_nodes.values()),
            micro_batches=self.micro_batches,
            dp_shard_size=self.dp_shard,
            host_floor_s=self.host_floor_s,
            backward_ratios=self.ratios,
            expert_data_parallel=self.expert_dp,
            expert_dp_params=frozenset(self.expert_dp_params),
        )

    # ---------------------------------------------------------------- expert parallelism over dp
    def _setup_expert_dp(self) -> None:
        """Checks the scope (DDP or FSDP, tensor-parallel axis of 1, dp dividing every layer's experts) and
        reads the exchanges and the region nodes' factors (the busiest data-parallel rank's rows under a
        measured routing load, over the mean's)."""
        if self.dp < 2 or self.dp_mode not in ("ddp", "fsdp") or self.tp != 1:
            raise ValueError(
                "expert parallelism over the data-parallel axis is planned under DDP or FSDP on a (dp, 1) "
                f"mesh with dp >= 2; got mesh {self.mesh_shape} {self.dp_mode}"
            )
        self.expert_dp = expert_exchanges(self.graph, self.tied, self.dp, self.routing)
        if not self.expert_dp:
            raise ValueError(
                "expert parallelism over the data-parallel axis: the model has no experts module"
            )
        for module, exchange in self.expert_dp.items():
            if exchange.num_experts % self.dp:
                raise ValueError(
                    f"expert parallelism over the data-parallel axis: {module} has {exchange.num_experts} experts, "
                    f"which {self.dp} data-parallel ranks do not divide"
                )
        for i, c in self.tied.canonical.items():
            node = self.graph.nodes[i]
            if i != c:
                continue
            module = next(
                (m for m in self.expert_dp if node.module == m or node.module.startswith(m + ".")), None
            )
            if module is not None:
                self.expert_dp_nodes[c] = self.expert_dp[module].skew

    def _expert_dp_node_time(self, c: int) -> float:
        """Seconds one op of an experts module run expert-parallel over the data-parallel axis adds to a step,
        forward and backward. The rank runs transformers' experts forward on the rows it received, one expert
        each: ``T·k`` of them under uniform routing — as many as the traced forward's ``T`` tokens times ``k``
        experts, so each op costs what it was traced at, times the busiest rank's skew — and a grouped GEMM
        reads its ``E/dp`` experts' weights only."""
        node, factor = self.graph.nodes[c], self.expert_dp_nodes[c]
        device_ratio, ops_ratio = self.ratios.of(node.module)
        if node.op == GROUPED_MM and len(node.inputs) >= 2:
            split = ("S0",)
            ins = tuple(split if k < 2 else ("R",) for k in range(len(node.inputs)))
            strat = Strategy(ins, tuple(split for _ in node.outputs), "custom")
            device = _local_device_time(self.graph, node, strat, 0, self.dp, self.spec, self.dp * factor)
        else:
            device = _local_device_time(self.graph, node, _replicated(node), 0, 1, self.spec) * factor
        return _with_host(device * (1.0 + device_ratio), node, 1.0 + ops_ratio, self.spec)

    def _add_expert_dp_exchange(self) -> None:
        """One node (a single option) for the exchange on the data-parallel link, every micro-batch, every
        layer: its all-to-alls, which the region waits for (not overlapped), and the sender's own kernels."""
        seconds = 0.0
        for exchange in self.expert_dp.values():
            comm = sum(self.dp_comm.time(kind, priced) for kind, _given, priced in exchange.collectives)
            device = sum(kernel_time(0.0, b, exchange.dtype, self.spec) for b in exchange.sender_kernels)
            host = host_time(self.spec) * len(exchange.sender_kernels)
            seconds += exchange.layers * (comm + join_host(device, host, self.spec))
        seconds *= self.micro_batches
        self.nodes.append(DecisionNode(EXPERT_DP_NODE, [seconds], ["all-to-all dispatch and combine"]))
        self.block_of[EXPERT_DP_NODE] = next(iter(self.expert_dp))

    def _expert_parallel_rules(self) -> list[FollowsInputs]:
        """What the runtime can run of expert parallelism, as rules: it runs an experts module expert-parallel
        only as a whole region (``apply/moe.py``: every stacked expert weight stored split on the expert dim over
        a 1-D tensor-parallel mesh and used so), so the ops of one module take their ``"expert-region"``
        strategies (``strategies.moe.add_expert_region_strategies``) all or none (a cycle of implications), the
        ops placed replicated inside the region (the routing indices) stay replicated then, and every
        parameter the region reads split on the expert dim is stored so. With parameters sharded over the
        data-parallel axis too (FSDP/HSDP: 2-D parameters, which the region does not take) none may."""
        members: dict[str, list[tuple[str, tuple[int, ...]]]] = defaultdict(list)
        replicated: dict[str, list[tuple[str, tuple[int, ...]]]] = defaultdict(list)
        params: dict[str, set[str]] = defaultdict(set)
        regions = expert_regions(self.graph)
        for i in sorted(self.tied.canonical):
            node = self.graph.nodes[i]
            if self.tied.canonical[i] != i:
                continue
            module = next((m for m in regions if node.module == m or node.module.startswith(m + ".")), None)
            name = _node_name(i)
            strategies = self.strat_of.get(name)
            if module is None or not strategies:
                continue
            region = tuple(j for j, s in enumerate(strategies) if s.source == EXPERT_REGION)
            if region:
                members[module].append((name, region))
                spec = strategies[region[0]]
                for k, vid in enumerate(node.inputs):
                    placed = spec.input_placements[k] if k < len(spec.input_placements) else None
                    if placed is not None and placed[self.axis] == "S0":
                        pname = self._param_node_of(vid)
                        if pname is not None:
                            params[module].add(pname)
                continue
            split = tuple(
                j
                for j, s in enumerate(strategies)
                if any(
                    p[self.axis] != "R" for p in (*s.input_placements, *s.output_placements) if p is not None
                )
            )
            if split:
                replicated[module].append((name, split))
        rules: list[FollowsInputs] = []
        for module, group in members.items():
            if self.dp_shard > 1:
                rules += [FollowsInputs(name, region, ()) for name, region in group]
                continue
            for (name, region), (after, after_region) in zip(group, group[1:] + group[:1], strict=True):
                if after != name:  # region here -> region in the next one too (a cycle: all or none)
                    others = tuple(j for j in range(len(self.strat_of[after])) if j not in after_region)
                    rules.append(FollowsInputs(name, region, ((after, others),)))
            first, first_region = group[0]
            for name, split in replicated.get(module, []):  # region -> the routing indices replicated
                rules.append(FollowsInputs(first, first_region, ((name, split),)))
            for weight in sorted(params[module]):  # region -> every expert-split parameter stored so
                stored = tuple(j for j, o in enumerate(self.param_options[weight]) if o != "S0")
                rules.append(FollowsInputs(first, first_region, ((weight, stored),)))
        return rules

    def _param_node_of(self, vid: int) -> str | None:
        """The parameter node of a value that is a parameter, or a view of one, if any."""
        root = view_root(self.graph, self.tied, self.producer, vid)
        pvid = viewed_param(self.graph, self.tied, self.producer, root)
        if pvid is None:
            value = self.graph.values[root]
            pvid = root if value.kind is ValueKind.PARAM and value.name else None
        if pvid is None:
            return None
        pname = _param_node_name(self.tied.canonical_param(self.graph.values[pvid].name))
        return pname if pname in self.param_options else None

    def _repeat_per_micro_batch(self) -> None:
        """Every micro-batch runs the ops, their tensor-parallel reshardings and recompute again: their costs
        (priced on one micro-batch's shapes) times k. Parameter nodes (the optimizer step, once per step) and
        the data-parallel synchronisation (``sync_terms``, priced per step) are left as they are."""
        k = float(self.micro_batches)
        for node in self.nodes:
            if node.name in self.strat_of:
                node.costs = [c * k for c in node.costs]
        self.edge_cost = {key: [[c * k for c in row] for row in m] for key, m in self.edge_cost.items()}
        self.shared_price = {key: [c * k for c in v] for key, v in self.shared_price.items()}
        for cond in self.conditional:
            cond.cost = [[c * k for c in row] for row in cond.cost]

    # ---------------------------------------------------------------- op nodes
    def _add_op_nodes(self) -> None:
        """One node per canonical forward op, its strategies the ones DTensor's rules allow (replicated when
        none). Cost per strategy: the op's forward and its share of backward on local shapes, host overhead
        included (:func:`_node_step_time`), plus the collectives the strategy costs outside the edges (a
        returned output gathered, a partial loss weight reduced: :func:`boundary_reshardings`). A copy of a
        folded block counts through the node's multiplicity."""
        graph, axis, tp = self.graph, self.axis, self.tp
        for c in self.canon_nodes:
            node = graph.nodes[c]
            strats = self.strategies.get(c) or [_replicated(node)]
            name = _node_name(c)
            costs = [
                (
                    self._expert_dp_node_time(c)
                    if c in self.expert_dp_nodes
                    else self._skewed(
                        c,
                        s,
                        functools.partial(_node_step_time, graph, node, s, axis, tp, self.spec, self.ratios),
                    )
                )
                + sum(t for t, _, _ in boundary_reshardings(graph, node, s, axis, self.tp_comm))
                for s in strats
            ]
            self.nodes.append(
                DecisionNode(
                    name, costs, [_label(s, axis) for s in strats], multiplicity=self.tied.multiplicity[c]
                )
            )
            self.strat_of[name] = strats
            self.node_of_name[name] = c
            self.block_of[name] = node.module
            if node.launches_kernel or self.spec.kind == "cpu":  # on a GPU a view hides behind the device
                ops = 1.0 + self.ratios.of(node.module)[1]
                self.host_floor_s += self.tied.multiplicity[c] * ops * host_time(self.spec, dtensor=True)

    # ---------------------------------------------------------------- parameter nodes
    def _add_param_nodes(self) -> None:
        """One node per canonical parameter that a forward op reads, its strategies its storage placements on
        the tensor-parallel axis (:func:`param_storage_options`; pinned by ``fixed_params``). Cost per option:
        its share of the optimizer step on the local shard. Alongside, per option, what later parts price: the
        data-parallel synchronisation (``sync_terms``, hidden behind compute by an :class:`Overlap`), the bytes
        of parameter + optimizer state, gradient and optimizer temporaries (sharded by the data-parallel axis
        too under FSDP), and under FSDP the bytes a gathered block adds (``gathered_terms``). A frozen parameter
        (``requires_grad=False``) costs its storage only: no gradient, optimizer state, step or sync."""
        graph, tied, tp, dp = self.graph, self.tied, self.tp, self.dp
        param_uses: dict[str, list[tuple[int, int]]] = defaultdict(list)
        """canonical param FQN -> (forward node, input position) of every use, over all copies."""
        for i in tied.canonical:
            node = graph.nodes[i]
            for k, vid in enumerate(node.inputs):
                v = graph.values[vid]
                if v.kind is ValueKind.PARAM and v.name is not None:
                    param_uses[tied.canonical_param(v.name)].append((i, k))
        # the optimizer step covers the trained parameters only (the profile's optimizer ops are theirs)
        total_param_bytes = float(graph.trainable_param_bytes) or 1.0
        opt_time = _optimizer_time(graph, self.spec)
        real_count: dict[str, int] = defaultdict(int)
        for fqn in graph.param_names:
            real_count[tied.canonical_param(fqn)] += 1
        opt_temp_ratio = _optimizer_temp_ratio(graph)
        fsdp_layers = [u.name for u in self.units] if self.dp_mode in SHARDED_DP_MODES and dp > 1 else []
        for fqn in sorted(param_uses):
            shape = graph.param_shapes.get(fqn)
            if shape is None:
                continue
            name = _param_node_name(fqn)
            options = param_storage_options(shape, tp)
            self._pin_param(fqn, name, shape, options)
            pbytes = float(graph.param_bytes[fqn])
            sbytes = float(graph.optimizer_state_bytes.get(fqn, 0))
            dp_shard = self.dp_shard
            module, _, _ = fqn.rpartition(".")
            exchange = self.expert_dp.get(module)
            over_dp = exchange is not None and len(shape) >= 1 and shape[0] == exchange.num_experts
            if over_dp:  # E/dp experts per data-parallel rank: state divided by dp, no gradient all-reduce
                dp_shard = dp
                self.expert_dp_params.add(fqn)
            trained = 1.0 if graph.is_trainable(fqn) else 0.0
            costs, mterms, gterms, tterms, syncs = [], [], [], [], []
            for opt in options:
                local = pbytes / shard_factor(opt, tp)
                sync = data_parallel_sync_time(self.dp_mode, local, self.dp_comm, self.micro_batches)
                syncs.append(0.0 if over_dp else trained * sync)
                costs.append(
                    trained * opt_time * (pbytes / total_param_bytes) / shard_factor(opt, tp) / dp_shard
                )
                mterms.append((local + sbytes / shard_factor(opt, tp)) / dp_shard)
                gterms.append(trained * local / dp_shard)
                tterms.append(trained * local / dp_shard * opt_temp_ratio)
            self.nodes.append(DecisionNode(name, costs, options, multiplicity=real_count[fqn]))
            self.param_options[name] = options
            if any(syncs):
                self.sync_terms[name] = syncs
            self.param_of_node[name] = fqn
            self.param_mem_terms[name] = mterms
            self.grad_terms[name] = gterms
            self.accumulated_grad_terms[name] = [
                trained * pbytes / shard_factor(o, tp) / (dp if over_dp else 1) for o in options
            ]
            self.opt_temp_terms[name] = tterms
            self.block_of[name] = fqn.rsplit(".", 1)[0]
            if fsdp_layers and not over_dp:  # FSDP leaves the experts over dp out: never gathered
                self.gathered_terms[name] = self._fsdp_gathered_bytes(
                    fqn, pbytes, options, fsdp_layers, real_count[fqn], graph.is_trainable(fqn)
                )

    def _pin_param(self, fqn: str, name: str, shape: tuple[int, ...], options: list[str]) -> None:
        """Fixes a parameter's storage option when ``fixed_params`` names it (or, with ``pin_unlisted``, to
        replicated when it does not)."""
        fixed_params = self.fixed_params
        if fixed_params is not None and (fqn in fixed_params or self.pin_unlisted):
            want = fixed_params.get(fqn, "R")
            if want not in options:
                raise ValueError(
                    f"placement {want!r} for parameter {fqn} (shape {tuple(shape)}) is not possible on a "
                    f"tensor-parallel axis of {self.tp}; possible: {options}"
                )
            self.fixed[name] = options.index(want)

    def _fsdp_gathered_bytes(
        self,
        fqn: str,
        pbytes: float,
        options: list[str],
        fsdp_layers: list[str],
        real_count: int,
        trainable: bool = True,
    ) -> list[float]:
        """Bytes per storage option a parameter adds at the activation peak while FSDP has it gathered.

        FSDP2 (one unit per block, the root for the rest) holds the root's parameters and gradients unsharded
        through backward, and one block's at a time while that block runs: the sharded memory terms count 1/dp
        of them, the rest is this. A frozen parameter has no unsharded gradient: its weight only."""
        dp = self.dp_shard  # FSDP's group: the shard group under HSDP
        in_block = [b for b in fsdp_layers if fqn.startswith(b + ".")]
        share = 1.0 / real_count if in_block else 1.0
        if in_block and in_block[0] != fsdp_layers[0]:
            share = 0.0  # one block gathered at a time: priced on the first block's parameters
        copies = 2 if trainable else 1  # the gathered weight, and its unsharded gradient when it has one
        return [copies * (1 - 1 / dp) * pbytes / shard_factor(o, self.tp) * share for o in options]

    # ---------------------------------------------------------------- edges
    def _add_edges(self) -> None:
        """Every use of a value by a forward op (over all traced copies, weighted by the real blocks each
        stands for) becomes an edge producer -> consumer: the forward resharding of the value and the backward
        resharding of its gradient (:func:`edge_reshardings`). Producers are parameter nodes
        (:meth:`_add_param_use`) or forward ops (:meth:`_add_activation_use`)."""
        graph, tied = self.graph, self.tied
        for v_idx in sorted(tied.canonical):
            v_node = graph.nodes[v_idx]
            for k, vid in enumerate(v_node.inputs):
                value = graph.values[vid]
                if value.kind is ValueKind.PARAM and value.name is not None:
                    self._add_param_use(v_idx, k, vid)
                else:
                    self._add_activation_use(v_idx, k, vid)

    def _add_param_use(self, v_idx: int, k: int, vid: int) -> None:
        """Parameter node -> consumer: the parameter redistributed from its storage placement to the one the
        consumer's strategy reads, and its gradient back to the storage placement. When the consumer can be
        recomputed, the forward part is also noted for the rerun (:meth:`_add_conditional_costs`)."""
        graph, tied, axis, tp_comm = self.graph, self.tied, self.axis, self.tp_comm
        value = graph.values[vid]
        w = tied.weight[v_idx]
        v_c = tied.canonical[v_idx]
        v_strats = self.strat_of[_node_name(v_c)]
        fqn = tied.canonical_param(value.name)
        pname = _param_node_name(fqn)
        if pname not in self.param_options:
            return
        matrix = [
            [
                w
                * _edge_time(
                    o,
                    s,
                    k,
                    value.nbytes,
                    axis,
                    tp_comm,
                    param=True,
                    consumers=self.readers[vid],
                    needs_grad=vid in self.grads,
                )
                for s in v_strats
            ]
            for o in self.param_options[pname]
        ]
        self._add_edge(pname, _node_name(v_c), matrix)
        if v_c in self.unit_index_of:
            forward = [
                [w * _forward_time(o, s, k, value.nbytes, axis, tp_comm) for s in v_strats]
                for o in self.param_options[pname]
            ]
            self._add_forward(pname, _node_name(v_c), forward)

    def _add_activation_use(self, v_idx: int, k: int, vid: int) -> None:
        """Forward op -> consumer: the value redistributed from the producer's output placement to the one the
        consumer reads, and its gradient back (a partial gradient passing back through a view is reduced where
        the viewed value was made, shared among that value's readers). A module input shared by sibling
        projections is redistributed once for all of them: its forward part is priced by
        :meth:`_add_shared_copy` instead. When the consumer can be recomputed, the forward part is also noted
        for the rerun. A value between two copies of one tied node costs nothing."""
        graph, tied, axis, tp_comm = self.graph, self.tied, self.axis, self.tp_comm
        value = graph.values[vid]
        src = self.producer.get(vid)
        if src is None:
            return
        u_idx, pos = src
        if u_idx not in tied.canonical:
            return
        w = tied.weight[v_idx]
        v_c = tied.canonical[v_idx]
        v_strats = self.strat_of[_node_name(v_c)]
        u_c = tied.canonical[u_idx]
        u_strats = self.strat_of[_node_name(u_c)]
        is_shared = (v_idx, k) in self.shared_uses
        root = view_root(graph, tied, self.producer, vid)
        through_view = root != vid and graph.nodes[u_idx].is_view
        of_param = self._storage_partial(v_idx, k, vid, root)

        matrix = [
            [
                w
                * _edge_time(
                    us.output_placements[pos][axis],
                    s,
                    k,
                    value.nbytes,
                    axis,
                    tp_comm,
                    consumers=self.readers[root] if through_view else self.readers[vid],
                    forward=not is_shared,
                    partial_to=_view_partial_to(us, axis) if through_view else None,
                    partial_elsewhere=of_param,
                    needs_grad=vid in self.grads,
                )
                for s in v_strats
            ]
            for us in u_strats
        ]
        if is_shared:
            self._add_shared_copy(v_idx, k, vid, u_c, pos)
        if u_c == v_c:
            return
        self._add_edge(_node_name(u_c), _node_name(v_c), matrix)
        if v_c in self.unit_index_of:
            forward = [
                [
                    w * _forward_time(us.output_placements[pos][axis], s, k, value.nbytes, axis, tp_comm)
                    for s in v_strats
                ]
                for us in u_strats
            ]
            self._add_forward(_node_name(u_c), _node_name(v_c), forward)

    def _storage_partial(self, v_idx: int, k: int, vid: int, root: int) -> bool:
        """A use whose partial gradient is reduced to a parameter's storage placement (``root`` is a view of
        the parameter, :func:`viewed_param`): prices that reduction on an edge parameter -> consumer, the two
        choices it depends on (the consumer's strategy makes the gradient partial, the storage says where it
        is reduced to), and says so (the view -> consumer edge then leaves it out)."""
        pvid = viewed_param(self.graph, self.tied, self.producer, root)
        if pvid is None or vid not in self.grads:
            return False
        pname = _param_node_name(self.tied.canonical_param(self.graph.values[pvid].name))
        if pname not in self.param_options:
            return False
        axis, nbytes = self.axis, self.graph.values[vid].nbytes
        w = self.tied.weight[v_idx]
        v_name = _node_name(self.tied.canonical[v_idx])
        share = 1.0 / self.readers[root]
        partial = [_partial_gradient(s, k, axis) for s in self.strat_of[v_name]]
        matrix = [
            [
                w * share * redistribute("P", o if is_shard(o) else "R", nbytes, self.tp_comm)[0]
                if p
                else 0.0
                for p in partial
            ]
            for o in self.param_options[pname]
        ]
        self._add_edge(pname, v_name, matrix)
        return True

    def _add_shared_copy(self, v_idx: int, k: int, vid: int, u_c: int, pos: int) -> None:
        """A use in :func:`shared_projection_inputs`: the runtime's projection hooks redistribute the value once
        per target placement and every sibling projection wanting that placement reads the copy. Registers the
        consumer's strategies that read each placement as members of one :class:`SharedCost`, priced once
        per producer strategy."""
        tied, axis = self.tied, self.axis
        value = self.graph.values[vid]
        w = tied.weight[v_idx]
        v_c = tied.canonical[v_idx]
        v_strats = self.strat_of[_node_name(v_c)]
        u_strats = self.strat_of[_node_name(u_c)]
        wanted_in = [
            s.input_placements[k][axis]
            if k < len(s.input_placements) and s.input_placements[k] is not None
            else None
            for s in v_strats
        ]
        for place in sorted({p for p in wanted_in if p is not None}):
            key = (vid, self.shared_uses[(v_idx, k)], place, w, _node_name(u_c))
            wanted = tuple(j for j, p in enumerate(wanted_in) if p == place)
            self.shared_members.setdefault(key, []).append((_node_name(v_c), wanted))
            self.shared_price[key] = [
                w * redistribute(us.output_placements[pos][axis], place, value.nbytes, self.tp_comm)[0]
                for us in u_strats
            ]

    def _add_edge(self, src: str, dst: str, matrix: list[list[float]]) -> None:
        """Adds ``matrix`` to the edge ``src -> dst`` (uses between the same two nodes sum)."""
        if src == dst:
            # A value flowing between two copies of one tied node (same strategy on both ends): diagonal only.
            return
        if (src, dst) in self.edge_cost:
            acc = self.edge_cost[(src, dst)]
            for a, row in zip(acc, matrix, strict=True):
                for j, v in enumerate(row):
                    a[j] += v
        else:
            self.edge_cost[(src, dst)] = [list(r) for r in matrix]

    def _add_forward(self, src: str, dst: str, matrix: list[list[float]]) -> None:
        """Adds ``matrix`` to the forward resharding ``src -> dst`` a rerun of ``dst`` repeats."""
        acc = self.fwd_into.setdefault((src, dst), [[0.0] * len(matrix[0]) for _ in matrix])
        for a, row in zip(acc, matrix, strict=True):
            for j, v in enumerate(row):
                a[j] += v

    # ---------------------------------------------------------------- recompute decisions
    def _add_recompute_decisions(self) -> None:
        """One node ``rc:<unit>`` per recompute unit, its strategies the unit's options
        (:func:`~hf_colossal_auto.solve.recompute.unit_options`; pinned by ``recompute_pin``). The node costs
        nothing itself: an edge ``rc -> op`` prices rerunning each op the option recomputes on its local shapes
        under the op's strategy, and :meth:`_add_conditional_costs` the forward reshardings a rerun repeats.
        What the option saves is priced by :meth:`_memory_constraints`."""
        graph, axis, tp, spec = self.graph, self.axis, self.tp, self.spec
        for unit in self.units:
            # what the block's own backward needs (a block output is kept by its readers, not recomputed for them)
            unit.last_saved = max(
                (c for c in unit.nodes if self.saved_for_backward.get(c) and c not in unit.escaping),
                default=None,
            )
            forward_s = {
                c: _local_node_time(graph, graph.nodes[c], _replicated(graph.nodes[c]), axis, 1, spec)
                for c in unit.nodes
            }
            options = unit_options(graph, unit, self.saved_for_backward, forward_s)
            pinned = self._pinned_option(unit)
            if pinned is not None and pinned not in {o.name for o in options}:
                # a level the ranking does not offer, pinned by a hand configuration (torchtitan's selective
                # policy recomputes the pointwise ops alone): priced as any other option
                options.append(parse_option(pinned))
            self.unit_options_of.append(options)
            rc = _recompute_node_name(unit.name)
            self.rc_names.append(rc)
            self.nodes.append(
                DecisionNode(rc, [0.0] * len(options), [o.name for o in options], multiplicity=1)
            )
            self.block_of[rc] = unit.name
            for c in unit.nodes:
                name = _node_name(c)
                node = graph.nodes[c]
                local = [
                    self._skewed(c, st, functools.partial(_local_node_time, graph, node, st, axis, tp, spec))
                    for st in self.strat_of[name]
                ]
                matrix = [
                    [t * self.tied.multiplicity[c] if unit.reruns(o, node) else 0.0 for t in local]
                    for o in options
                ]
                self.edge_cost[(rc, name)] = matrix
            self._pin_recompute(unit, rc, options)
        self._add_conditional_costs()

    def _pinned_option(self, unit: RecomputeUnit) -> str | None:
        """The option ``recompute_pin`` names for a unit (for every unit, or per unit: "none" for the units it
        leaves out); None when recompute is a decision."""
        recompute_pin = self.recompute_pin
        if recompute_pin is None:
            return None
        return recompute_pin if isinstance(recompute_pin, str) else recompute_pin.get(unit.name, "none")

    def _pin_recompute(self, unit: RecomputeUnit, rc: str, options: list[RecomputeOption]) -> None:
        """Fixes a unit's recompute option when ``recompute_pin`` names one (:meth:`_pinned_option`)."""
        want = self._pinned_option(unit)
        if want is None:
            return
        names = [o.name for o in options]
        if want not in names:
            raise ValueError(f"recompute option {want!r} for {unit.name} is not one of its options {names}")
        self.fixed[rc] = names.index(want)

    def _add_conditional_costs(self) -> None:
        """The forward resharding into a recomputable op is paid again when its unit's option reruns the op: a
        :class:`ConditionalCost` on the edge, active for those options."""
        units, graph = self.units, self.graph
        for (src, dst), matrix in sorted(self.fwd_into.items()):
            c = self.node_of_name[dst]
            u = self.unit_index_of[c]
            when = tuple(
                k for k, o in enumerate(self.unit_options_of[u]) if units[u].reruns(o, graph.nodes[c])
            )
            if when and any(any(row) for row in matrix):
                self.conditional.append(ConditionalCost(src, dst, self.rc_names[u], when, matrix))

    # ---------------------------------------------------------------- memory
    def _snapshots(self) -> tuple[_Snapshot, list[_Snapshot], list[_Snapshot], list[_Snapshot]]:
        """Live bytes at the moments the memory constraints are written at: the highest point of forward +
        backward, and per recompute unit inside its backward at the highest point, at the start of its backward
        (where a rerun happens) and at the highest point of its forward (what a rerun rebuilds)."""
        graph, units = self.graph, self.units
        # The same graph is built into several problems (data-parallel modes, the planner's relaxations): the
        # snapshots depend only on it, its units and the storages they are handed, so they are kept on it.
        cache = graph.__dict__.setdefault("_snapshot_cache", {})
        key = (tuple((u.name, tuple(u.nodes)) for u in units), tuple(sorted(self.checkpoint_args)))
        if key not in cache:
            cache[key] = self._snapshots_uncached()
        return cache[key]

    def _snapshots_uncached(self) -> tuple[_Snapshot, list[_Snapshot], list[_Snapshot], list[_Snapshot]]:
        graph, units = self.graph, self.units
        step = _unrolled(graph)
        moments = [_block_moment(graph, step, unit, Phase.BACKWARD, "peak") for unit in units]
        moments += [_block_moment(graph, step, unit, Phase.BACKWARD, "start") for unit in units]
        moments += [_block_moment(graph, step, unit, Phase.FORWARD, "peak") for unit in units]
        peak_snapshot, snapshots = _liveness(graph, step, moments, set(self.checkpoint_args))
        k = len(units)
        return peak_snapshot, snapshots[:k], snapshots[k : 2 * k], snapshots[2 * k :]

    def _memory_constraints(self) -> list[MemoryConstraint]:
        """Per-device memory under the budget at each constrained moment: the activation peak; the optimizer
        step (parameters, gradients, optimizer state and its temporaries, by parameter placement); and per
        recompute unit, the highest point of its backward (``recompute:<unit>``) and its rerun as its backward
        starts (``rerun:<unit>``). See :meth:`_constraint_at`."""
        constant_other = self._constant_bytes()
        constraints: list[MemoryConstraint] = []
        constraints.append(self._constraint_at("activation-peak", self.peak_snapshot, None))
        opt_terms = {
            p: [
                m + g + t
                for m, g, t in zip(
                    self.param_mem_terms[p], self.grad_terms[p], self.opt_temp_terms[p], strict=True
                )
            ]
            for p in self.param_mem_terms
        }
        constraints.append(
            MemoryConstraint(
                "optimizer-step", self.budget, constant_other, opt_terms, apply_multiplicity=True
            )
        )
        for u, (unit, snapshot) in enumerate(zip(self.units, self.unit_snapshots, strict=True)):
            constraints.append(self._constraint_at(f"recompute:{unit.name}", snapshot, u))
            constraints.append(
                self._constraint_at(
                    f"rerun:{unit.name}", self.start_snapshots[u], u, self.forward_snapshots[u]
                )
            )
        return constraints

    def _constant_bytes(self) -> float:
        """Bytes no decision changes: the model's inputs and buffers (at the activation peak)."""
        return self.peak_snapshot.by_kind.get("input", 0) + self.peak_snapshot.by_kind.get("buffer", 0)

    def _constraint_at(
        self, name: str, snapshot: _Snapshot, current: int | None, rerun: _Snapshot | None = None
    ) -> MemoryConstraint:
        """Per-device bytes at one moment of the step: what forward nodes still hold (kept per the recompute
        choice; inside unit ``current``'s backward, at its highest point, also its recomputed block),
        parameters, gradients alive then, and the moment's other transients (priced unsharded: an upper bound,
        since some of the gradients in flight are sharded).

        ``rerun``: the moment is the recompute of unit ``current``'s block, just as its backward starts; a
        block that reruns holds what it held at its own forward's highest point (``rerun``'s bytes of its
        nodes: saved outputs and forward temporaries) on top of the gradients arriving from above."""
        tied = self.tied
        saved = _weighted(tied, snapshot.by_node)
        rerun_alive = _weighted(tied, rerun.by_node) if rerun is not None else {}
        transient = max(0.0, snapshot.by_kind.get("activation", 0) - sum(saved.values()))
        terms: dict[str, list[float]] = {}
        edge_terms: dict[tuple[str, str], list[list[float]]] = {}
        for c in self.canon_nodes:
            name_c = _node_name(c)
            strats = self.strat_of[name_c]
            alive = saved.get(c, 0.0)
            u = self.unit_index_of.get(c)
            if u is None:
                if alive:
                    terms[name_c] = [alive / tied.multiplicity[c] / self._out_shard(st, c) for st in strats]
                continue
            over = current is not None and u > current  # that unit's backward is over: it holds nothing
            matrix = [
                [
                    (
                        0.0
                        if over
                        else self._held(
                            o,
                            c,
                            rerun_alive.get(c, 0.0)
                            if rerun is not None and u == current and not o.is_none
                            else alive,
                            self.weighted_saved.get(c, 0.0),
                            u == current,
                        )
                    )
                    / self._out_shard(st, c)
                    for st in strats
                ]
                for o in self.unit_options_of[u]
            ]
            if any(any(row) for row in matrix):
                edge_terms[(self.rc_names[u], name_c)] = matrix
        # the share of the gradients alive then: of the trained parameters' (frozen ones have none)
        param_total = self.graph.trainable_param_bytes
        grad_frac = snapshot.by_kind.get("grad", 0) / param_total if param_total else 0.0
        for pname, mterms in self.param_mem_terms.items():
            if self.micro_batches > 1:  # the earlier micro-batches' gradients are all alive
                grads = self.accumulated_grad_terms[pname]
                terms[pname] = [m + g for m, g in zip(mterms, grads, strict=True)]
            else:
                terms[pname] = [
                    m + grad_frac * g for m, g in zip(mterms, self.grad_terms[pname], strict=True)
                ]
            if pname in self.gathered_terms:
                terms[pname] = [t + x for t, x in zip(terms[pname], self.gathered_terms[pname], strict=True)]
        for sid, readers in sorted(self.checkpoint_args.items()):
            holding = tuple(u for u in sorted(readers) if current is None or u <= current)
            if holding and sid not in snapshot.watched_alive:
                terms[self._hold_node(sid, holding)] = [0.0, float(self.graph.storages[sid].nbytes)]
        return MemoryConstraint(
            name, self.budget, self._constant_bytes() + transient, terms, edge_terms, apply_multiplicity=True
        )

    def _hold_node(self, sid: int, units: tuple[int, ...]) -> str:
        """A node that is ``held`` exactly when one of ``units`` recomputes: then a checkpoint still holds storage
        ``sid`` (non-reentrant checkpoint keeps a block's arguments until the block's backward), which nothing
        else may hold at that moment (OPT's and Llama's position ids). It holds it once however many blocks
        recompute, so the term is an OR of the units' choices: two :class:`FollowsInputs` rules make the node's
        choice that OR (a recomputing option needs ``held``; ``held`` needs a recomputing unit)."""
        key = (sid, units)
        if key in self.hold_nodes:
            return self.hold_nodes[key]
        name = f"hold:{sid}:" + ",".join(self.units[u].name for u in units)
        self.hold_nodes[key] = name
        self.nodes.append(DecisionNode(name, [0.0, 0.0], ["released", "held"], multiplicity=1))
        for u in units:
            recomputing = tuple(k for k, o in enumerate(self.unit_options_of[u]) if not o.is_none)
            self.hold_rules.append(FollowsInputs(self.rc_names[u], recomputing, ((name, (0,)),)))
        none_of = [
            (self.rc_names[u], tuple(k for k, o in enumerate(self.unit_options_of[u]) if o.is_none))
            for u in units
        ]
        self.hold_rules.append(FollowsInputs(name, (1,), tuple(none_of)))
        return name

    def _out_shard(self, st: Strategy, c: int | None = None) -> float:
        """How many ways a strategy splits node ``c``'s (first) output: what its held bytes are divided by. The
        rows of an expert-parallel grouped GEMM under a measured routing load split as the busiest rank holds
        them (the mean skew over the layers the node stands for: bytes add up over them). An op of an experts
        module run expert-parallel over the data-parallel axis holds the values of the rows it received: its traced
        bytes under uniform routing, the busiest rank's skew times them under a measured one."""
        if c is not None and c in self.expert_dp_nodes:
            return 1.0 / self.expert_dp_nodes[c]
        ways = shard_factor(st.output_placements[0][self.axis] if st.output_placements else None, self.tp)
        skews = self.expert_skews.get(c) if c is not None else None
        if skews and ways > 1 and is_expert_parallel(self.graph, self.graph.nodes[c], st, self.axis):
            mean = sum(skew * k for skew, k in skews) / sum(k for _, k in skews)
            return ways / mean
        return ways

    def _skewed(self, c: int, st: Strategy, price) -> float:
        """``price(row_skew)`` of node ``c`` under ``st``: 1.0 unless ``st`` runs an expert-parallel grouped
        GEMM under a measured routing load, then averaged over the layers the node stands for (their costs add
        up through its multiplicity)."""
        skews = self.expert_skews.get(c)
        if not skews or not is_expert_parallel(self.graph, self.graph.nodes[c], st, self.axis):
            return price(1.0)
        if len(skews) == 1:
            return price(skews[0][0])
        return sum(price(skew) * k for skew, k in skews) / sum(k for _, k in skews)

    def _kept(self, option: RecomputeOption, c: int, alive: float) -> float:
        """Bytes one real block's node ``c`` keeps for backward under ``option`` (``alive``: what it keeps
        without recompute)."""
        if option.is_none:
            return alive
        escaping = c in self.units[self.unit_index_of[c]].escaping
        node = self.graph.nodes[c]
        cached = float(sum(self.graph.values[v].nbytes for v in node.outputs)) if option.caches(node) else 0.0
        return max(cached, alive) if escaping else cached

    def _held(self, option: RecomputeOption, c: int, alive: float, at_peak: float, inside: bool) -> float:
        """Bytes node ``c`` holds over all the real blocks it stands for. ``inside``: the moment is inside the
        backward of the unit's first block to go backward; that block holds what it holds without recompute
        (recomputed or kept, the same tensors), the others only what they keep."""
        mult = self.tied.multiplicity[c]
        if not inside:
            return mult * self._kept(option, c, alive / mult)
        others = at_peak * (mult - 1) / mult
        return (mult - 1) * self._kept(option, c, at_peak / mult) + max(0.0, alive - others)


def data_parallel_sync_time(
    dp_mode: str, local_bytes: float, dp_comm: AxisComm | HybridComm, micro_batches: int = 1
) -> float:
    """Seconds of one parameter's data-parallel synchronisation per step: DDP all-reduces its gradient; FSDP
    all-gathers it for forward and again for backward and reduce-scatters its gradient. HSDP does FSDP's three
    in its shard group (inside a node) and all-reduces the gradient shard (1/shard of the bytes) over its
    replicate group (across nodes): only that all-reduce pays the network. With k micro-batches the gradient
    is synchronised once (after the last one), but FSDP gathers the parameter for every one."""
    if dp_mode == "hsdp":
        hybrid = hybrid_comm(dp_comm)
        in_node = data_parallel_sync_time("fsdp", local_bytes, hybrid.shard, micro_batches)
        return in_node + hybrid.replicate.time("all_reduce", local_bytes / hybrid.shard.size)
    if dp_mode == "fsdp":
        gathers = 2 * micro_batches * dp_comm.time("all_gather", local_bytes)
        return gathers + dp_comm.time("reduce_scatter", local_bytes)
    return dp_comm.time("all_reduce", local_bytes)


def data_parallel_overlap(
    nodes: list[DecisionNode],
    sync_terms: dict[str, list[float]],
    dp_mode: str,
    ratios: BackwardRatios,
    block_of: dict[str, str],
    spec: DeviceSpec,
    micro_batches: int = 1,
) -> list[Overlap]:
    """The data-parallel synchronisation as communication behind computation, as the runtime runs it: DDP's
    gradient all-reduces are started as gradients are accumulated and run behind the rest of backward
    (``runtime._make_sync_hook``); FSDP2 prefetches the next block's all-gather in forward and backward and
    reduce-scatters behind the next block's backward, so all of the step's compute can hide it. The ops' own
    costs (forward + backward) are the computation; for DDP only their backward share — of the last micro-batch
    alone when there are several (the gradients are all-reduced during its backward only)."""
    if not sync_terms:
        return []
    compute: dict[str, list[float]] = {}
    for node in nodes:
        if node.name in sync_terms or not node.name.startswith("n"):
            continue
        share = 1.0
        if dp_mode not in SHARDED_DP_MODES:
            share = ratios.backward_share(block_of.get(node.name, "")) / micro_batches
        if any(node.costs):
            compute[node.name] = [c * share for c in node.costs]
    return [Overlap("data-parallel", dict(sync_terms), compute, spec.overlap_efficiency)]


def edge_reshardings(
    src_place: str,
    consumer: Strategy,
    k: int,
    nbytes: float,
    axis: int,
    comm: AxisComm,
    *,
    param: bool = False,
    consumers: int = 1,
    forward: bool = True,
    partial_to: str | None = None,
    partial_elsewhere: bool = False,
    needs_grad: bool = True,
) -> list[tuple[float, str, float]]:
    """(seconds, collective, how many of it) of one producer->consumer use: the forward resharding of the value and the
    backward resharding of its gradient.

    A value read by several consumers gets the sum of their gradients. Partial gradients are summed locally
    before a single reduction (what autograd's accumulation does with partial DTensors), so each of the
    ``consumers`` readers carries ``1/consumers`` of that reduction; exact when the readers agree (q, k and v
    projections of one normed input), an undercount when only some of them produce partial gradients.
    ``forward=False`` leaves the forward resharding out (a use in :func:`shared_projection_inputs`: priced
    once for all its readers by a :class:`SharedCost`). ``partial_to``: a partial gradient of a view passes
    through it and is reduced where the viewed value was made, to this placement (``consumers`` then counts
    that value's readers). ``partial_elsewhere``: a partial gradient is reduced to a parameter's storage and
    priced on the parameter's edge (:meth:`_ProblemBuilder._storage_partial`), not here. A value that needs no
    gradient (RoPE's cos/sin, masks) has no backward part.
    """
    spec = consumer.input_placements[k] if k < len(consumer.input_placements) else None
    dst = spec[axis] if spec is not None else src_place
    out: list[tuple[float, str, float]] = []
    t, kind = redistribute(src_place, dst, nbytes, comm)
    if kind and forward:
        out.append((t, kind, 1.0))
    if not needs_grad:
        return out
    ins = tuple(p[axis] if p is not None else None for p in consumer.input_placements)
    outs = tuple(p[axis] for p in consumer.output_placements)
    grad_from = gradient_at_consumer(dst, splits_work(ins, outs))
    if grad_from == "P" and partial_elsewhere and spec is not None:
        return out
    grad_to = src_place if param and is_shard(src_place) else gradient_at_producer(src_place)
    if grad_from == "P" and partial_to is not None:
        grad_to = partial_to
    t, kind = redistribute(grad_from, grad_to, nbytes, comm)
    if kind:
        share = 1.0 / consumers if grad_from == "P" else 1.0
        out.append((t * share, kind, share))
    return out


def _partial_gradient(consumer: Strategy, k: int, axis: int) -> bool:
    """Whether ``consumer`` makes a partial gradient for its input ``k`` (read replicated by a split op)."""
    spec = consumer.input_placements[k] if k < len(consumer.input_placements) else None
    if spec is None:
        return False  # reads whatever arrives: priced on the view's edge (see :func:`edge_reshardings`)
    ins = tuple(p[axis] if p is not None else None for p in consumer.input_placements)
    outs = tuple(p[axis] for p in consumer.output_placements)
    return gradient_at_consumer(spec[axis], splits_work(ins, outs)) == "P"


def _edge_time(*args, **kwargs) -> float:
    return sum(t for t, _, _ in edge_reshardings(*args, **kwargs))


def _forward_time(
    src_place: str, consumer: Strategy, k: int, nbytes: float, axis: int, comm: AxisComm
) -> float:
    """Seconds of the forward resharding of one use (what rerunning the consumer repeats)."""
    spec = consumer.input_placements[k] if k < len(consumer.input_placements) else None
    dst = spec[axis] if spec is not None else src_place
    return redistribute(src_place, dst, nbytes, comm)[0]


def _replicated(node: OpNode) -> Strategy:
    return Strategy(
        tuple(("R",) for _ in node.inputs), tuple(("R",) for _ in node.outputs), "replicate-fallback"
    )


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


def _label(s: Strategy, axis: int) -> str:
    ins = ",".join(p[axis] if p is not None else "-" for p in s.input_placements)
    outs = ",".join(p[axis] for p in s.output_placements)
    return f"({ins})->({outs})"


@dataclass
class _Snapshot:
    """Live bytes at one moment: by storage kind, and by the forward node that allocated them (summed over
    the blocks a replayed copy stands for)."""

    by_kind: dict[str, int]
    by_node: dict[int, int]
    watched_alive: frozenset[int] = frozenset()
    """The watched storages (see :func:`_liveness`) alive at that moment."""


Moment = tuple[int, str]
"""A position in ``UnrolledStep.order`` and ``"before"`` (the state before its events) or ``"max"`` (the state at
the highest point its events reach: an op's outputs and temporaries exist together before its frees)."""


def _liveness(
    graph: StepGraph, step: UnrolledStep, moments: list[Moment], watched: set[int] | None = None
) -> tuple[_Snapshot, list[_Snapshot]]:
    """The highest point of forward + backward (the optimizer step is priced apart) and the state at each of
    ``moments``; each snapshot says which of the ``watched`` storages are alive then."""
    alloc_node = {e.storage_id: e.slot for e in graph.memory_events if e.delta > 0}
    live: dict[ValueKind, int] = defaultdict(int, step.initial_by_kind)
    by_node: dict[int, int] = defaultdict(int)
    watched = watched or set()
    copies: dict[int, int] = defaultdict(int)  # watched storage -> live copies

    def snap() -> _Snapshot:
        return _Snapshot(
            {k.value: v for k, v in live.items()},
            {n: b for n, b in by_node.items() if b > 0},
            frozenset(s for s, c in copies.items() if c > 0),
        )

    before = sorted({pos for pos, kind in moments if kind == "before"})
    at_max = {pos for pos, kind in moments if kind == "max"}
    taken: dict[Moment, _Snapshot] = {}
    best_at: dict[int, int] = {}
    best_total, best = sum(live.values()), snap()
    total = best_total
    for (pos, delta, kind), sid in zip(step.events, step.event_storages, strict=True):
        while before and pos >= before[0]:
            taken[(before.pop(0), "before")] = snap()
        if pos >= 0 and graph.nodes[step.order[pos]].phase is Phase.OPTIMIZER:
            break
        total += delta
        live[kind] += delta
        node = alloc_node.get(sid)
        if node is not None and graph.nodes[node].phase is Phase.FORWARD:
            by_node[node] += delta
        if sid in watched:
            copies[sid] += 1 if delta > 0 else -1
        if total > best_total:
            best_total, best = total, snap()
        if pos in at_max and total > best_at.get(pos, -1):
            best_at[pos] = total
            taken[(pos, "max")] = snap()
    for pos in before:
        taken[(pos, "before")] = snap()
    return best, [taken.get(m) or snap() for m in moments]


def _checkpoint_args(
    graph: StepGraph, tied: TiedGraph, units: list[RecomputeUnit], unit_index_of: dict[int, int]
) -> dict[int, set[int]]:
    """Storages a forward op outside every unit made and the model passes to a unit's blocks (position ids,
    masks, rotary tables; used by the block or not), with the units whose blocks get them. A recomputed block's
    checkpoint keeps its arguments until its backward, whether or not anything else still needs them."""
    alloc = {e.storage_id: e.slot for e in graph.memory_events if e.delta > 0}
    runs = {run.representative: run.traced for run in graph.block_runs}
    readers: dict[int, set[int]] = defaultdict(set)
    for u, unit in enumerate(units):
        for block in runs.get(unit.name, unit.blocks):
            for sid in graph.block_args.get(block, ()):
                made = alloc.get(sid)
                if made is None or graph.nodes[made].phase is not Phase.FORWARD:
                    continue  # parameters, buffers and the batch exist all step anyway
                if tied.canonical.get(made, made) in unit_index_of:
                    continue  # made inside a unit (a block's output): priced with that unit's kept bytes
                readers[sid].add(u)
    return dict(readers)


def _weighted(tied: TiedGraph, by_node: dict[int, int]) -> dict[int, float]:
    """Bytes per canonical node: every copy's allocations land on the node that decides for it."""
    out: dict[int, float] = defaultdict(float)
    for i, c in tied.canonical.items():
        out[c] += by_node.get(i, 0)
    return out


def _block_moment(
    graph: StepGraph, step: UnrolledStep, unit: RecomputeUnit, phase: Phase, which: str
) -> Moment:
    """A moment in ``phase`` of the unit's block that goes backward first (its last block): ``"start"``, before
    its first op; ``"peak"``, inside the op at which the live bytes reach their highest."""
    block = unit.last_block
    inside_positions = [
        pos
        for pos, i in enumerate(step.order)
        if graph.nodes[i].phase is phase
        and (
            step.block_of[pos] == block
            or (
                step.block_of[pos] is None
                and (graph.nodes[i].module == block or graph.nodes[i].module.startswith(block + "."))
            )
        )
    ]
    if not inside_positions:
        return (len(step.order), "before")
    if which == "start":
        return (inside_positions[0], "before")
    wanted = set(inside_positions)
    total, best, best_pos = step.initial_bytes, -1, inside_positions[0]
    for pos, delta, _ in step.events:
        total += delta
        if pos in wanted and total > best:
            best, best_pos = total, pos
    return (best_pos, "max")


def _optimizer_time(graph: StepGraph, spec: DeviceSpec) -> float:
    """Roofline seconds of the whole optimizer step on one device, unsharded (folded blocks included: the
    profiler's node times count each foreach kernel's bytes for every twin parameter)."""
    times = node_times(graph, spec, dtensor=True)
    return sum(times[n.index] for n in graph.nodes if n.phase is Phase.OPTIMIZER)


def _unrolled(graph: StepGraph) -> UnrolledStep:
    """``unroll(graph)``, kept on the graph: every problem built from one step (data-parallel modes, the
    planner's relaxations) reads the same full-depth timeline, and a captured step does not change."""
    if "_unrolled" not in graph.__dict__:
        graph.__dict__["_unrolled"] = unroll(graph)
    return graph.__dict__["_unrolled"]


def _optimizer_temp_ratio(graph: StepGraph) -> float:
    """The optimizer step's temporary bytes at their peak, per byte of trainable parameter."""
    step = _unrolled(graph)
    opt_positions = [pos for pos, i in enumerate(step.order) if graph.nodes[i].phase is Phase.OPTIMIZER]
    if not opt_positions:
        return 0.0
    start = opt_positions[0]
    live = 0
    peak = 0
    for pos, delta, kind in step.events:
        if pos < start:
            continue
        if kind in (ValueKind.ACTIVATION,):
            live += delta
            peak = max(peak, live)
    total = graph.trainable_param_bytes
    return peak / total if total else 0.0
