"""Run a plan's pipeline stages: this rank's part of an HF causal LM under a ``torch.distributed.pipelining``
schedule.

Why torch's pipelining: its schedules (GPipe, 1F1B, interleaved 1F1B, the zero-bubble ones that split backward
into input and weight gradients) are the ones torchtitan runs and the planner prices; the runtime only decides
what a stage is and what the loss is.

What a stage is. The HF model's own modules and its own forward: a stage is a shallow copy of the model (its
top module and its base model — new containers, the same submodules) whose block list holds only the stage's
blocks and whose other stages' modules are swapped for stand-ins. The first stage runs ``model(input_ids=...)``;
a later one runs it with ``inputs_embeds=`` the hidden states it received, so the model's forward computes the
position ids, the causal mask and the rotary tables on every stage exactly as in one process, then runs the
stage's blocks. Learned position embeddings (GPT-2's ``wpe``) and the embedding dropout belong to the first
stage: a later stage's copy adds zeros and skips the dropout. The final norm belongs to the last stage (the
identity elsewhere), whose copy of the full model returns the logits; the others return the hidden states.

What a rank holds. The model is cut in place to this rank's stages: its block list keeps only their blocks
(under their own indices, so parameter names are the full model's), the embedding and head of stages held
elsewhere become stand-ins without parameters. ``model.parameters()`` is this rank's part; an optimizer made
from it trains it. A model built on ``meta`` is materialised for this rank's modules only: the other stages'
tensors are drawn one module at a time (the init's RNG sequence, so each kept value is the whole model's) and
left on meta (:func:`.materialize.materialize_meta_model`, ``keep``). A real model starts from rank 0's values
(broadcast to every rank before the cut). With ``pretrained=`` a checkpoint's tensors are read instead, this
rank's stages' only (:func:`.pretrained.load_pretrained`, ``keep``: on ``meta`` nothing else is allocated;
the whole model's keys are checked against the checkpoint first).

What the model does then (:mod:`.pipeline_runner`): its forward is the pipeline's. A training forward runs
the schedule (forwards and backwards of every micro-batch) and returns a loss whose backward applies the
step's gradients, so the user's loop runs unchanged; an evaluation forward runs the stages forward only and
returns the logits on every rank. Data parallelism inside a stage is DDP over the mesh's ``dp`` axis (each
replica a whole pipeline; gradients summed over it, the loss normalised by the global batch's tokens).
``save_pretrained`` writes every stage from rank 0 (:mod:`.pipeline_save`).

Training-state checkpoints (DCP: ``accelerator.save_state``, the Trainer's, ``save_checkpoint``) are written
per stage and read under any plan (:mod:`.pipeline_checkpoint`).

Not yet: tensor parallelism, FSDP or recompute inside a stage, full state dicts (refused by name).
"""

from __future__ import annotations

import copy
import functools
import logging
import os
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from .._torch_compat import tensor_is_view
from ..pipeline_layout import PipelineLayout, PipelineLayoutError, find_layout
from ..plan import Plan
from .agree import DEFAULT_TIMEOUT_S, as_timedelta, raise_if_any_rank_failed, set_timeout
from .materialize import is_meta_model, materialize_meta_model
from .pipeline_runner import _SCHEDULES, BATCH_KEYS, PipelineRunner, PipelineRuntimeError, _split_batch
from .pipeline_save import install_pipeline_save, record_saved_names

__all__ = [
    "BATCH_KEYS",
    "PipelineRunner",
    "PipelineRuntimeError",
    "StageModule",
    "_SCHEDULES",
    "_split_batch",
    "apply_pipeline_plan",
    "check_pipeline_plan",
    "pipeline_runner",
]

logger = logging.getLogger(__name__)

_PIPELINE = "_hf_colossal_auto_pipeline"
"""Attribute of a model cut into pipeline stages: its :class:`PipelineRunner`."""


# --------------------------------------------------------------------------------------------- stand-ins
class _HeldElsewhere(nn.Module):
    """Stands for a module of another stage: it has no parameters, and running it is a bug that names it."""

    def __init__(self, fqn: str):
        super().__init__()
        self.fqn = fqn

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise PipelineRuntimeError(
            f"{self.fqn} belongs to another pipeline stage; this rank does not hold it"
        )


class _ZeroPositions(nn.Module):
    """A later stage's learned position embedding: the first stage already added the positions to the hidden
    states it sent, so this adds zeros (``x + 0 == x`` exactly)."""

    def __init__(self, dim: int, dtype: torch.dtype):
        super().__init__()
        self.dim, self.dtype = dim, dtype

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        return torch.zeros(*positions.shape, self.dim, dtype=self.dtype, device=positions.device)


