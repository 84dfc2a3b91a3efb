"""Plans without tensor parallelism run on ordinary tensors: plain data parallelism, or FSDP2 on the plain module.

A plan whose tensor-parallel axis splits nothing — a ``(dp, 1)`` mesh under DDP, or a ``(dp, tp)`` one whose
placements are all replicated — computes each replica's step with whole tensors on every rank. DTensors would
add nothing there but their per-op cost, and they leak into the user's code: ``torch.testing.assert_close``
refuses to compare a DTensor parameter with a plain tensor (accelerate's own ``test_script.py`` does exactly
that after training), and any code that reads ``param.data`` sees a wrapper. So such a model keeps ordinary
``nn.Parameter`` tensors, as under accelerate's DDP:

* every rank starts from global rank 0's values (DDP's broadcast at construction);
* the forward is the model's own (the micro-batch check and the tensor-parallel group's generator agreement
  kept: ranks of one group compute the same replica and must draw the same numbers; with no DTensor random op
  to agree lazily at, a forward after one that drew nothing draws unagreed, with :mod:`.rng`'s warning, and the
  group agrees up front from the next one — as for random ops on plain tensors under the DTensor runtime);
* after each parameter's gradient is accumulated, it is all-reduced *asynchronously* over the data-parallel
  axis and averaged when backward ends (as :func:`.runtime._make_sync_hook` does for DTensors, and as the
  planner prices DDP: one all-reduce per parameter, overlapped with backward), except while a
  :class:`.micro_batch.GradientSyncControl` is off (``accelerator.no_sync``/``accumulate``: gradients only
  accumulate, and the next synchronising backward all-reduces their sum).

FSDP/HSDP on a ``(dp, 1)`` mesh (no experts over the data-parallel axis, no context parallelism) runs the same
way up to FSDP (:attr:`~hf_colossal_auto.plan.Plan.runs_on_plain_tensors`, as torchtitan and accelerate run
FSDP2): ordinary parameters broadcast from rank 0 and the forward wrapped as above, then ``fully_shard``
(:func:`.runtime._fully_shard`) stores each as its DTensor shard over the data-parallel mesh and gathers it as
an ordinary tensor for forward and backward, so every op runs eagerly; FSDP reduce-scatters the gradients
itself, and ``no_sync`` turns that off (no hooks of ours).

Anything else (a placement other than replicated on the tensor-parallel axis, a tensor-parallel collective,
experts over the data-parallel axis, FSDP over ``dp x cp``) keeps the DTensor runtime of :mod:`.runtime`. The
planner prices plain plans without DTensor's per-op host cost (the same property decides).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from .._torch_compat import queue_backward_callback
from .context_parallel import gradient_group
from .micro_batch import GradientSyncControl, check_micro_batch_rows, no_gradient_sync
from .rng import agreed_forward

logger = logging.getLogger(__name__)

PLAIN_ATTR = "_hf_colossal_auto_plain_parameters"
"""Attribute of a planned model: True when its forward runs on ordinary tensors (``Plan.runs_on_plain_tensors``;
its stored parameters are ordinary too unless FSDP shards them)."""


def mesh_device(mesh: DeviceMesh) -> torch.device:
    """The device this rank's tensors live on for ``mesh`` (the current CUDA device on a CUDA mesh)."""
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)


def keep_plain_parameters(model: nn.Module, mesh: DeviceMesh, broadcast: bool) -> dict[int, nn.Parameter]:
    """Leave ``model``'s parameters ordinary tensors, moved to the mesh's device (a parameter on ``meta`` stays
    there: materialisation or a checkpoint fills it) and, with ``broadcast``, set to global rank 0's values
    (DDP's broadcast at construction: replicas seeded differently start alike). Tied parameters stay tied.
    Returns ``id(old parameter) -> parameter`` (the same object where nothing moved)."""
    device = mesh_device(mesh)
    done: dict[int, nn.Parameter] = {}
    for fqn, param in list(model.named_parameters(remove_duplicate=False)):
        if id(param) not in done:
            if param.is_meta or param.device == device:
                done[id(param)] = param
            else:
                done[id(param)] = nn.Parameter(param.detach().to(device), requires_grad=param.requires_grad)
        module_name, _, attr = fqn.rpartition(".")
        setattr(model.get_submodule(module_name), attr, done[id(param)])
    if broadcast:
        broadcast_from_rank_zero(done.values())
    return done


