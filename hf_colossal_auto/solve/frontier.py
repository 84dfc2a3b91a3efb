"""The step-time vs memory-budget frontier: joint sharding + recompute against fixed-recipe baselines.

Why a frontier and not one plan: the joint ILP's claim is that, at *every* per-device budget, choosing
sharding and recompute together is at least as fast as any fixed recipe that fits, and fits where the
recipes do not. One budget shows one point of that; a sweep from the smallest memory any plan needs up to
what the fastest (no-recompute) plan uses shows the whole trade-off.

Approaches (all priced by the same cost model, see :mod:`hf_colossal_auto.solve.planner`):

* ``auto``: ``plan_model(memory_budget=b)``: sharding and per-block recompute chosen jointly, one ILP;
* ``two-stage``: ``plan_model(memory_budget=b, recompute="two-stage")``: shard first, then recompute;
* ``tp-only``: Megatron-style tensor parallelism, no recompute (``evaluate_plan("megatron", recompute="none")``);
* ``tp+full-recompute``: the same with every block checkpointed;
* ``tp+sp``: Megatron-style tensor parallelism with sequence parallelism on every block, no recompute
  (``evaluate_plan("megatron-sp", recompute="none")``; not in the default set);
* ``tp-local``: Megatron-style tensor parallelism with the attention / MLP modules that qualify run on local tensor
  shards, no recompute (``evaluate_plan("megatron-local", recompute="none")``; not in the default set);
* ``fsdp+full-recompute``: FSDP over all devices with every block checkpointed.

A baseline's placements and recompute are fixed, so its time and peak do not depend on the budget: it is
priced once and either fits a budget or not. ``auto`` and ``two-stage`` are planned at each budget.
"""

from __future__ import annotations

import inspect
import logging
import math
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from torch import nn

from ..hardware import DeviceSpec, get_device
from ..plan import PIPELINE_SCHEDULES, Plan
from ..units import format_bytes, format_seconds, parse_bytes
from .planner import MEGATRON_LAYOUTS, _largest_tp, evaluate_plan, plan_model
from .problem import InfeasibleError

logger = logging.getLogger(__name__)

PLANNED = {"auto": "auto", "two-stage": "two-stage"}
"""Approaches planned at each budget -> the ``plan_model`` recompute mode."""
BASELINE_RECIPES: dict[str, tuple[str, str]] = {
    "tp-only": ("megatron", "none"),
    "tp+full-recompute": ("megatron", "full"),
    "tp+sp": ("megatron-sp", "none"),
    "tp-local": ("megatron-local", "none"),
    "fsdp+full-recompute": ("fsdp", "full"),
    "ddp": ("ddp", "none"),
    "fsdp": ("fsdp", "none"),
}
"""Fixed recipes -> (``evaluate_plan`` baseline, recompute for every block)."""
PIPELINE_RECIPES: dict[str, tuple[int, str, str, str]] = {
    "fsdp-tp-pp": (8, "interleaved-1f1b", "fsdp", "full"),
    "fsdp-tp-pp-1f1b": (8, "1f1b", "fsdp", "full"),
    "llama3-4d": (16, "interleaved-1f1b", "fsdp", "selective:pointwise"),
}
"""Pipeline hand configurations -> (pp degree wanted, schedule, data-parallel mode inside a stage, recompute for
every block), tensor parallelism the largest that fits a node with Megatron's placements, one row per
micro-batch: torchtitan's FSDP x TP x PP (pp 8, full recompute) with its interleaved 1F1B layout and with its
1F1B one (a stage a rank: a larger bubble, fewer stages' activations in flight, and on a model of few blocks a
higher pp degree), and Llama 3's 4-D layout without context parallelism (tp 8, pp 16, data parallel the rest,
interleaved 1F1B). On a smaller cluster the pp degree is the largest power of two up to the one wanted that the
devices, the blocks (the schedule's stages a rank each at least one) and the batch allow."""
APPROACHES = tuple(PLANNED) + tuple(BASELINE_RECIPES) + tuple(PIPELINE_RECIPES)
DEFAULT_APPROACHES = ("auto", "tp-only", "tp+full-recompute", "fsdp+full-recompute")
TOP_MARGIN = 1.1
"""The default sweep ends at the fastest (no-recompute) plan's peak times this, so its last point is slack."""
_UNBOUNDED = 1 << 50


class PlotUnavailableError(ImportError):
    """matplotlib is not installed: the frontier (or a plan) can still be printed, not drawn."""


