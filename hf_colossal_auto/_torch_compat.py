"""The one place that touches private or fast-moving torch APIs.

Everything else in the package imports these names from here, so that a torch upgrade that moves a
private symbol is fixed in one file. Each import says which public behaviour we rely on.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode  # fake tensors: shapes, no memory
from torch.nn.utils.stateless import _reparametrize_module  # functional_call's own swap, held open
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.flop_counter import flop_registry as _torch_flop_registry
from torch.utils.weak import WeakIdKeyDictionary

__all__ = [
    "attention_block_backward",
    "attention_block_forward",
    "attention_lse_kernel",
    "tensor_is_view",
    "pipeline_schedule_actions",
    "pipeline_stage_with_transient_receive_buffers",
    "recording_point_to_point",
    "PointToPoint",
    "flatten_mesh_axes",
    "clip_grad_internals",
    "functional_all_to_all_rows",
    "set_clip_grad_internals",
    "queue_backward_callback",
    "set_group_timeout",
    "group_timeout",
    "default_dtensor_dispatch",
    "dtensor_random_ops",
    "dtensor_rng_region",
    "dtensor_tracks_random_ops",
    "ensure_dtensor_rng_tracker",
    "dtensor_op_handler",
    "dcp_metadata_path",
    "dtensor_op_has_handler",
    "register_dtensor_op_handler",
    "allow_implicit_replication",
    "local_tensor_mode",
    "simulated_rank_tensors",
    "DTensorSpec",
    "MaskPartial",
    "OpSchema",
    "OpSpec",
    "OpStrategy",
    "ShardingPlaceholder",
    "StridedShard",
    "TensorMeta",
    "TupleStrategy",
    "detached_device_mesh",
    "dtensor_decomposition_strategy",
    "dtensor_sharding_propagator",
    "FakeTensor",
    "FakeTensorMode",
    "MemTracker",
    "comm_debug_mode",
    "storage_key",
    "swapped_parameters",
    "ModTracker",
    "TorchDispatchMode",
    "WeakIdKeyDictionary",
    "flop_registry",
    "relax_grouped_mm_meta",
    "fake_process_group",
    "tree_flatten",
    "tracked_module_name",
    "tree_map",
]

if TYPE_CHECKING:
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed._tools.mod_tracker import ModTracker


def __getattr__(name: str) -> Any:
    """``MemTracker`` (measured peaks, DTensor local shards included) and ``ModTracker`` (module FQNs through
    forward and backward), imported when first asked for: the ``torch.distributed._tools`` package imports
    its FSDP memory tracker and runtime estimator, and through them the inductor, about 1 s per process
    that only runs a plan (every rank of every multi-process job)."""
    if name == "MemTracker":
        from torch.distributed._tools.mem_tracker import MemTracker

        return MemTracker
    if name == "ModTracker":
        from torch.distributed._tools.mod_tracker import ModTracker

        return ModTracker
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def comm_debug_mode(modules: bool = True) -> Any:
    """A ``CommDebugMode`` whose module tracker tolerates a module object called more than once per forward;
    with ``modules=False``, one that counts the collectives without attributing them to modules (no tracker
    runs): torch's tracker registers multi-grad hooks on every module's inputs, which autograd refuses under
    ``torch.autograd.grad`` — what a pipeline stage's backward calls.

    torch 2.13's tracker registers a forward hook on a module at every call and keeps one handle per module
    name, so a module called twice gets two hooks (each pops its parent list: ``IndexError``), and the
    hooks beyond one are never removed: they fire in every later forward of the process, with or without a
    CommDebugMode. transformers >= 5.25 (through the ``kernels`` package it requires) calls one module object,
    e.g. Llama's ``apply_rotary_pos_emb``, from every attention layer. This tracker keeps one hook per module
    object and removes them all on exit; ``_CommModeModuleTracker`` is private."""
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.distributed.tensor.debug._comm_mode import _CommModeModuleTracker

    class _OneHookPerModule(_CommModeModuleTracker):
        def __enter__(self):
            self._hooked: dict[int, Any] = {}
            return super().__enter__()

        def _fw_pre_hook(self, mod, input):
            super()._fw_pre_hook(mod, input)
            handle = self.register_forward_hook_handles.get(self.name)
            if handle is None or self.activation_checkpointing:
                return
            first = self._hooked.setdefault(id(mod), handle)
            if first is not handle:  # hooked at an earlier call: one hook pops once per call
                handle.remove()
                self.register_forward_hook_handles[self.name] = first

        def __exit__(self, *args):
            super().__exit__(*args)
            for handle in self._hooked.values():
                handle.remove()
            self._hooked.clear()

    class _NoModules(_CommModeModuleTracker):
        def __enter__(self):
            self.name = "Global"  # every collective counted at the top, with no parents
            self.module_parents_dict = {self.name: set()}
            return self

        def __exit__(self, *args):
            return None

    mode = CommDebugMode()
    mode.advanced_module_tracker = _OneHookPerModule() if modules else _NoModules()
    return mode


# FlopCounterMode's own registry, keyed by OpOverloadPacket. We read it (never mutate it) so that our
# per-op FLOPs are by construction what FlopCounterMode counts.
flop_registry = _torch_flop_registry


def tensor_is_view(t) -> bool:
    """True when autograd tracks ``t`` as a view of another tensor: torch's pipeline stages detach a stage's
    outputs in place after backward (``detach_``), which a view refuses."""
    return t._is_view()


def dtensor_is_view(t) -> bool:
    """True when a DTensor is a view of another DTensor (what a view op returns), as autograd tracks it on the
    wrapper: DTensor's dispatch does not keep its local tensors' view relation (a view's local tensor reads
    False), so the wrapper is asked."""
    return t._is_view()


def fake_process_group(world_size: int, rank: int = 0) -> None:
    """Initialise torch.distributed with the in-process fake backend (no communication, any world size).

    Used by the planner to build device meshes and price DTensor collectives without processes.
    """
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        return
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)


def tracked_module_name(tracker: ModTracker, module: object) -> str:
    """ModTracker's name for ``module`` (``"<RootClass>.<fqn>"``); a private method of ModTracker."""
    return tracker._get_mod_name(module)


