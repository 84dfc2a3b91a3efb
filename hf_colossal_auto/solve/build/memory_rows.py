"""The builder's memory rows: per-device memory at the highest point of forward and of backward, the optimizer step
and each recompute unit's backward and rerun moments."""

from __future__ import annotations

from typing import NamedTuple

from ...capture.graph import Phase
from ...strategies.placements import Strategy
from ..pricing.comm import shard_factor
from ..pricing.compute import is_expert_parallel
from ..pricing.memory import _block_moment, _highest_phase, _liveness, _Snapshot
from ..problem import (
    DecisionNode,
    FollowsInputs,
    MemoryConstraint,
)
from ..recompute import RecomputeOption
from ..tied import _weighted
from .names import MemoryRow, NodeKind, _node_name, memory_row_name


class _RowSnapshots(NamedTuple):
    """Live bytes at the moments the memory rows are written at."""

    peak: _Snapshot
    """The highest point of forward + backward."""
    phase_peak: tuple[Phase, _Snapshot] | None
    """The highest point of the other phase (None when the step has one)."""
    unit_peaks: list[_Snapshot]
    """Per recompute unit: the highest point inside the backward of its block that goes backward first."""
    unit_starts: list[_Snapshot]
    """Per recompute unit: the start of that backward (where a rerun happens)."""
    unit_forwards: list[_Snapshot]
    """Per recompute unit: the highest point of that block's forward (what a rerun rebuilds)."""


