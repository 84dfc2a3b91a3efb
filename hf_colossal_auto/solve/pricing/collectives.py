"""The collectives a solved plan issues (kinds, counts, bytes), where its ranks synchronise (rank skew), and
what a recompute repeats: counted from the solution with the builder's own edge and boundary pricing."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from ...hardware.skew import sync_wait
from ...strategies.placements import is_partial, is_shard
from ..build.names import _node_name, _param_node_name
from ..tied import (
    differentiable_values,
    forward_producers,
    gradient_root,
    reduced_param,
    shared_projection_inputs,
)
from .comm import (
    SHARDED_DP_MODES,
    boundary_reshardings,
    gradient_at_consumer,
    gradient_at_producer,
    redistribute,
    splits_work,
)


def _sync_wait(spec, built, solution, graph, tied, mesh, predicted: _CollectivePrediction) -> float:
    """Seconds a rank waits per step for the slowest of its peers (:func:`~..hardware.skew.sync_wait`).

    The step is walked in order — forward nodes, then their backward in reverse, every folded block as many
    times as it stands for — summing each node's time under the solution into the current segment; a
    tensor-parallel collective (:class:`_CollectivePrediction` sync points) closes a segment among the
    ``tp`` ranks. The data-parallel gradient synchronisation closes the last one among all ranks: with
    ``tp = 1`` that is the whole step (k micro-batches and the optimizer step that starts the next). A node's
    time splits into forward and backward by its module's backward ratio. FSDP's per-block all-gathers are
    prefetched a block ahead and not counted as synchronisations."""
    dp, tp = mesh
    if spec.rank_skew_s <= 0 or dp * tp < 2:
        return 0.0
    problem = built.problem
    micro = built.micro_batches
    ratios = built.backward_ratios
    forward: list[tuple[float, bool]] = []
    backward: list[tuple[float, bool]] = []
    group: list[int] = []

    def flush() -> None:
        copies = tied.weight[group[0]] if group else 0
        for _ in range(copies):
            for v in group:
                name = _node_name(tied.canonical[v])
                total = problem.node(name).costs[solution.choice[name]] / micro
                back = ratios.backward_share(graph.nodes[v].module)
                forward.append((total * (1 - back), v in predicted.forward_syncs))
                backward.append((total * back, v in predicted.backward_syncs))
        group.clear()

    for v in sorted(tied.canonical):  # runs of one folded copy repeat together
        if group and (tied.weight[v], tied.copy_prefix.get(v)) != (
            tied.weight[group[0]],
            tied.copy_prefix.get(group[0]),
        ):
            flush()
        group.append(v)
    flush()
    optimizer = sum(
        problem.node(p).costs[solution.choice[p]] * problem.node(p).multiplicity for p in built.param_options
    )
    wait, segment = 0.0, 0.0
    for seconds, syncs in [*forward, *reversed(backward)]:
        segment += seconds
        if syncs and tp > 1:
            wait += sync_wait(spec, segment, tp)
            segment = 0.0
    wait *= micro
    if dp > 1:
        last = segment * micro if tp == 1 else segment
        wait += sync_wait(spec, last + optimizer, dp)
    return wait


def _value_source(built, solution, graph, tied, producer, vid: int) -> tuple[str, bool] | None:
    """Tensor-parallel placement a value is made in under ``solution`` (a parameter's storage, or its
    producer's output), and whether it is a parameter; None for values the ILP does not place (inputs)."""
    value = graph.values[vid]
    if value.name is not None and value.kind.value == "param":
        pname = _param_node_name(tied.canonical_param(value.name))
        if pname not in built.param_options:
            return None
        return built.param_options[pname][solution.choice[pname]], True
    if vid in producer and producer[vid][0] in tied.canonical:
        u_idx, pos = producer[vid]
        u_name = _node_name(tied.canonical[u_idx])
        return built.strategies[u_name][solution.choice[u_name]].output_placements[pos][0], False
    return None


def _recompute_collectives(built, solution, graph, tied, mesh, tp_comm) -> dict[str, float]:
    """Forward collectives run again because the node they feed is recomputed in backward."""
    counts: dict[str, float] = defaultdict(float)
    rerun = {
        built.node_of_name[name]
        for rc, unit in built.recompute_units.items()
        for name in (_node_name(c) for c in unit.nodes)
        if unit.reruns(
            built.recompute_options[rc][solution.choice[rc]], graph.nodes[built.node_of_name[name]]
        )
    }
    if not rerun:
        return {}
    producer = forward_producers(graph)
    for v_idx in sorted(tied.canonical):
        v_c = tied.canonical[v_idx]
        if v_c not in rerun:
            continue
        v_name = _node_name(v_c)
        strat = built.strategies[v_name][solution.choice[v_name]]
        for k, vid in enumerate(graph.nodes[v_idx].inputs):
            made = _value_source(built, solution, graph, tied, producer, vid)
            if made is None:
                continue
            src, is_param = made
            if not is_param and _node_name(tied.canonical[producer[vid][0]]) == v_name:
                continue
            spec = strat.input_placements[k] if k < len(strat.input_placements) else None
            dst = spec[0] if spec is not None else src
            _, kind = redistribute(src, dst, graph.values[vid].nbytes, tp_comm)
            if kind:
                counts[kind] += tied.weight[v_idx]
    return dict(counts)


def _given_bytes(kind: str, size: float, tp: int) -> float:
    """Bytes of the tensor one rank hands a collective over a value of ``size`` logical bytes: its shard for an
    all-gather, the whole value for an all-reduce or a reduce-scatter (what CommDebugMode-style counting sees)."""
    return size / tp if kind in ("all_gather", "all_to_all") else size


@dataclass
class _CollectivePrediction:
    counts: dict[str, float]
    """Collectives per step by kind."""
    nbytes: dict[str, float]
    """Bytes each rank hands them per step, by kind (:func:`_given_bytes`)."""
    forward_syncs: set[int]
    """Forward nodes at which a tensor-parallel collective runs in forward (the ranks synchronise there)."""
    backward_syncs: set[int]
    """Forward nodes whose backward runs a tensor-parallel collective."""


def _collective_prediction(built, solution, graph, tied, mesh, tp_comm, dp_mode) -> _CollectivePrediction:
    """Predicted collectives per step, by kind: how many, and the bytes each rank hands them (:func:`_given_bytes`);
    and where in the step the tensor-parallel ones synchronise the ranks (:func:`_sync_wait`).

    Tensor-parallel: the forward resharding of every edge of the solution, and the backward resharding of its
    gradient. A *partial* gradient is not reduced where it is made: it passes back through views (a linear's
    flattening of its input) and sums with the other contributions to the value they view, and is reduced
    once there (what the runtime's boundary hooks and autograd's accumulation do): q, k and v projections of
    one normed input cost one all-reduce. Data-parallel: one gradient synchronisation per trained parameter (counted,
    its bytes not: they depend on the tensor-parallel shard each replica holds). With k micro-batches the
    tensor-parallel collectives and FSDP's all-gathers run k times, the gradient synchronisation once.
    """
    dp, tp = mesh
    counts, nbytes, forward_syncs, backward_syncs = _tensor_parallel_collectives(
        built, solution, graph, tied, tp_comm, tp
    )
    micro = built.micro_batches
    counts = defaultdict(float, {kind: micro * c for kind, c in counts.items()})
    nbytes = defaultdict(float, {kind: micro * b for kind, b in nbytes.items()})
    if dp > 1:
        _add_data_parallel_collectives(counts, nbytes, built, graph, tied, dp_mode)
    if dp > 1 and dp_mode == "hsdp":  # HSDP all-reduces each reduce-scattered shard over the replicate group
        counts["dp_all_reduce"] += counts["dp_reduce_scatter"]
    return _CollectivePrediction(
        counts={k: round(v, 6) for k, v in sorted(counts.items())},
        nbytes={k: round(v, 6) for k, v in sorted(nbytes.items())},
        forward_syncs=forward_syncs,
        backward_syncs=backward_syncs,
    )


def _tensor_parallel_collectives(
    built, solution, graph, tied, tp_comm, tp
) -> tuple[dict[str, float], dict[str, float], set[int], set[int]]:
    """One micro-batch's tensor-parallel collectives (:func:`_collective_prediction`): counts and bytes given
    by kind, and the forward nodes where they synchronise the ranks in forward and in backward."""
    counts: dict[str, float] = defaultdict(float)
    nbytes: dict[str, float] = defaultdict(float)
    producer = forward_producers(graph)

    def source(vid: int) -> tuple[str, bool] | None:
        return _value_source(built, solution, graph, tied, producer, vid)

    partial_roots: dict[int, int] = {}
    forward_syncs: set[int] = set()
    backward_syncs: set[int] = set()
    shared_uses = shared_projection_inputs(graph, tied)
    grads = differentiable_values(graph)
    shared_copies: dict[tuple[int, str, str, str], int] = {}
    for v_idx in sorted(tied.canonical):
        w = tied.weight[v_idx]
        v_name = _node_name(tied.canonical[v_idx])
        strat = built.strategies[v_name][solution.choice[v_name]]
        for k, vid in enumerate(graph.nodes[v_idx].inputs):
            made = source(vid)
            if made is None:
                continue
            src, is_param = made
            if not is_param and _node_name(tied.canonical[producer[vid][0]]) == v_name:
                continue
            size = graph.values[vid].nbytes
            spec = strat.input_placements[k] if k < len(strat.input_placements) else None
            dst = spec[0] if spec is not None else src
            if (v_idx, k) in shared_uses:
                # one copy per parent module and target placement, for all the sibling projections reading it
                shared_copies[(vid, shared_uses[(v_idx, k)], src, dst)] = w
                if redistribute(src, dst, size, tp_comm)[1]:
                    forward_syncs.add(v_idx)
            else:
                _, kind = redistribute(src, dst, size, tp_comm)
                if kind:
                    counts[kind] += w
                    nbytes[kind] += w * _given_bytes(kind, size, tp)
                    forward_syncs.add(v_idx)
            if vid not in grads:
                continue  # no gradient flows back to it
            ins = tuple(p[0] if p is not None else None for p in strat.input_placements)
            outs = tuple(p[0] for p in strat.output_placements)
            grad_from = gradient_at_consumer(dst, splits_work(ins, outs))
            if grad_from == "P" and not is_param:
                partial_roots[gradient_root(graph, tied, producer, vid)] = (
                    w  # reduced once where the viewed (or cast) value was made
                )
                continue
            grad_to = src if is_param and is_shard(src) else gradient_at_producer(src)
            _, kind = redistribute(grad_from, grad_to, size, tp_comm)
            if kind:
                counts[kind] += w
                nbytes[kind] += w * _given_bytes(kind, size, tp)
                backward_syncs.add(v_idx)
        returned_as = {
            pos: _read_placement(built, solution, tied, reader)
            for pos, reader in built.returned_via.get(v_name, {}).items()
        }
        for _seconds, kind, size in boundary_reshardings(
            graph, graph.nodes[v_idx], strat, 0, tp_comm, returned_as
        ):
            counts[kind] += w
            nbytes[kind] += w * _given_bytes(kind, size, tp)
            forward_syncs.add(v_idx)
    for (vid, _parent, src, dst), w in shared_copies.items():
        _, kind = redistribute(src, dst, graph.values[vid].nbytes, tp_comm)
        if kind:
            counts[kind] += w
            nbytes[kind] += w * _given_bytes(kind, graph.values[vid].nbytes, tp)
    for vid, w in partial_roots.items():
        # a view or a cast of a parameter (a gathered weight's transpose): reduced to the parameter's storage
        # placement, in its dtype
        pvid = reduced_param(graph, tied, producer, vid)
        made = source(pvid) if pvid is not None else None
        src, is_param = made if made is not None else source(vid)
        grad_to = src if is_param and is_shard(src) else gradient_at_producer(src)
        size = graph.values[pvid if made is not None else vid].nbytes
        _, kind = redistribute("P", grad_to, size, tp_comm)
        if kind:
            counts[kind] += w
            nbytes[kind] += w * _given_bytes(kind, size, tp)
            if vid in producer:
                backward_syncs.add(producer[vid][0])
    return counts, nbytes, forward_syncs, backward_syncs


def _read_placement(built, solution, tied, reader: tuple[int, int]) -> str:
    """The tensor-parallel placement a reader ``(node, input position)`` takes its input in ("P" where its
    strategy leaves that open or reads it partial: the value then stays as made)."""
    j, k = reader
    name = _node_name(tied.canonical[j])
    spec = built.strategies[name][solution.choice[name]].input_placements
    read = spec[k][0] if k < len(spec) and spec[k] is not None else "P"
    return "P" if is_partial(read) else read


def _add_data_parallel_collectives(
    counts: dict[str, float], nbytes: dict[str, float], built, graph, tied, dp_mode: str
) -> None:
    """Add the step's data-parallel collectives (:func:`_collective_prediction`) to ``counts`` and ``nbytes``:
    one gradient synchronisation per trained parameter, FSDP's all-gathers per micro-batch, the exchanges of
    experts sharded over dp."""
    micro = built.micro_batches
    # experts sharded over dp are neither all-reduced (DDP) nor gathered and reduce-scattered (FSDP, which
    # leaves them out): their exchange's collectives instead (with bytes)
    experts = {fqn for fqn in graph.param_names if tied.canonical_param(fqn) in built.expert_dp_params}
    n_params = len(graph.param_names) - len(experts)
    n_trained = sum(1 for fqn in graph.param_names if graph.is_trainable(fqn) and fqn not in experts)
    if dp_mode in SHARDED_DP_MODES:
        counts["dp_all_gather"] += 2 * micro * n_params
        counts["dp_reduce_scatter"] += n_trained
    else:
        counts["dp_all_reduce"] += n_trained
    for exchange in built.expert_data_parallel.values():
        for kind, given, _priced in exchange.collectives:
            counts[f"dp_{kind}"] += micro * exchange.layers
            nbytes[f"dp_{kind}"] += micro * exchange.layers * given
