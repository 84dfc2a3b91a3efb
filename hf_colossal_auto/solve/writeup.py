"""The Plan a solved ILP becomes, with its predictions: step time split into compute, exposed communication and
recompute (per block), per-device memory at each constrained moment, the collectives it will issue (counts and
bytes, for the fidelity tests), and the placements the runtime enforces.

Split from the search (:mod:`.search`) and the candidate (:mod:`.candidates`), which hands it a frozen
:class:`WriteupContext` rather than itself, so that where one predicted figure is made can be found in one place;
the collectives a plan issues are counted in :mod:`.pricing.collectives`.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..capture.graph import StepGraph
from ..capture.moe import MEASURED_LOAD, UNIFORM_LOAD, RoutingLoad, experts_modules, is_moe_model
from ..hardware import ClusterSpec, DeviceSpec
from ..plan import BlockCost, Plan
from ..profile.profiler import _module_list_children, block_units
from ..strategies import ops_without_dtensor_rule
from ..strategies.moe import moe_layer_choices
from .boundaries import block_input_placements, reduced_where_read
from .build.builder import BuiltProblem
from .build.names import MemoryRow, NodeKind, _node_name, _param_node_name, memory_row_name
from .pricing.collectives import _collective_prediction, _recompute_collectives, _sync_wait
from .pricing.comm import SHARDED_DP_MODES, AxisComm, boundary_reshardings
from .pricing.compute import HOST_STREAM, overlap_parts
from .problem import MemoryConstraint, Problem, Solution, evaluate, memory_usage
from .tied import TiedGraph, last_forward_ops

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WriteupContext:
    """What the write-up reads of the candidate a solution belongs to (instead of the planner itself): the model
    and its global batch, the device and cluster, the budget, the routing load priced, the step the problem was
    built from and the tensor-parallel axis's collective pricing."""

    model: nn.Module
    inputs: Mapping[str, Any]
    spec: DeviceSpec
    cluster: ClusterSpec
    budget: int
    batch: int
    routing: RoutingLoad | None
    graph: StepGraph
    tp_comm: AxisComm


def _make_plan(
    context: WriteupContext, mesh: tuple[int, int], dp_mode: str, built: BuiltProblem, solution: Solution
) -> Plan:
    """The Plan of ``solution``: its placements, predicted times (split by :func:`_split_time`), per-block table,
    memory and the collectives it issues."""
    micro = built.micro_batches
    graph = context.graph
    tied = TiedGraph.build(graph)
    problem = built.problem
    objective, peak, _ = evaluate(problem, solution.choice)
    split = _split_time(context, built, solution)
    recompute = _recompute_choice(built, solution)
    expert_dp = sorted(experts_modules(context.model)) if built.expert_data_parallel else []
    param_placements = _param_placements(built, solution, graph, tied, dp_mode)
    activation_placements = _module_output_placements(built, solution, graph, tied, mesh)
    blocks = _block_costs(context, built, solution, tied, mesh, split, param_placements, recompute)
    predicted = _collective_prediction(built, solution, graph, tied, mesh, context.tp_comm, dp_mode)
    sync_wait_s = _sync_wait(context.spec, built, solution, graph, tied, mesh, predicted)
    collectives = dict(predicted.counts)
    for kind, count in _recompute_collectives(built, solution, graph, tied, mesh, context.tp_comm).items():
        collectives[kind] = round(collectives.get(kind, 0.0) + micro * count, 6)
    param_mem, act_mem = _param_and_activation_bytes(built, solution)
    return Plan(
        model_class=graph.model_class,
        num_devices=context.cluster.num_devices,
        device=context.spec.name,
        mesh_shape=tuple(mesh),
        mesh_axis_names=("dp", "tp"),
        dp_mode=dp_mode,
        dp_shard_size=built.dp_shard_size,
        param_placements=param_placements,
        param_shapes={
            fqn: list(p.shape)
            for fqn, p in context.model.named_parameters(remove_duplicate=False)
            if fqn in param_placements
        },
        activation_placements=activation_placements,
        block_input_placements=block_input_placements(graph, activation_placements),
        moe_layers=_expert_dp_labels(
            moe_layer_choices(
                context.model,
                param_placements,
                mesh[1],
                _param_use_placements(built, solution, graph, tied, context.model),
            ),
            expert_dp,
            mesh[0],
        ),
        expert_data_parallel=expert_dp,
        local_modules=list(built.local_modules),
        moe_load=(MEASURED_LOAD if context.routing is not None else UNIFORM_LOAD)
        if is_moe_model(context.model)
        else "",
        moe_routing=(
            {fqn: list(c) for fqn, c in context.routing.rows_per_expert.items()}
            if context.routing is not None
            else {}
        ),
        replicated_ops=ops_without_dtensor_rule(graph),
        global_batch_size=context.batch,
        micro_batches=micro,
        input_shapes={k: list(v.shape) for k, v in context.inputs.items() if isinstance(v, torch.Tensor)},
        step_time_s=objective + sync_wait_s,
        compute_time_s=split.compute,
        communication_time_s=split.comm,
        recompute_time_s=split.rerun,
        memory_moments=_memory_moments(problem, solution),
        overlapped_communication_s=split.hidden,
        sync_wait_s=sync_wait_s,
        peak_memory_bytes=int(peak),
        memory_budget_bytes=context.budget,
        param_memory_bytes=int(param_mem),
        activation_memory_bytes=int(act_mem),
        blocks=blocks,
        collectives=collectives,
        recompute=recompute,
        param_use_placements=_param_use_placements(built, solution, graph, tied, context.model),
        collective_bytes=predicted.nbytes,
        solver={
            "status": solution.status,
            "gap": solution.gap if solution.gap is not None else 0.0,
            "solve_time_s": solution.solve_time_s,
            "solver": solution.solver,
            "variables": solution.num_variables,
            "constraints": solution.num_constraints,
        },
    )


