"""The ILP solved with PuLP (HiGHS, or pulp's bundled CBC): the only module that imports PuLP.

:func:`solve` turns a :class:`~.problem.Problem` into linear forms over one-hot strategy groups
(:mod:`.ilp_forms`), builds the MILP from them (:class:`_Model`: one binary per free group's strategy, joint
variables for pairwise terms, one variable per conditional, shared or overlapped cost, one row per rule and per
memory constraint that can bind), runs the backend (:func:`_run`) and checks the choice against the exact
memory rows, adding a cut and solving again where rounding let a row through. A budget nothing meets is
answered by :func:`_least_memory`: the least memory any choice needs, as an :class:`~.problem.InfeasibleError`.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import re
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass

import pulp

from .ilp_forms import _Affine, _Form, _Groups, _memory_rows, _objective_form, _Row, _tightest, _Triple
from .problem import (
    InfeasibleError,
    Problem,
    Solution,
    evaluate,
    infeasible_message,
    memory_usage,
    overshoot,
    reference_budget,
)

try:
    from highspy import HighsModelStatus
except ImportError:
    HighsModelStatus = None

SOLVERS = ("highs", "cbc")
MAX_REPAIRS = 100
logger = logging.getLogger(__name__)

OBJECTIVE_MAGNITUDE = 2.0**10


@functools.cache
def available_solvers() -> tuple[str, ...]:
    found = []
    if pulp.HiGHS(msg=False).available():
        found.append("highs")
    if _cbc(msg=False).available():
        found.append("cbc")
    return tuple(found)


def _cbc(**options: object) -> pulp.LpSolver:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return pulp.PULP_CBC_CMD(**options)


def _backend(solver: str) -> str:
    if solver not in ("auto", *SOLVERS):
        raise ValueError(f"unknown solver {solver!r}; expected 'auto', 'highs' or 'cbc'")
    available = available_solvers()
    if solver == "auto":
        if not available:
            raise RuntimeError("neither HiGHS (highspy) nor pulp's bundled CBC is available")
        return available[0]
    if solver not in available:
        raise RuntimeError(f"solver {solver!r} is not available here (available: {list(available)})")
    return solver


def _pow2(magnitude: float) -> float:
    if magnitude <= 0 or not math.isfinite(magnitude):
        return 1.0
    return math.ldexp(1.0, math.frexp(magnitude)[1])


class _Model:
    def __init__(self, groups: _Groups):
        self.groups = groups
        self.prob = pulp.LpProblem("hf_colossal_auto", pulp.LpMinimize)
        self.x: dict[int, list[pulp.LpVariable]] = {}
        self.e: dict[tuple[int, int], list[list[pulp.LpVariable]]] = {}
        self.cuts = 0
        for g in groups.free:
            xs = [pulp.LpVariable(f"x_{g:05d}_{s:03d}", cat=pulp.LpBinary) for s in range(groups.size[g])]
            self.x[g] = xs
            self.prob += pulp.LpAffineExpression([(v, 1.0) for v in xs]) == 1, f"one_{g:05d}"

    def joint(self, g: int, h: int) -> list[list[pulp.LpVariable]]:
        if (g, h) in self.e:
            return self.e[(g, h)]
        xs, ys = self.x[g], self.x[h]
        e = [
            [pulp.LpVariable(f"e_{g:05d}_{h:05d}_{i:03d}_{j:03d}", 0, 1) for j in range(len(ys))]
            for i in range(len(xs))
        ]
        for i, x in enumerate(xs):
            terms = [(v, 1.0) for v in e[i]] + [(x, -1.0)]
            self.prob += pulp.LpAffineExpression(terms) == 0, f"row_{g:05d}_{h:05d}_{i:03d}"
        for j, y in enumerate(ys):
            terms = [(e[i][j], 1.0) for i in range(len(xs))] + [(y, -1.0)]
            self.prob += pulp.LpAffineExpression(terms) == 0, f"col_{g:05d}_{h:05d}_{j:03d}"
        self.e[(g, h)] = e
        return e

    def terms(self, form: _Form, scale: float) -> list[tuple[pulp.LpVariable, float]]:
        out = []
        for g, values in form.lin.items():
            out += [(self.x[g][s], v / scale) for s, v in enumerate(values) if v]
        for (g, h), matrix in form.pairs.items():
            e = self.joint(g, h)
            out += [(e[i][j], v / scale) for i, row in enumerate(matrix) for j, v in enumerate(row) if v]
        return out

    def add_row(self, name: str, form: _Form, rhs: float) -> None:
        scale = _pow2(form.magnitude())
        self.prob += pulp.LpAffineExpression(self.terms(form, scale)) <= rhs / scale, name

    def triple_terms(self, triples: list[_Triple], scale: float) -> list[tuple[pulp.LpVariable, float]]:
        """Objective terms of conditional costs, one variable each:
        ``z >= sum_ij cost_ij e[g,h][i][j] - max(cost) * (1 - sum_{o in when} x_r[o])``, ``z >= 0``.

        Exact at integer points (costs are >= 0 and z is minimised); one variable per cost rather than one per
        matrix entry keeps the model small (per-entry variables made a two-block model's solve 15x slower).
        """
        out = []
        for index, t in enumerate(triples):
            g, h, matrix = t.g, t.h, t.cost
            if g > h:
                g, h = h, g
                matrix = [list(col) for col in zip(*matrix, strict=True)]
            e = self.joint(g, h)
            top = max(max(row) for row in matrix) / scale
            z = pulp.LpVariable(f"z_{index:05d}", lowBound=0)
            terms = [(z, 1.0)]
            terms += [(e[i][j], -v / scale) for i, row in enumerate(matrix) for j, v in enumerate(row) if v]
            terms += [(self.x[t.r][o], -top) for o in t.when]
            self.prob += pulp.LpAffineExpression(terms) >= -top, f"zc_{index:05d}"
            out.append((z, 1.0))
        return out

    def _member_terms(
        self, src: int, dst: int, strategies: tuple[int, ...], cost: list[float], scale: float
    ) -> tuple[list[tuple[pulp.LpVariable, float]], float]:
        """``sum_i cost_i [choice(src) = i and choice(dst) in strategies]`` as linear terms plus a constant."""
        pin_g, pin_h = self.groups.pin[src], self.groups.pin[dst]
        wanted = set(strategies)
        if pin_g is not None and pin_h is not None:
            return [], (cost[pin_g] / scale if pin_h in wanted else 0.0)
        if pin_g is not None:
            return [(self.x[dst][j], cost[pin_g] / scale) for j in strategies if cost[pin_g]], 0.0
        if pin_h is not None:
            if pin_h not in wanted:
                return [], 0.0
            return [(self.x[src][i], v / scale) for i, v in enumerate(cost) if v], 0.0
        if src == dst:  # one group: both take the same strategy
            return [(self.x[src][i], cost[i] / scale) for i in strategies if cost[i]], 0.0
        g, h = min(src, dst), max(src, dst)
        e = self.joint(g, h)
        terms = []
        for i, v in enumerate(cost):
            if not v:
                continue
            for j in strategies:
                terms.append((e[i][j] if src < dst else e[j][i], v / scale))
        return terms, 0.0

    def shared_terms(self, shared: list, scale: float) -> list[tuple[pulp.LpVariable, float]]:
        """Objective terms of shared costs, one variable each: ``z >= member's cost`` for every member,
        ``z >= 0``; exact at integer points (at most one ``cost_i`` is selected per member, and z is minimised).
        A member selected whatever the solver does makes the cost a constant (left to :func:`evaluate`)."""
        out = []
        for index, cost in enumerate(shared):
            src = self.groups.of[cost.src]
            members = [
                self._member_terms(src, self.groups.of[dst], strategies, cost.cost, scale)
                for dst, strategies in cost.members
            ]
            if any(constant > 0 for _, constant in members):
                continue  # paid in every solution (its src is pinned): a constant
            members = [terms for terms, _ in members if terms]
            if not members:
                continue
            z = pulp.LpVariable(f"zs_{index:05d}", lowBound=0)
            for k, terms in enumerate(members):
                row = [(z, 1.0)] + [(var, -v) for var, v in terms]
                self.prob += pulp.LpAffineExpression(row) >= 0, f"zs_{index:05d}_{k:03d}"
            out.append((z, 1.0))
        return out

    def overlap_terms(self, problem: Problem, scale: float) -> list[tuple[pulp.LpVariable, float]]:
        """Objective terms of :class:`Overlap` s, one variable each: ``z >= C - f K``, ``z >= (1 - f) C``,
        ``z >= 0``, with ``C`` and ``K`` linear in the choice. Exact at integer points (z is minimised)."""
        out = []
        for index, overlap in enumerate(problem.overlaps):
            comm, compute = _Affine(self.groups), _Affine(self.groups)
            for name, values in overlap.comm.items():
                comm.add_node(name, [problem.node(name).multiplicity * v for v in values])
            for name, values in overlap.compute.items():
                compute.add_node(name, [problem.node(name).multiplicity * v for v in values])
            for acc, edges in ((compute, overlap.compute_edges), (comm, overlap.comm_edges)):
                for (src, dst), matrix in edges.items():
                    m = problem.edge(src, dst).multiplicity
                    acc.add_edge(src, dst, [[m * v for v in row] for row in matrix])
            if not comm.lin and not comm.pairs and comm.constant == 0:
                continue
            z = pulp.LpVariable(f"zo_{index:05d}", lowBound=0)
            f = overlap.efficiency
            # pair terms (edges between two free groups) through their joint variables, as the objective's
            pairs = self.terms(_Form(0.0, {}, compute.pairs), 1.0) if compute.pairs else []
            comm_pairs = self.terms(_Form(0.0, {}, comm.pairs), 1.0) if comm.pairs else []
            for k, (weights, constant) in enumerate(((1.0, -f), (1.0 - f, 0.0))):
                row = [(z, 1.0)]
                row += [
                    (self.x[g][s], -weights * v / scale)
                    for g, vs in comm.lin.items()
                    for s, v in enumerate(vs)
                ]
                row += [
                    (self.x[g][s], -constant * v / scale)
                    for g, vs in compute.lin.items()
                    for s, v in enumerate(vs)
                ]
                row += [(var, -constant * v / scale) for var, v in pairs]
                row += [(var, -weights * v / scale) for var, v in comm_pairs]
                rhs = (weights * comm.constant + constant * compute.constant) / scale
                merged: dict[str, list] = {}
                for var, coefficient in row:
                    merged.setdefault(var.name, [var, 0.0])[1] += coefficient
                terms = [(var, c) for var, c in merged.values() if c]
                self.prob += pulp.LpAffineExpression(terms) >= rhs, f"zo_{index:05d}_{k}"
            out.append((z, 1.0))
        return out

    def add_follows(self, rules: list) -> None:
        """:class:`FollowsInputs` rules as ``sum_{j in sharding} x[dst][j] + sum_k [input k replicated] <=
        #inputs``: with every input replicated, no strategy of ``sharding`` can be taken. One row per rule (the
        one-hot ``x[dst]`` takes at most one of them), not one per strategy: DTensor's choices bar most of a
        node's strategies under each combination of inputs. Pinned nodes are constants."""
        for index, rule in enumerate(rules):
            g = self.groups.of[rule.dst]
            terms: list[tuple[pulp.LpVariable, float]] = []
            rhs = 0.0
            pin = self.groups.pin[g]
            if pin is not None:
                if pin not in rule.sharding:
                    continue
                rhs -= 1.0
            else:
                terms += [(self.x[g][j], 1.0) for j in rule.sharding]
            for src, ids in rule.inputs:
                if src is None:
                    continue  # always replicated: 1 on both sides
                rhs += 1.0
                h = self.groups.of[src]
                if self.groups.pin[h] is not None:
                    rhs -= 1.0 if self.groups.pin[h] in ids else 0.0
                else:
                    terms += [(self.x[h][i], 1.0) for i in ids]
            merged: dict[str, list] = {}  # one variable may appear twice (tied nodes): add, not overwrite
            for var, coefficient in terms:
                merged.setdefault(var.name, [var, 0.0])[1] += coefficient
            if merged:  # all pinned: nothing to decide (evaluate() reports a violation)
                row = [(var, c) for var, c in merged.values()]
                self.prob += pulp.LpAffineExpression(row) <= rhs, f"follow_{index:05d}"

    def cut(self, free_choice: dict[int, int], support: list[int]) -> None:
        terms = [(self.x[g][free_choice[g]], 1.0) for g in support]
        self.prob += pulp.LpAffineExpression(terms) <= len(support) - 1, f"cut_{self.cuts:05d}"
        self.cuts += 1

    def choice(self) -> dict[int, int]:
        out = {}
        for g, xs in self.x.items():
            values = [v.varValue or 0.0 for v in xs]
            out[g] = max(range(len(values)), key=values.__getitem__)
        return out

    def size(self) -> tuple[int, int]:
        return len(self.prob.variables()), len(self.prob.constraints)


