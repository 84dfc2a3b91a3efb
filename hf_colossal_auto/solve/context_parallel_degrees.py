"""The walk over context-parallel degrees (issue 28): which cp degrees are tried, in which order, what each one's
search must beat, and the plan returned (:func:`with_context_parallel`).

Each degree ``c`` is planned by its own :class:`~.context_parallel_search.ContextParallelPlanner` (the batch
chunked over cp, its own traces) and the ordinary mesh search (``search_meshes``). Degrees are walked in
increasing ``c``, and each degree's search is given the fastest step found so far — the plan without cp, or a
smaller degree's — as a step to beat (:attr:`~.search._Search.cutoff_s`): a candidate (mesh, mode, micro-batch
count) whose lower bound is no faster is pruned before its ILP is built, exactly as the flat search prunes
against its own best so far. The bounds are the flat search's: the data-parallel synchronisation floor and the
relaxation without memory or DTensor's rules (:meth:`~.search._Search.bounded_out`), the unconstrained optimum
of a one-piece candidate before its micro-batch search and a plan's time without recompute for more
micro-batches (:meth:`~.search._Search.try_micro_batches`). The floors that need only the parameters (state,
accumulated gradients, synchronisation) are read off a step already traced for another degree or without cp
(:meth:`~.context_parallel_search.ContextParallelPlanner.any_graph`): a degree whose candidates those floors rule
out costs no trace.

Why this chooses what the exhaustive walk chooses (``exhaustive=True``, every degree searched without a step to
beat, as before): a pruned candidate's step is no faster than the step to beat, which is the fastest plan found
earlier in the walk; the exhaustive walk takes the first of equally fast plans (the plan without cp first, then
smaller degrees), so a candidate no faster than an earlier plan is never what it returns. Which candidates are
pruned changes only what is recorded of the degrees not chosen (:func:`_figures`: a degree whose every candidate
was pruned records the least bound instead of a plan). Tested against the exhaustive walk in
``tests/test_context_parallel_degrees.py``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

from ..plan import Plan
from ..units import format_bytes
from .candidates import _Planner
from .context_parallel_search import (
    CP_MODES,
    ContextParallelPlanner,
    ContextParallelUnsupported,
    sequence_length,
)
from .problem import InfeasibleError
from .search import _Search

logger = logging.getLogger(__name__)


def context_parallel_degrees(planner: _Planner, context_parallel: int | None) -> list[int]:
    """The cp degrees to try: ``context_parallel`` itself (checked: it divides the devices, and twice it the
    sequence, the balanced layout's head and tail chunk per rank), or (None) every one from 2 that does."""
    n = planner.cluster.num_devices
    seq = sequence_length(planner.inputs)
    if context_parallel is not None:
        c = context_parallel
        if n % c:
            raise ValueError(
                f"context_parallel={c} does not divide the {n} devices; use a cp degree that divides them"
            )
        if seq % (2 * c):
            raise ValueError(
                f"context_parallel={c}: the sequence of {seq} tokens does not split into {2 * c} equal chunks "
                f"(a head and a tail chunk per cp rank, for balanced causal attention); use a sequence length "
                f"divisible by {2 * c} or another cp degree"
            )
        return [c]
    return [c for c in range(2, n + 1) if n % c == 0 and seq % (2 * c) == 0]


SearchMeshes = Callable[[_Planner, tuple[int, ...] | None, tuple[str, ...], float], _Search]
"""The planner's search without pipeline stages (meshes, modes, micro-batches, recompute), run: given the
planner, the (dp, tp) mesh_shape to fix (None: searched), the data-parallel modes and a step to beat
(:attr:`~.search._Search.cutoff_s`); its ``best`` is the fastest plan that fits (None: none fits, or none beats the
step, :attr:`~.search._Search.pruned_s`). Raises :class:`InfeasibleError` where nothing fits and nothing was
pruned."""


def with_context_parallel(
    planner: _Planner,
    best: Plan | None,
    context_parallel: int | None,
    mesh_shape: tuple[int, ...] | None,
    dp_modes: tuple[str, ...],
    search_meshes: SearchMeshes,
    exhaustive: bool = False,
) -> Plan | None:
    """The plan :func:`~.planner.plan_model` returns once cp degrees are searched: ``best`` (the fastest plan
    without cp, None if none fits or it was not searched) against the fastest plan of each cp degree, by
    predicted step time (the first of equally fast ones: ``best``, then smaller degrees). ``context_parallel``
    None searches every degree (a model or batch cp cannot price is logged and left out), an int >= 2 fixes it
    (errors say why it cannot be planned). ``mesh_shape`` fixes the ``(dp, tp)`` part. ``exhaustive``: every
    degree searched in full, with no step to beat (what the pruned walk is tested against)."""
    fixed = context_parallel is not None
    try:
        degrees = context_parallel_degrees(planner, context_parallel)
    except ContextParallelUnsupported as exc:
        if fixed:
            raise ValueError(f"context_parallel={context_parallel}: {exc}") from exc
        logger.info("context parallelism not searched: %s", exc)
        return best
    modes = tuple(m for m in dp_modes if m in CP_MODES)
    if not modes:
        if fixed:
            raise ValueError(
                f"context_parallel={context_parallel} is planned with {CP_MODES} over the dp x cp gradient group; "
                f"dp_modes={dp_modes!r} has neither"
            )
        logger.info("context parallelism not searched: dp_modes %s has none of %s", dp_modes, CP_MODES)
        return best
    found: list[Plan] = []
    least = math.inf
    per_degree: dict[str, dict[str, Any]] = {}
    """cp degree -> its fastest plan's figures, or the least memory any of its plans needs, or the least step
    any of its pruned candidates could take."""
    for c in degrees:
        inner_mesh = None if mesh_shape is None else _inner_mesh(mesh_shape, c, planner.cluster.num_devices)
        cutoff = math.inf if exhaustive else _step_to_beat(best, found)
        try:
            cp_planner = ContextParallelPlanner(planner, c)
            search = search_meshes(cp_planner, inner_mesh, modes, cutoff)
        except ContextParallelUnsupported as exc:
            if fixed:
                raise ValueError(f"context_parallel={c}: {exc}") from exc
            logger.info("context parallelism not searched: %s", exc)
            return best
        except InfeasibleError as exc:
            least = min(least, exc.min_required or math.inf)
            per_degree[str(c)] = {"fits": False, "min_required_bytes": exc.min_required}
            logger.info("context_parallel=%d: no plan fits (%s)", c, exc)
            continue
        plan = search.best
        if plan is not None:
            found.append(plan)
            per_degree[str(c)] = _figures(plan)
            logger.info("context_parallel=%d: best %.4g s on mesh %s", c, plan.step_time_s, plan.mesh_shape)
        else:
            per_degree[str(c)] = _pruned_figures(search)
            logger.info(
                "context_parallel=%d: no plan faster than %.4g s (each at least %.4g s, or not fitting)",
                c,
                cutoff,
                search.pruned_s,
            )
    if fixed and not found:
        raise InfeasibleError(
            f"No plan with context_parallel={context_parallel} for {type(planner.model).__name__} on "
            f"{planner.cluster.num_devices} x {planner.spec.name} fits {format_bytes(planner.budget)} per device"
            + (f": the least any needs is {format_bytes(least)}" if least < math.inf else "")
            + ". Use a larger cp degree, more devices, or context_parallel=None.",
            min_required=least if least < math.inf else None,
            exact=False,
            choice=None,
        )
    chosen = min(found, key=lambda p: p.step_time_s, default=None)
    if chosen is None or (best is not None and best.step_time_s <= chosen.step_time_s):
        if best is not None:
            best.solver["context_parallel_degrees"] = per_degree
        return best
    if best is not None:
        chosen.solver["best_without_cp_s"] = best.step_time_s
    chosen.solver["context_parallel_degrees"] = per_degree
    return chosen


def _step_to_beat(best: Plan | None, found: list[Plan]) -> float:
    """What a later degree's plan must beat to be returned: the fastest plan so far, without cp (``best``) or of
    a smaller degree (``found``); equally fast, the earlier one is returned. ``inf`` while there is none."""
    return min((p.step_time_s for p in (best, *found) if p is not None), default=math.inf)


def _figures(plan: Plan) -> dict[str, Any]:
    """What :attr:`Plan.solver` records of each cp degree's fastest plan."""
    return {
        "fits": True,
        "step_time_s": plan.step_time_s,
        "peak_memory_bytes": plan.peak_memory_bytes,
        "mesh": list(plan.mesh_shape),
        "dp_mode": plan.dp_mode,
        "micro_batches": plan.micro_batches,
        "recompute": sorted(set(plan.recompute.values())) or ["none"],
    }


def _pruned_figures(search: _Search) -> dict[str, Any]:
    """What :attr:`Plan.solver` records of a cp degree none of whose plans can beat the step it was given: not
    known to fit or not (``fits`` None), no plan faster than ``min_step_time_s`` (the least bound of its pruned
    candidates), and the least memory of those that were solved and did not fit, if any."""
    out: dict[str, Any] = {"fits": None, "min_step_time_s": search.pruned_s}
    if search.min_required < math.inf:
        out["min_required_bytes"] = search.min_required
    return out


def _inner_mesh(mesh_shape: tuple[int, ...], cp: int, n: int) -> tuple[int, int]:
    """A fixed ``(dp, tp)`` (or ``(tp,)``) mesh as the chunked problem's ``(dp x cp, tp)``."""
    shape = (1, *mesh_shape) if len(mesh_shape) == 1 else tuple(mesh_shape)
    if len(shape) != 2 or shape[0] * shape[1] * cp != n:
        raise ValueError(
            f"mesh_shape {tuple(mesh_shape)} with context_parallel={cp}: give the (dp, tp) part, dp x cp x tp = "
            f"{n} devices"
        )
    return (shape[0] * cp, shape[1])
