"""Load a HuggingFace safetensors checkpoint straight into the shards of a planned model.

Why: ``from_pretrained`` builds the whole model in one process; a job that applies a plan afterwards holds the
full model in every process first (at 70B, ~140 GB each). Here a model built on ``meta`` (or any model, planned
or not) is filled from the checkpoint's files by every rank reading only the slices it owns
(``pread`` of the slice's bytes, :mod:`.safetensors_io`), so no rank ever holds more than its own shards plus
the tensor being read.

What is transformers' and what is ours:

* the key renames transformers applies on load (legacy ``gamma``/``beta``, a base model's prefix added or
  dropped, per-model mappings) come from transformers itself (``get_model_conversion_mapping`` and
  ``rename_source_key``), so a checkpoint loads under the same names as with ``from_pretrained``;
* which slice of a full tensor a DTensor shard holds (any placements, FSDP's strided ones included) is
  transformers' shard-on-read (``DtensorShardOperation``); the result is checked against the shard's shape and
  a mismatch falls back to reading the full tensor and keeping this rank's part;
* checkpoint tensors that transformers *converts* on load (several checkpoint tensors fused into one
  parameter, e.g. per-expert weights stacked) are read in full, converted by transformers' own
  ``WeightConverter``, and this rank's part kept: one converted tensor at a time;
* values are copied *into* the model's existing tensors (their local shards), so parameter identity — ties,
  FSDP's sharded parameters, gradient hooks, optimizers already made — is unchanged.

Missing and unexpected keys and shape mismatches are errors naming the keys before anything is read, unless
the caller opts in (``strict=False``, ``ignore_mismatched_sizes=True``) as with ``from_pretrained``; the model's
own ``_keys_to_ignore_on_load_missing``/``_unexpected`` patterns are honoured as ``from_pretrained`` does.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import re
import types
from collections.abc import Iterator, Mapping
from contextlib import ExitStack
from copy import deepcopy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from .materialize import is_meta_model, materialize_meta_model
from .safetensors_io import CODES, DTYPES, SafetensorsFile, bytes_of, read_header

logger = logging.getLogger(__name__)

SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"


class PretrainedLoadError(ValueError):
    """A checkpoint that does not fit the model (keys, shapes) or a directory that holds no checkpoint."""


@dataclass
class LoadReport:
    """What :func:`load_pretrained` did on this rank (for logs and tests)."""

    files: list[str] = field(default_factory=list)  # the safetensors files read
    loaded: int = 0  # distinct model tensors filled from the checkpoint
    missing: list[str] = field(default_factory=list)  # model keys the checkpoint lacked (strict=False)
    unexpected: list[str] = field(default_factory=list)  # checkpoint keys the model has no place for
    mismatched: list[str] = field(default_factory=list)  # keys skipped for their shape (opted in)
    bytes_read: int = 0  # bytes this rank read from the files (in the checkpoint's dtype)
    checkpoint_bytes: int = 0  # bytes of every tensor the checkpoint holds
    local_bytes: int = 0  # bytes of this rank's loaded parameter and buffer shards (the model's dtype)


@dataclass
class _Source:
    """One checkpoint tensor: its file, shape and dtype from the file's header."""

    key: str
    file: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def nbytes(self) -> int:
        return _numel(self.shape) * (DTYPES[self.dtype].itemsize if self.dtype in DTYPES else 4)


@dataclass
class _Target:
    """A model tensor and the checkpoint tensors that fill it: one source, or several through a converter."""

    name: str
    sources: list[tuple[_Source, str]]  # (source, pattern it matched)
    converter: Any = None  # a transformers WeightConverter, or None for a plain (renamed) copy


def checkpoint_files(path: str | Path) -> tuple[Path, list[str]]:
    """The directory and the safetensors files of a checkpoint: ``model.safetensors`` or the files an index names.

    ``path`` is a local directory, or a Hub repository id already in the local HF cache (never downloaded).
    """
    directory = Path(path)
    if not directory.is_dir():
        directory = _cached_snapshot(str(path))
    index = directory / SAFE_WEIGHTS_INDEX_NAME
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return directory, sorted(set(weight_map.values()))
    if (directory / SAFE_WEIGHTS_NAME).is_file():
        return directory, [SAFE_WEIGHTS_NAME]
    found = sorted(p.name for p in directory.iterdir())[:8]
    raise PretrainedLoadError(
        f"{directory} holds neither {SAFE_WEIGHTS_NAME} nor {SAFE_WEIGHTS_INDEX_NAME} (found {found}). Point at a "
        "directory written by save_pretrained with safetensors; a pytorch_model.bin checkpoint must be converted "
        "first (load it once with from_pretrained and save_pretrained it)."
    )


