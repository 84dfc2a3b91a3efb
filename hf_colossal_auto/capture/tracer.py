"""Record one training step at the aten level under fake tensors.

Why dispatch-level tracing and not ``torch.export``: export gives the forward graph only (backward and the
optimizer step are what dominate memory), inlines activation checkpointing, and costs seconds per large
model. A ``TorchDispatchMode`` stacked on ``FakeTensorMode`` sees every aten op of the *real* eager step —
forward, the autograd engine's backward and the optimizer's foreach kernels — with real shapes and dtypes
but no data, and costs about what a fake forward+backward costs. Storage lifetimes come from the Python
storage objects' finalizers (storages keep their Python object alive while any tensor uses them), so the
memory timeline is what autograd really keeps alive, not a guess from graph liveness.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from .. import _torch_compat
from .._torch_compat import (
    FakeTensorMode,
    swapped_parameters,
    tracked_module_name,
    tree_flatten,
)
from .attention import target_attention_kernels
from .blocks import find_block_runs, folded
from .graph import (
    BlockRun,
    MemoryEvent,
    OpNode,
    Phase,
    Segment,
    StepGraph,
    ValueKind,
)
from .hf_masks import eager_mask_decisions
from .inputs import CaptureError, drop_all_ones_masks, validate_inputs
from .moe import enable_grouped_mm_tracing, static_experts_implementation
from .recorder import _Recorder

logger = logging.getLogger(__name__)

MIXED_PRECISION_DTYPES = {None: None, "no": None, "fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def _fake_like(t: torch.Tensor) -> torch.Tensor:
    """A fake CPU tensor with ``t``'s metadata. Works for real, meta and fake sources alike."""
    return torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=t.dtype, device="cpu")


def _make_optimizer(name: str | None, params: list[torch.Tensor]) -> torch.optim.Optimizer | None:
    if name is None or name == "none":
        return None
    key = name.lower()
    if key == "adamw":
        return torch.optim.AdamW(params, lr=1e-4, foreach=True)
    if key == "adam":
        return torch.optim.Adam(params, lr=1e-4, foreach=True)
    if key == "sgd":
        return torch.optim.SGD(params, lr=1e-4, momentum=0.9, foreach=True)
    raise ValueError(f"Unknown optimizer {name!r}; use one of 'adamw', 'adam', 'sgd' or None.")


def _extract_loss(output: Any, model: nn.Module, inputs: Mapping[str, Any]) -> torch.Tensor:
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, Mapping):
        loss = output.get("loss")
    if loss is None and isinstance(output, tuple) and output and isinstance(output[0], torch.Tensor):
        loss = output[0] if output[0].dim() == 0 else None
    if loss is None and not isinstance(output, Mapping):  # a transformers model without labels: say so below
        loss = _outside_loss(output)
    if loss is None:
        raise CaptureError(
            f"{type(model).__name__} returned no loss for the example inputs (keys: {sorted(inputs)}). "
            "A training step needs one: pass `labels` in example_inputs (for causal LMs labels=input_ids)."
        )
    return loss


def _outside_loss(output: Any) -> torch.Tensor | None:
    """For a plain module whose loss the training loop computes from its outputs (``mse_loss(model(x), y)``,
    the first-call plan of a plain accelerate script; a transformers model's output without a loss means its
    labels are missing, which stays an error): the sum of its floating outputs that need gradients stands
    in for that loss. The backward is the model's (a gradient of the outputs' shape flows back through every
    op); the few element-wise ops of the real loss are left out."""
    leaves = [
        t
        for t in tree_flatten(output)[0]
        if isinstance(t, torch.Tensor) and t.is_floating_point() and t.requires_grad
    ]
    if not leaves:
        return None
    logger.info(
        "the model returned no loss: planning with the backward of its outputs (a loss taken outside)"
    )
    return sum((t.sum() for t in leaves[1:]), leaves[0].sum())


