"""Context parallelism's outputs: the loss summed over cp at once, token-wise fields all-gathered only when read.

Why lazy: every cp rank holds its part of each token-wise output (logits ``[rows, S / cp, vocab]``, hidden
states). Gathering them into the whole sequence on every rank is what one process's tensors need, but a
training step reads only ``.loss``, and at long context the gathered logits are what does not fit (Llama-3-8B
at 131,072 tokens: 67 GB of fp32 logits on every cp rank). So the wrapped forward returns the model's own
output class (a subclass of it: ``isinstance`` holds) whose token-wise fields hold a :class:`PendingField`
until read; the first read all-gathers that field over the cp group, puts it in sequence order and keeps it
(exactly once per field), with the autograd the eager gather had: the gather runs in the grad mode of the
forward, its backward keeps this rank's positions and runs no collective.

**Reading a lazy field is a collective over the cp group.** Every cp rank of a replica runs the same loop on
the same rows, so they read alike; code that reads logits on one rank only (logging on the main process) would
leave the others out. Each read first exchanges a small tag over the cp group (which forward, which field): a
rank that reads something else raises :class:`ContextParallelError` on every rank that read, naming both, and a
rank whose peers never read raises after ``HF_COLOSSAL_AUTO_CP_READ_TIMEOUT_S`` seconds (default
:data:`READ_TIMEOUT_S`) instead of pairing its gather with another collective. Printing an output (its
``repr``) reads nothing.

Every way a transformers ``ModelOutput`` (an ``OrderedDict`` and a dataclass) is read goes through the class:
attributes (properties per field), ``out["logits"]``, ``out[1]`` / slices, ``to_tuple``, ``get``, ``values``,
``items``, ``dict(out)`` / ``**out`` (``keys`` + ``__getitem__``), equality, ``copy``, pickling, pytree
flattening (``values``). What reads the mapping's storage behind the class's back finds a
:class:`PendingField`, not a tensor: it fails instead of computing on this rank's part.

What runs inside ``model(...)`` sees this rank's output, not the lazy one (:func:`install_output_deferral`):
forward hooks that visit every output tensor (FSDP2's pre-backward hooks, MemTracker) and forward wrappers that
rebuild the output (accelerate's ``convert_outputs_to_fp32`` under mixed precision) would otherwise gather every
field on every step. Code outside the call that visits every field (a pytree ``tree_map`` of the output,
accelerate's ``gather``) reads them, alike on every rank.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from .context_parallel_attention import ContextParallel, ContextParallelError, GatherReplicated, SumReplicated

READ_TIMEOUT_S = 600.0
"""Default seconds a rank waits for its cp peers to read the same output field
(``HF_COLOSSAL_AUTO_CP_READ_TIMEOUT_S`` overrides)."""

READ_TAG = 0x6370_7265_6164
"""First element of the tag a read exchanges, so that a peer's unrelated collective does not look like a read."""

OUTPUTS_ATTR = "_hf_colossal_auto_cp_outputs"
"""Attribute of a context-parallel model: its :class:`OutputDeferral`."""


def read_timeout_s() -> float:
    """Seconds a lazy read waits for the other cp ranks (``HF_COLOSSAL_AUTO_CP_READ_TIMEOUT_S``)."""
    text = os.environ.get("HF_COLOSSAL_AUTO_CP_READ_TIMEOUT_S")
    if not text:
        return READ_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        raise ContextParallelError(
            f"HF_COLOSSAL_AUTO_CP_READ_TIMEOUT_S={text!r} is not a number of seconds"
        ) from None
    if value <= 0:
        raise ContextParallelError(f"HF_COLOSSAL_AUTO_CP_READ_TIMEOUT_S must be > 0 seconds, got {text!r}")
    return value


# ------------------------------------------------------------------------------------------- one field
@dataclasses.dataclass
class PendingField:
    """A token-wise output field not yet gathered: what the output holds in its place until it is read."""

    key: str
    code: int
    """The field's index among the output class's fields (the tag every cp rank compares)."""
    forward_index: int
    """Which forward of the model made it (the tag's other half)."""
    names: tuple[str, ...]
    """The output class's field names, to name a peer's field in an error."""
    cp: ContextParallel
    compute: Callable[[], Any]
    """The gathered value (and whatever was composed on it, :func:`transform_fields`)."""
    grad_enabled: bool
    inference: bool

    def __repr__(self) -> str:
        return f"<{self.key}: this rank's part, all-gathered over the {self.cp.size} cp ranks when read>"

    def read(self) -> Any:
        """The gathered value: every cp rank agrees on what it reads (:func:`agree_on_read`), then the gather
        runs in the forward's grad mode (so that its autograd is the eager gather's, wherever it is read)."""
        agree_on_read(self)
        with torch.inference_mode(self.inference), torch.set_grad_enabled(self.grad_enabled):
            return self.compute()


