"""The data a step sees, under any plan: exactly the rows plain accelerate gives the same processes.

**The rule.** Every data loader is prepared exactly as plain accelerate prepares it on this process (its
``prepare_data_loader``: the same sampler, the same draws from the random generators, the same
``even_batches`` padding, ``drop_last``, ``split_batches``, the same number of batches per epoch). A plan
with tensor parallelism (``tp > 1``) then *re-cuts* the prepared loader: the ``tp`` processes of one
tensor-parallel group compute on one batch, and that batch is the **union of the batches plain accelerate
gives those processes at that step** (processes ``g*tp .. g*tp+tp-1``, in rank order), collated once. So the
global batch of step ``i`` holds exactly plain accelerate's rows of step ``i``, whatever the mesh, and a
loader's length, ``gradient_state.remainder`` and ``skip_first_batches`` are accelerate's own.

How the re-cut is made, by loader kind (:func:`regroup_loader`):

* map-style datasets: accelerate's ``BatchSamplerShard`` becomes a :class:`GroupBatchSampler`, which walks
  the underlying batch sampler once per epoch and yields, per step, the batches ``BatchSamplerShard`` would give
  each member process, laid end to end (``split_batches``: a contiguous slice of the global batch);
* ``IterableDataset`` read by every process (``IterableDatasetShard``): the members' element slices of each
  ``batch x processes`` chunk, which are contiguous, and batches ``tp`` times as long;
* ``IterableDataset`` dispatched from the main process (accelerate's default for iterable datasets): each
  process keeps the members' slices of the dispatched batch instead of its own.

**Why re-cut after the fact.** The loader can be prepared before the plan exists (the Trainer prepares its
loader before its model; accelerate's own test scripts prepare loaders without any model), so the re-cut is a
change of the prepared loader's own sampler (same object, found by the Trainer and by accelerate's
``skip_first_batches``), made when the plan arrives: a loader prepared before (or without) a model behaves as
under plain accelerate until a plan needs it re-cut. The change applies from the loader's next epoch (next
``iter``); a dispatched loader's from its next batch.

**Why the union in the loader rather than per-process batches gathered inside the model.** Collating the
group's indices once gives the group one padding (dynamic padding with ``DataCollatorWithPadding`` pads every
per-process batch to its own longest row, so per-process batches of one group would not even have the same
shapes), and every rank holds the group's rows: a loss the script computes outside the model from the model's
outputs and the batch (``mse_loss(model(x), batch["y"])``) is the group's loss on every rank, as tensor
parallelism needs. Only the epoch in flight when a plan is made from the model's first call
(:mod:`.first_call`) has per-process batches; that call and the rest of that epoch gather them inside the model
(:func:`batch_is_per_process` tells).

What this costs callers: values a process computes from its batch are the group's, once per member.
``gather``/``gather_for_metrics`` therefore keep one copy of what a tensor-parallel group holds in common
(:func:`one_copy_per_group`), and the Trainer counts tokens once per group.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import logging
import random
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from accelerate.data_loader import BatchSamplerShard, IterableDatasetShard
from torch import nn
from torch.utils.data import BatchSampler, DataLoader

from ..apply.data import data_parallel_info

logger = logging.getLogger(__name__)


def tensor_parallel_members(rank: int, tp_size: int) -> tuple[int, ...]:
    """The processes of ``rank``'s tensor-parallel group: the plan's mesh is row-major with ``tp`` last, so
    a group is ``tp`` consecutive ranks."""
    first = rank - rank % tp_size
    return tuple(range(first, first + tp_size))


def group_members(rank: int, tp_size: int, pp_size: int = 1, dp_size: int = 1) -> tuple[int, ...]:
    """The processes whose batches ``rank``'s data-parallel group computes on, consecutive. Without pipeline
    stages the group's own ranks (:func:`tensor_parallel_members`). With them (mesh ``(pp, dp, tp)``, row-major)
    a group's ranks are not consecutive, but any ``pp x tp`` processes' batches will do as long as every rank of
    the group takes the same ones and the groups together take every process's once: group ``d`` takes
    processes ``d x pp x tp ..``, contiguous, so every loader kind can be re-cut for it."""
    if pp_size == 1:
        return tensor_parallel_members(rank, tp_size)
    group = (rank // tp_size) % dp_size
    size = tp_size * pp_size
    return tuple(range(group * size, (group + 1) * size))


# ----------------------------------------------------------------------------------------- map-style datasets
class _Stream:
    """One member's view of a shared pass over the batch sampler (``itertools.tee``), with the attributes
    ``BatchSamplerShard`` reads from the sampler it wraps."""

    def __init__(self, batches: Iterator[list[int]], source: Any) -> None:
        self._batches = batches
        self.batch_size = getattr(source, "batch_size", None)
        self.drop_last = getattr(source, "drop_last", False)
        self._length = source

    def __iter__(self) -> Iterator[list[int]]:
        # a copy per member: BatchSamplerShard completes the last batch in place (``batch += ...``)
        return (list(batch) for batch in self._batches)

    def __len__(self) -> int:
        return len(self._length)


class GroupBatchSampler(BatchSamplerShard):
    """accelerate's ``BatchSamplerShard`` for several processes at once (``members``): each step yields the
    batches plain accelerate gives those processes at that step, end to end. With ``members`` this process
    alone it is ``BatchSamplerShard`` itself. The underlying batch sampler is iterated once per epoch (one
    shuffle, one draw from its generator), as under plain accelerate."""

    members: tuple[int, ...] = ()
    grouped_iteration: bool = False
    """Whether the epoch being iterated yields group batches (False for an epoch begun before the re-cut)."""

    def _member_shard(
        self, process_index: int, batches: Iterator[list[int]] | None = None
    ) -> BatchSamplerShard:
        shard = BatchSamplerShard.__new__(BatchSamplerShard)
        shard.__dict__.update(self.__dict__)
        shard.process_index = process_index
        if batches is not None:
            shard.batch_sampler = _Stream(batches, self.batch_sampler)
        return shard

    def _alone(self) -> bool:
        return not self.members or tuple(self.members) == (self.process_index,)

    def __iter__(self) -> Iterator[list[int]]:
        self.grouped_iteration = not self._alone()
        if not self.grouped_iteration:
            yield from super().__iter__()
            return
        streams = itertools.tee(iter(self.batch_sampler), len(self.members))
        shards = [iter(self._member_shard(p, s)) for p, s in zip(self.members, streams, strict=True)]
        # even_batches=False can leave some members one batch short at the end: the group then computes on the
        # members' batches that exist, as those processes would under plain accelerate
        for parts in itertools.zip_longest(*shards):
            yield [index for part in parts if part is not None for index in part]

    def __len__(self) -> int:
        if self._alone():
            return super().__len__()
        return max(len(self._member_shard(p)) for p in self.members)


# ----------------------------------------------------------------------------------------- iterable datasets
class GroupIterableDatasetShard(IterableDatasetShard):
    """accelerate's ``IterableDatasetShard`` for a contiguous run of processes (``members``): of every chunk
    of ``batch x processes`` elements, the members' slices, which are contiguous and in rank order."""

    members: tuple[int, ...] = ()
    grouped_iteration: bool = False

    def __iter__(self) -> Iterator[Any]:
        members = tuple(self.members) or (self.process_index,)
        self.grouped_iteration = members != (self.process_index,)
        if not self.grouped_iteration:
            yield from super().__iter__()
            return
        # the members' slices of each chunk are one contiguous slice: run accelerate's own sharding over
        # len(members) times fewer, wider processes (same chunks, same end-of-data completion)
        wide = copy.copy(self)
        wide.__class__ = IterableDatasetShard
        per_process = self.batch_size // self.num_processes if self.split_batches else self.batch_size
        group = len(members)
        wide.num_processes = self.num_processes // group
        wide.process_index = members[0] // group
        wide.batch_size = self.batch_size if self.split_batches else per_process * group
        yield from wide.__iter__()