def _blocks_subset(blocks: nn.ModuleList, indices: range | list[int]) -> nn.ModuleList:
    """A new block list holding ``blocks[i]`` for ``i`` in ``indices`` under their own keys (``"3"``), so that
    parameter names stay the full model's; iterating and slicing it (the model's forward) sees only them."""
    subset = nn.ModuleList()
    for i in indices:
        subset._modules[str(i)] = blocks[i]
    return subset


def _shallow(module: nn.Module) -> nn.Module:
    """A copy of ``module`` sharing its submodules, parameters and code, with its own child container."""
    clone = copy.copy(module)
    clone._modules = dict(module._modules)
    return clone


def _set_child(root: nn.Module, fqn: str, child: nn.Module) -> None:
    parent, _, name = fqn.rpartition(".")
    root.get_submodule(parent)._modules[name] = child


def _stage_config(config: Any, blocks: range, num_blocks: int) -> Any:
    """The config a stage's copy of the base model reads: per-layer entries (``layer_types``, indexed by the
    position in the block list the forward iterates) re-indexed to the stage's blocks."""
    layer_types = getattr(config, "layer_types", None)
    if not isinstance(layer_types, (list, tuple)) or len(layer_types) != num_blocks:
        return config
    config = copy.copy(config)
    config.layer_types = [layer_types[i] for i in blocks]
    return config


class StageModule(nn.Module):
    """One pipeline stage: the model's own forward over the stage's modules (see the module docstring).

    ``forward(x, **per_token)``: ``x`` is the input ids on the first stage, the previous stage's hidden states
    on the others; it returns the hidden states, or the logits on the last stage."""

    def __init__(self, model: nn.Module, layout: PipelineLayout, index: int, stages: int, blocks: range):
        super().__init__()
        self.index, self.is_first, self.is_last = index, index == 0, index == stages - 1
        base = _shallow(model.get_submodule(layout.base))
        base._modules[layout.blocks.rpartition(".")[2]] = _blocks_subset(
            model.get_submodule(layout.blocks), blocks
        )
        base.config = _stage_config(base.config, blocks, layout.num_blocks)
        rel = len(layout.base) + 1  # FQNs below relative to the base model
        if not self.is_first:
            for fqn in layout.before:
                original = model.get_submodule(fqn)
                if fqn == layout.embedding:  # skipped: the stage passes inputs_embeds
                    _set_child(base, fqn[rel:], _HeldElsewhere(fqn))
                else:
                    _set_child(base, fqn[rel:], _ZeroPositions(original.embedding_dim, original.weight.dtype))
            for fqn in layout.dropouts:
                _set_child(base, fqn[rel:], nn.Identity())
        if not self.is_last:
            for fqn in layout.after[:-1]:  # the final norm(s); the head is not called on this stage
                _set_child(base, fqn[rel:], nn.Identity())
            self.root = base
        else:
            root = _shallow(model)
            root._modules[layout.base] = base
            self.root = root

    def forward(self, x: torch.Tensor, **per_token: torch.Tensor) -> torch.Tensor:
        inputs = {"input_ids": x} if self.is_first else {"inputs_embeds": x}
        out = self.root(**inputs, **per_token, use_cache=False)
        if self.is_last:
            return out.logits
        hidden = out.last_hidden_state
        # a view (GPT-2 reshapes its output) cannot be detached in place, as torch's stages do after backward
        return hidden.clone() if tensor_is_view(hidden) else hidden


# --------------------------------------------------------------------------------------------- the cut
def _held_modules(plan: Plan, rank: int) -> tuple[list[int], set[str]]:
    """This pp rank's stage indices and the FQNs of the modules they hold."""
    ranks = plan.stage_ranks()
    mine = [s for s, r in enumerate(ranks) if r == rank]
    return mine, {fqn for s in mine for fqn in plan.stages[s]}


def _keeps(held: set[str], shared: tuple[str, ...]) -> Any:
    """Whether a parameter or buffer FQN belongs to this rank: under a held module or a module every stage
    runs (rotary embeddings)."""
    prefixes = tuple(f"{m}." for m in (*held, *shared))
    return lambda fqn: fqn.startswith(prefixes)


def _broadcast_real_model(model: nn.Module) -> None:
    """Every rank (every stage, every data-parallel replica) starts from rank 0's values, as the runtime's
    other paths scatter rank 0's."""
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            dist.broadcast(tensor.data, src=0)


