"""A non-reentrant activation checkpoint whose one rerun serves every backward pass over the region.

Why: torch's zero-bubble pipeline schedules (``plan.SPLIT_BACKWARD_SCHEDULES``) split a stage's backward into an
input-gradient pass (``stage_backward_input``: one ``autograd.grad`` with ``retain_graph=True``) and a later
weight-gradient pass (``stage_backward_weight``: one ``autograd.grad`` per parameter group, 9 for a Llama block).
``torch.utils.checkpoint(use_reentrant=False)`` keys its recomputation by the backward pass running (its graph
task), so a checkpointed block reruns its forward in the input pass and again in every ``autograd.grad`` of the
weight pass, and a selective policy's cache serves one of them only. ``GraphExecGroup`` does not help: it refuses
two passes that unpack the same saved tensor, which these two do.

Here the region's first unpack, in whichever pass comes first, reruns the block once and puts every tensor the
rerun saves for backward on the holder autograd keeps for it (:class:`_Holder`, what the forward's pack hook
returned); every later unpack, in the same pass or another, reads it from there. The rerun restores what the
forward ran under, as torch's checkpoint does: the CPU and the inputs' devices' RNG states (the same dropout
masks), the autocast state (its weight-cast cache flag included), ``torch.enable_grad()`` and the rerun half of
``context_fn`` (a selective policy's cache), and it stops once every saved tensor is back.

Memory: a recomputed tensor lives as long as autograd keeps the saved variable that holds it. Under a split
backward that is from the input pass, which reruns the block, until the weight pass has run the node that saved
it (or the graph is freed after it): the block's rematerialised tensors are held from the schedule's I action to
its W action, not freed inside the input pass as torch's checkpoint frees them (the pipeline pricing holds them
so). Under an ordinary backward (``retain_graph=False``) each is freed as its node runs, as torch's are.

Public torch APIs (``torch.autograd.graph.saved_tensors_hooks``, ``torch.random.fork_rng``,
``torch.utils.checkpoint.get_device_states`` / ``set_device_states``, the autocast getters) and torch's pytree
through the adapter (``_torch_compat.tree_flatten`` / ``tree_map``) for the block's arguments.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from contextlib import AbstractContextManager, ExitStack, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch.autograd.graph import saved_tensors_hooks
from torch.utils.checkpoint import get_device_states, set_device_states

from .._torch_compat import tree_flatten, tree_map

ContextFn = Callable[[], tuple[AbstractContextManager, AbstractContextManager]]
"""torch's ``context_fn``: the contexts the forward and its rerun run under (a selective-checkpoint policy's)."""


class SharedRerunError(RuntimeError):
    """A checkpointed block's rerun did not save what its forward saved (a forward that is not deterministic in
    what it computes), or a backward reached the block before its forward had finished."""


class _AllSaved(Exception):
    """Stops the rerun once every tensor the forward saved is back: the rest of the block's forward is not
    needed (torch's ``_StopRecomputationError``). An ``Exception``, as torch's: modules run their
    ``always_call`` forward hooks on an ``Exception`` only (a module tracker's stack stays balanced). A block
    whose own ``except Exception`` swallows it runs on and saves more than its forward did, which is refused."""


@dataclass(frozen=True)
class _Saved:
    """What a saved tensor looked like in the forward, to check its recomputed value against (torch's default
    determinism check: shape, dtype, device)."""

    shape: torch.Size
    dtype: torch.dtype
    device: torch.device

    @classmethod
    def of(cls, x: torch.Tensor) -> _Saved:
        return cls(x.shape, x.dtype, x.device)


class _Holder:
    """What the forward's pack hook gives autograd for one saved tensor: autograd keeps it as long as it keeps
    the saved variable, and the rerun puts the recomputed tensor on it (``value``), so the tensor lives exactly
    that long. Holds its region strongly (the region holds holders weakly: no cycle)."""

    __slots__ = ("__weakref__", "index", "region", "saved", "value")

    def __init__(self, index: int, region: _Region, saved: _Saved) -> None:
        self.index = index
        self.region = region
        self.saved = saved
        self.value: torch.Tensor | None = None


@dataclass(frozen=True)
class _ForwardState:
    """The global state the forward ran under, which its rerun in backward runs under again."""

    cpu_rng: torch.Tensor
    device_type: str | None
    devices: list[int]
    device_rngs: list[torch.Tensor]
    autocast: tuple[tuple[str, bool, torch.dtype], ...]
    autocast_cache: bool

    @classmethod
    def record(cls, tensors: list[torch.Tensor]) -> _ForwardState:
        """The RNG states of the CPU and of the inputs' devices (as torch's checkpoint records them: a device no
        input is on is not touched) and autocast's state on the CPU and on that device type."""
        on_device = {t.device: t for t in tensors if t.device.type not in ("cpu", "meta")}  # one per device
        device_type = next(iter(on_device)).type if on_device else None
        devices, device_rngs = get_device_states(*on_device.values()) if on_device else ([], [])
        types = ["cpu"]
        if device_type is not None and torch.amp.is_autocast_available(device_type):
            types.append(device_type)
        autocast = tuple((t, torch.is_autocast_enabled(t), torch.get_autocast_dtype(t)) for t in types)
        cache = torch.is_autocast_cache_enabled()
        return cls(torch.get_rng_state(), device_type, devices, device_rngs, autocast, cache)

    def restored(self, stack: ExitStack) -> None:
        """Enter, on ``stack``, this state: the RNG forked (the caller's RNG is back after the rerun) and set to
        the forward's, autocast as the forward had it."""
        stack.enter_context(torch.random.fork_rng(devices=self.devices, device_type=self.device_type))
        torch.set_rng_state(self.cpu_rng)
        if self.devices:
            set_device_states(self.devices, self.device_rngs, device_type=self.device_type)
        for device_type, enabled, dtype in self.autocast:
            stack.enter_context(
                torch.autocast(device_type, dtype=dtype, enabled=enabled, cache_enabled=self.autocast_cache)
            )


def _detached(value: Any) -> Any:
    """``value`` with every tensor in it detached, ``requires_grad`` kept: the rerun's graph is its own, thrown
    away once the saved tensors are back."""
    return tree_map(
        lambda x: x.detach().requires_grad_(x.requires_grad) if isinstance(x, torch.Tensor) else x, value
    )


class _Region:
    """One forward of a checkpointed block: what it needs to rerun (the function, its arguments, the forward's
    global state, the rerun context) until it has rerun, and weak references to its saved tensors' holders."""

    def __init__(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        name: str,
        rerun_context: AbstractContextManager | None,
    ) -> None:
        self.fn: Callable[..., Any] | None = fn
        self.args, self.kwargs = args, kwargs
        self.name = name
        self.rerun_context = rerun_context
        tensors = [x for x in tree_flatten((args, kwargs))[0] if isinstance(x, torch.Tensor)]
        self.state: _ForwardState | None = _ForwardState.record(tensors)
        self.holders: list[weakref.ref[_Holder]] = []
        self.forward_done = False
        self.recorded = 0  # tensors the rerun has saved so far

    def pack(self, x: torch.Tensor) -> _Holder:
        """The forward's pack hook: a holder in place of the tensor (which is freed, or kept by whoever else
        holds it)."""
        holder = _Holder(len(self.holders), self, _Saved.of(x))
        self.holders.append(weakref.ref(holder))
        return holder

    @staticmethod
    def unpack(holder: _Holder) -> torch.Tensor:
        """The unpack hook, in any backward pass: the recomputed tensor, rerunning the block the first time."""
        region = holder.region
        if holder.value is None:
            region.rerun()
        if holder.value is None:  # rerun() raises where a saved tensor is missing; this is the last guard
            raise SharedRerunError(f"{region.name}: saved tensor {holder.index} was not recomputed")
        return holder.value

    def rerun(self) -> None:
        """Run the block's forward once more, recording each tensor it saves on its holder, and stop once all
        are back; then drop what only the rerun needed (its inputs among them)."""
        if not self.forward_done:
            raise SharedRerunError(
                f"{self.name}: a backward reached this checkpointed block before its forward finished "
                "(autograd.grad inside the block's forward), which its shared rerun does not support; run the "
                "block without recompute"
            )
        if self.fn is None or self.state is None:
            raise SharedRerunError(f"{self.name}: its rerun failed before; it is not run again")
        fn, state = self.fn, self.state
        args, kwargs = _detached(self.args), _detached(self.kwargs)
        self.recorded = 0
        try:
            with ExitStack() as stack:
                state.restored(stack)
                stack.enter_context(torch.enable_grad())
                stack.enter_context(self.rerun_context or nullcontext())
                stack.enter_context(saved_tensors_hooks(self.record, _recomputed))
                fn(*args, **kwargs)
        except _AllSaved:
            pass
        else:
            if self.recorded != len(self.holders):
                raise SharedRerunError(
                    f"{self.name}: its rerun in backward saved {self.recorded} tensors for backward where its "
                    f"forward saved {len(self.holders)}: the block's forward does not compute the same thing "
                    "twice (a branch on state that changed after the forward?)"
                )
        finally:
            self.fn = self.state = None  # one rerun, successful or not
        self.args, self.kwargs, self.rerun_context = (), {}, None

    def record(self, x: torch.Tensor) -> torch.Tensor:
        """The rerun's pack hook: the tensor, detached, on the holder of the same index while autograd still
        keeps that holder; raises :class:`_AllSaved` at the last one."""
        index = self.recorded
        self.recorded += 1
        if index >= len(self.holders):
            raise SharedRerunError(
                f"{self.name}: its rerun in backward saved more tensors for backward than its forward "
                f"({len(self.holders)}): the block's forward does not compute the same thing twice"
            )
        x = x.detach() if x.requires_grad else x
        holder = self.holders[index]()
        if holder is not None:  # else autograd freed it (its node ran, or its graph is gone): nothing to keep
            if _Saved.of(x) != holder.saved:
                raise SharedRerunError(
                    f"{self.name}: its rerun in backward saved tensor {index} as {_Saved.of(x)} where its "
                    f"forward saved {holder.saved}: the block's forward does not compute the same thing twice"
                )
            holder.value = x
        if self.recorded == len(self.holders):
            raise _AllSaved
        return x


def _recomputed(x: torch.Tensor) -> torch.Tensor:
    """The rerun's unpack hook (its own graph is never run backward; autograd asks for one)."""
    return x


def checkpoint_with_shared_rerun(
    fn: Callable[..., Any],
    *args: Any,
    context_fn: ContextFn | None = None,
    region_name: str | None = None,
    **kwargs: Any,
) -> Any:
    """``fn(*args, **kwargs)``, keeping for backward only what the region needs to rerun (its arguments and the
    forward's RNG and autocast state): the first backward pass that needs a saved tensor reruns ``fn`` once,
    and that rerun serves every backward pass over the region (see the module doc). ``context_fn``: torch's
    (``create_selective_checkpoint_contexts(policy)``: the forward caches what the policy keeps, the one rerun
    reads it). ``region_name``: the block, in errors. Without gradients ``fn`` just runs."""
    if not torch.is_grad_enabled():
        return fn(*args, **kwargs)
    forward_context, rerun_context = context_fn() if context_fn is not None else (nullcontext(), None)
    name = region_name or getattr(fn, "__qualname__", type(fn).__name__)
    region = _Region(fn, args, kwargs, name, rerun_context)
    with saved_tensors_hooks(region.pack, _Region.unpack), forward_context:
        out = fn(*args, **kwargs)
    region.forward_done = True
    return out
