"""Liveness peak of one training step, from the recorded allocation/free timeline.

The recorder saw every storage come to life and die while forward, backward and the optimizer step ran
on fake tensors; the peak is the maximum of the running sum over that timeline, on top of the memory that
exists before the step (parameters, buffers, optimizer state, the batch). This is the per-time-step
liveness that Alpa constrains, not Colossal-Auto's sum over every node.

When identical blocks were folded, :func:`unroll` rebuilds the full-depth timeline: the representative
block's forward and backward event slices are repeated once per untraced block (the tracer verified that
two middle copies produce identical slices), the untraced blocks' parameters and optimizer state join
the floor, and in the optimizer step every storage that belongs to a representative's parameter (the
recorder maps foreach list positions to parameters) is allocated and freed once per twin parameter.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from ..capture.graph import Phase, StepGraph, ValueKind


@dataclass
class UnrolledStep:
    """The full-depth step: node order (indices into the traced graph) and its memory timeline."""

    order: list[int]
    """Traced node index for every op of the full step, in execution order."""
    block_of: list[str | None]
    """The real block FQN each op of ``order`` belongs to (None outside traced blocks of folded runs)."""
    source_of: list[str | None]
    """The traced block whose op it is (differs from ``block_of`` for copies standing in for other blocks)."""
    events: list[tuple[int, int, ValueKind]]
    """(position in ``order``, bytes delta, storage kind), chronological; position -1 = before any op."""
    initial_bytes: int
    initial_by_kind: dict[ValueKind, int]
    event_storages: list[int] = field(default_factory=list)
    """The traced storage id of each event (replayed copies repeat their representative's ids)."""


@dataclass
class MemoryProfile:
    peak_bytes: int
    peak_position: int
    """Index into the unrolled order at which the peak happens."""
    peak_phase: Phase
    peak_by_kind: dict[str, int]
    activation_bytes: int
    """Activation bytes alive when the forward ends: what the step keeps for backward."""
    peak_activation_bytes: int
    """Largest activation/temporary footprint at any point of the step."""
    saved_bytes_per_node: dict[int, int] = field(default_factory=dict)
    """Per traced node: bytes it allocated in forward that are still alive when backward starts."""


def _group_by_slot(graph: StepGraph) -> dict[int, list[tuple[int, int]]]:
    by_slot: dict[int, list[tuple[int, int]]] = defaultdict(list)
    for e in graph.memory_events:
        by_slot[e.slot].append((e.delta, e.storage_id))
    return by_slot


def unroll(graph: StepGraph) -> UnrolledStep:
    """Expand folded blocks back to full depth (a no-op copy when nothing was folded)."""
    rep_info: dict[int, tuple[Phase, list[str]]] = {}
    """Segment start -> (phase, labels of the copies to emit in order)."""
    seg_end: dict[int, int] = {}
    block_label: dict[int, tuple[str, str]] = {}
    """Traced node -> (real block, traced block) for nodes of traced blocks."""
    for run in graph.block_runs:
        rep = run.representative
        extra = run.untraced
        for phase, seg in graph.block_segments[rep].items():
            labels = [rep, *extra] if phase is Phase.FORWARD else [*reversed(extra), rep]
            rep_info[seg.start] = (phase, labels)
            seg_end[seg.start] = seg.end
        for block in run.traced:
            for seg in graph.block_segments[block].values():
                for i in range(seg.start, seg.end):
                    block_label[i] = (run.real_block(block), block)

    by_slot = _group_by_slot(graph)
    kind_of = {sid: s.kind for sid, s in graph.storages.items()}
    for slot, frees in _escaping_frees(graph).items():
        by_slot[slot].extend(frees)
    opt_copies = _optimizer_copies(graph)
    opt_start = graph.phase_range(Phase.OPTIMIZER).start

    order: list[int] = []
    block_of: list[str | None] = []
    source_of: list[str | None] = []
    events: list[tuple[int, int, ValueKind]] = []
    event_storages: list[int] = []

    # per slot its events as emitted (delta, kind, storage, copies): a folded block's slots are emitted once per
    # block it stands for, so this is worked out once per slot, not once per emission
    slot_events = {
        i: [
            (delta, kind_of[sid], sid, opt_copies.get(sid, 1) if i >= opt_start else 1) for delta, sid in slot
        ]
        for i, slot in by_slot.items()
    }

    def emit(i: int, label: str | None, source: str | None) -> None:
        pos = len(order)
        order.append(i)
        block_of.append(label)
        source_of.append(source)
        for delta, kind, sid, copies in slot_events.get(i, ()):
            if copies == 1:
                events.append((pos, delta, kind))
                event_storages.append(sid)
            else:
                events.extend([(pos, delta, kind)] * copies)
                event_storages.extend([sid] * copies)

    for delta, sid in by_slot.get(-1, ()):
        events.append((-1, delta, kind_of[sid]))
        event_storages.append(sid)
    i = 0
    n = len(graph.nodes)
    while i < n:
        if i in rep_info:
            _, labels = rep_info[i]
            source = block_label[i][1]
            for label in labels:
                for j in range(i, seg_end[i]):
                    emit(j, label, source)
            i = seg_end[i]
            continue
        label, source = block_label.get(i, (None, None))
        emit(i, label, source)
        i += 1

    initial_by_kind: dict[ValueKind, int] = defaultdict(int)
    for sid in graph.initial_storages:
        initial_by_kind[kind_of[sid]] += graph.storages[sid].nbytes
    folded_params = _folded_params(graph)
    initial_by_kind[ValueKind.PARAM] += sum(graph.param_bytes[p] for p in folded_params)
    initial_by_kind[ValueKind.OPTIMIZER_STATE] += sum(
        graph.optimizer_state_bytes.get(p, 0) for p in folded_params
    )
    return UnrolledStep(
        order,
        block_of,
        source_of,
        events,
        sum(initial_by_kind.values()),
        dict(initial_by_kind),
        event_storages,
    )


def _escaping_frees(graph: StepGraph) -> dict[int, list[tuple[int, int]]]:
    """Frees to add so that every untraced copy releases what the representative releases outside the run.

    A storage allocated by the representative and freed inside a segment of the same run (a saved activation
    freed in backward, a hidden state handed to the next block) is replayed by the copies themselves. One freed
    elsewhere — e.g. per-block gradient contributions to a tensor shared by all blocks, summed and released
    once after the last block — must be freed once per copy at that same place.
    """
    extra: dict[int, list[tuple[int, int]]] = defaultdict(list)
    alloc_slot = {e.storage_id: e.slot for e in graph.memory_events if e.delta > 0}
    for run in graph.block_runs:
        if run.repeat == 0:
            continue
        inside = set()
        for block in run.traced:
            for seg in graph.block_segments[block].values():
                inside.update(range(seg.start, seg.end))
        rep_slots = set()
        for seg in graph.block_segments[run.representative].values():
            rep_slots.update(range(seg.start, seg.end))
        for e in graph.memory_events:
            if e.delta < 0 and e.slot not in inside and alloc_slot.get(e.storage_id) in rep_slots:
                extra[e.slot].extend([(e.delta, e.storage_id)] * run.repeat)
    return extra


def _folded_params(graph: StepGraph) -> list[str]:
    """Parameters that live in untraced blocks."""
    untraced = [b for run in graph.block_runs for b in run.all_blocks[len(run.traced) :]]
    if not untraced:
        return []
    prefixes = tuple(b + "." for b in untraced)
    return [p for p in graph.param_names if p.startswith(prefixes)]


def _optimizer_copies(graph: StepGraph) -> dict[int, int]:
    """Storages of the optimizer step that belong to a representative's parameter, and how many parameters
    of the full model each stands for (itself and its twins in every untraced block)."""
    prefixes = {run.representative + ".": 1 + run.repeat for run in graph.block_runs if run.repeat}
    if not prefixes:
        return {}
    copies: dict[int, int] = {}
    for sid, info in graph.storages.items():
        if info.owner is None:
            continue
        for prefix, count in prefixes.items():
            if info.owner.startswith(prefix):
                copies[sid] = count
                break
    return copies


def memory_profile(graph: StepGraph, unrolled: UnrolledStep | None = None) -> MemoryProfile:
    """Replay the (unrolled) timeline and report its peak and what the peak is made of."""
    step = unrolled or unroll(graph)
    live: dict[ValueKind, int] = defaultdict(int, step.initial_by_kind)
    total = step.initial_bytes
    peak, peak_pos = total, -1
    peak_kinds = dict(live)
    act_kinds = (ValueKind.ACTIVATION,)
    peak_act = live[ValueKind.ACTIVATION]
    fwd_end = _forward_end(graph, step)
    activation_at_fwd_end = live[ValueKind.ACTIVATION] if fwd_end < 0 else None
    for pos, delta, kind in step.events:
        if activation_at_fwd_end is None and pos >= fwd_end:
            activation_at_fwd_end = sum(live[k] for k in act_kinds)
        total += delta
        live[kind] += delta
        if total > peak:
            peak, peak_pos = total, pos
            peak_kinds = dict(live)
        peak_act = max(peak_act, live[ValueKind.ACTIVATION])
    if activation_at_fwd_end is None:
        activation_at_fwd_end = live[ValueKind.ACTIVATION]
    phase = graph.nodes[step.order[peak_pos]].phase if 0 <= peak_pos < len(step.order) else Phase.FORWARD
    return MemoryProfile(
        peak_bytes=peak,
        peak_position=peak_pos,
        peak_phase=phase,
        peak_by_kind={k.value: v for k, v in sorted(peak_kinds.items(), key=lambda kv: kv[0].value)},
        activation_bytes=activation_at_fwd_end,
        peak_activation_bytes=peak_act,
        saved_bytes_per_node=saved_bytes_per_node(graph),
    )


def _forward_end(graph: StepGraph, step: UnrolledStep) -> int:
    """Position in the unrolled order of the first non-forward op (-1 if the step has no forward)."""
    for pos, i in enumerate(step.order):
        if graph.nodes[i].phase is not Phase.FORWARD:
            return pos
    return len(step.order)


def saved_bytes_per_node(graph: StepGraph) -> dict[int, int]:
    """Bytes each forward node allocated that survive into backward (saved tensors and their storages)."""
    bwd_start = graph.phase_range(Phase.BACKWARD).start
    alloc_by: dict[int, tuple[int, int]] = {}
    freed_before_bwd: set[int] = set()
    for e in graph.memory_events:
        if e.delta > 0 and graph.nodes[e.slot].phase is Phase.FORWARD:
            alloc_by[e.storage_id] = (e.slot, e.delta)
        elif e.delta < 0 and e.slot < bwd_start:
            freed_before_bwd.add(e.storage_id)
    saved: dict[int, int] = defaultdict(int)
    for sid, (node, nbytes) in alloc_by.items():
        if sid not in freed_before_bwd:
            saved[node] += nbytes
    return dict(saved)
