"""Megatron-LM's tensor parallelism on local shards: which attention / MLP modules of the blocks can run every op
between their column-parallel inputs and row-parallel outputs on this rank's shard, with no DTensor op, and the
strategies those ops then run.

Why: the runtime runs a tensor-parallel model on DTensors, and DTensor's dispatch costs the host several times an
eager op's (about 60 us against 14 us per op on an H200 host). At cluster scale that host cost is what keeps
pipeline stages from paying and caps MFU. torchtitan, HF and Megatron-LM run the ops between a column-parallel and
a row-parallel projection on local tensors; only the module's borders touch DTensor: its inputs made replicated
and taken local on entry (their gradient an all-reduce in backward: Megatron's ``f``), its outputs wrapped as
partial sums and reduced to the placement the plan expects on exit (Megatron's ``g``). The runtime does that for
the modules a plan lists in :attr:`~hf_colossal_auto.plan.Plan.local_modules`; the planner prices their ops as
eager ops and pins them to the strategies local execution runs (:func:`local_tensor_parallel_layout`), which move
no more data than DTensor would on the same placements: the borders' collectives are priced as before.

Which modules, by data flow rather than names: every child of a block holding a parameter Megatron's layout shards
(:func:`~.baselines.megatron_placements`) is a candidate; its parameters are given Megatron's placements (the
others in it replicated), its inputs from outside it arrive replicated, and every forward op inside it, in order,
must have a strategy reading its inputs exactly as they arrive (a parameter stored replicated may be read as a
partial sum: a row-parallel bias, which the runtime adds once) — the op then follows its input's shard with no
redistribution. Its outputs read outside it must be partial sums (the row-parallel projection's). That refuses
GPT-2's attention (``c_attn`` packs q, k, v and splits them by the global width: no strategy splits a sharded
dim), and what the local forward would compute wrongly: a random op inside (dropout draws per rank, not the
global mask), experts (their own regions), heads or key/value heads the tensor-parallel size does not divide.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from torch import nn

from .._torch_compat import dtensor_random_ops
from ..capture.graph import Phase, StepGraph, ValueKind
from ..capture.module_kinds import drawn_dropouts
from ..capture.moe import experts_modules
from ..strategies.placements import Strategy
from .baselines import _attention_heads, megatron_placements
from .context_parallel_math import _kernel_dropout
from .tied import TiedGraph


@dataclass(frozen=True)
class LocalLayout:
    """What running some modules on local shards means for one traced step on one tensor-parallel size."""

    modules: tuple[str, ...] = ()
    """The real modules (every block's, sorted) that run on local shards: :attr:`Plan.local_modules`."""
    params: Mapping[str, str] = field(default_factory=dict)
    """Parameter FQN (every real one inside those modules) -> its tensor-parallel placement (Megatron's)."""
    pins: Mapping[int, list[Strategy]] = field(default_factory=dict)
    """Forward node (every traced copy) -> the one strategy local execution runs it with."""
    nodes: frozenset[int] = frozenset()
    """Forward nodes priced as eager ops (no DTensor dispatch): the ops inside the modules."""
    refused: Mapping[str, str] = field(default_factory=dict)
    """Traced candidate module -> why it cannot run on local shards."""

    def __bool__(self) -> bool:
        return bool(self.modules)


def _inside(module: str, outer: str) -> bool:
    return module == outer or module.startswith(outer + ".")


def _spec(placements: tuple | None) -> str | None:
    return None if placements is None else placements[0]


def _candidates(
    model: nn.Module, graph: StepGraph, blocks: Iterable[str], megatron: Mapping[str, str]
) -> list[str]:
    """The children of the traced blocks that hold a parameter Megatron's layout shards."""
    traced = {n.module for n in graph.nodes if n.phase is Phase.FORWARD}
    sharded = [fqn.rpartition(".")[0] for fqn, p in megatron.items() if p != "R"]
    out = []
    for block in blocks:
        if not any(_inside(m, block) for m in traced):
            continue
        children = {f"{block}.{name}" for name, _ in model.get_submodule(block).named_children()}
        out.extend(sorted(c for c in children if any(_inside(s, c) for s in sharded)))
    return out


def _model_refusal(model: nn.Module, tp: int) -> str | None:
    """Why no module of ``model`` runs on local shards at ``tp`` (None: nothing model-wide stops it)."""
    if tp < 2:
        return "no tensor-parallel axis"
    heads = _attention_heads(model)
    kv = getattr(getattr(model, "config", None), "num_key_value_heads", None) or heads
    if heads and (heads % tp or kv % tp):
        return f"{heads} heads / {kv} key-value heads do not split over tp={tp}"
    return None


def _module_refusal(model: nn.Module, graph: StepGraph, module: str, nodes: list[int]) -> str | None:
    """Why ``module`` would compute something else on local shards: experts, or a random op inside it."""
    if any(_inside(fqn, module) for fqn in experts_modules(model)):
        return "holds MoE experts"
    drawn = drawn_dropouts(model.get_submodule(module))  # what the runtime refuses (check_local_modules)
    if drawn:
        return f"dropout {module}: {drawn[0]} draws per rank"
    random_ops = {str(op) for op in dtensor_random_ops()}
    for i in nodes:
        node = graph.nodes[i]
        if node.op in random_ops:
            return f"random op {node.op} draws per rank"
        if "scaled_dot_product" in node.op and _kernel_dropout(node) > 0:
            return f"attention dropout {_kernel_dropout(node)} draws per rank"
    return None


def _follow(
    graph: StepGraph,
    strategies: Mapping[int, list[Strategy]],
    nodes: list[int],
    params: Mapping[str, str],
) -> tuple[dict[int, Strategy], str | None]:
    """Each op of ``nodes`` (in order) given the strategy that reads its inputs as they arrive — from outside the
    module replicated, parameters as ``params`` places them, values made inside as their op made them — and the
    placement of each value made; a reason where an op has no such strategy or an output leaves unreduced."""
    mine = set(nodes)
    made: dict[int, str] = {}
    chosen: dict[int, Strategy] = {}
    for i in nodes:
        node = graph.nodes[i]
        arriving: list[tuple[str, bool]] = []
        for vid in node.inputs:
            value = graph.values[vid]
            if vid in made:
                arriving.append((made[vid], False))
            elif value.kind is ValueKind.PARAM and value.name:
                arriving.append((params.get(value.name, "R"), True))
            else:
                arriving.append(("R", False))
        options = strategies.get(i) or []
        if not options:  # no rule: the op runs replicated
            if any(p != "R" for p, _ in arriving):
                return chosen, f"{node.op} in {node.module} has no strategy for sharded inputs"
            made.update(dict.fromkeys(node.outputs, "R"))
            continue
        exact = [s for s in options if _reads_as_arriving(s, arriving)]
        if not exact and node.is_view and [p for p, _ in arriving] == ["P"] and len(node.outputs) == 1:
            # a view of a partial sum is the partial sum viewed: what a local view of the local sum computes
            # (GPT-2's Conv1D unflattens by ``view``, which DTensor's rules offer no partial input)
            exact = [Strategy((("P",),), (("P",),), "custom")]
        if not exact:
            placed = ", ".join(p for p, _ in arriving)
            return chosen, f"{node.op} in {node.module} cannot run on its inputs' shards ({placed})"
        unreduced = [s for s in exact if not any(_spec(o) == "P" for o in s.output_placements)]
        pick = (unreduced or exact)[0]
        chosen[i] = pick
        for vid, out in zip(node.outputs, pick.output_placements, strict=False):
            made[vid] = _spec(out) or "R"
    readers: dict[int, list[int]] = {}
    for n in graph.nodes:
        if n.phase is Phase.FORWARD and n.index not in mine:
            for vid in n.inputs:
                readers.setdefault(vid, []).append(n.index)
    for vid, placement in made.items():
        if vid in readers and placement != "P":
            return (
                chosen,
                f"an output read outside it is {placement}, not a partial sum of a row-parallel projection",
            )
        if vid in graph.output_values:
            return chosen, "it makes a model output"
    return chosen, None


def _reads_as_arriving(strategy: Strategy, arriving: list[tuple[str, bool]]) -> bool:
    for k, (placement, is_param) in enumerate(arriving):
        want = _spec(strategy.input_placements[k]) if k < len(strategy.input_placements) else None
        if want is None or want == placement or (is_param and placement == "R" and want == "P"):
            continue
        return False
    return True


def local_tensor_parallel_layout(
    model: nn.Module,
    graph: StepGraph,
    strategies: Mapping[int, list[Strategy]],
    blocks: Iterable[str],
    tp: int,
) -> LocalLayout:
    """Which attention / MLP children of ``blocks`` run on local shards at ``tp`` (see the module docstring), the
    strategies their ops then run, and Megatron's placements of their parameters. ``strategies``: the step's
    per-node strategies on the tensor-parallel axis. A module refused in one traced copy of a folded run is
    refused in all (the copies share their ILP nodes)."""
    reason = _model_refusal(model, tp)
    megatron = megatron_placements(model)
    candidates = _candidates(model, graph, blocks, megatron)
    if reason is not None:
        return LocalLayout(refused=dict.fromkeys(candidates, reason))
    forward = [n for n in graph.nodes if n.phase is Phase.FORWARD]
    refused: dict[str, str] = {}
    kept: dict[str, tuple[dict[int, Strategy], dict[str, str]]] = {}
    for module in candidates:
        nodes = [n.index for n in forward if _inside(n.module, module)]
        params = {
            f"{module}.{name}": megatron.get(f"{module}.{name}", "R")
            for name, _ in model.get_submodule(module).named_parameters()
        }
        why = _module_refusal(model, graph, module, nodes)
        if why is None:
            chosen, why = _follow(graph, strategies, nodes, params)
        if why is not None:
            refused[module] = why
            continue
        kept[module] = (chosen, params)
    tied = TiedGraph.build(graph)
    bad = {
        tied.canonical[i] for i in tied.canonical if any(_inside(graph.nodes[i].module, m) for m in refused)
    }
    for module in list(kept):
        if any(tied.canonical[i] in bad for i in kept[module][0]):
            refused[module] = "another traced copy of it is refused"
            del kept[module]
    real: set[str] = set()
    params: dict[str, str] = {}
    pins: dict[int, list[Strategy]] = {}
    for module, (chosen, module_params) in kept.items():
        real.update(_real_modules(graph, module))
        for fqn, placement in module_params.items():
            for m in _real_modules(graph, module):
                params[m + fqn[len(module) :]] = placement
        pins.update({i: [s] for i, s in chosen.items()})
    return LocalLayout(tuple(sorted(real)), params, pins, frozenset(pins), refused)


def _real_modules(graph: StepGraph, module: str) -> list[str]:
    """A representative's module stands for the same module in every block of its run (the writer's rule)."""
    for run in graph.block_runs:
        rep = run.representative
        if _inside(module, rep):
            return [b + module[len(rep) :] for b in run.all_blocks]
    return [module]