def new_figure(what: str, figsize: tuple[float, float], dpi: int):
    """A matplotlib ``Figure`` on the Agg canvas (no display needed), or :class:`PlotUnavailableError` saying how
    to install matplotlib; ``what`` names what was to be drawn."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise PlotUnavailableError(
            f"Plotting {what} needs matplotlib, which is not installed: `pip install 'hf-colossal-auto[plot]'` "
            "(or `pip install matplotlib`). The table needs nothing."
        ) from exc
    fig = Figure(figsize=figsize, dpi=dpi)
    FigureCanvasAgg(fig)
    return fig


@dataclass(frozen=True)
class FrontierPoint:
    """One approach at one per-device budget. ``step_time_s`` is None when it does not fit."""

    budget_bytes: int
    step_time_s: float | None
    peak_memory_bytes: int | None
    """The approach's predicted per-device peak (a baseline's even when it does not fit; None when ``auto``
    finds no plan)."""
    mesh_shape: tuple[int, ...] | None
    dp_mode: str | None
    """The data-parallel mode as :attr:`Plan.dp_label` names it ("fsdp", "hsdp 2x4")."""
    recompute: str
    """Recompute per block, summarised (``"none"``, ``"full x36"``, ``"selective:pointwise x12, none x24"``)."""
    micro_batches: int = 1
    """Micro-batches per replica per step (gradients synchronised once)."""
    schedule: str | None = None
    """A plan with pipeline stages: its schedule (``mesh_shape`` then leads with pp); None: no stages."""

    @property
    def fits(self) -> bool:
        return self.step_time_s is not None


@dataclass
class Frontier:
    """Predicted step time against per-device memory budget, per approach (one point per budget)."""

    title: str
    budgets: list[int]
    curves: dict[str, list[FrontierPoint]]
    unavailable: dict[str, str] = field(default_factory=dict)
    """Approaches that cannot be priced for this model/batch/devices -> why."""
    min_feasible_bytes: float | None = None
    """The smallest per-device memory any joint plan needs (from the planner's infeasibility bound)."""
    no_recompute_peak_bytes: int | None = None
    """Peak of the fastest plan with no recompute at all (budget unbounded)."""

    def time_at(self, approach: str, budget: int) -> float | None:
        """``approach``'s predicted step time at one of :attr:`budgets` (None: it does not fit)."""
        return self.curves[approach][self.budgets.index(budget)].step_time_s

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def table(self) -> str:
        """Budget rows x approach columns (step time or "does not fit"), then each approach's plan."""
        names = list(self.curves)
        cells = [["budget / device", *names]]
        for i, budget in enumerate(self.budgets):
            row = [format_bytes(budget)]
            for name in names:
                point = self.curves[name][i]
                row.append(format_seconds(point.step_time_s) if point.fits else "does not fit")
            cells.append(row)
        widths = [max(len(r[c]) for r in cells) for c in range(len(cells[0]))]
        lines = [self.title, ""]
        for k, row in enumerate(cells):
            lines.append(
                "  ".join(
                    text.rjust(w) if c else text.ljust(w)
                    for c, (text, w) in enumerate(zip(row, widths, strict=True))
                )
            )
            if k == 0:
                lines.append("  ".join("-" * w for w in widths))
        lines.append("")
        lines.append(
            "plans (mesh [pp x] dp x tp, data-parallel mode [, schedule] [x micro-batches], recompute per block):"
        )
        for name in names:
            lines.extend(self._describe(name))
        for name, why in self.unavailable.items():
            lines.append(f"  {name}: not priced: {why}")
        if self.min_feasible_bytes is not None:
            lines.append(f"smallest memory any joint plan needs: {format_bytes(self.min_feasible_bytes)}")
        if self.no_recompute_peak_bytes is not None:
            lines.append(
                f"peak of the fastest plan without recompute: {format_bytes(self.no_recompute_peak_bytes)}"
            )
        lines.append("(predictions of the cost model, not measurements)")
        return "\n".join(lines)

    def _describe(self, name: str) -> list[str]:
        points = self.curves[name]
        fitting = [p for p in points if p.fits]
        if name in PLANNED:
            out = []
            for p in points:
                what = (
                    f"{_mesh_text(p)}, {p.recompute}, peak {format_bytes(p.peak_memory_bytes)}"
                    if p.fits
                    else "no plan fits"
                )
                out.append(f"  {name} @ {format_bytes(p.budget_bytes)}: {what}")
            return out
        p = points[0]
        first_fit = format_bytes(p.peak_memory_bytes) if p.peak_memory_bytes is not None else "?"
        state = f"fits from {first_fit}" if fitting else "fits none of these budgets"
        return [f"  {name}: {_mesh_text(p)}, {p.recompute}, peak {first_fit}, {state}"]

    def plot(self, path: str | Path) -> Path:
        """Write the frontier as a PNG (step time vs budget, one line per approach). Needs matplotlib; raises
        :class:`PlotUnavailableError` saying how to install it otherwise."""
        fig = new_figure("the frontier", (8, 5), 120)
        gib = float(1 << 30)
        ax = fig.add_subplot(1, 1, 1)
        for name, points in self.curves.items():
            xs = [p.budget_bytes / gib for p in points if p.fits]
            ys = [p.step_time_s * 1e3 for p in points if p.fits]
            if not xs:
                continue
            if name in PLANNED:  # auto thick underneath: where two-stage's thin line matches it, both show
                ax.plot(
                    xs,
                    ys,
                    "-o",
                    label=name,
                    drawstyle="steps-post",
                    linewidth=4 if name == "auto" else 1.5,
                    markersize=7 if name == "auto" else 4,
                    zorder=2 if name == "auto" else 3,
                )
            else:
                ax.plot(xs, ys, "--s", label=name, zorder=1)
        if self.min_feasible_bytes is not None:
            ax.axvline(
                self.min_feasible_bytes / gib, color="gray", linestyle=":", label="min memory (any plan)"
            )
        ax.set_xlabel("per-device memory budget (GiB)")
        ax.set_ylabel("predicted step time (ms)")
        ax.set_title(self.title, fontsize=9)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        out = Path(path)
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out, format="png")
        return out


