"""The search over pipeline stages (issue 27): for each pp degree, the layout inside a stage (tensor parallelism,
the data-parallel mode, recompute per block), the cut of the model's blocks into stages, the schedule and the
micro-batch count, jointly, priced by simulating the schedule.

What is searched. Mesh ``("pp", "dp", "tp")`` with pp leading (the Plan contract: pp is the outer, strided axis,
so a replica group ``dp x tp`` is consecutive ranks). For each pp degree, every inner mesh ``(dp, tp)`` of the
``devices / pp`` devices with ``tp`` dividing a node and the attention heads, each with DDP, FSDP (over all dp
ranks) or HSDP (shard groups of whole nodes' data-parallel ranks, as the flat search offers them). Whether pp or
dp crosses nodes follows from the degrees chosen (tp = 8 fills a node: both cross; pp inside a node happens when
``dp x tp`` is smaller than a node), and each is priced on the link it crosses.

How a stage layout is priced. One ILP of the inner mesh per (tp, rows of one micro-batch per replica, recompute
option, plain or DTensor pricing), on a cluster of that inner mesh, with the budget lifted and the recompute of
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

Memory per rank, checked exactly per stage and schedule: the higher of two moments. Through the schedule: its
stages' parameters and optimizer state (as the layout holds them: under FSDP the shards plus the parameters
gathered through the step), plus what the simulation's walk of the schedule's own action list holds at its peak:
activations (GPipe every micro-batch, 1F1B ``stages - stage_index``, interleaved more), each held micro-batch
counting its output too (torch's stage keeps it until the micro-batch's backward: the hidden states sent on, the
last stage's logits), the gradients from a stage's first backward on (the layout's: under FSDP the unsharded
accumulated gradient), the last stage's backward adding the step's transient (the loss's backward: the logits'
gradients; another stage's backward transient is not priced, docs/reliability.md), where a block recomputes its
rematerialised activations while its backward runs (the largest such block of the rank), and the receive buffers
torch's stages keep between steps (one per received send of a step). The optimizer step: the state (parameters,
gradients, optimizer state and the step's temporaries, as the layout holds them) and the receive buffers. A head
tied to the embedding on another rank: the last rank holds a copy (its state, gradient and optimizer step, as the
embedding's) and both ranks all-reduce its gradient (the runtime's tie group). The ILP's own memory model gives
the per-block bytes. Measured against real ranks in ``tests/multiproc/check_pipeline_planned.py``.

Recompute per block: the cut is chosen first (dynamic programming over contiguous block ranges minimising the
slowest stage without recompute, as Alpa and nnScaler cut; where even full recompute cannot fit a stage, the cut
is redone under each stage's memory with full recompute), then each rank upgrades blocks to more recompute
(none -> selective -> full), the block saving the most bytes per second of rerun first, until the rank's estimate
(per stage its most micro-batches in flight, a bound on the simulation's) fits the budget. The simulation then
gives the step and each rank's exact peak.

The schedule and the micro-batch count: every offered schedule (GPipe, 1F1B; interleaved 1F1B, interleaved zero
bubble and ZB-V with two stages per rank) and the micro-batch counts with the fewest rows per micro-batch (one or
two sequences; :data:`MAX_ROW_OPTIONS`), each simulated on its action list
(:func:`~.pricing.pipeline_schedule.simulate_schedule`): point-to-point sends on the link the pp axis crosses,
the stage's gradient synchronisation after its last backward, the optimizer step after everything.

Search order and pruning: every candidate gets a lower bound on its step without an ILP beyond its layout's
"none" one (every rank's share of the compute, synchronisation and optimizer, no bubble, no recompute);
candidates are simulated in increasing bound and the search stops at the first bound no faster than the best
candidate that fits (or than the best plan without stages). Recompute ILPs are solved only for the layouts whose
candidates need them. A layout whose state alone (parameters sharded as far as its tp and dp allow) exceeds the
budget is not priced.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
import logging
import math
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..hardware import ClusterSpec
from ..pipeline_layout import PipelineLayout, PipelineLayoutError, find_layout, hand_pipeline_plan
from ..plan import PIPELINE_SCHEDULES, BlockCost, PipelinePlanError, Plan, stage_ranks
from ..units import format_bytes
from .baselines import _attention_heads
from .build.builder import BuiltProblem
from .build.names import MemoryRow, NodeKind, memory_row_name
from .candidates import LIFTED_BUDGET, _first_rows, _Planner
from .ilp import solve
from .pricing.comm import AxisComm, shard_factor
from .pricing.pipeline_schedule import (
    Link,
    ScheduleSimulation,
    StageCost,
    _cached_actions,
    point_to_point_traffic,
    simulate_schedule,
)
from .problem import InfeasibleError, Solution, memory_usage
from .tied import TiedGraph
from .writeup import _activation_per_unit, _real_modules, _unit_mapper, _unit_order

logger = logging.getLogger(__name__)

OFFERED_SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "interleaved-zero-bubble", "zbv")
"""Schedules the search offers: every one the runtime runs and its tests cover."""

STAGE_DP_MODES = ("ddp", "fsdp", "hsdp")
"""Data-parallel modes offered inside a stage."""

RECOMPUTE_OFFERED = ("none", "selective:pointwise", "full")
"""Recompute options a block of a stage may take, least recompute first (torchtitan's selective policy keeps
matmul and attention outputs and reruns the pointwise ops)."""

MAX_ROW_OPTIONS = 2
"""Rows per micro-batch tried per stage layout (the fewest first: 1, then 2, ...): more micro-batches shrink the
bubble, and under 1F1B and the interleaved schedules the activations held do not grow with them; each row count
costs an ILP per layout."""

EFFICIENT_MICRO_BATCH_TOKENS = 4096
"""Tokens of a micro-batch past which more rows per micro-batch are not tried: the matmuls of a micro-batch that
size run near their peak (more rows would only grow the bubble), and every row count costs an ILP per layout."""


@dataclass
class UnitCost:
    """One depth unit's (a block, an embedding, the head) cost per micro-batch, or per step, or bytes per device."""

    forward_s: float = 0.0
    backward_s: float = 0.0
    """Backward of one micro-batch, recompute's reruns included."""
    optimizer_s: float = 0.0
    """Its share of the optimizer step (once per step)."""
    sync_s: float = 0.0
    """The data-parallel gradient synchronisation (once per step, after the stage's last backward)."""
    gather_s: float = 0.0
    """FSDP/HSDP: the all-gather of its parameters (once per step, before the stage's first forward)."""
    state_bytes: float = 0.0
    """Parameters, gradients, optimizer state and the optimizer's temporaries on one device (under FSDP also the
    parameters and gradients held gathered through the step): what the rank holds while it steps."""
    held_bytes: float = 0.0
    """Parameters and optimizer state on one device (under FSDP the shards plus the parameters gathered through
    the step): what the rank holds through the schedule (the optimizer state from the first step on), beside
    the activations and the gradients."""
    grad_bytes: float = 0.0
    """Parameter gradients on one device (under FSDP the unsharded accumulated gradient): made by the stage's
    first backward in a step, held to its end."""
    activation_bytes: float = 0.0
    """What one micro-batch's forward keeps for backward."""

    def add(self, other: UnitCost) -> None:
        for f in dataclasses.fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))


