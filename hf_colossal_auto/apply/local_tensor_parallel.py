"""Local tensor-parallel regions: the attention and MLP modules a plan lists run on this rank's shards.

Why: the runtime runs a tensor-parallel model on DTensors, and DTensor's dispatch costs the host tens of
microseconds per aten op (``DeviceSpec.dtensor_overhead_s``, several times an eager op's cost). Between a
column-parallel and a row-parallel projection (Megatron-LM's layout) no op needs DTensor: every value there
is this rank's slice of heads or of the intermediate features, and each op computes on it as one process
would on a smaller model. torchtitan, HF and Megatron run that stretch on local tensors (torch's
``ColwiseParallel(use_local_output=True)`` then ``RowwiseParallel``); only its two ends touch DTensor.
``Plan.local_modules`` names the modules the runtime runs so (:func:`install_local_regions`), and the planner
prices their ops without DTensor's cost.

A listed module ``M`` (its parameters already DTensors on the tensor-parallel mesh) runs as one region:

* **entry**: each DTensor input is redistributed to ``Replicate`` (an all-gather where the plan has it split
  on the sequence; nothing where it is replicated) and taken local with a ``Partial`` gradient: identity in
  forward, and in backward each rank's gradient of its shard's computation leaves as a partial sum, reduced
  where the input was made (reduce-scattered by the redistribution's backward under sequence parallelism) —
  Megatron's *f*. A plain input that needs a gradient is taken as replicated, likewise;
* **inside**: ``M``'s own forward (the HF module's code) with every parameter replaced by its local tensor
  (``to_local``, differentiable): a sharded parameter's gradient returns in its placement; a replicated one's
  (a per-head norm) as a partial sum, each rank's share from its shards (reduced by the gradient sync);
  the bias of a row-parallel projection is added as ``bias / tp`` on every rank (added once in the sum, as
  DTensor's ``Replicate -> Partial`` does) with an identity backward, its gradient the replicated output
  gradient (no reduction). No DTensor op runs inside;
* **exit**: the first output is the row-parallel projection's partial sum: ``DTensor.from_local(...,
  [Partial()])``, redistributed to the placement the plan gives ``M``'s output (``Plan.activation_placements``:
  replicated, an all-reduce; sequence-split, a reduce-scatter; partial, left to its reader as the DTensor run
  would). Other tensor outputs (attention probabilities) are this rank's heads: ``Shard(1)``. ``None`` stays.

The plan's placement hooks inside ``M`` (:func:`.enforce.enforce_plan`) are not installed: they act on DTensors.

Collectives a local region adds per forward + backward, against ``M`` on DTensors (what the planner prices):
forward, the entry's all-gather per sequence-split input and the exit's all-reduce (reduce-scatter to a
sequence split); backward, the exit's reverse (nothing after an all-reduce, an all-gather after a
reduce-scatter), the entry's reduce-scatter per sequence-split input (a replicated input's partial gradient
is reduced where it was made, one all-reduce however many projections read it), and one all-reduce per
replicated parameter of ``M`` other than a row-parallel bias (none in Llama's or GPT-2's MLP) at the gradient
sync. The DTensor run of Megatron's layout does the same.

Refused (:class:`~.plan_mismatch.PlanMismatchError`, on every rank before any collective,
:func:`check_local_modules`): a module the model lacks, nested listed modules, a layout that is not a
column-then-row pair (a parameter partial, a sharded parameter that is no projection's, a projection
sharded on neither dim in its use, no column or no row projection), attention heads a column projection would
split, context parallelism, MoE experts, dropout inside the module (its masks would repeat on every rank:
:mod:`.rng` draws per shard only for DTensors).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard

from .._torch_compat import tree_map
from ..capture.module_kinds import drawn_dropouts, projection_dims
from ..plan import Plan
from .plan_mismatch import PlanMismatchError
from .redistribute import redistribute_as_planned

logger = logging.getLogger(__name__)

_LOCAL_FQN = "_hf_colossal_auto_local_region"
"""Attribute of a module running as a local region: its FQN (the forward wrapper is installed once)."""

_SHARD, _REPLICATE, _ROW_BIAS = "shard", "replicate", "row_bias"
"""How a parameter of a local region enters it: its shard as is, replicated with a partial gradient, or
a row-parallel projection's bias added once over the ranks."""


def inside_regions(name: str, regions: Collection[str]) -> bool:
    """Whether module ``name`` is a listed region or inside one (its hooks must not run on local tensors)."""
    return any(name == r or name.startswith(f"{r}.") for r in regions)


