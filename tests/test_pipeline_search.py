"""The planner's search over pipeline stages (pp x DDP): the cut, the schedule and micro-batch choice, the plan
it writes (one the pipeline runtime accepts), and when it is chosen over a plan without stages."""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import random
from pathlib import Path

import pytest
import torch
from torchrun_launch import run_torchrun

from hf_colossal_auto.apply.pipeline import check_pipeline_plan
from hf_colossal_auto.apply.shared_casts import share_sibling_casts
from hf_colossal_auto.models import build_model, load_config, make_example_inputs
from hf_colossal_auto.pipeline_layout import find_layout
from hf_colossal_auto.plan import SPLIT_BACKWARD_SCHEDULES, Plan, stage_ranks
from hf_colossal_auto.solve.candidates import _Planner
from hf_colossal_auto.solve.pipeline import cut as cut_module
from hf_colossal_auto.solve.pipeline.costs import ModelCosts, StageLayout, UnitCost
from hf_colossal_auto.solve.pipeline.cut import choose_recompute, cut_blocks, simulate_candidate
from hf_colossal_auto.solve.pipeline.plan import _stage_of_blocks, with_pipelines
from hf_colossal_auto.solve.pipeline.pricing import _Pricer
from hf_colossal_auto.solve.pipeline.schedules import OFFERED_SCHEDULES, _in_flight, _valid_micro_batches
from hf_colossal_auto.solve.pipeline.search import search_pipelines
from hf_colossal_auto.solve.planner import evaluate_plan, plan_model
from hf_colossal_auto.solve.pricing.pipeline_schedule import Link
from hf_colossal_auto.solve.problem import InfeasibleError
from hf_colossal_auto.units import format_bytes

ROOT = Path(__file__).resolve().parents[1]


def _llama(layers: int):
    config = load_config("tiny-llama")
    config.num_hidden_layers = layers
    torch.manual_seed(0)
    return build_model(config, device="meta")


def _brute_force_cut(times: list[float], stages: int, first: float, last: float) -> float:
    """The slowest stage of the best cut, over every cut of at least one block a stage."""
    n = len(times)
    best = float("inf")
    for cuts in itertools.combinations(range(1, n), stages - 1):
        bounds = [0, *cuts, n]
        slowest = max(
            sum(times[bounds[s] : bounds[s + 1]])
            + (first if s == 0 else 0)
            + (last if s == stages - 1 else 0)
            for s in range(stages)
        )
        best = min(best, slowest)
    return best


def test_cut_balances_uneven_blocks():
    """The dynamic programme finds the cut whose slowest stage is fastest, with the embedding's and the head's
    extra seconds on the first and last stage; a memory condition moves the cut."""
    assert cut_blocks([1, 1, 1, 1, 1, 1, 6], 2) == [6, 1]
    assert cut_blocks([1.0] * 8, 2, first_s=0.0, last_s=2.0) == [5, 3]  # the head's stage takes fewer blocks
    assert cut_blocks([1.0] * 6, 3) == [2, 2, 2]
    rng = random.Random(0)
    for _ in range(40):
        n = rng.randint(2, 9)
        stages = rng.randint(1, n)
        times = [rng.uniform(0.1, 3.0) for _ in range(n)]
        first, last = rng.uniform(0, 2), rng.uniform(0, 2)
        counts = cut_blocks(times, stages, first, last)
        assert counts is not None and len(counts) == stages and sum(counts) == n and min(counts) >= 1
        bounds = [0, *itertools.accumulate(counts)]
        slowest = max(
            sum(times[bounds[s] : bounds[s + 1]])
            + (first if s == 0 else 0)
            + (last if s == stages - 1 else 0)
            for s in range(stages)
        )
        assert slowest == pytest.approx(_brute_force_cut(times, stages, first, last))
    # at most 3 blocks a stage: the time-optimal [6, 1] is not allowed
    assert cut_blocks([1, 1, 1, 1, 1, 1, 6], 3, fits=lambda s, i, j: j - i <= 3) == [3, 3, 1]
    assert cut_blocks([1.0] * 4, 2, fits=lambda s, i, j: False) is None


def test_cut_under_a_monotone_memory_condition_is_the_same_cut():
    """``fits_monotone`` (a stage that does not fit does not fit with more blocks in front: memory growing
    with its blocks) only stops the search for a stage's start early: the cut is the one found without it,
    also where no cut fits."""
    rng = random.Random(1)
    stopped_early = 0
    for _ in range(200):
        n = rng.randint(2, 12)
        stages = rng.randint(1, n)
        times = [rng.uniform(0.1, 3.0) for _ in range(n)]
        size = [rng.randint(0, 20) for _ in range(n)]  # integers: sums exact, so fits is monotone
        room = [rng.randint(5, 60) for _ in range(stages)]
        calls: list[int] = []

        def fits(s: int, i: int, j: int, size=size, room=room, calls=calls) -> bool:
            calls.append(1)
            return sum(size[i:j]) <= room[s]

        plain = cut_blocks(times, stages, 0.3, 0.7, fits)
        before = len(calls)
        assert cut_blocks(times, stages, 0.3, 0.7, fits, fits_monotone=True) == plain
        stopped_early += len(calls) - before < before
    assert stopped_early > 0  # the early stop happened in some cases