def agree_on_read(field: PendingField) -> None:
    """All-gather a small tag (which forward, which field) over the cp group before the field's own gather:
    a peer that reads another field or another forward's makes every rank that read raise, naming both; peers
    that do not read within :func:`read_timeout_s` make this rank raise (instead of pairing its gather with
    whatever collective they run next)."""
    cp = field.cp
    if not dist.is_initialized() or dist.get_backend() == "fake" or cp.size == 1:
        return
    mine = torch.tensor([READ_TAG, field.forward_index, field.code], dtype=torch.int64, device=cp.device)
    every = mine.new_empty(cp.size * mine.numel())
    timeout = read_timeout_s()
    work = dist.all_gather_into_tensor(every, mine, group=cp.group, async_op=True)
    _wait(work, timeout, field)
    table = every.view(cp.size, -1).tolist()
    for rank, row in enumerate(table):
        if row != table[cp.rank]:
            raise ContextParallelError(
                f"context-parallel outputs are read collectively, alike on every cp rank: cp rank {cp.rank} read "
                f"{field.key!r} of forward #{field.forward_index}, cp rank {rank} read "
                f"{_describe(row, field.names)}. Read the same fields of the same outputs in the same order on "
                "every process (e.g. compute metrics from logits on every process, log on the main one)"
            )


def _describe(row: list[int], names: tuple[str, ...]) -> str:
    """A peer's tag in words."""
    if len(row) != 3 or row[0] != READ_TAG:
        return f"no output field (its collective carried {row})"
    name = names[row[2]] if 0 <= row[2] < len(names) else f"field #{row[2]}"
    return f"{name!r} of forward #{row[1]}"


def _wait(work: Any, timeout: float, field: PendingField) -> None:
    """Wait for ``work`` at most ``timeout`` seconds (polled: a backend's own ``wait(timeout)`` may not block
    the host), turning a timeout or a failed collective into an error that says what a lazy read needs."""
    deadline = time.monotonic() + timeout
    delay = 1e-4
    while not work.is_completed():
        if time.monotonic() > deadline:
            raise ContextParallelError(_not_read_by_peers(field, f"waited {timeout:g} s for them"))
        time.sleep(delay)
        delay = min(2 * delay, 1e-2)
    try:
        work.wait()
    except RuntimeError as exc:
        raise ContextParallelError(_not_read_by_peers(field, f"the exchange failed: {exc}")) from exc


def _not_read_by_peers(field: PendingField, what: str) -> str:
    cp = field.cp
    return (
        f"reading {field.key!r} of a context-parallel output all-gathers it over the {cp.size} cp ranks (a "
        f"collective), but the other cp ranks did not read it with cp rank {cp.rank} ({what}; "
        "HF_COLOSSAL_AUTO_CP_READ_TIMEOUT_S sets the wait). Read token-wise outputs on every process alike "
        "(e.g. compute metrics from logits on every process and log on the main one), or read only .loss"
    )


# ------------------------------------------------------------------------------------------- the output class
class _GatheredWhenRead:
    """What the lazy output class adds to the model's output class: every read resolves pending fields (the
    mixin comes first in the MRO; ``super()`` is the model's own class)."""

    _hf_colossal_auto_gathered_when_read = True

    def _read(self, key: str) -> Any:
        value = OrderedDict.__getitem__(self, key)  # type: ignore[arg-type]
        if isinstance(value, PendingField):
            value = value.read()
            OrderedDict.__setitem__(self, key, value)  # type: ignore[arg-type]
            self.__dict__[key] = value
        return value

    def _read_all(self) -> None:
        for key in list(self.keys()):  # type: ignore[attr-defined]
            self._read(key)

    def __getitem__(self, k: Any) -> Any:
        if isinstance(k, str):
            k = _current_name(self, k)
            if k not in self.keys():  # type: ignore[attr-defined]
                raise KeyError(k)
            return self._read(k)
        keys = list(self.keys())[k]  # type: ignore[attr-defined]
        if isinstance(k, slice):
            return tuple(self._read(key) for key in keys)
        return self._read(keys)

    def get(self, key: str, default: Any = None) -> Any:
        key = _current_name(self, key)
        return self._read(key) if key in self.keys() else default  # type: ignore[attr-defined]

    def to_tuple(self) -> tuple:
        return tuple(self._read(k) for k in self.keys())  # type: ignore[attr-defined]

    def values(self) -> Any:
        self._read_all()
        return super().values()  # type: ignore[misc]

    def items(self) -> Any:
        self._read_all()
        return super().items()  # type: ignore[misc]

    def popitem(self, *args: Any, **kwargs: Any) -> Any:
        self._read_all()
        return super().popitem(*args, **kwargs)  # type: ignore[misc]

    def __eq__(self, other: object) -> bool:
        self._read_all()
        if isinstance(other, _GatheredWhenRead):
            other._read_all()
        return super().__eq__(other)  # type: ignore[misc]

    def __ne__(self, other: object) -> bool:
        return not self.__eq__(other)

    __hash__ = None  # type: ignore[assignment]

    def __or__(self, other: Any) -> Any:
        self._read_all()
        return super().__or__(other)  # type: ignore[misc]

    def __ror__(self, other: Any) -> Any:
        self._read_all()
        return super().__ror__(other)  # type: ignore[misc]

    def __ior__(self, other: Any) -> Any:
        self._read_all()
        return super().__ior__(other)  # type: ignore[misc]

    def plain(self) -> Any:
        """Every field read, as an instance of the model's own output class."""
        base = type(self).__hf_colossal_auto_base__
        self._read_all()
        return base(**{f.name: self.__dict__.get(f.name) for f in dataclasses.fields(base)})

    def copy(self) -> Any:
        return self.plain()

    def __reduce__(self) -> Any:
        return self.plain().__reduce__()

    def __repr__(self) -> str:  # reads nothing: printing on one rank must not be a collective
        shown = ", ".join(f"{f.name}={self.__dict__.get(f.name)!r}" for f in dataclasses.fields(self))  # type: ignore[arg-type]
        return f"{type(self).__hf_colossal_auto_base__.__qualname__}({shown})"