# --------------------------------------------------------------------------- DTensor sharding rules
# The strategy enumerator (hf_colossal_auto.strategies) asks DTensor's own sharding rules which placements an
# op supports. The rule registry, the OpSchema/OpStrategy containers and the placeholder/strided placement
# classes are private; they are named here only.
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta  # noqa: E402
from torch.distributed.tensor._op_schema import OpSchema, OpSpec, OpStrategy, TupleStrategy  # noqa: E402
from torch.distributed.tensor._ops.single_dim_strategy import (  # noqa: E402
    _ShardingPlaceholder as ShardingPlaceholder,  # "shard on dim d" in single-mesh-dim rules
)
from torch.distributed.tensor.placement_types import (  # noqa: E402
    _MaskPartial as MaskPartial,  # vocab-parallel embedding: partial output, locally masked ids
)
from torch.distributed.tensor.placement_types import (  # noqa: E402
    _StridedShard as StridedShard,  # interleaved sharding that 2-D view rules may emit
)


def dtensor_sharding_propagator():
    """DTensor's process-wide ShardingPropagator: the registries of per-op strategy functions
    (``op_strategy_funcs``, ``op_single_dim_strategy_funcs``, ``op_to_schema_info``) and the
    decomposition-tracing fallback (``decomp_strategy`` on torch 2.13; use :func:`dtensor_decomposition_strategy`,
    which also covers torch 2.11). Importing DTensor's ``_ops`` fills them."""
    import torch.distributed.tensor._ops  # noqa: F401  (registers every rule)
    from torch.distributed.tensor import DTensor

    return DTensor._op_dispatcher.sharding_propagator


class _PropagatorBoundDecompStrategy:
    """torch 2.11's ``DecompShardingStrategy`` (static methods that take the propagator) with the
    interface of the per-propagator instance that torch 2.13 keeps as ``ShardingPropagator.decomp_strategy``."""

    def __init__(self, sharding_prop) -> None:
        from torch.distributed.tensor._decompositions import DecompShardingStrategy

        self._cls = DecompShardingStrategy
        self._sp = sharding_prop

    def has_decomp(self, op) -> bool:
        return self._cls.has_decomp(op)

    def ensure_schema_info(self, op) -> None:
        self._cls.ensure_schema_info(op, self._sp)

    def propagate_strategy(self, op_schema):
        return self._cls.propagate_strategy(op_schema, self._sp)


def dtensor_decomposition_strategy(sharding_prop=None):
    """DTensor's decomposition-tracing rule source for ``sharding_prop`` (default: DTensor's own propagator):
    an object with ``has_decomp(op)``, ``ensure_schema_info(op)`` and ``propagate_strategy(op_schema)``.

    torch 2.13 keeps one per propagator (``sharding_prop.decomp_strategy``); before that (torch 2.11)
    ``DecompShardingStrategy`` is a class of static methods that take the propagator as an argument.
    """
    sp = sharding_prop if sharding_prop is not None else dtensor_sharding_propagator()
    decomp = getattr(sp, "decomp_strategy", None)
    return decomp if decomp is not None else _PropagatorBoundDecompStrategy(sp)


def detached_device_mesh(mesh_shape: tuple[int, ...], device_type: str = "cpu"):
    """A DeviceMesh of ``mesh_shape`` over ranks ``0..N-1`` with no process groups behind it, as seen by rank 0.

    Sharding rules read only the mesh's shape, so when the default (fake) group's size differs from the mesh
    the planner wants to evaluate, a mesh that never communicates is exactly right.
    """
    import torch
    from torch.distributed.device_mesh import DeviceMesh

    n = 1
    for s in mesh_shape:
        n *= s
    return DeviceMesh(device_type, torch.arange(n).reshape(mesh_shape), _init_backend=False, _rank=0)


