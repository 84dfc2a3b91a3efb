from __future__ import annotations

import itertools
import math
import random
import time

import pulp
import pytest

from hf_colossal_auto.solve import (
    ConditionalCost,
    DecisionEdge,
    DecisionNode,
    FollowsInputs,
    InfeasibleError,
    MemoryConstraint,
    Overlap,
    Problem,
    SharedCost,
    available_solvers,
    brute_force,
    evaluate,
    memory_usage,
    solve,
)

SOLVERS = available_solvers()
MIB = float(1 << 20)


def _value(rng: random.Random, integral: bool, scale: float) -> float:
    return float(rng.randint(0, 1000)) * scale if integral else rng.uniform(0.0, 1000.0) * scale


def _matrix(rng: random.Random, rows: int, cols: int, integral: bool, scale: float) -> list[list[float]]:
    kind = rng.choice(["dense", "dense", "additive", "zero", "diagonal"])
    if kind == "zero":
        return [[0.0] * cols for _ in range(rows)]
    if kind == "additive":
        a = [_value(rng, integral, scale) for _ in range(rows)]
        b = [_value(rng, integral, scale) for _ in range(cols)]
        return [[a[i] + b[j] for j in range(cols)] for i in range(rows)]
    if kind == "diagonal":
        off = _value(rng, integral, scale)
        return [[0.0 if i == j else off for j in range(cols)] for i in range(rows)]
    return [[_value(rng, integral, scale) for _ in range(cols)] for _ in range(rows)]


def _random_choice(rng: random.Random, problem: Problem) -> dict[str, int]:
    choice = {}
    for members, pin in problem.strategy_groups():
        strategy = pin if pin is not None else rng.randrange(len(problem.node(members[0]).costs))
        for name in members:
            choice[name] = strategy
    return choice


