"""Hand-written tensor-parallel recipes the planner is compared against, as parameter placements: Megatron-LM's
column-then-row attention and MLP, and HF-style ``tp_plan`` dicts. :func:`.planner.evaluate_plan` prices them
with the same cost model as the planner's own plans.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping

from torch import nn

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


def _linear_dims(model: nn.Module, module_fqn: str) -> tuple[int, int] | None:
    """(out-features dim, in-features dim) of a module's weight: (0, 1) for nn.Linear, (1, 0) for GPT-2's Conv1D."""
    module = dict(model.named_modules()).get(module_fqn)
    if isinstance(module, nn.Linear):
        return 0, 1
    if type(module).__name__ == "Conv1D":
        return 1, 0
    return None


def megatron_placements(model: nn.Module) -> dict[str, str]:
    """Megatron-style TP of every attention and MLP: column-parallel in, row-parallel out (Linear and Conv1D)."""
    out: dict[str, str] = {}
    for fqn, module in model.named_modules():
        dims = _linear_dims(model, fqn)
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
    prefixes = ["", *(n + "." for n, m in names.items() if m is not model and n and "." not in n)]
    for pattern, style in tp_plan.items():
        for fqn, module in names.items():
            if not any(fnmatch.fnmatchcase(fqn, p + pattern) for p in prefixes):
                continue
            dims = _linear_dims(model, fqn)
            base = style.split("_", 1)[-1] if style.startswith("packed_") else style
            if isinstance(module, nn.Embedding):
                out[f"{fqn}.weight"] = "S1" if base in ("colwise", "embedding_colwise") else "S0"
                continue
            if dims is None:
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
