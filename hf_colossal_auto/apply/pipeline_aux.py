"""The router load-balancing loss of an MoE model (Mixtral, Qwen2-MoE, Qwen3-MoE) under pipeline stages.

Why it needs its own piece. With ``output_router_logits`` the model's loss is ``lm_loss + coef * aux`` where
``aux`` (transformers' ``load_balancing_loss_func``) reads the router logits of *every* MoE layer over the
*whole* batch: ``aux = E * sum_e (T_e / R) * (P_e / R)``, with ``T_e`` the top-k assignments to expert ``e``
(counted, no gradient), ``P_e`` the routing probabilities summed over every layer's unmasked tokens, and ``R``
the rows counted (layers x unmasked tokens). The layers live on different stages and the schedule's loss
function sees only the last stage's output, one micro-batch at a time; a sum of per-micro-batch or per-stage
``aux`` values is a different number.

What makes it exact. Given the global counts ``T`` and rows ``R``, ``aux`` is *linear* in the probabilities:
each (stage, micro-batch) contributes ``E * sum_e T_e * P_e(stage, micro-batch) / R**2`` and these add up to
one process's ``aux``, value and gradient. So a training step

1. runs a forward-only pass over the stages first (no autograd) that counts ``T`` and ``R``, summed over the
   pipeline's ranks (and the data-parallel replicas: one process's batch is the global one);
2. runs the schedule, where each stage, per micro-batch, computes its term from its own layers' router logits
   and attaches it to its output (:class:`_AddToBackward`: the output unchanged, and the term receives gradient
   1 whenever the output's backward runs — once per micro-batch, in every schedule, the split-backward ones
   included), so its gradient reaches the routers and, through the hidden states, every earlier parameter;
3. reports the last stage's loss plus ``coef x aux`` from the counting pass's sums (the schedule's forward
   computes the same probabilities; its terms are not summed, since torch's first step also runs each stage
   once more to infer the shapes it sends).

The price is one extra forward pass per training step while the aux loss is on (``router_aux_loss_coef`` 0
or ``output_router_logits`` False: nothing runs). An evaluation forward counts and sums in its one pass.
The counting pass must route as the schedule's pass does, so random ops in a training forward (router jitter,
dropout) are refused with the aux loss on.
"""

from __future__ import annotations

import inspect
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

AUX_FUNCTION = "load_balancing_loss_func"


class RouterAuxError(RuntimeError):
    """An MoE model's load-balancing loss the pipeline runtime cannot compute as one process does."""


def _reference_code() -> Any:
    """The code of Mixtral's ``load_balancing_loss_func``, the formula :class:`RouterBalance` reproduces."""
    from transformers.models.mixtral import modeling_mixtral

    return inspect.unwrap(modeling_mixtral.load_balancing_loss_func).__code__.co_code


class _AddToBackward(torch.autograd.Function):
    """``output`` unchanged; ``term`` (a scalar) receives gradient 1 when ``output``'s backward runs, so the
    term's gradient is added to the step's as if it were added to the loss."""

    @staticmethod
    def forward(ctx: Any, output: torch.Tensor, term: torch.Tensor) -> torch.Tensor:
        ctx.term_shape = (term.dtype, term.device)
        return output.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        dtype, device = ctx.term_shape
        return grad, torch.ones((), dtype=dtype, device=device)


