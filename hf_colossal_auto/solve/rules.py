"""DTensor's own choices as ILP rules (:class:`~hf_colossal_auto.solve.problem.FollowsInputs`): an op the
runtime does not enforce runs as DTensor's propagation decides, so the ILP may only choose what DTensor would."""

from __future__ import annotations

import itertools
import logging
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from ..capture.graph import OpNode, StepGraph, ValueKind
from ..capture.module_kinds import PROJECTION_TYPES
from ..strategies.moe import EXPERT_REGION
from ..strategies.placements import Strategy, is_partial, is_shard
from .build.names import _node_name, _param_node_name
from .pricing.comm import gradient_at_producer
from .problem import (
    FollowsInputs,
)
from .tied import TiedGraph, forward_producers

logger = logging.getLogger(__name__)


def unenforced_split_rules(
    graph: StepGraph,
    tied: TiedGraph,
    strategies: dict[str, list[Strategy]],
    node_of_name: dict[str, int],
    axis: int,
) -> list[FollowsInputs]:
    """Ops of the model's own top-level code (its loss) run as DTensor decides: the runtime enforces the plan
    at module outputs and projection inputs only, and DTensor never splits an op whose inputs are all
    replicated. One :class:`FollowsInputs` rule per such op: its splitting strategies need a non-replicated
    input. (:func:`dtensor_choice_rules` says the same and more wherever DTensor's propagator answers; this
    rule still holds where it does not.)"""
    producer = forward_producers(graph)
    rules = []
    for name, strats in sorted(strategies.items()):
        node = graph.nodes[node_of_name[name]]
        if node.module:
            continue  # inside a module: :func:`dtensor_choice_rules`
        if not strats:
            continue
        acts = [k for k, vid in enumerate(node.inputs) if graph.values[vid].kind is not ValueKind.PARAM]
        if len(acts) != len(node.inputs) or not acts:
            continue  # reads a parameter (its use placement is enforced) or nothing
        sharding = tuple(
            j
            for j, st in enumerate(strats)
            if any(
                k < len(st.input_placements)
                and st.input_placements[k] is not None
                and st.input_placements[k][axis] != "R"
                for k in acts
            )
        )
        if not sharding:
            continue
        inputs: list[tuple[str | None, tuple[int, ...]]] = []
        for k in acts:
            made = producer.get(node.inputs[k])
            if made is None or made[0] not in tied.canonical:
                inputs.append((None, ()))  # a model input or buffer: replicated at run time
                continue
            src = _node_name(tied.canonical[made[0]])
            src_strats = strategies.get(src, [])
            inputs.append(
                (
                    src,
                    tuple(i for i, st in enumerate(src_strats) if st.output_placements[made[1]][axis] == "R"),
                )
            )
        rules.append(FollowsInputs(name, sharding, tuple(inputs)))
    return rules


def _enforced_input(graph: StepGraph, node: OpNode, vid: int) -> bool:
    """True when the runtime redistributes this input above autograd before the op sees it: the module input of
    a projection (``enforce_projection_inputs``) or of an ``nn.LayerNorm``."""
    if graph.module_types.get(node.module) not in (*PROJECTION_TYPES, "LayerNorm"):
        return False
    made = graph.values[vid].producer
    made_in = graph.nodes[made].module if made is not None else ""
    return not (made_in == node.module or made_in.startswith(node.module + "."))


_MAX_ARRIVALS = 32
"""Combinations of arriving placements asked of DTensor per op at most. Of an op with more (an attention kernel
reading q, k and v from three producers) only the combinations where its inputs arrive alike (all replicated,
all split on one dim) are asked, each a question that costs DTensor milliseconds; mixed ones are left to the
solver."""


@dataclass(frozen=True)
class _Arrival:
    """One dimension of the placements an op's inputs can arrive in: the node whose choice decides it, and per
    distinct outcome the placements it gives the op's inputs (input position -> spec) and the choices that
    give it."""

    src: str
    outcomes: tuple[tuple[tuple[tuple[int, tuple[str, ...]], ...], tuple[int, ...]], ...]