def test_unit_cost_add_sums_every_field():
    """``UnitCost.add`` names its fields one by one (speed): every field, a later one too, is summed."""
    for i, f in enumerate(dataclasses.fields(UnitCost)):
        total = UnitCost(**{g.name: 1.0 for g in dataclasses.fields(UnitCost)})
        total.add(UnitCost(**{f.name: 2.0 + i}))
        assert getattr(total, f.name) == 3.0 + i
        assert all(getattr(total, g.name) == 1.0 for g in dataclasses.fields(UnitCost) if g.name != f.name)


def test_pipeline_one_never_yields_pipeline_stages():
    """The default (1) and pipeline=1 plan without stages; a budget only stages could meet stays infeasible."""
    model = _llama(4)
    inputs = make_example_inputs(model, 4, 8, device="meta")
    plan = plan_model(model, inputs, num_devices=2, pipeline=1)
    assert plan.pp_size == 1 and "pp" not in plan.mesh_axis_names
    staged = plan_model(model, inputs, num_devices=2, pipeline=2)
    with pytest.raises(InfeasibleError):
        plan_model(
            model,
            inputs,
            num_devices=2,
            mesh_shape=(2, 1),
            dp_modes=("ddp",),
            memory_budget=staged.peak_memory_bytes,
        )


def test_one_micro_batch_leaves_a_pipelines_schedule_count_to_the_search():
    """micro_batches=1 (the batch in one forward, what the integrations pass without accumulation) does not
    fix a pipeline's schedule count, which a pipelined forward runs itself: pipeline=2 finds a count of at
    least the stages; an int >= 2 still fixes it."""
    model = _llama(2)
    inputs = make_example_inputs(model, 8, 16, device="meta")
    searched = plan_model(model, inputs, num_devices=2, pipeline=2, micro_batches=1)
    assert searched.pp_size == 2 and _valid_micro_batches(
        searched.schedule, searched.micro_batches, searched.num_stages, 2
    )
    fixed = plan_model(model, inputs, num_devices=2, pipeline=2, micro_batches=4)
    assert fixed.micro_batches == 4


def test_pipeline_two_on_tiny_llama_is_a_plan_the_runtime_runs():
    """pipeline=2 on 2 devices: pp 2 x dp 1, every field the runtime checks valid, predictions filled in and
    consistent (the worst rank's memory, the simulated step), the JSON round trip exact."""
    model = _llama(2)
    inputs = make_example_inputs(model, 8, 16, device="meta")
    plan = plan_model(model, inputs, num_devices=2, pipeline=2)
    assert plan.pp_size == 2 and tuple(plan.mesh_shape) == (2, 1, 1) and plan.dp_mode == "ddp"
    assert plan.schedule in OFFERED_SCHEDULES and _valid_micro_batches(
        plan.schedule, plan.micro_batches, plan.num_stages, 2
    )
    assert 8 % plan.micro_batches == 0
    check_pipeline_plan(model, plan)  # what apply_pipeline_plan checks before it cuts the model
    assert Plan.from_dict(plan.to_dict()) == plan
    assert plan.step_time_s > plan.compute_time_s > 0
    assert plan.fits and plan.peak_memory_bytes == max(plan.solver["rank_peak_memory_bytes"])
    assert plan.peak_memory_bytes == plan.param_memory_bytes + plan.activation_memory_bytes
    assert 0 < plan.solver["bubble_fraction"] < 1
    assert "pipeline" in plan.summary()


def _summary_line(plan: Plan, label: str) -> str:
    """The text after ``label`` on the one summary line it heads (labels are padded to 22 columns)."""
    (text,) = [line[22:] for line in plan.summary().splitlines() if line.startswith(label.ljust(22))]
    return text


def test_pipeline_plan_summary_shows_its_stages_schedule_bubble_and_per_stage_predictions():
    """A planner-made pipeline plan's summary says what the planner chose for its stages and predicted of them,
    on their own lines (not only in the solver's raw record): the stage count, the ranks, the schedule, the
    micro-batches, the modules each stage holds, the bubble, and each stage's ms per micro-batch and peak
    memory in stage order, the values plan.solver records."""
    model = _llama(2)
    inputs = make_example_inputs(model, 8, 16, device="meta")
    plan = plan_model(model, inputs, num_devices=2, pipeline=2)
    seconds, peaks = plan.solver["stage_s_per_micro_batch"], plan.solver["stage_peak_memory_bytes"]
    assert plan.num_stages == len(plan.stages) == len(seconds) == len(peaks) == 2
    assert _summary_line(plan, "pipeline") == (
        f"2 stages on 2 ranks (1 per rank), schedule {plan.schedule}, {plan.micro_batches} micro-batches; "
        f"modules per stage: {len(plan.stages[0])}, {len(plan.stages[1])}"
    )
    bubble = plan.solver["bubble_fraction"]
    assert 0 < bubble < 1
    assert _summary_line(plan, "pipeline bubble") == f"{bubble * 100:.1f} % of the ranks' time (predicted)"
    assert _summary_line(plan, "per stage") == (
        f"ms per micro-batch: {seconds[0] * 1e3:.3g}, {seconds[1] * 1e3:.3g}; "
        f"peak memory: {format_bytes(peaks[0])}, {format_bytes(peaks[1])}"
    )