def _cached_snapshot(repo_id: str) -> Path:
    """A Hub repository's snapshot from the local cache only: this package never downloads weights."""
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id, local_files_only=True))
    except Exception as exc:  # huggingface_hub raises several kinds (not cached, invalid id)
        raise PretrainedLoadError(
            f"{repo_id!r} is neither a local directory nor a repository in the local Hugging Face cache ({exc}). "
            "Download it first (e.g. `huggingface-cli download REPO`) or pass the directory."
        ) from exc


def _read_headers(directory: Path, files: list[str]) -> dict[str, _Source]:
    """Every tensor's file, shape and dtype, from the files' headers (no tensor data is read)."""
    sources: dict[str, _Source] = {}
    for name in files:
        for key, entry in read_header(directory / name)[1].items():
            sources[key] = _Source(key, name, tuple(entry["shape"]), entry["dtype"])
    return sources


def _conversions(model: nn.Module) -> tuple[list[Any], list[Any]]:
    """transformers' renamings and converters for this model (what ``from_pretrained`` applies on load)."""
    from transformers import PreTrainedModel

    if not isinstance(model, PreTrainedModel):
        return [], []
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming

    mapping = get_model_conversion_mapping(model)
    return (
        [m for m in mapping if isinstance(m, WeightRenaming)],
        [m for m in mapping if isinstance(m, WeightConverter)],
    )


def _rename(key: str, model: nn.Module, names: dict[str, Any], renamings: list, converters: list):
    """The model key a checkpoint key loads into, and the converter pattern it matched (or None), as
    ``convert_and_load_state_dict_in_model`` renames it."""
    from transformers.core_model_loading import rename_source_key

    prefix = getattr(model, "base_model_prefix", None) or None
    renamed, pattern = rename_source_key(key, renamings, converters, prefix, names)
    if renamed not in names and key in names:  # should not have been renamed; maybe a prefix to add
        renamed, pattern = rename_source_key(key, [], [], prefix, names)
    return renamed, pattern


def _ignored(model: nn.Module, attribute: str, keys: list[str]) -> list[str]:
    """``keys`` minus those the model's ``_keys_to_ignore_on_load_*`` patterns cover (as from_pretrained)."""
    patterns = list(getattr(model, attribute, None) or [])
    return [k for k in keys if not any(re.search(p, k) for p in patterns)]


@dataclass
class _Matching:
    """Which checkpoint tensor fills which model tensor, and what does not fit."""

    targets: list[_Target]
    missing: list[str]
    unexpected: list[str]
    mismatched: list[str]  # "key: checkpoint (a, b) vs model (c, d)"
    loaded_names: set[str]  # model keys whose tensor is filled (ties: every name of it)
    conversions: list[Any]  # transformers' renamings and converters that matched a checkpoint key


def _model_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's state-dict entries by name (live tensors, ties under every name); non-persistent buffers,
    which checkpoints do not hold, are left out."""
    out: dict[str, torch.Tensor] = dict(model.named_parameters(remove_duplicate=False))
    for name, buffer in model.named_buffers(remove_duplicate=False):
        module_name, _, attr = name.rpartition(".")
        if attr not in model.get_submodule(module_name)._non_persistent_buffers_set:
            out[name] = buffer
    return out


def _match(model: nn.Module, sources: dict[str, _Source]) -> _Matching:
    """Pair checkpoint keys with model keys through transformers' renames; shape-check the plain copies."""
    tensors = _model_tensors(model)
    names = dict.fromkeys(tensors, True)
    renamings, converters = _conversions(model)
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    targets: dict[str, _Target] = {}
    unexpected, mismatched = [], []
    for key in sorted(sources, key=_natural):
        renamed, pattern = _rename(key, model, names, renamings, converters)
        if renamed not in names:
            unexpected.append(key)
            continue
        target = targets.get(renamed)
        if target is None:
            converter = deepcopy(by_pattern[pattern]) if pattern is not None else None
            target = targets[renamed] = _Target(renamed, [], converter)
        target.sources.append((sources[key], pattern or key))
        want = tuple(tensors[renamed].shape)
        if target.converter is None and sources[key].shape != want:
            mismatched.append(f"{key}: checkpoint {sources[key].shape} vs model {want}")
    mismatched_keys = {m.split(":")[0] for m in mismatched}
    kept = [t for t in targets.values() if not any(s.key in mismatched_keys for s, _ in t.sources)]
    filled = {id(tensors[t.name]) for t in kept}
    loaded_names = {n for n, t in tensors.items() if id(t) in filled}
    missing = [n for n in tensors if n not in loaded_names]
    return _Matching(
        targets=kept,
        missing=_ignored(model, "_keys_to_ignore_on_load_missing", missing),
        unexpected=_ignored(model, "_keys_to_ignore_on_load_unexpected", unexpected),
        mismatched=mismatched,
        loaded_names=loaded_names,
        conversions=[c for c in renamings + converters if c.was_used()],
    )


