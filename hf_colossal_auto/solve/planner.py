"""``plan_model`` and ``evaluate_plan``: search meshes and data-parallel modes, solve, and write the Plan.

For N devices every mesh ``(dp, tp)`` with ``dp * tp = N`` is tried (the 1-D meshes are ``(N, 1)`` and
``(1, N)``), each with DDP and, when ``dp > 1``, FSDP on the data-parallel axis; the fastest plan that fits
the memory budget wins. Where the data-parallel axis crosses nodes, HSDP is tried too: FSDP inside shard groups of
one node's data-parallel ranks, the shards all-reduced across nodes
(:meth:`~hf_colossal_auto.hardware.ClusterSpec.hybrid_shard_size`). The data-parallel axis is the outer mesh axis, so with several nodes it is the one
that crosses nodes (:class:`hf_colossal_auto.hardware.ClusterSpec` prices it on the inter-node link).

Baselines are the same ILP with parameter placements pinned, priced by the same cost model:

* ``"ddp"``: mesh ``(N, 1)``, DDP;  ``"fsdp"``: mesh ``(N, 1)``, FSDP;
* ``"megatron"``: mesh ``(N / t, t)`` with ``t`` the largest tensor-parallel size up to the devices of one
  node that divides the heads, attention and MLP column-then-row (as Megatron-LM and HF's
  ``base_model_tp_plan``s do; GPT-2's fused ``c_attn`` Conv1D packed the same way), embeddings and head
  replicated;
* ``"megatron-sp"``: ``"megatron"`` with Megatron-LM's sequence parallelism on every block (what Megatron-LM's
  ``--sequence-parallel`` and torchtitan's TP plan run): the ops between a block's tensor-parallel regions (norms,
  residual adds, dropouts after the row-parallel projections) sharded on the sequence dim, row-parallel outputs
  reduce-scattered onto it and all-gathered before the column-parallel inputs
  (:mod:`~hf_colossal_auto.solve.sequence_parallel`); it needs a tensor-parallel axis > 1;
* ``"megatron-local"``: ``"megatron"`` with every attention / MLP module that can run on local tensor shards so
  run (as Megatron-LM, torchtitan and HF run the ops between a column- and a row-parallel projection: on local
  tensors, DTensor only at the module's borders; :mod:`~hf_colossal_auto.solve.local_tensor_parallel`), its
  ops priced as eager ops; it needs a tensor-parallel axis > 1 and a module that qualifies;
* ``"megatron-sp-local"``: both — sequence parallelism between the regions, attention and MLP on local shards:
  the tensor parallelism torchtitan's TP plan runs (``ColwiseParallel`` / ``RowwiseParallel`` with
  ``SequenceParallel`` norms) and Megatron-LM with ``--sequence-parallel``;
* a HF-style tp_plan dict (``{"layers.*.mlp.up_proj": "colwise", ...}``) on the tensor-parallel size you
  give with ``mesh_shape``.
"""

from __future__ import annotations

import functools
import logging
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from ..capture.moe import RoutingLoad
from ..hardware import ClusterSpec, DeviceSpec
from ..plan import Plan
from ..units import format_bytes
from .baselines import (
    _attention_heads,
    _largest_tp,
    megatron_placements,
    tp_plan_placements,
)
from .build.builder import BuiltProblem
from .candidates import (  # noqa: F401 (RECOMPUTE_MODES, PlanningTimeoutError re-exported)
    LIFTED_BUDGET,
    RECOMPUTE_MODES,
    PlanningTimeoutError,
    _plan_param_uses,
    _Planner,
    _routing,
)
from .context_parallel_degrees import with_context_parallel
from .context_parallel_search import ContextParallelPlanner
from .ilp import solve
from .local_tensor_parallel import LocalLayout
from .pipeline.costs import STAGE_DP_MODES, StageLayout
from .pipeline.plan import pipeline_configuration, price_pipeline, with_pipelines
from .pricing.comm import DP_MODES
from .problem import InfeasibleError, Solution
from .recompute import parse_option
from .search import (  # noqa: F401 (EXPERT_DP_KEY and EXPERT_FSDP_KEY re-exported: public names of the planner)
    _EXPERT_KEY_OF_MODE,
    EXPERT_DP_KEY,
    EXPERT_DP_KEYS,
    EXPERT_FSDP_KEY,
    SearchKey,
    _expert_dp_offered,
    _hsdp_candidates,
    _meshes,
    _micro_batch_clause,
    _Search,
    _search_order,
)
from .sequence_parallel import LOCAL_LAYOUTS, SEQUENCE_PARALLEL_LAYOUTS, hand_layout_pins
from .tied import TiedGraph

logger = logging.getLogger(__name__)


BASELINES = ("ddp", "fsdp", "megatron", "megatron-sp", "megatron-local", "megatron-sp-local")
"""The named hand configurations :func:`evaluate_plan` prices (see the module docstring)."""

MEGATRON_LAYOUTS = ("megatron", "megatron-sp", "megatron-local", "megatron-sp-local")
"""The baselines that place parameters as Megatron-LM does (on a tensor-parallel axis)."""


