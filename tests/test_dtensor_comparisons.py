"""Scripts compare a planned model's parameters and gradients (DTensors) with ordinary tensors —
``torch.allclose(param.grad, reference.grad)`` in accelerate's own test scripts. DTensor has no rule for such
ops (they answer a Python value), so the runtime answers them on the full values, as one process would."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from hf_colossal_auto.apply import register_runtime_rules


def test_allclose_of_a_dtensor_and_a_plain_tensor_is_one_process_answer(tmp_path):
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        register_runtime_rules()
        mesh = init_device_mesh("cpu", (1,))
        value = torch.arange(6.0).reshape(2, 3)
        for placement in (Replicate(), Shard(0), Shard(1)):
            planned = distribute_tensor(value, mesh, [placement])
            assert torch.allclose(planned, value) is True
            assert torch.allclose(planned, value + 1e-3) is False
            assert torch.allclose(value, planned) is True
    finally:
        dist.destroy_process_group()