def test_pipeline_search_prices_every_schedule_and_micro_batch_count():
    """pp 2 on a 4-block model: GPipe, 1F1B and the two-stages-a-rank schedules, at every valid micro-batch
    count; more micro-batches shrink GPipe's bubble; 1F1B holds fewer activations than GPipe."""
    model = _llama(4)
    inputs = make_example_inputs(model, 8, 16, device="meta")
    planner = _Planner.for_devices(model, inputs, 2, "a100-80gb", None, None, None, "adamw", 60.0, "none")
    best, tried = search_pipelines(planner, 2, exhaustive=True)
    assert best is not None and best in tried
    assert {c.schedule for c in tried} == set(OFFERED_SCHEDULES)
    assert all(
        _valid_micro_batches(c.schedule, c.micro_batches, c.pp * c.virtual, c.pp) and 8 % c.micro_batches == 0
        for c in tried
    )
    assert best.step_time_s == min(c.step_time_s for c in tried if c.peak_bytes <= planner.budget)
    gpipe = {c.micro_batches: c for c in tried if c.schedule == "gpipe"}
    bubbles = [gpipe[m].simulation.bubble_fraction for m in sorted(gpipe)]
    assert bubbles == sorted(bubbles, reverse=True) and len(bubbles) >= 2
    one_f = {c.micro_batches: c for c in tried if c.schedule == "1f1b"}
    m = max(one_f)
    assert max(one_f[m].simulation.peak_activation_bytes) < max(gpipe[m].simulation.peak_activation_bytes)


def test_interleaved_schedules_are_offered_four_stages_a_rank_with_fewer_micro_batches_than_stages():
    """pp 2 on an 8-block model: the interleaved schedules are priced with 2 and with 4 stages a rank, the latter
    also at 4 micro-batches (fewer than its 8 stages: torch's rounds of pp); at one micro-batch count, 4 stages
    a rank leave interleaved 1F1B less bubble than 2."""
    model = _llama(8)
    inputs = make_example_inputs(model, 8, 16, device="meta")
    planner = _Planner.for_devices(model, inputs, 2, "a100-80gb", None, None, None, "adamw", 60.0, "none")
    _, tried = search_pipelines(planner, 2, exhaustive=True)
    offered = {(c.schedule, c.virtual) for c in tried}
    for schedule in ("interleaved-1f1b", "interleaved-zero-bubble"):
        assert {(schedule, 2), (schedule, 4)} <= offered
    assert ("zbv", 4) not in offered and ("1f1b", 2) not in offered
    assert any(c.virtual == 4 and c.micro_batches < c.pp * c.virtual for c in tried)
    by = {(c.virtual, c.micro_batches): c for c in tried if c.schedule == "interleaved-1f1b"}
    common = [m for v, m in by if v == 4 and (2, m) in by]
    assert common
    for m in common:
        two, four = by[(2, m)].simulation, by[(4, m)].simulation
        assert four.bubble_fraction < two.bubble_fraction


def test_pipeline_chosen_where_only_stages_fit():
    """A budget that DDP's whole-model state cannot meet but a pipeline's half can: where no plan without
    stages fits (here DDP only: the search is handed none), pipeline=None's choice is the pipeline plan."""
    model = _llama(4)
    inputs = make_example_inputs(model, 4, 8, device="meta")
    staged = plan_model(model, inputs, num_devices=2, pipeline=2)
    budget = staged.peak_memory_bytes
    with pytest.raises(InfeasibleError):  # DDP over the 2 devices needs the whole model's state on each
        plan_model(model, inputs, num_devices=2, mesh_shape=(2, 1), dp_modes=("ddp",), memory_budget=budget)
    planner = _Planner.for_devices(model, inputs, 2, "a100-80gb", None, budget, None, "adamw", 60.0)
    chosen = with_pipelines(planner, None, None, None)
    assert chosen is not None and chosen.pp_size == 2 and chosen.fits
    check_pipeline_plan(model, chosen)
    # and plan_model(pipeline=None) under that budget returns a plan that fits: stages, or a sharded plan
    auto = plan_model(model, inputs, num_devices=2, memory_budget=budget, pipeline=None)
    assert auto.fits and auto.step_time_s <= chosen.step_time_s + 1e-12


def test_pipeline_argument_refusals():
    model = _llama(2)
    inputs = make_example_inputs(model, 8, 16, device="meta")
    with pytest.raises(ValueError, match="pipeline must be None"):
        plan_model(model, inputs, num_devices=2, pipeline=0)
    with pytest.raises(ValueError, match="drop mesh_shape"):
        plan_model(model, inputs, num_devices=2, pipeline=2, mesh_shape=(2, 1))
    with pytest.raises(ValueError, match="has none of them"):
        plan_model(model, inputs, num_devices=2, pipeline=2, dp_modes=("ddp-ep",))
    with pytest.raises(ValueError, match="fewer than the stages"):
        plan_model(model, inputs, num_devices=4, pipeline=4)


