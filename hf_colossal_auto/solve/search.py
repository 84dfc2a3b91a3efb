"""The search over meshes, data-parallel modes and micro-batch counts (:class:`_Search`): the fastest plan that
fits, with the floors and relaxations that prune candidates before their ILPs are built."""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass
from typing import Any

from torch import nn

from ..capture.graph import StepGraph, ValueKind
from ..capture.moe import experts_modules
from ..hardware import ClusterSpec
from ..plan import Plan
from .build.builder import BuiltProblem
from .candidates import CandidateInfeasibleError, _Planner
from .ilp import solve
from .pricing.comm import data_parallel_sync_time
from .problem import InfeasibleError
from .tied import TiedGraph

logger = logging.getLogger(__name__)


class _Search:
    """The search over meshes, data-parallel modes and micro-batch counts: the fastest plan that fits, what was
    tried, and the least memory any candidate needed (for the error when none fits)."""

    def __init__(self, planner: _Planner, cutoff_s: float = math.inf) -> None:
        self.planner = planner
        self.best: Plan | None = None
        self.cutoff_s = cutoff_s
        """A step time found elsewhere (the plan without cp, another cp degree's) that a candidate must beat to
        matter: candidates whose lower bound is no faster are pruned as if a plan that fast were in hand
        (:meth:`bar`). ``inf``: none, the search is the exhaustive one."""
        self.pruned_s = math.inf
        """The least lower bound of a candidate pruned by step time (:meth:`bar`): where the search found no plan,
        no plan it would have found is faster than this (``inf``: none was pruned so)."""
        self.tried: list[dict[str, Any]] = []
        self.min_required = math.inf
        self.one_piece: dict[tuple[tuple[int, int], str], tuple[Plan | None, float]] = {}
        """(mesh, dp mode) -> its plan with the batch in one piece (None: nothing fits) and the host seconds of
        its ops (:attr:`BuiltProblem.host_floor_s`; 0 when unknown)."""
        self._read_params: tuple[StepGraph, list[int]] | None = None
        """The trace :meth:`_sync_floor` last read and the bytes of every parameter (by name, a tied one per name)
        whose gradient it synchronises: trained, with a shape, read by an op."""
        self.deferred: list[tuple[tuple[int, int], str, int, int]] = []
        """(mesh, dp mode, micro-batches, model-state floor) of DDP/FSDP candidates :meth:`ruled_out` set aside."""
        self.over_budget: dict[tuple[tuple[int, int], str], BuiltProblem] = {}
        """(mesh, dp mode) -> the problem of its one-piece candidate, where no choice met the budget."""

    def try_candidate(self, mesh: tuple[int, int], dp_mode: SearchKey, micro_batches: int) -> Plan | None:
        """Solve one candidate, record it, keep it if it is the fastest that fits; its plan (None: infeasible).
        ``dp_mode`` is the search's key (:class:`SearchKey`)."""
        mode, shard = _split_mode(dp_mode)
        if self._accumulation_rules_out(mesh, dp_mode, micro_batches):
            return None
        try:
            built, solution = self.planner.solve_mesh(
                mesh, mode, micro_batches=micro_batches, dp_shard_size=shard, expert_dp=_is_expert_dp(dp_mode)
            )
        except InfeasibleError as exc:
            self.min_required = min(self.min_required, exc.min_required)
            self._record_infeasible(mesh, dp_mode, micro_batches, exc.min_required)
            plan, host_floor = None, 0.0
            if micro_batches == 1 and isinstance(exc, CandidateInfeasibleError):
                self.over_budget[(mesh, dp_mode)] = exc.built
        else:
            host_floor = built.host_floor_s
            plan = self.planner.to_plan(mesh, mode, built, solution)
            self.tried.append(
                {
                    "mesh": list(mesh),
                    "dp_mode": mode,
                    "dp_label": self.label(mesh, dp_mode),
                    "micro_batches": micro_batches,
                    "fits": plan.fits,
                    "step_time_s": plan.step_time_s,
                    "peak_memory_bytes": plan.peak_memory_bytes,
                }
            )
            if plan.fits and (self.best is None or plan.step_time_s < self.best.step_time_s - 1e-12):
                self.best = plan
        if micro_batches == 1:
            self.one_piece[(mesh, dp_mode)] = (plan, host_floor)
        return plan

    def bar(self) -> float:
        """The step time a candidate must beat: the best plan's so far, or :attr:`cutoff_s` if that is faster
        (``inf``: nothing to beat yet)."""
        best = self.best.step_time_s if self.best is not None else math.inf
        return min(best, self.cutoff_s)

    def _pruned(self, bound: float) -> None:
        """A candidate (or micro-batch count) left out because ``bound`` is no faster than :meth:`bar`."""
        self.pruned_s = min(self.pruned_s, bound)

    def label(self, mesh: tuple[int, int], dp_mode: SearchKey) -> str:
        """The mode as :attr:`Plan.dp_label` names it ("hsdp 2x4": 2 replicas of shard groups of 4)."""
        if _is_expert_dp(dp_mode):
            return f"{dp_mode.mode}, experts over dp"
        dp_mode, shard = _split_mode(dp_mode)
        if dp_mode == "hsdp" and shard is None:
            shard = self.planner.cluster.hybrid_shard_size(mesh)
        return f"hsdp {mesh[0] // shard}x{shard}" if shard else dp_mode

    def bounded_out(self, mesh: tuple[int, int], dp_mode: SearchKey, micro_batches: int) -> bool:
        """Whether a lower bound on its step time already rules ``(mesh, dp_mode)`` out, before its ILP is built in
        full (recorded as tried with that bound): the optimum of its relaxation — no memory budget, and no rules
        making ops follow DTensor's own choices, the costliest part of the ILP to build — is no faster than the
        best plan so far (or :attr:`cutoff_s`, :meth:`bar`). The bound holds at every micro-batch count (see
        :meth:`_unconstrained_time`), so no micro-batch search follows. To the floor and the relaxation is added
        what every plan of the candidate gets after its solve (:meth:`_Planner.fixed_added_s`: a cp rank's small
        all-reduces), once the floor alone has not ruled it out. Why: at
        cluster scale most meshes are far off (tensor parallelism across nodes), and their full ILPs asked
        DTensor about every op on meshes of up to thousands of ranks."""
        bar = self.bar()
        if bar == math.inf or _is_expert_dp(dp_mode):  # its floor would count the experts' all-reduce
            return False
        floor = self._sync_floor(mesh, dp_mode)
        added = self.planner.fixed_added_s(mesh, micro_batches) if bar > floor else 0.0
        bound = floor + added
        crosses = mesh[1] > self.planner.cluster.devices_per_node
        # The relaxation is built only where tensor parallelism crosses nodes: there DTensor's rules are costliest
        # and candidates far off; inside a node the full ILP costs little more than its relaxation, which then
        # rarely pays for itself (GPT2-XL on 8, Llama-7B on 64). Where every plan gets seconds after its solve (a
        # cp degree's logits all-gathers), the relaxation plus those often rules it out: built there too.
        if (crosses or added > 0) and bar > bound:
            mode, shard = _split_mode(dp_mode)
            relaxed = self.planner.build(
                mesh, mode, micro_batches=micro_batches, dp_shard_size=shard, dtensor_rules=False
            )
            bound = self._relaxed_optimum(relaxed) + added
        if bar > bound:
            return False
        logger.debug("mesh %s %s skipped: its relaxation takes %.3g s", mesh, dp_mode, bound)
        self._pruned(bound)
        self._record_unfit(mesh, dp_mode, micro_batches, min_step_time_s=bound)
        return True

    def _sync_floor(self, mesh: tuple[int, int], dp_mode: SearchKey) -> float:
        """A lower bound on the step time of ``(mesh, dp_mode)`` that needs no trace at its batch: the
        data-parallel synchronisation alone (the ILP's :class:`Overlap` exposes at least ``C - f K`` of it on top
        of ``K`` of compute, so a step is never shorter than ``C``), every trained parameter priced as the
        builder prices it (:func:`data_parallel_sync_time`) at its smallest share, split over all
        tensor-parallel ranks, and gathered once. Prunes the meshes whose data-parallel axis carries whole
        parameters over the network (Llama-3-70B on 1024 x 1) without tracing their batch."""
        graph = self.planner.any_graph(mesh[0])
        if self._read_params is None or self._read_params[0] is not graph:
            tied = TiedGraph.build(graph)
            read = set()
            for i in tied.canonical:
                for vid in graph.nodes[i].inputs:
                    value = graph.values[vid]
                    if value.kind is ValueKind.PARAM and value.name is not None:
                        read.add(tied.canonical_param(value.name))
            synced = []
            for fqn in graph.param_names:
                canonical = tied.canonical_param(fqn)
                if (
                    canonical in read
                    and graph.param_shapes.get(canonical) is not None
                    and graph.is_trainable(canonical)
                ):
                    synced.append(graph.param_bytes[canonical])
            self._read_params = (graph, synced)
        _, synced = self._read_params
        dp_mode, shard = _split_mode(dp_mode)
        dp_comm = (
            self.planner.hybrid_comm(mesh, shard) if dp_mode == "hsdp" else self.planner.axis_comm(mesh, 0)
        )
        total = 0.0
        for nbytes in synced:
            total += data_parallel_sync_time(dp_mode, nbytes / mesh[1], dp_comm)
        return total

    def _relaxed_optimum(self, built: BuiltProblem) -> float:
        """The optimum of ``built`` without its memory constraints: a lower bound on its step time (0 when the
        solver does not prove one)."""
        relaxed = dataclasses.replace(built.problem, memory_constraints=[])
        try:
            solution = solve(relaxed, time_limit_s=self.planner.time_limit_s)
        except InfeasibleError:
            return 0.0
        return solution.objective_s if solution.status == "optimal" else 0.0

    def ruled_out(self, mesh: tuple[int, int], dp_mode: SearchKey, shard: int, micro_batches: int) -> bool:
        """Whether a lower bound already rules ``(mesh, dp_mode)`` out, without building its ILP (recorded as
        tried and not fitting): the parameters and optimizer state alone, each split over every tensor- and
        data-parallel rank that can share it (``shard``: 1 under DDP, dp under FSDP, the shard group under
        HSDP), exceed the budget. No placement, recompute or micro-batch count needs less, so neither the ILP nor
        the micro-batch search is run for it. Why: HSDP's shard group is one node's ranks, and a model whose
        state does not fit there (Llama-3-70B on 8 per node) would otherwise cost an ILP per mesh and a
        micro-batch search; the same holds for DDP on every mesh of such a model."""
        if _is_expert_dp(dp_mode):  # the experts' state is divided by dp: the floor below would not hold
            return False
        floor = _model_state_floor(self.planner.any_graph(mesh[0], micro_batches), mesh[1] * shard)
        if floor <= self.planner.budget:
            return False
        logger.debug(
            "mesh %s %s skipped: parameters + optimizer state alone need %d bytes", mesh, dp_mode, floor
        )
        if dp_mode.mode == "hsdp":
            self._record_infeasible(mesh, dp_mode, micro_batches, floor)
        else:
            # DDP and FSDP may hold the least memory any plan needs, which the error when nothing fits states:
            # solved after all then (:meth:`run_deferred`)
            self.deferred.append((mesh, dp_mode, micro_batches, floor))
        return True

    def _accumulation_rules_out(self, mesh: tuple[int, int], dp_mode: SearchKey, micro_batches: int) -> bool:
        """Whether a micro-batched candidate cannot fit, known without its ILP (recorded with that floor): with
        k > 1 pieces every trained parameter's accumulated gradient is alive whole over the data-parallel ranks
        until the last piece (the builder's ``accumulated_grad_terms``), on top of the model state. Their floor —
        state over tensor- and data-parallel sharing, gradients over tensor-parallel ranks only — does not fall
        with k, so one test covers every count. Only applied once a plan is in hand (or a step to beat,
        :attr:`cutoff_s`): where nothing fits, the ILPs are solved anyway so that the error states the least
        memory a plan needs."""
        if micro_batches == 1 or self.bar() == math.inf or _is_expert_dp(dp_mode):
            return False
        floor = _accumulation_floor(
            self.planner.any_graph(mesh[0], micro_batches), mesh[1], self._shard(mesh, dp_mode)
        )
        if floor <= self.planner.budget:
            return False
        logger.debug(
            "mesh %s %s: %d micro-batches need %d bytes of state and gradients",
            mesh,
            dp_mode,
            micro_batches,
            floor,
        )
        self._record_infeasible(mesh, dp_mode, micro_batches, floor)
        return True

    def _shard(self, mesh: tuple[int, int], dp_mode: SearchKey) -> int:
        """Data-parallel ranks sharing a parameter's state under the search key ``dp_mode``: 1 under DDP, the
        whole axis under FSDP, the shard group under HSDP ("hsdp:16"; bare "hsdp": the cluster's default)."""
        mode, shard = _split_mode(dp_mode)
        if mode == "hsdp":
            return shard or self.planner.cluster.hybrid_shard_size(mesh) or 1
        return mesh[0] if mode == "fsdp" else 1

    def run_deferred(self, search_micro_batches: bool) -> None:
        """Where no plan fits: the candidates :meth:`ruled_out` set aside whose floor is under the least memory
        found so far are solved, in one piece and at the most micro-batches (the least memory of any count), so
        that the error states the least memory any plan needs, as if none had been set aside. The others are
        recorded with their floor, and all of them where candidates were pruned against a step to beat from
        elsewhere (:attr:`cutoff_s`, :attr:`pruned_s`): then no error follows, the search has no plan faster."""
        for mesh, dp_mode, micro_batches, floor in sorted(self.deferred, key=lambda d: d[3]):
            if floor >= self.min_required or self.pruned_s < math.inf:
                self._record_infeasible(mesh, dp_mode, micro_batches, floor)
                continue
            plan = self.try_candidate(mesh, dp_mode, micro_batches)
            options = self.planner.micro_batch_options(mesh[0]) if search_micro_batches else []
            if plan is None and options:
                self.try_candidate(mesh, dp_mode, options[-1])
        self.deferred = []

    def _record_infeasible(
        self, mesh: tuple[int, int], dp_mode: SearchKey, micro_batches: int, min_memory_bytes: float
    ) -> None:
        """A candidate nothing fits, with the least memory it would need, in the list of meshes tried."""
        self._record_unfit(mesh, dp_mode, micro_batches, min_memory_bytes=min_memory_bytes)

    def _record_unfit(
        self, mesh: tuple[int, int], dp_mode: SearchKey, micro_batches: int, **bound: float
    ) -> None:
        """A candidate with no plan in the list of meshes tried, with the bound that ruled it out
        (``min_memory_bytes``: the least memory it needs; ``min_step_time_s``: no faster than this)."""
        self.tried.append(
            {
                "mesh": list(mesh),
                "dp_mode": _split_mode(dp_mode)[0],
                "dp_label": self.label(mesh, dp_mode),
                "micro_batches": micro_batches,
                "fits": False,
                **bound,
            }
        )

    def try_micro_batches(self) -> None:
        """Micro-batching where the batch in one piece does not fit or needs recompute: k = 2, 4, ... (divisors
        of the replica's batch) up to the first k that fits without recompute; the fastest plan wins.

        Kept cheap, since each k costs a trace and an ILP: candidates are visited most promising first, and a k
        is skipped once the best plan so far is no slower than what it can reach — micro-batching at best
        removes the recompute of the last plan on that mesh (``step - recompute``), and k pieces cost at least
        k times the ops' host seconds. Where nothing fits in one piece, the smallest k that fits is found by
        bisection (memory falls with k), starting from the largest: if even that does not fit, no k does."""
        fixed_recompute = self.planner.recompute in ("none", "full")

        def done(plan: Plan | None) -> bool:
            return plan is not None and plan.fits and (fixed_recompute or not _recomputes(plan))

        pending = [(key, plan, floor) for key, (plan, floor) in self.one_piece.items() if not done(plan)]
        pending.sort(key=lambda c: _best_case(c[1]) if c[1] is not None else math.inf)
        for (mesh, dp_mode), plan, host_floor in pending:
            options = self.planner.micro_batch_options(mesh[0])
            if plan is None and options and self.bar() < math.inf:
                bound = self._unconstrained_time(mesh, dp_mode)
                if self.bar() <= bound:
                    logger.debug("mesh %s %s: micro-batches skipped (>= %.3g s)", mesh, dp_mode, bound)
                    self._pruned(bound)
                    continue
            if plan is None and options:
                first = self._smallest_fitting(mesh, dp_mode, options)
                if first is None or done(first[1]):
                    continue
                plan, options = first[1], [k for k in options if k > first[0]]
            for k in options:
                bound = max(_best_case(plan), k * host_floor) if plan is not None else 0.0
                if self.bar() <= bound:
                    logger.debug("mesh %s %s: %d micro-batches skipped (>= %.3g s)", mesh, dp_mode, k, bound)
                    self._pruned(bound)
                    break
                found = self.try_candidate(mesh, dp_mode, k)
                if done(found):
                    break
                plan = found if found is not None else plan

    def _unconstrained_time(self, mesh: tuple[int, int], dp_mode: SearchKey) -> float:
        """A lower bound on the step time of ``(mesh, dp_mode)`` at any micro-batch count, for a candidate whose
        batch in one piece fits no choice: its one-piece ILP solved without the memory budget (0 when unknown).
        k pieces run every op, resharding and FSDP gather k times on 1/k of the rows (no faster in total: a
        kernel's time does not fall faster than its rows, the host cost per op is paid per piece) and add
        recompute, while the gradient sync and the optimizer step stay once; the step time grows with compute
        and communication alike (the overlap hides at most the smaller), so no k beats this optimum. Plus what
        every plan gets after its solve in one piece (:meth:`_Planner.fixed_added_s`: collectives priced
        ``alpha + beta x bytes`` per piece cost no less in k pieces of ``1 / k`` the bytes). Without it
        the search would bisect micro-batch counts on meshes whose best case is already slower than a plan in
        hand (Llama-3-70B on 1024 devices: every mesh whose tensor parallelism crosses nodes)."""
        built = self.over_budget.pop((mesh, dp_mode), None)
        if built is None:
            return 0.0
        return self._relaxed_optimum(built) + self.planner.fixed_added_s(mesh, 1)

    def _smallest_fitting(
        self, mesh: tuple[int, int], dp_mode: SearchKey, options: list[int]
    ) -> tuple[int, Plan] | None:
        """The fewest micro-batches (of ``options``, ascending) with which ``(mesh, dp_mode)`` fits, and its
        plan; None when even the most do not. Bisection: fewer pieces never need less memory."""
        plans: dict[int, Plan] = {}
        top = self.try_candidate(mesh, dp_mode, options[-1])
        if top is None:
            return None
        plans[len(options) - 1] = top
        lo, hi = 0, len(options) - 1
        while lo < hi:
            mid = (lo + hi) // 2
            found = self.try_candidate(mesh, dp_mode, options[mid])
            if found is None:
                lo = mid + 1
            else:
                plans[mid], hi = found, mid
        return options[hi], plans[hi]


