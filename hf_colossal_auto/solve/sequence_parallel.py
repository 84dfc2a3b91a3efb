"""Megatron-LM's sequence parallelism as a hand layout: which forward ops of each block lie between its
tensor-parallel regions, and their strategies narrowed to the sequence-sharded ones.

The planner already offers sequence-parallel layouts (a row-parallel output reduce-scattered onto the sequence
dim, norms and residual adds on sequence shards, an all-gather before the column-parallel inputs; issue 28) and
chooses them where they pay. The ``"megatron-sp"`` baseline of :func:`~.planner.evaluate_plan` asks for them on
every block, as Megatron-LM with ``--sequence-parallel`` and torchtitan's ``SequenceParallel`` norms run: it
keeps, for each op of a block's sequence-parallel region, only the strategies whose outputs are sharded on dim 1
(the sequence dim of ``[batch, seq, hidden]``). Everything else — the projections, attention, the MLP, the
embeddings and the head — stays the solver's, as for the ``"megatron"`` baseline, and the runtime applies the
plan as it applies any plan (:mod:`hf_colossal_auto.apply.enforce`).

A block's region is found by data flow, not by module names: starting from the hidden states entering the block
from the one before it (its input of the block's output shape: the residual stream) and from the outputs of its
row-parallel modules,
it follows the forward readers inside the block and stops at an op of a tensor-parallel or projection module
(the column-parallel inputs) and at an op that offers no sequence-sharded output. In a Llama block that is the
two RMSNorms and the two residual adds; in GPT-2 also the dropouts after the row-parallel projections; in BERT
the dropout, residual add and LayerNorm of its output modules.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Collection, Iterable, Mapping
from typing import TYPE_CHECKING

from ..capture.graph import Phase, StepGraph
from ..capture.module_kinds import PROJECTION_TYPES
from ..strategies.placements import Strategy
from .baselines import tensor_parallel_modules

if TYPE_CHECKING:
    from .candidates import _Planner

logger = logging.getLogger(__name__)

SEQUENCE_PARALLEL_LAYOUTS = ("megatron-sp", "megatron-sp-local")
"""The hand layouts (:func:`~.planner.evaluate_plan` baselines, ``Plan.hand_layout``) whose blocks' regions
between tensor-parallel modules are pinned to sequence shards: Megatron-LM with ``--sequence-parallel``, and the
same with attention and MLP run on local shards (torchtitan's TP plan)."""

LOCAL_LAYOUTS = ("megatron-local", "megatron-sp-local")
"""The hand layouts that run every attention / MLP module that qualifies on local tensor shards."""

SEQUENCE_SHARD = ("S1",)
"""The sequence dim of ``[batch, seq, hidden]`` sharded over the (one) tensor-parallel axis the strategies of a
``(dp, tp)`` plan are enumerated on."""


class SequenceParallelError(ValueError):
    """A model none of whose blocks has an op that runs on sequence shards between tensor-parallel regions."""


def _inside(module: str, outer: str) -> bool:
    return module == outer or module.startswith(outer + ".")


def _sequence_sharded(strategy: Strategy) -> bool:
    return bool(strategy.output_placements) and all(o == SEQUENCE_SHARD for o in strategy.output_placements)


def sequence_parallel_regions(
    graph: StepGraph,
    strategies: Mapping[int, list[Strategy]],
    blocks: Iterable[str],
    tensor_parallel_modules: Collection[str],
    row_parallel_modules: Collection[str],
) -> dict[str, list[int]]:
    """Block FQN -> the forward nodes of its sequence-parallel region (see the module docstring), for every block
    of ``blocks`` the graph traced (a folded run traces some of them; the plan's writer extends the choice to the
    rest). ``tensor_parallel_modules``: modules holding a tensor-parallel parameter (the regions' borders);
    ``row_parallel_modules``: those among them whose output is a partial sum to reduce-scatter."""
    forward = [n for n in graph.nodes if n.phase is Phase.FORWARD]
    readers: dict[int, list[int]] = defaultdict(list)
    for n in forward:
        for vid in n.inputs:
            readers[vid].append(n.index)
    projections = [m for m, t in graph.module_types.items() if t in PROJECTION_TYPES]
    borders = [*tensor_parallel_modules, *projections]
    blocks = list(blocks)
    traced = {b for b in blocks if any(_inside(n.module, b) for n in forward)}
    in_blocks = {n.index for n in forward if any(_inside(n.module, b) for b in traced)}
    out: dict[str, list[int]] = {}
    for block in sorted(traced, key=lambda b: min(n.index for n in forward if _inside(n.module, b))):
        mine = {n.index for n in forward if _inside(n.module, block)}
        seeds = _hidden_inputs(graph, mine, in_blocks, readers) + _row_parallel_outputs(
            graph, mine, readers, [m for m in row_parallel_modules if _inside(m, block)]
        )
        region: set[int] = set()
        queue = list(seeds)
        seen: set[int] = set()
        while queue:
            vid = queue.pop()
            if vid in seen:
                continue
            seen.add(vid)
            for j in readers.get(vid, []):
                node = graph.nodes[j]
                if j not in mine or j in region or any(_inside(node.module, m) for m in borders):
                    continue
                if not any(_sequence_sharded(s) for s in strategies.get(j, [])):
                    continue  # not offered on sequence shards (a mask, a reduction over the sequence)
                region.add(j)
                queue.extend(node.outputs)
        out[block] = sorted(region)
    return out


def _hidden_inputs(
    graph: StepGraph, mine: set[int], in_blocks: set[int], readers: Mapping[int, list[int]]
) -> list[int]:
    """Values a block reads from the block before it that have the shape of what it hands on: the residual
    stream entering it (not the rotary tables, masks or position ids it also reads). The embeddings entering the
    first block are not among them: its first norm runs replicated, as the planner's own sequence-parallel plans
    run it, because the runtime enforces placements at module outputs and the embeddings come out of a replicated
    lookup (the model's inputs are replicated), on which DTensor keeps the norm replicated; its residual add, read
    from the attention's reduce-scattered output, slices them."""
    made = {vid for i in mine for vid in graph.nodes[i].outputs}
    handed_on = {graph.values[vid].shape for vid in made if any(j not in mine for j in readers.get(vid, []))}
    read = {vid for i in mine for vid in graph.nodes[i].inputs if vid not in made}
    return sorted(
        vid
        for vid in read
        if graph.values[vid].producer in in_blocks
        and graph.values[vid].shape in handed_on
        and len(graph.values[vid].shape) >= 3
    )


def _row_parallel_outputs(
    graph: StepGraph, mine: set[int], readers: Mapping[int, list[int]], rows: list[str]
) -> list[int]:
    """Values made inside a row-parallel module and read outside it within the block: its (partial) output."""
    out = []
    for i in mine:
        node = graph.nodes[i]
        module = next((m for m in rows if _inside(node.module, m)), None)
        if module is None:
            continue
        for vid in node.outputs:
            if any(j in mine and not _inside(graph.nodes[j].module, module) for j in readers.get(vid, [])):
                out.append(vid)
    return out


def hand_layout_pins(
    planner: _Planner, placements: Mapping[str, str], mesh: tuple[int, int], micro_batches: int = 1
) -> dict[int, list[Strategy]]:
    """:func:`sequence_parallel_pins` of a hand layout's tensor-parallel ``placements`` (parameter FQN -> its
    placement on tp) on ``planner``'s step at ``mesh`` ``(dp, tp)``: what ``evaluate_plan`` and the pipeline
    pricing hand ``_Planner.build(strategy_pins=...)`` for the ``"megatron-sp"`` layouts."""
    borders, rows = tensor_parallel_modules(planner.model, placements)
    dp, tp = mesh
    return sequence_parallel_pins(
        planner.graph(dp, micro_batches),
        planner.strategies(dp, tp, micro_batches),
        planner.layers,
        borders,
        rows,
    )


def sequence_parallel_pins(
    graph: StepGraph,
    strategies: Mapping[int, list[Strategy]],
    blocks: Iterable[str],
    tensor_parallel_modules: Collection[str],
    row_parallel_modules: Collection[str],
) -> dict[int, list[Strategy]]:
    """Every op of every block's sequence-parallel region -> its sequence-sharded strategies among
    ``strategies`` (only those nodes: ``_Planner.build`` lays them over the strategies it prices, which a local
    layout has already narrowed for its attention and MLP ops — a whole copy would undo that). A block with no
    such op is named in a warning; a model with none at all is refused (:class:`SequenceParallelError`), since
    its layout would be plain Megatron's."""
    regions = sequence_parallel_regions(
        graph, strategies, blocks, tensor_parallel_modules, row_parallel_modules
    )
    empty = [b for b, nodes in regions.items() if not nodes]
    if not regions or len(empty) == len(regions):
        raise SequenceParallelError(
            f"{graph.model_class}: no block ({', '.join(empty[:3]) or 'none traced'}) has an op between its "
            "tensor-parallel regions that runs sharded on the sequence dim (norms, residual adds, dropouts of "
            "[batch, seq, hidden] states), so sequence parallelism changes nothing here; use the 'megatron' "
            "baseline"
        )
    for block in empty:
        logger.warning(
            "megatron-sp: block %s has no op between its tensor-parallel regions that runs on sequence shards; "
            "it runs as plain Megatron",
            block,
        )
    out: dict[int, list[Strategy]] = {}
    for nodes in regions.values():
        for i in nodes:
            out[i] = [s for s in strategies[i] if _sequence_sharded(s)]
    logger.debug(
        "megatron-sp: %s",
        ", ".join(f"{b} {len(nodes)} ops on sequence shards" for b, nodes in regions.items()),
    )
    return out