def test_a_fixed_pp_degree_that_nothing_fits_states_a_finite_least():
    """pipeline=2 under a budget no stage layout's state fits: the error states the least memory a pp 2 plan
    needs as a finite lower bound (what the frontier's default sweep starts from: `plan --frontier --pipeline 2`
    failed without one), no higher than the peak of the plan pipeline=2 makes without a budget."""
    from hf_colossal_auto.solve.problem import InfeasibleError

    model = _llama(2)
    inputs = make_example_inputs(model, 8, 16, device="meta")
    with pytest.raises(InfeasibleError, match=r"pp=2 .* state alone fit, so none was priced") as refused:
        plan_model(model, inputs, num_devices=4, device="cpu", pipeline=2, memory_budget=1)
    least = refused.value.min_required
    free = plan_model(model, inputs, num_devices=4, device="cpu", pipeline=2, memory_budget=1 << 40)
    assert free.pp_size == 2 and 0 < least <= free.peak_memory_bytes, (least, free.peak_memory_bytes)


UNPRICED_BACKWARD_TRANSIENT = 0.05
"""How far a rank's measured peak may exceed the plan's prediction: a backward's transient on a stage other than
the last is not priced. Measured on this test's plans (receive buffers held only while their micro-batch is in
flight, sent gradients kept as torch's schedule keeps its sends): Llama's 1F1B 1.1-1.7 % above (up to 49,152
bytes: three hidden-state gradients of a micro-batch), interleaved 1F1B within 0.5 % either way, GPT-2's first
stage 3.6 % (115,000 bytes; alive at its peak, inside a later micro-batch's backward, the word embedding's dense
gradient made anew, 131,072 bytes, beside the accumulated one), its last 1.3 % (docs/reliability.md)."""

GRADIENTS_COUNTED_WHOLE = 0.10
"""How far a rank's measured peak may fall below the prediction: a stage's gradients are counted whole from its
first backward's start, before most exist. Measured: GPipe's first stage 7.2 % below (its peak lies inside the
first backward); at 6bff3e1 GPipe's second rank 9.6 % below, ZB-V with and without every block recomputed
-2.9 % .. +0.6 %."""


def test_planned_pipelines_run_on_two_gloo_ranks_as_predicted(tmp_path):
    """One launch (2 gloo ranks, a 4-block tiny Llama). The plan pipeline=2 chooses runs in the ordinary loop: its
    first loss is one process's, it trains, and its measured step is within a loose factor of the prediction (the
    static CPU spec is deliberately conservative and the machine shared: no tighter timing claim). For GPipe,
    1F1B, interleaved 1F1B (2 stages a rank, also under bf16 autocast, and 4 on an 8-block Llama with 4
    micro-batches) and ZB-V (also with every block recomputed: one rerun held to the weight pass) (and
    GPT-2's 1F1B, its head tied to the embedding across the ranks) the point-to-point
    sends and receives of a step, by peer, are the simulated
    schedule's, in count and bytes (c10d's isend / irecv as torch's pipelining issues them), and each rank's
    measured peak memory (the profiler's allocations from the first step on, a step after a warm-up) is within
    the plan's prediction for that rank: at most ``UNPRICED_BACKWARD_TRANSIENT`` above it (a backward's
    transient on a stage that does not compute the loss, not priced: docs/reliability.md) and at most
    ``GRADIENTS_COUNTED_WHOLE`` below it (a stage's gradients counted whole from its first backward on)."""
    out = tmp_path / "planned.json"
    run_torchrun(str(ROOT / "tests" / "multiproc" / "check_pipeline_planned.py"), "--out", str(out), nproc=2)
    ranks = json.loads(out.read_text())
    result = ranks[0]["planned"]
    assert result["losses"][0] == pytest.approx(result["reference_loss"], rel=1e-5)
    assert result["losses"][-1] < result["losses"][0]
    ratio = result["measured_step_s"] / result["predicted_step_s"]
    assert 0.05 < ratio < 20, result
    for rank, figures in enumerate(ranks):
        for schedule in (
            "tiny-llama gpipe",
            "tiny-llama 1f1b",
            "tiny-llama interleaved-1f1b",
            "tiny-gpt2 1f1b",
            "tiny-llama zbv",
            "tiny-llama zbv full",  # the one rerun's tensors held to the weight pass, with its gradients
            "tiny-llama-8 interleaved-1f1b",  # 4 stages a rank, 4 micro-batches for its 8 stages
            "tiny-llama interleaved-1f1b bf16",  # under autocast: weight casts kept once a step
        ):
            measured = figures[schedule]
            assert measured["rank"] == rank
            assert measured["measured_p2p"] == measured["predicted_p2p"], (schedule, measured)
            assert measured["predicted_p2p"], (schedule, measured)  # every rank both sends and receives
            over = measured["measured_peak_bytes"] / measured["predicted_peak_bytes"] - 1
            assert -GRADIENTS_COUNTED_WHOLE <= over <= UNPRICED_BACKWARD_TRANSIENT, (
                schedule,
                rank,
                over,
                measured,
            )


# ------------------------------------------------------------------ stage layouts: tp, FSDP, recompute inside
def _synthetic_costs(blocks: int, act_none: float, act_full: float, state: float) -> ModelCosts:
    """A model of identical blocks priced under "none" and "full" recompute (full: a third more seconds)."""
    none = [UnitCost(forward_s=1.0, backward_s=2.0, state_bytes=state, held_bytes=state, activation_bytes=act_none)
            for _ in range(blocks)]  # fmt: skip
    full = [UnitCost(forward_s=1.0, backward_s=3.0, state_bytes=state, held_bytes=state, activation_bytes=act_full)
            for _ in range(blocks)]  # fmt: skip
    # nothing sent between stages (no receive buffers, no kept outputs): the blocks' own figures only
    costs = ModelCosts(none, UnitCost(), UnitCost(), UnitCost(), 0, {})
    costs.options.update(none=none, full=full)
    return costs


