"""Write a planned model as a HuggingFace checkpoint that ``from_pretrained`` loads in one process.

Why: transformers' own ``save_pretrained`` hands the model's DTensors to safetensors, which cannot read their
storage, and gathering the whole model on one rank is what a plan avoids. :func:`save_pretrained` knows every
output file's names, shapes and dtypes from the model, so the writer writes each file's safetensors header first
and then each tensor's bytes as they arrive (:mod:`.stream`), with transformers' ties, ignored keys and reverted
load-time conversions; :func:`install_save_pretrained` makes the model's own ``save_pretrained`` this writer.
"""

from __future__ import annotations

import json
import logging
import types
from collections.abc import Mapping
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..safetensors_io import CODES
from .collective import _every_rank_arrives, _needs_gather, save_timeout_s
from .load import SAFE_WEIGHTS_INDEX_NAME, _model_tensors
from .stream import _gathered, _held_bytes, _return_freed_pages, _StreamedTensor, _write_bytes

logger = logging.getLogger(__name__)


@dataclass
class SaveReport:
    """What :func:`save_pretrained` did on this rank (for logs and tests)."""

    files: list[str] = field(default_factory=list)  # safetensors files written (the writing rank)
    tensors: int = 0  # tensors gathered and written
    total_bytes: int = 0  # bytes of every tensor written
    peak_held_bytes: int = 0  # the most bytes of one gathered tensor this rank held at once


def save_pretrained(
    model: nn.Module,
    path: str | Path,
    *,
    max_shard_size: int | str = "5GB",
    writer: int = 0,
    state_dict: Mapping[str, torch.Tensor] | None = None,
    write: bool = True,
    original_format: bool = True,
) -> SaveReport:
    """Write ``model`` as a HuggingFace checkpoint (config, safetensors shards of at most ``max_shard_size``,
    the index) that ``from_pretrained`` loads in one process, without any rank holding the full model.

    Tensors are gathered one at a time. Every output file's names, shapes and dtypes are known from the
    model before anything is gathered, so rank ``writer`` writes the file's safetensors header first and then
    each tensor's bytes as they arrive: a tensor split over one mesh dim comes in blocks of
    :data:`STREAM_BLOCK_BYTES`, any other layout whole, so every rank holds its own shards plus at most one
    full tensor. Files
    with tensors transformers converts on save (``revert_weight_conversion`` fusing or splitting tensors) are
    written whole instead: the writer holds that file's tensors. Tied weights are written once and load-time
    conversions reverted (unless ``original_format`` is False), as ``PreTrainedModel.save_pretrained`` does.

    ``state_dict``: the tensors to write instead of the model's own (plain or DTensors, under the model's
    names), as ``PreTrainedModel.save_pretrained(state_dict=...)`` takes them. ``write=False``: rank ``writer``
    takes part but writes nothing (transformers' ``is_main_process=False``).

    Collective when a tensor is sharded (the writer needs the other ranks' parts): call it on every rank. A
    rank that comes alone waits for the others at most the plan's collective timeout — warning after
    :data:`SAVE_WAIT_WARN_S` — and then raises :class:`SaveCollectiveError` instead of hanging. When the writer
    holds every tensor already (a plain model, a DDP plan's replicated parameters, full tensors passed as
    ``state_dict``) nothing is exchanged: the writer writes, the other ranks return at once.
    """
    import torch.distributed as dist

    if hasattr(model, "_hf_colossal_auto_pipeline"):  # pipeline stages: each rank holds its stages' tensors
        from ..pipeline_save import save_pipeline_pretrained

        if state_dict is not None:
            raise ValueError(
                "save_pretrained(state_dict=...) of a pipelined model: each rank holds only its stages; save "
                "without state_dict on every rank"
            )
        save_pipeline_pretrained(model, path, max_shard_size=max_shard_size, write=write)
        return SaveReport()
    rank = dist.get_rank() if dist.is_initialized() else writer
    tensors = _tensors_to_save(model, state_dict)
    collective = dist.is_initialized() and dist.get_world_size() > 1 and _needs_gather(tensors)
    if collective:
        _every_rank_arrives(tensors, save_timeout_s(model), "save_pretrained")
    elif rank != writer:
        return SaveReport()  # the writer holds every tensor: nothing to send
    writes = rank == writer and write
    directory = Path(path)
    if writes:
        directory.mkdir(parents=True, exist_ok=True)
        _save_config(model, directory)
    split = _output_split(model, max_shard_size, tensors)
    report = SaveReport()
    weight_map: dict[str, str] = {}
    for filename, names in split.filename_to_tensors.items():
        layout = _saved_names(model, names, tensors, original_format)
        if layout is not None:
            written = _stream_file(layout, tensors, directory / filename, writer, writes, report)
        else:
            written = _buffer_file(
                model, names, tensors, directory / filename, writer, writes, original_format, report
            )
        if writes:
            weight_map.update(dict.fromkeys(written, filename))
            report.files.append(filename)
    if writes:
        _finish_index(model, directory, split, weight_map)
    if collective:
        dist.barrier()
    logger.info(
        "saved %d tensors (%.1f MiB) to %s in %d files; this rank held at most %.1f MiB of gathered tensors",
        report.tensors,
        report.total_bytes / 2**20,
        directory,
        len(split.filename_to_tensors),
        report.peak_held_bytes / 2**20,
    )
    return report