class RouterBalance:
    """One pipelined model's load-balancing loss, shared by the rank's stages (see the module docstring).

    Modes: ``"count"`` (a forward-only pass: accumulate this rank's counts, probability sums and rows),
    ``"train"`` (the schedule's pass: attach each stage's term to its output), None (not recording)."""

    def __init__(self, num_experts: int, top_k: int, coef: float):
        self.num_experts, self.top_k, self.coef = num_experts, top_k, coef
        self.mode: str | None = None
        self.counts = self.probs = self.rows = None  # count mode: this rank's sums
        self.global_counts: torch.Tensor | None = None  # train mode: T and R of the step
        self.global_rows: torch.Tensor | None = None

    # ----------------------------------------------------------------------------------------- per stage
    def on_stage_output(
        self, output: torch.Tensor, router_logits: Any, attention_mask: torch.Tensor | None
    ) -> torch.Tensor:
        """Called by each stage after its forward with its layers' router logits; returns its output (in
        train mode carrying the stage's term for backward)."""
        if self.mode is None or not router_logits:
            return output
        counts, probs, rows = self._stats(router_logits, attention_mask)
        if self.mode == "count":
            self.counts = counts if self.counts is None else self.counts + counts
            self.probs = probs.detach() if self.probs is None else self.probs + probs.detach()
            self.rows = rows if self.rows is None else self.rows + rows
            return output
        assert self.global_counts is not None and self.global_rows is not None
        term = self.coef * self.num_experts * (self.global_counts * probs).sum() / self.global_rows**2
        return _AddToBackward.apply(output, term)

    def _stats(
        self, router_logits: Any, attention_mask: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """This stage's layers' top-k counts per expert, probability sums per expert (differentiable) and
        rows, as ``load_balancing_loss_func`` accumulates them."""
        from .moe import _full

        layers = [_full(g) for g in router_logits]
        device = layers[0].device
        rows_each = layers[0].shape[0]
        mask = (
            torch.ones(rows_each, dtype=torch.float32, device=device)
            if attention_mask is None
            else _full(attention_mask).reshape(-1).to(device=device, dtype=torch.float32)
        )
        counts = torch.zeros(self.num_experts, dtype=torch.float32, device=device)
        probs = torch.zeros(self.num_experts, dtype=torch.float32, device=device)
        for gate in layers:
            routing = torch.nn.functional.softmax(gate, dim=-1)
            _, selected = torch.topk(routing, self.top_k, dim=-1)
            counts = (
                counts
                + torch.zeros_like(counts)
                .scatter_add_(0, selected.reshape(-1), mask.repeat_interleave(self.top_k))
                .detach()
            )
            probs = probs + (routing.float() * mask.unsqueeze(-1)).sum(dim=0)
        return counts, probs, mask.sum() * len(layers)

    # ----------------------------------------------------------------------------------------- per step
    def start_counting(self) -> None:
        self.mode, self.counts, self.probs, self.rows = "count", None, None, None

    def reduced_sums(
        self, device: torch.device, group: dist.ProcessGroup, dp_group: dist.ProcessGroup | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The counting pass's counts, probability sums and rows, summed over the pipeline's ranks and over
        ``dp_group`` (None: this pipeline's batch only). Ends counting."""
        self.mode = None
        packed = torch.zeros(2 * self.num_experts + 1, dtype=torch.float32, device=device)
        if self.counts is not None:
            packed[: self.num_experts] = self.counts
            packed[self.num_experts : -1] = self.probs
            packed[-1] = self.rows
        dist.all_reduce(packed, group=group)
        if dp_group is not None:
            dist.all_reduce(packed, group=dp_group)
        e = self.num_experts
        return packed[:e], packed[e:-1], packed[-1]

    def loss_of(self, counts: torch.Tensor, probs: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """``coef x aux`` from whole-batch sums (the evaluation's one pass)."""
        return self.coef * self.num_experts * (counts * probs).sum() / rows**2

    def start_training(self, counts: torch.Tensor, rows: torch.Tensor) -> None:
        """The schedule's pass: each stage attaches ``coef x`` its term over ``counts`` and ``rows``."""
        self.mode, self.global_counts, self.global_rows = "train", counts, rows

    def stop(self) -> None:
        self.mode, self.global_counts, self.global_rows = None, None, None


def router_balance(model: nn.Module) -> RouterBalance | None:
    """The :class:`RouterBalance` of ``model`` when its loss has a load-balancing term (``output_router_logits``
    on, ``router_aux_loss_coef`` non-zero), else None. Raises :class:`RouterAuxError` for a family whose term
    is computed otherwise than Mixtral's, or a training forward with random ops (see the module docstring)."""
    config = getattr(model, "config", None)
    if not getattr(config, "output_router_logits", False) or not getattr(config, "router_aux_loss_coef", 0):
        return None
    name = type(model).__name__
    module = sys.modules.get(type(model).__module__)
    function = getattr(module, AUX_FUNCTION, None)
    known = function is not None and inspect.unwrap(function).__code__.co_code == _reference_code()
    attrs = all(hasattr(model, a) for a in ("num_experts", "num_experts_per_tok"))
    if not known or not attrs:
        raise RouterAuxError(
            f"{name} adds a router load-balancing loss (output_router_logits=True, router_aux_loss_coef="
            f"{config.router_aux_loss_coef}) that the pipeline runtime does not know how to split over stages "
            "(it computes Mixtral's load_balancing_loss_func). Set output_router_logits=False or "
            "router_aux_loss_coef=0 in the config, or plan without pipeline stages."
        )
    noisy = {
        k: getattr(config, k)
        for k in ("router_jitter_noise", "attention_dropout", "hidden_dropout", "dropout")
        if isinstance(getattr(config, k, 0), (int, float)) and getattr(config, k, 0) > 0
    }
    if noisy:
        raise RouterAuxError(
            f"{name} trains with random ops ({noisy}) and a router load-balancing loss; under pipeline stages "
            "the loss's expert counts come from a forward pass before the schedule's, which would draw other "
            "random values and route otherwise. Set those to 0, or output_router_logits=False / "
            "router_aux_loss_coef=0, or plan without pipeline stages."
        )
    return RouterBalance(model.num_experts, model.num_experts_per_tok, float(config.router_aux_loss_coef))