@dataclass
class _TimeSplit:
    """The objective split into compute, exposed communication and recompute, in all and per depth unit, with the
    synchronisation compute hides; filled in by :func:`_split_time`'s parts in the objective's order."""

    graph: StepGraph
    unit_of: Callable[[str], str]
    """Module -> the depth unit (block) it belongs to."""
    compute: float = 0.0
    comm: float = 0.0
    rerun: float = 0.0
    hidden: float = 0.0
    block_compute: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    block_comm: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    block_rerun: dict[str, float] = field(default_factory=lambda: defaultdict(float))

    def spread(self, target: dict[str, float], module: str, cost: float) -> None:
        """A tied node's cost is shared by the same module in every block it stands for."""
        reals = _real_modules(self.graph, module)
        for real in reals:
            target[self.unit_of(real)] += cost / len(reals)


def _split_time(context: WriteupContext, built: BuiltProblem, solution: Solution) -> _TimeSplit:
    """Split the objective into compute and communication (and recompute), per block: node costs, then edges and
    the costs gated on them, then the data-parallel overlap."""
    split = _TimeSplit(context.graph, _unit_mapper(context.model))
    _split_nodes(split, built, solution, context.tp_comm)
    _split_edges(split, built, solution)
    _split_overlaps(split, built, solution)
    return split


def _split_nodes(split: _TimeSplit, built: BuiltProblem, solution: Solution, tp_comm: AxisComm) -> None:
    """Node costs: the expert exchange is communication, a parameter's optimizer step compute, an op's cost
    compute but for the reshardings at its module's boundary."""
    micro = built.micro_batches
    graph = split.graph
    problem = built.problem
    spread = split.spread
    block_compute, block_comm = split.block_compute, split.block_comm
    for node in problem.nodes:
        i = solution.choice[node.name]
        cost = node.costs[i] * node.multiplicity
        module = built.block_of.get(node.name, "")
        if node.kind == NodeKind.EXPERT_EXCHANGE:  # the exchange of expert parallelism over dp, per layer
            split.comm += cost
            layers = sum(e.layers for e in built.expert_data_parallel.values())
            for m, exchange in built.expert_data_parallel.items():
                spread(block_comm, m, cost * exchange.layers / layers)
        elif node.kind == NodeKind.PARAM:  # its share of the optimizer step
            split.compute += cost
            spread(block_compute, module, cost)
        else:
            strat = built.strategies[node.name][i] if built.strategies.get(node.name) else None
            boundary = (
                micro
                * node.multiplicity
                * sum(
                    t
                    for t, _, _ in (
                        boundary_reshardings(
                            graph,
                            graph.nodes[built.node_of_name[node.name]],
                            strat,
                            0,
                            tp_comm,
                            built.returned_as(node.name),
                        )
                        if strat is not None
                        else ()
                    )
                )
            )
            split.compute += cost - boundary
            spread(block_compute, module, cost - boundary)
            split.comm += boundary
            spread(block_comm, module, boundary)


