"""``plan_model`` and ``evaluate_plan``: search meshes and data-parallel modes, solve, and write the Plan.

For N devices every mesh ``(dp, tp)`` with ``dp * tp = N`` is tried (the 1-D meshes are ``(N, 1)`` and
``(1, N)``), each with DDP and, when ``dp > 1``, FSDP on the data-parallel axis; the fastest plan that fits
the memory budget wins. The data-parallel axis is the outer mesh axis, so with several nodes it is the one
that crosses nodes (:class:`hf_colossal_auto.hardware.ClusterSpec` prices it on the inter-node link).

Baselines are the same ILP with parameter placements pinned, priced by the same cost model:

* ``"ddp"``: mesh ``(N, 1)``, DDP;  ``"fsdp"``: mesh ``(N, 1)``, FSDP;
* ``"megatron"``: mesh ``(N / t, t)`` with ``t`` the largest tensor-parallel size up to the devices of one
  node that divides the heads, attention and MLP column-then-row (as Megatron-LM and HF's
  ``base_model_tp_plan``s do; GPT-2's fused ``c_attn`` Conv1D packed the same way), embeddings and head
  replicated;
* a HF-style tp_plan dict (``{"layers.*.mlp.up_proj": "colwise", ...}``) on the tensor-parallel size you
  give with ``mesh_shape``.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import logging
import math
import time
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..capture.graph import Phase, StepGraph
from ..capture.tracer import trace_training_step
from ..hardware import ClusterSpec, DeviceSpec, get_device
from ..hardware.catalog import memory_budget_default
from ..hardware.roofline import host_time
from ..plan import BlockCost, Plan
from ..profile.profiler import _module_list_children, block_units
from ..strategies import enumerate_strategies
from ..strategies.placements import is_shard
from ..units import format_bytes, parse_bytes
from .builder import (
    BuiltProblem,
    TiedGraph,
    _node_name,
    _param_node_name,
    boundary_reshardings,
    build_problem,
    differentiable_values,
    forward_producers,
    shared_projection_inputs,
    view_root,
)
from .cost_model import (
    AxisComm,
    gradient_at_consumer,
    gradient_at_producer,
    redistribute,
    splits_work,
)
from .ilp import solve
from .problem import InfeasibleError, Solution, evaluate, memory_usage

logger = logging.getLogger(__name__)

BASELINES = ("ddp", "fsdp", "megatron")
RECOMPUTE_MODES = ("auto", "none", "full", "two-stage")
"""``auto``: recompute per block chosen jointly with sharding; ``none``/``full``: fixed for every block;
``two-stage``: shard first ignoring memory, then choose recompute (the baseline the joint ILP beats)."""


@dataclass
class Estimate:
    """The predicted cost of a plan or baseline under our cost model."""

    name: str
    step_time_s: float
    peak_memory_bytes: int
    memory_budget_bytes: int
    mesh_shape: tuple[int, ...]
    dp_mode: str
    plan: Plan | None = None

    @property
    def fits(self) -> bool:
        return self.peak_memory_bytes <= self.memory_budget_bytes


# ---------------------------------------------------------------------------------------------- helpers
def _global_batch(example_inputs: Mapping[str, Any]) -> int:
    sizes = {v.shape[0] for v in example_inputs.values() if isinstance(v, torch.Tensor) and v.dim() > 0}
    if len(sizes) != 1:
        raise ValueError(f"example_inputs must share one batch dimension; got batch sizes {sorted(sizes)}")
    return sizes.pop()


def _local_batch(example_inputs: Mapping[str, Any], dp: int) -> dict[str, Any]:
    out = {}
    for k, v in example_inputs.items():
        if isinstance(v, torch.Tensor) and v.dim() > 0:
            out[k] = v[: v.shape[0] // dp]
        else:
            out[k] = v
    return out


class _Planner:
    """Caches traces (per local batch) and strategies (per trace and tensor-parallel size)."""

    def __init__(
        self,
        model: nn.Module,
        example_inputs: Mapping[str, Any],
        cluster: ClusterSpec,
        budget: int,
        mixed_precision: str | None,
        optimizer: str | None,
        time_limit_s: float,
        recompute: str = "auto",
    ) -> None:
        if recompute not in RECOMPUTE_MODES:
            raise ValueError(f"recompute must be one of {RECOMPUTE_MODES}, got {recompute!r}")
        self.recompute = recompute
        self.model = model
        self.inputs = example_inputs
        self.cluster = cluster
        self.spec = cluster.device
        self.budget = budget
        self.mixed_precision = mixed_precision
        self.optimizer = optimizer
        self.time_limit_s = time_limit_s
        self.batch = _global_batch(example_inputs)
        self._graphs: dict[int, StepGraph] = {}
        self._strategies: dict[tuple[int, int], dict] = {}

    @classmethod
    def for_devices(
        cls,
        model: nn.Module,
        example_inputs: Mapping[str, Any],
        num_devices: int,
        device: str | DeviceSpec,
        devices_per_node: int | None,
        memory_budget: int | str | None,
        mixed_precision: str | None,
        optimizer: str | None,
        time_limit_s: float,
        recompute: str = "auto",
    ) -> _Planner:
        """A planner for the public entry points' arguments (device name, budget string)."""
        spec = get_device(device)
        cluster = ClusterSpec(spec, num_devices, devices_per_node)
        budget = _resolve_budget(memory_budget, spec)
        return cls(
            model, example_inputs, cluster, budget, mixed_precision, optimizer, time_limit_s, recompute
        )

    def graph(self, dp: int) -> StepGraph:
        if dp not in self._graphs:
            self._graphs[dp] = trace_training_step(
                self.model,
                _local_batch(self.inputs, dp),
                mixed_precision=self.mixed_precision,
                optimizer=self.optimizer,
                device_kind=self.spec.kind,
            )
        return self._graphs[dp]

    def strategies(self, dp: int, tp: int) -> dict:
        key = (dp, tp)
        if tp == 1:
            # On a one-device axis every placement is the whole tensor: replicated. DTensor's rules would still
            # offer Shard strategies there, which its view ops then refuse to reshape at run time.
            return {}
        if key not in self._strategies:
            self._strategies[key] = enumerate_strategies(self.graph(dp), (tp,), phases=(Phase.FORWARD,))
        return self._strategies[key]

    def build(
        self,
        mesh: tuple[int, int],
        dp_mode: str,
        fixed_params: dict[str, str] | None = None,
        pin_unlisted: bool = False,
        recompute_pin: str | Mapping[str, str] | None = None,
    ) -> BuiltProblem:
        """The ILP of one mesh; recompute is a decision unless ``recompute_pin`` (or the planner's mode "none" /
        "full") fixes it."""
        if recompute_pin is None and self.recompute in ("none", "full"):
            recompute_pin = self.recompute
        dp, tp = mesh
        graph = self.graph(dp)
        tp_comm = self.axis_comm(mesh, 1)
        dp_comm = self.axis_comm(mesh, 0)
        return build_problem(
            graph,
            self.strategies(dp, tp),
            spec=self.spec,
            mesh_shape=mesh,
            tp_comm=tp_comm,
            dp_comm=dp_comm,
            dp_mode=dp_mode,
            budget=self.budget,
            fixed_params=fixed_params,
            pin_unlisted=pin_unlisted,
            recompute_layers=self.layers,
            recompute_pin=recompute_pin,
        )

    def axis_comm(self, mesh: tuple[int, int], axis: int) -> AxisComm:
        """Collective pricing on one mesh axis. A tensor-parallel resharding is a DTensor redistribution (the
        host pays a DTensor op and the device a launch on top of the alpha-beta time); a data-parallel
        gradient synchronisation is a plain collective (an eager op and a launch)."""
        overhead = self.spec.kernel_overhead_s + host_time(self.spec, dtensor=axis == 1)
        via = "dtensor" if axis == 1 else None
        return AxisComm(mesh[axis], self.cluster.axis_link(mesh, axis), self.spec.kind, overhead, via)

    @property
    def layers(self) -> list[str]:
        """The blocks recompute can be decided for: the model's ``ModuleList`` children."""
        return _module_list_children(self.model)

    def solve_mesh(
        self, mesh: tuple[int, int], dp_mode: str, fixed_params: dict[str, str] | None = None
    ) -> tuple[BuiltProblem, Solution]:
        if self.recompute == "two-stage":
            return self._two_stage(mesh, dp_mode, fixed_params)
        built = self.build(mesh, dp_mode, fixed_params)
        solution = solve(built.problem, time_limit_s=self.time_limit_s)
        return built, solution

    def _two_stage(
        self, mesh: tuple[int, int], dp_mode: str, fixed_params: dict[str, str] | None
    ) -> tuple[BuiltProblem, Solution]:
        """The baseline the joint ILP is measured against: shard for speed ignoring memory (no recompute),
        then choose recompute per block for that sharding under the budget."""
        budget = self.budget
        self.budget = 1 << 62
        try:
            first = self.build(mesh, dp_mode, fixed_params, recompute_pin="none")
        finally:
            self.budget = budget
        sharding = solve(first.problem, time_limit_s=self.time_limit_s).choice
        built = self.build(mesh, dp_mode, fixed_params)
        fixed = dict(built.problem.fixed)
        for node in built.problem.nodes:
            if node.name in sharding and node.name not in built.recompute_options:
                fixed[node.name] = sharding[node.name]
        built.problem = dataclasses.replace(built.problem, fixed=fixed)
        return built, solve(built.problem, time_limit_s=self.time_limit_s)

    def to_plan(self, mesh: tuple[int, int], dp_mode: str, built: BuiltProblem, solution: Solution) -> Plan:
        return _make_plan(self, mesh, dp_mode, built, solution)


