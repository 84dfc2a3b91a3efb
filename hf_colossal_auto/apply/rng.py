"""Random ops under tensor parallelism: the tensor-parallel group draws as one process would.

Why: the ranks of a tensor-parallel group compute one replica's step together. A value they share (a replicated
activation) must see the same dropout mask on every rank, or the replicas of "one" value part ways and so do
the replicated parameters they train; a value split over the group (attention probabilities on the local
heads) must see *different* numbers on each shard — together, one process's mask. Neither holds by itself:
each process's generator is its own (``accelerate.utils.set_seed(seed, device_specific=True)`` seeds each with
seed + rank), and on CPU DTensor runs a random op on every local shard from that generator (its offset-based
RNG tracker exists for CUDA only). Data-parallel replicas are left alone: they keep their own streams, as under
plain DDP.

Two pieces:

* **agreement** (:class:`TensorParallelRNG`): at the start of a planned training forward the group's first
  rank broadcasts its generator states (CPU, and CUDA's where the mesh is on CUDA) to the group, and every
  rank draws from them. After the forward the first rank keeps its advanced generator (as one process would);
  the others get back their own, so that what they draw outside the model (a data collator) is what it was.
  Activation checkpointing records the generator state at a recomputed block's entry — the agreed one — and
  replays it in backward, so recomputed blocks draw the same masks. A model whose last training forward drew
  nothing (dropout 0, no noise) skips the broadcast until it draws again (see :meth:`TensorParallelRNG.forward`).
  ``generate()`` runs on agreed generators as a whole: sampling picks the next tokens outside the forward, and
  the group's ranks must pick the same ones.
* **per-shard draws** (:func:`register_random_op_handlers`): a DTensor random op on a value sharded over the
  group, where DTensor has no offset-based tracker (CPU), draws the *whole* tensor from the agreed generator
  on every rank and keeps this rank's part: the shards' numbers are exactly one process's, and every rank's
  generator advances alike. On CUDA DTensor's ``OffsetBasedRNGTracker`` does this with Philox offsets (no
  whole-size draw); it is created without its world-wide state broadcast, which would make every data-parallel
  replica draw rank 0's masks. Fused attention kernels with dropout (CUDA) are not DTensor random ops: on
  sharded heads they run in the tracker's per-shard region (:func:`fused_attention_dropout_region`).

What is not covered: random ops on *plain* tensors that hold one shard of a value (the runtime's local-tensor
regions, e.g. an MoE expert computed on local tensors) draw the same numbers on every rank of the group.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import warnings
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

from .._torch_compat import (
    default_dtensor_dispatch,
    dtensor_random_ops,
    dtensor_rng_region,
    dtensor_tracks_random_ops,
    ensure_dtensor_rng_tracker,
    register_dtensor_op_handler,
    tree_map,
)

logger = logging.getLogger(__name__)

_RNG_ATTR = "_hf_colossal_auto_rng"
"""Attribute of a planned model holding its :class:`TensorParallelRNG` (absent without tensor parallelism)."""

_active: TensorParallelRNG | None = None
"""The generator agreement of the planned forward running now (random-op handlers agree lazily through it)."""


def _device_of(mesh: DeviceMesh) -> torch.device | None:
    """The CUDA device whose generator the mesh's random ops use, or None (CPU)."""
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return None


def _generator_states(device: torch.device | None) -> list[torch.Tensor]:
    """This process's generator states: CPU's, then the CUDA device's (uint8 tensors, on CPU)."""
    states = [torch.get_rng_state()]
    if device is not None:
        states.append(torch.cuda.get_rng_state(device))
    return states


def _set_generator_states(states: list[torch.Tensor], device: torch.device | None) -> None:
    torch.set_rng_state(states[0])
    if device is not None:
        torch.cuda.set_rng_state(states[1], device)