def allow_implicit_replication(enabled: bool) -> None:
    """Let DTensor ops treat plain tensors as replicated, process-wide (the public context manager
    ``implicit_replication`` only covers a ``with`` block, and backward runs outside the model's forward)."""
    from torch.distributed.tensor import DTensor

    DTensor._op_dispatcher._allow_implicit_replication = enabled


def local_tensor_mode(world_size: int):
    """torch's single-process simulation of ``world_size`` ranks (for multi-rank tests without processes)."""
    from torch.distributed._local_tensor import LocalTensorMode

    return LocalTensorMode(frozenset(range(world_size)))


def simulated_rank_tensors(t) -> dict:
    """Under :func:`local_tensor_mode`: rank -> the tensor that rank holds of DTensor ``t`` (its local shard as
    each simulated rank would have it), for tests that look at storages."""
    return dict(t.to_local()._local_tensors)


def register_dtensor_op_handler(op, handler) -> None:
    """Route ``op`` on DTensors through ``handler(op, args, kwargs)`` (DTensor's private table of ops it
    special-cases); inside the handler, :func:`default_dtensor_dispatch` runs DTensor's normal path."""
    from torch.distributed.tensor import DTensor

    DTensor._op_dispatcher._custom_op_handlers[op] = handler


def dtensor_op_has_handler(op) -> bool:
    """Whether DTensor special-cases ``op`` in its private handler table (it then needs no sharding rule)."""
    from torch.distributed.tensor import DTensor

    return op in DTensor._op_dispatcher._custom_op_handlers


def dtensor_op_handler(op):
    """The handler DTensor special-cases ``op`` with (its private handler table), or None."""
    from torch.distributed.tensor import DTensor

    return DTensor._op_dispatcher._custom_op_handlers.get(op)


def default_dtensor_dispatch(op, args, kwargs):
    """Run ``op`` through DTensor's normal dispatch from inside a handler registered for it (the handler is
    taken out of the table for the call; DTensor's dispatcher has no public "default" entry point)."""
    from torch.distributed.tensor import DTensor

    handlers = DTensor._op_dispatcher._custom_op_handlers
    handler = handlers.pop(op)
    try:
        return op(*args, **(kwargs or {}))
    finally:
        handlers[op] = handler


def dtensor_random_ops() -> frozenset:
    """The aten ops DTensor's dispatcher treats as random (dropout, ``bernoulli_``, ``rand_like``...): the ops
    its RNG tracker offsets per shard on CUDA (a private set of its op dispatcher)."""
    from torch.distributed.tensor import DTensor

    return frozenset(DTensor._op_dispatcher._random_ops)


def dtensor_tracks_random_ops(mesh) -> bool:
    """Whether DTensor's random ops on ``mesh`` run under an offset-based RNG tracker (distinct numbers per
    shard): a tracker exists, is enabled, and the mesh's device has a generator it can offset (CUDA-like;
    ``torch.distributed.tensor._random.is_rng_supported_mesh`` without its warning). Never on CPU."""
    from torch.distributed.tensor import _random

    handle = getattr(torch, mesh.device_type, None)
    tracker = _random._rng_tracker
    return (
        mesh.device_type != "cpu"
        and hasattr(handle, "set_rng_state")
        and tracker is not None
        and tracker.distribute_region_enabled
    )


def ensure_dtensor_rng_tracker(mesh) -> None:
    """Create DTensor's ``OffsetBasedRNGTracker`` for ``mesh`` (a CUDA-like mesh) unless one exists, *without*
    its state synchronisation: left to DTensor, the first random op creates it and broadcasts global rank 0's
    generator state to every rank — data-parallel replicas included, which then draw the same masks. What
    ``torch.distributed.tensor.random.manual_seed`` does, without reseeding."""
    from torch.distributed.tensor import _random

    if _random._rng_tracker is None:
        _random._rng_tracker = _random.OffsetBasedRNGTracker(mesh, run_state_sync=False)


def dtensor_rng_region(dtensor):
    """DTensor's RNG tracker's per-shard region for a random op whose output is laid out like ``dtensor``: each
    shard draws from its own offset of the (shared) Philox state, and every rank leaves it at the same offset.
    A null context where DTensor has no tracker for the mesh's device."""
    import contextlib

    from torch.distributed.tensor import _random

    if not dtensor_tracks_random_ops(dtensor.device_mesh):
        return contextlib.nullcontext()
    return _random._rng_tracker._distribute_region(dtensor._spec)