def _tp_entry(plan: Plan, placements: list[str]) -> str:
    tp_axis = list(plan.mesh_axis_names).index("tp") if "tp" in plan.mesh_axis_names else -1
    return placements[tp_axis]


def _layout(model: nn.Module, plan: Plan, fqn: str) -> tuple[dict[str, str], dict[str, int]]:
    """(relative parameter name of ``fqn`` -> how it enters the region, relative name of each column-parallel
    ``Conv1D`` -> its local output width), after checking the plan's layout for it (raises
    :class:`PlanMismatchError` naming the module and the placements found). GPT-2's ``Conv1D`` shapes its
    output by its ``nf`` attribute (the global width), which the region sets to the local one."""
    module = model.get_submodule(fqn)
    found = {
        name: _tp_entry(plan, plan.param_placements[f"{fqn}.{name}"])
        for name, _ in module.named_parameters()
        if f"{fqn}.{name}" in plan.param_placements
    }
    described = ", ".join(f"{n}: {p}" for n, p in found.items()) or "no parameters"

    def refuse(why: str) -> PlanMismatchError:
        return PlanMismatchError(
            f"the plan runs {fqn} on local tensor shards (Plan.local_modules), but {why}; its tensor-parallel "
            f"placements are {{{described}}}. A local region needs Megatron's layout: input projections split "
            "on their output features (biases too), output projections on their input features (biases "
            "replicated), every other parameter replicated. Re-plan, or drop the module from local_modules."
        )

    kinds: dict[str, str] = {}
    widths: dict[str, int] = {}
    columns, rows = [], []
    for sub_name, sub in module.named_modules():
        dims = projection_dims(sub)
        prefix = f"{sub_name}." if sub_name else ""
        if dims is None:
            continue
        weight = found.get(f"{prefix}weight")
        out_dim, in_dim = dims
        if weight == f"S{out_dim}":
            columns.append(sub_name)
            kinds[f"{prefix}weight"] = _SHARD
            if f"{prefix}bias" in found:
                if found[f"{prefix}bias"] != "S0":
                    raise refuse(
                        f"{prefix}bias of the column-parallel {sub_name} is {found[f'{prefix}bias']}"
                    )
                kinds[f"{prefix}bias"] = _SHARD
            head_dim = getattr(module, "head_dim", None)
            local_out = sub.weight.shape[out_dim] // plan.tp_size
            if not isinstance(sub, nn.Linear):
                widths[sub_name] = local_out
            if isinstance(head_dim, int) and head_dim > 0 and local_out % head_dim:
                raise refuse(
                    f"{sub_name}'s {sub.weight.shape[out_dim]} output features split over {plan.tp_size} ranks "
                    f"give {local_out}, not whole heads of {head_dim}"
                )
        elif weight == f"S{in_dim}":
            rows.append(sub_name)
            kinds[f"{prefix}weight"] = _SHARD
            if f"{prefix}bias" in found:
                if found[f"{prefix}bias"] != "R":
                    raise refuse(f"{prefix}bias of the row-parallel {sub_name} is {found[f'{prefix}bias']}")
                kinds[f"{prefix}bias"] = _ROW_BIAS
    for name, placement in found.items():
        if name in kinds:
            continue
        if placement != "R":
            raise refuse(f"{name} is {placement} and is no projection's weight or column bias")
        kinds[name] = _REPLICATE
    for name in kinds:
        use = plan.param_use_placements.get(f"{fqn}.{name}")
        if use is not None and _tp_entry(plan, use) != found[name]:
            raise refuse(f"the plan uses {name} as {_tp_entry(plan, use)}, stored {found[name]}")
    if not columns or not rows:
        raise refuse(
            f"it has {len(columns)} column-parallel projections ({', '.join(columns) or 'none'}) and {len(rows)} "
            f"row-parallel ones ({', '.join(rows) or 'none'}), where a column-then-row pair is needed"
        )
    return kinds, widths


