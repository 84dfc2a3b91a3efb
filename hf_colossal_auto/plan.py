"""The Plan: the contract between planning and the parallel runtime.

A plan is plain JSON in stable names — parameter FQNs and module paths of the HF model — so that it can be
made on a laptop for hardware you don't have, checked into a repository, broadcast from one rank to all, and
applied to a freshly built model. It carries its own predictions (seconds and bytes) so that the runtime and
the tests can hold it to them.

Placements are strings per mesh axis, in the order of ``mesh_axis_names``: ``"R"`` (replicate), ``"S<d>"``
(shard tensor dim ``d``), ``"P"`` (partial sum, activations only).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .recompute_options import RERUN
from .units import format_bytes, format_seconds

PLAN_FORMAT_VERSION = 1

PIPELINE_SCHEDULES: dict[str, tuple[int, int | None]] = {
    "gpipe": (1, 1),
    "1f1b": (1, 1),
    "interleaved-1f1b": (2, None),
    "interleaved-zero-bubble": (2, None),
    "zbv": (2, 2),
}
"""Pipeline schedule name -> (fewest, most) stages per pp rank it runs (None: no upper bound). Each is run by
``torch.distributed.pipelining``'s schedule of the same name (``ScheduleGPipe``, ``Schedule1F1B``,
``ScheduleInterleaved1F1B``, ``ScheduleInterleavedZeroBubble``, ``ScheduleZBVZeroBubble``)."""

SPLIT_BACKWARD_SCHEDULES = frozenset({"interleaved-zero-bubble", "zbv"})
"""Schedules whose runtime splits each backward into an input-gradient and a weight-gradient pass (separate
``torch.autograd.grad`` calls over one retained graph). A checkpointed block reruns its forward in each pass
(non-reentrant checkpoint recomputes once per backward pass): twice a micro-batch, priced so. The runtime makes
the weight pass one call (torch's makes one per parameter group) and lets a selective policy's kept outputs
serve both reruns (torch's serve one)."""

PIPELINE_FIELDS = ("pp_size", "stages", "schedule", "virtual_stages")
"""The Plan's pipeline fields: written to JSON only for a plan with pipeline stages (``pp_size > 1``), so that
a plan without them reads and writes exactly as before they existed."""


class PipelinePlanError(ValueError):
    """A plan's pipeline fields cannot be run: they contradict each other, the mesh or the schedule."""


MESH_AXIS_ORDER = ("pp", "dp", "cp", "tp")
"""The order of the mesh axes a plan may have (row-major: the last varies fastest); absent axes are left out
(``("dp", "tp")``, ``("pp", "dp", "tp")``, ``("dp", "cp", "tp")``...)."""


class ContextParallelPlanError(ValueError):
    """A plan's context-parallel degree contradicts its mesh."""


@dataclass
class BlockCost:
    """Predicted cost of one depth unit (an embedding, a transformer block, the head) per training step."""

    name: str
    compute_s: float
    communication_s: float
    memory_bytes: int
    """Activation bytes this unit keeps for backward, per device."""
    placements: dict[str, str] = field(default_factory=dict)
    """Parameter FQN (inside the unit) -> tensor-parallel placement, for the summary."""
    recompute: str = "none"
    """The unit's activation-recompute option ("none", "full", "selective:<op classes>")."""
    recompute_s: float = 0.0
    """Seconds its recomputed forward costs in backward (not in ``compute_s``)."""


@dataclass
class Plan:
    """How to run one training step of one model on one mesh, with what it is predicted to cost."""

    model_class: str
    num_devices: int
    device: str
    mesh_shape: tuple[int, ...]
    mesh_axis_names: tuple[str, ...]
    dp_mode: str
    """"ddp" (parameters replicated over the data-parallel axis, gradients all-reduced), "fsdp" (parameters,
    gradients and optimizer state sharded over it) or "hsdp" (sharded over groups of ``dp_shard_size`` ranks
    inside a node, the groups replicas of each other: gradient shards all-reduced across nodes)."""
    param_placements: dict[str, list[str]]
    """Parameter FQN -> placement per mesh axis."""
    activation_placements: dict[str, list[str]]
    """Module FQN -> placement of its forward output per mesh axis, enforced at the module boundary."""
    global_batch_size: int
    input_shapes: dict[str, list[int]]
    step_time_s: float
    compute_time_s: float
    communication_time_s: float
    peak_memory_bytes: int
    memory_budget_bytes: int
    param_memory_bytes: int
    """Parameters + gradients + optimizer state per device."""
    activation_memory_bytes: int
    blocks: list[BlockCost] = field(default_factory=list)
    collectives: dict[str, float] = field(default_factory=dict)
    """Predicted collectives per step, by kind (e.g. {"all_reduce": 98}), for the fidelity check."""
    recompute: dict[str, str] = field(default_factory=dict)
    """Block FQN -> activation-recompute option: "none", "full" (checkpoint the block) or
    "selective:<op classes>" (recompute those classes, keep the other ops' outputs; see
    :mod:`hf_colossal_auto.capture.op_classes`), optionally ";rerun=<module>,<module>" (recompute the ops of
    those modules of the block too: :mod:`hf_colossal_auto.recompute_options`). Blocks not listed are not
    recomputed."""
    solver: dict[str, Any] = field(default_factory=dict)
    """status, gap, solve time, solver name, problem size."""
    alternatives: list[dict[str, Any]] = field(default_factory=list)
    """Other meshes/modes tried: mesh, dp_mode, step_time_s, peak_memory_bytes, fits."""
    param_use_placements: dict[str, list[str]] = field(default_factory=dict)
    """``<module FQN>.<attr>`` -> placement per mesh axis a parameter is redistributed to where that module
    uses it, when it differs from its storage placement (e.g. a sharded weight gathered for use)."""
    block_input_placements: dict[str, list[str]] = field(default_factory=dict)
    """Block FQN -> placement per mesh axis its first input (the hidden states) is redistributed to on entry, for
    the blocks of a folded run (:func:`hf_colossal_auto.solve.boundaries.block_input_placements`): the first
    block enters as the ones after it, which read their predecessor's output. Empty when no run is folded (and
    in plans written before it existed); left out of the JSON then."""
    hand_layout: str = ""
    """The named hand layout whose activation placements the plan keeps (``"megatron-sp"`` /
    ``"megatron-sp-local"``: Megatron-LM's sequence parallelism on every block,
    :func:`hf_colossal_auto.solve.planner.evaluate_plan`), so that pricing the plan again pins them again instead
    of leaving them to the solver. Empty for the planner's own plans and the other baselines (and in plans
    written before it existed); left out of the JSON then."""
    local_modules: list[str] = field(default_factory=list)
    """Module FQNs (attention and MLP submodules of blocks) the runtime runs on local tensor shards rather than on
    DTensors: column-parallel projections in, row-parallel out, every op between on this rank's shard with no
    redistribution (Megatron-LM's tensor parallelism, as torch's ``ColwiseParallel``/``RowwiseParallel`` run it),
    so those ops pay an eager op's host cost instead of DTensor's dispatch. The planner writes it and prices
    their ops so; the runtime checks each listed module's placements are that layout. Empty when none (and in
    plans written before it existed); left out of the JSON then."""
    collective_bytes: dict[str, float] = field(default_factory=dict)
    """Predicted bytes per step by collective kind (the tensor each collective is given), for the fidelity
    check; same keys as ``collectives``."""
    recompute_time_s: float = 0.0
    """Seconds of forward rerun by activation recompute (in ``step_time_s``, not in ``compute_time_s``)."""
    memory_moments: list[list[Any]] = field(default_factory=list)
    """``[moment, bytes]`` per device at each moment of the step the planner constrains, in step order: the
    activation peak, the start and the highest point of each recomputed block's backward, the optimizer step."""
    overlapped_communication_s: float = 0.0
    """Data-parallel communication predicted to run hidden behind computation (not in ``step_time_s``;
    ``communication_time_s`` is what the step waits for)."""
    sync_wait_s: float = 0.0
    """Seconds a rank waits at synchronising collectives for the slowest of its peers (rank skew, in
    ``step_time_s``; :mod:`hf_colossal_auto.hardware.skew`): 0 on a device without measured skew."""
    moe_layers: dict[str, str] = field(default_factory=dict)
    """Mixture-of-experts layers: experts module FQN -> the plan's choice for its stacked expert weights
    (``"experts: replicated"``, ``"experts: TP×2"``...; see
    :mod:`hf_colossal_auto.strategies.moe`). Empty for dense models."""
    replicated_ops: list[str] = field(default_factory=list)
    """Ops of the step DTensor has no sharding rule for (e.g. a model's custom op): the planner warned and priced
    them replicated; the runtime runs them replicated (inputs gathered, the same result on every rank) unless
    a rule of ours covers them."""
    param_shapes: dict[str, list[int]] = field(default_factory=dict)
    """Parameter FQN -> the shape the plan was made for: a plan for another configuration of the same class
    (another vocabulary, another width) is refused by name instead of being applied to shapes it never saw.
    Empty in plans written before it existed (then only names and divisibility are checked)."""
    micro_batches: int = 1
    """Micro-batches each replica's batch (``global_batch_size / dp``) runs in per step, gradients accumulated
    and synchronised once after the last (:func:`hf_colossal_auto.accumulate`). Plans written before it
    existed load as 1 (the batch in one piece). Under a pipeline (``pp_size > 1``) the schedule's micro-batches:
    it runs them through the stages itself, at least one per stage, or under the interleaved schedules at least
    one per pp rank, in equal rounds of ``pp_size`` (torch's flexible interleaving, as Llama 3 runs it: more
    stages per rank than micro-batches per rank shrink the bubble further)."""
    dp_shard_size: int = 0
    """Ranks a parameter's data-parallel copy is sharded over: 1 under DDP, dp under FSDP, the shard group
    under HSDP (its replicate groups have ``dp // dp_shard_size`` ranks). Under "fsdp" and "ddp" it is always
    the mode's own (dp, 1), so plans written before it existed load as before."""
    moe_load: str = ""
    """Mixture-of-experts models: the routing assumption the plan is priced under, ``"uniform"`` (each expert
    gets the same rows; the default) or ``"measured"`` (``moe_routing``). Empty for dense models and in plans
    written before it existed."""
    moe_routing: dict[str, list[int]] = field(default_factory=dict)
    """Under a measured load: experts module FQN -> rows routed to each expert (the histogram the plan was
    priced with, :class:`hf_colossal_auto.capture.moe.RoutingLoad`). Empty under uniform routing."""
    expert_data_parallel: list[str] = field(default_factory=list)
    """Mixture-of-experts layers whose experts are sharded over the *data-parallel* axis (expert parallelism
    over ranks that hold different tokens, under DDP or FSDP — FSDP then leaves the experts out): experts
    module FQNs. Each data-parallel rank stores
    ``E/dp`` whole experts (their ``param_placements`` are ``["S0", ...]``); each (token, expert) pair's row
    goes to its expert's rank and comes back by all-to-all (:mod:`hf_colossal_auto.apply.moe`). Empty
    otherwise, and in plans written before it existed."""
    pp_size: int = 1
    """Pipeline stages' ranks: the leading mesh axis ``"pp"`` (mesh ``("pp", "dp", "tp")``). Each pp rank holds
    ``virtual_stages`` of the :attr:`stages` and runs them under :attr:`schedule`, ``micro_batches`` micro-batches
    a step. 1 (no pipeline) in plans written before it existed."""
    stages: list[list[str]] = field(default_factory=list)
    """Per pipeline stage, in model order, the FQNs of the modules it holds: whole blocks of the model's block
    list (uneven counts allowed), the embeddings in the first stage, the final norm and the head in the last.
    Stage ``s`` runs on pp rank :meth:`stage_ranks` ``[s]``. Empty without a pipeline."""
    schedule: str = ""
    """The pipeline schedule, a key of :data:`PIPELINE_SCHEDULES`; empty without a pipeline."""
    virtual_stages: int = 1
    """Stages per pp rank: 1 for "gpipe" and "1f1b", at least 2 for the interleaved schedules, 2 for "zbv"."""
    sequence_sharded_sends: bool = False
    """Under a pipeline with tensor parallelism: a stage sends each tensor-parallel rank's sequence shard of the
    hidden states (``[batch, seq / tp, hidden]``) and the next stage takes it as that rank's shard, instead of
    the whole tensor on every rank (Megatron-LM's pipeline under sequence parallelism). The planner sets it
    where every block returns its hidden states sequence-sharded over tp
    (:func:`~hf_colossal_auto.pipeline_layout.sends_sequence_shards`), so a shard is what each rank already holds
    at any cut; it prices the sends, the receive buffers and the kept outputs at a tp-th. False in plans without
    it (and written before it existed; left out of the JSON then): the whole tensor is sent."""
    cp_size: int = 1
    """Context-parallel ranks: the mesh axis ``"cp"`` (mesh ``("dp", "cp", "tp")``, after ``"pp"`` when there is
    one). The ``cp`` ranks of a data-parallel replica hold the same rows and each computes a balanced part of
    their sequence (a head chunk and a tail chunk; :mod:`hf_colossal_auto.apply.context_parallel`): every
    token-wise activation is split on the sequence dim over the axis (implicitly: placements name only the
    plan's dp and tp axes' choices, and read ``"R"`` on the cp axis), attention all-gathers keys and values
    over it, parameters are replicated over it and their gradients summed over it (and averaged over dp). 1 (no
    context parallelism) in plans written before it existed, and then left out of the JSON."""
    format_version: int = PLAN_FORMAT_VERSION

    def __post_init__(self) -> None:
        """Fills in ``dp_shard_size`` for plans written before it existed and refuses one HSDP cannot run, or
        pipeline fields that cannot run together."""
        self._check_pipeline()
        self._check_context_parallel()
        dp = self.dp_size
        if self.dp_mode != "hsdp":  # the mode's own: a dp_mode set by hand agrees again once read (broadcast)
            self.dp_shard_size = dp if self.dp_mode == "fsdp" else 1
            return
        if not self.dp_shard_size:
            raise ValueError("Plan: dp_mode 'hsdp' needs dp_shard_size (the ranks of one shard group)")
        s = self.dp_shard_size
        if self.dp_mode == "hsdp" and not (isinstance(s, int) and 1 < s < dp and dp % s == 0):
            raise ValueError(
                f"Plan: an HSDP shard group of {s!r} ranks must divide the data-parallel axis of {dp} and lie "
                "strictly between 1 and it"
            )

    def _check_pipeline(self) -> None:
        """Refuse pipeline fields that cannot run: a pp degree that is not the mesh's leading ``"pp"`` axis or
        does not divide the devices, an unknown schedule, a stage count that is not ``pp_size x virtual_stages``
        or that the schedule cannot run, a module in two stages, fewer micro-batches than stages."""
        pp = self.pp_size
        if not isinstance(pp, int) or isinstance(pp, bool) or pp < 1:
            raise PipelinePlanError(f"Plan: pp_size must be a whole number >= 1, got {pp!r}")
        if pp == 1:
            if self.stages or self.schedule or self.virtual_stages != 1:
                raise PipelinePlanError(
                    "Plan: stages, schedule and virtual_stages describe a pipeline; a plan with pp_size 1 has "
                    f"none (got {len(self.stages)} stages, schedule {self.schedule!r}, virtual_stages "
                    f"{self.virtual_stages!r}). Set pp_size to the pipeline ranks, or drop them."
                )
            if "pp" in self.mesh_axis_names:
                raise PipelinePlanError("Plan: a mesh with a 'pp' axis needs pp_size > 1")
            if self.sequence_sharded_sends:
                raise PipelinePlanError(
                    "Plan: sequence_sharded_sends describes what pipeline stages send; a plan with pp_size 1 "
                    "has no stages. Drop it, or set pp_size to the pipeline ranks."
                )
            return
        _check_pipeline_mesh(self)
        _check_schedule(self.schedule, self.virtual_stages, pp)
        _check_stage_lists(self.stages, pp * self.virtual_stages, pp, self.virtual_stages)
        _check_pipeline_micro_batches(self.schedule, self.micro_batches, len(self.stages), pp)
        if self.sequence_sharded_sends and self.tp_size == 1:
            raise PipelinePlanError(
                "Plan: sequence_sharded_sends sends each tensor-parallel rank's sequence shard between stages; "
                f"the mesh {dict(zip(self.mesh_axis_names, self.mesh_shape, strict=False))} has no tensor "
                "parallelism. Drop it, or plan with a 'tp' axis."
            )

    def _check_context_parallel(self) -> None:
        """Refuse a cp degree that is not the mesh's ``"cp"`` axis, or axes out of :data:`MESH_AXIS_ORDER`."""
        cp = self.cp_size
        if not isinstance(cp, int) or isinstance(cp, bool) or cp < 1:
            raise ContextParallelPlanError(f"Plan: cp_size must be a whole number >= 1, got {cp!r}")
        names = tuple(self.mesh_axis_names)
        if cp == 1:
            if "cp" in names:
                raise ContextParallelPlanError(
                    "Plan: a mesh with a 'cp' axis needs cp_size > 1 (leave the axis out without context "
                    "parallelism)"
                )
            return
        if "cp" not in names or self.mesh_shape[names.index("cp")] != cp:
            raise ContextParallelPlanError(
                f"Plan: context parallelism over {cp} ranks needs a mesh axis 'cp' of size {cp} (mesh "
                f"{dict(zip(names, self.mesh_shape, strict=False))}); e.g. mesh_axis_names ('dp', 'cp', 'tp')"
            )
        order = [MESH_AXIS_ORDER.index(n) for n in names if n in MESH_AXIS_ORDER]
        if len(order) != len(names) or order != sorted(order):
            raise ContextParallelPlanError(
                f"Plan: mesh axes {names} are not in the order {MESH_AXIS_ORDER} (absent ones left out)"
            )

    # ------------------------------------------------------------------ serialisation
    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["mesh_shape"] = list(self.mesh_shape)
        data["mesh_axis_names"] = list(self.mesh_axis_names)
        if (
            self.pp_size == 1
        ):  # a plan without a pipeline writes exactly what it wrote before pipelines existed
            for name in PIPELINE_FIELDS:
                data.pop(name)
        if (
            not self.sequence_sharded_sends
        ):  # plans that send whole hidden states write what they wrote before
            data.pop("sequence_sharded_sends")
        if self.cp_size == 1:  # a plan without context parallelism writes what it wrote before cp existed
            data.pop("cp_size")
        if (
            not self.block_input_placements
        ):  # plans with no folded run write what they wrote before it existed
            data.pop("block_input_placements")
        if not self.hand_layout:  # the planner's own plans write what they wrote before it existed
            data.pop("hand_layout")
        if not self.local_modules:  # plans with no local region write what they wrote before it existed
            data.pop("local_modules")
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Plan:
        version = data.get("format_version", PLAN_FORMAT_VERSION)
        if version != PLAN_FORMAT_VERSION:
            raise ValueError(
                f"Plan format version {version} is not supported by this hf-colossal-auto (expects "
                f"{PLAN_FORMAT_VERSION}); re-plan with this version."
            )
        data = dict(data)
        data["mesh_shape"] = tuple(data["mesh_shape"])
        data["mesh_axis_names"] = tuple(data["mesh_axis_names"])
        data["blocks"] = [BlockCost(**b) for b in data.get("blocks", [])]
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"Plan JSON has unknown fields {unknown}; was it written by another tool?")
        k = data.get("micro_batches", 1)
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(f"Plan JSON: micro_batches must be a whole number >= 1, got {k!r}")
        return cls(**data)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json())

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        return cls.from_dict(json.loads(Path(path).read_text()))

    # ------------------------------------------------------------------ queries
    @property
    def tp_size(self) -> int:
        return self.mesh_shape[self.mesh_axis_names.index("tp")] if "tp" in self.mesh_axis_names else 1

    @property
    def dp_size(self) -> int:
        return self.mesh_shape[self.mesh_axis_names.index("dp")] if "dp" in self.mesh_axis_names else 1

    @property
    def batch_group_size(self) -> int:
        """Processes that compute on one data-parallel replica's rows within one pipeline stage: its
        tensor-parallel ranks times its context-parallel ranks, consecutive ranks in the row-major mesh."""
        return self.tp_size * self.cp_size

    @property
    def num_stages(self) -> int:
        """Pipeline stages in all (``pp_size x virtual_stages``); 1 without a pipeline."""
        return len(self.stages) if self.pp_size > 1 else 1

    def stage_ranks(self) -> list[int]:
        """The pp rank of each stage: round robin (stage ``s`` on rank ``s % pp``) for every schedule but
        "zbv", whose two stages per rank form a V (rank ``r`` holds stages ``r`` and ``2 pp - 1 - r``), as
        torch's schedules place them."""
        return stage_ranks(self.schedule, self.num_stages, self.pp_size)

    @property
    def shards_nothing(self) -> bool:
        """Whether every rank runs on whole tensors: no FSDP/HSDP over more than one rank (of dp x cp), no
        experts split over the data-parallel axis, and on a tensor-parallel axis of more than one rank every
        parameter (stored and used) and module output replicated, with no tensor-parallel collective predicted
        (a plan that splits only activations, to save their memory, has some). The runtime runs such a plan on
        ordinary tensors (:mod:`hf_colossal_auto.apply.data_parallel`) and the planner prices it without
        DTensor's per-op cost."""
        if self.dp_mode in ("fsdp", "hsdp") and self.dp_size * self.cp_size > 1:  # FSDP shards over dp x cp
            return False
        if self.expert_data_parallel:
            return False
        if self.tp_size == 1:
            return True
        axis = list(self.mesh_axis_names).index("tp")
        placed = [*self.param_placements.values(), *self.param_use_placements.values()]
        placed += list(self.activation_placements.values())
        if any(len(p) > axis and p[axis] != "R" for p in placed):
            return False
        return not any(count > 0 for kind, count in self.collectives.items() if not kind.startswith("dp_"))

    @property
    def runs_on_plain_tensors(self) -> bool:
        """Whether the runtime runs this plan's forward and backward on ordinary tensors, with no DTensor op: a
        plan that shards nothing (:attr:`shards_nothing`), or a layout whose ops never see a DTensor whatever
        it shards (:func:`layout_runs_on_plain_tensors`: FSDP/HSDP without tensor parallelism among them).
        The runtime (:func:`hf_colossal_auto.apply.apply_plan`, pipeline stages too) and the planner (which
        prices such a plan without DTensor's per-op host cost) both read it, so that they cannot disagree."""
        return self.shards_nothing or layout_runs_on_plain_tensors(
            self.tp_size, self.dp_mode, self.cp_size, bool(self.expert_data_parallel)
        )

    @property
    def dp_replicate_size(self) -> int:
        """Replicas of each parameter shard over the data-parallel axis (dp under DDP, 1 under FSDP)."""
        return self.dp_size // self.dp_shard_size

    @property
    def dp_label(self) -> str:
        """The data-parallel mode as the summary and the frontier name it: "hsdp 2x4" is 2 replicas of
        shard groups of 4; "ddp, experts over dp" has the MoE experts sharded over the replicas."""
        if self.dp_mode == "hsdp":
            return f"hsdp {self.dp_replicate_size}x{self.dp_shard_size}"
        if self.expert_data_parallel:  # the MoE experts sharded over the replicas
            return f"{self.dp_mode}, experts over dp"
        return self.dp_mode

    @property
    def sequence_parallel_blocks(self) -> list[str]:
        """The blocks (numbered children of a ``ModuleList``) that run sequence-parallel (Megatron-LM's sequence
        parallelism): the block's own output or a direct child's (its norms, attention and MLP outputs) is sharded on dim 1 over the tensor-parallel axis —
        the sequence dim of the ``[batch, seq, hidden]`` hidden states between tensor-parallel regions."""
        if "tp" not in self.mesh_axis_names or self.tp_size == 1:
            return []
        tp = self.mesh_axis_names.index("tp")
        seq = {m for m, p in self.activation_placements.items() if len(p) > tp and p[tp] == "S1"}
        parents = {m.rpartition(".")[0] for m in seq}
        return [
            b.name
            for b in self.blocks
            if b.name.rpartition(".")[2].isdigit() and (b.name in seq or b.name in parents)
        ]

    @property
    def fits(self) -> bool:
        return self.peak_memory_bytes <= self.memory_budget_bytes

    def summary(self, max_rows: int | None = 24) -> str:
        """Per-block table (placements, memory, time) and the predicted totals."""
        header = ("block", "tensor-parallel placements", "recompute", "act. mem", "compute", "comm")
        rows = []
        for b in self.blocks:
            shown = _compact_placements(b.placements)
            rows.append(
                (
                    b.name or "(model)",
                    shown,
                    _short_recompute(b.recompute),
                    format_bytes(b.memory_bytes),
                    format_seconds(b.compute_s),
                    format_seconds(b.communication_s),
                )
            )
        rows = _collapse_repeats(rows)
        if max_rows is not None and len(rows) > max_rows:
            keep = max_rows // 2
            rows = [
                *rows[:keep],
                (f"... {len(rows) - max_rows} more rows", "", "", "", "", ""),
                *rows[-keep:],
            ]
        widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
        aligns = ["<", "<", "<", *[">"] * (len(widths) - 3)]
        fmt = "  ".join(f"{{:{a}{w}}}" for a, w in zip(aligns, widths, strict=True))
        mesh = " x ".join(f"{n}={s}" for n, s in zip(self.mesh_axis_names, self.mesh_shape, strict=True))
        lines = [
            f"Plan for {self.model_class} on {self.num_devices} x {self.device}: mesh {mesh}, data parallel: "
            f"{self.dp_label}{_micro_batch_note(self.global_batch_size, self.dp_size, self.micro_batches)}",
            fmt.format(*header),
            "  ".join("-" * w for w in widths),
            *(fmt.format(*r) for r in rows),
            "",
            f"predicted step time   {format_seconds(self.step_time_s)} (compute {format_seconds(self.compute_time_s)}, "
            + (f"recompute {format_seconds(self.recompute_time_s)}, " if self.recompute_time_s else "")
            + f"communication {format_seconds(self.communication_time_s)}"
            + (f", waiting for peers {format_seconds(self.sync_wait_s)}" if self.sync_wait_s else "")
            + (
                f"; {format_seconds(self.overlapped_communication_s)} more hidden behind compute)"
                if self.overlapped_communication_s > 0
                else ")"
            ),
            f"predicted peak memory {format_bytes(self.peak_memory_bytes)} per device of a "
            f"{format_bytes(self.memory_budget_bytes)} budget (parameters+grads+optimizer "
            f"{format_bytes(self.param_memory_bytes)}, activations {format_bytes(self.activation_memory_bytes)})",
        ]
        lines.extend(_pipeline_lines(self))
        if self.cp_size > 1:
            lines.append(
                f"context parallel      {self.cp_size} ranks per replica split each sequence (a head and a tail "
                "chunk each); attention all-gathers keys and values over them"
            )
            lines.extend(_context_parallel_output_lines(self.solver.get("context_parallel")))
        lines.extend(_sequence_parallel_lines(self.sequence_parallel_blocks))
        lines.extend(_moe_lines(self.moe_layers))
        if self.moe_load:
            lines.append(
                f"MoE load              {_moe_load_line(self.moe_load, self.moe_routing, self.tp_size)}"
            )
        if self.solver:
            lines.append(
                "solver                "
                + ", ".join(
                    f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in self.solver.items()
                )
            )
        return "\n".join(lines)