def storage_key(tensor) -> int:
    """An id of ``tensor``'s storage, equal for its views and ``.data`` aliases, also on ``meta`` (where
    ``data_ptr()`` is 0 for every tensor): the address of the StorageImpl (``UntypedStorage._cdata``)."""
    return tensor.untyped_storage()._cdata


def swapped_parameters(module, tensors):
    """``torch.func.functional_call``'s parameter swap as a context manager, so that it can stay open through
    backward too (activation recompute reruns forward code inside backward, on the same swapped tensors)."""
    return _reparametrize_module(module, tensors, tie_weights=True, strict=False)


def queue_backward_callback(callback) -> None:
    """Run ``callback`` once the running backward pass ends (autograd's execution engine; call it from a hook
    that runs during backward). What DDP and FSDP1 use to finish gradient reductions they started
    asynchronously."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def set_group_timeout(timeout, group=None) -> None:
    """A process group's collective timeout after its creation (``_set_pg_timeout``: gloo and NCCL backends).

    Why: the group is created by the launcher's ``init_process_group`` (accelerate, the Trainer, the user) with
    torch's 30-minute default; the plan's runtime shortens it so a lost peer ends the job in minutes."""
    from torch.distributed.distributed_c10d import _set_pg_timeout

    _set_pg_timeout(timeout, group)


def default_store():
    """The default process group's key-value store (``_get_default_store``: the launcher's TCP store).

    Why: a rank can leave a note there and wait for the others' notes with a timeout of its own, without
    entering a collective that would block for good if a peer never joins (``save_pretrained`` called on the
    main process only)."""
    from torch.distributed.distributed_c10d import _get_default_store

    return _get_default_store()


def dcp_metadata_path(reader, rank=None):
    """Where a ``torch.distributed.checkpoint.FileSystemReader`` reads its checkpoint's metadata from
    (``_get_metadata_path``: ``.metadata``, or the rank's own file where DCP wrote one per rank)."""
    return reader._get_metadata_path(rank)


def group_timeout(group=None):
    """The collective timeout a process group's CPU backend runs with now (a ``timedelta``; the default group
    when ``group`` is None): what :func:`set_group_timeout` set, read back from the backend's options."""
    import torch.distributed as dist

    group = dist.group.WORLD if group is None else group
    return group._get_backend(torch.device("cpu")).options._timeout


_GROUPED_MM_META_LIBRARY: list = []  # the Library object must stay alive for its registration to hold


def relax_grouped_mm_meta(output_layout) -> None:
    """Register ``aten::_grouped_mm``'s Meta kernel without its bfloat16-only check (once per process).

    torch 2.13's meta kernel (``_meta_registrations.meta_grouped_mm``) states the CUDA kernel's contract, bf16
    only, but the CPU kernel runs fp32 and fp16 too, and transformers' MoE experts call it in the model's
    dtype. Fake tensors (capture) and DTensor's sharding propagation (runtime) both take output shapes from the
    Meta kernel, so an fp32 MoE step could be neither traced nor run on DTensors. ``output_layout(mat_a,
    mat_b, offs, dtype) -> (shape, stride)`` is what the CPU kernel allocates (rows padded to 16 bytes).
    Overriding an aten Meta kernel goes through ``torch.library.Library(..., "IMPL")``; a torch whose meta
    kernel accepts fp32 makes this a no-op in effect.
    """
    if _GROUPED_MM_META_LIBRARY:
        return

    def meta(mat_a, mat_b, offs=None, bias=None, out_dtype=None):
        torch._check(
            mat_a.dtype == mat_b.dtype and mat_a.dtype.is_floating_point,
            lambda: f"_grouped_mm needs operands of one floating dtype, got {mat_a.dtype} and {mat_b.dtype}",
        )
        dtype = out_dtype or mat_a.dtype
        shape, stride = output_layout(mat_a, mat_b, offs, dtype)
        return mat_a.new_empty_strided(shape, stride, dtype=dtype)

    library = torch.library.Library("aten", "IMPL")
    library.impl("_grouped_mm", meta, "Meta", allow_override=True)
    _GROUPED_MM_META_LIBRARY.append(library)


def clip_grad_internals():
    """``(total_norm, clip_with_norm)``: the two private functions ``torch.nn.utils.clip_grad_norm_`` is made of
    (the norm of many gradients; scaling them by it), which mixed-mesh gradient clipping wraps."""
    from torch.nn.utils import clip_grad

    return clip_grad._get_total_norm, clip_grad._clip_grads_with_norm_


def set_clip_grad_internals(total_norm, clip_with_norm) -> None:
    """Replace the functions :func:`clip_grad_internals` returns; ``clip_grad_norm_`` calls them by module
    attribute, so it (and accelerate's, and the Trainer's) runs the replacements. Their public aliases
    (``torch.nn.utils.get_total_norm``, ``clip_grads_with_norm_``: the same functions, bound at import) are
    rebound too, so a training loop that clips in two calls gets them as well."""
    import torch.nn.utils as utils
    from torch.nn.utils import clip_grad

    for public, private, replacement in (
        ("get_total_norm", "_get_total_norm", total_norm),
        ("clip_grads_with_norm_", "_clip_grads_with_norm_", clip_with_norm),
    ):
        if getattr(utils, public, None) is getattr(clip_grad, private):
            setattr(utils, public, replacement)
        setattr(clip_grad, private, replacement)


def functional_all_to_all_rows(t, output_splits, input_splits, group, *, differentiable: bool = True):
    """Rows of ``t`` exchanged over ``group`` by all-to-all: ``input_splits[j]`` rows to rank ``j``,
    ``output_splits[j]`` rows from it (None: equal blocks). Through torch's functional collectives, as DTensor
    issues its own, so ``CommDebugMode`` and the tests' recorders count it; ``differentiable``: its backward is
    the reverse all-to-all of the gradient."""
    from torch.distributed import _functional_collectives as funcol

    exchange = funcol.all_to_all_single_autograd if differentiable else funcol.all_to_all_single
    return funcol.wait_tensor(exchange(t, output_splits, input_splits, group))


def pipeline_schedule_actions(
    schedule_class: str, pp_size: int, micro_batches: int, stages_per_rank: int
) -> list[list[tuple[str, int, int] | None]]:
    """torch's own compute actions per pp rank of a ``torch.distributed.pipelining`` schedule class (its
    ``pipeline_order``, what its runtime executes), as ``(kind, stage, micro-batch)`` with kind "F" (forward),
    "B" (full backward), "I" (input gradient), "W" (weight gradient); None where torch's list has an idle
    slot. Made by torch's schedule visualiser helper (a mocked stage: no process group, no model)."""
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

    ops = get_schedule_ops(_compute_only_schedule(schedule_class), pp_size, micro_batches, stages_per_rank)
    return [_compute_actions(rank) for rank in ops]


@functools.cache
def _compute_only_schedule(schedule_class: str) -> type:
    """torch's schedule class whose construction stops at its compute actions (``pipeline_order``): the
    multi-stage schedules lower those to communication and FSDP actions as they are built (private
    ``_prepare_schedule_with_comms``), most of their construction time at 64 stages and 32 micro-batches, and
    nothing the compute actions depend on (it runs last in each ``__init__``)."""
    from torch.distributed import pipelining

    base = getattr(pipelining, schedule_class)
    return type(base.__name__, (base,), {"_prepare_schedule_with_comms": _no_lowering})


def _no_lowering(self, actions, format: str = "compute_only") -> None:
    """Stands for the lowering to communication actions, which a list of compute actions does not need."""


def schedule_compute_actions(schedule) -> list[list[tuple[str, int, int]]]:
    """A built multi-stage ``torch.distributed.pipelining`` schedule's compute actions per pp rank, in the order
    its runtime runs them (its private ``pipeline_order``), as :func:`pipeline_schedule_actions` gives them, idle
    slots dropped."""
    order = schedule.pipeline_order
    return [[a for a in _compute_actions(order[rank]) if a is not None] for rank in sorted(order)]


def _compute_actions(actions) -> list[tuple[str, int, int] | None]:
    """One rank's torch ``_Action`` list as ``(kind, stage, micro-batch)`` compute actions, None kept where torch
    has an idle slot, communication and FSDP actions left out."""
    return [
        None if a is None else (a.computation_type.value, a.stage_index, a.microbatch_index)
        for a in actions
        if a is None or a.computation_type.value in ("F", "B", "I", "W")
    ]


def free_whole_storages(tensors) -> None:
    """Free the storage of each of ``tensors`` that is its whole storage (resized to 0: whoever still holds the
    tensor, a send's work among them, holds an empty one); a view of a larger storage is left alone."""
    for t in tensors:
        storage = t.untyped_storage()
        if t.is_contiguous() and storage.nbytes() == t.numel() * t.element_size():
            storage.resize_(0)


def isend_point_to_point_ops(ops) -> list:
    """Issue ``ops`` (``dist.P2POp`` sends, as a pipeline stage's ``get_bwd_send_ops`` returns them) one by one,
    as torch's pipelining runtime issues a batch of sends (``_batch_p2p``), and return their works."""
    return [op.op(op.tensor, group=op.group, tag=op.tag, group_dst=op.group_peer) for op in ops]


def pipeline_stage_with_transient_receive_buffers(
    submodule, stage_index: int, num_stages: int, device, group, gradient_sends=None
):
    """torch's ``PipelineStage`` whose receive buffers live only while their micro-batch is in flight.

    torch's stage allocates one buffer per micro-batch and direction when its schedule first runs (the
    activation received from the previous stage, the gradient from the next) and keeps them all between steps:
    at 405B (hidden 16384, 8192 tokens a micro-batch, fp32, 32 micro-batches, 2 stages a rank) 64 GiB per rank
    that no micro-batch is using. Here each buffer is allocated just before its receive is posted and dropped
    once the micro-batch's backward has run (a forward-only step: at its end), so a rank holds the buffers of
    its micro-batches in flight only; the activation buffer is the stage's input, which the backward keeps
    anyway. A dropped buffer is left as a meta tensor of its shape, dtype and stride (torch's ``_RecvInfo``
    treats a ``None`` buffer as "no tensor").

    Sent activations likewise: torch's multi-stage schedules keep every send's work, and with it the tensor
    sent, to the end of the step. Once a micro-batch's backward on this stage is complete (its weight gradient
    included), the next stage has received that micro-batch's activation (it sent back the gradient this
    backward used) and nothing here reads the sent output any more, so its storage is freed (resized to 0; the
    work keeps an empty tensor).

    Sent gradients, given ``gradient_sends`` (:class:`hf_colossal_auto.apply.pipeline_sends.GradientSends`,
    shared by a rank's stages): the stage issues its backward sends itself and hands their works to it instead
    of to torch's schedule, and tells it as each forward or backward starts (its received input waited), which
    is when the schedule's order may prove an earlier send received. Private: ``args_recv_info`` /
    ``grad_recv_info``, ``_RecvInfo``, ``_prepare_forward_infra`` / ``_prepare_backward_infra``,
    ``backward_state``."""
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.stage import _RecvInfo

    def move(infos, device, *, to_meta: bool) -> None:
        """Each received buffer of ``infos`` that is (not) on meta, as an empty one of its shape, stride and
        dtype on ``device``: dropped (``to_meta``) or allocated for a receive."""
        for info in infos or ():
            buffer = info.buffer if isinstance(info, _RecvInfo) and not info.is_root_arg else None
            if isinstance(buffer, torch.Tensor) and buffer.is_meta != to_meta:
                info.buffer = torch.empty_strided(
                    buffer.size(), buffer.stride(), dtype=buffer.dtype, device=device
                )

    def drop(infos) -> None:
        move(infos, "meta", to_meta=True)

    def allocate(infos, device) -> None:
        move(infos, device, to_meta=False)

    class _Stage(PipelineStage):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self._sent: dict[int, list[torch.Tensor]] = {}

        def _prepare_forward_infra(self, *args, **kwargs):
            out = super()._prepare_forward_infra(*args, **kwargs)
            for infos in self.args_recv_info.values():
                drop(infos)
            return out

        def _prepare_backward_infra(self, *args, **kwargs):
            out = super()._prepare_backward_infra(*args, **kwargs)
            for infos in self.grad_recv_info.values():
                drop(infos)
            return out

        def get_fwd_recv_ops(self, fwd_chunk_id: int):
            allocate(self.args_recv_info[fwd_chunk_id], self.device)
            return super().get_fwd_recv_ops(fwd_chunk_id)

        def get_bwd_recv_ops(self, bwd_chunk_id: int):
            allocate(self.grad_recv_info.get(bwd_chunk_id), self.device)
            return super().get_bwd_recv_ops(bwd_chunk_id)

        def set_local_bwd_input(self, next_stage_bwd_outputs, mb_index: int) -> None:
            allocate(self.grad_recv_info.get(mb_index), self.device)  # a None gradient zeroes the buffer
            super().set_local_bwd_input(next_stage_bwd_outputs, mb_index)

        def get_fwd_send_ops(self, fwd_chunk_id: int):
            ops = super().get_fwd_send_ops(fwd_chunk_id)
            self._sent[fwd_chunk_id] = [op.tensor for op in ops]
            return ops

        def get_bwd_send_ops(self, bwd_chunk_id: int):
            ops = super().get_bwd_send_ops(bwd_chunk_id)
            if gradient_sends is None or not ops:
                return ops
            gradient_sends.issue(self.stage_index, bwd_chunk_id, ops)
            return []  # nothing for torch's schedule to keep

        def forward_one_chunk(self, fwd_chunk_id: int, *args, **kwargs):
            if gradient_sends is not None:
                gradient_sends.starting(("F", self.stage_index, fwd_chunk_id))
            return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)

        def backward_one_chunk(
            self, bwd_chunk_id: int, loss=None, full_backward: bool = True, last_backward=False
        ):
            if gradient_sends is not None:
                gradient_sends.starting(("B" if full_backward else "I", self.stage_index, bwd_chunk_id))
            out = super().backward_one_chunk(
                bwd_chunk_id, loss=loss, full_backward=full_backward, last_backward=last_backward
            )
            drop(self.args_recv_info.get(bwd_chunk_id))
            drop(self.grad_recv_info.get(bwd_chunk_id))
            if full_backward:
                free_whole_storages(self._sent.pop(bwd_chunk_id, ()))
            return out

        def backward_weight_one_chunk(self, bwd_chunk_id: int, last_backward=False):
            out = super().backward_weight_one_chunk(bwd_chunk_id, last_backward=last_backward)
            free_whole_storages(self._sent.pop(bwd_chunk_id, ()))
            return out

        def clear_runtime_states(self) -> None:
            super().clear_runtime_states()
            self._sent = {}  # a forward-only step's sends: left to torch (no backward says they arrived)
            if not self.has_backward or not torch.is_grad_enabled():  # a forward-only step keeps no input
                for infos in self.args_recv_info.values():
                    drop(infos)

    return _Stage(submodule, stage_index, num_stages, device, group=group)