class _MemoryRowsPart:
    """Memory constraints (:class:`~.builder._ProblemBuilder`)."""

    # ---------------------------------------------------------------- memory
    def _snapshots(self) -> _RowSnapshots:
        """Live bytes at the moments the memory constraints are written at (:class:`_RowSnapshots`)."""
        units = self.units
        # The same graph is built into several problems (data-parallel modes, the planner's relaxations): the
        # snapshots depend only on it, its units and the storages they are handed, so they are kept with its
        # StepMemory.
        cache = self.step_memory.snapshots
        key = (tuple((u.name, tuple(u.nodes)) for u in units), tuple(sorted(self.checkpoint_args)))
        if key not in cache:
            cache[key] = self._snapshots_uncached()
        return cache[key]

    def _snapshots_uncached(self) -> _RowSnapshots:
        graph, units = self.graph, self.units
        step = self.step_memory.unrolled
        moments = [_block_moment(graph, step, unit, Phase.BACKWARD, "peak") for unit in units]
        moments += [_block_moment(graph, step, unit, Phase.BACKWARD, "start") for unit in units]
        moments += [_block_moment(graph, step, unit, Phase.FORWARD, "peak") for unit in units]
        peaks, snapshots = _liveness(graph, step, moments, set(self.checkpoint_args))
        highest = _highest_phase(peaks)
        others = [(phase, snapshot) for phase, snapshot in peaks.items() if phase is not highest]
        k = len(units)
        return _RowSnapshots(
            peaks[highest],
            others[0] if others else None,
            snapshots[:k],
            snapshots[k : 2 * k],
            snapshots[2 * k :],
        )

    def _memory_constraints(self) -> list[MemoryConstraint]:
        """Per-device memory under the budget at each constrained moment: the activation peak and the other
        phase's peak (:meth:`_phase_constraints`); the optimizer step (:meth:`_optimizer_constraint`); and per
        recompute unit, the highest point of its backward (``recompute:<unit>``) and its rerun as its backward
        starts (``rerun:<unit>``). See :meth:`_constraint_at`."""
        constraints = self._phase_constraints()
        constraints.append(self._optimizer_constraint())
        for u, (unit, snapshot) in enumerate(zip(self.units, self.unit_snapshots, strict=True)):
            constraints.append(self._constraint_at(MemoryRow.RECOMPUTE, snapshot, u, of=unit.name))
            constraints.append(
                self._constraint_at(
                    MemoryRow.RERUN,
                    self.start_snapshots[u],
                    u,
                    self.forward_snapshots[u],
                    of=unit.name,
                )
            )
        return constraints

    def _phase_constraints(self) -> list[MemoryConstraint]:
        """The rows outside any recompute unit's moments: at the step's highest point before sharding
        (``activation-peak``), and at the other phase's highest point (``phase-peak:<phase>``).

        Why two: which moment is highest depends on the choice. A strategy divides what a moment's nodes hold by
        how it shards them, but not the moment's transient (priced whole), so a forward peak of saved
        activations falls under sharding while a backward peak made of a transient does not: at 131,072 tokens
        a causal LM's forward loss is its highest point before sharding, and its loss backward (two float32
        gradients of the logits) the highest after it. A row at one moment lets a choice fit it and overshoot
        the other; the plan's predicted peak, the highest of its rows, is then the highest of the two."""
        rows = [self._constraint_at(MemoryRow.ACTIVATION_PEAK, self.peak_snapshot, None)]
        if self.phase_peak is not None:
            phase, snapshot = self.phase_peak
            rows.append(self._constraint_at(MemoryRow.PHASE_PEAK, snapshot, None, of=phase.value))
        return rows

    def _optimizer_constraint(self) -> MemoryConstraint:
        """The optimizer step: parameters, gradients, optimizer state and its temporaries, by parameter
        placement."""
        opt_terms = {
            p: [
                m + g + t
                for m, g, t in zip(
                    self.param_mem_terms[p], self.grad_terms[p], self.opt_temp_terms[p], strict=True
                )
            ]
            for p in self.param_mem_terms
        }
        return MemoryConstraint(
            memory_row_name(MemoryRow.OPTIMIZER_STEP),
            self.budget,
            self._constant_bytes(),
            opt_terms,
            apply_multiplicity=True,
            kind=MemoryRow.OPTIMIZER_STEP,
        )

    def _constant_bytes(self) -> float:
        """Bytes no decision changes: the model's inputs and buffers (at the activation peak)."""
        return self.peak_snapshot.by_kind.get("input", 0) + self.peak_snapshot.by_kind.get("buffer", 0)

    def _constraint_at(
        self,
        kind: MemoryRow,
        snapshot: _Snapshot,
        current: int | None,
        rerun: _Snapshot | None = None,
        *,
        of: str | None = None,
    ) -> MemoryConstraint:
        """Per-device bytes at one moment of the step: what forward nodes still hold (kept per the recompute
        choice; inside unit ``current``'s backward, at its highest point, also its recomputed block),
        parameters, gradients alive then, and the moment's other transients (priced unsharded: an upper bound,
        since some of the gradients in flight are sharded).

        ``rerun``: the moment is the recompute of unit ``current``'s block, just as its backward starts; a
        block that reruns holds what it held at its own forward's highest point (``rerun``'s bytes of its
        nodes: saved outputs and forward temporaries) on top of the gradients arriving from above. The row is
        named by ``kind`` and, for a kind with a row per unit or phase, by ``of`` (:func:`~.names.memory_row_name`)."""
        tied = self.tied
        saved = _weighted(tied, snapshot.by_node)
        rerun_alive = _weighted(tied, rerun.by_node) if rerun is not None else {}
        transient = max(0.0, snapshot.by_kind.get("activation", 0) - sum(saved.values()))
        terms: dict[str, list[float]] = {}
        edge_terms: dict[tuple[str, str], list[list[float]]] = {}
        for c in self.canon_nodes:
            name_c = _node_name(c)
            strats = self.strat_of[name_c]
            alive = saved.get(c, 0.0)
            u = self.unit_index_of.get(c)
            if u is None:
                if alive:
                    terms[name_c] = [alive / tied.multiplicity[c] / self._out_shard(st, c) for st in strats]
                continue
            over = current is not None and u > current  # that unit's backward is over: it holds nothing
            matrix = [
                [
                    (
                        0.0
                        if over
                        else self._held(
                            o,
                            c,
                            rerun_alive.get(c, 0.0)
                            if rerun is not None and u == current and not o.is_none
                            else alive,
                            self.weighted_saved.get(c, 0.0),
                            u == current,
                        )
                    )
                    / self._out_shard(st, c)
                    for st in strats
                ]
                for o in self.unit_options_of[u]
            ]
            if any(any(row) for row in matrix):
                edge_terms[(self.rc_names[u], name_c)] = matrix
        # the share of the gradients alive then: of the trained parameters' (frozen ones have none)
        param_total = self.graph.trainable_param_bytes
        grad_frac = snapshot.by_kind.get("grad", 0) / param_total if param_total else 0.0
        for pname, mterms in self.param_mem_terms.items():
            if self.micro_batches > 1:  # the earlier micro-batches' gradients are all alive
                grads = self.accumulated_grad_terms[pname]
                terms[pname] = [m + g for m, g in zip(mterms, grads, strict=True)]
            else:
                terms[pname] = [
                    m + grad_frac * g for m, g in zip(mterms, self.grad_terms[pname], strict=True)
                ]
            if pname in self.gathered_terms:
                terms[pname] = [t + x for t, x in zip(terms[pname], self.gathered_terms[pname], strict=True)]
        for sid, readers in sorted(self.checkpoint_args.items()):
            holding = tuple(u for u in sorted(readers) if current is None or u <= current)
            if holding and sid not in snapshot.watched_alive:
                terms[self._hold_node(sid, holding)] = [0.0, float(self.graph.storages[sid].nbytes)]
        return MemoryConstraint(
            memory_row_name(kind, of),
            self.budget,
            self._constant_bytes() + transient,
            terms,
            edge_terms,
            apply_multiplicity=True,
            kind=kind,
        )

    def _hold_node(self, sid: int, units: tuple[int, ...]) -> str:
        """A node that is ``held`` exactly when one of ``units`` recomputes: then a checkpoint still holds storage
        ``sid`` (non-reentrant checkpoint keeps a block's arguments until the block's backward), which nothing
        else may hold at that moment (OPT's and Llama's position ids). It holds it once however many blocks
        recompute, so the term is an OR of the units' choices: two :class:`FollowsInputs` rules make the node's
        choice that OR (a recomputing option needs ``held``; ``held`` needs a recomputing unit)."""
        key = (sid, units)
        if key in self.hold_nodes:
            return self.hold_nodes[key]
        name = f"hold:{sid}:" + ",".join(self.units[u].name for u in units)
        self.hold_nodes[key] = name
        self.nodes.append(
            DecisionNode(name, [0.0, 0.0], ["released", "held"], multiplicity=1, kind=NodeKind.HOLD)
        )
        for u in units:
            recomputing = tuple(k for k, o in enumerate(self.unit_options_of[u]) if not o.is_none)
            self.hold_rules.append(FollowsInputs(self.rc_names[u], recomputing, ((name, (0,)),)))
        none_of = [
            (self.rc_names[u], tuple(k for k, o in enumerate(self.unit_options_of[u]) if o.is_none))
            for u in units
        ]
        self.hold_rules.append(FollowsInputs(name, (1,), tuple(none_of)))
        return name

    def _out_shard(self, st: Strategy, c: int | None = None) -> float:
        """How many ways a strategy splits node ``c``'s (first) output: what its held bytes are divided by. The
        rows of an expert-parallel grouped GEMM under a measured routing load split as the busiest rank holds
        them (the mean skew over the layers the node stands for: bytes add up over them). An op of an experts
        module run expert-parallel over the data-parallel axis holds the values of the rows it received: its traced
        bytes under uniform routing, the busiest rank's skew times them under a measured one."""
        if c is not None and c in self.expert_dp_nodes:
            return 1.0 / self.expert_dp_nodes[c]
        ways = shard_factor(st.output_placements[0][self.axis] if st.output_placements else None, self.tp)
        skews = self.expert_skews.get(c) if c is not None else None
        if skews and ways > 1 and is_expert_parallel(self.graph, self.graph.nodes[c], st, self.axis):
            mean = sum(skew * k for skew, k in skews) / sum(k for _, k in skews)
            return ways / mean
        return ways

    def _skewed(self, c: int, st: Strategy, price) -> float:
        """``price(row_skew)`` of node ``c`` under ``st``: 1.0 unless ``st`` runs an expert-parallel grouped
        GEMM under a measured routing load, then averaged over the layers the node stands for (their costs add
        up through its multiplicity)."""
        skews = self.expert_skews.get(c)
        if not skews or not is_expert_parallel(self.graph, self.graph.nodes[c], st, self.axis):
            return price(1.0)
        if len(skews) == 1:
            return price(skews[0][0])
        return sum(price(skew) * k for skew, k in skews) / sum(k for _, k in skews)

    def _kept(self, option: RecomputeOption, c: int, alive: float) -> float:
        """Bytes one real block's node ``c`` keeps for backward under ``option`` (``alive``: what it keeps
        without recompute)."""
        if option.is_none:
            return alive
        escaping = c in self.units[self.unit_index_of[c]].escaping
        node = self.graph.nodes[c]
        cached = float(sum(self.graph.values[v].nbytes for v in node.outputs)) if option.caches(node) else 0.0
        return max(cached, alive) if escaping else cached

    def _held(self, option: RecomputeOption, c: int, alive: float, at_peak: float, inside: bool) -> float:
        """Bytes node ``c`` holds over all the real blocks it stands for. ``inside``: the moment is inside the
        backward of the unit's first block to go backward; that block holds what it holds without recompute
        (recomputed or kept, the same tensors), the others only what they keep."""
        mult = self.tied.multiplicity[c]
        if not inside:
            return mult * self._kept(option, c, alive / mult)
        others = at_peak * (mult - 1) / mult
        return (mult - 1) * self._kept(option, c, at_peak / mult) + max(0.0, alive - others)