def _context_parallel_output_lines(record: Any) -> list[str]:
    """What a planner-made cp plan prices of the outputs: a step that reads only the loss (the runtime gathers
    logits and hidden states over cp when read), and what reading the logits would add."""
    if not isinstance(record, dict) or record.get("outputs") != "loss only":
        return []
    line = "                      priced for a training step that reads only the loss: outputs are gathered over cp"
    if record.get("logits_read_bytes"):
        return [
            line,
            f"                      when read (reading the logits adds {format_bytes(record['logits_read_bytes'])}"
            f" all-gathered per step, {format_seconds(record.get('logits_read_s', 0.0))}, and their memory)",
        ]
    return [line + " when read"]


def layout_runs_on_plain_tensors(tp_size: int, dp_mode: str, cp_size: int, experts_over_dp: bool) -> bool:
    """Whether a layout's ops run on ordinary tensors, whatever its placements: no tensor-parallel axis (tp 1),
    no experts split over the data-parallel axis (the runtime's expert regions are DTensor code), and FSDP or
    HSDP only without context parallelism (FSDP over ``dp x cp`` keeps the DTensor runtime for now).

    Why FSDP/HSDP count: FSDP2 stores each parameter as a DTensor shard on the data-parallel mesh, but its
    hooks all-gather the *unsharded* parameters as ordinary tensors for forward and backward, so on the plain
    module every op runs eagerly, as under torchtitan and accelerate's FSDP2 — on DTensors each would cost
    DTensor's dispatch on the host (``DeviceSpec.dtensor_overhead_s``, several times an eager op's) for nothing.
    The planner decides its pricing by this before a plan exists (its ILP cannot see "anything sharded" on a
    tensor-parallel axis: :attr:`Plan.runs_on_plain_tensors` adds that case for a finished plan)."""
    if tp_size != 1 or experts_over_dp:
        return False
    return dp_mode not in ("fsdp", "hsdp") or cp_size == 1


