"""The builder's decision nodes: one per canonical forward op (its compute time) and one per parameter
(its storage placements: optimizer update, data-parallel sync, memory)."""

from __future__ import annotations

import functools
from collections import defaultdict

from ...capture.graph import ValueKind
from ..pricing.comm import SHARDED_DP_MODES, boundary_reshardings, data_parallel_sync_time, shard_factor
from ..pricing.compute import _node_host_time, _node_step_time, _optimizer_time, _replicated, host_runs_ahead
from ..pricing.memory import _optimizer_temp_ratio
from ..problem import (
    DecisionNode,
)
from ..tied import view_root, viewed_param
from .names import NodeKind, _label, _node_name, _param_node_name, param_storage_options


class _NodesPart:
    """Op and parameter nodes (:class:`~.builder._ProblemBuilder`)."""

    def _param_node_of(self, vid: int) -> str | None:
        """The parameter node of a value that is a parameter, or a view of one, if any."""
        root = view_root(self.graph, self.tied, self.producer, vid)
        pvid = viewed_param(self.graph, self.tied, self.producer, root)
        if pvid is None:
            value = self.graph.values[root]
            pvid = root if value.kind is ValueKind.PARAM and value.name else None
        if pvid is None:
            return None
        pname = _param_node_name(self.tied.canonical_param(self.graph.values[pvid].name))
        return pname if pname in self.param_options else None

    # ---------------------------------------------------------------- op nodes
    def _add_op_nodes(self) -> None:
        """One node per canonical forward op, its strategies the ones DTensor's rules allow (replicated when
        none). Cost per strategy: the op's forward and its share of backward on local shapes, host overhead
        included on a CPU (:func:`_node_step_time`; where the host runs ahead of the device its seconds are a
        stream priced per block, ``host_terms``), plus the collectives the strategy costs outside the edges (a
        returned output gathered, a partial loss weight reduced: :func:`boundary_reshardings`). A copy of a
        folded block counts through the node's multiplicity. An op of a module run on local shards
        (``eager_nodes``) costs the host an eager op's seconds, not DTensor's."""
        graph, axis, tp = self.graph, self.axis, self.tp
        for c in self.canon_nodes:
            node = graph.nodes[c]
            strats = self.strategies.get(c) or [_replicated(node)]
            name = _node_name(c)
            returned_as = dict.fromkeys(self.returned_by_node.get(name, {}))  # priced on the reader's edge
            costs = [
                (
                    self._expert_dp_node_time(c)
                    if c in self.expert_dp_nodes
                    else self._skewed(
                        c,
                        s,
                        functools.partial(
                            _node_step_time,
                            graph,
                            node,
                            s,
                            axis,
                            tp,
                            self.spec,
                            self.ratios,
                            dtensor=c not in self.eager_nodes,
                        ),
                    )
                )
                + sum(t for t, _, _ in boundary_reshardings(graph, node, s, axis, self.tp_comm, returned_as))
                for s in strats
            ]
            self.nodes.append(
                DecisionNode(
                    name,
                    costs,
                    [_label(s, axis) for s in strats],
                    multiplicity=self.tied.multiplicity[c],
                    kind=NodeKind.OP,
                )
            )
            self.strat_of[name] = strats
            self.node_of_name[name] = c
            self.block_of[name] = node.module
            host = _node_host_time(node, self.spec, self.ratios, dtensor=c not in self.eager_nodes)
            self.host_floor_s += self.tied.multiplicity[c] * host
            self.dtensor_host_floor_s += self.tied.multiplicity[c] * (
                _node_host_time(node, self.spec, self.ratios) if c in self.eager_nodes else host
            )
            if host_runs_ahead(self.spec) and c not in self.expert_dp_nodes:  # the exchange joins its own
                self.host_terms[name] = host
                unit = self.unit_index_of.get(c)
                self.segment_of[name] = self.units[unit].name if unit is not None else ""

    # ---------------------------------------------------------------- parameter nodes
    def _add_param_nodes(self) -> None:
        """One node per canonical parameter that a forward op reads, its strategies its storage placements on
        the tensor-parallel axis (:func:`param_storage_options`; pinned by ``fixed_params``). Cost per option:
        its share of the optimizer step on the local shard. Alongside, per option, what later parts price: the
        data-parallel synchronisation (``sync_terms``, hidden behind compute by an :class:`Overlap`), the bytes
        of parameter + optimizer state, gradient and optimizer temporaries (sharded by the data-parallel axis
        too under FSDP), and under FSDP the bytes a gathered block adds (``gathered_terms``). A frozen parameter
        (``requires_grad=False``) costs its storage only: no gradient, optimizer state, step or sync."""
        graph, tied, tp, dp = self.graph, self.tied, self.tp, self.dp
        param_uses: dict[str, list[tuple[int, int]]] = defaultdict(list)
        """canonical param FQN -> (forward node, input position) of every use, over all copies."""
        for i in tied.canonical:
            node = graph.nodes[i]
            for k, vid in enumerate(node.inputs):
                v = graph.values[vid]
                if v.kind is ValueKind.PARAM and v.name is not None:
                    param_uses[tied.canonical_param(v.name)].append((i, k))
        # the optimizer step covers the trained parameters only (the profile's optimizer ops are theirs)
        total_param_bytes = float(graph.trainable_param_bytes) or 1.0
        opt_time = self._of_step(("optimizer_time", self.spec), lambda: _optimizer_time(graph, self.spec))
        real_count: dict[str, int] = defaultdict(int)
        for fqn in graph.param_names:
            real_count[tied.canonical_param(fqn)] += 1
        opt_temp_ratio = self._of_step(
            ("optimizer_temp_ratio",), lambda: _optimizer_temp_ratio(graph, self.step_memory.unrolled)
        )
        fsdp_layers = [u.name for u in self.units] if self.dp_mode in SHARDED_DP_MODES and dp > 1 else []
        for fqn in sorted(param_uses):
            shape = graph.param_shapes.get(fqn)
            if shape is None:
                continue
            name = _param_node_name(fqn)
            options = param_storage_options(shape, tp)
            self._pin_param(fqn, name, shape, options)
            pbytes = float(graph.param_bytes[fqn])
            sbytes = float(graph.optimizer_state_bytes.get(fqn, 0))
            dp_shard = self.dp_shard
            module, _, _ = fqn.rpartition(".")
            exchange = self.expert_dp.get(module)
            over_dp = exchange is not None and len(shape) >= 1 and shape[0] == exchange.num_experts
            if over_dp:  # E/dp experts per data-parallel rank: state divided by dp, no gradient all-reduce
                dp_shard = dp
                self.expert_dp_params.add(fqn)
            trained = 1.0 if graph.is_trainable(fqn) else 0.0
            costs, mterms, gterms, tterms, syncs = [], [], [], [], []
            for opt in options:
                local = pbytes / shard_factor(opt, tp)
                sync = data_parallel_sync_time(self.dp_mode, local, self.dp_comm, self.micro_batches)
                syncs.append(0.0 if over_dp else trained * sync)
                costs.append(
                    trained * opt_time * (pbytes / total_param_bytes) / shard_factor(opt, tp) / dp_shard
                )
                mterms.append((local + sbytes / shard_factor(opt, tp)) / dp_shard)
                gterms.append(trained * local / dp_shard)
                tterms.append(trained * local / dp_shard * opt_temp_ratio)
            self.nodes.append(
                DecisionNode(name, costs, options, multiplicity=real_count[fqn], kind=NodeKind.PARAM)
            )
            self.param_options[name] = options
            if any(syncs):
                self.sync_terms[name] = syncs
            self.param_of_node[name] = fqn
            self.param_mem_terms[name] = mterms
            self.grad_terms[name] = gterms
            self.accumulated_grad_terms[name] = [
                trained * pbytes / shard_factor(o, tp) / (dp if over_dp else 1) for o in options
            ]
            self.opt_temp_terms[name] = tterms
            self.block_of[name] = fqn.rsplit(".", 1)[0]
            if fsdp_layers and not over_dp:  # FSDP leaves the experts over dp out: never gathered
                self.gathered_terms[name] = self._fsdp_gathered_bytes(
                    fqn, pbytes, options, fsdp_layers, real_count[fqn], graph.is_trainable(fqn)
                )

    def _pin_param(self, fqn: str, name: str, shape: tuple[int, ...], options: list[str]) -> None:
        """Fixes a parameter's storage option when ``fixed_params`` names it (or, with ``pin_unlisted``, to
        replicated when it does not)."""
        fixed_params = self.fixed_params
        if fixed_params is not None and (fqn in fixed_params or self.pin_unlisted):
            want = fixed_params.get(fqn, "R")
            if want not in options:
                raise ValueError(
                    f"placement {want!r} for parameter {fqn} (shape {tuple(shape)}) is not possible on a "
                    f"tensor-parallel axis of {self.tp}; possible: {options}"
                )
            self.fixed[name] = options.index(want)

    def _fsdp_gathered_bytes(
        self,
        fqn: str,
        pbytes: float,
        options: list[str],
        fsdp_layers: list[str],
        real_count: int,
        trainable: bool = True,
    ) -> list[float]:
        """Bytes per storage option a parameter adds at the activation peak while FSDP has it gathered.

        FSDP2 (one unit per block, the root for the rest) holds the root's parameters and gradients unsharded
        through backward, and one block's at a time while that block runs: the sharded memory terms count 1/dp
        of them, the rest is this. A frozen parameter has no unsharded gradient: its weight only."""
        dp = self.dp_shard  # FSDP's group: the shard group under HSDP
        in_block = [b for b in fsdp_layers if fqn.startswith(b + ".")]
        share = 1.0 / real_count if in_block else 1.0
        if in_block and in_block[0] != fsdp_layers[0]:
            share = 0.0  # one block gathered at a time: priced on the first block's parameters
        copies = 2 if trainable else 1  # the gathered weight, and its unsharded gradient when it has one
        return [copies * (1 - 1 / dp) * pbytes / shard_factor(o, self.tp) * share for o in options]