def random_problem(seed: int, binding: bool = True) -> Problem:
    rng = random.Random(seed)
    integral = seed % 2 == 0
    seconds = 1e-3 if integral else 1e-5
    nbytes = MIB if integral else 1e6
    count = rng.randint(3, 6)
    nodes = []
    for index in range(count):
        size = rng.randint(2, 4)
        nodes.append(
            DecisionNode(
                name=f"n{index}",
                costs=[_value(rng, integral, seconds) for _ in range(size)],
                labels=[f"s{s}" for s in range(size)],
                multiplicity=rng.randint(1, 4),
            )
        )
    pairs = [(a, b) for a in nodes for b in nodes if a is not b or rng.random() < 0.1]
    edges = [
        DecisionEdge(
            a.name,
            b.name,
            _matrix(rng, len(a.costs), len(b.costs), integral, seconds),
            multiplicity=rng.randint(0, 4),
        )
        for a, b in rng.sample(pairs, min(len(pairs), rng.randint(2, 2 * count)))
    ]
    equal = []
    same = [(a.name, b.name) for a, b in itertools.combinations(nodes, 2) if len(a.costs) == len(b.costs)]
    if same and rng.random() < 0.5:
        equal.append(rng.choice(same))
    fixed = {}
    if rng.random() < 0.3:
        node = rng.choice(nodes)
        if all(node.name not in pair for pair in equal):
            fixed[node.name] = rng.randrange(len(node.costs))
    constraints = []
    for index in range(rng.randint(1, 4)):
        terms = {
            node.name: [_value(rng, integral, nbytes) for _ in node.costs]
            for node in rng.sample(nodes, rng.randint(1, count))
        }
        edge_terms = {}
        for edge in edges:
            if rng.random() < 0.3:
                rows, cols = len(edge.cost), len(edge.cost[0])
                edge_terms[(edge.src, edge.dst)] = _matrix(rng, rows, cols, integral, nbytes)
        constraints.append(
            MemoryConstraint(
                name=f"t{index}",
                budget=math.inf,
                constant=_value(rng, integral, nbytes),
                terms=terms,
                edge_terms=edge_terms,
                apply_multiplicity=rng.random() < 0.8,
            )
        )
    conditional = []
    for _ in range(rng.randint(0, 3)):
        a, b, gate = (rng.choice(nodes) for _ in range(3))
        when = tuple(rng.sample(range(len(gate.costs)), rng.randint(1, len(gate.costs))))
        matrix = _matrix(rng, len(a.costs), len(b.costs), integral, seconds)
        conditional.append(ConditionalCost(a.name, b.name, gate.name, when, matrix))
    shared = []
    for _ in range(rng.randint(0, 3)):
        src = rng.choice(nodes)
        members = []
        for dst in rng.sample(nodes, rng.randint(1, min(3, count))):
            members.append(
                (dst.name, tuple(rng.sample(range(len(dst.costs)), rng.randint(1, len(dst.costs)))))
            )
        shared.append(
            SharedCost(src.name, tuple(members), [_value(rng, integral, seconds) for _ in src.costs])
        )
    follows = []
    pinned = {n for pair in equal for n in pair if any(m in fixed for m in pair)} | set(fixed)
    for _ in range(rng.randint(0, 2)):
        dst = rng.choice(nodes)
        tied = any(dst.name in pair for pair in equal)
        if dst.name in pinned or tied or any(rule.dst == dst.name for rule in follows):
            continue  # keep a strategy outside `sharding` reachable, so that some choice is runnable
        sharding = tuple(rng.sample(range(len(dst.costs)), rng.randint(1, len(dst.costs) - 1)))
        inputs = []
        for src in rng.sample([n for n in nodes if n is not dst], rng.randint(1, 2)):
            inputs.append(
                (src.name, tuple(rng.sample(range(len(src.costs)), rng.randint(1, len(src.costs)))))
            )
        if rng.random() < 0.3:
            inputs.append((None, ()))
        follows.append(FollowsInputs(dst.name, sharding, tuple(inputs)))
    overlaps = []
    for index in range(rng.randint(0, 2)):
        comm = {n.name: [_value(rng, integral, seconds) for _ in n.costs] for n in rng.sample(nodes, 2)}
        compute = {n.name: [_value(rng, integral, seconds) for _ in n.costs] for n in rng.sample(nodes, 2)}
        efficiency = rng.choice([0.0, 0.5, 1.0, rng.random()])
        # seconds on edges too (the host stream's collectives), read through the pairs' joint variables
        compute_edges = {
            (e.src, e.dst): _matrix(rng, len(e.cost), len(e.cost[0]), integral, seconds)
            for e in edges
            if rng.random() < 0.3
        }
        comm_edges = {
            (e.src, e.dst): _matrix(rng, len(e.cost), len(e.cost[0]), integral, seconds)
            for e in edges
            if rng.random() < 0.2
        }
        overlaps.append(Overlap(f"o{index}", comm, compute, efficiency, compute_edges, comm_edges))
    problem = Problem(
        nodes,
        edges,
        constraints,
        name=f"random{seed}",
        fixed=fixed,
        equal_strategy=equal,
        conditional_costs=conditional,
        shared_costs=shared,
        follows_inputs=follows,
        overlaps=overlaps,
    )
    if binding:
        usages = [memory_usage(problem, _random_choice(rng, problem)) for _ in range(3)]
        for constraint in constraints:
            constraint.budget = min(usage[constraint.name] for usage in usages)
            if rng.random() < 0.2:
                constraint.budget = max(usage[constraint.name] for usage in usages) * 2
    return problem


def _close(a: float, b: float, rtol: float = 1e-9) -> bool:
    return abs(a - b) <= rtol * max(abs(a), abs(b), 1e-300)


