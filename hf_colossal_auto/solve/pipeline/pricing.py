"""How a stage layout is priced. One ILP of the inner mesh per (tp, rows of one micro-batch per replica, recompute
option, lean or not), on a cluster of that inner mesh, with the budget lifted and the recompute of
every block pinned to the option ("none", "selective:pointwise" — torchtitan's selective policy — and "full").
The parameter placements of the "none" solution are pinned in the others, so that every option prices the
same layout. Identical blocks are solved once (the ILP's folded runs). From each solution every depth unit's
forward and backward seconds per micro-batch (ops, tensor-parallel reshardings, the reruns of recompute — all
backward), and the activation bytes it keeps for backward are read; the ILP's data-parallel figures are not
used: they are priced here per pp semantics, per parameter, from its tensor-parallel shard:

* DDP: parameters + gradients + optimizer state whole on every replica; the gradient all-reduce once per step,
  after the stage's last backward.
* FSDP / HSDP under a pipeline, as torch's pipelining runs an FSDP2 stage (``reshard_after_backward`` off and
  gradient sync off until the last backward; torchtitan does not reshard after forward under pp): every
  parameter is all-gathered once per step, before the stage's first forward (priced as the part that a
  micro-batch's forward does not hide plus the first block's gather), kept gathered through the step together
  with its unsharded accumulated gradient (so a stage holds its parameters and gradients whole over dp, only the
  optimizer state and the fp32 master sharded), and reduce-scattered once after the last backward (HSDP: in its
  shard group, then the shard all-reduced across replicas).
"""

from __future__ import annotations

import dataclasses
import functools
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ...capture.graph import Phase, ValueKind
from ...capture.op_classes import MATMUL, WEIGHT_COPIES, op_class
from ...hardware import ClusterSpec
from ...pipeline_layout import PipelineLayout, sends_sequence_shards
from ..baselines import _attention_heads
from ..build.builder import BuiltProblem
from ..build.names import MemoryRow, NodeKind, _node_name, memory_row_name
from ..candidates import LIFTED_BUDGET, _first_rows, _Planner
from ..context_parallel_search import sequence_length
from ..ilp import solve
from ..pricing.comm import AxisComm, shard_factor
from ..pricing.compute import HOST_STREAM, overlap_parts
from ..problem import InfeasibleError, Solution, memory_usage
from ..recompute import RERUN, UNREAD
from ..tied import TiedGraph
from ..writeup import (
    _activation_per_unit,
    _module_output_placements,
    _real_modules,
    _recompute_choice,
    _unit_mapper,
    _unit_order,
    forward_peak_row,
)
from .costs import STAGE_DP_MODES, ModelCosts, StageLayout, UnitCost


@dataclass(frozen=True)
class _ParamShare:
    """One real parameter's figures on one device of a stage, before the data-parallel mode is applied."""

    unit: str
    local_bytes: float
    """The parameter's bytes after tensor parallelism."""
    state_bytes: float
    """Its optimizer state after tensor parallelism."""
    grad_bytes: float
    """Its gradient (0 for a frozen parameter)."""
    temp_bytes: float
    """The optimizer step's temporaries for it."""
    optimizer_s: float
    """Its optimizer step on the tensor-parallel shard, unsharded over dp."""
    fqn: str = ""
    """The canonical parameter name."""


@dataclass
class InnerPricing:
    """One inner ILP solved: one micro-batch of one replica at (tp, rows, recompute option), per unit."""

    units: dict[str, UnitCost]
    """Forward, backward and kept activation bytes per unit (no data-parallel figures)."""
    params: list[_ParamShare]
    send_bytes: int
    """What a stage sends on per micro-batch and device: the hidden states, a tp-th of them where
    :attr:`sequence_sharded_sends`."""
    planner: _Planner
    mesh: tuple[int, int]
    dp_mode: str
    built: BuiltProblem
    solution: Solution
    param_choice: dict[str, str]
    """Canonical parameter FQN -> its tensor-parallel storage placement."""
    output_bytes: int = 0
    """The model's largest output of one micro-batch on one device (the logits)."""
    backward_transient_bytes: float = 0.0
    """The activation-peak row's transient (:attr:`ModelCosts.backward_transient_bytes`)."""
    local: bool = False
    """Whether the layout runs its qualifying attention / MLP modules on local tensor shards
    (:mod:`..local_tensor_parallel`; the plan lists them)."""
    sequence_sharded_sends: bool = False
    """Whether stages of this layout send each tensor-parallel rank's sequence shard
    (:func:`~hf_colossal_auto.pipeline_layout.sends_sequence_shards` of the solution's block outputs)."""

    @property
    def recompute_names(self) -> frozenset[str]:
        """The recompute options the solution runs its units under: the pinned one, as the builder resolved it
        (a ``;rerun=*`` pin names each unit's own modules)."""
        choice = self.solution.choice
        return frozenset(options[choice[rc]].name for rc, options in self.built.recompute_options.items())