def _micro_batch_clause(fixed: int | None, tried: list[int]) -> str:
    """How micro-batching was tried, for the error when nothing fits (it closes the parenthesis)."""
    if fixed is not None:
        return f", with micro_batches={fixed} fixed; micro_batches=None searches it)"
    if len(tried) > 1:
        return f", micro-batching tried: up to {max(tried)} micro-batches per replica)"
    return "; micro-batching tried: no replica's batch splits further)"


def _model_state_floor(graph: StepGraph, ranks: int) -> int:
    """Bytes per device no plan can go below: every parameter and its optimizer state split evenly over
    ``ranks`` (gradients, activations and replicated leftovers come on top)."""
    return math.ceil((graph.total_param_bytes + graph.total_optimizer_state_bytes) / ranks)


def _accumulation_floor(graph: StepGraph, tp: int, shard: int) -> int:
    """Bytes per device no plan in k > 1 micro-batches can go below: the model state over the ``tp x shard``
    ranks sharing it, and every trained parameter's accumulated gradient, split over tensor-parallel ranks
    only (it stays whole over data-parallel ranks until the last micro-batch's synchronisation)."""
    return _model_state_floor(graph, tp * shard) + math.ceil(graph.trainable_param_bytes / tp)


def _best_case(plan: Plan) -> float:
    """What more micro-batches could at best bring a plan's step time down to: its time without recompute
    (they add compute and per-piece collectives and save only memory)."""
    return plan.step_time_s - plan.recompute_time_s