def unpriced_plan(**fields: Any) -> Plan:
    """A hand-made plan: the fields the runtime reads (``fields``), no predictions (times and bytes 0, no
    activation placements), device "hand-made". What ``hand_pipeline_plan`` and ``hand_context_parallel_plan``
    build, so that a test or a user can run a layout the planner did not price."""
    unpriced: dict[str, Any] = dict(
        device="hand-made",
        activation_placements={},
        step_time_s=0.0,
        compute_time_s=0.0,
        communication_time_s=0.0,
        peak_memory_bytes=0,
        memory_budget_bytes=0,
        param_memory_bytes=0,
        activation_memory_bytes=0,
    )
    return Plan(**{**unpriced, **fields})


def _short_recompute(option: str) -> str:
    """A recompute option as the summary's table shows it: ``pointwise+attention (rerun o_proj, down_proj)``."""
    classes, _, rerun = option.removeprefix("selective:").partition(RERUN)
    if not rerun:
        return classes
    return f"{classes} (rerun {', '.join(path.rsplit('.', 1)[-1] for path in rerun.split(','))})"


def stage_ranks(schedule: str, num_stages: int, pp_size: int) -> list[int]:
    """The pp rank of each of ``num_stages`` stages under ``schedule`` (see :meth:`Plan.stage_ranks`)."""
    if schedule != "zbv":
        return [s % pp_size for s in range(num_stages)]
    return [s if s < pp_size else 2 * pp_size - 1 - s for s in range(num_stages)]


