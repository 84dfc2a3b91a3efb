"""Expert parallelism over the data-parallel axis: the all-to-all exchange of each experts module and the
builder's part that prices it (its node, its ops on the rows a rank receives, the rules keeping it whole)."""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

from ...capture.graph import Phase, StepGraph, ValueKind
from ...capture.moe import RoutingLoad
from ...hardware.roofline import host_time, join_host, kernel_time
from ...strategies.moe import EXPERT_REGION, expert_regions
from ...strategies.placements import Strategy
from ..pricing.compute import GROUPED_MM, _expert_skews, _local_device_time, _replicated, _with_host
from ..problem import (
    DecisionNode,
    FollowsInputs,
)
from ..tied import TiedGraph, differentiable_values
from .names import EXPERT_DP_NODE, NodeKind, _node_name


@dataclass
class ExpertExchange:
    """The all-to-all exchange of one experts module run expert-parallel over the data-parallel axis
    (``apply/moe.py::expert_data_parallel_forward``): ``collectives`` are ``(kind, bytes one rank hands it,
    bytes the alpha-beta model prices)`` in step order — forward: the per-expert counts, the (token, expert)
    pairs' rows out (dispatch) and their results back (combine); backward: the combine's and the dispatch's
    gradients, where a gradient flows. The bytes one rank hands in are the mean rank's (``T·k`` rows each
    way: exact summed over the ranks, whatever the routing); the priced ones the busiest rank's (``skew``
    times them). ``sender_kernels``: the bytes each of the sender's own kernels moves (sorting the pairs'
    rows out, putting the results back in token order, weighting and summing them; forward and backward),
    which the traced experts forward has no counterpart of. ``layers``: real MoE layers it stands for."""

    num_experts: int
    layers: int
    collectives: list[tuple[str, float, float]]
    skew: float = 1.0
    sender_kernels: tuple[float, ...] = ()
    dtype: str = "float32"


def expert_exchanges(
    graph: StepGraph, tied: TiedGraph, dp: int, routing: RoutingLoad | None = None
) -> dict[str, ExpertExchange]:
    """Canonical experts module -> its :class:`ExpertExchange` on ``dp`` data-parallel ranks. The region's
    inputs are read off the graph: the tokens (floating point, the shape of the module's output), the routing
    weights (the other floating-point input) and the routing indices (integers, ``T·k`` of them), each ``T``
    rows of one replica's tokens. ``routing``: a measured load, whose busiest rank (mean over the layers the
    module stands for) prices the row exchanges; None: uniform."""
    out: dict[str, ExpertExchange] = {}
    grads = differentiable_values(graph)
    skews = _expert_skews(graph, tied, routing, dp)
    for module, (num_experts, first) in expert_regions(graph).items():
        if tied.canonical.get(first, first) != first:
            continue
        nodes = [
            n
            for n in graph.nodes
            if n.phase is Phase.FORWARD and (n.module == module or n.module.startswith(module + "."))
        ]
        inside = {v for n in nodes for v in n.outputs}
        inputs: list[int] = []
        for n in nodes:
            for v in n.inputs:
                if v not in inside and graph.values[v].kind is not ValueKind.PARAM and v not in inputs:
                    inputs.append(v)
        used_after = {v for n in graph.nodes if n.phase is Phase.FORWARD and n not in nodes for v in n.inputs}
        outputs = [v for v in inside if v in used_after]
        if len(outputs) != 1 or len(inputs) != 3:
            raise ValueError(
                f"expert parallelism over the data-parallel axis: {module} takes {len(inputs)} tensors and gives "
                f"{len(outputs)} (expected tokens, routing weights and indices in, tokens out)"
            )
        out_value = graph.values[outputs[0]]
        floats = [v for v in inputs if graph.values[v].dtype.startswith(("float", "bfloat", "half"))]
        hidden = next((v for v in floats if graph.values[v].shape == out_value.shape), None)
        weights = next((v for v in floats if v != hidden), None)
        index = next((v for v in inputs if v not in floats), None)
        if hidden is None or weights is None or index is None or not graph.values[hidden].shape:
            raise ValueError(f"expert parallelism over the data-parallel axis: cannot read {module}'s inputs")
        tokens = graph.values[hidden].shape[0]
        pairs = math.prod(graph.values[index].shape)
        rows = float(graph.values[hidden].nbytes) / tokens * pairs  # the (token, expert) pairs' rows
        o = float(out_value.nbytes)
        by_skew = skews.get(first, ())  # the module's grouped GEMM: (skew, real layers) pairs
        skew = sum(k * n for k, n in by_skew) / sum(n for _, n in by_skew) if by_skew else 1.0
        counts = 8.0 * num_experts  # int64 per-expert counts
        collectives = [
            ("all_to_all", counts, counts),
            ("all_to_all", rows, skew * rows),
            ("all_to_all", rows, skew * rows),
        ]
        # backward, where a gradient flows: the combine's always with the output's, the dispatch's with the
        # tokens' (the routing weights stay on their rank)
        if outputs[0] in grads:
            collectives.append(("all_to_all", rows, skew * rows))
        if hidden in grads:
            collectives.append(("all_to_all", rows, skew * rows))
        # the sender's kernels: forward the gather of the pairs' rows, their results put back in token order,
        # weighted, summed over k; backward the sum's expansion, the weighting's two products, the reorder's
        # and the gather's scatters
        sender = (2 * rows, 2 * rows, 2 * rows, rows + o)
        if outputs[0] in grads:
            sender += (rows + o, 2 * rows, 2 * rows, 2 * rows, 2 * rows + o)
        out[module] = ExpertExchange(
            num_experts,
            tied.multiplicity.get(first, 1),
            collectives,
            skew,
            sender,
            graph.values[hidden].dtype,
        )
    return out


