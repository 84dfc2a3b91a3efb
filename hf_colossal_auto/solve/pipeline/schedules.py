"""The schedule and the micro-batch count: every offered schedule (GPipe, 1F1B; interleaved 1F1B and interleaved
zero bubble with two or four stages per rank, ZB-V with two) and the micro-batch counts with the fewest rows per
micro-batch (one or two sequences; :data:`MAX_ROW_OPTIONS`), each simulated on its action list
(:func:`~..pricing.pipeline_schedule.simulate_schedule`): point-to-point sends on the link the pp axis crosses,
the stage's gradient synchronisation after its last backward, the optimizer step after everything.
"""

from __future__ import annotations

import functools

from ...plan import PIPELINE_SCHEDULES, PipelinePlanError
from ..pricing.pipeline_schedule import _cached_actions

OFFERED_SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "interleaved-zero-bubble", "zbv")
"""Schedules the search offers: every one the runtime runs and its tests cover."""

MAX_ROW_OPTIONS = 2
"""Rows per micro-batch tried per stage layout (the fewest first: 1, then 2, ...): more micro-batches shrink the
bubble, and under 1F1B and the interleaved schedules the activations held do not grow with them; each row count
costs an ILP per layout."""

EFFICIENT_MICRO_BATCH_TOKENS = 4096
"""Tokens of a micro-batch past which more rows per micro-batch are not tried: the matmuls of a micro-batch that
size run near their peak (more rows would only grow the bubble), and every row count costs an ILP per layout."""


INTERLEAVED_VIRTUAL_STAGES = (2, 4)
"""Stages per rank offered to the schedules that take any number (the interleaved ones): each doubling halves
their bubble (``(pp - 1) / (virtual x micro_batches)`` of a step) for more micro-batches held in warm-up and
twice the sends. Measured with ``scripts/bench_planner.py --scale``: 4 a rank is chosen at Llama-3-70B / 1024 and
405B / 8192; 3, 5, 6 or 8 were never chosen there (126 or 80 blocks cut into stages of unequal depth) and each
one offered adds seconds of search."""


def _schedules_for(num_blocks: int, pp: int, schedules: tuple[str, ...]) -> list[tuple[str, int]]:
    """(schedule, stages per rank) offered for ``pp`` ranks: one stage a rank for GPipe and 1F1B, two for ZB-V,
    :data:`INTERLEAVED_VIRTUAL_STAGES` for the interleaved schedules, where the blocks give every stage at least
    one."""
    out = []
    for schedule in schedules:
        least, most = PIPELINE_SCHEDULES[schedule]
        offered = (least,) if least == most else tuple(v for v in INTERLEAVED_VIRTUAL_STAGES if v >= least)
        out += [(schedule, v) for v in offered if pp * v <= num_blocks]
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
    from ...plan import _check_pipeline_micro_batches

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
    return _most_at_once(schedule, pp, micro_batches, virtual, "F", ("B", "W"))


@functools.lru_cache(maxsize=512)
def _awaiting_weight(schedule: str, pp: int, micro_batches: int, virtual: int) -> tuple[int, ...]:
    """Per stage, the most micro-batches between their input and weight gradients at once along the schedule's
    action list (all 0 under a schedule with whole backwards). A recomputed block's one rerun, in the input pass,
    serves the weight pass (``apply/shared_rerun``): its rematerialised tensors are held that long."""
    return _most_at_once(schedule, pp, micro_batches, virtual, "I", ("W",))


def _most_at_once(
    schedule: str, pp: int, micro_batches: int, virtual: int, opens: str, closes: tuple[str, ...]
) -> tuple[int, ...]:
    """Per stage, the most micro-batches at once between an action of kind ``opens`` and one of ``closes``, along
    each rank's action list."""
    most = [0] * (pp * virtual)
    for rank in _cached_actions(schedule, pp, micro_batches, virtual):
        count = [0] * (pp * virtual)
        for kind, s, _ in rank:
            if kind == opens:
                count[s] += 1
                most[s] = max(most[s], count[s])
            elif kind in closes:
                count[s] -= 1
    return tuple(most)
