"""The dispatch mode that records a traced step: one :class:`OpNode` per aten call, storages and their
lifetimes.

Why its own module: :mod:`.tracer` decides *what* runs (fake parameters, the steady-state optimizer, forward,
backward, optimizer step, folded blocks); this records what each op did — its inputs and outputs as values,
the storages it allocated, and each storage's free from its Python object's finalizer, which fires when the
last tensor using it dies, so the memory timeline is what autograd really keeps alive.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Mapping
from typing import Any

import torch

from .._torch_compat import (
    TorchDispatchMode,
    WeakIdKeyDictionary,
    tree_flatten,
    tree_map,
)
from .flops import op_flops
from .graph import (
    MemoryEvent,
    OpNode,
    Phase,
    StorageInfo,
    TensorRef,
    ValueInfo,
    ValueKind,
)

logger = logging.getLogger(__name__)
aten = torch.ops.aten

# Metadata queries that are not kernels; FlopCounterMode skips the same set.
_METADATA_OPS = {
    aten.sym_is_contiguous.default,
    aten.is_contiguous.default,
    aten.is_contiguous.memory_format,
    aten.is_strides_like_format.default,
    aten.is_non_overlapping_and_dense.default,
    aten.size.default,
    aten.sym_size.default,
    aten.stride.default,
    aten.sym_stride.default,
    aten.storage_offset.default,
    aten.sym_storage_offset.default,
    aten.numel.default,
    aten.sym_numel.default,
    aten.dim.default,
    torch.ops.prim.layout.default,
    torch.ops.prim.device.default,
}


# In-place ops that change only a tensor's metadata or storage pointer: no kernel runs over the data.
_METADATA_MUTATIONS = frozenset({"resize_", "resize_as_", "set_", "as_strided_", "_resize_output_"})


def mutates_data(func: Any) -> bool:
    """True for an in-place op that runs a kernel over a tensor it was given (``bernoulli_``, ``add_``, ``copy_``):
    it aliases its input like a view but costs time like any op (dropout's ``bernoulli_`` is one of a CPU
    step's larger costs)."""
    schema = getattr(func, "_schema", None)
    if schema is None or not schema.is_mutable:
        return False
    return schema.name.split("::")[-1] not in _METADATA_MUTATIONS


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class _Recorder(TorchDispatchMode):
    """Dispatch mode that appends an :class:`OpNode` per aten call and tracks storages."""

    def __init__(self) -> None:
        super().__init__()
        self.nodes: list[OpNode] = []
        self.values: dict[int, ValueInfo] = {}
        self.storages: dict[int, StorageInfo] = {}
        self.events: list[MemoryEvent] = []
        self.initial: list[int] = []
        self.phase = Phase.FORWARD
        self.module_stack: list[str] = []
        self.recording = True
        self.scalar_stub = False
        self._storage_ids: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._value_by_view: dict[tuple, int] = {}
        self._next_storage = 0
        self._next_value = 0
        self._finalizers: list[weakref.finalize] = []
        self.output_values: list[int] = []
        self.block_args: dict[str, list[int]] = {}

    # ------------------------------------------------------------ identities
    def _storage(
        self, t: torch.Tensor, *, kind: ValueKind, name: str | None, initial: bool
    ) -> tuple[int, bool]:
        st = t.untyped_storage()
        sid = self._storage_ids.get(st)
        if sid is not None:
            return sid, False
        sid = self._next_storage
        self._next_storage += 1
        self._storage_ids[st] = sid
        nbytes = int(st.nbytes())
        self.storages[sid] = StorageInfo(sid, nbytes, kind, name)
        if initial:
            self.initial.append(sid)
        else:
            self.events.append(MemoryEvent(len(self.nodes), sid, nbytes))
        self._finalizers.append(weakref.finalize(st, self._on_free, sid, nbytes))
        return sid, True

    def _on_free(self, sid: int, nbytes: int) -> None:
        if self.recording:
            self.events.append(MemoryEvent(len(self.nodes), sid, -nbytes))

    @staticmethod
    def _view_key(t: torch.Tensor, sid: int) -> tuple:
        return (sid, t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)

    def register(
        self,
        t: torch.Tensor,
        kind: ValueKind,
        name: str | None = None,
        *,
        initial: bool,
        producer: int | None = None,
    ) -> int:
        sid, _ = self._storage(t, kind=kind, name=name, initial=initial)
        vid = self._next_value
        self._next_value += 1
        self.values[vid] = ValueInfo(
            id=vid,
            shape=tuple(t.shape),
            dtype=_dtype_name(t.dtype),
            nbytes=t.numel() * t.element_size(),
            storage_id=sid,
            kind=kind,
            producer=producer,
            name=name,
            requires_grad=t.requires_grad,
        )
        self._value_by_view[self._view_key(t, sid)] = vid
        return vid

    def known_values(self, output: Any) -> list[int]:
        """Ids of the recorded values among the tensors of ``output`` (a ModelOutput, tuple or tensor)."""
        if isinstance(output, Mapping):
            output = list(output.values())
        ids = []
        for t in tree_flatten(output)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            sid = self._storage_ids.get(t.untyped_storage())
            vid = self._value_by_view.get(self._view_key(t, sid)) if sid is not None else None
            if vid is not None and vid not in ids:
                ids.append(vid)
        return ids

    def value_of(self, t: torch.Tensor) -> int:
        st = t.untyped_storage()
        sid = self._storage_ids.get(st)
        if sid is not None:
            vid = self._value_by_view.get(self._view_key(t, sid))
            if vid is not None:
                return vid
            return self.register(t, self.storages[sid].kind, initial=False)
        # A tensor made outside the recorder (should be rare): count its storage from the start.
        logger.debug("untracked tensor of shape %s enters the step", tuple(t.shape))
        return self.register(t, ValueKind.ACTIVATION, initial=True)

    # ------------------------------------------------------------ dispatch
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _METADATA_OPS or not self.recording:
            return func(*args, **kwargs)
        if func is aten._local_scalar_dense.default and self.scalar_stub:
            # Optimizers read their step counter with .item(); a fake tensor has no value. The value does not
            # change any shape or allocation, so any number serves.
            return 1.0 if args[0].dtype.is_floating_point else 1
        # Same as FlopCounterMode: an op with a CompositeImplicit decomposition is recorded as its parts.
        with self:
            decomposed = func.decompose(*args, **kwargs)
        if decomposed is not NotImplemented:
            return decomposed
        out = func(*args, **kwargs)
        self._record(func, args, kwargs, out)
        return out

    def _record(self, func, args, kwargs, out) -> None:
        index = len(self.nodes)
        in_tensors = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        in_ids = [self.value_of(t) for t in in_tensors]
        out_tensors = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor)]
        in_storages = {self.values[v].storage_id for v in in_ids}
        out_ids: list[int] = []
        new_bytes = 0
        for t in out_tensors:
            st = t.untyped_storage()
            known = self._storage_ids.get(st)
            vid = self.register(t, ValueKind.ACTIVATION, initial=False, producer=index)
            out_ids.append(vid)
            if known is None:
                new_bytes += self.values[vid].nbytes
        if self.phase is Phase.OPTIMIZER:
            self._assign_owners(args, in_ids, out_tensors, out_ids)
        is_view = (
            bool(out_tensors)
            and new_bytes == 0
            and all(self.values[v].storage_id in in_storages for v in out_ids)
        )
        mutates = mutates_data(func)
        free = is_view and not mutates
        bytes_read = 0 if free else sum(self.values[v].nbytes for v in dict.fromkeys(in_ids))
        bytes_written = 0 if free else sum(self.values[v].nbytes for v in out_ids)
        ref_of = {id(t): TensorRef(v) for t, v in zip(in_tensors, in_ids, strict=True)}
        recorded_args = tree_map(
            lambda a: ref_of.get(id(a), a) if isinstance(a, torch.Tensor) else a, (args, kwargs)
        )
        self.nodes.append(
            OpNode(
                index=index,
                op=str(func),
                phase=self.phase,
                module=self.module_stack[-1] if self.module_stack else "",
                inputs=in_ids,
                outputs=out_ids,
                flops=op_flops(func, args, kwargs, out),
                bytes_read=bytes_read,
                bytes_written=bytes_written,
                args=recorded_args,
                is_view=is_view,
                mutates=mutates,
            )
        )

    def set_owner(self, t: torch.Tensor, owner: str) -> None:
        sid = self._storage_ids.get(t.untyped_storage())
        if sid is not None:
            self.storages[sid].owner = owner

    def _assign_owners(self, args, in_ids, out_tensors, out_ids) -> None:
        """Attribute each new storage of an optimizer op to a parameter: foreach ops map list position to
        parameter (out[i] belongs to the owner of the first list argument's element i); others inherit the
        owner of their first owned input."""
        lists = [a for a in args if isinstance(a, (list, tuple)) and a and isinstance(a[0], torch.Tensor)]
        for pos, (_t, vid) in enumerate(zip(out_tensors, out_ids, strict=True)):
            info = self.storages[self.values[vid].storage_id]
            if info.owner is not None:
                continue
            owner = None
            if lists and len(lists[0]) == len(out_tensors):
                owner = self.storages[self.values[self.value_of(lists[0][pos])].storage_id].owner
            if owner is None:
                owner = next(
                    (
                        self.storages[self.values[v].storage_id].owner
                        for v in in_ids
                        if self.storages[self.values[v].storage_id].owner
                    ),
                    None,
                )
            info.owner = owner
