"""``plan_model`` and ``evaluate_plan``: search meshes and data-parallel modes, solve, and write the Plan.

For N devices every mesh ``(dp, tp)`` with ``dp * tp = N`` is tried (the 1-D meshes are ``(N, 1)`` and
``(1, N)``), each with DDP and, when ``dp > 1``, FSDP on the data-parallel axis; the fastest plan that fits
the memory budget wins. Where the data-parallel axis crosses nodes, HSDP is tried too: FSDP inside shard groups of
one node's data-parallel ranks, the shards all-reduced across nodes
(:meth:`~hf_colossal_auto.hardware.ClusterSpec.hybrid_shard_size`). The data-parallel axis is the outer mesh axis, so with several nodes it is the one
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
import logging
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..capture.batch_rows import TracesByRows
from ..capture.graph import Phase, StepGraph, ValueKind
from ..capture.moe import RoutingLoad, experts_modules
from ..capture.tracer import trace_training_step
from ..hardware import ClusterSpec, DeviceSpec, get_device
from ..hardware.catalog import memory_budget_default
from ..hardware.roofline import host_time
from ..plan import Plan
from ..profile.profiler import _module_list_children
from ..strategies import enumerate_strategies
from ..units import format_bytes, parse_bytes
from .baselines import (  # re-exported: public names of the planner
    _attention_heads,
    _largest_tp,
    megatron_placements,
    tp_plan_placements,
)
from .builder import (
    BuiltProblem,
    TiedGraph,
    build_problem,
    data_parallel_sync_time,
)
from .cost_model import (
    DP_MODES,
    AxisComm,
    HybridComm,
)
from .ilp import solve
from .prediction import _make_plan
from .problem import InfeasibleError, Solution
from .recompute import parse_option

logger = logging.getLogger(__name__)

BASELINES = ("ddp", "fsdp", "megatron")


class PlanningTimeoutError(ValueError):
    """The solver's time limit ran out before it found any plan for a candidate mesh."""
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


