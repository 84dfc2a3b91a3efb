"""Make the runtime follow the plan's placements where DTensor's own propagation would choose differently.

DTensor picks, per op, the strategy that is cheapest to reach from the placements its inputs happen to have.
The planner chose strategies for the whole step at once, so the two part ways: a weight the plan gathers for
use (cheaper than resharding activations around it) DTensor computes on in its stored, sharded form; and a
redistribution DTensor performs *inside* an op's dispatch is invisible to autograd — the op saves its
un-redistributed input, and its backward redistributes it again (a row-parallel output left partial is
all-reduced once before a layer norm in forward and once more in its backward).

Two hooks enforce the plan where it is decided, and do every redistribution above autograd, so that each
one's backward is the reverse redistribution of the gradient the planner's edges price:

* parameter uses (``Plan.param_use_placements``): a forward pre-hook on the using module swaps in the
  parameter redistributed to the plan's placement for that use, and the post-hook puts the parameter back;
  the gradient flows through the redistribution to the parameter;
* module outputs (``Plan.activation_placements``): a forward hook redistributes the output tensor (or the
  first tensor of a tuple / ModelOutput) to the plan's placement (a partial target is left to DTensor),
  and in backward reduces a partial gradient arriving there to the placement the planner prices for it
  (the gradient of a value made replicated is replicated; of a shard, that shard);
* inputs of column- and row-parallel projections (``nn.Linear``, GPT-2's ``Conv1D``): a weight used sharded
  on its output features admits one matmul strategy only, with the input replicated; sharded on its input
  features, with the input sharded on its last dim (and a partial output). The plan's strategy is therefore
  known from the weight's use placement, and a forward pre-hook redistributes the input to it. Left to
  DTensor, the op may instead gather the weight (equal bytes at some shapes) and reshard the output
  afterwards, which is not what the plan priced. The input's gradient is left partial when it is partial:
  the plan reduces it once where the input was made (q, k and v of one normed input: one reduction).
  Sibling projections reading one input in one placement share one redistributed copy (one gather for q, k
  and v), as the planner's ``SharedCost`` prices it;
* inputs of ``nn.LayerNorm`` sharded on a normalised dim are gathered above autograd (DTensor would gather
  inside the op and again in its backward, from the sharded input the op saved);
* an elementwise op (a residual add) reading DTensors sharded on different dims: each sharded input's
  gradient goes back to its own placement at that use, before autograd sums it with the value's other uses
  (:func:`_gradients_to_sources`, in :class:`ReducePartialGradientsAtProducers`);
* block inputs (``Plan.block_input_placements``, blocks of a folded run): a forward pre-hook brings the hidden
  states to the placement the run's blocks were planned to receive them in (the first block's embeddings
  sliced onto the sequence dim under sequence parallelism), above autograd;
* partial module outputs: the plan records the placement their readers take them in (a row-parallel output
  reduce-scattered onto the sequence dim, :func:`hf_colossal_auto.solve.boundaries.reduced_where_read`), and
  the output hook above redistributes them there;
* a product of a partial sum with a differentiable factor (an MoE layer's expert outputs, partial under
  tensor parallelism inside the experts, times their routing weights): the partial input is reduced above
  autograd before the op (:func:`_partial_factors_reduced`), as the planner prices it.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Collection, Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard
from torch.overrides import TorchFunctionMode

from .._torch_compat import dtensor_is_view
from ..capture.module_kinds import projection_dims
from ..plan import Plan
from .local_tensor_parallel import inside_regions
from .redistribute import redistribute_as_planned

logger = logging.getLogger(__name__)


def _gather_at_producer(grad: Any) -> Any:
    if (
        isinstance(grad, DTensor)
        and grad.device_mesh.ndim == 1
        and not isinstance(grad.placements[0], Replicate)
    ):
        return grad.redistribute(grad.device_mesh, [Replicate()])
    return grad


class _GradientToSource(torch.autograd.Function):
    """Identity in forward; in backward a sharded or replicated gradient goes back to the input's own
    placement (a partial one stays partial: reduced where the value was made)."""

    @staticmethod
    def forward(ctx: Any, value: DTensor) -> DTensor:
        ctx.source = value.placements
        return value.view_as(value)

    @staticmethod
    def backward(ctx: Any, grad: Any) -> Any:
        if (
            isinstance(grad, DTensor)
            and not grad.placements[0].is_partial()
            and grad.placements != ctx.source
        ):
            grad = grad.redistribute(grad.device_mesh, ctx.source)
        return grad


_ELEMENTWISE = frozenset(
    {torch.add, torch.Tensor.add, torch.Tensor.__add__, torch.Tensor.__radd__}
    | {torch.mul, torch.Tensor.mul, torch.Tensor.__mul__, torch.Tensor.__rmul__}
    | {torch.sub, torch.Tensor.sub, torch.Tensor.__sub__, torch.Tensor.__rsub__}
)
"""Out-of-place binary ops whose DTensor inputs, sharded on different dims, DTensor redistributes inside the op."""


def _gradients_to_sources(func: Any, args: tuple) -> tuple:
    """The args of an elementwise op reading DTensors placed differently, each sharded or replicated one wrapped
    so its gradient returns to its own placement at this use (:class:`_GradientToSource`).

    Why: the planner prices each use's gradient back to the producer's placement on its own. Left alone, the
    op's gradient for the input DTensor redistributed comes back in the op's placement and autograd sums it
    with the value's other uses first, converting each later contribution to that placement (a residual
    stream sharded on the hidden dim read batch-sharded by the residual add: its RMSNorm's two uses'
    gradients are each moved to the batch shard, two collectives the plan does not price). A replicated input
    read by an op that runs sharded (BERT's residual ``hidden_states + input_tensor`` after a row-parallel output
    reduce-scattered to the batch shard) gets its shard of the gradient gathered at this use: summed first with
    another use's partial gradient, DTensor would reduce-scatter that one instead of all-reducing it."""
    if func not in _ELEMENTWISE:
        return args
    placed = [a.placements for a in args if isinstance(a, DTensor) and a.device_mesh.ndim == 1]
    if len(placed) < 2 or len(set(placed)) < 2:
        return args
    return tuple(
        _GradientToSource.apply(a)
        if isinstance(a, DTensor)
        and a.device_mesh.ndim == 1
        and a.requires_grad
        and isinstance(a.placements[0], (Shard, Replicate))
        else a
        for a in args
    )