def _meshes(planner: _Planner, mesh_shape: tuple[int, ...] | None) -> list[tuple[int, int]]:
    n = planner.cluster.num_devices
    if mesh_shape is not None:
        shape = tuple(mesh_shape)
        if len(shape) == 1:
            shape = (1, shape[0])
        if math.prod(shape) != n or len(shape) != 2:
            raise ValueError(
                f"mesh_shape {tuple(mesh_shape)} must be (tp,) or (dp, tp) with a product of {n} devices"
            )
        candidates = [shape]
    else:
        candidates = [(n // t, t) for t in range(1, n + 1) if n % t == 0]
    usable = []
    for dp, tp in candidates:
        if planner.batch % dp:
            logger.info(
                "mesh (%d, %d) skipped: global batch %d does not split over %d replicas",
                dp,
                tp,
                planner.batch,
                dp,
            )
            continue
        usable.append((dp, tp))
    if not usable:
        raise ValueError(
            f"No mesh of {n} devices can split the global batch of {planner.batch}: use a batch divisible by a "
            f"data-parallel size, or pass mesh_shape=(1, {n}) for tensor parallelism only."
        )
    return usable


def _resolve_budget(memory_budget: int | str | None, spec: DeviceSpec) -> int:
    if memory_budget is None:
        return memory_budget_default(spec)
    return parse_bytes(memory_budget)


def plan_model(
    model: nn.Module,
    example_inputs: Mapping[str, Any],
    *,
    num_devices: int,
    device: str | DeviceSpec = "a100-80gb",
    memory_budget: int | str | None = None,
    mesh_shape: tuple[int, ...] | None = None,
    devices_per_node: int | None = None,
    mixed_precision: str | None = None,
    optimizer: str | None = "adamw",
    time_limit_s: float = 60.0,
    dp_modes: tuple[str, ...] = ("ddp", "fsdp"),
    recompute: str = "auto",
) -> Plan:
    """Plan data + tensor parallelism for ``model`` on ``num_devices`` devices of kind ``device``.

    Runs on a meta/fake model with no processes. ``example_inputs`` is one *global* batch (what one optimizer
    step consumes across all data-parallel ranks). ``memory_budget`` is per device, in bytes or a string like
    ``"40GiB"``; None means the device's memory minus the margin of
    :func:`hf_colossal_auto.hardware.memory_budget_default`. ``dp_modes`` are the data-parallel modes tried on
    meshes with a data-parallel axis ("ddp", "fsdp"). ``recompute``: "auto" chooses activation recompute per
    block jointly with the sharding (one ILP); "none" and "full" fix it for every block; "two-stage" shards
    first and then chooses recompute (a baseline).
    """
    unknown = sorted(set(dp_modes) - {"ddp", "fsdp"})
    if unknown or not dp_modes:
        raise ValueError(f"dp_modes must be a non-empty subset of ('ddp', 'fsdp'), got {dp_modes!r}")
    if num_devices < 1:
        raise ValueError(f"num_devices must be >= 1, got {num_devices}")
    planner = _Planner.for_devices(
        model,
        example_inputs,
        num_devices,
        device,
        devices_per_node,
        memory_budget,
        mixed_precision,
        optimizer,
        time_limit_s,
        recompute,
    )
    spec, budget = planner.spec, planner.budget
    t0 = time.perf_counter()
    best: tuple[float, Plan] | None = None
    tried: list[dict[str, Any]] = []
    min_required = math.inf
    for mesh in _meshes(planner, mesh_shape):
        for dp_mode in dp_modes if mesh[0] > 1 else ("ddp",):
            try:
                built, solution = planner.solve_mesh(mesh, dp_mode)
            except InfeasibleError as exc:
                min_required = min(min_required, exc.min_required)
                tried.append(
                    {
                        "mesh": list(mesh),
                        "dp_mode": dp_mode,
                        "fits": False,
                        "min_memory_bytes": exc.min_required,
                    }
                )
                continue
            plan = planner.to_plan(mesh, dp_mode, built, solution)
            tried.append(
                {
                    "mesh": list(mesh),
                    "dp_mode": dp_mode,
                    "fits": plan.fits,
                    "step_time_s": plan.step_time_s,
                    "peak_memory_bytes": plan.peak_memory_bytes,
                }
            )
            if plan.fits and (best is None or plan.step_time_s < best[0] - 1e-12):
                best = (plan.step_time_s, plan)
    if best is None:
        raise InfeasibleError(
            f"No plan for {type(model).__name__} on {num_devices} x {spec.name} fits {format_bytes(budget)} per "
            f"device: the smallest per-device memory any plan needs is {format_bytes(min_required)}"
            + (
                " (with full activation recompute where it helps)"
                if recompute != "none"
                else f" without activation recompute (recompute={recompute!r})"
            )
            + ". Use more devices, a smaller batch or sequence, or a larger budget.",
            min_required=min_required,
            exact=False,
            choice=None,
        )
    plan = best[1]
    if plan.tp_size > 1 and all(p[1] == "R" for p in plan.param_placements.values()):
        heads = _attention_heads(model)
        logger.warning(
            "%s on mesh %s: no parameter is sharded over the tensor-parallel axis of %d%s; its devices repeat the "
            "same work. A mesh whose tensor-parallel size divides the model's dimensions plans better.",
            type(model).__name__,
            tuple(plan.mesh_shape),
            plan.tp_size,
            f" (the model has {heads} attention heads)" if heads else "",
        )
    plan.alternatives = tried
    plan.solver["total_planning_s"] = time.perf_counter() - t0
    return plan


# ---------------------------------------------------------------------------------------------- plan
def _make_plan(
    planner: _Planner, mesh: tuple[int, int], dp_mode: str, built: BuiltProblem, solution: Solution
) -> Plan:
    graph = planner.graph(mesh[0])
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
        if node.name in built.param_options:  # its share of the optimizer step
            compute += cost
            spread(block_compute, module, cost)
        else:
            strat = built.strategies[node.name][i] if built.strategies.get(node.name) else None
            boundary = node.multiplicity * sum(
                t
                for t, _, _ in (
                    boundary_reshardings(graph, graph.nodes[built.node_of_name[node.name]], strat, 0, tp_comm)
                    if strat is not None
                    else ()
                )
            )
            compute += cost - boundary
            spread(block_compute, module, cost - boundary)
            comm += boundary
            spread(block_comm, module, boundary)
    for edge in problem.edges:
        c = edge.cost[solution.choice[edge.src]][solution.choice[edge.dst]] * edge.multiplicity
        if edge.src in built.recompute_options:  # the forward a recomputed node runs again
            compute += c
            spread(block_compute, built.block_of.get(edge.dst, ""), c)
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
    # placements
    tp_place: dict[str, str] = {}
    for pname, fqn in built.param_of_node.items():
        tp_place[fqn] = built.param_options[pname][solution.choice[pname]]
    dp_place = "S0" if dp_mode == "fsdp" else "R"
    param_placements = {}
    for fqn in graph.param_names:
        canon = tied.canonical_param(fqn)
        param_placements[fqn] = [dp_place, tp_place.get(canon, "R")]
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
            )
        )
    collectives = _collectives(built, solution, graph, tied, mesh, planner, dp_mode)
    for kind, count in _recompute_collectives(built, solution, graph, tied, mesh, planner).items():
        collectives[kind] = round(collectives.get(kind, 0.0) + count, 6)
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
        param_placements=param_placements,
        activation_placements=activation_placements,
        global_batch_size=planner.batch,
        input_shapes={k: list(v.shape) for k, v in planner.inputs.items() if isinstance(v, torch.Tensor)},
        step_time_s=objective,
        compute_time_s=compute,
        communication_time_s=comm,
        overlapped_communication_s=hidden,
        peak_memory_bytes=int(peak),
        memory_budget_bytes=planner.budget,
        param_memory_bytes=int(param_mem),
        activation_memory_bytes=int(act_mem),
        blocks=blocks,
        collectives=collectives,
        recompute=recompute,
        param_use_placements=_param_use_placements(built, solution, graph, tied, planner.model),
        collective_bytes=_collective_bytes(built, solution, graph, tied, mesh, planner, dp_mode),
        solver={
            "status": solution.status,
            "gap": solution.gap if solution.gap is not None else 0.0,
            "solve_time_s": solution.solve_time_s,
            "solver": solution.solver,
            "variables": solution.num_variables,
            "constraints": solution.num_constraints,
        },
    )


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


