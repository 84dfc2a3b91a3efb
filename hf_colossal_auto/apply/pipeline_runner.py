"""Run a pipelined model's steps: torch's schedule over this rank's stages, behind the model's own forward.

Why behind the forward. The user's loop stays ``loss = model(**batch).loss; loss.backward();
optimizer.step()``. A pipeline cannot run its forwards and its backwards apart (1F1B interleaves them; the
activations of a micro-batch are freed by its backward), so a *training* forward runs the whole schedule —
forwards and backwards of every micro-batch — and keeps the gradients it computed aside. The loss it returns
is a scalar whose backward adds ``s x`` those gradients to the parameters' ``.grad``, where ``s`` is the
gradient flowing into the loss. That is the chain rule for any differentiable function of the loss:
``loss / accumulation_steps``, a gradient scaler's ``loss x scale``, ``loss ** 2`` are all honoured exactly,
and gradient accumulation over several forwards adds up as it does in one process. Terms computed from the
parameters themselves (a penalty) reach them through ordinary autograd. Terms on the logits cannot be
honoured (the logits of a training step are consumed inside the schedule): a training forward returns no
logits, and reading them raises an error that says why and what to do (:mod:`.pipeline_outputs`: set the term
as the model's ``loss_function``, or plan without stages) instead of training on something else.

An *evaluation* forward (``model.eval()`` or ``torch.no_grad()``) runs the stages forward only (each rank its
stages in stage order over the micro-batches; not torch's ``schedule.eval()``, see :meth:`PipelineRunner.eval_forward`)
and returns the logits (broadcast from the last stage) and, with labels, the loss, on every rank.

The loss. The last stage computes the model's own loss function (transformers' ``ForCausalLMLoss``: labels
shifted inside, -100 ignored) per micro-batch as a sum over its tokens divided by the token count of the whole
*global* batch (``num_items_in_batch``: this pipeline's count summed over the data-parallel replicas), and the
schedule does not rescale (``scale_grads=False``). The micro-batch losses of all replicas add up to one
process's mean loss over the global batch, and so do the gradients, which are therefore *summed* over the
data-parallel axis (an all-reduce per step): the result is one process's on the global batch, also when the
replicas' batches hold different token counts (under FSDP the reduce-scatter sums them). The loss returned on
every rank is that global loss. Gradients of DTensor parameters (tensor parallelism, FSDP) are the
parameters' placements; the norm :meth:`PipelineRunner.clip_grad_norm_` clips by is the whole model's. An MoE
model's router load-balancing term (over every layer, on every stage) is added as one process adds it
(:mod:`.pipeline_aux`: a forward-only counting pass, then each stage's term attached to its output's backward).

A caller that passes ``num_items_in_batch`` (transformers' Trainer, counting the label tokens of every process
over its gradient-accumulation window) follows DDP's contract instead: the loss is normalised by that count,
the value returned is this pipeline's (not summed over dp), and the gradients are *averaged* over dp — the
Trainer multiplies the loss by the data-parallel replicas itself, as it does for DDP's averaging.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .._torch_compat import pipeline_stage_with_transient_receive_buffers, schedule_compute_actions
from ..pipeline_layout import PipelineLayout
from ..pipeline_receipts import gradient_send_releases
from ..plan import Plan
from .pipeline_aux import RouterBalance
from .pipeline_sends import GradientSends
from .pipeline_sync import ReplicaSync

logger = logging.getLogger(__name__)

IGNORE_INDEX = -100
"""Label value transformers' causal-LM loss ignores."""

BATCH_KEYS = frozenset({"input_ids", "labels", "attention_mask", "position_ids"})
"""What a pipelined step reads from a batch: ``input_ids`` (first stage), ``labels`` (last stage), and the
per-token inputs every stage's copy of the model needs."""

IGNORED_KEYS = frozenset({"use_cache", "return_dict"})
"""Forward keywords a pipelined forward accepts and does not need: the stages never cache, outputs are a
``ModelOutput``."""

