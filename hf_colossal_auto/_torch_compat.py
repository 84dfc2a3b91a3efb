"""The one place that touches private or fast-moving torch APIs.

Everything else in the package imports these names from here, so that a torch upgrade that moves a
private symbol is fixed in one file. Each import says which public behaviour we rely on.
"""

from __future__ import annotations

from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode  # fake tensors: shapes, no memory
from torch.distributed._tools.mod_tracker import ModTracker  # module FQN tracking through fwd and bwd
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.flop_counter import flop_registry as _torch_flop_registry
from torch.utils.weak import WeakIdKeyDictionary

__all__ = [
    "FakeTensor",
    "FakeTensorMode",
    "ModTracker",
    "TorchDispatchMode",
    "WeakIdKeyDictionary",
    "flop_registry",
    "fake_process_group",
    "tree_flatten",
    "tracked_module_name",
    "tree_map",
]

# FlopCounterMode's own registry, keyed by OpOverloadPacket. We read it (never mutate it) so that our
# per-op FLOPs are by construction what FlopCounterMode counts.
flop_registry = _torch_flop_registry


def fake_process_group(world_size: int, rank: int = 0) -> None:
    """Initialise torch.distributed with the in-process fake backend (no communication, any world size).

    Used by the planner to build device meshes and price DTensor collectives without processes.
    """
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        return
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)


def tracked_module_name(tracker: ModTracker, module: object) -> str:
    """ModTracker's name for ``module`` (``"<RootClass>.<fqn>"``); a private method of ModTracker."""
    return tracker._get_mod_name(module)
