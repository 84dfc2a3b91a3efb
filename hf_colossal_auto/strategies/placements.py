"""Our own placement vocabulary: plain strings, so strategies are JSON-friendly and free of DTensor objects.

Why not keep DTensor's ``Placement`` objects: the planner stores strategies, hashes them, compares them,
writes them into reports and ships them to other processes; DTensor placements drag a device mesh and
private subclasses along (``_MaskPartial`` carries an offset shape, ``_StridedShard`` a split factor) and
their spelling changes between torch releases. A strategy only needs to say, per tensor and per mesh
dimension, whether the tensor is whole, split along a tensor dim, or a pending sum. So:

* ``"R"``  - replicated: every device on that mesh dim holds the whole tensor;
* ``"S{d}"`` - sharded: split evenly along tensor dim ``d`` (``"S0"``, ``"S2"``);
* ``"P"``  - partial sum: each device holds an addend; the value is their sum (an all-reduce away from R).
  Partial values reduced by another operator are spelled ``"P(avg)"``, ``"P(max)"``, ``"P(min)"`` so that
  no pending reduction is silently mistaken for a sum; :func:`is_partial` accepts every spelling.

A *spec* (:data:`PlacementSpec`) is the tuple of placements of one tensor over the mesh dims, so it has
length 1 on a 1-D mesh and length 2 on a 2-D mesh.
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

Placement = str
"""``"R"``, ``"P"`` (``"P(avg)"`` ...) or ``"S{d}"``."""
PlacementSpec = tuple[Placement, ...]
"""One placement per mesh dim for one tensor."""
StrategySource = Literal["dtensor", "custom", "replicate-fallback", "plain-tensor", "expert-region"]

REPLICATE: Placement = "R"
PARTIAL: Placement = "P"
SOURCES: tuple[str, ...] = ("dtensor", "custom", "replicate-fallback", "plain-tensor", "expert-region")
"""``plain-tensor``: the op reads no parameter and no model input (RoPE tables from buffers, masks from
constants), so at run time it computes on ordinary tensors, the same on every rank: replicated, nothing else.
``expert-region``: the op runs inside an experts module that the runtime runs expert-parallel as one local
region (:func:`hf_colossal_auto.strategies.moe.add_expert_region_strategies`), not as DTensor decides."""

_SHARD_RE = re.compile(r"^S(\d+)$")
_PARTIAL_RE = re.compile(r"^P(?:\((sum|avg|max|min|product)\))?$")


def shard(dim: int) -> Placement:
    """The placement that splits a tensor evenly along ``dim``."""
    if dim < 0:
        raise ValueError(f"shard dims are non-negative tensor dims, got {dim}")
    return f"S{dim}"


def shard_dim(p: Placement) -> int | None:
    """The tensor dim a shard placement splits, or None when ``p`` is not a shard."""
    m = _SHARD_RE.match(p)
    return int(m.group(1)) if m else None


def is_shard(p: Placement | None) -> bool:
    return p is not None and _SHARD_RE.match(p) is not None


def is_partial(p: Placement | None) -> bool:
    return p is not None and _PARTIAL_RE.match(p) is not None


def is_replicate(p: Placement | None) -> bool:
    return p == REPLICATE


def partial_op(p: Placement) -> str:
    """The reduction a partial placement is waiting for (``"sum"`` for plain ``"P"``)."""
    m = _PARTIAL_RE.match(p)
    if m is None:
        raise ValueError(f"{p!r} is not a partial placement")
    return m.group(1) or "sum"


def partial(reduce_op: str = "sum") -> Placement:
    """The partial placement for ``reduce_op``; sums are plain ``"P"``."""
    p = PARTIAL if reduce_op == "sum" else f"P({reduce_op})"
    if not _PARTIAL_RE.match(p):
        raise ValueError(f"unsupported partial reduction {reduce_op!r}")
    return p


def validate_placement(p: Any) -> Placement:
    """Return ``p`` when it is a well-formed placement string, else raise ValueError naming it."""
    if not isinstance(p, str) or not (p == REPLICATE or _SHARD_RE.match(p) or _PARTIAL_RE.match(p)):
        raise ValueError(f"not a placement: {p!r} (expected 'R', 'P', 'P(<op>)' or 'S<dim>')")
    return p


def replicate_spec(mesh_ndim: int) -> PlacementSpec:
    return (REPLICATE,) * mesh_ndim


# ---------------------------------------------------------------------------------------------- DTensor
def to_dtensor(p: Placement) -> Any:
    """Our placement as a DTensor ``Replicate()`` / ``Shard(d)`` / ``Partial(op)`` object."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    validate_placement(p)
    if p == REPLICATE:
        return Replicate()
    d = shard_dim(p)
    if d is not None:
        return Shard(d)
    return Partial(partial_op(p))


