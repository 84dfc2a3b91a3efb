"""Apply a Plan to the live model: DTensor parameters on a ``(dp, tp)`` mesh, the model's own forward.

Why DTensor for everything rather than ``ParallelStyle``s per module: a plan may place any parameter on any
dim (the planner's strategies are DTensor's, and it finds placements no style expresses), and DTensor ops
have *global* semantics, so the model's Python code — GPT-2's fused ``c_attn`` split by ``split_size``, views
with hard-coded head counts — runs unchanged on sharded tensors. What this module does:

1. checks the plan against the model (names, shapes) and the job (world size);
2. builds the mesh (NCCL on GPUs, gloo on CPU, whatever the default group is);
3. turns every parameter into a DTensor with the plan's placements, tied parameters once, scattered from
   rank 0's values so every rank starts from the same weights — or, for a model built on ``meta``, allocates
   only each rank's shards and fills them with the model's own init (:mod:`.materialize`);
4. wraps ``model.forward``: tensor inputs are each rank's *local* batch, made DTensors sharded over the
   data-parallel axis and replicated over the tensor-parallel one; DTensor outputs come back as ordinary
   tensors (replicated ones locally, sharded ones gathered);
5. the data-parallel axis: DDP — after backward every gradient is brought to its parameter's placements and
   averaged over the replicas; or FSDP — FSDP2 ``fully_shard`` per block on the data-parallel sub-mesh, which
   composes with the tensor-parallel DTensors (parameters become 2-D DTensors).

Non-DTensor tensors the model makes itself (masks, position ids, RoPE tables) are the same on every rank, so
DTensor is told to treat them as replicated (``implicit replication``) for the whole process.

The plan's choices are enforced where DTensor's propagation would choose differently (:mod:`.enforce`):
parameter uses and module outputs are redistributed as planned, above autograd, and partial gradients are
reduced at module outputs; tests/test_fidelity.py holds the collectives to the plan's prediction.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import gc
import json
import logging
import math
import os
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard, distribute_tensor

from .._torch_compat import allow_implicit_replication, flatten_mesh_axes, queue_backward_callback, tree_map
from ..plan import Plan
from .agree import DEFAULT_TIMEOUT_S, as_timedelta, raise_if_any_rank_failed, run_on_one_rank, set_timeout
from .context_parallel import check_context_parallel_model, gradient_group, install_context_parallel
from .data_parallel import (
    broadcast_from_rank_zero,
    keep_plain_parameters,
    mesh_device,
    register_plain_gradient_sync,
    wrap_plain_forward,
)
from .dtensor_rules import register_replicated_fallbacks, register_runtime_rules
from .enforce import ReducePartialGradientsAtProducers, enforce_plan
from .local_tensor_parallel import check_local_modules, install_local_regions
from .materialize import is_meta_model, materialize_meta_model
from .micro_batch import GradientSyncControl, check_micro_batch_rows, no_gradient_sync
from .moe import (
    check_expert_data_parallel,
    expert_data_parallel_weights,
    install_aux_loss_region,
    install_expert_data_parallel_regions,
    install_expert_parallel_regions,
)
from .plan_mismatch import PlanMismatchError
from .pretrained import install_save_pretrained, load_pretrained
from .recompute import apply_recompute
from .rng import agreed_forward, fused_attention_dropout_region, install_replica_rng
from .shared_casts import share_sibling_casts

logger = logging.getLogger(__name__)


def to_placement(p: str) -> Placement:
    if p == "R":
        return Replicate()
    if p.startswith("S"):
        return Shard(int(p[1:]))
    if p.startswith("P"):
        return Partial()
    raise ValueError(f"unknown placement {p!r} in plan (expected R, S<d> or P)")


def validate_plan(model: nn.Module, plan: Plan, world_size: int | None = None) -> None:
    """Refuse a plan made for another model (parameter names/shapes) or another world size, or one listing
    modules to run on local tensor shards that cannot (:func:`.local_tensor_parallel.check_local_modules`)."""
    params = dict(model.named_parameters())
    missing = sorted(set(params) - set(plan.param_placements))
    extra = sorted(set(plan.param_placements) - set(params))
    if missing or extra:
        raise PlanMismatchError(
            f"This plan was made for another model: it places {len(extra)} parameters {extra[:3]} the "
            f"{type(model).__name__} does not have and misses {len(missing)} {missing[:3]}. Re-plan for this model."
        )
    if plan.model_class != type(model).__name__:
        raise PlanMismatchError(f"plan made for {plan.model_class}, applied to {type(model).__name__}")
    wrong = [
        f"{fqn} {tuple(params[fqn].shape)} (plan: {tuple(shape)})"
        for fqn, shape in plan.param_shapes.items()
        if fqn in params and tuple(params[fqn].shape) != tuple(shape)
    ]
    if wrong:
        raise PlanMismatchError(
            f"This plan was made for another configuration of {plan.model_class}: {len(wrong)} parameters have "
            f"other shapes, e.g. {'; '.join(wrong[:3])}. Re-plan for this model."
        )
    mesh_size = math.prod(plan.mesh_shape)
    if world_size is not None and mesh_size != world_size:
        raise PlanMismatchError(
            f"plan's mesh {tuple(plan.mesh_shape)} needs {mesh_size} processes, the job has {world_size}; "
            "re-plan with num_devices equal to the world size"
        )
    check_local_modules(model, plan)
    fsdp_axis = _fsdp_axis(plan)
    for fqn, placements in plan.param_placements.items():
        shape = tuple(params[fqn].shape)
        for axis, p in enumerate(placements):
            if axis == fsdp_axis and not _sharded_experts(plan, fqn):
                continue  # FSDP2 shards dim 0 unevenly (padded): a (1,)-shaped scale over 2 ranks is fine
            if p.startswith("S"):
                d = int(p[1:])
                size = plan.mesh_shape[axis]
                if d >= len(shape) or shape[d] % size:
                    raise PlanMismatchError(
                        f"plan shards {fqn} (shape {shape}) on dim {d} over {size} devices, which does not divide "
                        "it; the plan was made for another configuration"
                    )


def _fsdp_axis(plan: Plan) -> int | None:
    """The mesh axis FSDP2 shards parameters over (the data-parallel one under FSDP/HSDP), or None."""
    if plan.dp_mode in ("fsdp", "hsdp") and "dp" in plan.mesh_axis_names:
        return list(plan.mesh_axis_names).index("dp")
    return None


def _sharded_experts(plan: Plan, fqn: str) -> bool:
    """Whether ``fqn`` belongs to experts the plan splits over the data-parallel axis itself (whole experts
    per rank: the expert count must divide)."""
    return any(fqn.startswith(f"{m}.") for m in plan.expert_data_parallel)


def _validate_on_every_rank(model: nn.Module, plan: Plan, world_size: int | None) -> None:
    """:func:`validate_plan`, agreed: if the plan does not fit on any rank (a plan file only one rank could
    read, a model built differently on one rank), every rank raises, before any rank enters a collective."""
    error: PlanMismatchError | None = None
    try:
        validate_plan(model, plan, world_size)
    except PlanMismatchError as exc:
        error = exc
    if world_size is not None and world_size > 1 and _processes_are_real():
        raise_if_any_rank_failed(error, what="checking the plan against the model")
    elif error is not None:
        raise error


def _processes_are_real() -> bool:
    """A job of real processes, not the one-process fake group the planner and the symbolic runtime simulate
    ranks with (agreeing with peers, or a timeout, means nothing there)."""
    return dist.is_initialized() and dist.get_backend() != "fake"


def build_mesh(plan: Plan, device_type: str | None = None) -> DeviceMesh:
    """The plan's mesh over the running job's ranks (row-major: the last axis varies fastest)."""
    if device_type is None:
        device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
    return init_device_mesh(device_type, tuple(plan.mesh_shape), mesh_dim_names=tuple(plan.mesh_axis_names))


def tensor_parallel_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The tensor-parallel sub-mesh DTensor computes on. The data-parallel axis is kept out of DTensor: a
    replica's batch is not a replicated tensor (each replica holds different data), so DTensor must never be
    free to slice it on that axis and gather it back; gradients are averaged over it explicitly."""
    names = mesh.mesh_dim_names or ()
    return mesh["tp"] if "tp" in names and mesh.ndim > 1 else mesh


