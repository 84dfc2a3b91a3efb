"""The cut of the model's blocks into stages, recompute per block, and the simulation of one candidate.

Recompute per block: the cut is chosen first (dynamic programming over contiguous block ranges minimising the
slowest stage without recompute, as Alpa and nnScaler cut; where even full recompute cannot fit a stage, the cut
is redone under each stage's memory with full recompute), then each rank upgrades blocks to more recompute
(none -> selective -> full), the block saving the most bytes per second of rerun first, until the rank's estimate
(per stage its most micro-batches in flight, a bound on the simulation's) fits the budget. The simulation then
gives the step and each rank's exact peak.

Memory per rank, checked exactly per stage and schedule: the higher of two moments. Through the schedule: its
stages' parameters and optimizer state (as the layout holds them: under FSDP the shards plus the parameters
gathered through the step; under mixed precision the weight casts of blocks without recompute, once a step:
autocast's cache), plus what the simulation's walk of the schedule's own action list holds at its peak:
activations (GPipe every micro-batch, 1F1B ``stages - stage_index``, interleaved more), each held micro-batch
counting its output too (torch's stage keeps it until the micro-batch's backward: the hidden states sent on, the
last stage's logits) and the activation it received from another rank (its receive buffer, dropped after that
backward by the runtime's stage), the gradients from a stage's first backward on (the layout's: under FSDP the unsharded
accumulated gradient), the last stage's backward adding the step's transient (the loss's backward: the logits'
gradients; another stage's backward transient is not priced, docs/reliability.md), where a block recomputes its
rematerialised activations while its backward runs (the largest such block of the rank; under a split backward
instead held, with the gradients the input pass hands the weight pass, from the input to the weight gradient), a
backward receiving its gradient from another rank adding that buffer, a stage's FSDP reduce-scatter its copy of a
unit's gradients as its last backward ends. The optimizer step: the state (parameters, gradients,
optimizer state and the step's temporaries, as the layout holds them); no receive buffer is alive then. A head
tied to the embedding on another rank: the last rank holds a copy (its state, gradient and optimizer step, as the
embedding's) and both ranks all-reduce its gradient (the runtime's tie group). The ILP's own memory model gives
the per-block bytes. Measured against real ranks in ``tests/multiproc/check_pipeline_planned.py``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from ...plan import stage_ranks
from ..pricing.comm import SHARDED_DP_MODES
from ..pricing.pipeline_schedule import (
    Link,
    StageCost,
    _cached_actions,
    simulate_schedule,
)
from .costs import (
    ModelCosts,
    PipelineCandidate,
    StageLayout,
    UnitCost,
    _backward_transient,
    _block_seconds,
    _kept_output_bytes,
    _received_activation_bytes,
    _received_gradient_bytes,
    _stage_extras,
)
from .schedules import _awaiting_weight, _in_flight


def cut_blocks(
    block_s: list[float],
    num_stages: int,
    first_s: float = 0.0,
    last_s: float = 0.0,
    fits: Callable[[int, int, int], bool] | None = None,
    fits_monotone: bool = False,
) -> list[int] | None:
    """Blocks per stage (each at least one, contiguous, in order) minimising the slowest stage's seconds, the
    first stage also paying ``first_s`` and the last ``last_s``; among cuts as good, the one whose stages are
    most even (least sum of squares). ``fits(stage, first_block, end_block)``: whether a stage may hold those
    blocks (its memory); None when no cut meets it. ``fits_monotone``: a stage that does not fit does not fit
    with more blocks in front either (``fits(s, i, j)`` false implies ``fits(s, i', j)`` false for ``i' < i``),
    so the search for a stage's first block stops at the first that does not fit (the same cut, fewer
    calls). Dynamic programming over prefix lengths: O(stages x blocks^2)."""
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

    stop_early = fits is not None and fits_monotone
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
                if stop_early:
                    # asked first: every earlier start gives this stage more blocks, so none fits (without it,
                    # starts whose first stages cannot hold their blocks would be walked to the first block)
                    if not fits(s, i, j):
                        break
                    if prev[0] == math.inf:
                        continue
                elif prev[0] == math.inf or (fits is not None and not fits(s, i, j)):
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


def choose_recompute(
    costs: ModelCosts,
    counts: list[int],
    owner: list[int],
    in_flight: tuple[int, ...],
    budget: float,
    micro_batches: int,
    awaiting: tuple[int, ...] = (),
) -> list[int] | None:
    """Per block, the index into ``costs.block_options()`` of its recompute option: each rank starts without
    recompute and, while its estimate (state + per stage its activations times its most micro-batches in flight
    + what recompute rematerialises, :func:`_rematerialised_held`) exceeds ``budget``, moves the block that saves
    the most bytes per second of rerun to a higher option (a stage's blocks are moved in order, the lowest option
    first). None: some rank does not fit even with every block at the most recompute offered. The estimate is
    the higher of the two moments (see the module docstring), the last stage's backward transient and the receive
    buffers of its micro-batches in flight counted. ``awaiting``: per stage the most micro-batches between their
    input and weight gradients (:func:`~.schedules._awaiting_weight`; empty under whole backwards)."""
    options = costs.block_options()
    per_option = [costs.options[o] for o in options]
    top = len(options) - 1
    num_stages = len(counts)
    starts = [sum(counts[:s]) for s in range(num_stages)]
    levels = [0] * len(costs.blocks)
    for rank in sorted(set(owner)):
        mine = [s for s in range(num_stages) if owner[s] == rank]
        state = fixed = held = 0.0
        for s in mine:
            extra = _stage_extras(costs, num_stages, s, owner)
            blocks = costs.blocks[starts[s] : starts[s] + counts[s]]
            state += extra.state_bytes + sum(b.state_bytes for b in blocks)
            fixed += extra.held_bytes + extra.grad_bytes + sum(b.held_bytes + b.grad_bytes for b in blocks)
            fixed += _backward_transient(costs, num_stages, s) + _received_gradient_bytes(costs, owner, s)
            acts = extra.activation_bytes + sum(b.activation_bytes for b in blocks)
            kept = _kept_output_bytes(costs, num_stages, s) + _received_activation_bytes(costs, owner, s)
            deferred = extra.deferred_grad_bytes + sum(b.deferred_grad_bytes for b in blocks)
            held += in_flight[s] * (acts + kept) + _rematerialised_held(awaiting, s) * deferred
        transient = 0.0
        while max(state, fixed + held + transient) > budget:
            move = _best_move(
                per_option, levels, mine, starts, counts, in_flight, micro_batches, top, awaiting
            )
            if move is None:
                return None
            b, s, target = move
            before, after = per_option[levels[b]][b], per_option[target][b]
            held -= _kept_saved(before, after, in_flight[s], _rematerialised_held(awaiting, s))
            fixed -= before.held_bytes - after.held_bytes  # weight casts kept once a step without recompute
            levels[b] = target
            if not awaiting:
                transient = max(transient, per_option[0][b].kept_alone - after.kept_alone)
    return levels


def _rematerialised_held(awaiting: tuple[int, ...], stage: int) -> int:
    """How many micro-batches' worth of a stage's rematerialised activations (its blocks' recompute, against
    none) a rank holds at once. Under whole backwards none: a block's rerun lives only while its backward runs
    (the largest block's, a transient on top). Under the input/weight split the one rerun, in the input pass,
    serves the weight pass too (``apply/shared_rerun``), and what it rematerialised is held from the input to
    the weight gradient: the stage's most micro-batches in that window (at least one: a stage whose backward is
    whole holds its blocks' reruns within it)."""
    return max(awaiting[stage], 1) if awaiting else 0


def _kept_saved(before: UnitCost, after: UnitCost, in_flight: int, waiting: int) -> float:
    """What a stage holds less for its micro-batches when a block moves from option ``before`` to ``after``: its
    kept activations times the micro-batches in flight, less (under the input/weight split) what the rerun
    rematerialises, weight casts included, times the micro-batches awaiting their weight pass."""
    rematerialised = before.kept_alone - after.kept_alone
    return in_flight * (before.activation_bytes - after.activation_bytes) - waiting * rematerialised


def _best_move(
    per_option: list[list[UnitCost]],
    levels: list[int],
    stages: list[int],
    starts: list[int],
    counts: list[int],
    in_flight: tuple[int, ...],
    micro_batches: int,
    top: int,
    awaiting: tuple[int, ...] = (),
) -> tuple[int, int, int] | None:
    """(block, stage, option) of the upgrade that saves the most activation bytes per second of rerun among the
    next block (lowest option, first in the stage) of each of ``stages``; None when none saves any (under the
    input/weight split a stage whose micro-batches wait for their weight gradient as long as they are in flight
    saves nothing by recompute: :func:`_rematerialised_held`)."""
    best: tuple[float, int, int, int] | None = None
    for s in stages:
        blocks = range(starts[s], starts[s] + counts[s])
        if not counts[s]:
            continue
        b = min(blocks, key=lambda i: (levels[i], i))
        low = levels[b]
        for target in range(low + 1, top + 1):
            before, after = per_option[low][b], per_option[target][b]
            saved = _kept_saved(before, after, in_flight[s], _rematerialised_held(awaiting, s))
            saved += before.held_bytes - after.held_bytes
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
    awaiting: tuple[int, ...] = (),
) -> list[int] | None:
    """A cut in which every stage fits ``budget / virtual`` with full recompute of its blocks (the most offered),
    balancing time without recompute; None when there is none."""
    most = costs.options[costs.block_options()[-1]]
    per_block = [_block_seconds(b) for b in costs.blocks]
    state = _prefix([b.state_bytes for b in costs.blocks])
    fixed = _prefix([b.held_bytes + b.grad_bytes for b in most])
    act = _prefix([b.activation_bytes for b in most])
    rerun = block_rematerialised(costs, [len(costs.block_options()) - 1] * len(costs.blocks))
    rematerialised = _prefix(rerun)
    deferred = _prefix([b.deferred_grad_bytes for b in costs.blocks])
    delta = max(rerun, default=0)
    owner = list(range(num_stages))  # the tied copy where the first and the last stage differ, as on pp ranks
    extras = [_stage_extras(costs, num_stages, s, owner) for s in range(num_stages)]
    # per stage, what does not depend on its blocks (``fits`` is asked O(stages x blocks^2) times)
    kept_base = [
        e.activation_bytes
        + _kept_output_bytes(costs, num_stages, s)
        + _received_activation_bytes(costs, owner, s)
        for s, e in enumerate(extras)
    ]
    waiting = [_rematerialised_held(awaiting, s) for s in range(num_stages)]
    through_base = [
        e.held_bytes + e.grad_bytes + _backward_transient(costs, num_stages, s)
        + _received_gradient_bytes(costs, owner, s) + (0 if waiting[s] else delta)
        for s, e in enumerate(extras)
    ]  # fmt: skip
    per_stage = budget / virtual

    def fits(s: int, i: int, j: int) -> bool:
        extra = extras[s]
        held = in_flight[s] * (kept_base[s] + act[j] - act[i])
        if waiting[s]:
            held += waiting[s] * (
                rematerialised[j] - rematerialised[i] + deferred[j] - deferred[i] + extra.deferred_grad_bytes
            )
        through = through_base[s] + fixed[j] - fixed[i] + held
        return max(extra.state_bytes + state[j] - state[i], through) <= per_stage

    first = _block_seconds(costs.first)
    last = _block_seconds(costs.last)
    # with no block's bytes negative, the prefix differences (and so every term of ``fits``) only grow as a
    # stage takes more blocks: a stage that does not fit does not fit with more
    monotone = all(
        b.state_bytes >= 0 and b.held_bytes + b.grad_bytes >= 0 and b.activation_bytes >= 0 for b in most
    ) and all(r >= 0 for r in rerun)
    return cut_blocks(per_block, num_stages, first, last, fits, fits_monotone=monotone)


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
    awaiting = _split_awaiting(schedule, pp, micro_batches, virtual)
    levels = None
    if counts is None:
        counts = _time_cut(costs, num_stages)
        levels = choose_recompute(costs, counts, owner, in_flight, budget, micro_batches, awaiting)
        if levels is None:
            counts = _memory_cut(costs, num_stages, virtual, in_flight, budget, awaiting) or counts
    if levels is None:
        levels = choose_recompute(costs, counts, owner, in_flight, budget, micro_batches, awaiting)
    if levels is None:
        levels = [len(costs.block_options()) - 1] * len(costs.blocks)
    return counts, levels


