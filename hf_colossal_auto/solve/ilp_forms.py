"""The problem as linear forms over one-hot strategy groups, before any solver sees it (no PuLP here: the model
:mod:`.ilp` builds from these forms is its only PuLP user).

Nodes that must take the same strategy (``Problem.equal_strategy``) form one group (:class:`_Groups`), pinned
or free; every cost and memory term becomes an affine form over the free groups' one-hot choices
(:class:`_Affine` -> :class:`_Form`): pinned groups fold into the constant, an edge's matrix into two linear
terms where it is additive (:func:`_additive`) or else a pairwise term, a conditional cost over at most two
free groups into a pairwise term (:func:`_conditional`; three free groups stay a :class:`_Triple`). Memory
constraints become rows (:func:`_memory_rows`), of which only the tightest of identical forms is kept
(:func:`_tightest`). Forms are shifted so every term is >= 0 with its minimum in the constant, which lets the
solver drop rows that cannot bind.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .problem import ConditionalCost, MemoryConstraint, Problem

ADDITIVE_RTOL = 1e-12
"""How far from additive (``row_i + col_j``) a pairwise matrix may be, relative to its largest entry, and still be
split into two linear terms."""
ROUNDING_RTOL = 1e-12
"""The slack a memory row is given, relative to its largest figure, for the solver's floating-point rounding."""


class _Groups:
    def __init__(self, problem: Problem):
        self.members: list[list[str]] = []
        self.pin: list[int | None] = []
        self.size: list[int] = []
        self.of: dict[str, int] = {}
        for index, (members, pin) in enumerate(problem.strategy_groups()):
            self.members.append(members)
            self.pin.append(pin)
            self.size.append(len(problem.node(members[0]).costs))
            for name in members:
                self.of[name] = index
        self.free = [g for g, pin in enumerate(self.pin) if pin is None]

    def expand(self, free_choice: dict[int, int]) -> dict[str, int]:
        choice = {}
        for g, members in enumerate(self.members):
            pin = self.pin[g]
            strategy = pin if pin is not None else free_choice[g]
            for name in members:
                choice[name] = strategy
        return dict(sorted(choice.items()))

    def support(self, problem: Problem, constraint: MemoryConstraint) -> list[int]:
        names = set(constraint.terms)
        for src, dst in constraint.edge_terms:
            names.update((src, dst))
        return sorted({self.of[n] for n in names if self.pin[self.of[n]] is None})


def _additive(matrix: list[list[float]]) -> tuple[list[float], list[float]] | None:
    rows = [row[0] for row in matrix]
    cols = [value - matrix[0][0] for value in matrix[0]]
    tolerance = ADDITIVE_RTOL * max(abs(v) for row in matrix for v in row)
    for i, row in enumerate(matrix):
        for j, value in enumerate(row):
            if abs(value - rows[i] - cols[j]) > tolerance:
                return None
    return rows, cols


@dataclass
class _Form:
    constant: float
    lin: dict[int, list[float]]
    pairs: dict[tuple[int, int], list[list[float]]]

    def top(self) -> float:
        tops = [max(v) for v in self.lin.values()]
        tops += [max(max(row) for row in m) for m in self.pairs.values()]
        return math.fsum(tops)

    def magnitude(self) -> float:
        values = [max(v) for v in self.lin.values()]
        values += [max(max(row) for row in m) for m in self.pairs.values()]
        return max(values, default=0.0)

    def key(self) -> tuple:
        lin = tuple((g, tuple(v)) for g, v in sorted(self.lin.items()))
        pairs = tuple((k, tuple(map(tuple, m))) for k, m in sorted(self.pairs.items()))
        return lin, pairs