_PRODUCTS = frozenset({torch.mul, torch.Tensor.mul, torch.Tensor.__mul__, torch.Tensor.__rmul__})


def _partial_factors_reduced(func: Any, args: tuple) -> tuple:
    """The args of a product reading a *partial* DTensor next to a differentiable non-partial one, the partial
    ones reduced to replicated (above autograd).

    Why: DTensor multiplies a partial sum by a replicated factor without reducing it (the product is linear in
    it) and reduces the partial product later, but the factor's gradient, ``grad * partial``, is then partial
    too: one more reduction in backward (an MoE layer's routing weights, ``(tokens x top_k,)``, after experts
    split on their intermediate dim). The planner offers no strategy that carries a partial sum through a
    product (:func:`hf_colossal_auto.strategies.dtensor_rules._keep`): it reduces the partial input where the
    product reads it, and prices no reduction for the factor's gradient."""
    if func not in _PRODUCTS:
        return args
    dtensors = [a for a in args if isinstance(a, DTensor) and a.device_mesh.ndim == 1]
    partial = [a for a in dtensors if a.placements[0].is_partial()]
    if not partial or not any(a.requires_grad and not a.placements[0].is_partial() for a in dtensors):
        return args
    return tuple(
        a.redistribute(a.device_mesh, [Replicate()])
        if isinstance(a, DTensor) and any(a is p for p in partial)
        else a
        for a in args
    )


_EMBEDDINGS = frozenset({torch.nn.functional.embedding, torch.embedding})