def _current_name(output: Any, key: str) -> str:
    """transformers' renaming of an old field name (``past_key_values`` -> ``cache``) where it has one."""
    rename = getattr(output, "_replace_old_cache_name", None)
    return rename(key) if rename is not None else key


def _field_property(name: str) -> property:
    """Attribute access to a field: read (gathered) when pending. The setter is what ``ModelOutput.__setattr__``
    ends in (``object.__setattr__`` finds the property): a value set replaces a pending one."""

    def get(self: Any) -> Any:
        value = self.__dict__.get(name)
        return self._read(name) if isinstance(value, PendingField) else value

    def set_(self: Any, value: Any) -> None:
        self.__dict__[name] = value

    return property(get, set_, doc=f"the output's {name!r} (all-gathered over cp when first read)")


@functools.cache
def lazy_output_class(base: type) -> type:
    """The subclass of the model's output class ``base`` whose token-wise fields are gathered when read."""
    namespace: dict[str, Any] = {f.name: _field_property(f.name) for f in dataclasses.fields(base)}
    namespace["__hf_colossal_auto_base__"] = base
    namespace["__module__"] = __name__
    namespace["__doc__"] = (
        f"{base.__name__} of a context-parallel forward: token-wise fields all-gathered over cp when read."
    )
    return type(base)(f"ContextParallel{base.__name__}", (_GatheredWhenRead, base), namespace)


def is_gathered_when_read(output: Any) -> bool:
    """Whether ``output`` is a lazy context-parallel output."""
    return isinstance(output, _GatheredWhenRead)


def transform_fields(output: Any, fn: Callable[[Any], Any]) -> Any:
    """``output`` with ``fn`` applied to every field's value (a ModelOutput in place, else ``fn(output)``);
    on a lazy output a pending field gets ``fn`` composed on its gather (still read lazily, ``fn`` after the
    gather, as if it had run eagerly)."""
    if not isinstance(output, Mapping):
        return fn(output)
    for key in list(output.keys()):
        held = OrderedDict.__getitem__(output, key) if is_gathered_when_read(output) else None
        if isinstance(held, PendingField):
            held.compute = functools.partial(lambda inner: fn(inner()), held.compute)
        else:
            output[key] = fn(output[key])
    return output


# ------------------------------------------------------------------------------------------- the forward
@dataclasses.dataclass
class OutputDeferral:
    """A context-parallel model's output handling: counts forwards (the read tags) and, while the model's
    ``__call__`` runs (:func:`install_output_deferral`), holds this forward's deferral until the call's hooks
    have run on the local output."""

    forwards: int = 0
    call_depth: int = 0
    """> 0 inside the model's ``__call__``: the cp forward returns this rank's output and leaves the deferral
    (``stashed``) to the end of the call."""
    stashed: Callable[[Any], Any] | None = None

    def finish(self, output: Any, cp: ContextParallel, length: int, rows: int) -> Any:
        """The cp forward's last step: ``output`` (this rank's) deferred now (a direct ``model.forward`` call),
        or stashed for the end of the model's ``__call__``."""
        self.forwards += 1
        defer = functools.partial(
            defer_outputs,
            cp=cp,
            length=length,
            rows=rows,
            order=cp.layout.order,
            forward_index=self.forwards,
            grad_enabled=torch.is_grad_enabled(),
            inference=torch.is_inference_mode_enabled(),
        )
        if self.call_depth:
            self.stashed = defer
            return output
        return defer(output)

    def release(self, output: Any) -> Any:
        """``output`` deferred if this call's forward stashed its deferral (else as it is: done already)."""
        defer, self.stashed = self.stashed, None
        return output if defer is None else defer(output)