def check_local_modules(model: nn.Module, plan: Plan) -> None:
    """Refuse (:class:`PlanMismatchError`) a ``Plan.local_modules`` entry the runtime cannot run on local
    shards: see the module doc. Called by :func:`.runtime.validate_plan`, so that every rank raises alike
    before any collective."""
    if not plan.local_modules:
        return
    modules = dict(model.named_modules())
    for fqn in plan.local_modules:
        if fqn not in modules:
            raise PlanMismatchError(
                f"the plan runs {fqn} on local tensor shards (Plan.local_modules), but {type(model).__name__} has "
                "no such module; the plan was made for another model: re-plan for this one"
            )
        if plan.cp_size > 1:
            raise PlanMismatchError(
                f"the plan runs {fqn} on local tensor shards under context parallelism (cp_size "
                f"{plan.cp_size}), whose attention gathers keys and values over the cp ranks on DTensors; "
                "re-plan with local_modules empty, or without context parallelism"
            )
        outer = [r for r in plan.local_modules if r != fqn and fqn.startswith(f"{r}.")]
        if outer:
            raise PlanMismatchError(
                f"the plan runs {fqn} on local tensor shards inside {outer[0]}, which is listed too; list "
                "the attention and MLP modules once each (Plan.local_modules)"
            )
        module = modules[fqn]
        experts = [n for n, p in module.named_parameters() if p.dim() > 2 or n.split(".")[0] == "experts"] + [
            m for m in plan.expert_data_parallel if inside_regions(m, [fqn])
        ]
        if experts:
            raise PlanMismatchError(
                f"the plan runs {fqn} on local tensor shards, but it holds MoE experts ({experts[0]}), which "
                "run as expert regions of their own (apply/moe.py); drop it from local_modules"
            )
        dropout = drawn_dropouts(module)
        if dropout:
            raise PlanMismatchError(
                f"the plan runs {fqn} on local tensor shards, but it draws dropout ({', '.join(dropout[:3])}): "
                "on plain tensors every tensor-parallel rank would draw the same masks for its own shard (only "
                "DTensor random ops draw per shard, apply/rng.py). Set that dropout to 0, or drop the module "
                "from local_modules"
            )
        _layout(model, plan, fqn)


class _AddedOnce(torch.autograd.Function):
    """A row-parallel projection's replicated bias as each rank adds it to its partial sum: ``bias / n`` in
    forward (the ranks' sum adds it once, as DTensor's ``Replicate -> Partial`` divides it), identity in
    backward (the output's gradient is replicated, so each rank's is the whole gradient of the bias)."""

    @staticmethod
    def forward(ctx: Any, bias: torch.Tensor, n: int) -> torch.Tensor:
        return bias / n

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def _local_parameter(param: DTensor, kind: str) -> torch.Tensor:
    if kind == _SHARD:
        return param.to_local()  # the gradient returns in the parameter's own placement
    if kind == _ROW_BIAS:
        return _AddedOnce.apply(param.to_local(grad_placements=[Replicate()]), param.device_mesh.size())
    return param.to_local(grad_placements=[Partial()])


@contextmanager
def _local_parameters(
    entries: list[tuple[nn.Module, str, str]], widths: list[tuple[nn.Module, int]]
) -> Iterator[None]:
    """Each listed parameter replaced by its local tensor for its owner's forward (and each column-parallel
    ``Conv1D``'s ``nf`` by its local width), put back after. Read at call time: FSDP swaps its unsharded
    parameters (DTensors on the tensor-parallel mesh) in before each block's forward, and a recomputed block
    runs this again in backward."""
    saved: list[tuple[nn.Module, str, Any]] = []
    widened = [(conv, conv.nf) for conv, _ in widths]
    try:
        for conv, width in widths:
            conv.nf = width
        for owner, attr, kind in entries:
            param = owner._parameters.get(attr)
            if isinstance(param, DTensor):
                saved.append((owner, attr, param))
                owner._parameters[attr] = _local_parameter(param, kind)
        yield
    finally:
        for owner, attr, param in saved:
            owner._parameters[attr] = param
        for conv, width in widened:
            conv.nf = width


def _entered(value: Any, mesh: DeviceMesh) -> Any:
    """An input of the region as a local tensor, its gradient a partial sum over the tensor-parallel ranks."""
    if isinstance(value, DTensor):
        if value.device_mesh.ndim != 1:
            return value  # not an activation of the tensor-parallel mesh: left as the module would see it
        if not isinstance(value.placements[0], Replicate):
            value = value.redistribute(value.device_mesh, [Replicate()])
        return value.to_local(grad_placements=[Partial()]) if value.requires_grad else value.to_local()
    if (
        isinstance(value, torch.Tensor) and value.requires_grad
    ):  # a plain value of the group, taken replicated
        value = DTensor.from_local(value, mesh, [Replicate()], run_check=False)
        return value.to_local(grad_placements=[Partial()])
    return value


