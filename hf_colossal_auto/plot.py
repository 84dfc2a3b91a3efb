"""``plot_plan``: a plan's predictions as a picture (``hf-colossal-auto plan ... --plot plan.png``).

Two panels: the per-device memory at each moment of the step the planner constrains, against the budget (the
activation peak, each recomputed block's backward, the optimizer step), and the predicted step time per block
split into compute, exposed communication and recompute. A pipeline plan the planner priced adds a third column:
each stage's seconds per micro-batch (titled with the predicted bubble) above its peak memory against the
budget, the numbers the summary's "per stage" line prints. matplotlib is optional (``pip install
'hf-colossal-auto[plot]'``); without it :class:`~hf_colossal_auto.solve.frontier.PlotUnavailableError`
says so.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .plan import Plan
from .solve.frontier import new_figure

__all__ = ["plot_plan"]

_GIB = float(1 << 30)


def _moment_label(name: str) -> str:
    kind, _, block = name.partition(":")
    if kind == "phase-peak":  # the other phase's highest point: "backward peak" / "forward peak"
        return f"{block} peak"
    short = {"activation-peak": "activation peak", "optimizer-step": "optimizer step"}.get(kind, kind)
    return f"{short} {block.rsplit('.', 1)[-1]}" if block else short


def _stage_predictions(plan: Plan) -> tuple[list[float], list[int]] | None:
    """Each stage's seconds per micro-batch and peak memory, where the planner priced the stages (a hand-made
    pipeline plan has neither): what the per-stage panels draw, or None for no such panels."""
    if plan.pp_size == 1:
        return None
    seconds = plan.solver.get("stage_s_per_micro_batch")
    peaks = plan.solver.get("stage_peak_memory_bytes")
    if not seconds or not peaks:
        return None
    return list(seconds), list(peaks)


def plot_plan(plan: Plan, path: str | Path, title: str | None = None) -> Path:
    """Write ``plan``'s predicted memory over the step and time per block as a PNG at ``path``; for a priced
    pipeline plan, each stage's time per micro-batch and peak memory too."""
    stages = _stage_predictions(plan)
    if stages is None:
        fig = new_figure("a plan", (11, 5), 110)
        mem_ax, time_ax = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    else:  # a third column, split in two: seconds and memory have their own scales
        fig = new_figure("a plan", (15, 5), 110)
        grid = fig.add_gridspec(2, 3)
        mem_ax, time_ax = fig.add_subplot(grid[:, 0]), fig.add_subplot(grid[:, 1])
        stage_time_ax = fig.add_subplot(grid[0, 2])
        _stage_panels(plan, *stages, stage_time_ax, fig.add_subplot(grid[1, 2], sharex=stage_time_ax))
    _memory_panel(plan, mem_ax)
    _time_panel(plan, time_ax)
    fig.suptitle(title or _figure_title(plan))
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    return out


def _memory_panel(plan: Plan, ax: Any) -> None:
    """The per-device memory at each moment the planner constrains, against the budget."""
    moments = plan.memory_moments or [["activation peak", plan.peak_memory_bytes]]
    xs = list(range(len(moments)))
    ax.plot(xs, [b / _GIB for _, b in moments], "-o", label="predicted per-device memory")
    ax.axhline(plan.memory_budget_bytes / _GIB, color="red", linestyle="--", label="budget")
    ax.set_xticks(xs)
    ax.set_xticklabels([_moment_label(n) for n, _ in moments], rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("GiB per device")
    ax.set_title("memory over the step", fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)


def _time_panel(plan: Plan, ax: Any) -> None:
    """The predicted step time per block: compute, exposed communication and recompute, stacked."""
    blocks = plan.blocks
    names = [b.name.rsplit(".", 1)[-1] if b.name else "(model)" for b in blocks]
    ys = list(range(len(blocks)))
    compute = [b.compute_s * 1e3 for b in blocks]
    comm = [b.communication_s * 1e3 for b in blocks]
    rerun = [b.recompute_s * 1e3 for b in blocks]
    ax.barh(ys, compute, label="compute")
    ax.barh(ys, comm, left=compute, label="exposed communication")
    ax.barh(ys, rerun, left=[a + b for a, b in zip(compute, comm, strict=True)], label="recompute")
    ax.set_yticks(ys)
    ax.set_yticklabels(names, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("ms per step")
    hidden = plan.overlapped_communication_s * 1e3
    notes = [f"{hidden:.1f} ms communication hidden"] if hidden else []
    if plan.sync_wait_s:
        notes.append(f"{plan.sync_wait_s * 1e3:.1f} ms waiting for peers")
    ax.set_title(
        f"step {plan.step_time_s * 1e3:.1f} ms" + (f" ({'; '.join(notes)})" if notes else ""),
        fontsize=9,
    )
    ax.grid(True, axis="x", alpha=0.3)
    ax.legend(fontsize=8)


def _stage_panels(plan: Plan, seconds: list[float], peaks: list[int], time_ax: Any, mem_ax: Any) -> None:
    """One bar per stage (named with the pp rank that runs it): its predicted ms per micro-batch, titled with
    the bubble, above its predicted peak memory against the budget. Why per stage: the slowest stage sets the
    pipeline's pace and the fullest one is where memory runs out, which the per-block panels hide. A rank that
    runs several stages (interleaved schedules) holds them all at once: its peak is the memory panel's."""
    xs = list(range(len(seconds)))
    time_ax.bar(xs, [s * 1e3 for s in seconds])
    time_ax.set_ylabel("ms per micro-batch", fontsize=8)
    bubble = plan.solver.get("bubble_fraction")
    time_ax.set_title(
        f"stages, {plan.schedule} x{plan.micro_batches}"
        + (f": bubble {bubble * 100:.1f}% (predicted)" if bubble is not None else ""),
        fontsize=9,
    )
    time_ax.grid(True, axis="y", alpha=0.3)
    time_ax.tick_params(labelbottom=False)
    mem_ax.bar(xs, [b / _GIB for b in peaks], color="tab:orange", label="predicted stage peak")
    mem_ax.axhline(plan.memory_budget_bytes / _GIB, color="red", linestyle="--", label="budget")
    mem_ax.set_xticks(xs)
    mem_ax.set_xticklabels(
        [f"stage {s}\nrank {r}" for s, r in zip(xs, plan.stage_ranks(), strict=True)], fontsize=7
    )
    mem_ax.set_ylabel("GiB per device", fontsize=8)
    mem_ax.grid(True, axis="y", alpha=0.3)
    mem_ax.legend(fontsize=7)


def _figure_title(plan: Plan) -> str:
    """The model, the devices, the mesh and the data-parallel mode; for a pipeline plan its stages, schedule
    and bubble (the memory panel's moments are then the pp ranks' peaks: the planner writes them so)."""
    mesh = "x".join(map(str, plan.mesh_shape))
    stages = ""
    if plan.pp_size > 1:
        bubble = plan.solver.get("bubble_fraction")
        stages = f", {plan.num_stages} stages, {plan.schedule} x{plan.micro_batches}" + (
            f", bubble {bubble * 100:.0f}%" if bubble is not None else ""
        )
    return f"{plan.model_class} on {plan.num_devices} x {plan.device}: mesh {mesh}, {plan.dp_mode}{stages}"
