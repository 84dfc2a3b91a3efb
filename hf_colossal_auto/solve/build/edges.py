"""The builder's edges: producer -> consumer reshardings of every use (forward value and gradient), and the
shared copy of a module input its sibling projections read alike."""

from __future__ import annotations

from ...capture.graph import ValueKind
from ...strategies.placements import is_partial
from ..pricing.comm import (
    _edge_time_calls,
    _forward_time,
    _partial_gradient,
    gradient_at_producer,
    redistribute,
)
from ..rules import _view_partial_to
from ..tied import gradient_root, reduced_param, view_root
from .names import _node_name, _param_node_name


class _EdgesPart:
    """Edges and shared copies (:class:`~.builder._ProblemBuilder`)."""

    # ---------------------------------------------------------------- edges
    def _add_edges(self) -> None:
        """Every use of a value by a forward op (over all traced copies, weighted by the real blocks each
        stands for) becomes an edge producer -> consumer: the forward resharding of the value and the backward
        resharding of its gradient (:func:`edge_reshardings`). Producers are parameter nodes
        (:meth:`_add_param_use`) or forward ops (:meth:`_add_activation_use`).

        The edges depend on the step, its strategies, the tensor-parallel axis and the recompute units only,
        not on the data-parallel mode, the budget, pinned choices or the micro-batch count (applied after), so
        problems built from one step on one axis (a mesh's data-parallel modes, its relaxation) price them
        once: they are kept with the step's :class:`~..pricing.memory.StepMemory` and copied into each
        problem (later parts add to them in place)."""
        cache = self.step_memory.parts
        key = (
            "edges",
            id(self.strategies),
            self.tp,
            self.axis,
            self.tp_comm,
            tuple((u.name, tuple(u.nodes)) for u in self.units),
        )
        kept = cache.get(key)
        if kept is not None and kept[0] is self.strategies:
            self._restore_edges(kept[1])
            return
        self._add_edges_uncached()
        cache[key] = (self.strategies, self._copy_edges())

    def _copy_edges(self) -> tuple:
        """What :meth:`_add_edges` made, copied (its matrices are added to in place by later parts)."""
        return (
            {key: [list(row) for row in m] for key, m in self.edge_cost.items()},
            {key: [list(row) for row in m] for key, m in self.edge_calls.items()},
            {key: [list(row) for row in m] for key, m in self.fwd_into.items()},
            {key: list(members) for key, members in self.shared_members.items()},
            {key: list(price) for key, price in self.shared_price.items()},
        )

    def _restore_edges(self, kept: tuple) -> None:
        """The edges of an earlier problem of the same step and axis (:meth:`_add_edges`), copied in."""
        edge_cost, edge_calls, fwd_into, shared_members, shared_price = kept
        self.edge_cost = {key: [list(row) for row in m] for key, m in edge_cost.items()}
        self.edge_calls = {key: [list(row) for row in m] for key, m in edge_calls.items()}
        self.fwd_into = {key: [list(row) for row in m] for key, m in fwd_into.items()}
        self.shared_members = {key: list(members) for key, members in shared_members.items()}
        self.shared_price = {key: list(price) for key, price in shared_price.items()}

    def _add_edges_uncached(self) -> None:
        graph, tied = self.graph, self.tied
        for v_idx in sorted(tied.canonical):
            v_node = graph.nodes[v_idx]
            for k, vid in enumerate(v_node.inputs):
                value = graph.values[vid]
                if value.kind is ValueKind.PARAM and value.name is not None:
                    self._add_param_use(v_idx, k, vid)
                else:
                    self._add_activation_use(v_idx, k, vid)

    def _add_param_use(self, v_idx: int, k: int, vid: int) -> None:
        """Parameter node -> consumer: the parameter redistributed from its storage placement to the one the
        consumer's strategy reads, and its gradient back to the storage placement. When the consumer can be
        recomputed, the forward part is also noted for the rerun (:meth:`_add_conditional_costs`)."""
        graph, tied, axis, tp_comm = self.graph, self.tied, self.axis, self.tp_comm
        value = graph.values[vid]
        w = tied.weight[v_idx]
        v_c = tied.canonical[v_idx]
        v_strats = self.strat_of[_node_name(v_c)]
        fqn = tied.canonical_param(value.name)
        pname = _param_node_name(fqn)
        if pname not in self.param_options:
            return
        priced = [
            [
                _edge_time_calls(
                    o,
                    s,
                    k,
                    value.nbytes,
                    axis,
                    tp_comm,
                    param=True,
                    consumers=self.readers[vid],
                    needs_grad=vid in self.grads,
                )
                for s in v_strats
            ]
            for o in self.param_options[pname]
        ]
        self._add_edge(pname, _node_name(v_c), *_weighted_pairs(priced, w))
        if v_c in self.unit_index_of:
            forward = [
                [w * _forward_time(o, s, k, value.nbytes, axis, tp_comm) for s in v_strats]
                for o in self.param_options[pname]
            ]
            self._add_forward(pname, _node_name(v_c), forward)

    def _add_activation_use(self, v_idx: int, k: int, vid: int) -> None:
        """Forward op -> consumer: the value redistributed from the producer's output placement to the one the
        consumer reads, and its gradient back (a partial gradient passing back through a view is reduced where
        the viewed value was made, shared among that value's readers; through a cast too, priced apart:
        :meth:`_root_partial`; to a parameter's storage: :meth:`_storage_partial`). A module input shared by sibling
        projections is redistributed once for all of them: its forward part is priced by
        :meth:`_add_shared_copy` instead. When the consumer can be recomputed, the forward part is also noted
        for the rerun. A value between two copies of one tied node costs nothing."""
        graph, tied, axis, tp_comm = self.graph, self.tied, self.axis, self.tp_comm
        value = graph.values[vid]
        src = self.producer.get(vid)
        if src is None:
            return
        u_idx, pos = src
        if u_idx not in tied.canonical:
            return
        w = tied.weight[v_idx]
        v_c = tied.canonical[v_idx]
        v_strats = self.strat_of[_node_name(v_c)]
        u_c = tied.canonical[u_idx]
        u_strats = self.strat_of[_node_name(u_c)]
        is_shared = (v_idx, k) in self.shared_uses
        root = view_root(graph, tied, self.producer, vid)
        through_view = root != vid and graph.nodes[u_idx].is_view
        cast_root = gradient_root(graph, tied, self.producer, vid)
        reduced_elsewhere = self._storage_partial(v_idx, k, vid, root) or (
            cast_root != root and self._root_partial(v_idx, k, vid, cast_root)
        )

        priced = [
            [
                _edge_time_calls(
                    us.output_placements[pos][axis],
                    s,
                    k,
                    value.nbytes,
                    axis,
                    tp_comm,
                    consumers=self.readers[root] if through_view else self.readers[vid],
                    forward=not is_shared,
                    partial_to=_view_partial_to(us, axis) if through_view else None,
                    partial_elsewhere=reduced_elsewhere,
                    needs_grad=vid in self.grads,
                )
                for s in v_strats
            ]
            for us in u_strats
        ]
        if is_shared:
            self._add_shared_copy(v_idx, k, vid, u_c, pos)
        if u_c == v_c:
            return
        if self.returned_via.get((v_idx, k)) == (u_idx, pos):
            priced = self._returned_from_reader(priced, u_strats, v_strats, pos, k, value.nbytes)
        self._add_edge(_node_name(u_c), _node_name(v_c), *_weighted_pairs(priced, w))
        if v_c in self.unit_index_of:
            forward = [
                [
                    w * _forward_time(us.output_placements[pos][axis], s, k, value.nbytes, axis, tp_comm)
                    for s in v_strats
                ]
                for us in u_strats
            ]
            self._add_forward(_node_name(u_c), _node_name(v_c), forward)

    def _returned_from_reader(
        self, priced: list[list[tuple[float, float]]], u_strats, v_strats, pos: int, k: int, nbytes: float
    ) -> list[list[tuple[float, float]]]:
        """``priced`` plus the return to the caller of a partial output the module boundary gives this reader's
        placement first (:attr:`returned_via`): gathered from that placement (left partial where the reader
        takes it partial: all-reduced)."""
        axis = self.axis
        out = []
        for us, row in zip(u_strats, priced, strict=True):
            made = us.output_placements[pos][axis]
            new_row = []
            for s, (t, n) in zip(v_strats, row, strict=True):
                if is_partial(made):
                    spec = s.input_placements[k] if k < len(s.input_placements) else None
                    read = spec[axis] if spec is not None else made
                    seconds, kind = redistribute(
                        made if is_partial(read) else read, "R", nbytes, self.tp_comm
                    )
                    t, n = t + seconds, n + (1.0 if kind else 0.0)
                new_row.append((t, n))
            out.append(new_row)
        return out

    def _storage_partial(self, v_idx: int, k: int, vid: int, root: int) -> bool:
        """A use whose partial gradient is reduced to a parameter's storage placement (``root`` is a view or a
        cast of the parameter, :func:`reduced_param`): prices that reduction, in the parameter's dtype, on an
        edge parameter -> consumer, the two choices it depends on (the consumer's strategy makes the gradient
        partial, the storage says where it is reduced to), and says so (the view -> consumer edge then leaves
        it out)."""
        pvid = reduced_param(self.graph, self.tied, self.producer, root)
        if pvid is None or vid not in self.grads:
            return False
        pname = _param_node_name(self.tied.canonical_param(self.graph.values[pvid].name))
        if pname not in self.param_options:
            return False
        w = self.tied.weight[v_idx]
        v_name = _node_name(self.tied.canonical[v_idx])
        share = 1.0 / self.readers[root]
        to = [gradient_at_producer(o) for o in self.param_options[pname]]
        priced = self._reductions(to, v_name, k, self.graph.values[pvid].nbytes)
        self._add_edge(pname, v_name, *_weighted_pairs(priced, w * share))
        return True

    def _reductions(
        self, reduced_to: list[str], v_name: str, k: int, nbytes: float
    ) -> list[list[tuple[float, float]]]:
        """(seconds, collectives) of a partial gradient of consumer ``v_name``'s input ``k`` reduced to each of
        ``reduced_to`` (one row each), for each of the consumer's strategies (nothing where it makes none)."""
        partial = [_partial_gradient(s, k, self.axis) for s in self.strat_of[v_name]]
        return [
            [_reduction(redistribute("P", to, nbytes, self.tp_comm)) if p else (0.0, 0.0) for p in partial]
            for to in reduced_to
        ]

    def _root_partial(self, v_idx: int, k: int, vid: int, root: int) -> bool:
        """A use whose partial gradient passes back through a floating-point cast (and views) to ``root`` (an
        activation, :func:`gradient_root`) and is reduced there, once, with the other uses' (under autocast q,
        k and v each cast one normed input: one reduction, in the input's dtype): prices that reduction on an
        edge root's producer -> consumer, the two choices it depends on (the consumer's strategy makes the
        gradient partial, the producer's output placement is where it is reduced to; the cast reads the
        runtime's copy, whose placement says nothing of it), a ``1 / readers`` share per use, and says so (the
        edge into the consumer then leaves it out). False where no gradient reaches ``vid`` or the root is made
        by no op of the problem. A chain of views alone is priced on the edge into the consumer, as the view
        before it places it (:func:`edge_reshardings`' ``partial_to``): no edge more for the solver."""
        made = self.producer.get(root)
        if made is None or vid not in self.grads or made[0] not in self.tied.canonical:
            return False
        u_c, pos = self.tied.canonical[made[0]], made[1]
        v_c = self.tied.canonical[v_idx]
        if u_c == v_c:
            return False
        u_name, v_name = _node_name(u_c), _node_name(v_c)
        to = [gradient_at_producer(us.output_placements[pos][self.axis]) for us in self.strat_of[u_name]]
        priced = self._reductions(to, v_name, k, self.graph.values[root].nbytes)
        if any(t for row in priced for t, _ in row):  # nothing to reduce on one device: no edge
            share = self.tied.weight[v_idx] / self.readers[root]
            self._add_edge(u_name, v_name, *_weighted_pairs(priced, share))
        return True

    def _add_shared_copy(self, v_idx: int, k: int, vid: int, u_c: int, pos: int) -> None:
        """A use in :func:`shared_projection_inputs`: the runtime's projection hooks redistribute the value once
        per target placement and every sibling projection wanting that placement reads the copy. Registers the
        consumer's strategies that read each placement as members of one :class:`SharedCost`, priced once
        per producer strategy."""
        tied, axis = self.tied, self.axis
        value = self.graph.values[vid]
        w = tied.weight[v_idx]
        v_c = tied.canonical[v_idx]
        v_strats = self.strat_of[_node_name(v_c)]
        u_strats = self.strat_of[_node_name(u_c)]
        wanted_in = [
            s.input_placements[k][axis]
            if k < len(s.input_placements) and s.input_placements[k] is not None
            else None
            for s in v_strats
        ]
        for place in sorted({p for p in wanted_in if p is not None}):
            key = (vid, self.shared_uses[(v_idx, k)], place, w, _node_name(u_c))
            wanted = tuple(j for j, p in enumerate(wanted_in) if p == place)
            self.shared_members.setdefault(key, []).append((_node_name(v_c), wanted))
            self.shared_price[key] = [
                w * redistribute(us.output_placements[pos][axis], place, value.nbytes, self.tp_comm)[0]
                for us in u_strats
            ]

    def _add_edge(
        self, src: str, dst: str, matrix: list[list[float]], calls: list[list[float]] | None = None
    ) -> None:
        """Adds ``matrix`` to the edge ``src -> dst`` (uses between the same two nodes sum), and ``calls``, the
        collectives each entry issues, to ``edge_calls``."""
        if src == dst:
            # A value flowing between two copies of one tied node (same strategy on both ends): diagonal only.
            return
        for target, values in ((self.edge_cost, matrix), (self.edge_calls, calls)):
            if values is None:
                continue
            if (src, dst) in target:
                acc = target[(src, dst)]
                for a, row in zip(acc, values, strict=True):
                    for j, v in enumerate(row):
                        a[j] += v
            else:
                target[(src, dst)] = [list(r) for r in values]

    def _add_forward(self, src: str, dst: str, matrix: list[list[float]]) -> None:
        """Adds ``matrix`` to the forward resharding ``src -> dst`` a rerun of ``dst`` repeats."""
        acc = self.fwd_into.setdefault((src, dst), [[0.0] * len(matrix[0]) for _ in matrix])
        for a, row in zip(acc, matrix, strict=True):
            for j, v in enumerate(row):
                a[j] += v


def _weighted_pairs(
    priced: list[list[tuple[float, float]]], w: float
) -> tuple[list[list[float]], list[list[float]]]:
    """(seconds, collectives) per strategy pair -> the two matrices, times the use's weight."""
    return [[w * t for t, _ in row] for row in priced], [[w * n for _, n in row] for row in priced]


def _reduction(priced: tuple[float, str | None]) -> tuple[float, float]:
    """A redistribution's (seconds, collective) as (seconds, collectives issued)."""
    seconds, kind = priced
    return seconds, 1.0 if kind else 0.0
