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

Each selective level also comes with its ``;rerun=`` twin where the block has modules whose kept outputs no
backward reads (:func:`unread_modules`: a sub-layer's last projection): the twin recomputes those modules too,
keeping less; the ILP weighs the bytes against the rerun (free where the module comes after the last tensor
the block's backward reads: :attr:`RecomputeUnit.last_saved`).

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
    RERUN,
    RecomputeOption,
    in_module,
    parse_option,
    selective,
)

UNREAD = "*"
"""In a recompute pin (never in a Plan), ``"selective:<classes>;rerun=*"``: that level with its unit's
:func:`unread_modules` rerun (the pipeline pricing pins it for every block)."""


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


def unread_modules(
    graph: StepGraph, unit: RecomputeUnit, saved_bytes: dict[int, float], option: RecomputeOption
) -> list[str]:
    """Paths inside the unit's block of the modules whose every output ``option`` keeps is read by no backward
    and leaves no block (``saved_bytes``: per canonical node, what its backward reads of its outputs): what the
    policy keeps there only to replay the block's forward, not for any gradient. A sub-layer's last projection
    (its output goes to the residual add or, under tensor parallelism, the reduce-scatter of a full-size partial
    sum: neither saves it), and the projections feeding rotary embeddings (their multiplications by the
    position tables save the tables only); never one whose output a later op saves (gate / up before the
    activation). Rerunning one costs its matmul unless it comes after :attr:`RecomputeUnit.last_saved`; the
    ILP weighs that against the bytes, for all of them together (the option's ``;rerun=`` twin). Leaf modules
    only: a module holding others (an attention block) may carry the tensor-parallel region's own collectives
    in its hooks, which a rerun must not repeat."""
    prefixes = sorted({unit.name, *unit.blocks}, key=len, reverse=True)
    by_module: dict[str, list[OpNode]] = defaultdict(list)
    for i in unit.nodes:
        node = graph.nodes[i]
        block = next((b for b in prefixes if node.module.startswith(b + ".")), None)
        if block is not None:
            by_module[node.module[len(block) + 1 :]].append(node)
    unread: list[str] = []
    for path in sorted(by_module):
        if any(other != path and in_module(other, path) for other in by_module):
            continue  # leaf modules only (a projection): a region's own hooks (tensor parallelism) stay out
        kept = [n for n in by_module[path] if option.caches(n)]
        if any(graph.values[v].nbytes for n in kept for v in n.outputs) and all(
            not saved_bytes.get(n.index) and n.index not in unit.escaping for n in kept
        ):
            unread.append(path)
    return unread


def resolve_pin(text: str, graph: StepGraph, unit: RecomputeUnit, saved_bytes: dict[int, float]) -> str:
    """A recompute pin for ``unit``: ``text`` itself, or for ``"<level>;rerun=*"`` (:data:`UNREAD`) the level
    with the unit's :func:`unread_modules` (the level alone where it has none)."""
    if not text.endswith(RERUN + UNREAD):
        return text
    level = parse_option(text[: -len(RERUN + UNREAD)])
    return selective(level.recomputed, unread_modules(graph, unit, saved_bytes, level)).name


def unit_options(
    graph: StepGraph, unit: RecomputeUnit, saved_bytes: dict[int, float], forward_s: dict[int, float]
) -> list[RecomputeOption]:
    """``none``, the selective levels worth having (classes that free bytes, best bytes-per-second first), each
    followed by its ``;rerun=`` twin where it has :func:`unread_modules`, and ``full``. ``saved_bytes``/``forward_s``: per canonical node, unsharded, for ranking only."""
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
    levels: list[RecomputeOption] = []
    for k in range(len(ranked)):
        level = selective(ranked[: k + 1])
        levels.append(level)
        unread = unread_modules(graph, unit, saved_bytes, level)
        if unread:
            levels.append(selective(level.recomputed, unread))
    return [NO_RECOMPUTE, *levels, FULL_RECOMPUTE]
