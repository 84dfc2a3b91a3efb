"""Where a solved plan's module boundaries put their values: a partial module output reduced to the placement
its readers take it in, and the input of every block of a folded run brought to the placement the run's
representative receives it in. The runtime enforces both above autograd (:mod:`hf_colossal_auto.apply.enforce`).

Why these two: they make Megatron-LM's sequence parallelism a plan like any other. A row-parallel projection's
sum is carried through its unflattening view (:data:`~hf_colossal_auto.strategies.dtensor_rules.PARTIAL_VIEWS`)
to its module's output; the residual add after it takes it sharded on the sequence dim, so the module output is
reduce-scattered there (the edge the planner priced), not all-reduced. And the first block of a run reads the
embeddings, which no DTensor op shards on the sequence dim by itself (the model's inputs are replicated), while
the blocks after it read their predecessor's output; one tied decision serves them all only if the first block's
input is made what the others receive.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from ..capture.graph import StepGraph
from ..strategies.placements import is_partial
from .build.names import _node_name
from .tied import TiedGraph


def _readers(graph: StepGraph, tied: TiedGraph) -> dict[int, list[tuple[int, int]]]:
    """Value id -> (forward node, input position) of every forward op reading it; kept on the graph (a captured
    step does not change, and every plan written from it asks)."""
    if "_forward_readers" not in graph.__dict__:
        readers: dict[int, list[tuple[int, int]]] = defaultdict(list)
        for i in tied.canonical:
            for k, vid in enumerate(graph.nodes[i].inputs):
                readers[vid].append((i, k))
        graph.__dict__["_forward_readers"] = dict(readers)
    return graph.__dict__["_forward_readers"]


def _inside(module: str, outer: str) -> bool:
    return not outer or module == outer or module.startswith(outer + ".")


def reduced_where_read(
    built: Any, solution: Any, graph: StepGraph, tied: TiedGraph, module: str, node: int, placement: str
) -> str:
    """The tensor-parallel placement the runtime gives ``module``'s output, made by forward node ``node`` in
    ``placement``: a partial sum becomes the one placement its readers outside the module take it in (a
    row-parallel output read sequence-sharded by the residual add: reduce-scattered at the module boundary, as
    the edge to the add is priced); anything else, or readers that disagree, stays as made (DTensor then reduces
    a partial sum where an op needs it)."""
    if not is_partial(placement) or not graph.nodes[node].outputs:
        return placement
    wanted: set[str] = set()
    for j, k in _readers(graph, tied).get(graph.nodes[node].outputs[0], []):
        if _inside(graph.nodes[j].module, module):
            continue
        name = _node_name(tied.canonical[j])
        if name not in built.strategies:
            return placement
        spec = built.strategies[name][solution.choice[name]].input_placements
        if k >= len(spec) or spec[k] is None:
            return placement
        wanted.add(spec[k][0])
    if len(wanted) == 1 and not is_partial(next(iter(wanted))):
        return next(iter(wanted))
    return placement


def block_input_placements(
    graph: StepGraph, activation_placements: dict[str, list[str]]
) -> dict[str, list[str]]:
    """Block FQN -> the placement (per mesh axis) its first input (the hidden states) is brought to on entry,
    for every block of a folded run: its own output's placement, which is what every block after the first
    receives from its predecessor. The ILP ties the blocks of a run to one decision and asks DTensor's choices
    of the representative, which reads its predecessor's output
    (:func:`hf_colossal_auto.solve.rules.dtensor_choice_rules`); the first block reads what the model made
    before the run (the embeddings), and entering it as the others do keeps the tie true at run time."""
    out: dict[str, list[str]] = {}
    for run in graph.block_runs:
        for block in run.all_blocks:
            if block in activation_placements:
                out[block] = list(activation_placements[block])
    return out