def _projection_weight_reader(graph: StepGraph, tied: TiedGraph, node: OpNode) -> tuple[int, int] | None:
    """(canonical node, input position) of the op reading the ``weight`` of ``node``'s projection module:
    its use placement decides whether the runtime redistributes the module input (a sharded use) or leaves it
    to DTensor (a replicated one)."""
    for i in sorted(tied.canonical):
        other = graph.nodes[i]
        if other.module != node.module or tied.canonical[i] != i:
            continue
        for k, vid in enumerate(other.inputs):
            value = graph.values[vid]
            if value.kind is ValueKind.PARAM and value.name is not None and value.name.endswith(".weight"):
                return i, k
    return None


def _enforced_to(graph: StepGraph, node: OpNode, k: int, arriving: str, weight_use: str | None) -> str:
    """Where the runtime's pre-hooks put input ``k`` of ``node`` (arriving in ``arriving``) before the op sees
    it: a projection's module input to what its sharded weight use needs (replicated for a column-parallel
    weight, sharded on its last dim for a row-parallel one), an ``nn.LayerNorm`` input sharded on a normalised
    dim gathered; anything else as it arrives."""
    kind = graph.module_types.get(node.module)
    ndim = len(graph.values[node.inputs[k]].shape)
    if kind in PROJECTION_TYPES:
        if weight_use is None or not is_shard(weight_use):
            return arriving
        rows_are_outputs = kind == "Linear"
        out_dim = 0 if rows_are_outputs else 1
        return "R" if int(weight_use[1:]) == out_dim else f"S{ndim - 1}"
    if kind == "LayerNorm" and is_shard(arriving):
        args = node.args[0] if node.args is not None else ()
        normalized = args[1] if len(args) > 1 and isinstance(args[1], (list, tuple)) else ()
        if normalized and int(arriving[1:]) >= ndim - len(normalized):
            return "R"
    return arriving


def dtensor_choice_rules(
    graph: StepGraph,
    tied: TiedGraph,
    strategies: dict[str, list[Strategy]],
    param_options: dict[str, list[str]],
    axis: int,
    mesh_shape: tuple[int, ...],
) -> list[FollowsInputs]:
    """Every op runs as DTensor's sharding propagation picks, given the placements its inputs arrive in: the
    runtime enforces the plan only at parameter uses, module outputs and the inputs of projections and layer
    norms (the model's top-level code, its loss, not at all). For every combination of arriving placements (each producer's possible
    output placements; parameters at the use the strategy names, as the runtime's hooks make them; module
    inputs where the hooks put them; a parameter the strategy wants partial, which no hook makes, at its
    storage placement), DTensor's own propagator is asked which strategy it runs
    (:func:`~hf_colossal_auto.strategies.dtensor_rules.dtensor_choice`), and one :class:`FollowsInputs` rule
    bars every other strategy under that combination.

    Why: left free, the solver prices strategies DTensor never runs (a replicated LM head split over the batch
    because its input is replicated and slicing is free), and the collectives it predicts part from the run.
    Where DTensor's pick is not among the node's strategies (a partial sum carried through a view), the node
    is left to the solver: the plan redistributes the same value one op earlier or later. Traced copies of a
    folded block whose inputs come from the same producers as the representative's add nothing.
    """
    from ..strategies.dtensor_rules import dtensor_choice
    from ..strategies.enumerate import device_mesh

    if all(size == 1 for size in mesh_shape):
        return []  # one device: every strategy runs alike
    mesh = device_mesh(mesh_shape)
    producer = forward_producers(graph)
    rules: dict[tuple, FollowsInputs] = {}
    seen: set[tuple] = set()
    for i in sorted(tied.canonical):
        node = graph.nodes[i]
        name = _node_name(tied.canonical[i])
        strats = strategies.get(name)
        if not strats or len(strats) < 2 or all(s.source == "plain-tensor" for s in strats):
            continue
        arrivals = _arrivals(graph, tied, strategies, param_options, producer, name, node, axis)
        if arrivals is None or (name, tuple(arrivals)) in seen:
            continue
        seen.add((name, tuple(arrivals)))
        combos = 1
        for arrival in arrivals:
            combos *= len(arrival.outcomes)
        alike_only = combos > _MAX_ARRIVALS
        if alike_only:
            logger.debug("%s: %d combinations of arriving placements, alike ones asked", name, combos)
        for rule in _choice_rules(
            graph, node, name, strats, arrivals, axis, mesh, dtensor_choice, alike_only
        ):
            rules.setdefault((rule.dst, rule.sharding, rule.inputs), rule)
    return list(rules.values())