def _splits_backward(schedule: str, pp: int, micro_batches: int, virtual: int) -> bool:
    """Whether ``schedule``'s action list runs input and weight gradients apart (zero-bubble schedules)."""
    return any(
        action[0] == "W" for rank in _cached_actions(schedule, pp, micro_batches, virtual) for action in rank
    )


def _split_awaiting(schedule: str, pp: int, micro_batches: int, virtual: int) -> tuple[int, ...]:
    """Per stage the most micro-batches awaiting their weight gradient (:func:`~.schedules._awaiting_weight`)
    under a schedule that splits backward; empty under whole backwards."""
    awaiting = _awaiting_weight(schedule, pp, micro_batches, virtual)
    return awaiting if any(awaiting) else ()


def _refined_bound(
    costs: ModelCosts, pp: int, schedule: str, micro_batches: int, counts: list[int], levels: list[int]
) -> float:
    """No simulation of this cut and recompute choice is faster: per rank, the stages before its first one
    (micro-batch 0 reaches it through their forwards; under a schedule with whole backwards its last gradient
    goes back through their backwards after its own last one) plus all its own work of the step; and its busy
    time (compute, gradient synchronisation, optimizer). Under a zero-bubble schedule (backward split into input
    and weight gradients) the earlier stages' backwards are not counted: the rank's deferred weight gradients
    may run while its last input gradient travels back through them, so counting both overstated the bound
    (Llama-3-70B, pp 8 ZB-V: bounded at 5.16 s, simulated 4.90 s, and pruned)."""
    owner = stage_ranks(schedule, len(counts), pp)
    stages, _ = _stages(costs, counts, levels, owner)
    split = _splits_backward(schedule, pp, micro_batches, len(counts) // pp)
    bound = 0.0
    for rank in range(pp):
        mine = [i for i in range(len(stages)) if owner[i] == rank]
        work = sum(micro_batches * _block_seconds(stages[i]) for i in mine)
        earlier = range(min(mine))
        before = sum(stages[i].forward_s if split else _block_seconds(stages[i]) for i in earlier)
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
    reruns = _stage_reruns(costs, counts, levels)
    awaiting = _split_awaiting(schedule, pp, micro_batches, virtual)
    rematerialised = _stage_rematerialised(costs, counts, levels)
    # under a split the reruns are held from the input to the weight gradient: in the simulation's walk
    if awaiting:
        transients = [0.0] * num_stages
    unsharded_at = _unsharded_at(stages, owner)
    stage_costs = []
    for index, s in enumerate(stages):
        # torch's stage keeps a micro-batch's output (sent on, or the logits) until its backward
        # and the activation it received, in the buffer dropped after that backward
        kept = (
            int(s.activation_bytes)
            + _kept_output_bytes(costs, num_stages, index)
            + _received_activation_bytes(costs, owner, index)
        )
        stage_costs.append(
            StageCost(
                forward_s=s.forward_s,
                # a matmul's input and weight gradients cost alike; a split's input pass reruns the recompute,
                # which serves its weight pass too (apply/shared_rerun)
                backward_input_s=(s.backward_s + reruns[index]) / 2,
                backward_weight_s=(s.backward_s - reruns[index]) / 2,
                activation_bytes=kept,
                # held to the weight gradient beside them: the rerun's tensors, the outputs' gradients it reads
                weight_grad_bytes=kept + int(rematerialised[index] + s.deferred_grad_bytes)
                if awaiting
                else None,
                send_bytes=costs.send_bytes,
                grad_bytes=int(s.grad_bytes),
                backward_transient_bytes=_backward_transient(costs, num_stages, index)
                + _received_gradient_bytes(costs, owner, index),
                unsharded_at_s=unsharded_at[index],
                last_backward_extra_s=s.sync_s,
                sync_transient_bytes=_sync_transient(costs, counts, index, stage, owner),
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
    # the two highest moments: the schedule's (activations and gradients beside the state) and the optimizer step's
    peaks = [
        max(rank_state[r], rank_held[r] + simulation.peak_activation_bytes[r] + rank_transient[r])
        for r in range(pp)
    ]
    stage_peaks = [
        max(
            s.state_bytes,
            s.held_bytes + s.grad_bytes + transients[i] + _backward_transient(costs, num_stages, i)
            + _received_gradient_bytes(costs, owner, i)
            + _rematerialised_held(awaiting, i) * (rematerialised[i] + s.deferred_grad_bytes)
            + in_flight[i] * (
                s.activation_bytes + _kept_output_bytes(costs, num_stages, i)
                + _received_activation_bytes(costs, owner, i)
            ),
        )
        for i, s in enumerate(stages)
    ]  # fmt: skip
    return PipelineCandidate(
        pp, stage, schedule, virtual, micro_batches, list(counts), [options[lv] for lv in levels], simulation,
        rank_state, rank_held, peaks, [s.forward_s + s.backward_s for s in stages], stage_peaks, costs,
    )  # fmt: skip


def _sync_transient(
    costs: ModelCosts, counts: list[int], index: int, stage: StageLayout, owner: list[int]
) -> int:
    """What stage ``index``'s gradient synchronisation allocates on top as its last backward ends: under FSDP /
    HSDP the reduce-scatter of a unit's gradients from a copy of them, with its shard (the largest unit: a
    block, or what the stage holds besides its blocks); nothing under DDP (the runtime all-reduces in place)."""
    if stage.dp_mode not in SHARDED_DP_MODES or stage.dp < 2:
        return 0
    start = sum(counts[:index])
    units = [b.grad_bytes for b in costs.blocks[start : start + counts[index]]]
    units.append(_stage_extras(costs, len(counts), index, owner).grad_bytes)
    return int(max(units) * (1 + 1 / stage.shard))


def _unsharded_at(stages: list[UnitCost], owner: list[int]) -> list[float]:
    """Per stage, when its parameters are gathered: the runtime issues each rank's stages' all-gathers as the
    step starts, in stage order, one after another on its data-parallel link (0 without FSDP)."""
    out, issued = [], [0.0] * (max(owner, default=0) + 1)
    for stage, rank in zip(stages, owner, strict=True):
        issued[rank] += stage.gather_s
        out.append(issued[rank] if stage.gather_s > 0 else 0.0)
    return out


def block_reruns(costs: ModelCosts, levels: list[int]) -> list[float]:
    """Per block, the seconds its recompute reruns in one backward pass (its option against no recompute)."""
    options = costs.block_options()
    return [
        _block_seconds(costs.options[options[level]][b]) - _block_seconds(costs.blocks[b])
        for b, level in enumerate(levels)
    ]


def _stage_reruns(costs: ModelCosts, counts: list[int], levels: list[int]) -> list[float]:
    """Per stage, the seconds its blocks' recompute reruns in one backward."""
    return _per_stage(block_reruns(costs, levels), counts)


def _stage_rematerialised(costs: ModelCosts, counts: list[int], levels: list[int]) -> list[float]:
    """Per stage, the activation bytes its blocks' recompute rematerialises in one backward (each block's
    option against none)."""
    return _per_stage(block_rematerialised(costs, levels), counts)


def block_rematerialised(costs: ModelCosts, levels: list[int]) -> list[float]:
    """Per block, the bytes its recompute rematerialises in one backward pass: what its forward would keep alone
    without recompute (the weight casts included, which a rerun makes anew) against its option's."""
    options = costs.block_options()
    return [
        costs.blocks[b].kept_alone - costs.options[options[level]][b].kept_alone
        for b, level in enumerate(levels)
    ]


def _per_stage(per_block: list[float], counts: list[int]) -> list[float]:
    """``per_block`` summed over each stage's blocks (``counts[s]`` of them, in order)."""
    out, start = [], 0
    for count in counts:
        out.append(sum(per_block[start : start + count]))
        start += count
    return out


def _stages(
    costs: ModelCosts, counts: list[int], levels: list[int], owner: list[int] | None = None
) -> tuple[list[UnitCost], list[float]]:
    """Each stage's cost (its blocks, ``counts[s]`` of them in order, each under its recompute option, and what it
    runs besides; with the stages' ranks ``owner``, the tied head's copy, :func:`_stage_extras`), and the
    activations its largest recomputed block rematerialises during its backward."""
    options = costs.block_options()
    rematerialised = block_rematerialised(costs, levels)
    stages: list[UnitCost] = []
    transients: list[float] = []
    start = 0
    for index, count in enumerate(counts):
        stage = _stage_extras(costs, len(counts), index, owner)
        for b in range(start, start + count):
            stage.add(costs.options[options[levels[b]]][b])
        stages.append(stage)
        transients.append(max([0.0, *rematerialised[start : start + count]]))
        start += count
    return stages, transients