def flatten_mesh_axes(mesh, names: tuple[str, ...], flat_name: str):
    """The 1-D mesh over the ranks of ``mesh``'s axes ``names`` (row-major), with its process group: torch's
    private ``DeviceMesh._flatten`` (every rank must call it, in the same order)."""
    return mesh[names]._flatten(flat_name)


class PointToPoint(NamedTuple):
    """One point-to-point op a rank issued."""

    op: str
    """"isend", "irecv", "send" or "recv"."""
    peer: int
    """The other rank's global rank."""
    nbytes: int


_P2P_OPS = ("isend", "irecv", "send", "recv")


def _global_peer(peer: int | None, group: Any, group_peer: int | None) -> int:
    """The global rank of a point-to-point op's peer, given as a global rank or as a rank of ``group``."""
    import torch.distributed as dist

    if peer is not None:
        return peer
    return dist.get_global_rank(group if group is not None else dist.group.WORLD, group_peer)


class recording_point_to_point:  # noqa: N801 (used as a context manager, like torch's own modes)
    """Inside it, every point-to-point op this process issues through ``torch.distributed`` (``isend``,
    ``irecv``, ``send``, ``recv``: what ``torch.distributed.pipelining`` sends and receives, also through
    ``batch_isend_irecv``) is appended to ``self.records`` as a :class:`PointToPoint`, then run unchanged.

    Why wrapping the functions: under gloo the pipelining schedules issue plain ``isend`` / ``irecv`` (gloo
    does not coalesce), which neither ``CommDebugMode`` (functional collectives only) nor a flight recorder
    (NCCL) sees. The wrappers replace the functions in ``torch.distributed`` *and* in ``distributed_c10d``,
    whose ``P2POp`` and ``batch_isend_irecv`` check an op by identity against the module's own names."""

    def __init__(self) -> None:
        self.records: list[PointToPoint] = []
        self._saved: list[tuple[Any, str, Any]] = []

    def _wrap(self, name: str, original: Any) -> Any:
        peer_key = "dst" if name in ("isend", "send") else "src"

        def wrapper(tensor, *args, **kwargs):
            peer = args[0] if args else kwargs.get(peer_key)
            group = args[1] if len(args) > 1 else kwargs.get("group")
            group_peer = kwargs.get("group_" + peer_key)
            nbytes = tensor.numel() * tensor.element_size()
            self.records.append(PointToPoint(name, _global_peer(peer, group, group_peer), nbytes))
            return original(tensor, *args, **kwargs)

        wrapper.__wrapped__ = original
        return wrapper

    def __enter__(self) -> recording_point_to_point:
        import torch.distributed as dist
        from torch.distributed import distributed_c10d

        for name in _P2P_OPS:
            original = getattr(distributed_c10d, name)
            wrapper = self._wrap(name, original)
            for module in (distributed_c10d, dist):
                self._saved.append((module, name, getattr(module, name)))
                setattr(module, name, wrapper)
        return self

    def __exit__(self, *exc: object) -> None:
        for module, name, original in reversed(self._saved):
            setattr(module, name, original)
        self._saved.clear()


