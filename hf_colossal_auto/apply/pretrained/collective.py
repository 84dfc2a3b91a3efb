"""A save of sharded tensors is collective: every rank arrives with the same tensors, or every rank raises.

Why: a user's ``if accelerator.is_main_process: model.save_pretrained(...)`` would otherwise block the main
process for good in the first gather. Before any collective each rank checks in through the process group's
key-value store (:func:`_every_rank_arrives`); a rank that waits past the plan's timeout raises
:class:`SaveCollectiveError` naming the ranks that did not come. Also ``accelerator.save``'s gather of DTensors
(:func:`gathered_for_saving`), which makes the same check first.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from .stream import _gathered, _StreamedTensor

logger = logging.getLogger(__name__)


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
    from ..agree import DEFAULT_TIMEOUT_S

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

    from ..._torch_compat import default_store

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
