"""Ask DTensor's own sharding rules which placements a recorded op supports.

Why DTensor's rules: they are PyTorch's maintained catalogue of "this op can run on these shards and
produces those" for ~1,000 aten ops, the same rules that later execute the plan, so a strategy the planner
picks is one DTensor can run. We only *enumerate* with them; we never use their ``redistribute_cost``
(a rough byte count with no notion of our links), the planner prices resharding itself.

DTensor keeps three kinds of rules (torch 2.13):

* **single-dim** (``op_single_dim_strategy_funcs``): the valid placements over *one* mesh dim, with
  ``_ShardingPlaceholder(d)`` for "sharded on tensor dim d". We fill the placeholders with ``S{d}``, add the
  all-replicate rule, and take the cartesian product over mesh dims (mesh dims act independently). We call
  the rule function directly instead of DTensor's expansion because that expansion fills placeholders only
  with shard types already present on the runtime inputs: with replicated probes it would return nothing
  but the replicate rule.
* **op-strategy** (``op_strategy_funcs``): a function of an ``OpSchema`` whose tensor arguments are
  ``OpStrategy`` objects. Many of these *follow* their input (views, reductions, softmax, cat): they answer
  with one strategy per input spec offered. So we probe: each input in turn is offered one evenly-sharded
  spec, the other inputs replicated. One spec per call, not all at once, because (a) multi-input rules
  pair the i-th specs of their inputs, (b) one spec a rule rejects (an uneven unflatten raises) would
  spoil the whole batch, and (c) every answer is priced against every offered spec with
  ``redistribute_cost``, quadratic in the batch and most of the time on a 2-D mesh.
* **decomposition**: for ops without either rule DTensor traces the op's decomposition under every input
  placement. Slow but generic; the enumerator consults our custom rules first.

Anything unexpected (an exception inside a rule, outputs that do not line up with the recorded node, a
placement we cannot spell) returns None and the caller falls back.
"""

from __future__ import annotations

import functools
import logging
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch

from .._torch_compat import (
    DTensorSpec,
    OpSchema,
    OpSpec,
    OpStrategy,
    ShardingPlaceholder,
    TensorMeta,
    TupleStrategy,
    dtensor_decomposition_strategy,
    dtensor_sharding_propagator,
)
from ..capture.graph import OpNode, StepGraph, TensorRef
from .placements import (
    REPLICATE,
    PlacementSpec,
    Strategy,
    candidate_specs,
    expand_single_dim_rules,
    from_dtensor,
    from_dtensor_spec,
    is_partial,
    is_shard,
    shard,
    to_dtensor_spec,
)

logger = logging.getLogger(__name__)

RuleKind = Literal["single-dim", "op-strategy", "decomposition"]


# ---------------------------------------------------------------------------------------------- lookups
@functools.cache
def resolve_op(name: str) -> torch._ops.OpOverload | None:
    """The OpOverload a recorded op name (``"aten.mm.default"``) stands for, or None when it is unknown."""
    parts = name.split(".")
    if len(parts) == 2:
        parts.append("default")
    if len(parts) != 3:
        return None
    namespace, packet_name, overload = parts
    try:
        packet = getattr(getattr(torch.ops, namespace), packet_name)
        op = getattr(packet, overload)
    except (AttributeError, RuntimeError):
        return None
    return op if isinstance(op, torch._ops.OpOverload) else None


def dtensor_rule_kind(op: torch._ops.OpOverload) -> RuleKind | None:
    """Which DTensor rule would answer for ``op``, in the order DTensor itself prefers them."""
    sp = dtensor_sharding_propagator()
    if op in sp.op_single_dim_strategy_funcs:
        return "single-dim"
    if op in sp.op_strategy_funcs:
        return "op-strategy"
    try:
        if dtensor_decomposition_strategy(sp).has_decomp(op):
            return "decomposition"
    except RuntimeError:  # overloads registered in Python but absent from the dispatcher
        return None
    return None