def _split_edges(split: _TimeSplit, built: BuiltProblem, solution: Solution) -> None:
    """Edge costs (a recompute decision's edges are the forward it runs again), the collectives a recompute
    repeats, and the reshardings shared by sibling projections."""
    problem = built.problem
    spread = split.spread
    block_comm, block_rerun = split.block_comm, split.block_rerun
    for edge in problem.edges:
        c = edge.cost[solution.choice[edge.src]][solution.choice[edge.dst]] * edge.multiplicity
        if edge.src in built.recompute_options:  # the forward a recomputed node runs again
            split.rerun += c
            spread(block_rerun, built.block_of.get(edge.dst, ""), c)
        else:
            split.comm += c
            spread(block_comm, built.block_of.get(edge.dst, ""), c)
    for cond in problem.conditional_costs:  # collectives feeding a recomputed node, run again
        if solution.choice[cond.when_node] in cond.when:
            c = cond.cost[solution.choice[cond.src]][solution.choice[cond.dst]]
            split.comm += c
            spread(block_comm, built.block_of.get(cond.dst, ""), c)
    for shared in problem.shared_costs:  # a value resharded once for all the projections reading it
        if shared.applies(solution.choice):
            c = shared.cost[solution.choice[shared.src]]
            split.comm += c
            spread(block_comm, built.block_of.get(shared.members[0][0], ""), c)


def _split_overlaps(split: _TimeSplit, built: BuiltProblem, solution: Solution) -> None:
    """The data-parallel synchronisation: what compute does not hide is communication, the rest hidden. The
    host's stream (:func:`~.pricing.compute.host_stream_overlaps`): what the device does not hide is compute
    (the step waits for the host to issue its ops), the rest is not reported."""
    problem = built.problem
    for overlap in problem.overlaps:
        exposed = overlap.exposed(problem, solution.choice)
        total = overlap.totals(problem, solution.choice)[0]
        host = overlap.name.startswith(HOST_STREAM)
        if host:
            split.compute += exposed
        else:
            split.hidden += total - exposed
            split.comm += exposed
        target = split.block_compute if host else split.block_comm
        for k, seconds in overlap_parts(problem, overlap, solution.choice):
            if total > 0:
                split.spread(target, built.block_of.get(k, ""), exposed * seconds / total)


def _param_placements(
    built: BuiltProblem, solution: Solution, graph: StepGraph, tied: TiedGraph, dp_mode: str
) -> dict[str, list[str]]:
    """Every parameter's placement ``[over dp, over tp]``: its canonical copy's storage choice on the
    tensor-parallel axis; sharded over dp under a sharded mode, or as an expert split over dp."""
    tp_place: dict[str, str] = {}
    for pname, fqn in built.param_of_node.items():
        tp_place[fqn] = built.param_options[pname][solution.choice[pname]]
    dp_place = "S0" if dp_mode in SHARDED_DP_MODES else "R"
    param_placements = {}
    for fqn in graph.param_names:
        canon = tied.canonical_param(fqn)
        over_dp = "S0" if canon in built.expert_dp_params else dp_place  # experts sharded over dp
        param_placements[fqn] = [over_dp, tp_place.get(canon, "R")]
    return param_placements


def _block_costs(
    context: WriteupContext,
    built: BuiltProblem,
    solution: Solution,
    tied: TiedGraph,
    mesh: tuple[int, int],
    split: _TimeSplit,
    param_placements: dict[str, list[str]],
    recompute: dict[str, str],
) -> list[BlockCost]:
    """The per-block table: each depth unit's compute, communication and recompute seconds, activation bytes at
    the peak, parameter placements and recompute option, in the model's order."""
    graph, unit_of = context.graph, split.unit_of
    blocks: list[BlockCost] = []
    per_unit_params: dict[str, dict[str, str]] = defaultdict(dict)
    for fqn in graph.param_names:
        per_unit_params[unit_of(fqn.rsplit(".", 1)[0])][fqn] = param_placements[fqn][1]
    act_per_unit = _activation_per_unit(built, solution, graph, tied, unit_of, mesh[1])
    for unit in _unit_order(context.model, unit_of):
        if unit not in split.block_compute and unit not in split.block_comm and unit not in per_unit_params:
            continue
        blocks.append(
            BlockCost(
                name=unit,
                compute_s=split.block_compute.get(unit, 0.0),
                communication_s=split.block_comm.get(unit, 0.0),
                memory_bytes=int(act_per_unit.get(unit, 0)),
                placements=per_unit_params.get(unit, {}),
                recompute=recompute.get(unit, "none"),
                recompute_s=split.block_rerun.get(unit, 0.0),
            )
        )
    return blocks