@dataclass(frozen=True)
class StageLayout:
    """How the devices of one pipeline stage (``devices / pp``) run it: mesh ``(dp, tp)`` and the data-parallel
    mode; ``shard``: the ranks a parameter's state is sharded over on the dp axis (1 under DDP, dp under FSDP,
    the shard group under HSDP)."""

    tp: int
    dp: int
    dp_mode: str
    shard: int
    lean: bool = False
    """Its tensor-parallel activation placements chosen to keep activations small (:func:`_lean_budgets`: the
    ILP then shards the kept activations, sequence parallelism among them) rather than for speed alone."""

    @property
    def label(self) -> str:
        mode = f"hsdp {self.dp // self.shard}x{self.shard}" if self.dp_mode == "hsdp" else self.dp_mode
        return f"{self.dp}x{self.tp} {mode}" + (", lean activations" if self.lean else "")

    @property
    def plain(self) -> bool:
        """Runs on ordinary tensors (no DTensor per-op cost): DDP without tensor parallelism."""
        return self.tp == 1 and (self.dp_mode == "ddp" or self.dp == 1)


@dataclass
class ModelCosts:
    """The model's costs at one stage layout and micro-batch size, by where they land in a pipeline."""

    blocks: list[UnitCost]
    """Per block of the layout's block list, in order, without recompute."""
    first: UnitCost
    """What runs before the blocks (the first stage's)."""
    last: UnitCost
    """What runs after the blocks (the last stage's): final norm, head, loss."""
    every: UnitCost
    """What every stage runs (rotary tables, the base model's own ops)."""
    send_bytes: int
    """The hidden states one micro-batch sends between stages."""
    unit_names: dict[str, UnitCost]
    """Unit name -> its cost, in model order (the plan's block table)."""
    options: dict[str, list[UnitCost]] = field(default_factory=dict)
    """Recompute option -> per block its cost under it (``"none"`` is :attr:`blocks`); only the options priced."""
    output_bytes: int = 0
    """The model's largest output per micro-batch (the logits): what the last stage returns and keeps."""
    tied: UnitCost = field(default_factory=UnitCost)
    """The head's parameters that are the embedding's (tied word embeddings) under the stage layout: where the
    first and the last stage's ranks differ, the last holds a copy (state, gradient, optimizer step and
    data-parallel figures, as the embedding's)."""
    tie_sync_s: float = 0.0
    """The tied parameters' gradient all-reduce between the first and the last stage's ranks (the runtime's tie
    group), on both, after the schedule, where those ranks differ."""
    backward_transient_bytes: float = 0.0
    """Per micro-batch: what the step allocates at its highest point beyond what forwards keep, the inputs and
    the buffers (the activation-peak row's transient: in a causal LM the loss's backward, the logits'
    gradients), on top of what the last stage holds while it runs a backward. Another stage's (a block's
    gradients in flight, far smaller) is not priced: an open gap, docs/reliability.md."""

    def block_options(self) -> list[str]:
        """The options priced, least recompute first (a hand configuration's own option last)."""
        return [o for o in RECOMPUTE_OFFERED if o in self.options] + [
            o for o in self.options if o not in RECOMPUTE_OFFERED
        ]


def _stage_extras(costs: ModelCosts, num_stages: int, index: int, owner: list[int] | None = None) -> UnitCost:
    """What stage ``index`` of ``num_stages`` runs besides its blocks. With the stages' ranks (``owner``): where
    the first and the last differ, the last holds a copy of the tied head parameters and both all-reduce their
    gradient (the runtime's tie group)."""
    extra = UnitCost()
    extra.add(costs.every)
    if index == 0:
        extra.add(costs.first)
    if index == num_stages - 1:
        extra.add(costs.last)
    if owner is not None and owner[0] != owner[-1]:
        if index == num_stages - 1:
            extra.add(costs.tied)
        if index in (0, num_stages - 1):
            extra.sync_s += costs.tie_sync_s
    return extra


def _kept_output_bytes(costs: ModelCosts, num_stages: int, index: int) -> int:
    """What stage ``index`` keeps of each held micro-batch beyond its activations: torch's stage keeps its
    output until the micro-batch's backward (the hidden states it sends on; the last stage's logits)."""
    return costs.output_bytes if index == num_stages - 1 else costs.send_bytes


def _backward_transient(costs: ModelCosts, num_stages: int, index: int) -> int:
    """What a backward of stage ``index`` allocates on top (the last stage's: the loss's backward)."""
    return int(costs.backward_transient_bytes) if index == num_stages - 1 else 0


def _receive_bytes(costs: ModelCosts, owner: list[int], micro_batches: int) -> list[float]:
    """Per rank: the receive buffers torch's stages keep between steps, one per received send of a step (each
    micro-batch's activation from the previous stage and gradient from the next, where another rank runs it)."""
    out = [0.0] * (max(owner) + 1)
    for s, rank in enumerate(owner):
        neighbours = [t for t in (s - 1, s + 1) if 0 <= t < len(owner) and owner[t] != rank]
        out[rank] += len(neighbours) * micro_batches * costs.send_bytes
    return out


def cut_blocks(
    block_s: list[float],
    num_stages: int,
    first_s: float = 0.0,
    last_s: float = 0.0,
    fits: Callable[[int, int, int], bool] | None = None,
) -> list[int] | None:
    """Blocks per stage (each at least one, contiguous, in order) minimising the slowest stage's seconds, the
    first stage also paying ``first_s`` and the last ``last_s``; among cuts as good, the one whose stages are
    most even (least sum of squares). ``fits(stage, first_block, end_block)``: whether a stage may hold those
    blocks (its memory); None when no cut meets it. Dynamic programming over prefix lengths:
    O(stages x blocks^2)."""
    n = len(block_s)
    if not 1 <= num_stages <= n:
        raise ValueError(f"{n} blocks cannot be cut into {num_stages} stages of at least one block each")
    prefix = [0.0]
    for t in block_s:
        prefix.append(prefix[-1] + t)

    def stage_time(s: int, i: int, j: int) -> float:
        return prefix[j] - prefix[i] + (first_s if s == 0 else 0.0) + (last_s if s == num_stages - 1 else 0.0)

    def allowed(s: int, i: int, j: int) -> bool:
        return fits is None or fits(s, i, j)

    inf = (math.inf, math.inf)
    # best[s][j]: (slowest, sum of squares) of the first j blocks in s + 1 stages; back[s][j]: where stage s starts
    best = [[inf] * (n + 1) for _ in range(num_stages)]
    back = [[0] * (n + 1) for _ in range(num_stages)]
    for j in range(1, n + 1):
        if allowed(0, 0, j):
            t = stage_time(0, 0, j)
            best[0][j] = (t, t * t)
    for s in range(1, num_stages):
        extra = last_s if s == num_stages - 1 else 0.0
        before, row, rows_back = best[s - 1], best[s], back[s]
        for j in range(s + 1, n + 1):
            top = prefix[j] + extra
            for i in range(j - 1, s - 1, -1):  # the stage grows as i falls: past the best, nothing better
                t = top - prefix[i]
                if t > row[j][0]:
                    break
                prev = before[i]
                if prev[0] == math.inf or (fits is not None and not fits(s, i, j)):
                    continue
                candidate = (prev[0] if prev[0] > t else t, prev[1] + t * t)
                if candidate < row[j] or (candidate == row[j] and i < rows_back[j]):
                    row[j], rows_back[j] = candidate, i
    if best[num_stages - 1][n][0] == math.inf:
        return None
    counts = []
    j = n
    for s in range(num_stages - 1, 0, -1):
        i = back[s][j]
        counts.append(j - i)
        j = i
    counts.append(j)
    return counts[::-1]


# ------------------------------------------------------------------------------------------ pricing the model
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


