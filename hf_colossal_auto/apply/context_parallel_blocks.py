"""Context parallelism's causal attention without a mask (the common case: causal, no padding, no packed
documents; a sliding window too): this rank's two query chunks against the gathered keys in blocks, merged
exactly by their log-sum-exp.

Why: the mask path (:func:`.context_parallel_attention._mask`) builds one additive mask ``[1, 1, S / cp, S]`` a
step, and sdpa saves a copy of it for backward; at Llama-3-8B's 131,072 tokens that is 4.3 GB at cp 8 and more
at smaller cp, what kept cp 4 and 8 from fitting an H100 (docs/benchmarks.md). Under the balanced layout rank
``r`` holds chunk ``r`` (head) and chunk ``2 cp - 1 - r`` (tail) of ``2 cp`` chunks of ``c`` tokens. A query chunk
``g`` sees every key of the chunks before it and its own chunk causally, so its attention is: the fully
visible keys without a mask, the diagonal chunk with the kernel's causal flag (top-left causal is exact for a
chunk against itself), merged by log-sum-exp (as torch's ring attention merges its steps). Under a sliding
window, chunks wholly inside the window are unmasked, chunks wholly outside skipped, and the (at most two)
chunks it cuts get a ``[c, c]`` mask that depends only on the distance in chunks (shared by every layer).

Keys and values are gathered in two all-gathers, each of K and V together: every rank's head chunks (chunks
``0 .. cp - 1`` in order) and every rank's tail chunks (chunks ``2 cp - 1 .. cp``). Every block's keys are then
a contiguous slice of one buffer, at the K/V heads (the kernels take grouped-query attention, no ``repeat_kv``
copy), and no mask exists. Same collectives, bytes and count as the mask path (K and V there); the gradients
are reduce-scattered the same way.

Backward is exact: each block's kernel backward is given the *merged* output and log-sum-exp (the softmax over
all keys, restricted to the block's), so the blocks' gradients sum to one kernel's over all keys (what
flash-attention's backward computes). The kernels go through :mod:`hf_colossal_auto._torch_compat`
(``attention_block_forward`` / ``attention_block_backward``); where none is available the caller keeps the
mask path.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .._torch_compat import attention_block_backward, attention_block_forward, attention_lse_kernel
from ..context_parallel_layout import Block, causal_blocks

logger = logging.getLogger(__name__)


def window_mask(
    distance: int, chunk: int, window: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """The additive ``[1, 1, c, c]`` mask of a query chunk against the key chunk ``distance`` chunks before it
    under a sliding ``window`` (query ``i``, key ``l``: ``k > q - window``, and ``k <= q`` on the diagonal):
    0 where it attends, the dtype's lowest value elsewhere (as the mask path's)."""
    i = torch.arange(chunk, device=device)[:, None]
    l_ = torch.arange(chunk, device=device)[None, :]
    allowed = (l_ - i) > distance * chunk - window
    if distance == 0:
        allowed = allowed & (l_ <= i)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(
        ~allowed, torch.finfo(dtype).min
    )
    return mask[None, None]


# ------------------------------------------------------------------------------------------- the collectives
def _kv_rows(k: torch.Tensor, v: torch.Tensor, rows: slice) -> torch.Tensor:
    """K and V ``[b, heads, L, d]`` at local ``rows``, sequence first and K/V second: ``[n, 2, b, heads, d]``
    (one tensor, so one all-gather moves both)."""
    return torch.stack((k[:, :, rows].permute(2, 0, 1, 3), v[:, :, rows].permute(2, 0, 1, 3)), dim=1)


def gather_heads_tails(
    k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup, chunk: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every rank's head chunks and every rank's tail chunks of K and V: two buffers ``[cp x c, 2, b, heads,
    d]`` (rank order: the heads buffer is chunks ``0 .. cp - 1``, the tails buffer chunks ``2 cp - 1 .. cp``)."""
    size = dist.get_world_size(group)
    out = []
    for rows in (slice(0, chunk), slice(chunk, 2 * chunk)):
        local = _kv_rows(k, v, rows)
        gathered = local.new_empty((size * chunk, *local.shape[1:]))
        dist.all_gather_into_tensor(gathered, local, group=group)
        out.append(gathered)
    return out[0], out[1]