@pytest.mark.parametrize("schedule", OFFERED_SCHEDULES)
def test_the_searchs_refined_bound_never_exceeds_the_simulated_step(schedule):
    """The search prunes a candidate whose refined bound is no faster than the best found, so the bound must be
    a lower bound of the candidate's simulated step, for every schedule: uneven blocks (seconds drawn at random,
    backward 1-3x forward), uneven cuts, 2 and 4 ranks, micro-batches from one per stage up. Under the
    zero-bubble schedules the earlier stages' backwards once counted in it overstated it (a rank's deferred
    weight gradients overlap its last input gradient's way back): Llama-3-70B's best pp plan was pruned."""
    from hf_colossal_auto.solve.pipeline.cut import _refined_bound

    rng = random.Random(0)
    stage = StageLayout(1, 1, "ddp", 1)
    for _ in range(12):
        pp = rng.choice((2, 4))
        virtual = 1 if schedule in ("gpipe", "1f1b") else 2
        stages = pp * virtual
        blocks = [UnitCost(forward_s=f, backward_s=f * rng.uniform(1.0, 3.0))
                  for f in (rng.uniform(0.5, 2.0) for _ in range(stages + rng.randrange(6)))]  # fmt: skip
        costs = ModelCosts(blocks, UnitCost(), UnitCost(), UnitCost(), 0, {})
        costs.options["none"] = blocks
        cuts = sorted(rng.sample(range(1, len(blocks)), stages - 1))
        counts = [b - a for a, b in zip([0, *cuts], [*cuts, len(blocks)], strict=True)]
        levels = [0] * len(blocks)
        for m in {stages, 2 * stages}:
            simulated = simulate_candidate(
                costs, pp, stage, schedule, virtual, m, Link(), counts=counts, levels=levels
            )
            bound = _refined_bound(costs, pp, schedule, m, counts, levels)
            assert bound <= simulated.step_time_s * (1 + 1e-9), (pp, m, counts, bound, simulated.step_time_s)


@pytest.mark.parametrize("schedule", OFFERED_SCHEDULES)
def test_per_stage_memory_is_checked_exactly_per_schedule(schedule):
    """The micro-batches a stage holds at once (GPipe: all; 1F1B: stages - index; the split schedules until the
    weight gradient, as the simulation's memory walk holds their activations) are the simulation's own; recompute is chosen per rank where the schedule holds most; each
    rank's predicted peak is the higher of its optimizer-step state and its held state + the simulation's
    activation peak + its largest rematerialised block, and
    it fits the budget the choice was made for."""
    pp, m = 2, 4
    virtual = 2 if schedule not in ("gpipe", "1f1b") else 1
    costs = _synthetic_costs(8, act_none=100.0, act_full=10.0, state=50.0)
    stage = StageLayout(1, 1, "ddp", 1)
    free = simulate_candidate(costs, pp, stage, schedule, virtual, m, Link(), budget=float("inf"))
    in_flight = _in_flight(schedule, pp, m, virtual)
    if schedule in (
        "interleaved-zero-bubble",
        "zbv",
    ):  # held until the weight gradient, counted until the input's
        assert all(a >= b for a, b in zip(in_flight, free.simulation.max_in_flight, strict=True))
    else:
        assert list(in_flight) == free.simulation.max_in_flight
    if schedule == "gpipe":
        assert list(in_flight) == [m, m]
    if schedule == "1f1b":
        assert list(in_flight) == [2, 1]
    assert all(option == "none" for option in free.recompute)
    budget = max(free.rank_peak_bytes) * 0.8  # no rank fits without recompute where it holds most
    tight = simulate_candidate(costs, pp, stage, schedule, virtual, m, Link(), budget=budget)
    # under a split the rerun's bytes are held to the weight pass: recompute saves less, and the choice's
    # estimate (most micro-batches in flight and most awaiting their weight pass, apart) recomputes every block
    assert tight.peak_bytes <= budget and "full" in tight.recompute
    assert "none" in tight.recompute or schedule in SPLIT_BACKWARD_SCHEDULES
    assert tight.step_time_s > free.step_time_s
    split = (
        schedule in SPLIT_BACKWARD_SCHEDULES
    )  # a rerun is held to the weight pass: in the simulation's walk
    for rank in range(pp):
        blocks = [b for b, s in enumerate(_stage_of_blocks(tight.blocks_per_stage))
                  if tight.simulation.max_in_flight and stage_ranks(schedule, pp * virtual, pp)[s] == rank]  # fmt: skip
        transient = 90.0 if any(tight.recompute[b] == "full" for b in blocks) and not split else 0.0
        through = tight.rank_held_bytes[rank] + tight.simulation.peak_activation_bytes[rank] + transient
        expected = max(tight.rank_state_bytes[rank], through)
        assert tight.rank_peak_bytes[rank] == pytest.approx(expected)
    # the ranks holding most micro-batches recompute at least as many blocks
    if schedule == "1f1b":
        first, second = tight.blocks_per_stage[0], tight.blocks_per_stage[1]
        assert tight.recompute[:first].count("full") / first >= tight.recompute[first:].count("full") / second
    # nothing fits: every block at full recompute, priced and reported as not fitting
    hopeless = simulate_candidate(costs, pp, stage, schedule, virtual, m, Link(), budget=1.0)
    assert hopeless.peak_bytes > 1.0 and set(hopeless.recompute) == {"full"}