def _mesh_text(point: FrontierPoint) -> str:
    if point.mesh_shape is None:
        return "-"
    micro = f" x{point.micro_batches} micro-batches" if point.micro_batches > 1 else ""
    if point.schedule is None:
        return f"{'x'.join(map(str, point.mesh_shape))} {point.dp_mode}{micro}"
    pp, *rest = point.mesh_shape  # a pipeline's: which schedule tells its recipes apart
    return f"pp {pp} x {'x'.join(map(str, rest))} {point.dp_mode}, {point.schedule}{micro}"


def summarize_recompute(plan: Plan) -> str:
    """Recompute per block in a few words: each option with how many blocks use it, most used first."""
    counts = Counter(plan.recompute.values())
    blocks = len(plan.recompute)
    if not counts or set(counts) == {"none"}:
        return "none"
    parts = [f"{opt} x{n}" for opt, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))]
    if blocks and len(parts) == 1 and counts.most_common(1)[0][1] == blocks:
        return parts[0]
    return ", ".join(parts)


def default_budgets(low: float, high: float, points: int) -> list[int]:
    """``points`` budgets spaced geometrically from ``low`` to ``high`` bytes (both ends included)."""
    if points < 2:
        raise ValueError(f"a frontier needs at least 2 budget points, got points={points}")
    if not (0 < low < high):
        raise ValueError(f"budget sweep needs 0 < low < high, got low={low}, high={high}")
    ratio = (high / low) ** (1.0 / (points - 1))
    return sorted({math.ceil(low * ratio**k) for k in range(points)})


def _kwargs_for(fn: Callable[..., Any], kwargs: Mapping[str, Any]) -> dict[str, Any]:
    accepted = inspect.signature(fn).parameters
    return {k: v for k, v in kwargs.items() if k in accepted}


