"""Run the runtime symbolically: which collectives does one training step of a plan issue, and how big?

The planner's ILP prices communication with its own model of each op's strategy, while the runtime lets
DTensor's sharding propagation choose between parameters, so the two can differ. This answers the runtime side
exactly and cheaply, the way the profiler answers memory: apply the plan to a copy of the model under fake
tensors and the in-process fake process group, run forward + backward, and record every collective DTensor
issues with its payload. Nothing is computed or communicated.
"""

from __future__ import annotations

import copy
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from .._torch_compat import FakeTensorMode, TorchDispatchMode, fake_process_group
from ..capture.hf_masks import eager_mask_decisions
from ..capture.inputs import drop_all_ones_masks
from ..plan import Plan
from .runtime import apply_plan, build_mesh

_KINDS = {
    "all_reduce": "all_reduce",
    "all_gather_into_tensor": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "all_to_all_single": "all_to_all",
    "shard_dim_alltoall": "all_to_all",
    "broadcast": "broadcast",
}


@dataclass
class SimulatedComm:
    """Collectives of one step as the runtime issues them, by kind: how many, and the bytes each rank sends in."""

    counts: dict[str, int] = field(default_factory=dict)
    bytes: dict[str, int] = field(default_factory=dict)


class _CollectiveRecorder(TorchDispatchMode):
    """Counts collectives on plain tensors. For ops on DTensors it steps aside (NotImplemented) so that DTensor
    runs first and the collectives it desugars into come back through here — CommDebugMode's technique."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[str, int] = defaultdict(int)
        self.bytes: dict[str, int] = defaultdict(int)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **kwargs)
        if any(t is DTensor for t in types):
            return NotImplemented
        kind = _KINDS.get(func._overloadpacket.__name__)
        if kind is not None and func.namespace in ("_c10d_functional", "c10d_functional", "_dtensor"):
            first = next((a for a in args if isinstance(a, torch.Tensor)), None)
            if func._overloadpacket.__name__ == "shard_dim_alltoall" and first is not None and first.is_cpu:
                # a CPU mesh runs it as an all-gather and a chunk (gloo has no all-to-all; torch's
                # ``shard_dim_alltoall``), except under LocalTensorMode, which simulates ranks: count what a
                # gloo run sends
                kind = "all_gather"
            self.counts[kind] += 1
            if first is not None:
                self.bytes[kind] += first.numel() * first.element_size()
        return func(*args, **kwargs)


def _fake_state(model: nn.Module, fake: FakeTensorMode) -> None:
    """Swap ``model``'s parameters and buffers for fake copies (tied ones stay tied: the mode memoises by
    tensor), so that applying a plan and running the step allocate nothing."""
    made: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is not None:
                if id(param) not in made:
                    made[id(param)] = nn.Parameter(fake.from_tensor(param), requires_grad=param.requires_grad)
                module._parameters[name] = made[id(param)]
        for name, buf in list(module._buffers.items()):
            if buf is not None:
                module._buffers[name] = fake.from_tensor(buf)


def simulate_collectives(model: nn.Module, plan: Plan, example_inputs: Mapping[str, Any]) -> SimulatedComm:
    """Collectives of one forward + backward of ``plan`` applied to a copy of ``model`` (one rank's view).

    Runs outside a training job: it uses the fake process group (started, or re-started at the plan's world
    size). ``example_inputs`` is one tensor-parallel group's batch.
    """
    if dist.is_initialized() and dist.get_backend() != "fake":
        raise RuntimeError(
            "simulate_collectives runs outside a training job (it needs the fake process group)"
        )
    world = 1
    for size in plan.mesh_shape:
        world *= size
    if dist.is_initialized() and dist.get_world_size() != world:
        dist.destroy_process_group()
    if not dist.is_initialized():
        fake_process_group(world)
    batch = drop_all_ones_masks(example_inputs)
    replica = copy.deepcopy(model)
    mesh = build_mesh(plan, "cpu")
    recorder = _CollectiveRecorder()
    with FakeTensorMode(allow_non_fake_inputs=True) as fake:
        _fake_state(replica, fake)
    # Outside the mode: apply_plan's agreement between ranks pickles Python objects through real tensors
    # (a fake one has no value to read back); the fake parameters still compute under their own mode.
    apply_plan(replica, plan, mesh)
    with fake:
        fake_batch = {k: fake.from_tensor(v) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
        with recorder, eager_mask_decisions(batch):
            replica(**fake_batch).loss.backward()
    return SimulatedComm(dict(recorder.counts), dict(recorder.bytes))