def batch_group_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The ranks that compute on one data-parallel replica's rows (one pipeline stage's): the tensor-parallel
    sub-mesh, or with context parallelism its ``cp x tp`` ranks flattened (consecutive in the row-major mesh)."""
    names = mesh.mesh_dim_names or ()
    if "cp" not in names or mesh.size(names.index("cp")) == 1:
        return tensor_parallel_mesh(mesh)
    if "tp" not in names or mesh.size(names.index("tp")) == 1:
        return mesh["cp"]
    return flatten_mesh_axes(mesh, ("cp", "tp"), "cp_tp")


def distribute_parameters(model: nn.Module, plan: Plan, mesh: DeviceMesh) -> dict[int, nn.Parameter]:
    """Replace each parameter by a DTensor on the tensor-parallel sub-mesh with the plan's tensor-parallel
    placement (tied parameters stay tied). Returns ``id(old parameter) -> new parameter``."""
    tp_mesh = tensor_parallel_mesh(mesh)
    tp_axis = (
        list(plan.mesh_axis_names).index("tp") if "tp" in plan.mesh_axis_names else len(plan.mesh_shape) - 1
    )
    done: dict[int, nn.Parameter] = {}
    names = dict(model.named_parameters())
    over_dp = expert_data_parallel_params(model, plan)
    for fqn, param in list(model.named_parameters(remove_duplicate=False)):
        module_name, _, attr = fqn.rpartition(".")
        module = model.get_submodule(module_name)
        if id(param) not in done:
            placements = plan.param_placements.get(fqn)
            if placements is None:  # an alias of a tied parameter listed under its first name
                placements = next(plan.param_placements[n] for n, p in names.items() if p is param)
            local = param.detach()
            # a meta parameter stays on meta (no values to scatter): materialize_meta_model allocates its shards
            source = None if local.is_meta else 0
            if fqn in over_dp:  # experts sharded over the data-parallel axis: the whole mesh, split on dp
                dt = distribute_tensor(
                    local, mesh, [to_placement(p) for p in placements], src_data_rank=source
                )
            else:
                dt = distribute_tensor(
                    local, tp_mesh, [to_placement(placements[tp_axis])], src_data_rank=source
                )
            done[id(param)] = nn.Parameter(dt, requires_grad=param.requires_grad)
        setattr(module, attr, done[id(param)])
    return done


def expert_data_parallel_params(model: nn.Module, plan: Plan) -> set[str]:
    """FQNs of the per-expert weights ``plan`` stores split over the data-parallel axis
    (``Plan.expert_data_parallel``): DTensors on the whole mesh, not on its tensor-parallel part."""
    out: set[str] = set()
    for fqn in plan.expert_data_parallel:
        module = model.get_submodule(fqn)
        out.update(f"{fqn}.{name}" for name in expert_data_parallel_weights(module))
    return out


def remap_optimizer(optimizer: torch.optim.Optimizer, replaced: dict[int, nn.Parameter]) -> None:
    """Point an optimizer made before parallelization at the new (DTensor) parameters.

    Param groups keep their hyper-parameters; state already accumulated for a parameter (a resumed optimizer)
    is sharded like the parameter.
    """
    for group in optimizer.param_groups:
        group["params"] = [replaced.get(id(p), p) for p in group["params"]]
    state = {}
    for param, param_state in optimizer.state.items():
        new = replaced.get(id(param), param)
        if new is not param and isinstance(new, DTensor):
            param_state = {
                k: distribute_tensor(v, new.device_mesh, new.placements, src_data_rank=0)
                if isinstance(v, torch.Tensor) and v.shape == param.shape
                else v
                for k, v in param_state.items()
            }
        state[new] = param_state
    optimizer.state.clear()
    optimizer.state.update(state)


def remap_optimizers_by_name(
    model: nn.Module,
    originals: list[tuple[str, nn.Parameter]],
    optimizers: tuple[torch.optim.Optimizer, ...] | list[torch.optim.Optimizer],
) -> None:
    """Point optimizers made before parallelization at ``model``'s parameters now, matched by name
    (``originals``: ``named_parameters(remove_duplicate=False)`` before): after every replacement (FSDP
    replaces the DTensor parameters once more)."""
    if not optimizers:
        return
    final = dict(model.named_parameters(remove_duplicate=False))
    replaced = {id(p): final[fqn] for fqn, p in originals if fqn in final}
    for optimizer in optimizers:
        remap_optimizer(optimizer, replaced)


def _to_dtensor(value: Any, mesh: DeviceMesh, placements: list[Placement]) -> Any:
    if isinstance(value, torch.Tensor) and not isinstance(value, DTensor) and value.dim() > 0:
        return DTensor.from_local(value, mesh, placements, run_check=False)
    return value


def _from_dtensor(value: Any) -> Any:
    if not isinstance(value, DTensor):
        return value
    replicated = all(isinstance(p, Replicate) for p in value.placements)
    local = value.to_local() if replicated else value.full_tensor()
    # A scalar (the loss) is copied: callers scale it in place (the Trainer's ``loss *= ...``), which autograd
    # forbids on the view DTensor's conversions return. Larger outputs (logits) stay views, to cost no memory.
    return local.clone() if local.dim() == 0 else local


_original_sdpa = torch.nn.functional.scaled_dot_product_attention


def _sdpa_with_placed_mask(query, key, value, attn_mask=None, *args, **kwargs):
    """Attention on DTensors with a DTensor mask: DTensor's kernels take the mask as a keyword argument, which
    its sharding expansion does not place (only positional inputs are redistributed). Split the mask the way
    the queries are split — heads or batch — unless it broadcasts on that dim (T5's position bias is a
    per-head mask)."""
    if isinstance(query, DTensor) and isinstance(attn_mask, torch.Tensor) and query.device_mesh.ndim == 1:
        mesh = query.device_mesh
        if not isinstance(attn_mask, DTensor):  # made by the model from plain tensors: the same on every rank
            attn_mask = DTensor.from_local(attn_mask, mesh, [Replicate()], run_check=False)
        placement = query.placements[0]
        if placement.is_partial():
            query, key, value = (t.redistribute(mesh, [Replicate()]) for t in (query, key, value))
            placement = Replicate()
        if isinstance(placement, Shard) and placement.dim in (0, 1) and attn_mask.dim() == 4:
            key, value = (t.redistribute(mesh, [placement]) for t in (key, value))
            wanted = placement if attn_mask.shape[placement.dim] > 1 else Replicate()
        else:
            query, key, value = (t.redistribute(mesh, [Replicate()]) for t in (query, key, value))
            wanted = Replicate()
        attn_mask = attn_mask.redistribute(mesh, [wanted])
    dropout_p = args[0] if args else kwargs.get("dropout_p", 0.0)
    with fused_attention_dropout_region(query, dropout_p):  # CUDA: each head shard its own masks
        return _original_sdpa(query, key, value, attn_mask, *args, **kwargs)


def install_sdpa_mask_placement() -> None:
    """Route ``F.scaled_dot_product_attention`` through :func:`_sdpa_with_placed_mask` for the whole process.

    Process-wide rather than around the model's forward: a recomputed block (activation checkpointing) runs
    its attention again *during backward*, outside any forward. The wrapper only acts on DTensor queries;
    every other call goes straight to torch's function."""
    torch.nn.functional.scaled_dot_product_attention = _sdpa_with_placed_mask