class _Pricer:
    """Prices stage layouts for one model, caching the inner ILPs by (tp, rows, recompute option, lean) and the
    per-layout costs by (pp, layout, micro-batches, options). ``fixed_params`` (FQN -> tensor-parallel placement)
    pins a hand configuration's placements in every ILP. ``local``: whether a tensor-parallel layout runs the
    attention / MLP modules that qualify on local shards (:meth:`_Planner.local_layout`): None prices it both ways
    and keeps the faster (the search), True / False one way (a hand configuration, a Plan re-priced).
    ``sequence_parallel``: the ops between the tensor-parallel regions of ``fixed_params`` run on sequence shards
    (Megatron-LM's sequence parallelism, the ``"megatron-sp"`` hand layout:
    :func:`~..sequence_parallel.sequence_parallel_pins`), in every ILP of tp > 1."""

    def __init__(
        self,
        planner: _Planner,
        layout: PipelineLayout,
        fixed_params: dict[str, str] | None = None,
        pin_unlisted: bool = False,
        local: bool | None = None,
        sequence_parallel: bool = False,
    ) -> None:
        if sequence_parallel and not fixed_params:
            raise ValueError(
                "sequence parallelism inside pipeline stages needs the tensor-parallel placements"
            )
        self.planner = planner
        self.layout = layout
        self.fixed_params = fixed_params
        self.pin_unlisted = pin_unlisted
        self.local = local
        self.sequence_parallel = sequence_parallel
        self._inner: dict[tuple, InnerPricing] = {}
        self._costs: dict[tuple, ModelCosts] = {}
        self._tied_names: set[str] | None = None
        self.ilps = 0

    def tied_names(self) -> set[str]:
        """The names of the parameters the embedding and the head share (the tied head), read once: walking a
        deep model's parameters per priced layout cost more than the layout's own arithmetic."""
        if self._tied_names is None:
            model = self.planner.model
            embedding = {id(p) for p in model.get_submodule(self.layout.embedding).parameters()}
            head = {id(p) for p in model.get_submodule(self.layout.head).parameters()}
            shared = embedding & head
            self._tied_names = {
                n for n, p in model.named_parameters(remove_duplicate=False) if id(p) in shared
            }
        return self._tied_names

    def inner(self, tp: int, rows: int, option: str, lean: bool = False) -> InnerPricing:
        key = (tp, rows, option, lean)
        if key not in self._inner:
            fixed = self.fixed_params
            budgets = [LIFTED_BUDGET]
            if option != "none" or lean:
                none = self.inner(tp, rows, "none")
                fixed = none.param_choice  # the same layout under every option
                if lean:
                    budgets = _lean_budgets(self.inner(tp, rows, option), tp) + budgets
                self._inner[key] = self._solve(tp, rows, option, fixed, budgets, none.local)
            else:
                self._inner[key] = self._faster(tp, rows, option, fixed, budgets)
        return self._inner[key]

    def _faster(
        self, tp: int, rows: int, option: str, fixed: dict[str, str] | None, budgets: list[int]
    ) -> InnerPricing:
        """The layout priced each way :meth:`_ways` offers, the faster kept (the DTensor one on a tie); the DTensor
        ILP is not solved where its ops' host seconds alone exceed the local solution (as the flat search)."""
        priced: list[InnerPricing] = []
        for local in self._ways(tp, rows)[::-1]:
            if priced and priced[0].solution.objective_s < priced[0].built.dtensor_host_floor_s:
                break
            priced.append(self._solve(tp, rows, option, fixed, budgets, local))
        return min(priced[::-1], key=lambda p: p.solution.objective_s)

    def _ways(self, tp: int, rows: int) -> tuple[bool, ...]:
        """How a layout of ``tp`` at ``rows`` is priced: on DTensors, on local shards where modules qualify, or
        both (:attr:`local` None; the faster is kept, the DTensor one on a tie)."""
        if tp < 2 or self.local is False:
            return (False,)
        layout = self._planner_of(tp, rows).local_layout(1, tp)
        if not layout and self.local:
            why = "; ".join(f"{m}: {r}" for m, r in sorted(layout.refused.items())[:4])
            raise ValueError(
                f"megatron-local: no module of the blocks runs on local tensor shards at tp={tp} ({why}); price "
                "'megatron' (the same placements on DTensors)"
            )
        if not layout:
            return (False,)
        return (True,) if self.local else (False, True)

    def _planner_of(self, tp: int, rows: int, dp: int = 1) -> _Planner:
        """The planner of an inner mesh ``(dp, tp)`` at ``rows`` rows per replica, sharing the outer planner's
        traces, strategies and local layouts."""
        planner = self.planner
        inner = _planner_on(planner, _first_rows(planner.inputs, rows * dp), dp * tp)
        inner._graphs = planner._graphs
        inner._step_memories = planner._step_memories
        inner._strategies = planner._strategies
        inner._local = planner._local
        inner.routing = planner.routing
        return inner

    def _solve(
        self,
        tp: int,
        rows: int,
        option: str,
        fixed: dict[str, str] | None,
        budgets: list[int],
        local: bool = False,
    ) -> InnerPricing:
        """The ILP of one replica's micro-batch on the inner mesh ``(1, tp)``, recompute pinned, its activation
        peak under the first of ``budgets`` a choice meets (lean ones, :func:`_lean_budgets`, then lifted), its
        other memory rows lifted (a stage's state is priced by :func:`_data_parallel_side`). Its ops are priced
        as every stage layout of that tp runs them: the planner's build decides by the runtime's rule
        (:func:`~hf_colossal_auto.plan.layout_runs_on_plain_tensors`), which at tp 1 holds for DDP, FSDP and
        HSDP alike (a stage has neither context parallelism nor experts over dp) and at tp > 1 for none, so
        the stage's own dp mode and size do not change it."""
        planner = self.planner
        mode = "ddp"
        inner = self._planner_of(tp, rows)
        mesh = (1, tp)
        built = inner.build(
            mesh,
            mode,
            fixed_params=fixed,
            pin_unlisted=self.pin_unlisted,
            recompute_pin=option,
            budget=LIFTED_BUDGET,
            strategy_pins=self._sequence_parallel_pins(inner, tp),
            local=local,
        )
        peak = built.problem.memory_constraint(memory_row_name(MemoryRow.ACTIVATION_PEAK))
        solution = None
        for budget in budgets:
            peak.budget = budget
            self.ilps += 1
            try:
                solution = solve(built.problem, time_limit_s=planner.time_limit_s)
                break
            except InfeasibleError:  # the next, looser budget
                continue
        assert solution is not None  # the last budget is lifted
        graph = inner.graph(1)
        tied = TiedGraph.build(graph)
        units = _unit_costs(planner, built, solution, graph, tied, tp)
        params, choice = _param_shares(planner, built, solution, graph, tp)
        output = max((graph.values[v].nbytes for v in graph.output_values), default=0)
        transient = max(0.0, peak.constant - graph.input_bytes - graph.buffer_bytes)
        sharded = tp > 1 and sends_sequence_shards(
            self.layout,
            _module_output_placements(built, solution, graph, tied, mesh),
            tp,
            sequence_length(planner.inputs),
        )
        sends = _send_bytes(graph, self.layout) // (tp if sharded else 1)
        return InnerPricing(
            units,
            params,
            sends,
            inner,
            mesh,
            mode,
            built,
            solution,
            choice,
            output,
            transient,
            local,
            sharded,
        )

    def _sequence_parallel_pins(self, inner: _Planner, tp: int) -> dict | None:
        """The ``"megatron-sp"`` layout's sequence-sharded regions on the inner mesh ``(1, tp)`` (None: not
        asked for, or no tensor parallelism)."""
        if not self.sequence_parallel or tp < 2:
            return None
        from ..sequence_parallel import hand_layout_pins

        return hand_layout_pins(inner, self.fixed_params or {}, (1, tp))

    def costs(self, pp: int, stage: StageLayout, micro_batches: int, options: tuple[str, ...]) -> ModelCosts:
        """The model's per-unit costs for ``stage`` in a ``pp``-stage pipeline at ``micro_batches`` micro-batches,
        blocks priced under each recompute option of ``options`` ("none" always)."""
        key = (pp, stage, micro_batches, options)
        if key not in self._costs:
            rows = self.planner.batch // (stage.dp * micro_batches)
            none = self.inner(stage.tp, rows, "none", stage.lean)
            param_side = _data_parallel_side(self.planner, none.params, pp, stage)
            costs = _with_param_side(none, param_side, self.planner, self.layout)
            costs.options["none"] = costs.blocks
            costs.output_bytes = none.output_bytes
            costs.backward_transient_bytes = none.backward_transient_bytes
            costs.tied, costs.tie_sync_s = _tied_side(self.planner, self.tied_names(), none.params, pp, stage)
            for option in options:
                if option != "none":
                    priced = self.inner(stage.tp, rows, option, stage.lean)
                    name = _option_name(option, priced)
                    if name is not None and name not in costs.options:
                        costs.options[name] = _with_param_side(
                            priced, param_side, self.planner, self.layout
                        ).blocks
            self._costs[key] = costs
        return self._costs[key]


