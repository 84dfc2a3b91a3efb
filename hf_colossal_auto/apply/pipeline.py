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
(broadcast over the pipeline group before the cut).

The loss. The last stage computes the model's own loss function (transformers' ``ForCausalLMLoss``: labels
shifted inside, -100 ignored) per micro-batch as a sum over its tokens divided by the token count of the whole
batch (``num_items_in_batch``), and the schedule does not rescale (``scale_grads=False``): the micro-batch
losses add up to one process's mean loss over the batch, and so do the gradients. An embedding tied to the
head on another rank has its two gradient halves summed after each step.

Not yet: tensor or data parallelism inside a stage (a pipeline plan must have dp = tp = 1), recompute, a
forward-only schedule for evaluation, and the user's loop unchanged (train with :meth:`PipelineRunner.step`).
"""

from __future__ import annotations

import copy
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from .._torch_compat import tensor_is_view
from ..pipeline_layout import PipelineLayout, PipelineLayoutError, find_layout
from ..plan import Plan
from .agree import DEFAULT_TIMEOUT_S, raise_if_any_rank_failed, set_timeout
from .materialize import is_meta_model, materialize_meta_model

logger = logging.getLogger(__name__)

IGNORE_INDEX = -100
"""Label value transformers' causal-LM loss ignores."""

BATCH_KEYS = frozenset({"input_ids", "labels", "attention_mask", "position_ids"})
"""What a pipelined step reads from a batch: ``input_ids`` (first stage), ``labels`` (last stage), and the
per-token inputs every stage's copy of the model needs."""

_PIPELINE = "_hf_colossal_auto_pipeline"
"""Attribute of a model cut into pipeline stages: its :class:`PipelineRunner`."""


class PipelineRuntimeError(RuntimeError):
    """A pipelined model was asked for something the pipeline runtime does not run."""


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


def _broadcast_real_model(model: nn.Module, group: dist.ProcessGroup, src: int) -> None:
    """Every rank starts from rank ``src``'s values, as the runtime's other paths scatter rank 0's."""
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            dist.broadcast(tensor.data, src=src, group=group)


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


# --------------------------------------------------------------------------------------------- the runner
@dataclass
class _Built:
    """The torch pipeline objects for one micro-batch shape (torch infers the shapes sent between stages on
    the first step, so a new shape needs new ones)."""

    key: tuple
    schedule: Any


class PipelineRunner:
    """This rank's stages of a pipelined model and the schedule that trains them.

    ``step(batch)`` runs one training step's forwards and backwards over the plan's micro-batches and returns
    the batch's loss (the mean over its label tokens, as one process computes it) on every rank; the
    gradients are in this rank's parameters, for the optimizer to step."""

    def __init__(
        self,
        model: nn.Module,
        plan: Plan,
        layout: PipelineLayout,
        stages: list[StageModule],
        group: dist.ProcessGroup,
        device: torch.device,
        tie_group: dist.ProcessGroup | None,
        tied: list[nn.Parameter],
    ):
        self.model, self.plan, self.layout, self.stages = model, plan, layout, stages
        self.group, self.device = group, device
        self.tie_group, self.tied = tie_group, tied
        ranks = plan.stage_ranks()
        self.last_rank = dist.get_global_rank(group, ranks[-1])
        self.holds_first = any(s.is_first for s in stages)
        self.holds_last = any(s.is_last for s in stages)
        self._built: _Built | None = None

    def _schedule(self, rows: int, seq: int, kwargs: dict[str, torch.Tensor]) -> Any:
        key = (rows, seq, tuple(sorted((k, tuple(v.shape)) for k, v in kwargs.items())))
        if self._built is None or self._built.key != key:
            self._built = _Built(key, _make_schedule(self, self.plan))
        return self._built.schedule

    def step(self, batch: Mapping[str, Any]) -> torch.Tensor:
        """One training step of the pipeline on ``batch`` (the whole batch, the same on every rank of the
        pipeline: the first stage reads its ``input_ids``, the last its ``labels``). Returns the loss on every
        rank; gradients accumulate into this rank's parameters."""
        input_ids, labels, kwargs = _split_batch(batch, self.plan.micro_batches, self.device)
        schedule = self._schedule(input_ids.shape[0], input_ids.shape[-1], kwargs)
        args = (input_ids,) if self.holds_first else ()
        losses: list[torch.Tensor] | None = [] if self.holds_last else None
        count = (labels[..., 1:] != IGNORE_INDEX).sum()
        schedule.step(
            *args,
            target=labels if self.holds_last else None,
            losses=losses,
            return_outputs=False,
            loss_kwargs={"num_items_in_batch": count},
            **kwargs,
        )
        self._sum_tied_gradients()
        loss = torch.stack(losses).sum().detach() if losses else torch.zeros((), device=self.device)
        dist.broadcast(loss, src=self.last_rank, group=self.group)
        return loss

    def _sum_tied_gradients(self) -> None:
        """An embedding tied to the head on another rank: each rank's copy got its own stage's part of the
        gradient; both need the sum."""
        if self.tie_group is None:
            return
        for param in self.tied:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            dist.all_reduce(param.grad, group=self.tie_group)


