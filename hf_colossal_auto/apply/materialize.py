"""Materialise a model built on the ``meta`` device after planning: each rank allocates only its own shards.

Why: a 7B model built on ``meta`` costs nothing to plan, but the ordinary path (every rank holds the full model
and rank 0's values are scattered) needs the whole model in every process. Here the parameters become DTensors
with the plan's placements while still on ``meta`` (:func:`.runtime.distribute_parameters`), FSDP shards them
further if the plan says so, and only then this module allocates each rank's local shards (``to_empty``) and
fills them with the model's *own* initialisation.

How the values are made. DTensor's random ops draw consistent shards only with CUDA's offset-based generator
(its RNG tracker refuses CPU), so we do what works on every device: run transformers' own init
(``PreTrainedModel.initialize_weights``: ``_init_weights`` per module, rotary ``inv_freq``, BERT's
``position_ids``...) on full-size *stand-in* tensors, from one RNG state shared by every rank, and keep only
each rank's part. Stand-ins exist only while the module inits that touch them run:

1. a dry run on ``meta`` stand-ins records which parameters and buffers each module's init reads or writes
   (by storage, so views and ``.data`` count);
2. the real run allocates a parameter's full tensor just before the first init that touches it, and copies
   the rank's shard into the sharded parameter right after the last one, then frees it. The extra memory is
   what one module's init touches at once (a Linear's weight and bias; a tied embedding written by the root
   module's init lives from its own init to the root's), never the whole model.

Because every rank draws the same full tensors in the same order, replicated parameters are bit-identical
everywhere and sharded ones are shards of one full tensor — the same values for any plan, given the seed.
Tied parameters follow ``from_pretrained``'s rule for missing weights: the tie's source is initialised, its
targets are not. Modules transformers' init does not cover fall back to their ``reset_parameters``; a
parameter or buffer nothing can initialise is an error that names it (load weights with
``hf_colossal_auto.apply.load_checkpoint`` after applying, or build the model on a real device).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from .._torch_compat import TorchDispatchMode, storage_key, tree_flatten

logger = logging.getLogger(__name__)

_FLAG = "_is_hf_initialized"  # transformers' guarded init functions skip tensors (and modules) carrying it


class MetaInitError(ValueError):
    """A model on ``meta`` whose weights cannot be initialised the way the model itself would."""


@dataclass
class MaterializeReport:
    """What materialisation did, in bytes of this rank (for logs and tests)."""

    parameters: int = 0  # distinct parameters initialised
    buffers: int = 0  # buffers initialised
    local_bytes: int = 0  # bytes of this rank's parameter shards
    full_bytes: int = 0  # bytes of the full parameters (what a rank would hold without sharding)
    peak_temporary_bytes: int = 0  # the most full-size stand-in bytes alive at once
    left_for_loading: int = 0  # distinct tensors allocated but not initialised (a checkpoint fills them)
    reset_parameters_modules: list[str] = field(default_factory=list)  # initialised by reset_parameters()


@dataclass
class _Slot:
    """One distinct parameter or buffer of the model on ``meta`` (tied holders share a slot)."""

    name: str  # first fully-qualified name
    is_param: bool
    holders: list[tuple[nn.Module, str, str]]  # (module, attribute, fqn) for every name it has
    final: torch.Tensor  # the tensor the model ends with (a DTensor with allocated shards, or a stand-in)
    shape: torch.Size
    dtype: torch.dtype
    requires_grad: bool
    tie_targets: set[str] = field(default_factory=set)  # holder fqns that transformers ties to the source
    standin: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        return self.shape.numel() * self.dtype.itemsize

    def set_on(self, value: torch.Tensor, *, targets: torch.Tensor | None = None) -> None:
        for module, attr, fqn in self.holders:
            v = targets if targets is not None and fqn in self.tie_targets else value
            (module._parameters if self.is_param else module._buffers)[attr] = v


def _meta(t: torch.Tensor) -> bool:
    return t.is_meta  # a DTensor is on meta when its local shard is


def is_meta_model(model: nn.Module) -> bool:
    """True when ``model``'s parameters (and possibly buffers) are on ``meta``, False when none is.

    A model with some parameters on ``meta`` and others real is refused: materialisation runs the whole
    model's init, which would overwrite or mix with the real weights.
    """
    params = list(model.named_parameters())
    on_meta = [n for n, p in params if _meta(p)]
    if on_meta and len(on_meta) != len(params):
        real = [n for n, p in params if not _meta(p)]
        raise MetaInitError(
            f"{len(on_meta)} parameters of {type(model).__name__} are on the meta device (e.g. {on_meta[:2]}) "
            f"and {len(real)} are not (e.g. {real[:2]}). Build the model entirely on meta "
            "(`with torch.device('meta'): ...`) to have it initialised shard by shard, or entirely on a real device."
        )
    return bool(on_meta) or any(_meta(b) for b in model.buffers())


def _collect_slots(model: nn.Module) -> list[_Slot]:
    tie_targets = set(getattr(model, "all_tied_weights_keys", None) or {})
    slots: dict[int, _Slot] = {}
    for is_param, named in (
        (True, model.named_parameters(remove_duplicate=False)),
        (False, model.named_buffers(remove_duplicate=False)),
    ):
        for fqn, tensor in named:
            if not _meta(tensor):
                continue
            module_name, _, attr = fqn.rpartition(".")
            holder = (model.get_submodule(module_name), attr, fqn)
            slot = slots.get(id(tensor))
            if slot is None:
                slot = slots[id(tensor)] = _Slot(
                    name=fqn,
                    is_param=is_param,
                    holders=[],
                    final=tensor,
                    shape=tensor.shape,
                    dtype=tensor.dtype,
                    requires_grad=tensor.requires_grad,
                )
            slot.holders.append(holder)
    for slot in slots.values():
        targets = {fqn for _, _, fqn in slot.holders if fqn in tie_targets}
        if len(targets) < len(slot.holders):  # a tie's source is among the holders: only it is initialised
            slot.tie_targets = targets
    return list(slots.values())


def _standin(slot: _Slot, device: torch.device) -> torch.Tensor:
    full = torch.empty(slot.shape, dtype=slot.dtype, device=device)
    return nn.Parameter(full, requires_grad=slot.requires_grad) if slot.is_param else full


def _placeholder(slot: _Slot, *, skipped: bool) -> torch.Tensor:
    """A meta tensor a holder keeps while its values are not needed. ``skipped``: flagged so that transformers'
    guarded init functions leave it alone (tie targets). Others are not flagged, as the dry run's stand-ins
    are not: transformers skips a module whose tensors are all flagged, which would change the visits."""
    placeholder = torch.empty(slot.shape, dtype=slot.dtype, device="meta")
    if slot.is_param:
        placeholder = nn.Parameter(placeholder, requires_grad=slot.requires_grad)
    if skipped:
        setattr(placeholder, _FLAG, True)
    return placeholder


def _skipped_placeholder(slot: _Slot) -> torch.Tensor:
    """What a tie target holds during init: a meta tensor transformers' guarded init functions skip."""
    return _placeholder(slot, skipped=True)


