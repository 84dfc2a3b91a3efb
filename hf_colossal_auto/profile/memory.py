"""Liveness peak of one training step, from the recorded allocation/free timeline.

The recorder saw every storage come to life and die while forward, backward and the optimizer step ran
on fake tensors; the peak is the maximum of the running sum over that timeline, on top of the memory that
exists before the step (parameters, buffers, optimizer state, the batch). This is the per-time-step
liveness that Alpa constrains, not Colossal-Auto's sum over every node.

When identical blocks were folded, :func:`unroll` rebuilds the full-depth timeline: the representative
block's forward and backward event slices are repeated once per untraced block (the tracer verified that
two consecutive copies produce identical slices), the untraced blocks' parameters and optimizer state join
the floor, and the optimizer phase — whose foreach kernels allocate in proportion to the parameters they
update — is scaled by the ratio of trainable parameter bytes.
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
    """The real block FQN each op of ``order`` belongs to (None outside folded blocks)."""
    events: list[tuple[int, int, ValueKind]]
    """(position in ``order``, bytes delta, storage kind), chronological; position -1 = before any op."""
    initial_bytes: int
    initial_by_kind: dict[ValueKind, int]


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
    for run in graph.block_runs:
        segs = graph.block_segments[run.representative]
        extra = run.all_blocks[len(run.traced) :]
        for phase, seg in segs.items():
            labels = [run.representative, *extra] if phase is Phase.FORWARD else [*reversed(extra), run.representative]
            rep_info[seg.start] = (phase, labels)
            seg_end[seg.start] = seg.end

    block_label: dict[int, str] = {}
    for block, segs in graph.block_segments.items():
        for seg in segs.values():
            for i in range(seg.start, seg.end):
                block_label[i] = block

    by_slot = _group_by_slot(graph)
    kind_of = {sid: s.kind for sid, s in graph.storages.items()}
    scale = _optimizer_scale(graph)
    opt_start = graph.phase_range(Phase.OPTIMIZER).start if scale != 1.0 else len(graph.nodes)

    order: list[int] = []
    block_of: list[str | None] = []
    events: list[tuple[int, int, ValueKind]] = []

    def emit(i: int, label: str | None) -> None:
        pos = len(order)
        order.append(i)
        block_of.append(label)
        factor = scale if i >= opt_start else 1.0
        for delta, sid in by_slot.get(i, ()):
            events.append((pos, round(delta * factor), kind_of[sid]))

    for delta, sid in by_slot.get(-1, ()):
        events.append((-1, delta, kind_of[sid]))
    i = 0
    n = len(graph.nodes)
    while i < n:
        if i in rep_info:
            _, labels = rep_info[i]
            for label in labels:
                for j in range(i, seg_end[i]):
                    emit(j, label)
            i = seg_end[i]
            continue
        emit(i, block_label.get(i))
        i += 1

    initial_by_kind: dict[ValueKind, int] = defaultdict(int)
    for sid in graph.initial_storages:
        initial_by_kind[kind_of[sid]] += graph.storages[sid].nbytes
    folded_params = _folded_params(graph)
    initial_by_kind[ValueKind.PARAM] += sum(graph.param_bytes[p] for p in folded_params)
    initial_by_kind[ValueKind.OPTIMIZER_STATE] += sum(graph.optimizer_state_bytes.get(p, 0) for p in folded_params)
    return UnrolledStep(order, block_of, events, sum(initial_by_kind.values()), dict(initial_by_kind))


def _folded_params(graph: StepGraph) -> list[str]:
    """Parameters that live in untraced blocks."""
    untraced = [b for run in graph.block_runs for b in run.all_blocks[len(run.traced) :]]
    if not untraced:
        return []
    prefixes = tuple(b + "." for b in untraced)
    return [p for p in graph.param_names if p.startswith(prefixes)]


def _optimizer_scale(graph: StepGraph) -> float:
    """Full-model over traced trainable parameter bytes; the optimizer's temporaries scale with it."""
    folded = set(_folded_params(graph))
    if not folded:
        return 1.0
    traced = sum(b for p, b in graph.param_bytes.items() if p not in folded)
    return (traced + sum(graph.param_bytes[p] for p in folded)) / traced if traced else 1.0


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