@dataclass
class Estimate:
    """The predicted cost of a plan or baseline under our cost model."""

    name: str
    step_time_s: float
    peak_memory_bytes: int
    memory_budget_bytes: int
    mesh_shape: tuple[int, ...]
    dp_mode: str
    plan: Plan | None = None

    @property
    def fits(self) -> bool:
        return self.peak_memory_bytes <= self.memory_budget_bytes


def _without_sharding_of_scalars(model: nn.Module, dp_modes: tuple[str, ...]) -> tuple[str, ...]:
    """FSDP2's ``fully_shard`` refuses 0-dim parameters (a learnable scale, say): with one, the data-parallel
    modes that shard parameters over the replicas are not offered (a warning names it); asking for those
    alone is an error that says so."""
    scalars = [n for n, p in model.named_parameters() if p.dim() == 0]
    if not scalars:
        return dp_modes
    sharded = {"fsdp", "hsdp", EXPERT_FSDP_KEY}
    kept = tuple(m for m in dp_modes if m not in sharded)
    if not kept:
        raise ValueError(
            f"{type(model).__name__} has 0-dim parameters ({', '.join(scalars[:3])}), which FSDP cannot shard, "
            f"and dp_modes={dp_modes!r} are all sharded modes: allow 'ddp', or make them 1-element tensors"
        )
    if kept != dp_modes:
        logger.warning(
            "%s has 0-dim parameters (%s), which FSDP cannot shard: data-parallel modes %s are not tried",
            type(model).__name__,
            ", ".join(scalars[:3]),
            sorted(set(dp_modes) - set(kept)),
        )
    return kept


def plan_model(
    model: nn.Module,
    example_inputs: Mapping[str, Any],
    *,
    num_devices: int,
    device: str | DeviceSpec = "a100-80gb",
    memory_budget: int | str | None = None,
    mesh_shape: tuple[int, ...] | None = None,
    devices_per_node: int | None = None,
    mixed_precision: str | None = None,
    optimizer: str | None = "adamw",
    time_limit_s: float = 60.0,
    dp_modes: tuple[str, ...] = DP_MODES,
    recompute: str = "auto",
    micro_batches: int | None = None,
    routing: RoutingLoad | str | Path | None = None,
    pipeline: int | None = 1,
    context_parallel: int | None = 1,
) -> Plan:
    """Plan data + tensor parallelism for ``model`` on ``num_devices`` devices of kind ``device``.

    Runs on a meta/fake model with no processes. ``example_inputs`` is one *global* batch (what one optimizer
    step consumes across all data-parallel ranks). ``memory_budget`` is per device, in bytes or a string like
    ``"40GiB"``; None means the device's memory minus the margin of
    :func:`hf_colossal_auto.hardware.memory_budget_default`. ``dp_modes`` are the data-parallel modes tried on
    meshes with a data-parallel axis ("ddp", "fsdp", "hsdp"; HSDP only where that axis crosses nodes). With
    "ddp", MoE models also try DDP with every layer's experts sharded over the data-parallel axis (on (dp, 1)
    meshes whose dp divides every layer's experts: :mod:`hf_colossal_auto.apply.moe`), which ``"ddp-ep"`` alone
    asks for by name; with "fsdp", FSDP with the experts so sharded and left out of FSDP (``"fsdp-ep"``).
    ``recompute``: "auto" chooses activation recompute per
    block jointly with the sharding (one ILP); "none" and "full" fix it for every block; "two-stage" shards
    first and then chooses recompute (a baseline). ``micro_batches``: None searches it — each replica's batch
    (global / dp) runs in k pieces with gradients accumulated and synchronised once, tried where the batch in
    one piece does not fit or needs recompute; an int fixes k for every mesh (1: never split).
    ``routing`` (MoE models): a measured routing histogram (:class:`~hf_colossal_auto.capture.moe.RoutingLoad`,
    e.g. from :func:`~hf_colossal_auto.capture.moe.measure_routing` on one real batch, or the path of its JSON,
    or ``"measure"``: counted on ``example_inputs`` by one forward of ``model``, which then needs real weights
    and a real batch); expert parallelism is then priced by each layer's busiest rank. None assumes routing
    uniform over experts.
    ``pipeline``: pipeline stages (with tensor parallelism, DDP/FSDP/HSDP and recompute inside a stage:
    :mod:`.pipeline`). 1 (the
    default for now) plans without them; None also searches every pp degree and returns the faster of the best
    plans with and without stages; an int >= 2 fixes the pp degree (only pipeline plans). ``micro_batches``
    >= 2 is then also the schedule's count; 1 (the batch in one forward, as the plain loop feeds it) leaves
    the schedule's count to the search, since a pipelined forward splits its batch itself.
    ``context_parallel``: context parallelism (each sequence's tokens split over a "cp" mesh axis, K/V
    all-gathered per attention layer: :mod:`.context_parallel_search`). 1 (the default for now) plans without
    it; None also searches every cp degree that divides the devices and the sequence (in ``2 x cp`` chunks) and
    returns the fastest plan (not with ``mesh_shape``, which fixes the mesh); an int >= 2 fixes the degree (only
    plans with it; ``mesh_shape`` is then the ``(dp, tp)`` part). Not combined with fixed pipeline stages.
    """
    _check_pipeline_argument(pipeline, mesh_shape, dp_modes)
    _check_context_parallel_argument(context_parallel, pipeline)
    unknown = sorted(set(dp_modes) - {*DP_MODES, *EXPERT_DP_KEYS})
    if unknown or not dp_modes:
        raise ValueError(
            f"dp_modes must be a non-empty subset of {(*DP_MODES, *EXPERT_DP_KEYS)}, got {dp_modes!r}"
        )
    if num_devices < 1:
        raise ValueError(f"num_devices must be >= 1, got {num_devices}")
    dp_modes = _without_sharding_of_scalars(model, tuple(dp_modes))
    if micro_batches is not None and micro_batches < 1:
        raise ValueError(f"micro_batches must be None (searched) or >= 1, got {micro_batches}")
    planner = _Planner.for_devices(
        model,
        example_inputs,
        num_devices,
        device,
        devices_per_node,
        memory_budget,
        mixed_precision,
        optimizer,
        time_limit_s,
        recompute,
    )
    planner.routing = _routing(model, routing, example_inputs)
    t0 = time.perf_counter()
    search = _Search(planner)
    if (pipeline is None or pipeline == 1) and context_parallel in (None, 1):
        _search(search, mesh_shape, dp_modes, micro_batches)
    plan = search.best
    if context_parallel is None and mesh_shape is not None:
        logger.info("context parallelism not searched: mesh_shape %s fixes the mesh", mesh_shape)
    elif context_parallel != 1:

        def search_meshes(
            cp_planner: _Planner, inner_mesh: tuple[int, ...] | None, modes: tuple[str, ...], cutoff_s: float
        ) -> _Search:
            cp_search = _Search(cp_planner, cutoff_s)
            _search(cp_search, inner_mesh, modes, micro_batches)
            if cp_search.best is None and cp_search.pruned_s == math.inf:
                raise _no_plan_error(model, num_devices, cp_planner, cp_search, recompute, micro_batches)
            return cp_search

        plan = with_context_parallel(planner, plan, context_parallel, mesh_shape, dp_modes, search_meshes)
    stage_modes = tuple(m for m in STAGE_DP_MODES if m in dp_modes)
    if pipeline != 1 and not (pipeline is None and (mesh_shape is not None or not stage_modes)):
        # a pipelined forward runs its schedule's micro-batches itself: "one piece" fixes no schedule count
        schedule_count = None if micro_batches == 1 else micro_batches
        plan = with_pipelines(planner, plan, pipeline, schedule_count, stage_modes)
    if plan is None:
        raise _no_plan_error(model, num_devices, planner, search, recompute, micro_batches)
    _warn_if_tensor_parallel_repeats(model, plan)
    plan.solver["total_planning_s"] = time.perf_counter() - t0
    plan.solver["steps_traced"] = planner._graphs.traced
    plan.solver["batch_sizes"] = planner._graphs.sizes
    return plan


