"""Checkpoints of a parallelized model: sharded training state, and a consolidated HF export.

* :func:`save_checkpoint` / :func:`load_checkpoint`: model + optimizer state with
  ``torch.distributed.checkpoint`` — every rank writes its own shards, and a job with the same plan resumes
  from them (``accelerator.save_state`` cannot: it saves optimizer state from the main process only and fails
  on DTensor parameters).
* :func:`save_pretrained`: a directory that ``from_pretrained`` loads in one process — every rank joins the
  gather of the full tensors, rank 0 writes.

All of them are collective: call them on every rank.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor


def _training_state(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict:
    model_sd, optim_sd = get_state_dict(model, optimizer if optimizer is not None else [])
    state = {"model": model_sd}
    if optimizer is not None:
        state["optimizer"] = optim_sd
    return state


def save_checkpoint(model: nn.Module, optimizer: torch.optim.Optimizer | None, path: str | Path) -> None:
    """Write the sharded model (and optimizer) state under ``path`` (a directory), one file per rank."""
    dcp.save(_training_state(model, optimizer), checkpoint_id=str(path))


def load_checkpoint(model: nn.Module, optimizer: torch.optim.Optimizer | None, path: str | Path) -> None:
    """Load what :func:`save_checkpoint` wrote into a model parallelized with the same plan."""
    state = _training_state(model, optimizer)
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(
        model,
        optimizer if optimizer is not None else [],
        model_state_dict=state["model"],
        optim_state_dict=state.get("optimizer", {}),
    )


def consolidated_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Full, ordinary tensors for every entry of the model's state dict (collective: all ranks gather)."""
    out = {}
    for name, value in model.state_dict().items():
        if isinstance(value, DTensor):
            value = value.full_tensor()
        out[name] = value.detach().cpu().clone()
    return out


def save_pretrained(model: nn.Module, path: str | Path, **kwargs) -> None:
    """Write a consolidated HF checkpoint: all ranks gather, rank 0 writes ``model.save_pretrained``."""
    state = consolidated_state_dict(model)
    if not dist.is_initialized() or dist.get_rank() == 0:
        model.save_pretrained(str(path), state_dict=state, **kwargs)
    if dist.is_initialized():
        dist.barrier()