def _natural(key: str) -> list[Any]:
    """Sort ``layers.10`` after ``layers.9``: files are read in the model's order."""
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", key)]


def _refuse(
    model: nn.Module, path: str | Path, matching: _Matching, strict: bool, ignore_sizes: bool
) -> None:
    """Raise, naming the keys, when the checkpoint does not fit and the caller did not opt in."""
    problems = []
    if matching.mismatched and not ignore_sizes:
        problems.append(
            f"{len(matching.mismatched)} tensors have another shape: {'; '.join(matching.mismatched[:5])} "
            "(pass ignore_mismatched_sizes=True to leave them as initialised)"
        )
    if strict and matching.missing:
        problems.append(
            f"{len(matching.missing)} model keys are missing from the checkpoint: {matching.missing[:8]} "
            "(pass strict=False to keep their initialisation)"
        )
    if strict and matching.unexpected:
        problems.append(
            f"{len(matching.unexpected)} checkpoint keys have no place in the model: {matching.unexpected[:8]} "
            "(pass strict=False to ignore them)"
        )
    if problems:
        raise PretrainedLoadError(
            f"the checkpoint {path} does not fit {type(model).__name__}: " + "; ".join(problems) + ". Was it "
            "saved from another architecture or configuration?"
        )


def load_pretrained(
    model: nn.Module,
    path: str | Path,
    *,
    strict: bool = True,
    ignore_mismatched_sizes: bool = False,
    device: torch.device | str | None = None,
) -> LoadReport:
    """Fill ``model`` from the safetensors checkpoint at ``path``, each rank reading only its own slices.

    ``model`` may be planned (DTensor parameters, FSDP) or not, and may be on ``meta``: then its tensors are
    allocated first — this rank's shards only — and only what the checkpoint lacks (non-persistent buffers such
    as rotary tables, or missing keys with ``strict=False``) is initialised by the model's own init. Values are
    cast to each tensor's dtype. Call it on every rank of a planned model (a model on ``meta`` is materialised
    collectively); the checks run before anything is read, identically on every rank. ``device``: where a
    plain tensor on ``meta`` is allocated (default: :func:`.materialize.materialize_meta_model`'s).
    """
    directory, files = checkpoint_files(path)
    sources = _read_headers(directory, files)
    matching = _match(model, sources)
    _refuse(model, path, matching, strict, ignore_mismatched_sizes)
    if is_meta_model(model):
        materialize_meta_model(model, device, loaded=matching.loaded_names)
    report = LoadReport(
        files=files,
        missing=matching.missing,
        unexpected=matching.unexpected,
        mismatched=matching.mismatched,
        checkpoint_bytes=sum(s.nbytes for s in sources.values()),
    )
    tensors = _model_tensors(model)
    with _OpenFiles(directory) as opened, torch.no_grad():
        for target in sorted(matching.targets, key=lambda t: t.sources[0][0].file):  # each file opened once
            live = tensors[target.name]
            if target.converter is None:
                source = target.sources[0][0]
                report.bytes_read += _fill(target.name, live, opened.slice(source), source)
            else:
                for name, local, read in _convert(target, opened, model, tensors):
                    report.bytes_read += read
                    _store(name, tensors[name], local)
            report.loaded += 1
    report.local_bytes = _local_bytes(tensors[n] for n in matching.loaded_names)
    if hasattr(model, "config"):  # as from_pretrained records them: a later save reverts what matched
        model._weight_conversions = matching.conversions
    logger.info(
        "loaded %d tensors from %s (%d files): read %.1f MiB of %.1f MiB, %.1f MiB of shards on this rank%s",
        report.loaded,
        directory,
        len(files),
        report.bytes_read / 2**20,
        report.checkpoint_bytes / 2**20,
        report.local_bytes / 2**20,
        f"; missing {report.missing[:5]}, unexpected {report.unexpected[:5]}"
        if report.missing or report.unexpected
        else "",
    )
    return report