def _search(
    search: _Search, mesh_shape: tuple[int, ...] | None, dp_modes: tuple[str, ...], micro_batches: int | None
) -> None:
    """The search without pipeline stages: every mesh and mode, then micro-batches and the candidates set aside
    (``search.best``: the fastest that fits, its ``alternatives`` everything tried)."""
    _try_meshes(search, search.planner.model, mesh_shape, dp_modes, micro_batches)
    if micro_batches is None:
        search.try_micro_batches()
    if search.best is None:
        search.run_deferred(search_micro_batches=micro_batches is None)
    if search.best is not None:
        search.best.alternatives = search.tried


def _check_context_parallel_argument(context_parallel: int | None, pipeline: int | None) -> None:
    """``context_parallel`` is None, 1 or a cp degree >= 2, and not fixed beside fixed pipeline stages (the
    runtime does not run pp x cp; both None searches each alone)."""
    cp = context_parallel
    if cp is not None and (not isinstance(cp, int) or isinstance(cp, bool) or cp < 1):
        raise ValueError(
            f"context_parallel must be None (searched), 1 (none) or a cp degree >= 2, got {context_parallel!r}"
        )
    fixed_cp, fixed_pp = cp not in (None, 1), pipeline not in (None, 1)
    if (fixed_cp and pipeline != 1) or (fixed_pp and cp != 1):
        raise ValueError(
            f"context_parallel={cp!r} with pipeline={pipeline!r}: pipeline stages and context parallelism are not "
            "planned together; set the other to 1"
        )