def _option_name(option: str, priced: InnerPricing) -> str | None:
    """The name ``option``'s blocks are priced under: ``option``, or for a ``;rerun=*`` pin the one option every
    unit resolved it to (None where the units resolved it differently: not offered)."""
    if not option.endswith(RERUN + UNREAD):
        return option
    return next(iter(priced.recompute_names)) if len(priced.recompute_names) == 1 else None


LEAN_FRACTIONS = (0.125, 0.25, 0.5)
"""Shares of the lifted solution's activations a lean pricing asks for, in turn, until one can be met."""


def _lean_budgets(lifted: InnerPricing, tp: int) -> list[int]:
    """Budgets for the inner ILP's activation-peak row (the other rows lifted) that make it keep its activations
    small, tightest first: the lifted solution's peak with its activations (what the row holds beyond the
    parameters' terms) cut to 1/tp — what sharding every kept activation over the tensor-parallel ranks
    (sequence parallelism) would reach — then to the larger shares of :data:`LEAN_FRACTIONS`."""
    problem, choice = lifted.built.problem, lifted.solution.choice
    usage = memory_usage(problem, choice)
    peak_row = memory_row_name(MemoryRow.ACTIVATION_PEAK)
    row = problem.memory_constraint(peak_row)
    state = sum(
        row.terms[n.name][choice[n.name]] * n.multiplicity
        for n in problem.nodes
        if n.kind == NodeKind.PARAM and n.name in row.terms
    )
    activations = max(usage[peak_row] - state, 0.0)
    shares = sorted({1 / tp, *(f for f in LEAN_FRACTIONS if f > 1 / tp)})
    return [int(state + activations * f) for f in shares]