def frontier(
    model: nn.Module,
    inputs: Mapping[str, Any],
    *,
    num_devices: int,
    device: str | DeviceSpec,
    budgets: Iterable[int | str] | None = None,
    points: int = 8,
    approaches: Sequence[str] = DEFAULT_APPROACHES,
    mesh_shape: tuple[int, ...] | None = None,
    progress: bool | None = None,
    title: str | None = None,
    **plan_kwargs: Any,
) -> Frontier:
    """Predicted step time of each approach at each per-device budget.

    ``budgets``: bytes or strings like ``"20GiB"``; default: ``points`` budgets spaced geometrically from the
    smallest memory any joint plan needs up to the no-recompute plan's peak x 1.1. ``mesh_shape`` fixes the
    mesh of ``auto``/``two-stage`` and the tensor-parallel size of the Megatron baselines. ``plan_kwargs`` go
    to :func:`plan_model` (and those it shares to :func:`evaluate_plan`): ``mixed_precision``, ``optimizer``,
    ``devices_per_node``, ``time_limit_s``, ``dp_modes``. ``progress``: a progress bar on stderr (None: only
    once the sweep has run a few seconds). Deterministic: the same inputs give the same frontier.
    """
    unknown = [a for a in approaches if a not in APPROACHES]
    if unknown or not approaches:
        raise ValueError(f"unknown frontier approaches {unknown}; choose from {list(APPROACHES)}")
    spec = get_device(device)
    plan_args = dict(num_devices=num_devices, device=spec, mesh_shape=mesh_shape, **plan_kwargs)
    eval_args = {k: v for k, v in _kwargs_for(evaluate_plan, plan_args).items() if k != "pipeline"}
    plan_args = _kwargs_for(plan_model, plan_args)
    bounds_needed = budgets is None
    budget_list = sorted({parse_bytes(b) for b in budgets}) if budgets is not None else []
    if budgets is not None and not budget_list:
        raise ValueError(
            "budgets is empty: give at least one per-device budget, or None for the default sweep"
        )
    planned = [a for a in approaches if a in PLANNED]
    fixed = [a for a in approaches if a in BASELINE_RECIPES or a in PIPELINE_RECIPES]
    total = (
        (2 if bounds_needed else 0)
        + len(fixed)
        + len(planned) * (points if bounds_needed else len(budget_list))
    )
    bar = _progress(total, progress)
    try:
        min_feasible: float | None = None
        top: int | None = None
        if bounds_needed:
            min_feasible, top = _bounds(model, inputs, plan_args, bar)
        if bounds_needed:
            if min_feasible is None or not math.isfinite(min_feasible):
                raise ValueError(
                    "could not find the smallest feasible memory of this model; pass budgets explicitly"
                )
            budget_list = default_budgets(min_feasible, max(top * TOP_MARGIN, min_feasible * 1.01), points)
        curves, unavailable = _baseline_curves(
            model, inputs, fixed, budget_list, eval_args, mesh_shape, plan_kwargs, spec, num_devices, bar
        )
        for name in planned:
            points_of: list[FrontierPoint] = []
            for b in budget_list:
                bar.set_description(f"{name} @ {format_bytes(b)}")
                points_of.append(_planned_point(model, inputs, b, PLANNED[name], plan_args))
                bar.update(1)
            curves[name] = points_of
    finally:
        bar.close()
    ordered = {a: curves[a] for a in approaches if a in curves}
    heading = title or f"{type(model).__name__} on {num_devices} x {spec.name}"
    return Frontier(
        title=f"Step time vs per-device memory budget: {heading}",
        budgets=budget_list,
        curves=ordered,
        unavailable=unavailable,
        min_feasible_bytes=min_feasible,
        no_recompute_peak_bytes=top,
    )


def _bounds(
    model: nn.Module, inputs: Mapping[str, Any], plan_args: Mapping[str, Any], bar: Any
) -> tuple[float | None, int]:
    """The default sweep's ends: the smallest memory any joint plan needs (None where planning does not say),
    and the no-recompute plan's peak."""
    min_feasible: float | None = None
    bar.set_description("bounds")
    try:
        plan_model(model, inputs, memory_budget=1, **plan_args)
    except InfeasibleError as exc:
        min_feasible = exc.min_required
    bar.update(1)
    top = plan_model(model, inputs, memory_budget=_UNBOUNDED, recompute="none", **plan_args).peak_memory_bytes
    bar.update(1)
    return min_feasible, top


