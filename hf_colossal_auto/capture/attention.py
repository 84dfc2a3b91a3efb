"""Trace the attention kernels the *target* device would run, not the host's.

``scaled_dot_product_attention`` picks its kernel at dispatch time from the device it runs on. Profiling for a
GPU on a CPU host would otherwise record the CPU choice — in training (dropout > 0) the math path, which
materialises and saves the full ``heads × seq × seq`` score matrix in fp32, tens of times the memory the
GPU's flash kernel keeps. While tracing for a CUDA target we route the call to the CUDA kernels' aten ops,
whose shape functions run fine on fake tensors: flash attention when there is no explicit mask and the dtype
is half precision (what PyTorch picks on Ampere and newer), memory-efficient attention otherwise. Both have
FLOP formulas in torch's registry and save just q, k, v, the output and the log-sum-exp for backward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F

aten = torch.ops.aten
_original_sdpa = F.scaled_dot_product_attention


def _cuda_sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    if query.dim() != 4:
        return _original_sdpa(
            query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa
        )
    # autocast casts scaled_dot_product_attention's inputs to its dtype (it is on autocast's lower-precision
    # list); the kernels called directly below are not, so cast as it would: fp32 q/k from RoPE's fp32 tables
    # would otherwise pick the fp32 memory-efficient kernel where the GPU runs a half-precision one
    autocast = _autocast_dtype()
    if autocast is not None:
        query, key, value = (t.to(autocast) if t.is_floating_point() else t for t in (query, key, value))
    if enable_gqa and key.shape[-3] != query.shape[-3]:
        groups = query.shape[-3] // key.shape[-3]
        key = key.repeat_interleave(groups, dim=-3)
        value = value.repeat_interleave(groups, dim=-3)
    if attn_mask is None and query.dtype in (torch.float16, torch.bfloat16):
        return aten._scaled_dot_product_flash_attention(
            query, key, value, dropout_p, is_causal, False, scale=scale
        )[0]
    bias = attn_mask
    if bias is not None:
        if bias.dtype == torch.bool:
            bias = torch.zeros(bias.shape, dtype=query.dtype, device=query.device).masked_fill(
                ~bias, float("-inf")
            )
        else:
            bias = bias.to(query.dtype)
        b, h, lq, lk = query.shape[0], query.shape[1], query.shape[2], key.shape[2]
        bias = bias.expand(b, h, lq, lk)
    return aten._scaled_dot_product_efficient_attention(
        query, key, value, bias, True, dropout_p, is_causal and bias is None, scale=scale
    )[0]


def _autocast_dtype() -> torch.dtype | None:
    """The dtype autocast would cast ``scaled_dot_product_attention``'s inputs to, if autocast is on."""
    for device_type in ("cuda", "cpu"):
        if torch.is_autocast_enabled(device_type):
            return torch.get_autocast_dtype(device_type)
    return None


@contextlib.contextmanager
def target_attention_kernels(device_kind: str) -> Iterator[None]:
    """Within the block, ``F.scaled_dot_product_attention`` runs the kernels of ``device_kind`` ("cuda"/"cpu")."""
    if device_kind != "cuda":
        yield
        return
    F.scaled_dot_product_attention = _cuda_sdpa
    try:
        yield
    finally:
        F.scaled_dot_product_attention = _original_sdpa