def _recomputes(plan: Plan) -> bool:
    """Whether a plan reruns any block's forward."""
    return any(option != "none" for option in plan.recompute.values())


def _meshes(
    planner: _Planner, mesh_shape: tuple[int, ...] | None, micro_batches: int = 1
) -> list[tuple[int, int]]:
    n = planner.cluster.num_devices
    if mesh_shape is not None:
        shape = tuple(mesh_shape)
        if len(shape) == 1:
            shape = (1, shape[0])
        if math.prod(shape) != n or len(shape) != 2:
            raise ValueError(
                f"mesh_shape {tuple(mesh_shape)} must be (tp,) or (dp, tp) with a product of {n} devices"
            )
        candidates = [shape]
    else:
        candidates = [(n // t, t) for t in range(1, n + 1) if n % t == 0]
    usable = []
    for dp, tp in candidates:
        if not planner.offers_mesh((dp, tp)):
            continue
        if planner.batch % (dp * micro_batches):
            logger.info(
                "mesh (%d, %d) skipped: global batch %d does not split over %d replicas x %d micro-batches",
                dp,
                tp,
                planner.batch,
                dp,
                micro_batches,
            )
            continue
        usable.append((dp, tp))
    if not usable:
        pieces = f" into {micro_batches} micro-batches per replica" if micro_batches > 1 else ""
        raise ValueError(
            f"No mesh of {n} devices can split the global batch of {planner.batch}{pieces}: use a batch divisible "
            f"by a data-parallel size{' x the micro-batches' if pieces else ''}, or pass mesh_shape=(1, {n}) for "
            "tensor parallelism only."
        )
    return usable


EXPERT_DP_KEY = "ddp-ep"
"""The search key of DDP with every MoE layer expert-parallel over the data-parallel axis."""


EXPERT_FSDP_KEY = "fsdp-ep"
"""The search key of FSDP with every MoE layer expert-parallel over the data-parallel axis: the expert weights
split over dp (whole experts per rank, left out of FSDP), every other parameter sharded by FSDP."""


EXPERT_DP_KEYS = {EXPERT_DP_KEY: "ddp", EXPERT_FSDP_KEY: "fsdp"}
"""Search key of expert parallelism over the data-parallel axis -> the data-parallel mode of the other
parameters."""


_EXPERT_KEY_OF_MODE = {mode: key for key, mode in EXPERT_DP_KEYS.items()}
"""Data-parallel mode -> the search key of the same mode with the experts sharded over the data-parallel axis."""


@dataclass(frozen=True)
class SearchKey:
    """One data-parallel candidate of the search on a mesh: its mode ("ddp", "fsdp", "hsdp"), HSDP's shard group
    (None: the cluster's own, one node's data-parallel ranks) and whether every MoE layer's experts are sharded
    over the data-parallel axis (DDP or FSDP only)."""

    mode: str
    shard: int | None = None
    experts_over_dp: bool = False

    @classmethod
    def named(cls, name: str) -> SearchKey:
        """The key a ``dp_modes`` entry names ("ddp", "fsdp", "hsdp", "ddp-ep", "fsdp-ep")."""
        if name in EXPERT_DP_KEYS:
            return cls(EXPERT_DP_KEYS[name], experts_over_dp=True)
        return cls(name)

    def __str__(self) -> str:
        """As ``dp_modes`` and the logs name it ("hsdp:16": shard groups of 16 ranks)."""
        if self.experts_over_dp:
            return _EXPERT_KEY_OF_MODE[self.mode]
        return f"{self.mode}:{self.shard}" if self.shard else self.mode


def _split_mode(key: SearchKey) -> tuple[str, int | None]:
    """A search candidate's data-parallel mode and HSDP shard group (None: the cluster's)."""
    return key.mode, key.shard


def _is_expert_dp(key: SearchKey) -> bool:
    """Whether a search key is DDP or FSDP with expert parallelism over the data-parallel axis."""
    return key.experts_over_dp


def _expert_dp_offered(model: nn.Module, mesh: tuple[int, int]) -> bool:
    """Whether expert parallelism over the data-parallel axis is a candidate on ``mesh``: a (dp, 1) mesh with
    dp >= 2 dividing every experts module's experts (the runtime's scope: DDP or FSDP, no tensor
    parallelism)."""
    dp, tp = mesh
    if dp < 2 or tp != 1:
        return False
    modules = experts_modules(model)
    counts = [int(getattr(m, "num_experts", 0) or 0) for m in modules.values()]
    return bool(counts) and all(n > 0 and n % dp == 0 for n in counts)


def _hsdp_candidates(cluster: ClusterSpec, mesh: tuple[int, int]) -> list[tuple[SearchKey, int]]:
    """HSDP's shard groups on a mesh, as (search key, shard size): one node's data-parallel ranks (the cluster's,
    :meth:`~hf_colossal_auto.hardware.ClusterSpec.hybrid_shard_size`, key "hsdp") and whole numbers of nodes
    doubling from there (keys "hsdp:<ranks>"), while they divide the data-parallel axis and leave at least two
    replicas. Larger groups trade the all-reduce across replicas and the memory of a smaller shard against
    collectives over more ranks (more latency per collective: at thousands of ranks, where a model's state does
    not fit one node, FSDP over the whole axis pays it on every gather)."""
    dp, tp = mesh
    per_node = cluster.devices_per_node
    if per_node % tp or not cluster.axis_crosses_nodes(mesh, 0):
        return []
    default = cluster.hybrid_shard_size(mesh)
    out = []
    shard = per_node // tp
    while shard < dp:
        if shard > 1 and dp % shard == 0:
            out.append((SearchKey("hsdp", None if shard == default else shard), shard))
        shard *= 2
    return out


def _search_order(planner: _Planner, meshes: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The meshes in the order they are tried: tensor parallelism the size of a node first, then outwards (the
    usual best, so that :meth:`_Search.bounded_out` has a fast plan to prune the others against); the order
    changes what is pruned, not which plan wins (a tie between meshes excepted)."""
    per_node = planner.cluster.devices_per_node
    return sorted(meshes, key=lambda m: abs(math.log2(m[1]) - math.log2(per_node)))
