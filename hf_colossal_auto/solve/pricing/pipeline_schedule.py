"""Price a pipeline schedule by simulating its action list: step time, idle time (the bubble) and activation
memory per stage, from per-stage seconds and bytes.

Why a simulation and not a closed formula: the formulas (GPipe's bubble ``(p-1)/(m+p-1)``...) hold for equal
stages without communication; a planner's stages are uneven (the embedding and the head land on the first and
last), zero-bubble schedules fill the bubble with weight gradients only as far as the times allow, and the
point-to-point sends sit on the critical path. Walking the schedule's own actions with each stage's times
gives all of that, and the formulas come out as special cases (tests).

The action lists: GPipe (every forward, then every backward) and 1F1B (``p - 1 - r`` warm-up forwards on
rank ``r``, then one forward and one backward in turn, then the remaining backwards) are written here, as
torch's single-stage schedules run them; the multi-stage schedules (interleaved 1F1B, interleaved zero bubble,
ZB-V) are torch's own ``pipeline_order`` (:func:`hf_colossal_auto._torch_compat.pipeline_schedule_actions`),
what its runtime executes.

The model. Each rank runs its actions in list order, an action starting when the rank is free and its inputs
have arrived: a forward needs the previous stage's forward of the same micro-batch (plus the send when the
stages are on different ranks), a backward (full or input-gradient) needs its own forward and the next
stage's backward (plus the send back), a weight gradient its input gradient. A send takes ``latency +
bytes / bandwidth`` on the directed link between two ranks, one send at a time per link, without holding the
ranks' compute (sends are asynchronous). Extras per stage: ``unsharded_at_s``, before which its first
forward cannot start (its FSDP all-gathers, issued as the step starts: they run while the rank waits for its
first micro-batch), ``last_backward_extra_s`` on its rank after its last backward or weight gradient, the
gradient already sent on (e.g. the data-parallel gradient sync), and ``optimizer_s`` per rank after
everything.

Memory: a forward keeps ``activation_bytes`` of its stage until that micro-batch's backward ends; under the
input/weight split the input gradient frees all but ``weight_grad_bytes`` (what the weight gradient still
reads), which the weight gradient frees; as a backward starts, its ``backward_transient_bytes`` come on top; a
stage's first backward (full or weight-gradient) makes its ``grad_bytes``, held from then on (counted whole
from that action: a bound within it), and its last its ``sync_transient_bytes`` as it ends (the gradient
synchronisation's). A tensor sent to another rank lives as long as the runtime keeps
its send's work (:data:`SENDS_KEPT_TO_STEP_END`): GPipe keeps a sent gradient to the end of the step; 1F1B waits
each send before the next; under the multi-stage schedules a sent gradient lives until the first action of its
rank whose received input proves it arrived (:mod:`hf_colossal_auto.pipeline_receipts`); a sent activation is
the stage's kept output, freed with its micro-batch's backward (the runtime's stage frees it even where torch
keeps its send). A rank's peak is the most its stages hold at
once along its list. Units: seconds and bytes.
"""

from __future__ import annotations

import functools
import heapq
from dataclasses import dataclass, field

from ...pipeline_receipts import gradient_send_releases
from ...plan import PIPELINE_SCHEDULES, stage_ranks

TORCH_MULTI_STAGE = {
    "interleaved-1f1b": "ScheduleInterleaved1F1B",
    "interleaved-zero-bubble": "ScheduleInterleavedZeroBubble",
    "zbv": "ScheduleZBVZeroBubble",
}
"""Schedules whose action lists are torch's own (multi-stage), by their Plan name."""

SENDS_KEPT_TO_STEP_END: dict[str, frozenset[str]] = {
    **{name: frozenset() for name in TORCH_MULTI_STAGE},
    "gpipe": frozenset({"grad"}),
    "1f1b": frozenset(),
}
"""Per schedule, the sends (``"grad"``: the input gradients sent back) whose tensors live until the step ends:
``ScheduleGPipe`` waits its backward sends only then; ``Schedule1F1B`` waits each send before the next. A sent
activation is freed by the runtime's stage once its micro-batch's backward is complete
(``_torch_compat.pipeline_stage_with_transient_receive_buffers``), as the stage's kept output is priced. Under
the multi-stage schedules (:data:`GRADIENTS_FREED_ON_RECEIPT`) a sent gradient lives until its rank holds proof
that it arrived."""