# ------------------------------------------------------------------- attention with its log-sum-exp
# Context parallelism's causal attention without a mask (apply/context_parallel_blocks.py) runs a rank's queries
# against blocks of the gathered keys and merges the blocks by their log-sum-exp; the public
# ``scaled_dot_product_attention`` returns no log-sum-exp, the private SDPA kernels do (and their backward takes
# the merged output and log-sum-exp, as torch's own ring attention uses them). Layouts: q, k, v ``[b, heads, L,
# d]`` (any strides with a contiguous last dim), the log-sum-exp ``[b, heads, L]`` in float32.

_aten = torch.ops.aten

EFFICIENT_ALIGNMENT = 32
"""CUDA memory-efficient attention pads its log-sum-exp to a multiple of 32 queries (and wants its bias rows
aligned): the blocked attention uses it only for query chunks that are such a multiple."""


def attention_lse_kernel(device: torch.device, dtype: torch.dtype, head_dim: int, chunk: int) -> str | None:
    """The SDPA kernel with a log-sum-exp that runs ``dtype`` attention of ``chunk``-query blocks on ``device``:
    ``"cpu"`` (``_scaled_dot_product_flash_attention_for_cpu``: any float dtype, masks, grouped-query heads),
    ``"cuda"`` (CUDA flash attention for unmasked / causal fp16 and bf16 blocks on sm80+, memory-efficient
    attention for the rest: fp32, masked blocks), or None where neither exists (the caller keeps the mask
    path)."""
    if not dtype.is_floating_point or head_dim <= 0:
        return None
    if device.type == "cpu":
        return "cpu" if hasattr(_aten, "_scaled_dot_product_flash_attention_for_cpu") else None
    if device.type == "cuda":
        ok = hasattr(_aten, "_scaled_dot_product_efficient_attention") and dtype in (
            torch.float32,
            torch.float16,
            torch.bfloat16,
        )
        return "cuda" if ok and chunk % EFFICIENT_ALIGNMENT == 0 and head_dim % 8 == 0 else None
    return None