def _tensors_to_save(
    model: nn.Module, state_dict: Mapping[str, torch.Tensor] | None
) -> dict[str, torch.Tensor]:
    """The model's state-dict entries (live tensors), or the tensors of ``state_dict`` the caller passed."""
    if state_dict is None:
        return _model_tensors(model)
    tensors = {k: v for k, v in state_dict.items() if isinstance(v, torch.Tensor)}
    others = sorted(k for k in state_dict if k not in tensors)
    if others:
        logger.warning(
            "save_pretrained: state_dict entries that are not tensors are not saved: %s", others[:8]
        )
    return tensors


def install_save_pretrained(model: nn.Module, timeout_s: float) -> None:
    """Make a planned transformers model's own ``save_pretrained`` the streamed writer (an instance attribute,
    as the runtime's ``forward``), so that the lines users already have —
    ``accelerator.unwrap_model(model).save_pretrained(dir, is_main_process=..., save_function=accelerator.save)``,
    the Trainer's ``_save`` — write a checkpoint ``from_pretrained`` loads in one process. transformers' own
    method would hand the model's DTensors to safetensors, which cannot read their storage.
    ``timeout_s``: how long a rank waits in a save for the others (the plan's collective timeout)."""
    from transformers import PreTrainedModel

    model._hf_colossal_auto_timeout_s = timeout_s
    if isinstance(model, PreTrainedModel):
        model.save_pretrained = types.MethodType(planned_save_pretrained, model)


def planned_save_pretrained(
    self: nn.Module,
    save_directory: str | Path,
    is_main_process: bool = True,
    state_dict: Mapping[str, torch.Tensor] | None = None,
    push_to_hub: bool = False,
    max_shard_size: int | str = "50GB",
    variant: str | None = None,
    token: str | bool | None = None,
    save_peft_format: bool = True,
    save_original_format: bool = True,
    distributed_checkpoint: bool = False,
    **kwargs: Any,
) -> None:
    """``PreTrainedModel.save_pretrained`` of a planned model: the same directory (config.json,
    generation_config.json, safetensors files of at most ``max_shard_size`` and their index, ties written
    once, load-time conversions reverted unless ``save_original_format=False``), written by the streaming
    :func:`save_pretrained`. Call it on every rank, as transformers' examples do: the sharded tensors are
    gathered from all of them; only the main process writes (``is_main_process``, rank 0). ``state_dict``
    (plain tensors, e.g. ``accelerator.get_state_dict(model)``, or DTensors) is written instead of the model's
    tensors. As in transformers 5, ``save_function`` and ``safe_serialization`` are accepted and unused
    (safetensors is written). ``push_to_hub``, ``variant``, ``distributed_checkpoint`` and models with PEFT
    adapters loaded are refused with what to do instead."""
    _refuse_save_options(self, push_to_hub, variant, distributed_checkpoint)
    ignored = sorted(set(kwargs) - {"save_function", "safe_serialization"})
    if ignored:
        logger.debug("save_pretrained: %s only matter when pushing to the Hub; ignored", ignored)
    if Path(save_directory).is_file():
        logger.error("Provided path (%s) should be a directory, not a file", save_directory)
        return
    save_pretrained(
        self,
        save_directory,
        max_shard_size=max_shard_size,
        state_dict=state_dict,
        write=is_main_process,
        original_format=save_original_format,
    )