# ---------------------------------------------------------------------------------------------- the call
class _Call:
    """A recorded node, rebuilt for DTensor: its tensor arguments in flattened order with shapes/dtypes."""

    def __init__(self, node: OpNode, graph: StepGraph) -> None:
        self.node = node
        self.op = resolve_op(node.op)
        args, kwargs = node.args if node.args is not None else ((), {})
        self.args: tuple = tuple(args)
        self.kwargs: dict = dict(kwargs or {})
        self.refs: list[TensorRef] = []
        _walk_refs((self.args, self.kwargs), self.refs)
        self.in_shapes = [tuple(graph.values[r.value_id].shape) for r in self.refs]
        self.in_metas = [_tensor_meta(graph, r.value_id) for r in self.refs]
        self.out_shapes = [tuple(graph.values[v].shape) for v in node.outputs]

    @property
    def aligned(self) -> bool:
        """Whether our flattening of the arguments found the node's tensor inputs, in order."""
        return [r.value_id for r in self.refs] == list(self.node.inputs)

    def map_args(self, leaf: Callable[[int], Any], tensor_list: Callable[[list[Any]], Any]) -> tuple:
        """``(args, kwargs)`` with the i-th TensorRef replaced by ``leaf(i)`` and every all-tensor list by
        ``tensor_list(items)`` (DTensor's TupleStrategy convention for cat and foreach ops)."""
        counter = iter(range(len(self.refs)))

        def conv(obj: Any) -> Any:
            if isinstance(obj, TensorRef):
                return leaf(next(counter))
            if isinstance(obj, (list, tuple)):
                items = [conv(o) for o in obj]
                if obj and all(isinstance(o, TensorRef) for o in obj):
                    return tensor_list(items)
                return type(obj)(items)
            if isinstance(obj, dict):
                return {k: conv(v) for k, v in obj.items()}
            return obj

        args = tuple(conv(a) for a in self.args)
        kwargs = {k: conv(v) for k, v in self.kwargs.items()}
        return args, kwargs


def _walk_refs(obj: Any, out: list[TensorRef]) -> None:
    if isinstance(obj, TensorRef):
        out.append(obj)
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            _walk_refs(o, out)
    elif isinstance(obj, dict):
        for o in obj.values():
            _walk_refs(o, out)


def _contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(stride))


def _tensor_meta(graph: StepGraph, vid: int) -> TensorMeta:
    v = graph.values[vid]
    return TensorMeta(torch.Size(v.shape), _contiguous_stride(v.shape), getattr(torch, v.dtype))


# ---------------------------------------------------------------------------------------------- public
def dtensor_strategies(
    node: OpNode,
    graph: StepGraph,
    mesh: Any,
    *,
    allow_partial_inputs: bool = False,
) -> list[Strategy] | None:
    """Every strategy DTensor's rule for ``node.op`` allows on ``mesh``, as our :class:`Strategy` objects.

    ``mesh`` is a DeviceMesh (only its shape is read by rules). Strategies that merely carry a partial-sum
    input through a linear op are left out unless ``allow_partial_inputs`` (see :func:`_keep`): the planner
    prices reductions on edges, and they would double the candidates of every matmul.
    Returns None when DTensor has no rule, the rule fails, or its answer does not match the recorded node.
    Unevenly sharded and duplicate strategies are *not* removed here (the enumerator does it for every
    source alike).
    """
    call = _Call(node, graph)
    if call.op is None or not call.aligned:
        if call.op is not None:
            logger.debug("%s: could not line up tensor arguments with the recorded inputs", node.op)
        return None
    kind = dtensor_rule_kind(call.op)
    if kind is None:
        return None
    sp = dtensor_sharding_propagator()
    mesh_shape = tuple(mesh.shape)
    attempts: list[Callable[[], list[Strategy] | None]] = []
    if kind == "single-dim":
        attempts.append(lambda: _single_dim(call, sp, mesh_shape, allow_partial_inputs))
    if call.op in sp.op_strategy_funcs:
        attempts.append(lambda: _op_strategy(call, sp, mesh, allow_partial_inputs))
    if kind == "decomposition":
        attempts.append(lambda: _decomposition(call, sp, mesh, allow_partial_inputs))
    for attempt in attempts:
        try:
            result = attempt()
        except Exception as exc:  # a rule that cannot handle this call: try the next, then fall back
            logger.debug("%s: DTensor %s rule failed: %s: %s", node.op, kind, type(exc).__name__, exc)
            continue
        if result:
            return result
    return None


# ---------------------------------------------------------------------------------------------- single-dim
def _placeholder_or_placement(p: Any, *, as_input: bool) -> str | None:
    if p is None:
        return None
    if isinstance(p, ShardingPlaceholder):
        return shard(p.dim)
    return from_dtensor(p, as_input=as_input)