def test_choose_recompute_is_none_only_when_full_recompute_cannot_fit():
    costs = _synthetic_costs(4, act_none=100.0, act_full=10.0, state=50.0)
    owner = [0, 1]
    assert choose_recompute(costs, [2, 2], owner, (2, 1), 1e9, 4) == [0, 0, 0, 0]
    levels = choose_recompute(costs, [2, 2], owner, (2, 1), 2 * 50 + 2 * (100 + 10) + 90, 4)
    assert levels == [1, 0, 0, 0]  # rank 0 holds 2 micro-batches: one block of it recomputes
    assert choose_recompute(costs, [2, 2], owner, (2, 1), 2 * 50 + 2 * 20 - 1, 4) is None


def test_every_block_keeps_its_activations_whichever_moment_of_the_step_is_highest():
    """What a micro-batch's forward keeps per block is read at the end of forward. At one row a micro-batch the
    tiny Llama's step is highest late in backward (its gradients outweigh its activations), where the blocks
    whose backward has run hold nothing: read there, three of its four blocks kept 0 bytes and a 4-rank pp x dp
    step measured 25-30 % above its prediction. Each block keeps the same, half of what it keeps at two rows.
    And the gradients a split backward's input pass hands its weight pass, unpriced before (ZB-V on 2 gloo ranks,
    its middle rank: 8 % above its prediction without recompute, 23 % with full recompute; now within 0.5 %)."""
    config = load_config("tiny-llama")
    config.hidden_size, config.intermediate_size, config.vocab_size = 256, 704, 2000
    config.num_attention_heads = config.num_key_value_heads = 8
    config.head_dim, config.num_hidden_layers = 32, 4
    model = build_model(config, device="meta")
    inputs = make_example_inputs(model, 8, 128, device="meta")
    planner = _Planner.for_devices(model, inputs, 2, "cpu", None, None, None, "adamw", 60.0, "none")
    kept = {}
    for m in (4, 8):  # two rows a micro-batch, then one
        _, tried = search_pipelines(
            planner, 2, ("1f1b",), micro_batches=m, dp_modes=("ddp",), exhaustive=True
        )
        (candidate,) = [c for c in tried if c.record(planner.budget)["tp"] == 1]
        kept[candidate.rows] = [b.activation_bytes for b in candidate.costs.blocks]
    assert len(set(kept[1])) == 1 and kept[1][0] > 0
    assert kept[1] == [b / 2 for b in kept[2]]
    # what a split backward's input pass keeps for the weight pass: the gradient of every output of an op that
    # reads a parameter, float32 per token: q, k, v, o, down (hidden each), gate, up (intermediate each), and
    # the two norms' products with their weights (hidden each)
    per_token = 4 * (7 * config.hidden_size + 2 * config.intermediate_size)
    assert [b.deferred_grad_bytes for b in candidate.costs.blocks] == [1 * 128 * per_token] * 4