def _lookup_reduced(out: Any) -> Any:
    """An embedding lookup into a vocab-sharded table returns a *masked* partial sum (DTensor's
    ``_MaskPartial``), valid only until its lookup mask is consumed: reduced where it is made, also for tables
    that are a bare parameter read with ``F.embedding`` (CPM-Ant's position bias), which the ``nn.Embedding``
    output hook (:func:`hf_colossal_auto.apply.runtime.register_embedding_reduction`) does not see. Left
    partial, a view of it (a reshape to heads) reaches the reduction with another shape than its mask."""
    if isinstance(out, DTensor) and any(p.is_partial() for p in out.placements):
        placements = [Replicate() if p.is_partial() else p for p in out.placements]
        return out.redistribute(out.device_mesh, placements)
    return out


_MEAN_LOSSES = frozenset({torch.nn.functional.cross_entropy, torch.nn.functional.nll_loss})


def _row_sharded_mean(func: Any, args: tuple, kwargs: dict) -> inspect.BoundArguments | None:
    """The bound arguments of a mean-reduced cross-entropy / NLL loss whose input is split over its rows (a
    batch- or sequence-sharded LM head's logits), else None. Only without class weights (their mean divides by
    the targets' summed weights) or the legacy ``size_average``/``reduce``; label smoothing is averaged over the
    same targets, so it is kept."""
    if func not in _MEAN_LOSSES:
        return None
    try:
        bound = inspect.signature(func).bind(*args, **kwargs)
    except TypeError:
        return None
    bound.apply_defaults()
    given = bound.arguments
    logits = given["input"]
    if (
        given["reduction"] != "mean"
        or given["weight"] is not None
        or given["size_average"] is not None
        or given["reduce"] is not None
        or not isinstance(logits, DTensor)
        or logits.device_mesh.ndim != 1
        or not isinstance(logits.placements[0], Shard)
        or logits.placements[0].dim == (1 if logits.dim() > 1 else 0)  # split over the classes
    ):
        return None
    return bound


def _exact_mean_loss(func: Any, bound: inspect.BoundArguments) -> Any:
    """A mean loss over row-split logits as one process computes it: the summed loss over the count of targets
    not ignored. Why: DTensor reduces a mean loss over split rows as the mean of each shard's mean, which differs
    from the mean over all targets as soon as the shards hold different numbers of ignored targets — always under
    sequence parallelism of a causal LM (the label shifted out of the last position is ignored, on the last
    shard). The gradient was right either way (its backward divides by the total weight, reduced); the loss
    value was not (5e-5 off on tiny-llama's 6.25)."""
    given = dict(bound.arguments)
    given["reduction"] = "sum"
    target = given["target"]
    total = func(**given)
    return total / (target != given["ignore_index"]).sum()


