"""Mixture-of-experts layers: what capture needs to trace them with static shapes, and how they are priced.

transformers 5 runs MoE experts (Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek-V3, ...) through
``transformers.integrations.moe``: tokens are sorted by expert and multiplied by the stacked expert weights
with one ``aten._grouped_mm`` per projection (``config._experts_implementation == "grouped_mm"``, the default
where the kernel exists). Every shape in that path is static — ``S = tokens x top_k`` rows, whatever the
routing — so a fake-tensor trace records exactly the ops and allocations of a real step. Two things stood in
the way, both handled here:

* torch 2.13's Meta kernel for ``_grouped_mm`` accepts bf16 only (the CUDA kernel's contract) while the CPU
  kernel runs any float dtype; :func:`enable_grouped_mm_tracing` registers a Meta kernel that allocates what
  the CPU kernel allocates (``_torch_compat.relax_grouped_mm_meta``).
* ``FlopCounterMode`` has no formula for ``_grouped_mm`` (it counts it as 0, which would make experts free in
  every plan). :func:`grouped_mm_flop` is the formula, added to ``EXTRA_FLOP_FORMULAS``.

The ``"eager"`` experts implementation loops over the experts that received tokens (``nonzero``): its shapes
depend on the routing and cannot be traced; :func:`static_experts_implementation` switches such a model to
``"grouped_mm"`` for the capture (same math, same parameters).

**Load assumption.** The grouped GEMMs' FLOPs and bytes do not depend on the routing (every one of the ``S``
rows is multiplied by exactly one expert), so capture needs none. Where a cost does depend on it — the share
of the ``S`` rows one expert-parallel rank computes — routing is assumed uniform over experts (each expert
gets ``S / num_experts`` rows); :data:`UNIFORM_LOAD` names that assumption in plans and summaries. A
measured routing histogram (:class:`RoutingLoad`, e.g. from :func:`measure_routing` on one real batch) is the
option (:data:`MEASURED_LOAD`): an expert-parallel rank then computes the rows routed to its own experts, and
the step waits for the busiest rank (:meth:`RoutingLoad.skew`).
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .._torch_compat import relax_grouped_mm_meta

logger = logging.getLogger(__name__)

UNIFORM_LOAD = "uniform"
"""The routing assumption of every MoE cost by default: each expert receives ``tokens * top_k / num_experts``
rows."""
MEASURED_LOAD = "measured"
"""The routing assumption of a plan priced with a measured :class:`RoutingLoad`: each expert receives its
measured share of the rows."""

# The CPU and CUDA kernels pad each output row to 16 bytes.
_ROW_ALIGNMENT_BYTES = 16


def grouped_mm_output_layout(
    mat_a: torch.Tensor, mat_b: torch.Tensor, offs: torch.Tensor | None, dtype: torch.dtype
) -> tuple[list[int], list[int]]:
    """``(shape, stride)`` of ``_grouped_mm(mat_a, mat_b, offs)``'s output as the kernels allocate it.

    2d x 3d (forward: tokens sorted by expert times stacked weights) -> ``(S, N)``; 2d x 2d (weight gradient,
    grouped over the shared dim) -> ``(G, M, N)``; 3d x 2d -> ``(M, N)``; 3d x 3d is a batched matmul.
    Rows are padded to 16 bytes, as the real CPU kernel pads them (a ``(6, 5)`` fp32 output has stride
    ``(8, 1)``), so the traced allocation is the real one.
    """
    a2, b2 = mat_a.dim() == 2, mat_b.dim() == 2
    if a2 and b2:
        groups = offs.size(0) if offs is not None else 1
        shape = [groups, mat_a.size(0), mat_b.size(1)]
    elif a2:
        shape = [mat_a.size(0), mat_b.size(-1)]
    elif b2:
        shape = [mat_a.size(1), mat_b.size(1)]
    else:
        shape = [mat_a.size(0), mat_a.size(1), mat_b.size(-1)]
    alignment = max(1, _ROW_ALIGNMENT_BYTES // dtype.itemsize)
    padded = -(-shape[-1] // alignment) * alignment
    stride = [shape[1] * padded, padded, 1] if len(shape) == 3 else [padded, 1]
    return shape, stride


def grouped_mm_flop(mat_a_shape, mat_b_shape, *args, out_shape=None, **kwargs) -> int:
    """FLOPs of one ``_grouped_mm`` (a multiply-add counts 2, as in ``FlopCounterMode``), from shapes.

    Every output element is one dot product over ``mat_a``'s last dim, except for 2d x 2d (the weight
    gradient), where each group's outputs sum over that group's slice of the shared dim only: all groups
    together cover it once, so the total is ``2 * M * N * K``. None of this depends on the routing.
    """
    if len(mat_a_shape) == 2 and len(mat_b_shape) == 2:
        return 2 * mat_a_shape[0] * mat_b_shape[1] * mat_a_shape[1]
    numel = 1
    for d in out_shape:
        numel *= d
    return 2 * numel * mat_a_shape[-1]


def enable_grouped_mm_tracing() -> None:
    """Make ``_grouped_mm`` traceable under fake tensors and DTensor in any float dtype (see module doc)."""
    relax_grouped_mm_meta(grouped_mm_output_layout)


def experts_modules(model: nn.Module) -> dict[str, nn.Module]:
    """FQN -> transformers MoE experts module (stacked 3-D expert weights behind a router)."""
    return {
        fqn: m
        for fqn, m in model.named_modules()
        if hasattr(m, "_is_expert_parallel") and hasattr(m, "num_experts")
    }


def expert_weight_dims(module: nn.Module, param_name: str) -> tuple[int, int] | None:
    """(output dim, input dim) of one stacked expert weight (``gate_up_proj``, ``up_proj``, ``down_proj``;
    dim 0 is the expert). transformers stores them ``(E, out, in)``, or ``(E, in, out)`` for families that
    set ``is_transposed`` (GPT-OSS). None for anything else (biases, norms)."""
    if param_name not in ("gate_up_proj", "up_proj", "down_proj"):
        return None
    param = getattr(module, param_name, None)
    if not isinstance(param, nn.Parameter) or param.dim() != 3:
        return None
    return (2, 1) if getattr(module, "is_transposed", False) else (1, 2)


def is_moe_model(model: nn.Module) -> bool:
    """True when ``model`` holds transformers MoE experts (stacked expert weights behind a router)."""
    return bool(experts_modules(model))


@contextlib.contextmanager
def static_experts_implementation(model: nn.Module) -> Iterator[None]:
    """Run the experts of ``model`` through ``grouped_mm`` while the context is open.

    ``"eager"`` experts loop over the experts the routing hit (``nonzero``), a data-dependent shape no fake
    trace can follow; ``grouped_mm`` computes the same function of the same parameters with static shapes.
    Other implementations (``batched_mm`` is static too) are left alone.
    """
    configs = {id(m.config): m.config for m in experts_modules(model).values() if getattr(m, "config", None)}
    changed = []
    for config in configs.values():
        if getattr(config, "_experts_implementation", None) in (None, "eager"):
            changed.append((config, config._experts_implementation))
            config._experts_implementation = "grouped_mm"
    if changed:
        logger.info(
            "%s: experts traced through 'grouped_mm' (the 'eager' loop has routing-dependent shapes)",
            type(model).__name__,
        )
    try:
        yield
    finally:
        for config, value in changed:
            config._experts_implementation = value


# ---------------------------------------------------------------------------------------------- routing load
@dataclass(frozen=True)
class RoutingLoad:
    """A measured routing histogram: experts module FQN -> rows routed to each of its experts.

    A row is one (token, expert) pair of the routing (``tokens x top_k`` per layer), counted over one real
    batch (:func:`measure_routing`); the counts' batch need not be the plan's, only their shares are used.
    JSON: ``{"rows_per_expert": {"model.layers.0.mlp.experts": [412, 380, ...], ...}}`` (:meth:`save`,
    :meth:`load`; the FQNs are the model's own, one entry per MoE layer, one count per expert).
    """

    rows_per_expert: Mapping[str, tuple[int, ...]]

    def __post_init__(self) -> None:
        rows: dict[str, tuple[int, ...]] = {}
        if not isinstance(self.rows_per_expert, Mapping):
            raise ValueError(
                "RoutingLoad: rows_per_expert must map each experts module FQN to its rows per expert, got "
                f"{type(self.rows_per_expert).__name__}"
            )
        for fqn, counts in self.rows_per_expert.items():
            if isinstance(counts, (str, bytes)) or not hasattr(counts, "__iter__"):
                raise ValueError(
                    f"RoutingLoad: MoE layer {fqn!r}: expected a list of rows per expert, got {counts!r}"
                )
            values = list(counts)
            bad = [c for c in values if isinstance(c, bool) or not isinstance(c, int) or c < 0]
            if bad:
                raise ValueError(
                    f"RoutingLoad: MoE layer {fqn!r} has counts {bad[:4]} that are not whole numbers >= 0; a "
                    "histogram counts the rows routed to each expert (measure_routing counts them on one batch)"
                )
            if not values or sum(values) == 0:
                raise ValueError(
                    f"RoutingLoad: MoE layer {fqn!r} routes no rows; measure it on a batch that reaches the layer"
                )
            rows[str(fqn)] = tuple(values)
        object.__setattr__(self, "rows_per_expert", rows)

    # ------------------------------------------------------------------ serialisation
    def to_dict(self) -> dict[str, Any]:
        return {"rows_per_expert": {fqn: list(c) for fqn, c in self.rows_per_expert.items()}}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RoutingLoad:
        """From :meth:`to_dict`'s form (a bare ``{fqn: counts}`` mapping is taken too)."""
        if not isinstance(data, Mapping):
            raise ValueError(f"RoutingLoad JSON must be an object, got {type(data).__name__}")
        return cls(data.get("rows_per_expert", data))

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2))

    @classmethod
    def load(cls, path: str | Path) -> RoutingLoad:
        try:
            data = json.loads(Path(path).read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not a routing histogram (JSON: {e})") from None
        return cls.from_dict(data)

    # ------------------------------------------------------------------ queries
    def check(self, model: nn.Module) -> None:
        """Refuse a histogram that is not this model's: one entry per MoE layer (its experts module FQN), one
        count per expert. The message names the layer and what to do."""
        modules = experts_modules(model)
        if not modules:
            raise ValueError(f"RoutingLoad given for {type(model).__name__}, which has no MoE layer")
        fix = (
            "measure it on this model (measure_routing(model, batch)) or give one count per expert per layer"
        )
        missing = [fqn for fqn in modules if fqn not in self.rows_per_expert]
        if missing:
            raise ValueError(
                f"RoutingLoad has no counts for MoE layer {missing[0]!r}"
                + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
                + f"; {type(model).__name__} has {len(modules)} MoE layers ({next(iter(modules))}, ...): {fix}"
            )
        extra = [fqn for fqn in self.rows_per_expert if fqn not in modules]
        if extra:
            raise ValueError(
                f"RoutingLoad names MoE layer {extra[0]!r}, which {type(model).__name__} does not have (its experts "
                f"modules are {next(iter(modules))}, ...; {len(modules)} in all): {fix}"
            )
        for fqn, module in modules.items():
            counts = self.rows_per_expert[fqn]
            if len(counts) != module.num_experts:
                raise ValueError(
                    f"RoutingLoad: MoE layer {fqn!r} has {len(counts)} counts for {module.num_experts} experts: {fix}"
                )

    def skew(self, fqn: str, ranks: int) -> float:
        """How many times the mean rank's rows the busiest of ``ranks`` expert-parallel ranks computes in layer
        ``fqn`` (1.0 under uniform routing, exactly). Rank ``r`` owns the contiguous experts
        ``[r E/n, (r+1) E/n)`` (the expert dim split as ``Shard(0)`` splits it)."""
        return busiest_rank_skew(self.rows_per_expert[fqn], ranks)

    def describe(self, ranks: int) -> str:
        """One line for a summary: the busiest expert-parallel rank's load against the mean, over the layers."""
        if ranks <= 1 or not self.rows_per_expert:
            return "measured routing histogram"
        worst = max(self.rows_per_expert, key=lambda f: self.skew(f, ranks))
        return (
            f"measured routing histogram (busiest of {ranks} expert-parallel ranks up to "
            f"{self.skew(worst, ranks):.2f}x the mean rows, in {worst})"
        )


def busiest_rank_skew(counts: tuple[int, ...] | list[int], ranks: int) -> float:
    """The busiest rank's rows over the mean rank's when ``len(counts)`` experts split ``ranks`` ways in
    contiguous blocks (exactly 1.0 when every block gets the same rows). Experts that do not divide evenly
    (no expert-parallel split exists then) or one rank give 1.0."""
    n = len(counts)
    total = sum(counts)
    if ranks <= 1 or n % ranks or total == 0:
        return 1.0
    per = n // ranks
    busiest = max(sum(counts[r * per : (r + 1) * per]) for r in range(ranks))
    return busiest * ranks / total


def measure_routing(model: nn.Module, batch: Mapping[str, Any]) -> RoutingLoad:
    """Rows per expert per MoE layer, counted on one real forward of ``model`` on ``batch`` (no gradients).

    Every transformers experts module is called as ``experts(hidden_states, top_k_index, top_k_weights)``
    with the router's choice: a hook on it counts ``top_k_index`` per expert (transformers' expert-parallel
    sentinels, ``>= num_experts``, are not counted). The model needs its real weights (the routing is a
    function of them): plan on a meta model, measure on the materialised one (or a checkpoint of the same
    configuration) and pass the result to ``plan_model(..., routing=...)``. The model's training mode is kept
    (a router's jitter noise, if any, applies as in training), and so is the random state: the forward runs on
    forked RNG, so measuring moves no job's random stream. The batch is moved to the model's device.
    """
    modules = experts_modules(model)
    if not modules:
        raise ValueError(f"measure_routing: {type(model).__name__} has no MoE layer")
    meta = next((n for n, p in model.named_parameters() if p.is_meta), None)
    if meta is not None:
        raise ValueError(
            f"measure_routing needs the model's real weights ({meta} is on the meta device): routing is a "
            "function of them. Measure on the materialised model, or load a histogram measured elsewhere "
            "(RoutingLoad.load)"
        )
    if any(isinstance(v, torch.Tensor) and v.is_meta for v in batch.values()):
        raise ValueError(
            "measure_routing needs a real batch (the inputs are on the meta device): measure with real inputs, "
            "or load a histogram measured elsewhere (RoutingLoad.load / --routing-histogram)"
        )
    device = next(p.device for p in model.parameters())
    batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    counts: dict[str, torch.Tensor] = {}

    def hook(fqn: str, module: nn.Module):
        def count(_module, args, kwargs):
            index = kwargs.get("top_k_index", args[1] if len(args) > 1 else None)
            if index is None:
                raise RuntimeError(f"measure_routing: {fqn} was called without top_k_index")
            flat = index.detach().reshape(-1).long()
            flat = flat[flat < module.num_experts]
            got = torch.bincount(flat.cpu(), minlength=module.num_experts)
            counts[fqn] = counts[fqn] + got if fqn in counts else got

        return count

    handles = [m.register_forward_pre_hook(hook(fqn, m), with_kwargs=True) for fqn, m in modules.items()]
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            model(**batch)
    finally:
        for handle in handles:
            handle.remove()
    unreached = [fqn for fqn in modules if fqn not in counts]
    if unreached:
        raise RuntimeError(f"measure_routing: the batch never reached MoE layer {unreached[0]!r}")
    return RoutingLoad({fqn: tuple(int(c) for c in counts[fqn].tolist()) for fqn in modules})