def _arrivals(graph, tied, strategies, param_options, producer, name, node, axis) -> list[_Arrival] | None:
    """The dimensions of :func:`dtensor_choice_rules` for one node: per producer node, the distinct placements
    its choices give the node's inputs; per parameter some strategy wants partial, its storage options (other
    parameter uses follow the strategy: the runtime's hooks make them). None when the node reads its own
    output (a tied copy's input made by the copy it stands for)."""
    out: list[_Arrival] = []
    strats = strategies[name]
    for k, vid in enumerate(node.inputs):
        value = graph.values[vid]
        if value.kind is not ValueKind.PARAM or value.name is None:
            continue
        wanted = {st.input_placements[k][axis] for st in strats if st.input_placements[k] is not None}
        pname = _param_node_name(tied.canonical_param(value.name))
        if not any(is_partial(p) for p in wanted) or pname not in param_options:
            continue
        stored: dict[str, list[int]] = defaultdict(list)
        for j, option in enumerate(param_options[pname]):
            stored[option].append(j)
        out.append(
            _Arrival(pname, tuple(((("param", k, option),), tuple(ids)) for option, ids in stored.items()))
        )
    positions: dict[str, list[tuple[int, int]]] = defaultdict(list)
    weight = None
    for k, vid in enumerate(node.inputs):
        if graph.values[vid].kind is ValueKind.PARAM:
            continue
        made = producer.get(vid)
        if made is None or made[0] not in tied.canonical:
            continue  # a model input or buffer: replicated
        src = _node_name(tied.canonical[made[0]])
        if src == name or src not in strategies or _enters_run(tied, node.index, made[0]):
            return None
        positions[src].append((k, made[1]))
        if graph.module_types.get(node.module) in PROJECTION_TYPES and _enforced_input(graph, node, vid):
            weight = _projection_weight_reader(graph, tied, node)
    for src, ks in positions.items():
        outcomes: dict[tuple, list[int]] = defaultdict(list)
        for j, st in enumerate(strategies[src]):
            outcomes[tuple((k, st.output_placements[pos]) for k, pos in ks)].append(j)
        out.append(_Arrival(src, tuple((key, tuple(ids)) for key, ids in outcomes.items())))
    if weight is not None:
        w_name = _node_name(weight[0])
        outcomes = defaultdict(list)
        for j, st in enumerate(strategies[w_name]):
            spec = st.input_placements[weight[1]] if weight[1] < len(st.input_placements) else None
            outcomes[(("weight", spec),)].append(j)
        out.append(_Arrival(w_name, tuple((key, tuple(ids)) for key, ids in outcomes.items())))
    return out


def _enters_run(tied: TiedGraph, reader: int, made: int) -> bool:
    """Whether ``reader``, in a traced copy of a folded run other than the representative, reads a value made
    before the run (the first block's hidden states: the embeddings). The runtime brings that input to what the
    representative receives from its predecessor (``Plan.block_input_placements``), so the copy asks DTensor
    nothing the representative does not."""
    copy = tied.copy_prefix.get(reader)
    if copy is None or copy[0] == copy[1]:
        return False
    source = tied.copy_prefix.get(made)
    return source is None or source[1] != copy[1]


