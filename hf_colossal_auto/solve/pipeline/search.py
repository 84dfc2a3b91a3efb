"""The search over a model's pipeline candidates (pp degree, stage layout, schedule, micro-batch count).

Search order and pruning: every candidate gets a lower bound on its step without an ILP beyond its layout's
"none" one (every rank's share of the compute, synchronisation and optimizer, no bubble, no recompute);
candidates are simulated in increasing bound and the search stops at the first bound no faster than the best
candidate that fits (or than the best plan without stages). Recompute ILPs are solved only for the layouts whose
candidates need them. A layout whose state alone (parameters sharded as far as its tp and dp allow) exceeds the
budget is not priced.
"""

from __future__ import annotations

import dataclasses
import heapq
import logging
import math
from dataclasses import dataclass, field

from ...hardware import ClusterSpec
from ...pipeline_layout import PipelineLayout, PipelineLayoutError, find_layout
from ...plan import stage_ranks
from ..candidates import _Planner
from ..pricing.pipeline_schedule import Link
from .costs import (
    RECOMPUTE_OFFERED,
    STAGE_DP_MODES,
    ModelCosts,
    PipelineCandidate,
    StageLayout,
    _block_seconds,
)
from .cut import (
    _refined_bound,
    _split_awaiting,
    _time_cut,
    choose_recompute,
    cut_and_recompute,
    simulate_candidate,
)
from .pricing import _Pricer, _state_floor, stage_layouts
from .schedules import (
    OFFERED_SCHEDULES,
    _in_flight,
    _micro_batch_options,
    _row_tokens,
    _schedules_for,
    _valid_micro_batches,
)

logger = logging.getLogger(__name__)


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
    awaiting = _split_awaiting(entry.schedule, pp, m, entry.virtual)
    counts = _time_cut(costs, num_stages)
    if choose_recompute(costs, counts, owner, in_flight, budget, m, awaiting) is None:
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