def _collectives(built, solution, graph, tied, mesh, planner, dp_mode) -> dict[str, float]:
    """Predicted collectives per step by kind (see :func:`_collective_prediction`)."""
    return _collective_prediction(built, solution, graph, tied, mesh, planner, dp_mode)[0]


def _collective_bytes(built, solution, graph, tied, mesh, planner, dp_mode) -> dict[str, float]:
    """Predicted bytes per step by collective kind (see :func:`_collective_prediction`)."""
    return _collective_prediction(built, solution, graph, tied, mesh, planner, dp_mode)[1]


def _given_bytes(kind: str, size: float, tp: int) -> float:
    """Bytes of the tensor one rank hands a collective over a value of ``size`` logical bytes: its shard for an
    all-gather, the whole value for an all-reduce or a reduce-scatter (what CommDebugMode-style counting sees)."""
    return size / tp if kind in ("all_gather", "all_to_all") else size


def _collective_prediction(
    built, solution, graph, tied, mesh, planner, dp_mode
) -> tuple[dict[str, float], dict[str, float]]:
    """Predicted collectives per step, by kind: how many, and the bytes each rank hands them (:func:`_given_bytes`).

    Tensor-parallel: the forward resharding of every edge of the solution, and the backward resharding of its
    gradient. A *partial* gradient is not reduced where it is made: it passes back through views (a linear's
    flattening of its input) and sums with the other contributions to the value they view, and is reduced
    once there (what the runtime's boundary hooks and autograd's accumulation do): q, k and v projections of
    one normed input cost one all-reduce. Data-parallel: one gradient synchronisation per parameter (counted,
    its bytes not: they depend on the tensor-parallel shard each replica holds).
    """
    counts: dict[str, float] = defaultdict(float)
    nbytes: dict[str, float] = defaultdict(float)
    dp, tp = mesh
    producer = forward_producers(graph)
    tp_comm = planner.axis_comm(mesh, 1)

    def source(vid: int) -> tuple[str, bool] | None:
        return _value_source(built, solution, graph, tied, producer, vid)

    partial_roots: dict[int, int] = {}
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
            else:
                _, kind = redistribute(src, dst, size, tp_comm)
                if kind:
                    counts[kind] += w
                    nbytes[kind] += w * _given_bytes(kind, size, tp)
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
        for _seconds, kind, size in boundary_reshardings(graph, graph.nodes[v_idx], strat, 0, tp_comm):
            counts[kind] += w
            nbytes[kind] += w * _given_bytes(kind, size, tp)
    for (vid, _parent, src, dst), w in shared_copies.items():
        _, kind = redistribute(src, dst, graph.values[vid].nbytes, tp_comm)
        if kind:
            counts[kind] += w
            nbytes[kind] += w * _given_bytes(kind, graph.values[vid].nbytes, tp)
    for vid, w in partial_roots.items():
        src, is_param = source(vid)
        grad_to = src if is_param and is_shard(src) else gradient_at_producer(src)
        _, kind = redistribute("P", grad_to, graph.values[vid].nbytes, tp_comm)
        if kind:
            counts[kind] += w
            nbytes[kind] += w * _given_bytes(kind, graph.values[vid].nbytes, tp)
    if dp > 1:
        n_params = len(graph.param_names)
        if dp_mode == "fsdp":
            counts["dp_all_gather"] += 2 * n_params
            counts["dp_reduce_scatter"] += n_params
        else:
            counts["dp_all_reduce"] += n_params
    return (
        {k: round(v, 6) for k, v in sorted(counts.items())},
        {k: round(v, 6) for k, v in sorted(nbytes.items())},
    )


