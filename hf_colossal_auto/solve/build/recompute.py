"""The builder's recompute decisions: one node per recompute unit, the reruns and the forward reshardings a
rerun repeats (conditional costs), and the micro-batch repetition of everything a micro-batch runs."""

from __future__ import annotations

import functools

from ..pricing.compute import _local_node_time, _replicated
from ..problem import (
    ConditionalCost,
    DecisionNode,
)
from ..recompute import RecomputeOption, RecomputeUnit, parse_option, resolve_pin, unit_options
from .names import NodeKind, _node_name, _recompute_node_name


class _RecomputePart:
    """Recompute decisions and micro-batch repetition (:class:`~.builder._ProblemBuilder`)."""

    def _repeat_per_micro_batch(self) -> None:
        """Every micro-batch runs the ops (device and host), their tensor-parallel reshardings and recompute again: their costs
        (priced on one micro-batch's shapes) times k. Parameter nodes (the optimizer step, once per step) and
        the data-parallel synchronisation (``sync_terms``, priced per step) are left as they are."""
        k = float(self.micro_batches)
        for node in self.nodes:
            if node.name in self.strat_of:
                node.costs = [c * k for c in node.costs]
        self.edge_cost = {key: [[c * k for c in row] for row in m] for key, m in self.edge_cost.items()}
        self.edge_calls = {key: [[c * k for c in row] for row in m] for key, m in self.edge_calls.items()}
        self.shared_price = {key: [c * k for c in v] for key, v in self.shared_price.items()}
        for cond in self.conditional:
            cond.cost = [[c * k for c in row] for row in cond.cost]
        self.host_terms = {name: host * k for name, host in self.host_terms.items()}

    # ---------------------------------------------------------------- recompute decisions
    def _add_recompute_decisions(self) -> None:
        """One node ``rc:<unit>`` per recompute unit, its strategies the unit's options
        (:func:`~hf_colossal_auto.solve.recompute.unit_options`; pinned by ``recompute_pin``). The node costs
        nothing itself: an edge ``rc -> op`` prices rerunning each op the option recomputes on its local shapes
        under the op's strategy, and :meth:`_add_conditional_costs` the forward reshardings a rerun repeats.
        What the option saves is priced by :meth:`_memory_constraints`."""
        graph, axis, tp, spec = self.graph, self.axis, self.tp, self.spec
        for unit in self.units:
            # what the block's own backward needs (a block output is kept by its readers, not recomputed for them)
            unit.last_saved = max(
                (c for c in unit.nodes if self.saved_for_backward.get(c) and c not in unit.escaping),
                default=None,
            )
            forward_s = {
                c: _local_node_time(graph, graph.nodes[c], _replicated(graph.nodes[c]), axis, 1, spec)
                for c in unit.nodes
            }
            options = unit_options(graph, unit, self.saved_for_backward, forward_s)
            pinned = self._pinned_option(unit)
            if pinned is not None and pinned not in {o.name for o in options}:
                # a level the ranking does not offer, pinned by a hand configuration (torchtitan's selective
                # policy recomputes the pointwise ops alone): priced as any other option
                options.append(parse_option(pinned))
            self.unit_options_of.append(options)
            rc = _recompute_node_name(unit.name)
            self.rc_names.append(rc)
            self.nodes.append(
                DecisionNode(
                    rc,
                    [0.0] * len(options),
                    [o.name for o in options],
                    multiplicity=1,
                    kind=NodeKind.RECOMPUTE,
                )
            )
            self.block_of[rc] = unit.name
            for c in unit.nodes:
                name = _node_name(c)
                node = graph.nodes[c]
                eager = c in self.eager_nodes  # a module run on local shards reruns eager ops
                local = [
                    self._skewed(
                        c,
                        st,
                        functools.partial(
                            _local_node_time, graph, node, st, axis, tp, spec, dtensor=not eager
                        ),
                    )
                    for st in self.strat_of[name]
                ]
                matrix = [
                    [t * self.tied.multiplicity[c] if unit.reruns(o, node) else 0.0 for t in local]
                    for o in options
                ]
                self.edge_cost[(rc, name)] = matrix
            self._pin_recompute(unit, rc, options)
        self._add_conditional_costs()

    def _pinned_option(self, unit: RecomputeUnit) -> str | None:
        """The option ``recompute_pin`` names for a unit (for every unit, or per unit: "none" for the units it
        leaves out); None when recompute is a decision."""
        recompute_pin = self.recompute_pin
        if recompute_pin is None:
            return None
        text = recompute_pin if isinstance(recompute_pin, str) else recompute_pin.get(unit.name, "none")
        return resolve_pin(text, self.graph, unit, self.saved_for_backward)

    def _pin_recompute(self, unit: RecomputeUnit, rc: str, options: list[RecomputeOption]) -> None:
        """Fixes a unit's recompute option when ``recompute_pin`` names one (:meth:`_pinned_option`)."""
        want = self._pinned_option(unit)
        if want is None:
            return
        names = [o.name for o in options]
        if want not in names:
            raise ValueError(f"recompute option {want!r} for {unit.name} is not one of its options {names}")
        self.fixed[rc] = names.index(want)

    def _add_conditional_costs(self) -> None:
        """The forward resharding into a recomputable op is paid again when its unit's option reruns the op: a
        :class:`ConditionalCost` on the edge, active for those options."""
        units, graph = self.units, self.graph
        for (src, dst), matrix in sorted(self.fwd_into.items()):
            c = self.node_of_name[dst]
            u = self.unit_index_of[c]
            when = tuple(
                k for k, o in enumerate(self.unit_options_of[u]) if units[u].reruns(o, graph.nodes[c])
            )
            if when and any(any(row) for row in matrix):
                self.conditional.append(ConditionalCost(src, dst, self.rc_names[u], when, matrix))
