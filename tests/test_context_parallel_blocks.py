"""Context parallelism's blocked causal attention (``apply/context_parallel_blocks.py``), in one process:

* the blocks of every rank cover exactly the (query, key) pairs the causal mask (and a sliding window) allows,
  each once, for cp 1-4 and several chunk sizes and windows;
* every cp rank simulated in one process (the all-gather answered with every rank's K/V, the reduce-scatter's
  inputs summed over the simulated ranks): each rank's output, its query gradient and the summed K/V
  gradients equal one causal attention over the whole sequence (float64, grouped-query heads, windows);
* which calls keep the mask path, and why.

The gloo runs of the whole model are in ``test_context_parallel.py``.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from hf_colossal_auto.apply import context_parallel_blocks as cpb
from hf_colossal_auto.apply.context_parallel import balanced_positions
from hf_colossal_auto.context_parallel_layout import causal_blocks


def _allowed(seq: int, window: int | None) -> torch.Tensor:
    pos = torch.arange(seq)
    allowed = pos[None, :] <= pos[:, None]
    if window is not None:
        allowed &= pos[None, :] > pos[:, None] - window
    return allowed


def _buffer_positions(seq: int, cp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Global positions of the rows of the gathered heads and tails buffers."""
    parts = [balanced_positions(seq, cp, r) for r in range(cp)]
    chunk = seq // (2 * cp)
    return torch.cat([p[:chunk] for p in parts]), torch.cat([p[chunk:] for p in parts])


def test_blocks_cover_each_allowed_pair_once():
    for cp in (1, 2, 3, 4):
        for chunk in (1, 3, 4):
            for window in (None, 1, 2, 5, 8, 13):
                _check_cover(cp, chunk, window)


def _check_cover(cp: int, chunk: int, window: int | None) -> None:
    seq = 2 * cp * chunk
    allowed = _allowed(seq, window)
    buffers = _buffer_positions(seq, cp)
    for rank in range(cp):
        queries = balanced_positions(seq, cp, rank)
        seen = torch.zeros(seq, seq, dtype=torch.int64)
        for block in causal_blocks(cp, rank, chunk, window):
            qpos = queries[block.query * chunk : (block.query + 1) * chunk]
            kpos = buffers[block.buffer][block.start : block.stop]
            assert len(kpos) > 0
            covered = torch.ones(chunk, len(kpos), dtype=torch.bool)
            if block.causal:
                covered = torch.ones(chunk, chunk, dtype=torch.bool).tril()
            if block.offset is not None:
                mask = cpb.window_mask(block.offset, chunk, window, torch.float32, torch.device("cpu"))[0, 0]
                covered = covered & (mask == 0)
            seen[qpos[:, None], kpos[None, :]] += covered.long()
        assert torch.equal(seen[queries], allowed[queries].long()), (cp, rank, chunk, window)


def _simulated_ranks(monkeypatch, cp, q, k, v, window, go):
    """Every cp rank's blocked attention in one process: outputs and query gradients at each rank's positions,
    and the K/V gradients summed over ranks (what the reduce-scatter sums) at global positions."""
    seq = q.shape[2]
    chunk = seq // (2 * cp)
    parts = [balanced_positions(seq, cp, r) for r in range(cp)]
    recorded: list[torch.Tensor] = []
    gathers = [0]

    def all_gather(out, local, group=None):  # each forward gathers the heads, then the tails
        half = gathers[0] % 2
        gathers[0] += 1
        rows = slice(half * chunk, (half + 1) * chunk)
        out.copy_(torch.cat([cpb._kv_rows(k[:, :, p], v[:, :, p], rows) for p in parts]))

    def reduce_scatter(out, full, group=None):
        recorded.append(full.clone())
        out.zero_()

    monkeypatch.setattr(dist, "get_world_size", lambda group=None: cp)
    monkeypatch.setattr(dist, "all_gather_into_tensor", all_gather)
    monkeypatch.setattr(dist, "reduce_scatter_tensor", reduce_scatter)
    outs, dqs = [], []
    for rank, pos in enumerate(parts):
        q_local = q[:, :, pos].detach().requires_grad_()
        k_local, v_local = k[:, :, pos].detach(), v[:, :, pos].detach()
        k_local.requires_grad_(), v_local.requires_grad_()
        blocks = causal_blocks(cp, rank, chunk, window)
        masks = {
            b.offset: cpb.window_mask(b.offset, chunk, window, q.dtype, q.device)
            for b in blocks
            if b.offset is not None
        }
        spec = cpb.BlockedSpec(None, chunk, blocks, masks, None)
        out = cpb._BlockedCausalAttention.apply(q_local, k_local, v_local, spec)
        out.backward(go[:, pos])  # the K/V gradients: recorded by the reduce-scatter
        outs.append(out.detach())
        dqs.append(q_local.grad)
    heads_pos, tails_pos = _buffer_positions(seq, cp)
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    for i, grad in enumerate(recorded):  # per rank: heads buffer, then tails buffer
        pos = heads_pos if i % 2 == 0 else tails_pos
        dk[:, :, pos] += grad[:, 0].permute(1, 2, 0, 3)
        dv[:, :, pos] += grad[:, 1].permute(1, 2, 0, 3)
    return parts, outs, dqs, dk, dv