def _baseline_curves(
    model: nn.Module,
    inputs: Mapping[str, Any],
    fixed: list[str],
    budget_list: list[int],
    eval_args: Mapping[str, Any],
    mesh_shape: tuple[int, ...] | None,
    plan_kwargs: Mapping[str, Any],
    spec: DeviceSpec,
    num_devices: int,
    bar: Any,
) -> tuple[dict[str, list[FrontierPoint]], dict[str, str]]:
    """The baselines' curves (each priced once; it fits the budgets at or above its peak), and the baselines
    that cannot run here with the reason."""
    curves: dict[str, list[FrontierPoint]] = {}
    unavailable: dict[str, str] = {}
    for name in fixed:
        bar.set_description(name)
        if name in PIPELINE_RECIPES:
            try:
                args = _pipeline_recipe_args(model, inputs, name, eval_args, plan_kwargs, spec, num_devices)
            except ValueError as exc:  # no pp degree fits this model and cluster
                unavailable[name] = str(exc)
                bar.update(1)
                continue
            baseline, recompute = "megatron", args.pop("recompute")
        else:
            baseline, recompute = BASELINE_RECIPES[name]
            args = dict(eval_args)
        if baseline in MEGATRON_LAYOUTS and mesh_shape is None and name not in PIPELINE_RECIPES:
            # evaluate_plan picks the tensor-parallel size from the device preset's devices per node and
            # ignores a devices_per_node override; pick it here from the cluster actually asked for.
            per_node = plan_kwargs.get("devices_per_node") or spec.devices_per_node
            tp = _largest_tp(num_devices, per_node, model)
            args["mesh_shape"] = (num_devices // tp, tp)
        try:
            est = evaluate_plan(model, inputs, baseline, recompute=recompute, **args)
        except ValueError as exc:  # e.g. a batch that does not split over the baseline's replicas
            unavailable[name] = str(exc)
            bar.update(1)
            continue
        summary = summarize_recompute(est.plan) if est.plan is not None else recompute
        staged = est.plan if est.plan is not None and est.plan.pp_size > 1 else None
        curves[name] = [
            FrontierPoint(
                b,
                est.step_time_s if est.peak_memory_bytes <= b else None,
                est.peak_memory_bytes,
                tuple(est.mesh_shape),
                est.dp_mode,
                summary,
                **_pipeline_fields(staged),
            )
            for b in budget_list
        ]
        bar.update(1)
    return curves, unavailable


def _pipeline_recipe_args(
    model: nn.Module,
    inputs: Mapping[str, Any],
    name: str,
    eval_args: Mapping[str, Any],
    plan_kwargs: Mapping[str, Any],
    spec: DeviceSpec,
    num_devices: int,
) -> dict[str, Any]:
    """:func:`evaluate_plan`'s arguments for a pipeline recipe on this cluster (see :data:`PIPELINE_RECIPES`);
    a ValueError names why it cannot run here."""
    from ..pipeline_layout import find_layout
    from .candidates import _global_batch

    want, schedule, dp_mode, recompute = PIPELINE_RECIPES[name]
    per_node = plan_kwargs.get("devices_per_node") or spec.devices_per_node
    blocks = find_layout(model).num_blocks
    per_rank = PIPELINE_SCHEDULES[schedule][0]  # the fewest stages a rank runs, each of a block at least
    batch = _global_batch(inputs)
    pp = want
    while pp >= 2:
        tp = _largest_tp(num_devices // pp, per_node, model) if num_devices % pp == 0 else 0
        if tp and pp * per_rank <= blocks and batch % (num_devices // (pp * tp)) == 0:
            break
        pp //= 2
    if pp < 2:
        raise ValueError(
            f"{name}: no pp degree of at least 2 fits {num_devices} devices and {blocks} blocks ({schedule} runs "
            f"{per_rank} stage{'s' * (per_rank > 1)} a rank); use more devices or a model with more blocks"
        )
    dp = num_devices // (pp * tp)
    args = dict(eval_args)
    args.update(pipeline=pp, mesh_shape=(dp, tp), schedule=schedule, recompute=recompute,
                dp_mode=dp_mode if dp > 1 else "ddp", micro_batches=batch // dp)  # fmt: skip
    return args


def _planned_point(
    model: nn.Module, inputs: Mapping[str, Any], budget: int, mode: str, plan_args: Mapping[str, Any]
) -> FrontierPoint:
    try:
        plan = plan_model(model, inputs, memory_budget=budget, recompute=mode, **plan_args)
    except InfeasibleError:
        return FrontierPoint(budget, None, None, None, None, "-")
    return FrontierPoint(
        budget,
        plan.step_time_s,
        plan.peak_memory_bytes,
        tuple(plan.mesh_shape),
        plan.dp_label,
        summarize_recompute(plan),
        plan.micro_batches,
        plan.schedule if plan.pp_size > 1 else None,
    )


def _pipeline_fields(plan: Plan | None) -> dict[str, Any]:
    """A fixed recipe's point's micro-batches and schedule where it has pipeline stages (its recipes differ by
    schedule alone); none for one without (one forward a replica, as evaluate_plan prices it)."""
    if plan is None:
        return {}
    return {"micro_batches": plan.micro_batches, "schedule": plan.schedule}


class _NoBar:
    def update(self, n: int = 1) -> None:
        pass

    def set_description(self, text: str) -> None:
        pass

    def close(self) -> None:
        pass


def _progress(total: int, progress: bool | None) -> Any:
    """A tqdm bar on stderr that appears only after a few seconds (``progress=None``), always, or never."""
    if progress is False:
        return _NoBar()
    try:
        from tqdm import tqdm
    except ImportError:  # tqdm is a dependency; a stripped install still plans
        return _NoBar()
    return tqdm(total=total, unit="plan", delay=0 if progress else 3.0, leave=False, dynamic_ncols=True)