GRADIENTS_FREED_ON_RECEIPT = frozenset(TORCH_MULTI_STAGE)
"""Schedules whose runtime frees a sent gradient once the schedule's order proves it received
(:func:`hf_colossal_auto.pipeline_receipts.gradient_send_releases`, :mod:`hf_colossal_auto.apply.pipeline_sends`):
torch's multi-stage runtime would keep each to the step's end."""

Action = tuple[str, int, int]
"""``(kind, stage, micro-batch)``: kind "F", "B" (full backward), "I" (input gradient), "W" (weight
gradient)."""


@dataclass(frozen=True)
class Send:
    """One point-to-point send the schedule makes: an activation forward or a gradient back."""

    src: int
    dst: int
    kind: str
    """"act" (a forward's output to the next stage) or "grad" (its gradient back to the previous one)."""
    stage: int
    """The stage that sends it."""
    micro_batch: int
    nbytes: int


@dataclass(frozen=True)
class StageCost:
    """One stage's cost per micro-batch."""

    forward_s: float
    backward_input_s: float
    """The input-gradient part of backward (a full backward is ``backward_input_s + backward_weight_s``)."""
    backward_weight_s: float
    activation_bytes: int = 0
    """What one micro-batch's forward keeps for its backward on this stage."""
    send_bytes: int = 0
    """The activation this stage sends the next one per micro-batch (its gradient comes back the same size)."""
    weight_grad_bytes: int | None = None
    """What is held from the input gradient to the weight gradient (None: all of ``activation_bytes``); more than
    it where a recomputed block's rerun, in the input pass, is held for the weight pass (``apply/shared_rerun``)."""
    grad_bytes: int = 0
    """The stage's parameter gradients: made by its first backward (full or weight-gradient), held to the end
    of the step."""
    backward_transient_bytes: int = 0
    """What a backward (full or input-gradient) allocates on top of what is held while it runs (e.g. the
    logits' gradients in the loss's backward)."""
    unsharded_at_s: float = 0.0
    """When, from the step's start, the stage's parameters are gathered: its first forward starts no earlier. The
    runtime issues every stage's data-parallel all-gathers as the step starts (``apply/pipeline_runner``), one
    after another on the rank's data-parallel link; a bound for the first forward, whose first block could start
    on its own unit's."""
    last_backward_extra_s: float = 0.0
    sync_transient_bytes: int = 0
    """What the stage's gradient synchronisation allocates on top of what is held as its last backward (full or
    weight-gradient) ends: FSDP2 reduce-scatters each unit's gradients from a copy of them (its largest unit's,
    with its shard)."""

    @property
    def backward_s(self) -> float:
        return self.backward_input_s + self.backward_weight_s


@dataclass(frozen=True)
class Link:
    """The link the pp axis crosses: point-to-point seconds are ``latency_s + bytes / bandwidth``."""

    bandwidth_bytes_per_s: float = float("inf")
    latency_s: float = 0.0

    def seconds(self, nbytes: int) -> float:
        return self.latency_s + nbytes / self.bandwidth_bytes_per_s


@dataclass
class ScheduleSimulation:
    """What a simulated step costs."""

    step_time_s: float
    busy_s: list[float]
    """Compute seconds per rank (extras and optimizer included)."""
    peak_activation_bytes: list[int]
    """Per rank: the most activation bytes its stages hold at once, with the gradients their backwards have
    made by then (:attr:`StageCost.grad_bytes`) and a backward's transient."""
    max_in_flight: list[int]
    """Per stage: the most micro-batches whose activations it holds at once."""
    timeline: list[tuple[int, Action, float, float]] = field(default_factory=list)
    """``(rank, action, start, end)`` of every action, in the order simulated."""
    sends: list[Send] = field(default_factory=list)
    """Every point-to-point send between two ranks, in the order simulated (none between stages of one rank)."""

    @property
    def bubble_fraction(self) -> float:
        """Idle share of the ranks' time over the step: ``1 - sum(busy) / (ranks x step time)``."""
        if self.step_time_s <= 0:
            return 0.0
        return 1.0 - sum(self.busy_s) / (len(self.busy_s) * self.step_time_s)


