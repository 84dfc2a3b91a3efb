"""The combinations of arriving placements DTensor is asked about per op (solve/rules.py): for an op with many
producers only the alike ones, generated without walking the product. Before, xLSTM's ``stack`` of 16
per-time-step outputs walked 3^16 combinations to keep 3, and planning it on a 1 x 2 mesh ran for over 20
minutes (the coverage sweep's one crash)."""

from __future__ import annotations

import itertools
import random

import hf_colossal_auto.solve.planner  # noqa: F401 - loads solve/ in its own order (rules and build import each other)
from hf_colossal_auto.solve.rules import _alike_combos, _Arrival

SPECS = (("R",), ("S0",), ("S1",), ("P",))


def _activation(src: str, positions: list[int], outcomes: list[tuple[tuple[str, ...], ...]]) -> _Arrival:
    """A producer feeding inputs ``positions``; per outcome, the placement each of them arrives in."""
    return _Arrival(
        src,
        tuple((tuple(zip(positions, specs, strict=True)), (j,)) for j, specs in enumerate(outcomes)),
    )


def _filtered_product(arrivals: list[_Arrival]) -> list[tuple]:
    """What the planner did before: the whole product, filtered to combinations whose activation inputs all
    arrive in one placement."""
    return [
        combo
        for combo in itertools.product(*(a.outcomes for a in arrivals))
        if len({e[1] for placed, _ in combo for e in placed if isinstance(e[0], int)}) <= 1
    ]


def _random_arrivals(rng: random.Random) -> list[_Arrival]:
    arrivals: list[_Arrival] = []
    position = 0
    for a in range(rng.randint(1, 5)):
        kind = rng.random()
        if kind < 0.2:  # a parameter some strategy wants partial: its storage options
            options = rng.sample(["R", "S0", "S1"], rng.randint(1, 3))
            arrivals.append(
                _Arrival(f"p{a}", tuple(((("param", position, o),), (j,)) for j, o in enumerate(options)))
            )
        elif kind < 0.3:  # the weight use of a projection
            arrivals.append(
                _Arrival(f"w{a}", tuple(((("weight", s),), (j,)) for j, s in enumerate(SPECS[:2])))
            )
        else:  # a producer feeding one or two inputs, in distinct placement tuples
            width = rng.randint(1, 2)
            tuples = list(itertools.product(SPECS, repeat=width))
            chosen = rng.sample(tuples, rng.randint(1, min(5, len(tuples))))
            arrivals.append(_activation(f"n{a}", list(range(position, position + width)), chosen))
        position += 2
    return arrivals


def test_alike_combinations_are_the_filtered_product_in_its_order():
    rng = random.Random(0)
    for _ in range(300):
        arrivals = _random_arrivals(rng)
        assert _alike_combos(arrivals) == _filtered_product(arrivals), arrivals


def test_an_op_reading_many_producers_gets_one_combination_per_shared_placement():
    """A stack of 16 time steps, each step's output replicated, split on dim 0 or on dim 1: 3^16 = 43 million
    combinations, 3 of them alike; a weight use on top doubles them. Generated directly (the test would not
    finish walking the product)."""
    steps = [_activation(f"step{t}", [t], [(s,) for s in SPECS[:3]]) for t in range(16)]
    combos = _alike_combos(steps)
    assert len(combos) == 3
    assert [{entry[1] for placed, _ in combo for entry in placed} for combo in combos] == [
        {("R",)},
        {("S0",)},
        {("S1",)},
    ]
    weight = _Arrival("w", tuple(((("weight", s),), (j,)) for j, s in enumerate(SPECS[:2])))
    assert len(_alike_combos([*steps, weight])) == 6


def test_a_producer_that_never_gives_all_its_inputs_one_placement_leaves_no_alike_combination():
    mixed = _activation("n0", [0, 1], [(("R",), ("S0",)), (("S0",), ("S1",))])
    other = _activation("n1", [2], [(("R",),), (("S0",),)])
    assert _alike_combos([mixed, other]) == [] == _filtered_product([mixed, other])