def _split_batch(
    batch: Mapping[str, Any], micro_batches: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """``input_ids``, ``labels`` and the per-token keyword inputs of ``batch``, on ``device``; refuses what the
    pipelined step cannot honour."""
    unknown = sorted(set(batch) - BATCH_KEYS)
    if unknown:
        raise PipelineRuntimeError(
            f"a pipelined step reads {sorted(BATCH_KEYS)} from the batch; it got {unknown} too, which the stages "
            "would not see. Drop them from the batch, or train without pipeline stages."
        )
    if "input_ids" not in batch or "labels" not in batch:
        raise PipelineRuntimeError(
            "a pipelined training step needs input_ids and labels in the batch (the last stage computes the loss)"
        )
    tensors = {k: v.to(device) for k, v in batch.items()}
    rows = tensors["input_ids"].shape[0]
    if rows < micro_batches:
        raise PipelineRuntimeError(
            f"the batch has {rows} rows, fewer than the plan's {micro_batches} micro-batches; the schedule runs "
            "at least one row per micro-batch"
        )
    for key, value in tensors.items():
        if value.shape[0] != rows:
            raise PipelineRuntimeError(
                f"batch[{key!r}] has {value.shape[0]} rows and input_ids {rows}: every input is cut into "
                "micro-batches along its first dim"
            )
    kwargs = {k: v for k, v in tensors.items() if k not in ("input_ids", "labels")}
    return tensors["input_ids"], tensors["labels"], kwargs


_SCHEDULES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved-1f1b": "ScheduleInterleaved1F1B",
    "interleaved-zero-bubble": "ScheduleInterleavedZeroBubble",
    "zbv": "ScheduleZBVZeroBubble",
}
"""The plan's schedule names -> torch.distributed.pipelining's classes."""


def _make_schedule(runner: PipelineRunner, plan: Plan) -> Any:
    """torch's ``PipelineStage`` per held stage and the plan's schedule over them (the loss: the model's own,
    normalised by the whole batch's tokens through ``num_items_in_batch``; no rescaling by the schedule)."""
    from torch.distributed import pipelining

    stages = [
        pipelining.PipelineStage(s, s.index, plan.num_stages, runner.device, group=runner.group)
        for s in runner.stages
    ]
    cls = getattr(pipelining, _SCHEDULES[plan.schedule])
    model, vocab = runner.model, runner.model.config.vocab_size

    def loss_fn(logits: torch.Tensor, labels: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        return model.loss_function(logits=logits, labels=labels, vocab_size=vocab, **kwargs)

    held = stages[0] if plan.virtual_stages == 1 else stages
    return cls(held, n_microbatches=plan.micro_batches, loss_fn=loss_fn, scale_grads=False)


def _device(mesh: DeviceMesh) -> torch.device:
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)