def _cut_model(model: nn.Module, layout: PipelineLayout, blocks: list[int], held: set[str]) -> None:
    """Cut ``model`` in place to this rank's part: the block list keeps ``blocks`` (their own keys), modules
    before and after the blocks that this rank does not hold become parameter-less stand-ins."""
    _set_child(model, layout.blocks, _blocks_subset(model.get_submodule(layout.blocks), blocks))
    for fqn in (*layout.before, *layout.after):
        if fqn not in held:
            _set_child(model, fqn, _HeldElsewhere(fqn))


def _tied_parameters(model: nn.Module, layout: PipelineLayout) -> list[nn.Parameter]:
    """Head parameters that are the embedding's own (tied word embeddings)."""
    embedding = {id(p) for p in model.get_submodule(layout.embedding).parameters()}
    return [p for p in model.get_submodule(layout.head).parameters() if id(p) in embedding]


def _device(mesh: DeviceMesh) -> torch.device:
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)


def check_pipeline_plan(model: nn.Module, plan: Plan) -> PipelineLayout:
    """The model's layout, after checking that the plan's stages cut it whole and that the runtime runs the
    plan (pp x DDP, no tensor parallelism, no FSDP inside a stage, no recompute for now). Raises
    :class:`PipelineLayoutError` or :class:`PipelineRuntimeError`."""
    if plan.tp_size > 1:
        raise PipelineRuntimeError(
            f"the plan runs pipeline stages with tp={plan.tp_size}; the pipeline runtime runs no tensor "
            "parallelism inside a stage yet. Plan with mesh (pp, dp, 1), or without pipeline stages."
        )
    if plan.dp_size > 1 and plan.dp_mode != "ddp":
        raise PipelineRuntimeError(
            f"the plan runs pipeline stages with dp_mode {plan.dp_mode!r}; inside a stage the pipeline runtime "
            "runs DDP only (FSDP/HSDP are not applied to a stage's blocks yet). Plan with dp_mode 'ddp', or "
            "without pipeline stages."
        )
    unsupported = [
        name
        for name, value in (
            ("recompute", any(option != "none" for option in plan.recompute.values())),
            ("expert_data_parallel", bool(plan.expert_data_parallel)),
        )
        if value
    ]
    if unsupported:
        raise PipelineRuntimeError(
            f"the plan runs pipeline stages with {', '.join(unsupported)}, which the pipeline runtime does not "
            "apply inside a stage yet; plan without them, or without pipeline stages"
        )
    layout = find_layout(model)
    layout.block_ranges(plan.stages)
    return layout


def apply_pipeline_plan(
    model: nn.Module,
    plan: Plan,
    mesh: DeviceMesh | None = None,
    optimizers: tuple[torch.optim.Optimizer, ...] | list[torch.optim.Optimizer] = (),
    *,
    timeout: float | timedelta | None = DEFAULT_TIMEOUT_S,
    pretrained: str | os.PathLike | None = None,
) -> nn.Module:
    """Cut ``model`` in place to this rank's pipeline stages and make its forward the pipeline's
    (:class:`.pipeline_runner.PipelineRunner`); :func:`.runtime.apply_plan` calls it for a plan with
    ``pp_size > 1``, with the same arguments. Collective over the job. The plan is checked against the model
    (names, shapes, world size, the stages' cut) on every rank first: each rank raises the same error, before
    anything is allocated."""
    from .runtime import _processes_are_real, _validate_on_every_rank, build_mesh

    world = dist.get_world_size() if dist.is_initialized() else None
    if world is None:
        raise PipelineRuntimeError(
            "a pipeline plan runs in a torch.distributed job (torchrun), one rank a stage"
        )
    _validate_on_every_rank(model, plan, world)
    if mesh is None:
        mesh = build_mesh(plan)
    if timeout is not None and _processes_are_real():
        set_timeout(timeout, (mesh.get_group(axis) for axis in range(mesh.ndim)))
    error: Exception | None = None
    layout: PipelineLayout | None = None
    try:
        layout = check_pipeline_plan(model, plan)
    except (PipelineLayoutError, PipelineRuntimeError) as exc:
        error = exc
    raise_if_any_rank_failed(error, what="checking the plan's pipeline stages against the model")
    assert layout is not None
    group = mesh.get_group("pp")
    rank = dist.get_rank(group)
    mine, held = _held_modules(plan, rank)
    ranges = layout.block_ranges(plan.stages)
    blocks = [i for s in mine for i in ranges[s]]
    device = _device(mesh)
    if pretrained is not None:  # this rank's stages' tensors only, read from the checkpoint's files
        from .pretrained import load_pretrained

        on_meta = is_meta_model(model)
        keep = _keeps(held, layout.shared)
        model._hf_colossal_auto_load_report = load_pretrained(model, pretrained, device=device, keep=keep)
        if not on_meta:
            model.to(device)
    elif is_meta_model(model):
        materialize_meta_model(model, device, keep=_keeps(held, layout.shared))
    else:
        _broadcast_real_model(model)
        model.to(device)
    tied = _tied_parameters(model, layout)  # after materialising: it makes new parameters
    tie_group = _tie_group(plan, mesh, bool(tied))
    holds_tie = 0 in mine or plan.num_stages - 1 in mine
    stages = [StageModule(model, layout, s, plan.num_stages, ranges[s]) for s in mine]
    record_saved_names(model)  # what save_pretrained writes, read off the whole model
    _cut_model(model, layout, blocks, held)
    dp_group = mesh.get_group("dp") if plan.dp_size > 1 else None
    runner = PipelineRunner(
        model, plan, layout, stages, group, device, tie_group, tied if holds_tie else [], dp_group
    )
    setattr(model, _PIPELINE, runner)
    _install_forward(model, runner)
    model._hf_colossal_auto_plan = plan
    model._hf_colossal_auto_mesh = mesh
    install_pipeline_save(model, as_timedelta(timeout or DEFAULT_TIMEOUT_S).total_seconds())
    kept = {id(p) for p in model.parameters()}
    for optimizer in optimizers:  # an optimizer made before: only this rank's parameters remain
        for param_group in optimizer.param_groups:
            param_group["params"] = [p for p in param_group["params"] if id(p) in kept]
    logger.info(
        "pipeline rank %d of %d (dp %d): stages %s (blocks %s), schedule %s, %d micro-batches",
        rank,
        plan.pp_size,
        plan.dp_size,
        mine,
        blocks,
        plan.schedule,
        plan.micro_batches,
    )
    return model