@pytest.mark.parametrize("backend", SOLVERS)
def test_matches_brute_force(backend: str) -> None:
    infeasible = 0
    for seed in range(50):
        problem = random_problem(seed)
        try:
            expected = brute_force(problem)
        except InfeasibleError as error:
            infeasible += 1
            with pytest.raises(InfeasibleError) as caught:
                solve(problem, solver=backend)
            assert caught.value.exact
            assert _close(caught.value.min_required, error.min_required, 1e-6), seed
            continue
        found = solve(problem, solver=backend)
        assert found.status == "optimal", seed
        assert _close(found.objective_s, expected.objective_s), (seed, found, expected)
        objective, peak, feasible = evaluate(problem, found.choice)
        assert feasible, seed
        assert objective == found.objective_s
        assert peak == found.peak_memory
        assert found.labels == {n.name: n.labels[found.choice[n.name]] for n in problem.nodes}
    assert infeasible < 25


def _node(name: str, costs: list[float], multiplicity: int = 1) -> DecisionNode:
    return DecisionNode(name, costs, [f"{name}{s}" for s in range(len(costs))], multiplicity)


def _chain(count: int, strategies: int, seed: int) -> Problem:
    rng = random.Random(seed)
    nodes = [_node(f"n{i:03d}", [rng.uniform(0, 1e-2) for _ in range(strategies)]) for i in range(count)]
    edges = [
        DecisionEdge(
            a.name, b.name, [[rng.uniform(0, 1e-2) for _ in range(strategies)] for _ in range(strategies)]
        )
        for a, b in itertools.pairwise(nodes)
    ]
    return Problem(nodes, edges, name="chain")


def _knapsack(seed: int, count: int = 80, rows: int = 4) -> Problem:
    problem = _chain(count, 4, seed)
    rng = random.Random(seed)
    for k in range(rows):
        terms = {n.name: [rng.uniform(0, 1e9) for _ in range(4)] for n in problem.nodes}
        low = sum(min(v) for v in terms.values())
        high = sum(max(v) for v in terms.values())
        problem.memory_constraints.append(MemoryConstraint(f"t{k}", low + 0.3 * (high - low), 0.0, terms))
    return Problem(problem.nodes, problem.edges, problem.memory_constraints, name="knapsack")


def test_random_problems_cover_both_outcomes() -> None:
    outcomes = []
    for seed in range(50):
        try:
            brute_force(random_problem(seed))
            outcomes.append(True)
        except InfeasibleError:
            outcomes.append(False)
    assert 10 <= sum(outcomes) <= 45


@pytest.mark.parametrize("backend", SOLVERS)
def test_infeasible_reports_least_memory(backend: str) -> None:
    nodes = [_node("a", [1.0, 2.0]), _node("b", [1.0, 1.0, 3.0], multiplicity=2)]
    edges = [DecisionEdge("a", "b", [[0.0, 1.0, 2.0], [2.0, 1.0, 0.0]])]
    constraint = MemoryConstraint(
        "fwd",
        budget=60.0,
        constant=40.0,
        terms={"a": [30.0, 10.0], "b": [20.0, 25.0, 5.0]},
        edge_terms={("a", "b"): [[0.0, 0.0, 7.0], [1.0, 0.0, 4.0]]},
    )
    problem = Problem(nodes, edges, [constraint])
    with pytest.raises(InfeasibleError) as caught:
        solve(problem, solver=backend)
    least = 40.0 + 10.0 + 2 * 5.0 + 4.0
    assert caught.value.min_required == least
    assert caught.value.exact
    assert caught.value.choice == {"a": 1, "b": 2}
    assert isinstance(caught.value, ValueError)
    assert f"the smallest per-device memory any choice needs is {least:.0f} bytes" in str(caught.value)
    with pytest.raises(InfeasibleError) as oracle:
        brute_force(problem)
    assert oracle.value.min_required == least


@pytest.mark.parametrize("backend", SOLVERS)
def test_infeasible_only_jointly(backend: str) -> None:
    nodes = [_node("a", [0.0, 0.0]), _node("b", [0.0, 0.0])]
    constraints = [
        MemoryConstraint("t0", 10.0, 0.0, {"a": [12.0, 0.0], "b": [0.0, 1.0]}),
        MemoryConstraint("t1", 10.0, 0.0, {"a": [0.0, 11.0], "b": [3.0, 0.0]}),
    ]
    problem = Problem(nodes, [], constraints)
    with pytest.raises(InfeasibleError) as caught:
        solve(problem, solver=backend)
    assert caught.value.exact
    assert caught.value.min_required == 11.0
    assert caught.value.choice == {"a": 1, "b": 1}
    with pytest.raises(InfeasibleError) as oracle:
        brute_force(problem)
    assert oracle.value.min_required == 11.0