_SCHEDULES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved-1f1b": "ScheduleInterleaved1F1B",
    "interleaved-zero-bubble": "ScheduleInterleavedZeroBubble",
    "zbv": "ScheduleZBVZeroBubble",
}
"""The plan's schedule names -> torch.distributed.pipelining's classes."""


class PipelineRuntimeError(RuntimeError):
    """A pipelined model was asked for something the pipeline runtime does not run."""


@dataclass
class _Built:
    """The torch pipeline objects for one micro-batch shape (torch infers the shapes sent between stages on
    the first step, so a new shape needs new ones)."""

    key: tuple
    schedule: Any
    gradient_sends: GradientSends | None
    """The sent gradients the stages hold until proven received (multi-stage schedules; None: torch's)."""


class _StepGradients(torch.autograd.Function):
    """The loss of a pipelined training step. Its backward adds ``incoming x`` the step's gradients (computed
    by the schedule in the forward) to each parameter's ``.grad``; it has no gradient of its own inputs.

    The step's gradients are scaled in place and handed on, not copied: they are this step's own (the schedule
    made them; ``.grad`` was restored after it), and a copy per parameter would hold every gradient of the rank
    twice at the end of backward (measured: a pp x tp rank's peak 20-30 % above its prediction, tiny Llama).
    So the backward applies them once: a second backward of the same loss (``retain_graph=True``) is refused."""

    @staticmethod
    def forward(
        ctx: Any, loss: torch.Tensor, anchor: torch.Tensor, grads: list, sink: Any = None
    ) -> torch.Tensor:
        ctx.grads, ctx.sink = grads, sink
        return loss.detach().clone()

    @staticmethod
    def backward(ctx: Any, incoming: torch.Tensor) -> tuple[None, None, None, None]:
        grads, ctx.grads = ctx.grads, None
        if grads is None:
            raise PipelineRuntimeError(
                "the loss of a pipelined training step was backpropagated a second time (retain_graph=True): its "
                "first backward already applied the step's gradients, which the schedule computed in the forward. "
                "Run the forward again for another backward."
            )
        with torch.no_grad():
            for _param, grad in grads:
                grad.mul_(incoming.to(grad.dtype))
        if ctx.sink is not None:  # the dp reduction deferred (:mod:`.pipeline_sync`)
            ctx.sink(grads)
            return None, None, None, None
        for param, grad in grads:
            if param.grad is None:
                param.grad = grad
            else:
                param.grad.add_(grad)
        return None, None, None, None


