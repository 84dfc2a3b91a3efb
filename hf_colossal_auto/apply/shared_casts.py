"""One low-precision cast of an input that sibling projections read, under ``torch.autocast``.

Under autocast every ``F.linear`` casts its input to the low-precision dtype and saves that copy for its weight
gradient. q, k and v of one attention read the same normed hidden states (gate and up of one MLP too), so autocast
makes, and backward keeps, three copies of one tensor: at Llama-3-405B under tp 8, 256 MiB each per block and
micro-batch. Autocast caches the casts of leaf parameters only, never of activations (Megatron-LM fuses q, k and v
into one projection and keeps one copy).

A forward pre-hook on each projection (``nn.Linear``, GPT-2's ``Conv1D``) casts its input once per forward of the
parent module and hands each sibling its own alias of that copy (:class:`_SharedCast`). An alias's backward casts
its gradient back to the input's dtype, as autocast's own cast does, so the siblings' gradients are still summed in
the input's dtype, one by one, as without the hook: the same gradients, bit for bit. The projection then receives a
low-precision input, which autocast leaves as it is.

The hooks are registered after the plan's placement hooks (:mod:`.enforce`): the cast is of the copy a projection
reads (q, k and v's input gathered once over the tensor-parallel axis, then cast once). The planner prices what this
runs from the captured step (:func:`hf_colossal_auto.capture.shared_casts.share_sibling_casts`): the later
siblings' casts allocate nothing and run no kernel.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..capture.module_kinds import projection_dims


class _SharedCast(torch.autograd.Function):
    """``x`` cast to ``low.dtype``, as an alias of ``low`` (the one cast the siblings share); in backward the
    gradient cast back to ``x``'s dtype, as autocast's cast (``ToCopyBackward``) does."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, made: _Made) -> torch.Tensor:
        ctx.dtype = x.dtype
        return made.low.detach()  # a tensor of its own (one autograd node per reader), the copy's storage

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad.to(ctx.dtype), None


class _Made:
    """One cast: the input it was made from (kept so that its id is not reused while the entry lives) and the
    low-precision copy."""

    __slots__ = ("low", "source")

    def __init__(self, source: torch.Tensor, low: torch.Tensor) -> None:
        self.source, self.low = source, low


class _SiblingCasts:
    """The casts made during one forward of a parent module, by input and dtype. Cleared when that forward ends:
    autograd keeps what backward needs, and a recomputed parent (activation checkpointing) casts anew."""

    def __init__(self) -> None:
        self.made: dict[tuple[int, torch.dtype, bool], _Made] = {}

    def get(self, x: torch.Tensor, dtype: torch.dtype) -> _Made:
        # a no-grad cast is not reused by a forward that records
        key = (id(x), dtype, torch.is_grad_enabled())
        if key not in self.made:
            with torch.no_grad():
                self.made[key] = _Made(x, x.to(dtype))
        return self.made[key]

    def clear(self, *_: Any) -> None:
        self.made.clear()


def _autocast_dtype(x: torch.Tensor) -> torch.dtype | None:
    """The dtype autocast would cast ``x`` to as a projection's input, or None when it would not cast it."""
    device_type = x.device.type
    if not torch.amp.is_autocast_available(device_type) or not torch.is_autocast_enabled(device_type):
        return None
    dtype = torch.get_autocast_dtype(device_type)
    if not x.is_floating_point() or x.dtype in (dtype, torch.float64):  # autocast leaves float64 alone
        return None
    return dtype


def _cast_input_hook(casts: _SiblingCasts):
    def hook(module: nn.Module, args: Any) -> Any:
        if not args or not isinstance(args[0], torch.Tensor):
            return None
        x = args[0]
        dtype = _autocast_dtype(x)
        if dtype is None:
            return None
        made = casts.get(x, dtype)
        low = _SharedCast.apply(x, made) if x.requires_grad and torch.is_grad_enabled() else made.low
        return (low, *args[1:])

    return hook


def share_sibling_casts(model: nn.Module) -> int:
    """Pre-hook the projections of ``model`` that have a sibling projection (another child projection of the same
    parent module) so that, under autocast, siblings reading one input share one cast of it. Register after the
    placement hooks. Returns the number of projections hooked."""
    by_parent: dict[str, list[nn.Module]] = {}
    for name, module in model.named_modules():
        if name and projection_dims(module) is not None:
            by_parent.setdefault(name.rpartition(".")[0], []).append(module)
    count = 0
    for parent, projections in by_parent.items():
        if len(projections) < 2 or not parent:  # a cast shared with nobody; the root's forward is the step
            continue
        casts = _SiblingCasts()
        model.get_submodule(parent).register_forward_hook(casts.clear, always_call=True)
        for module in projections:
            module.register_forward_pre_hook(_cast_input_hook(casts))
            count += 1
    return count