class _TouchRecorder(TorchDispatchMode):
    """Which stand-ins (by storage) each op reads or writes, attributed to the current init visit."""

    def __init__(self, keys: dict[int, int]):
        super().__init__()
        self.keys = keys
        self.visit: int | None = None
        self.touched: dict[int, set[int]] = {}  # visit -> slot indices
        self.outside: set[int] = set()  # slots touched outside any visit

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        for value in tree_flatten((args, kwargs or {}))[0]:
            if isinstance(value, torch.Tensor) and not isinstance(value, DTensor):
                index = self.keys.get(storage_key(value))
                if index is not None:
                    target = (
                        self.outside if self.visit is None else self.touched.setdefault(self.visit, set())
                    )
                    target.add(index)
        return func(*args, **(kwargs or {}))


def _pretrained_models(model: nn.Module) -> list[nn.Module]:
    try:
        from transformers import PreTrainedModel
    except ImportError:  # pragma: no cover - transformers is a dependency
        return []
    return [m for m in model.modules() if isinstance(m, PreTrainedModel)]


@contextlib.contextmanager
def _visits(model: nn.Module, before: Callable[[int, nn.Module], None], after: Callable[[int], None]):
    """Call ``before``/``after`` around each module init transformers runs (``_init_weights(module)`` of
    the owning ``PreTrainedModel``), by shadowing the bound method on each instance for the duration."""
    owners = _pretrained_models(model)
    counter = iter(range(1 << 62))

    def wrap(original):
        def _init_weights(module):
            index = next(counter)
            before(index, module)
            try:
                return original(module)
            finally:
                after(index)

        return _init_weights

    for owner in owners:
        owner._init_weights = wrap(owner._init_weights)
    try:
        yield
    finally:
        for owner in owners:
            owner.__dict__.pop("_init_weights", None)


