"""The attention side of context parallelism (:mod:`.context_parallel`): the collectives over the cp group, one
forward's sequence layout on this rank, and the attention registered in transformers' registry that runs this
rank's queries against every rank's keys and values (all-gathered) under a mask in global positions.

Kept apart from the model wrapping (inputs cut, outputs gathered, what is refused) so that each reads alone.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .context_parallel_blocks import blocked_attention, blocked_reason

logger = logging.getLogger(__name__)

ATTENTION_NAME = "hf_colossal_auto_context_parallel"
"""The name of the context-parallel attention in transformers' attention registry."""

SUPPORTED_ATTENTION = ("sdpa", "eager")
"""Attention implementations the context-parallel attention runs (they take an arbitrary mask)."""


CP_ATTR = "_hf_colossal_auto_context_parallel"
"""Attribute every submodule of a context-parallel model carries: its :class:`ContextParallel`."""


class ContextParallelError(ValueError):
    """A model, an input or a setting that context parallelism cannot run exactly."""


# ------------------------------------------------------------------------------------------- collectives
class _GatherSequence(torch.autograd.Function):
    """All-gather over the cp group along ``dim`` (ranks' parts end to end); backward reduce-scatters (sums)
    the gradient back: each rank's keys and values are read by every rank's queries."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, group: dist.ProcessGroup, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        size = dist.get_world_size(group)
        moved = local.movedim(dim, 0).contiguous()
        out = moved.new_empty((size * moved.shape[0], *moved.shape[1:]))
        dist.all_gather_into_tensor(out, moved, group=group)
        return out.movedim(0, dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        size = dist.get_world_size(ctx.group)
        moved = grad.movedim(ctx.dim, 0).contiguous()
        out = moved.new_empty((moved.shape[0] // size, *moved.shape[1:]))
        dist.reduce_scatter_tensor(out, moved, group=ctx.group)
        return out.movedim(0, ctx.dim), None, None


class GatherReplicated(torch.autograd.Function):
    """All-gather over the cp group along ``dim`` for values every rank then uses alike (outputs): backward
    keeps this rank's part of the gradient, with no collective (each rank holds the whole gradient)."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, group: dist.ProcessGroup, dim: int) -> torch.Tensor:
        ctx.dim, ctx.rank, ctx.length = dim, dist.get_rank(group), local.shape[dim]
        return _GatherSequence.forward(ctx, local, group, dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return grad.narrow(ctx.dim, ctx.rank * ctx.length, ctx.length), None, None


class SumReplicated(torch.autograd.Function):
    """All-reduce (sum) over the cp group of each rank's share of the loss; backward is the identity: every
    rank back-propagates the same total, whose gradient with respect to its own share is one."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        total = local.detach().clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def local_tensor(t: Any) -> Any:
    """A DTensor's local tensor (the cp axis is outside DTensor's tensor-parallel mesh), else ``t``."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _gather_kv(t: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Keys or values ``[batch, heads, seq, dim]`` of every cp rank, end to end on the sequence dim (a DTensor
    stays one, on its tensor-parallel mesh: only its local sequence grows)."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        gathered = _GatherSequence.apply(t.to_local(), group, 2)
        return DTensor.from_local(gathered, t.device_mesh, t.placements, run_check=False)
    return _GatherSequence.apply(t, group, 2)


# ------------------------------------------------------------------------------------------- per-step state
@dataclass
class StepLayout:
    """One forward's sequence layout on this rank: what the attention needs to mask in global positions."""

    query_positions: torch.Tensor
    """Global positions of this rank's tokens, in local order."""
    key_positions: torch.Tensor
    """Global positions of the gathered keys (every rank's tokens, rank by rank)."""
    order: torch.Tensor
    """Index into the gathered sequence that restores sequence order (``argsort(key_positions)``)."""
    padding: torch.Tensor | None
    """The caller's 2-D attention mask over the whole sequence (True: attend), or None."""
    documents: torch.Tensor | None
    """Packed sequences: the document index of each position of the whole sequence, or None."""
    masks: dict[tuple[Any, ...], torch.Tensor] = field(default_factory=dict)
    """Masks built so far this step, by (window, causal, dtype): every layer shares one (the blocked path's
    window masks too, by distance)."""
    attention_calls: int = 0
    blocked_calls: int = 0
    """Attention calls that ran blocked, without a mask (:mod:`.context_parallel_blocks`)."""