def wrap_forward(model: nn.Module, mesh: DeviceMesh) -> None:
    """Make ``model(**local_batch)`` run on DTensors and return ordinary tensors (same signature).

    Each rank's batch is declared replicated on every mesh axis: within a tensor-parallel group all ranks get
    the same batch; across the data-parallel axis the batches differ, as in DDP, and the gradients are
    averaged after backward (:func:`register_gradient_sync`). The loss is then DDP's: the mean of the
    replicas' losses.
    """
    mesh = tensor_parallel_mesh(mesh)
    original = model.forward
    install_sdpa_mask_placement()
    install_aux_loss_region(model)  # MoE: the load-balancing loss runs on full local tensors (apply/moe.py)

    @functools.wraps(original)
    def forward(*args, **kwargs):
        check_micro_batch_rows(model, args, kwargs)  # a k > 1 plan fed its whole batch: refused, by name
        with planned_forward(model):
            output = original(*inputs_on_mesh(args, mesh), **inputs_on_mesh(kwargs, mesh))
        return local_outputs(output)

    model.forward = forward
    model._hf_colossal_auto_original_forward = original


def inputs_on_mesh(value: Any, mesh: DeviceMesh) -> Any:
    """``value`` (a pytree) with every tensor of one dim or more a DTensor replicated on the tensor-parallel
    ``mesh`` (the rank's own tensor, not copied: the group's ranks hold the same one)."""
    return tree_map(lambda v: _to_dtensor(v, mesh, [Replicate()]), value)


