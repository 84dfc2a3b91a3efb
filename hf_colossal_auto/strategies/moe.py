"""What a plan does with each mixture-of-experts layer, in words a plan's reader looks for.

A plan is per-parameter placements; for an MoE layer the interesting decision is one per layer, over its
stacked expert weights (``gate_up_proj``/``up_proj`` and ``down_proj``, dim 0 the expert):

* ``replicated`` — (a): every rank holds and computes every expert (only data parallelism splits them);
* ``TP×n`` — (b): tensor parallelism inside every expert, as for a dense MLP: the up/gate projection split
  on its output dim and the down projection on its input dim, both the expert's intermediate dim;
* ``expert-dim shards×n (gathered per use)`` — the expert dim split in storage, every expert's weight
  all-gathered where it is used (DTensor's ``_grouped_mm`` rule has no expert-dim split of a 2-D x 3-D
  product). This is a ZeRO-style storage split, not expert parallelism: (c), whole experts per rank with the
  tokens dispatched to them by all-to-all, needs a dispatch region the runtime does not have yet;
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
        return f"expert-dim shards×{tp_size} (gathered per use)"
    if all(p == f"S{intermediate[n]}" for n, p in placed.items()):
        return f"TP×{tp_size}"
    return f"TP×{tp_size} (" + " ".join(f"{n}:{p}" for n, p in placed.items()) + ")"


def moe_layer_choices(
    model: nn.Module, param_placements: Mapping[str, list[str]], tp_size: int
) -> dict[str, str]:
    """Experts module FQN -> ``"experts: <label>"`` for every MoE layer of ``model`` under a plan's
    ``param_placements`` (FQN -> per-mesh-axis placements, the tensor-parallel axis last)."""
    tp = {fqn: placements[-1] for fqn, placements in param_placements.items() if placements}
    out: dict[str, str] = {}
    for fqn, module in experts_modules(model).items():
        label = experts_choice(module, fqn, tp, tp_size)
        if label is not None:
            out[fqn] = f"experts: {label}"
    return out