def _trace_once(
    model: nn.Module,
    inputs: Mapping[str, Any],
    *,
    autocast_dtype: torch.dtype | None,
    optimizer: str | None,
    device_kind: str = "cpu",
    held_inputs: Mapping[str, Any] | None = None,
) -> tuple[_Recorder, dict[str, int]]:
    """Trace one steady-state step of ``model`` (as it is now, maybe folded). Returns the recorder and the
    optimizer-state bytes per parameter FQN. ``held_inputs``: tensors of the batch the model is not given
    (masks that mask nothing) but that the caller's batch still holds through the step: memory, no ops."""
    rec = _Recorder()
    fake_mode = FakeTensorMode(allow_non_fake_inputs=False)
    root_name = type(model).__name__
    with fake_mode:
        params = {n: _fake_like(p).requires_grad_(p.requires_grad) for n, p in model.named_parameters()}
        buffers = {n: _fake_like(b) for n, b in model.named_buffers()}
        fake_inputs = {k: (_fake_like(v) if isinstance(v, torch.Tensor) else v) for k, v in inputs.items()}
        fake_held = {k: _fake_like(v) for k, v in (held_inputs or {}).items() if isinstance(v, torch.Tensor)}
        trainable = [p for p in params.values() if p.requires_grad]
        opt = _make_optimizer(optimizer, trainable)
        state_bytes = _steady_state_optimizer(rec, opt, trainable, params)
        _register_step_floor(rec, params, buffers, [*fake_inputs.items(), *fake_held.items()], opt)

        tracker = _torch_compat.ModTracker()  # imported on first use (see _torch_compat)
        _track_module_stack(rec, tracker, root_name)
        arg_hooks = _block_argument_hooks(rec, model)
        try:
            with tracker, rec:
                _record_step(
                    rec,
                    model,
                    inputs,
                    fake_inputs,
                    params,
                    buffers,
                    opt,
                    trainable,
                    autocast_dtype,
                    device_kind,
                )
        finally:
            rec.recording = False
            tracker.clear_user_hooks()
            for handle in arg_hooks:
                handle.remove()
    return rec, state_bytes


def _steady_state_optimizer(
    rec: _Recorder,
    opt: torch.optim.Optimizer | None,
    trainable: list[torch.Tensor],
    params: dict[str, torch.Tensor],
) -> dict[str, int]:
    """Steady state: the optimizer state exists before the step begins (one unrecorded step on zero gradients
    makes it). Returns its bytes per parameter FQN."""
    state_bytes: dict[str, int] = {}
    if opt is not None and trainable:
        # Steady state: the optimizer state exists before the step begins.
        for p in trainable:
            p.grad = torch.zeros_like(p)
        rec.scalar_stub = True
        rec.recording = False
        with rec:
            opt.step()
        rec.recording = True
        rec.scalar_stub = False  # only the optimizer's step counter; the model's .item() must fail
        for p in trainable:
            p.grad = None
        for n, p in params.items():
            st = opt.state.get(p, {})
            state_bytes[n] = sum(
                v.untyped_storage().nbytes() for v in st.values() if isinstance(v, torch.Tensor)
            )
    return state_bytes


def _register_step_floor(
    rec: _Recorder,
    params: dict[str, torch.Tensor],
    buffers: dict[str, torch.Tensor],
    inputs: list[tuple[str, Any]],
    opt: torch.optim.Optimizer | None,
) -> None:
    """Everything alive before the step (parameters, buffers, the batch, optimizer state) registered as the
    step's memory floor, parameters and optimizer state owned by their parameter's FQN."""
    # Everything alive now is the memory floor of the step.
    param_fqn = {}
    for n, p in params.items():
        rec.register(p, ValueKind.PARAM, n, initial=True)
        rec.set_owner(p, n)
        param_fqn[id(p)] = n
    for n, b in buffers.items():
        rec.register(b, ValueKind.BUFFER, n, initial=True)
    for k, v in inputs:
        if isinstance(v, torch.Tensor):
            rec.register(v, ValueKind.INPUT, k, initial=True)
    if opt is not None:
        for p, st in opt.state.items():
            n = param_fqn.get(id(p), "?")
            for key, v in st.items():
                if isinstance(v, torch.Tensor):
                    rec.register(v, ValueKind.OPTIMIZER_STATE, f"{n}.{key}", initial=True)
                    rec.set_owner(v, n)


