"""One candidate: the step traced (or interpolated) at its local batch, its strategies, its ILP built and
solved (:class:`_Planner`), and the Plan written from the solution."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..capture.batch_rows import TracesByRows
from ..capture.graph import Phase, StepGraph, ValueKind
from ..capture.moe import RoutingLoad
from ..capture.shared_casts import share_sibling_casts
from ..capture.tracer import trace_training_step
from ..hardware import ClusterSpec, DeviceSpec, get_device
from ..hardware.catalog import memory_budget_default
from ..hardware.roofline import host_time
from ..plan import Plan, layout_runs_on_plain_tensors
from ..profile.profiler import _module_list_children
from ..strategies import enumerate_strategies
from ..strategies.placements import Strategy
from ..units import parse_bytes
from .build.builder import BuiltProblem, build_problem
from .build.names import NodeKind
from .ilp import solve
from .local_tensor_parallel import LocalLayout, local_tensor_parallel_layout
from .pricing.comm import AxisComm, HybridComm
from .pricing.memory import StepMemories
from .problem import InfeasibleError, Solution
from .tied import TiedGraph
from .writeup import WriteupContext, _make_plan

logger = logging.getLogger(__name__)


RECOMPUTE_MODES = ("auto", "none", "full", "two-stage")
"""``auto``: recompute per block chosen jointly with sharding; ``none``/``full``: fixed for every block;
``two-stage``: shard first ignoring memory, then choose recompute (the baseline the joint ILP beats)."""


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


LIFTED_BUDGET = 1 << 62
"""The per-device budget of a problem priced whatever memory it needs (a baseline that does not fit, the first
stage of ``two-stage``): large enough that no constraint binds, finite for the solver."""


class CandidateInfeasibleError(InfeasibleError):
    """A candidate whose budget no choice meets, with the problem it was (:attr:`built`)."""

    def __init__(self, error: InfeasibleError, built: BuiltProblem) -> None:
        super().__init__(str(error), min_required=error.min_required, exact=error.exact, choice=error.choice)
        self.built = built


class PlanningTimeoutError(ValueError):
    """The solver's time limit ran out before it found any plan for a candidate mesh."""


def _solve_candidate(built: BuiltProblem, time_limit_s: float, what: str) -> Solution:
    """``built`` solved; where nothing fits, the error carries ``built``; where the solver's time ran out
    before it found any choice (an empty choice would fail later, in pricing, with no word of the cause), a
    clear error naming ``what`` (the candidate) and the time limit."""
    try:
        solution = solve(built.problem, time_limit_s=time_limit_s)
    except InfeasibleError as exc:
        raise CandidateInfeasibleError(exc, built) from exc
    if solution.choice or solution.status != "timeout_no_solution":
        return solution
    raise PlanningTimeoutError(
        f"the solver found no plan for {what} within time_limit_s={time_limit_s:g} "
        f"({solution.num_variables} variables, {solution.num_constraints} constraints): raise plan_model's "
        "(or autoparallelize's) time_limit_s, or fix the mesh with mesh_shape"
    )