def _same_states(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _agreement_group(mesh: DeviceMesh, tp_mesh: DeviceMesh) -> dist.ProcessGroup:
    """The group the generator states are broadcast in: the tensor-parallel group itself under gloo; under
    another backend (NCCL) a gloo group of the same ranks, so that the states (host memory) travel without a
    copy to the device and a wait on its stream. Every rank creates every tensor-parallel group's (in order)."""
    if dist.get_backend() == "gloo":
        return tp_mesh.get_group(0)
    rows = mesh.mesh.reshape(-1, tp_mesh.size()).tolist()
    mine = None
    for ranks in rows:
        group = dist.new_group(ranks, backend="gloo")
        if dist.get_rank() in ranks:
            mine = group
    if mine is None:
        raise RuntimeError(
            f"rank {dist.get_rank()} is not in the plan's mesh {rows}; apply the plan on every rank"
        )
    return mine


class TensorParallelRNG:
    """The generator agreement of one planned model's tensor-parallel group (see the module doc)."""

    def __init__(self, group: dist.ProcessGroup, device: torch.device | None, always: bool) -> None:
        self.group = group
        self.device = device
        self.is_first = dist.get_rank(group) == 0
        self.always = always  # agree in every training forward (recomputed blocks: no lazy agreement)
        self.draws: bool | None = None  # did the last training forward draw? None: not known yet
        self.own: list[torch.Tensor] | None = None  # this rank's states while the group's are in use
        self.agreed_states: list[torch.Tensor] | None = None
        self.unagreed_warned = False

    def agree(self) -> None:
        """Broadcast the first rank's generator states to the group and draw from them from now on."""
        own = _generator_states(self.device)
        sizes = [s.numel() for s in own]
        buffer = torch.cat(own)
        dist.broadcast(buffer, group=self.group, group_src=0)
        agreed = list(buffer.split(sizes))
        _set_generator_states(agreed, self.device)
        self.own, self.agreed_states = own, agreed

    def on_draw(self) -> None:
        """A random op is about to run: agree first if this forward has not (it skipped the broadcast because
        the model's previous training forward drew nothing)."""
        if self.own is None:
            self.agree()

    @contextlib.contextmanager
    def agreed(self) -> Iterator[None]:
        """Agreed generators for the duration, whatever the model draws (around ``generate()``)."""
        self.agree()
        try:
            yield
        finally:
            self._finish()

    def _finish(self) -> None:
        """After the forward: the first rank keeps its advanced generator, the others get theirs back."""
        if self.own is not None and not self.is_first:
            _set_generator_states(self.own, self.device)
        self.own = self.agreed_states = None

    @contextlib.contextmanager
    def forward(self, training: bool, checkpointed: bool = False) -> Iterator[None]:
        """Around one forward of the planned model: agreed generators in training.

        The broadcast is skipped in evaluation and while the last training forward drew nothing (judged by
        the generator states: unchanged means nothing drew); a DTensor random op in such a forward agrees
        lazily before it draws. A model with recomputed blocks (the plan's, or transformers' ``checkpointed``)
        always agrees up front: a block's checkpoint records the generator state at its entry, which must
        already be the agreed one."""
        global _active
        if not training or self.own is not None:  # evaluation, or inside an agreed region (generate())
            yield
            return
        eager = self.always or checkpointed or self.draws is not False
        if eager:
            self.agree()
        start = self.agreed_states if eager else _generator_states(self.device)
        previous, _active = _active, self
        try:
            yield
        finally:
            _active = previous
            agreed_lazily = not eager and self.own is not None
            self.draws = agreed_lazily or not _same_states(start, _generator_states(self.device))
            if self.draws and self.own is None and not self.unagreed_warned:
                self.unagreed_warned = True
                logger.warning(
                    "a training forward drew random numbers outside DTensor's random ops after one that drew "
                    "none, before the tensor-parallel group's generators were agreed; from the next forward "
                    "on they are agreed up front"
                )
            self._finish()


def install_tensor_parallel_rng(model: torch.nn.Module, mesh: DeviceMesh, recomputed: bool) -> None:
    """Give ``model`` (its forward wrapped by the runtime) a :class:`TensorParallelRNG` for its
    tensor-parallel group, and register the per-shard random-op handlers — only where that group has more than
    one rank and the processes are real (the planner's fake group simulates ranks in one process)."""
    from .runtime import tensor_parallel_mesh

    tp_mesh = tensor_parallel_mesh(mesh)
    if "tp" not in (tp_mesh.mesh_dim_names or ()) or tp_mesh.size() < 2:
        return
    if not dist.is_initialized() or dist.get_backend() == "fake":
        return
    register_random_op_handlers()
    device = _device_of(tp_mesh)
    if device is not None:
        ensure_dtensor_rng_tracker(tp_mesh)
    rng = TensorParallelRNG(_agreement_group(mesh, tp_mesh), device, recomputed)
    setattr(model, _RNG_ATTR, rng)
    _agree_in_generate(model, rng)


def _agree_in_generate(model: torch.nn.Module, rng: TensorParallelRNG) -> None:
    """``model.generate`` runs on agreed generators: sampling (``do_sample=True``) draws the next tokens from the
    logits outside the forward, on plain tensors; from each rank's own generator the group's ranks would pick
    different tokens and feed them to the next forward as one replicated batch."""
    original = getattr(model, "generate", None)
    if not callable(original):
        return

    @functools.wraps(original)
    def generate(*args: Any, **kwargs: Any) -> Any:
        with rng.agreed():
            return original(*args, **kwargs)

    model.generate = generate


def rng_of(model: torch.nn.Module) -> TensorParallelRNG | None:
    return getattr(model, _RNG_ATTR, None)


@contextlib.contextmanager
def agreed_forward(model: torch.nn.Module) -> Iterator[None]:
    """The planned forward's generator context (nothing without tensor parallelism)."""
    rng = rng_of(model)
    if rng is None:
        yield
        return
    with rng.forward(model.training, checkpointed=_hf_checkpointing(model)):
        yield


def _hf_checkpointing(model: torch.nn.Module) -> bool:
    """Whether transformers' own activation checkpointing is on (a plan without recompute leaves it)."""
    # transformers 5 renamed the flag; reading the old name warns
    new_name = hasattr(type(model), "is_activation_checkpointing")
    return bool(
        getattr(model, "is_activation_checkpointing" if new_name else "is_gradient_checkpointing", False)
    )


# --------------------------------------------------------------------------- per-shard draws


def _writes_self(op: torch._ops.OpOverload) -> bool:
    first = op._schema.arguments[0]
    return first.alias_info is not None and first.alias_info.is_write


def _ignores_values(op: torch._ops.OpOverload) -> bool:
    """The op's numbers depend on its input's shape and dtype only (``rand_like``, an in-place ``uniform_``);
    otherwise they depend on its values too (``native_dropout``, ``bernoulli`` of probabilities)."""
    return _writes_self(op) or op._schema.name.endswith("_like")


def _draws_per_shard(x: Any, args: tuple, kwargs: dict) -> bool:
    """Whether this op must draw the whole tensor: ``x`` is sharded over a 1-D (tensor-parallel) mesh of more
    than one rank, DTensor has no offset-based tracker for the device, and no other argument is a DTensor."""
    if not isinstance(x, DTensor) or x.device_mesh.ndim != 1 or x.device_mesh.size() < 2:
        return False
    if all(isinstance(p, Replicate) or p.is_partial() for p in x.placements):
        return False
    if dtensor_tracks_random_ops(x.device_mesh) or x.to_local().is_meta:
        return False
    others = [*args[1:], *kwargs.values()]
    return not any(isinstance(a, DTensor) for a in others)


def _whole_draw(op: torch._ops.OpOverload, x: DTensor, args: tuple, kwargs: dict) -> Any:
    """``op`` on the whole of ``x`` from this rank's (agreed) generator, this rank's part kept."""
    mesh, placements = x.device_mesh, x.placements
    if _ignores_values(op):
        whole = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.to_local().device)
    else:
        whole = x.full_tensor()  # the values matter: gathered (ops CPU dropout does not use)
    out = op(whole, *args[1:], **kwargs)

    def part(t: Any) -> Any:
        if isinstance(t, torch.Tensor) and t.shape == x.shape:
            return distribute_tensor(t, mesh, placements, src_data_rank=None)
        return t

    if _writes_self(op):
        x.to_local().copy_(part(out).to_local())
        return x
    return tree_map(part, out)