def _param_and_activation_bytes(built: BuiltProblem, solution: Solution) -> tuple[float, float]:
    """Per-device bytes of parameters (with gradients, optimizer state and its temporaries: the optimizer step's
    row) and of everything else at the solution's higher phase peak (:func:`_peak_row`)."""
    problem = built.problem
    param_mem = 0.0
    at_peak_params = 0.0
    optimizer_row = problem.memory_constraint(memory_row_name(MemoryRow.OPTIMIZER_STEP))
    peak_row = _peak_row(problem, solution)
    for pname in built.param_options:
        node = problem.node(pname)
        terms = optimizer_row.terms.get(pname)
        if terms:
            param_mem += terms[solution.choice[pname]] * node.multiplicity
        peak_terms = peak_row.terms.get(pname)
        if peak_terms:
            at_peak_params += peak_terms[solution.choice[pname]] * node.multiplicity
    act_mem = memory_usage(problem, solution.choice)[peak_row.name] - at_peak_params
    return param_mem, act_mem


def _peak_row(problem: Problem, solution: Solution) -> MemoryConstraint:
    """Of the rows at the highest point of forward and of backward (``activation-peak``, ``phase-peak:<phase>``),
    the one the solution needs most at: the step's highest point before sharding need not be after it."""
    usage = memory_usage(problem, solution.choice)
    rows = [
        c for c in problem.memory_constraints if c.kind in (MemoryRow.ACTIVATION_PEAK, MemoryRow.PHASE_PEAK)
    ]
    return max(rows, key=lambda c: usage[c.name])  # the activation peak on a tie: it comes first


def _expert_dp_labels(labels: dict[str, str], expert_dp: list[str], dp: int) -> dict[str, str]:
    """The MoE layer labels, those run expert-parallel over the data-parallel axis named so
    (``experts: EP×2 (dp)``)."""
    return {fqn: f"experts: EP×{dp} (dp)" if fqn in expert_dp else label for fqn, label in labels.items()}


def _memory_moments(problem, solution: Solution) -> list[list[Any]]:
    """Per-device bytes at each moment the ILP constrains, in step order (the activation peak first: it is
    wherever forward and backward peak; then the other phase's peak; then each recomputed block's backward, last
    block first; then the optimizer step)."""
    usage = memory_usage(problem, solution.choice)
    rows = problem.memory_constraints
    order = [c.name for c in rows if c.kind in (MemoryRow.ACTIVATION_PEAK, MemoryRow.PHASE_PEAK)]
    order += [c.name for c in rows if c.kind in (MemoryRow.RERUN, MemoryRow.RECOMPUTE)]
    order += [c.name for c in rows if c.name not in order]
    return [[name, float(usage[name])] for name in order]


def _copies_not_rep(graph: StepGraph) -> list[str]:
    return [b for run in graph.block_runs for b in run.traced if b != run.representative]


def _real_modules(graph: StepGraph, module: str) -> list[str]:
    """A representative's module stands for the same module in every block of its run."""
    for run in graph.block_runs:
        rep = run.representative
        if module == rep or module.startswith(rep + "."):
            return [b + module[len(rep) :] for b in run.all_blocks]
    return [module]


def _unit_mapper(model: nn.Module):
    names = [n for n, _ in model.named_modules()]
    mapping = block_units(names, _module_list_children(model))

    def unit_of(module: str) -> str:
        while module and module not in mapping:
            module = module.rsplit(".", 1)[0] if "." in module else ""
        return mapping.get(module, module)

    return unit_of


def _unit_order(model: nn.Module, unit_of) -> list[str]:
    seen: dict[str, None] = {}
    for name, _ in model.named_modules():
        seen.setdefault(unit_of(name), None)
    return list(seen)


def _activation_per_unit(
    built, solution, graph, tied, unit_of, tp, row: str | None = None
) -> dict[str, float]:
    """Activation bytes per depth unit at the moment of memory row ``row`` (default the activation peak), the
    recompute choice applied."""
    out: dict[str, float] = defaultdict(float)
    constraint = built.problem.memory_constraint(row or memory_row_name(MemoryRow.ACTIVATION_PEAK))

    def add(name: str, per_copy: float) -> None:
        module = graph.nodes[built.node_of_name[name]].module
        reals = _real_modules(graph, module)
        for real in reals:
            out[unit_of(real)] += per_copy / len(reals)

    for name in built.strategies:
        t = constraint.terms.get(name)
        if t:
            # terms are per real block; the constraint multiplies them by the node's multiplicity
            add(name, t[solution.choice[name]] * built.problem.node(name).multiplicity)
    for (src, dst), matrix in constraint.edge_terms.items():
        if src in built.recompute_options:
            add(dst, matrix[solution.choice[src]][solution.choice[dst]])
    return out


