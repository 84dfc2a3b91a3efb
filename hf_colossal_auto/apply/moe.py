"""Mixture-of-experts models under a plan: the parts of an MoE step that run as one local region.

Everything of an MoE layer that DTensor can shard op by op runs op by op: the router (a ``Linear``), the
routing (``topk``, ``softmax``, ``sort``, ``histc``: replicated like their inputs) and the experts' grouped
GEMMs (DTensor's ``_grouped_mm`` rule: replicated, or stacked weights split on their hidden or intermediate
dim; its Meta kernel is relaxed for fp32 in :mod:`hf_colossal_auto.capture.moe`).

The load-balancing auxiliary loss (``load_balancing_loss_func`` of each MoE family) cannot: with a padding
mask it accumulates into a plain ``torch.zeros`` buffer in place (``scatter_add_``) from DTensor routing
tensors, which DTensor refuses. It is a few hundred FLOPs on ``num_experts``-long vectors, so it runs as a
*local region* (what ``local_map`` does): its DTensor arguments enter as full tensors, the result leaves as
a replicated DTensor, and autograd runs through both conversions, so the router's gradient from the aux loss
is the one-process gradient. The router logits it reads are replicated in every plan the planner makes for
them (their dim is ``num_experts``), so entering the region moves no data.

**Expert parallelism.** An experts module whose stacked weights the plan splits on the expert dim runs as
one region too (:func:`install_expert_parallel_regions`): the ranks of a tensor-parallel group hold the same
tokens, so *dispatch* is local — rank ``r`` keeps the (token, expert) pairs routed to its ``E/n`` experts
and marks the others as transformers' own expert-parallel sentinels (skipped by the grouped GEMM, zero
routing weight) — and *combine* is a reduction of the partial outputs (each token's sum over its experts,
split over the ranks that own them), left to DTensor as a ``Partial`` output. The gradients of the tokens
and routing weights leave as partial sums too, reduced where they are made. No all-to-all is needed for
tokens replicated over the group. The planner prices the region as it runs
(``strategies.moe.add_expert_region_strategies``: tokens, routing weights and indices redistributed to
replicated on the way in, a partial sum out, partial gradients back), the grouped GEMMs' work under the
uniform-load assumption or a measured histogram; the real load is whatever the router does.

**Expert parallelism over the data-parallel axis** (``Plan.expert_data_parallel``, DDP or FSDP — under FSDP
the expert weights are left out of ``fully_shard``, every other parameter sharded as usual): the replicas hold
different tokens, so dispatch and combine exchange them by all-to-all (:func:`expert_data_parallel_forward`):
each (token, expert) pair's row goes to the rank that owns the expert and its result comes back. What one rank
sends and receives depends on the routing; summed over the ranks it does not, so the planner's prediction of
the exchange (uniform routing, or the busiest rank's under a measured histogram) is exact on average. gloo (torch 2.13)
runs all-to-all with uneven splits, as NCCL does: one code path on every device kind.
"""

from __future__ import annotations

import copy
import functools
import logging
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from .._torch_compat import (
    FakeTensor,
    clip_grad_internals,
    functional_all_to_all_rows,
    set_clip_grad_internals,
    tree_flatten,
    tree_map,
)
from ..capture.moe import expert_weight_dims, experts_modules
from ..plan import Plan

logger = logging.getLogger(__name__)

AUX_LOSS_FUNCTION = "load_balancing_loss_func"
_LOCAL_REGION_MARK = "_hf_colossal_auto_local_region"


def _full(value: Any) -> Any:
    """A DTensor as the full tensor every rank holds (differentiable); anything else as it is."""
    if not isinstance(value, DTensor):
        return value
    if all(isinstance(p, Replicate) for p in value.placements):
        return value.to_local()
    return value.full_tensor()


