"""Checkpoints of a parallelized model: sharded training state, and a consolidated HF export.

* :func:`save_checkpoint` / :func:`load_checkpoint`: model + optimizer state with
  ``torch.distributed.checkpoint`` — every rank writes its own shards, and a job resumes from them under the
  same plan or another one (other placements, FSDP instead of TP, another world size, one process without a
  plan): DCP stores each shard with its global offsets and reads back whatever slices the loading job's
  tensors cover (``accelerator.save_state`` cannot: it saves optimizer state from the main process only and
  fails on DTensor parameters). A single-process optimizer state (the Trainer's ``optimizer.pt``,
  accelerate's ``optimizer.bin``) loads into a parallelized job with :func:`load_full_optimizer_state`.
* :func:`save_pretrained`: a directory that ``from_pretrained`` loads in one process, streamed — tensor by tensor
  (split ones in blocks) to rank 0, which writes them into each output file as they arrive
  (:func:`.pretrained.save_pretrained`); :func:`.pretrained.load_pretrained` reads such a directory (or any HF
  safetensors checkpoint) back into a planned model, each rank reading its own slices.

All of them are collective: call them on every rank.
"""

from __future__ import annotations

import contextlib
import pickle
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.tensor import DTensor

from .._torch_compat import dcp_metadata_path
from .pretrained import SaveReport
from .pretrained import save_pretrained as stream_save_pretrained


class UnsafeCheckpointError(pickle.UnpicklingError):
    """A checkpoint's metadata names something other than DCP's own metadata classes: loading it would run code."""


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's ``.metadata`` allowing only what DCP writes there: its metadata classes, ``torch.Size``,
    dtypes, layouts and paths. ``pickle.load`` (what DCP's reader does) would call anything a crafted file names."""

    def __init__(self, file: Any, path: str) -> None:
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        found = super().find_class(module, name)
        if module.startswith("torch.distributed.checkpoint.") and isinstance(found, type):
            return found
        if module == "torch" and (found is torch.Size or isinstance(found, torch.dtype)):
            return found
        if (module, name) in _ALLOWED_GLOBALS:
            return found
        raise UnsafeCheckpointError(
            f"{self.path} names {module}.{name}, which a checkpoint's metadata never holds: loading it would run "
            "code from the checkpoint directory, so it is refused. Resume only from checkpoints you wrote."
        )


_ALLOWED_GLOBALS = {
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
}


class SafeFileSystemReader(FileSystemReader):
    """DCP's file-system reader whose metadata is read by :class:`_MetadataUnpickler` (every load of ours
    passes it): a crafted ``.metadata`` is refused with :class:`UnsafeCheckpointError` instead of run."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = dcp_metadata_path(self, kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as stream:
            metadata = _MetadataUnpickler(stream, str(path)).load()
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def load_sharded(state: dict, path: str | Path) -> None:
    """``dcp.load`` of ``state`` from ``path`` through :class:`SafeFileSystemReader`. The metadata is read once
    before, on every rank: DCP's collective load would wrap a refusal in its own exception, and the user should
    see which file was refused and why."""
    reader = SafeFileSystemReader(str(path))
    reader.read_metadata()
    with one_process_is_fine():
        dcp.load(state, storage_reader=reader)


@contextlib.contextmanager
def one_process_is_fine() -> Iterator[None]:
    """DCP warns when it loads without a process group; one process reading a parallel job's shards is meant."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _training_state(
    model: nn.Module, optimizer: torch.optim.Optimizer | None, form: str | None = None
) -> dict:
    """DCP's state of ``model`` (and ``optimizer``) as a checkpoint holds it, whatever the plan (pipeline
    stages included: :func:`.pipeline_checkpoint.checkpoint_state`); ``form``: the optimizer state's form to
    read (a checkpoint's), default the one to write."""
    from .pipeline_checkpoint import checkpoint_state

    model_sd, optim_sd = checkpoint_state(model, [optimizer] if optimizer is not None else [], form)
    state = {"model": model_sd}
    if optimizer is not None:
        state["optimizer"] = optim_sd
    return state


def save_checkpoint(model: nn.Module, optimizer: torch.optim.Optimizer | None, path: str | Path) -> None:
    """Write the sharded model (and optimizer) state under ``path`` (a directory), one file per rank (under
    pipeline stages each rank its stages' tensors)."""
    dcp.save(_training_state(model, optimizer), checkpoint_id=str(path))


