"""Training-state checkpoints (``torch.distributed.checkpoint``) that any plan writes and any plan reads,
pipeline stages included.

Why a module of its own: under pipeline stages each rank holds whole tensors of some stages only (the cut
model's state dict is its stages', under the full model's names), so DCP can write them as they are — each
rank its stages, the data-parallel replicas deduplicated by DCP's planner, the union the whole model. Two
things make such a checkpoint readable under another plan (and a non-pipelined one readable under stages):

* The optimizer's state dict is *flattened* (``StateDictOptions(flatten_optimizer_state_dict=True)``: every
  entry keyed by its parameter's name, ``state.<fqn>.exp_avg``, ``param_groups.<fqn>.lr``). The nested form
  holds each param group's list of names, which differs between a pipeline's ranks (DCP would keep one rank's
  list); flattened, each rank writes and reads only its parameters' entries. A job without stages keeps writing
  the nested form it always wrote; loading reads whichever form the checkpoint holds (:func:`saved_format`),
  so old checkpoints load too.
* A head tied to the embedding is one parameter in one process, whose optimizer state is saved under the
  embedding's name (the first of its names). A pipeline rank holding the head without the embedding (the last
  stage on another rank than the first) has that parameter under the head's name: its optimizer entries are
  renamed to the embedding's on the way out and back on the way in (:func:`optimizer_renames`). The first and
  the last stage write the same values under the same names (the tie's gradients are summed over both).

The model's entries need no renaming: one process's state dict holds both names of a tie, and each stage's
rank writes the one it holds.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch
from torch import nn

FLAT, NESTED = "flat", "nested"
"""The two forms of an optimizer state dict in a checkpoint (see the module docstring)."""

_NESTED_KEY = re.compile(r"(^|\.)param_groups\.\d+\.params$")
_FLAT_KEY = re.compile(r"(^|\.)param_groups\.")


def optimizer_renames(model: nn.Module) -> dict[str, str]:
    """``{name on this rank: name in the checkpoint}`` for the optimizer entries of a pipelined model whose
    rank holds the tied head but not the embedding; empty otherwise (nothing to rename)."""
    from .pipeline import is_pipelined, pipeline_runner

    if not is_pipelined(model):
        return {}
    runner = pipeline_runner(model)
    if not runner.tied or runner.holds_first:
        return {}
    tied = {id(p) for p in runner.tied}
    head, embedding = runner.layout.head, runner.layout.embedding
    return {
        f"{head}.{name}": f"{embedding}.{name}"
        for name, param in model.get_submodule(head).named_parameters()
        if id(param) in tied
    }


def _rename_flat(state: dict[str, Any], renames: dict[str, str]) -> dict[str, Any]:
    """Keys ``state.<fqn>.<entry>`` / ``param_groups.<fqn>.<entry>`` with ``fqn`` renamed."""
    if not renames:
        return state
    out = {}
    for key, value in state.items():
        for old, new in renames.items():
            for section in ("state", "param_groups"):
                if key.startswith(f"{section}.{old}."):
                    key = f"{section}.{new}.{key[len(section) + len(old) + 2 :]}"
                    break
        out[key] = value
    return out


def _rename_nested(state: dict[str, Any], renames: dict[str, str]) -> dict[str, Any]:
    """``{"state": {fqn: ...}, "param_groups": [{"params": [fqn, ...]}]}`` with the names renamed."""
    if not renames or "state" not in state:
        return state
    return {
        "state": {renames.get(k, k): v for k, v in state["state"].items()},
        "param_groups": [
            {**g, "params": [renames.get(n, n) for n in g["params"]]} for g in state["param_groups"]
        ],
    }


def rename_optimizer_state(state: dict[str, Any], renames: dict[str, str]) -> dict[str, Any]:
    """An optimizer state dict (either form) with its parameter names mapped through ``renames``."""
    return _rename_nested(state, renames) if "state" in state else _rename_flat(state, renames)


def checkpoint_state(
    model: nn.Module, optimizers: list[torch.optim.Optimizer], form: str | None = None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The model's and the optimizers' state dicts as a checkpoint holds them (names of the whole model, the
    tied head's optimizer entries under the embedding's name), in the optimizer ``form`` asked (default: flat
    for a pipelined model, which needs it to save, nested otherwise, as earlier checkpoints; a pipelined model
    reads a nested checkpoint through a nested template: each rank then reads the saving job's whole list of
    names per param group, and keeps its own)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    from .pipeline import PipelineRuntimeError, is_pipelined

    pipelined = is_pipelined(model)
    if form is None:
        form = FLAT if pipelined else NESTED
    options = StateDictOptions(flatten_optimizer_state_dict=form == FLAT)
    try:
        model_sd, optim_sd = get_state_dict(model, optimizers, options=options)
    except NotImplementedError as exc:  # torch flattens tensor, int, float and dict states only
        raise PipelineRuntimeError(
            f"the optimizer state of {[type(o).__name__ for o in optimizers]} cannot be checkpointed per "
            f"pipeline stage ({exc}); checkpoint it without pipeline stages, or use an optimizer whose state "
            "holds tensors and numbers (AdamW, SGD)"
        ) from exc
    return model_sd, rename_optimizer_state(optim_sd, optimizer_renames(model))


def restore_state(
    model: nn.Module,
    optimizers: list[torch.optim.Optimizer],
    model_sd: dict[str, Any],
    optim_sd: dict[str, Any],
) -> None:
    """``set_state_dict`` of what :func:`checkpoint_state` gave and DCP filled, names back to this rank's."""
    from torch.distributed.checkpoint.state_dict import set_state_dict

    renames = {new: old for old, new in optimizer_renames(model).items()}
    set_state_dict(
        model,
        optimizers,
        model_state_dict=model_sd,
        optim_state_dict=rename_optimizer_state(optim_sd, renames) if optim_sd else {},
    )


def saved_format(path: str | Path, prefix: str = "optimizer") -> str | None:
    """The form of the optimizer state under ``prefix`` in the DCP checkpoint at ``path`` (flat or nested),
    None when it holds none (read from its metadata, through the safe reader)."""
    from .checkpoint import SafeFileSystemReader

    keys = SafeFileSystemReader(str(path)).read_metadata().state_dict_metadata
    mine = [k[len(prefix) + 1 :] for k in keys if k.startswith(f"{prefix}.")]
    if any(_NESTED_KEY.search(k) for k in mine):
        return NESTED
    if any(_FLAT_KEY.match(k) or k.startswith("state.") for k in mine):
        return FLAT
    return None