def test_infeasible_lower_bound_without_solver(monkeypatch: pytest.MonkeyPatch) -> None:
    nodes = [_node("a", [0.0, 1.0]), _node("b", [2.0])]
    constraint = MemoryConstraint("t", 50.0, 45.0, {"a": [9.0, 6.0], "b": [3.0]})
    monkeypatch.setattr(pulp.LpProblem, "solve", _forbidden)
    with pytest.raises(InfeasibleError) as caught:
        solve(Problem(nodes, [], [constraint], fixed={"a": 0}))
    assert caught.value.min_required == 57.0
    assert caught.value.choice == {"a": 0, "b": 0}


def _forbidden(*args: object, **kwargs: object) -> None:
    raise AssertionError("the solver must not be called")


def test_trivial_problem_skips_solver(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pulp.LpProblem, "solve", _forbidden)
    nodes = [_node("a", [1.5]), _node("b", [2.0], multiplicity=3), _node("c", [4.0, 0.5])]
    edges = [DecisionEdge("a", "b", [[0.25]], multiplicity=2), DecisionEdge("b", "c", [[1.0, 2.0]])]
    constraint = MemoryConstraint("t", 100.0, 10.0, {"a": [5.0], "b": [7.0], "c": [1.0, 2.0]})
    solution = solve(Problem(nodes, edges, [constraint], fixed={"c": 1}))
    assert solution.solver == "none"
    assert solution.status == "optimal"
    assert solution.choice == {"a": 0, "b": 0, "c": 1}
    assert solution.objective_s == 1.5 + 6.0 + 0.5 + 0.5 + 2.0
    assert solution.peak_memory == 10.0 + 5.0 + 21.0 + 2.0
    assert solution.num_variables == 0


@pytest.mark.parametrize("backend", SOLVERS)
def test_fixed_strategies_honoured(backend: str) -> None:
    nodes = [_node("a", [5.0, 1.0, 2.0]), _node("b", [1.0, 9.0, 9.0]), _node("c", [3.0, 3.0, 0.0])]
    edges = [
        DecisionEdge("a", "b", [[0.0, 4.0, 1.0], [3.0, 0.0, 2.0], [1.0, 5.0, 0.0]]),
        DecisionEdge("b", "c", [[0.0, 1.0, 6.0], [1.0, 0.0, 1.0], [2.0, 7.0, 0.0]]),
    ]
    free = solve(Problem(nodes, edges), solver=backend)
    for node in nodes:
        for strategy in range(3):
            if free.choice[node.name] == strategy:
                continue
            problem = Problem(nodes, edges, fixed={node.name: strategy})
            solution = solve(problem, solver=backend)
            assert solution.choice[node.name] == strategy
            assert solution.objective_s == brute_force(problem).objective_s
            assert solution.objective_s >= free.objective_s