def local_outputs(output: Any) -> Any:
    """A forward's outputs as ordinary tensors: replicated DTensors locally, sharded ones gathered; a HF
    ``ModelOutput`` keeps its class."""
    if isinstance(output, Mapping):  # HF ModelOutput is an OrderedDict subclass: keep its class
        for key in list(output.keys()):
            output[key] = tree_map(_from_dtensor, output[key])
        return output
    return tree_map(_from_dtensor, output)


@contextlib.contextmanager
def planned_forward(model: nn.Module) -> Any:
    """Around one forward of (a part of) a planned ``model``: the tensor-parallel group draws as one process
    (:mod:`.rng`), and partial gradients are reduced where the plan makes their values
    (:class:`.enforce.ReducePartialGradientsAtProducers`)."""
    with agreed_forward(model), ReducePartialGradientsAtProducers():
        yield


def _reduce_partial_output(module: nn.Module, args: Any, output: Any) -> Any:
    """A vocab-sharded embedding returns a *masked* partial sum (DTensor's ``_MaskPartial``), which is only valid
    until its lookup mask is consumed: reduce it where it is made, as Megatron's vocab-parallel embedding does."""
    if isinstance(output, DTensor) and any(p.is_partial() for p in output.placements):
        placements = [Replicate() if p.is_partial() else p for p in output.placements]
        return output.redistribute(output.device_mesh, placements)
    return output