# ---------------------------------------------------------------------------------------------- baselines
_COLWISE_NAMES = (
    "q_proj",
    "k_proj",
    "v_proj",
    "gate_proj",
    "up_proj",
    "query",
    "key",
    "value",
    "c_fc",
    "fc1",
    "wi",
    "wi_0",
    "wi_1",
    "q",
    "k",
    "v",
    "intermediate.dense",
)
_ROWWISE_NAMES = ("o_proj", "down_proj", "attention.output.dense", "output.dense", "fc2", "wo", "o", "c_proj")


def _linear_dims(model: nn.Module, module_fqn: str) -> tuple[int, int] | None:
    """(out-features dim, in-features dim) of a module's weight: (0, 1) for nn.Linear, (1, 0) for GPT-2's Conv1D."""
    module = dict(model.named_modules()).get(module_fqn)
    if isinstance(module, nn.Linear):
        return 0, 1
    if type(module).__name__ == "Conv1D":
        return 1, 0
    return None


def megatron_placements(model: nn.Module) -> dict[str, str]:
    """Megatron-style TP of every attention and MLP: column-parallel in, row-parallel out (Linear and Conv1D)."""
    out: dict[str, str] = {}
    for fqn, module in model.named_modules():
        dims = _linear_dims(model, fqn)
        if dims is None:
            continue
        leaf = fqn.rsplit(".", 1)[-1]
        tail2 = ".".join(fqn.rsplit(".", 2)[-2:])
        col_dim, row_dim = dims
        is_attn_proj = leaf == "c_proj" and ".attn." in f".{fqn}."
        if leaf == "c_attn" or leaf in _COLWISE_NAMES or tail2 in _COLWISE_NAMES:
            if leaf in ("c_proj",):
                continue
            out[f"{fqn}.weight"] = f"S{col_dim}"
            if getattr(module, "bias", None) is not None:
                out[f"{fqn}.bias"] = "S0"
        elif leaf in _ROWWISE_NAMES or tail2 in _ROWWISE_NAMES or is_attn_proj:
            out[f"{fqn}.weight"] = f"S{row_dim}"
            if getattr(module, "bias", None) is not None:
                out[f"{fqn}.bias"] = "R"
    return out