def _check_pipeline_mesh(plan: Plan) -> None:
    """The pp axis leads the mesh, has ``pp_size`` ranks, and the mesh covers the plan's devices."""
    pp = plan.pp_size
    names, shape = tuple(plan.mesh_axis_names), tuple(plan.mesh_shape)
    if plan.num_devices % pp:
        raise PipelinePlanError(
            f"Plan: pp_size {pp} does not divide the {plan.num_devices} devices; choose a pp degree that divides "
            "them"
        )
    if not names or names[0] != "pp" or shape[0] != pp:
        raise PipelinePlanError(
            f"Plan: a pipeline of {pp} ranks needs the mesh's leading axis 'pp' of size {pp} (mesh "
            f"{dict(zip(names, shape, strict=False))}); e.g. mesh_axis_names ('pp', 'dp', 'tp')"
        )
    product = 1
    for size in shape:
        product *= size
    if product != plan.num_devices:
        raise PipelinePlanError(
            f"Plan: the mesh {shape} holds {product} devices, the plan is for {plan.num_devices}"
        )


def _check_schedule(schedule: str, virtual: int, pp: int) -> None:
    """A known schedule with as many stages per rank as it runs."""
    if schedule not in PIPELINE_SCHEDULES:
        raise PipelinePlanError(
            f"Plan: unknown pipeline schedule {schedule!r}; the runtime runs {', '.join(PIPELINE_SCHEDULES)}"
        )
    least, most = PIPELINE_SCHEDULES[schedule]
    if (
        not isinstance(virtual, int)
        or isinstance(virtual, bool)
        or virtual < least
        or (most and virtual > most)
    ):
        wanted = f"exactly {least}" if least == most else f"at least {least}"
        raise PipelinePlanError(
            f"Plan: schedule {schedule!r} runs {wanted} stage(s) per pp rank, the plan has virtual_stages "
            f"{virtual!r}"
            + ("; use 'interleaved-1f1b', 'interleaved-zero-bubble' or 'zbv' for more" if most == 1 else "")
        )