def register_embedding_reduction(model: nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, nn.Embedding):
            module.register_forward_hook(_reduce_partial_output)


def _make_sync_hook(mesh: DeviceMesh, control: GradientSyncControl | None = None):
    """A post-accumulate-grad hook per parameter: bring its gradient to the parameter's placements, then (DDP)
    start averaging it over the data-parallel axis *asynchronously*, so that the all-reduce runs while backward
    computes the gradients of earlier layers (what the planner prices as overlapped, at the efficiency the
    device's calibration measured). The reductions are waited for, and the gradients set, when backward ends.
    While ``control`` is disabled (micro-batches before the last: :func:`.micro_batch.accumulate`) the gradient
    only accumulates locally; the next synchronising backward all-reduces the sum, once per step."""
    # the data-parallel group, or with context parallelism the dp x cp ranks (summed over cp, divided by dp)
    dp_group, dp_size = gradient_group(mesh)
    pending: list[tuple[nn.Parameter, torch.Tensor, Any, DTensor]] = []

    def finish() -> None:
        for param, local, work, grad in pending:
            work.wait()
            local.div_(dp_size)
            param.grad = DTensor.from_local(local, grad.device_mesh, grad.placements, run_check=False)
        pending.clear()

    def hook(param: nn.Parameter) -> None:
        grad = param.grad
        if not isinstance(grad, DTensor):
            return
        if tuple(grad.placements) != tuple(param.placements):
            grad = grad.redistribute(param.device_mesh, param.placements)
        if dp_group is None or (control is not None and not control.enabled):
            param.grad = grad
            return
        if param.device_mesh.ndim > 1:
            # experts sharded over the data-parallel axis (apply/moe.py): this rank's experts saw every rank's
            # tokens, so their gradient is already the sum over the replicas; DDP's average divides it by dp
            param.grad = grad / dp_size
            return
        # DDP: every replica computed the gradient of its own batch; average them (on a copy: autograd may
        # have handed the accumulated gradient a buffer that backward still reads)
        local = grad.to_local().clone()
        work = dist.all_reduce(local, group=dp_group, async_op=True)
        if not pending:
            queue_backward_callback(finish)
        pending.append((param, local, work, grad))

    return hook


def data_parallel_shard_mesh(plan: Plan, mesh: DeviceMesh) -> DeviceMesh:
    """The mesh FSDP2 shards over: the data-parallel axis under FSDP; under HSDP that axis unflattened into
    ``(dp_replicate, dp_shard)`` (row-major, so a shard group is consecutive ranks: one node's data-parallel
    ranks, as the plan priced it), on which ``fully_shard`` reduce-scatters in the shard group and all-reduces
    the shards in the replicate group. Unflattened from the plan's mesh, so that it shares its root with the
    tensor-parallel sub-mesh the parameters live on (FSDP2 requires it). With context parallelism (FSDP only)
    the ``dp x cp`` ranks flattened: each of them holds ``1 / (dp x cp)`` of every parameter, as the planner
    prices it (:func:`set_context_parallel_gradient_sum` makes their reduce-scatter a sum over cp)."""
    if plan.cp_size > 1:
        return flatten_mesh_axes(mesh, ("dp", "cp"), "dp_cp")
    if plan.dp_mode != "hsdp":
        return mesh["dp"]
    sizes = (plan.dp_replicate_size, plan.dp_shard_size)
    hybrid = mesh._unflatten("dp", sizes, ("dp_replicate", "dp_shard"))
    return hybrid["dp_replicate", "dp_shard"]


