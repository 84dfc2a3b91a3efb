"""What a plan does with each mixture-of-experts layer, in words a plan's reader looks for.

A plan is per-parameter placements; for an MoE layer the interesting decision is one per layer, over its
stacked expert weights (``gate_up_proj``/``up_proj`` and ``down_proj``, dim 0 the expert):

* ``replicated`` — (a): every rank holds and computes every expert (only data parallelism splits them);
* ``TP×n`` — (b): tensor parallelism inside every expert, as for a dense MLP: the up/gate projection split
  on its output dim and the down projection on its input dim, both the expert's intermediate dim;
* ``EP×n`` — (c): expert parallelism, whole experts per rank (the expert dim split): dispatch is local for
  the tokens a tensor-parallel group shares, combine a reduction (``apply/moe.py``), priced under the
  uniform-load assumption (``strategies.custom_rules.grouped_mm_expert_parallel_rule``);
* a weight stored split but gathered (or sliced) for use is labelled by its use, its storage in brackets
  (``replicated (stored EP×2)``: a ZeRO-style split of the experts, all-gathered where they are used);
* anything else is spelled out as ``TP×n (gate_up_proj:S2 down_proj:S2)`` (e.g. a split of the hidden dim,
  which the solver may prefer at small widths).

Routing costs that depend on which expert gets which rows assume uniform load
(:data:`hf_colossal_auto.capture.moe.UNIFORM_LOAD`).
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn

from ..capture.moe import expert_weight_dims, experts_modules


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