def _try_meshes(
    search: _Search,
    model: nn.Module,
    mesh_shape: tuple[int, ...] | None,
    dp_modes: tuple[str, ...],
    micro_batches: int | None,
) -> None:
    """Every mesh in search order, with each data-parallel mode it offers (and HSDP shard group, experts over
    dp): ruled out or bounded out by floors that need no ILP, else tried (``search.best`` keeps the fastest)."""
    planner = search.planner
    for mesh in _search_order(planner, _meshes(planner, mesh_shape, micro_batches or 1)):
        for dp_mode in dp_modes if mesh[0] > 1 else ("ddp",):
            named = SearchKey.named(dp_mode)
            if named.experts_over_dp:  # asked for by name: only where it is offered
                shard = mesh[0] if named.mode == "fsdp" else 1
                candidates = [(named, shard)] if _expert_dp_offered(model, mesh) else []
            elif dp_mode == "hsdp":
                # none where the data-parallel axis stays in a node (FSDP is as good) or nodes do not split it
                candidates = _hsdp_candidates(planner.cluster, mesh)[::-1]  # largest first: prunes the rest
            else:
                candidates = [(named, mesh[0] if dp_mode == "fsdp" else 1)]  # ranks sharing the state with tp
                expert_key = _EXPERT_KEY_OF_MODE.get(dp_mode)
                if expert_key and expert_key not in dp_modes and _expert_dp_offered(model, mesh):
                    # the experts sharded over the replicas
                    candidates.append((SearchKey(dp_mode, experts_over_dp=True), candidates[0][1]))
            for key, shard in candidates:
                if search.ruled_out(mesh, key, shard, micro_batches or 1):
                    continue
                if search.bounded_out(mesh, key, micro_batches or 1):
                    continue
                search.try_candidate(mesh, key, micro_batches or 1)


def _check_pipeline_argument(
    pipeline: int | None, mesh_shape: tuple[int, ...] | None, dp_modes: tuple[str, ...]
) -> None:
    """``pipeline`` is None, 1 or a pp degree >= 2, and does not contradict the other settings: pipeline
    stages run DDP, FSDP or HSDP inside a stage (one of them among ``dp_modes``) on a mesh the search lays out
    (no ``mesh_shape``)."""
    if pipeline is not None and (not isinstance(pipeline, int) or isinstance(pipeline, bool) or pipeline < 1):
        raise ValueError(
            f"pipeline must be None (searched), 1 (no stages) or a pp degree >= 2, got {pipeline!r}"
        )
    if pipeline is not None and pipeline > 1:
        if mesh_shape is not None:
            raise ValueError(
                f"pipeline={pipeline} lays out the mesh (pp, dp, tp) itself; drop mesh_shape={mesh_shape!r}"
            )
        if not set(dp_modes) & set(STAGE_DP_MODES):
            raise ValueError(
                f"pipeline={pipeline}: a stage runs {', '.join(STAGE_DP_MODES)} over its data-parallel ranks; "
                f"dp_modes={dp_modes!r} has none of them. Add one, or plan with pipeline=1."
            )


def _no_plan_error(
    model: nn.Module,
    num_devices: int,
    planner: _Planner,
    search: _Search,
    recompute: str,
    micro_batches: int | None,
) -> InfeasibleError:
    """What no candidate fitting says: the least per-device memory any plan needs, with the recompute and
    micro-batches it was tried with, and the ways out."""
    spec, budget = planner.spec, planner.budget
    tried_k = sorted({t["micro_batches"] for t in search.tried})
    return InfeasibleError(
        f"No plan for {type(model).__name__} on {num_devices} x {spec.name} fits {format_bytes(budget)} per "
        f"device: the smallest per-device memory any plan needs is {format_bytes(search.min_required)}"
        + (
            " (with full activation recompute where it helps"
            if recompute != "none"
            else f" without activation recompute (recompute={recompute!r}"
        )
        + _micro_batch_clause(micro_batches, tried_k)
        + ". Use more devices, a smaller batch or sequence, or a larger budget.",
        min_required=search.min_required,
        exact=False,
        choice=None,
    )


def _warn_if_tensor_parallel_repeats(model: nn.Module, plan: Plan) -> None:
    """A plan on a tensor-parallel axis that shards no parameter repeats the same work on its devices: say so,
    with the model's attention heads (what a tensor-parallel size should divide). The tp axis is read by name:
    a pipeline plan's placements lead with the pp axis."""
    tp = plan.mesh_axis_names.index("tp") if "tp" in plan.mesh_axis_names else -1
    if plan.tp_size > 1 and all(p[tp] == "R" for p in plan.param_placements.values()):
        heads = _attention_heads(model)
        logger.warning(
            "%s on mesh %s: no parameter is sharded over the tensor-parallel axis of %d%s; its devices repeat the "
            "same work. A mesh whose tensor-parallel size divides the model's dimensions plans better.",
            type(model).__name__,
            tuple(plan.mesh_shape),
            plan.tp_size,
            f" (the model has {heads} attention heads)" if heads else "",
        )


