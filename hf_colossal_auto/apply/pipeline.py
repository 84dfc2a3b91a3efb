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

What runs inside a stage (:func:`_run_plan_in_stages`): the plan's tensor parallelism, FSDP/HSDP and
per-block recompute, keyed by the whole model's names as in a plan without stages, on the ``(dp, tp)``
sub-mesh of this rank's pp coordinate, by the runtime's own pieces (:mod:`.runtime`, :mod:`.recompute`). What
the runtime installs on a whole model's *top* forward (inputs as DTensors, the planned forward's context,
outputs back to tensors) each :class:`StageModule` does around its own forward, since stages run the model's
inner forwards; and each stage is its own FSDP root, as torchtitan shards each model part.

What the model does then (:mod:`.pipeline_runner`): its forward is the pipeline's. A training forward runs
the schedule (forwards and backwards of every micro-batch) and returns a loss whose backward applies the
step's gradients, so the user's loop runs unchanged; an evaluation forward runs the stages forward only and
returns the logits on every rank. Data parallelism inside a stage is DDP over the mesh's ``dp`` axis (each
replica a whole pipeline; gradients summed over it, the loss normalised by the global batch's tokens) or
FSDP/HSDP (gradients reduce-scattered as sums). ``save_pretrained`` writes every stage from rank 0
(:mod:`.pipeline_save`).