def local_region(function: Callable[..., Any]) -> Callable[..., Any]:
    """``function`` run on full local tensors when it is given DTensors; its tensor results come back as
    replicated DTensors on the mesh of its first DTensor argument. Calls without DTensors pass through."""
    if getattr(function, _LOCAL_REGION_MARK, False):
        return function

    @functools.wraps(function)
    def region(*args: Any, **kwargs: Any) -> Any:
        dtensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, DTensor)]
        if not dtensors:
            return function(*args, **kwargs)
        mesh = dtensors[0].device_mesh
        result = function(*tree_map(_full, args), **tree_map(_full, kwargs))
        placements = [Replicate()] * mesh.ndim
        return tree_map(
            lambda t: (
                DTensor.from_local(t, mesh, placements, run_check=False)
                if isinstance(t, torch.Tensor) and not isinstance(t, DTensor)
                else t
            ),
            result,
        )

    setattr(region, _LOCAL_REGION_MARK, True)
    return region


def install_aux_loss_region(model: nn.Module) -> bool:
    """Run the load-balancing loss of ``model``'s family as a local region (see the module docstring).

    Patches the function in the model class's own module (where its forward looks the name up), for the
    whole process like the SDPA mask placement: every model of that family is then safe under a plan, and
    unplanned calls (plain tensors) run unchanged. Returns whether the family has such a function.
    """
    module = sys.modules.get(type(model).__module__)
    function = getattr(module, AUX_LOSS_FUNCTION, None) if module is not None else None
    if function is None:
        return False
    if not getattr(function, _LOCAL_REGION_MARK, False):
        setattr(module, AUX_LOSS_FUNCTION, local_region(function))
        logger.debug("%s.%s runs as a local region under plans", module.__name__, AUX_LOSS_FUNCTION)
    return True


def _owned_slice(param: torch.Tensor, num_experts: int, rank: int, size: int) -> torch.Tensor:
    """This rank's experts of a per-expert parameter: the local shard of an expert-dim split, or the rows
    ``[rank E/n, (rank+1) E/n)`` of a replicated one, whose gradient then leaves as a partial sum (every rank
    fills only its own experts' rows)."""
    if not isinstance(param, DTensor):
        return param
    if any(isinstance(p, Shard) and p.dim == 0 for p in param.placements):
        return param.to_local()
    local = param.to_local(grad_placements=[Partial()] * param.device_mesh.ndim)
    if local.dim() >= 1 and local.shape[0] == num_experts:
        per_rank = num_experts // size
        return local[rank * per_rank : (rank + 1) * per_rank]
    return local


def expert_parallel_forward(module: nn.Module, original: Callable[..., Any]) -> Callable[..., Any]:
    """``module.forward`` (transformers experts: ``(hidden, top_k_index, top_k_weights) -> hidden``) run with
    this rank's experts only, as described in the module docstring."""

    @functools.wraps(original)
    def forward(hidden_states: Any, top_k_index: Any, top_k_weights: Any) -> Any:
        mesh = (
            module.gate_up_proj.device_mesh if hasattr(module, "gate_up_proj") else module.up_proj.device_mesh
        )
        size, rank = mesh.size(), mesh.get_local_rank()
        per_rank = module.num_experts // size

        def local_input(t: Any) -> torch.Tensor:
            if not isinstance(t, DTensor):
                return t
            full = (
                t
                if all(isinstance(p, Replicate) for p in t.placements)
                else t.redistribute(mesh, [Replicate()] * mesh.ndim)
            )
            return full.to_local(grad_placements=[Partial()] * mesh.ndim)

        hidden, weights, index = (local_input(t) for t in (hidden_states, top_k_weights, top_k_index))
        out = _own_experts_forward(
            module,
            hidden,
            index,
            weights,
            rank,
            per_rank,
            lambda p: _owned_slice(p, module.num_experts, rank, size),
        )
        return DTensor.from_local(out, mesh, [Partial()] * mesh.ndim, run_check=False)

    return forward


