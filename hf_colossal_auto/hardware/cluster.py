"""A cluster of identical devices and the device meshes the planner may lay over it.

Ranks are assumed to be numbered node by node (rank ``r`` lives on node
``r // devices_per_node``), which is what torchrun and SLURM produce, and a
mesh assigns ranks row-major (last mesh axis fastest), exactly like
``torch.distributed.device_mesh.init_device_mesh``.  Under these two rules we
can tell, for every mesh axis, whether its process groups stay inside a node
(fast NVLink/PCIe link) or cross nodes (network link), which is what makes e.g.
"TP inside the node, DP across nodes" cheaper than the transpose.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from functools import lru_cache

from hf_colossal_auto.hardware.comm import collective_time
from hf_colossal_auto.hardware.spec import DeviceSpec, LinkSpec

__all__ = ["ClusterSpec", "mesh_shapes", "axis_spans_nodes", "launcher_devices_per_node"]


def launcher_devices_per_node(world_size: int) -> int | None:
    """Processes per node of the running job, as its launcher says (``LOCAL_WORLD_SIZE``: torchrun and
    ``accelerate launch`` set it on every process), when that splits ``world_size`` into nodes; None where the
    launcher says nothing or something that cannot be (the device preset's own figure then stands)."""
    value = os.environ.get("LOCAL_WORLD_SIZE")
    if value is None or not value.isdigit():
        return None
    local = int(value)
    return local if 1 <= local <= world_size and world_size % local == 0 else None


def mesh_shapes(num_devices: int) -> list[tuple[int, ...]]:
    """Candidate meshes for ``num_devices``: the 1-D mesh, then every 2-D ``(dp, tp)``.

    Order (deterministic, relied upon by the solver's tie-breaking): ``(N,)``
    first, then ``(dp, tp)`` with ``dp * tp == N`` by increasing ``dp``.  So
    ``mesh_shapes(8) == [(8,), (1, 8), (2, 4), (4, 2), (8, 1)]``.  Degenerate
    2-D shapes with a size-1 axis are kept on purpose: ``(1, N)`` is "pure TP"
    and ``(N, 1)`` "pure DP" in the solver's (dp, tp) vocabulary.
    """
    if isinstance(num_devices, bool) or not isinstance(num_devices, int) or num_devices < 1:
        raise ValueError(f"num_devices must be an int >= 1, got {num_devices!r}")
    shapes: list[tuple[int, ...]] = [(num_devices,)]
    shapes.extend((dp, num_devices // dp) for dp in range(1, num_devices + 1) if num_devices % dp == 0)
    return shapes


@lru_cache(maxsize=4096)
def axis_spans_nodes(mesh_shape: tuple[int, ...], axis: int, devices_per_node: int) -> bool:
    """True if any process group along ``axis`` of a row-major mesh contains ranks of two nodes.

    Checked by enumerating the groups, which is exact for every shape
    (including uneven ones where only some groups straddle a node boundary);
    the result is cached because the solver asks the same few questions
    thousands of times.
    """
    ndim = len(mesh_shape)
    if not -ndim <= axis < ndim:
        raise ValueError(f"axis {axis} out of range for mesh {mesh_shape}")
    axis %= ndim
    size = mesh_shape[axis]
    if size == 1:
        return False
    stride = math.prod(mesh_shape[axis + 1 :])
    total = math.prod(mesh_shape)
    block = size * stride  # ranks [k*block, (k+1)*block) hold `stride` complete groups
    for block_start in range(0, total, block):
        for offset in range(stride):
            first = block_start + offset
            last = first + (size - 1) * stride
            if first // devices_per_node != last // devices_per_node:
                return True
    return False


@dataclass(frozen=True)
class ClusterSpec:
    """``num_devices`` identical devices, ``devices_per_node`` to a node.

    ``devices_per_node=None`` means the device's default (8 for datacenter
    GPUs), capped at ``num_devices`` so that a 4-GPU job is one node.  After
    construction ``devices_per_node`` is always an int.

    Raises:
        ValueError: if ``num_devices`` is not a multiple of ``devices_per_node``
            (when it spans more than one node): partially-filled nodes would
            make link assignment depend on rank placement we cannot know.
    """

    device: DeviceSpec
    num_devices: int
    devices_per_node: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.device, DeviceSpec):
            raise ValueError(f"ClusterSpec.device must be a DeviceSpec, got {self.device!r}")
        if (
            isinstance(self.num_devices, bool)
            or not isinstance(self.num_devices, int)
            or self.num_devices < 1
        ):
            raise ValueError(f"ClusterSpec.num_devices must be an int >= 1, got {self.num_devices!r}")
        per_node = self.device.devices_per_node if self.devices_per_node is None else self.devices_per_node
        if isinstance(per_node, bool) or not isinstance(per_node, int) or per_node < 1:
            raise ValueError(f"ClusterSpec.devices_per_node must be an int >= 1, got {per_node!r}")
        per_node = min(per_node, self.num_devices)
        if self.num_devices % per_node != 0:
            raise ValueError(
                f"num_devices={self.num_devices} is not a multiple of devices_per_node={per_node}; "
                "nodes must be fully populated"
            )
        object.__setattr__(self, "devices_per_node", per_node)

    @property
    def num_nodes(self) -> int:
        """Number of nodes."""
        return self.num_devices // self._per_node

    @property
    def _per_node(self) -> int:
        # devices_per_node is resolved to an int in __post_init__; this keeps type checkers honest.
        assert self.devices_per_node is not None
        return self.devices_per_node

    def mesh_shapes(self) -> list[tuple[int, ...]]:
        """:func:`mesh_shapes` for this cluster's device count."""
        return mesh_shapes(self.num_devices)

    def _check_mesh(self, mesh_shape: tuple[int, ...]) -> tuple[int, ...]:
        shape = tuple(mesh_shape)
        if not shape or any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in shape):
            raise ValueError(f"mesh_shape must be a non-empty tuple of ints >= 1, got {mesh_shape!r}")
        if math.prod(shape) != self.num_devices:
            raise ValueError(
                f"mesh {shape} has {math.prod(shape)} devices but the cluster has {self.num_devices}"
            )
        return shape

    def axis_crosses_nodes(self, mesh_shape: tuple[int, ...], axis: int) -> bool:
        """True when the process groups along ``axis`` (row-major layout) span more than one node."""
        return axis_spans_nodes(self._check_mesh(mesh_shape), axis, self._per_node)

    def axis_link(self, mesh_shape: tuple[int, ...], axis: int) -> LinkSpec:
        """The link collectives along ``axis`` of ``mesh_shape`` run over.

        Inter-node if any group along the axis spans nodes (the slowest hop
        bounds a ring), intra-node otherwise.  E.g. 16 devices, 8 per node:
        mesh (2, 8) axis 1 and mesh (4, 4) axis 1 are intra-node; their axis 0
        and the 1-D mesh (16,) are inter-node.
        """
        if self.axis_crosses_nodes(mesh_shape, axis):
            return self.device.inter_node_link
        return self.device.intra_node_link

    def hybrid_shard_size(self, mesh_shape: tuple[int, int]) -> int | None:
        """The shard group of hybrid sharded data parallelism (HSDP) on a ``(dp, tp)`` mesh, or None where HSDP
        has no point.

        The data-parallel axis becomes ``(dp // s, s)`` (replicate, shard; row-major, so the shard group holds
        consecutive ranks): with ``s = devices_per_node // tp`` every shard group is one node's worth of
        data-parallel ranks, so FSDP's per-block all-gathers and reduce-scatters stay on the intra-node link and
        only the all-reduce of the shards crosses nodes. None unless the data-parallel axis spans nodes (else
        plain FSDP is already intra-node), ``tp`` divides a node and ``1 < s < dp`` divides ``dp``.
        """
        dp, tp = self._check_mesh(tuple(mesh_shape))
        if self._per_node % tp or not self.axis_crosses_nodes((dp, tp), 0):
            return None
        shard = self._per_node // tp
        if not 1 < shard < dp or dp % shard:
            return None
        return shard

    def hybrid_links(self, mesh_shape: tuple[int, int], shard: int) -> tuple[LinkSpec, LinkSpec]:
        """(replicate link, shard link) of HSDP with shard groups of ``shard`` ranks on a ``(dp, tp)`` mesh:
        the links of axes 0 and 1 of the 3-D mesh ``(dp // shard, shard, tp)`` the runtime builds."""
        dp, tp = self._check_mesh(tuple(mesh_shape))
        if shard < 1 or dp % shard:
            raise ValueError(
                f"an HSDP shard group of {shard} ranks does not divide the data-parallel axis of {dp}"
            )
        shape = (dp // shard, shard, tp)
        return self.axis_link(shape, 0), self.axis_link(shape, 1)

    def collective_time(
        self, kind: str, nbytes: int | float, mesh_shape: tuple[int, ...], axis: int
    ) -> float:
        """Seconds for collective ``kind`` of ``nbytes`` over ``axis`` of ``mesh_shape``.

        Convenience for ``collective_time(kind, nbytes, mesh_shape[axis], axis_link(...))``.
        """
        shape = self._check_mesh(mesh_shape)
        return collective_time(kind, nbytes, shape[axis], self.axis_link(shape, axis))