def _single_dim(
    call: _Call, sp: Any, mesh_shape: tuple[int, ...], allow_partial: bool
) -> list[Strategy] | None:
    op = call.op
    info = sp.op_single_dim_strategy_funcs[op]
    args_meta, kwargs_meta = call.map_args(lambda i: call.in_metas[i], tuple)
    raw = info.func(op, args_meta, kwargs_meta)
    n_in = len(call.refs)
    rules: list[tuple[list[str | None], list[str | None]]] = []
    for rule in raw:
        n_out = len(rule) - n_in
        if n_out < 0:
            return None
        try:
            outs = [_placeholder_or_placement(p, as_input=False) for p in rule[:n_out]]
            ins = [_placeholder_or_placement(p, as_input=True) for p in rule[n_out:]]
        except ValueError:  # strided shards: not expressible, skip this rule only
            continue
        rules.append((ins, outs))

    n_out = len(rules[0][1]) if rules else len(call.out_shapes)
    # Masked-off outputs (e.g. grad of a layer norm's bias when not requested) are None in every rule and
    # absent from the recorded node: drop those positions.
    masked = {k for _, outs in rules for k, p in enumerate(outs) if p is None}
    keep = [k for k in range(n_out) if k not in masked]
    rules = [(ins, [outs[k] for k in keep]) for ins, outs in rules if len(outs) == n_out]
    if len(keep) != len(call.out_shapes):
        logger.debug("%s: single-dim rule has %d outputs, node has %d", op, len(keep), len(call.out_shapes))
        return None
    replicate = ([REPLICATE] * n_in, [REPLICATE] * len(keep))
    if not any(ins == replicate[0] and outs == replicate[1] for ins, outs in rules):
        rules.insert(0, replicate)
    strategies = [
        s
        for s in expand_single_dim_rules(rules, len(mesh_shape), "dtensor")
        if _keep(s, allow_partial or _carries_partial(op))
    ]
    if _is_inplace(op):
        # The output *is* the first input: DTensor rejects strategies that would change its placement.
        strategies = [s for s in strategies if s.input_placements[0] == s.output_placements[0]]
    return strategies


def _keep(strategy: Strategy, allow_partial: bool) -> bool:
    """Whether to offer a strategy with partial-sum inputs.

    On a mesh dim where some input is partial but none is sharded, the strategy only carries a pending
    all-reduce through a linear op (``mm(P, R) -> P``, ``add(P, P) -> P``): the same reduction is paid on
    some edge anyway, and the planner prices reductions on edges, so these only multiply the candidates.
    A partial input *next to* sharded ones is different: it is how a row-parallel ``addmm`` takes its bias
    (``addmm(P, S1, S0) -> P``; making a replicated bias partial is free), and is kept.
    """
    if allow_partial:
        return True
    specs = [s for s in strategy.input_placements if s is not None]
    for d in range(strategy.mesh_ndim or 0):
        column = [spec[d] for spec in specs]
        if any(is_partial(p) for p in column) and not any(is_shard(p) for p in column):
            return False
    return True


PARTIAL_VIEWS: frozenset[str] = frozenset({"aten._unsafe_view.default"})
"""Views offered with a partial sum carried through them (``(P) -> (P)``), as DTensor runs them.

Why: a row-parallel linear's sum is made on the flattened ``[batch * seq, hidden]`` rows and unflattened by
``_unsafe_view`` (what ``F.linear`` ends with) to ``[batch, seq, hidden]``. Reduced before the unflatten, it can only be scattered over the
flattened rows (``S0`` there is the batch dim after it); the sequence shard of Megatron's sequence
parallelism (``S1`` of ``[batch, seq, hidden]``) is a strided shard of the flattened rows, which has no
spelling here. Carried through the view, the sum is reduced after it, where a reduce-scatter onto ``S1`` is
an ordinary resharding the planner prices. Not ``view``: DTensor's rules then make every view of a partial carry
it (flattening views included), and plans at the time-fidelity benchmark's shape parted from their run (see
docs/ARCHITECTURE.md, "Sequence parallelism")."""


def _carries_partial(op: torch._ops.OpOverload) -> bool:
    """Whether ``op`` is one of :data:`PARTIAL_VIEWS` (a partial input kept partial is offered for it)."""
    return str(op) in PARTIAL_VIEWS or f"{op}.default" in PARTIAL_VIEWS


def _is_inplace(op: torch._ops.OpOverload) -> bool:
    base = op.name().split("::")[-1].split(".")[0]
    return base.endswith("_") and not base.endswith("__")


