"""Memory pricing: the liveness snapshots of a step (what each node holds at the highest point of forward and of
backward and at each recompute unit's moments), the arguments a checkpoint holds, and the optimizer's temporaries."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

from ...capture.graph import Phase, StepGraph, ValueKind
from ...profile.memory import UnrolledStep, unroll
from ..recompute import RecomputeUnit
from ..tied import TiedGraph


@dataclass
class _Snapshot:
    """Live bytes at one moment: by storage kind, and by the forward node that allocated them (summed over
    the blocks a replayed copy stands for)."""

    by_kind: dict[str, int]
    by_node: dict[int, int]
    watched_alive: frozenset[int] = frozenset()
    """The watched storages (see :func:`_liveness`) alive at that moment."""

    @property
    def total(self) -> int:
        """Live bytes of every kind."""
        return sum(self.by_kind.values())


Moment = tuple[int, str]
"""A position in ``UnrolledStep.order`` and ``"before"`` (the state before its events) or ``"max"`` (the state at
the highest point its events reach: an op's outputs and temporaries exist together before its frees)."""


def _liveness(
    graph: StepGraph, step: UnrolledStep, moments: list[Moment], watched: set[int] | None = None
) -> tuple[dict[Phase, _Snapshot], list[_Snapshot]]:
    """The highest point of each phase of forward + backward (the optimizer step is priced apart; a phase with no
    op has none) and the state at each of ``moments``; each snapshot says which of the ``watched`` storages are
    alive then. Events before any op count as forward.

    Why per phase: the memory rows bound each phase's highest moment (:func:`_highest_phase` tells the step's),
    because sharding shrinks the two unevenly — the forward holds the saved activations, which a strategy splits,
    while the backward's highest point is often a transient priced whole (a causal LM's loss gradients), so the
    lower of the two before sharding can be the higher after it."""
    alloc_node = {e.storage_id: e.slot for e in graph.memory_events if e.delta > 0}
    live: dict[ValueKind, int] = defaultdict(int, step.initial_by_kind)
    by_node: dict[int, int] = defaultdict(int)
    watched = watched or set()
    copies: dict[int, int] = defaultdict(int)  # watched storage -> live copies

    def snap() -> _Snapshot:
        return _Snapshot(
            {k.value: v for k, v in live.items()},
            {n: b for n, b in by_node.items() if b > 0},
            frozenset(s for s, c in copies.items() if c > 0),
        )

    before = sorted({pos for pos, kind in moments if kind == "before"})
    at_max = {pos for pos, kind in moments if kind == "max"}
    taken: dict[Moment, _Snapshot] = {}
    best_at: dict[int, int] = {}
    total = sum(live.values())
    best_total: dict[Phase, int] = {Phase.FORWARD: total}
    peaks: dict[Phase, _Snapshot] = {Phase.FORWARD: snap()}
    for (pos, delta, kind), sid in zip(step.events, step.event_storages, strict=True):
        while before and pos >= before[0]:
            taken[(before.pop(0), "before")] = snap()
        phase = graph.nodes[step.order[pos]].phase if pos >= 0 else Phase.FORWARD
        if phase is Phase.OPTIMIZER:
            break
        total += delta
        live[kind] += delta
        node = alloc_node.get(sid)
        if node is not None and graph.nodes[node].phase is Phase.FORWARD:
            by_node[node] += delta
        if sid in watched:
            copies[sid] += 1 if delta > 0 else -1
        if total > best_total.get(phase, -1):
            best_total[phase], peaks[phase] = total, snap()
        if pos in at_max and total > best_at.get(pos, -1):
            best_at[pos] = total
            taken[(pos, "max")] = snap()
    for pos in before:
        taken[(pos, "before")] = snap()
    return peaks, [taken.get(m) or snap() for m in moments]


def _highest_phase(peaks: dict[Phase, _Snapshot]) -> Phase:
    """The phase of :func:`_liveness`'s ``peaks`` whose highest point is the step's (the forward on a tie: it comes
    first)."""
    return max(peaks, key=lambda phase: (peaks[phase].total, phase is Phase.FORWARD))


def _checkpoint_args(
    graph: StepGraph, tied: TiedGraph, units: list[RecomputeUnit], unit_index_of: dict[int, int]
) -> dict[int, set[int]]:
    """Storages a forward op outside every unit made and the model passes to a unit's blocks (position ids,
    masks, rotary tables; used by the block or not), with the units whose blocks get them. A recomputed block's
    checkpoint keeps its arguments until its backward, whether or not anything else still needs them."""
    alloc = {e.storage_id: e.slot for e in graph.memory_events if e.delta > 0}
    runs = {run.representative: run.traced for run in graph.block_runs}
    readers: dict[int, set[int]] = defaultdict(set)
    for u, unit in enumerate(units):
        for block in runs.get(unit.name, unit.blocks):
            for sid in graph.block_args.get(block, ()):
                made = alloc.get(sid)
                if made is None or graph.nodes[made].phase is not Phase.FORWARD:
                    continue  # parameters, buffers and the batch exist all step anyway
                if tied.canonical.get(made, made) in unit_index_of:
                    continue  # made inside a unit (a block's output): priced with that unit's kept bytes
                readers[sid].add(u)
    return dict(readers)


def _block_moment(
    graph: StepGraph, step: UnrolledStep, unit: RecomputeUnit, phase: Phase, which: str
) -> Moment:
    """A moment in ``phase`` of the unit's block that goes backward first (its last block): ``"start"``, before
    its first op; ``"peak"``, inside the op at which the live bytes reach their highest."""
    block = unit.last_block
    inside_positions = [
        pos
        for pos, i in enumerate(step.order)
        if graph.nodes[i].phase is phase
        and (
            step.block_of[pos] == block
            or (
                step.block_of[pos] is None
                and (graph.nodes[i].module == block or graph.nodes[i].module.startswith(block + "."))
            )
        )
    ]
    if not inside_positions:
        return (len(step.order), "before")
    if which == "start":
        return (inside_positions[0], "before")
    wanted = set(inside_positions)
    total, best, best_pos = step.initial_bytes, -1, inside_positions[0]
    for pos, delta, _ in step.events:
        total += delta
        if pos in wanted and total > best:
            best, best_pos = total, pos
    return (best_pos, "max")


class StepMemory:
    """What every problem built from one captured step reads of its memory, worked out once: the full-depth
    timeline (``unroll``) and the liveness snapshots the memory rows are written at, per set of recompute units
    and checkpoint arguments (:meth:`~..build.memory_rows._MemoryRowsPart._snapshots`).

    Why an object: one step is built into several problems (data-parallel modes, the planner's relaxations and
    bounds), and a captured step does not change, so each is worked out once per step. Whoever builds those
    problems owns it (the candidate planner, through :class:`StepMemories`); nothing is kept on the step itself,
    so a step interpolated at other rows (a fresh object) never reads another step's figures."""

    def __init__(self, graph: StepGraph) -> None:
        self.graph = graph
        self._unrolled: UnrolledStep | None = None
        self.snapshots: dict[Hashable, Any] = {}
        """Snapshots by what they depend on besides the step (the builder's key)."""
        self.parts: dict[Hashable, Any] = {}
        """What the builder reads that depends on the step and a few settings only, not on the data-parallel
        mode (its edges and DTensor's rules per tensor-parallel axis, the backward ratios and optimizer figures
        per device), by what else it depends on (the builder's keys)."""

    @property
    def unrolled(self) -> UnrolledStep:
        """``unroll(graph)``, made on first use."""
        if self._unrolled is None:
            self._unrolled = unroll(self.graph)
        return self._unrolled


class StepMemories:
    """One :class:`StepMemory` per step, by the step's identity: what a planning call holds for the steps it
    builds problems from. Each entry holds its step, so an identity is never reused while its entry lives, and
    the entries go with the planning call."""

    def __init__(self) -> None:
        self._by_id: dict[int, StepMemory] = {}

    def of(self, graph: StepGraph) -> StepMemory:
        memory = self._by_id.get(id(graph))
        if memory is None:
            memory = self._by_id[id(graph)] = StepMemory(graph)
        return memory


def _optimizer_temp_ratio(graph: StepGraph, step: UnrolledStep | None = None) -> float:
    """The optimizer step's temporary bytes at their peak, per byte of trainable parameter (``step``: the step's
    unrolled timeline, if at hand)."""
    step = unroll(graph) if step is None else step
    opt_positions = [pos for pos, i in enumerate(step.order) if graph.nodes[i].phase is Phase.OPTIMIZER]
    if not opt_positions:
        return 0.0
    start = opt_positions[0]
    live = 0
    peak = 0
    for pos, delta, kind in step.events:
        if pos < start:
            continue
        if kind in (ValueKind.ACTIVATION,):
            live += delta
            peak = max(peak, live)
    total = graph.trainable_param_bytes
    return peak / total if total else 0.0