def _refuse_save_options(model: nn.Module, push_to_hub: bool, variant: str | None, distributed: bool) -> None:
    """The ``save_pretrained`` options the streamed writer does not do, each refused with what to do instead."""
    name = type(model).__name__
    if push_to_hub:
        raise ValueError(
            f"save_pretrained(push_to_hub=True) of the planned {name}: uploading is not done from a parallel job. "
            "Save on every rank without push_to_hub, then upload the directory from one process "
            "(`huggingface_hub.upload_folder` or `hf upload`)."
        )
    if variant is not None:
        raise ValueError(
            f"save_pretrained(variant={variant!r}) of the planned {name}: weight variants are not written by the "
            "streamed save. Save without variant, load the directory in one process and save_pretrained it with "
            "the variant there."
        )
    if distributed:
        raise ValueError(
            f"save_pretrained(distributed_checkpoint=True) of the planned {name}: for sharded training state use "
            "accelerator.save_state (or hf_colossal_auto.apply.save_checkpoint), which any plan resumes from; "
            "without it save_pretrained writes a from_pretrained checkpoint."
        )
    if getattr(model, "_hf_peft_config_loaded", False):
        raise ValueError(
            f"save_pretrained of the planned {name} with PEFT adapters loaded (add_adapter/load_adapter): saving "
            "adapters alone is not done by the streamed save. Gather the weights with accelerator.get_state_dict(model) "
            "(on every rank) and save the adapter entries from the main process."
        )


def _saved_names(
    model: nn.Module, names: list[str], tensors: dict[str, torch.Tensor], original_format: bool = True
) -> list[tuple[str, str]] | None:
    """``(model name, name in the file)`` per tensor when each is written as it is (at most renamed by the
    reverted conversions, found on a meta stand-in per tensor); None when a conversion changes shapes or
    combines tensors, or a dtype has no safetensors code — the file is then written whole."""
    layout = []
    for name in names:
        live = tensors[name]
        if live.dtype not in CODES:
            return None
        standin = {name: torch.empty(live.shape, dtype=live.dtype, device="meta")}
        if original_format and hasattr(model, "get_parameter_or_buffer"):
            from transformers.core_model_loading import revert_weight_conversion

            standin = revert_weight_conversion(model, standin)
        if len(standin) != 1:
            return None
        ((saved, value),) = standin.items()
        value = value[0] if isinstance(value, list) else value
        if tuple(value.shape) != tuple(live.shape) or value.dtype != live.dtype:
            return None
        layout.append((name, saved))
    return layout