def evaluate_plan(
    model: nn.Module,
    example_inputs: Mapping[str, Any],
    plan_or_baseline: Plan | str | Mapping[str, str],
    *,
    num_devices: int,
    device: str | DeviceSpec = "a100-80gb",
    memory_budget: int | str | None = None,
    mesh_shape: tuple[int, ...] | None = None,
    devices_per_node: int | None = None,
    mixed_precision: str | None = None,
    optimizer: str | None = "adamw",
    time_limit_s: float = 60.0,
    recompute: str | None = None,
    micro_batches: int | None = None,
    dp_mode: str | None = None,
    dp_shard_size: int | None = None,
    fit_budget: bool = False,
    pin_uses: bool = False,
    routing: RoutingLoad | str | Path | None = None,
    pipeline: int | None = None,
    schedule: str | None = None,
    virtual_stages: int | None = None,
    blocks_per_stage: list[int] | None = None,
) -> Estimate:
    """Price a Plan, a HF-style tp_plan dict or a named baseline (:data:`BASELINES`) under our model.

    ``recompute``: "none", "full" or a selective option ("selective:pointwise": recompute the listed op classes,
    keep the others' outputs) for every block, or "auto" (recompute chosen per block to fit the budget with the
    baseline's placements: the baseline's best case). Default: a Plan's own choice, "none" for the others. A
    Plan is priced under the budget it was made for unless ``memory_budget`` says otherwise, so that pricing a
    solved plan reproduces its own prediction (time and memory). ``micro_batches``: each replica's batch runs in
    that many pieces with one gradient synchronisation (default: a Plan's own, else 1).

    Hand configurations (not for a Plan, which carries its own): ``dp_mode`` runs a "megatron" or "megatron-sp"
    baseline or a
    tp_plan dict's data-parallel axis as "ddp" (the default), "fsdp" or "hsdp" (torchtitan's FSDP x TP and
    HSDP x TP), ``dp_shard_size`` is HSDP's shard group (default: one node's data-parallel ranks). A baseline is
    priced with the budget lifted (its activation placements chosen for time alone); ``fit_budget`` prices it
    under the budget first (activations placed to fit, as a runtime's sharding would be tuned) and lifts the
    budget only where its pinned choices cannot fit.

    ``pin_uses`` (for a Plan): every parameter is read where the plan's runtime hands it over, at its use
    placement (``Plan.param_use_placements``) or else as stored, instead of the solver choosing again where to
    gather or slice it. A plan whose use placements were edited (the MoE runtime tests use split experts as
    stored) is priced as it will run.

    ``routing``: the MoE routing load to price under, as for :func:`plan_model` (default: a Plan's own
    measured histogram, ``Plan.moe_routing``, else uniform).

    Pipeline stages (:func:`~.pipeline.plan.price_pipeline`, the search's own pricing): a Plan with
    ``pp_size > 1`` is re-priced as it is; a baseline or tp_plan with ``pipeline`` (the pp degree >= 2) is a
    hand pipeline: ``mesh_shape`` (dp, tp) inside each stage, ``dp_mode`` / ``dp_shard_size`` as above,
    ``schedule`` (default "1f1b"), ``virtual_stages``, ``blocks_per_stage`` (default even), ``micro_batches``
    (the schedule's; default one row each), ``recompute`` for every block (or "auto").
    E.g. torchtitan's FSDP x TP x PP: ``evaluate_plan(model, batch, "megatron", pipeline=8,
    mesh_shape=(dp, 8), dp_mode="fsdp", schedule="interleaved-1f1b", recompute="full", ...)``.
    """
    if pipeline is not None or (isinstance(plan_or_baseline, Plan) and plan_or_baseline.pp_size > 1):
        return _evaluate_pipeline(
            model, example_inputs, plan_or_baseline, num_devices=num_devices, device=device,
            memory_budget=memory_budget, mesh_shape=mesh_shape, devices_per_node=devices_per_node,
            mixed_precision=mixed_precision, optimizer=optimizer, time_limit_s=time_limit_s, recompute=recompute,
            micro_batches=micro_batches, dp_mode=dp_mode, dp_shard_size=dp_shard_size, pipeline=pipeline,
            schedule=schedule, virtual_stages=virtual_stages, blocks_per_stage=blocks_per_stage,
        )  # fmt: skip
    _check_estimate_arguments(plan_or_baseline, recompute, dp_mode, dp_shard_size, pin_uses)
    hand_dp_mode = dp_mode
    if isinstance(plan_or_baseline, Plan) and memory_budget is None:
        memory_budget = plan_or_baseline.memory_budget_bytes  # the budget the plan was made for
    planner = _Planner.for_devices(
        model,
        example_inputs,
        num_devices,
        device,
        devices_per_node,
        memory_budget,
        mixed_precision,
        optimizer,
        time_limit_s,
    )
    if isinstance(plan_or_baseline, Plan) and plan_or_baseline.cp_size > 1:  # priced as it was planned
        planner = ContextParallelPlanner(planner, plan_or_baseline.cp_size)
    if routing is None and isinstance(plan_or_baseline, Plan) and plan_or_baseline.moe_routing:
        routing = plan_or_baseline.moe_routing
    planner.routing = _routing(model, routing, example_inputs)
    budget = planner.budget
    if micro_batches is None:
        micro_batches = plan_or_baseline.micro_batches if isinstance(plan_or_baseline, Plan) else 1
    k = micro_batches
    name, mesh, dp_mode, fixed, shard = _configuration(
        model, plan_or_baseline, planner, num_devices, mesh_shape, hand_dp_mode, dp_shard_size
    )
    if planner.batch % (mesh[0] * k):
        raise ValueError(
            f"{name}: global batch {planner.batch} does not split over {mesh[0]} data-parallel replicas x {k} "
            "micro-batches"
        )
    # a Plan's experts sharded over the data-parallel axis are priced so (Plan.expert_data_parallel)
    expert_dp = isinstance(plan_or_baseline, Plan) and bool(plan_or_baseline.expert_data_parallel)
    tied = TiedGraph.build(planner.graph(mesh[0], k))
    canonical_fixed = {tied.canonical_param(k): v for k, v in fixed.items()}
    param_uses = _plan_param_uses(model, plan_or_baseline) if pin_uses else None
    pins = None
    layout = plan_or_baseline.hand_layout if isinstance(plan_or_baseline, Plan) else name
    # the ops between tensor-parallel regions pinned to sequence shards
    if layout in SEQUENCE_PARALLEL_LAYOUTS:
        pins = hand_layout_pins(planner, fixed, mesh, k)
    # a Plan whose modules run on local shards is priced so again (its layout is the same at its tp)
    local = layout in LOCAL_LAYOUTS or (
        isinstance(plan_or_baseline, Plan) and bool(plan_or_baseline.local_modules)
    )
    if local:
        _check_local_layout(name, planner.local_layout(mesh[0], mesh[1], k), mesh)
    # Every parameter the baseline does not name stays replicated, as the baseline means; activations are
    # left to the solver (what a runtime's sharding propagation would do best). The budget is lifted so that a
    # baseline that does not fit is still priced, and reported as not fitting.
    if recompute is None:
        recompute = "none" if not isinstance(plan_or_baseline, Plan) else None
    pin: str | dict[str, str] | None = recompute if recompute not in (None, "auto") else None
    if recompute is None:  # a Plan's own per-block choice
        pin = dict(plan_or_baseline.recompute) or "none"
    build = functools.partial(
        planner.build,
        mesh,
        dp_mode,
        canonical_fixed,
        pin_unlisted=True,
        micro_batches=k,
        dp_shard_size=shard,
        param_uses=param_uses,
        expert_dp=expert_dp,
        strategy_pins=pins,
        local=local,
    )
    built, solution = _priced(
        build, recompute, pin, isinstance(plan_or_baseline, Plan) or fit_budget, time_limit_s
    )
    plan = planner.to_plan(mesh, dp_mode, built, solution)
    plan.memory_budget_bytes = budget
    if pins is not None or layout in LOCAL_LAYOUTS:
        plan.hand_layout = layout
    return Estimate(name, plan.step_time_s, plan.peak_memory_bytes, budget, tuple(mesh), dp_mode, plan)