@pytest.mark.parametrize("backend", SOLVERS)
def test_multiplicity_equals_unrolled_blocks(backend: str) -> None:
    rng = random.Random(7)

    def vec() -> list[float]:
        return [rng.uniform(0, 1) for _ in range(3)]

    def mat() -> list[list[float]]:
        return [vec() for _ in range(3)]

    embed, block, head, into, between, out = vec(), vec(), vec(), mat(), mat(), mat()
    saved, params = vec(), vec()
    layers = 4
    tied = Problem(
        [_node("embed", embed), _node("block", block, multiplicity=layers), _node("head", head)],
        [
            DecisionEdge("embed", "block", into),
            DecisionEdge("block", "block", between, multiplicity=layers - 1),
            DecisionEdge("block", "head", out),
        ],
        [
            MemoryConstraint(
                "peak", 2.1 * layers, 0.0, {"block": [s + p for s, p in zip(saved, params, strict=True)]}
            )
        ],
    )
    names = [f"block{k}" for k in range(layers)]
    unrolled = Problem(
        [_node("embed", embed)] + [_node(n, block) for n in names] + [_node("head", head)],
        [DecisionEdge("embed", names[0], into), DecisionEdge(names[-1], "head", out)]
        + [DecisionEdge(a, b, between) for a, b in itertools.pairwise(names)],
        [
            MemoryConstraint(
                "peak",
                2.1 * layers,
                0.0,
                {n: [s + p for s, p in zip(saved, params, strict=True)] for n in names},
            )
        ],
        equal_strategy=list(itertools.pairwise(names)),
    )
    a = solve(tied, solver=backend)
    b = solve(unrolled, solver=backend)
    assert all(b.choice[n] == a.choice["block"] for n in names)
    assert _close(a.objective_s, b.objective_s, 1e-12)
    assert _close(a.peak_memory, b.peak_memory, 1e-12)
    assert a.objective_s == brute_force(tied).objective_s
    assert (a.num_variables, a.num_constraints) == (b.num_variables, b.num_constraints)


@pytest.mark.parametrize("backend", SOLVERS)
def test_apply_multiplicity_false(backend: str) -> None:
    nodes = [_node("blk", [0.0, 1.0], multiplicity=8)]
    scaled = MemoryConstraint("s", 100.0, 0.0, {"blk": [20.0, 10.0]})
    raw = MemoryConstraint("r", 100.0, 0.0, {"blk": [20.0, 10.0]}, apply_multiplicity=False)
    assert solve(Problem(nodes, [], [scaled]), solver=backend).choice == {"blk": 1}
    assert solve(Problem(nodes, [], [raw]), solver=backend).choice == {"blk": 0}
    assert evaluate(Problem(nodes, [], [scaled]), {"blk": 1}) == (8.0, 80.0, True)


@pytest.mark.parametrize("backend", SOLVERS)
def test_budget_one_byte_under_is_repaired(backend: str) -> None:
    budget = 80.0 * (1 << 30)
    nodes = [_node("n0", [0.0, 1.0])] + [_node(f"n{i}", [0.0, 2.0]) for i in range(1, 4)]
    terms = {n.name: [budget / 4, budget / 8] for n in nodes}
    terms["n0"] = [budget / 4 + 1.0, budget / 8]
    problem = Problem(nodes, [], [MemoryConstraint("t", budget, 0.0, terms)])
    solution = solve(problem, solver=backend)
    assert evaluate(problem, solution.choice)[2]
    assert solution.choice == {"n0": 1, "n1": 0, "n2": 0, "n3": 0}
    assert solution.objective_s == brute_force(problem).objective_s == 1.0
    assert solution.peak_memory <= budget
    assert solution.num_constraints == 4 + 1 + 1


@pytest.mark.parametrize("backend", SOLVERS)
def test_determinism(backend: str) -> None:
    for seed in (3, 11, 20, 33):
        first = solve(random_problem(seed, binding=False), solver=backend)
        second = solve(random_problem(seed, binding=False), solver=backend)
        assert first.choice == second.choice
        assert first.objective_s == second.objective_s
    chain = [solve(_chain(60, 4, 1), solver=backend).choice for _ in range(2)]
    assert chain[0] == chain[1]


@pytest.mark.parametrize("backend", SOLVERS)
def test_tighter_budget_never_cheaper(backend: str) -> None:
    for seed in (0, 1, 2, 5):
        problem = random_problem(seed, binding=False)
        unconstrained = solve(problem, solver=backend)
        peaks = sorted(
            {memory_usage(problem, _random_choice(random.Random(k), problem))["t0"] for k in range(12)},
            reverse=True,
        )
        previous = unconstrained.objective_s
        for budget in peaks:
            for constraint in problem.memory_constraints:
                constraint.budget = budget if constraint.name == "t0" else math.inf
            try:
                objective = solve(problem, solver=backend).objective_s
            except InfeasibleError:
                break
            assert objective >= previous - 1e-12 * abs(previous)
            assert _close(objective, brute_force(problem).objective_s)
            previous = objective