class _LongerBatches(BatchSampler):
    """The iterable-dataset loader's own batch sampler, with batches ``factor`` times longer; its
    ``batch_size`` stays the per-process one that accelerate's ``total_batch_size`` and remainder read."""

    factor: int = 1

    def __iter__(self) -> Iterator[list[Any]]:
        size = self.batch_size * self.factor
        batch: list[Any] = []
        for index in self.sampler:
            batch.append(index)
            if len(batch) == size:
                yield batch
                batch = []
        if batch and not self.drop_last:
            yield batch


class _DispatchSlice:
    """``slice_fn`` of a dispatched loader: the members' rows of the dispatched batch instead of this
    process's (the members' slices are contiguous)."""

    def __init__(self, inner: Any, members: tuple[int, ...]) -> None:
        self.inner = inner
        self.members = members
        self.grouped_iteration = False

    def __call__(self, data: Any, tensor_slice: slice, process_index: int, num_processes: int) -> Any:
        width = tensor_slice.stop - tensor_slice.start
        if tensor_slice.start == process_index * width and process_index in self.members:
            tensor_slice = slice(self.members[0] * width, (self.members[-1] + 1) * width)
        self.grouped_iteration = len(self.members) > 1
        return self.inner(data, tensor_slice, process_index=process_index, num_processes=num_processes)