def _left(output: Any, mesh: DeviceMesh, target: Placement | None, heads: int | None, fqn: str) -> Any:
    """The region's outputs as DTensors: the first tensor a partial sum brought to ``target`` (None: left
    partial), any other this rank's heads (``Shard(1)``)."""

    def first(t: torch.Tensor) -> DTensor:
        out = DTensor.from_local(t, mesh, [Partial()], run_check=False)
        return out if target is None else redistribute_as_planned(out, target)

    def other(index: int, t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        if heads is not None and t.dim() >= 2 and t.shape[1] * mesh.size() == heads:
            return DTensor.from_local(t, mesh, [Shard(1)], run_check=False)
        raise RuntimeError(
            f"{fqn} runs on local tensor shards (Plan.local_modules) and returned a tensor of shape "
            f"{tuple(t.shape)} as output {index}, neither its projection's output nor its heads' (dim 1 of "
            f"{heads} heads over {mesh.size()} ranks); re-plan without {fqn} in local_modules"
        )

    if isinstance(output, torch.Tensor):
        return first(output)
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        rest = [other(i, t) for i, t in enumerate(output[1:], start=1)]
        return type(output)([first(output[0]), *rest])
    raise RuntimeError(
        f"{fqn} runs on local tensor shards (Plan.local_modules) and returned {type(output).__name__}, not a "
        f"tensor or a tuple starting with one; re-plan without {fqn} in local_modules"
    )


def _heads(module: nn.Module) -> int | None:
    config = getattr(module, "config", None)
    heads = getattr(config, "num_attention_heads", None) or getattr(module, "num_heads", None)
    return heads if isinstance(heads, int) else None


def local_region_forward(
    module: nn.Module,
    fqn: str,
    kinds: dict[str, str],
    widths: dict[str, int],
    mesh: DeviceMesh,
    target: Placement | None,
) -> Callable[..., Any]:
    """``module.forward`` run as a local region (module doc); ``kinds``: relative parameter name -> how it
    enters, ``widths``: relative name of a column-parallel ``Conv1D`` -> its local width, ``target``: the placement the plan gives the output on ``mesh`` (None: partial)."""
    inner = module.forward
    owners: dict[str, tuple[list[tuple[nn.Module, str, str]], list[tuple[nn.Module, int]]]] = {}
    for name, kind in kinds.items():
        owner_name, _, attr = name.rpartition(".")
        owners.setdefault(owner_name, ([], []))[0].append((module.get_submodule(owner_name), attr, kind))
    for name, width in widths.items():
        owners.setdefault(name, ([], []))[1].append((module.get_submodule(name), width))
    own_entries, own_convs = owners.pop("", ([], []))
    for owner_name, (entries, convs) in owners.items():
        owner = module.get_submodule(owner_name)
        owner.forward = _owner_forward(owner.forward, entries, convs)
    heads = _heads(module)

    @functools.wraps(inner)
    def forward(*args: Any, **kwargs: Any) -> Any:
        args, kwargs = tree_map(lambda v: _entered(v, mesh), (args, kwargs))
        with _local_parameters(own_entries, own_convs):
            output = inner(*args, **kwargs)
        return _left(output, mesh, target, heads, fqn)

    return forward


def _owner_forward(
    inner: Callable[..., Any], entries: list[tuple[nn.Module, str, str]], convs: list[tuple[nn.Module, int]]
) -> Callable[..., Any]:
    """A submodule of a region that owns some of its parameters: they are its local tensors inside its own
    forward only. Hooks that run around that forward (MemTracker's, which registers gradient hooks on the
    module's parameters; a user's) and everything outside it see the parameters themselves, leaf DTensors."""

    @functools.wraps(inner)
    def forward(*args: Any, **kwargs: Any) -> Any:
        with _local_parameters(entries, convs):
            return inner(*args, **kwargs)

    return forward


def install_local_regions(model: nn.Module, plan: Plan, tp_mesh: DeviceMesh) -> list[str]:
    """Make each module of ``plan.local_modules`` that ``model`` holds (a pipeline stage's cut model holds some)
    run as a local region on ``tp_mesh`` (the tensor-parallel sub-mesh its parameters live on; they are already
    DTensors). The plan was checked by :func:`check_local_modules`. Returns the FQNs installed."""
    modules = dict(model.named_modules())
    installed = []
    for fqn in plan.local_modules:
        module = modules.get(fqn)
        if module is None or getattr(module, _LOCAL_FQN, None) is not None:
            continue
        kinds, widths = _layout(model, plan, fqn)
        placements = plan.activation_placements.get(fqn)
        target: Placement | None = Replicate()
        if placements is not None:
            entry = _tp_entry(plan, placements)
            target = Replicate() if entry == "R" else Shard(int(entry[1:])) if entry.startswith("S") else None
        module.forward = local_region_forward(module, fqn, kinds, widths, tp_mesh, target)
        setattr(module, _LOCAL_FQN, fqn)
        installed.append(fqn)
    if installed:
        logger.info("%d modules run on local tensor shards (Plan.local_modules)", len(installed))
    return installed