@dataclass
class ContextParallel:
    """A model's context parallelism: the cp group, this rank's place in it, the attention it wraps."""

    group: dist.ProcessGroup
    size: int
    rank: int
    base_attention: str
    device: torch.device
    layout: StepLayout | None = None
    """The last forward's layout; kept after the forward so that recomputed blocks (activation checkpointing)
    rerun attention in backward with the same masks."""
    blocked: bool = True
    """Causal attention without padding or documents runs blocked, without a mask, where a kernel with a
    log-sum-exp exists (:mod:`.context_parallel_blocks`); False keeps every call on the mask path."""
    fallbacks: set[str] = field(default_factory=set)
    """Why calls kept the mask path (logged once each)."""


# ------------------------------------------------------------------------------------------- attention
def _mask(cp: ContextParallel, module: nn.Module, window: int | None, dtype: torch.dtype) -> torch.Tensor:
    """This step's additive attention mask ``[batch or 1, 1, local queries, all keys]`` for ``module``: causal
    in global positions, the sliding window, padding and documents (0 where a query attends, the dtype's
    lowest value elsewhere). Additive, in the queries' dtype, for sdpa too: sdpa converts a boolean mask to
    that on every call and its CPU kernel saves the copy for backward, one per layer; one tensor made here is
    shared by every layer of the step."""
    layout = cp.layout
    causal = bool(getattr(module, "is_causal", True))
    key = (window, causal, dtype)
    if key in layout.masks:
        return layout.masks[key]
    q = layout.query_positions[:, None]
    k = layout.key_positions[None, :]
    allowed = k <= q if causal else torch.ones_like(k <= q)
    if window is not None:
        allowed = allowed & (k > q - window)
    allowed = allowed[None, None]
    if layout.padding is not None:
        allowed = allowed & layout.padding[:, layout.key_positions][:, None, None, :]
    if layout.documents is not None:
        docs = layout.documents
        same = docs[:, layout.query_positions][:, :, None] == docs[:, layout.key_positions][:, None, :]
        allowed = allowed & same[:, None]
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    mask = mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    layout.masks[key] = mask
    return mask


def context_parallel_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    *args: Any,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """transformers' attention interface: this rank's queries against every rank's keys and values (all-gathered
    over cp). Causal attention without padding or documents runs blocked, without a mask
    (:func:`.context_parallel_blocks.blocked_attention`); the rest is masked in global positions and computed
    by the model's own ``sdpa`` or ``eager`` attention."""
    cp: ContextParallel | None = getattr(module, CP_ATTR, None)
    if cp is None or cp.layout is None:
        raise ContextParallelError(
            f"{type(module).__name__} ran the context-parallel attention outside a context-parallel forward; "
            "call the planned model itself"
        )
    cp.layout.attention_calls += 1
    window = kwargs.get("sliding_window", getattr(module, "sliding_window", None))
    if cp.blocked:
        reason = _blocked_reason(cp, module, query, key, value, kwargs)
        if reason is None:
            cp.layout.blocked_calls += 1
            scale = kwargs.get("scaling")
            out = blocked_attention(
                cp.group, cp.size, cp.rank, query, key, value, window, scale, cp.layout.masks
            )
            return out, None
        if reason not in cp.fallbacks:
            cp.fallbacks.add(reason)
            logger.info(
                "context-parallel attention in %s runs with a mask: %s", type(module).__name__, reason
            )
    key, value = _gather_kv(key, cp.group), _gather_kv(value, cp.group)
    mask = _mask(cp, module, window, local_tensor(query).dtype)
    kwargs.pop("sliding_window", None)
    attention = _base_attention(module, cp.base_attention)
    return attention(module, query, key, value, mask, *args, **kwargs)


def _blocked_reason(
    cp: ContextParallel, module: nn.Module, query: Any, key: Any, value: Any, kwargs: dict[str, Any]
) -> str | None:
    """Why this call keeps the mask path, or None (:func:`.context_parallel_blocks.blocked_reason`)."""
    padded = cp.layout.padding is not None or cp.layout.documents is not None
    return blocked_reason(module, cp.base_attention, query, key, value, padded, kwargs)


def _base_attention(module: nn.Module, kind: str) -> Callable[..., Any]:
    """The attention function the model would run: transformers' registered sdpa, or the model's own eager."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if kind == "eager":
        own = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
        if own is None:
            raise ContextParallelError(
                f"{type(module).__name__}: its module has no eager_attention_forward for context parallelism to "
                "run; use attn_implementation='sdpa'"
            )
        return own
    return ALL_ATTENTION_FUNCTIONS[kind]


def register_attention() -> None:
    """Put :func:`context_parallel_attention` in transformers' attention registry (not in the mask registry:
    the model then builds no mask of its own, and the attention builds one in global positions)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if ATTENTION_NAME not in ALL_ATTENTION_FUNCTIONS:
        ALL_ATTENTION_FUNCTIONS.register(ATTENTION_NAME, context_parallel_attention)