def _track_module_stack(rec: _Recorder, tracker: Any, root_name: str) -> None:
    """ModTracker hooks that keep ``rec.module_stack`` the modules running now (forward and backward), named
    by FQN below the root model (``root_name``), so each recorded op knows its module.

    A module outside the model's tree is not pushed: its ops belong to the model's module that runs it. With
    the ``kernels`` package installed (transformers >= 5.25 requires it), ``@use_kernel_forward_from_hub``
    turns a function such as Llama's ``apply_rotary_pos_emb`` into one module object shared by every
    attention layer and called from their forwards; pushed, it named its ops after no module (the root), which
    split every block's ops in two and made identical blocks trace differently."""

    def _name(mod: nn.Module) -> str | None:
        full = tracked_module_name(tracker, mod)
        if full == root_name:
            return ""
        return full[len(root_name) + 1 :] if full.startswith(root_name + ".") else None

    def _push(mod, *_):
        if mod is None:  # a module built inside forward may be gone by backward
            return
        name = _name(mod)
        if name is not None:
            push_module(rec.module_stack, name, backward=rec.phase is Phase.BACKWARD)

    def _pop(mod, *_):
        if mod is None:
            return
        name = _name(mod)
        if name is None:
            return
        for i in range(len(rec.module_stack) - 1, -1, -1):
            if rec.module_stack[i] == name:
                del rec.module_stack[i]
                break

    tracker.register_user_hooks(_push, _pop, _push, _pop)


def _block_argument_hooks(rec: _Recorder, model: nn.Module) -> list[Any]:
    """Forward pre-hooks on every ``ModuleList`` child recording what each block is called with; the caller
    removes the returned handles."""
    # what each block is called with (keyword arguments included, which ModTracker's hooks do not see)
    return [
        child.register_forward_pre_hook(
            functools.partial(_record_block_args, rec, f"{name}.{key}"), with_kwargs=True
        )
        for name, mod in model.named_modules()
        if isinstance(mod, nn.ModuleList)
        for key, child in mod.named_children()
    ]


def _record_step(
    rec: _Recorder,
    model: nn.Module,
    inputs: Mapping[str, Any],
    fake_inputs: dict[str, Any],
    params: dict[str, torch.Tensor],
    buffers: dict[str, torch.Tensor],
    opt: torch.optim.Optimizer | None,
    trainable: list[torch.Tensor],
    autocast_dtype: torch.dtype | None,
    device_kind: str,
) -> None:
    """The recorded step, inside the recorder and the module tracker: forward (under autocast, the target's
    attention kernels and the model's eager mask decisions) and backward on the fake parameters, then the
    optimizer step."""
    rec.phase = Phase.FORWARD
    ctx = (
        torch.autocast("cpu", dtype=autocast_dtype)
        if autocast_dtype is not None
        else torch.autocast("cpu", enabled=False)
    )
    with swapped_parameters(model, {**params, **buffers}):
        with ctx, target_attention_kernels(device_kind), eager_mask_decisions(inputs):
            output = model(**fake_inputs)
        rec.output_values = rec.known_values(output)
        loss = _extract_loss(output, model, inputs)
        del output
        rec.phase = Phase.BACKWARD
        rec.module_stack.clear()
        loss.backward()  # inside the swap: a checkpointed block reruns its forward here
        del loss
    rec.module_stack.clear()
    _classify_grads(rec, params)
    if opt is not None and trainable:
        rec.phase = Phase.OPTIMIZER
        rec.scalar_stub = True
        opt.step()


def push_module(stack: list[str], name: str, *, backward: bool) -> None:
    """Enter module ``name``: the op nodes recorded next belong to the top of ``stack``.

    In backward, modules that return the same tensor (a model's head returning its last ``Linear``'s output,
    a block returning its last norm's) have their pre-backward hooks on that one tensor, and torch runs them
    in registration order: the innermost module, whose forward ended first, first. Pushed as they come, the
    outermost would own the ops — a decoder's two backward GEMMs recorded under the model's ``cls`` head,
    which has no forward op of its own to price them with. So in backward an ancestor of modules already on
    the stack goes beneath them: the ops belong to the innermost module running backward."""
    if not backward:
        stack.append(name)
        return
    at = len(stack)
    while at > 0 and _is_descendant(stack[at - 1], name):
        at -= 1
    stack.insert(at, name)


def _is_descendant(module: str, ancestor: str) -> bool:
    """``module`` lies strictly inside ``ancestor`` (``""`` is the root, an ancestor of every module)."""
    return module != ancestor and (ancestor == "" or module.startswith(ancestor + "."))