# ---------------------------------------------------------------------------------------------- op-strategy
def _op_strategy(call: _Call, sp: Any, mesh: Any, allow_partial: bool) -> list[Strategy] | None:
    op = call.op
    func = sp.op_strategy_funcs[op]
    mesh_shape = tuple(mesh.shape)
    schema_info = sp.op_to_schema_info.get(op)
    allow_partial = allow_partial or _carries_partial(op)
    cands = [candidate_specs(s, mesh_shape, include_partial=allow_partial) for s in call.in_shapes]
    replicated = tuple(REPLICATE for _ in mesh_shape)

    def run(specs_per_input: list[list[PlacementSpec]]) -> list[Strategy]:
        def leaf(i: int) -> OpStrategy:
            meta = call.in_metas[i]
            return OpStrategy(
                [OpSpec(DTensorSpec(mesh, to_dtensor_spec(s), tensor_meta=meta)) for s in specs_per_input[i]]
            )

        args, kwargs = call.map_args(leaf, lambda items: TupleStrategy(tuple(items)))
        result = func(OpSchema(op, args, kwargs, schema_info=schema_info))
        if not isinstance(result, OpStrategy):  # TupleStrategy: foreach ops, independent per element
            raise TypeError(f"{type(result).__name__} result")
        return [s for s in (_convert_spec(call, spec) for spec in result.strategies) if s is not None]

    # One probe per (input, candidate spec): that input offered the spec, every other input replicated.
    probes: list[list[list[PlacementSpec]]] = [[]] if not call.refs else []
    for i, specs in enumerate(cands):
        for spec in specs:
            probes.append([[spec] if j == i else [replicated] for j in range(len(call.refs))])
    out: list[Strategy] = []
    failure: Exception | None = None
    for probe in probes:
        try:
            out.extend(run(probe))
        except Exception as exc:  # this input placement is not supported; others may be
            failure = exc
    if not out and failure is not None:
        raise failure
    return [s for s in out if _keep(s, allow_partial)]


def _convert_spec(call: _Call, spec: OpSpec) -> Strategy | None:
    """An OpSpec as our Strategy, or None when it has a placement we cannot spell or does not line up."""
    outputs = spec.output_specs
    out_specs = list(outputs) if isinstance(outputs, (list, tuple)) else [outputs]
    out_specs = [o for o in out_specs if o is not None]
    if len(out_specs) == 1 and len(call.out_shapes) > 1:
        out_specs = out_specs * len(call.out_shapes)  # one spec stands for every tensor of a tuple return
    if len(out_specs) != len(call.out_shapes):
        return None
    try:
        outs = tuple(from_dtensor_spec(o.placements) for o in out_specs)
        if spec.input_specs is None:  # DTensor: inputs follow the output
            ins: tuple[PlacementSpec | None, ...] = tuple(
                from_dtensor_spec(out_specs[0].placements, as_input=True) for _ in call.refs
            )
        else:
            in_specs = list(spec.input_specs)
            if len(in_specs) != len(call.refs):
                return None
            ins = tuple(
                None if s is None else from_dtensor_spec(s.placements, as_input=True) for s in in_specs
            )
    except ValueError:
        return None
    return Strategy(ins, outs, "dtensor")


# ---------------------------------------------------------------------------------------------- decomposition
def _decomposition(call: _Call, sp: Any, mesh: Any, allow_partial: bool) -> list[Strategy] | None:
    """DTensor's decomposition tracer. It tries, for every input, R and every placement kind present on the
    inputs (with shards widened to every tensor dim), so one input is offered sharded to make it try
    shards at all."""
    from torch.distributed.tensor import Replicate, Shard

    if not call.refs:
        return None
    op = call.op
    seeded = False

    def leaf(i: int) -> DTensorSpec:
        nonlocal seeded
        placements: list[Any] = [Replicate()] * mesh.ndim
        if not seeded and len(call.in_shapes[i]) > 0:
            placements[0] = Shard(0)
            seeded = True
        return DTensorSpec(mesh, tuple(placements), tensor_meta=call.in_metas[i])

    args, kwargs = call.map_args(leaf, list)
    decomp = dtensor_decomposition_strategy(sp)
    decomp.ensure_schema_info(op)
    result = decomp.propagate_strategy(OpSchema(op, args, kwargs, schema_info=sp.op_to_schema_info.get(op)))
    if not isinstance(result, OpStrategy):
        return None
    out = [s for s in (_convert_spec(call, spec) for spec in result.strategies) if s is not None]
    return [s for s in out if _keep(s, allow_partial)]