def _stream_file(
    layout: list[tuple[str, str]],
    tensors: dict[str, torch.Tensor],
    filename: Path,
    writer: int,
    writes: bool,
    report: SaveReport,
) -> list[str]:
    """One safetensors file written tensor by tensor: the header (names, dtypes, shapes, offsets) from the
    model's metadata, then each gathered tensor's bytes, dropped right after. The format is safetensors' own
    (8-byte little-endian header length, JSON header padded to 8 bytes, the tensors' bytes back to back), which
    its library can only write from a complete dict of tensors."""
    import struct

    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, saved in layout:
        live = tensors[name]
        size = live.numel() * live.element_size()
        header[saved] = {
            "dtype": CODES[live.dtype],
            "shape": list(live.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    with ExitStack() as stack:
        out = stack.enter_context(open(filename, "wb")) if writes else None
        if out is not None:
            out.write(struct.pack("<Q", len(encoded)) + encoded)
        for name, _ in layout:
            full = _gathered(tensors[name], writer)
            report.tensors += 1
            report.total_bytes += tensors[name].numel() * tensors[name].element_size()
            if full is not None:  # on the writer: written, or only received when it does not write
                report.peak_held_bytes = max(report.peak_held_bytes, _held_bytes(full))
                _write_bytes(out, full)
            del full
            if out is not None:
                _return_freed_pages()
    return [saved for _, saved in layout]


def _buffer_file(
    model: nn.Module,
    names: list[str],
    tensors: dict[str, torch.Tensor],
    filename: Path,
    writer: int,
    writes: bool,
    original_format: bool,
    report: SaveReport,
) -> list[str]:
    """One output file whose tensors the reverted conversions combine: the writer keeps the file's gathered
    tensors, then safetensors writes them after the conversion."""
    shard: dict[str, torch.Tensor] = {}
    held = 0
    for name in names:
        full = _gathered(tensors[name], writer)
        report.tensors += 1
        report.total_bytes += tensors[name].numel() * tensors[name].element_size()
        if full is not None:
            shard[name] = full.joined() if isinstance(full, _StreamedTensor) else full
            held += shard[name].numel() * shard[name].element_size()
        report.peak_held_bytes = max(report.peak_held_bytes, held)
        del full
    return _write_shard(model, shard, filename, original_format) if shard and writes else []


def _save_config(model: nn.Module, directory: Path) -> None:
    """config.json (with dtype and the architecture, as save_pretrained records them) and generation_config."""
    config = getattr(model, "config", None)
    if config is None:
        return
    param = next(model.parameters(), None)
    if param is not None:
        config.dtype = str(param.dtype).split(".")[1]
    config.architectures = [type(model).__name__.removeprefix("FSDP")]
    config.save_pretrained(directory)
    can_generate = getattr(model, "can_generate", None)
    if callable(can_generate) and can_generate() and getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(directory)


def _output_split(model: nn.Module, max_shard_size: int | str, tensors: dict[str, torch.Tensor]) -> Any:
    """Which of ``tensors`` goes to which output file, from shapes alone (every rank computes the same): meta
    stand-ins, ties and ``_keys_to_ignore_on_save`` dropped as transformers does (ties found from the model's
    own tensors, so a state dict of separate full copies drops them too), split by huggingface_hub's
    ``split_torch_state_dict_into_shards``."""
    from huggingface_hub import split_torch_state_dict_into_shards

    shapes = {n: torch.empty(t.shape, dtype=t.dtype, device="meta") for n, t in tensors.items()}
    for key in getattr(model, "_keys_to_ignore_on_save", None) or []:
        shapes.pop(key, None)
    if hasattr(model, "get_parameter_or_buffer"):
        from transformers.modeling_utils import remove_tied_weights_from_state_dict

        own = _model_tensors(model)
        known = {n: s for n, s in shapes.items() if n in own}  # meta stand-ins are matched to the model's
        kept = remove_tied_weights_from_state_dict(known, model)
        shapes = {n: s for n, s in shapes.items() if n in kept or n not in own}
    else:  # not a transformers model: keep each tensor's first name
        seen: set[int] = set()
        shapes = {n: s for n, s in shapes.items() if not (id(tensors[n]) in seen or seen.add(id(tensors[n])))}
    return split_torch_state_dict_into_shards(
        shapes, filename_pattern="model{suffix}.safetensors", max_shard_size=max_shard_size
    )


def _write_shard(
    model: nn.Module, shard: dict[str, torch.Tensor], filename: Path, original_format: bool = True
) -> list[str]:
    """One output file, with transformers' load-time conversions reverted on its tensors (unless
    ``original_format`` is False); returns its keys."""
    from safetensors.torch import save_file

    if original_format and hasattr(model, "get_parameter_or_buffer"):
        from transformers.core_model_loading import revert_weight_conversion

        shard = revert_weight_conversion(model, shard)
    save_file(shard, str(filename), metadata={"format": "pt"})
    return list(shard)


def _finish_index(model: nn.Module, directory: Path, split: Any, weight_map: dict[str, str]) -> None:
    """The index of a sharded checkpoint; stale files of an earlier save into the same directory removed."""
    for stale in directory.glob("model*.safetensors*"):
        if stale.name not in split.filename_to_tensors and stale.name != SAFE_WEIGHTS_INDEX_NAME:
            stale.unlink()
    index = directory / SAFE_WEIGHTS_INDEX_NAME
    if not split.is_sharded:
        index.unlink(missing_ok=True)
        return
    params = sum(p.numel() for p in model.parameters())
    content = {"metadata": {"total_parameters": params, **split.metadata}, "weight_map": weight_map}
    index.write_text(json.dumps(content, indent=2, sort_keys=True) + "\n")
