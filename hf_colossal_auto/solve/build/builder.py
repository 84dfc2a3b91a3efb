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

import logging
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ...capture.graph import StepGraph
from ...capture.moe import RoutingLoad
from ...hardware.catalog import DeviceSpec
from ...hardware.roofline import host_time
from ...profile.memory import saved_bytes_per_node
from ...strategies.placements import Strategy
from ..pricing.comm import AxisComm, HybridComm, data_parallel_overlap, data_parallel_shard_size
from ..pricing.compute import BackwardRatios, _backward_ratios, _expert_skews, host_stream_overlaps
from ..pricing.memory import StepMemory, _checkpoint_args
from ..problem import (
    ConditionalCost,
    DecisionEdge,
    DecisionNode,
    FollowsInputs,
    Problem,
    SharedCost,
)
from ..recompute import RecomputeOption, RecomputeUnit, find_units
from ..rules import dtensor_choice_rules, unenforced_split_rules
from ..tied import (
    TiedGraph,
    _weighted,
    differentiable_values,
    forward_producers,
    returned_through_hook,
    shared_projection_inputs,
    value_readers,
)
from .edges import _EdgesPart
from .expert_exchange import ExpertExchange, _ExpertExchangePart
from .memory_rows import _MemoryRowsPart
from .names import _node_name
from .nodes import _NodesPart
from .recompute import _RecomputePart

logger = logging.getLogger(__name__)


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
    dtensor_host_floor_s: float = 0.0
    """:attr:`host_floor_s` were every op run on DTensors (the ops of ``local_modules`` too): a lower bound on one
    micro-batch of the same candidate priced without local shards, so that its ILP need not be solved where the
    local one is already faster (:meth:`~..candidates._Planner.solve_mesh`)."""
    backward_ratios: BackwardRatios = field(default_factory=lambda: BackwardRatios({}, {}))
    """Per module, backward over forward (device time, op count): how a node's cost splits into its forward
    and its backward (where in the step the ranks synchronise, :mod:`.prediction`)."""
    expert_data_parallel: dict[str, ExpertExchange] = field(default_factory=dict)
    """Experts modules (canonical FQN) run expert-parallel over the data-parallel axis, with the collectives
    each runs per micro-batch (:func:`expert_exchanges`); empty unless the problem was built with
    ``expert_dp``."""
    expert_dp_params: frozenset[str] = frozenset()
    """Canonical FQNs of the per-expert weights stored ``E/dp`` experts per data-parallel rank then."""
    local_modules: tuple[str, ...] = ()
    """The modules whose ops the problem prices as run on local shards (:attr:`Plan.local_modules`)."""
    returned_via: dict[str, dict[int, tuple[int, int]]] = field(default_factory=dict)
    """Op node name -> output position -> (reader, input position): returned outputs whose return to the caller
    the edge to that reader prices, not the node (:func:`~..tied.returned_through_hook`)."""

    def returned_as(self, name: str) -> dict[int, None]:
        """``boundary_reshardings``' ``returned_as`` for the node's cost as built: those outputs left out."""
        return dict.fromkeys(self.returned_via.get(name, {}))


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
    step_memory: StepMemory | None = None,
    eager_nodes: frozenset[int] = frozenset(),
    local_modules: tuple[str, ...] = (),
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

    ``step_memory``: what problems built from ``graph`` share of its memory (its unrolled timeline and liveness
    snapshots), for a caller that builds several from one step; None works it out for this problem alone.

    ``eager_nodes`` (forward node indices) are the ops of ``local_modules``, the modules the runtime runs on local
    tensor shards (:mod:`~hf_colossal_auto.solve.local_tensor_parallel`; their strategies pinned by the caller):
    their host seconds are an eager op's, not DTensor's dispatch, and the plan lists the modules.

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
        step_memory=step_memory,
        eager_nodes=eager_nodes,
        local_modules=local_modules,
    ).build()