def load_checkpoint(model: nn.Module, optimizer: torch.optim.Optimizer | None, path: str | Path) -> None:
    """Load what :func:`save_checkpoint` wrote, into a model parallelized with the same plan or another one
    (pipeline stages or not), or not at all (one process, plain tensors). DCP reshards: each rank reads the
    slices its tensors cover."""
    from .pipeline_checkpoint import restore_state, saved_format

    form = saved_format(path) if optimizer is not None else None
    state = _training_state(model, optimizer, form)
    load_sharded(state, path)
    restore_state(
        model, [optimizer] if optimizer is not None else [], state["model"], state.get("optimizer", {})
    )


def load_full_optimizer_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, saved: dict, *, source: str = "the saved optimizer"
) -> None:
    """Load a single-process ``optimizer.state_dict()`` — parameters numbered in the order of its param groups,
    as the Trainer's ``optimizer.pt`` and accelerate's ``optimizer.bin`` hold it — into ``optimizer`` over
    ``model``, parallelized or not (collective: call on every rank; each keeps the slices of its shards).

    The saved groups are matched to ``optimizer``'s by position, so it must be built as the saving job built
    its own (the same code: same groups, parameters in the same order); a group of another length, or a state
    tensor of another shape than the parameter it is matched to, is an error that says so."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    from .pipeline import is_pipelined
    from .pipeline_checkpoint import load_positional_optimizer_state

    if is_pipelined(model):  # this rank's stages' parameters, matched through the whole model's order
        load_positional_optimizer_state(model, optimizer, saved, source)
        return
    names = {id(p): n for n, p in model.named_parameters()}
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}  # a DTensor's shape is the global one
    groups, saved_groups = optimizer.param_groups, saved.get("param_groups", [])
    mine = [len(g["params"]) for g in groups]
    theirs = [len(g["params"]) for g in saved_groups]
    if mine != theirs:
        raise ValueError(
            f"{source} has param groups of {theirs} parameters, this optimizer {mine}: it can only be matched "
            "parameter by parameter to an optimizer built the same way (same groups, same parameter order)"
        )
    state: dict[str, dict] = {}
    param_groups = []
    for group, saved_group in zip(groups, saved_groups, strict=True):
        fqns = []
        for param, number in zip(group["params"], saved_group["params"], strict=True):
            if id(param) not in names:
                raise ValueError(f"{source}: the optimizer holds a parameter that is not one of the model's")
            fqn = names[id(param)]
            fqns.append(fqn)
            entry = saved.get("state", {}).get(number)
            if entry is None:
                continue
            for key, value in entry.items():
                if isinstance(value, torch.Tensor) and value.dim() > 0 and tuple(value.shape) != shapes[fqn]:
                    raise ValueError(
                        f"{source}: {key} of parameter #{number} has shape {tuple(value.shape)}, but the parameter "
                        f"in that place, {fqn}, has {shapes[fqn]}; build the optimizer as the saving job did"
                    )
            state[fqn] = dict(entry)
        param_groups.append({**saved_group, "params": fqns})
    full = {"state": state, "param_groups": param_groups}
    if not any(isinstance(p, DTensor) for p in model.parameters()):
        # nothing sharded: the positional state dict loads as it is
        optimizer.load_state_dict(saved)
        return
    set_optimizer_state_dict(model, optimizer, full, options=StateDictOptions(full_state_dict=True))


def consolidated_state_dict(model: nn.Module, *, rank0_only: bool = False) -> dict[str, torch.Tensor]:
    """Full, ordinary CPU tensors for every entry of the model's state dict as one process holds it
    (collective: every rank calls it). A pipelined model's come from the stages that hold them
    (:func:`.pipeline_save.pipeline_state_dict`: the whole model's keys, not this rank's stages').

    Every rank ends with the whole model — or with ``rank0_only`` (accelerate's FSDP full state dict) only rank
    0, the others getting ``{}``: for writing a checkpoint use :func:`save_pretrained`, which streams."""
    from .pipeline import is_pipelined
    from .pipeline_save import pipeline_state_dict

    if is_pipelined(model):
        return pipeline_state_dict(model, rank0_only=rank0_only)
    keep = not rank0_only or not dist.is_initialized() or dist.get_rank() == 0
    out = {}
    for name, value in model.state_dict().items():
        if isinstance(value, DTensor):
            value = value.full_tensor()
        if keep:
            out[name] = value.detach().cpu().clone()
    return out


def save_pretrained(model: nn.Module, path: str | Path, *, max_shard_size: int | str = "5GB") -> SaveReport:
    """Write a consolidated HF checkpoint that ``from_pretrained`` loads in one process, without any rank
    holding the full model: :func:`.pretrained.save_pretrained` (collective: call on every rank)."""
    return stream_save_pretrained(model, path, max_shard_size=max_shard_size)