def _saved_per_block(model, batch, micro_batches: int) -> list[dict[str, int]]:
    """Per micro-batch, per block, the bytes of the storages its forward saves for backward that no earlier
    micro-batch saved (parameters excluded), the forwards run one after another inside one bf16 autocast region,
    as a pipeline schedule runs them inside the step's forward."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: set[int] = set()
    per = [dict.fromkeys(range(len(model.model.layers)), 0) for _ in range(micro_batches)]
    where = [0, -1]  # micro-batch, block (-1: outside every block)
    for i, layer in enumerate(model.model.layers):
        layer.register_forward_pre_hook(lambda m, a, i=i: where.__setitem__(1, i))
        layer.register_forward_hook(lambda m, a, o: where.__setitem__(1, -1))

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if where[1] >= 0 and ptr not in params and ptr not in seen:
            seen.add(ptr)
            per[where[0]][where[1]] += t.untyped_storage().nbytes()
        return t

    kept = []  # every micro-batch's graph alive: no saved storage is freed and its address reused
    with (
        torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
        torch.autocast("cpu", dtype=torch.bfloat16),
    ):
        for m in range(micro_batches):
            where[0] = m
            kept.append(model(**batch).loss)
    return per


def test_weight_casts_are_kept_once_a_step_by_blocks_without_recompute():
    """Under bf16 autocast a projection's weight is cast once per autocast region (torch's cast cache), and a
    pipeline schedule runs every micro-batch inside the step's forward: measured, a second micro-batch's forward
    keeps per block the pricing's ``activation_bytes``, the first also its ``cached_cast_bytes`` (the casts,
    priced as held once a step); a fully recomputed block keeps none of them (its rerun casts anew, so what it
    rematerialises counts them)."""
    config = load_config("tiny-llama")
    config.num_hidden_layers = 3
    torch.manual_seed(0)
    model = build_model(config, device="cpu")
    share_sibling_casts(model)  # as the runtime runs it: q, k, v (gate, up) share one cast of their input
    batch = make_example_inputs(model, 2, 32, seed=0)
    first, second = _saved_per_block(model, batch, 2)
    meta = build_model(config, device="meta")
    planner = _Planner.for_devices(
        meta,
        make_example_inputs(meta, 4, 32, device="meta"),
        2,
        "cpu",
        None,
        None,
        "bf16",
        "adamw",
        60.0,
        "none",
    )
    _, tried = search_pipelines(planner, 2, ("1f1b",), micro_batches=2, dp_modes=("ddp",), exhaustive=True)
    (candidate,) = [c for c in tried if c.record(planner.budget)["tp"] == 1]
    blocks = candidate.costs.blocks
    # block 0 is the first to save the rotary embedding's cos / sin, made before the blocks (priced with it)
    assert [b.activation_bytes for b in blocks[1:]] == [second[i] for i in range(1, 3)]
    assert [b.activation_bytes + b.cached_cast_bytes for b in blocks[1:]] == [first[i] for i in range(1, 3)]
    weights = sum(p.numel() for n, p in model.model.layers[0].named_parameters() if n.endswith("proj.weight"))
    assert all(b.cached_cast_bytes == 2 * weights for b in blocks)  # bf16 copies of the seven projections
    assert all(b.held_bytes >= b.cached_cast_bytes for b in blocks)
    costs = _Pricer(planner, find_layout(meta)).costs(2, candidate.stage, 2, ("none", "full"))
    full = costs.options["full"]
    assert all(f.cached_cast_bytes == 0 for f in full)
    assert cut_module.block_rematerialised(costs, [costs.block_options().index("full")] * 3) == [
        b.kept_alone - f.activation_bytes for b, f in zip(costs.blocks, full, strict=True)
    ]


def _tiny_llama_planner(budget=None, devices=4):
    model = _llama(4)
    inputs = make_example_inputs(model, 8, 32, device="meta")
    planner = _Planner.for_devices(model, inputs, devices, "a100-80gb", 4, budget, None, "adamw", 60.0)
    return model, inputs, planner


def test_stage_layout_with_sharding_or_recompute_chosen_where_only_it_fits():
    """pp 2 on 4 devices (stage meshes 2 x 1 DDP / FSDP, 1 x 2 tensor parallel, lean or not, recompute per
    block): under a budget below every DDP-without-recompute candidate's peak but above another layout's, the
    search returns a fitting candidate with FSDP, tensor parallelism or recompute inside its stages, and the plan
    says so in its fields."""
    model, inputs, planner = _tiny_llama_planner()
    _, tried = search_pipelines(planner, 2, exhaustive=True)
    assert {(c.stage.tp, c.stage.dp_mode) for c in tried} >= {(1, "ddp"), (1, "fsdp"), (2, "ddp")}
    plain = [
        c for c in tried if c.stage.tp == 1 and c.stage.dp_mode == "ddp" and set(c.recompute) == {"none"}
    ]
    floor = min(c.peak_bytes for c in plain)
    others = [c.peak_bytes for c in tried if c.peak_bytes < floor]
    assert others, "no other layout needs less memory than plain DDP: the test's premise"
    budget = int((floor + max(others)) / 2)
    _, _, tight = _tiny_llama_planner(budget)
    plan = with_pipelines(
        tight, None, 2, None
    )  # what plan_model(pipeline=2) returns, without the flat search
    assert plan is not None and plan.fits and plan.pp_size == 2 and plan.mesh_axis_names == ("pp", "dp", "tp")
    assert plan.peak_memory_bytes <= budget
    assert plan.tp_size > 1 or plan.dp_mode != "ddp" or set(plan.recompute.values()) != {"none"}
    assert len(plan.solver["stage_peak_memory_bytes"]) == plan.num_stages
    assert Plan.from_dict(plan.to_dict()) == plan


def test_hand_pipeline_configurations_priced_by_the_same_model():
    """torchtitan's FSDP x TP x PP (interleaved 1F1B, full recompute) on 8 devices as a hand configuration: the
    plan has its layout, every block recomputed, tensor-parallel placements Megatron's; a searched pipeline plan
    re-priced by evaluate_plan gives its own prediction back."""
    model = _llama(4)
    inputs = make_example_inputs(model, 8, 16, device="meta")
    common = dict(num_devices=8, devices_per_node=4)
    hand = evaluate_plan(model, inputs, "megatron", pipeline=2, mesh_shape=(2, 2), dp_mode="fsdp",
                         schedule="interleaved-1f1b", recompute="full", micro_batches=4, **common)  # fmt: skip
    plan = hand.plan
    assert plan.pp_size == 2 and tuple(plan.mesh_shape) == (2, 2, 2) and plan.dp_mode == "fsdp"
    assert plan.schedule == "interleaved-1f1b" and plan.virtual_stages == 2 and plan.micro_batches == 4
    assert set(plan.recompute.values()) == {"full"} and hand.step_time_s == plan.step_time_s > 0
    assert plan.param_placements["model.layers.0.mlp.down_proj.weight"] == ["R", "S0", "S1"]
    cheaper = evaluate_plan(model, inputs, "megatron", pipeline=2, mesh_shape=(2, 2), dp_mode="fsdp",
                            schedule="interleaved-1f1b", recompute="none", micro_batches=4, **common)  # fmt: skip
    assert cheaper.step_time_s < hand.step_time_s  # recompute costs time
    searched = plan_model(model, inputs, pipeline=2, num_devices=2)
    again = evaluate_plan(model, inputs, searched, num_devices=2)
    assert again.step_time_s == pytest.approx(searched.step_time_s, rel=1e-9)
    assert again.peak_memory_bytes == searched.peak_memory_bytes


@pytest.mark.parametrize("layout", ["megatron-sp", "megatron-sp-local"])
def test_sequence_parallel_stages_send_sequence_shards_priced_at_a_tp_th(layout, caplog):
    """Megatron-LM's sequence parallelism inside pipeline stages (the "megatron-sp" hand layout with pipeline=,
    and "megatron-sp-local" with attention and MLP on local shards, torchtitan's TP plan):
    its blocks return sequence shards, so the plan sends each tp rank's shard — the simulated sends carry half
    of plain Megatron's bytes at tp 2, in the same count — and holds less; the plan names its layout, so that
    evaluate_plan pins it again and gives its prediction back. Without tensor parallelism it is refused."""
    model = _llama(4)
    inputs = make_example_inputs(model, 8, 32, device="meta")
    common = dict(
        num_devices=4, device="cpu", pipeline=2, mesh_shape=(1, 2), schedule="1f1b", micro_batches=4
    )
    sp = evaluate_plan(model, inputs, layout, recompute="full", **common).plan
    plain = evaluate_plan(model, inputs, layout.replace("-sp", ""), recompute="full", **common).plan
    assert sp.sequence_sharded_sends and sp.hand_layout == layout and not plain.sequence_sharded_sends
    assert "stage sends           each tensor-parallel rank's sequence shard (1/2" in sp.summary()
    assert "stage sends" not in plain.summary()
    assert bool(sp.local_modules) == layout.endswith("local") == bool(plain.local_modules)
    assert set(sp.solver["point_to_point"]) == set(plain.solver["point_to_point"]) == {"0->1", "1->0"}
    for pair, (count, nbytes) in plain.solver["point_to_point"].items():
        assert sp.solver["point_to_point"][pair] == [count, nbytes // 2]
    assert sp.peak_memory_bytes < plain.peak_memory_bytes
    # DDP inside the stages ("R" on dp, the placements' second axis under pp): no "repeats the same work" warning
    from hf_colossal_auto.solve.planner import _warn_if_tensor_parallel_repeats

    with caplog.at_level(logging.WARNING, logger="hf_colossal_auto.solve.planner"):
        _warn_if_tensor_parallel_repeats(model, sp)
        assert not caplog.records
        replicated = {f: ["R", "R", "R"] for f in sp.param_placements}
        _warn_if_tensor_parallel_repeats(model, dataclasses.replace(sp, param_placements=replicated))
    assert "no parameter is sharded over the tensor-parallel axis of 2" in caplog.text
    again = evaluate_plan(model, inputs, sp, num_devices=4, device="cpu")
    assert again.step_time_s == pytest.approx(sp.step_time_s, rel=1e-9)
    assert again.plan.sequence_sharded_sends
    with pytest.raises(ValueError, match=f"{layout}: sequence parallelism needs a tensor-parallel axis"):
        evaluate_plan(model, inputs, layout, **{**common, "mesh_shape": (2, 1)})


@pytest.mark.parametrize("schedule", OFFERED_SCHEDULES)
def test_recompute_is_priced_once_per_micro_batch_and_held_to_the_weight_pass(schedule, monkeypatch):
    """Under the zero-bubble schedules torch runs each backward as an input-gradient pass and a weight-gradient
    pass; the runtime's checkpoint reruns a block once, in the first, and keeps what it rematerialised for the
    second (``apply/shared_rerun``; ``test_recompute.py``): every rank's busy time grows by one rerun per
    micro-batch and block under every schedule, and under a split the stage holds the rematerialised bytes from
    the input to the weight gradient (so full recompute there saves less memory than under whole backwards)."""
    split = schedule in SPLIT_BACKWARD_SCHEDULES
    pp, virtual = 2, (1 if schedule in ("gpipe", "1f1b") else 2)
    m, blocks = 4, 2 * pp * virtual
    costs = _synthetic_costs(blocks, act_none=100.0, act_full=10.0, state=50.0)  # full: +1 s a backward
    stage = StageLayout(1, 1, "ddp", 1)
    counts = [2] * (pp * virtual)
    free = simulate_candidate(
        costs, pp, stage, schedule, virtual, m, Link(), counts=counts, levels=[0] * blocks
    )
    simulated = []  # the stage figures the simulation is handed
    simulate = cut_module.simulate_schedule
    monkeypatch.setattr(
        cut_module, "simulate_schedule", lambda n, s, *a: simulated.append(s) or simulate(n, s, *a)
    )
    full = simulate_candidate(
        costs, pp, stage, schedule, virtual, m, Link(), counts=counts, levels=[1] * blocks
    )
    per_rank = blocks // pp  # blocks a rank holds, each rerun 1 s per micro-batch
    for rank in range(pp):
        extra = full.simulation.busy_s[rank] - free.simulation.busy_s[rank]
        assert extra == pytest.approx(m * per_rank * 1.0), (schedule, rank)
    (stages,) = simulated  # two blocks a stage, each rematerialising 100 - 10 bytes
    held = [s.weight_grad_bytes for s in stages]
    assert held == ([s.activation_bytes + 2 * 90 for s in stages] if split else [None] * len(stages))
