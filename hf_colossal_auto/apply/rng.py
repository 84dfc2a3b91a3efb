"""Random ops under tensor and context parallelism: the ranks of one replica draw as one process would.

Why: the ranks of a tensor-parallel group compute one replica's step together. A value they share (a replicated
activation) must see the same dropout mask on every rank, or the replicas of "one" value part ways and so do
the replicated parameters they train; a value split over the group (attention probabilities on the local
heads) must see *different* numbers on each shard — together, one process's mask. Neither holds by itself:
each process's generator is its own (``accelerate.utils.set_seed(seed, device_specific=True)`` seeds each with
seed + rank), and on CPU DTensor runs a random op on every local shard from that generator (its offset-based
RNG tracker exists for CUDA only). Data-parallel replicas are left alone: they keep their own streams, as under
plain DDP.

Context parallelism splits the same rows' tokens over the ``cp`` ranks of a replica, each computing on plain
(or tensor-parallel) values of its own tokens with the same shapes as the others. Left alone, cp ranks seeded
alike (``set_seed(seed)``, accelerate's default) draw the *same* masks for *different* tokens: one process's
masks are independent over the tokens, these would repeat from chunk to chunk — a silent change of what
dropout does. Drawing per global position (each rank drawing the whole sequence's mask and keeping its part,
as the per-shard draws below do over tp) would give one process's masks bit for bit, but at cp times the
numbers and a whole-sequence transient per draw — for attention dropout the ``S x S`` probabilities, which is
what context parallelism exists to avoid. So under cp each cp rank draws from its own stream instead: one
process's distribution (independent masks for every token), not its numbers.

Two pieces:

* **agreement** (:class:`ModelParallelRNG`): at the start of a planned training forward the replica's first
  rank broadcasts its generator states (CPU, and CUDA's where the mesh is on CUDA) to the replica's ``cp x tp``
  ranks. The ranks of cp rank 0 draw from them; those of cp rank ``c > 0`` from generators seeded from a hash of
  them and ``c`` (:func:`stream_states`), so the tensor-parallel ranks of one cp rank agree, the cp ranks'
  streams differ, and every mask of the replica follows from its first rank's generator, however the others
  were seeded. After the forward the first rank keeps its advanced generator (as one process would);
  the others get back their own, so that what they draw outside the model (a data collator) is what it was.
  Activation checkpointing records the generator state at a recomputed block's entry — the agreed one — and
  replays it in backward, so recomputed blocks draw the same masks. A model whose last training forward drew
  nothing (dropout 0, no noise) skips the broadcast until it draws again (see :meth:`ModelParallelRNG.forward`).
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
regions, e.g. an MoE expert computed on local tensors) draw the same numbers on every tensor-parallel rank.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
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
"""Attribute of a planned model holding its :class:`ModelParallelRNG` (absent without tensor or context
parallelism)."""

_active: ModelParallelRNG | None = None
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


def _agreement_group(mesh: DeviceMesh, group_mesh: DeviceMesh) -> dist.ProcessGroup:
    """The group the generator states are broadcast in: the replica's ``cp x tp`` ranks (``group_mesh``, 1-D)
    themselves under gloo; under another backend (NCCL) a gloo group of the same ranks, so that the states (host
    memory) travel without a copy to the device and a wait on its stream. Those ranks are consecutive in the
    row-major mesh; every rank creates every such group (in order)."""
    if dist.get_backend() == "gloo":
        return group_mesh.get_group(0)
    rows = mesh.mesh.reshape(-1, group_mesh.size()).tolist()
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


def stream_states(agreed: list[torch.Tensor], device: torch.device | None, stream: int) -> list[torch.Tensor]:
    """The generator states cp rank ``stream`` draws from, given the replica's agreed ones: those themselves
    for cp rank 0; for the others fresh generators seeded from a hash of every agreed state (the CUDA one too:
    on a CUDA mesh the CPU generator may not advance between steps) and ``stream``, so each cp rank's stream is
    its own, changes whenever the first rank's generator advances, and is the same on its tensor-parallel
    ranks."""
    if stream == 0:
        return agreed
    digest = hashlib.blake2b(
        b"".join(s.numpy().tobytes() for s in agreed), digest_size=8, salt=stream.to_bytes(16, "little")
    ).digest()
    seed = int.from_bytes(digest, "little") >> 1  # a non-negative 63-bit seed
    states = [torch.Generator().manual_seed(seed).get_state()]
    if device is not None:
        states.append(torch.Generator(device=device).manual_seed(seed).get_state())
    return states


class ModelParallelRNG:
    """The generator agreement of one planned model's replica: its ``cp x tp`` ranks (see the module doc)."""

    def __init__(
        self, group: dist.ProcessGroup, device: torch.device | None, always: bool, stream: int = 0
    ) -> None:
        self.group = group
        self.device = device
        self.is_first = dist.get_rank(group) == 0
        self.always = always  # agree in every training forward (recomputed blocks, cp: no lazy agreement)
        self.stream = stream  # this rank's cp rank: which stream of the agreed generator it draws from
        self.draws: bool | None = None  # did the last training forward draw? None: not known yet
        self.own: list[torch.Tensor] | None = None  # this rank's states while the group's are in use
        self.agreed_states: list[torch.Tensor] | None = None  # what this rank draws from in the forward
        self.unagreed_warned = False

    def agree(self) -> None:
        """Broadcast the first rank's generator states to the group and draw from them (this cp rank's stream of
        them) from now on."""
        own = _generator_states(self.device)
        sizes = [s.numel() for s in own]
        buffer = torch.cat(own)
        dist.broadcast(buffer, group=self.group, group_src=0)
        agreed = stream_states(list(buffer.split(sizes)), self.device, self.stream)
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
                    "none, before the replica's generators were agreed; from the next forward "
                    "on they are agreed up front"
                )
            self._finish()


def install_replica_rng(model: torch.nn.Module, mesh: DeviceMesh, recomputed: bool) -> None:
    """Give ``model`` (its forward wrapped by the runtime) a :class:`ModelParallelRNG` for its replica's
    ``cp x tp`` ranks, and with tensor parallelism register the per-shard random-op handlers — only where the
    replica has more than one rank and the processes are real (the planner's fake group simulates ranks in one
    process). Under cp the agreement runs in every training forward: the cp ranks' draws are on plain tensors
    too, which cannot agree lazily at a DTensor random op."""
    from .runtime import batch_group_mesh, tensor_parallel_mesh

    names = tuple(mesh.mesh_dim_names or ())
    tp = mesh.size(names.index("tp")) if "tp" in names else 1
    cp = mesh.size(names.index("cp")) if "cp" in names else 1
    if tp * cp < 2:
        return
    if not dist.is_initialized() or dist.get_backend() == "fake":
        return
    group_mesh = batch_group_mesh(mesh)
    device = _device_of(group_mesh)
    if tp > 1:
        register_random_op_handlers()
        if device is not None:
            ensure_dtensor_rng_tracker(tensor_parallel_mesh(mesh))
    stream = mesh.get_local_rank("cp") if cp > 1 else 0
    rng = ModelParallelRNG(_agreement_group(mesh, group_mesh), device, recomputed or cp > 1, stream)
    setattr(model, _RNG_ATTR, rng)
    _agree_in_generate(model, rng)


def _agree_in_generate(model: torch.nn.Module, rng: ModelParallelRNG) -> None:
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


def rng_of(model: torch.nn.Module) -> ModelParallelRNG | None:
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
