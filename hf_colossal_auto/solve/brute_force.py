from __future__ import annotations

import itertools
import math
import time

from .problem import (
    InfeasibleError,
    Problem,
    Solution,
    evaluate,
    infeasible_message,
    overshoot,
    reference_budget,
)


def brute_force(problem: Problem, limit: int = 200_000) -> Solution:
    start = time.perf_counter()
    groups = problem.strategy_groups()
    free = [(members, len(problem.node(members[0]).costs)) for members, pin in groups if pin is None]
    space = math.prod(size for _, size in free)
    if space > limit:
        raise ValueError(
            f"brute force over problem {problem.name!r} would enumerate {space} choices, "
            f"more than the limit of {limit}"
        )
    choice = {name: pin for members, pin in groups if pin is not None for name in members}
    best: tuple[float, dict[str, int]] | None = None
    closest: tuple[float, dict[str, int]] | None = None
    for combination in itertools.product(*(range(size) for _, size in free)):
        for (members, _), strategy in zip(free, combination, strict=True):
            for name in members:
                choice[name] = strategy
        if any(rule.violated(choice) for rule in problem.follows_inputs):
            continue  # not a choice the runtime can run, whatever its memory
        objective, _, feasible = evaluate(problem, choice)
        if feasible:
            if best is None or objective < best[0]:
                best = (objective, dict(sorted(choice.items())))
        elif best is None:
            excess = overshoot(problem, choice)
            if closest is None or excess < closest[0]:
                closest = (excess, dict(sorted(choice.items())))
    if best is None:
        assert closest is not None
        required = reference_budget(problem) + closest[0]
        raise InfeasibleError(
            infeasible_message(problem, required, True), min_required=required, exact=True, choice=closest[1]
        )
    objective, peak, _ = evaluate(problem, best[1])
    return Solution(
        choice=best[1],
        objective_s=objective,
        status="optimal",
        gap=0.0,
        solve_time_s=time.perf_counter() - start,
        solver="brute_force",
        num_variables=len(free),
        num_constraints=len(problem.memory_constraints),
        peak_memory=peak,
        labels={name: problem.node(name).labels[s] for name, s in best[1].items()},
    )