def _fully_shard(
    model: nn.Module,
    dp_mesh: DeviceMesh,
    ignored: set[nn.Parameter] | None = None,
    *,
    reshard_after_forward: bool | None = None,
) -> None:
    """FSDP on the data-parallel axis (FSDP2 ``fully_shard`` per block, then the root): parameters, gradients
    and optimizer state sharded over the replicas (over the shard group under HSDP), gathered per block for
    compute (the next block's gather started by the current block's forward), gradients reduce-scattered.
    ``ignored``: parameters FSDP leaves alone in every unit (the experts sharded over the data-parallel axis,
    already split over it: never gathered nor reduce-scattered). ``reshard_after_forward``: None is FSDP2's
    default (blocks resharded after forward, the root kept gathered for its backward); False keeps each
    block gathered from its forward to its backward (a pipeline stage runs several micro-batches' forwards
    before their backwards: resharding would gather every block again per micro-batch, as torchtitan avoids).
    ``model`` may be a pipeline stage: its blocks and whatever else it holds (embedding, head) are sharded."""
    from torch.distributed.fsdp import fully_shard

    ignored = ignored or None

    sharded: list[str] = []
    for name, module in model.named_modules():
        # the outermost lists of blocks only: a list inside a block already sharded (T5's per-block ``layer``
        # list) belongs to that block's FSDP unit, and FSDP2 refuses to shard its parameters twice
        inside = any(name.startswith(prefix + ".") for prefix in sharded)
        if isinstance(module, nn.ModuleList) and not inside:
            blocks = list(module)
            sharded += [f"{name}.{i}" if name else str(i) for i in range(len(blocks))]
            for block in blocks:
                fully_shard(
                    block, mesh=dp_mesh, ignored_params=ignored, reshard_after_forward=reshard_after_forward
                )
            # each block's forward starts the next block's all-gather, so that it runs behind this block's
            # compute, as the planner prices it (FSDP2 prefetches in backward by itself)
            for block, following in zip(blocks, blocks[1:], strict=False):
                block.set_modules_to_forward_prefetch([following])
    fully_shard(model, mesh=dp_mesh, ignored_params=ignored, reshard_after_forward=reshard_after_forward)