def _check_local_layout(name: str, layout: LocalLayout, mesh: tuple[int, int]) -> None:
    """A configuration that runs modules on local shards needs one that qualifies: else an error naming why each
    candidate was refused."""
    if layout:
        return
    why = (
        "; ".join(f"{m}: {r}" for m, r in sorted(layout.refused.items())[:4]) or "no attention or MLP module"
    )
    raise ValueError(
        f"{name}: no module of the blocks runs on local tensor shards on mesh {mesh} ({why}); price 'megatron' "
        "(the same placements on DTensors), or turn the dropout inside the modules off"
    )


def _evaluate_pipeline(
    model: nn.Module,
    example_inputs: Mapping[str, Any],
    plan_or_baseline: Plan | str | Mapping[str, str],
    *,
    num_devices: int,
    device: str | DeviceSpec,
    memory_budget: int | str | None,
    mesh_shape: tuple[int, ...] | None,
    devices_per_node: int | None,
    mixed_precision: str | None,
    optimizer: str | None,
    time_limit_s: float,
    recompute: str | None,
    micro_batches: int | None,
    dp_mode: str | None,
    dp_shard_size: int | None,
    pipeline: int | None,
    schedule: str | None,
    virtual_stages: int | None,
    blocks_per_stage: list[int] | None,
) -> Estimate:
    """:func:`evaluate_plan` of a pipeline Plan or a hand pipeline configuration (see there)."""
    if isinstance(plan_or_baseline, Plan) and memory_budget is None:
        memory_budget = plan_or_baseline.memory_budget_bytes
    planner = _Planner.for_devices(
        model, example_inputs, num_devices, device, devices_per_node, memory_budget, mixed_precision, optimizer,
        time_limit_s,
    )  # fmt: skip
    if isinstance(plan_or_baseline, Plan):
        config = pipeline_configuration(planner, plan_or_baseline)
        name = "plan"
    else:
        config = _hand_pipeline(
            model, plan_or_baseline, planner, pipeline, mesh_shape, dp_mode, dp_shard_size
        )
        config.update(
            schedule=schedule or "1f1b",
            virtual_stages=virtual_stages,
            blocks_per_stage=blocks_per_stage,
            recompute=recompute or "none",
        )
        stage = config["stage"]
        config["micro_batches"] = micro_batches or planner.batch // stage.dp
        name = plan_or_baseline if isinstance(plan_or_baseline, str) else "tp_plan"
    plan = price_pipeline(planner, **config)
    return Estimate(
        name,
        plan.step_time_s,
        plan.peak_memory_bytes,
        planner.budget,
        tuple(plan.mesh_shape),
        plan.dp_mode,
        plan,
    )