def _cuda_flash(q: torch.Tensor, mask: torch.Tensor | None) -> bool:
    """Whether a CUDA block runs flash attention (half dtypes, no mask, head dim <= 256, sm80+), not the
    memory-efficient kernel."""
    return (
        mask is None
        and q.dtype in (torch.float16, torch.bfloat16)
        and q.shape[-1] <= 256
        and torch.cuda.get_device_capability(q.device) >= (8, 0)
    )


def _repeat_heads(t: torch.Tensor, heads: int) -> torch.Tensor:
    """K or V ``[b, kv heads, L, d]`` repeated to ``heads`` (the memory-efficient kernel has no grouped-query
    attention): each K/V head serves ``heads / kv heads`` consecutive query heads."""
    return t if t.shape[1] == heads else t.repeat_interleave(heads // t.shape[1], dim=1)


def _grouped_sum(grad: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """A gradient at the query heads summed back onto ``kv_heads`` (the inverse of :func:`_repeat_heads`)."""
    b, heads, length, d = grad.shape
    if heads == kv_heads:
        return grad
    return grad.view(b, kv_heads, heads // kv_heads, length, d).sum(2)


def attention_block_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    mask: torch.Tensor | None,
    scale: float | None,
) -> tuple[torch.Tensor, torch.Tensor, tuple[Any, ...]]:
    """One block of attention without autograd: the output ``[b, heads, L, d]``, the log-sum-exp ``[b, heads,
    L]`` (float32; for float64 inputs float64) and what the kernel's backward needs besides (opaque).
    ``mask``: additive ``[1, 1, L, keys]`` or None; ``causal``: top-left causal (the diagonal block)."""
    if q.device.type == "cpu":
        out, lse = _aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, attn_mask=mask, scale=scale
        )
        return out, lse, ("cpu",)
    if _cuda_flash(q, mask):
        out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = _aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, causal, False, scale=scale
        )
        return out, lse, ("flash", cum_q, cum_k, max_q, max_k, seed, offset)
    heads, length = q.shape[1], q.shape[2]
    bias = None if mask is None else mask.expand(q.shape[0], heads, length, k.shape[2])
    out, lse, seed, offset = _aten._scaled_dot_product_efficient_attention(
        q, _repeat_heads(k, heads), _repeat_heads(v, heads), bias, True, 0.0, causal, scale=scale
    )
    return out, lse[..., :length], ("efficient", seed, offset)