def tp_plan_placements(model: nn.Module, tp_plan: Mapping[str, str]) -> dict[str, str]:
    """Parameter placements of a HF-style ``tp_plan`` (module pattern -> "colwise" | "rowwise" | ...)."""
    out: dict[str, str] = {}
    names = dict(model.named_modules())
    prefixes = ["", *(n + "." for n, m in names.items() if m is not model and n and "." not in n)]
    for pattern, style in tp_plan.items():
        for fqn, module in names.items():
            if not any(fnmatch.fnmatchcase(fqn, p + pattern) for p in prefixes):
                continue
            dims = _linear_dims(model, fqn)
            base = style.split("_", 1)[-1] if style.startswith("packed_") else style
            if isinstance(module, nn.Embedding):
                out[f"{fqn}.weight"] = "S1" if base in ("colwise", "embedding_colwise") else "S0"
                continue
            if dims is None:
                continue
            col, row = dims
            if base in ("colwise", "colwise_rep", "local_colwise"):
                out[f"{fqn}.weight"] = f"S{col}"
                if getattr(module, "bias", None) is not None:
                    out[f"{fqn}.bias"] = "S0"
            elif base in ("rowwise", "rowwise_rep", "local_rowwise"):
                out[f"{fqn}.weight"] = f"S{row}"
            else:
                raise ValueError(
                    f"tp_plan style {style!r} for {pattern!r} is not supported; use colwise or rowwise"
                )
    return out