def _hand_pipeline(
    model: nn.Module,
    baseline: str | Mapping[str, str],
    planner: _Planner,
    pipeline: int | None,
    mesh_shape: tuple[int, ...] | None,
    dp_mode: str | None,
    dp_shard_size: int | None,
) -> dict[str, Any]:
    """A hand pipeline's pp degree, stage layout and tensor-parallel placements: ``baseline`` "ddp" / "fsdp"
    (tp = 1), "megatron" (Megatron's placements on tp = ``mesh_shape[-1]``, default the largest that fits a node;
    "megatron-sp" with its sequence parallelism, "megatron-local" run on local shards, "megatron-sp-local" both)
    or a tp_plan dict, inside each of ``pipeline`` stages."""
    if pipeline is None or pipeline < 2:
        raise ValueError(f"pipeline must be a pp degree >= 2 for a hand pipeline, got {pipeline!r}")
    n = planner.cluster.num_devices
    if n % pipeline:
        raise ValueError(f"pipeline={pipeline} does not divide the {n} devices")
    inner = n // pipeline
    if isinstance(baseline, str) and baseline in ("ddp", "fsdp"):
        tp, fixed, mode = 1, {}, baseline
    elif baseline in MEGATRON_LAYOUTS or not isinstance(baseline, str):
        tp = mesh_shape[-1] if mesh_shape else _largest_tp(inner, planner.cluster.devices_per_node, model)
        placements = (
            megatron_placements(model) if isinstance(baseline, str) else tp_plan_placements(model, baseline)
        )
        fixed, mode = (placements if tp > 1 else {}), "ddp"
    else:
        raise ValueError(f"Unknown baseline {baseline!r}; use one of {BASELINES}, a Plan, or a tp_plan dict.")
    if inner % tp:
        raise ValueError(f"tensor parallelism {tp} does not divide the {inner} devices of a pipeline stage")
    dp = inner // tp
    mode = dp_mode or mode
    if mode not in DP_MODES:
        raise ValueError(f"dp_mode must be one of {DP_MODES}, got {mode!r}")
    if mode == "hsdp":
        from .search import _hsdp_candidates

        shards = [
            s
            for _, s in _hsdp_candidates(
                ClusterSpec(planner.spec, inner, min(planner.cluster.devices_per_node, inner)), (dp, tp)
            )
        ]
        shard = dp_shard_size or (shards[0] if shards else 0)
        if not shard or dp % shard:
            raise ValueError(f"HSDP needs a shard group dividing the {dp} data-parallel ranks of a stage")
    else:
        shard = dp if mode == "fsdp" else 1
    if baseline in SEQUENCE_PARALLEL_LAYOUTS and tp < 2:
        raise ValueError(
            f"{baseline}: sequence parallelism needs a tensor-parallel axis > 1 inside the stages"
        )
    return dict(pp=pipeline, stage=StageLayout(tp, dp, mode if dp > 1 else "ddp", shard if dp > 1 else 1),
                fixed_params=fixed, local=baseline in LOCAL_LAYOUTS,
                sequence_parallel=baseline in SEQUENCE_PARALLEL_LAYOUTS)  # fmt: skip


def _check_estimate_arguments(
    plan_or_baseline: Plan | str | Mapping[str, str],
    recompute: str | None,
    dp_mode: str | None,
    dp_shard_size: int | None,
    pin_uses: bool,
) -> None:
    """:func:`evaluate_plan`'s arguments that contradict each other or name nothing, refused before any trace."""
    if pin_uses and not isinstance(plan_or_baseline, Plan):
        raise ValueError("pin_uses prices a Plan's own use placements; pass a Plan")
    if recompute not in (None, "auto"):
        parse_option(recompute)  # "none", "full", "selective:<classes>"; raises for anything else
    if isinstance(plan_or_baseline, Plan) and (dp_mode is not None or dp_shard_size is not None):
        raise ValueError("dp_mode and dp_shard_size are a Plan's own; pass them for a baseline or a tp_plan")
    if dp_mode is not None and dp_mode not in DP_MODES:
        raise ValueError(f"dp_mode must be one of {DP_MODES}, got {dp_mode!r}")
    if dp_shard_size is not None and dp_mode != "hsdp":
        raise ValueError("dp_shard_size is HSDP's shard group: pass it with dp_mode='hsdp'")