class _Planner:
    """Caches traces (per local batch), strategies (per trace and tensor-parallel size) and what the problems
    built from one trace share of its memory (:class:`~.pricing.memory.StepMemories`)."""

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
        self._step_memories = StepMemories()
        """What the problems built from one step share of its memory (timeline, liveness snapshots), per step."""
        self.routing: RoutingLoad | None = None
        """A measured routing load the MoE costs are priced under (:func:`_routing`); None: uniform."""
        self._local: dict[tuple[int, int], tuple[LocalLayout, dict, dict[str, str]]] = {}
        """By (micro-batch rows, tensor-parallel size): the modules that can run on local shards, the strategies
        with theirs pinned (one dict per key, so that the problems built from it share their cached edges and
        DTensor rules) and their parameters' placements by canonical FQN."""
        self.cp = 1
        """Context-parallel ranks per replica (a context-parallel planner's degree; its meshes' first entry is
        ``dp x cp``): whether FSDP runs on ordinary tensors depends on it."""

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
        """The step as a planned model runs it: traced, then its sibling projections' input casts shared as the
        runtime shares them under autocast (:mod:`hf_colossal_auto.capture.shared_casts`)."""
        graph = trace_training_step(
            self.model,
            _first_rows(self.inputs, rows),
            mixed_precision=self.mixed_precision,
            optimizer=self.optimizer,
            device_kind=self.spec.kind,
        )
        share_sibling_casts(graph)
        return graph

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

    def local_layout(self, dp: int, tp: int, micro_batches: int = 1) -> LocalLayout:
        """The attention / MLP modules of the blocks that can run on local tensor shards at ``tp``
        (:func:`~.local_tensor_parallel.local_tensor_parallel_layout`; empty without a tensor-parallel axis)."""
        return self._local_parts(dp, tp, micro_batches)[0]

    def _local_parts(self, dp: int, tp: int, micro_batches: int) -> tuple[LocalLayout, dict, dict[str, str]]:
        key = (self.batch // (dp * micro_batches), tp)
        if key not in self._local:
            if tp < 2:
                self._local[key] = (LocalLayout(), {}, {})
            else:
                graph = self.graph(dp, micro_batches)
                strategies = self.strategies(dp, tp, micro_batches)
                layout = local_tensor_parallel_layout(self.model, graph, strategies, self.layers, tp)
                tied = TiedGraph.build(graph)
                params = {tied.canonical_param(fqn): p for fqn, p in layout.params.items()}
                self._local[key] = (layout, {**strategies, **layout.pins}, params)
        return self._local[key]

    def offers_mesh(self, mesh: tuple[int, int]) -> bool:
        """Whether the search tries ``mesh`` (every mesh here; a context-parallel planner narrows it)."""
        return True

    def fixed_added_s(self, mesh: tuple[int, int], micro_batches: int) -> float:
        """Seconds every plan of ``(mesh, micro_batches)`` gets after its ILP is solved, whatever its choices: a
        term the search adds to its lower bounds (none here; a context-parallel planner's per-micro-batch
        collectives)."""
        return 0.0

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
        budget: int | None = None,
        strategy_pins: Mapping[int, list[Strategy]] | None = None,
        local: bool = False,
    ) -> BuiltProblem:
        """The ILP of one mesh (under ``budget``, default the planner's; :data:`LIFTED_BUDGET` to price what does
        not fit); recompute is a decision unless ``recompute_pin`` (or the planner's mode "none" /
        "full") fixes it. ``micro_batches``: the step runs each replica's batch in that many pieces.
        ``dp_shard_size``: HSDP's shard group (default: the cluster's, :meth:`hybrid_comm`). ``dtensor_rules``:
        False builds the relaxation without DTensor's own choices (:func:`build_problem`). ``param_uses``
        (canonical parameter FQN -> tensor-parallel placement) pins where every op that reads a parameter reads
        it (:func:`_pin_param_uses`). ``expert_dp``: every MoE layer expert-parallel over the data-parallel
        axis (:func:`build_problem`). ``strategy_pins`` (graph node -> the strategies it keeps): a hand layout's
        narrowed choices (the ``"megatron-sp"`` baseline's sequence-sharded regions,
        :func:`~.sequence_parallel.sequence_parallel_pins`). ``local``: the modules of :meth:`local_layout` run on
        local tensor shards — their parameters pinned to Megatron's placements, their ops to the strategies local
        execution runs, priced as eager ops (the plan lists them in :attr:`Plan.local_modules`).

        DDP, FSDP and HSDP on a ``(dp, 1)`` mesh run on ordinary tensors
        (:func:`~hf_colossal_auto.plan.layout_runs_on_plain_tensors`, the rule the runtime reads,
        :mod:`hf_colossal_auto.apply.data_parallel`): their ops are priced without DTensor's per-op host cost
        (not FSDP over ``dp x cp``, nor experts over dp, which run on DTensors). A tensor-parallel mesh's ILP prices every choice on
        DTensors, the one that replicates everything too (which the runtime also runs on ordinary tensors: an
        over-prediction the ILP cannot avoid without a variable for "anything sharded")."""
        if recompute_pin is None and self.recompute in ("none", "full"):
            recompute_pin = self.recompute
        dp, tp = mesh
        graph = self.graph(dp, micro_batches)
        tp_comm = self.axis_comm(mesh, 1)
        dp_comm = self.hybrid_comm(mesh, dp_shard_size) if dp_mode == "hsdp" else self.axis_comm(mesh, 0)
        strategies = self.strategies(dp, tp, micro_batches)
        layout = LocalLayout()
        if local:
            layout, strategies, local_params = self._local_parts(dp, tp, micro_batches)
            fixed_params = {**(fixed_params or {}), **local_params} if layout else fixed_params
        if strategy_pins:
            strategies = {**strategies, **strategy_pins}
        if param_uses:
            strategies = _pin_param_uses(graph, strategies, param_uses)
        plain = layout_runs_on_plain_tensors(tp, dp_mode, self.cp, expert_dp)  # the runtime's own rule
        return build_problem(
            graph,
            strategies,
            spec=self.plain_spec if plain else self.spec,
            mesh_shape=mesh,
            tp_comm=tp_comm,
            dp_comm=dp_comm,
            dp_mode=dp_mode,
            budget=self.budget if budget is None else budget,
            fixed_params=fixed_params,
            pin_unlisted=pin_unlisted,
            recompute_layers=self.layers,
            recompute_pin=recompute_pin,
            micro_batches=micro_batches,
            dtensor_rules=dtensor_rules,
            routing=self.routing,
            expert_dp=expert_dp,
            step_memory=self._step_memories.of(graph),
            eager_nodes=layout.nodes,
            local_modules=layout.modules,
        )

    @property
    def plain_spec(self) -> DeviceSpec:
        """The device as a plan on ordinary tensors runs on it: no DTensor host cost per op."""
        return self.spec.with_overrides(dtensor_overhead_s=0.0)

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
        """Build and solve one candidate. Where its budget cannot be met, :class:`CandidateInfeasibleError` carries
        the problem (the micro-batch search prices it without the budget as a lower bound).

        On a tensor-parallel mesh with modules that can run on local shards (:meth:`local_layout`) the candidate
        is also solved with them so (Megatron's layout there, its ops eager), and the faster of the two that fits
        is kept: local execution saves DTensor's dispatch on every op inside, but pins those modules' layout, which
        the free solution may beat (a layout that needs less memory, or shards differently). The local one is
        solved first, and the other not at all where the host's seconds alone of its ops on DTensors
        (:attr:`BuiltProblem.dtensor_host_floor_s`, per micro-batch) already exceed it."""
        if self.recompute == "two-stage":
            return self._two_stage(mesh, dp_mode, fixed_params, micro_batches, dp_shard_size, expert_dp)
        name = self._candidate_name(mesh, dp_mode)
        solved: list[tuple[BuiltProblem, Solution]] = []
        error: CandidateInfeasibleError | None = None
        local_offered = not expert_dp and bool(self.local_layout(mesh[0], mesh[1], micro_batches))
        for local in (True, False) if local_offered else (False,):
            if (
                not local
                and solved
                and solved[0][1].objective_s < micro_batches * solved[0][0].dtensor_host_floor_s
            ):
                break  # DTensor's host seconds alone exceed the local plan: it cannot be faster
            built = self.build(
                mesh,
                dp_mode,
                fixed_params,
                micro_batches=micro_batches,
                dp_shard_size=dp_shard_size,
                expert_dp=expert_dp,
                local=local,
            )
            try:
                solved.append((built, _solve_candidate(built, self.time_limit_s, name)))
            except CandidateInfeasibleError as exc:
                error = error or exc
        if not solved:
            assert error is not None
            raise error
        return min(solved[::-1], key=lambda pair: pair[1].objective_s)  # the DTensor one on a tie

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
        first = self.build(
            mesh,
            dp_mode,
            fixed_params,
            recompute_pin="none",
            micro_batches=micro_batches,
            dp_shard_size=dp_shard_size,
            expert_dp=expert_dp,
            budget=LIFTED_BUDGET,
        )
        sharding = solve(first.problem, time_limit_s=self.time_limit_s).choice
        built = self.build(
            mesh,
            dp_mode,
            fixed_params,
            micro_batches=micro_batches,
            dp_shard_size=dp_shard_size,
            expert_dp=expert_dp,
        )
        fixed = dict(built.problem.fixed)
        for node in built.problem.nodes:
            decided_by_recompute = node.kind in (NodeKind.RECOMPUTE, NodeKind.HOLD)
            if node.name in sharding and not decided_by_recompute:
                fixed[node.name] = sharding[node.name]
        built.problem = dataclasses.replace(built.problem, fixed=fixed)
        return built, _solve_candidate(built, self.time_limit_s, self._candidate_name(mesh, dp_mode))

    def _candidate_name(self, mesh: tuple[int, int], dp_mode: str) -> str:
        return f"mesh {mesh[0]}x{mesh[1]} ({dp_mode}) of {type(self.model).__name__}"

    def to_plan(self, mesh: tuple[int, int], dp_mode: str, built: BuiltProblem, solution: Solution) -> Plan:
        context = WriteupContext(
            model=self.model,
            inputs=self.inputs,
            spec=self.spec,
            cluster=self.cluster,
            budget=self.budget,
            batch=self.batch,
            routing=self.routing,
            graph=self.graph(mesh[0], built.micro_batches),
            tp_comm=self.axis_comm(mesh, 1),
        )
        return _make_plan(context, mesh, dp_mode, built, solution)


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