def attention_block_backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    state: tuple[Any, ...],
    *,
    causal: bool,
    mask: torch.Tensor | None,
    scale: float | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of one block (q, k, v as given to :func:`attention_block_forward`, K/V at their own heads)
    from the *merged* output and log-sum-exp of every block the queries attend to: the softmax over all
    keys restricted to this block's, so that the blocks' gradients sum to one kernel's over all keys."""
    kind = state[0]
    if kind == "cpu":
        return _aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, q, k, v, out, lse, 0.0, causal, attn_mask=mask, scale=scale
        )
    if kind == "flash":
        _, cum_q, cum_k, max_q, max_k, seed, offset = state
        dq, dk, dv = _aten._scaled_dot_product_flash_attention_backward(
            grad_out, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, 0.0, causal, seed, offset, scale=scale
        )
        return dq, dk, dv
    _, seed, offset = state
    heads, kv_heads = q.shape[1], k.shape[1]
    bias = None if mask is None else mask.expand(q.shape[0], heads, q.shape[2], k.shape[2])
    dq, dk, dv, _ = _aten._scaled_dot_product_efficient_attention_backward(
        grad_out,
        q,
        _repeat_heads(k, heads),
        _repeat_heads(v, heads),
        bias,
        out,
        lse.contiguous(),
        seed,
        offset,
        0.0,
        [True, True, True, False],
        causal,
        scale=scale,
    )
    return dq, _grouped_sum(dk, kv_heads), _grouped_sum(dv, kv_heads)
