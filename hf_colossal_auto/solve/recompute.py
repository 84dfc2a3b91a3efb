"""Activation-recompute options per block, for the joint sharding + recompute ILP.

A *unit* is what one recompute decision covers: a run of identical transformer blocks (tied, like their
sharding: one decision for all of them) or a single block of a ``ModuleList`` that was not folded. Its
options, cheapest in time first:

* ``none``: every output autograd saves stays alive until backward;
* ``selective:<classes>``: the outputs of the other op classes are kept (a selective-checkpoint policy caches
  them whether or not autograd needs them) and the listed classes are recomputed in backward
  (:mod:`hf_colossal_auto.capture.op_classes`). Levels add classes in order of bytes freed per second of
  recompute, the greedy order of a knapsack over classes (torch's SAC estimator ranks ops the same way);
* ``full``: the block is checkpointed; only what leaves the block is kept and its whole forward reruns.

Under any option a recomputed op's forward time is paid again, and so are the collectives that feed it
(DTensor redistributes its inputs again when it reruns): the builder prices them as conditional costs.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

from ..capture.graph import OpNode, Phase, StepGraph
from ..capture.op_classes import ATTENTION, POINTWISE, op_class
from ..recompute_options import (  # noqa: F401 (re-exported: the options are the Plan's contract)
    FULL_RECOMPUTE,
    NO_RECOMPUTE,
    RecomputeOption,
    parse_option,
    selective,
)


@dataclass
class RecomputeUnit:
    """Blocks that share one recompute decision, and the forward nodes (canonical) that decide for them."""

    name: str
    blocks: list[str]
    """Real block FQNs the decision applies to (the runtime checkpoints each)."""
    nodes: list[int]
    """Canonical forward node indices inside the unit."""
    escaping: frozenset[int]
    """Nodes whose outputs are read after the unit (by the next block, the head): kept under any option."""
    last_block: str
    """The block whose backward comes first: the moment its recompute adds to everything still saved."""
    last_saved: int | None = None
    """The last node (in forward order) whose output the block's own backward needs. Recomputation stops there
    (non-reentrant checkpoint stops early once every saved tensor is back), so the ops after it do not rerun."""

    def reruns(self, option: RecomputeOption, node: OpNode) -> bool:
        """Does backward run this forward op of the unit again under ``option``?"""
        return self.last_saved is not None and node.index <= self.last_saved and option.recomputes(node)


def _inside(module: str, block: str) -> bool:
    return module == block or module.startswith(block + ".")


def find_units(graph: StepGraph, canonical: dict[int, int], layers: Iterable[str]) -> list[RecomputeUnit]:
    """Units for the ``layers`` (``ModuleList`` children) of a traced step: one per folded run, one per other
    layer that ran forward ops. ``canonical`` maps forward nodes to the node deciding for them."""
    fwd = [n for n in graph.nodes if n.phase is Phase.FORWARD]
    runs = {run.representative: run for run in graph.block_runs}
    in_run = {b for run in graph.block_runs for b in run.all_blocks}
    units: list[RecomputeUnit] = []
    layers = list(layers)
    outer = [x for x in layers if not any(_inside(x, y) and x != y for y in [*layers, *in_run])]
    # one decision per transformer block: a ModuleList inside a block (T5's sub-layers) is decided with it
    candidates = [(rep, run.all_blocks) for rep, run in runs.items()]
    candidates += [(layer, [layer]) for layer in outer if layer not in in_run]
    for name, blocks in candidates:
        traced = runs[name].traced if name in runs else blocks
        members = {n.index for n in fwd if any(_inside(n.module, b) for b in traced)}
        nodes = sorted({canonical[i] for i in members})
        if not nodes:
            continue
        escaping: set[int] = set()
        for block in traced:  # each block is checkpointed alone: what the next block reads is kept
            own = {n.index for n in fwd if _inside(n.module, block)}
            # By storage, not by value: a block may return a view of what it made (OPT's layers end in
            # ``(residual + h).view(shape)``); the view allocates nothing, and the storage it keeps alive is
            # the one its base's producer allocated, so that producer's output is what the block keeps.
            read_after = {graph.values[v].storage_id for n in fwd if n.index not in own for v in n.inputs}
            escaping.update(
                canonical[i]
                for i in own
                if any(graph.values[v].storage_id in read_after for v in graph.nodes[i].outputs)
            )
        units.append(RecomputeUnit(name, list(blocks), nodes, frozenset(escaping), blocks[-1]))
    units.sort(key=lambda u: min(u.nodes))
    return units


def unit_options(
    graph: StepGraph, unit: RecomputeUnit, saved_bytes: dict[int, float], forward_s: dict[int, float]
) -> list[RecomputeOption]:
    """``none``, the selective levels worth having (classes that free bytes, best bytes-per-second first), and
    ``full``. ``saved_bytes``/``forward_s``: per canonical node, unsharded, for ranking only."""
    freed: dict[str, float] = defaultdict(float)
    cost: dict[str, float] = defaultdict(float)
    for i in unit.nodes:
        node = graph.nodes[i]
        cls = op_class(node.op)
        cost[cls] += forward_s.get(i, 0.0)
        if i not in unit.escaping:
            freed[cls] += saved_bytes.get(i, 0.0)
    ranked = sorted(
        (c for c in (POINTWISE, ATTENTION) if freed[c] > 0),
        key=lambda c: (-freed[c] / max(cost[c], 1e-30), c),
    )
    levels = [selective(ranked[: k + 1]) for k in range(len(ranked))]
    return [NO_RECOMPUTE, *levels, FULL_RECOMPUTE]