def from_dtensor(placement: Any, *, as_input: bool = False) -> Placement:
    """A DTensor placement in our vocabulary.

    ``_MaskPartial`` (the vocab-parallel embedding's placement) is a sum-partial on an output; on an *input*
    (the token ids) it only asks each device to mask ids outside its vocabulary slice, which it does locally
    on a replicated tensor, so with ``as_input=True`` it reads as ``"R"``. ``_StridedShard`` (an interleaved
    split) has no spelling here: ValueError, and callers drop the strategy.
    """
    from torch.distributed.tensor import Partial, Replicate, Shard

    from .._torch_compat import MaskPartial, StridedShard

    if isinstance(placement, StridedShard):
        raise ValueError(f"strided sharding {placement!r} has no equivalent placement")
    if isinstance(placement, Replicate):
        return REPLICATE
    if isinstance(placement, Shard):
        return shard(placement.dim)
    if isinstance(placement, MaskPartial):
        return REPLICATE if as_input else PARTIAL
    if isinstance(placement, Partial):
        return partial(str(placement.reduce_op))
    raise ValueError(f"unknown DTensor placement {placement!r}")


def to_dtensor_spec(spec: PlacementSpec) -> tuple[Any, ...]:
    return tuple(to_dtensor(p) for p in spec)


def from_dtensor_spec(placements: Iterable[Any], *, as_input: bool = False) -> PlacementSpec:
    return tuple(from_dtensor(p, as_input=as_input) for p in placements)


# ---------------------------------------------------------------------------------------------- shapes
def evenly_sharded(shape: Sequence[int], spec: PlacementSpec | None, mesh_shape: Sequence[int]) -> bool:
    """Whether every sharded tensor dim divides evenly among the devices that split it.

    A dim sharded on several mesh dims (``("S0", "S0")`` on a 2-D mesh) is split by the product of their
    sizes. Shards of a dim that is not a multiple of the shard count are uneven: the cost model would
    price the largest shard, collectives would need padding, and the solver could not trust per-device
    memory figures, so the enumerator drops those strategies instead of pricing them wrongly. A sharded
    dim that does not exist (``S3`` on a 2-D tensor) is also rejected.
    """
    if spec is None:
        return True
    splits: dict[int, int] = {}
    for p, size in zip(spec, mesh_shape, strict=True):
        d = shard_dim(p)
        if d is not None:
            splits[d] = splits.get(d, 1) * size
    return all(d < len(shape) and shape[d] % n == 0 for d, n in splits.items())


def candidate_specs(
    shape: Sequence[int], mesh_shape: Sequence[int], *, include_partial: bool = False
) -> list[PlacementSpec]:
    """Every evenly-sharded spec of a tensor of ``shape`` on the mesh: R and each ``S{d}`` per mesh dim
    (and P when asked), replicated first so that rules which keep only one candidate keep the cheap one."""
    per_dim: list[Placement] = [REPLICATE] + [shard(d) for d in range(len(shape))]
    if include_partial:
        per_dim.append(PARTIAL)
    return [
        spec
        for spec in itertools.product(per_dim, repeat=len(mesh_shape))
        if evenly_sharded(shape, spec, mesh_shape)
    ]


def local_shape(shape: Sequence[int], spec: PlacementSpec, mesh_shape: Sequence[int]) -> tuple[int, ...]:
    """The per-device shape of an evenly sharded tensor (what memory and FLOP models should use)."""
    out = list(shape)
    for p, size in zip(spec, mesh_shape, strict=True):
        d = shard_dim(p)
        if d is not None:
            out[d] //= size
    return tuple(out)