# ---------------------------------------------------------------------------------------------- DTensor's pick
def _specs_in_order(obj: Any, out: list[Any]) -> None:
    """The DTensorSpecs of a (redistribute) schema's arguments, in the order :func:`_walk_refs` finds tensors."""
    if isinstance(obj, DTensorSpec):
        out.append(obj)
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            _specs_in_order(o, out)
    elif isinstance(obj, dict):
        for o in obj.values():
            _specs_in_order(o, out)


def dtensor_choice(
    node: OpNode,
    graph: StepGraph,
    mesh: Any,
    placements: Sequence[PlacementSpec],
    strategies: Sequence[Strategy] | None = None,
    signature: tuple | None = None,
) -> Strategy | None:
    """The strategy DTensor's own dispatch runs ``node`` with when its tensor inputs arrive in ``placements``
    (one spec per input, in :attr:`OpNode.inputs` order): the input specs it redistributes them to and the
    output specs it produces.

    Why: ops the runtime does not enforce run as DTensor's sharding propagation picks (the strategy that is
    cheapest to reach from the arriving placements by DTensor's own cost, ties broken DTensor's way). The
    planner asks the same propagator the dispatch asks, so that what it predicts for such an op is what runs.
    None when DTensor cannot answer (no rule, a rule that fails, outputs that do not line up, a placement we
    cannot spell). Given the node's ``strategies``, inputs that arrive exactly as some of them take them are
    answered without asking: DTensor runs a strategy that needs no redistribution when one exists (and these
    agree on their outputs). ``signature``: the node's enumeration signature, when the caller has it (asking
    about many placements of one node).
    """
    from ..dtensor_registration import register_runtime_rules
    from .enumerate import _signature

    if signature is None:
        signature = _signature(node, graph, tuple(mesh.shape), False)
    key = (signature, tuple(placements))
    if key in _choices:
        _choices.move_to_end(key)
        return _choices[key]
    chosen = _no_redistribution(strategies, placements) if strategies is not None else None
    if chosen is None:
        register_runtime_rules()  # the rules the runtime adds (CPU flash attention) before it runs a plan
        chosen = _dtensor_choice(node, graph, mesh, placements)
    _choices[key] = chosen
    if len(_choices) > _CHOICE_CACHE_SIZE:
        _choices.popitem(last=False)
    return chosen


def _no_redistribution(
    strategies: Sequence[Strategy], placements: Sequence[PlacementSpec]
) -> Strategy | None:
    """The strategy that takes every input exactly as it arrives, when the node has such strategies and they
    all produce the same outputs (DTensor prefers a strategy that needs no redistribution); else None."""
    exact = [
        s
        for s in strategies
        if len(s.input_placements) == len(placements)
        and all(p is None or p == q for p, q in zip(s.input_placements, placements, strict=True))
    ]
    if not exact or any(s.output_placements != exact[0].output_placements for s in exact):
        return None
    return Strategy(tuple(placements), exact[0].output_placements, exact[0].source)


_CHOICE_CACHE_SIZE = 65536
_choices: OrderedDict[tuple, Strategy | None] = OrderedDict()
"""(node signature, input placements) -> DTensor's pick: the blocks of a model ask the same questions, and so
do the meshes and data-parallel modes a search builds problems for."""


def _dtensor_choice(
    node: OpNode, graph: StepGraph, mesh: Any, placements: Sequence[PlacementSpec]
) -> Strategy | None:
    """:func:`dtensor_choice`, uncached."""
    call = _Call(node, graph)
    if call.op is None or not call.aligned or len(placements) != len(call.refs):
        return None
    sp = dtensor_sharding_propagator()

    def leaf(i: int) -> DTensorSpec:
        return DTensorSpec(mesh, to_dtensor_spec(placements[i]), tensor_meta=call.in_metas[i])

    args, kwargs = call.map_args(leaf, list)
    schema_info = sp.op_to_schema_info.get(call.op) or sp.op_to_schema_info_for_single_dim_strategy.get(
        call.op
    )
    try:
        result = sp.propagate_op_sharding(OpSchema(call.op, args, kwargs, schema_info=schema_info))
    except Exception as exc:  # no rule, or a rule that rejects these placements: DTensor would raise too
        logger.debug("%s: DTensor's propagation failed for %s: %s", node.op, placements, exc)
        return None
    chosen: list[Any] = []
    if result.redistribute_schema is not None:
        schema = result.redistribute_schema
        _specs_in_order((schema.args_schema, schema.kwargs_schema), chosen)
    else:
        _specs_in_order((args, kwargs), chosen)
    if len(chosen) != len(call.refs):
        return None
    return _convert_spec(call, OpSpec(result.output_spec, input_specs=chosen))