def _run_hf_init(model: nn.Module) -> None:
    """transformers' own initialisation of every module (what ``post_init`` does off meta)."""
    if not _pretrained_models(model):
        return
    for module in model.modules():
        module.__dict__.pop(_FLAG, None)
    owners = _pretrained_models(model)
    inner = {id(m) for owner in owners for m in owner.modules() if m is not owner}
    try:
        for owner in owners:
            # FSDP2 swaps in a class made outside transformers, which transformers would take for remote code
            # and init differently (it skips modules without parameters of their own, GPT-2's scaled c_proj)
            owner.is_custom_code = _unwrapped_class(owner).is_custom_code
        for owner in owners:  # the outermost ones: each recurses into its sub-models itself
            if id(owner) not in inner:
                owner.initialize_weights()
    finally:
        for owner in owners:
            owner.__dict__.pop("is_custom_code", None)


def _unwrapped_class(module: nn.Module) -> type:
    """The model's own class under the one ``fully_shard`` substitutes (``FSDP<Class>``)."""
    from torch.distributed.fsdp import FSDPModule

    cls = type(module)
    if issubclass(cls, FSDPModule):
        cls = next(c for c in cls.__mro__[1:] if not issubclass(c, FSDPModule))
    return cls


@contextlib.contextmanager
def _shared_rng(device: torch.device, seed: int | None) -> Iterator[None]:
    """One RNG state on every rank for the duration (rank 0's current one unless ``seed`` is given); the
    ranks' own generators are restored afterwards, so dropout streams are not disturbed."""
    cuda = device.type == "cuda"
    with torch.random.fork_rng(devices=[device] if cuda else [], device_type="cuda"):
        if seed is not None:
            torch.manual_seed(seed)
        else:
            state = torch.cuda.get_rng_state(device) if cuda else torch.get_rng_state()
            if dist.is_initialized() and dist.get_world_size() > 1:
                comm_device = "cuda" if dist.get_backend() == "nccl" else "cpu"
                buffer = state.to(comm_device)
                dist.broadcast(buffer, src=0)
                state = buffer.cpu()
            if cuda:
                torch.cuda.set_rng_state(state, device)
            else:
                torch.set_rng_state(state)
        yield


def _default_device(slots: list[_Slot]) -> torch.device:
    for slot in slots:
        if isinstance(slot.final, DTensor):
            kind = slot.final.device_mesh.device_type
            if kind == "cuda":
                return torch.device("cuda", torch.cuda.current_device())
            return torch.device(kind)
    return torch.device("cpu")


def _unreproducible(slots: list[_Slot], indices: list[int], model: nn.Module) -> MetaInitError:
    names = []
    for i in indices[:5]:
        module, attr, fqn = slots[i].holders[0]
        kind = "parameter" if slots[i].is_param else "buffer"
        names.append(f"{kind} {fqn!r} of {type(module).__name__}")
    return MetaInitError(
        f"cannot initialise {len(indices)} tensors of {type(model).__name__} built on the meta device: "
        f"{'; '.join(names)}. Neither transformers' init (_init_weights) nor the module's reset_parameters() "
        "sets them. Give the module a reset_parameters() (or cover it in _init_weights), load its weights "
        "with hf_colossal_auto.apply.load_checkpoint after applying the plan, or build the model on a real "
        "device (e.g. build_model(..., device='cpu')) so that rank 0's weights are scattered instead."
    )