def _random_op(op: torch._ops.OpOverload, args: tuple, kwargs: dict | None) -> Any:
    """DTensor handler of every DTensor random op: agree the group's generators if the forward has not yet,
    then draw per shard where DTensor cannot (:func:`_whole_draw`)."""
    kwargs = kwargs or {}
    if _active is not None:
        _active.on_draw()
    x = args[0] if args else None
    if _draws_per_shard(x, args, kwargs):
        return _whole_draw(op, x, args, kwargs)
    with warnings.catch_warnings():
        # DTensor warns that CPU random ops lack its tracker: handled here, the warning would mislead
        warnings.filterwarnings("ignore", message="DTensor random operators may not have complete support")
        return default_dtensor_dispatch(op, args, kwargs)


_handlers_registered = False


def register_random_op_handlers() -> None:
    """Route DTensor's random ops with a tensor first argument through :func:`_random_op` (once a process)."""
    global _handlers_registered
    if _handlers_registered:
        return
    for op in dtensor_random_ops():
        arguments = op._schema.arguments
        if arguments and str(arguments[0].type) == "Tensor":
            register_dtensor_op_handler(op, _random_op)
    _handlers_registered = True


def fused_attention_dropout_region(query: Any, dropout_p: float) -> contextlib.AbstractContextManager:
    """Around a fused attention kernel with dropout on a sharded DTensor ``query`` (CUDA): DTensor's tracker's
    per-shard generator region (the kernel is not one of DTensor's random ops, so on its own every shard would
    draw the local heads' masks from the same Philox offset). Elsewhere nothing: on CPU the attention with
    dropout runs torch's math path, whose dropout is a DTensor random op drawn per shard above."""
    if dropout_p > 0 and _active is not None:
        _active.on_draw()
    if (
        dropout_p <= 0
        or not isinstance(query, DTensor)
        or all(isinstance(p, Replicate) for p in query.placements)
    ):
        return contextlib.nullcontext()
    return dtensor_rng_region(query)