_UNIT_MAPS: dict[int, tuple[Any, Callable[[str], str], dict[str, int]]] = {}


def _units_of(model) -> tuple[Callable[[str], str], dict[str, int]]:
    """(module -> its depth unit, unit -> its position in model order) for ``model``, computed once per model
    (reading the module tree is slow on a 126-block model)."""
    cached = _UNIT_MAPS.get(id(model))
    if cached is None or cached[0] is not model:
        unit_of = functools.lru_cache(maxsize=None)(_unit_mapper(model))
        order = {u: i for i, u in enumerate(_unit_order(model, unit_of))}
        if len(_UNIT_MAPS) > 8:
            _UNIT_MAPS.clear()
        cached = _UNIT_MAPS[id(model)] = (model, unit_of, order)
    return cached[1], cached[2]


def _unit_costs(
    planner: _Planner, built: BuiltProblem, solution: Solution, graph, tied: TiedGraph, tp: int
) -> dict[str, UnitCost]:
    """Per depth unit: forward / backward seconds of one micro-batch and the activation bytes it keeps, read off
    the solved problem (a node's cost spread over the real blocks it stands for). Ops and reshardings are split by
    their module's backward share; reruns of recompute (edges from a recompute node) and the reshardings a rerun
    repeats are backward. Parameter nodes (optimizer, data-parallel sync, state) are priced by
    :func:`_data_parallel_side`."""
    unit_of, _ = _units_of(planner.model)
    units: dict[str, UnitCost] = defaultdict(UnitCost)
    problem = built.problem
    ratios = built.backward_ratios
    choice = solution.choice

    def spread(module: str, seconds: float, share: float | None = None) -> None:
        if not seconds:
            return
        share = ratios.backward_share(module) if share is None else share
        reals = _real_modules(graph, module)
        for real in reals:
            cost = units[unit_of(real)]
            cost.forward_s += seconds * (1 - share) / len(reals)
            cost.backward_s += seconds * share / len(reals)

    for node in problem.nodes:
        if node.kind == NodeKind.OP:
            spread(built.block_of.get(node.name, ""), node.costs[choice[node.name]] * node.multiplicity)
    for edge in problem.edges:
        c = edge.cost[choice[edge.src]][choice[edge.dst]] * edge.multiplicity
        rerun = edge.src in built.recompute_options
        spread(built.block_of.get(edge.dst, ""), c, 1.0 if rerun else None)
    for cond in problem.conditional_costs:
        if choice[cond.when_node] in cond.when:
            spread(built.block_of.get(cond.dst, ""), cond.cost[choice[cond.src]][choice[cond.dst]], 1.0)
    for shared in problem.shared_costs:
        if shared.applies(choice):
            spread(built.block_of.get(shared.src, ""), shared.cost[choice[shared.src]])
    for overlap in problem.overlaps:  # the host's excess over the device, per block (its own segment)
        if overlap.name.startswith(HOST_STREAM):
            total = overlap.totals(problem, choice)[0]
            exposed = overlap.exposed(problem, choice)
            for k, seconds in overlap_parts(problem, overlap, choice):
                if total > 0 and exposed > 0:
                    spread(built.block_of.get(k, ""), exposed * seconds / total)
    # what a micro-batch's forward keeps per block: the blocks' terms at the end of forward (at the step's
    # highest point, late in backward where gradients outweigh activations, the blocks already done hold none)
    kept = _activation_per_unit(built, solution, graph, tied, unit_of, 1, forward_peak_row(problem))
    for unit, nbytes in kept.items():
        units[unit].activation_bytes += nbytes
    for unit, nbytes in _deferred_gradients(built, solution, graph, unit_of, tp).items():
        units[unit].deferred_grad_bytes += nbytes
    # the weight casts a unit without recompute keeps: one copy for the step (autocast's cache), not per micro-batch
    recomputed = frozenset(
        unit_of(b) for b, option in _recompute_choice(built, solution).items() if option != "none"
    )
    casts = _autocast_weight_casts(graph)
    for unit, nbytes in _output_bytes(built, solution, graph, unit_of, tp, casts, recomputed).items():
        units[unit].activation_bytes -= nbytes
        units[unit].held_bytes += nbytes
        units[unit].cached_cast_bytes += nbytes
    return dict(units)


