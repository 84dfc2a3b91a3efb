"""The Plan a solved ILP becomes, with its predictions: step time split into compute, exposed communication and
recompute (per block), per-device memory at each constrained moment, the collectives it will issue (counts and
bytes, for the fidelity tests), and the placements the runtime enforces.

Split from :mod:`.planner` (which searches meshes and modes) so that where one predicted figure is made can be
found in one place.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..capture.graph import StepGraph
from ..capture.moe import MEASURED_LOAD, UNIFORM_LOAD, experts_modules, is_moe_model
from ..hardware.skew import sync_wait
from ..plan import BlockCost, Plan
from ..profile.profiler import _module_list_children, block_units
from ..strategies import ops_without_dtensor_rule
from ..strategies.moe import moe_layer_choices
from ..strategies.placements import is_shard
from .builder import (
    EXPERT_DP_NODE,
    BuiltProblem,
    TiedGraph,
    _node_name,
    _param_node_name,
    boundary_reshardings,
    differentiable_values,
    forward_producers,
    shared_projection_inputs,
    view_root,
    viewed_param,
)
from .cost_model import (
    SHARDED_DP_MODES,
    gradient_at_consumer,
    gradient_at_producer,
    redistribute,
    splits_work,
)
from .problem import Solution, evaluate, memory_usage

if TYPE_CHECKING:
    from .planner import _Planner

logger = logging.getLogger(__name__)


def _make_plan(
    planner: _Planner, mesh: tuple[int, int], dp_mode: str, built: BuiltProblem, solution: Solution
) -> Plan:
    micro = built.micro_batches
    graph = planner.graph(mesh[0], micro)
    tied = TiedGraph.build(graph)
    problem = built.problem
    objective, peak, _ = evaluate(problem, solution.choice)
    tp_comm = planner.axis_comm(mesh, 1)
    # split the objective into compute and communication
    compute = 0.0
    comm = 0.0
    block_compute: dict[str, float] = defaultdict(float)
    block_comm: dict[str, float] = defaultdict(float)

    unit_of = _unit_mapper(planner.model)

    def spread(target: dict[str, float], module: str, cost: float) -> None:
        """A tied node's cost is shared by the same module in every block it stands for."""
        reals = _real_modules(graph, module)
        for real in reals:
            target[unit_of(real)] += cost / len(reals)

    for node in problem.nodes:
        i = solution.choice[node.name]
        cost = node.costs[i] * node.multiplicity
        module = built.block_of.get(node.name, "")
        if node.name == EXPERT_DP_NODE:  # the exchange of expert parallelism over dp, per layer
            comm += cost
            layers = sum(e.layers for e in built.expert_data_parallel.values())
            for m, exchange in built.expert_data_parallel.items():
                spread(block_comm, m, cost * exchange.layers / layers)
        elif node.name in built.param_options:  # its share of the optimizer step
            compute += cost
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
                            graph, graph.nodes[built.node_of_name[node.name]], strat, 0, tp_comm
                        )
                        if strat is not None
                        else ()
                    )
                )
            )
            compute += cost - boundary
            spread(block_compute, module, cost - boundary)
            comm += boundary
            spread(block_comm, module, boundary)
    rerun = 0.0
    block_rerun: dict[str, float] = defaultdict(float)
    for edge in problem.edges:
        c = edge.cost[solution.choice[edge.src]][solution.choice[edge.dst]] * edge.multiplicity
        if edge.src in built.recompute_options:  # the forward a recomputed node runs again
            rerun += c
            spread(block_rerun, built.block_of.get(edge.dst, ""), c)
        else:
            comm += c
            spread(block_comm, built.block_of.get(edge.dst, ""), c)
    for cond in problem.conditional_costs:  # collectives feeding a recomputed node, run again
        if solution.choice[cond.when_node] in cond.when:
            c = cond.cost[solution.choice[cond.src]][solution.choice[cond.dst]]
            comm += c
            spread(block_comm, built.block_of.get(cond.dst, ""), c)
    for shared in problem.shared_costs:  # a value resharded once for all the projections reading it
        if shared.applies(solution.choice):
            c = shared.cost[solution.choice[shared.src]]
            comm += c
            spread(block_comm, built.block_of.get(shared.members[0][0], ""), c)
    hidden = 0.0
    for overlap in problem.overlaps:  # data-parallel synchronisation: what compute does not hide
        exposed = overlap.exposed(problem, solution.choice)
        total = sum(problem.node(k).multiplicity * v[solution.choice[k]] for k, v in overlap.comm.items())
        hidden += total - exposed
        comm += exposed
        for k, values in overlap.comm.items():
            if total > 0:
                share = problem.node(k).multiplicity * values[solution.choice[k]] / total
                spread(block_comm, built.block_of.get(k, ""), exposed * share)
    recompute = _recompute_choice(built, solution)
    expert_dp = sorted(experts_modules(planner.model)) if built.expert_data_parallel else []
    # placements
    tp_place: dict[str, str] = {}
    for pname, fqn in built.param_of_node.items():
        tp_place[fqn] = built.param_options[pname][solution.choice[pname]]
    dp_place = "S0" if dp_mode in SHARDED_DP_MODES else "R"
    param_placements = {}
    for fqn in graph.param_names:
        canon = tied.canonical_param(fqn)
        over_dp = "S0" if canon in built.expert_dp_params else dp_place  # experts sharded over dp
        param_placements[fqn] = [over_dp, tp_place.get(canon, "R")]
    activation_placements = _module_output_placements(built, solution, graph, tied, mesh)
    # per-block table
    blocks: list[BlockCost] = []
    per_unit_params: dict[str, dict[str, str]] = defaultdict(dict)
    for fqn in graph.param_names:
        per_unit_params[unit_of(fqn.rsplit(".", 1)[0])][fqn] = param_placements[fqn][1]
    act_per_unit = _activation_per_unit(built, solution, graph, tied, unit_of, mesh[1])
    for unit in _unit_order(planner.model, unit_of):
        if unit not in block_compute and unit not in block_comm and unit not in per_unit_params:
            continue
        blocks.append(
            BlockCost(
                name=unit,
                compute_s=block_compute.get(unit, 0.0),
                communication_s=block_comm.get(unit, 0.0),
                memory_bytes=int(act_per_unit.get(unit, 0)),
                placements=per_unit_params.get(unit, {}),
                recompute=recompute.get(unit, "none"),
                recompute_s=block_rerun.get(unit, 0.0),
            )
        )
    predicted = _collective_prediction(built, solution, graph, tied, mesh, planner, dp_mode)
    sync_wait_s = _sync_wait(planner.spec, built, solution, graph, tied, mesh, predicted)
    collectives = dict(predicted.counts)
    for kind, count in _recompute_collectives(built, solution, graph, tied, mesh, planner).items():
        collectives[kind] = round(collectives.get(kind, 0.0) + micro * count, 6)
    param_mem = 0.0
    at_peak_params = 0.0
    for pname in built.param_options:
        node = problem.node(pname)
        terms = problem.memory_constraints[1].terms.get(pname)
        if terms:
            param_mem += terms[solution.choice[pname]] * node.multiplicity
        peak_terms = problem.memory_constraints[0].terms.get(pname)
        if peak_terms:
            at_peak_params += peak_terms[solution.choice[pname]] * node.multiplicity
    act_mem = memory_usage(problem, solution.choice)["activation-peak"] - at_peak_params
    return Plan(
        model_class=graph.model_class,
        num_devices=planner.cluster.num_devices,
        device=planner.spec.name,
        mesh_shape=tuple(mesh),
        mesh_axis_names=("dp", "tp"),
        dp_mode=dp_mode,
        dp_shard_size=built.dp_shard_size,
        param_placements=param_placements,
        param_shapes={
            fqn: list(p.shape)
            for fqn, p in planner.model.named_parameters(remove_duplicate=False)
            if fqn in param_placements
        },
        activation_placements=activation_placements,
        moe_layers=_expert_dp_labels(
            moe_layer_choices(
                planner.model,
                param_placements,
                mesh[1],
                _param_use_placements(built, solution, graph, tied, planner.model),
            ),
            expert_dp,
            mesh[0],
        ),
        expert_data_parallel=expert_dp,
        moe_load=(MEASURED_LOAD if planner.routing is not None else UNIFORM_LOAD)
        if is_moe_model(planner.model)
        else "",
        moe_routing=(
            {fqn: list(c) for fqn, c in planner.routing.rows_per_expert.items()}
            if planner.routing is not None
            else {}
        ),
        replicated_ops=ops_without_dtensor_rule(graph),
        global_batch_size=planner.batch,
        micro_batches=micro,
        input_shapes={k: list(v.shape) for k, v in planner.inputs.items() if isinstance(v, torch.Tensor)},
        step_time_s=objective + sync_wait_s,
        compute_time_s=compute,
        communication_time_s=comm,
        recompute_time_s=rerun,
        memory_moments=_memory_moments(problem, solution),
        overlapped_communication_s=hidden,
        sync_wait_s=sync_wait_s,
        peak_memory_bytes=int(peak),
        memory_budget_bytes=planner.budget,
        param_memory_bytes=int(param_mem),
        activation_memory_bytes=int(act_mem),
        blocks=blocks,
        collectives=collectives,
        recompute=recompute,
        param_use_placements=_param_use_placements(built, solution, graph, tied, planner.model),
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


def _sync_wait(spec, built, solution, graph, tied, mesh, predicted: _CollectivePrediction) -> float:
    """Seconds a rank waits per step for the slowest of its peers (:func:`~..hardware.skew.sync_wait`).

    The step is walked in order — forward nodes, then their backward in reverse, every folded block as many
    times as it stands for — summing each node's time under the solution into the current segment; a
    tensor-parallel collective (:class:`_CollectivePrediction` sync points) closes a segment among the
    ``tp`` ranks. The data-parallel gradient synchronisation closes the last one among all ranks: with
    ``tp = 1`` that is the whole step (k micro-batches and the optimizer step that starts the next). A node's
    time splits into forward and backward by its module's backward ratio. FSDP's per-block all-gathers are
    prefetched a block ahead and not counted as synchronisations."""
    dp, tp = mesh
    if spec.rank_skew_s <= 0 or dp * tp < 2:
        return 0.0
    problem = built.problem
    micro = built.micro_batches
    ratios = built.backward_ratios
    forward: list[tuple[float, bool]] = []
    backward: list[tuple[float, bool]] = []
    group: list[int] = []

    def flush() -> None:
        copies = tied.weight[group[0]] if group else 0
        for _ in range(copies):
            for v in group:
                name = _node_name(tied.canonical[v])
                total = problem.node(name).costs[solution.choice[name]] / micro
                back = ratios.backward_share(graph.nodes[v].module)
                forward.append((total * (1 - back), v in predicted.forward_syncs))
                backward.append((total * back, v in predicted.backward_syncs))
        group.clear()

    for v in sorted(tied.canonical):  # runs of one folded copy repeat together
        if group and (tied.weight[v], tied.copy_prefix.get(v)) != (
            tied.weight[group[0]],
            tied.copy_prefix.get(group[0]),
        ):
            flush()
        group.append(v)
    flush()
    optimizer = sum(
        problem.node(p).costs[solution.choice[p]] * problem.node(p).multiplicity for p in built.param_options
    )
    wait, segment = 0.0, 0.0
    for seconds, syncs in [*forward, *reversed(backward)]:
        segment += seconds
        if syncs and tp > 1:
            wait += sync_wait(spec, segment, tp)
            segment = 0.0
    wait *= micro
    if dp > 1:
        last = segment * micro if tp == 1 else segment
        wait += sync_wait(spec, last + optimizer, dp)
    return wait


def _expert_dp_labels(labels: dict[str, str], expert_dp: list[str], dp: int) -> dict[str, str]:
    """The MoE layer labels, those run expert-parallel over the data-parallel axis named so
    (``experts: EP×2 (dp)``)."""
    return {fqn: f"experts: EP×{dp} (dp)" if fqn in expert_dp else label for fqn, label in labels.items()}


def _memory_moments(problem, solution: Solution) -> list[list[Any]]:
    """Per-device bytes at each moment the ILP constrains, in step order (the activation peak first: it is
    wherever forward and backward peak; then each recomputed block's backward, last block first; then the
    optimizer step)."""
    usage = memory_usage(problem, solution.choice)
    names = [c.name for c in problem.memory_constraints]
    order = [n for n in names if n == "activation-peak"]
    order += [n for n in names if n.startswith(("rerun:", "recompute:"))]
    order += [n for n in names if n not in order]
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


def _activation_per_unit(built, solution, graph, tied, unit_of, tp) -> dict[str, float]:
    """Activation bytes at the peak per depth unit (the recompute choice applied)."""
    out: dict[str, float] = defaultdict(float)
    constraint = built.problem.memory_constraints[0]

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


def _recompute_choice(built: BuiltProblem, solution: Solution) -> dict[str, str]:
    """Block FQN -> the recompute option chosen for it."""
    out: dict[str, str] = {}
    for rc, unit in built.recompute_units.items():
        option = built.recompute_options[rc][solution.choice[rc]].name
        for block in unit.blocks:
            out[block] = option
    return out


def _value_source(built, solution, graph, tied, producer, vid: int) -> tuple[str, bool] | None:
    """Tensor-parallel placement a value is made in under ``solution`` (a parameter's storage, or its
    producer's output), and whether it is a parameter; None for values the ILP does not place (inputs)."""
    value = graph.values[vid]
    if value.name is not None and value.kind.value == "param":
        pname = _param_node_name(tied.canonical_param(value.name))
        if pname not in built.param_options:
            return None
        return built.param_options[pname][solution.choice[pname]], True
    if vid in producer and producer[vid][0] in tied.canonical:
        u_idx, pos = producer[vid]
        u_name = _node_name(tied.canonical[u_idx])
        return built.strategies[u_name][solution.choice[u_name]].output_placements[pos][0], False
    return None


def _recompute_collectives(built, solution, graph, tied, mesh, planner) -> dict[str, float]:
    """Forward collectives run again because the node they feed is recomputed in backward."""
    counts: dict[str, float] = defaultdict(float)
    tp_comm = planner.axis_comm(mesh, 1)
    rerun = {
        built.node_of_name[name]
        for rc, unit in built.recompute_units.items()
        for name in (_node_name(c) for c in unit.nodes)
        if unit.reruns(
            built.recompute_options[rc][solution.choice[rc]], graph.nodes[built.node_of_name[name]]
        )
    }
    if not rerun:
        return {}
    producer = forward_producers(graph)
    for v_idx in sorted(tied.canonical):
        v_c = tied.canonical[v_idx]
        if v_c not in rerun:
            continue
        v_name = _node_name(v_c)
        strat = built.strategies[v_name][solution.choice[v_name]]
        for k, vid in enumerate(graph.nodes[v_idx].inputs):
            made = _value_source(built, solution, graph, tied, producer, vid)
            if made is None:
                continue
            src, is_param = made
            if not is_param and _node_name(tied.canonical[producer[vid][0]]) == v_name:
                continue
            spec = strat.input_placements[k] if k < len(strat.input_placements) else None
            dst = spec[0] if spec is not None else src
            _, kind = redistribute(src, dst, graph.values[vid].nbytes, tp_comm)
            if kind:
                counts[kind] += tied.weight[v_idx]
    return dict(counts)


def _ancestors(module: str) -> list[str]:
    """``a.b.c`` -> ``["a.b.c", "a.b", "a"]`` (the root ``""`` excluded: its output is the model's output)."""
    parts = module.split(".") if module else []
    return [".".join(parts[:n]) for n in range(len(parts), 0, -1)]


def _module_output_placements(built, solution, graph, tied, mesh) -> dict[str, list[str]]:
    """Module FQN -> placement per mesh axis of the module's forward output: the output of the *last* forward
    op run inside the module or any of its children (what the module returns; a module ending in a child's
    op returns that child's output). The runtime redistributes module outputs to these placements, so that
    redistributions happen where autograd sees them, as the planner's edges price them."""
    copies = tuple(f"{c}." for c in _copies_not_rep(graph))
    last: dict[str, int] = {}
    for i in sorted(tied.canonical):
        n = graph.nodes[i]
        if not n.outputs:
            continue
        for module in _ancestors(n.module):
            if (module + ".").startswith(copies):
                continue  # inside a traced copy: the representative decides for it
            last[module] = i
    dp_place = "S0" if mesh[0] > 1 else "R"
    out: dict[str, list[str]] = {}
    for module, i in sorted(last.items()):
        name = _node_name(tied.canonical[i])
        if name not in built.strategies:
            continue
        strat = built.strategies[name][solution.choice[name]]
        if strat.output_placements:
            for real in _real_modules(graph, module):
                out[real] = [dp_place, strat.output_placements[0][0]]
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


def _given_bytes(kind: str, size: float, tp: int) -> float:
    """Bytes of the tensor one rank hands a collective over a value of ``size`` logical bytes: its shard for an
    all-gather, the whole value for an all-reduce or a reduce-scatter (what CommDebugMode-style counting sees)."""
    return size / tp if kind in ("all_gather", "all_to_all") else size


@dataclass
class _CollectivePrediction:
    counts: dict[str, float]
    """Collectives per step by kind."""
    nbytes: dict[str, float]
    """Bytes each rank hands them per step, by kind (:func:`_given_bytes`)."""
    forward_syncs: set[int]
    """Forward nodes at which a tensor-parallel collective runs in forward (the ranks synchronise there)."""
    backward_syncs: set[int]
    """Forward nodes whose backward runs a tensor-parallel collective."""


def _collective_prediction(built, solution, graph, tied, mesh, planner, dp_mode) -> _CollectivePrediction:
    """Predicted collectives per step, by kind: how many, and the bytes each rank hands them (:func:`_given_bytes`);
    and where in the step the tensor-parallel ones synchronise the ranks (:func:`_sync_wait`).

    Tensor-parallel: the forward resharding of every edge of the solution, and the backward resharding of its
    gradient. A *partial* gradient is not reduced where it is made: it passes back through views (a linear's
    flattening of its input) and sums with the other contributions to the value they view, and is reduced
    once there (what the runtime's boundary hooks and autograd's accumulation do): q, k and v projections of
    one normed input cost one all-reduce. Data-parallel: one gradient synchronisation per trained parameter (counted,
    its bytes not: they depend on the tensor-parallel shard each replica holds). With k micro-batches the
    tensor-parallel collectives and FSDP's all-gathers run k times, the gradient synchronisation once.
    """
    counts: dict[str, float] = defaultdict(float)
    nbytes: dict[str, float] = defaultdict(float)
    dp, tp = mesh
    producer = forward_producers(graph)
    tp_comm = planner.axis_comm(mesh, 1)

    def source(vid: int) -> tuple[str, bool] | None:
        return _value_source(built, solution, graph, tied, producer, vid)

    partial_roots: dict[int, int] = {}
    forward_syncs: set[int] = set()
    backward_syncs: set[int] = set()
    shared_uses = shared_projection_inputs(graph, tied)
    grads = differentiable_values(graph)
    shared_copies: dict[tuple[int, str, str, str], int] = {}
    for v_idx in sorted(tied.canonical):
        w = tied.weight[v_idx]
        v_name = _node_name(tied.canonical[v_idx])
        strat = built.strategies[v_name][solution.choice[v_name]]
        for k, vid in enumerate(graph.nodes[v_idx].inputs):
            made = source(vid)
            if made is None:
                continue
            src, is_param = made
            if not is_param and _node_name(tied.canonical[producer[vid][0]]) == v_name:
                continue
            size = graph.values[vid].nbytes
            spec = strat.input_placements[k] if k < len(strat.input_placements) else None
            dst = spec[0] if spec is not None else src
            if (v_idx, k) in shared_uses:
                # one copy per parent module and target placement, for all the sibling projections reading it
                shared_copies[(vid, shared_uses[(v_idx, k)], src, dst)] = w
                if redistribute(src, dst, size, tp_comm)[1]:
                    forward_syncs.add(v_idx)
            else:
                _, kind = redistribute(src, dst, size, tp_comm)
                if kind:
                    counts[kind] += w
                    nbytes[kind] += w * _given_bytes(kind, size, tp)
                    forward_syncs.add(v_idx)
            if vid not in grads:
                continue  # no gradient flows back to it
            ins = tuple(p[0] if p is not None else None for p in strat.input_placements)
            outs = tuple(p[0] for p in strat.output_placements)
            grad_from = gradient_at_consumer(dst, splits_work(ins, outs))
            if grad_from == "P" and not is_param:
                partial_roots[view_root(graph, tied, producer, vid)] = (
                    w  # reduced once where the viewed value was made
                )
                continue
            grad_to = src if is_param and is_shard(src) else gradient_at_producer(src)
            _, kind = redistribute(grad_from, grad_to, size, tp_comm)
            if kind:
                counts[kind] += w
                nbytes[kind] += w * _given_bytes(kind, size, tp)
                backward_syncs.add(v_idx)
        for _seconds, kind, size in boundary_reshardings(graph, graph.nodes[v_idx], strat, 0, tp_comm):
            counts[kind] += w
            nbytes[kind] += w * _given_bytes(kind, size, tp)
            forward_syncs.add(v_idx)
    for (vid, _parent, src, dst), w in shared_copies.items():
        _, kind = redistribute(src, dst, graph.values[vid].nbytes, tp_comm)
        if kind:
            counts[kind] += w
            nbytes[kind] += w * _given_bytes(kind, graph.values[vid].nbytes, tp)
    for vid, w in partial_roots.items():
        # a view of a parameter (a gathered weight's transpose): reduced to the parameter's storage placement
        pvid = viewed_param(graph, tied, producer, vid)
        made = source(pvid) if pvid is not None else None
        src, is_param = made if made is not None else source(vid)
        grad_to = src if is_param and is_shard(src) else gradient_at_producer(src)
        _, kind = redistribute("P", grad_to, graph.values[vid].nbytes, tp_comm)
        if kind:
            counts[kind] += w
            nbytes[kind] += w * _given_bytes(kind, graph.values[vid].nbytes, tp)
            if vid in producer:
                backward_syncs.add(producer[vid][0])
    micro = built.micro_batches
    counts = defaultdict(float, {kind: micro * c for kind, c in counts.items()})
    nbytes = defaultdict(float, {kind: micro * b for kind, b in nbytes.items()})
    if dp > 1:
        # experts sharded over dp are neither all-reduced (DDP) nor gathered and reduce-scattered (FSDP, which
        # leaves them out): their exchange's collectives instead (with bytes)
        experts = {fqn for fqn in graph.param_names if tied.canonical_param(fqn) in built.expert_dp_params}
        n_params = len(graph.param_names) - len(experts)
        n_trained = sum(1 for fqn in graph.param_names if graph.is_trainable(fqn) and fqn not in experts)
        if dp_mode in SHARDED_DP_MODES:
            counts["dp_all_gather"] += 2 * micro * n_params
            counts["dp_reduce_scatter"] += n_trained
        else:
            counts["dp_all_reduce"] += n_trained
        for exchange in built.expert_data_parallel.values():
            for kind, given, _priced in exchange.collectives:
                counts[f"dp_{kind}"] += micro * exchange.layers
                nbytes[f"dp_{kind}"] += micro * exchange.layers * given
    if dp > 1 and dp_mode == "hsdp":  # HSDP all-reduces each reduce-scattered shard over the replicate group
        counts["dp_all_reduce"] += counts["dp_reduce_scatter"]
    return _CollectivePrediction(
        counts={k: round(v, 6) for k, v in sorted(counts.items())},
        nbytes={k: round(v, 6) for k, v in sorted(nbytes.items())},
        forward_syncs=forward_syncs,
        backward_syncs=backward_syncs,
    )