def _own_experts_forward(
    module: nn.Module,
    hidden: torch.Tensor,
    index: torch.Tensor,
    weights: torch.Tensor,
    rank: int,
    per_rank: int,
    local_param: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """transformers' own forward of ``module`` on rank ``rank``'s ``per_rank`` experts (``local_param`` gives
    each parameter's part of them as a plain tensor): the (token, expert) pairs routed to other ranks' experts
    become transformers' expert-parallel sentinels with zero routing weight, so the output sums over the ranks
    to the one-process output. Used by the expert-parallel region over tp; the one over dp sends each row to its
    expert's rank instead, and runs :func:`_experts_view` on the rows it receives."""
    local_index = index - rank * per_rank
    mine = (local_index >= 0) & (local_index < per_rank)
    local_index = torch.where(mine, local_index, torch.full_like(local_index, per_rank))  # sentinel
    weights = weights * mine.to(weights.dtype)
    # the class's forward: transformers' dispatch to the configured experts implementation, which skips
    # expert-parallel sentinels (grouped_mm: past the offsets; eager: the extra one-hot class)
    return type(module).forward(_experts_view(module, per_rank, local_param), hidden, local_index, weights)


def _experts_view(
    module: nn.Module, per_rank: int, local_param: Callable[[torch.Tensor], torch.Tensor]
) -> nn.Module:
    """``module`` with ``per_rank`` experts, each parameter replaced by its part of them as a plain tensor
    (``local_param``), marked expert-parallel for transformers' experts forward."""
    view = copy.copy(module)
    view.__dict__["_parameters"] = {}
    for name, param in module._parameters.items():
        if param is not None:
            view.__dict__[name] = local_param(param)
    view.__dict__["num_experts"] = per_rank
    view.__dict__["_is_expert_parallel"] = True
    return view


def _split_on_expert_dim(module: nn.Module, fqn: str, plan: Plan) -> bool:
    """True when every stacked expert weight of ``module`` is a DTensor split on its expert dim (dim 0) on a
    one-dimensional (tensor-parallel) mesh, evenly, and the plan uses it that way (a plan may store a weight
    split and gather it for use: then the experts run op by op, as planned)."""
    names = [name for name, _ in module.named_parameters(recurse=False) if expert_weight_dims(module, name)]
    if not names:
        return False
    for name in names:
        weight = getattr(module, name)
        use = plan.param_use_placements.get(f"{fqn}.{name}") or plan.param_placements.get(f"{fqn}.{name}")
        if not (
            isinstance(weight, DTensor)
            and weight.device_mesh.ndim == 1
            and weight.placements == (Shard(0),)
            and module.num_experts % weight.device_mesh.size() == 0
            and use is not None
            and use[-1] == "S0"
        ):
            return False
    return True


def _partly_expert_parallel(module: nn.Module, fqn: str, plan: Plan) -> list[str]:
    """The stacked expert weights ``plan`` uses split on the expert dim, when not all of them are (a per-op
    mix the ILP may price, e.g. ``down_proj`` expert-parallel and ``gate_up_proj`` split on its hidden dim)."""
    names = [name for name, _ in module.named_parameters(recurse=False) if expert_weight_dims(module, name)]
    used = {
        name: (
            plan.param_use_placements.get(f"{fqn}.{name}") or plan.param_placements.get(f"{fqn}.{name}") or []
        )
        for name in names
    }
    split = [name for name, use in used.items() if use and use[-1] == "S0"]
    return split if 0 < len(split) < len(names) else []


def install_expert_parallel_regions(model: nn.Module, plan: Plan) -> list[str]:
    """Run every experts module whose weights ``plan`` splits on the expert dim, for storage and use, as an
    expert-parallel region. Returns their FQNs. A module the plan makes expert-parallel for some weights only
    runs op by op (correct; DTensor gathers those weights where they are used), and a warning says so: the
    plan's time for it assumed otherwise."""
    installed, mixed = [], []
    for fqn, module in experts_modules(model).items():
        if _split_on_expert_dim(module, fqn, plan) and "forward" not in module.__dict__:
            module.forward = expert_parallel_forward(module, module.forward)
            installed.append(fqn)
        elif _partly_expert_parallel(module, fqn, plan):
            mixed.append(f"{fqn} ({', '.join(_partly_expert_parallel(module, fqn, plan))})")
    if mixed:
        logger.warning(
            "the plan uses some expert weights split on the expert dim and others not, in %d MoE layers (%s%s): "
            "the runtime runs expert parallelism per whole experts module only, so these weights are gathered "
            "where they are used and those layers take longer than the plan predicts",
            len(mixed),
            ", ".join(mixed[:2]),
            ", ..." if len(mixed) > 2 else "",
        )
    if installed:
        logger.info("expert parallelism (local dispatch, partial combine) in %d MoE layers", len(installed))
    return installed


# ---------------------------------------------------------------------------------------------------------------
# Expert parallelism over the data-parallel axis
# ---------------------------------------------------------------------------------------------------------------


def expert_data_parallel_weights(module: nn.Module) -> list[str]:
    """The parameters of an experts module that are per expert (dim 0 the expert): stored ``E/dp`` experts
    per data-parallel rank under expert parallelism over the data-parallel axis."""
    return [
        name
        for name, param in module.named_parameters(recurse=False)
        if param.dim() >= 1 and param.shape[0] == module.num_experts
    ]


def _even_splits(rows: int, size: int) -> list[int]:
    """``rows`` split as evenly as possible over ``size`` ranks: the uniform routing the planner prices."""
    return [rows // size + (1 if j < rows % size else 0) for j in range(size)]


def _exchange_counts(per_expert: torch.Tensor, group: Any, size: int, per_rank: int) -> tuple[Any, Any, Any]:
    """Rows this rank sends to and receives from each rank of ``group``, and the received rows' counts per
    (source rank, local expert): one all-to-all of the ``E`` per-expert counts (rank ``j`` gets the counts of
    its own ``E/size`` experts from every rank).

    In a symbolic run (fake tensors: :mod:`hf_colossal_auto.apply.simulate`) the counts have no values; the
    splits are then the uniform routing's (``T·k/size`` rows each way), which is what the planner prices, and
    the received counts None."""
    received = functional_all_to_all_rows(per_expert, None, None, group, differentiable=False)
    if isinstance(received, FakeTensor):
        return None, None, None
    sent = per_expert.view(size, per_rank).sum(1).tolist()
    return sent, received.view(size, per_rank).sum(1).tolist(), received


def expert_data_parallel_forward(
    module: nn.Module, original: Callable[..., Any], dp_mesh: Any
) -> Callable[..., Any]:
    """``module.forward`` with its experts sharded over the data-parallel group ``dp_mesh`` (a 1-D mesh of
    ``n`` ranks, ``E/n`` experts each), each rank holding different tokens: token dispatch and combine by
    all-to-all, as Megatron's and DeepSpeed's expert parallelism run.

    * *dispatch*: the ``T·k`` (token, expert) pairs sorted by expert, so by owning rank; one all-to-all of the
      ``E`` per-expert counts tells every rank what it will receive, a second sends each pair's token row
      to the rank that owns its expert;
    * every rank runs its ``E/n`` experts on the rows it received (transformers' own experts forward, one
      expert per row, weight 1);
    * *combine*: a third all-to-all returns each result to the rank of its token, which weights the ``k``
      results by the routing weights and sums them (the routing weights never leave their rank, so their
      gradient needs no exchange).

    Backward mirrors the two row exchanges (the reverse all-to-all of their gradients). Each rank's expert
    gradients are the sum over every rank's tokens (every rank's loss); the gradient synchronisation divides
    them by ``n``, as DDP averages (:func:`hf_colossal_auto.apply.runtime.register_gradient_sync`). Tokens
    that come in as DTensors on the tensor-parallel mesh are made replicated there; the output leaves
    replicated.

    The bytes a rank sends and receives depend on the routing (``T·k`` rows out in the dispatch, whatever its
    experts were routed in the combine); summed over the ranks they are ``n·T·k`` rows each way, the uniform
    routing's, whatever the router does."""
    group = dp_mesh
    size = dp_mesh.size()
    per_rank = module.num_experts // size

    @functools.wraps(original)
    def forward(hidden_states: Any, top_k_index: Any, top_k_weights: Any) -> Any:
        out_mesh = next(
            (t.device_mesh for t in (hidden_states, top_k_weights, top_k_index) if isinstance(t, DTensor)),
            None,
        )

        def local_input(t: Any) -> torch.Tensor:
            if not isinstance(t, DTensor):
                return t
            if not all(isinstance(p, Replicate) for p in t.placements):
                t = t.redistribute(t.device_mesh, [Replicate()] * t.device_mesh.ndim)
            return t.to_local()

        hidden, weights, index = (local_input(t) for t in (hidden_states, top_k_weights, top_k_index))
        out = _all_to_all_experts(module, hidden, index, weights, group, size, per_rank)
        if out_mesh is None:
            return out
        return DTensor.from_local(out, out_mesh, [Replicate()] * out_mesh.ndim, run_check=False)

    return forward


def _all_to_all_experts(
    module: nn.Module,
    hidden: torch.Tensor,
    index: torch.Tensor,
    weights: torch.Tensor,
    group: Any,
    size: int,
    per_rank: int,
) -> torch.Tensor:
    """The dispatch, expert computation and combine of :func:`expert_data_parallel_forward` on plain tensors:
    ``hidden`` ``(T, H)``, ``index`` and ``weights`` ``(T, k)``."""
    tokens, k = index.shape
    flat = index.reshape(-1)
    order = torch.argsort(flat, stable=True)  # by expert, so by owning rank
    per_expert = torch.zeros(module.num_experts, dtype=torch.int64, device=flat.device)
    per_expert.scatter_add_(0, flat, torch.ones_like(flat))  # bincount, with a static shape
    sent, received, received_per_expert = _exchange_counts(per_expert, group, size, per_rank)
    if sent is None:  # symbolic run: the uniform routing's splits
        sent = received = _even_splits(flat.numel(), size)
    rows = functional_all_to_all_rows(hidden.index_select(0, order // k), received, sent, group)
    if received_per_expert is None:
        local_expert = torch.arange(rows.shape[0], device=rows.device) % per_rank
    else:  # the rows arrive by source rank, each source's sorted by expert
        local_expert = torch.repeat_interleave(
            torch.arange(per_rank, device=rows.device).repeat(size),
            received_per_expert,
            output_size=rows.shape[0],
        )
    # every received row is for one of this rank's experts: transformers' experts forward, one expert per row
    view = _experts_view(module, per_rank, lambda p: p.to_local() if isinstance(p, DTensor) else p)
    ones = torch.ones(rows.shape[0], 1, dtype=weights.dtype, device=rows.device)
    results = type(module).forward(view, rows, local_expert.unsqueeze(1), ones)
    back = functional_all_to_all_rows(results, sent, received, group)
    per_pair = back.index_select(0, torch.argsort(order)).view(tokens, k, -1)
    return (per_pair * weights.unsqueeze(-1)).sum(1).to(hidden.dtype)


def check_expert_data_parallel(model: nn.Module, plan: Plan) -> None:
    """Refuse, with what to do, a plan whose expert parallelism over the data-parallel axis this runtime
    cannot run: only under DDP or FSDP (the experts left out of FSDP's units), on a data-parallel axis that
    divides each listed module's experts, with those modules' per-expert weights stored ``["S0", "R"]`` (split
    over dp, replicated over tp)."""
    if not plan.expert_data_parallel:
        return
    if plan.dp_mode == "hsdp":
        raise ValueError(
            "expert parallelism over the data-parallel axis runs under DDP or FSDP, not HSDP (the experts "
            "would be split over the whole data-parallel axis while the other parameters replicate over its "
            "replicate group): re-plan with dp_modes=('fsdp-ep',) or ('ddp-ep',), or drop "
            "Plan.expert_data_parallel"
        )
    if plan.dp_mode not in ("ddp", "fsdp"):
        raise ValueError(
            "expert parallelism over the data-parallel axis runs under DDP or FSDP, the plan is "
            f"{plan.dp_mode!r}: re-plan (the planner offers it as 'ddp-ep' and 'fsdp-ep') or drop "
            "Plan.expert_data_parallel"
        )
    dp = plan.dp_size
    modules = experts_modules(model)
    for fqn in plan.expert_data_parallel:
        module = modules.get(fqn)
        if module is None:
            raise ValueError(
                f"Plan.expert_data_parallel names {fqn}, which is not an experts module of the model"
            )
        if dp < 2 or module.num_experts % dp:
            raise ValueError(
                f"expert parallelism over the data-parallel axis for {fqn}: {module.num_experts} experts over "
                f"{dp} data-parallel ranks (needs dp >= 2 dividing the experts)"
            )
        for name in expert_data_parallel_weights(module):
            placed = list(plan.param_placements.get(f"{fqn}.{name}", []))
            if placed[:1] != ["S0"] or any(p != "R" for p in placed[1:]):
                raise ValueError(
                    f"Plan.expert_data_parallel names {fqn} but places {fqn}.{name} {placed}: its per-expert "
                    "weights must be stored ['S0', 'R'] (whole experts per data-parallel rank)"
                )


def install_expert_data_parallel_regions(model: nn.Module, plan: Plan, mesh: Any) -> list[str]:
    """Run every experts module ``plan.expert_data_parallel`` names with its experts sharded over the
    data-parallel axis of ``mesh`` (:func:`expert_data_parallel_forward`). Returns their FQNs."""
    if not plan.expert_data_parallel:
        return []
    dp_mesh = mesh["dp"]
    install_mixed_mesh_grad_norm()  # gradients on two meshes from now on
    modules = experts_modules(model)
    for fqn in plan.expert_data_parallel:
        module = modules[fqn]
        module.forward = expert_data_parallel_forward(module, module.forward, dp_mesh)
    logger.info(
        "expert parallelism over the data-parallel axis (all-to-all dispatch and combine) in %d MoE layers",
        len(plan.expert_data_parallel),
    )
    return list(plan.expert_data_parallel)


_MIXED_MESH_NORM = "_hf_colossal_auto_mixed_mesh_norm"


def _by_mesh(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """``tensors`` grouped by DTensor mesh (plain tensors in a group of their own), in first-seen order."""
    groups: dict[Any, list[torch.Tensor]] = {}
    for t in tensors:
        key = t.device_mesh if isinstance(t, DTensor) else None
        groups.setdefault(key, []).append(t)
    return list(groups.values())


def install_mixed_mesh_grad_norm() -> None:
    """Let ``torch.nn.utils.clip_grad_norm_`` take gradients on several meshes.

    Under expert parallelism over the data-parallel axis the expert weights are DTensors on the whole
    ``(dp, tp)`` mesh and the other parameters on its tensor-parallel part (under FSDP: on FSDP's
    data-parallel mesh); torch's total norm stacks the
    per-tensor norms, which DTensor refuses across meshes. The total norm is then taken per mesh (torch's own
    code), each made a plain full tensor (the expert weights' norm summed over the data-parallel shards), and
    combined; the result is a plain tensor, which scales the gradients of every mesh, one mesh at a time. Calls
    with one mesh run torch's code unchanged. Process-wide, like the load-balancing region; idempotent."""
    original, clip = clip_grad_internals()
    if getattr(original, _MIXED_MESH_NORM, False):
        return

    @functools.wraps(original)
    def total_norm(tensors: Any, norm_type: float = 2.0, error_if_nonfinite: bool = False, foreach=None):
        listed = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        groups = _by_mesh(listed)
        if len(groups) <= 1 or not any(isinstance(t, DTensor) for t in listed):
            return original(listed, norm_type, error_if_nonfinite, foreach)
        norms = []
        for group in groups:
            norm = original(group, norm_type, False, foreach)
            norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
        total = torch.linalg.vector_norm(torch.stack(norms), float(norm_type))
        if error_if_nonfinite and torch.logical_or(total.isnan(), total.isinf()):
            raise RuntimeError(
                f"The total norm of order {norm_type} for gradients from `parameters` is non-finite, so it cannot "
                "be clipped. To disable this error and scale the gradients by the non-finite norm anyway, set "
                "`error_if_nonfinite=False`"
            )
        return total

    @functools.wraps(clip)
    def clip_with_norm(parameters: Any, max_norm: float, total_norm: torch.Tensor, foreach=None) -> None:
        listed = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        groups = _by_mesh([p for p in listed if p.grad is not None])
        if len(groups) <= 1:
            return clip(listed, max_norm, total_norm, foreach)
        for group in groups:  # torch's foreach product refuses gradients on several meshes in one call
            clip(group, max_norm, total_norm, foreach)
        return None

    setattr(total_norm, _MIXED_MESH_NORM, True)
    set_clip_grad_internals(total_norm, clip_with_norm)