def set_context_parallel_gradient_sum(model: nn.Module, dp_size: int) -> None:
    """FSDP over ``dp x cp`` ranks (:func:`data_parallel_shard_mesh`): reduce-scatter each gradient as a sum
    divided by ``dp`` only, not FSDP's mean over the ``dp x cp`` group. Each cp rank's loss is its share of its
    replica's mean loss (:mod:`.context_parallel`), so a replica's gradient is the sum over its cp ranks, and the
    replicas' gradients are averaged, as under DDP (:func:`.context_parallel.gradient_group`). Forced to a plain
    sum then a division (gloo has no pre-multiplied sum), as the pipeline runtime does."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(float(dp_size))
            module.set_force_sum_reduction_for_comms(True)


_EXPERTS_OVER_DP = "_hf_colossal_auto_experts_over_dp"
"""Attribute of a model under FSDP: FQNs of the expert parameters sharded over the data-parallel axis (not
FSDP's). Names, not the parameters: materialising a meta model may replace them."""


def register_gradient_sync(model: nn.Module, mesh: DeviceMesh, average_over_dp: bool = True) -> None:
    """After each parameter's gradient is accumulated: bring it to the parameter's placements, then average
    it over the data-parallel axis of ``mesh`` (the full mesh; parameters live on its tensor-parallel part)."""
    control = GradientSyncControl()  # micro_batch.set_gradient_sync turns it off between micro-batches
    model._hf_colossal_auto_grad_sync = control
    # DDP's name: accelerate's Accelerator.no_sync (so accelerator.accumulate and the Trainer's gradient
    # accumulation) looks it up on the model and defers the synchronisation to the last micro-batch
    model.no_sync = functools.partial(no_gradient_sync, model)
    hook = _make_sync_hook(mesh, control) if average_over_dp else _make_sync_hook(tensor_parallel_mesh(mesh))
    # under FSDP the experts sharded over the data-parallel axis are not FSDP's: the DDP hook divides their
    # gradients by dp (once per step, as under DDP); FSDP reduce-scatters every other gradient
    experts = set() if average_over_dp else getattr(model, _EXPERTS_OVER_DP, set())
    expert_hook = _make_sync_hook(mesh, control) if experts else None
    for fqn, param in model.named_parameters():
        if isinstance(param, DTensor) and param.requires_grad:
            param.register_post_accumulate_grad_hook(expert_hook if fqn in experts else hook)


def apply_plan(
    model: nn.Module,
    plan: Plan,
    mesh: DeviceMesh | None = None,
    optimizers: tuple[torch.optim.Optimizer, ...] | list[torch.optim.Optimizer] = (),
    *,
    timeout: float | timedelta | None = DEFAULT_TIMEOUT_S,
    pretrained: str | os.PathLike | None = None,
    dtensors: bool | None = None,
) -> nn.Module:
    """Shard ``model`` in place per ``plan`` on ``mesh`` (built from the running job when None).

    Optimizers are best created afterwards, from ``model.parameters()``; one created before must be passed in
    ``optimizers`` so that it is pointed at the new parameters. A plan that does not fit the model or the job
    raises :class:`PlanMismatchError` on every rank. ``timeout`` (seconds; None keeps the process group's)
    becomes the collective timeout of the groups the plan runs on. ``pretrained``: a HF safetensors checkpoint
    (directory, or a repository in the local HF cache) each rank loads its own shards from once the model is
    sharded (:func:`.pretrained.load_pretrained`, strict) — for a model built on ``meta``, instead of initialising
    the weights. ``dtensors``: None runs a plan on ordinary tensors where
    :attr:`~hf_colossal_auto.plan.Plan.runs_on_plain_tensors` (:mod:`.data_parallel`; under FSDP/HSDP the
    stored parameters are FSDP2's DTensor shards over the data-parallel mesh, its forward and backward on
    ordinary tensors) and any other on DTensors; True forces DTensors (what the calibration times: the per-op
    cost of a plan that shards over a tensor-parallel axis).
    """
    if (
        plan.pp_size > 1
    ):  # pipeline stages: this rank's part of the model and its schedule (apply/pipeline.py)
        from .pipeline import apply_pipeline_plan

        return apply_pipeline_plan(model, plan, mesh, optimizers, timeout=timeout, pretrained=pretrained)
    world = dist.get_world_size() if dist.is_initialized() else None
    _validate_on_every_rank(model, plan, world)
    check_expert_data_parallel(model, plan)
    if plan.cp_size > 1:  # before any collective: the same model refuses on every rank
        check_context_parallel_model(model, plan)
    fsdp = plan.dp_mode in ("fsdp", "hsdp") and plan.dp_size * plan.cp_size > 1  # FSDP shards over dp x cp
    install_dtensor_rules(plan)
    if mesh is None:
        mesh = build_mesh(plan)
    originals = list(model.named_parameters(remove_duplicate=False))
    on_meta = is_meta_model(model)
    # ordinary tensors in forward and backward (apply/data_parallel.py): DDP's averaging by hooks, or FSDP2 on
    # the plain module (its unsharded parameters are ordinary tensors; it reduce-scatters the gradients itself)
    plain = plan.runs_on_plain_tensors and not dtensors
    if plain:
        keep_plain_parameters(model, mesh, broadcast=_processes_are_real())
        wrap_plain_forward(model)
    else:
        _distribute(model, plan, mesh)
    if plan.cp_size > 1:  # sequences split over the cp axis (the outermost forward wrapper)
        install_context_parallel(model, plan, mesh)
    share_sibling_casts(model)  # after the placement hooks: the cast of the copy each projection reads
    # inside FSDP's per-block hooks, as torchtitan orders AC and FSDP
    recomputed = apply_recompute(model, plan)
    install_replica_rng(model, mesh, recomputed=bool(recomputed))
    if fsdp:
        model._hf_colossal_auto_dp_mesh = data_parallel_shard_mesh(plan, mesh)
        over_dp = expert_data_parallel_params(model, plan)
        setattr(model, _EXPERTS_OVER_DP, over_dp)
        experts = {p for fqn, p in model.named_parameters() if fqn in over_dp}
        _fully_shard(model, model._hf_colossal_auto_dp_mesh, ignored=experts)
        if plan.cp_size > 1:
            set_context_parallel_gradient_sum(model, plan.dp_size)
    # after FSDP, so that each rank allocates (and reads) only its data- and tensor-parallel shards
    device = mesh_device(mesh) if plain else None  # a plain parameter on meta has no mesh to say where
    if pretrained is not None:
        # what each rank read, kept for logs and tests
        model._hf_colossal_auto_load_report = load_pretrained(model, pretrained, device=device)
    elif on_meta:
        materialize_meta_model(model, device)
    if plain:
        register_plain_gradient_sync(model, mesh, reduce=not fsdp)
    else:
        register_gradient_sync(model, mesh, average_over_dp=not fsdp)
    remap_optimizers_by_name(model, originals, optimizers)
    release_freed_memory()
    model._hf_colossal_auto_plan = plan
    model._hf_colossal_auto_mesh = mesh
    # the model's own save_pretrained streams its shards to the main process (a rank waits this long for peers)
    install_save_pretrained(model, as_timedelta(timeout or DEFAULT_TIMEOUT_S).total_seconds())
    tp = plan.tp_size
    model._tp_size = tp  # transformers' Trainer reads it for batch-size arithmetic
    if timeout is not None and _processes_are_real():
        set_timeout(timeout, (mesh.get_group(axis) for axis in range(mesh.ndim)))
    logger.info("applied plan: mesh %s, %s on the data-parallel axis", tuple(plan.mesh_shape), plan.dp_mode)
    return model


def install_dtensor_rules(plan: Plan) -> None:
    """What DTensor needs, for the whole process, to run planned models: our sharding rules, the plan's ops
    without one run replicated, and plain tensors the model makes itself (masks, positions, rotary tables: the
    same on every rank) taken as replicated."""
    register_runtime_rules()
    register_replicated_fallbacks(plan.replicated_ops)
    allow_implicit_replication(True)


def _distribute(model: nn.Module, plan: Plan, mesh: DeviceMesh) -> None:
    """The DTensor runtime of a plan that shards something: DTensor parameters, the forward on DTensors, the
    expert regions, the plan's placements enforced. Every rank first takes global rank 0's values, as DDP
    does: sharding then splits one model (FSDP keeps no replica that would otherwise show the difference)."""
    if _processes_are_real():
        broadcast_from_rank_zero(_on_mesh_device(model, mesh))
    distribute_parameters(model, plan, mesh)
    wrap_forward(model, mesh)
    install_placement_hooks(model, plan, mesh)


def install_placement_hooks(model: nn.Module, plan: Plan, mesh: DeviceMesh) -> None:
    """The module hooks that run the plan's placements on ``model`` (its parameters already DTensors): the
    expert regions, the vocab-sharded embedding's reduction, the attention and MLP modules run on local shards
    (``Plan.local_modules``), the plan's enforced placements (none inside those). Keyed by module FQN: on a
    pipeline stage's cut model only its own modules are hooked."""
    install_expert_parallel_regions(model, plan)  # experts split on the expert dim (apply/moe.py)
    install_expert_data_parallel_regions(model, plan, mesh)  # experts split over the data-parallel axis
    register_embedding_reduction(model)
    local = install_local_regions(model, plan, tensor_parallel_mesh(mesh))  # apply/local_tensor_parallel.py
    enforce_plan(model, plan, local_modules=local)


def _on_mesh_device(model: nn.Module, mesh: DeviceMesh) -> list[nn.Parameter]:
    """``model``'s parameters, each real one moved to the mesh's device first when it is elsewhere (NCCL
    broadcasts only device tensors; distribution moves them there anyway)."""
    device = mesh_device(mesh)
    for _, param in list(model.named_parameters(remove_duplicate=False)):
        if not param.is_meta and param.device.type != device.type:
            moved = nn.Parameter(param.detach().to(device), requires_grad=param.requires_grad)
            for name, other in list(model.named_parameters(remove_duplicate=False)):  # ties stay tied
                if other is param:
                    owner, _, leaf = name.rpartition(".")
                    setattr(model.get_submodule(owner), leaf, moved)
    return list(model.parameters())


def release_freed_memory() -> None:
    """Hand the pages of freed tensors back to the operating system (glibc's ``malloc_trim``).

    Why: the full-size parameters were just replaced by their shards, and rank 0 may have traced and solved a
    plan; glibc keeps such freed memory in the process's heap, where on CPU it counts in the resident memory
    of every following step (measured: ~100-200 MiB per rank of the 66 M-parameter benchmark Llama). No-op
    where the C library has no ``malloc_trim``; device memory is not affected.
    """
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).malloc_trim(0)


def broadcast_plan(plan: Plan | None, src: int = 0) -> Plan:
    """Every rank runs the same plan: rank ``src`` sends the plan it already has (the others pass None), by
    :func:`plan_on_one_rank`."""

    def sent() -> Plan:
        if plan is None:
            raise RuntimeError(f"rank {src} had no plan to broadcast")
        return plan

    return plan_on_one_rank(sent, src)


def plan_on_one_rank(
    make_plan: Callable[[], Plan], src: int = 0, *, limit_s: float | None = None, what: str = "planning"
) -> Plan:
    """``make_plan()`` on rank ``src``, its plan on every rank — or, when it raises, the same error (type and
    message) on every rank within seconds, instead of the others waiting out the process-group timeout. The
    others wait in heartbeats, so a long plan is no collective timeout; past ``limit_s`` every rank raises
    :class:`~hf_colossal_auto.apply.agree.TookTooLongError` naming ``what`` and where planning was."""
    text = run_on_one_rank(lambda: make_plan().to_json(), src=src, what=what, limit_s=limit_s)
    return Plan.from_dict(json.loads(text))