class _OpenFiles:
    """One checkpoint file open at a time (targets are read file by file), read with ``pread``
    (:class:`.safetensors_io.SafetensorsFile`): a memory map would keep every page a slice read touches — for
    a column shard, the whole tensor's — resident in this process until the file closes."""

    def __init__(self, directory: Path):
        self.directory = directory
        self.file: str | None = None
        self.handle: SafetensorsFile | None = None

    def __enter__(self) -> _OpenFiles:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.handle is not None:
            self.handle.close()

    def slice(self, source: _Source) -> Any:
        if source.file != self.file:
            if self.handle is not None:
                self.handle.close()
            self.handle = SafetensorsFile(self.directory / source.file)
            self.file = source.file
        return self.handle.get_slice(source.key)


def _fill(name: str, live: torch.Tensor, piece: Any, source: _Source) -> int:
    """Read this rank's part of a checkpoint tensor into the model's tensor; returns the bytes read.

    A tensor that is whole or evenly sharded once per dim (TP's and FSDP's usual layouts) has its block read
    straight into the local shard when the dtypes agree (no temporary, memory touched once); other layouts go
    through transformers' shard-on-read (:func:`_read_local`) and a copy."""
    ranges = _own_ranges(live)
    if ranges is None:
        local, read = _read_local(piece, source, live)
        _store(name, live, local)
        return read
    target = _local_view(live)
    read = _numel(target.shape) * DTYPES[source.dtype].itemsize
    if target.is_contiguous() and target.device.type == "cpu" and DTYPES[source.dtype] == target.dtype:
        piece.read(ranges, out=target)
    else:
        _store(name, live, piece.read(ranges).to(dtype=target.dtype))
    return read


def _own_ranges(live: torch.Tensor) -> list[tuple[int, int]] | None:
    """The ``[start, stop)`` per dim of the full tensor that this rank's shard holds, for a plain tensor or a
    DTensor with replicated and plain, even ``Shard`` placements (at most one per dim); None otherwise."""
    shape = tuple(live.shape)
    ranges = [(0, n) for n in shape]
    if not isinstance(live, DTensor):
        return ranges
    mesh = live.device_mesh
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        return None
    for axis, placement in enumerate(live.placements):
        if placement.is_replicate():
            continue
        if type(placement) is not Shard or ranges[placement.dim] != (0, shape[placement.dim]):
            return None
        size = shape[placement.dim]
        if size % mesh.size(axis):
            return None
        step = size // mesh.size(axis)
        ranges[placement.dim] = (coordinate[axis] * step, (coordinate[axis] + 1) * step)
    local = tuple(live.to_local().shape)
    return ranges if tuple(b - a for a, b in ranges) == local else None


def _local_view(live: torch.Tensor) -> torch.Tensor:
    """The tensor this rank stores for ``live``: a DTensor's local shard, else the tensor."""
    return live.to_local() if isinstance(live, DTensor) else live