def _check_stage_lists(stages: list[list[str]], expected: int, pp: int, virtual: int) -> None:
    """``expected`` non-empty stages of module FQNs, no module in two of them."""
    if len(stages) != expected:
        raise PipelinePlanError(
            f"Plan: {pp} pp ranks x {virtual} stage(s) per rank make {expected} stages, the plan lists "
            f"{len(stages)}"
        )
    owner: dict[str, int] = {}
    for index, modules in enumerate(stages):
        if not isinstance(modules, list) or not modules or not all(isinstance(m, str) for m in modules):
            raise PipelinePlanError(
                f"Plan: stage {index} must list the FQNs of the modules it holds (a non-empty list of strings), "
                f"got {modules!r}"
            )
        for fqn in modules:
            if fqn in owner:
                raise PipelinePlanError(f"Plan: module {fqn!r} is in stages {owner[fqn]} and {index}")
            owner[fqn] = index


def _check_pipeline_micro_batches(schedule: str, micro_batches: int, num_stages: int, pp: int) -> None:
    """A micro-batch count the schedule runs: at least one per stage, except under the interleaved schedules,
    which take any count of at least one per pp rank that torch splits into equal rounds of ``pp``
    (``ScheduleInterleaved1F1B`` / ``ScheduleInterleavedZeroBubble``: ``micro_batches // pp`` rounds). There a
    rank's stages take turns within a round, so 32 micro-batches run through 64 stages on 16 ranks (4 a rank)."""
    interleaved = schedule.startswith("interleaved")
    least = pp if interleaved else num_stages
    if micro_batches < least:
        needed = (
            f"at least one micro-batch per pp rank (micro_batches >= {pp})"
            if interleaved
            else f"at least one micro-batch per stage (micro_batches >= {num_stages})"
        )
        raise PipelinePlanError(
            f"Plan: the pipeline has {num_stages} stages on {pp} ranks and {micro_batches} micro-batches; "
            f"schedule {schedule!r} needs {needed}"
        )
    if interleaved:
        rounds = max(1, micro_batches // pp)
        if micro_batches % rounds:
            raise PipelinePlanError(
                f"Plan: schedule {schedule!r} runs micro-batches in rounds of {pp} (one per pp rank): "
                f"{micro_batches} micro-batches do not split into {rounds} equal rounds; use a multiple of {pp}"
            )


def _pipeline_lines(plan: Plan) -> list[str]:
    """The summary's pipeline lines: stages, what each holds, the schedule and its micro-batches, whether the
    stages send sequence shards; where the planner priced it, the predicted bubble and each stage's seconds per
    micro-batch and peak memory."""
    if plan.pp_size == 1:
        return []
    held = ", ".join(f"{len(modules)}" for modules in plan.stages)
    lines = [
        f"pipeline              {plan.num_stages} stages on {plan.pp_size} ranks ({plan.virtual_stages} per "
        f"rank), schedule {plan.schedule}, {plan.micro_batches} micro-batches; modules per stage: {held}"
    ]
    if plan.sequence_sharded_sends:
        lines.append(
            f"stage sends           each tensor-parallel rank's sequence shard (1/{plan.tp_size} of the hidden "
            "states)"
        )
    seconds = plan.solver.get("stage_s_per_micro_batch")
    peaks = plan.solver.get("stage_peak_memory_bytes")
    if "bubble_fraction" in plan.solver:
        lines.append(
            f"pipeline bubble       {plan.solver['bubble_fraction'] * 100:.1f} % of the ranks' time (predicted)"
        )
    if seconds and peaks:
        lines.append(
            "per stage             ms per micro-batch: "
            + ", ".join(f"{s * 1e3:.3g}" for s in seconds)
            + "; peak memory: "
            + ", ".join(format_bytes(b) for b in peaks)
        )
    return lines


def _moe_lines(moe_layers: dict[str, str]) -> list[str]:
    """One summary line per distinct MoE choice, naming the layers that take it (``model.layers.{0,1}``)."""
    by_choice: dict[str, list[str]] = {}
    for fqn, choice in moe_layers.items():
        by_choice.setdefault(choice, []).append(fqn)
    lines = []
    for choice, fqns in by_choice.items():
        where = _brace_indices(fqns)
        lines.append(f"MoE layers            {choice} in {len(fqns)} layer{'s' * (len(fqns) > 1)} ({where})")
    return lines


def _moe_load_line(load: str, routing: dict[str, list[int]], tp: int) -> str:
    """The routing assumption in words: uniform, or the measured histogram's busiest expert-parallel rank."""
    if load != "measured" or not routing:
        return "uniform over experts (assumed)"
    from .capture.moe import RoutingLoad  # torch: only for a plan that has a measured histogram

    return RoutingLoad(routing).describe(tp)


def _brace_indices(fqns: list[str]) -> str:
    """``model.layers.{0,1,5}.mlp.experts`` for FQNs that differ only in one block index, else the first."""
    parts = [f.split(".") for f in fqns]
    if len(fqns) == 1 or len({len(p) for p in parts}) != 1:
        return fqns[0] + (", ..." if len(fqns) > 1 else "")
    differing = [i for i in range(len(parts[0])) if len({p[i] for p in parts}) > 1]
    if len(differing) != 1:
        return fqns[0] + ", ..."
    i = differing[0]
    return ".".join([*parts[0][:i], "{" + ",".join(p[i] for p in parts) + "}", *parts[0][i + 1 :]])


def _micro_batch_note(global_batch: int, dp: int, k: int) -> str:
    """``, 4 micro-batches of 2`` for the summary's header (nothing when the batch runs in one piece)."""
    if k <= 1:
        return ""
    return f", {k} micro-batches of {global_batch // max(dp, 1) // k} per replica (gradients synced once)"


def _sequence_parallel_lines(blocks: list[str]) -> list[str]:
    """One summary line naming the blocks that run sequence-parallel (runs of numbered blocks collapsed)."""
    if not blocks:
        return []
    names = ", ".join(row[0] for row in _collapse_repeats([(b,) for b in blocks]))
    return [f"sequence parallel     {names} (hidden states sharded on the sequence dim between TP regions)"]


def _compact_placements(placements: dict[str, str]) -> str:
    """``attn.c_attn.weight:S1 ...`` with the block prefix stripped, only sharded ones, for the table."""
    if not placements:
        return "-"
    prefix = _common_prefix(list(placements))
    parts = [f"{k[len(prefix) :].removesuffix('.weight')}:{v}" for k, v in placements.items() if v != "R"]
    return " ".join(parts) if parts else "replicated"


def _common_prefix(names: list[str]) -> str:
    if len(names) == 1:
        return names[0].rsplit(".", 2)[0] + "." if names[0].count(".") >= 2 else ""
    first = names[0].split(".")
    n = 0
    while all(len(x.split(".")) > n + 1 and x.split(".")[n] == first[n] for x in names):
        n += 1
    return ".".join(first[:n]) + "." if n else ""


def _collapse_repeats(rows: list[tuple[str, ...]]) -> list[tuple[str, ...]]:
    """Merge consecutive rows that differ only in a block index ("h.3 .. h.46 (x44)")."""
    out: list[tuple[str, ...]] = []
    i = 0
    while i < len(rows):
        j = i
        stem = rows[i][0].rsplit(".", 1)[0]
        while (
            j + 1 < len(rows)
            and rows[j + 1][0].rsplit(".", 1)[0] == stem
            and rows[j + 1][0].rsplit(".", 1)[-1].isdigit()
            and rows[j + 1][1:] == rows[i][1:]
        ):
            j += 1
        if j > i:
            out.append((f"{rows[i][0]} .. {rows[j][0].rsplit('.', 1)[-1]} (x{j - i + 1})", *rows[i][1:]))
        else:
            out.append(rows[i])
        i = j + 1
    return out
