"""The search over pipeline stages (issue 27, first version): for each pp degree, the cut of the model's blocks
into stages, the schedule and the micro-batch count, priced by simulating the schedule.

What is searched is what the runtime runs (:mod:`hf_colossal_auto.apply.pipeline`): pp x DDP — mesh
``(pp, dp, 1)``, every replica a whole pipeline, no tensor parallelism, FSDP or recompute inside a stage. No
other combination is offered.

How a candidate is priced. The whole model is priced once per (dp, micro-batch rows) by the existing path: the
ILP of the inner mesh ``(dp, 1)`` under DDP at one micro-batch of one replica (``global / (dp x m)`` rows), on a
cluster of the inner ``devices / pp`` devices (its data-parallel groups are consecutive ranks, as the runtime's
mesh ``(pp, dp, tp)`` lays them), without recompute and with the budget lifted (a stage holds only part of the
model: memory is checked per stage below). From its solution each depth unit's forward and backward seconds
(an op's cost split by its module's backward share), its optimizer-step seconds, its parameter + gradient +
optimizer-state bytes (the optimizer step's memory row) and the activation bytes it keeps for backward (the
activation peak's row) are read; the data-parallel all-reduce of each unit's gradients is priced per parameter
as the builder prices it. Units before the blocks (embeddings) land on the first stage, units after them (the
final norm, the head, the loss) on the last, units that run on every stage (rotary tables, the base model's
mask) on every stage.

The cut: dynamic programming over contiguous block ranges minimising the slowest stage (forward + backward per
micro-batch, with the first and last stage's extras), as Alpa and nnScaler cut. The schedule and the
micro-batch count: every offered schedule (GPipe, 1F1B; interleaved 1F1B, interleaved zero bubble and ZB-V with
two stages per rank where the blocks allow) and every micro-batch count that is at least the stages and
divides a replica's batch, each simulated on its action list
(:func:`~.pricing.pipeline_schedule.simulate_schedule`): point-to-point sends on the link the pp axis crosses,
the stage's gradient all-reduce after its last backward, the optimizer step after everything. Memory per rank:
the higher of two moments, under the budget. Through the schedule: its stages' parameters and optimizer
state plus what the simulation holds at its peak: activations (per schedule: GPipe every micro-batch, 1F1B
``stages - stage_index``) and the gradients from a stage's first backward on, each stage's held micro-batch
counting its output too (torch's stage keeps it until the micro-batch's backward: the hidden states sent on,
the last stage's logits), the last stage's backward adding the step's transient (the loss's backward: the
logits' gradients; another stage's backward transient is not priced, docs/reliability.md), and the receive
buffers torch's stages keep between steps (one per received send of a step). The optimizer step: the state,
the step's temporaries and the receive buffers.
Measured against real ranks in ``tests/multiproc/check_pipeline_planned.py``. The fastest that fits wins.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..hardware import ClusterSpec
from ..pipeline_layout import PipelineLayout, PipelineLayoutError, find_layout, hand_pipeline_plan
from ..plan import PIPELINE_SCHEDULES, BlockCost, PipelinePlanError, Plan, stage_ranks
from ..units import format_bytes
from .build.builder import BuiltProblem
from .build.names import MemoryRow, NodeKind, memory_row_name
from .candidates import LIFTED_BUDGET, _first_rows, _Planner
from .ilp import solve
from .pricing.comm import data_parallel_sync_time
from .pricing.pipeline_schedule import (
    Link,
    ScheduleSimulation,
    StageCost,
    point_to_point_traffic,
    simulate_schedule,
)
from .problem import InfeasibleError, Solution
from .tied import TiedGraph
from .writeup import _activation_per_unit, _real_modules, _unit_mapper, _unit_order

logger = logging.getLogger(__name__)

OFFERED_SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "interleaved-zero-bubble", "zbv")
"""Schedules the search offers: every one the runtime runs and its tests cover."""

MAX_MICRO_BATCH_OPTIONS = 6
"""Micro-batch counts tried per pp degree (the fewest that are valid): each costs a pricing of the model at
smaller rows, and the bubble shrinks little past a few per stage while per-micro-batch host costs grow."""


@dataclass
class UnitCost:
    """One depth unit's (a block, an embedding, the head) cost per micro-batch, or bytes per device."""

    forward_s: float = 0.0
    backward_s: float = 0.0
    optimizer_s: float = 0.0
    """Its share of the optimizer step (once per step)."""
    sync_s: float = 0.0
    """The data-parallel all-reduce of its gradients (once per step, after the last backward)."""
    state_bytes: float = 0.0
    """Parameters, gradients, optimizer state and the optimizer step's temporaries (the optimizer step's memory
    row): what the rank holds while it steps."""
    held_bytes: float = 0.0
    """Parameters and optimizer state: what the rank holds through the schedule (the optimizer state from the
    first step on), beside the activations and the gradients."""
    grad_bytes: float = 0.0
    """Parameter gradients: made by the stage's first backward in a step, held to its end."""
    activation_bytes: float = 0.0
    """What one micro-batch's forward keeps for backward."""

    def add(self, other: UnitCost) -> None:
        for f in dataclasses.fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))