def _reset_parameter_fallback(
    slots: list[_Slot], untouched: list[int], model: nn.Module
) -> dict[int, list[int]]:
    """Modules whose meta parameters transformers' init never touches, initialised by their own
    ``reset_parameters()``: ``id(module) -> slot indices``. Raises when something stays uncovered."""
    by_module: dict[int, tuple[nn.Module, list[int]]] = {}
    uncovered = []
    for i in untouched:
        slot = slots[i]
        module = slot.holders[0][0]
        if slot.is_param and callable(getattr(module, "reset_parameters", None)):
            by_module.setdefault(id(module), (module, []))[1].append(i)
        else:
            uncovered.append(i)
    for module, indices in by_module.values():
        own = {id(p) for p in module.parameters(recurse=False)}
        partly = [s for s in range(len(slots)) if id(slots[s].final) in own and s not in indices]
        if partly:  # reset_parameters() would overwrite what transformers' init already set
            uncovered.extend(indices)
    if uncovered:
        raise _unreproducible(slots, sorted(uncovered), model)
    return {key: indices for key, (_, indices) in by_module.items()}


def _finalise(slot: _Slot) -> int:
    """Put the stand-in's values into the model's own tensor; returns the bytes this rank keeps."""
    full = slot.standin
    if isinstance(slot.final, DTensor):
        with torch.no_grad():
            piece = distribute_tensor(
                full.detach(), slot.final.device_mesh, slot.final.placements, src_data_rank=None
            )
            local = slot.final.to_local()
            local.copy_(piece.to_local())
        kept = local.numel() * local.element_size()
    else:  # not distributed: the stand-in is the tensor
        slot.final = full
        kept = full.numel() * full.element_size()
    # tie targets keep a skipped placeholder until the init is over: a later visit of the target's module must
    # not draw into the source's values (the ties are restored at the end)
    slot.set_on(slot.final, targets=_skipped_placeholder(slot) if slot.tie_targets else None)
    slot.standin = None
    return kept


@dataclass
class _Schedule:
    """What the dry run found: the module visits in order, and per slot its first and last visit."""

    visits: list[int]  # id() of the module of each visit
    first: dict[int, list[int]]  # visit -> slots it touches first
    last: dict[int, list[int]]  # visit -> slots it touches last
    untouched: list[int]  # slots no visit touches


def _dry_run(model: nn.Module, slots: list[_Slot], real: list[torch.Tensor]) -> _Schedule:
    """Run transformers' init on ``meta`` stand-ins (no memory, no RNG) and record which slots each module's
    init touches."""
    for slot in slots:
        slot.standin = _standin(slot, torch.device("meta"))
    recorder = _TouchRecorder({storage_key(s.standin): i for i, s in enumerate(slots)})
    visits: list[int] = []

    def before(index: int, module: nn.Module) -> None:
        recorder.visit = index
        visits.append(id(module))

    def after(index: int) -> None:
        recorder.visit = None

    with (
        _protected(real),
        _installed(slots, [s.standin for s in slots]),
        _visits(model, before, after),
        recorder,
    ):
        _run_hf_init(model)
    for slot in slots:
        slot.standin = None
    if recorder.outside:
        raise MetaInitError(
            f"transformers' init of {type(model).__name__} touched "
            f"{[slots[i].name for i in sorted(recorder.outside)][:3]} outside any module's _init_weights; it "
            "cannot be replayed shard by shard. Build the model on a real device instead."
        )
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    for visit in sorted(recorder.touched):
        for i in recorder.touched[visit]:
            first.setdefault(i, visit)
            last[i] = visit
    schedule = _Schedule(visits, {}, {}, [i for i in range(len(slots)) if i not in first])
    for i, v in first.items():
        schedule.first.setdefault(v, []).append(i)
    for i, v in last.items():
        schedule.last.setdefault(v, []).append(i)
    return schedule