class _ProblemBuilder(_NodesPart, _EdgesPart, _RecomputePart, _MemoryRowsPart, _ExpertExchangePart):
    """Builds the ILP of :func:`build_problem` for one mesh and data-parallel mode, one part per method.

    ``__init__`` holds what every part reads: the inputs (the graph, the strategies, device and communication
    models), what :meth:`_derive_from_graph` works out of the graph (its tied copies, backward ratios, recompute
    units and the liveness snapshots) and the empty parts of :meth:`_start_problem`; :meth:`build` runs the
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
        step_memory: StepMemory | None = None,
        eager_nodes: frozenset[int] = frozenset(),
        local_modules: tuple[str, ...] = (),
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
        if step_memory is not None and step_memory.graph is not graph:
            raise ValueError("build_problem: step_memory belongs to another step than the graph being built")
        self.step_memory = step_memory if step_memory is not None else StepMemory(graph)
        """What problems built from this step share of its memory (:class:`StepMemory`)."""
        self.eager_nodes = eager_nodes
        """Forward nodes run as eager ops on local shards (no DTensor dispatch)."""
        self.local_modules = local_modules

        self._derive_from_graph(recompute_layers, expert_dp)
        self._start_problem()

    def _derive_from_graph(self, recompute_layers: Sequence[str] | None, expert_dp: bool) -> None:
        """What every part reads of the graph: its tied copies, expert skews and experts over dp, backward
        ratios, producers and readers, recompute units, checkpoint arguments and the liveness snapshots."""
        graph = self.graph
        self.tied = self._of_step(("tied",), lambda: TiedGraph.build(graph))
        self.expert_skews = _expert_skews(graph, self.tied, self.routing, self.tp)
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
        self.ratios = self._of_step(
            ("backward_ratios", self.spec), lambda: _backward_ratios(graph, self.spec)
        )
        self.producer = forward_producers(graph)
        self.canon_nodes = sorted({self.tied.canonical[i] for i in self.tied.canonical})
        self.readers = value_readers(graph, self.tied)
        self.grads = differentiable_values(graph)
        self.shared_uses = shared_projection_inputs(graph, self.tied)
        self.returned_via: dict[tuple[int, int], tuple[int, int]] = self._of_step(
            ("returned_via",), lambda: returned_through_hook(graph, self.tied)
        )
        """(reader, input position) -> (node, output position) of a returned output its module's boundary gives
        that reader's placement before the model returns it (:func:`returned_through_hook`): the gather to the
        caller is priced on the edge to the reader."""
        self.returned_by_node: dict[str, dict[int, tuple[int, int]]] = defaultdict(dict)
        """:attr:`returned_via` by op node name and output position (:attr:`BuiltProblem.returned_via`)."""
        for reader, (node, pos) in self.returned_via.items():
            self.returned_by_node[_node_name(node)][pos] = reader
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
        (
            self.peak_snapshot,
            self.phase_peak,
            self.unit_snapshots,
            self.start_snapshots,
            self.forward_snapshots,
        ) = self._snapshots()
        self.weighted_saved = _weighted(self.tied, self.peak_snapshot.by_node)
        """Canonical node -> bytes it holds at the activation peak, over every copy it stands for."""
        self.saved_for_backward = _weighted(self.tied, saved_bytes_per_node(graph))
        """Canonical node -> bytes its outputs keep into backward, wherever the peak falls (a T5 decoder block's
        activations are all freed by the time of its step's peak, yet its backward needs them)."""

    def _of_step(self, key: tuple, make: Callable[[], Any]) -> Any:
        """``make()``, a figure that depends on the step and ``key`` only (read, never changed, by the parts):
        worked out once for the problems built from the step (kept with its :class:`StepMemory`)."""
        parts = self.step_memory.parts
        if key not in parts:
            parts[key] = make()
        return parts[key]

    def _start_problem(self) -> None:
        """The problem's parts, empty: filled in by the parts of :meth:`build`."""
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
        self.dtensor_host_floor_s = 0.0
        self.host_terms: dict[str, float] = {}
        """Op node -> host seconds of its forward and backward ops (where the host runs ahead of the device:
        priced per block by :func:`host_stream_overlaps`, not in the node's cost)."""
        self.edge_calls: dict[tuple[str, str], list[list[float]]] = {}
        """Edge -> per strategy pair the tensor-parallel collectives (DTensor redistributions) it issues, each
        of which costs the host a DTensor op (:func:`host_stream_overlaps`)."""
        self.segment_of: dict[str, str] = {}
        """Op node -> the block (recompute unit) whose host stream it belongs to; "" outside the blocks."""

    def _edge_host(self, reruns: set[str]) -> dict[tuple[str, str], list[list[float]]]:
        """Where the host runs ahead of the device: per edge into an op of a host stream, the host's seconds of
        its redistributions (one DTensor op each, :meth:`~..candidates._Planner.axis_comm` prices it in the
        collective's call), taken out of the edge's cost (which keeps the device's seconds) and priced by the
        stream instead. Empty elsewhere, and where the axis prices no call overhead."""
        per_call = min(host_time(self.spec, dtensor=True), self.tp_comm.call_overhead_s)
        if not self.host_terms or per_call <= 0:
            return {}
        out = {}
        for key, calls in self.edge_calls.items():
            if key[0] in reruns or key[1] not in self.host_terms or not any(any(row) for row in calls):
                continue
            host = [[per_call * n for n in row] for row in calls]
            cost = self.edge_cost[key]
            self.edge_cost[key] = [
                [max(c - h, 0.0) for c, h in zip(cr, hr, strict=True)]
                for cr, hr in zip(cost, host, strict=True)
            ]
            out[key] = host
        return out

    def _dtensor_choice_rules(self) -> list[FollowsInputs]:
        """:func:`dtensor_choice_rules` of this problem. They depend on the step, its strategies, the
        tensor-parallel axis and the parameters' storage options only, so the problems built from one step on
        one axis (a mesh's data-parallel modes) ask DTensor once: kept with the step's :class:`StepMemory`
        (the rules are not changed once made)."""
        cache = self.step_memory.parts
        options = tuple((name, tuple(opts)) for name, opts in self.param_options.items())
        key = ("dtensor_rules", id(self.strategies), self.tp, self.axis, options)
        kept = cache.get(key)
        if kept is None or kept[0] is not self.strategies:
            rules = dtensor_choice_rules(
                self.graph, self.tied, self.strat_of, self.param_options, self.axis, (self.tp,)
            )
            kept = cache[key] = (self.strategies, rules)
        return list(kept[1])

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
        reruns = set(self.rc_names)
        edge_host = self._edge_host(reruns)
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
            )
            + host_stream_overlaps(
                self.nodes,
                {key: m for key, m in self.edge_cost.items() if key[0] not in reruns},
                self.host_terms,
                self.segment_of,
                edge_host,
            ),
            name=f"mesh{self.mesh_shape}-{self.dp_mode}",
            fixed=self.fixed,
            conditional_costs=self.conditional,
            follows_inputs=unenforced_split_rules(
                self.graph, self.tied, self.strat_of, self.node_of_name, self.axis
            )
            + (self._dtensor_choice_rules() if self.dtensor_rules else [])
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
            dtensor_host_floor_s=self.dtensor_host_floor_s,
            backward_ratios=self.ratios,
            expert_data_parallel=self.expert_dp,
            expert_dp_params=frozenset(self.expert_dp_params),
            local_modules=self.local_modules,
            returned_via=dict(self.returned_by_node),
        )