def _deferred_gradients(built: BuiltProblem, solution: Solution, graph, unit_of, tp: int) -> dict[str, float]:
    """Per depth unit, the bytes on one device of one micro-batch's gradients of the outputs of the forward ops
    that read a parameter (through views and casts): a matmul's, the embedding's, a norm's product with its
    weight. A split backward's input pass keeps them for its weight pass (the weight gradient of each such op
    is computed from its output's gradient), held from the input to the weight gradient."""
    carries = {v for v, info in graph.values.items() if info.kind == ValueKind.PARAM}
    readers = []
    for node in graph.nodes:
        if node.phase != Phase.FORWARD or not any(v in carries for v in node.inputs):
            continue
        if node.is_view or node.op in WEIGHT_COPIES:  # a transpose, a cast: on to the reader
            carries.update(node.outputs)
            continue
        readers.append(node)
    return _output_bytes(built, solution, graph, unit_of, tp, readers)


def _output_bytes(
    built: BuiltProblem,
    solution: Solution,
    graph,
    unit_of,
    tp: int,
    nodes: list,
    skip: frozenset[str] = frozenset(),
) -> dict[str, float]:
    """Per depth unit (but those in ``skip``), the bytes on one device of ``nodes``' outputs at their chosen
    placements (a traced block's node standing for each real block it repeats)."""
    out: dict[str, float] = defaultdict(float)
    for node in nodes:
        name = _node_name(node.index)
        if name not in built.strategies:
            continue
        strategy = built.strategies[name][solution.choice[name]]
        nbytes = sum(
            graph.values[v].nbytes / shard_factor(spec[-1] if spec else None, tp)
            for v, spec in zip(node.outputs, strategy.output_placements, strict=False)
        )
        reals = _real_modules(graph, node.module)
        for real in reals:
            if unit_of(real) not in skip:
                out[unit_of(real)] += nbytes * built.problem.node(name).multiplicity / len(reals)
    return out