class ReducePartialGradientsAtProducers(TorchFunctionMode):
    """While the model's forward runs: every replicated activation (not a view) gets a gradient hook that brings
    a *partial* or *sharded* gradient to replicated where the activation was made, once its readers'
    contributions are summed.

    Why: that is where the planner prices it (a consumer that splits its work over a replicated input yields a
    partial gradient, reduced at the producer; one that takes a free slice of it yields a shard, gathered at
    the producer). Left alone, DTensor carries a partial gradient on through every backward op linear in it
    and reduces it only where it meets a sharded value — in an RMSNorm over a sharded hidden dim, the gradient
    of the ``[b, s, 1]`` inverse norm travels back to the ``[b, s, h]`` input and is reduce-scattered there, a
    thousand times the bytes — and it carries a sharded one back through the producer's backward to every
    module output hook it reaches (a residual add's two inputs: two gathers where the plan prices one). Views
    are skipped: a partial gradient passes back through them and is reduced once at the value they view (q,
    k and v of one input: one reduction)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        loss = _row_sharded_mean(func, args, kwargs or {})
        if loss is not None:
            return _exact_mean_loss(func, loss)
        out = func(*_gradients_to_sources(func, _partial_factors_reduced(func, args)), **(kwargs or {}))
        if func in _EMBEDDINGS:
            out = _lookup_reduced(out)
        if (
            isinstance(out, DTensor)
            and out.requires_grad
            and out.grad_fn is not None
            and out.device_mesh.ndim == 1
            and isinstance(out.placements[0], Replicate)
            and not dtensor_is_view(out)
        ):
            out.register_hook(_gather_at_producer)
        return out


def _tp_placement(plan: Plan, placements: list[str]) -> Placement | None:
    """The tensor-parallel entry of a plan placement as a DTensor placement (None for a partial target)."""
    tp_axis = list(plan.mesh_axis_names).index("tp") if "tp" in plan.mesh_axis_names else -1
    p = placements[tp_axis]
    if p == "R":
        return Replicate()
    if p.startswith("S"):
        return Shard(int(p[1:]))
    return None


_REDUCE_HOOKED = "_hf_colossal_auto_reduce_hooked"
"""Attribute of a module output that already carries :func:`_reduce_gradient_hook` (an identity module's output
is its input: hooked once, by the innermost module, whose placement the plan gives the value)."""


def _reduce_gradient_hook(target: Placement):
    """A gradient hook for a module output: a gradient arriving in another placement (a *partial* one above
    all) is brought to ``target``, the placement the planner prices for the gradient of this output
    (replicated, or the output's shard). Without it a partial gradient flows on through every backward op that
    is linear in it (a Llama RMSNorm's muls) and is reduced late and piecemeal (once per parameter gradient it
    reaches) instead of once where the module's output was made.

    A hook on the output itself, not an identity ``autograd.Function`` around it: a Function's output is a view
    that autograd forbids modifying in place, and models do modify module outputs in place (Falcon's
    ``mlp_output += attention_output``). A hook registered before an in-place update fires on the gradient of
    the value as the module returned it, which is the value the plan placed."""

    def hook(grad: Any) -> Any:
        if isinstance(grad, DTensor) and grad.device_mesh.ndim == 1 and grad.placements[0] != target:
            grad = grad.redistribute(grad.device_mesh, [target])
        return grad

    return hook


def _enforced(value: Any, placement: Placement) -> Any:
    """A module output redistributed to the plan's placement, with :func:`_reduce_gradient_hook` on it."""
    if not isinstance(value, DTensor) or value.device_mesh.ndim != 1:
        return value
    value = redistribute_as_planned(value, placement)
    if value.requires_grad and not getattr(value, _REDUCE_HOOKED, False):
        target = value.placements[0] if isinstance(value.placements[0], Shard) else Replicate()
        value.register_hook(_reduce_gradient_hook(target))
        setattr(value, _REDUCE_HOOKED, True)
    return value


class _RedistributeInput(torch.autograd.Function):
    """Redistribute a module input to ``placement``; in backward the gradient goes back to the input's own
    placement, except that a partial gradient stays partial (to be summed with the value's other uses and
    reduced once where the value was made, as the plan prices it)."""

    @staticmethod
    def forward(ctx: Any, value: DTensor, placement: Placement) -> DTensor:
        ctx.source = value.placements
        return value.redistribute(value.device_mesh, [placement])

    @staticmethod
    def backward(ctx: Any, grad: Any) -> tuple[Any, None]:
        if (
            isinstance(grad, DTensor)
            and not grad.placements[0].is_partial()
            and grad.placements != ctx.source
        ):
            grad = grad.redistribute(grad.device_mesh, ctx.source)
        return grad, None


def _projection_input_placement(weight: DTensor, input_dim: int, rows_are_outputs: bool) -> Placement | None:
    """The input placement the one local matmul strategy of a sharded projection weight needs, or None
    (a replicated weight has several; DTensor and the plan's output placement decide)."""
    used = weight.placements[0]
    if not isinstance(used, Shard):
        return None
    out_dim = 0 if rows_are_outputs else 1
    return Replicate() if used.dim == out_dim else Shard(input_dim - 1)


class _SharedCopies:
    """The projections of one parent module that read one value in one placement share one redistributed copy
    (q, k and v of one normed input: one gather), as the planner prices it (``SharedCost`` over sibling
    projections). The copies are dropped when the parent's forward ends: autograd keeps what backward needs,
    and a recomputed parent (activation checkpointing) makes its own copies again."""

    def __init__(self) -> None:
        self.by_input: dict[int, tuple[DTensor, dict[tuple[Placement, bool], DTensor]]] = {}

    def get(self, x: DTensor, placement: Placement) -> DTensor:
        _, made = self.by_input.setdefault(id(x), (x, {}))
        key = (placement, torch.is_grad_enabled())  # a no-grad copy is not reused by a forward that records
        if key not in made:
            made[key] = _RedistributeInput.apply(x, placement)
        return made[key]

    def clear(self, *_: Any) -> None:
        self.by_input.clear()


def _projection_input_hook(rows_are_outputs: bool, copies: _SharedCopies):
    def hook(module: nn.Module, args: Any) -> Any:
        weight = module._parameters.get("weight")
        if not args or not isinstance(weight, DTensor) or weight.device_mesh.ndim != 1:
            return None
        x = args[0]
        if not isinstance(x, DTensor) or x.device_mesh.ndim != 1:
            return None
        placement = _projection_input_placement(weight, x.dim(), rows_are_outputs)
        if placement is None or x.placements[0] == placement:
            return None
        return (copies.get(x, placement), *args[1:])

    return hook


def _projection_layout(module: nn.Module) -> bool | None:
    """True for an ``nn.Linear`` (weight ``[out, in]``), False for a ``Conv1D`` (``[in, out]``), else None."""
    dims = projection_dims(module)
    return None if dims is None else dims == (0, 1)


def enforce_projection_inputs(model: nn.Module, local_modules: Collection[str] = ()) -> int:
    """Pre-hook every ``nn.Linear`` / ``Conv1D`` of ``model`` whose weight is a DTensor so that its input is
    redistributed to what the weight's (use) placement needs, except inside ``local_modules`` (run on local
    shards). Returns the number of modules hooked."""
    count = 0
    copies_of: dict[str, _SharedCopies] = {}
    for name, module in model.named_modules():
        if inside_regions(name, local_modules):
            continue
        layout = _projection_layout(module)
        if layout is not None and isinstance(module._parameters.get("weight"), DTensor):
            parent = name.rpartition(".")[0]
            if parent not in copies_of:
                copies_of[parent] = _SharedCopies()
                model.get_submodule(parent).register_forward_hook(copies_of[parent].clear, always_call=True)
            module.register_forward_pre_hook(_projection_input_hook(layout, copies_of[parent]))
            count += 1
    return count


def _layer_norm_input_hook(module: nn.LayerNorm, args: Any) -> Any:
    """An ``nn.LayerNorm`` input sharded on a normalised dim is gathered by DTensor *inside* the op, which
    autograd does not see: the op saves the sharded input and its backward gathers it a second time. Gather it
    here, above autograd, as the plan prices it (one forward gather; the replicated gradient is sliced back)."""
    x = args[0] if args else None
    if not isinstance(x, DTensor) or x.device_mesh.ndim != 1:
        return None
    current = x.placements[0]
    if not isinstance(current, Shard) or current.dim < x.dim() - len(module.normalized_shape):
        return None
    return (_RedistributeInput.apply(x, Replicate()), *args[1:])


def enforce_layer_norm_inputs(model: nn.Module, local_modules: Collection[str] = ()) -> int:
    """Pre-hook every ``nn.LayerNorm`` of ``model`` outside ``local_modules`` with :func:`_layer_norm_input_hook`."""
    count = 0
    for name, module in model.named_modules():
        if isinstance(module, nn.LayerNorm) and not inside_regions(name, local_modules):
            module.register_forward_pre_hook(_layer_norm_input_hook)
            count += 1
    return count


def _output_hook(placement: Placement):
    def hook(module: nn.Module, args: Any, output: Any) -> Any:
        if isinstance(output, DTensor):
            return _enforced(output, placement)
        if isinstance(output, tuple) and output and isinstance(output[0], DTensor):
            return (_enforced(output[0], placement), *output[1:])
        if isinstance(output, Mapping) and output:
            key = next(iter(output.keys()))
            if isinstance(output[key], DTensor):
                output[key] = _enforced(output[key], placement)
        return output

    return hook


def _param_use_hooks(uses: dict[str, Placement]):
    """Pre-hook: swap each listed parameter for its redistributed use; post-hook: restore the parameters."""
    saved: list[dict[str, nn.Parameter]] = []

    def pre(module: nn.Module, args: Any) -> None:
        originals = {}
        for attr, placement in uses.items():
            param = module._parameters.get(attr)
            if isinstance(param, DTensor):
                originals[attr] = param
                # _parameters holds the non-leaf use for this call only (as FSDP swaps unsharded parameters)
                module._parameters[attr] = redistribute_as_planned(param, placement)
        saved.append(originals)

    def post(module: nn.Module, args: Any, output: Any) -> None:
        if saved:
            module._parameters.update(saved.pop())

    return pre, post


def _entering(value: Any, placement: Placement) -> Any:
    """A block's hidden-states input brought to ``placement`` above autograd (its gradient goes back to the
    placement it came in), unless it is there already or does not split evenly (an epoch's smaller last batch)."""
    if not isinstance(value, DTensor) or value.device_mesh.ndim != 1 or value.placements[0] == placement:
        return value
    if isinstance(placement, Shard) and (
        placement.dim >= value.dim() or value.shape[placement.dim] % value.device_mesh.size(0)
    ):
        return value
    return _RedistributeInput.apply(value, placement)


def _block_input_hook(placement: Placement):
    """Forward pre-hook of a block of a folded run (``Plan.block_input_placements``): its first input — the
    hidden states, positional or ``hidden_states=`` — enters in the placement the run's representative was planned
    to receive it in (its predecessor's output placement). Only the first block of a run moves anything: the
    embeddings it reads come replicated (or hidden-sharded), where the plan has the blocks sequence-sharded."""

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> Any:
        if args and isinstance(args[0], DTensor):
            return (_entering(args[0], placement), *args[1:]), kwargs
        if isinstance(kwargs.get("hidden_states"), DTensor):
            return args, {**kwargs, "hidden_states": _entering(kwargs["hidden_states"], placement)}
        return None

    return hook


def enforce_plan(model: nn.Module, plan: Plan, local_modules: Collection[str] = ()) -> int:
    """Register the hooks above on ``model`` (its parameters already DTensors). Returns the number of hooks.

    ``local_modules``: modules that run on local tensor shards (:mod:`.local_tensor_parallel`): no hook on
    them or inside them acts on DTensors, so none is installed there but their own output's (the region
    returns DTensors in the plan's placement; the hook reduces a partial gradient arriving at it)."""
    modules = dict(model.named_modules())
    count = 0
    by_module: dict[str, dict[str, Placement]] = {}
    for key, placements in plan.param_use_placements.items():
        module_name, _, attr = key.rpartition(".")
        placement = _tp_placement(plan, placements)
        if placement is None or module_name not in modules or inside_regions(module_name, local_modules):
            continue
        by_module.setdefault(module_name, {})[attr] = placement
    for module_name, uses in by_module.items():
        pre, post = _param_use_hooks(uses)
        modules[module_name].register_forward_pre_hook(pre)
        modules[module_name].register_forward_hook(post, always_call=True)
        count += 1
    # after the parameter-use pre-hooks: it sees weights as used
    count += enforce_projection_inputs(model, local_modules)
    count += enforce_layer_norm_inputs(model, local_modules)
    for module_name, placements in plan.activation_placements.items():
        placement = _tp_placement(plan, placements)
        if not module_name or placement is None or module_name not in modules:
            continue
        if module_name not in local_modules and inside_regions(module_name, local_modules):
            continue
        modules[module_name].register_forward_hook(_output_hook(placement))
        count += 1
    for block, placements in plan.block_input_placements.items():
        placement = _tp_placement(plan, placements)
        if placement is not None and block in modules:
            modules[block].register_forward_pre_hook(_block_input_hook(placement), with_kwargs=True)
            count += 1
    logger.debug("plan enforced by %d module hooks", count)
    return count