def _scatter_heads_tails(
    heads: torch.Tensor, tails: torch.Tensor, group: dist.ProcessGroup, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients of the two gathered buffers reduce-scattered (summed) back to this rank's K and V
    gradients ``[b, heads, 2c, d]``."""
    parts = []
    for grad in (heads, tails):
        grad = grad.to(dtype)
        mine = grad.new_empty((grad.shape[0] // dist.get_world_size(group), *grad.shape[1:]))
        dist.reduce_scatter_tensor(mine, grad, group=group)
        parts.append(mine)
    both = torch.cat(parts, dim=0)  # [2c, 2, b, heads, d]
    return both[:, 0].permute(1, 2, 0, 3), both[:, 1].permute(1, 2, 0, 3)


def _keys(buffer: torch.Tensor, which: int, block: Block) -> torch.Tensor:
    """K (``which`` 0) or V (1) of ``block``'s rows of a gathered buffer, as ``[b, heads, rows, d]`` (a view)."""
    return buffer[block.start : block.stop, which].permute(1, 2, 0, 3)


# ------------------------------------------------------------------------------------------- the attention
@dataclass(frozen=True)
class BlockedSpec:
    """What one layer's blocked attention needs besides its tensors."""

    group: dist.ProcessGroup
    chunk: int
    blocks: tuple[Block, ...]
    masks: dict[int, torch.Tensor]
    """Window masks by distance in chunks (:func:`window_mask`)."""
    scale: float | None


def _accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    """Blocks are merged and gradients summed in at least float32 (as the kernels accumulate)."""
    return torch.promote_types(dtype, torch.float32)


class _BlockedCausalAttention(torch.autograd.Function):
    """K/V gathered (heads and tails), blocks of attention merged by log-sum-exp; backward: each block's kernel
    backward from the merged output and log-sum-exp, K/V gradients reduce-scattered. Output ``[b, 2c, heads,
    d]`` (transformers' attention output layout). Saves q, the two gathered buffers (all ``S`` tokens at the
    K/V heads), the output and the float32 log-sum-exp; masks only under a sliding window."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: BlockedSpec) -> torch.Tensor:
        heads, tails = gather_heads_tails(k, v, spec.group, spec.chunk)
        buffers = (heads, tails)
        b, h, length, _ = q.shape
        acc = _accumulate_dtype(q.dtype)
        out = q.new_empty((b, length, h, v.shape[-1]))
        lse = torch.empty((b, h, length), dtype=acc, device=q.device)
        states = []
        for query in (0, 1):
            rows = slice(query * spec.chunk, (query + 1) * spec.chunk)
            merged_out, merged_lse = None, None
            for block in (bl for bl in spec.blocks if bl.query == query):
                o, l_, state = attention_block_forward(
                    q[:, :, rows],
                    _keys(buffers[block.buffer], 0, block),
                    _keys(buffers[block.buffer], 1, block),
                    causal=block.causal,
                    mask=None if block.offset is None else spec.masks[block.offset],
                    scale=spec.scale,
                )
                states.append(state)
                merged_out, merged_lse = _merge(merged_out, merged_lse, o, l_.to(acc))
            out[:, rows] = merged_out.transpose(1, 2)
            lse[:, :, rows] = merged_lse
        ctx.save_for_backward(q, heads, tails, out, lse, *spec.masks.values())
        ctx.spec, ctx.states, ctx.kv_dtype = spec, states, k.dtype
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None]:
        q, heads, tails, out, lse, *masks = ctx.saved_tensors
        spec: BlockedSpec = ctx.spec
        by_distance = dict(zip(spec.masks.keys(), masks, strict=True))
        buffers = (heads, tails)
        acc = _accumulate_dtype(q.dtype)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        grads = tuple(torch.zeros(b_.shape, dtype=acc, device=b_.device) for b_ in buffers)
        grad, out = grad.transpose(1, 2), out.transpose(1, 2)  # [b, heads, 2c, d] views
        states = iter(ctx.states)
        for query in (0, 1):
            rows = slice(query * spec.chunk, (query + 1) * spec.chunk)
            lse_rows = lse[:, :, rows].contiguous()
            for block in (bl for bl in spec.blocks if bl.query == query):
                buffer = buffers[block.buffer]
                dq_, dk, dv = attention_block_backward(
                    grad[:, :, rows],
                    q[:, :, rows],
                    _keys(buffer, 0, block),
                    _keys(buffer, 1, block),
                    out[:, :, rows],
                    lse_rows,
                    next(states),
                    causal=block.causal,
                    mask=None if block.offset is None else by_distance[block.offset],
                    scale=spec.scale,
                )
                dq[:, :, rows] += dq_
                target = grads[block.buffer][block.start : block.stop]
                target[:, 0] += dk.permute(2, 0, 1, 3)
                target[:, 1] += dv.permute(2, 0, 1, 3)
        dk, dv = _scatter_heads_tails(grads[0], grads[1], spec.group, ctx.kv_dtype)
        return dq.to(q.dtype), dk, dv, None


def _merge(
    out: torch.Tensor | None, lse: torch.Tensor | None, block_out: torch.Tensor, block_lse: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Two attention results over disjoint keys as one (``out`` ``[b, heads, c, d]`` in the accumulation
    dtype, ``lse`` ``[b, heads, c]``): each weighted by its share of the total softmax mass."""
    if out is None:
        return block_out.to(block_lse.dtype), block_lse
    total = torch.logaddexp(lse, block_lse)
    merged = out * (lse - total).exp().unsqueeze(-1) + block_out * (block_lse - total).exp().unsqueeze(-1)
    return merged, total


# ------------------------------------------------------------------------------------------- entry point
_UNSUPPORTED_KWARGS = ("softcap", "position_bias", "s_aux")
"""Attention arguments that change the scores or the softmax (logit soft-capping, T5's bias, attention sinks):
the mask path (whose sdpa refuses or applies them) runs those."""


def blocked_reason(
    module: nn.Module,
    base_attention: str,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    padded: bool,
    kwargs: dict[str, Any],
) -> str | None:
    """Why this layer's attention keeps the mask path (None: it runs blocked): eager attention (its own
    softmax), padding or packed documents, a non-causal layer, dropout, scores-changing arguments, DTensors
    split on the sequence or head dims, head dims or dtypes that differ, no kernel with a log-sum-exp for the
    device and dtype."""
    if base_attention != "sdpa":
        return f"attn_implementation {base_attention!r}"
    if padded:
        return "a padding mask or packed documents"
    if not getattr(module, "is_causal", True) or kwargs.get("is_causal") is False:
        return "non-causal attention"
    if kwargs.get("dropout", 0.0):
        return "attention dropout"
    extra = [k for k in _UNSUPPORTED_KWARGS if kwargs.get(k) is not None]
    if extra:
        return f"the attention argument {extra[0]!r}"
    local = _local_split(query, key, value)
    if local is None:
        return "tensor-parallel placements that split the sequence or head dim"
    q, k, v = local
    if not (q.shape[-1] == k.shape[-1] == v.shape[-1]) or q.shape[1] % k.shape[1] or k.shape[1] != v.shape[1]:
        return "query, key and value head shapes the kernels do not take"
    if not (q.dtype == k.dtype == v.dtype):
        return "query, key and value of different dtypes (sdpa casts them; the kernels do not)"
    chunk = q.shape[2] // 2
    if attention_lse_kernel(q.device, q.dtype, q.shape[-1], chunk) is None:
        return f"no attention kernel with a log-sum-exp for {q.dtype} on {q.device.type}"
    return None


def _local_split(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
    """The local tensors of q, k, v, when the blocked attention can run on them: plain tensors, or DTensors
    with the same mesh and placements split at most on the batch or head dims (each rank's local attention is
    then its part of the whole). None otherwise."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    kinds = {isinstance(t, DTensor) for t in tensors}
    if kinds == {False}:
        return tensors
    if kinds != {True}:
        return None
    first = tensors[0]
    for t in tensors:
        if t.device_mesh != first.device_mesh or t.placements != first.placements:
            return None
    for p in first.placements:
        if not (isinstance(p, Replicate) or (isinstance(p, Shard) and p.dim in (0, 1))):
            return None
    return tuple(t.to_local() for t in tensors)


def blocked_attention(
    group: dist.ProcessGroup,
    cp: int,
    rank: int,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    window: int | None,
    scale: float | None,
    masks: dict[Any, torch.Tensor],
) -> torch.Tensor:
    """This rank's causal attention output ``[b, 2c, heads, d]`` (a DTensor when the query is one, heads split
    as the query's), computed blocked (:class:`_BlockedCausalAttention`). ``masks``: the step's mask cache
    (window masks are built once a step, shared by every layer). Call after :func:`blocked_reason` said None."""
    from torch.distributed.tensor import DTensor, Shard

    q, k, v = _local_split(query, key, value)
    chunk = q.shape[2] // 2
    blocks = causal_blocks(cp, rank, chunk, window)
    needed = sorted({b.offset for b in blocks if b.offset is not None})
    spec = BlockedSpec(
        group, chunk, blocks, {d: _cached_mask(masks, d, chunk, window, q) for d in needed}, scale
    )
    out = _BlockedCausalAttention.apply(q, k, v, spec)
    if isinstance(query, DTensor):  # [b, heads, L, d] placements -> [b, L, heads, d]
        placements = [Shard(2) if isinstance(p, Shard) and p.dim == 1 else p for p in query.placements]
        return DTensor.from_local(out, query.device_mesh, placements, run_check=False)
    return out


def _cached_mask(
    masks: dict[Any, torch.Tensor], distance: int, chunk: int, window: int | None, q: torch.Tensor
) -> torch.Tensor:
    key = ("window-block", distance, chunk, window, q.dtype)
    if key not in masks:
        masks[key] = window_mask(distance, chunk, window or 0, q.dtype, q.device)
    return masks[key]