@dataclass
class ModelCosts:
    """The model's costs at one inner configuration, by where they land in a pipeline."""

    blocks: list[UnitCost]
    """Per block of the layout's block list, in order."""
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
    output_bytes: int = 0
    """The model's largest output per micro-batch (the logits): what the last stage returns."""
    tied: UnitCost = dataclasses.field(default_factory=lambda: UnitCost())
    """The head's parameters that are the embedding's (tied word embeddings), with their gradient all-reduce
    between the first and the last stage's ranks in ``sync_s``: where those ranks differ, the last holds a copy
    (its state) and both all-reduce the gradient after the schedule (the runtime's tie group)."""
    backward_transient_bytes: float = 0.0
    """Per micro-batch: what the step allocates at its highest point beyond what forwards keep, the inputs and
    the buffers (the activation-peak row's transient: in a causal LM the loss's backward, the logits'
    gradients), on top of what the last stage holds while it runs a backward. Another stage's (a block's
    gradients in flight, far smaller) is not priced: an open gap, docs/reliability.md."""


def _stage_extras(costs: ModelCosts, num_stages: int, index: int) -> UnitCost:
    """What stage ``index`` of ``num_stages`` runs besides its blocks."""
    extra = UnitCost()
    extra.add(costs.every)
    if index == 0:
        extra.add(costs.first)
    if index == num_stages - 1:
        extra.add(costs.last)
    return extra


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
        for j in range(s + 1, n + 1):
            for i in range(s, j):
                prev = best[s - 1][i]
                if prev[0] == math.inf or not allowed(s, i, j):
                    continue
                t = stage_time(s, i, j)
                candidate = (max(prev[0], t), prev[1] + t * t)
                if candidate < best[s][j]:
                    best[s][j], back[s][j] = candidate, i
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
def _inner_planner(planner: _Planner, pp: int, micro_batches: int) -> _Planner:
    """A planner for one pipeline replica's data-parallel group: ``devices / pp`` devices (as many per node),
    the global batch cut to ``global / micro_batches`` rows so that one replica's piece is one micro-batch,
    sharing the outer planner's traces (they depend on the rows only)."""
    cluster = planner.cluster
    inner_devices = cluster.num_devices // pp
    inner = _Planner(
        planner.model,
        _first_rows(planner.inputs, planner.batch // micro_batches),
        ClusterSpec(cluster.device, inner_devices, min(cluster.devices_per_node, inner_devices)),
        planner.budget,
        planner.mixed_precision,
        planner.optimizer,
        planner.time_limit_s,
        "none",
    )
    inner._graphs = planner._graphs
    inner._step_memories = planner._step_memories
    inner.routing = planner.routing
    return inner


def price_model(planner: _Planner, layout: PipelineLayout, pp: int, micro_batches: int) -> ModelCosts:
    """The model's per-unit costs under pp x DDP with ``micro_batches`` micro-batches (see the module
    docstring): one ILP of the inner mesh ``(devices / pp, 1)``, recompute off, budget lifted."""
    inner = _inner_planner(planner, pp, micro_batches)
    dp = inner.cluster.num_devices
    mesh = (dp, 1)
    built = inner.build(mesh, "ddp", recompute_pin="none", budget=LIFTED_BUDGET)
    solution = solve(built.problem, time_limit_s=planner.time_limit_s)
    graph = inner.graph(dp)
    units = _unit_costs(planner, built, solution, graph)
    dp_comm = inner.axis_comm(mesh, 0)
    unit_of = _unit_mapper(planner.model)
    for fqn in graph.param_names:
        if fqn not in graph.param_bytes:
            continue
        unit = units.setdefault(unit_of(fqn.rsplit(".", 1)[0]), UnitCost())
        trained = graph.is_trainable(fqn)
        unit.held_bytes += graph.param_bytes[fqn] + graph.optimizer_state_bytes.get(fqn, 0)
        unit.grad_bytes += graph.param_bytes[fqn] * trained
        if dp > 1 and trained:
            unit.sync_s += data_parallel_sync_time("ddp", graph.param_bytes[fqn], dp_comm)
    order = _unit_order(planner.model, unit_of)
    ordered = {u: units[u] for u in sorted(units, key=lambda u: order.index(u) if u in order else len(order))}
    costs = _by_role(ordered, layout, _send_bytes(graph, layout))
    costs.output_bytes = max((graph.values[v].nbytes for v in graph.output_values), default=0)
    costs.tied = _tied_costs(planner, layout, built, solution, graph, pp)
    peak_row = built.problem.memory_constraint(memory_row_name(MemoryRow.ACTIVATION_PEAK))
    costs.backward_transient_bytes = max(0.0, peak_row.constant - graph.input_bytes - graph.buffer_bytes)
    return costs


def _unit_costs(planner: _Planner, built: BuiltProblem, solution: Solution, graph) -> dict[str, UnitCost]:
    """Per depth unit: forward / backward seconds of one micro-batch, optimizer seconds, state and activation
    bytes, read off the solved problem (a node's cost spread over the real blocks it stands for)."""
    unit_of = _unit_mapper(planner.model)
    units: dict[str, UnitCost] = defaultdict(UnitCost)
    problem = built.problem
    ratios = built.backward_ratios

    def spread(module: str, **amounts: float) -> None:
        reals = _real_modules(graph, module)
        for real in reals:
            cost = units[unit_of(real)]
            for name, value in amounts.items():
                setattr(cost, name, getattr(cost, name) + value / len(reals))

    optimizer_row = problem.memory_constraint(memory_row_name(MemoryRow.OPTIMIZER_STEP))
    for node in problem.nodes:
        choice = solution.choice[node.name]
        cost = node.costs[choice] * node.multiplicity
        module = built.block_of.get(node.name, "")
        if node.kind == NodeKind.PARAM:
            terms = optimizer_row.terms.get(node.name)
            state = terms[choice] * node.multiplicity if terms else 0.0
            spread(module, optimizer_s=cost, state_bytes=state)
        elif node.kind == NodeKind.OP:
            share = ratios.backward_share(module)
            spread(module, forward_s=cost * (1 - share), backward_s=cost * share)
    for edge in problem.edges:  # reshardings (none on a one-device tensor-parallel axis), priced where read
        c = edge.cost[solution.choice[edge.src]][solution.choice[edge.dst]] * edge.multiplicity
        if c:
            module = built.block_of.get(edge.dst, "")
            share = ratios.backward_share(module)
            spread(module, forward_s=c * (1 - share), backward_s=c * share)
    tied = TiedGraph.build(graph)
    for unit, nbytes in _activation_per_unit(built, solution, graph, tied, unit_of, 1).items():
        units[unit].activation_bytes += nbytes
    return dict(units)


def _tied_costs(
    planner: _Planner, layout: PipelineLayout, built: BuiltProblem, solution: Solution, graph, pp: int
) -> UnitCost:
    """The tied head parameters' copy on the last stage's rank (state, held and gradient bytes, as the embedding's
    own are priced) and their gradient all-reduce over the two ranks of the runtime's tie group."""
    model = planner.model
    embedding = {id(p) for p in model.get_submodule(layout.embedding).parameters()}
    names = {n for n, p in model.named_parameters(remove_duplicate=False) if id(p) in embedding}
    head = {
        f"{layout.head}.{n}"
        for n, p in model.get_submodule(layout.head).named_parameters()
        if id(p) in embedding
    }
    tied = UnitCost()
    if not head:
        return tied
    optimizer_row = built.problem.memory_constraint(memory_row_name(MemoryRow.OPTIMIZER_STEP))
    n = planner.cluster.num_devices
    tie_comm = dataclasses.replace(planner.axis_comm((pp, n // pp), 0), size=2)
    for node, fqn in built.param_of_node.items():
        if fqn not in names or fqn not in graph.param_bytes:
            continue
        choice, copies = solution.choice[node], built.problem.node(node).multiplicity
        terms = optimizer_row.terms.get(node)
        tied.state_bytes += terms[choice] * copies if terms else 0.0
        tied.optimizer_s += built.problem.node(node).costs[choice] * copies
        trained = graph.is_trainable(fqn)
        tied.held_bytes += graph.param_bytes[fqn] + graph.optimizer_state_bytes.get(fqn, 0)
        tied.grad_bytes += graph.param_bytes[fqn] * trained
        if trained:
            tied.sync_s += data_parallel_sync_time("ddp", graph.param_bytes[fqn], tie_comm)
    return tied


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


# -------------------------------------------------------------------------------------------- one candidate
@dataclass
class PipelineCandidate:
    """A priced pipeline: its configuration, the simulation and the memory of each pp rank."""

    pp: int
    dp: int
    schedule: str
    virtual: int
    micro_batches: int
    blocks_per_stage: list[int]
    simulation: ScheduleSimulation
    rank_state_bytes: list[float]
    """Per rank: what it holds while the optimizer steps (:attr:`UnitCost.state_bytes`)."""
    rank_held_bytes: list[float]
    """Per rank: what it holds through the schedule beside the activations (:attr:`UnitCost.held_bytes`)."""
    rank_peak_bytes: list[float]
    stage_s: list[float]
    """Per stage: forward + backward seconds of one micro-batch."""
    costs: ModelCosts

    @property
    def step_time_s(self) -> float:
        return self.simulation.step_time_s

    @property
    def peak_bytes(self) -> float:
        return max(self.rank_peak_bytes)

    def record(self, budget: int) -> dict[str, Any]:
        """What :attr:`Plan.solver` and the logs say of it."""
        return {
            "pp": self.pp,
            "dp": self.dp,
            "schedule": self.schedule,
            "virtual_stages": self.virtual,
            "micro_batches": self.micro_batches,
            "blocks_per_stage": list(self.blocks_per_stage),
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


def _micro_batch_options(local_batch: int, least: int) -> list[int]:
    """Micro-batch counts for a replica's batch of ``local_batch`` rows: divisors of it, at least ``least``
    (the pp degree: one per stage of a one-stage-a-rank schedule), the fewest first."""
    return [m for m in range(least, local_batch + 1) if local_batch % m == 0][:MAX_MICRO_BATCH_OPTIONS]


def _valid_micro_batches(schedule: str, micro_batches: int, num_stages: int, pp: int) -> bool:
    """Whether the Plan contract accepts the count for the schedule (at least a stage each, interleaved rounds)."""
    from ..plan import _check_pipeline_micro_batches

    try:
        _check_pipeline_micro_batches(schedule, micro_batches, num_stages, pp)
    except PipelinePlanError:
        return False
    return True


def simulate_candidate(
    costs: ModelCosts,
    pp: int,
    dp: int,
    schedule: str,
    virtual: int,
    micro_batches: int,
    link: Link,
    budget: float = math.inf,
) -> PipelineCandidate:
    """Cut the blocks for ``schedule`` and simulate one step (see the module docstring). The cut balances the
    stages' seconds; where a rank then exceeds ``budget``, the blocks are cut again under each stage's memory
    (its state and its activations times the micro-batches the first simulation keeps in flight on it, within
    ``budget / virtual``), and that cut is kept when it needs less."""
    num_stages = pp * virtual
    per_block = [b.forward_s + b.backward_s for b in costs.blocks]
    first = costs.first.forward_s + costs.first.backward_s
    last = costs.last.forward_s + costs.last.backward_s
    counts = cut_blocks(per_block, num_stages, first, last)
    assert counts is not None  # no memory condition: a cut always exists
    candidate = _simulate_cut(costs, pp, dp, schedule, virtual, micro_batches, link, counts)
    if candidate.peak_bytes <= budget:
        return candidate
    in_flight = candidate.simulation.max_in_flight
    state = [b.state_bytes for b in costs.blocks]
    act = [b.activation_bytes for b in costs.blocks]

    def fits(s: int, i: int, j: int) -> bool:
        extra = _stage_extras(costs, num_stages, s)
        held = extra.state_bytes + sum(state[i:j]) + in_flight[s] * (extra.activation_bytes + sum(act[i:j]))
        return held <= budget / virtual

    counts = cut_blocks(per_block, num_stages, first, last, fits)
    if counts is None:
        return candidate
    by_memory = _simulate_cut(costs, pp, dp, schedule, virtual, micro_batches, link, counts)
    return by_memory if by_memory.peak_bytes < candidate.peak_bytes else candidate


def _simulate_cut(
    costs: ModelCosts,
    pp: int,
    dp: int,
    schedule: str,
    virtual: int,
    micro_batches: int,
    link: Link,
    counts: list[int],
) -> PipelineCandidate:
    """One cut's step simulated, with each rank's state and peak memory."""
    num_stages = pp * virtual
    owner = stage_ranks(schedule, num_stages, pp)
    stages = _stages(costs, counts, owner)
    last = num_stages - 1
    stage_costs = [
        StageCost(
            forward_s=s.forward_s,
            backward_input_s=s.backward_s / 2,  # a matmul's input and weight gradients cost alike
            backward_weight_s=s.backward_s / 2,
            # torch's stage keeps a micro-batch's output (sent on, or the logits) until its backward
            activation_bytes=int(s.activation_bytes)
            + (costs.output_bytes if i == last else costs.send_bytes),
            send_bytes=costs.send_bytes,
            grad_bytes=int(s.grad_bytes),
            backward_transient_bytes=int(costs.backward_transient_bytes) if i == last else 0,
            last_backward_extra_s=s.sync_s,
        )
        for i, s in enumerate(stages)
    ]
    rank_optimizer = [0.0] * pp
    rank_state = [0.0] * pp
    rank_held = [0.0] * pp
    for index, stage in enumerate(stages):
        rank_optimizer[owner[index]] += stage.optimizer_s
        rank_state[owner[index]] += stage.state_bytes
        rank_held[owner[index]] += stage.held_bytes
    simulation = simulate_schedule(schedule, stage_costs, micro_batches, pp, link, max(rank_optimizer))
    # torch's stages receive into buffers of their own, one per micro-batch and direction, kept between steps
    for send in simulation.sends:
        rank_held[send.dst] += send.nbytes
        rank_state[send.dst] += send.nbytes
    # the two highest moments: the schedule's (activations beside the state) and the optimizer step's
    peaks = [max(rank_state[r], rank_held[r] + simulation.peak_activation_bytes[r]) for r in range(pp)]
    return PipelineCandidate(
        pp, dp, schedule, virtual, micro_batches, counts, simulation, rank_state, rank_held, peaks,
        [s.forward_s + s.backward_s for s in stages], costs,
    )  # fmt: skip


def _stages(costs: ModelCosts, counts: list[int], owner: list[int] | None = None) -> list[UnitCost]:
    """Each stage's cost: its blocks (``counts[s]`` of them, in order) and what it runs besides. With the stages'
    ranks (``owner``): where the first and the last differ, the last holds a copy of the tied head parameters and
    both all-reduce their gradient (the runtime's tie group)."""
    stages: list[UnitCost] = []
    start = 0
    for index, count in enumerate(counts):
        stage = _stage_extras(costs, len(counts), index)
        for block in costs.blocks[start : start + count]:
            stage.add(block)
        stages.append(stage)
        start += count
    if owner is not None and owner[0] != owner[-1]:
        stages[-1].add(dataclasses.replace(costs.tied, sync_s=0.0))
        for stage in (stages[0], stages[-1]):
            stage.sync_s += costs.tied.sync_s
    return stages


def p2p_link(cluster: ClusterSpec, pp: int) -> Link:
    """The link the pp axis's sends cross on mesh ``(pp, devices / pp, 1)``: inter-node when any pp group spans
    nodes (the slowest hop bounds the pipeline)."""
    spec = cluster.axis_link((pp, cluster.num_devices // pp, 1), 0)
    return Link(bandwidth_bytes_per_s=spec.bandwidth, latency_s=spec.latency)


# ------------------------------------------------------------------------------------------------ the search
def pipeline_degrees(planner: _Planner, num_blocks: int, pipeline: int | None) -> list[int]:
    """The pp degrees to try: ``pipeline`` itself, or (None) every one from 2 that divides the devices, splits
    the global batch over its replicas and leaves each stage a block."""
    n = planner.cluster.num_devices
    if pipeline is not None:
        return [pipeline]
    return [pp for pp in range(2, min(n, num_blocks) + 1) if n % pp == 0 and planner.batch % (n // pp) == 0]


def search_pipelines(
    planner: _Planner,
    pipeline: int | None,
    schedules: tuple[str, ...] = OFFERED_SCHEDULES,
    micro_batches: int | None = None,
) -> tuple[PipelineCandidate | None, list[PipelineCandidate]]:
    """The fastest pp x DDP candidate that fits the budget (None: none does) and every candidate priced.
    ``pipeline``: a pp degree (>= 2) or None (every degree); ``micro_batches``: a fixed count, or None (searched)."""
    layout = find_layout(planner.model)
    n = planner.cluster.num_devices
    tried: list[PipelineCandidate] = []
    best: PipelineCandidate | None = None
    for pp in pipeline_degrees(planner, layout.num_blocks, pipeline):
        _check_degree(planner, layout, pp)
        dp = n // pp
        link = p2p_link(planner.cluster, pp)
        local = planner.batch // dp
        options = [micro_batches] if micro_batches is not None else _micro_batch_options(local, pp)
        for m in options:
            if m < 1 or local % m:
                continue
            costs: ModelCosts | None = None
            for schedule, virtual in _schedules_for(layout.num_blocks, pp, schedules):
                if not _valid_micro_batches(schedule, m, pp * virtual, pp):
                    continue
                costs = costs or price_model(planner, layout, pp, m)
                try:
                    candidate = simulate_candidate(costs, pp, dp, schedule, virtual, m, link, planner.budget)
                except ValueError as exc:  # a schedule torch cannot lay out for these counts
                    logger.debug("pp %d %s m=%d not simulated: %s", pp, schedule, m, exc)
                    continue
                tried.append(candidate)
                logger.debug("pipeline candidate %s", candidate.record(planner.budget))
                fits = candidate.peak_bytes <= planner.budget
                if fits and (best is None or candidate.step_time_s < best.step_time_s - 1e-12):
                    best = candidate
    return best, tried


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
    if planner.batch % (n // pp):
        raise ValueError(
            f"pipeline={pp}: the global batch of {planner.batch} does not split over {n // pp} data-parallel "
            "replicas of the pipeline; use a batch divisible by them or another pp degree"
        )


# -------------------------------------------------------------------------------------------------- the plan
def pipeline_plan(planner: _Planner, candidate: PipelineCandidate, tried: list[PipelineCandidate]) -> Plan:
    """The Plan the runtime runs for ``candidate``, with its predictions: the simulated step, the worst rank's
    memory (state + activations at its peak), per-block costs of one step, per-stage figures in ``solver``."""
    plan = hand_pipeline_plan(
        planner.model,
        planner.inputs,
        pp_size=candidate.pp,
        schedule=candidate.schedule,
        micro_batches=candidate.micro_batches,
        virtual_stages=candidate.virtual,
        blocks_per_stage=candidate.blocks_per_stage,
        dp_size=candidate.dp,
    )
    sim = candidate.simulation
    worst = max(range(candidate.pp), key=lambda r: candidate.rank_peak_bytes[r])
    m = candidate.micro_batches
    stage_sync = [0.0] * candidate.pp
    compute = [0.0] * candidate.pp
    costs = candidate.costs
    owner = stage_ranks(candidate.schedule, len(candidate.blocks_per_stage), candidate.pp)
    for index, stage in enumerate(_stages(costs, candidate.blocks_per_stage, owner)):
        stage_sync[owner[index]] += stage.sync_s
        compute[owner[index]] += m * (stage.forward_s + stage.backward_s) + stage.optimizer_s
    slowest = max(range(candidate.pp), key=lambda r: sim.busy_s[r])
    plan.device = planner.spec.name
    plan.step_time_s = sim.step_time_s
    plan.compute_time_s = compute[slowest]
    plan.communication_time_s = stage_sync[slowest]
    plan.peak_memory_bytes = math.ceil(
        candidate.rank_peak_bytes[worst]
    )  # whole bytes, never below the figure
    plan.memory_budget_bytes = planner.budget
    plan.param_memory_bytes = int(candidate.rank_held_bytes[worst])
    plan.activation_memory_bytes = plan.peak_memory_bytes - plan.param_memory_bytes
    plan.blocks = [
        BlockCost(
            name=name,
            compute_s=m * (c.forward_s + c.backward_s) + c.optimizer_s,
            communication_s=c.sync_s,
            memory_bytes=int(c.activation_bytes),
        )
        for name, c in costs.unit_names.items()
    ]
    plan.solver = {
        "status": "pipeline search",
        "bubble_fraction": sim.bubble_fraction,
        "stage_s_per_micro_batch": [round(s, 9) for s in candidate.stage_s],
        "rank_peak_memory_bytes": [math.ceil(b) for b in candidate.rank_peak_bytes],
        "rank_state_bytes": [int(b) for b in candidate.rank_state_bytes],
        "rank_held_bytes": [int(b) for b in candidate.rank_held_bytes],
        "rank_activation_bytes": [int(b) for b in sim.peak_activation_bytes],
        "point_to_point": {
            f"{src}->{dst}": [count, nbytes]
            for (src, dst), (count, nbytes) in sorted(point_to_point_traffic(sim.sends).items())
        },  # fmt: skip
        "pipeline_candidates": len(tried),
    }
    return plan


def with_pipelines(
    planner: _Planner, best: Plan | None, pipeline: int | None, micro_batches: int | None
) -> Plan | None:
    """The plan :func:`~.planner.plan_model` returns once pipelines are searched: ``best`` (the fastest plan
    without pipeline stages, None if none fits) against the fastest pp x DDP plan that fits, by predicted step
    time. ``pipeline`` None searches every pp degree, an int >= 2 fixes it (``best`` is then None: not
    searched)."""
    try:
        found, tried = search_pipelines(planner, pipeline, micro_batches=micro_batches)
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
                f"device: the least any schedule and micro-batch count needs is "
                f"{format_bytes(least) if least < math.inf else 'unknown (no candidate)'} (pp x DDP, no recompute "
                "inside a stage). Use more pp stages, a smaller batch or sequence, or pipeline=None.",
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
    plan = pipeline_plan(planner, found, tried)
    if best is not None:
        plan.alternatives = list(best.alternatives)
        plan.solver["best_without_pipeline_s"] = best.step_time_s
    return plan