def _record_block_args(rec: _Recorder, fqn: str, module: nn.Module, args: Any, kwargs: Any) -> None:
    """Forward pre-hook of a ``ModuleList`` child: the storages of its tensor arguments, on its first call in
    forward (a recomputed block is called again in backward)."""
    if rec.phase is not Phase.FORWARD or fqn in rec.block_args:
        return
    found = []
    for t in tree_flatten((args, kwargs))[0]:
        if isinstance(t, torch.Tensor):
            sid = rec._storage_ids.get(t.untyped_storage())
            if sid is not None and sid not in found:
                found.append(sid)
    rec.block_args[fqn] = found


def _classify_grads(rec: _Recorder, params: dict[str, torch.Tensor]) -> None:
    for n, p in params.items():
        if p.grad is not None:
            sid = rec._storage_ids.get(p.grad.untyped_storage())
            if sid is not None:
                rec.storages[sid].kind = ValueKind.GRAD
                rec.storages[sid].name = f"{n}.grad"
                rec.storages[sid].owner = n


def _segments(nodes: list[OpNode], block: str) -> dict[Phase, Segment] | None:
    """Contiguous forward/backward node ranges of one block, or None when its ops are not contiguous."""
    result: dict[Phase, Segment] = {}
    prefix = block + "."
    for phase in (Phase.FORWARD, Phase.BACKWARD):
        idx = [
            n.index for n in nodes if n.phase is phase and (n.module == block or n.module.startswith(prefix))
        ]
        if not idx:
            continue
        if idx[-1] - idx[0] + 1 != len(idx):
            return None
        result[phase] = Segment(idx[0], idx[-1] + 1)
    return result


def _segment_signature(rec: _Recorder, seg: Segment) -> tuple:
    ops = tuple(n.op for n in rec.nodes[seg.start : seg.end])
    deltas = tuple((e.slot - seg.start, e.delta) for e in rec.events if seg.start <= e.slot < seg.end)
    return ops, deltas


def _verify_folding(rec: _Recorder, runs: list[BlockRun]) -> dict[str, dict[Phase, Segment]] | None:
    """Check that the two middle traced copies of each run behaved identically; return every block's segments."""
    segments: dict[str, dict[Phase, Segment]] = {}
    for run in runs:
        segs = [_segments(rec.nodes, b) for b in run.traced]
        if any(s is None for s in segs):
            return None
        first, rep = segs[-3], segs[-2]
        if set(first) != set(rep) or Phase.FORWARD not in rep:
            return None
        for phase in rep:
            if _segment_signature(rec, first[phase]) != _segment_signature(rec, rep[phase]):
                return None
        for b, s in zip(run.traced, segs, strict=True):
            segments[b] = s
    return segments


def trace_training_step(
    model: nn.Module,
    example_inputs: Mapping[str, Any],
    *,
    mixed_precision: str | None = None,
    optimizer: str | None = "adamw",
    fold_blocks: bool = True,
    device_kind: str = "cpu",
) -> StepGraph:
    """Record one steady-state training step of ``model`` on ``example_inputs`` without real compute.

    The model may live on ``meta``, on CPU or anywhere else: only parameter metadata is read. The step is
    forward (under autocast when ``mixed_precision`` is ``"bf16"``/``"fp16"``), backward of ``output.loss``,
    and ``optimizer.step()`` with the optimizer state already allocated. ``device_kind`` ("cpu" or "cuda")
    selects which device's attention kernels are traced (see :mod:`hf_colossal_auto.capture.attention`).
    """
    if mixed_precision not in MIXED_PRECISION_DTYPES:
        raise ValueError(
            f"Unknown mixed_precision {mixed_precision!r}; use one of {sorted(k for k in MIXED_PRECISION_DTYPES if k)}"
            " or None."
        )
    if optimizer not in (None, "none") and (
        not isinstance(optimizer, str) or optimizer.lower() not in ("adamw", "adam", "sgd")
    ):  # checked here: inside the trace it would surface as a CaptureError about the inputs
        raise ValueError(f"Unknown optimizer {optimizer!r}; use one of 'adamw', 'adam', 'sgd' or None.")
    autocast_dtype = MIXED_PRECISION_DTYPES[mixed_precision]
    validate_inputs(model, example_inputs)
    all_inputs = example_inputs
    example_inputs = drop_all_ones_masks(example_inputs)
    # A dropped mask changes what the model runs, not what exists: the caller's batch holds it all step long.
    held = {k: v for k, v in all_inputs.items() if k not in example_inputs}
    runs = find_block_runs(model) if fold_blocks else []
    segments: dict[str, dict[Phase, Segment]] = {}
    rec: _Recorder | None = None
    if runs:
        with folded(model, runs):
            rec, state_bytes = _run_capture(
                model, example_inputs, autocast_dtype, optimizer, device_kind, held
            )
        verified = _verify_folding(rec, runs)
        if verified is None:
            logger.info(
                "%s: repeated blocks did not trace identically; profiling every block instead",
                type(model).__name__,
            )
            runs, rec = [], None
        else:
            segments = verified
    if rec is None:
        rec, state_bytes = _run_capture(model, example_inputs, autocast_dtype, optimizer, device_kind, held)

    return _assemble(model, rec, state_bytes, runs, segments, mixed_precision, optimizer, all_inputs)