def _first_rows(example_inputs: Mapping[str, Any], rows: int) -> dict[str, Any]:
    """The batch cut to its first ``rows`` rows: one micro-batch of one replica."""
    return {
        k: v[:rows] if isinstance(v, torch.Tensor) and v.dim() > 0 else v for k, v in example_inputs.items()
    }


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
        self._graphs = TracesByRows(self._trace)
        """Steps by the rows of one micro-batch of one replica (global batch / (dp * micro-batches)): the step
        depends on nothing else, so (dp, k) candidates with the same dp * k share one; most sizes are
        interpolated from three traces."""
        self._strategies: dict[tuple[int, int], dict] = {}
        """Strategies by (micro-batch rows, tensor-parallel size)."""
        self.last_built: BuiltProblem | None = None
        """The problem :meth:`solve_mesh` built last."""
        self.routing: RoutingLoad | None = None
        """A measured routing load the MoE costs are priced under (:func:`_routing`); None: uniform."""

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

    def graph(self, dp: int, micro_batches: int = 1) -> StepGraph:
        """The step at one micro-batch of one replica (global batch / dp / micro_batches rows): traced, or
        interpolated from traces at other sizes once the step has proved affine in its rows
        (:class:`~hf_colossal_auto.capture.batch_rows.TracesByRows`)."""
        return self._graphs.get(self.batch // (dp * micro_batches))

    def _trace(self, rows: int) -> StepGraph:
        return trace_training_step(
            self.model,
            _first_rows(self.inputs, rows),
            mixed_precision=self.mixed_precision,
            optimizer=self.optimizer,
            device_kind=self.spec.kind,
        )

    def any_graph(self, dp: int, micro_batches: int = 1) -> StepGraph:
        """A step at hand already, else the one of ``graph(dp, micro_batches)``: for what does not depend on the
        batch (parameter and optimizer-state bytes), without a trace per shape."""
        return self._graphs.any() or self.graph(dp, micro_batches)

    def strategies(self, dp: int, tp: int, micro_batches: int = 1) -> dict:
        key = (self.batch // (dp * micro_batches), tp)
        if tp == 1:
            # On a one-device axis every placement is the whole tensor: replicated. DTensor's rules would still
            # offer Shard strategies there, which its view ops then refuse to reshape at run time.
            return {}
        if key not in self._strategies:
            graph = self.graph(dp, micro_batches)
            self._strategies[key] = enumerate_strategies(graph, (tp,), phases=(Phase.FORWARD,))
        return self._strategies[key]

    def micro_batch_options(self, dp: int) -> list[int]:
        """Micro-batch counts k > 1 a replica's batch splits into evenly (the divisors of global / dp), fewest
        first: each costs a trace at a smaller shape, so they are tried in order and only when needed."""
        local = self.batch // dp
        return [k for k in range(2, local + 1) if local % k == 0]

    def build(
        self,
        mesh: tuple[int, int],
        dp_mode: str,
        fixed_params: dict[str, str] | None = None,
        pin_unlisted: bool = False,
        recompute_pin: str | Mapping[str, str] | None = None,
        micro_batches: int = 1,
        dp_shard_size: int | None = None,
        dtensor_rules: bool = True,
        param_uses: Mapping[str, str] | None = None,
        expert_dp: bool = False,
    ) -> BuiltProblem:
        """The ILP of one mesh; recompute is a decision unless ``recompute_pin`` (or the planner's mode "none" /
        "full") fixes it. ``micro_batches``: the step runs each replica's batch in that many pieces.
        ``dp_shard_size``: HSDP's shard group (default: the cluster's, :meth:`hybrid_comm`). ``dtensor_rules``:
        False builds the relaxation without DTensor's own choices (:func:`build_problem`). ``param_uses``
        (canonical parameter FQN -> tensor-parallel placement) pins where every op that reads a parameter reads
        it (:func:`_pin_param_uses`). ``expert_dp``: every MoE layer expert-parallel over the data-parallel
        axis (:func:`build_problem`)."""
        if recompute_pin is None and self.recompute in ("none", "full"):
            recompute_pin = self.recompute
        dp, tp = mesh
        graph = self.graph(dp, micro_batches)
        tp_comm = self.axis_comm(mesh, 1)
        dp_comm = self.hybrid_comm(mesh, dp_shard_size) if dp_mode == "hsdp" else self.axis_comm(mesh, 0)
        strategies = self.strategies(dp, tp, micro_batches)
        if param_uses:
            strategies = _pin_param_uses(graph, strategies, param_uses)
        return build_problem(
            graph,
            strategies,
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
            micro_batches=micro_batches,
            dtensor_rules=dtensor_rules,
            routing=self.routing,
            expert_dp=expert_dp,
        )

    def axis_comm(self, mesh: tuple[int, int], axis: int) -> AxisComm:
        """Collective pricing on one mesh axis. A tensor-parallel resharding is a DTensor redistribution (the
        host pays a DTensor op and the device a launch on top of the alpha-beta time); a data-parallel
        gradient synchronisation is a plain collective (an eager op and a launch)."""
        overhead = self.spec.kernel_overhead_s + host_time(self.spec, dtensor=axis == 1)
        via = "dtensor" if axis == 1 else None
        return AxisComm(mesh[axis], self.cluster.axis_link(mesh, axis), self.spec.kind, overhead, via)

    def hybrid_comm(self, mesh: tuple[int, int], shard: int | None = None) -> HybridComm:
        """HSDP's collective pricing: its shard group (``shard`` ranks, by default one node's data-parallel
        ranks) on the link inside it, its replicate group on the link between them. Plain collectives, as
        :meth:`axis_comm` prices the data-parallel axis."""
        if shard is None:
            shard = self.cluster.hybrid_shard_size(mesh)
            if shard is None:
                raise ValueError(
                    f"HSDP on mesh {mesh} with {self.cluster.devices_per_node} devices per node: its data-parallel "
                    "axis does not cross nodes, or a node's data-parallel ranks do not divide it; use 'fsdp'"
                )
        replicate_link, shard_link = self.cluster.hybrid_links(mesh, shard)
        overhead = self.spec.kernel_overhead_s + host_time(self.spec, dtensor=False)
        kind = self.spec.kind
        return HybridComm(
            shard=AxisComm(shard, shard_link, kind, overhead),
            replicate=AxisComm(mesh[0] // shard, replicate_link, kind, overhead),
        )

    @property
    def layers(self) -> list[str]:
        """The blocks recompute can be decided for: the model's ``ModuleList`` children."""
        return _module_list_children(self.model)

    def solve_mesh(
        self,
        mesh: tuple[int, int],
        dp_mode: str,
        fixed_params: dict[str, str] | None = None,
        micro_batches: int = 1,
        dp_shard_size: int | None = None,
        expert_dp: bool = False,
    ) -> tuple[BuiltProblem, Solution]:
        """Build and solve one candidate. Where its budget cannot be met (:class:`InfeasibleError`), the problem
        stays in :attr:`last_built` (the micro-batch search prices it without the budget as a lower bound)."""
        if self.recompute == "two-stage":
            return self._two_stage(mesh, dp_mode, fixed_params, micro_batches, dp_shard_size, expert_dp)
        built = self.last_built = self.build(
            mesh,
            dp_mode,
            fixed_params,
            micro_batches=micro_batches,
            dp_shard_size=dp_shard_size,
            expert_dp=expert_dp,
        )
        solution = solve(built.problem, time_limit_s=self.time_limit_s)
        return built, self._found(solution, mesh, dp_mode)

    def _found(self, solution: Solution, mesh: tuple[int, int], dp_mode: str) -> Solution:
        """``solution``, or a clear error when the solver's time ran out before it found any choice (an
        empty choice would fail later, in pricing, with no word of the cause)."""
        if solution.choice or solution.status != "timeout_no_solution":
            return solution
        raise PlanningTimeoutError(
            f"the solver found no plan for mesh {mesh[0]}x{mesh[1]} ({dp_mode}) of "
            f"{type(self.model).__name__} within time_limit_s={self.time_limit_s:g} "
            f"({solution.num_variables} variables, {solution.num_constraints} constraints): raise plan_model's "
            "(or autoparallelize's) time_limit_s, or fix the mesh with mesh_shape"
        )

    def _two_stage(
        self,
        mesh: tuple[int, int],
        dp_mode: str,
        fixed_params: dict[str, str] | None,
        micro_batches: int = 1,
        dp_shard_size: int | None = None,
        expert_dp: bool = False,
    ) -> tuple[BuiltProblem, Solution]:
        """The baseline the joint ILP is measured against: shard for speed ignoring memory (no recompute),
        then choose recompute per block for that sharding under the budget."""
        budget = self.budget
        self.budget = 1 << 62
        try:
            first = self.build(
                mesh,
                dp_mode,
                fixed_params,
                recompute_pin="none",
                micro_batches=micro_batches,
                dp_shard_size=dp_shard_size,
                expert_dp=expert_dp,
            )
        finally:
            self.budget = budget
        sharding = solve(first.problem, time_limit_s=self.time_limit_s).choice
        built = self.last_built = self.build(
            mesh,
            dp_mode,
            fixed_params,
            micro_batches=micro_batches,
            dp_shard_size=dp_shard_size,
            expert_dp=expert_dp,
        )
        fixed = dict(built.problem.fixed)
        for node in built.problem.nodes:
            decided_by_recompute = node.name in built.recompute_options or node.name in built.hold_nodes
            if node.name in sharding and not decided_by_recompute:
                fixed[node.name] = sharding[node.name]
        built.problem = dataclasses.replace(built.problem, fixed=fixed)
        return built, self._found(solve(built.problem, time_limit_s=self.time_limit_s), mesh, dp_mode)

    def to_plan(self, mesh: tuple[int, int], dp_mode: str, built: BuiltProblem, solution: Solution) -> Plan:
        return _make_plan(self, mesh, dp_mode, built, solution)


class _Search:
    """The search over meshes, data-parallel modes and micro-batch counts: the fastest plan that fits, what was
    tried, and the least memory any candidate needed (for the error when none fits)."""

    def __init__(self, planner: _Planner) -> None:
        self.planner = planner
        self.best: Plan | None = None
        self.tried: list[dict[str, Any]] = []
        self.min_required = math.inf
        self.one_piece: dict[tuple[tuple[int, int], str], tuple[Plan | None, float]] = {}
        """(mesh, dp mode) -> its plan with the batch in one piece (None: nothing fits) and the host seconds of
        its ops (:attr:`BuiltProblem.host_floor_s`; 0 when unknown)."""
        self._read_params: tuple[StepGraph, TiedGraph, set[str]] | None = None
        """The trace :meth:`_sync_floor` last read, its tied graph and the canonical parameters its ops read."""
        self.deferred: list[tuple[tuple[int, int], str, int, int]] = []
        """(mesh, dp mode, micro-batches, model-state floor) of DDP/FSDP candidates :meth:`ruled_out` set aside."""
        self.over_budget: dict[tuple[tuple[int, int], str], BuiltProblem] = {}
        """(mesh, dp mode) -> the problem of its one-piece candidate, where no choice met the budget."""

    def try_candidate(self, mesh: tuple[int, int], dp_mode: str, micro_batches: int) -> Plan | None:
        """Solve one candidate, record it, keep it if it is the fastest that fits; its plan (None: infeasible).
        ``dp_mode`` is the search's key (:func:`_split_mode`: "hsdp:16" names its shard group)."""
        mode, shard = _split_mode(dp_mode)
        if self._accumulation_rules_out(mesh, dp_mode, micro_batches):
            return None
        try:
            built, solution = self.planner.solve_mesh(
                mesh, mode, micro_batches=micro_batches, dp_shard_size=shard, expert_dp=_is_expert_dp(dp_mode)
            )
        except InfeasibleError as exc:
            self.min_required = min(self.min_required, exc.min_required)
            self._record_infeasible(mesh, dp_mode, micro_batches, exc.min_required)
            plan, host_floor = None, 0.0
            if micro_batches == 1 and self.planner.last_built is not None:
                self.over_budget[(mesh, dp_mode)] = self.planner.last_built
        else:
            host_floor = built.host_floor_s
            plan = self.planner.to_plan(mesh, mode, built, solution)
            self.tried.append(
                {
                    "mesh": list(mesh),
                    "dp_mode": mode,
                    "dp_label": self.label(mesh, dp_mode),
                    "micro_batches": micro_batches,
                    "fits": plan.fits,
                    "step_time_s": plan.step_time_s,
                    "peak_memory_bytes": plan.peak_memory_bytes,
                }
            )
            if plan.fits and (self.best is None or plan.step_time_s < self.best.step_time_s - 1e-12):
                self.best = plan
        if micro_batches == 1:
            self.one_piece[(mesh, dp_mode)] = (plan, host_floor)
        return plan

    def label(self, mesh: tuple[int, int], dp_mode: str) -> str:
        """The mode as :attr:`Plan.dp_label` names it ("hsdp 2x4": 2 replicas of shard groups of 4)."""
        if _is_expert_dp(dp_mode):
            return f"{EXPERT_DP_KEYS[dp_mode]}, experts over dp"
        dp_mode, shard = _split_mode(dp_mode)
        if dp_mode == "hsdp" and shard is None:
            shard = self.planner.cluster.hybrid_shard_size(mesh)
        return f"hsdp {mesh[0] // shard}x{shard}" if shard else dp_mode

    def bounded_out(self, mesh: tuple[int, int], dp_mode: str, micro_batches: int) -> bool:
        """Whether a lower bound on its step time already rules ``(mesh, dp_mode)`` out, before its ILP is built in
        full (recorded as tried with that bound): the optimum of its relaxation — no memory budget, and no rules
        making ops follow DTensor's own choices, the costliest part of the ILP to build — is no faster than the
        best plan so far. The bound holds at every micro-batch count (see :meth:`_unconstrained_time`), so no
        micro-batch search follows. Why: at cluster scale most meshes are far off (tensor parallelism across
        nodes), and their full ILPs asked DTensor about every op on meshes of up to thousands of ranks."""
        if self.best is None or _is_expert_dp(dp_mode):  # its floor would count the experts' all-reduce
            return False
        bound = self._sync_floor(mesh, dp_mode)
        crosses = mesh[1] > self.planner.cluster.devices_per_node
        # The relaxation is built only where tensor parallelism crosses nodes: there DTensor's rules are costliest
        # and candidates far off; inside a node the full ILP costs little more than its relaxation, which then
        # rarely pays for itself (GPT2-XL on 8, Llama-7B on 64).
        if crosses and self.best.step_time_s > bound:
            mode, shard = _split_mode(dp_mode)
            relaxed = self.planner.build(
                mesh, mode, micro_batches=micro_batches, dp_shard_size=shard, dtensor_rules=False
            )
            bound = self._relaxed_optimum(relaxed)
        if self.best.step_time_s > bound:
            return False
        logger.debug("mesh %s %s skipped: its relaxation takes %.3g s", mesh, dp_mode, bound)
        self._record_unfit(mesh, dp_mode, micro_batches, min_step_time_s=bound)
        return True

    def _sync_floor(self, mesh: tuple[int, int], dp_mode: str) -> float:
        """A lower bound on the step time of ``(mesh, dp_mode)`` that needs no trace at its batch: the
        data-parallel synchronisation alone (the ILP's :class:`Overlap` exposes at least ``C - f K`` of it on top
        of ``K`` of compute, so a step is never shorter than ``C``), every trained parameter priced as the
        builder prices it (:func:`data_parallel_sync_time`) at its smallest share, split over all
        tensor-parallel ranks, and gathered once. Prunes the meshes whose data-parallel axis carries whole
        parameters over the network (Llama-3-70B on 1024 x 1) without tracing their batch."""
        graph = self.planner.any_graph(mesh[0])
        if self._read_params is None or self._read_params[0] is not graph:
            tied = TiedGraph.build(graph)
            read = set()
            for i in tied.canonical:
                for vid in graph.nodes[i].inputs:
                    value = graph.values[vid]
                    if value.kind is ValueKind.PARAM and value.name is not None:
                        read.add(tied.canonical_param(value.name))
            self._read_params = (graph, tied, read)
        _, tied, read = self._read_params
        dp_mode, shard = _split_mode(dp_mode)
        dp_comm = (
            self.planner.hybrid_comm(mesh, shard) if dp_mode == "hsdp" else self.planner.axis_comm(mesh, 0)
        )
        total = 0.0
        for fqn in graph.param_names:
            canonical = tied.canonical_param(fqn)
            if (
                canonical in read
                and graph.param_shapes.get(canonical) is not None
                and graph.is_trainable(canonical)
            ):
                local = graph.param_bytes[canonical] / mesh[1]
                total += data_parallel_sync_time(dp_mode, local, dp_comm)
        return total

    def _relaxed_optimum(self, built: BuiltProblem) -> float:
        """The optimum of ``built`` without its memory constraints: a lower bound on its step time (0 when the
        solver does not prove one)."""
        relaxed = dataclasses.replace(built.problem, memory_constraints=[])
        try:
            solution = solve(relaxed, time_limit_s=self.planner.time_limit_s)
        except InfeasibleError:
            return 0.0
        return solution.objective_s if solution.status == "optimal" else 0.0

    def ruled_out(self, mesh: tuple[int, int], dp_mode: str, shard: int, micro_batches: int) -> bool:
        """Whether a lower bound already rules ``(mesh, dp_mode)`` out, without building its ILP (recorded as
        tried and not fitting): the parameters and optimizer state alone, each split over every tensor- and
        data-parallel rank that can share it (``shard``: 1 under DDP, dp under FSDP, the shard group under
        HSDP), exceed the budget. No placement, recompute or micro-batch count needs less, so neither the ILP nor
        the micro-batch search is run for it. Why: HSDP's shard group is one node's ranks, and a model whose
        state does not fit there (Llama-3-70B on 8 per node) would otherwise cost an ILP per mesh and a
        micro-batch search; the same holds for DDP on every mesh of such a model."""
        if _is_expert_dp(dp_mode):  # the experts' state is divided by dp: the floor below would not hold
            return False
        floor = _model_state_floor(self.planner.any_graph(mesh[0], micro_batches), mesh[1] * shard)
        if floor <= self.planner.budget:
            return False
        logger.debug(
            "mesh %s %s skipped: parameters + optimizer state alone need %d bytes", mesh, dp_mode, floor
        )
        if dp_mode == "hsdp":
            self._record_infeasible(mesh, dp_mode, micro_batches, floor)
        else:
            # DDP and FSDP may hold the least memory any plan needs, which the error when nothing fits states:
            # solved after all then (:meth:`run_deferred`)
            self.deferred.append((mesh, dp_mode, micro_batches, floor))
        return True

    def _accumulation_rules_out(self, mesh: tuple[int, int], dp_mode: str, micro_batches: int) -> bool:
        """Whether a micro-batched candidate cannot fit, known without its ILP (recorded with that floor): with
        k > 1 pieces every trained parameter's accumulated gradient is alive whole over the data-parallel ranks
        until the last piece (the builder's ``accumulated_grad_terms``), on top of the model state. Their floor —
        state over tensor- and data-parallel sharing, gradients over tensor-parallel ranks only — does not fall
        with k, so one test covers every count. Only applied once a plan is in hand: where nothing fits, the
        ILPs are solved anyway so that the error states the least memory a plan needs."""
        if micro_batches == 1 or self.best is None or _is_expert_dp(dp_mode):
            return False
        floor = _accumulation_floor(
            self.planner.any_graph(mesh[0], micro_batches), mesh[1], self._shard(mesh, dp_mode)
        )
        if floor <= self.planner.budget:
            return False
        logger.debug(
            "mesh %s %s: %d micro-batches need %d bytes of state and gradients",
            mesh,
            dp_mode,
            micro_batches,
            floor,
        )
        self._record_infeasible(mesh, dp_mode, micro_batches, floor)
        return True

    def _shard(self, mesh: tuple[int, int], dp_mode: str) -> int:
        """Data-parallel ranks sharing a parameter's state under the search key ``dp_mode``: 1 under DDP, the
        whole axis under FSDP, the shard group under HSDP ("hsdp:16"; bare "hsdp": the cluster's default)."""
        mode, shard = _split_mode(dp_mode)
        if mode == "hsdp":
            return shard or self.planner.cluster.hybrid_shard_size(mesh) or 1
        return mesh[0] if mode == "fsdp" else 1

    def run_deferred(self, search_micro_batches: bool) -> None:
        """Where no plan fits: the candidates :meth:`ruled_out` set aside whose floor is under the least memory
        found so far are solved, in one piece and at the most micro-batches (the least memory of any count), so
        that the error states the least memory any plan needs, as if none had been set aside. The others are
        recorded with their floor."""
        for mesh, dp_mode, micro_batches, floor in sorted(self.deferred, key=lambda d: d[3]):
            if floor >= self.min_required:
                self._record_infeasible(mesh, dp_mode, micro_batches, floor)
                continue
            plan = self.try_candidate(mesh, dp_mode, micro_batches)
            options = self.planner.micro_batch_options(mesh[0]) if search_micro_batches else []
            if plan is None and options:
                self.try_candidate(mesh, dp_mode, options[-1])
        self.deferred = []

    def _record_infeasible(
        self, mesh: tuple[int, int], dp_mode: str, micro_batches: int, min_memory_bytes: float
    ) -> None:
        """A candidate nothing fits, with the least memory it would need, in the list of meshes tried."""
        self._record_unfit(mesh, dp_mode, micro_batches, min_memory_bytes=min_memory_bytes)

    def _record_unfit(self, mesh: tuple[int, int], dp_mode: str, micro_batches: int, **bound: float) -> None:
        """A candidate with no plan in the list of meshes tried, with the bound that ruled it out
        (``min_memory_bytes``: the least memory it needs; ``min_step_time_s``: no faster than this)."""
        self.tried.append(
            {
                "mesh": list(mesh),
                "dp_mode": _split_mode(dp_mode)[0],
                "dp_label": self.label(mesh, dp_mode),
                "micro_batches": micro_batches,
                "fits": False,
                **bound,
            }
        )

    def try_micro_batches(self) -> None:
        """Micro-batching where the batch in one piece does not fit or needs recompute: k = 2, 4, ... (divisors
        of the replica's batch) up to the first k that fits without recompute; the fastest plan wins.

        Kept cheap, since each k costs a trace and an ILP: candidates are visited most promising first, and a k
        is skipped once the best plan so far is no slower than what it can reach — micro-batching at best
        removes the recompute of the last plan on that mesh (``step - recompute``), and k pieces cost at least
        k times the ops' host seconds. Where nothing fits in one piece, the smallest k that fits is found by
        bisection (memory falls with k), starting from the largest: if even that does not fit, no k does."""
        fixed_recompute = self.planner.recompute in ("none", "full")

        def done(plan: Plan | None) -> bool:
            return plan is not None and plan.fits and (fixed_recompute or not _recomputes(plan))

        pending = [(key, plan, floor) for key, (plan, floor) in self.one_piece.items() if not done(plan)]
        pending.sort(key=lambda c: _best_case(c[1]) if c[1] is not None else math.inf)
        for (mesh, dp_mode), plan, host_floor in pending:
            options = self.planner.micro_batch_options(mesh[0])
            if plan is None and options and self.best is not None:
                bound = self._unconstrained_time(mesh, dp_mode)
                if self.best.step_time_s <= bound:
                    logger.debug("mesh %s %s: micro-batches skipped (>= %.3g s)", mesh, dp_mode, bound)
                    continue
            if plan is None and options:
                first = self._smallest_fitting(mesh, dp_mode, options)
                if first is None or done(first[1]):
                    continue
                plan, options = first[1], [k for k in options if k > first[0]]
            for k in options:
                bound = max(_best_case(plan), k * host_floor) if plan is not None else 0.0
                if self.best is not None and self.best.step_time_s <= bound:
                    logger.debug("mesh %s %s: %d micro-batches skipped (>= %.3g s)", mesh, dp_mode, k, bound)
                    break
                found = self.try_candidate(mesh, dp_mode, k)
                if done(found):
                    break
                plan = found if found is not None else plan

    def _unconstrained_time(self, mesh: tuple[int, int], dp_mode: str) -> float:
        """A lower bound on the step time of ``(mesh, dp_mode)`` at any micro-batch count, for a candidate whose
        batch in one piece fits no choice: its one-piece ILP solved without the memory budget (0 when unknown).
        k pieces run every op, resharding and FSDP gather k times on 1/k of the rows (no faster in total: a
        kernel's time does not fall faster than its rows, the host cost per op is paid per piece) and add
        recompute, while the gradient sync and the optimizer step stay once; the step time grows with compute
        and communication alike (the overlap hides at most the smaller), so no k beats this optimum. Without it
        the search would bisect micro-batch counts on meshes whose best case is already slower than a plan in
        hand (Llama-3-70B on 1024 devices: every mesh whose tensor parallelism crosses nodes)."""
        built = self.over_budget.pop((mesh, dp_mode), None)
        return 0.0 if built is None else self._relaxed_optimum(built)

    def _smallest_fitting(
        self, mesh: tuple[int, int], dp_mode: str, options: list[int]
    ) -> tuple[int, Plan] | None:
        """The fewest micro-batches (of ``options``, ascending) with which ``(mesh, dp_mode)`` fits, and its
        plan; None when even the most do not. Bisection: fewer pieces never need less memory."""
        plans: dict[int, Plan] = {}
        top = self.try_candidate(mesh, dp_mode, options[-1])
        if top is None:
            return None
        plans[len(options) - 1] = top
        lo, hi = 0, len(options) - 1
        while lo < hi:
            mid = (lo + hi) // 2
            found = self.try_candidate(mesh, dp_mode, options[mid])
            if found is None:
                lo = mid + 1
            else:
                plans[mid], hi = found, mid
        return options[hi], plans[hi]


def _plan_param_uses(model: nn.Module, plan: Plan) -> dict[str, str]:
    """Parameter FQN (every alias) -> the tensor-parallel placement ``plan``'s runtime hands it to the ops
    reading it in: its use placement where the plan names one (keyed by the using module), else its storage.
    A tied parameter whose modules use it differently is left out (DTensor chooses per use)."""
    aliases: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(param), []).append(name)
    out: dict[str, str] = {}
    for names in aliases.values():
        stored = next((plan.param_placements[n] for n in names if n in plan.param_placements), None)
        if not stored:
            continue
        uses = {(plan.param_use_placements.get(n) or stored)[-1] for n in names}
        if len(uses) == 1:
            out.update(dict.fromkeys(names, uses.pop()))
    return out


def _pin_param_uses(graph: StepGraph, strategies: dict, param_uses: Mapping[str, str]) -> dict:
    """``strategies`` with every op that reads a parameter ``param_uses`` names (FQN -> tensor-parallel placement)
    left with the strategies that read it in that placement: the parameter reaches the op as the runtime hands
    it over (its storage placement, or a plan's use placement) and DTensor's own choice follows from there
    (:func:`~hf_colossal_auto.solve.builder.dtensor_choice_rules`). An op none of whose strategies reads it so
    keeps them all (left to the solver, as for an op DTensor's pick is not a strategy of)."""
    out = dict(strategies)
    for i, options in strategies.items():
        node = graph.nodes[i]
        wanted = {}
        for k, vid in enumerate(node.inputs):
            value = graph.values[vid]
            if value.kind is ValueKind.PARAM and value.name in param_uses:
                wanted[k] = param_uses[value.name]
        if not wanted:
            continue
        kept = [
            s
            for s in options
            if all(
                k < len(s.input_placements)
                and s.input_placements[k] is not None
                and s.input_placements[k][0] == p
                for k, p in wanted.items()
            )
        ]
        if kept:
            out[i] = kept
        else:
            logger.debug(
                "%s in %s: no strategy reads its parameters as pinned %s", node.op, node.module, wanted
            )
    return out


def _micro_batch_clause(fixed: int | None, tried: list[int]) -> str:
    """How micro-batching was tried, for the error when nothing fits (it closes the parenthesis)."""
    if fixed is not None:
        return f", with micro_batches={fixed} fixed; micro_batches=None searches it)"
    if len(tried) > 1:
        return f", micro-batching tried: up to {max(tried)} micro-batches per replica)"
    return "; micro-batching tried: no replica's batch splits further)"


def _model_state_floor(graph: StepGraph, ranks: int) -> int:
    """Bytes per device no plan can go below: every parameter and its optimizer state split evenly over
    ``ranks`` (gradients, activations and replicated leftovers come on top)."""
    return math.ceil((graph.total_param_bytes + graph.total_optimizer_state_bytes) / ranks)


def _accumulation_floor(graph: StepGraph, tp: int, shard: int) -> int:
    """Bytes per device no plan in k > 1 micro-batches can go below: the model state over the ``tp x shard``
    ranks sharing it, and every trained parameter's accumulated gradient, split over tensor-parallel ranks
    only (it stays whole over data-parallel ranks until the last micro-batch's synchronisation)."""
    return _model_state_floor(graph, tp * shard) + math.ceil(graph.trainable_param_bytes / tp)


def _best_case(plan: Plan) -> float:
    """What more micro-batches could at best bring a plan's step time down to: its time without recompute
    (they add compute and per-piece collectives and save only memory)."""
    return plan.step_time_s - plan.recompute_time_s


def _recomputes(plan: Plan) -> bool:
    """Whether a plan reruns any block's forward."""
    return any(option != "none" for option in plan.recompute.values())


def _meshes(
    planner: _Planner, mesh_shape: tuple[int, ...] | None, micro_batches: int = 1
) -> list[tuple[int, int]]:
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
        if planner.batch % (dp * micro_batches):
            logger.info(
                "mesh (%d, %d) skipped: global batch %d does not split over %d replicas x %d micro-batches",
                dp,
                tp,
                planner.batch,
                dp,
                micro_batches,
            )
            continue
        usable.append((dp, tp))
    if not usable:
        pieces = f" into {micro_batches} micro-batches per replica" if micro_batches > 1 else ""
        raise ValueError(
            f"No mesh of {n} devices can split the global batch of {planner.batch}{pieces}: use a batch divisible "
            f"by a data-parallel size{' x the micro-batches' if pieces else ''}, or pass mesh_shape=(1, {n}) for "
            "tensor parallelism only."
        )
    return usable


EXPERT_DP_KEY = "ddp-ep"
"""The search key of DDP with every MoE layer expert-parallel over the data-parallel axis."""
EXPERT_FSDP_KEY = "fsdp-ep"
"""The search key of FSDP with every MoE layer expert-parallel over the data-parallel axis: the expert weights
split over dp (whole experts per rank, left out of FSDP), every other parameter sharded by FSDP."""
EXPERT_DP_KEYS = {EXPERT_DP_KEY: "ddp", EXPERT_FSDP_KEY: "fsdp"}
"""Search key of expert parallelism over the data-parallel axis -> the data-parallel mode of the other
parameters."""
_EXPERT_KEY_OF_MODE = {mode: key for key, mode in EXPERT_DP_KEYS.items()}
"""Data-parallel mode -> the search key of the same mode with the experts sharded over the data-parallel axis."""


def _split_mode(key: str) -> tuple[str, int | None]:
    """A search candidate's data-parallel mode and HSDP shard group: "hsdp:16" is HSDP with shard groups of 16
    data-parallel ranks, "hsdp" the cluster's own (one node's data-parallel ranks), "ddp"/"fsdp" themselves;
    "ddp-ep" / "fsdp-ep" are DDP / FSDP with the experts sharded over the data-parallel axis
    (:func:`_is_expert_dp`)."""
    if key in EXPERT_DP_KEYS:
        return EXPERT_DP_KEYS[key], None
    mode, _, shard = key.partition(":")
    return mode, int(shard) if shard else None


def _is_expert_dp(key: str) -> bool:
    """Whether a search key is DDP or FSDP with expert parallelism over the data-parallel axis."""
    return key in EXPERT_DP_KEYS


def _expert_dp_offered(model: nn.Module, mesh: tuple[int, int]) -> bool:
    """Whether expert parallelism over the data-parallel axis is a candidate on ``mesh``: a (dp, 1) mesh with
    dp >= 2 dividing every experts module's experts (the runtime's scope: DDP or FSDP, no tensor
    parallelism)."""
    dp, tp = mesh
    if dp < 2 or tp != 1:
        return False
    modules = experts_modules(model)
    counts = [int(getattr(m, "num_experts", 0) or 0) for m in modules.values()]
    return bool(counts) and all(n > 0 and n % dp == 0 for n in counts)


def _hsdp_candidates(cluster: ClusterSpec, mesh: tuple[int, int]) -> list[tuple[str, int]]:
    """HSDP's shard groups on a mesh, as (search key, shard size): one node's data-parallel ranks (the cluster's,
    :meth:`~hf_colossal_auto.hardware.ClusterSpec.hybrid_shard_size`, key "hsdp") and whole numbers of nodes
    doubling from there (keys "hsdp:<ranks>"), while they divide the data-parallel axis and leave at least two
    replicas. Larger groups trade the all-reduce across replicas and the memory of a smaller shard against
    collectives over more ranks (more latency per collective: at thousands of ranks, where a model's state does
    not fit one node, FSDP over the whole axis pays it on every gather)."""
    dp, tp = mesh
    per_node = cluster.devices_per_node
    if per_node % tp or not cluster.axis_crosses_nodes(mesh, 0):
        return []
    default = cluster.hybrid_shard_size(mesh)
    out = []
    shard = per_node // tp
    while shard < dp:
        if shard > 1 and dp % shard == 0:
            out.append(("hsdp" if shard == default else f"hsdp:{shard}", shard))
        shard *= 2
    return out


def _search_order(planner: _Planner, meshes: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The meshes in the order they are tried: tensor parallelism the size of a node first, then outwards (the
    usual best, so that :meth:`_Search.bounded_out` has a fast plan to prune the others against); the order
    changes what is pruned, not which plan wins (a tie between meshes excepted)."""
    per_node = planner.cluster.devices_per_node
    return sorted(meshes, key=lambda m: abs(math.log2(m[1]) - math.log2(per_node)))


MEASURE_ROUTING = "measure"
"""``routing=`` value that measures the routing on the example batch itself (the model needs its real weights)."""


def _routing(
    model: nn.Module,
    routing: RoutingLoad | str | Path | Mapping | None,
    example_inputs: Mapping[str, Any] | None = None,
) -> RoutingLoad | None:
    """A measured routing load (a :class:`RoutingLoad`, the path of its JSON, or its dict) checked against
    ``model``: one entry per MoE layer, one count per expert (a histogram for another model is refused, naming
    the layer). ``"measure"``: counted on ``example_inputs`` by one forward of ``model`` (what the Trainer and
    accelerate paths have: the real model and a real batch). None: uniform routing."""
    if routing is None:
        return None
    if isinstance(routing, str) and routing == MEASURE_ROUTING:
        return _measured_routing(model, example_inputs)
    if isinstance(routing, (str, Path)):
        routing = RoutingLoad.load(routing)
    elif not isinstance(routing, RoutingLoad):
        routing = RoutingLoad.from_dict(routing)
    routing.check(model)
    return routing


def _measured_routing(model: nn.Module, example_inputs: Mapping[str, Any] | None) -> RoutingLoad:
    """``routing="measure"``: :func:`~hf_colossal_auto.capture.moe.measure_routing` on the example batch (it
    keeps the random state: on the Trainer's path only the planning rank runs it), its refusals prefixed with
    the setting that asked for it."""
    from ..capture.moe import measure_routing

    if example_inputs is None:
        raise ValueError('routing="measure" counts the routing on the example batch; none was given')
    try:
        return measure_routing(model, example_inputs)
    except ValueError as exc:
        raise ValueError(f'routing="measure": {exc}') from exc


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
    dp_modes: tuple[str, ...] = DP_MODES,
    recompute: str = "auto",
    micro_batches: int | None = None,
    routing: RoutingLoad | str | Path | None = None,
) -> Plan:
    """Plan data + tensor parallelism for ``model`` on ``num_devices`` devices of kind ``device``.

    Runs on a meta/fake model with no processes. ``example_inputs`` is one *global* batch (what one optimizer
    step consumes across all data-parallel ranks). ``memory_budget`` is per device, in bytes or a string like
    ``"40GiB"``; None means the device's memory minus the margin of
    :func:`hf_colossal_auto.hardware.memory_budget_default`. ``dp_modes`` are the data-parallel modes tried on
    meshes with a data-parallel axis ("ddp", "fsdp", "hsdp"; HSDP only where that axis crosses nodes). With
    "ddp", MoE models also try DDP with every layer's experts sharded over the data-parallel axis (on (dp, 1)
    meshes whose dp divides every layer's experts: :mod:`hf_colossal_auto.apply.moe`), which ``"ddp-ep"`` alone
    asks for by name; with "fsdp", FSDP with the experts so sharded and left out of FSDP (``"fsdp-ep"``).
    ``recompute``: "auto" chooses activation recompute per
    block jointly with the sharding (one ILP); "none" and "full" fix it for every block; "two-stage" shards
    first and then chooses recompute (a baseline). ``micro_batches``: None searches it — each replica's batch
    (global / dp) runs in k pieces with gradients accumulated and synchronised once, tried where the batch in
    one piece does not fit or needs recompute; an int fixes k for every mesh (1: never split).
    ``routing`` (MoE models): a measured routing histogram (:class:`~hf_colossal_auto.capture.moe.RoutingLoad`,
    e.g. from :func:`~hf_colossal_auto.capture.moe.measure_routing` on one real batch, or the path of its JSON,
    or ``"measure"``: counted on ``example_inputs`` by one forward of ``model``, which then needs real weights
    and a real batch); expert parallelism is then priced by each layer's busiest rank. None assumes routing
    uniform over experts.
    """
    unknown = sorted(set(dp_modes) - {*DP_MODES, *EXPERT_DP_KEYS})
    if unknown or not dp_modes:
        raise ValueError(
            f"dp_modes must be a non-empty subset of {(*DP_MODES, *EXPERT_DP_KEYS)}, got {dp_modes!r}"
        )
    if num_devices < 1:
        raise ValueError(f"num_devices must be >= 1, got {num_devices}")
    if micro_batches is not None and micro_batches < 1:
        raise ValueError(f"micro_batches must be None (searched) or >= 1, got {micro_batches}")
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
    planner.routing = _routing(model, routing, example_inputs)
    spec, budget = planner.spec, planner.budget
    t0 = time.perf_counter()
    search = _Search(planner)
    for mesh in _search_order(planner, _meshes(planner, mesh_shape, micro_batches or 1)):
        for dp_mode in dp_modes if mesh[0] > 1 else ("ddp",):
            if dp_mode in EXPERT_DP_KEYS:  # asked for by name: only where it is offered
                shard = mesh[0] if EXPERT_DP_KEYS[dp_mode] == "fsdp" else 1
                candidates = [(dp_mode, shard)] if _expert_dp_offered(model, mesh) else []
            elif dp_mode == "hsdp":
                # none where the data-parallel axis stays in a node (FSDP is as good) or nodes do not split it
                candidates = _hsdp_candidates(planner.cluster, mesh)[::-1]  # largest first: prunes the rest
            else:
                candidates = [
                    (dp_mode, mesh[0] if dp_mode == "fsdp" else 1)
                ]  # ranks sharing the state with tp
                expert_key = _EXPERT_KEY_OF_MODE.get(dp_mode)
                if expert_key and expert_key not in dp_modes and _expert_dp_offered(model, mesh):
                    candidates.append((expert_key, candidates[0][1]))  # the experts sharded over the replicas
            for key, shard in candidates:
                if search.ruled_out(mesh, key, shard, micro_batches or 1):
                    continue
                if search.bounded_out(mesh, key, micro_batches or 1):
                    continue
                search.try_candidate(mesh, key, micro_batches or 1)
    if micro_batches is None:
        search.try_micro_batches()
    if search.best is None:
        search.run_deferred(search_micro_batches=micro_batches is None)
    best = search.best
    if best is None:
        tried_k = sorted({t["micro_batches"] for t in search.tried})
        raise InfeasibleError(
            f"No plan for {type(model).__name__} on {num_devices} x {spec.name} fits {format_bytes(budget)} per "
            f"device: the smallest per-device memory any plan needs is {format_bytes(search.min_required)}"
            + (
                " (with full activation recompute where it helps"
                if recompute != "none"
                else f" without activation recompute (recompute={recompute!r}"
            )
            + _micro_batch_clause(micro_batches, tried_k)
            + ". Use more devices, a smaller batch or sequence, or a larger budget.",
            min_required=search.min_required,
            exact=False,
            choice=None,
        )
    plan = best
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
    plan.alternatives = search.tried
    plan.solver["total_planning_s"] = time.perf_counter() - t0
    plan.solver["steps_traced"] = planner._graphs.traced
    plan.solver["batch_sizes"] = planner._graphs.sizes
    return plan


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
    micro_batches: int | None = None,
    dp_mode: str | None = None,
    dp_shard_size: int | None = None,
    fit_budget: bool = False,
    pin_uses: bool = False,
    routing: RoutingLoad | str | Path | None = None,
) -> Estimate:
    """Price a Plan, a HF-style tp_plan dict or a named baseline ("ddp", "fsdp", "megatron") under our model.

    ``recompute``: "none", "full" or a selective option ("selective:pointwise": recompute the listed op classes,
    keep the others' outputs) for every block, or "auto" (recompute chosen per block to fit the budget with the
    baseline's placements: the baseline's best case). Default: a Plan's own choice, "none" for the others. A
    Plan is priced under the budget it was made for unless ``memory_budget`` says otherwise, so that pricing a
    solved plan reproduces its own prediction (time and memory). ``micro_batches``: each replica's batch runs in
    that many pieces with one gradient synchronisation (default: a Plan's own, else 1).

    Hand configurations (not for a Plan, which carries its own): ``dp_mode`` runs a "megatron" baseline or a
    tp_plan dict's data-parallel axis as "ddp" (the default), "fsdp" or "hsdp" (torchtitan's FSDP x TP and
    HSDP x TP), ``dp_shard_size`` is HSDP's shard group (default: one node's data-parallel ranks). A baseline is
    priced with the budget lifted (its activation placements chosen for time alone); ``fit_budget`` prices it
    under the budget first (activations placed to fit, as a runtime's sharding would be tuned) and lifts the
    budget only where its pinned choices cannot fit.

    ``pin_uses`` (for a Plan): every parameter is read where the plan's runtime hands it over, at its use
    placement (``Plan.param_use_placements``) or else as stored, instead of the solver choosing again where to
    gather or slice it. A plan whose use placements were edited (the MoE runtime tests use split experts as
    stored) is priced as it will run.

    ``routing``: the MoE routing load to price under, as for :func:`plan_model` (default: a Plan's own
    measured histogram, ``Plan.moe_routing``, else uniform).
    """
    if pin_uses and not isinstance(plan_or_baseline, Plan):
        raise ValueError("pin_uses prices a Plan's own use placements; pass a Plan")
    if recompute not in (None, "auto"):
        parse_option(recompute)  # "none", "full", "selective:<classes>"; raises for anything else
    if isinstance(plan_or_baseline, Plan) and (dp_mode is not None or dp_shard_size is not None):
        raise ValueError("dp_mode and dp_shard_size are a Plan's own; pass them for a baseline or a tp_plan")
    if dp_mode is not None and dp_mode not in DP_MODES:
        raise ValueError(f"dp_mode must be one of {DP_MODES}, got {dp_mode!r}")
    if dp_shard_size is not None and dp_mode != "hsdp":
        raise ValueError("dp_shard_size is HSDP's shard group: pass it with dp_mode='hsdp'")
    hand_dp_mode = dp_mode
    if isinstance(plan_or_baseline, Plan) and memory_budget is None:
        memory_budget = plan_or_baseline.memory_budget_bytes  # the budget the plan was made for
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
    if routing is None and isinstance(plan_or_baseline, Plan) and plan_or_baseline.moe_routing:
        routing = plan_or_baseline.moe_routing
    planner.routing = _routing(model, routing, example_inputs)
    cluster, budget = planner.cluster, planner.budget
    n = num_devices
    if micro_batches is None:
        micro_batches = plan_or_baseline.micro_batches if isinstance(plan_or_baseline, Plan) else 1
    k = micro_batches
    shard: int | None = None
    """HSDP's shard group: a Plan's own (None: the cluster's)."""
    if isinstance(plan_or_baseline, Plan):
        plan = plan_or_baseline
        mesh = (plan.dp_size, plan.tp_size)
        dp_mode = plan.dp_mode
        shard = plan.dp_shard_size if dp_mode == "hsdp" else None
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
    if hand_dp_mode is not None:
        if isinstance(plan_or_baseline, str) and name != "megatron":
            raise ValueError(
                f"{name}: its data-parallel mode is its name; dp_mode is for 'megatron' or a tp_plan"
            )
        if hand_dp_mode != "ddp" and mesh[0] == 1:
            raise ValueError(
                f"{name}: dp_mode {hand_dp_mode!r} needs a data-parallel axis; mesh {mesh} has none"
            )
        dp_mode, shard = hand_dp_mode, dp_shard_size
    if planner.batch % (mesh[0] * k):
        raise ValueError(
            f"{name}: global batch {planner.batch} does not split over {mesh[0]} data-parallel replicas x {k} "
            "micro-batches"
        )
    # a Plan's experts sharded over the data-parallel axis are priced so (Plan.expert_data_parallel)
    expert_dp = isinstance(plan_or_baseline, Plan) and bool(plan_or_baseline.expert_data_parallel)
    tied = TiedGraph.build(planner.graph(mesh[0], k))
    canonical_fixed = {tied.canonical_param(k): v for k, v in fixed.items()}
    param_uses = _plan_param_uses(model, plan_or_baseline) if pin_uses else None
    # Every parameter the baseline does not name stays replicated, as the baseline means; activations are
    # left to the solver (what a runtime's sharding propagation would do best). The budget is lifted so that a
    # baseline that does not fit is still priced, and reported as not fitting.
    if recompute is None:
        recompute = "none" if not isinstance(plan_or_baseline, Plan) else None
    pin: str | dict[str, str] | None = recompute if recompute not in (None, "auto") else None
    if recompute is None:  # a Plan's own per-block choice
        pin = dict(plan_or_baseline.recompute) or "none"
    built = solution = None
    if recompute == "auto":
        built = planner.build(
            mesh,
            dp_mode,
            canonical_fixed,
            pin_unlisted=True,
            micro_batches=k,
            dp_shard_size=shard,
            param_uses=param_uses,
            expert_dp=expert_dp,
        )
        try:
            solution = solve(built.problem, time_limit_s=time_limit_s)
        except InfeasibleError:
            pin = "full"  # priced (and reported as not fitting) with the most recompute there is

    def build_pinned() -> BuiltProblem:
        """The ILP with every placement and the recompute choice pinned as the plan or baseline has them."""
        return planner.build(
            mesh,
            dp_mode,
            canonical_fixed,
            pin_unlisted=True,
            recompute_pin=pin,
            micro_batches=k,
            dp_shard_size=shard,
            param_uses=param_uses,
            expert_dp=expert_dp,
        )

    if solution is None and (isinstance(plan_or_baseline, Plan) or fit_budget):
        # A plan is priced as it was made: under its budget, which its pinned choices fit. With the budget lifted,
        # the activation placements a plan leaves to the solver could trade memory for time, and the estimate
        # would undercut the plan's own prediction.
        try:
            built = build_pinned()
            solution = solve(built.problem, time_limit_s=time_limit_s)
        except InfeasibleError:
            solution = None  # another device or budget than the plan's: priced below with the budget lifted
    if solution is None:
        planner.budget = 1 << 62
        try:
            built = build_pinned()
        finally:
            planner.budget = budget
        solution = solve(built.problem, time_limit_s=time_limit_s)
    plan = planner.to_plan(mesh, dp_mode, built, solution)
    plan.memory_budget_bytes = budget
    return Estimate(name, plan.step_time_s, plan.peak_memory_bytes, budget, tuple(mesh), dp_mode, plan)