def check_pipeline_plan(model: nn.Module, plan: Plan) -> PipelineLayout:
    """The model's layout, after checking that the plan's stages cut it whole and that the runtime runs the
    plan (pp with dp = tp = 1 for now). Raises :class:`PipelineLayoutError` or :class:`PipelineRuntimeError`."""
    if plan.dp_size > 1 or plan.tp_size > 1:
        raise PipelineRuntimeError(
            f"the plan runs pipeline stages with dp={plan.dp_size} and tp={plan.tp_size}; the pipeline runtime "
            "runs dp = tp = 1 for now. Plan with the pipeline alone (mesh (pp, 1, 1)) or without it."
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
    """Cut ``model`` in place to this rank's pipeline stages and attach the :class:`PipelineRunner` that trains
    them (:func:`pipeline_runner`); :func:`.runtime.apply_plan` calls it for a plan with ``pp_size > 1``, with
    the same arguments. Collective over the job. The plan is checked against the model (names, shapes, world
    size, the stages' cut) on every rank first: each rank raises the same error, before anything is
    allocated."""
    from .runtime import _processes_are_real, _validate_on_every_rank, build_mesh

    if pretrained is not None:
        raise PipelineRuntimeError(
            "pretrained= is not run under pipeline stages yet: apply the plan to a model built with its weights "
            "(from_pretrained on one device), or plan without pipeline stages"
        )
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
    if is_meta_model(model):
        materialize_meta_model(model, _device(mesh), keep=_keeps(held, layout.shared))
    else:
        _broadcast_real_model(model, group, src=dist.get_global_rank(group, 0))
        model.to(_device(mesh))
    tied = _tied_parameters(model, layout)  # after materialising: it makes new parameters
    tie_group = _tie_group(plan, group, bool(tied))
    holds_tie = 0 in mine or plan.num_stages - 1 in mine
    stages = [StageModule(model, layout, s, plan.num_stages, ranges[s]) for s in mine]
    _cut_model(model, layout, blocks, held)
    runner = PipelineRunner(
        model, plan, layout, stages, group, _device(mesh), tie_group, tied if holds_tie else []
    )
    setattr(model, _PIPELINE, runner)
    _refuse_direct_forward(model)
    kept = {id(p) for p in model.parameters()}
    for optimizer in optimizers:  # an optimizer made before: only this rank's parameters remain
        for param_group in optimizer.param_groups:
            param_group["params"] = [p for p in param_group["params"] if id(p) in kept]
    logger.info(
        "pipeline rank %d of %d: stages %s (blocks %s), schedule %s, %d micro-batches",
        rank,
        plan.pp_size,
        mine,
        blocks,
        plan.schedule,
        plan.micro_batches,
    )
    return model


def _tie_group(plan: Plan, group: dist.ProcessGroup, tied: bool) -> dist.ProcessGroup | None:
    """The ranks holding the first and the last stage, when the head is tied to the embedding and they differ
    (created on every rank, as ``new_group`` requires; None on the ranks outside it)."""
    ranks = plan.stage_ranks()
    if not tied or ranks[0] == ranks[-1]:
        return None
    members = sorted({dist.get_global_rank(group, ranks[0]), dist.get_global_rank(group, ranks[-1])})
    made = dist.new_group(members)
    return made if dist.get_rank() in members else None


def _refuse_direct_forward(model: nn.Module) -> None:
    """The cut model's own forward would run only this rank's blocks: it raises, saying what to call."""

    def forward(*args: Any, **kwargs: Any) -> Any:
        raise PipelineRuntimeError(
            f"{type(model).__name__} is cut into pipeline stages (this rank holds some of its blocks): train it "
            "with hf_colossal_auto.pipeline_runner(model).step(batch); its own forward would run "
            "only this rank's blocks"
        )

    model.forward = forward


def pipeline_runner(model: nn.Module) -> PipelineRunner:
    """The :class:`PipelineRunner` of a model a pipeline plan was applied to."""
    runner = getattr(model, _PIPELINE, None)
    if runner is None:
        raise PipelineRuntimeError(f"{type(model).__name__} has no pipeline plan applied")
    return runner