def _configuration(
    model: nn.Module,
    plan_or_baseline: Plan | str | Mapping[str, str],
    planner: _Planner,
    n: int,
    mesh_shape: tuple[int, ...] | None,
    hand_dp_mode: str | None,
    dp_shard_size: int | None,
) -> tuple[str, tuple[int, int], str, dict[str, str], int | None]:
    """What :func:`evaluate_plan` prices: its name, mesh, data-parallel mode, pinned tensor-parallel placements
    (FQN -> placement) and HSDP shard group (None: the cluster's), from a Plan, a named baseline or a tp_plan
    dict, with a hand configuration's ``dp_mode`` and ``dp_shard_size``."""
    cluster = planner.cluster
    shard: int | None = None
    """HSDP's shard group: a Plan's own (None: the cluster's)."""
    if isinstance(plan_or_baseline, Plan):
        plan = plan_or_baseline
        mesh = (
            plan.dp_size * plan.cp_size,
            plan.tp_size,
        )  # a cp plan's (dp x cp, tp): see ContextParallelPlanner
        dp_mode = plan.dp_mode
        shard = plan.dp_shard_size if dp_mode == "hsdp" else None
        fixed = {fqn: placements[-1] for fqn, placements in plan.param_placements.items()}  # the tp axis
        name = "plan"
    elif isinstance(plan_or_baseline, str):
        name = plan_or_baseline
        if name == "ddp":
            mesh, dp_mode, fixed = (n, 1), "ddp", {}
        elif name == "fsdp":
            mesh, dp_mode, fixed = (n, 1), "fsdp", {}
        elif name in MEGATRON_LAYOUTS:
            t = mesh_shape[-1] if mesh_shape else _largest_tp(n, cluster.devices_per_node, model)
            mesh, dp_mode = (n // t, t), "ddp"
            fixed = megatron_placements(model) if t > 1 else {}
            if t == 1 and name != "megatron":
                raise ValueError(
                    f"{name} baseline: it runs between tensor-parallel regions and needs a "
                    f"tensor-parallel axis > 1; mesh {mesh} has none"
                    + (
                        ""
                        if mesh_shape
                        else f" (no tensor-parallel size of {n} devices divides the attention heads)"
                    )
                    + ": pass mesh_shape=(dp, tp) with tp > 1, or price 'megatron'"
                )
            if t == 1:
                logger.warning(
                    "megatron baseline: no tensor-parallel size of %d devices divides the attention heads; "
                    "it degenerates to DDP",
                    n,
                )
        else:
            raise ValueError(f"Unknown baseline {name!r}; use one of {BASELINES}, a Plan, or a tp_plan dict.")
    else:
        name = "tp_plan"
        t = mesh_shape[-1] if mesh_shape else _largest_tp(n, cluster.devices_per_node, model)
        mesh, dp_mode = (n // t, t), "ddp"
        fixed = tp_plan_placements(model, plan_or_baseline)
    if hand_dp_mode is not None:
        if isinstance(plan_or_baseline, str) and name not in MEGATRON_LAYOUTS:
            raise ValueError(
                f"{name}: its data-parallel mode is its name; dp_mode is for "
                f"{', '.join(repr(n) for n in MEGATRON_LAYOUTS)} or a tp_plan"
            )
        if hand_dp_mode != "ddp" and mesh[0] == 1:
            raise ValueError(
                f"{name}: dp_mode {hand_dp_mode!r} needs a data-parallel axis; mesh {mesh} has none"
            )
        dp_mode, shard = hand_dp_mode, dp_shard_size
    return name, mesh, dp_mode, fixed, shard


def _priced(
    build: Callable[..., BuiltProblem],
    recompute: str | None,
    pin: str | dict[str, str] | None,
    under_budget: bool,
    time_limit_s: float,
) -> tuple[BuiltProblem, Solution]:
    """The problem :func:`evaluate_plan` prices and its solution: with recompute chosen under the budget
    (``recompute="auto"``), else with it pinned (``pin``) under the budget where ``under_budget`` (a Plan, or
    ``fit_budget``) and that fits, else with the budget lifted. ``build``: the planner's build with the
    configuration's placements pinned."""
    built = solution = None
    if recompute == "auto":
        built = build()
        try:
            solution = solve(built.problem, time_limit_s=time_limit_s)
        except InfeasibleError:
            pin = "full"  # priced (and reported as not fitting) with the most recompute there is

    def build_pinned(budget: int | None = None) -> BuiltProblem:
        """The ILP with every placement and the recompute choice pinned as the plan or baseline has them."""
        return build(recompute_pin=pin, budget=budget)

    if solution is None and under_budget:
        # A plan is priced as it was made: under its budget, which its pinned choices fit. With the budget lifted,
        # the activation placements a plan leaves to the solver could trade memory for time, and the estimate
        # would undercut the plan's own prediction.
        try:
            built = build_pinned()
            solution = solve(built.problem, time_limit_s=time_limit_s)
        except InfeasibleError:
            solution = None  # another device or budget than the plan's: priced below with the budget lifted
    if solution is None:
        built = build_pinned(LIFTED_BUDGET)
        solution = solve(built.problem, time_limit_s=time_limit_s)
    return built, solution