@pytest.mark.parametrize("backend", SOLVERS)
def test_chain_of_200_is_fast(backend: str) -> None:
    problem = _chain(200, 4, 0)
    started = time.perf_counter()
    solution = solve(problem, solver=backend)
    assert time.perf_counter() - started < 10
    assert solution.status == "optimal"
    assert solution.num_variables == 200 * 4 + 199 * 16


def test_reductions_keep_the_model_small() -> None:
    nodes = [_node(f"n{i}", [1.0, 2.0, 3.0]) for i in range(5)]
    additive = [[a + b for b in (0.5, 0.0, 2.0)] for a in (1.0, 3.0, 0.0)]
    zero = [[0.0] * 3 for _ in range(3)]
    edges = [
        DecisionEdge("n0", "n1", additive),
        DecisionEdge("n1", "n2", zero),
        DecisionEdge("n2", "n3", zero),
    ]
    edges.append(DecisionEdge("n3", "n4", [[0.0, 1.0, 1.0], [1.0, 0.0, 1.0], [1.0, 1.0, 0.0]]))
    loose = MemoryConstraint("loose", 100.0, 10.0, {"n0": [1.0, 2.0, 3.0]})
    same = [MemoryConstraint(f"same{k}", 20.0 - k, 10.0, {"n1": [4.0, 5.0, 9.0]}) for k in range(3)]
    solution = solve(Problem(nodes, edges, [loose, *same], fixed={"n2": 2}))
    assert solution.num_variables == 4 * 3 + 9
    assert solution.num_constraints == 4 + 6 + 1
    assert solution.choice["n2"] == 2


def test_time_limit_returns_incumbent_with_gap() -> None:
    problem = _knapsack(0)
    solution = solve(problem, time_limit_s=0.5)
    assert solution.status in ("feasible", "optimal", "timeout_no_solution")
    if solution.status == "feasible":
        assert evaluate(problem, solution.choice)[2]
        assert solution.gap is not None and solution.gap > 0
        assert solution.solve_time_s < 5
    relaxed = solve(problem, mip_gap=0.05)
    assert relaxed.status == "optimal"
    assert relaxed.gap is not None and relaxed.gap <= 0.05


def test_time_limit_before_first_solve() -> None:
    solution = solve(_chain(200, 4, 0), time_limit_s=1e-9)
    assert solution.status == "timeout_no_solution"
    assert solution.choice == {}