def _tie_group(plan: Plan, mesh: DeviceMesh, tied: bool) -> dist.ProcessGroup | None:
    """The ranks holding the first and the last stage of this rank's pipeline, when the head is tied to the
    embedding and they differ. One group per pipeline (every data-parallel replica has its own), each created
    on every rank in the same order, as ``new_group`` requires; None on the ranks outside this one's."""
    ranks = plan.stage_ranks()
    if not tied or ranks[0] == ranks[-1]:
        return None
    grid = mesh.mesh.reshape(plan.pp_size, -1)  # (pp, dp x tp): one column per pipeline
    mine = None
    for column in range(grid.shape[1]):
        members = sorted({int(grid[ranks[0], column]), int(grid[ranks[-1], column])})
        made = dist.new_group(members)
        if dist.get_rank() in members:
            mine = made
    return mine


def _install_forward(model: nn.Module, runner: PipelineRunner) -> None:
    """The model's forward becomes the pipeline's (its own would run only this rank's blocks): a plain
    function, as the runtime's other forward wrapper, so that accelerate's autocast wrapper (which re-binds a
    bound method's ``__func__`` to the model) wraps it intact. It carries the model's own signature
    (``functools.wraps``): the Trainer keeps the dataset columns the forward names."""

    @functools.wraps(model.forward)
    def forward(*args: Any, **kwargs: Any) -> Any:
        return runner.forward(*args, **kwargs)

    model.forward = forward


def pipeline_runner(model: nn.Module) -> PipelineRunner:
    """The :class:`.pipeline_runner.PipelineRunner` of a model a pipeline plan was applied to."""
    runner = getattr(model, _PIPELINE, None)
    if runner is None:
        raise PipelineRuntimeError(f"{type(model).__name__} has no pipeline plan applied")
    return runner


def is_pipelined(model: nn.Module) -> bool:
    """Whether a pipeline plan was applied to ``model`` (it holds only this rank's stages)."""
    return getattr(model, _PIPELINE, None) is not None


def refuse_if_pipelined(model: nn.Module, what: str, instead: str | None = None) -> None:
    """What a pipelined model cannot do (each rank holds only its stages), refused by name instead of taking one
    stage for the model; ``instead``: what to do (default: export with save_pretrained, checkpoint training
    state with save_state / save_checkpoint)."""
    if is_pipelined(model):
        raise PipelineRuntimeError(
            f"{what} of the pipelined {type(model).__name__} is not done per pipeline stage (each rank holds "
            "only its stages). "
            + (
                instead
                or "Export the model with save_pretrained / accelerator.save_model (every stage is written), and "
                "checkpoint training state with accelerator.save_state or save_checkpoint (each rank its stages)."
            )
        )
