"""Write a pipelined model as a HuggingFace checkpoint that ``from_pretrained`` loads in one process.

Why its own writer: under pipeline stages each rank holds whole tensors, but only its stages' — the model's
own ``save_pretrained`` (and the DTensor streaming writer, which gathers shards over a mesh) would write one
stage. Here the writer (global rank 0) knows every tensor's name, shape and dtype (gathered from the pipeline's
ranks), writes each output file's safetensors header, then each tensor's bytes as its owner sends them, one
tensor at a time: no rank holds more than its own stages plus one tensor. Only the first data-parallel
replica's pipeline sends (the replicas hold the same values); the writer is rank 0 of the job.

What is written is what ``PreTrainedModel.save_pretrained`` writes for the whole model: config.json (and the
generation config), safetensors files of at most ``max_shard_size`` and their index, ties written once under
the name transformers keeps, ``_keys_to_ignore_on_save`` dropped. The names, ties and ignored keys are read
off the whole model before it is cut (:func:`record_saved_names`). Models whose checkpoints transformers
converts on save (fused or split weights) are refused, with what to do.
"""

from __future__ import annotations

import json
import logging
import struct
import types
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .safetensors_io import CODES

logger = logging.getLogger(__name__)

_SAVED = "_hf_colossal_auto_pipeline_saved_names"
"""Attribute of a pipelined model: the names its checkpoint holds (whole model, ties once), or a reason why
it cannot be written."""


def record_saved_names(model: nn.Module) -> None:
    """Before the cut: the state-dict names ``save_pretrained`` writes for the whole ``model`` (ties once,
    ignored keys dropped), in model order — or why they cannot be written as they are (a load-time
    conversion that save reverts)."""
    from .pretrained.load import _model_tensors
    from .pretrained.save import _output_split, _saved_names

    tensors = _model_tensors(model)
    split = _output_split(model, "1000GB", tensors)
    kept = {name for names in split.filename_to_tensors.values() for name in names}
    names = [n for n in tensors if n in kept]
    layout = _saved_names(model, names, tensors)
    if layout is None or any(name != saved for name, saved in layout):
        setattr(model, _SAVED, f"{type(model).__name__}'s checkpoint format converts its weights on save")
    else:
        setattr(model, _SAVED, names)
    # the whole model's parameters in its order (ties once): a one-process optimizer's positions
    model._hf_colossal_auto_parameter_order = [n for n, _ in model.named_parameters()]
    model._hf_colossal_auto_state_dict_keys = _state_dict_keys(model)


def _state_dict_keys(model: nn.Module) -> list[tuple[str, str]]:
    """The whole model's ``state_dict()`` keys in order, each with the first name of the tensor it holds (a
    head tied to the embedding is one tensor under two keys in one process; the stages may hold it under
    either)."""
    first: dict[int, str] = {}
    for name, tensor in [
        *model.named_parameters(remove_duplicate=False),
        *model.named_buffers(remove_duplicate=False),
    ]:
        first.setdefault(id(tensor), name)
    canonical = {
        name: first[id(tensor)]
        for name, tensor in [
            *model.named_parameters(remove_duplicate=False),
            *model.named_buffers(remove_duplicate=False),
        ]
    }
    return [(key, canonical.get(key, key)) for key in model.state_dict()]


def pipeline_state_dict(model: nn.Module, *, rank0_only: bool = False) -> dict[str, torch.Tensor]:
    """One process's full ``state_dict()`` of a pipelined ``model`` (collective: call it on every rank): the
    whole model's keys in its order, plain CPU tensors, a tied head the same tensor as its embedding, as one
    process holds them. Each tensor is sent from the first rank that holds it (a stage sharded by tensor
    parallelism or FSDP gathered whole on its ranks first, one tensor at a time) to every rank — or, with
    ``rank0_only`` (as accelerate's FSDP full state dict), to rank 0 only, the others getting ``{}``, so no rank
    but rank 0 holds more than its stages and one tensor."""
    from torch.distributed.tensor import DTensor

    from .pipeline import pipeline_runner

    keys = getattr(model, "_hf_colossal_auto_state_dict_keys", None)
    if keys is None:
        raise RuntimeError(
            f"the pipelined {type(model).__name__} has no record of its whole state dict (it was cut by an older "
            "version); re-apply the plan"
        )
    device = pipeline_runner(model).device
    local = model.state_dict()
    held = {name: (tuple(t.shape), t.dtype) for name, t in local.items()}
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, held)
    rank = dist.get_rank()
    out: dict[str, torch.Tensor] = {}
    sent: dict[str, torch.Tensor] = {}  # canonical name -> the tensor it became here
    for key, canonical in keys:
        if canonical in sent:
            out[key] = sent[canonical]
            continue
        names = (key, canonical)
        source = next((r for r, h in enumerate(everyone) if any(n in h for n in names)), None)
        if source is None:
            raise RuntimeError(f"state dict of the pipelined {type(model).__name__}: no stage holds {key}")
        name = next(n for n in names if n in everyone[source])
        shape, dtype = everyone[source][name]
        mine = local.get(name)
        if isinstance(mine, DTensor):  # the stage's ranks (all hold it) gather it whole, as the owner does
            mine = mine.detach().full_tensor()
        if rank0_only and rank not in (0, source):
            continue
        tensor = (
            mine.detach().contiguous() if rank == source else torch.empty(shape, dtype=dtype, device=device)
        )
        if not rank0_only:
            dist.broadcast(tensor, src=source)
        elif source != 0 and rank == source:
            dist.send(tensor, dst=0)
        elif source != 0:
            dist.recv(tensor, src=source)
        if rank0_only and rank != 0:
            continue
        # the owner's value a copy (a snapshot, as one process's clone would be), a received one as it came
        sent[canonical] = out[key] = tensor.to("cpu", copy=True) if rank == source else tensor.cpu()
    return out