@dataclass
class _Outcome:
    status: str
    choice: dict[int, int] | None
    bound: float | None


def _cbc_bound(log_path: str) -> float | None:
    try:
        with open(log_path) as f:
            text = f.read()
    except OSError:
        return None
    found = re.findall(r"^Lower bound:\s+(\S+)", text, flags=re.MULTILINE)
    try:
        return float(found[-1]) if found else None
    except ValueError:
        return None


@contextlib.contextmanager
def _native_stdout_to_debug_log(name: str) -> Iterator[None]:
    """Send what native code writes to file descriptor 1 (HiGHS prints its banner when pulp creates its
    solver object, whatever ``msg`` says) to this module's debug log instead of every rank's stdout."""
    sys.stdout.flush()
    saved = os.dup(1)
    with tempfile.TemporaryFile(mode="w+b") as sink:
        os.dup2(sink.fileno(), 1)
        try:
            yield
        finally:
            sys.stdout.flush()
            os.dup2(saved, 1)
            os.close(saved)
            sink.seek(0)
            text = sink.read().decode(errors="replace").strip()
            if text:
                logger.debug("%s output:\n%s", name, text)


def _run(model: _Model, backend: str, time_limit: float, mip_gap: float, msg: bool) -> _Outcome:
    gap_abs = 0.0 if mip_gap == 0 else None
    if backend == "highs":
        solver = pulp.HiGHS(msg=msg, timeLimit=time_limit, gapRel=mip_gap, gapAbs=gap_abs)
        with contextlib.nullcontext() if msg else _native_stdout_to_debug_log("HiGHS"):
            model.prob.solve(solver)
        highs = model.prob.solverModel
        raw = highs.getModelStatus()
        timed_out = raw in (
            HighsModelStatus.kTimeLimit,
            HighsModelStatus.kInterrupt,
            HighsModelStatus.kIterationLimit,
        )
        bound = highs.getInfo().mip_dual_bound
        bound = bound if math.isfinite(bound) else None
    else:
        with tempfile.TemporaryDirectory(prefix="hf_colossal_auto_cbc_") as tmp:
            log_path = None if msg else os.path.join(tmp, "cbc.log")
            solver = _cbc(msg=msg, timeLimit=time_limit, gapRel=mip_gap, gapAbs=gap_abs, logPath=log_path)
            model.prob.solve(solver)
            bound = _cbc_bound(log_path) if log_path else None
        timed_out = model.prob.status == pulp.LpStatusNotSolved
    status, sol = model.prob.status, model.prob.sol_status
    if status == pulp.LpStatusInfeasible or sol == pulp.LpSolutionInfeasible:
        return _Outcome("infeasible", None, None)
    if sol == pulp.LpSolutionOptimal:
        return _Outcome("optimal", model.choice(), bound)
    if sol == pulp.LpSolutionIntegerFeasible:
        return _Outcome("feasible", model.choice(), bound)
    if sol == pulp.LpSolutionNoSolutionFound and timed_out:
        return _Outcome("timeout_no_solution", None, bound)
    raise RuntimeError(
        f"{backend} failed on problem {model.prob.name!r}: status {pulp.LpStatus.get(status)}, "
        f"solution {pulp.LpSolution.get(sol)}"
    )