def _read_local(piece: Any, source: _Source, live: torch.Tensor) -> tuple[torch.Tensor, int]:
    """This rank's part of a checkpoint tensor, read slice-wise, in ``live``'s dtype; and the bytes read."""
    want = _local_view(live)
    if isinstance(live, DTensor):
        from transformers.distributed.sharding_utils import DtensorShardOperation

        try:
            local = DtensorShardOperation(live).shard_tensor(piece, dtype=live.dtype)
        except (ValueError, NotImplementedError, IndexError) as exc:  # a layout its shard-on-read lacks
            logger.debug("shard-on-read of %s failed (%s): reading it in full", source.key, exc)
            local = None
        if local is not None and tuple(local.shape) == tuple(want.shape):
            return local, local.numel() * source.nbytes // max(_numel(source.shape), 1)
        full = piece[...].to(dtype=live.dtype)
        local = distribute_tensor(full, live.device_mesh, live.placements, src_data_rank=None).to_local()
        return local, source.nbytes
    return piece[...].to(dtype=live.dtype), source.nbytes


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _convert(
    target: _Target, opened: _OpenFiles, model: nn.Module, tensors: dict[str, torch.Tensor]
) -> Iterator[tuple[str, torch.Tensor, int]]:
    """Tensors transformers converts on load (several checkpoint tensors into one parameter): read the sources
    in full, let transformers' converter build the full parameter(s), keep this rank's part of each."""
    converter = target.converter
    read = 0
    for source, pattern in target.sources:
        full = opened.slice(source)[...]
        read += source.nbytes
        converter.add_tensor(target.name, source.key, pattern, (lambda t=full: t))
    converted = converter.convert(target.name, model=model, config=getattr(model, "config", None))
    for name, value in converted.items():
        value = value[0] if isinstance(value, list) else value
        if name not in tensors:
            raise PretrainedLoadError(
                f"transformers' conversion of {target.name} made {name!r}, which {type(model).__name__} does not "
                "have; load this checkpoint with from_pretrained on a real device, then apply the plan"
            )
        live = tensors[name]
        if tuple(value.shape) != tuple(live.shape):
            raise PretrainedLoadError(
                f"{name}: converted checkpoint tensor has shape {tuple(value.shape)}, the model {tuple(live.shape)}"
            )
        value = value.to(dtype=live.dtype)
        if isinstance(live, DTensor):
            value = distribute_tensor(value, live.device_mesh, live.placements, src_data_rank=None).to_local()
        yield name, value, read
        read = 0


def _store(name: str, live: torch.Tensor, local: torch.Tensor) -> None:
    """Copy this rank's values into the model's own tensor, in place (identity, ties and FSDP kept)."""
    target = _local_view(live)
    if tuple(local.shape) != tuple(target.shape):
        raise PretrainedLoadError(
            f"{name}: this rank's slice has shape {tuple(local.shape)}, its shard {tuple(target.shape)}; the "
            "parameter's placements are not ones the loader can slice. Please report it with the plan."
        )
    target.copy_(local.to(device=target.device))