class PipelineRunner:
    """This rank's stages of a pipelined model, the schedule that runs them, and the model's forward.

    ``forward(**batch)`` is the cut model's forward (see the module docstring); ``step(batch)`` runs one
    training step and adds its gradients to ``.grad`` at once, returning the loss (no backward needed)."""

    def __init__(
        self,
        model: nn.Module,
        plan: Plan,
        layout: PipelineLayout,
        stages: list[nn.Module],
        group: dist.ProcessGroup,
        device: torch.device,
        tie_group: dist.ProcessGroup | None,
        tied: list[nn.Parameter],
        dp_group: dist.ProcessGroup | None = None,
        *,
        fsdp: bool = False,
        router_balance: RouterBalance | None = None,
    ):
        self.model, self.plan, self.layout, self.stages = model, plan, layout, stages
        self.group, self.device, self.dp_group = group, device, dp_group
        self.fsdp = fsdp  # FSDP reduces the gradients over dp itself (summed: apply/pipeline.py)
        self._gathered_before = False  # a step ran FSDP2's lazy set-up: _prefetch_parameters
        self.tie_group, self.tied = tie_group, tied
        self.router_balance = router_balance  # the MoE load-balancing loss over stages (:mod:`.pipeline_aux`)
        # no_sync defers the dp reduction (not FSDP's, which reduce-scatters each step itself)
        self.replica_sync = ReplicaSync(model, None if fsdp else dp_group, plan.dp_size)
        ranks = plan.stage_ranks()
        self.last_rank = dist.get_global_rank(group, ranks[-1])
        self.holds_first = any(s.is_first for s in stages)
        self.holds_last = any(s.is_last for s in stages)
        self._built: _Built | None = None

    # ----------------------------------------------------------------------------------------- the forward
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The cut model's forward: a training step (grad enabled, ``model.training``) or an evaluation."""
        batch = _forward_batch(type(self.model).__name__, args, kwargs)
        items = batch.pop("num_items_in_batch", None)  # the Trainer's count (see the module docstring)
        if torch.is_grad_enabled() and self.model.training:
            return self.training_forward(batch, items)
        return self.eval_forward(batch, items)

    def training_forward(self, batch: Mapping[str, Any], num_items: Any = None) -> Any:
        """The schedule's forwards and backwards over ``batch``; the returned output's ``loss`` applies the
        step's gradients when its backward runs (:class:`_StepGradients`). No logits: reading them raises, saying
        why (:mod:`.pipeline_outputs`)."""
        from .pipeline_outputs import PipelineTrainingOutput

        defer = self.replica_sync.deferring()
        loss, grads = self._train_step(batch, num_items, reduce=not defer)
        sink = self.replica_sync.receiver(average=num_items is not None) if defer else None
        anchor = torch.zeros((), device=loss.device, requires_grad=True)
        return PipelineTrainingOutput(loss=_StepGradients.apply(loss, anchor, grads, sink))

    def eval_forward(self, batch: Mapping[str, Any], num_items: Any = None) -> Any:
        """A forward-only pass: the logits (on every rank) and, with labels, the global loss.

        Not torch's ``schedule.eval()``: on torch 2.13 it fails under "zbv" (the V's two stages on one rank
        keep their local backward actions in the list it runs). Each rank runs its stages in stage order over
        the micro-batches, receiving each micro-batch's input from the previous stage's rank and sending its
        output to the next (GPipe's forward half: later stages start as soon as the first micro-batch
        arrives); the last stage computes the logits and the loss, and broadcasts the logits."""
        from transformers.modeling_outputs import CausalLMOutputWithPast

        input_ids, labels, kwargs = _split_batch(
            batch, self.plan.micro_batches, self.device, need_labels=False
        )
        self._send_sequence_shards(input_ids)
        count = self._count(labels, num_items) if labels is not None else None
        balance = self.router_balance if labels is not None else None
        with torch.no_grad():
            try:
                if balance is not None:
                    balance.start_counting()
                logits, losses = self._forward_stages(input_ids, labels, kwargs, count)
            finally:
                self._reshard()
            logits = self._broadcast_logits(logits)
            loss = None if labels is None else self._global_loss(losses, over_dp=num_items is None)
            if balance is not None:  # one process's coef x aux over the (global) batch
                dp = self.dp_group if num_items is None else None
                loss = loss + balance.loss_of(*balance.reduced_sums(self.device, self.group, dp))
        return CausalLMOutputWithPast(loss=loss, logits=logits)

    def _forward_stages(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor | None,
        kwargs: dict[str, torch.Tensor],
        count: torch.Tensor | None,
    ) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
        """This rank's stages in stage order, each over every micro-batch; returns the merged logits and the
        micro-batch losses on the last stage's rank (None and [] elsewhere)."""
        m = self.plan.micro_batches
        per_token = [{k: v for k, v in zip(kwargs, values, strict=True)}
                     for values in zip(*(v.tensor_split(m) for v in kwargs.values()), strict=True)] or [{}] * m  # fmt: skip
        ranks = [dist.get_global_rank(self.group, r) for r in self.plan.stage_ranks()]
        me = dist.get_rank()
        held = {stage.index: stage for stage in self.stages}
        carried = list(input_ids.tensor_split(m))  # the first stage's inputs; then each stage's outputs
        for index, rank in enumerate(ranks):
            if rank != me:
                continue
            stage = held[index]
            if index > 0 and ranks[index - 1] != me:
                carried = [_receive(ranks[index - 1], self.device) for _ in range(m)]
            carried = [stage(x, **per_token[i]) for i, x in enumerate(carried)]
            if index + 1 < len(ranks) and ranks[index + 1] != me:
                for output in carried:
                    _send(output, ranks[index + 1])
        if not self.holds_last:
            return None, []
        losses = []
        if labels is not None:
            vocab = self.model.config.vocab_size
            for logits, part in zip(carried, labels.tensor_split(m), strict=True):
                losses.append(
                    self.model.loss_function(
                        logits=logits, labels=part, vocab_size=vocab, num_items_in_batch=count
                    )
                )
        return torch.cat(carried), losses

    # ----------------------------------------------------------------------------------------- steps
    def step(self, batch: Mapping[str, Any]) -> torch.Tensor:
        """One training step of the pipeline on ``batch`` (the whole batch of this pipeline, the same on every
        rank of it). Returns the global loss on every rank; the gradients are added to ``.grad`` at once."""
        loss, grads = self._train_step(batch)
        for param, grad in grads:
            param.grad = grad if param.grad is None else param.grad.add_(grad)
        return loss

    def _train_step(
        self, batch: Mapping[str, Any], num_items: Any = None, reduce: bool = True
    ) -> tuple[torch.Tensor, list]:
        """Run the schedule; returns the global loss and ``(parameter, gradient)`` of the step, summed over the
        tied copies and (unless ``reduce`` is False: deferred) the data-parallel replicas, leaving ``.grad`` as
        it was. ``num_items``: the caller's ``num_items_in_batch`` (see the module docstring)."""
        input_ids, labels, kwargs = _split_batch(batch, self.plan.micro_batches, self.device)
        self._send_sequence_shards(input_ids)
        over_dp = num_items is None
        aux = self._count_routing(input_ids, kwargs, over_dp) if self.router_balance is not None else None
        schedule = self._schedule(input_ids.shape, kwargs)
        params = [p for p in self.model.parameters() if p.requires_grad]
        saved = [p.grad for p in params]
        for param in params:
            param.grad = None
        losses: list[torch.Tensor] | None = [] if self.holds_last else None
        self._prefetch_parameters()
        try:
            schedule.step(
                *((input_ids,) if self.holds_first else ()),
                target=labels if self.holds_last else None,
                losses=losses,
                return_outputs=False,
                loss_kwargs={"num_items_in_batch": self._count(labels, num_items)},
                **kwargs,
            )
            if self._built.gradient_sends is not None:
                self._built.gradient_sends.wait_all()
            _gradients_to_placements(params)
            self._sum_tied_gradients()
            if reduce:  # else deferred to the backward (:mod:`.pipeline_sync`)
                self._sum_over_replicas(params, average=num_items is not None)
            grads = [(p, p.grad) for p in params if p.grad is not None]
        finally:
            for param, grad in zip(params, saved, strict=True):
                param.grad = grad
            if self.router_balance is not None:
                self.router_balance.stop()
        loss = self._global_loss(losses, over_dp=over_dp)
        return (loss if aux is None else loss + aux), grads

    def _count_routing(
        self, input_ids: torch.Tensor, kwargs: dict[str, torch.Tensor], over_dp: bool
    ) -> torch.Tensor:
        """The load-balancing loss's expert counts and rows over the whole (global) batch, by a forward-only
        pass over the stages before the schedule's (:mod:`.pipeline_aux`), set for the schedule's stages to
        attach their terms; returns ``coef x aux``."""
        balance = self.router_balance
        assert balance is not None
        with torch.no_grad():
            balance.start_counting()
            try:
                self._forward_stages(input_ids, None, kwargs, None)
            finally:
                self._reshard()
            counts, probs, rows = balance.reduced_sums(
                self.device, self.group, self.dp_group if over_dp else None
            )
        balance.start_training(counts, rows)
        return balance.loss_of(counts, probs, rows)

    def _send_sequence_shards(self, input_ids: torch.Tensor) -> None:
        """Whether this step's stages send sequence shards: the plan's :attr:`~hf_colossal_auto.plan.Plan.
        sequence_sharded_sends`, where the step's sequence divides over tp (every rank of a pipeline reads the
        same batch, so all agree; a sequence that does not divide is sent whole, as a plan without it does)."""
        tp = self.plan.tp_size
        shards = self.plan.sequence_sharded_sends and input_ids.dim() > 1 and input_ids.shape[1] % tp == 0
        for stage in self.stages:
            stage.sequence_shards = shards

    def _schedule(self, shape: torch.Size, kwargs: dict[str, torch.Tensor]) -> Any:
        key = (tuple(shape), tuple(sorted((k, tuple(v.shape)) for k, v in kwargs.items())))
        if self._built is None or self._built.key != key:
            self._built = _Built(key, *_make_schedule(self, self.plan))
        return self._built.schedule

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over the whole model: each rank holds some stages' gradients, so
        the norm is summed over the pipeline (a tied embedding counted once, on the first stage's rank).
        Returns the total norm on every rank."""
        params = [p for p in self.model.parameters() if p.grad is not None]
        skip = {id(p) for p in self.tied} if not self.holds_first else set()
        mine = [p.grad.detach() for p in params if id(p) not in skip]
        norm_type = float(norm_type)
        if norm_type == float("inf"):
            total = max(
                (_whole(g.abs().max()) for g in mine), default=torch.zeros((), device=self.device)
            ).float()
            dist.all_reduce(total, op=dist.ReduceOp.MAX, group=self.group)
        else:
            total = sum(
                (_whole(g.float().norm(norm_type)) ** norm_type for g in mine),
                torch.zeros((), device=self.device),
            )
            dist.all_reduce(total, group=self.group)
            total = total ** (1.0 / norm_type)
        scale = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for param in params:
            param.grad.detach().mul_(scale.to(param.grad.dtype))
        return total

    # ----------------------------------------------------------------------------------------- collectives
    def _token_count(self, labels: torch.Tensor) -> torch.Tensor:
        """Label tokens of the global batch (after the causal shift): this pipeline's, summed over dp."""
        count = (labels[..., 1:] != IGNORE_INDEX).sum()
        if self.dp_group is not None:
            dist.all_reduce(count, group=self.dp_group)
        return count

    def _count(self, labels: torch.Tensor, num_items: Any) -> Any:
        """What the loss is normalised by: the caller's ``num_items_in_batch`` when given, else the global
        batch's label tokens."""
        if num_items is None:
            return self._token_count(labels)
        return num_items.to(self.device) if isinstance(num_items, torch.Tensor) else num_items

    def _global_loss(self, losses: list[torch.Tensor] | None, over_dp: bool = True) -> torch.Tensor:
        """The last stage's micro-batch losses summed, on every rank of the pipeline, summed over dp (else
        this pipeline's)."""
        loss = torch.stack(losses).sum().detach().float() if losses else torch.zeros((), device=self.device)
        dist.broadcast(loss, src=self.last_rank, group=self.group)
        if over_dp and self.dp_group is not None:
            dist.all_reduce(loss, group=self.dp_group)
        return loss

    def _broadcast_logits(self, logits: torch.Tensor | None) -> torch.Tensor:
        """The last stage's merged logits, on every rank of the pipeline."""
        meta = [None if logits is None else (tuple(logits.shape), logits.dtype)]
        dist.broadcast_object_list(meta, src=self.last_rank, group=self.group)
        shape, dtype = meta[0]
        if logits is None:
            logits = torch.empty(shape, dtype=dtype, device=self.device)
        dist.broadcast(logits, src=self.last_rank, group=self.group)
        return logits

    def _sum_tied_gradients(self) -> None:
        """An embedding tied to the head on another rank: each rank's copy got its own stage's part of the
        gradient; both need the sum."""
        if self.tie_group is None:
            return
        for param in self.tied:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            # both copies are sharded alike (the same plan, the same dp/tp coordinates): shards add up
            dist.all_reduce(_local(param.grad), group=self.tie_group)

    def _sum_over_replicas(self, params: list[nn.Parameter], average: bool = False) -> None:
        """Each replica's gradient is of its rows' share of the global loss: the global gradient is the sum
        (FSDP's reduce-scatter already summed it; ``average``: DDP's mean, for a caller that scales the loss by
        the replicas itself)."""
        if self.dp_group is None:
            return
        for param in params:
            if param.grad is None:
                continue
            if not self.fsdp:
                dist.all_reduce(_local(param.grad), group=self.dp_group)
            if average:
                param.grad.div_(self.plan.dp_size)

    def _prefetch_parameters(self) -> None:
        """FSDP: issue every stage's all-gathers as the step starts, in stage order (FSDP2's pre-forward waits for
        each unit's): they run while this rank waits for its first micro-batch, as the pipeline pricing has them
        (``StageCost.unsharded_at_s``). Left to FSDP2 (each unit gathered at its first forward, only the next
        one prefetched) a stage's gathers sat on the forward chain of the step's first micro-batch, one stage
        after another. Not before the stages' first forward, where FSDP2 sets up its state."""
        if not self.fsdp:
            return
        if not self._gathered_before:
            self._gathered_before = True
            return
        for unit in self._fsdp_units():  # each stage's root (its embedding or head) first, then its blocks
            unit.unshard(async_op=True)

    def _reshard(self) -> None:
        """FSDP: free the blocks an evaluation forward gathered (kept gathered after forward, for backward),
        so that the model's parameters are the sharded ones again."""
        if not self.fsdp:
            return
        for unit in self._fsdp_units():
            unit.reshard()

    def _fsdp_units(self) -> list[nn.Module]:
        """Every FSDP2 unit of this rank's stages, in stage order, each stage's root before its blocks."""
        from torch.distributed.fsdp import FSDPModule

        return [m for stage in self.stages for m in stage.modules() if isinstance(m, FSDPModule)]


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (sharing its storage: collectives on it act on the DTensor), a tensor itself."""
    from torch.distributed.tensor import DTensor

    if not isinstance(tensor, DTensor):
        return tensor
    with torch.no_grad():
        return tensor.to_local()


def _whole(value: torch.Tensor) -> torch.Tensor:
    """A reduction of a DTensor gradient (its norm) as the whole tensor's, a plain value itself."""
    from torch.distributed.tensor import DTensor

    return value.full_tensor() if isinstance(value, DTensor) else value


def _gradients_to_placements(params: list[nn.Parameter]) -> None:
    """Each DTensor gradient in its parameter's placements (a tensor-parallel gradient may come out partial:
    the runtime's hook does this per backward; the zero-bubble schedules' weight gradients are set outside
    autograd's accumulation, where no hook runs). FSDP's gradients are already the parameters'."""
    from torch.distributed.tensor import DTensor

    for param in params:
        grad = param.grad
        moved = isinstance(grad, DTensor) and isinstance(param, DTensor)
        if moved and tuple(grad.placements) != tuple(param.placements):
            param.grad = grad.redistribute(param.device_mesh, param.placements)


def _send(tensor: torch.Tensor, dst: int) -> None:
    """A tensor to rank ``dst``, its shape and dtype first (the receiver allocates from them)."""
    dist.send_object_list([(tuple(tensor.shape), tensor.dtype)], dst=dst)
    dist.send(tensor.contiguous(), dst=dst)


def _receive(src: int, device: torch.device) -> torch.Tensor:
    """What :func:`_send` sent from rank ``src``."""
    meta: list[Any] = [None]
    dist.recv_object_list(meta, src=src)
    shape, dtype = meta[0]
    tensor = torch.empty(shape, dtype=dtype, device=device)
    dist.recv(tensor, src=src)
    return tensor


def _forward_batch(model_name: str, args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The batch of a forward call: ``model(input_ids, ...)`` or ``model(**batch)``, the keywords every stage
    ignores dropped (``return_dict=False`` refused: the output is a ``ModelOutput``)."""
    if len(args) > 1 or (args and "input_ids" in kwargs):
        raise PipelineRuntimeError(
            f"the pipelined {model_name} takes input_ids as its one positional argument and the rest by keyword "
            "(model(**batch))"
        )
    batch = dict(kwargs, input_ids=args[0]) if args else dict(kwargs)
    if batch.get("return_dict") is False:
        raise PipelineRuntimeError(
            f"the pipelined {model_name} returns a ModelOutput; call it without return_dict=False"
        )
    if batch.get("use_cache"):
        raise PipelineRuntimeError(
            f"the pipelined {model_name} runs without a KV cache (use_cache=True was asked): generate with the "
            "model loaded in one process (save_pretrained, then from_pretrained)"
        )
    return {k: v for k, v in batch.items() if k not in IGNORED_KEYS}


def _split_batch(
    batch: Mapping[str, Any], micro_batches: int, device: torch.device, need_labels: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, torch.Tensor]]:
    """``input_ids``, ``labels`` and the per-token keyword inputs of ``batch``, on ``device``; refuses what the
    pipelined step cannot honour."""
    unknown = sorted(set(batch) - BATCH_KEYS)
    if unknown:
        raise PipelineRuntimeError(
            f"a pipelined step reads {sorted(BATCH_KEYS)} from the batch; it got {unknown} too, which the stages "
            "would not see. Drop them from the batch, or train without pipeline stages."
        )
    if "input_ids" not in batch or (need_labels and "labels" not in batch):
        raise PipelineRuntimeError(
            "a pipelined training step needs input_ids and labels in the batch (the last stage computes the "
            "loss inside the schedule); without labels, evaluate under model.eval() or torch.no_grad()"
        )
    tensors = {k: v.to(device) for k, v in batch.items() if v is not None}
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
    return tensors["input_ids"], tensors.get("labels"), kwargs


def _make_schedule(runner: PipelineRunner, plan: Plan) -> tuple[Any, GradientSends | None]:
    """torch's ``PipelineStage`` per held stage (its receive buffers held only while their micro-batch is in
    flight) and the plan's schedule over them (the loss: the model's own, normalised by the global batch's
    tokens through ``num_items_in_batch``; no rescaling by the schedule). Under a multi-stage schedule the
    stages' sent gradients are held until the schedule's order proves them received (:mod:`.pipeline_sends`),
    returned with the schedule."""
    from torch.distributed import pipelining

    sends = GradientSends() if plan.virtual_stages > 1 else None
    stages = [
        pipeline_stage_with_transient_receive_buffers(
            s, s.index, plan.num_stages, runner.device, runner.group, gradient_sends=sends
        )
        for s in runner.stages
    ]
    cls = getattr(pipelining, _SCHEDULES[plan.schedule])
    model, vocab = runner.model, runner.model.config.vocab_size

    def loss_fn(logits: torch.Tensor, labels: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        return model.loss_function(logits=logits, labels=labels, vocab_size=vocab, **kwargs)

    held = stages[0] if plan.virtual_stages == 1 else stages
    schedule = cls(held, n_microbatches=plan.micro_batches, loss_fn=loss_fn, scale_grads=False)
    if sends is not None:
        sends.releases = gradient_send_releases(schedule_compute_actions(schedule), plan.stage_ranks())
    return schedule, sends
