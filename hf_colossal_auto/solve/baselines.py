"""Hand-written tensor-parallel recipes the planner is compared against, as parameter placements: Megatron-LM's
column-then-row attention and MLP, and HF-style ``tp_plan`` dicts. :func:`.planner.evaluate_plan` prices them
with the same cost model as the planner's own plans.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping

from torch import nn

from ..capture.module_kinds import projection_dims
from ..capture.moe import expert_weight_dims, experts_modules

_COLWISE_NAMES = (
    "q_proj",
    "k_proj",
    "v_proj",
    "gate_proj",
    "up_proj",
    "query",
    "key",
    "value",
    "c_fc",
    "fc1",
    "wi",
    "wi_0",
    "wi_1",
    "q",
    "k",
    "v",
    "intermediate.dense",
)
_ROWWISE_NAMES = ("o_proj", "down_proj", "attention.output.dense", "output.dense", "fc2", "wo", "o", "c_proj")


def expert_tp_placements(model: nn.Module) -> dict[str, str]:
    """Tensor parallelism inside every expert (strategy (b) of an MoE layer), as for a dense MLP: the
    up/gate projection split on its output (intermediate) dim, the down projection on its input
    (intermediate) dim. ``gate_up_proj`` packs gate and up along that dim, so a plain split gives one rank
    the gate half; DTensor then gathers the activation before ``chunk`` (correct, and priced), as it does
    for GPT-2's fused ``c_attn``."""
    out: dict[str, str] = {}
    for fqn, module in experts_modules(model).items():
        for name, _ in module.named_parameters(recurse=False):
            dims = expert_weight_dims(module, name)
            if dims is not None:
                out[f"{fqn}.{name}"] = f"S{dims[0] if name != 'down_proj' else dims[1]}"
    return out


def megatron_placements(model: nn.Module) -> dict[str, str]:
    """Megatron-style TP of every attention and MLP: column-parallel in, row-parallel out (Linear and Conv1D);
    MoE experts get tensor parallelism inside every expert (:func:`expert_tp_placements`, what Megatron-LM
    does with expert-model-parallel size 1). Routers stay replicated."""
    out: dict[str, str] = expert_tp_placements(model)
    for fqn, module in model.named_modules():
        dims = projection_dims(module)  # (out dim, in dim) of its weight; None: no projection
        if dims is None:
            continue
        leaf = fqn.rsplit(".", 1)[-1]
        tail2 = ".".join(fqn.rsplit(".", 2)[-2:])
        col_dim, row_dim = dims
        is_attn_proj = leaf == "c_proj" and ".attn." in f".{fqn}."
        if leaf == "c_attn" or leaf in _COLWISE_NAMES or tail2 in _COLWISE_NAMES:
            if leaf in ("c_proj",):
                continue
            out[f"{fqn}.weight"] = f"S{col_dim}"
            if getattr(module, "bias", None) is not None:
                out[f"{fqn}.bias"] = "S0"
        elif leaf in _ROWWISE_NAMES or tail2 in _ROWWISE_NAMES or is_attn_proj:
            out[f"{fqn}.weight"] = f"S{row_dim}"
            if getattr(module, "bias", None) is not None:
                out[f"{fqn}.bias"] = "R"
    return out


def tp_plan_placements(model: nn.Module, tp_plan: Mapping[str, str]) -> dict[str, str]:
    """Parameter placements of a HF-style ``tp_plan`` (module pattern -> "colwise" | "rowwise" | ...)."""
    out: dict[str, str] = {}
    names = dict(model.named_modules())
    experts = experts_modules(model)
    prefixes = ["", *(n + "." for n, m in names.items() if m is not model and n and "." not in n)]
    for pattern, style in tp_plan.items():
        out.update(_expert_tp_plan_placements(model, prefixes, pattern, style))
        for fqn, module in names.items():
            if not any(fnmatch.fnmatchcase(fqn, p + pattern) for p in prefixes):
                continue
            dims = projection_dims(module)
            base = style.split("_", 1)[-1] if style.startswith("packed_") else style
            if isinstance(module, nn.Embedding):
                out[f"{fqn}.weight"] = "S1" if base in ("colwise", "embedding_colwise") else "S0"
                continue
            if dims is None or fqn in experts:  # experts: their parameters are named
                continue
            col, row = dims
            if base in ("colwise", "colwise_rep", "local_colwise"):
                out[f"{fqn}.weight"] = f"S{col}"
                if getattr(module, "bias", None) is not None:
                    out[f"{fqn}.bias"] = "S0"
            elif base in ("rowwise", "rowwise_rep", "local_rowwise"):
                out[f"{fqn}.weight"] = f"S{row}"
            else:
                raise ValueError(
                    f"tp_plan style {style!r} for {pattern!r} is not supported; use colwise or rowwise"
                )
    return out


# HF styles for stacked expert weights: split inside every expert, or whole experts per rank (expert parallel).
_EXPERT_STYLES = {"colwise": 0, "packed_colwise": 0, "rowwise": 1, "grouped_gemm": None}


def _expert_tp_plan_placements(
    model: nn.Module, prefixes: list[str], pattern: str, style: str
) -> dict[str, str]:
    """Placements a HF ``tp_plan``/``ep_plan`` entry gives stacked expert weights (``...experts.gate_up_proj``
    are parameters, not modules): colwise splits the output dim, rowwise the input dim, ``grouped_gemm`` (the
    ``ep_plan`` style) the expert dim. Entries for the experts module itself (``moe_tp_experts``,
    ``ep_dispatch_experts``: how HF's runtime wraps it) name no parameter and place nothing."""
    out: dict[str, str] = {}
    if style not in _EXPERT_STYLES:
        return out
    for fqn, module in experts_modules(model).items():
        for name, _ in module.named_parameters(recurse=False):
            full = f"{fqn}.{name}"
            dims = expert_weight_dims(module, name)
            if dims is None or not any(fnmatch.fnmatchcase(full, p + pattern) for p in prefixes):
                continue
            which = _EXPERT_STYLES[style]
            out[full] = "S0" if which is None else f"S{dims[which]}"
    return out


def _attention_heads(model: nn.Module) -> int | None:
    config = getattr(model, "config", None)
    for attr in ("num_attention_heads", "n_head", "num_heads"):
        heads = getattr(config, attr, None)
        if heads:
            return heads
    return None


def _largest_tp(n: int, per_node: int, model: nn.Module) -> int:
    config = getattr(model, "config", None)
    heads = _attention_heads(model)
    kv = getattr(config, "num_key_value_heads", None) or heads
    best = 1
    for t in range(1, min(n, per_node) + 1):
        if n % t == 0 and (heads is None or (heads % t == 0 and kv % t == 0)):
            best = t
    return best


def tensor_parallel_modules(model: nn.Module, placements: Mapping[str, str]) -> tuple[set[str], set[str]]:
    """(modules holding a parameter ``placements`` shards over tp, the row-parallel ones among them): the borders
    of the tensor-parallel regions a Megatron-SP layout keeps the sequence-sharded ops between, and the modules
    whose partial output it reduce-scatters (a Linear / Conv1D weight split on its input features)."""
    sharded: set[str] = set()
    rows: set[str] = set()
    modules = dict(model.named_modules())
    for fqn, placement in placements.items():
        if placement == "R":
            continue
        module, _, leaf = fqn.rpartition(".")
        sharded.add(module)
        dims = projection_dims(modules.get(module))
        if leaf == "weight" and dims is not None and placement == f"S{dims[1]}":
            rows.add(module)
    return sharded, rows