def _autocast_weight_casts(graph) -> list:
    """The forward's casts of a parameter that only matmuls read (through views): under mixed precision,
    ``torch.autocast``'s casts of the projections' weights. Autocast caches the cast of a leaf that requires
    grad until its outermost region exits, and a pipelined step's schedule runs inside the forward's region: a
    block that keeps them (no recompute) holds one copy of each weight for the step, not one per micro-batch in
    flight (a recomputed block runs with the cache off and keeps none: ``apply/recompute``). Measured: a second
    micro-batch's forward in the same region keeps a tiny Llama block's 73,728 bytes of weight casts fewer."""
    if not graph.mixed_precision:
        return []
    readers: dict[int, list] = defaultdict(list)
    for node in graph.nodes:
        for v in node.inputs:
            readers[v].append(node)

    def read_by_matmuls(values: list[int]) -> bool:
        return all(
            read_by_matmuls(reader.outputs) if reader.is_view else op_class(reader.op) == MATMUL
            for v in values
            for reader in readers[v]
        )

    return [
        node
        for node in graph.nodes
        if node.phase == Phase.FORWARD
        and node.op == "aten._to_copy.default"
        and node.inputs
        and graph.values[node.inputs[0]].kind == ValueKind.PARAM
        and read_by_matmuls(node.outputs)
    ]


def _param_shares(
    planner: _Planner, built: BuiltProblem, solution: Solution, graph, tp: int
) -> tuple[list[_ParamShare], dict[str, str]]:
    """Every real parameter's bytes and optimizer seconds on one device after tensor parallelism (from the
    solution's storage placement; the optimizer's temporaries from the optimizer step's memory row), and the
    canonical FQN -> tensor-parallel placement chosen."""
    unit_of, _ = _units_of(planner.model)
    problem = built.problem
    row = problem.memory_constraint(memory_row_name(MemoryRow.OPTIMIZER_STEP))
    shares: list[_ParamShare] = []
    choice: dict[str, str] = {}
    for node in problem.nodes:
        if node.kind != NodeKind.PARAM:
            continue
        fqn = built.param_of_node[node.name]
        placement = built.param_options[node.name][solution.choice[node.name]]
        choice[fqn] = placement
        sf = shard_factor(placement, tp)
        local = float(graph.param_bytes.get(fqn, 0)) / sf
        state = float(graph.optimizer_state_bytes.get(fqn, 0)) / sf
        grad = local if graph.is_trainable(fqn) else 0.0
        terms = row.terms.get(node.name)
        term = terms[solution.choice[node.name]] if terms else local + state + grad
        temp = max(term - local - state - grad, 0.0)
        optimizer_s = node.costs[solution.choice[node.name]]
        reals = _real_modules(graph, built.block_of.get(node.name, fqn.rsplit(".", 1)[0]))
        copies = node.multiplicity / len(reals)
        for real in reals:
            shares.append(
                _ParamShare(
                    unit_of(real), local * copies, state * copies, grad * copies, temp * copies,
                    optimizer_s * copies, fqn,
                )
            )  # fmt: skip
    return shares, choice


def _planner_on(planner: _Planner, inputs: Any, devices: int) -> _Planner:
    """``planner``'s model and settings on ``devices`` devices of its kind (a stage's share, or an inner mesh),
    feeding ``inputs``, without recompute (the pipeline search chooses it per rank)."""
    cluster = planner.cluster
    return _Planner(
        planner.model,
        inputs,
        ClusterSpec(cluster.device, devices, min(cluster.devices_per_node, devices)),
        planner.budget,
        planner.mixed_precision,
        planner.optimizer,
        planner.time_limit_s,
        "none",
    )


