"""Communication pricing: alpha-beta collectives per mesh axis (:class:`AxisComm`, HSDP's :class:`HybridComm`),
DTensor's redistributions between placements, the reshardings of an edge (forward value and backward gradient)
and at module boundaries, and the data-parallel gradient synchronisation with its overlap."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ...capture.graph import OpNode, StepGraph
from ...hardware.catalog import DeviceSpec, LinkSpec
from ...hardware.comm import collective_time
from ...strategies.placements import Strategy, is_partial, is_shard, reduced_lookup
from ..build.names import NodeKind
from ..problem import (
    DecisionNode,
    Overlap,
)

if TYPE_CHECKING:
    from .compute import BackwardRatios


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


_MEAN_REDUCTION = 1  # torch's Reduction.MEAN


def boundary_reshardings(
    graph: StepGraph,
    node: OpNode,
    strat: Strategy,
    axis: int,
    comm: AxisComm,
    returned_as: Mapping[int, str | None] | None = None,
) -> list[tuple[float, str, float]]:
    """Collectives an op's strategy costs outside the edges between ops: ``(seconds, kind, bytes)`` each.

    * An output the model returns (its loss, its logits) is handed to the caller as an ordinary tensor, so a
      sharded or partial one is gathered or reduced in forward (the runtime's ``wrap_forward``). A partial one
      that its module's boundary gives its reader's placement first (``returned_as``: output position -> that
      placement, :func:`~hf_colossal_auto.solve.tied.returned_through_hook`) is gathered from there;
      ``None``: not known here (the edge to the reader prices it).
    * ``nll_loss`` with mean reduction and class weights: DTensor's backward kernel needs the total weight
      replicated, so a partial total weight (a batch- or sequence-sharded loss) is all-reduced in backward.
      Without class weights the runtime computes the mean as a sum over the count of targets
      (``apply/enforce.py::_exact_mean_loss``), which needs no total weight.
    * An embedding lookup into a vocab-sharded table: the runtime all-reduces the partial sum DTensor makes
      where the lookup makes it (:func:`~hf_colossal_auto.strategies.placements.reduced_lookup`), once for
      all its readers; the strategy's output says replicated, what the readers receive.
    """
    out: list[tuple[float, str, float]] = []
    if reduced_lookup(node.op, strat, axis) and node.outputs:
        nbytes = float(graph.values[node.outputs[0]].nbytes)
        seconds, kind = redistribute("P", "R", nbytes, comm)
        if kind:
            out.append((seconds, kind, nbytes))
    returned = set(graph.output_values)
    for pos, vid in enumerate(node.outputs):
        if vid in returned and pos < len(strat.output_placements):
            nbytes = float(graph.values[vid].nbytes)
            made = strat.output_placements[pos][axis]
            if is_partial(made) and returned_as is not None and pos in returned_as:
                if returned_as[pos] is None:
                    continue
                made = returned_as[pos] or made
            seconds, kind = redistribute(made, "R", nbytes, comm)
            if kind:
                out.append((seconds, kind, nbytes))
    if node.op.startswith("aten.nll_loss") and "forward" in node.op and len(strat.output_placements) > 1:
        args = node.args[0] if isinstance(node.args, tuple) and node.args else ()
        reduction = args[3] if len(args) > 3 else _MEAN_REDUCTION
        weighted = len(args) > 2 and args[2] is not None
        # unweighted: the runtime sums over split rows and divides by the targets' count
        # (apply/enforce.py::_exact_mean_loss), so no total weight is reduced
        if reduction == _MEAN_REDUCTION and weighted:
            nbytes = float(graph.values[node.outputs[1]].nbytes)
            seconds, kind = redistribute(strat.output_placements[1][axis], "R", nbytes, comm)
            if kind:
                out.append((seconds, kind, nbytes))
    return out


def data_parallel_sync_time(
    dp_mode: str, local_bytes: float, dp_comm: AxisComm | HybridComm, micro_batches: int = 1
) -> float:
    """Seconds of one parameter's data-parallel synchronisation per step: DDP all-reduces its gradient; FSDP
    all-gathers it for forward and again for backward and reduce-scatters its gradient. HSDP does FSDP's three
    in its shard group (inside a node) and all-reduces the gradient shard (1/shard of the bytes) over its
    replicate group (across nodes): only that all-reduce pays the network. With k micro-batches the gradient
    is synchronised once (after the last one), but FSDP gathers the parameter for every one."""
    if dp_mode == "hsdp":
        hybrid = hybrid_comm(dp_comm)
        in_node = data_parallel_sync_time("fsdp", local_bytes, hybrid.shard, micro_batches)
        return in_node + hybrid.replicate.time("all_reduce", local_bytes / hybrid.shard.size)
    if dp_mode == "fsdp":
        gathers = 2 * micro_batches * dp_comm.time("all_gather", local_bytes)
        return gathers + dp_comm.time("reduce_scatter", local_bytes)
    return dp_comm.time("all_reduce", local_bytes)


def data_parallel_overlap(
    nodes: list[DecisionNode],
    sync_terms: dict[str, list[float]],
    dp_mode: str,
    ratios: BackwardRatios,
    block_of: dict[str, str],
    spec: DeviceSpec,
    micro_batches: int = 1,
) -> list[Overlap]:
    """The data-parallel synchronisation as communication behind computation, as the runtime runs it: DDP's
    gradient all-reduces are started as gradients are accumulated and run behind the rest of backward
    (``runtime._make_sync_hook``); FSDP2 prefetches the next block's all-gather in forward and backward and
    reduce-scatters behind the next block's backward, so all of the step's compute can hide it. The ops' own
    costs (forward + backward) are the computation; for DDP only their backward share — of the last micro-batch
    alone when there are several (the gradients are all-reduced during its backward only)."""
    if not sync_terms:
        return []
    compute: dict[str, list[float]] = {}
    for node in nodes:
        if node.name in sync_terms or node.kind != NodeKind.OP:
            continue
        share = 1.0
        if dp_mode not in SHARDED_DP_MODES:
            share = ratios.backward_share(block_of.get(node.name, "")) / micro_batches
        if any(node.costs):
            compute[node.name] = [c * share for c in node.costs]
    return [Overlap("data-parallel", dict(sync_terms), compute, spec.overlap_efficiency)]


def edge_reshardings(
    src_place: str,
    consumer: Strategy,
    k: int,
    nbytes: float,
    axis: int,
    comm: AxisComm,
    *,
    param: bool = False,
    consumers: int = 1,
    forward: bool = True,
    partial_to: str | None = None,
    partial_elsewhere: bool = False,
    needs_grad: bool = True,
) -> list[tuple[float, str, float]]:
    """(seconds, collective, how many of it) of one producer->consumer use: the forward resharding of the value and the
    backward resharding of its gradient.

    A value read by several consumers gets the sum of their gradients. Partial gradients are summed locally
    before a single reduction (what autograd's accumulation does with partial DTensors), so each of the
    ``consumers`` readers carries ``1/consumers`` of that reduction; exact when the readers agree (q, k and v
    projections of one normed input), an undercount when only some of them produce partial gradients.
    ``forward=False`` leaves the forward resharding out (a use in :func:`shared_projection_inputs`: priced
    once for all its readers by a :class:`SharedCost`). ``partial_to``: a partial gradient of a view passes
    through it and is reduced where the viewed value was made, to this placement (``consumers`` then counts
    that value's readers). ``partial_elsewhere``: a partial gradient is reduced to a parameter's storage, or
    passes back through a cast to where the value cast was made, and is priced on another edge
    (``_EdgesPart._storage_partial``, ``_EdgesPart._root_partial``), not here. A value that needs no
    gradient (RoPE's cos/sin, masks) has no backward part.
    """
    spec = consumer.input_placements[k] if k < len(consumer.input_placements) else None
    dst = spec[axis] if spec is not None else src_place
    out: list[tuple[float, str, float]] = []
    t, kind = redistribute(src_place, dst, nbytes, comm)
    if kind and forward:
        out.append((t, kind, 1.0))
    if not needs_grad:
        return out
    ins = tuple(p[axis] if p is not None else None for p in consumer.input_placements)
    outs = tuple(p[axis] for p in consumer.output_placements)
    grad_from = gradient_at_consumer(dst, splits_work(ins, outs))
    if grad_from == "P" and partial_elsewhere and spec is not None:
        return out
    grad_to = src_place if param and is_shard(src_place) else gradient_at_producer(src_place)
    if grad_from == "P" and partial_to is not None:
        grad_to = partial_to
    t, kind = redistribute(grad_from, grad_to, nbytes, comm)
    if kind:
        share = 1.0 / consumers if grad_from == "P" else 1.0
        out.append((t * share, kind, share))
    return out


def _partial_gradient(consumer: Strategy, k: int, axis: int) -> bool:
    """Whether ``consumer`` makes a partial gradient for its input ``k`` (read replicated by a split op)."""
    spec = consumer.input_placements[k] if k < len(consumer.input_placements) else None
    if spec is None:
        return False  # reads whatever arrives: priced on the view's edge (see :func:`edge_reshardings`)
    ins = tuple(p[axis] if p is not None else None for p in consumer.input_placements)
    outs = tuple(p[axis] for p in consumer.output_placements)
    return gradient_at_consumer(spec[axis], splits_work(ins, outs)) == "P"


def _edge_time(*args, **kwargs) -> float:
    return sum(t for t, _, _ in edge_reshardings(*args, **kwargs))


def _edge_time_calls(*args, **kwargs) -> tuple[float, float]:
    """Seconds of one use's reshardings and how many collectives they issue (a shared partial gradient's
    reduction counts its share): each is a DTensor redistribution, which costs the host a DTensor op."""
    parts = edge_reshardings(*args, **kwargs)
    return sum(t for t, _, _ in parts), sum(n for _, _, n in parts)


def _forward_time(
    src_place: str, consumer: Strategy, k: int, nbytes: float, axis: int, comm: AxisComm
) -> float:
    """Seconds of the forward resharding of one use (what rerunning the consumer repeats)."""
    spec = consumer.input_placements[k] if k < len(consumer.input_placements) else None
    dst = spec[axis] if spec is not None else src_place
    return redistribute(src_place, dst, nbytes, comm)[0]