# ----------------------------------------------------------------------------------------- the re-cut
def _batch_sampler_shard(loader: Any) -> BatchSamplerShard | None:
    for name in ("batch_sampler", "sampler"):
        found = getattr(loader, name, None)
        if isinstance(found, BatchSamplerShard):
            return found
    return None


def regroup_loader(loader: Any, members: Sequence[int]) -> bool:
    """Make the prepared ``loader`` (what accelerate's ``prepare_data_loader`` returned on this process) yield
    its tensor-parallel group's batches (``members``: the group's processes, consecutive). Returns whether the
    loader is one of accelerate's sharded kinds (else it is left alone: one process, or a loader accelerate
    does not shard, whose every process already reads the same data)."""
    members = tuple(members)
    from accelerate.data_loader import DataLoaderDispatcher

    shard = _batch_sampler_shard(loader)
    if shard is not None:
        if not isinstance(shard, GroupBatchSampler):
            shard.__class__ = GroupBatchSampler  # the same object the DataLoader (and the Trainer) hold
        shard.members = members
        return True
    dataset = getattr(loader, "dataset", None)
    if isinstance(dataset, IterableDatasetShard):
        if not isinstance(dataset, GroupIterableDatasetShard):
            dataset.__class__ = GroupIterableDatasetShard
        dataset.members = members
        sampler = loader.batch_sampler  # the loader's own (over an infinite sampler), not accelerate's
        if not isinstance(sampler, _LongerBatches):
            sampler.__class__ = _LongerBatches
        sampler.factor = len(members)
        return True
    if isinstance(loader, DataLoaderDispatcher):
        current = loader.slice_fn
        inner = current.inner if isinstance(current, _DispatchSlice) else current
        loader.slice_fn = _DispatchSlice(inner, members)
        return True
    if getattr(loader, "_is_accelerate_prepared", False) and len(members) > 1:
        _refuse_unshardable(loader)
    return False


def _refuse_unshardable(loader: Any) -> None:
    """A prepared loader sharded some other way (a ``datasets`` streaming dataset split by shards per process):
    its group batches cannot be formed from what each process reads."""
    dataset = getattr(loader, "dataset", None)
    if hasattr(dataset, "n_shards"):
        raise ValueError(
            f"this plan has tensor parallelism, so each tensor-parallel group must compute on one batch, but "
            f"accelerate split the streaming dataset ({type(dataset).__name__}, {dataset.n_shards} shards) by "
            "shards over the processes, which cannot be re-cut per group. Use "
            "Accelerator(dataloader_config=DataLoaderConfiguration(dispatch_batches=True)) (the main process "
            "reads and dispatches), or fewer shards than processes"
        )


def group_batch_active(loader: Any) -> bool:
    """Whether ``loader``'s current iteration yields its tensor-parallel group's batches."""
    probe: Any = loader
    for _ in range(4):  # skip_first_batches wraps the batch sampler once more
        for name in ("batch_sampler", "sampler", "dataset", "slice_fn"):
            found = getattr(probe, name, None)
            if isinstance(found, GroupBatchSampler | GroupIterableDatasetShard | _DispatchSlice):
                return bool(found.grouped_iteration)
        probe = getattr(probe, "batch_sampler", None)
        if probe is None:
            return False
    return False


def batch_is_per_process() -> bool:
    """Whether the batch a model is called with now is one process's (plain accelerate's layout), not its
    tensor-parallel group's: no prepared loader is being iterated, or the one being iterated began its epoch
    before the plan re-cut it."""
    from accelerate.state import GradientState

    active = GradientState().active_dataloader
    return active is None or not group_batch_active(active)