Training-state checkpoints (DCP: ``accelerator.save_state``, the Trainer's, ``save_checkpoint``) are written
per stage and read under any plan (:mod:`.pipeline_checkpoint`).

An MoE model's router load-balancing loss spans the stages; :mod:`.pipeline_aux` adds it as one process does.

Not yet (refused by name): experts split over the data-parallel axis inside a stage, FSDP of a tied embedding held
twice on one rank, full state dicts.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import logging
import os
from collections.abc import Callable, Sequence
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
from .pipeline_aux import RouterAuxError, RouterBalance, router_balance
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

        self.tp_mesh: DeviceMesh | None = None
        """Set by :func:`_run_plan_in_stages` when the plan runs on DTensors (``Plan.runs_on_plain_tensors`` false):
        the stage then runs on DTensors."""
        self.forward_context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
        """Around each forward: the planned model's (:func:`.runtime.planned_forward`)."""
        self.router_balance: RouterBalance | None = None
        """Set by :func:`apply_pipeline_plan` when the model's loss has a router load-balancing term: it reads
        the stage's router logits (:mod:`.pipeline_aux`)."""
        self.sequence_shards = False
        """Set by the runner for each step (:attr:`~hf_colossal_auto.plan.Plan.sequence_sharded_sends`, and the
        step's sequence divides over tp): the hidden states a stage receives and sends are this tensor-parallel
        rank's sequence shard."""

    def forward(self, x: torch.Tensor, **per_token: torch.Tensor) -> torch.Tensor:
        """The stage's part of the model's forward. Under tensor parallelism its inputs (the rank's whole
        micro-batch, or the hidden states received whole) become DTensors replicated over the tensor-parallel
        group, as the runtime's forward does for a whole model, and its output comes back whole: what is sent
        to the next stage is the hidden states every rank of the group holds alike. With
        :attr:`sequence_shards` the hidden states received are this rank's sequence shard (a DTensor sharded
        on dim 1) and those sent are its shard of the output: no gather on either side where the blocks
        return them so sharded (the plan sets it only then), the same values either way."""
        shards = self.tp_mesh is not None and self.sequence_shards
        if shards and not self.is_first:
            x = _sequence_shard_in(x, self.tp_mesh)
        inputs = {"input_ids": x} if self.is_first else {"inputs_embeds": x}
        inputs.update(per_token)
        if self.tp_mesh is not None:
            from .runtime import inputs_on_mesh

            inputs = inputs_on_mesh(inputs, self.tp_mesh)  # leaves a DTensor as it is
        with self.forward_context():
            out = self.root(**inputs, use_cache=False)
        result = out.logits if self.is_last else out.last_hidden_state
        if shards and not self.is_last:
            result = _sequence_shard_out(result, self.tp_mesh)
        elif self.tp_mesh is not None:
            from .runtime import local_outputs

            result = local_outputs(result)
        # a view (GPT-2 reshapes its output; a replicated DTensor's local tensor) cannot be detached in place,
        # as torch's stages do after backward
        result = result.clone() if tensor_is_view(result) else result
        if self.router_balance is not None:
            result = self.router_balance.on_stage_output(
                result, getattr(out, "router_logits", None), per_token.get("attention_mask")
            )
        return result


def _sequence_shard_in(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """The received hidden states (this tensor-parallel rank's sequence shard) as the DTensor they are part of:
    sharded on dim 1 over ``mesh``. Its backward hands on this rank's shard of the input's gradient."""
    from torch.distributed.tensor import DTensor, Shard

    return DTensor.from_local(x, mesh, [Shard(1)], run_check=False)


def _sequence_shard_out(result: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """This tensor-parallel rank's sequence shard of the stage's output hidden states, to send: no
    communication where the output is already sharded on dim 1 (the plan's blocks return it so), a local slice
    of a replicated one (a plain tensor is taken as replicated, as the stage's inputs are), a reduce-scatter of
    a partial one."""
    from torch.distributed.tensor import Shard

    from .runtime import inputs_on_mesh

    return inputs_on_mesh(result, mesh).redistribute(mesh, [Shard(1)]).to_local()


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


def _tied_names(model: nn.Module, layout: PipelineLayout) -> list[tuple[str, str]]:
    """``(embedding FQN, head FQN)`` of each head parameter that is the embedding's own, read off the whole
    model: after the cut a rank holds one of the two names, or both."""
    embedding = {
        id(p): f"{layout.embedding}.{n}" for n, p in model.get_submodule(layout.embedding).named_parameters()
    }
    return [
        (embedding[id(p)], f"{layout.head}.{n}")
        for n, p in model.get_submodule(layout.head).named_parameters()
        if id(p) in embedding
    ]


def _held_tied(model: nn.Module, names: list[tuple[str, str]]) -> list[nn.Parameter]:
    """This rank's tied parameters (:func:`_tied_names`) as the cut, planned model holds them now."""
    params = dict(model.named_parameters(remove_duplicate=False))
    return [params[a] if a in params else params[b] for a, b in names if a in params or b in params]


def _device(mesh: DeviceMesh) -> torch.device:
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)


def check_pipeline_plan(model: nn.Module, plan: Plan) -> PipelineLayout:
    """The model's layout, after checking that the plan's stages cut it whole and that the runtime runs the
    plan inside a stage: tensor parallelism, DDP/FSDP/HSDP and recompute (selective too under the zero-bubble
    schedules) run; experts split over the data-parallel axis, and FSDP of an embedding tied to a head on the
    same rank, do not. Raises :class:`PipelineLayoutError` or :class:`PipelineRuntimeError`."""
    if plan.expert_data_parallel:
        raise PipelineRuntimeError(
            f"the plan runs pipeline stages with experts split over the data-parallel axis "
            f"({len(plan.expert_data_parallel)} MoE layers in expert_data_parallel), which the pipeline runtime "
            "does not apply inside a stage yet; plan without them (dp_modes without 'ddp-ep'/'fsdp-ep'), or "
            "without pipeline stages"
        )
    layout = find_layout(model)
    layout.block_ranges(plan.stages)
    try:
        router_balance(model)
    except RouterAuxError as exc:
        raise PipelineRuntimeError(str(exc)) from exc
    ranks = plan.stage_ranks()
    if _fsdp(plan) and ranks[0] == ranks[-1] and _tied_parameters(model, layout):
        raise PipelineRuntimeError(
            f"the plan runs the first and the last pipeline stage of {type(model).__name__} on one rank "
            f"(schedule {plan.schedule!r}) under {plan.dp_mode.upper()}, and its head is tied to its embedding: "
            "both stages would shard that one parameter as their own, which FSDP does not do. Plan with "
            "dp_mode 'ddp', another schedule (the first and last stages on different ranks), or untied "
            "embeddings."
        )
    return layout


def _held_part(plan: Plan, held: dict[str, nn.Module], tied_names: Sequence[tuple[str, str]]) -> Plan:
    """``plan`` as this rank's cut model reads it: recompute and local regions of the modules it holds only (the
    others' are not missing), and a head tied to the embedding placed as the embedding (the plan lists a tie once, under the
    embedding's name, which the last stage's rank does not hold)."""
    placements = dict(plan.param_placements)
    for embedding, head in tied_names:
        if embedding in placements:
            placements.setdefault(head, placements[embedding])
    recompute = {fqn: option for fqn, option in plan.recompute.items() if fqn in held}
    local = [fqn for fqn in plan.local_modules if fqn in held]
    return dataclasses.replace(plan, param_placements=placements, recompute=recompute, local_modules=local)


def _fsdp(plan: Plan) -> bool:
    """Whether the plan shards over its data-parallel axis with FSDP (or HSDP) inside each stage."""
    return plan.dp_mode in ("fsdp", "hsdp") and plan.dp_size > 1


def _run_plan_in_stages(
    model: nn.Module,
    stages: list[StageModule],
    plan: Plan,
    mesh: DeviceMesh,
    tied_names: Sequence[tuple[str, str]] = (),
) -> None:
    """The plan's placements, recompute and data-parallel mode on this rank's stages, by the runtime's own
    pieces (:mod:`.runtime`), on the ``(dp, tp)`` sub-mesh of this rank's pp coordinate. ``model`` is already
    cut to this rank's modules (their FQNs the full model's, as the plan keys them); the stages share them.

    * a plan that runs on DTensors (:attr:`~hf_colossal_auto.plan.Plan.runs_on_plain_tensors` false: tensor
      parallelism that shards something): parameters become
      DTensors on the tensor-parallel sub-mesh (:func:`.runtime.distribute_parameters`), the plan's module
      hooks are installed (:func:`.runtime.install_placement_hooks`), and each stage's forward runs on
      DTensors (:class:`StageModule`) inside the planned forward's context (the tensor-parallel group's
      generators, partial gradients reduced where they are made);
    * recompute per block (:func:`.recompute.apply_recompute`, the blocks this rank holds), inside FSDP's
      units as in the runtime;
    * FSDP/HSDP: each stage is an FSDP2 root over its blocks' units (:func:`.runtime._fully_shard`), as
      torchtitan shards each model part, kept gathered from forward to backward (``reshard_after_forward``
      False: a stage runs several micro-batches' forwards before their backwards), every stage's gathers
      issued as a step starts (:meth:`.pipeline_runner.PipelineRunner._prefetch_parameters`); torch's
      ``PipelineStage`` defers the gradient reduction to the last micro-batch. Gradients are reduce-scattered as *sums* (divide
      factor 1): each replica's loss is its share of the global batch's, normalised by the global token count
      (:mod:`.pipeline_runner`), so the global gradient is their sum, as DDP's all-reduce makes it."""
    from .moe import install_aux_loss_region
    from .recompute import apply_recompute
    from .rng import agreed_forward, install_replica_rng
    from .runtime import (
        _fully_shard,
        data_parallel_shard_mesh,
        distribute_parameters,
        install_dtensor_rules,
        install_placement_hooks,
        install_sdpa_mask_placement,
        planned_forward,
        tensor_parallel_mesh,
    )
    from .shared_casts import share_sibling_casts

    sharded = not plan.runs_on_plain_tensors  # FSDP without tensor parallelism: plain stages, FSDP2 below
    held = dict(model.named_modules())
    plan = _held_part(plan, held, tied_names)
    if sharded:
        install_dtensor_rules(plan)
        distribute_parameters(model, plan, mesh)
        install_placement_hooks(model, plan, mesh)
        install_sdpa_mask_placement()
        install_aux_loss_region(model)  # MoE: the last stage's copy of the model computes the aux loss too
    share_sibling_casts(model)  # after the placement hooks (apply/shared_casts.py)
    recomputed = apply_recompute(model, plan)
    install_replica_rng(model, mesh, recomputed=bool(recomputed))
    for stage in stages:
        stage.tp_mesh = tensor_parallel_mesh(mesh) if sharded else None
        stage.forward_context = functools.partial(planned_forward if sharded else agreed_forward, model)
    if _fsdp(plan):
        from torch.distributed.fsdp import FSDPModule

        dp_mesh = data_parallel_shard_mesh(plan, mesh)
        for stage in stages:
            _fully_shard(stage, dp_mesh, reshard_after_forward=False)
            for module in stage.modules():
                if isinstance(module, FSDPModule):  # a plain sum (gloo has no pre-multiplied sum)
                    module.set_gradient_divide_factor(1.0)
                    module.set_force_sum_reduction_for_comms(True)


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
    from .runtime import (
        _processes_are_real,
        _validate_on_every_rank,
        build_mesh,
        release_freed_memory,
        remap_optimizers_by_name,
    )

    world = dist.get_world_size() if dist.is_initialized() else None
    if world is None:
        raise PipelineRuntimeError(
            "a pipeline plan runs in a torch.distributed job (torchrun), one rank a stage"
        )
    _validate_on_every_rank(model, plan, world)
    originals = list(model.named_parameters(remove_duplicate=False))
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
    tied_names = _tied_names(model, layout)
    tie_group = _tie_group(plan, mesh, bool(tied_names))
    holds_tie = 0 in mine or plan.num_stages - 1 in mine
    stages = [StageModule(model, layout, s, plan.num_stages, ranges[s]) for s in mine]
    balance = router_balance(model)  # checked above
    for stage in stages:
        stage.router_balance = balance
    record_saved_names(model)  # what save_pretrained writes, read off the whole model
    _cut_model(model, layout, blocks, held)
    _run_plan_in_stages(model, stages, plan, mesh, tied_names)
    tied = _held_tied(model, tied_names)  # after distributing and FSDP, which replace the parameters
    dp_group = mesh.get_group("dp") if plan.dp_size > 1 else None
    runner = PipelineRunner(
        model, plan, layout, stages, group, device, tie_group, tied if holds_tie else [], dp_group,
        fsdp=_fsdp(plan), router_balance=balance,
    )  # fmt: skip
    setattr(model, _PIPELINE, runner)
    _install_forward(model, runner)
    model._hf_colossal_auto_plan = plan
    model._hf_colossal_auto_mesh = mesh
    install_pipeline_save(model, as_timedelta(timeout or DEFAULT_TIMEOUT_S).total_seconds())
    remap_optimizers_by_name(model, originals, optimizers)
    release_freed_memory()
    kept = {id(p) for p in model.parameters()}
    for optimizer in optimizers:  # an optimizer made before: only this rank's parameters remain
        for param_group in optimizer.param_groups:
            param_group["params"] = [p for p in param_group["params"] if id(p) in kept]
    logger.info(
        "pipeline rank %d of %d (dp %d %s, tp %d): stages %s (blocks %s), schedule %s, %d micro-batches",
        rank,
        plan.pp_size,
        plan.dp_size,
        plan.dp_mode,
        plan.tp_size,
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
