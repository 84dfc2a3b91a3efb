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

import json
import logging
import re
from collections.abc import Callable, Iterator
from copy import deepcopy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from ..materialize import is_meta_model, materialize_meta_model
from ..safetensors_io import DTYPES, SafetensorsFile, read_header

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
    keep: Callable[[str], bool] | None = None,
) -> LoadReport:
    """Fill ``model`` from the safetensors checkpoint at ``path``, each rank reading only its own slices.

    ``model`` may be planned (DTensor parameters, FSDP) or not, and may be on ``meta``: then its tensors are
    allocated first — this rank's shards only — and only what the checkpoint lacks (non-persistent buffers such
    as rotary tables, or missing keys with ``strict=False``) is initialised by the model's own init. Values are
    cast to each tensor's dtype. Call it on every rank of a planned model (a model on ``meta`` is materialised
    collectively); the checks run before anything is read, identically on every rank. ``device``: where a
    plain tensor on ``meta`` is allocated (default: :func:`.materialize.materialize_meta_model`'s).

    ``keep``: the names of the tensors this rank holds (a pipeline stage's, before the model is cut to them);
    only those are allocated and read — a tensor any of whose names it accepts, so a head tied to the
    embedding is filled from the embedding's key on the last stage. The checks still cover the whole model.
    """
    directory, files = checkpoint_files(path)
    sources = _read_headers(directory, files)
    matching = _match(model, sources)
    _refuse(model, path, matching, strict, ignore_mismatched_sizes)
    if is_meta_model(model):
        loaded = [n for n in matching.loaded_names if keep is None or keep(n)]
        materialize_meta_model(model, device, loaded=loaded, keep=keep)
    report = LoadReport(
        files=files,
        missing=matching.missing,
        unexpected=matching.unexpected,
        mismatched=matching.mismatched,
        checkpoint_bytes=sum(s.nbytes for s in sources.values()),
    )
    tensors = _model_tensors(model)
    held = {id(t) for n, t in tensors.items() if keep is None or keep(n)}
    targets = [t for t in matching.targets if id(tensors[t.name]) in held]
    with _OpenFiles(directory) as opened, torch.no_grad():
        for target in sorted(targets, key=lambda t: t.sources[0][0].file):  # each file opened once
            live = tensors[target.name]
            if target.converter is None:
                source = target.sources[0][0]
                report.bytes_read += _fill(target.name, live, opened.slice(source), source)
            else:
                for name, local, read in _convert(target, opened, model, tensors):
                    report.bytes_read += read
                    if id(tensors[name]) in held:
                        _store(name, tensors[name], local)
            report.loaded += 1
    report.local_bytes = _local_bytes(tensors[n] for n in matching.loaded_names if id(tensors[n]) in held)
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