def _local_bytes(tensors: Iterator[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind these tensors' local shards: a shard that were a view of a full
    tensor would count in full, which is what tests hold the loader to."""
    seen: dict[int, int] = {}
    for tensor in tensors:
        storage = _local_view(tensor).untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


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


def _needs_gather(tensors: Mapping[str, torch.Tensor]) -> bool:
    """Whether some tensor has parts on other ranks than its own (a DTensor sharded, or partial, on some mesh
    dim): then the writer must receive them, and every rank must take part. Decided from placements alone,
    so that every rank decides the same."""
    return any(
        isinstance(t, DTensor) and not all(p.is_replicate() for p in t.placements) for t in tensors.values()
    )


SAVE_WAIT_WARN_S = 30.0
"""Seconds a rank waits in :func:`save_pretrained` for the other ranks before warning that they may not call it
(it goes on waiting, up to the plan's collective timeout)."""

_save_calls = 0  # this process's completed collective saves: names the store keys of the next one


class SaveCollectiveError(RuntimeError):
    """``save_pretrained`` of a sharded model was not called on every rank (or with other tensors on some)."""


def save_timeout_s(model: nn.Module | None) -> float:
    """How long a rank waits in a save for the others: the plan's collective timeout (set by apply_plan)."""
    from .agree import DEFAULT_TIMEOUT_S

    return float(getattr(model, "_hf_colossal_auto_timeout_s", DEFAULT_TIMEOUT_S))


def _every_rank_arrives(tensors: Mapping[str, torch.Tensor], timeout_s: float, what: str) -> None:
    """Wait, through the process group's key-value store, until every rank has entered this save with the same
    tensors (names, shapes, dtypes) — before any collective, so that a rank that came alone (a user's
    ``if accelerator.is_main_process: model.save_pretrained(...)``) or with another state dict gets an error
    that says so instead of blocking for good in the first gather.

    Each rank notes its layout's digest under its rank and counts itself under the digest; the rank that
    completes the count tells the others. A rank that times out takes its count back: when that leaves the
    count one short of the world, the last rank arrived in between and has gone on, so this one goes on too;
    else it raises, and so does every other rank that waits (at its own timeout) — no rank enters the gather."""
    import torch.distributed as dist

    from .._torch_compat import default_store

    global _save_calls
    store, world, rank = default_store(), dist.get_world_size(), dist.get_rank()
    digest = _layout_digest(tensors, what)
    key = f"hf_colossal_auto/save/{_save_calls}"
    store.set(f"{key}/rank{rank}", digest)
    count = f"{key}/{digest}/count"
    done = f"{key}/{digest}/done"
    if store.add(count, 1) == world:
        store.set(done, "1")
    else:
        if not _wait_for(store, done, min(SAVE_WAIT_WARN_S, timeout_s)):
            logger.warning(
                "rank %d has waited %g s in %s for the other ranks: saving sharded tensors is collective, "
                "every rank must call it (not only the main process); waiting up to %g s",
                rank,
                min(SAVE_WAIT_WARN_S, timeout_s),
                what,
                timeout_s,
            )
            late = _wait_for(store, done, max(timeout_s - SAVE_WAIT_WARN_S, 0.0))
            # timed out: take this rank's count back; one short of the world means the last came meanwhile
            if not late and store.add(count, -1) != world - 1:
                raise SaveCollectiveError(_absent_message(store, key, world, rank, digest, timeout_s, what))
    _save_calls += 1


def _wait_for(store: Any, key: str, seconds: float) -> bool:
    """Whether ``key`` is set in ``store`` within ``seconds`` (the store's own blocking wait)."""
    import datetime

    import torch.distributed as dist

    if store.check([key]):
        return True
    if seconds <= 0:
        return False
    try:
        store.wait([key], datetime.timedelta(seconds=seconds))
    except dist.DistStoreError:
        return False
    return True


def _layout_digest(tensors: Mapping[str, torch.Tensor], what: str) -> str:
    """A short fingerprint of what a rank is about to save, and by which call: names, global shapes and dtypes,
    in order."""
    import hashlib

    text = what + ";" + ";".join(f"{n}:{tuple(t.shape)}:{t.dtype}" for n, t in tensors.items())
    return hashlib.sha1(text.encode()).hexdigest()[:16]


_COLLECTIVE_ADVICE = {
    "save_pretrained": "Call `model.save_pretrained(dir, is_main_process=accelerator.is_main_process)` (or "
    "accelerator.save_model / trainer.save_model) on every rank, not under `if accelerator.is_main_process:` — "
    "only the main process writes files — and pass every rank the same state_dict (or none).",
    "accelerator.save": "Call `accelerator.save(obj, path)` on every rank, not under `if "
    "accelerator.is_main_process:` — only the main process writes the file — with the same tensors on every "
    "rank.",
}


def _absent_message(
    store: Any, key: str, world: int, rank: int, digest: str, timeout_s: float, what: str
) -> str:
    """What went wrong in a save that not every rank joined: which ranks never came, which came with other
    tensors (or another call), and what to do."""
    notes = [f"{key}/rank{r}" for r in range(world)]
    absent = [r for r, note in enumerate(notes) if not store.check([note])]
    other = [r for r, note in enumerate(notes) if r not in absent and store.get(note).decode() != digest]
    problems = []
    if absent:
        problems.append(f"rank(s) {absent} did not call it within {timeout_s:g} s")
    if other:
        problems.append(f"rank(s) {other} called it (or another save) with other tensors")
    return (
        f"{what} on rank {rank}: the tensors are sharded over the ranks, so saving them is collective, but "
        f"{' and '.join(problems) or 'not every rank arrived'}. {_COLLECTIVE_ADVICE[what]}"
    )


def gathered_for_saving(obj: Any, *, timeout_s: float, every_rank: bool = False, writer: int = 0) -> Any:
    """``obj`` (nested mappings, lists, tuples) with each DTensor replaced by the full plain tensor, for
    ``accelerator.save``: a replicated one is its local tensor (nothing exchanged); a sharded one is gathered,
    to rank ``writer`` (None in its place elsewhere) or with ``every_rank`` to all, one tensor at a time.
    Collective when something is sharded, with the same arrival check as :func:`save_pretrained` first: a rank
    that came alone raises :class:`SaveCollectiveError` after ``timeout_s`` instead of hanging."""
    import torch.distributed as dist

    leaves = dict(_dtensor_leaves(obj, ""))
    if dist.is_initialized() and dist.get_world_size() > 1 and _needs_gather(leaves):
        _every_rank_arrives(leaves, timeout_s, "accelerator.save")

    def full(value: DTensor) -> torch.Tensor | None:
        if all(p.is_replicate() for p in value.placements):
            return value.to_local()
        if every_rank:
            return value.full_tensor().cpu()
        gathered = _gathered(value, writer)
        return gathered.joined() if isinstance(gathered, _StreamedTensor) else gathered

    return _replace_dtensors(obj, full)


def _dtensor_leaves(obj: Any, where: str) -> Iterator[tuple[str, DTensor]]:
    """``(path, DTensor)`` of every DTensor in ``obj``, in the order :func:`_replace_dtensors` visits them."""
    if isinstance(obj, DTensor):
        yield where, obj
    elif isinstance(obj, Mapping):
        for k, v in obj.items():
            yield from _dtensor_leaves(v, f"{where}.{k}" if where else str(k))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _dtensor_leaves(v, f"{where}[{i}]")


def _replace_dtensors(obj: Any, fn: Any) -> Any:
    """``obj`` rebuilt with ``fn(d)`` for each DTensor ``d`` (dicts, lists, tuples and named tuples kept)."""
    if isinstance(obj, DTensor):
        return fn(obj)
    if isinstance(obj, Mapping):
        out = {k: _replace_dtensors(v, fn) for k, v in obj.items()}
        return type(obj)(out) if isinstance(obj, dict) else out
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(_replace_dtensors(v, fn) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_replace_dtensors(v, fn) for v in obj)
    return obj


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


STREAM_BLOCK_BYTES = 16 * 2**20
"""Most bytes of a sharded tensor the writer receives at once: one block of another rank's rows, or one block of
full rows assembled from every rank's columns."""


def _row_blocks(local: torch.Tensor, ranks: int, dim: int) -> list[torch.Tensor]:
    """A contiguous shard cut on dim 0 into views (one row at least), the same cut on every rank: blocks of at
    most :data:`STREAM_BLOCK_BYTES`, or for a shard on another dim (whose ``ranks`` blocks side by side make
    full rows) at most that divided among the ranks."""
    if local.shape[0] == 0:
        return []
    row_bytes = max(1, local[0].numel() * local.element_size())
    budget = STREAM_BLOCK_BYTES if dim == 0 else STREAM_BLOCK_BYTES // ranks
    step = max(1, budget // row_bytes)
    return [local[i : i + step] for i in range(0, local.shape[0], step)]


class _StreamedTensor:
    """A tensor split evenly on tensor dim ``dim`` over ``ranks``, as the writer receives it, in row order: for
    a row split, each rank's rows in turn; for a split of another dim, each block of rows assembled from every
    rank's columns of it. The writer's own part is a view of its shard; every other rank's comes in blocks
    (:data:`STREAM_BLOCK_BYTES`), received when the writer asks for it and dropped once written — the writer
    never holds another rank's whole shard, let alone the full tensor. Iterate it exactly once, on the writer,
    before the next collective; the other ranks call :func:`_send_blocks`."""

    def __init__(self, local: torch.Tensor, ranks: list[int], writer: int, dim: int) -> None:
        self.local, self.ranks, self.writer, self.dim = local, ranks, writer, dim
        self.blocks = _row_blocks(local, len(ranks), dim)

    def _from(self, rank: int, block: torch.Tensor) -> torch.Tensor:
        if rank == self.writer:
            return block
        import torch.distributed as dist

        received = torch.empty_like(block)
        dist.recv(_as_bytes(received), src=rank)
        return received

    def __iter__(self) -> Iterator[torch.Tensor]:
        if self.dim == 0:
            for rank in self.ranks:
                for block in self.blocks:
                    yield self._from(rank, block)
        else:
            for block in self.blocks:
                yield torch.cat([self._from(rank, block) for rank in self.ranks], dim=self.dim)

    def held_bytes(self) -> int:
        """The most bytes of this tensor in hand at once beyond the writer's own shard: one block received,
        or for an assembled row block the other ranks' parts and the assembled rows."""
        largest = max((b.numel() * b.element_size() for b in self.blocks), default=0)
        return largest if self.dim == 0 else largest * (2 * len(self.ranks) - 1)

    def joined(self) -> torch.Tensor:
        """The whole tensor (for a file written whole): the blocks concatenated."""
        return torch.cat(list(self), dim=0)


def _split_group(value: DTensor, writer: int) -> tuple[list[int], int] | None:
    """The ranks holding ``value``'s parts beside the writer, in order, and the tensor dim they split — when
    ``value`` is split evenly over one mesh dim and replicated over any other (Megatron's column and row
    splits, FSDP's shards, a ``dp x 1`` mesh); None for any other layout."""
    placements = value.placements
    split = [d for d, p in enumerate(placements) if not p.is_replicate()]
    if len(split) != 1 or not placements[split[0]].is_shard() or value.ndim == 0:
        return None
    mesh, (mesh_dim,) = value.device_mesh, split
    dim = placements[mesh_dim].dim % value.ndim
    if value.shape[dim] % mesh.size(mesh_dim) != 0:
        return None
    coordinate = (mesh.mesh == writer).nonzero()[0].tolist()
    coordinate[mesh_dim] = slice(None)
    return mesh.mesh[tuple(coordinate)].tolist(), dim


def _send_blocks(local: torch.Tensor, ranks: int, dim: int, writer: int) -> None:
    """The other side of :class:`_StreamedTensor`: this rank's shard to the writer, block by block."""
    import torch.distributed as dist

    for block in _row_blocks(local, ranks, dim):
        dist.send(_as_bytes(block), dst=writer)


def _as_bytes(block: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's memory as uint8 (no copy): point-to-point sends move bytes of any dtype alike."""
    return block.reshape(-1).view(torch.uint8)


def _held_bytes(value: torch.Tensor | _StreamedTensor) -> int:
    """The most bytes of one gathered tensor in hand at once while it is written."""
    return value.held_bytes() if isinstance(value, _StreamedTensor) else value.numel() * value.element_size()


def _write_bytes(out: Any, value: torch.Tensor | _StreamedTensor) -> None:
    """A gathered tensor's bytes (row-major, little-endian as the host) appended to an open file; with no file
    (a writer told not to write), a streamed tensor is still received in full, which its senders wait for."""
    for piece in value if isinstance(value, _StreamedTensor) else [value]:
        if out is None:
            continue
        out.write(bytes_of(piece.detach().cpu().contiguous()))


def _return_freed_pages() -> None:
    """glibc's ``malloc_trim``: the gathered tensors, freed one after the other, would otherwise stay in the
    heap (glibc raises its mmap threshold after each large free) and the writer's resident memory would grow by
    a file's worth (measured: +0.2 GiB on the 1.1B benchmark; +0.09 GiB with this). No-op without glibc."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).malloc_trim(0)


def _gathered(live: torch.Tensor, writer: int) -> torch.Tensor | _StreamedTensor | None:
    """The full tensor on CPU on rank ``writer``, None elsewhere (collective over the tensor's mesh).

    The writer alone needs it, so the cheapest collective that brings it there is used: none for a replicated
    tensor (the writer has it) or on a mesh without the writer (another replica group's copy); a tensor split
    evenly over one mesh dim streamed to the writer in blocks (:class:`_StreamedTensor`); DTensor's all-gather
    (``full_tensor``) for any other layout."""
    import torch.distributed as dist

    value = live.detach()
    rank = dist.get_rank() if dist.is_initialized() else writer
    if not isinstance(value, DTensor):
        return value.cpu().contiguous() if rank == writer else None
    mesh = value.device_mesh
    if writer not in mesh.mesh.flatten().tolist():
        return None
    placements = value.placements
    if all(p.is_replicate() for p in placements):
        return value.to_local().cpu().contiguous() if rank == writer else None
    group = _split_group(value, writer)
    if group is not None:  # streamed to the writer block by block
        ranks, dim = group
        if rank not in ranks:
            return None
        local = value.to_local().contiguous()
        if rank != writer:
            _send_blocks(local, len(ranks), dim, writer)
            return None
        return _StreamedTensor(local, ranks, writer, dim)
    full = value.full_tensor()
    return full.cpu().contiguous() if rank == writer else None


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