@pytest.mark.parametrize(
    ("build", "match"),
    [
        (lambda: _node("a", []), "node 'a' has no strategies"),
        (lambda: DecisionNode("a", [1.0, 2.0], ["x"]), "node 'a' has 2 costs but 1 labels"),
        (lambda: _node("a", [1.0], multiplicity=-1), "node 'a': multiplicity must be >= 0"),
        (lambda: _node("a", [math.nan]), "node 'a' costs"),
        (lambda: DecisionEdge("a", "b", [[1.0], [1.0, 2.0]]), "edge 'a'->'b'"),
        (lambda: DecisionEdge("a", "b", [[1.0]], multiplicity=-2), "edge 'a'->'b': multiplicity"),
        (lambda: Problem([_node("a", [1.0]), _node("a", [2.0])]), "node 'a' is defined twice"),
        (lambda: Problem([_node("a", [1.0])], [DecisionEdge("a", "z", [[1.0]])]), "unknown node 'z'"),
        (
            lambda: Problem([_node("a", [1.0]), _node("b", [1.0, 2.0])], [DecisionEdge("a", "b", [[1.0]])]),
            r"edge 'a'->'b' cost matrix has shape \(1, 1\), expected \(1, 2\)",
        ),
        (
            lambda: Problem(
                [_node("a", [1.0])], [DecisionEdge("a", "a", [[1.0]]), DecisionEdge("a", "a", [[2.0]])]
            ),
            "edge 'a'->'a' is defined twice",
        ),
        (
            lambda: Problem([_node("a", [1.0])], [], [MemoryConstraint("t", 1.0, 0.0, {"q": [1.0]})]),
            "memory constraint 't' refers to unknown node 'q'",
        ),
        (
            lambda: Problem([_node("a", [1.0])], [], [MemoryConstraint("t", 1.0, 0.0, {"a": [1.0, 2.0]})]),
            "memory constraint 't' term for node 'a' has 2 values, expected 1",
        ),
        (
            lambda: Problem(
                [_node("a", [1.0])],
                [],
                [MemoryConstraint("t", 1.0, 0.0, {}, edge_terms={("a", "a"): [[1.0]]})],
            ),
            "unknown edge 'a'->'a'",
        ),
        (
            lambda: Problem([_node("a", [1.0])], fixed={"a": 1}),
            "fixed strategy 1 of node 'a' is out of range",
        ),
        (lambda: Problem([_node("a", [1.0])], fixed={"b": 0}), "fixed strategy refers to unknown node 'b'"),
        (
            lambda: Problem([_node("a", [1.0, 2.0]), _node("b", [1.0])], equal_strategy=[("a", "b")]),
            "equal_strategy ties node 'a'",
        ),
        (
            lambda: Problem(
                [_node("a", [1.0, 2.0]), _node("b", [1.0, 2.0])],
                fixed={"a": 0, "b": 1},
                equal_strategy=[("a", "b")],
            ),
            "pinned to different strategies",
        ),
        (lambda: MemoryConstraint("t", math.nan, 0.0, {}), "memory constraint 't': budget"),
    ],
)
def test_validation(build, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        build()


def test_bad_arguments() -> None:
    problem = _chain(3, 2, 0)
    with pytest.raises(ValueError, match="unknown solver"):
        solve(problem, solver="gurobi")
    with pytest.raises(ValueError, match="time_limit_s"):
        solve(problem, time_limit_s=0)
    with pytest.raises(ValueError, match="no strategy for node 'n002'"):
        evaluate(problem, {"n000": 0, "n001": 1})
    with pytest.raises(ValueError, match="brute force"):
        brute_force(_chain(30, 4, 0))
    assert "highs" in SOLVERS


def test_memory_rows_are_read_by_name() -> None:
    """A row is found by its name whatever its position; an unknown name is an error naming the rows there are."""
    nodes = [DecisionNode("a", [0.0, 1.0], ["r", "s"])]
    rows = [
        MemoryConstraint(n, 10.0, 0.0, {"a": [1.0, 2.0]}, kind=k) for n, k in (("x", "peak"), ("y", "step"))
    ]
    problem = Problem(nodes, memory_constraints=rows)
    assert problem.memory_constraint("y") is rows[1] and problem.memory_constraint("y").kind == "step"
    with pytest.raises(ValueError, match=r"unknown memory constraint 'z' \(rows: \['x', 'y'\]\)"):
        problem.memory_constraint("z")


@pytest.mark.parametrize("backend", SOLVERS)
def test_conditional_cost_is_paid_only_under_its_gate(backend: str) -> None:
    """A pairwise cost gated by a third node (the collectives a recomputed block runs again): three free
    nodes, so the solver needs its gated variables; the optimum moves when the gate makes a pair expensive."""
    a, b = _node("a", [0.0, 0.3]), _node("b", [0.0, 0.3])
    gate = _node("r", [0.0, 0.1])  # option 1 is cheap in itself
    memory = MemoryConstraint("m", 1.0, 0.0, {"r": [2.0, 0.0]})  # ...and the only one that fits
    conditional = [ConditionalCost("a", "b", "r", (1,), [[1.0, 0.0], [0.0, 0.0]])]
    problem = Problem([a, b, gate], [], [memory], conditional_costs=conditional)
    found = solve(problem, solver=backend)
    assert found.choice["r"] == 1
    assert found.objective_s == pytest.approx(0.4)  # r=1 (0.1) + one of a/b moved off 0 (0.3), not 1.0
    assert found.objective_s == pytest.approx(brute_force(problem).objective_s)
    ungated = Problem([a, b, gate], [], [], conditional_costs=conditional)
    assert solve(ungated, solver=backend).objective_s == 0.0


def test_overlap_exposes_what_compute_cannot_hide() -> None:
    """The exposed communication of an overlap: all of it without overlap, max(C, K) - K with a perfect one,
    never below (1 - efficiency) C."""
    nodes = [_node("a", [0.0, 0.0]), _node("b", [0.0, 0.0])]
    for efficiency, compute, expected in ((0.0, 5.0, 3.0), (1.0, 5.0, 0.0), (1.0, 1.0, 2.0), (0.5, 5.0, 1.5)):
        overlap = Overlap("dp", {"a": [3.0, 0.0]}, {"b": [compute, 0.0]}, efficiency)
        problem = Problem(nodes, overlaps=[overlap])
        assert evaluate(problem, {"a": 0, "b": 0})[0] == pytest.approx(expected)
    with pytest.raises(ValueError, match="efficiency"):
        Overlap("dp", {"a": [1.0, 1.0]}, {}, 1.5)
    with pytest.raises(ValueError, match="2 values|expected 2"):
        Problem(nodes, overlaps=[Overlap("dp", {"a": [1.0]}, {}, 1.0)])


@pytest.mark.parametrize("backend", SOLVERS)
def test_overlap_steers_the_choice(backend: str) -> None:
    """Serial, strategy 0 of ``a`` (compute 4, comm 4) loses to strategy 1 (compute 5, comm 0); hidden behind
    the compute, its communication is free and strategy 0 wins."""
    a = _node("a", [4.0, 5.0])
    for efficiency, expected in ((0.0, 1), (1.0, 0)):
        problem = Problem([a], overlaps=[Overlap("dp", {"a": [4.0, 0.0]}, {"a": [4.0, 5.0]}, efficiency)])
        assert solve(problem, solver=backend).choice["a"] == expected


@pytest.mark.parametrize("backend", SOLVERS)
def test_overlap_hides_behind_an_edge(backend: str) -> None:
    """Computation on an edge hides an overlap's communication (the host stream runs ahead of a collective as of
    a kernel), read through the pair's joint choice: host 6; the edge's device time 6 at (0, 0), else 1. At
    (0, 0) the step is max(6, 6) = 6; at (1, 0) 1 + (6 - 1) = 6; with the edge left out of the overlap's
    computation neither would be below 7, so the solver's 6 needs it."""
    a, b = _node("a", [0.0, 0.0]), _node("b", [0.0, 3.0])
    edge = DecisionEdge("a", "b", [[6.0, 1.0], [1.0, 1.0]])
    overlap = Overlap("host", {"a": [6.0, 6.0]}, {}, 1.0, {("a", "b"): [[6.0, 1.0], [1.0, 1.0]]})
    problem = Problem([a, b], [edge], overlaps=[overlap])
    assert evaluate(problem, {"a": 0, "b": 0})[0] == pytest.approx(6.0)
    assert evaluate(problem, {"a": 1, "b": 0})[0] == pytest.approx(6.0 + 0.0)  # 1 + (6 - 1)
    assert evaluate(problem, {"a": 1, "b": 1})[0] == pytest.approx(1.0 + 3.0 + 5.0)
    solution = solve(problem, solver=backend)
    assert solution.objective_s == pytest.approx(6.0)
    with pytest.raises(ValueError, match="matches no edge"):
        Problem(
            [a, b], [edge], overlaps=[Overlap("host", {"a": [1.0, 1.0]}, {}, 1.0, {("b", "a"): edge.cost})]
        )
