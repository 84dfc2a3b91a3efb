"""Run the plan's activation recompute: per block, nothing, a full checkpoint, or a selective one.

``full`` wraps the block's forward in non-reentrant ``torch.utils.checkpoint`` (only the block's inputs are
kept; its forward reruns in backward). ``selective:<classes>`` adds a selective-checkpoint context whose
policy keeps the outputs of every op *not* in the listed classes and recomputes the rest — decided op by op
with :func:`hf_colossal_auto.capture.op_classes.op_class`, the same function the planner priced the option
with. ``;rerun=<modules>`` recomputes every op run inside those modules of the block as well
(:class:`_InsideModules`: forward hooks count the calls entered, reset as each forward or rerun of the block
starts, since a rerun may stop inside one). Both work on DTensor-sharded blocks (the policy sees DTensor-level
aten ops, as the planner's trace did) and under FSDP2 (its pre-backward hook unshards the parameters before the
block is recomputed). Under a pipeline schedule that splits each backward into an input and a weight pass
(``plan.SPLIT_BACKWARD_SCHEDULES``), torch's checkpoint would rerun a block in the input pass and again in each
``autograd.grad`` of the weight pass (one per parameter group): there the block is checkpointed by
:func:`.shared_rerun.checkpoint_with_shared_rerun`, whose one rerun (in the input pass) serves both passes, its
tensors held until the weight pass has used them.

A block that is checkpointed is given no KV cache while it records for backward (``use_cache=False``, the
cache arguments None), as HF's own ``GradientCheckpointingLayer`` does: its rerun in backward would write the
cache a second time (a training forward of a config with ``use_cache`` on returns a cache twice as long once
backward has run, and a cache passed in would be read with the block's own keys appended). Without gradients
(``generate()``, evaluation) nothing is checkpointed and the cache is used as usual.

A recomputed block runs with autocast's weight-cast cache off (:func:`uncached_autocast_casts`), in forward
and in its rerun (checkpoint restores the flag it saw). Under ``torch.autocast`` torch keeps the low-precision
copy of every fp32 parameter it casts until the *outermost* autocast context exits: after the whole forward,
and under a pipeline plan after the whole schedule (the step's forward runs it inside the caller's autocast).
A checkpointed block would then hold a copy of each of its weights to that point — under FSDP a copy of the
gathered weight, so a model's whole weights in bf16 at the end of forward — where the planner prices what the
block keeps as nothing but its inputs (``full``) or its kept outputs (``selective``). Without the cache each
use casts again (a projection's weight is used once per forward, so nothing is cast twice), the copy is freed
with the block's forward and made again by its rerun, as priced. The values are the same: a cast is a cast.

HF's own switch (``model.gradient_checkpointing_enable()``, the Trainer's ``gradient_checkpointing=True``)
would checkpoint every layer a second time, on top of the plan, at the price the planner avoided. The plan
wins: a plan that decides recompute turns HF's switch off and makes later calls to it warn and do nothing.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from ..capture.op_classes import op_class
from ..plan import SPLIT_BACKWARD_SCHEDULES, Plan
from ..recompute_options import RecomputeOption, parse_option
from .shared_rerun import checkpoint_with_shared_rerun

logger = logging.getLogger(__name__)


class _InsideModules:
    """Whether an op runs inside one of a block's ``;rerun=`` modules: their forward pre-hooks count a call in,
    their forward hooks (also on an exception) count it out. A rerun that stops early (non-reentrant checkpoint
    raises once every saved tensor is back) may leave a call counted in: :meth:`reset` as every forward or
    rerun of the block starts."""

    def __init__(self, block: nn.Module, paths: frozenset[str]) -> None:
        self.depth = 0
        for path in sorted(paths):
            try:
                module = block.get_submodule(path)
            except AttributeError:
                logger.warning(
                    "recompute option reruns %s, which %s does not have; its ops are kept as the option's "
                    "classes decide", path, type(block).__name__,
                )  # fmt: skip
                continue
            module.register_forward_pre_hook(self._enter)
            module.register_forward_hook(self._leave, always_call=True)

    def _enter(self, *_: Any) -> None:
        self.depth += 1

    def _leave(self, *_: Any) -> None:
        self.depth = max(self.depth - 1, 0)

    def reset(self) -> None:
        self.depth = 0

    @property
    def inside(self) -> bool:
        return self.depth > 0


def selective_policy(option: RecomputeOption, rerun: _InsideModules | None = None):
    """The selective-checkpoint policy of ``option``: keep what the option keeps, recompute the rest (with
    ``rerun``, every op inside the option's ``;rerun=`` modules too).

    Views are never kept, as the planner prices it (``RecomputeOption.caches``): a cached view holds its base
    alive, so keeping the transpose of a recomputed attention output kept that output too (rerunning a view
    costs nothing)."""
    recomputed = option.recomputed

    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if op_class(str(func)) in recomputed or getattr(func, "is_view", False):
            return CheckpointPolicy.PREFER_RECOMPUTE
        if rerun is not None and rerun.inside:
            return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE

    return policy


_CACHE_ARGUMENTS = ("cache", "past_key_values", "past_key_value", "layer_past")
"""Keyword names transformers' blocks take their KV cache by (``cache`` since transformers 5.x)."""
_warned_cache_dropped: set[str] = set()  # block classes already warned about (once each, not once per layer)


def _without_cache(module: nn.Module, kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` with the KV cache left out, for a block that is recomputed in backward (see the module doc)."""
    dropped = [k for k in _CACHE_ARGUMENTS if kwargs.get(k) is not None]
    if kwargs.get("use_cache"):
        dropped.append("use_cache")
    if not dropped:
        return kwargs
    if type(module).__name__ not in _warned_cache_dropped:
        _warned_cache_dropped.add(type(module).__name__)
        logger.warning(
            "%s is recomputed in backward (the plan's activation recompute), so it does not use the KV cache "
            "while training (%s dropped), as HF's gradient checkpointing does; generate() and no-grad "
            "evaluation use it as usual",
            type(module).__name__,
            ", ".join(dropped),
        )
    kwargs = {k: (None if k in _CACHE_ARGUMENTS else v) for k, v in kwargs.items()}
    if "use_cache" in kwargs:
        kwargs["use_cache"] = False
    return kwargs


@contextmanager
def uncached_autocast_casts() -> Iterator[None]:
    """Autocast's weight-cast cache off inside (restored after): see the module doc. The flag is the thread's;
    non-reentrant checkpoint records it with the autocast state and sets it again for the rerun."""
    previous = torch.is_autocast_cache_enabled()
    torch.set_autocast_cache_enabled(False)
    try:
        yield
    finally:
        torch.set_autocast_cache_enabled(previous)


def checkpoint_module(
    module: nn.Module, option: RecomputeOption, passes: int = 1, name: str | None = None
) -> None:
    """Make ``module``'s forward recompute per ``option`` in backward (in place; idempotent per module).
    ``passes``: backward passes each forward serves. 1: torch's non-reentrant checkpoint. 2 (a schedule that
    splits input and weight gradients): :func:`.shared_rerun.checkpoint_with_shared_rerun`, one rerun for both
    passes (torch's would rerun once in the input pass and once per parameter group in the weight pass), a
    selective policy's kept outputs read by that one rerun. ``name``: the block in errors (its FQN)."""
    if option.is_none or is_recomputed(module):
        return
    inner = module.forward
    rerun = _InsideModules(module, option.rerun_modules) if option.rerun_modules else None
    if option.is_full:
        context_fn = None
    else:
        policy = selective_policy(option, rerun)

        def context_fn():
            return create_selective_checkpoint_contexts(policy)

    block = name or type(module).__name__

    def run(*args: Any, **kwargs: Any) -> Any:  # the forward checkpoint records and reruns
        if rerun is not None:
            rerun.reset()
        return inner(*args, **kwargs)

    @functools.wraps(inner)
    def forward(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return inner(*args, **kwargs)
        kwargs = _without_cache(module, kwargs)
        with uncached_autocast_casts():
            if passes > 1:
                return checkpoint_with_shared_rerun(
                    run, *args, context_fn=context_fn, region_name=block, **kwargs
                )
            extra = {"context_fn": context_fn} if context_fn is not None else {}
            return checkpoint(run, *args, use_reentrant=False, **extra, **kwargs)

    module.forward = forward
    module._hf_colossal_auto_recompute = option.name


def is_recomputed(module: nn.Module) -> bool:
    """Whether :func:`checkpoint_module` made ``module`` recompute in backward."""
    return getattr(module, "_hf_colossal_auto_recompute", None) is not None


def apply_recompute(model: nn.Module, plan: Plan) -> dict[str, str]:
    """Apply ``plan.recompute`` to ``model``; returns block FQN -> option applied (``none`` left out)."""
    if not plan.recompute:
        return {}
    passes = 2 if plan.schedule in SPLIT_BACKWARD_SCHEDULES else 1
    modules = dict(model.named_modules())
    applied: dict[str, str] = {}
    for fqn, text in sorted(plan.recompute.items()):
        option = parse_option(text)
        if option.is_none:
            continue
        module = modules.get(fqn)
        if module is None:
            logger.warning(
                "plan recomputes %s but %s has no such module; it runs without", fqn, type(model).__name__
            )
            continue
        checkpoint_module(module, option, passes, fqn)
        applied[fqn] = option.name
    _plan_wins_over_hf_checkpointing(model)
    if applied:
        kinds = sorted(set(applied.values()))
        logger.info("activation recompute on %d blocks (%s)", len(applied), ", ".join(kinds))
    return applied


def _plan_wins_over_hf_checkpointing(model: nn.Module) -> None:
    # transformers 5 renamed the switch (activation_checkpointing_*); the old names warn
    new_names = hasattr(model, "is_activation_checkpointing")
    enabled = getattr(
        model, "is_activation_checkpointing" if new_names else "is_gradient_checkpointing", False
    )
    disable = getattr(
        model, "activation_checkpointing_disable" if new_names else "gradient_checkpointing_disable", None
    )
    if enabled and disable is not None:
        logger.warning(
            "%s had HF gradient checkpointing enabled; the plan decides activation recompute per block, so it "
            "is turned off (it would recompute every layer again on top of the plan)",
            type(model).__name__,
        )
        disable()
    for switch in ("gradient_checkpointing_enable", "activation_checkpointing_enable"):
        if hasattr(model, switch):

            def refuse(*args: Any, _switch: str = switch, **kwargs: Any) -> None:
                logger.warning(
                    "%s() ignored: this model runs a plan that decides activation recompute per block "
                    "(hf_colossal_auto); re-plan with recompute='full' to checkpoint every block",
                    _switch,
                )

            setattr(model, switch, refuse)