class _Pricer:
    """Prices stage layouts for one model, caching the inner ILPs by (tp, rows, recompute option, plain) and the
    per-layout costs by (pp, layout, micro-batches, options). ``fixed_params`` (FQN -> tensor-parallel placement)
    pins a hand configuration's placements in every ILP."""

    def __init__(
        self,
        planner: _Planner,
        layout: PipelineLayout,
        fixed_params: dict[str, str] | None = None,
        pin_unlisted: bool = False,
    ) -> None:
        self.planner = planner
        self.layout = layout
        self.fixed_params = fixed_params
        self.pin_unlisted = pin_unlisted
        self._inner: dict[tuple, InnerPricing] = {}
        self._costs: dict[tuple, ModelCosts] = {}
        self.ilps = 0

    def inner(self, tp: int, rows: int, option: str, plain: bool, lean: bool = False) -> InnerPricing:
        key = (tp, rows, option, plain, lean)
        if key not in self._inner:
            fixed = self.fixed_params
            budgets = [LIFTED_BUDGET]
            if option != "none" or lean:
                fixed = self.inner(tp, rows, "none", plain).param_choice  # the same layout under every option
            if lean:
                budgets = _lean_budgets(self.inner(tp, rows, option, plain), tp) + budgets
            self._inner[key] = self._solve(tp, rows, option, plain, fixed, budgets)
        return self._inner[key]

    def _solve(
        self, tp: int, rows: int, option: str, plain: bool, fixed: dict[str, str] | None, budgets: list[int]
    ) -> InnerPricing:
        """The ILP of one replica's micro-batch on an inner mesh: ``(1, tp)`` (``(2, 1)`` under FSDP where tp = 1,
        so that its ops are priced on DTensors as a sharded stage runs them), recompute pinned, its activation
        peak under the first of ``budgets`` a choice meets (lean ones, :func:`_lean_budgets`, then lifted), its
        other memory rows lifted (a stage's state is priced by :func:`_data_parallel_side`)."""
        planner = self.planner
        dp = 2 if tp == 1 and not plain else 1
        mode = "fsdp" if dp > 1 else "ddp"
        inner = _planner_on(planner, _first_rows(planner.inputs, rows * dp), dp * tp)
        inner._graphs = planner._graphs
        inner._step_memories = planner._step_memories
        inner._strategies = planner._strategies
        inner.routing = planner.routing
        mesh = (dp, tp)
        built = inner.build(
            mesh,
            mode,
            fixed_params=fixed,
            pin_unlisted=self.pin_unlisted,
            recompute_pin=option,
            budget=LIFTED_BUDGET,
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
        graph = inner.graph(dp)
        units = _unit_costs(planner, built, solution, graph)
        params, choice = _param_shares(planner, built, solution, graph, tp, dp if mode == "fsdp" else 1)
        output = max((graph.values[v].nbytes for v in graph.output_values), default=0)
        transient = max(0.0, peak.constant - graph.input_bytes - graph.buffer_bytes)
        return InnerPricing(
            units, params, _send_bytes(graph, self.layout), inner, mesh, mode, built, solution, choice,
            output, transient,
        )  # fmt: skip

    def costs(self, pp: int, stage: StageLayout, micro_batches: int, options: tuple[str, ...]) -> ModelCosts:
        """The model's per-unit costs for ``stage`` in a ``pp``-stage pipeline at ``micro_batches`` micro-batches,
        blocks priced under each recompute option of ``options`` ("none" always)."""
        key = (pp, stage, micro_batches, options)
        if key not in self._costs:
            rows = self.planner.batch // (stage.dp * micro_batches)
            none = self.inner(stage.tp, rows, "none", stage.plain, stage.lean)
            param_side = _data_parallel_side(self.planner, none.params, pp, stage)
            costs = _with_param_side(none, param_side, self.planner, self.layout)
            costs.options["none"] = costs.blocks
            costs.output_bytes = none.output_bytes
            costs.backward_transient_bytes = none.backward_transient_bytes
            costs.tied, costs.tie_sync_s = _tied_side(self.planner, self.layout, none.params, pp, stage)
            for option in options:
                if option != "none":
                    priced = self.inner(stage.tp, rows, option, stage.plain, stage.lean)
                    costs.options[option] = _with_param_side(
                        priced, param_side, self.planner, self.layout
                    ).blocks
            self._costs[key] = costs
        return self._costs[key]


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


def _unit_costs(planner: _Planner, built: BuiltProblem, solution: Solution, graph) -> dict[str, UnitCost]:
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
    tied = TiedGraph.build(graph)
    for unit, nbytes in _activation_per_unit(built, solution, graph, tied, unit_of, 1).items():
        units[unit].activation_bytes += nbytes
    return dict(units)


def _param_shares(
    planner: _Planner, built: BuiltProblem, solution: Solution, graph, tp: int, ilp_shard: int
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
        term = terms[solution.choice[node.name]] * ilp_shard if terms else local + state + grad
        temp = max(term - local - state - grad, 0.0)
        optimizer_s = node.costs[solution.choice[node.name]] * ilp_shard
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
    planner: _Planner, layout: PipelineLayout, shares: list[_ParamShare], pp: int, stage: StageLayout
) -> tuple[UnitCost, float]:
    """The tied head parameters' copy on the last stage's rank under ``stage`` (state, held and gradient bytes,
    optimizer, gather and data-parallel sync, as the embedding's own are priced) and the seconds of their
    gradient all-reduce over the two ranks of the runtime's tie group (each rank's local shard: both copies are
    sharded alike)."""
    model = planner.model
    embedding = {id(p) for p in model.get_submodule(layout.embedding).parameters()}
    head = {id(p) for p in model.get_submodule(layout.head).parameters()}
    names = {n for n, p in model.named_parameters(remove_duplicate=False) if id(p) in embedding & head}
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
    from .search import _hsdp_candidates

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


# -------------------------------------------------------------------------------------------- one candidate
@dataclass
class PipelineCandidate:
    """A priced pipeline: its configuration, the simulation and the memory of each pp rank."""

    pp: int
    stage: StageLayout
    schedule: str
    virtual: int
    micro_batches: int
    blocks_per_stage: list[int]
    recompute: list[str]
    """Per block (model order), its recompute option."""
    simulation: ScheduleSimulation
    rank_state_bytes: list[float]
    """Per rank: what it holds while the optimizer steps (:attr:`UnitCost.state_bytes`, receive buffers)."""
    rank_held_bytes: list[float]
    """Per rank: what it holds through the schedule beside the activations and gradients
    (:attr:`UnitCost.held_bytes`, receive buffers)."""
    rank_peak_bytes: list[float]
    stage_s: list[float]
    """Per stage: forward + backward seconds of one micro-batch (recompute included)."""
    stage_peak_bytes: list[float]
    """Per stage: the higher of its optimizer-step state and what it holds through the schedule (parameters,
    gradients, its activations and kept outputs times the most micro-batches it holds at once, transients)."""
    costs: ModelCosts
    rows: int = 0
    """Rows of one micro-batch of one replica."""

    @property
    def dp(self) -> int:
        return self.stage.dp

    @property
    def tp(self) -> int:
        return self.stage.tp

    @property
    def step_time_s(self) -> float:
        return self.simulation.step_time_s

    @property
    def peak_bytes(self) -> float:
        return max(self.rank_peak_bytes)

    def recompute_text(self) -> str:
        counts: dict[str, int] = defaultdict(int)
        for option in self.recompute:
            counts[option] += 1
        return ", ".join(f"{o} x{n}" for o, n in counts.items())

    def record(self, budget: int) -> dict[str, Any]:
        """What :attr:`Plan.solver` and the logs say of it."""
        return {
            "pp": self.pp,
            "dp": self.dp,
            "tp": self.tp,
            "dp_mode": self.stage.dp_mode,
            "dp_shard": self.stage.shard,
            "schedule": self.schedule,
            "virtual_stages": self.virtual,
            "micro_batches": self.micro_batches,
            "blocks_per_stage": list(self.blocks_per_stage),
            "recompute": self.recompute_text(),
            "step_time_s": self.step_time_s,
            "peak_memory_bytes": math.ceil(self.peak_bytes),
            "fits": self.peak_bytes <= budget,
        }


def _schedules_for(num_blocks: int, pp: int, schedules: tuple[str, ...]) -> list[tuple[str, int]]:
    """(schedule, stages per rank) offered for ``pp`` ranks: one stage a rank for GPipe and 1F1B, two for the
    multi-stage schedules, where the blocks give every stage at least one."""
    out = []
    for schedule in schedules:
        virtual = PIPELINE_SCHEDULES[schedule][0]
        if pp * virtual <= num_blocks:
            out.append((schedule, virtual))
    return out


def _micro_batch_options(local_batch: int, least: int, row_tokens: int = 1) -> list[int]:
    """Micro-batch counts for a replica's batch of ``local_batch`` rows: divisors of it, at least ``least``
    (the pp degree: one per stage of a one-stage-a-rank schedule), the fewest rows per micro-batch first: up to
    :data:`MAX_ROW_OPTIONS`, and more rows than the fewest only while a micro-batch is under
    :data:`EFFICIENT_MICRO_BATCH_TOKENS` tokens (``row_tokens`` a row)."""
    counts = [m for m in range(least, local_batch + 1) if local_batch % m == 0][::-1]
    out = counts[:1]
    for m in counts[1:MAX_ROW_OPTIONS]:
        if (local_batch // out[-1]) * row_tokens >= EFFICIENT_MICRO_BATCH_TOKENS:
            break
        out.append(m)
    return out


def _row_tokens(inputs) -> int:
    """Tokens in one row of the batch (its sequence length; 1 for inputs without one)."""
    dims = [v.shape[1] for v in inputs.values() if hasattr(v, "shape") and len(v.shape) > 1]
    return max(dims, default=1)


def _valid_micro_batches(schedule: str, micro_batches: int, num_stages: int, pp: int) -> bool:
    """Whether the Plan contract accepts the count for the schedule (at least a stage each, interleaved rounds)."""
    from ..plan import _check_pipeline_micro_batches

    try:
        _check_pipeline_micro_batches(schedule, micro_batches, num_stages, pp)
    except PipelinePlanError:
        return False
    return True


@functools.lru_cache(maxsize=512)
def _in_flight(schedule: str, pp: int, micro_batches: int, virtual: int) -> tuple[int, ...]:
    """Per stage, the most micro-batches whose activations it holds at once along the schedule's action list (as
    the simulation's memory walk holds them: until the full backward, or under the input/weight split until the
    weight gradient; it does not depend on the stages' costs)."""
    actions = _cached_actions(schedule, pp, micro_batches, virtual)
    most = [0] * (pp * virtual)
    for rank in actions:
        count = [0] * (pp * virtual)
        for kind, s, _ in rank:
            if kind == "F":
                count[s] += 1
                most[s] = max(most[s], count[s])
            elif kind in ("B", "W"):  # under the input/weight split the weight gradient frees them
                count[s] -= 1
    return tuple(most)


def _block_seconds(cost: UnitCost) -> float:
    return cost.forward_s + cost.backward_s


def choose_recompute(
    costs: ModelCosts,
    counts: list[int],
    owner: list[int],
    in_flight: tuple[int, ...],
    budget: float,
    micro_batches: int,
) -> list[int] | None:
    """Per block, the index into ``costs.block_options()`` of its recompute option: each rank starts without
    recompute and, while its estimate (state + per stage its activations times its most micro-batches in flight
    + the largest rematerialised block) exceeds ``budget``, moves the block that saves the most bytes per second
    of rerun to a higher option (a stage's blocks are moved in order, the lowest option first). None: some rank
    does not fit even with every block at the most recompute offered. The estimate is the higher of the two
    moments (see the module docstring), the last stage's backward transient and a rank's receive buffers
    counted."""
    options = costs.block_options()
    per_option = [costs.options[o] for o in options]
    top = len(options) - 1
    num_stages = len(counts)
    starts = [sum(counts[:s]) for s in range(num_stages)]
    levels = [0] * len(costs.blocks)
    received = _receive_bytes(costs, owner, micro_batches)
    for rank in sorted(set(owner)):
        mine = [s for s in range(num_stages) if owner[s] == rank]
        state = fixed = received[rank]
        held = 0.0
        for s in mine:
            extra = _stage_extras(costs, num_stages, s, owner)
            blocks = costs.blocks[starts[s] : starts[s] + counts[s]]
            state += extra.state_bytes + sum(b.state_bytes for b in blocks)
            fixed += extra.held_bytes + extra.grad_bytes + sum(b.held_bytes + b.grad_bytes for b in blocks)
            fixed += _backward_transient(costs, num_stages, s)
            acts = extra.activation_bytes + sum(b.activation_bytes for b in blocks)
            held += in_flight[s] * (acts + _kept_output_bytes(costs, num_stages, s))
        transient = 0.0
        while max(state, fixed + held + transient) > budget:
            move = _best_move(per_option, levels, mine, starts, counts, in_flight, micro_batches, top)
            if move is None:
                return None
            b, s, target = move
            before, after = per_option[levels[b]][b], per_option[target][b]
            held -= in_flight[s] * (before.activation_bytes - after.activation_bytes)
            levels[b] = target
            transient = max(transient, per_option[0][b].activation_bytes - after.activation_bytes)
    return levels


def _best_move(
    per_option: list[list[UnitCost]],
    levels: list[int],
    stages: list[int],
    starts: list[int],
    counts: list[int],
    in_flight: tuple[int, ...],
    micro_batches: int,
    top: int,
) -> tuple[int, int, int] | None:
    """(block, stage, option) of the upgrade that saves the most activation bytes per second of rerun among the
    next block (lowest option, first in the stage) of each of ``stages``; None when none saves any."""
    best: tuple[float, int, int, int] | None = None
    for s in stages:
        blocks = range(starts[s], starts[s] + counts[s])
        if not counts[s]:
            continue
        b = min(blocks, key=lambda i: (levels[i], i))
        low = levels[b]
        for target in range(low + 1, top + 1):
            saved = in_flight[s] * (
                per_option[low][b].activation_bytes - per_option[target][b].activation_bytes
            )
            if saved <= 0:
                continue
            extra = micro_batches * (
                _block_seconds(per_option[target][b]) - _block_seconds(per_option[low][b])
            )
            ratio = saved / max(extra, 1e-15)
            if best is None or ratio > best[0]:
                best = (ratio, b, s, target)
    return None if best is None else best[1:]


def _memory_cut(
    costs: ModelCosts,
    num_stages: int,
    virtual: int,
    in_flight: tuple[int, ...],
    budget: float,
    micro_batches: int,
) -> list[int] | None:
    """A cut in which every stage fits ``budget / virtual`` with full recompute of its blocks (the most offered),
    balancing time without recompute; None when there is none."""
    most = costs.options[costs.block_options()[-1]]
    per_block = [_block_seconds(b) for b in costs.blocks]
    state = _prefix([b.state_bytes for b in costs.blocks])
    fixed = _prefix([b.held_bytes + b.grad_bytes for b in costs.blocks])
    act = _prefix([b.activation_bytes for b in most])
    delta = max(
        (b.activation_bytes - f.activation_bytes for b, f in zip(costs.blocks, most, strict=True)), default=0
    )
    owner = list(range(num_stages))  # the tied copy where the first and the last stage differ, as on pp ranks
    extras = [_stage_extras(costs, num_stages, s, owner) for s in range(num_stages)]
    received = 2 * micro_batches * costs.send_bytes  # a bound: both neighbours on other ranks

    def fits(s: int, i: int, j: int) -> bool:
        extra = extras[s]
        kept = extra.activation_bytes + act[j] - act[i] + _kept_output_bytes(costs, num_stages, s)
        held = in_flight[s] * kept + delta + _backward_transient(costs, num_stages, s)
        through = extra.held_bytes + extra.grad_bytes + fixed[j] - fixed[i] + held
        return max(extra.state_bytes + state[j] - state[i], through) + received <= budget / virtual

    first = _block_seconds(costs.first)
    last = _block_seconds(costs.last)
    return cut_blocks(per_block, num_stages, first, last, fits)


def _prefix(values: list[float]) -> list[float]:
    out = [0.0]
    for v in values:
        out.append(out[-1] + v)
    return out


def _time_cut(costs: ModelCosts, num_stages: int) -> list[int]:
    """The cut balancing the stages' seconds without recompute (cached by the blocks' seconds: layouts that
    differ in their data-parallel mode only share it)."""
    per_block = tuple(_block_seconds(b) for b in costs.blocks)
    key = (per_block, _block_seconds(costs.first), _block_seconds(costs.last), num_stages)
    if key not in _TIME_CUTS:
        counts = cut_blocks(list(per_block), num_stages, key[1], key[2])
        assert counts is not None  # no memory condition: a cut always exists
        if len(_TIME_CUTS) > 4096:
            _TIME_CUTS.clear()
        _TIME_CUTS[key] = counts
    return list(_TIME_CUTS[key])


_TIME_CUTS: dict[tuple, list[int]] = {}


def simulate_candidate(
    costs: ModelCosts,
    pp: int,
    stage: StageLayout,
    schedule: str,
    virtual: int,
    micro_batches: int,
    link: Link,
    budget: float = math.inf,
    counts: list[int] | None = None,
    levels: list[int] | None = None,
) -> PipelineCandidate:
    """Cut the blocks for ``schedule`` (``counts`` when given), choose recompute per block under ``budget``
    (``levels`` when given: per block an index into ``costs.block_options()``; see :func:`cut_and_recompute`)
    and simulate one step (see the module docstring)."""
    if counts is None or levels is None:
        counts, levels = cut_and_recompute(costs, pp, schedule, virtual, micro_batches, budget, counts)
    in_flight = _in_flight(schedule, pp, micro_batches, virtual)
    return _simulate_cut(costs, pp, stage, schedule, virtual, micro_batches, link, counts, levels, in_flight)


def cut_and_recompute(
    costs: ModelCosts,
    pp: int,
    schedule: str,
    virtual: int,
    micro_batches: int,
    budget: float,
    counts: list[int] | None = None,
) -> tuple[list[int], list[int]]:
    """The cut (``counts`` when given, else balancing the stages' seconds without recompute) and per block its
    recompute level (:func:`choose_recompute`). Where no recompute choice fits the time-balanced cut, the blocks
    are cut again under each stage's memory with the most recompute; where nothing fits, every block takes the
    most recompute (priced, not fitting)."""
    num_stages = pp * virtual
    owner = stage_ranks(schedule, num_stages, pp)
    in_flight = _in_flight(schedule, pp, micro_batches, virtual)
    levels = None
    if counts is None:
        counts = _time_cut(costs, num_stages)
        levels = choose_recompute(costs, counts, owner, in_flight, budget, micro_batches)
        if levels is None:
            counts = _memory_cut(costs, num_stages, virtual, in_flight, budget, micro_batches) or counts
    if levels is None:
        levels = choose_recompute(costs, counts, owner, in_flight, budget, micro_batches)
    if levels is None:
        levels = [len(costs.block_options()) - 1] * len(costs.blocks)
    return counts, levels


def _refined_bound(
    costs: ModelCosts, pp: int, schedule: str, micro_batches: int, counts: list[int], levels: list[int]
) -> float:
    """No simulation of this cut and recompute choice is faster: per rank, the stages before its first one
    (micro-batch 0 reaches it through them, and its last gradient goes back through them) plus all its own work
    of the step; and its busy time (compute, gradient synchronisation, optimizer)."""
    owner = stage_ranks(schedule, len(counts), pp)
    stages, _ = _stages(costs, counts, levels, owner)
    bound = 0.0
    for rank in range(pp):
        mine = [i for i in range(len(stages)) if owner[i] == rank]
        work = sum(micro_batches * _block_seconds(stages[i]) for i in mine)
        before = sum(_block_seconds(stages[i]) for i in range(min(mine)))
        busy = work + sum(stages[i].optimizer_s + stages[i].sync_s for i in mine)
        bound = max(bound, before + work, busy)
    return bound


def _simulate_cut(
    costs: ModelCosts,
    pp: int,
    stage: StageLayout,
    schedule: str,
    virtual: int,
    micro_batches: int,
    link: Link,
    counts: list[int],
    levels: list[int],
    in_flight: tuple[int, ...],
) -> PipelineCandidate:
    """One cut and recompute choice simulated, with each rank's state and exact peak memory."""
    num_stages = pp * virtual
    options = costs.block_options()
    owner = stage_ranks(schedule, num_stages, pp)
    stages, transients = _stages(costs, counts, levels, owner)
    stage_costs = []
    for index, s in enumerate(stages):
        first_gather = s.gather_s / (
            counts[index] + 1
        )  # the first block's (or embedding's) gather, not hidden
        stage_costs.append(
            StageCost(
                forward_s=s.forward_s,
                backward_input_s=s.backward_s / 2,  # a matmul's input and weight gradients cost alike
                backward_weight_s=s.backward_s / 2,
                # torch's stage keeps a micro-batch's output (sent on, or the logits) until its backward
                activation_bytes=int(s.activation_bytes) + _kept_output_bytes(costs, num_stages, index),
                send_bytes=costs.send_bytes,
                grad_bytes=int(s.grad_bytes),
                backward_transient_bytes=_backward_transient(costs, num_stages, index),
                first_forward_extra_s=first_gather + max(s.gather_s - first_gather - s.forward_s, 0.0),
                last_backward_extra_s=s.sync_s,
            )
        )
    rank_optimizer = [0.0] * pp
    rank_state = [0.0] * pp
    rank_held = [0.0] * pp
    rank_transient = [0.0] * pp
    for index, s in enumerate(stages):
        rank_optimizer[owner[index]] += s.optimizer_s
        rank_state[owner[index]] += s.state_bytes
        rank_held[owner[index]] += s.held_bytes
        rank_transient[owner[index]] = max(rank_transient[owner[index]], transients[index])
    simulation = simulate_schedule(schedule, stage_costs, micro_batches, pp, link, max(rank_optimizer))
    # torch's stages receive into buffers of their own, one per micro-batch and direction, kept between steps
    for send in simulation.sends:
        rank_held[send.dst] += send.nbytes
        rank_state[send.dst] += send.nbytes
    # the two highest moments: the schedule's (activations and gradients beside the state) and the optimizer step's
    peaks = [
        max(rank_state[r], rank_held[r] + simulation.peak_activation_bytes[r] + rank_transient[r])
        for r in range(pp)
    ]
    stage_peaks = [
        max(
            s.state_bytes,
            s.held_bytes + s.grad_bytes + transients[i] + _backward_transient(costs, num_stages, i)
            + in_flight[i] * (s.activation_bytes + _kept_output_bytes(costs, num_stages, i)),
        )
        for i, s in enumerate(stages)
    ]  # fmt: skip
    return PipelineCandidate(
        pp, stage, schedule, virtual, micro_batches, list(counts), [options[lv] for lv in levels], simulation,
        rank_state, rank_held, peaks, [s.forward_s + s.backward_s for s in stages], stage_peaks, costs,
    )  # fmt: skip


def _stages(
    costs: ModelCosts, counts: list[int], levels: list[int], owner: list[int] | None = None
) -> tuple[list[UnitCost], list[float]]:
    """Each stage's cost (its blocks, ``counts[s]`` of them in order, each under its recompute option, and what it
    runs besides; with the stages' ranks ``owner``, the tied head's copy, :func:`_stage_extras`), and the
    activations its largest recomputed block rematerialises during its backward."""
    options = costs.block_options()
    stages: list[UnitCost] = []
    transients: list[float] = []
    start = 0
    for index, count in enumerate(counts):
        stage = _stage_extras(costs, len(counts), index, owner)
        transient = 0.0
        for b in range(start, start + count):
            chosen = costs.options[options[levels[b]]][b]
            stage.add(chosen)
            transient = max(transient, costs.blocks[b].activation_bytes - chosen.activation_bytes)
        stages.append(stage)
        transients.append(transient)
        start += count
    return stages, transients


def p2p_link(cluster: ClusterSpec, pp: int) -> Link:
    """The link the pp axis's sends cross on mesh ``(pp, devices / pp)``: inter-node when any pp group spans
    nodes (the slowest hop bounds the pipeline)."""
    spec = cluster.axis_link((pp, cluster.num_devices // pp, 1), 0)
    return Link(bandwidth_bytes_per_s=spec.bandwidth, latency_s=spec.latency)


# ------------------------------------------------------------------------------------------------ the search
def pipeline_degrees(planner: _Planner, num_blocks: int, pipeline: int | None) -> list[int]:
    """The pp degrees to try: ``pipeline`` itself, or (None) every one from 2 that divides the devices and
    leaves each stage a block."""
    n = planner.cluster.num_devices
    if pipeline is not None:
        return [pipeline]
    return [pp for pp in range(2, min(n, num_blocks) + 1) if n % pp == 0]


@dataclass
class _Entry:
    """A candidate before it is simulated, with the lower bound it is ordered by."""

    bound_s: float
    pp: int
    stage: StageLayout
    micro_batches: int
    schedule: str
    virtual: int
    link: Link = field(compare=False)


def _lower_bound(costs: ModelCosts, pp: int, virtual: int, micro_batches: int) -> float:
    """No step of this layout is faster: every rank's share of the compute without recompute, the gradient
    synchronisation and the optimizer step, with no bubble."""
    stages = pp * virtual
    per_mb = sum(_block_seconds(b) for b in costs.blocks)
    per_mb += _block_seconds(costs.first) + _block_seconds(costs.last) + stages * _block_seconds(costs.every)
    once = sum(b.optimizer_s + b.sync_s for b in costs.blocks)
    once += costs.first.optimizer_s + costs.first.sync_s + costs.last.optimizer_s + costs.last.sync_s
    return (micro_batches * per_mb + once) / pp


def search_pipelines(
    planner: _Planner,
    pipeline: int | None,
    schedules: tuple[str, ...] = OFFERED_SCHEDULES,
    micro_batches: int | None = None,
    *,
    dp_modes: tuple[str, ...] = STAGE_DP_MODES,
    cutoff_s: float = math.inf,
    exhaustive: bool = False,
) -> tuple[PipelineCandidate | None, list[PipelineCandidate]]:
    """The fastest pipeline candidate that fits the budget (None: none does) and every candidate simulated.
    ``pipeline``: a pp degree (>= 2) or None (every degree); ``micro_batches``: a fixed count, or None (searched);
    ``dp_modes``: the data-parallel modes offered inside a stage; ``cutoff_s``: a step to beat (the best plan
    without stages): candidates whose lower bound is no faster are not simulated, nor (unless ``exhaustive``)
    those whose bound is no faster than the best fitting candidate found."""
    pricer = _Pricer(planner, find_layout(planner.model))
    return _search(pricer, pipeline, schedules, micro_batches, dp_modes, cutoff_s, exhaustive)


def search_pipeline_plan(
    planner: _Planner,
    pipeline: int | None,
    schedules: tuple[str, ...] = OFFERED_SCHEDULES,
    micro_batches: int | None = None,
    dp_modes: tuple[str, ...] = STAGE_DP_MODES,
) -> Plan | None:
    """The Plan of :func:`search_pipelines`' fastest fitting candidate (None: none fits), written up from the
    search's own ILPs: what a bench or a check runs for one schedule and micro-batch count."""
    pricer = _Pricer(planner, find_layout(planner.model))
    best, tried = _search(pricer, pipeline, schedules, micro_batches, dp_modes, math.inf, False)
    return None if best is None else pipeline_plan(planner, best, tried, pricer)


def _search(
    pricer: _Pricer,
    pipeline: int | None,
    schedules: tuple[str, ...],
    micro_batches: int | None,
    dp_modes: tuple[str, ...],
    cutoff_s: float,
    exhaustive: bool,
) -> tuple[PipelineCandidate | None, list[PipelineCandidate]]:
    """:func:`search_pipelines` on a pricer (whose ILPs the plan's write-up reuses): candidates in increasing lower
    bound, until the bound is no faster than ``cutoff_s`` or (unless ``exhaustive``) the best found."""
    planner = pricer.planner
    entries = _entries(planner, pricer.layout, pricer, pipeline, schedules, micro_batches, dp_modes)
    heap: list[tuple[float, int, int]] = [(e.bound_s, i, 0) for i, e in enumerate(entries)]
    heapq.heapify(heap)
    prepared: dict[int, tuple[ModelCosts, list[int], list[int]]] = {}
    tried: list[PipelineCandidate] = []
    best: PipelineCandidate | None = None
    while heap:
        bound, index, phase = heapq.heappop(heap)
        if bound >= cutoff_s or (not exhaustive and best is not None and bound >= best.step_time_s):
            break
        entry = entries[index]
        if phase == 0:  # cut and recompute chosen: a tighter bound, then back in line
            prepared[index] = _prepare(pricer, entry, planner.budget)
            refined = _refined_bound(prepared[index][0], entry.pp, entry.schedule, entry.micro_batches,
                                     *prepared[index][1:])  # fmt: skip
            heapq.heappush(heap, (max(bound, refined), index, 1))
            continue
        costs, counts, levels = prepared.pop(index)
        candidate = simulate_candidate(costs, entry.pp, entry.stage, entry.schedule, entry.virtual,
                                       entry.micro_batches, entry.link, planner.budget, counts, levels)  # fmt: skip
        candidate.rows = planner.batch // (entry.stage.dp * entry.micro_batches)
        tried.append(candidate)
        logger.debug("pipeline candidate %s", candidate.record(planner.budget))
        if candidate.peak_bytes <= planner.budget and (
            best is None or candidate.step_time_s < best.step_time_s - 1e-12
        ):
            best = candidate
    logger.info(
        "pipeline search: %d candidates bounded, %d cut, %d simulated, %d ILPs",
        len(entries), len(tried) + len(prepared), len(tried), pricer.ilps,
    )  # fmt: skip
    return best, tried


def _entries(
    planner: _Planner,
    layout: PipelineLayout,
    pricer: _Pricer,
    pipeline: int | None,
    schedules: tuple[str, ...],
    micro_batches: int | None,
    dp_modes: tuple[str, ...],
) -> list[_Entry]:
    """Every (pp, stage layout, micro-batches, schedule) the search may simulate, with its lower bound; layouts
    whose state alone cannot fit are left out."""
    entries: list[_Entry] = []
    for pp in pipeline_degrees(planner, layout.num_blocks, pipeline):
        _check_degree(planner, layout, pp)
        link = p2p_link(planner.cluster, pp)
        layouts = stage_layouts(planner, pp, dp_modes)
        if not layouts and pipeline is not None:
            raise ValueError(
                f"pipeline={pp}: the global batch of {planner.batch} does not split over the data-parallel "
                f"replicas of any stage layout of {planner.cluster.num_devices // pp} devices; use a batch "
                "divisible by them or another pp degree"
            )
        for stage in layouts:
            if _state_floor(planner, pp, stage) > planner.budget:
                continue
            local = planner.batch // stage.dp
            options = (
                [micro_batches]
                if micro_batches is not None
                else _micro_batch_options(local, pp, _row_tokens(planner.inputs))
            )
            for m in options:
                if m < 1 or local % m:
                    continue
                for schedule, virtual in _schedules_for(layout.num_blocks, pp, schedules):
                    if not _valid_micro_batches(schedule, m, pp * virtual, pp):
                        continue
                    # a lean layout is no faster than the same layout for speed alone: bound by that one
                    costs = pricer.costs(pp, dataclasses.replace(stage, lean=False), m, ("none",))
                    bound = _lower_bound(costs, pp, virtual, m)
                    entries.append(_Entry(bound, pp, stage, m, schedule, virtual, link))
    return entries


def _prepare(pricer: _Pricer, entry: _Entry, budget: float) -> tuple[ModelCosts, list[int], list[int]]:
    """One entry's costs, cut and recompute per block: without recompute where that fits, else with the
    recompute options priced too (their ILPs solved only now)."""
    pp, m = entry.pp, entry.micro_batches
    costs = pricer.costs(pp, entry.stage, m, ("none",))
    num_stages = pp * entry.virtual
    owner = stage_ranks(entry.schedule, num_stages, pp)
    in_flight = _in_flight(entry.schedule, pp, m, entry.virtual)
    counts = _time_cut(costs, num_stages)
    if choose_recompute(costs, counts, owner, in_flight, budget, m) is None:
        costs = pricer.costs(pp, entry.stage, m, RECOMPUTE_OFFERED)
    counts, levels = cut_and_recompute(costs, pp, entry.schedule, entry.virtual, m, budget)
    return costs, counts, levels


def _check_degree(planner: _Planner, layout: PipelineLayout, pp: int) -> None:
    """A pp degree that cannot run is refused with what would."""
    n = planner.cluster.num_devices
    if pp < 2 or n % pp:
        raise ValueError(f"pipeline={pp}: a pp degree must be >= 2 and divide the {n} devices")
    if pp > layout.num_blocks:
        raise PipelineLayoutError(
            f"pipeline={pp}: {layout.model_class} has {layout.num_blocks} blocks, fewer than the stages; use a pp "
            f"degree up to {layout.num_blocks}"
        )


# -------------------------------------------------------------------------------------------------- the plan
def pipeline_plan(
    planner: _Planner, candidate: PipelineCandidate, tried: list[PipelineCandidate], pricer: _Pricer
) -> Plan:
    """The Plan the runtime runs for ``candidate``: the stage layout's placements (tensor-parallel from its
    ILP, sharded over dp under FSDP/HSDP, replicated over pp), recompute per block, the pipeline fields, with its
    predictions: the simulated step, the worst rank's memory (state + activations at its peak), per-block costs
    of one step, per-stage figures in ``solver``."""
    stage = candidate.stage
    priced = pricer.inner(stage.tp, candidate.rows, "none", stage.plain, stage.lean)
    flat = priced.planner.to_plan(priced.mesh, priced.dp_mode, priced.built, priced.solution)
    base = hand_pipeline_plan(
        planner.model,
        planner.inputs,
        pp_size=candidate.pp,
        schedule=candidate.schedule,
        micro_batches=candidate.micro_batches,
        virtual_stages=candidate.virtual,
        blocks_per_stage=candidate.blocks_per_stage,
        dp_size=stage.dp,
    )
    sharded = stage.dp_mode in ("fsdp", "hsdp") and stage.dp > 1
    over_dp = "S0" if sharded else "R"
    batch_dp = "S0" if stage.dp > 1 else "R"
    layout = find_layout(planner.model)
    recompute = {layout.block(i): option for i, option in enumerate(candidate.recompute)}
    plan = dataclasses.replace(
        base,
        num_devices=candidate.pp * stage.dp * stage.tp,
        mesh_shape=(candidate.pp, stage.dp, stage.tp),
        dp_mode=stage.dp_mode if stage.dp > 1 else "ddp",
        dp_shard_size=stage.shard if stage.dp > 1 else 1,
        param_placements={f: ["R", over_dp, p[-1]] for f, p in flat.param_placements.items()},
        param_use_placements={f: ["R", "R", p[-1]] for f, p in flat.param_use_placements.items()},
        activation_placements={k: ["R", batch_dp, p[-1]] for k, p in flat.activation_placements.items()},
        block_input_placements={k: ["R", batch_dp, p[-1]] for k, p in flat.block_input_placements.items()},
        recompute=recompute,
        replicated_ops=flat.replicated_ops,
    )
    _fill_predictions(plan, planner, candidate, flat)
    plan.solver["pipeline_candidates"] = len(tried)
    plan.solver["pipeline_ilps"] = pricer.ilps
    return plan


def _fill_predictions(plan: Plan, planner: _Planner, candidate: PipelineCandidate, flat: Plan) -> None:
    """The candidate's predicted figures on ``plan``: step, the slowest rank's compute / communication /
    recompute, the worst rank's memory, per-unit costs of one step, per-stage figures in ``solver``."""
    sim = candidate.simulation
    pp, m = candidate.pp, candidate.micro_batches
    costs = candidate.costs
    options = costs.block_options()
    levels = [options.index(o) for o in candidate.recompute]
    owner = stage_ranks(candidate.schedule, len(candidate.blocks_per_stage), pp)
    stages, _ = _stages(costs, candidate.blocks_per_stage, levels, owner)
    comm, compute = [0.0] * pp, [0.0] * pp
    for index, stage in enumerate(stages):
        comm[owner[index]] += stage.sync_s + stage.gather_s
        compute[owner[index]] += m * (stage.forward_s + stage.backward_s) + stage.optimizer_s
    rerun = [m * (_block_seconds(costs.options[o][b]) - _block_seconds(costs.blocks[b]))
             for b, o in enumerate(candidate.recompute)]  # fmt: skip
    worst = max(range(pp), key=lambda r: candidate.rank_peak_bytes[r])
    slowest = max(range(pp), key=lambda r: sim.busy_s[r])
    plan.device = planner.spec.name
    plan.step_time_s = sim.step_time_s
    plan.recompute_time_s = sum(rerun[b] for b, s in enumerate(_stage_of_blocks(candidate.blocks_per_stage))
                                if owner[s] == slowest)  # fmt: skip
    plan.compute_time_s = compute[slowest] - plan.recompute_time_s
    plan.communication_time_s = comm[slowest]
    plan.peak_memory_bytes = math.ceil(
        candidate.rank_peak_bytes[worst]
    )  # whole bytes, never below the figure
    plan.memory_budget_bytes = planner.budget
    plan.param_memory_bytes = int(candidate.rank_held_bytes[worst])
    plan.activation_memory_bytes = plan.peak_memory_bytes - plan.param_memory_bytes
    layout = find_layout(planner.model)
    block_index = {layout.block(i): i for i in range(layout.num_blocks)}
    flat_blocks = {b.name: b for b in flat.blocks}
    plan.blocks = []
    for name, c in costs.unit_names.items():
        index = block_index.get(name)
        option = candidate.recompute[index] if index is not None else "none"
        chosen = costs.options[option][index] if index is not None else c
        plan.blocks.append(
            BlockCost(
                name=name,
                compute_s=m * _block_seconds(c) + c.optimizer_s,
                communication_s=c.sync_s + c.gather_s,
                memory_bytes=int(chosen.activation_bytes),
                placements=flat_blocks[name].placements if name in flat_blocks else {},
                recompute=option,
                recompute_s=rerun[index] if index is not None else 0.0,
            )
        )
    plan.memory_moments = [
        [f"pp rank {r} peak", math.ceil(b)] for r, b in enumerate(candidate.rank_peak_bytes)
    ]
    plan.collectives = {}
    plan.collective_bytes = {}
    plan.solver = {
        "status": "pipeline search",
        "stage_layout": candidate.stage.label,
        "bubble_fraction": sim.bubble_fraction,
        "stage_s_per_micro_batch": [round(s, 9) for s in candidate.stage_s],
        "stage_peak_memory_bytes": [math.ceil(b) for b in candidate.stage_peak_bytes],
        "rank_peak_memory_bytes": [math.ceil(b) for b in candidate.rank_peak_bytes],
        "rank_state_bytes": [int(b) for b in candidate.rank_state_bytes],
        "rank_held_bytes": [int(b) for b in candidate.rank_held_bytes],
        "rank_activation_bytes": [int(b) for b in sim.peak_activation_bytes],
        "point_to_point": {
            f"{src}->{dst}": [count, nbytes]
            for (src, dst), (count, nbytes) in sorted(point_to_point_traffic(sim.sends).items())
        },  # fmt: skip
    }


def _stage_of_blocks(counts: list[int]) -> list[int]:
    return [s for s, count in enumerate(counts) for _ in range(count)]


def with_pipelines(
    planner: _Planner,
    best: Plan | None,
    pipeline: int | None,
    micro_batches: int | None,
    dp_modes: tuple[str, ...] = STAGE_DP_MODES,
) -> Plan | None:
    """The plan :func:`~.planner.plan_model` returns once pipelines are searched: ``best`` (the fastest plan
    without pipeline stages, None if none fits) against the fastest pipeline plan that fits, by predicted step
    time. ``pipeline`` None searches every pp degree, an int >= 2 fixes it (``best`` is then None: not
    searched)."""
    cutoff = best.step_time_s if best is not None else math.inf
    try:
        pricer = _Pricer(planner, find_layout(planner.model))
        found, tried = _search(
            pricer, pipeline, OFFERED_SCHEDULES, micro_batches, STAGE_DP_MODES, cutoff, False
        )
    except PipelineLayoutError as exc:
        if pipeline is not None:
            raise
        logger.info("pipeline stages not searched: %s", exc)
        return best
    if found is None:
        if pipeline is not None:
            least = min((c.peak_bytes for c in tried), default=math.inf)
            raise InfeasibleError(
                f"No pipeline plan with pp={pipeline} for {type(planner.model).__name__} on "
                f"{planner.cluster.num_devices} x {planner.spec.name} fits {format_bytes(planner.budget)} per "
                f"device: the least any stage layout, schedule and micro-batch count needs is "
                f"{format_bytes(least) if least < math.inf else 'unknown (no candidate)'} (with full recompute "
                "where it helps). Use more pp stages, a smaller batch or sequence, or pipeline=None.",
                min_required=least,
                exact=False,
                choice=None,
            )
        return best
    if best is not None and best.step_time_s <= found.step_time_s:
        logger.info(
            "pipeline: the best pp plan (%s) is no faster than %.4g s without stages",
            found.record(planner.budget),
            best.step_time_s,
        )
        return best
    plan = pipeline_plan(planner, found, tried, pricer)
    if best is not None:
        plan.alternatives = list(best.alternatives)
        plan.solver["best_without_pipeline_s"] = best.step_time_s
    return plan


# ---------------------------------------------------------------------------------------- hand configurations
def price_pipeline(
    planner: _Planner,
    *,
    pp: int,
    stage: StageLayout,
    schedule: str,
    micro_batches: int,
    virtual_stages: int | None = None,
    blocks_per_stage: list[int] | None = None,
    recompute: str | list[str] = "none",
    fixed_params: dict[str, str] | None = None,
) -> Plan:
    """A pipeline configuration written by hand (torchtitan's FSDP x TP x PP, Llama 3's 4-D layout without
    context parallelism, or a pipeline Plan to re-price) priced by the same model as the search: ``stage`` inside
    each of ``pp`` stages, ``schedule`` with ``virtual_stages`` stages per rank (default: the fewest it runs),
    ``blocks_per_stage`` (default: as even as the blocks divide, as torchtitan and Llama 3 split),
    ``recompute`` one option for every block, a list (one per block), or "auto" (chosen per block under the
    budget as the search does), ``fixed_params`` the tensor-parallel placements (FQN -> placement; unlisted
    parameters replicated). Its Plan carries the predictions (``fits`` says whether it meets the budget)."""
    layout = find_layout(planner.model)
    _check_degree(planner, layout, pp)
    virtual = virtual_stages or PIPELINE_SCHEDULES[schedule][0]
    num_stages = pp * virtual
    if planner.cluster.num_devices != pp * stage.dp * stage.tp:
        raise ValueError(
            f"pipeline {pp} x mesh ({stage.dp}, {stage.tp}) holds {pp * stage.dp * stage.tp} devices, the cluster "
            f"{planner.cluster.num_devices}"
        )
    if planner.batch % (stage.dp * micro_batches):
        raise ValueError(
            f"the global batch of {planner.batch} does not split over {stage.dp} data-parallel replicas x "
            f"{micro_batches} micro-batches"
        )
    if not _valid_micro_batches(schedule, micro_batches, num_stages, pp):
        raise PipelinePlanError(
            f"schedule {schedule!r} with {num_stages} stages on {pp} ranks cannot run {micro_batches} micro-batches"
        )
    if blocks_per_stage is None:
        base, extra = divmod(layout.num_blocks, num_stages)
        blocks_per_stage = [base + (s < extra) for s in range(num_stages)]
    per_block = [recompute] * layout.num_blocks if isinstance(recompute, str) else list(recompute)
    auto = per_block == ["auto"] * layout.num_blocks
    options = RECOMPUTE_OFFERED if auto else tuple(dict.fromkeys(["none", *per_block]))
    if fixed_params is not None:
        tied = TiedGraph.build(planner.any_graph(1))
        fixed_params = {tied.canonical_param(k): v for k, v in fixed_params.items()}
    pricer = _Pricer(planner, layout, fixed_params, pin_unlisted=fixed_params is not None)
    costs = pricer.costs(pp, stage, micro_batches, options)
    link = p2p_link(planner.cluster, pp)
    if auto:
        counts, levels = cut_and_recompute(
            costs, pp, schedule, virtual, micro_batches, planner.budget, list(blocks_per_stage)
        )
    else:
        order = costs.block_options()
        counts, levels = list(blocks_per_stage), [order.index(o) for o in per_block]
    candidate = simulate_candidate(
        costs, pp, stage, schedule, virtual, micro_batches, link, planner.budget, counts, levels
    )
    candidate.rows = planner.batch // (stage.dp * micro_batches)
    return pipeline_plan(planner, candidate, [candidate], pricer)


def pipeline_configuration(planner: _Planner, plan: Plan) -> dict[str, Any]:
    """:func:`price_pipeline`'s arguments that re-price a pipeline Plan as it is: its stage layout,
    schedule, cut, recompute per block and tensor-parallel placements."""
    layout = find_layout(planner.model)
    ranges = layout.block_ranges(plan.stages)
    shard = plan.dp_shard_size if plan.dp_mode == "hsdp" else (plan.dp_size if plan.dp_mode == "fsdp" else 1)
    return dict(
        pp=plan.pp_size,
        stage=StageLayout(plan.tp_size, plan.dp_size, plan.dp_mode, shard),
        schedule=plan.schedule,
        micro_batches=plan.micro_batches,
        virtual_stages=plan.virtual_stages,
        blocks_per_stage=[len(r) for r in ranges],
        recompute=[plan.recompute.get(layout.block(i), "none") for i in range(layout.num_blocks)],
        fixed_params={fqn: p[-1] for fqn, p in plan.param_placements.items()},
    )
