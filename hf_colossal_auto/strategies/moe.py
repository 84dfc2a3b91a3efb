"""What a plan does with each mixture-of-experts layer, in words a plan's reader looks for.

A plan is per-parameter placements; for an MoE layer the interesting decision is one per layer, over its
stacked expert weights (``gate_up_proj``/``up_proj`` and ``down_proj``, dim 0 the expert):

* ``replicated`` — (a): every rank holds and computes every expert (only data parallelism splits them);
* ``TP×n`` — (b): tensor parallelism inside every expert, as for a dense MLP: the up/gate projection split
  on its output dim and the down projection on its input dim, both the expert's intermediate dim;
* ``EP×n`` — (c): expert parallelism, whole experts per rank (the expert dim split): dispatch is local for
  the tokens a tensor-parallel group shares, combine a reduction (``apply/moe.py``), priced as that region
  runs (:func:`add_expert_region_strategies`), the grouped GEMMs' work under the uniform-load assumption;
* ``EP×n (dp)``: expert parallelism over the *data-parallel* axis (``Plan.expert_data_parallel``, DDP on a
  ``(dp, 1)`` mesh): ``E/dp`` experts per replica, each (token, expert) pair's row sent to its expert's rank
  and back by all-to-all (``apply/moe.py::expert_data_parallel_forward``), priced by
  ``solve/build/expert_exchange.py`` (``expert_dp``), not by per-op strategies;
* a weight stored split but gathered (or sliced) for use is labelled by its use, its storage in brackets
  (``replicated (stored EP×2)``: a ZeRO-style split of the experts, all-gathered where they are used);
* anything else is spelled out as ``TP×n (gate_up_proj:S2 down_proj:S2)`` (e.g. a split of the hidden dim,
  which the solver may prefer at small widths).

Routing costs that depend on which expert gets which rows assume uniform load
(:data:`hf_colossal_auto.capture.moe.UNIFORM_LOAD`) unless the plan is made with a measured routing histogram
(:class:`hf_colossal_auto.capture.moe.RoutingLoad`): then each layer's busiest expert-parallel rank.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from torch import nn

from ..capture.graph import Phase, StepGraph, ValueKind
from ..capture.moe import expert_weight_dims, experts_modules
from ..capture.op_classes import WEIGHT_COPIES
from .placements import Strategy

GROUPED_MM = "aten._grouped_mm.default"
EXPERT_REGION = "expert-region"
"""Source of the strategies :func:`add_expert_region_strategies` offers."""
_FLOATING = ("float", "bfloat", "half", "complex")


def experts_choice(module: nn.Module, fqn: str, tp_placements: Mapping[str, str], tp_size: int) -> str | None:
    """The label of one experts module's strategy from its weights' tensor-parallel placements (``"R"``,
    ``"S1"``...), or None when it has no stacked expert weight."""
    placed: dict[str, str] = {}
    intermediate: dict[str, int] = {}
    for name, _ in module.named_parameters(recurse=False):
        dims = expert_weight_dims(module, name)
        if dims is None:
            continue
        placed[name] = tp_placements.get(f"{fqn}.{name}", "R")
        intermediate[name] = dims[1] if name == "down_proj" else dims[0]
    if not placed:
        return None
    if tp_size == 1 or all(p == "R" for p in placed.values()):
        return "replicated"
    if all(p == "S0" for p in placed.values()):
        return f"EP×{tp_size}"
    if all(p == f"S{intermediate[n]}" for n, p in placed.items()):
        return f"TP×{tp_size}"
    return f"TP×{tp_size} (" + " ".join(f"{n}:{p}" for n, p in placed.items()) + ")"


def moe_layer_choices(
    model: nn.Module,
    param_placements: Mapping[str, list[str]],
    tp_size: int,
    use_placements: Mapping[str, list[str]] | None = None,
) -> dict[str, str]:
    """Experts module FQN -> ``"experts: <label>"`` for every MoE layer of ``model`` under a plan's
    ``param_placements`` (FQN -> per-mesh-axis placements, the tensor-parallel axis last). The label is what
    the experts compute with: a weight the plan gathers or slices for use (``use_placements``,
    ``Plan.param_use_placements``) counts at its use placement, and the storage is named after it when it
    differs (``"experts: replicated (stored EP×2)"``: split on the expert dim, all-gathered per use)."""
    stored = {fqn: placements[-1] for fqn, placements in param_placements.items() if placements}
    used = {**stored, **{fqn: p[-1] for fqn, p in (use_placements or {}).items() if p}}
    out: dict[str, str] = {}
    for fqn, module in experts_modules(model).items():
        label = experts_choice(module, fqn, used, tp_size)
        if label is None:
            continue
        storage = experts_choice(module, fqn, stored, tp_size)
        out[fqn] = f"experts: {label}" + (f" (stored {storage})" if storage != label else "")
    return out


def expert_regions(graph: StepGraph) -> dict[str, tuple[int, int]]:
    """Experts module FQN -> (number of experts, first forward node index) for every module of ``graph`` whose
    forward runs a grouped GEMM over stacked expert weights (rows x a view of a 3-D parameter, dim 0 the
    expert): the modules the runtime may run expert-parallel as one region (``apply/moe.py``)."""
    out: dict[str, tuple[int, int]] = {}
    for node in graph.nodes:
        if node.phase is not Phase.FORWARD or node.op != GROUPED_MM or len(node.inputs) < 2:
            continue
        vid = node.inputs[1]
        while True:  # through views and casts to the parameter
            value = graph.values[vid]
            if value.kind is ValueKind.PARAM or value.producer is None:
                break
            made = graph.nodes[value.producer]
            if not (made.is_view or made.op in WEIGHT_COPIES) or not made.inputs:
                break
            vid = made.inputs[0]
        value = graph.values[vid]
        if value.kind is ValueKind.PARAM and len(value.shape) == 3 and node.module not in out:
            out[node.module] = (int(value.shape[0]), node.index)
    return out


def expert_region_labels(graph: StepGraph, module: str, num_experts: int) -> dict[int, tuple[list, list]]:
    """Forward node index -> (input placements, output placements) on the tensor-parallel axis, for every op of
    ``module`` (and its children) as the runtime's expert-parallel region runs it on ``n`` ranks:

    * ``S0``: a parameter whose dim 0 is the expert dim (stacked weights, per-expert biases), stored split on
      it, and views or casts of one: each rank reads its own ``E/n`` experts;
    * ``P``: a floating-point value that carries a gradient (the dispatched rows, the routing weights, the
      grouped GEMMs' outputs and what is made of them): every rank holds all rows, non-zero only on the
      (token, expert) pairs routed to its experts (the others marked as transformers' expert-parallel
      sentinels), so the values sum over the ranks to the one-process value (their supports are disjoint, and
      what the region applies to them row by row maps zero to zero), and the region's output is a partial sum;
    * ``R``: the routing indices (sort, offsets, permutations), computed on every rank alike, and what enters
      the region from outside (the runtime makes the tokens and routing replicated first).

    An op reading replicated values and making partial ones splits its work, so its replicated inputs' gradients
    are partial sums, as the region's are (``to_local(grad_placements=Partial)``)."""
    prefix = module + "."
    nodes = [
        n
        for n in graph.nodes
        if n.phase is Phase.FORWARD and (n.module == module or n.module.startswith(prefix))
    ]
    needs = {
        v.id
        for v in graph.values.values()
        if v.kind is ValueKind.PARAM and (v.name is None or graph.is_trainable(v.name))
    }
    label: dict[int, str] = {}
    out: dict[int, tuple[list, list]] = {}
    for node in graph.nodes:  # gradients flow from every earlier op, not only the region's
        if node.phase is Phase.FORWARD and any(v in needs for v in node.inputs):
            needs.update(v for v in node.outputs if graph.values[v].dtype.startswith(_FLOATING))
    for node in nodes:
        ins = []
        for vid in node.inputs:
            value = graph.values[vid]
            if vid in label:
                ins.append(label[vid])
            elif value.kind is ValueKind.PARAM and len(value.shape) >= 2 and value.shape[0] == num_experts:
                ins.append("S0")
            else:
                ins.append("R")
        outs = []
        for vid in node.outputs:
            value = graph.values[vid]
            copies = node.is_view or node.op in WEIGHT_COPIES
            if copies and "S0" in ins and "P" not in ins and value.shape[:1] == (num_experts,):
                outs.append("S0")
            elif vid in needs and value.dtype.startswith(_FLOATING):
                outs.append("P")
            else:
                outs.append("R")
            label[vid] = outs[-1]
        out[node.index] = (ins, outs)
    return out


def add_expert_region_strategies(
    graph: StepGraph, strategies: dict[int, list[Strategy]], mesh_shape: Sequence[int]
) -> dict[str, list[int]]:
    """Offer, in ``strategies`` (forward node index -> strategies, changed in place), expert parallelism as the
    runtime runs it: per experts module whose experts the 1-D tensor-parallel axis divides, every op of the
    module that :func:`expert_region_labels` places other than replicated gets one strategy of source
    ``"expert-region"`` with those placements, and loses the strategies that read an expert-split parameter
    split on the expert dim otherwise (DTensor's transpose of a weight stored split on the expert dim): a plan
    using the experts split on the expert dim *is* the region at run time (``apply/moe.py``).

    The inputs and outputs of the region are then priced by the edges like any op's: the tokens and routing
    weights redistributed to replicated on the way in (their gradients partial sums, reduced where they were
    made), the output a partial sum reduced where the plan needs it. The builder prices the grouped GEMMs'
    work (``E/n`` experts, under uniform load ``S/n`` rows) and ties every op of a module to the same choice.
    Returns experts module FQN -> the node indices given a region strategy."""
    if len(mesh_shape) != 1 or mesh_shape[0] <= 1:
        return {}
    n = int(mesh_shape[0])
    out: dict[str, list[int]] = {}
    for module, (num_experts, _first) in expert_regions(graph).items():
        if num_experts % n:
            continue
        members = []
        for i, (ins, outs) in expert_region_labels(graph, module, num_experts).items():
            if i not in strategies or all(p == "R" for p in (*ins, *outs)):
                continue
            split_params = {
                k
                for k, p in enumerate(ins)
                if p == "S0" and graph.values[graph.nodes[i].inputs[k]].kind is ValueKind.PARAM
            }
            kept = [
                s
                for s in strategies[i]
                if not any(
                    k < len(s.input_placements)
                    and s.input_placements[k] is not None
                    and s.input_placements[k][0] == "S0"
                    for k in split_params
                )
            ]
            region = Strategy(tuple((p,) for p in ins), tuple((p,) for p in outs), EXPERT_REGION)
            strategies[i] = [*kept, region]
            members.append(i)
        if members:
            out[module] = members
    return out