def install_pipeline_save(model: nn.Module, timeout_s: float) -> None:
    """The pipelined model's own ``save_pretrained`` becomes :func:`save_pipeline_pretrained` (an instance
    attribute, as the forward), so that ``unwrap_model(model).save_pretrained(dir)`` and
    ``accelerator.save_model`` write the whole model."""
    from transformers import PreTrainedModel

    model._hf_colossal_auto_timeout_s = timeout_s
    if isinstance(model, PreTrainedModel):
        model.save_pretrained = types.MethodType(_pipelined_save_pretrained, model)


def _pipelined_save_pretrained(
    self: nn.Module,
    save_directory: str | Path,
    is_main_process: bool = True,
    state_dict: Any = None,
    push_to_hub: bool = False,
    max_shard_size: int | str = "50GB",
    variant: str | None = None,
    **kwargs: Any,
) -> None:
    """``PreTrainedModel.save_pretrained`` of a pipelined model (call it on every rank)."""
    from .pretrained.save import _refuse_save_options

    _refuse_save_options(self, push_to_hub, variant, kwargs.get("distributed_checkpoint", False))
    if state_dict is not None:  # a full one (accelerator.get_state_dict): the main process writes it
        _save_full_state_dict(self, save_directory, state_dict, max_shard_size, is_main_process)
        return
    save_pipeline_pretrained(self, save_directory, max_shard_size=max_shard_size, write=is_main_process)


def _save_full_state_dict(
    model: nn.Module, path: str | Path, state_dict: dict, max_shard_size: int | str, write: bool
) -> None:
    """``save_pretrained(dir, state_dict=full)`` of a pipelined model, as accelerate's export loop calls it with
    :func:`pipeline_state_dict`'s whole-model dict: the names ``save_pretrained`` writes for the whole model (ties
    once), from ``state_dict``, in safetensors files of at most ``max_shard_size`` (``write``: this process
    writes). A dict of this rank's stages only is refused with what to do."""
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file

    from .pretrained.load import SAFE_WEIGHTS_INDEX_NAME
    from .pretrained.save import _save_config

    names = getattr(model, _SAVED, None)
    if isinstance(names, str):
        raise ValueError(f"save_pretrained of the pipelined {type(model).__name__}: {names}")
    if not write:
        return
    missing = [n for n in names if n not in state_dict]
    if missing:
        raise ValueError(
            f"save_pretrained(state_dict=...) of the pipelined {type(model).__name__}: the state dict lacks "
            f"{missing[:4]} ({len(missing)} of the whole model's tensors; this rank's stages' state_dict() is not "
            "the model's). Pass accelerator.get_state_dict(model) (the whole model), or call save_pretrained(dir) "
            "on every rank without state_dict."
        )
    tensors = {n: state_dict[n].detach().cpu().contiguous() for n in names}
    split = split_torch_state_dict_into_shards(
        tensors, filename_pattern="model{suffix}.safetensors", max_shard_size=max_shard_size
    )
    directory = Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    _save_config(model, directory)
    for filename, file_names in split.filename_to_tensors.items():
        save_file({n: tensors[n] for n in file_names}, directory / filename, metadata={"format": "pt"})
    _write_index(directory, split, tensors, SAFE_WEIGHTS_INDEX_NAME)