# ----------------------------------------------------------------------------------------- gathers
def group_batch_rows(loader: Any, tp_size: int) -> int | None:
    """Rows of the full batch a tensor-parallel group computes on while ``loader`` (the active prepared loader)
    yields group batches: ``tp`` per-process batches. None when unknown (no loader is being iterated, or its
    epoch began before the re-cut)."""
    if loader is None or not group_batch_active(loader):
        return None
    shard = _batch_sampler_shard(loader)
    source = shard if shard is not None else getattr(loader, "dataset", None)
    if not isinstance(source, BatchSamplerShard | IterableDatasetShard) or not source.batch_size:
        return None
    per_process = source.batch_size // source.num_processes if source.split_batches else source.batch_size
    return per_process * tp_size


def _group_rows(tensor: torch.Tensor, world: int, tp_size: int, pp_size: int = 1) -> torch.Tensor | None:
    """One copy per data-parallel group of an all-gathered tensor (``world`` equal blocks along dim 0, rank
    ``r = (p x dp + d) x tp + t`` of the mesh ``(pp, dp, tp)``), or None when the blocks of some group differ
    (then the values are per process, not the group's)."""
    if tensor.dim() == 0 or tensor.shape[0] % world:
        return None
    dp = world // (tp_size * pp_size)
    blocks = tensor.reshape(pp_size, dp, tp_size, tensor.shape[0] // world, *tensor.shape[1:])
    first = blocks[0, :, 0]
    if not all(torch.equal(first, blocks[p, :, t]) for p in range(pp_size) for t in range(tp_size)):
        return None
    return first.reshape(-1, *tensor.shape[1:])


def one_copy_per_group(
    gathered: Any,
    world: int,
    tp_size: int,
    *,
    objects: bool = False,
    group_rows: int | None = None,
    pp_size: int = 1,
) -> Any:
    """Of what every process gathered, one copy per tensor-parallel group where the group's members hold the
    same rows computed from their shared batch, in rank order: the result plain accelerate's ``gather``
    gives, each sample once. Values that differ within a group (a process index, say) are kept from every
    process, as accelerate gathers them. ``objects``: ``gathered`` is ``gather_object``'s list of every
    process's items.

    ``group_rows``: the rows of the batch the group computes on, where known (:func:`group_batch_rows`). Then
    only a value with that many rows is per sample of the group's batch and kept once; any other (a batch's
    loss repeated per process-batch row, as transformers' examples gather it) stands for one process's batch
    under plain accelerate, so every process's copy is kept and the count is plain accelerate's.

    ``pp_size``: the plan's pipeline ranks; the copies of a group's values are then spread over the mesh
    ``(pp, dp, tp)`` (:func:`_group_rows`), not consecutive."""
    from accelerate.utils import recursively_apply

    if tp_size * pp_size == 1:
        return gathered
    if objects:
        per = len(gathered) // world if world else 0
        if per * world != len(gathered):
            return gathered
        chunks = [gathered[r * per : (r + 1) * per] for r in range(world)]
        dp = world // (tp_size * pp_size)
        groups = [
            [chunks[(p * dp + d) * tp_size + t] for p in range(pp_size) for t in range(tp_size)]
            for d in range(dp)
        ]
        if any(any(c != group[0] for c in group[1:]) for group in groups):
            return gathered
        return [item for group in groups for item in group[0]]

    def one_copy(tensor: torch.Tensor) -> torch.Tensor:
        if group_rows is not None and (tensor.dim() == 0 or tensor.shape[0] != group_rows * world):
            return tensor
        rows = _group_rows(tensor, world, tp_size, pp_size)
        return tensor if rows is None else rows

    return recursively_apply(one_copy, gathered, error_on_other_type=False)


def gather_for_metrics(
    accelerator: Any, input_data: Any, tp_size: int, use_gather_object: bool = False, pp_size: int = 1
) -> Any:
    """accelerate's ``gather_for_metrics`` for an accelerator whose tensor-parallel groups share batches: one
    copy per group (:func:`one_copy_per_group`), then the last batch's padding cut as accelerate cuts it (its
    remainder counts plain accelerate's rows, which are the rows kept)."""
    from accelerate.utils import gather, gather_object, recursively_apply

    try:
        recursively_apply(lambda x: x, input_data, error_on_other_type=True)
        all_tensors = True
    except TypeError:
        all_tensors = False
    world = accelerator.num_processes
    if use_gather_object or not all_tensors:
        data = one_copy_per_group(gather_object(input_data), world, tp_size, objects=True, pp_size=pp_size)
    else:
        rows = group_batch_rows(accelerator.gradient_state.active_dataloader, tp_size * pp_size)
        data = one_copy_per_group(gather(input_data), world, tp_size, group_rows=rows, pp_size=pp_size)
    state = accelerator.gradient_state
    if state.end_of_dataloader and state.remainder > 0:
        if isinstance(data, list):
            return data[: state.remainder]
        return recursively_apply(lambda t: t[: state.remainder], data)
    return data


def follow_plan(accelerator: Any, group_size: int, pp_size: int = 1, dp_size: int = 1) -> None:
    """Make a plain ``accelerate.Accelerator`` (the Trainer's, under ``torchrun`` with the callback) follow a
    plan's batch rule: its loaders, prepared so far and later, are re-cut for the data-parallel groups (the
    ``group_size = tp x cp`` consecutive ranks of a replica, :attr:`Plan.batch_group_size`, and its pipeline
    stages share a batch, :func:`group_members`), and ``gather``/``gather_for_metrics`` keep one copy per group.
    An ``AutoParallelAccelerator`` does this itself."""
    if group_size * pp_size == 1 or getattr(accelerator, "_hf_colossal_auto_follows", False):
        return
    members = group_members(accelerator.process_index, group_size, pp_size, dp_size)
    world = accelerator.num_processes
    prepare, base_gather = accelerator.prepare_data_loader, accelerator.gather

    def prepare_data_loader(data_loader, device_placement=None, slice_fn_for_dispatch=None):
        prepared = prepare(data_loader, device_placement, slice_fn_for_dispatch)
        regroup_loader(prepared, members)
        return prepared

    def gather_once(tensor: Any) -> Any:
        rows = group_batch_rows(accelerator.gradient_state.active_dataloader, group_size * pp_size)
        return one_copy_per_group(base_gather(tensor), world, group_size, group_rows=rows, pp_size=pp_size)

    def metrics(input_data: Any, use_gather_object: bool = False) -> Any:
        return gather_for_metrics(accelerator, input_data, group_size, use_gather_object, pp_size=pp_size)

    accelerator.prepare_data_loader = prepare_data_loader
    accelerator.gather = gather_once
    accelerator.gather_for_metrics = metrics
    accelerator._hf_colossal_auto_follows = True
    for loader in accelerator._dataloaders:
        regroup_loader(loader, members)


# ----------------------------------------------------------------------------------------- helpers
@contextlib.contextmanager
def preserved_rng() -> Iterator[None]:
    """Planning and applying a plan must not move the run's random streams (data order, dropout, init):
    accelerate seeds a shuffling sampler's generator from the global RNG when it prepares the loader."""
    py_state, np_state = random.getstate(), np.random.get_state()
    devices = (
        [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    )
    with torch.random.fork_rng(devices=devices):
        try:
            yield
        finally:
            random.setstate(py_state)
            np.random.set_state(np_state)


def data_parallel_loader(loader: DataLoader, model: nn.Module, **prepare_kwargs: Any) -> DataLoader:
    """``loader`` (made with one process's batch size, not yet sharded: no ``DistributedSampler``) as this
    process reads it under ``model``'s plan: prepared as accelerate would for this job's processes, then
    re-cut so that a tensor-parallel group reads the union of its members' batches. Extra keyword arguments
    go to accelerate's ``prepare_data_loader`` (e.g. ``device``, ``even_batches``)."""
    from accelerate.data_loader import prepare_data_loader

    info = data_parallel_info(model)
    world = info.world_size
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    prepare_kwargs.setdefault("dispatch_batches", False)
    # as accelerate's Accelerator: every epoch starts from rank 0's shuffling state, so the shards agree
    prepare_kwargs.setdefault("rng_types", ["generator"])
    prepared = prepare_data_loader(loader, num_processes=world, process_index=rank, **prepare_kwargs)
    if info.group_processes > 1:
        regroup_loader(prepared, group_members(rank, info.tp_size * info.cp_size, info.pp_size, info.size))
    return prepared