# ---------------------------------------------------------------------------------------------- strategy
@dataclass(frozen=True)
class Strategy:
    """One way to run a node on the mesh: where each input must be and where each output ends up.

    ``input_placements[i]`` is the spec the i-th tensor input (in :attr:`OpNode.inputs` order) must have
    when the op runs, or None when the op does not care; ``output_placements[j]`` is the spec of the j-th
    tensor output (in :attr:`OpNode.outputs` order). Frozen and made of tuples of strings, so strategies
    hash, compare and deduplicate by value and serialise with :meth:`to_dict`.
    """

    input_placements: tuple[PlacementSpec | None, ...]
    output_placements: tuple[PlacementSpec, ...]
    source: StrategySource = "dtensor"

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise ValueError(f"unknown strategy source {self.source!r}; one of {SOURCES}")
        lengths = {len(s) for s in (*self.input_placements, *self.output_placements) if s is not None}
        if len(lengths) > 1:
            raise ValueError(f"placement specs of different mesh ranks in one strategy: {self}")
        for spec in (*self.input_placements, *self.output_placements):
            for p in spec or ():
                validate_placement(p)

    @property
    def mesh_ndim(self) -> int | None:
        for s in (*self.output_placements, *self.input_placements):
            if s is not None:
                return len(s)
        return None

    @property
    def key(self) -> tuple:
        """The placements without the source: two rules that agree on placements are the same strategy."""
        return (self.input_placements, self.output_placements)

    def is_replicate(self) -> bool:
        return all(
            s is None or all(p == REPLICATE for p in s)
            for s in (*self.input_placements, *self.output_placements)
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "inputs": [list(s) if s is not None else None for s in self.input_placements],
            "outputs": [list(s) for s in self.output_placements],
            "source": self.source,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Strategy:
        return cls(
            input_placements=tuple(tuple(s) if s is not None else None for s in data["inputs"]),
            output_placements=tuple(tuple(s) for s in data["outputs"]),
            source=data.get("source", "dtensor"),
        )

    def __str__(self) -> str:
        def fmt(spec: PlacementSpec | None) -> str:
            return "*" if spec is None else ",".join(spec)

        ins = " ".join(fmt(s) for s in self.input_placements)
        outs = " ".join(fmt(s) for s in self.output_placements)
        return f"({ins}) -> ({outs}) [{self.source}]"


LOOKUP_OPS = frozenset({"aten.embedding.default"})
"""Embedding lookups: into a table split over its rows (the vocabulary) they make a partial sum, which the
runtime reduces where it is made (:func:`reduced_lookup`)."""


def reduced_lookup(op: str, strategy: Strategy, axis: int) -> bool:
    """Whether ``strategy`` runs the lookup ``op`` on a vocab-sharded table (its weight read ``S0`` on
    ``axis``): DTensor makes a masked partial sum there (``_MaskPartial``), valid only until its lookup mask is
    consumed, so the runtime all-reduces it to replicated where it is made, whatever its readers want
    (``apply/enforce.py::_lookup_reduced``, ``apply/runtime.py::_reduce_partial_output``). The enumerator gives
    such strategies a replicated output (:func:`~.enumerate.enumerate_strategies`) and the planner prices the
    all-reduce once on the lookup (:func:`~hf_colossal_auto.solve.pricing.comm.boundary_reshardings`)."""
    if op not in LOOKUP_OPS or not strategy.input_placements:
        return False
    weight = strategy.input_placements[0]
    return weight is not None and weight[axis] == "S0"


def replicate_strategy(
    n_inputs: int, n_outputs: int, mesh_ndim: int, source: StrategySource = "replicate-fallback"
) -> Strategy:
    """Everything replicated: always valid (each device runs the whole op), hence the universal fallback."""
    r = replicate_spec(mesh_ndim)
    return Strategy((r,) * n_inputs, (r,) * n_outputs, source)


def expand_single_dim_rules(
    rules: Iterable[tuple[Sequence[Placement | None], Sequence[Placement | None]]],
    mesh_ndim: int,
    source: StrategySource,
) -> list[Strategy]:
    """Combine rules that hold on one mesh dim into strategies on a ``mesh_ndim``-D mesh.

    Each rule is ``(input placements, output placements)`` for a single mesh dim. Mesh dims act
    independently (each one splits or sums over its own device group), so any choice of one rule per mesh
    dim is a valid strategy: the cartesian product, as DTensor's ``expand_to_full_mesh_op_strategy`` does.
    A None entry (an input the rule does not constrain) makes that tensor's spec None.
    """
    rule_list = [(tuple(i), tuple(o)) for i, o in rules]
    out: list[Strategy] = []
    for combo in itertools.product(rule_list, repeat=mesh_ndim):
        n_in = len(combo[0][0])
        n_out = len(combo[0][1])
        ins = tuple(_column(combo, 0, k) for k in range(n_in))
        outs = tuple(_column(combo, 1, k) for k in range(n_out))
        if any(o is None for o in outs):
            continue
        out.append(Strategy(ins, outs, source))  # type: ignore[arg-type]
    return out


def _column(combo: Sequence[tuple[tuple, tuple]], side: int, k: int) -> PlacementSpec | None:
    ps = [rule[side][k] for rule in combo]
    return None if any(p is None for p in ps) else tuple(ps)


def mesh_size(mesh_shape: Sequence[int]) -> int:
    return math.prod(mesh_shape)