def broadcast_from_rank_zero(params: Any) -> None:
    """Set every real parameter in ``params`` to global rank 0's values, in place (DDP's broadcast at
    construction): replicas built from different seeds (``set_seed(..., device_specific=True)``) start alike,
    as under plain accelerate, whatever the plan. Parameters on ``meta`` are skipped (materialisation draws
    them alike)."""
    with torch.no_grad():
        for param in _distinct_real(params):
            dist.broadcast(param.data, src=0)


def _distinct_real(params: Any) -> Iterator[nn.Parameter]:
    seen: set[int] = set()
    for param in params:
        if id(param) not in seen and not param.is_meta:
            seen.add(id(param))
            yield param


def wrap_plain_forward(model: nn.Module) -> None:
    """``model.forward`` as the model's own, inside the two things a planned forward needs whatever its tensors:
    the micro-batch check (a k > 1 plan fed its whole batch is refused by name) and the tensor-parallel
    group's generator agreement (:mod:`.rng`; nothing on a ``(dp, 1)`` mesh)."""
    original = model.forward

    @functools.wraps(original)
    def forward(*args: Any, **kwargs: Any) -> Any:
        check_micro_batch_rows(model, args, kwargs)
        with agreed_forward(model):
            return original(*args, **kwargs)

    model.forward = forward
    model._hf_colossal_auto_original_forward = original
    setattr(model, PLAIN_ATTR, True)


def _data_parallel_group(mesh: DeviceMesh) -> tuple[dist.ProcessGroup | None, int]:
    """The data-parallel group of ``mesh`` and what its gradient sums are divided by (None, 1 without one or
    with one rank)."""
    return gradient_group(mesh)  # with context parallelism the dp x cp ranks, divided by dp


def plain_gradient_hook(group: dist.ProcessGroup, size: int, control: GradientSyncControl):
    """A post-accumulate-grad hook: start the all-reduce of the parameter's gradient over ``group`` (on a copy:
    autograd may have handed the accumulated gradient a buffer that backward still reads), so that it runs
    while backward computes earlier layers; when backward ends, wait for them all and set the averages. While
    ``control`` is off the gradient only accumulates."""
    pending: list[tuple[nn.Parameter, torch.Tensor, Any]] = []

    def finish() -> None:
        for param, local, work in pending:
            work.wait()
            param.grad = local.div_(size)
        pending.clear()

    def hook(param: nn.Parameter) -> None:
        if param.grad is None or not control.enabled:
            return
        local = param.grad.clone()
        work = dist.all_reduce(local, group=group, async_op=True)
        if not pending:
            queue_backward_callback(finish)
        pending.append((param, local, work))

    return hook


def register_plain_gradient_sync(model: nn.Module, mesh: DeviceMesh, reduce: bool = True) -> None:
    """DDP's gradient averaging over the data-parallel axis of ``mesh`` for ordinary parameters, and DDP's
    ``no_sync`` (which ``accelerator.no_sync``/``accumulate`` and the Trainer's accumulation look up) deferring
    it: :func:`plain_gradient_hook` on every trained parameter. ``reduce`` False (FSDP2 on the plain module,
    which reduce-scatters the gradients itself): only ``no_sync``, which turns FSDP's reduction off and on
    (:func:`.micro_batch.set_gradient_sync` calls the root's ``set_requires_gradient_sync``)."""
    control = GradientSyncControl()
    model._hf_colossal_auto_grad_sync = control
    model.no_sync = functools.partial(no_gradient_sync, model)
    if not reduce:
        return
    group, size = _data_parallel_group(mesh)
    if group is None:
        return
    hook = plain_gradient_hook(group, size, control)
    for param in model.parameters():
        if param.requires_grad:
            param.register_post_accumulate_grad_hook(hook)