def point_to_point_traffic(sends: list[Send]) -> dict[tuple[int, int], tuple[int, int]]:
    """``(src, dst) -> (sends, bytes)`` summed over a step's sends: what a run's point-to-point records must
    show (the tests compare them with c10d's)."""
    traffic: dict[tuple[int, int], tuple[int, int]] = {}
    for send in sends:
        count, nbytes = traffic.get((send.src, send.dst), (0, 0))
        traffic[(send.src, send.dst)] = (count + 1, nbytes + send.nbytes)
    return traffic


def schedule_actions(
    schedule: str, pp_size: int, micro_batches: int, virtual_stages: int = 1
) -> list[list[Action]]:
    """Per pp rank, the compute actions ``schedule`` runs in order (idle slots dropped: a rank waits for its
    inputs instead)."""
    if schedule not in PIPELINE_SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {schedule!r}; one of {', '.join(PIPELINE_SCHEDULES)}")
    if schedule == "gpipe":
        return [[("F", r, m) for m in range(micro_batches)] + [("B", r, m) for m in range(micro_batches)]
                for r in range(pp_size)]  # fmt: skip
    if schedule == "1f1b":
        return [_one_f_one_b(r, pp_size, micro_batches) for r in range(pp_size)]
    from ..._torch_compat import pipeline_schedule_actions

    lists = pipeline_schedule_actions(TORCH_MULTI_STAGE[schedule], pp_size, micro_batches, virtual_stages)
    return [[a for a in rank if a is not None] for rank in lists]


def _one_f_one_b(rank: int, pp: int, m: int) -> list[Action]:
    """1F1B on ``rank``: ``p - 1 - rank`` warm-up forwards, then a forward and a backward in turn, then the
    remaining backwards (torch's ``Schedule1F1B`` order)."""
    warmup = min(m, pp - 1 - rank)
    actions: list[Action] = [("F", rank, i) for i in range(warmup)]
    for i in range(m - warmup):
        actions += [("F", rank, warmup + i), ("B", rank, i)]
    actions += [("B", rank, i) for i in range(m - warmup, m)]
    return actions


def simulate_schedule(
    schedule: str,
    stages: list[StageCost],
    micro_batches: int,
    pp_size: int,
    link: Link | None = None,
    optimizer_s: float = 0.0,
) -> ScheduleSimulation:
    """Simulate one training step of ``schedule`` with ``stages`` (in model order, ``pp_size x virtual``
    of them) and ``micro_batches`` micro-batches; see the module docstring for the model."""
    virtual = len(stages) // pp_size
    if virtual * pp_size != len(stages):
        raise ValueError(f"{len(stages)} stages do not spread over {pp_size} pp ranks evenly")
    actions = _cached_actions(schedule, pp_size, micro_batches, virtual)
    owner = stage_ranks(schedule, len(stages), pp_size)
    receipts = (
        _cached_receipts(schedule, pp_size, micro_batches, virtual)
        if schedule in GRADIENTS_FREED_ON_RECEIPT
        else None
    )
    simulator = _Simulator(
        stages, owner, link or Link(), micro_batches, SENDS_KEPT_TO_STEP_END[schedule], receipts
    )
    return simulator.run(actions, optimizer_s)


@functools.lru_cache(maxsize=256)
def _cached_actions(schedule: str, pp_size: int, micro_batches: int, virtual: int) -> list[list[Action]]:
    """:func:`schedule_actions`, computed once per configuration (torch's multi-stage lists are slow to build);
    callers must not modify the lists."""
    return schedule_actions(schedule, pp_size, micro_batches, virtual)


@functools.lru_cache(maxsize=256)
def _cached_receipts(schedule: str, pp_size: int, micro_batches: int, virtual: int) -> dict[Action, list]:
    """Per action, the gradient sends its rank frees as it starts (:func:`gradient_send_releases`), computed once
    per configuration; callers must not modify it."""
    actions = _cached_actions(schedule, pp_size, micro_batches, virtual)
    return gradient_send_releases(actions, stage_ranks(schedule, pp_size * virtual, pp_size))