def _relative_gap(value: float, bound: float | None) -> float | None:
    if bound is None:
        return None
    scale = max(abs(value), abs(bound))
    return 0.0 if scale == 0 else max(0.0, value - bound) / scale


def _solution(
    problem: Problem,
    choice: dict[str, int],
    status: str,
    gap: float | None,
    start: float,
    solver: str,
    size: tuple[int, int],
) -> Solution:
    objective, peak, _ = evaluate(problem, choice)
    labels = {node.name: node.labels[choice[node.name]] for node in problem.nodes}
    return Solution(
        choice=choice,
        objective_s=objective,
        status=status,
        gap=gap,
        solve_time_s=time.perf_counter() - start,
        solver=solver,
        num_variables=size[0],
        num_constraints=size[1],
        peak_memory=peak,
        labels=dict(sorted(labels.items())),
    )


def _no_solution(start: float, solver: str, size: tuple[int, int]) -> Solution:
    return Solution(
        choice={},
        objective_s=math.inf,
        status="timeout_no_solution",
        gap=None,
        solve_time_s=time.perf_counter() - start,
        solver=solver,
        num_variables=size[0],
        num_constraints=size[1],
        peak_memory=math.inf,
    )


def _least_memory(
    problem: Problem,
    groups: _Groups,
    rows: list[_Row],
    backend: str,
    deadline: float,
    msg: bool,
    start: float,
) -> Solution:
    reference = reference_budget(problem)
    lower = max(row.form.constant - row.budget for row in rows)
    choice: dict[str, int] | None = None
    exact = False
    if not groups.free:
        choice = groups.expand({})
        exact = True
    else:
        relevant = _tightest([r for r in rows if r.form.constant - r.budget + r.form.top() > lower])
        remaining = deadline - time.perf_counter()
        if not relevant:
            choice = groups.expand({g: 0 for g in groups.free})
            exact = True
        elif remaining > 0:
            model = _Model(groups)
            model.add_follows(problem.follows_inputs)
            unit = _pow2(max([abs(lower)] + [r.form.magnitude() for r in relevant]))
            excess = pulp.LpVariable("t", lowBound=lower / unit)
            model.prob.setObjective(pulp.LpAffineExpression([(excess, 1.0)]))
            for index, row in enumerate(relevant):
                terms = model.terms(row.form, unit) + [(excess, -1.0)]
                model.prob += pulp.LpAffineExpression(terms) <= row.slack / unit, f"mem_{index:05d}"
            outcome = _run(model, backend, remaining, 0.0, msg)
            if outcome.choice is not None:
                choice = groups.expand(outcome.choice)
                exact = outcome.status == "optimal"
            if outcome.bound is not None:
                lower = max(lower, outcome.bound * unit)
    if choice is not None:
        shortfall = overshoot(problem, choice)
        if shortfall <= 0:
            return _solution(problem, choice, "feasible", None, start, backend, (0, 0))
        if exact:
            lower = shortfall
    raise InfeasibleError(
        infeasible_message(problem, reference + lower, exact),
        min_required=reference + lower,
        exact=exact,
        choice=choice,
    )