def _frees_in_storage_order(events: list[MemoryEvent]) -> list[MemoryEvent]:
    """``events`` with each run of consecutive frees at one position sorted by storage id. Frees arrive from
    weakref finalizers in the order the garbage collector drops the storages, which can differ between two
    traces of the same step (a tuple of tensors freed at once); frees that happen together commute, so the
    sorted order is as true and makes the recorded step deterministic (what ``capture.batch_rows`` compares)."""
    out: list[MemoryEvent] = []
    run: list[MemoryEvent] = []
    for e in events:
        if run and (e.delta > 0 or e.position != run[0].position):
            out.extend(sorted(run, key=lambda f: f.storage_id))
            run = []
        (run if e.delta < 0 else out).append(e)
    out.extend(sorted(run, key=lambda f: f.storage_id))
    return out


def _run_capture(model, inputs, autocast_dtype, optimizer, device_kind="cpu", held=None):
    enable_grouped_mm_tracing()  # MoE experts: see capture/moe.py
    try:
        with static_experts_implementation(model):
            return _trace_once(
                model,
                inputs,
                autocast_dtype=autocast_dtype,
                optimizer=optimizer,
                device_kind=device_kind,
                held_inputs=held,
            )
    except CaptureError:
        raise
    except Exception as exc:  # the user's model failed under fake tensors: say where and what to try
        raise CaptureError.from_exception(model, exc) from exc


def _assemble(
    model: nn.Module,
    rec: _Recorder,
    traced_state_bytes: dict[str, int],
    runs: list[BlockRun],
    segments: dict[str, dict[Phase, Segment]],
    mixed_precision: str | None,
    optimizer: str | None,
    inputs: Mapping[str, Any],
) -> StepGraph:
    all_params = dict(model.named_parameters())
    param_bytes = {n: p.numel() * p.element_size() for n, p in all_params.items()}
    param_shapes = {n: tuple(p.shape) for n, p in all_params.items()}
    # Optimizer state of folded blocks mirrors the representative's, parameter by parameter.
    state_bytes: dict[str, int] = {}
    rep_of: dict[str, str] = {}
    for run in runs:
        for b in run.all_blocks[len(run.traced) :]:
            rep_of[b] = run.representative
    for n in all_params:
        if n in traced_state_bytes:
            state_bytes[n] = traced_state_bytes[n]
            continue
        for b, rep in rep_of.items():
            if n.startswith(b + "."):
                state_bytes[n] = traced_state_bytes.get(rep + n[len(b) :], 0)
                break
        else:
            state_bytes[n] = 0
    buffer_bytes = sum(b.numel() * b.element_size() for b in model.buffers())
    input_bytes = sum(v.numel() * v.element_size() for v in inputs.values() if isinstance(v, torch.Tensor))
    return StepGraph(
        model_class=type(model).__name__,
        nodes=rec.nodes,
        values=rec.values,
        storages=rec.storages,
        initial_storages=rec.initial,
        memory_events=_frees_in_storage_order(rec.events),
        param_names=list(all_params),
        param_bytes=param_bytes,
        param_shapes=param_shapes,
        optimizer_state_bytes=state_bytes,
        buffer_bytes=buffer_bytes,
        input_bytes=input_bytes,
        block_runs=runs,
        block_segments=segments,
        mixed_precision=mixed_precision,
        optimizer=optimizer,
        output_values=list(rec.output_values),
        block_args=dict(rec.block_args),
        frozen_params=frozenset(n for n, p in all_params.items() if not p.requires_grad),
        module_types={name: type(module).__name__ for name, module in model.named_modules()},
    )
