"""The captured step as the runtime runs it under autocast: sibling projections share one cast of their input.

The tracer records a plain model under ``torch.autocast``: q, k and v of one attention (gate and up of one MLP)
each cast the same input to the low-precision dtype, and each keeps its copy for backward. A planned model runs
:func:`hf_colossal_auto.apply.shared_casts.share_sibling_casts` instead: one cast per input and parent module's
forward, every sibling reading an alias of it. :func:`share_sibling_casts` rewrites the recorded step to match:
the first sibling's cast stays as recorded, and lives until the last sibling's copy would have died; every later
sibling's cast is marked :attr:`~hf_colossal_auto.capture.graph.OpNode.shared_with` (no kernel, no memory), its
output in the first cast's storage and its own storage's events dropped.

A profile of the plain model (``profile_model``) keeps the recorded step: that is what the plain model runs.
"""

from __future__ import annotations

import dataclasses
from collections import Counter, defaultdict

from .graph import MemoryEvent, OpNode, Phase, StepGraph, ValueKind
from .module_kinds import PROJECTION_TYPES

_CAST = "aten._to_copy.default"


def _input_casts(graph: StepGraph) -> dict[tuple[int, str, str], list[OpNode]]:
    """Forward casts of a projection's module input (made outside it), by (input, parent module, dtype), for
    parents with two or more projection children (the runtime's hooks)."""
    children: dict[str, set[str]] = defaultdict(set)
    for module, kind in graph.module_types.items():
        if kind in PROJECTION_TYPES and module:
            children[module.rpartition(".")[0]].add(module)
    groups: dict[tuple[int, str, str], list[OpNode]] = defaultdict(list)
    for node in graph.nodes:
        if (
            node.phase is not Phase.FORWARD
            or node.op != _CAST
            or len(node.inputs) != 1
            or len(node.outputs) != 1
        ):
            continue
        module = node.module
        parent = module.rpartition(".")[0]
        if graph.module_types.get(module) not in PROJECTION_TYPES or not parent or len(children[parent]) < 2:
            continue
        source = graph.values[node.inputs[0]]
        if source.kind in (ValueKind.PARAM, ValueKind.BUFFER):
            continue  # a weight: autocast's own cache
        if graph.made_inside(source.id, module):
            continue  # made inside the projection: not its module input
        groups[(source.id, parent, graph.values[node.outputs[0]].dtype)].append(node)
    return {key: nodes for key, nodes in groups.items() if len(nodes) > 1}


def share_sibling_casts(graph: StepGraph) -> int:
    """Rewrite ``graph`` (in place) as the runtime runs it: one cast per input read by sibling projections (see
    the module doc). Returns the number of casts that became aliases. A graph without mixed precision is left
    as it is."""
    if not graph.mixed_precision:
        return 0
    allocated_by = {e.storage_id: e.slot for e in graph.memory_events if e.delta > 0}
    merged: dict[int, int] = {}  # dropped storage -> the storage that takes its place
    aliases = 0
    for nodes in _input_casts(graph).values():
        keeper = graph.values[nodes[0].outputs[0]]
        for node in nodes[1:]:
            value = graph.values[node.outputs[0]]
            if value.nbytes != keeper.nbytes or allocated_by.get(value.storage_id) != node.index:
                continue  # not a fresh copy of the same size: leave it as recorded
            merged[value.storage_id] = keeper.storage_id
            graph.values[value.id] = dataclasses.replace(value, storage_id=keeper.storage_id)
            node.shared_with = nodes[0].index
            node.bytes_read = node.bytes_written = 0
            aliases += 1
    if merged:
        graph.memory_events = _merged_events(graph.memory_events, merged)
    return aliases


def _merged_events(events: list[MemoryEvent], merged: dict[int, int]) -> list[MemoryEvent]:
    """``events`` without the dropped storages' allocations, each kept storage freed where the last of its group
    was (never, when one of them never was)."""
    group_of = dict(merged) | {keep: keep for keep in merged.values()}
    allocations: Counter[int] = Counter()
    frees: Counter[int] = Counter()
    last_free: dict[int, int] = {}
    for i, e in enumerate(events):
        keep = group_of.get(e.storage_id)
        if keep is not None:
            (allocations if e.delta > 0 else frees)[keep] += 1
            if e.delta < 0:
                last_free[keep] = i
    out: list[MemoryEvent] = []
    for i, e in enumerate(events):
        keep = group_of.get(e.storage_id)
        if keep is None or (e.delta > 0 and e.storage_id == keep):
            out.append(e)
        elif e.delta < 0 and frees[keep] == allocations[keep] and last_free[keep] == i:
            out.append(MemoryEvent(e.position, keep, e.delta))  # the members' sizes are equal
    return out
