"""The runtime runs a sharded projection with the one strategy its weight's placement allows (apply/enforce.py).

At shapes where a weight is smaller than the activation it multiplies, DTensor's own choice for a
column-parallel Linear fed a batch-sharded input is to gather the *weight* (and to reshard the output later);
the plan priced gathering the input. These tests hold the runtime to the plan's choice and to exact values.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from hf_colossal_auto.apply.enforce import enforce_projection_inputs
from hf_colossal_auto.apply.simulate import _CollectiveRecorder


def _sharded(dense: nn.Linear, mesh, dim: int) -> nn.Linear:
    linear = nn.Linear(dense.in_features, dense.out_features, bias=False)
    linear.weight = nn.Parameter(distribute_tensor(dense.weight.detach(), mesh, [Shard(dim)]))
    return linear


def test_column_parallel_linear_gathers_its_input_not_its_weight(two_ranks):
    torch.manual_seed(0)
    dense = nn.Linear(8, 6, bias=False)
    # 512 input values against 48 weight values: left to itself, DTensor would gather the weight
    x = torch.randn(4, 16, 8, requires_grad=True)
    expected = dense(x)
    expected.sum().backward()
    linear = _sharded(dense, two_ranks, 0)
    assert enforce_projection_inputs(linear) == 1
    xd = distribute_tensor(x.detach(), two_ranks, [Shard(0)]).requires_grad_()
    recorder = _CollectiveRecorder()
    with recorder:
        out = linear(xd)
    assert out.placements == (Shard(2),)
    assert dict(recorder.counts) == {"all_gather": 1}
    assert recorder.bytes["all_gather"] == 2 * 16 * 8 * 4  # each rank hands in its half of the input
    torch.testing.assert_close(out.full_tensor(), expected.detach())
    out.sum().backward()
    torch.testing.assert_close(xd.grad.full_tensor(), x.grad)
    torch.testing.assert_close(linear.weight.grad.full_tensor(), dense.weight.grad)


def test_row_parallel_linear_slices_a_replicated_input(two_ranks):
    torch.manual_seed(0)
    dense = nn.Linear(8, 6, bias=False)
    x = torch.randn(4, 16, 8)
    linear = _sharded(dense, two_ranks, 1)
    enforce_projection_inputs(linear)
    recorder = _CollectiveRecorder()
    with recorder:
        out = linear(distribute_tensor(x, two_ranks, [Replicate()]))
    assert isinstance(out, DTensor) and out.placements[0].is_partial()
    assert dict(recorder.counts) == {}
    torch.testing.assert_close(out.full_tensor(), dense(x).detach())