class _RealRun:
    """Full-size stand-ins allocated just before the first visit that touches them and finalised (this rank's
    part kept, the rest freed) just after the last one; the report is kept up to date."""

    def __init__(
        self,
        slots: list[_Slot],
        device: torch.device,
        report: MaterializeReport,
        dropped: Collection[int] = (),
    ):
        self.slots, self.device, self.report = slots, device, report
        self.dropped = set(dropped)
        self.live = 0
        self.visits: list[int] = []

    def allocate(self, indices: list[int]) -> None:
        for i in indices:
            slot = self.slots[i]
            slot.standin = _standin(slot, self.device)
            slot.set_on(slot.standin, targets=_skipped_placeholder(slot) if slot.tie_targets else None)
            self.live += slot.nbytes
        self.report.peak_temporary_bytes = max(self.report.peak_temporary_bytes, self.live)

    def release(self, indices: list[int]) -> None:
        for i in indices:
            slot = self.slots[i]
            if i in self.dropped:  # drawn for the RNG sequence only (another pipeline stage's): back to meta
                slot.standin = None
                slot.set_on(_placeholder(slot, skipped=False))
                self.live -= slot.nbytes
                continue
            kept = _finalise(slot)
            self.live -= slot.nbytes
            if slot.is_param:
                self.report.parameters += 1
                self.report.local_bytes += kept
                self.report.full_bytes += slot.nbytes
            else:
                self.report.buffers += 1


def _allocate_shards(model: nn.Module, slots: list[_Slot], device: torch.device) -> None:
    """``to_empty``: this rank's shards only (FSDP re-pads its sharded parameters); real buffers keep their
    values, and the slots follow the tensors ``to_empty`` may have replaced."""
    kept = [(m, n, b) for m in model.modules() for n, b in m._buffers.items() if b is not None]
    model.to_empty(device=device)
    for module, name, buffer in kept:
        module._buffers[name] = buffer
    for slot in slots:
        module, attr, _ = slot.holders[0]
        slot.final = (module._parameters if slot.is_param else module._buffers)[attr]


def _split_loaded(slots: list[_Slot], loaded: Collection[str]) -> tuple[list[_Slot], list[_Slot]]:
    """(slots to initialise, slots a checkpoint fills): a tensor is loaded when any of its names (a tie's
    source or target) is in ``loaded``."""
    names = set(loaded)
    kept, skipped = [], []
    for slot in slots:
        (skipped if any(fqn in names for _, _, fqn in slot.holders) else kept).append(slot)
    return kept, skipped


def _allocate_plain(slots: list[_Slot], device: torch.device) -> None:
    """Full, uninitialised tensors for loaded slots that are not DTensors (a model without a plan)."""
    for slot in slots:
        if isinstance(slot.final, DTensor):
            continue
        tensor = torch.empty(slot.shape, dtype=slot.dtype, device=device)
        slot.final = nn.Parameter(tensor, requires_grad=slot.requires_grad) if slot.is_param else tensor
        slot.set_on(slot.final)