def _attention_heads(model: nn.Module) -> int | None:
    config = getattr(model, "config", None)
    for attr in ("num_attention_heads", "n_head", "num_heads"):
        heads = getattr(config, attr, None)
        if heads:
            return heads
    return None


def _largest_tp(n: int, per_node: int, model: nn.Module) -> int:
    config = getattr(model, "config", None)
    heads = _attention_heads(model)
    kv = getattr(config, "num_key_value_heads", None) or heads
    best = 1
    for t in range(1, min(n, per_node) + 1):
        if n % t == 0 and (heads is None or (heads % t == 0 and kv % t == 0)):
            best = t
    return best


def evaluate_plan(
    model: nn.Module,
    example_inputs: Mapping[str, Any],
    plan_or_baseline: Plan | str | Mapping[str, str],
    *,
    num_devices: int,
    device: str | DeviceSpec = "a100-80gb",
    memory_budget: int | str | None = None,
    mesh_shape: tuple[int, ...] | None = None,
    devices_per_node: int | None = None,
    mixed_precision: str | None = None,
    optimizer: str | None = "adamw",
    time_limit_s: float = 60.0,
    recompute: str | None = None,
) -> Estimate:
    """Price a Plan, a HF-style tp_plan dict or a named baseline ("ddp", "fsdp", "megatron") under our model.

    ``recompute``: "none" or "full" for every block, or "auto" (recompute chosen per block to fit the budget
    with the baseline's placements: the baseline's best case). Default: a Plan's own choice, "none" for the
    others.
    """
    if recompute not in (None, "none", "full", "auto"):
        raise ValueError(f"recompute must be None, 'none', 'full' or 'auto', got {recompute!r}")
    planner = _Planner.for_devices(
        model,
        example_inputs,
        num_devices,
        device,
        devices_per_node,
        memory_budget,
        mixed_precision,
        optimizer,
        time_limit_s,
    )
    cluster, budget = planner.cluster, planner.budget
    n = num_devices
    if isinstance(plan_or_baseline, Plan):
        plan = plan_or_baseline
        mesh = (plan.dp_size, plan.tp_size)
        dp_mode = plan.dp_mode
        fixed = {fqn: placements[1] for fqn, placements in plan.param_placements.items()}
        name = "plan"
    elif isinstance(plan_or_baseline, str):
        name = plan_or_baseline
        if name == "ddp":
            mesh, dp_mode, fixed = (n, 1), "ddp", {}
        elif name == "fsdp":
            mesh, dp_mode, fixed = (n, 1), "fsdp", {}
        elif name == "megatron":
            t = mesh_shape[-1] if mesh_shape else _largest_tp(n, cluster.devices_per_node, model)
            mesh, dp_mode = (n // t, t), "ddp"
            fixed = megatron_placements(model) if t > 1 else {}
            if t == 1:
                logger.warning(
                    "megatron baseline: no tensor-parallel size of %d devices divides the attention heads; "
                    "it degenerates to DDP",
                    n,
                )
        else:
            raise ValueError(f"Unknown baseline {name!r}; use one of {BASELINES}, a Plan, or a tp_plan dict.")
    else:
        name = "tp_plan"
        t = mesh_shape[-1] if mesh_shape else _largest_tp(n, cluster.devices_per_node, model)
        mesh, dp_mode = (n // t, t), "ddp"
        fixed = tp_plan_placements(model, plan_or_baseline)
    if planner.batch % mesh[0]:
        raise ValueError(
            f"{name}: global batch {planner.batch} does not split over {mesh[0]} data-parallel replicas"
        )
    tied = TiedGraph.build(planner.graph(mesh[0]))
    canonical_fixed = {tied.canonical_param(k): v for k, v in fixed.items()}
    # Every parameter the baseline does not name stays replicated, as the baseline means; activations are
    # left to the solver (what a runtime's sharding propagation would do best). The budget is lifted so that a
    # baseline that does not fit is still priced, and reported as not fitting.
    if recompute is None:
        recompute = "none" if not isinstance(plan_or_baseline, Plan) else None
    pin: str | dict[str, str] | None = recompute if recompute in ("none", "full") else None
    if recompute is None:  # a Plan's own per-block choice
        pin = dict(plan_or_baseline.recompute) or "none"
    built = solution = None
    if recompute == "auto":
        built = planner.build(mesh, dp_mode, canonical_fixed, pin_unlisted=True)
        try:
            solution = solve(built.problem, time_limit_s=time_limit_s)
        except InfeasibleError:
            pin = "full"  # priced (and reported as not fitting) with the most recompute there is
    if solution is None:
        planner.budget = 1 << 62
        try:
            built = planner.build(mesh, dp_mode, canonical_fixed, pin_unlisted=True, recompute_pin=pin)
        finally:
            planner.budget = budget
        solution = solve(built.problem, time_limit_s=time_limit_s)
    plan = planner.to_plan(mesh, dp_mode, built, solution)
    plan.memory_budget_bytes = budget
    return Estimate(name, plan.step_time_s, plan.peak_memory_bytes, budget, tuple(mesh), dp_mode, plan)