def save_pipeline_pretrained(
    model: nn.Module, path: str | Path, *, max_shard_size: int | str = "5GB", write: bool = True
) -> list[str]:
    """Write the pipelined ``model`` (every stage) to ``path`` from rank 0. Collective: call it on every rank.
    ``write=False``: rank 0 receives but writes nothing. Returns the files written (rank 0)."""
    from huggingface_hub import split_torch_state_dict_into_shards

    from .pipeline import pipeline_runner
    from .pretrained.load import SAFE_WEIGHTS_INDEX_NAME, _model_tensors
    from .pretrained.save import _save_config

    names = getattr(model, _SAVED, None)
    if isinstance(names, str):
        raise ValueError(
            f"save_pretrained of the pipelined {type(model).__name__}: {names}, which the pipeline writer does "
            "not do. Save training state with accelerator.save_state, or train without pipeline stages to export."
        )
    runner = pipeline_runner(model)
    mesh = model._hf_colossal_auto_mesh
    first_pipeline = [int(r) for r in mesh.mesh.reshape(runner.plan.pp_size, -1)[:, 0]]
    rank = dist.get_rank()
    writer = first_pipeline[0]
    local = _whole_tensors(_model_tensors(model))
    sizes: list[Any] = [None] * len(first_pipeline)
    held = {n: (tuple(t.shape), t.dtype) for n, t in local.items() if n in set(names)}
    if rank in first_pipeline:
        dist.all_gather_object(sizes, held, group=runner.group)
    files: list[str] = []
    if rank in first_pipeline:
        owner = {}
        for pp_rank, entries in enumerate(sizes):
            for name, meta in entries.items():
                owner.setdefault(name, (first_pipeline[pp_rank], meta))
        missing = [n for n in names if n not in owner]
        if missing:
            raise RuntimeError(f"save_pretrained: no pipeline stage holds {missing[:4]}")
        stand_ins = {n: torch.empty(owner[n][1][0], dtype=owner[n][1][1], device="meta") for n in names}
        split = split_torch_state_dict_into_shards(
            stand_ins, filename_pattern="model{suffix}.safetensors", max_shard_size=max_shard_size
        )
        directory = Path(path)
        writes = rank == writer and write
        if writes:
            directory.mkdir(parents=True, exist_ok=True)
            _save_config(model, directory)
        for filename, file_names in split.filename_to_tensors.items():
            order = [n for n in names if n in set(file_names)]
            _stream_file(directory / filename, order, owner, local, (rank, writer, runner.device), writes)
            files.append(filename)
        if writes:
            _write_index(directory, split, stand_ins, SAFE_WEIGHTS_INDEX_NAME)
    dist.barrier()
    return files if rank == writer and write else []


def _whole_tensors(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` with each DTensor (a stage sharded by tensor parallelism or FSDP) gathered whole, a tied one
    once. Collective over the stage's ``(dp, tp)`` group: its ranks hold the same names, in the same order.
    The stage is then whole on each of its ranks while it is written."""
    from torch.distributed.tensor import DTensor

    gathered: dict[int, torch.Tensor] = {}
    out = {}
    for name, tensor in tensors.items():
        if isinstance(tensor, DTensor):
            if id(tensor) not in gathered:
                gathered[id(tensor)] = tensor.detach().full_tensor()
            out[name] = gathered[id(tensor)]
        else:
            out[name] = tensor
    return out


def _stream_file(
    filename: Path,
    names: list[str],
    owner: dict[str, tuple[int, tuple]],
    local: dict[str, torch.Tensor],
    where: tuple[int, int, torch.device],
    writes: bool,
) -> None:
    """One safetensors file: the writer writes the header, then each tensor's bytes — its own, or received
    from the rank that holds it; every other rank sends the file's tensors it owns, in the file's order."""
    from .pretrained.stream import _as_bytes, _write_bytes

    rank, writer, device = where
    if rank != writer:
        for name in names:
            if owner[name][0] == rank:
                dist.send(_as_bytes(local[name].detach().contiguous()), dst=writer)
        return
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name in names:
        shape, dtype = owner[name][1]
        size = _numel(shape) * torch.empty((), dtype=dtype).element_size()
        header[name] = {"dtype": CODES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    with open(filename, "wb") if writes else _NoFile() as out:
        out.write(struct.pack("<Q", len(encoded)) + encoded)
        for name in names:
            source, (shape, dtype) = owner[name]
            if source == writer:
                tensor = local[name].detach()
            else:
                tensor = torch.empty(shape, dtype=dtype, device=device)
                dist.recv(_as_bytes(tensor), src=source)
            _write_bytes(out, tensor)
            del tensor


class _NoFile:
    """A file a writer told not to write (``is_main_process=False``): it still receives every tensor."""

    def __enter__(self) -> _NoFile:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    def write(self, data: bytes) -> None:
        return None


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _write_index(directory: Path, split: Any, stand_ins: dict[str, torch.Tensor], index_name: str) -> None:
    """The index of a sharded checkpoint (none for one file); files of an earlier save removed."""
    for stale in directory.glob("model*.safetensors*"):
        if stale.name not in split.filename_to_tensors and stale.name != index_name:
            stale.unlink()
    index = directory / index_name
    if not split.is_sharded:
        index.unlink(missing_ok=True)
        return
    weight_map = {n: f for f, names in split.filename_to_tensors.items() for n in names}
    total = sum(t.numel() for t in stand_ins.values())
    content = {"metadata": {"total_parameters": total, **split.metadata}, "weight_map": weight_map}
    index.write_text(json.dumps(content, indent=2, sort_keys=True) + "\n")