def forward_peak_row(problem: Problem) -> str:
    """The name of the memory row at the forward's highest point: the end of forward, where every block holds
    what it keeps for backward (the other phase's row when the step's highest point is in its backward, where
    the blocks whose backward has run hold nothing)."""
    forward = memory_row_name(MemoryRow.PHASE_PEAK, "forward")
    if any(c.name == forward for c in problem.memory_constraints):
        return forward
    return memory_row_name(MemoryRow.ACTIVATION_PEAK)


def _recompute_choice(built: BuiltProblem, solution: Solution) -> dict[str, str]:
    """Block FQN -> the recompute option chosen for it."""
    out: dict[str, str] = {}
    for rc, unit in built.recompute_units.items():
        option = built.recompute_options[rc][solution.choice[rc]].name
        for block in unit.blocks:
            out[block] = option
    return out


def _module_output_placements(built, solution, graph, tied, mesh) -> dict[str, list[str]]:
    """Module FQN -> placement per mesh axis of the module's forward output: the output of the *last* forward
    op run inside the module or any of its children (what the module returns; a module ending in a child's
    op returns that child's output). The runtime redistributes module outputs to these placements, so that
    redistributions happen where autograd sees them, as the planner's edges price them."""
    copies = tuple(f"{c}." for c in _copies_not_rep(graph))
    # a module inside a traced copy is left out: the representative decides for it
    last = {m: i for m, i in last_forward_ops(graph, tied).items() if not (m + ".").startswith(copies)}
    dp_place = "S0" if mesh[0] > 1 else "R"
    out: dict[str, list[str]] = {}
    for module, i in sorted(last.items()):
        name = _node_name(tied.canonical[i])
        if name not in built.strategies:
            continue
        strat = built.strategies[name][solution.choice[name]]
        if strat.output_placements:
            tp_place = reduced_where_read(
                built, solution, graph, tied, module, i, strat.output_placements[0][0]
            )
            for real in _real_modules(graph, module):
                out[real] = [dp_place, tp_place]
    return out


def _param_use_placements(built, solution, graph, tied, model: nn.Module) -> dict[str, list[str]]:
    """``<module FQN>.<attr>`` -> the placement (per mesh axis) the plan's strategy needs a parameter in where
    that module uses it, for the uses that differ from the parameter's storage placement (the solver chose to
    gather a sharded weight, or to slice a replicated one). Keyed by the using module so that tied parameters
    (an embedding and a head) can be used differently. Conflicting uses inside one module are left out (the
    runtime then lets DTensor choose)."""
    aliases = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    uses: dict[str, set[str]] = defaultdict(set)
    storage: dict[str, str] = {}
    copies = tuple(f"{c}." for c in _copies_not_rep(graph))
    readers: dict[int, list[tuple[int, int]]] = defaultdict(list)
    for i in tied.canonical:
        for k, vid in enumerate(graph.nodes[i].inputs):
            readers[vid].append((i, k))

    def strategy(i: int):
        name = _node_name(tied.canonical[i])
        return built.strategies[name][solution.choice[name]]

    def use_placement(i: int, k: int) -> str | None:
        """Where input ``k`` of node ``i`` is needed; through a view (``t`` of a weight) the placement its
        readers need: a gathered view is a gathered parameter."""
        strat = strategy(i)
        if k >= len(strat.input_placements) or strat.input_placements[k] is None:
            return None
        own = strat.input_placements[k][0]
        node = graph.nodes[i]
        if node.is_view and len(node.outputs) == 1 and readers.get(node.outputs[0]):
            after = {use_placement(j, kk) for j, kk in readers[node.outputs[0]]}
            if after == {"R"}:
                return "R"
        return own

    for i in sorted(tied.canonical):
        node = graph.nodes[i]
        if (node.module + ".").startswith(copies):
            continue
        for k, vid in enumerate(node.inputs):
            value = graph.values[vid]
            if value.kind.value != "param" or value.name is None:
                continue
            pname = _param_node_name(tied.canonical_param(value.name))
            use = use_placement(i, k)
            if pname not in built.param_options or use is None:
                continue
            stored = built.param_options[pname][solution.choice[pname]]
            attr = value.name.rsplit(".", 1)[-1]
            for real in _real_modules(graph, node.module):
                key = f"{real}.{attr}" if real else attr
                if key in aliases:
                    uses[key].add(use)
                    storage[key] = stored
    out: dict[str, list[str]] = {}
    for key, placements in sorted(uses.items()):
        if len(placements) > 1:
            logger.debug("parameter %s is used in %s by one module; left to DTensor", key, sorted(placements))
            continue
        (use,) = placements
        if use != storage[key] and use != "P":
            out[key] = ["R", use]
    return out