def materialize_meta_model(
    model: nn.Module,
    device: torch.device | str | None = None,
    *,
    seed: int | None = None,
    loaded: Collection[str] = (),
    keep: Callable[[str], bool] | None = None,
) -> MaterializeReport:
    """Allocate and initialise every ``meta`` parameter and buffer of ``model`` in place.

    Parameters that are DTensors (after :func:`.runtime.distribute_parameters`, and FSDP) get only this rank's
    shards; plain ones become full tensors on ``device`` (default: the parameters' mesh device, else CPU).
    Values come from the model's own init with one RNG state shared by all ranks — rank 0's current one, or
    ``seed`` — so every rank holds parts of the same full tensors. Collective when ``seed`` is None and a
    process group runs (rank 0's RNG state is broadcast): call on every rank.

    ``loaded``: names (state-dict keys) a checkpoint is about to fill (:func:`.pretrained.load_pretrained`).
    Their tensors are allocated (this rank's shards) but not initialised — transformers' guarded init skips
    them as ``from_pretrained`` skips loaded weights — so drawing values that would be overwritten costs
    neither time nor full-size stand-ins.

    ``keep``: when given, only tensors with a name it accepts are allocated; the others (another pipeline
    stage's) are drawn — one module's full tensors at a time, so that the RNG sequence and hence every kept
    value is the one a whole-model init gives — and left on ``meta``.
    """
    report = MaterializeReport()
    if not is_meta_model(model):
        return report
    slots, skipped = _split_loaded(_collect_slots(model), loaded)
    device = torch.device(device) if device is not None else _default_device(slots + skipped)
    if skipped:  # allocated before the dry run, so that it sees them as real, flagged tensors
        if any(isinstance(s.final, DTensor) for s in slots + skipped):
            _allocate_shards(model, slots + skipped, device)
        _allocate_plain(skipped, device)
        report.left_for_loading = len(skipped)
    real = [b for b in model.buffers() if not b.is_meta] + [s.final for s in skipped]
    schedule = _dry_run(model, slots, real)  # before allocating anything: refusals cost nothing
    fallback = _reset_parameter_fallback(slots, schedule.untouched, model)
    if any(isinstance(s.final, DTensor) for s in slots) and not skipped:
        _allocate_shards(model, slots, device)

    dropped = (
        [i for i, s in enumerate(slots) if not any(keep(fqn) for _, _, fqn in s.holders)] if keep else []
    )
    run = _RealRun(slots, device, report, dropped)

    def before(index: int, module: nn.Module) -> None:
        run.visits.append(id(module))
        run.allocate(schedule.first.get(index, []))

    def after(index: int) -> None:
        run.release(schedule.last.get(index, []))

    placeholders = [_placeholder(s, skipped=False) for s in slots]
    with _shared_rng(device, seed), torch.no_grad(), _protected(real), _installed(slots, placeholders):
        with _visits(model, before, after):
            _run_hf_init(model)
        if run.visits != schedule.visits:
            raise MetaInitError(
                f"transformers' init of {type(model).__name__} visited other modules on the second run than "
                "on the first; its init depends on values and cannot be replayed shard by shard. Build the "
                "model on a real device instead."
            )
        for indices in fallback.values():
            run.allocate(indices)
            slots[indices[0]].holders[0][0].reset_parameters()
            run.release(indices)
            report.reset_parameters_modules.append(slots[indices[0]].name.rpartition(".")[0])
    logger.info(
        "materialised %d parameters and %d buffers from meta: %.1f MiB of shards on this rank (full model "
        "%.1f MiB), at most %.1f MiB of full-size temporaries",
        report.parameters,
        report.buffers,
        report.local_bytes / 2**20,
        report.full_bytes / 2**20,
        report.peak_temporary_bytes / 2**20,
    )
    return report


@contextlib.contextmanager
def _installed(slots: list[_Slot], values: list[torch.Tensor]) -> Iterator[None]:
    """Holders hold ``values[i]`` (tie targets a skipped placeholder) for the duration, then the model's own
    tensors again."""
    for slot, value in zip(slots, values, strict=True):
        slot.set_on(value, targets=_skipped_placeholder(slot) if slot.tie_targets else None)
    try:
        yield
    finally:
        for slot in slots:
            slot.set_on(slot.final)


@contextlib.contextmanager
def _protected(tensors: list[torch.Tensor]) -> Iterator[None]:
    """Real (non-meta) buffers keep their values: transformers' guarded init skips flagged tensors."""
    flagged = [t for t in tensors if not getattr(t, _FLAG, False)]
    for t in flagged:
        setattr(t, _FLAG, True)
    try:
        yield
    finally:
        for t in flagged:
            with contextlib.suppress(AttributeError):
                delattr(t, _FLAG)