def _choice_rules(graph, node, name, strats, arrivals, axis, mesh, choose, alike_only) -> list[FollowsInputs]:
    """One rule per combination of arrival outcomes (``alike_only``: those where every activation input
    arrives in one placement) and per group of strategies that use the node's parameters alike: every
    strategy of the group DTensor would not run is barred under that combination."""
    from ..strategies.enumerate import _signature

    params = [k for k, vid in enumerate(node.inputs) if graph.values[vid].kind is ValueKind.PARAM]
    groups: dict[tuple, list[int]] = defaultdict(list)
    for j, st in enumerate(strats):
        groups[
            tuple(st.input_placements[k] if k < len(st.input_placements) else None for k in params)
        ].append(j)
    replicated = tuple("R" for _ in strats[0].output_placements[0])
    signature = _signature(node, graph, tuple(mesh.shape), False)
    hooked = {k for k, vid in enumerate(node.inputs) if k not in params and _enforced_input(graph, node, vid)}
    rules: list[FollowsInputs] = []
    for combo in (
        _alike_combos(arrivals) if alike_only else itertools.product(*(a.outcomes for a in arrivals))
    ):
        given: dict[int, tuple[str, ...]] = {}
        stored: dict[int, str] = {}
        weight_use: tuple[str, ...] | None = None
        for placed, _ids in combo:
            for entry in placed:
                if entry[0] == "weight":
                    weight_use = entry[1]
                elif entry[0] == "param":
                    stored[entry[1]] = entry[2]
                else:
                    given[entry[0]] = entry[1]
        use = weight_use[axis] if weight_use is not None else None
        for uses, members in groups.items():
            placements = []
            relevant = set()
            for k in range(len(node.inputs)):
                if k in params:
                    spec = uses[params.index(k)] or replicated
                    if is_partial(spec[axis]) and k in stored:  # no hook makes a parameter partial
                        spec = tuple(stored[k] if d == axis else p for d, p in enumerate(spec))
                        relevant.add(("param", k))
                    placements.append(spec)
                    continue
                arriving = given.get(k, replicated)
                if k in hooked:  # a module input the runtime's pre-hooks see first
                    arriving = tuple(
                        _enforced_to(graph, node, k, p, use) if d == axis else p
                        for d, p in enumerate(arriving)
                    )
                placements.append(arriving)
            chosen = choose(node, graph, mesh, placements, strats, signature)
            if chosen is None:
                continue
            if not any(_same_strategy(st, chosen) for st in strats):
                continue  # DTensor's pick is not a strategy of the node: left to the solver
            barred = tuple(
                j
                for j in members
                if not _same_strategy(strats[j], chosen)
                and strats[j].source != EXPERT_REGION  # a local region
            )
            if not barred:
                continue
            conditions = tuple(
                (a.src, ids)
                for a, (placed, ids) in zip(arrivals, combo, strict=True)
                if placed[0][0] != "param" or ("param", placed[0][1]) in relevant
            )
            rules.append(FollowsInputs(name, barred, conditions))
    return rules


def _arriving_specs(placed: tuple) -> set:
    """The placements one arrival outcome gives the op's activation inputs (parameter and weight entries are
    keyed by a word, activation entries by the input position)."""
    return {entry[1] for entry in placed if isinstance(entry[0], int)}


def _alike_combos(arrivals: Sequence[_Arrival]) -> list[tuple]:
    """The combinations of arrival outcomes in which every activation input arrives in one placement, in the
    order ``itertools.product`` lists them, without walking the product: an op reading many producers (a
    ``stack`` of the per-time-step outputs of a recurrent loop, 16 producers of 3 outcomes each) has
    billions of combinations, of which only a few are alike.

    Per placement ``p``: each activation arrival contributes its one outcome that gives every input it feeds
    ``p`` (outcomes are distinct placement tuples), each parameter or weight arrival all of its outcomes; the
    index tuples of every ``p`` are merged in lexicographic order (``product``'s)."""
    kinds = [
        any(isinstance(entry[0], int) for placed, _ in arrival.outcomes for entry in placed)
        for arrival in arrivals
    ]
    if not any(kinds):
        return list(itertools.product(*(a.outcomes for a in arrivals)))
    first = kinds.index(True)  # every alike combination gives all inputs one of this arrival's placements
    candidates = list(
        dict.fromkeys(
            spec
            for placed, _ in arrivals[first].outcomes
            if len(specs := _arriving_specs(placed)) == 1
            for spec in specs
        )
    )
    indices: list[tuple[int, ...]] = []
    for spec in candidates:
        choices: list[list[int]] = []
        for arrival, activation in zip(arrivals, kinds, strict=True):
            if activation:
                choices.append(
                    [j for j, (placed, _) in enumerate(arrival.outcomes) if _arriving_specs(placed) == {spec}]
                )
            else:
                choices.append(list(range(len(arrival.outcomes))))
        indices.extend(itertools.product(*choices))
    return [
        tuple(arrival.outcomes[j] for arrival, j in zip(arrivals, index, strict=True))
        for index in sorted(indices)
    ]


def _same_strategy(planned: Strategy, chosen: Strategy) -> bool:
    """Whether DTensor's pick is the planned strategy (an input the plan does not care about matches any)."""
    if planned.output_placements != chosen.output_placements:
        return False
    return all(
        p is None or p == c for p, c in zip(planned.input_placements, chosen.input_placements, strict=True)
    )


def _view_partial_to(view: Strategy, axis: int) -> str | None:
    """Where a partial gradient arriving at a view's output is reduced to: its input's gradient placement."""
    if not view.input_placements or view.input_placements[0] is None:
        return None
    return gradient_at_producer(view.input_placements[0][axis])
