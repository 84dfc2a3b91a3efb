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


def load_stage_weights(model: nn.Module, path: str | Path) -> Any:
    """Fill a pipelined ``model`` (already cut to this rank's stages) from a ``save_pretrained`` directory
    (what the Trainer's ``load_best_model_at_end`` and a ``save_only_model`` resume read): each rank reads its
    stages' tensors only. Strict: the checkpoint must hold exactly the names the whole model saves (read off it
    before the cut); a head tied to the embedding on a rank without the embedding is read from the embedding's
    key, which is where a checkpoint keeps a tie. Returns the loader's report."""
    from .pipeline_save import _SAVED
    from .pretrained.load import PretrainedLoadError, _read_headers, checkpoint_files, load_pretrained

    names = getattr(model, _SAVED, None)
    directory, files = checkpoint_files(path)
    keys = set(_read_headers(directory, files))
    if isinstance(names, list) and keys != set(names):
        missing, unexpected = sorted(set(names) - keys), sorted(keys - set(names))
        raise PretrainedLoadError(
            f"the checkpoint {path} does not hold the names {type(model).__name__} saves (missing {missing[:6]}, "
            f"unexpected {unexpected[:6]}); a pipelined model loads checkpoints of its own architecture as "
            "save_pretrained writes them. Load it without pipeline stages, or convert it with from_pretrained "
            "and save_pretrained first."
        )
    report = load_pretrained(model, directory, strict=False)
    tied = optimizer_renames(model)  # head name -> embedding name, where the embedding is not here
    left = [n for n in report.missing if n not in tied]
    if left:
        raise PretrainedLoadError(f"the checkpoint {path} lacks {left[:6]}, which this pipeline rank holds")
    _fill_tied_head(model, directory, files, tied)
    return report


def _fill_tied_head(model: nn.Module, directory: Path, files: list[str], tied: dict[str, str]) -> None:
    """The tied head's values from the embedding's key (read whole: it is this rank's tensor)."""
    from .pretrained.load import _read_headers
    from .safetensors_io import SafetensorsFile

    if not tied:
        return
    sources = _read_headers(directory, files)
    params = dict(model.named_parameters())
    for head, embedding in tied.items():
        with SafetensorsFile(directory / sources[embedding].file) as opened, torch.no_grad():
            value = opened.get_slice(embedding)[...]
            params[head].copy_(value.to(dtype=params[head].dtype))


def load_positional_optimizer_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, saved: dict, source: str
) -> None:
    """A one-process ``optimizer.state_dict()`` (parameters numbered in the order of its param groups: the
    Trainer's ``optimizer.pt``, accelerate's ``optimizer.bin``) into this pipeline rank's ``optimizer``.

    A one-process optimizer built by the same code as this one holds, in each group, the whole model's
    parameters that this job's ranks hold in that group, in model order. So the pipeline's ranks share which of
    their parameters (by name, the tied head under the embedding's) each group holds; the union, in the whole
    model's parameter order (recorded before the cut), is the saved group's list, position by position. A group
    of another length or a state tensor of another shape is an error that says so."""
    from .pipeline import pipeline_runner

    runner = pipeline_runner(model)
    renames = optimizer_renames(model)
    names = {id(p): renames.get(n, n) for n, p in model.named_parameters()}
    shapes = {names[id(p)]: tuple(p.shape) for p in model.parameters()}
    mine = [[names[id(p)] for p in group["params"]] for group in optimizer.param_groups]
    every: list[Any] = [None] * torch.distributed.get_world_size(runner.group)
    torch.distributed.all_gather_object(every, mine, group=runner.group)
    order = {n: i for i, n in enumerate(model._hf_colossal_auto_parameter_order)}
    saved_groups = saved.get("param_groups", [])
    if any(len(g) != len(saved_groups) for g in every):
        raise ValueError(
            f"{source} has {len(saved_groups)} param groups, this job's optimizer {len(mine)}: it can only be "
            "matched to an optimizer built the same way (same groups, same parameter order)"
        )
    state: dict[int, Any] = {}
    local_groups = []
    number = 0
    for g, saved_group in enumerate(saved_groups):
        union = sorted({n for ranks in every for n in ranks[g]}, key=lambda n: order.get(n, len(order)))
        if len(union) != len(saved_group["params"]):
            raise ValueError(
                f"{source} has a param group of {len(saved_group['params'])} parameters where the whole model "
                f"built this way has {len(union)}: build the optimizer as the saving job did"
            )
        position = dict(zip(union, saved_group["params"], strict=True))
        local = []
        for fqn in mine[g]:
            entry = saved.get("state", {}).get(position[fqn])
            if entry is not None:
                for key, value in entry.items():
                    if (
                        isinstance(value, torch.Tensor)
                        and value.dim() > 0
                        and tuple(value.shape) != shapes[fqn]
                    ):
                        raise ValueError(
                            f"{source}: {key} of parameter #{position[fqn]} has shape {tuple(value.shape)}, but "
                            f"the parameter in that place, {fqn}, has {shapes[fqn]}; build the optimizer as the "
                            "saving job did"
                        )
                state[number] = entry
            local.append(number)
            number += 1
        local_groups.append({**saved_group, "params": local})
    optimizer.load_state_dict({"state": state, "param_groups": local_groups})