def solve(
    problem: Problem,
    *,
    time_limit_s: float = 60,
    solver: str = "auto",
    mip_gap: float = 0.0,
    msg: bool = False,
) -> Solution:
    start = time.perf_counter()
    if not time_limit_s > 0:
        raise ValueError(f"time_limit_s must be > 0, got {time_limit_s!r}")
    if not 0 <= mip_gap < 1:
        raise ValueError(f"mip_gap must be in [0, 1), got {mip_gap!r}")
    backend = _backend(solver)
    deadline = start + time_limit_s
    groups = _Groups(problem)
    rows = _memory_rows(problem, groups)
    if any(row.slack < -row.rounding for row in rows):
        return _least_memory(problem, groups, rows, backend, deadline, msg, start)
    if not groups.free:
        choice = groups.expand({})
        if overshoot(problem, choice) > 0:
            return _least_memory(problem, groups, rows, backend, deadline, msg, start)
        return _solution(problem, choice, "optimal", 0.0, start, "none", (0, 0))

    objective, triples = _objective_form(problem, groups)
    magnitude = max(
        [objective.magnitude()]
        + [max(max(row) for row in t.cost) for t in triples]
        + [max(c.cost) for c in problem.shared_costs]
        + [max((max(v) for v in o.comm.values()), default=0.0) for o in problem.overlaps]
    )
    unit = _pow2(magnitude) / OBJECTIVE_MAGNITUDE
    model = _Model(groups)
    terms = model.terms(objective, unit) + model.triple_terms(triples, unit)
    terms += model.shared_terms(problem.shared_costs, unit)
    terms += model.overlap_terms(problem, unit)
    model.add_follows(problem.follows_inputs)
    model.prob.setObjective(pulp.LpAffineExpression(terms))
    binding = _tightest([r for r in rows if (r.form.lin or r.form.pairs) and r.form.top() > r.slack])
    for index, row in enumerate(binding):
        model.add_row(f"mem_{index:05d}", row.form, row.slack + row.rounding)

    for _ in range(MAX_REPAIRS):
        remaining = deadline - time.perf_counter()
        if remaining <= 0:
            return _no_solution(start, backend, model.size())
        outcome = _run(model, backend, remaining, mip_gap, msg)
        if outcome.status == "infeasible":
            return _least_memory(problem, groups, rows, backend, deadline, msg, start)
        if outcome.choice is None:
            return _no_solution(start, backend, model.size())
        choice = groups.expand(outcome.choice)
        usage = memory_usage(problem, choice)
        violated = [c for c in problem.memory_constraints if usage[c.name] > c.budget]
        if not violated:
            objective_s, _, _ = evaluate(problem, choice)
            bound = None if outcome.bound is None else objective.constant + outcome.bound * unit
            gap = _relative_gap(objective_s, bound)
            if gap is None and outcome.status == "optimal" and mip_gap == 0:
                gap = 0.0
            return _solution(problem, choice, outcome.status, gap, start, backend, model.size())
        supports = {tuple(groups.support(problem, c)) for c in violated}
        if () in supports:
            return _least_memory(problem, groups, rows, backend, deadline, msg, start)
        for support in sorted(supports):
            model.cut(outcome.choice, list(support))
    raise RuntimeError(
        f"the solver kept returning choices that exceed a memory budget by less than its tolerance "
        f"({MAX_REPAIRS} repairs); problem {problem.name!r}"
    )