class _Affine:
    def __init__(self, groups: _Groups, constant: float = 0.0):
        self.groups = groups
        self.constant = constant
        self.lin: dict[int, list[float]] = {}
        self.pairs: dict[tuple[int, int], list[list[float]]] = {}

    def add_group(self, g: int, values: list[float]) -> None:
        pin = self.groups.pin[g]
        if pin is not None:
            self.constant += values[pin]
            return
        acc = self.lin.setdefault(g, [0.0] * len(values))
        for s, value in enumerate(values):
            acc[s] += value

    def add_node(self, name: str, values: list[float]) -> None:
        self.add_group(self.groups.of[name], values)

    def add_edge(self, src: str, dst: str, matrix: list[list[float]]) -> None:
        g, h = self.groups.of[src], self.groups.of[dst]
        pin_g, pin_h = self.groups.pin[g], self.groups.pin[h]
        if pin_g is not None and pin_h is not None:
            self.constant += matrix[pin_g][pin_h]
        elif pin_g is not None:
            self.add_group(h, matrix[pin_g])
        elif pin_h is not None:
            self.add_group(g, [row[pin_h] for row in matrix])
        elif g == h:
            self.add_group(g, [matrix[i][i] for i in range(len(matrix))])
        else:
            if g > h:
                g, h = h, g
                matrix = [list(col) for col in zip(*matrix, strict=True)]
            acc = self.pairs.setdefault((g, h), [[0.0] * len(matrix[0]) for _ in matrix])
            for i, row in enumerate(matrix):
                for j, value in enumerate(row):
                    acc[i][j] += value

    def finish(self) -> _Form:
        pairs = {}
        for key in sorted(self.pairs):
            matrix = self.pairs[key]
            if not any(any(row) for row in matrix):
                continue
            split = _additive(matrix)
            if split is None:
                pairs[key] = matrix
            else:
                self.add_group(key[0], split[0])
                self.add_group(key[1], split[1])
        constant = self.constant
        lin = {}
        for g in sorted(self.lin):
            low = min(self.lin[g])
            constant += low
            shifted = [value - low for value in self.lin[g]]
            if any(shifted):
                lin[g] = shifted
        for key, matrix in pairs.items():
            low = min(min(row) for row in matrix)
            constant += low
            pairs[key] = [[value - low for value in row] for row in matrix]
        return _Form(constant, lin, pairs)


def _objective_form(problem: Problem, groups: _Groups) -> tuple[_Form, list[_Triple]]:
    acc = _Affine(groups)
    for node in sorted(problem.nodes, key=lambda n: n.name):
        acc.add_node(node.name, [node.multiplicity * c for c in node.costs])
    for edge in sorted(problem.edges, key=lambda e: (e.src, e.dst)):
        if edge.multiplicity and any(any(row) for row in edge.cost):
            acc.add_edge(edge.src, edge.dst, [[edge.multiplicity * c for c in row] for row in edge.cost])
    triples = [t for c in problem.conditional_costs if (t := _conditional(acc, groups, c)) is not None]
    return acc.finish(), triples


@dataclass
class _Triple:
    """A conditional cost over three distinct free groups: ``cost[i][j]`` when ``g=i, h=j`` and ``r`` in ``when``."""

    g: int
    h: int
    r: int
    when: tuple[int, ...]
    cost: list[list[float]]


def _conditional(acc: _Affine, groups: _Groups, cond: ConditionalCost) -> _Triple | None:
    """Fold a conditional cost into ``acc`` when pins or shared groups leave at most two free groups; otherwise
    return it as a triple for :meth:`_Model.triple_terms`."""
    if not any(any(row) for row in cond.cost):
        return None
    slots = (groups.of[cond.src], groups.of[cond.dst], groups.of[cond.when_node])
    free = sorted({g for g in slots if groups.pin[g] is None})
    if len(free) == 3:
        return _Triple(*slots, cond.when, cond.cost)
    when = set(cond.when)

    def value(assign: dict[int, int]) -> float:
        i, j, o = (assign[g] if groups.pin[g] is None else groups.pin[g] for g in slots)
        return cond.cost[i][j] if o in when else 0.0

    if not free:
        acc.constant += value({})
    elif len(free) == 1:
        (g,) = free
        acc.add_group(g, [value({g: i}) for i in range(groups.size[g])])
    else:
        g, h = free
        matrix = [[value({g: i, h: j}) for j in range(groups.size[h])] for i in range(groups.size[g])]
        acc.add_edge(groups.members[g][0], groups.members[h][0], matrix)
    return None


@dataclass
class _Row:
    name: str
    budget: float
    form: _Form

    @property
    def slack(self) -> float:
        return self.budget - self.form.constant

    @property
    def rounding(self) -> float:
        return ROUNDING_RTOL * max(abs(self.budget), abs(self.form.constant), self.form.top())


def _memory_rows(problem: Problem, groups: _Groups) -> list[_Row]:
    rows = []
    for constraint in sorted(problem.memory_constraints, key=lambda c: c.name):
        if not math.isfinite(constraint.budget):
            continue
        acc = _Affine(groups, constraint.constant)
        for name in sorted(constraint.terms):
            scale = problem.node(name).multiplicity if constraint.apply_multiplicity else 1
            acc.add_node(name, [scale * v for v in constraint.terms[name]])
        for src, dst in sorted(constraint.edge_terms):
            scale = problem.edge(src, dst).multiplicity if constraint.apply_multiplicity else 1
            matrix = constraint.edge_terms[(src, dst)]
            acc.add_edge(src, dst, [[scale * v for v in row] for row in matrix])
        rows.append(_Row(constraint.name, constraint.budget, acc.finish()))
    return rows


def _tightest(rows: list[_Row]) -> list[_Row]:
    best: dict[tuple, _Row] = {}
    for row in rows:
        key = row.form.key()
        if key not in best or row.slack < best[key].slack:
            best[key] = row
    return sorted(best.values(), key=lambda r: r.name)
