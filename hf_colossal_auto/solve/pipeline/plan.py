"""The Plan a priced pipeline candidate becomes (its stages, predictions and solver record), the planner's
entry points (:func:`with_pipelines`, :func:`search_pipeline_plan`) and hand pipeline configurations priced
by the search's own pricing (:func:`price_pipeline`, :func:`pipeline_configuration`).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any

from ...pipeline_layout import PipelineLayoutError, find_layout, hand_pipeline_plan
from ...plan import PIPELINE_SCHEDULES, BlockCost, PipelinePlanError, Plan, stage_ranks
from ...units import format_bytes
from ..candidates import _Planner
from ..pricing.pipeline_schedule import point_to_point_traffic
from ..problem import InfeasibleError
from ..sequence_parallel import SEQUENCE_PARALLEL_LAYOUTS
from ..tied import TiedGraph
from .costs import RECOMPUTE_OFFERED, STAGE_DP_MODES, PipelineCandidate, StageLayout, _block_seconds
from .cut import _stages, block_reruns, cut_and_recompute, simulate_candidate
from .pricing import _Pricer, _state_floor, stage_layouts
from .schedules import OFFERED_SCHEDULES, _valid_micro_batches
from .search import _check_degree, _search, p2p_link

logger = logging.getLogger(__name__)


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


# -------------------------------------------------------------------------------------------------- the plan
def pipeline_plan(
    planner: _Planner, candidate: PipelineCandidate, tried: list[PipelineCandidate], pricer: _Pricer
) -> Plan:
    """The Plan the runtime runs for ``candidate``: the stage layout's placements (tensor-parallel from its
    ILP, sharded over dp under FSDP/HSDP, replicated over pp), recompute per block, the pipeline fields, with its
    predictions: the simulated step, the worst rank's memory (state + activations at its peak), per-block costs
    of one step, per-stage figures in ``solver``."""
    stage = candidate.stage
    priced = pricer.inner(stage.tp, candidate.rows, "none", stage.lean)
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
        local_modules=flat.local_modules,
        sequence_sharded_sends=priced.sequence_sharded_sends,
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
    # one rerun a micro-batch, under an input / weight split too (its weight pass reads the input pass's)
    rerun = [m * seconds for seconds in block_reruns(costs, levels)]
    comm, compute = [0.0] * pp, [0.0] * pp
    for index, stage in enumerate(stages):  # a stage's backward_s holds its reruns
        comm[owner[index]] += stage.sync_s + stage.gather_s
        compute[owner[index]] += m * (stage.forward_s + stage.backward_s) + stage.optimizer_s
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


def _no_pipeline_fits(planner: _Planner, pipeline: int, tried: list) -> InfeasibleError:
    """What a fixed pp degree with no fitting candidate says: the least peak of the candidates simulated, or,
    where every stage layout's state alone was over the budget (none simulated), the least such state — a
    lower bound, which the frontier's sweep starts from (``min_required``)."""
    least = min((c.peak_bytes for c in tried), default=math.inf)
    if least < math.inf:
        why = (
            f"the least any stage layout, schedule and micro-batch count needs is {format_bytes(least)} (with "
            "full recompute where it helps)"
        )
    else:
        least = min(
            (_state_floor(planner, pipeline, s) for s in stage_layouts(planner, pipeline, STAGE_DP_MODES)),
            default=math.inf,
        )
        shown = format_bytes(least) if least < math.inf else "unknown (no stage layout)"
        why = (
            "no stage layout's parameters, gradients and optimizer state alone fit, so none was priced: a plan "
            f"needs at least {shown}"
        )
    return InfeasibleError(
        f"No pipeline plan with pp={pipeline} for {type(planner.model).__name__} on "
        f"{planner.cluster.num_devices} x {planner.spec.name} fits {format_bytes(planner.budget)} per device: "
        f"{why}. Use more pp stages, a smaller batch or sequence, or pipeline=None.",
        min_required=least,
        exact=False,
        choice=None,
    )


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
            raise _no_pipeline_fits(planner, pipeline, tried)
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
    local: bool = False,
    sequence_parallel: bool = False,
) -> Plan:
    """A pipeline configuration written by hand (torchtitan's FSDP x TP x PP, Llama 3's 4-D layout without
    context parallelism, or a pipeline Plan to re-price) priced by the same model as the search: ``stage`` inside
    each of ``pp`` stages, ``schedule`` with ``virtual_stages`` stages per rank (default: the fewest it runs),
    ``blocks_per_stage`` (default: as even as the blocks divide, as torchtitan and Llama 3 split),
    ``recompute`` one option for every block, a list (one per block), or "auto" (chosen per block under the
    budget as the search does), ``fixed_params`` the tensor-parallel placements (FQN -> placement; unlisted
    parameters replicated), ``local`` whether its qualifying attention / MLP modules run on local tensor shards
    (:mod:`..local_tensor_parallel`), ``sequence_parallel`` whether the ops between its tensor-parallel regions
    run on sequence shards (Megatron-LM's sequence parallelism; the plan's ``hand_layout`` "megatron-sp", or
    "megatron-sp-local" with ``local``). Its Plan carries the predictions (``fits`` says whether it meets the
    budget)."""
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
    pricer = _Pricer(
        planner,
        layout,
        fixed_params,
        pin_unlisted=fixed_params is not None,
        local=local,
        sequence_parallel=sequence_parallel,
    )
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
    plan = pipeline_plan(planner, candidate, [candidate], pricer)
    if sequence_parallel:  # pinned again when the plan is priced again (pipeline_configuration)
        plan.hand_layout = "megatron-sp-local" if local else "megatron-sp"
    return plan


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
        local=bool(plan.local_modules),
        sequence_parallel=plan.hand_layout in SEQUENCE_PARALLEL_LAYOUTS,
    )