class _ExpertExchangePart:
    """The builder's expert-parallel-over-dp part (:class:`~.builder._ProblemBuilder`)."""

    # ---------------------------------------------------------------- expert parallelism over dp
    def _setup_expert_dp(self) -> None:
        """Checks the scope (DDP or FSDP, tensor-parallel axis of 1, dp dividing every layer's experts) and
        reads the exchanges and the region nodes' factors (the busiest data-parallel rank's rows under a
        measured routing load, over the mean's)."""
        if self.dp < 2 or self.dp_mode not in ("ddp", "fsdp") or self.tp != 1:
            raise ValueError(
                "expert parallelism over the data-parallel axis is planned under DDP or FSDP on a (dp, 1) "
                f"mesh with dp >= 2; got mesh {self.mesh_shape} {self.dp_mode}"
            )
        self.expert_dp = expert_exchanges(self.graph, self.tied, self.dp, self.routing)
        if not self.expert_dp:
            raise ValueError(
                "expert parallelism over the data-parallel axis: the model has no experts module"
            )
        for module, exchange in self.expert_dp.items():
            if exchange.num_experts % self.dp:
                raise ValueError(
                    f"expert parallelism over the data-parallel axis: {module} has {exchange.num_experts} experts, "
                    f"which {self.dp} data-parallel ranks do not divide"
                )
        for i, c in self.tied.canonical.items():
            node = self.graph.nodes[i]
            if i != c:
                continue
            module = next(
                (m for m in self.expert_dp if node.module == m or node.module.startswith(m + ".")), None
            )
            if module is not None:
                self.expert_dp_nodes[c] = self.expert_dp[module].skew

    def _expert_dp_node_time(self, c: int) -> float:
        """Seconds one op of an experts module run expert-parallel over the data-parallel axis adds to a step,
        forward and backward. The rank runs transformers' experts forward on the rows it received, one expert
        each: ``T·k`` of them under uniform routing — as many as the traced forward's ``T`` tokens times ``k``
        experts, so each op costs what it was traced at, times the busiest rank's skew — and a grouped GEMM
        reads its ``E/dp`` experts' weights only."""
        node, factor = self.graph.nodes[c], self.expert_dp_nodes[c]
        device_ratio, ops_ratio = self.ratios.of(node.module)
        if node.op == GROUPED_MM and len(node.inputs) >= 2:
            split = ("S0",)
            ins = tuple(split if k < 2 else ("R",) for k in range(len(node.inputs)))
            strat = Strategy(ins, tuple(split for _ in node.outputs), "custom")
            device = _local_device_time(self.graph, node, strat, 0, self.dp, self.spec, self.dp * factor)
        else:
            device = _local_device_time(self.graph, node, _replicated(node), 0, 1, self.spec) * factor
        return _with_host(device * (1.0 + device_ratio), node, 1.0 + ops_ratio, self.spec)

    def _add_expert_dp_exchange(self) -> None:
        """One node (a single option) for the exchange on the data-parallel link, every micro-batch, every
        layer: its all-to-alls, which the region waits for (not overlapped), and the sender's own kernels."""
        seconds = 0.0
        for exchange in self.expert_dp.values():
            comm = sum(self.dp_comm.time(kind, priced) for kind, _given, priced in exchange.collectives)
            device = sum(kernel_time(0.0, b, exchange.dtype, self.spec) for b in exchange.sender_kernels)
            host = host_time(self.spec) * len(exchange.sender_kernels)
            seconds += exchange.layers * (comm + join_host(device, host, self.spec))
        seconds *= self.micro_batches
        self.nodes.append(
            DecisionNode(
                EXPERT_DP_NODE,
                [seconds],
                ["all-to-all dispatch and combine"],
                kind=NodeKind.EXPERT_EXCHANGE,
            )
        )
        self.block_of[EXPERT_DP_NODE] = next(iter(self.expert_dp))

    def _expert_parallel_rules(self) -> list[FollowsInputs]:
        """What the runtime can run of expert parallelism, as rules: it runs an experts module expert-parallel
        only as a whole region (``apply/moe.py``: every stacked expert weight stored split on the expert dim over
        a 1-D tensor-parallel mesh and used so), so the ops of one module take their ``"expert-region"``
        strategies (``strategies.moe.add_expert_region_strategies``) all or none (a cycle of implications), the
        ops placed replicated inside the region (the routing indices) stay replicated then, and every
        parameter the region reads split on the expert dim is stored so. With parameters sharded over the
        data-parallel axis too (FSDP/HSDP: 2-D parameters, which the region does not take) none may."""
        members: dict[str, list[tuple[str, tuple[int, ...]]]] = defaultdict(list)
        replicated: dict[str, list[tuple[str, tuple[int, ...]]]] = defaultdict(list)
        params: dict[str, set[str]] = defaultdict(set)
        regions = expert_regions(self.graph)
        for i in sorted(self.tied.canonical):
            node = self.graph.nodes[i]
            if self.tied.canonical[i] != i:
                continue
            module = next((m for m in regions if node.module == m or node.module.startswith(m + ".")), None)
            name = _node_name(i)
            strategies = self.strat_of.get(name)
            if module is None or not strategies:
                continue
            region = tuple(j for j, s in enumerate(strategies) if s.source == EXPERT_REGION)
            if region:
                members[module].append((name, region))
                spec = strategies[region[0]]
                for k, vid in enumerate(node.inputs):
                    placed = spec.input_placements[k] if k < len(spec.input_placements) else None
                    if placed is not None and placed[self.axis] == "S0":
                        pname = self._param_node_of(vid)
                        if pname is not None:
                            params[module].add(pname)
                continue
            split = tuple(
                j
                for j, s in enumerate(strategies)
                if any(
                    p[self.axis] != "R" for p in (*s.input_placements, *s.output_placements) if p is not None
                )
            )
            if split:
                replicated[module].append((name, split))
        rules: list[FollowsInputs] = []
        for module, group in members.items():
            if self.dp_shard > 1:
                rules += [FollowsInputs(name, region, ()) for name, region in group]
                continue
            for (name, region), (after, after_region) in zip(group, group[1:] + group[:1], strict=True):
                if after != name:  # region here -> region in the next one too (a cycle: all or none)
                    others = tuple(j for j in range(len(self.strat_of[after])) if j not in after_region)
                    rules.append(FollowsInputs(name, region, ((after, others),)))
            first, first_region = group[0]
            for name, split in replicated.get(module, []):  # region -> the routing indices replicated
                rules.append(FollowsInputs(first, first_region, ((name, split),)))
            for weight in sorted(params[module]):  # region -> every expert-split parameter stored so
                stored = tuple(j for j, o in enumerate(self.param_options[weight]) if o != "S0")
                rules.append(FollowsInputs(first, first_region, ((weight, stored),)))
        return rules
