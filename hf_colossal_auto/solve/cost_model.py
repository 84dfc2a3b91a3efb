"""Seconds and bytes of sharding choices: compute on local shapes, resharding as collectives on a mesh axis.

Everything is priced in seconds from the hardware model (roofline per kernel, alpha-beta per collective),
never in FLOPs glued to seconds by a factor.

Resharding one tensor of ``n`` logical bytes over a mesh axis of ``p`` devices (what DTensor's redistribute
runs):

=============  ================================  =========================
from -> to     collective                         bytes passed to the model
=============  ================================  =========================
R -> S, R -> P  none (local slice / local zero)   -
S -> R          all-gather                        n (the gathered output)
P -> R          all-reduce                        n
P -> S          reduce-scatter                    n (the input)
S(a) -> S(b)    all-to-all                        n / p (per-rank buffer)
                (CPU/gloo: all-gather, then chunk  n)
S -> P          all-gather, then local            n
=============  ================================  =========================

These are the collectives DTensor's ``redistribute`` issues (checked against ``CommDebugMode`` in the tests);
DTensor's shard-to-shard redistribution does not use all-to-all on CPU meshes (``shard_dim_alltoall`` falls
back to an all-gather and keeps its chunk, though gloo has all-to-all), so neither does the price.

Backward reverses each edge for the gradient: a consumer that computes with a replicated input while
splitting its work produces a *partial* input gradient, which the producer then needs replicated (the
all-reduce Megatron's "f" operator performs); a sharded input gets a sharded gradient.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..hardware.catalog import LinkSpec
from ..hardware.comm import collective_time
from ..strategies.placements import is_partial, is_shard


@dataclass(frozen=True)
class AxisComm:
    """Collective timing on one mesh axis: its size and the link its ranks talk over."""

    size: int
    link: LinkSpec
    device_kind: str = "cuda"
    """"cpu" meshes: DTensor redistributes shard to shard by all-gather there, not all-to-all."""
    call_overhead_s: float = 0.0
    """Fixed cost of issuing one collective (a kernel launch), on top of the alpha-beta time: two collectives
    that move what one does are not free to split."""

    via: str | None = None
    """The layer that issues this axis's collectives ("dtensor" for tensor-parallel redistributions): where
    the link has a fit measured through it, that fit prices the whole call (copies and bookkeeping included,
    so no separate call overhead)."""

    _times: dict[tuple[str, float], float] = field(
        default_factory=dict, init=False, repr=False, compare=False, hash=False
    )
    """Seconds already priced, by (kind, bytes): a problem prices the same few tensor sizes hundreds of
    thousands of times (every producer/consumer pair of strategies of every edge)."""

    def time(self, kind: str, nbytes: float) -> float:
        if self.size == 1 or nbytes == 0:
            return 0.0
        key = (kind, nbytes)
        seconds = self._times.get(key)
        if seconds is None:
            overhead = 0.0 if self.link.measured_through(self.via, kind) else self.call_overhead_s
            seconds = collective_time(kind, nbytes, self.size, self.link, self.via) + overhead
            self._times[key] = seconds
        return seconds


DP_MODES = ("ddp", "fsdp", "hsdp")
"""Data-parallel modes: DDP (replicas), FSDP (sharded over the whole data-parallel axis) and HSDP (sharded inside
a group of ranks, the groups replicas of each other)."""
SHARDED_DP_MODES = ("fsdp", "hsdp")
"""The modes that shard parameters, gradients and optimizer state (FSDP2 runs both)."""


@dataclass(frozen=True)
class HybridComm:
    """The two process groups of hybrid sharded data parallelism (HSDP) on a data-parallel axis of
    ``shard.size * replicate.size`` ranks: FSDP's all-gathers and reduce-scatters run in the shard group (laid
    inside a node, on its fast link), one all-reduce of each gradient shard in the replicate group (across
    nodes). Why two: a flat FSDP group spanning nodes puts every per-block all-gather on the network."""

    shard: AxisComm
    replicate: AxisComm

    @property
    def size(self) -> int:
        """Ranks of the whole data-parallel axis."""
        return self.shard.size * self.replicate.size


def hybrid_comm(dp_comm: AxisComm | HybridComm) -> HybridComm:
    """``dp_comm`` as the two groups HSDP is priced on; a single axis is a caller's mistake."""
    if not isinstance(dp_comm, HybridComm):
        raise TypeError("dp_mode 'hsdp' is priced on a HybridComm (its shard and replicate groups)")
    return dp_comm


def data_parallel_shard_size(dp_mode: str, dp: int, dp_comm: AxisComm | HybridComm) -> int:
    """How many ranks split a parameter's data-parallel copy (its storage, gradient and optimizer state): none
    under DDP, the whole axis under FSDP, the shard group under HSDP."""
    if dp_mode not in DP_MODES:
        raise ValueError(f"dp_mode must be one of {DP_MODES}, got {dp_mode!r}")
    if dp_mode == "hsdp":
        return hybrid_comm(dp_comm).shard.size
    return dp if dp_mode == "fsdp" else 1


def redistribute(src: str, dst: str, nbytes: float, axis: AxisComm) -> tuple[float, str | None]:
    """Seconds to move a tensor from placement ``src`` to ``dst`` on ``axis``, and the collective used."""
    if src == dst or axis.size == 1 or nbytes == 0:
        return 0.0, None
    if src == "R":
        return 0.0, None  # slicing or zeroing a replica is local
    if is_shard(src):
        if dst == "R" or is_partial(dst):
            return axis.time("all_gather", nbytes), "all_gather"
        if axis.device_kind == "cpu":
            return axis.time("all_gather", nbytes), "all_gather"
        return axis.time("all_to_all", nbytes / axis.size), "all_to_all"
    if is_partial(src):
        if dst == "R":
            return axis.time("all_reduce", nbytes), "all_reduce"
        if is_shard(dst):
            return axis.time("reduce_scatter", nbytes), "reduce_scatter"
        return 0.0, None  # P(sum) -> P(sum)
    raise ValueError(f"cannot price a redistribution from {src!r} to {dst!r}")


def splits_work(inputs: tuple, outputs: tuple) -> bool:
    """True when a strategy divides the op's work over the axis (any input or output not replicated)."""
    return any(p is not None and p != "R" for p in (*inputs, *outputs))


def gradient_at_consumer(input_placement: str | None, work_split: bool) -> str:
    """Placement of the gradient a consumer produces for one of its inputs."""
    if input_placement is None or input_placement == "R":
        return "P" if work_split else "R"
    if is_partial(input_placement):
        return "R"
    return input_placement


def gradient_at_producer(output_placement: str) -> str:
    """Placement the producer needs its output's gradient in."""
    return output_placement if is_shard(output_placement) else "R"


def shard_factor(placement: str | None, axis_size: int) -> int:
    """How many pieces a tensor with this placement is split into on the axis (memory and traffic)."""
    return axis_size if is_shard(placement) else 1
