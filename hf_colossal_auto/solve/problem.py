"""The ILP's intermediate representation: what the builder writes and the solvers (:mod:`.ilp`, :mod:`.brute_force`)
read, model-agnostic and validated on construction.

Each family of the problem and the code that writes it:

* :class:`DecisionNode` — op nodes and parameter nodes: ``build/nodes.py`` (costs from ``pricing/compute.py``);
  recompute decisions: ``build/recompute.py``; the expert exchange: ``build/expert_exchange.py``; the nodes a
  checkpoint holds a storage through: ``build/memory_rows.py::_hold_node``;
* :class:`DecisionEdge` — reshardings between producer and consumer: ``build/edges.py`` (priced by
  ``pricing/comm.py::edge_reshardings``), recompute's reruns: ``build/recompute.py``;
* :class:`MemoryConstraint` — the activation peak, the optimizer step, each recompute unit's moments:
  ``build/memory_rows.py`` (liveness from ``pricing/memory.py``);
* :class:`ConditionalCost` — the forward reshardings a recompute repeats: ``build/recompute.py``;
* :class:`SharedCost` — one redistribution shared by sibling projections: ``build/edges.py::_add_shared_copy``;
* :class:`FollowsInputs` — DTensor's own choices and unenforced splits: ``rules.py``; hold rules:
  ``build/memory_rows.py``; expert-parallel modules kept whole: ``build/expert_exchange.py``;
* :class:`Overlap` — the data-parallel synchronisation behind compute: ``pricing/comm.py::data_parallel_overlap``;
* ``fixed`` — pinned placements and recompute options: ``build/nodes.py::_pin_param``,
  ``build/recompute.py::_pin_recompute``.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field

GIB = float(1 << 30)


def _number(value: object, what: str) -> float:
    try:
        number = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ValueError(f"{what}: {value!r} is not a number") from None
    if not math.isfinite(number):
        raise ValueError(f"{what}: {value!r} is not finite")
    return number


def _vector(values: object, what: str) -> list[float]:
    if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
        raise ValueError(f"{what}: expected a list of numbers, got {values!r}")
    return [_number(v, what) for v in values]  # type: ignore[union-attr]


def _matrix(rows: object, what: str) -> list[list[float]]:
    if isinstance(rows, (str, bytes)) or not hasattr(rows, "__iter__"):
        raise ValueError(f"{what}: expected a list of rows, got {rows!r}")
    matrix = [_vector(row, what) for row in rows]  # type: ignore[union-attr]
    if not matrix or not matrix[0]:
        raise ValueError(f"{what}: the matrix is empty")
    if any(len(row) != len(matrix[0]) for row in matrix):
        raise ValueError(f"{what}: rows have different lengths {[len(r) for r in matrix]}")
    return matrix


def _index(value: object) -> int | None:
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        return None


def _count(value: object, what: str) -> int:
    count = _index(value)
    if count is None:
        raise ValueError(f"{what}: multiplicity must be an integer, got {value!r}")
    if count < 0:
        raise ValueError(f"{what}: multiplicity must be >= 0, got {count}")
    return count


def _shape(matrix: list[list[float]]) -> tuple[int, int]:
    return len(matrix), len(matrix[0])


@dataclass
class DecisionNode:
    name: str
    costs: list[float]
    labels: list[str]
    multiplicity: int = 1
    kind: str = ""
    """What the node decides, as its writer names it (the builder's :class:`~.build.names.NodeKind`: an op's
    strategy, a parameter's storage, a recompute option...); pricing reads it (the data-parallel overlap hides
    behind the op nodes' compute). The solvers never read it."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"node name must be a non-empty string, got {self.name!r}")
        what = f"node {self.name!r}"
        self.costs = _vector(self.costs, f"{what} costs")
        if not self.costs:
            raise ValueError(f"{what} has no strategies")
        self.labels = list(self.labels)
        if len(self.labels) != len(self.costs):
            raise ValueError(f"{what} has {len(self.costs)} costs but {len(self.labels)} labels")
        if not all(isinstance(label, str) for label in self.labels):
            raise ValueError(f"{what} labels must be strings, got {self.labels!r}")
        self.multiplicity = _count(self.multiplicity, what)


@dataclass
class DecisionEdge:
    src: str
    dst: str
    cost: list[list[float]]
    multiplicity: int = 1

    def __post_init__(self) -> None:
        what = f"edge {self.src!r}->{self.dst!r}"
        if not isinstance(self.src, str) or not isinstance(self.dst, str):
            raise ValueError(f"{what}: endpoints must be node names")
        self.cost = _matrix(self.cost, f"{what} cost")
        self.multiplicity = _count(self.multiplicity, what)


@dataclass
class MemoryConstraint:
    name: str
    budget: float
    constant: float
    terms: dict[str, list[float]]
    edge_terms: dict[tuple[str, str], list[list[float]]] = field(default_factory=dict)
    apply_multiplicity: bool = True
    kind: str = ""
    """What moment of the step the row stands for, as its writer names it (the builder's
    :class:`~.build.names.MemoryRow`); the write-up reads rows by name (:meth:`Problem.memory_constraint`) and
    orders them by kind. The solvers never read it."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"memory constraint name must be a non-empty string, got {self.name!r}")
        what = f"memory constraint {self.name!r}"
        budget = float(self.budget)
        if math.isnan(budget) or budget == -math.inf:
            raise ValueError(f"{what}: budget {self.budget!r} is not a number of bytes")
        self.budget = budget
        self.constant = _number(self.constant, f"{what} constant")
        self.terms = {node: _vector(values, f"{what} term {node!r}") for node, values in self.terms.items()}
        edge_terms = {}
        for key, matrix in (self.edge_terms or {}).items():
            if not isinstance(key, tuple) or len(key) != 2:
                raise ValueError(f"{what}: edge term key must be a (src, dst) tuple, got {key!r}")
            edge_terms[key] = _matrix(matrix, f"{what} edge term {key[0]!r}->{key[1]!r}")
        self.edge_terms = edge_terms


@dataclass
class ConditionalCost:
    """A pairwise cost ``cost[choice[src]][choice[dst]]`` paid only when node ``when_node`` takes one of the
    strategies in ``when``.

    Why: the collectives inside a recomputed block run twice, and whether they run at all depends on the two
    endpoints' shardings while whether they run *again* depends on the block's recompute choice, a third node.
    Costs must be >= 0 (the solver prices them through a variable bounded from below only).
    """

    src: str
    dst: str
    when_node: str
    when: tuple[int, ...]
    cost: list[list[float]]

    def __post_init__(self) -> None:
        what = f"conditional cost {self.src!r}->{self.dst!r} when {self.when_node!r}"
        self.cost = _matrix(self.cost, f"{what} cost")
        if any(v < 0 for row in self.cost for v in row):
            raise ValueError(f"{what}: costs must be >= 0")
        when = [_index(w) for w in self.when]
        if any(w is None for w in when):
            raise ValueError(f"{what}: strategies must be integers, got {self.when!r}")
        self.when = tuple(sorted(set(when)))  # type: ignore[arg-type]


@dataclass
class SharedCost:
    """A cost ``cost[choice[src]]`` paid once when at least one member ``(dst, strategies)`` has
    ``choice[dst]`` in ``strategies``.

    Why: a value several ops read in the same placement is redistributed once and the copy shared (the
    runtime's projection-input hooks keep the copy they made): the q, k and v projections of one normed input
    gather it once, not three times. A pairwise edge cost cannot say "once for all of them". Costs must be
    >= 0 (the solver prices them through a variable bounded from below only).
    """

    src: str
    members: tuple[tuple[str, tuple[int, ...]], ...]
    cost: list[float]

    def __post_init__(self) -> None:
        what = f"shared cost of {self.src!r}"
        self.cost = _vector(self.cost, f"{what} cost")
        if any(v < 0 for v in self.cost):
            raise ValueError(f"{what}: costs must be >= 0")
        members = []
        for member in self.members:
            if not isinstance(member, (tuple, list)) or len(member) != 2 or not isinstance(member[0], str):
                raise ValueError(f"{what}: members must be (node, strategies) pairs, got {member!r}")
            strategies = [_index(w) for w in member[1]]
            if any(w is None for w in strategies):
                raise ValueError(f"{what}: strategies must be integers, got {member[1]!r}")
            members.append((member[0], tuple(sorted(set(strategies)))))
        self.members = tuple(members)  # type: ignore[assignment]

    def applies(self, choice: dict[str, int]) -> bool:
        return any(choice[dst] in strategies for dst, strategies in self.members)


@dataclass
class FollowsInputs:
    """Node ``dst`` may take one of the strategies in ``sharding`` only if at least one of its inputs is not
    replicated: an input ``(producer, replicated)`` is replicated when the producer takes a strategy in
    ``replicated`` (``None`` for an input that is always replicated, e.g. a model input).

    Why: the runtime enforces the plan at module boundaries and projections; an op it does not enforce (the loss
    the model's own ``forward`` computes) runs as DTensor's propagation decides, and DTensor never splits an op
    whose inputs are all replicated. Pricing such a split would predict work and collectives that do not run.
    """

    dst: str
    sharding: tuple[int, ...]
    inputs: tuple[tuple[str | None, tuple[int, ...]], ...]

    def __post_init__(self) -> None:
        self.sharding = tuple(sorted({int(j) for j in self.sharding}))
        self.inputs = tuple((src, tuple(sorted({int(i) for i in ids}))) for src, ids in self.inputs)

    def violated(self, choice: dict[str, int]) -> bool:
        if choice[self.dst] not in self.sharding:
            return False
        return all(src is None or choice[src] in ids for src, ids in self.inputs)


@dataclass
class Overlap:
    """Communication that runs in the background of computation: the step pays only what is not hidden.

    ``C = sum comm[n][choice[n]]`` (times each node's multiplicity) is the communication, ``K`` likewise the
    computation it can run behind, and ``efficiency`` in ``[0, 1]`` how much of the overlapped span the device
    and its collectives really share (measured by calibration: 1 where they use separate engines, lower where
    the collective's thread competes with the compute for the same cores). The exposed part is
    ``C - efficiency * min(C, K) = max(C - efficiency * K, (1 - efficiency) * C)``: never less than
    ``(1 - efficiency) * C``, never more than ``C``, and ``max(C, K)`` when the overlap is perfect.

    Why: DDP's gradient all-reduce runs while backward computes the next gradients, FSDP's all-gathers and
    reduce-scatters while a neighbouring block computes; pricing them as if serial overstates exactly the plans
    that synchronise most. Those costs must not also be in the nodes' own costs.
    """

    name: str
    comm: dict[str, list[float]]
    compute: dict[str, list[float]]
    efficiency: float
    compute_edges: dict[tuple[str, str], list[list[float]]] = field(default_factory=dict)
    """Computation priced on edges, ``(src, dst) -> cost[src strategy][dst strategy]`` (times the edge's
    multiplicity): the device time of the collectives between ops, which the host's stream runs ahead of as it
    does of kernels (:func:`~.pricing.compute.host_stream_overlaps`)."""
    comm_edges: dict[tuple[str, str], list[list[float]]] = field(default_factory=dict)
    """Communication priced on edges, likewise (the host's seconds of the redistributions an edge issues)."""

    def __post_init__(self) -> None:
        what = f"overlap {self.name!r}"
        self.comm = {k: _vector(v, f"{what} comm of {k!r}") for k, v in self.comm.items()}
        self.compute = {k: _vector(v, f"{what} compute of {k!r}") for k, v in self.compute.items()}
        self.compute_edges = {
            (str(src), str(dst)): _matrix(m, f"{what} compute of edge {src!r} -> {dst!r}")
            for (src, dst), m in self.compute_edges.items()
        }
        self.comm_edges = {
            (str(src), str(dst)): _matrix(m, f"{what} comm of edge {src!r} -> {dst!r}")
            for (src, dst), m in self.comm_edges.items()
        }
        if any(x < 0 for values in (*self.comm.values(), *self.compute.values()) for x in values) or any(
            x < 0 for m in (*self.compute_edges.values(), *self.comm_edges.values()) for row in m for x in row
        ):
            raise ValueError(f"{what}: seconds must be >= 0")
        self.efficiency = _number(self.efficiency, f"{what} efficiency")
        if not 0.0 <= self.efficiency <= 1.0:
            raise ValueError(f"{what}: efficiency must be in [0, 1], got {self.efficiency}")

    def exposed(self, problem: Problem, choice: dict[str, int]) -> float:
        """Seconds of communication the step waits for under ``choice``."""
        comm, compute = self.totals(problem, choice)
        return comm - self.efficiency * min(comm, compute)

    def totals(self, problem: Problem, choice: dict[str, int]) -> tuple[float, float]:
        """``(C, K)`` under ``choice``: the communication and the computation, nodes' and edges'."""

        def total(nodes: dict[str, list[float]], edges: dict[tuple[str, str], list[list[float]]]) -> float:
            return math.fsum(
                [problem._by_name[k].multiplicity * v[choice[k]] for k, v in nodes.items()]
                + [
                    problem._edge_by_key[(src, dst)].multiplicity * m[choice[src]][choice[dst]]
                    for (src, dst), m in edges.items()
                ]
            )

        return total(self.comm, self.comm_edges), total(self.compute, self.compute_edges)


@dataclass
class Problem:
    nodes: list[DecisionNode]
    edges: list[DecisionEdge] = field(default_factory=list)
    memory_constraints: list[MemoryConstraint] = field(default_factory=list)
    name: str = ""
    fixed: dict[str, int] = field(default_factory=dict)
    equal_strategy: list[tuple[str, str]] = field(default_factory=list)
    conditional_costs: list[ConditionalCost] = field(default_factory=list)
    shared_costs: list[SharedCost] = field(default_factory=list)
    follows_inputs: list[FollowsInputs] = field(default_factory=list)
    overlaps: list[Overlap] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.nodes = list(self.nodes)
        self.edges = list(self.edges)
        self.conditional_costs = list(self.conditional_costs)
        self.shared_costs = list(self.shared_costs)
        self.follows_inputs = list(self.follows_inputs)
        self.memory_constraints = list(self.memory_constraints)
        self.fixed = dict(self.fixed)
        self.equal_strategy = [tuple(pair) for pair in self.equal_strategy]
        self._by_name: dict[str, DecisionNode] = {}
        for node in self.nodes:
            if not isinstance(node, DecisionNode):
                raise ValueError(f"nodes must be DecisionNode instances, got {node!r}")
            if node.name in self._by_name:
                raise ValueError(f"node {node.name!r} is defined twice")
            self._by_name[node.name] = node
        self._edge_by_key: dict[tuple[str, str], DecisionEdge] = {}
        for edge in self.edges:
            self._check_edge(edge)
        self._constraint_by_name: dict[str, MemoryConstraint] = {}
        for constraint in self.memory_constraints:
            if constraint.name in self._constraint_by_name:
                raise ValueError(f"memory constraint {constraint.name!r} is defined twice")
            self._check_constraint(constraint)
            self._constraint_by_name[constraint.name] = constraint
        for node_name, value in self.fixed.items():
            node = self._node(node_name, "fixed strategy")
            strategy = _index(value)
            if strategy is None:
                raise ValueError(f"fixed strategy of node {node_name!r} must be an int, got {value!r}")
            self.fixed[node_name] = strategy
            if not 0 <= strategy < len(node.costs):
                raise ValueError(
                    f"fixed strategy {strategy} of node {node_name!r} is out of range "
                    f"(it has {len(node.costs)} strategies)"
                )
        for cond in self.conditional_costs:
            if not isinstance(cond, ConditionalCost):
                raise ValueError(f"conditional_costs must be ConditionalCost instances, got {cond!r}")
            what = f"conditional cost {cond.src!r}->{cond.dst!r}"
            src, dst = self._node(cond.src, what), self._node(cond.dst, what)
            gate = self._node(cond.when_node, what)
            if _shape(cond.cost) != (len(src.costs), len(dst.costs)):
                raise ValueError(
                    f"{what} cost matrix has shape {_shape(cond.cost)}, expected {(len(src.costs), len(dst.costs))}"
                )
            if any(not 0 <= w < len(gate.costs) for w in cond.when):
                raise ValueError(f"{what}: strategies {cond.when} out of range for node {gate.name!r}")
        for shared in self.shared_costs:
            if not isinstance(shared, SharedCost):
                raise ValueError(f"shared_costs must be SharedCost instances, got {shared!r}")
            what = f"shared cost of {shared.src!r}"
            src = self._node(shared.src, what)
            if len(shared.cost) != len(src.costs):
                raise ValueError(f"{what} has {len(shared.cost)} costs, expected {len(src.costs)}")
            for dst, strategies in shared.members:
                node = self._node(dst, what)
                if any(not 0 <= w < len(node.costs) for w in strategies):
                    raise ValueError(f"{what}: strategies {strategies} out of range for node {dst!r}")
        for rule in self.follows_inputs:
            if not isinstance(rule, FollowsInputs):
                raise ValueError(f"follows_inputs must be FollowsInputs instances, got {rule!r}")
            what = f"follows-inputs rule of {rule.dst!r}"
            dst = self._node(rule.dst, what)
            if any(not 0 <= j < len(dst.costs) for j in rule.sharding):
                raise ValueError(f"{what}: strategies {rule.sharding} out of range")
            for src, ids in rule.inputs:
                if src is not None and any(not 0 <= i < len(self._node(src, what).costs) for i in ids):
                    raise ValueError(f"{what}: strategies {ids} out of range for node {src!r}")
        self.overlaps = list(self.overlaps)
        for overlap in self.overlaps:
            if not isinstance(overlap, Overlap):
                raise ValueError(f"overlaps must be Overlap instances, got {overlap!r}")
            for k, values in (*overlap.comm.items(), *overlap.compute.items()):
                node = self._node(k, f"overlap {overlap.name!r}")
                if len(values) != len(node.costs):
                    raise ValueError(
                        f"overlap {overlap.name!r}: {len(values)} values for node {k!r}, expected {len(node.costs)}"
                    )
            for key, matrix in (*overlap.compute_edges.items(), *overlap.comm_edges.items()):
                edge = self._edge_by_key.get(key)
                if edge is None or _shape(matrix) != _shape(edge.cost):
                    raise ValueError(
                        f"overlap {overlap.name!r}: compute of {key!r} matches no edge of the problem"
                    )
        for pair in self.equal_strategy:
            if len(pair) != 2:
                raise ValueError(f"equal_strategy entries must be (node, node) pairs, got {pair!r}")
            first = self._node(pair[0], "equal_strategy")
            second = self._node(pair[1], "equal_strategy")
            if len(first.costs) != len(second.costs):
                raise ValueError(
                    f"equal_strategy ties node {first.name!r} ({len(first.costs)} strategies) to node "
                    f"{second.name!r} ({len(second.costs)} strategies); the counts must match"
                )
        self.strategy_groups()

    def _node(self, name: object, where: str) -> DecisionNode:
        node = self._by_name.get(name) if isinstance(name, str) else None
        if node is None:
            raise ValueError(f"{where} refers to unknown node {name!r}")
        return node

    def _check_edge(self, edge: DecisionEdge) -> None:
        if not isinstance(edge, DecisionEdge):
            raise ValueError(f"edges must be DecisionEdge instances, got {edge!r}")
        what = f"edge {edge.src!r}->{edge.dst!r}"
        src = self._node(edge.src, what)
        dst = self._node(edge.dst, what)
        expected = (len(src.costs), len(dst.costs))
        if _shape(edge.cost) != expected:
            raise ValueError(f"{what} cost matrix has shape {_shape(edge.cost)}, expected {expected}")
        key = (edge.src, edge.dst)
        if key in self._edge_by_key:
            raise ValueError(f"{what} is defined twice; merge the two by summing their cost matrices")
        self._edge_by_key[key] = edge

    def _check_constraint(self, constraint: MemoryConstraint) -> None:
        if not isinstance(constraint, MemoryConstraint):
            raise ValueError(f"memory_constraints must be MemoryConstraint instances, got {constraint!r}")
        what = f"memory constraint {constraint.name!r}"
        for node_name, values in constraint.terms.items():
            node = self._node(node_name, what)
            if len(values) != len(node.costs):
                raise ValueError(
                    f"{what} term for node {node_name!r} has {len(values)} values, expected {len(node.costs)}"
                )
        for key, matrix in constraint.edge_terms.items():
            edge = self._edge_by_key.get(key)
            if edge is None:
                raise ValueError(f"{what} has an edge term for unknown edge {key[0]!r}->{key[1]!r}")
            if _shape(matrix) != _shape(edge.cost):
                raise ValueError(
                    f"{what} edge term {key[0]!r}->{key[1]!r} has shape {_shape(matrix)}, "
                    f"expected {_shape(edge.cost)}"
                )

    def node(self, name: str) -> DecisionNode:
        return self._node(name, "lookup")

    def memory_constraint(self, name: str) -> MemoryConstraint:
        """The memory row named ``name`` (rows are read by name, never by position)."""
        constraint = self._constraint_by_name.get(name)
        if constraint is None:
            raise ValueError(f"unknown memory constraint {name!r} (rows: {sorted(self._constraint_by_name)})")
        return constraint

    def edge(self, src: str, dst: str) -> DecisionEdge:
        edge = self._edge_by_key.get((src, dst))
        if edge is None:
            raise ValueError(f"unknown edge {src!r}->{dst!r}")
        return edge

    def strategy_groups(self) -> list[tuple[list[str], int | None]]:
        parent = {name: name for name in self._by_name}

        def root(name: str) -> str:
            while parent[name] != name:
                parent[name] = parent[parent[name]]
                name = parent[name]
            return name

        for first, second in self.equal_strategy:
            a, b = root(first), root(second)
            if a != b:
                parent[max(a, b)] = min(a, b)
        members: dict[str, list[str]] = {}
        for name in sorted(self._by_name):
            members.setdefault(root(name), []).append(name)
        groups = []
        for group in sorted(members.values()):
            pins = {self.fixed[name] for name in group if name in self.fixed}
            if len(pins) > 1:
                pinned = {name: self.fixed[name] for name in group if name in self.fixed}
                raise ValueError(f"equal_strategy ties nodes pinned to different strategies: {pinned}")
            pin = pins.pop() if pins else None
            if pin is None and len(self._by_name[group[0]].costs) == 1:
                pin = 0
            groups.append((group, pin))
        return groups


@dataclass
class Solution:
    choice: dict[str, int]
    objective_s: float
    status: str
    gap: float | None
    solve_time_s: float
    solver: str
    num_variables: int
    num_constraints: int
    peak_memory: float
    labels: dict[str, str] = field(default_factory=dict)


class InfeasibleError(ValueError):
    def __init__(self, message: str, *, min_required: float, exact: bool, choice: dict[str, int] | None):
        super().__init__(message)
        self.min_required = min_required
        self.exact = exact
        self.choice = choice


def infeasible_message(problem: Problem, min_required: float, exact: bool) -> str:
    budget = reference_budget(problem)
    amount = f"{min_required:.0f} bytes ({min_required / GIB:.3f} GiB)"
    if exact:
        head = f"the smallest per-device memory any choice needs is {amount}"
    else:
        head = f"the smallest per-device memory any choice needs is at least {amount} (search timed out)"
    label = f" for problem {problem.name!r}" if problem.name else ""
    return (
        f"no strategy choice fits the memory budget{label}: {head}, "
        f"over the budget of {budget:.0f} bytes ({budget / GIB:.3f} GiB)"
    )


def reference_budget(problem: Problem) -> float:
    budgets = [c.budget for c in problem.memory_constraints if math.isfinite(c.budget)]
    return max(budgets) if budgets else math.inf


def _check_choice(problem: Problem, choice: dict[str, int]) -> None:
    for name in choice:
        problem._node(name, "choice")
    for node in problem.nodes:
        if node.name not in choice:
            raise ValueError(f"choice has no strategy for node {node.name!r}")
        strategy = _index(choice[node.name])
        if strategy is None or not 0 <= strategy < len(node.costs):
            raise ValueError(
                f"choice gives node {node.name!r} strategy {strategy!r}, "
                f"which is not in range({len(node.costs)})"
            )


def _objective(problem: Problem, choice: dict[str, int]) -> float:
    parts = [node.multiplicity * node.costs[choice[node.name]] for node in problem.nodes]
    parts += [edge.multiplicity * edge.cost[choice[edge.src]][choice[edge.dst]] for edge in problem.edges]
    parts += [
        c.cost[choice[c.src]][choice[c.dst]]
        for c in problem.conditional_costs
        if choice[c.when_node] in c.when
    ]
    parts += [c.cost[choice[c.src]] for c in problem.shared_costs if c.applies(choice)]
    parts += [overlap.exposed(problem, choice) for overlap in problem.overlaps]
    return math.fsum(parts)


def _usage(problem: Problem, constraint: MemoryConstraint, choice: dict[str, int]) -> float:
    parts = [constraint.constant]
    for node_name, values in constraint.terms.items():
        scale = problem._by_name[node_name].multiplicity if constraint.apply_multiplicity else 1
        parts.append(scale * values[choice[node_name]])
    for (src, dst), matrix in constraint.edge_terms.items():
        scale = problem._edge_by_key[(src, dst)].multiplicity if constraint.apply_multiplicity else 1
        parts.append(scale * matrix[choice[src]][choice[dst]])
    return math.fsum(parts)


def memory_usage(problem: Problem, choice: dict[str, int]) -> dict[str, float]:
    _check_choice(problem, choice)
    return {c.name: _usage(problem, c, choice) for c in problem.memory_constraints}


def overshoot(problem: Problem, choice: dict[str, int]) -> float:
    excess = [
        _usage(problem, c, choice) - c.budget for c in problem.memory_constraints if math.isfinite(c.budget)
    ]
    return max(excess) if excess else -math.inf


def evaluate(problem: Problem, choice: dict[str, int]) -> tuple[float, float, bool]:
    _check_choice(problem, choice)
    usage = [(_usage(problem, c, choice), c.budget) for c in problem.memory_constraints]
    peak = max((value for value, _ in usage), default=0.0)
    feasible = all(value <= budget for value, budget in usage)
    feasible = feasible and all(choice[name] == strategy for name, strategy in problem.fixed.items())
    feasible = feasible and all(choice[a] == choice[b] for a, b in problem.equal_strategy)
    feasible = feasible and not any(rule.violated(choice) for rule in problem.follows_inputs)
    return _objective(problem, choice), peak, feasible