@pytest.mark.parametrize("cp, window", [(2, None), (3, None), (4, None), (4, 5), (3, 2), (2, 9)])
def test_simulated_ranks_equal_one_causal_attention(monkeypatch, cp, window):
    torch.manual_seed(0)
    b, heads, kv_heads, d, chunk = 2, 4, 2, 8, 3
    seq = 2 * cp * chunk
    q = torch.randn(b, heads, seq, d, dtype=torch.float64, requires_grad=True)
    k = torch.randn(b, kv_heads, seq, d, dtype=torch.float64, requires_grad=True)
    v = torch.randn(b, kv_heads, seq, d, dtype=torch.float64, requires_grad=True)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=_allowed(seq, window), enable_gqa=True)
    ref = ref.transpose(1, 2)  # [b, seq, heads, d], the blocked attention's layout
    go = torch.randn_like(ref)
    rq, rk, rv = torch.autograd.grad(ref, (q, k, v), go)
    parts, outs, dqs, dk, dv = _simulated_ranks(
        monkeypatch, cp, q.detach(), k.detach(), v.detach(), window, go
    )
    for pos, out, dq in zip(parts, outs, dqs, strict=True):
        torch.testing.assert_close(out, ref[:, pos].detach(), rtol=0, atol=1e-12)
        torch.testing.assert_close(dq, rq[:, :, pos], rtol=0, atol=1e-12)
    torch.testing.assert_close(dk, rk, rtol=0, atol=1e-12)
    torch.testing.assert_close(dv, rv, rtol=0, atol=1e-12)


class _Attention(torch.nn.Module):
    is_causal = True


@pytest.mark.parametrize(
    "base, padded, kwargs, q_dtype, words",
    [
        ("sdpa", False, {}, torch.float32, None),
        ("sdpa", False, {"sliding_window": 4, "scaling": 0.3}, torch.bfloat16, None),
        ("eager", False, {}, torch.float32, "attn_implementation 'eager'"),
        ("sdpa", True, {}, torch.float32, "padding mask or packed documents"),
        ("sdpa", False, {"dropout": 0.1}, torch.float32, "attention dropout"),
        ("sdpa", False, {"is_causal": False}, torch.float32, "non-causal"),
        ("sdpa", False, {"softcap": 30.0}, torch.float32, "'softcap'"),
        ("sdpa", False, {}, torch.int64, "no attention kernel"),
        ("sdpa", False, {}, torch.float64, "different dtypes"),
    ],
)
def test_blocked_reason_says_why_the_mask_path_runs(base, padded, kwargs, q_dtype, words):
    q = torch.zeros(1, 4, 8, 16, dtype=q_dtype)
    kv = torch.zeros(1, 2, 8, 16, dtype=torch.float32 if q_dtype == torch.float64 else q_dtype)
    reason = cpb.blocked_reason(_Attention(), base, q, kv, kv, padded, kwargs)
    if words is None:
        assert reason is None
    else:
        assert words in reason, reason