def _group_comms(planner: _Planner, pp: int, stage: StageLayout) -> tuple[AxisComm, AxisComm | None]:
    """(the collective pricing FSDP's gathers and reduce-scatters / DDP's all-reduce run on, HSDP's replicate
    group or None) for the data-parallel groups of one pipeline stage: ``dp x tp`` consecutive ranks of the
    ``devices / pp`` a stage has, as the runtime's mesh ``(pp, dp, tp)`` lays them."""
    group = _planner_on(planner, planner.inputs, planner.cluster.num_devices // pp)
    mesh = (stage.dp, stage.tp)
    if stage.dp_mode == "hsdp":
        hybrid = group.hybrid_comm(mesh, stage.shard)
        return hybrid.shard, hybrid.replicate
    return group.axis_comm(mesh, 0), None


def _data_parallel_side(
    planner: _Planner, shares: list[_ParamShare], pp: int, stage: StageLayout
) -> dict[str, UnitCost]:
    """Per unit: optimizer seconds, gather and sync seconds per step and state bytes per device under the
    stage's data-parallel mode, as a pipeline runs it (see the module docstring)."""
    comm, replicate = _group_comms(planner, pp, stage)
    out: dict[str, UnitCost] = defaultdict(UnitCost)
    dp, ds = stage.dp, stage.shard
    sharded = stage.dp_mode in ("fsdp", "hsdp") and dp > 1
    for share in shares:
        cost = out[share.unit]
        trained = share.grad_bytes > 0
        if sharded:
            cost.state_bytes += (share.local_bytes + share.state_bytes + share.temp_bytes) / ds
            cost.state_bytes += (
                share.local_bytes + share.grad_bytes
            )  # gathered and accumulated through the step
            cost.held_bytes += (share.local_bytes + share.state_bytes) / ds + share.local_bytes
            cost.grad_bytes += share.grad_bytes
            cost.optimizer_s += share.optimizer_s / ds
            cost.gather_s += comm.time("all_gather", share.local_bytes)
            if trained:
                cost.sync_s += comm.time("reduce_scatter", share.local_bytes)
                if replicate is not None and replicate.size > 1:
                    cost.sync_s += replicate.time("all_reduce", share.local_bytes / ds)
        else:
            cost.state_bytes += share.local_bytes + share.state_bytes + share.grad_bytes + share.temp_bytes
            cost.held_bytes += share.local_bytes + share.state_bytes
            cost.grad_bytes += share.grad_bytes
            cost.optimizer_s += share.optimizer_s
            if trained and dp > 1:
                cost.sync_s += comm.time("all_reduce", share.local_bytes)
    return out


def _tied_side(
    planner: _Planner, names: set[str], shares: list[_ParamShare], pp: int, stage: StageLayout
) -> tuple[UnitCost, float]:
    """The tied head parameters' copy on the last stage's rank under ``stage`` (state, held and gradient bytes,
    optimizer, gather and data-parallel sync, as the embedding's own are priced) and the seconds of their
    gradient all-reduce over the two ranks of the runtime's tie group (each rank's local shard: both copies are
    sharded alike). ``names``: the tied parameters' names (:meth:`_Pricer.tied_names`)."""
    tied_shares = [s for s in shares if s.fqn in names]
    tied = UnitCost()
    if not tied_shares:
        return tied, 0.0
    for cost in _data_parallel_side(planner, tied_shares, pp, stage).values():
        tied.add(cost)
    n = planner.cluster.num_devices
    tie_comm = dataclasses.replace(planner.axis_comm((pp, n // pp), 0), size=2)
    sharded = stage.dp_mode in ("fsdp", "hsdp") and stage.dp > 1
    gradient = sum(s.local_bytes for s in tied_shares if s.grad_bytes > 0) / (stage.shard if sharded else 1)
    return tied, tie_comm.time("all_reduce", gradient) if gradient else 0.0


def _with_param_side(
    priced: InnerPricing, param_side: dict[str, UnitCost], planner: _Planner, layout: PipelineLayout
) -> ModelCosts:
    """One inner pricing's units with the data-parallel figures added, grouped by where a pipeline runs them."""
    names = set(priced.units) | set(param_side)
    _, order = _units_of(planner.model)
    ordered: dict[str, UnitCost] = {}
    for name in sorted(names, key=lambda u: order.get(u, len(order))):
        cost = UnitCost()
        if name in priced.units:
            cost.add(priced.units[name])
        if name in param_side:
            cost.add(param_side[name])
        ordered[name] = cost
    return _by_role(ordered, layout, priced.send_bytes)


def _send_bytes(graph, layout: PipelineLayout) -> int:
    """The hidden states a stage sends on per micro-batch: the largest tensor a block is called with."""
    sizes = [
        graph.storages[s].nbytes for args in graph.block_args.values() for s in args if s in graph.storages
    ]
    return max(sizes, default=0)


def _by_role(units: dict[str, UnitCost], layout: PipelineLayout, send_bytes: int) -> ModelCosts:
    """Units grouped by where a pipeline runs them (blocks by index; before, after, every stage)."""
    blocks = [UnitCost() for _ in range(layout.num_blocks)]
    first, last, every = UnitCost(), UnitCost(), UnitCost()
    before, after = set(layout.before), set(layout.after)
    prefix = layout.blocks + "."
    for name, cost in units.items():
        rest = name[len(prefix) :] if name.startswith(prefix) else ""
        if rest.isdigit():
            blocks[int(rest)].add(cost)
        elif name in before or any(name.startswith(b + ".") for b in before):
            first.add(cost)
        elif name == "" or name in after or any(name.startswith(a + ".") for a in after):
            last.add(cost)  # the loss ("") runs with the head
        else:
            every.add(cost)
    return ModelCosts(blocks, first, last, every, send_bytes, units)


# -------------------------------------------------------------------------------------------- stage layouts
def stage_layouts(
    planner: _Planner, pp: int, dp_modes: tuple[str, ...] = STAGE_DP_MODES
) -> list[StageLayout]:
    """The inner meshes of a ``pp``-stage pipeline: ``(dp, tp)`` over ``devices / pp`` with tp dividing a node
    and the attention (and key/value) heads, dp dividing the global batch; each with the offered data-parallel
    modes (FSDP where dp > 1; HSDP where dp crosses nodes, shard groups as the flat search tries them)."""
    from ..search import _hsdp_candidates

    cluster = planner.cluster
    devices = cluster.num_devices // pp
    per_node = cluster.devices_per_node
    heads = _attention_heads(planner.model)
    kv = getattr(getattr(planner.model, "config", None), "num_key_value_heads", None) or heads
    inner = ClusterSpec(cluster.device, devices, min(per_node, devices))
    out: list[StageLayout] = []
    for tp in range(1, min(devices, per_node) + 1):
        if devices % tp or per_node % tp or (heads and (heads % tp or kv % tp)):
            continue
        dp = devices // tp
        if planner.batch % dp:
            continue
        modes = [
            (m, 1 if m == "ddp" else dp) for m in ("ddp", "fsdp") if m in dp_modes and (m == "ddp" or dp > 1)
        ]
        if dp > 1 and "hsdp" in dp_modes:
            modes.extend(("hsdp", shard) for _, shard in _hsdp_candidates(inner, (dp, tp)))
        for lean in (False, True) if tp > 1 else (False,):
            out.extend(StageLayout(tp, dp, mode, shard, lean) for mode, shard in modes)
    return out


def _state_floor(planner: _Planner, pp: int, stage: StageLayout) -> float:
    """The least state a device of ``stage`` can hold: the model's parameters, gradients and optimizer state
    spread evenly over the pp stages and the tensor-parallel ranks, sharded as the data-parallel mode does (FSDP
    under a pipeline keeps its parameters and gradients gathered through the step)."""
    graph = planner.any_graph(1)
    params = float(sum(graph.param_bytes.values()))
    state = float(sum(graph.optimizer_state_bytes.values()))
    grads = float(sum(b for f, b in graph.param_bytes.items() if graph.is_trainable(f)))
    if stage.dp_mode in ("fsdp", "hsdp") and stage.dp > 1:
        total = (params + state) / stage.shard + params + grads
    else:
        total = params + state + grads
    return total / (pp * stage.tp)
