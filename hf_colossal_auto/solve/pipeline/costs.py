"""The costs a pipeline's pricing passes around: one depth unit's (:class:`UnitCost`), a stage's layout
(:class:`StageLayout`), a model's per role (:class:`ModelCosts`), the per-stage extras (embedding, head, kept
outputs, the loss's backward transient, receive buffers) a stage adds to its blocks, and the priced candidate
(:class:`PipelineCandidate`).
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from ..pricing.pipeline_schedule import ScheduleSimulation
from ..recompute import RERUN, UNREAD

STAGE_DP_MODES = ("ddp", "fsdp", "hsdp")
"""Data-parallel modes offered inside a stage."""

RECOMPUTE_OFFERED = ("none", "selective:pointwise", "selective:pointwise;rerun=*", "full")
"""Recompute options a block of a stage may take, least recompute first: torchtitan's selective policy (keeps
matmul and attention outputs, reruns the pointwise ops), then the same rerunning the block's modules whose kept
outputs no backward reads (a pin: each block's own modules, :func:`~..recompute.unread_modules`; priced under
the name it resolves to, not offered where there is none)."""


def _offered_rank(name: str) -> int:
    """Where option ``name`` comes in :data:`RECOMPUTE_OFFERED` (a resolved ``;rerun=`` twin where its pin
    does; a hand configuration's own option after all of them)."""
    if name in RECOMPUTE_OFFERED:
        return RECOMPUTE_OFFERED.index(name)
    base, rerun, _ = name.partition(RERUN)
    pin = f"{base}{rerun}{UNREAD}"
    return RECOMPUTE_OFFERED.index(pin) if rerun and pin in RECOMPUTE_OFFERED else len(RECOMPUTE_OFFERED)


@dataclass
class UnitCost:
    """One depth unit's (a block, an embedding, the head) cost per micro-batch, or per step, or bytes per device."""

    forward_s: float = 0.0
    backward_s: float = 0.0
    """Backward of one micro-batch, recompute's reruns included."""
    optimizer_s: float = 0.0
    """Its share of the optimizer step (once per step)."""
    sync_s: float = 0.0
    """The data-parallel gradient synchronisation (once per step, after the stage's last backward)."""
    gather_s: float = 0.0
    """FSDP/HSDP: the all-gather of its parameters (once per step, before the stage's first forward)."""
    state_bytes: float = 0.0
    """Parameters, gradients, optimizer state and the optimizer's temporaries on one device (under FSDP also the
    parameters and gradients held gathered through the step): what the rank holds while it steps."""
    held_bytes: float = 0.0
    """Parameters and optimizer state on one device (under FSDP the shards plus the parameters gathered through
    the step): what the rank holds through the schedule (the optimizer state from the first step on), beside
    the activations and the gradients; under mixed precision also :attr:`cached_cast_bytes`."""
    cached_cast_bytes: float = 0.0
    """Of :attr:`held_bytes`, the low-precision copies of its weights a unit without recompute keeps for
    backward: ``torch.autocast`` caches a weight's cast until the step's forward (the whole schedule) returns,
    so every micro-batch's forward reads, and keeps, the one copy. A recomputed unit's forward and rerun cast
    anew per micro-batch (cache off), so its rerun rematerialises them: :meth:`kept_alone`."""
    grad_bytes: float = 0.0
    """Parameter gradients on one device (under FSDP the unsharded accumulated gradient): made by the stage's
    first backward in a step, held to its end."""
    activation_bytes: float = 0.0
    """What one micro-batch's forward keeps for backward."""
    deferred_grad_bytes: float = 0.0
    """One micro-batch's gradients of the outputs of the ops that read its parameters: what the input pass of a
    split backward keeps for the weight pass (torch's ``stage_backward_input`` hands them on)."""

    @property
    def kept_alone(self) -> float:
        """What one micro-batch's forward keeps for backward counting the weight casts it would keep alone (the
        measure of what recompute rematerialises against no recompute)."""
        return self.activation_bytes + self.cached_cast_bytes

    def add(self, other: UnitCost) -> None:
        self.forward_s += other.forward_s
        self.backward_s += other.backward_s
        self.optimizer_s += other.optimizer_s
        self.sync_s += other.sync_s
        self.gather_s += other.gather_s
        self.state_bytes += other.state_bytes
        self.held_bytes += other.held_bytes
        self.cached_cast_bytes += other.cached_cast_bytes
        self.grad_bytes += other.grad_bytes
        self.activation_bytes += other.activation_bytes
        self.deferred_grad_bytes += other.deferred_grad_bytes


@dataclass(frozen=True)
class StageLayout:
    """How the devices of one pipeline stage (``devices / pp``) run it: mesh ``(dp, tp)`` and the data-parallel
    mode; ``shard``: the ranks a parameter's state is sharded over on the dp axis (1 under DDP, dp under FSDP,
    the shard group under HSDP)."""

    tp: int
    dp: int
    dp_mode: str
    shard: int
    lean: bool = False
    """Its tensor-parallel activation placements chosen to keep activations small (:func:`_lean_budgets`: the
    ILP then shards the kept activations, sequence parallelism among them) rather than for speed alone."""

    @property
    def label(self) -> str:
        mode = f"hsdp {self.dp // self.shard}x{self.shard}" if self.dp_mode == "hsdp" else self.dp_mode
        return f"{self.dp}x{self.tp} {mode}" + (", lean activations" if self.lean else "")


@dataclass
class ModelCosts:
    """The model's costs at one stage layout and micro-batch size, by where they land in a pipeline."""

    blocks: list[UnitCost]
    """Per block of the layout's block list, in order, without recompute."""
    first: UnitCost
    """What runs before the blocks (the first stage's)."""
    last: UnitCost
    """What runs after the blocks (the last stage's): final norm, head, loss."""
    every: UnitCost
    """What every stage runs (rotary tables, the base model's own ops)."""
    send_bytes: int
    """The hidden states one micro-batch sends between stages."""
    unit_names: dict[str, UnitCost]
    """Unit name -> its cost, in model order (the plan's block table)."""
    options: dict[str, list[UnitCost]] = field(default_factory=dict)
    """Recompute option -> per block its cost under it (``"none"`` is :attr:`blocks`); only the options priced."""
    output_bytes: int = 0
    """The model's largest output per micro-batch (the logits): what the last stage returns and keeps."""
    tied: UnitCost = field(default_factory=UnitCost)
    """The head's parameters that are the embedding's (tied word embeddings) under the stage layout: where the
    first and the last stage's ranks differ, the last holds a copy (state, gradient, optimizer step and
    data-parallel figures, as the embedding's)."""
    tie_sync_s: float = 0.0
    """The tied parameters' gradient all-reduce between the first and the last stage's ranks (the runtime's tie
    group), on both, after the schedule, where those ranks differ."""
    backward_transient_bytes: float = 0.0
    """Per micro-batch: what the step allocates at its highest point beyond what forwards keep, the inputs and
    the buffers (the activation-peak row's transient: in a causal LM the loss's backward, the logits'
    gradients), on top of what the last stage holds while it runs a backward. Another stage's (a block's
    gradients in flight, far smaller) is not priced: an open gap, docs/reliability.md."""

    def block_options(self) -> list[str]:
        """The options priced, least recompute first (a hand configuration's own option last)."""
        return sorted(self.options, key=_offered_rank)  # stable: hand configurations' options as given


def _stage_extras(costs: ModelCosts, num_stages: int, index: int, owner: list[int] | None = None) -> UnitCost:
    """What stage ``index`` of ``num_stages`` runs besides its blocks. With the stages' ranks (``owner``): where
    the first and the last differ, the last holds a copy of the tied head parameters and both all-reduce their
    gradient (the runtime's tie group)."""
    extra = UnitCost()
    extra.add(costs.every)
    if index == 0:
        extra.add(costs.first)
    if index == num_stages - 1:
        extra.add(costs.last)
    if owner is not None and owner[0] != owner[-1]:
        if index == num_stages - 1:
            extra.add(costs.tied)
        if index in (0, num_stages - 1):
            extra.sync_s += costs.tie_sync_s
    return extra


def _kept_output_bytes(costs: ModelCosts, num_stages: int, index: int) -> int:
    """What stage ``index`` keeps of each held micro-batch beyond its activations: torch's stage keeps its
    output until the micro-batch's backward (the hidden states it sends on; the last stage's logits)."""
    return costs.output_bytes if index == num_stages - 1 else costs.send_bytes


def _backward_transient(costs: ModelCosts, num_stages: int, index: int) -> int:
    """What a backward of stage ``index`` allocates on top (the last stage's: the loss's backward)."""
    return int(costs.backward_transient_bytes) if index == num_stages - 1 else 0


def _received_activation_bytes(costs: ModelCosts, owner: list[int], index: int) -> int:
    """Per micro-batch in flight on stage ``index``: the activation it received from the previous stage's rank.
    The runtime allocates that receive buffer for the receive and drops it after the micro-batch's backward
    (``pipeline_stage_with_transient_receive_buffers``); 0 where the previous stage is on the same rank (the
    tensor is passed on, not received) or there is none."""
    return costs.send_bytes if index > 0 and owner[index - 1] != owner[index] else 0


def _received_gradient_bytes(costs: ModelCosts, owner: list[int], index: int) -> int:
    """What a backward of stage ``index`` holds on top for the ranks beside it: the gradient received from the
    next stage's rank (its buffer allocated for the receive, dropped after that backward) and the gradient of
    the activation received from the previous stage's rank (made by the backward, alive until sent back)."""
    received = index < len(owner) - 1 and owner[index + 1] != owner[index]
    return costs.send_bytes * (int(received) + int(_received_activation_bytes(costs, owner, index) > 0))


# -------------------------------------------------------------------------------------------- one candidate
@dataclass
class PipelineCandidate:
    """A priced pipeline: its configuration, the simulation and the memory of each pp rank."""

    pp: int
    stage: StageLayout
    schedule: str
    virtual: int
    micro_batches: int
    blocks_per_stage: list[int]
    recompute: list[str]
    """Per block (model order), its recompute option."""
    simulation: ScheduleSimulation
    rank_state_bytes: list[float]
    """Per rank: what it holds while the optimizer steps (:attr:`UnitCost.state_bytes`)."""
    rank_held_bytes: list[float]
    """Per rank: what it holds through the schedule beside the activations and gradients
    (:attr:`UnitCost.held_bytes`; the receive buffers go with the micro-batches in flight)."""
    rank_peak_bytes: list[float]
    stage_s: list[float]
    """Per stage: forward + backward seconds of one micro-batch (recompute included)."""
    stage_peak_bytes: list[float]
    """Per stage: the higher of its optimizer-step state and what it holds through the schedule (parameters,
    gradients, its activations and kept outputs times the most micro-batches it holds at once, transients)."""
    costs: ModelCosts
    rows: int = 0
    """Rows of one micro-batch of one replica."""

    @property
    def dp(self) -> int:
        return self.stage.dp

    @property
    def tp(self) -> int:
        return self.stage.tp

    @property
    def step_time_s(self) -> float:
        return self.simulation.step_time_s

    @property
    def peak_bytes(self) -> float:
        return max(self.rank_peak_bytes)

    def recompute_text(self) -> str:
        counts: dict[str, int] = defaultdict(int)
        for option in self.recompute:
            counts[option] += 1
        return ", ".join(f"{o} x{n}" for o, n in counts.items())

    def record(self, budget: int) -> dict[str, Any]:
        """What :attr:`Plan.solver` and the logs say of it."""
        return {
            "pp": self.pp,
            "dp": self.dp,
            "tp": self.tp,
            "dp_mode": self.stage.dp_mode,
            "dp_shard": self.stage.shard,
            "schedule": self.schedule,
            "virtual_stages": self.virtual,
            "micro_batches": self.micro_batches,
            "blocks_per_stage": list(self.blocks_per_stage),
            "recompute": self.recompute_text(),
            "step_time_s": self.step_time_s,
            "peak_memory_bytes": math.ceil(self.peak_bytes),
            "fits": self.peak_bytes <= budget,
        }


def _block_seconds(cost: UnitCost) -> float:
    return cost.forward_s + cost.backward_s