def _last_backwards(actions: list[list[Action]]) -> list[list[bool]]:
    """Per rank, per action, whether it is its stage's last backward action (its whole backward, or its last
    weight gradient under a split): where the stage's gradients are complete and its data-parallel
    synchronisation starts."""
    last: dict[int, tuple[int, int]] = {}
    for r, rank in enumerate(actions):
        for i, (kind, s, _) in enumerate(rank):
            if kind in ("B", "W"):
                last[s] = (r, i)
    flags = [[False] * len(rank) for rank in actions]
    for r, i in last.values():
        flags[r][i] = True
    return flags


class _Simulator:
    """List scheduling of each rank's actions in order, earliest start first across ranks."""

    def __init__(
        self,
        stages: list[StageCost],
        owner: list[int],
        link: Link,
        micro_batches: int,
        kept_sends: frozenset[str] = frozenset(),
        receipts: dict[Action, list[tuple[int, int]]] | None = None,
    ):
        self.stages, self.owner, self.link, self.m = stages, owner, link, micro_batches
        self.kept_sends = kept_sends
        self.receipts = receipts  # None: sent gradients are not held until proven received
        self.done: dict[Action, float] = {}
        self.link_free: dict[tuple[int, int], float] = {}
        self.arrival: dict[tuple[str, int, int], float] = {}  # ("act"|"grad", stage, mb) -> arrival time
        self.sends: list[Send] = []
        self.durations = [
            {"F": c.forward_s, "B": c.backward_s, "I": c.backward_input_s, "W": c.backward_weight_s}
            for c in stages
        ]

    def _ready(self, action: Action) -> float | None:
        """When ``action``'s inputs are there (None: not yet produced)."""
        kind, s, m = action
        ready = 0.0
        if kind == "F":
            if s > 0:
                arrived = self.arrival.get(("act", s, m))
                if arrived is None:
                    return None
                ready = max(ready, arrived)
            if m == 0:
                ready = max(ready, self.stages[s].unsharded_at_s)
        elif kind in ("B", "I"):
            forward = self.done.get(("F", s, m))
            if forward is None:
                return None
            ready = max(ready, forward)
            if s < len(self.stages) - 1:
                arrived = self.arrival.get(("grad", s, m))
                if arrived is None:
                    return None
                ready = max(ready, arrived)
        elif kind == "W":
            inputs = self.done.get(("I", s, m))
            if inputs is None:
                return None
            ready = max(ready, inputs)
        return ready

    def _duration(self, action: Action) -> float:
        kind, s, _ = action
        return self.durations[s][kind]

    def _send(self, kind: str, s: int, m: int, produced: float) -> None:
        """The activation (forward) or gradient (backward) of ``(s, m)`` to the stage that reads it."""
        target = s + 1 if kind == "act" else s - 1
        if not 0 <= target < len(self.stages):
            return
        src, dst = self.owner[s], self.owner[target]
        if src == dst:
            self.arrival[(kind, target, m)] = produced
            return
        nbytes = self.stages[min(s, target)].send_bytes
        self.sends.append(Send(src, dst, kind, s, m, nbytes))
        start = max(produced, self.link_free.get((src, dst), 0.0))
        end = start + self.link.seconds(nbytes)
        self.link_free[(src, dst)] = end
        self.arrival[(kind, target, m)] = end

    def run(self, actions: list[list[Action]], optimizer_s: float) -> ScheduleSimulation:
        """Each step starts the action that can start earliest (ties: the lowest rank). A rank's readiness only
        changes when it runs an action or a send reaches one of its stages, so only those ranks are looked at
        again (a heap of ranks keyed by their next action's start; stale entries are skipped)."""
        ranks = len(actions)
        position = [0] * ranks
        free = [0.0] * ranks
        busy = [0.0] * ranks
        timeline: list[tuple[int, Action, float, float]] = []
        last = _last_backwards(actions)
        heap: list[tuple[float, int]] = []
        start_of: list[float | None] = [None] * ranks

        def refresh(r: int) -> None:
            if position[r] >= len(actions[r]):
                start_of[r] = None
                return
            ready = self._ready(actions[r][position[r]])
            start_of[r] = None if ready is None else max(ready, free[r])
            if start_of[r] is not None:
                heapq.heappush(heap, (start_of[r], r))

        for r in range(ranks):
            refresh(r)
        left = sum(len(a) for a in actions)
        while left:
            while heap and start_of[heap[0][1]] != heap[0][0]:
                heapq.heappop(heap)  # stale: the rank moved on or its start changed
            if not heap:
                stuck = {r: actions[r][position[r]] for r in range(ranks) if position[r] < len(actions[r])}
                raise ValueError(f"the schedule's actions wait on each other: next actions {stuck}")
            start, r = heapq.heappop(heap)
            start_of[r] = None
            action = actions[r][position[r]]
            kind, s, m = action
            end = start + self._duration(action)
            # after the stage's last backward (its gradient already sent on): e.g. the gradient sync
            extra = self.stages[s].last_backward_extra_s if last[r][position[r]] else 0.0
            self.done[action] = end
            busy[r] += end - start + extra
            free[r] = end + extra
            position[r] += 1
            left -= 1
            timeline.append((r, action, start, end))
            reader = r  # the rank whose stage reads what this action sends
            if kind == "F":
                self._send("act", s, m, end)
                if s + 1 < len(self.stages):
                    reader = self.owner[s + 1]
            elif kind in ("B", "I"):
                self._send("grad", s, m, end)
                if s > 0:
                    reader = self.owner[s - 1]
            refresh(r)  # after the send: the reader may be this rank (ZB-V's turn of the V)
            if reader != r:
                refresh(reader)
        for r in range(ranks):
            free[r] += optimizer_s
            busy[r] += optimizer_s
        peaks, in_flight = self._memory(actions)
        return ScheduleSimulation(max(free), busy, peaks, in_flight, timeline, self.sends)

    def _memory(self, actions: list[list[Action]]) -> tuple[list[int], list[int]]:
        """Per rank the peak activation bytes along its list, per stage the most micro-batches in flight."""
        peaks: list[int] = []
        most = [0] * len(self.stages)
        last = _last_backwards(actions)
        for rank, rank_last in zip(actions, last, strict=True):
            held, peak, grads = 0, 0, 0
            count = [0] * len(self.stages)
            has_grads: set[int] = set()
            sent_back: dict[tuple[int, int], int] = {}  # gradients sent, not yet proven received
            for (kind, s, m), is_last in zip(rank, rank_last, strict=True):
                cost = self.stages[s]
                for key in (self.receipts or {}).get((kind, s, m), ()):
                    held -= sent_back.pop(key)
                kept = cost.activation_bytes if cost.weight_grad_bytes is None else cost.weight_grad_bytes
                if kind in ("B", "I"):  # as it starts: the incoming gradients' transient on what is held
                    peak = max(peak, held + grads + cost.backward_transient_bytes)
                if kind in ("B", "W") and s not in has_grads:  # the stage's gradients come to exist
                    has_grads.add(s)
                    grads += cost.grad_bytes
                # an action's end, before it frees anything (a bound within it)
                peak = max(peak, held + grads)
                if is_last:  # the stage's gradient synchronisation
                    peak = max(peak, held + grads + cost.sync_transient_bytes)
                if kind == "F":
                    held += cost.activation_bytes
                    count[s] += 1
                    most[s] = max(most[s], count[s])
                elif kind == "B":  # what it sent on or back stays with the send's work to the step's end
                    held -= cost.activation_bytes - self._kept_sent_bytes(s)
                    count[s] -= 1
                elif kind == "I":
                    held -= cost.activation_bytes - kept - self._kept_sent_bytes(s)
                    count[s] -= 1
                elif kind == "W":
                    held -= kept
                if kind in ("B", "I") and self._holds_sent_gradient(s):
                    sent_back[(s, m)] = self.stages[s - 1].send_bytes
                    held += sent_back[(s, m)]
                peak = max(peak, held + grads)
            peaks.append(peak)
        return peaks, most

    def _holds_sent_gradient(self, s: int) -> bool:
        """Whether a backward of stage ``s`` leaves its input gradient, sent to another rank, alive until proven
        received."""
        return self.receipts is not None and s > 0 and self.owner[s - 1] != self.owner[s]

    def _kept_sent_bytes(self, s: int) -> int:
        """What a backward of stage ``s`` leaves alive to the step's end under this schedule: the input gradient
        it sends back to another rank, where the schedule keeps its send's work (``"grad"``). No schedule keeps
        a sent activation (the runtime's stage frees it with its micro-batch's backward: the kept output)."""
        if "grad" in self.kept_sends and s > 0 and self.owner[s - 1] != self.owner[s]:
            return self.stages[s - 1].send_bytes
        return 0