def install_output_deferral(model: torch.nn.Module, state: OutputDeferral) -> None:
    """Defer the outputs at the end of ``model(...)``, after every forward hook (module and global: FSDP2's
    pre-backward hooks, MemTracker's module tracker, ...) and every forward wrapper (accelerate's autocast and
    ``convert_outputs_to_fp32``) has run on this rank's output. Why: those read every field (FSDP2 registers
    hooks on each grad-requiring tensor of the output, accelerate rebuilds it from its items); given the lazy
    output they would gather the logits on every step. The model's class becomes a subclass of its own, of the
    same name, whose ``__call__`` does this (as FSDP2's ``fully_shard`` swaps classes)."""
    setattr(model, OUTPUTS_ATTR, state)
    if not getattr(type(model), "_hf_colossal_auto_defers_outputs", False):
        model.__class__ = _deferring_class(type(model))


@functools.cache
def _deferring_class(cls: type) -> type:
    def __call__(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        state: OutputDeferral = getattr(self, OUTPUTS_ATTR)
        state.call_depth += 1
        try:
            output = super(deferring, self).__call__(*args, **kwargs)
        finally:
            state.call_depth -= 1
        return state.release(output)

    namespace = {
        "__call__": __call__,
        "__module__": cls.__module__,
        "__qualname__": cls.__qualname__,
        "_hf_colossal_auto_defers_outputs": True,
    }
    deferring = type(cls)(cls.__name__, (cls,), namespace)
    return deferring


def defer_now(model: torch.nn.Module, output: Any) -> Any:
    """``output`` of ``model``'s forward deferred now, inside its ``__call__`` (a forward wrapper that must
    work on the lazy output: the first-call wrapper cuts its rows after the gather); as it is without cp."""
    state: OutputDeferral | None = getattr(model, OUTPUTS_ATTR, None)
    return output if state is None else state.release(output)


def defer_outputs(
    output: Any,
    *,
    cp: ContextParallel,
    length: int,
    rows: int,
    order: torch.Tensor,
    forward_index: int,
    grad_enabled: bool,
    inference: bool,
) -> Any:
    """One process's outputs from this rank's: the loss summed over cp now; token-wise fields (tensors
    ``[rows, length / cp, ...]`` or tuples of them) gathered into sequence order when first read (a
    ``ModelOutput``), or now (a tuple or another container, which cannot defer a read)."""
    local_length = length // cp.size

    def token_wise(value: Any) -> bool:
        if isinstance(value, tuple | list):
            return any(token_wise(v) for v in value)
        return (
            isinstance(value, torch.Tensor)
            and value.dim() >= 2
            and value.shape[0] == rows
            and value.shape[1] == local_length
        )

    def whole(value: Any) -> Any:
        if isinstance(value, tuple | list):
            return type(value)(whole(v) for v in value)
        if token_wise(value):
            return GatherReplicated.apply(value, cp.group, 1).index_select(1, order)
        return value

    if not isinstance(output, Mapping):
        return whole(output)
    if not dataclasses.is_dataclass(output):
        for key in list(output.keys()):
            output[key] = _summed(output[key], cp) if key == "loss" else whole(output[key])
        return output
    base = type(output)
    names = tuple(f.name for f in dataclasses.fields(base))
    lazy = lazy_output_class(base)(**{name: output.__dict__.get(name) for name in names})
    for key in list(lazy.keys()):
        value = OrderedDict.__getitem__(lazy, key)
        if key == "loss":
            lazy[key] = _summed(value, cp)
        elif token_wise(value):
            pending = PendingField(
                key=key,
                code=names.index(key),
                forward_index=forward_index,
                names=names,
                cp=cp,
                compute=functools.partial(whole, value),
                grad_enabled=grad_enabled,
                inference=inference,
            )
            OrderedDict.__setitem__(lazy, key, pending)
            lazy.__dict__[key] = pending
    return lazy


def _summed(loss: Any, cp: ContextParallel) -> Any:
    """The loss summed over cp (each rank's is its share of the replica's mean); backward the identity."""
    return SumReplicated.apply(loss, cp.group) if isinstance(loss, torch.Tensor) else loss
