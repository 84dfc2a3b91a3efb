"""``plot_plan``: a plan's predictions as a picture (``hf-colossal-auto plan ... --plot plan.png``).

Two panels: the per-device memory at each moment of the step the planner constrains, against the budget (the
activation peak, each recomputed block's backward, the optimizer step), and the predicted step time per block
split into compute, exposed communication and recompute. matplotlib is optional (``pip install
'hf-colossal-auto[plot]'``); without it :class:`~hf_colossal_auto.solve.frontier.PlotUnavailableError`
says so.
"""

from __future__ import annotations

from pathlib import Path

from .plan import Plan
from .solve.frontier import new_figure

__all__ = ["plot_plan"]


def _moment_label(name: str) -> str:
    kind, _, block = name.partition(":")
    if kind == "phase-peak":  # the other phase's highest point: "backward peak" / "forward peak"
        return f"{block} peak"
    short = {"activation-peak": "activation peak", "optimizer-step": "optimizer step"}.get(kind, kind)
    return f"{short} {block.rsplit('.', 1)[-1]}" if block else short


def plot_plan(plan: Plan, path: str | Path, title: str | None = None) -> Path:
    """Write ``plan``'s predicted memory over the step and time per block as a PNG at ``path``."""
    fig = new_figure("a plan", (11, 5), 110)
    gib = float(1 << 30)
    mem_ax, time_ax = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)

    moments = plan.memory_moments or [["activation peak", plan.peak_memory_bytes]]
    xs = list(range(len(moments)))
    mem_ax.plot(xs, [b / gib for _, b in moments], "-o", label="predicted per-device memory")
    mem_ax.axhline(plan.memory_budget_bytes / gib, color="red", linestyle="--", label="budget")
    mem_ax.set_xticks(xs)
    mem_ax.set_xticklabels([_moment_label(n) for n, _ in moments], rotation=60, ha="right", fontsize=7)
    mem_ax.set_ylabel("GiB per device")
    mem_ax.set_title("memory over the step", fontsize=9)
    mem_ax.grid(True, alpha=0.3)
    mem_ax.legend(fontsize=8)

    blocks = plan.blocks
    names = [b.name.rsplit(".", 1)[-1] if b.name else "(model)" for b in blocks]
    ys = list(range(len(blocks)))
    compute = [b.compute_s * 1e3 for b in blocks]
    comm = [b.communication_s * 1e3 for b in blocks]
    rerun = [b.recompute_s * 1e3 for b in blocks]
    time_ax.barh(ys, compute, label="compute")
    time_ax.barh(ys, comm, left=compute, label="exposed communication")
    time_ax.barh(ys, rerun, left=[a + b for a, b in zip(compute, comm, strict=True)], label="recompute")
    time_ax.set_yticks(ys)
    time_ax.set_yticklabels(names, fontsize=7)
    time_ax.invert_yaxis()
    time_ax.set_xlabel("ms per step")
    hidden = plan.overlapped_communication_s * 1e3
    notes = [f"{hidden:.1f} ms communication hidden"] if hidden else []
    if plan.sync_wait_s:
        notes.append(f"{plan.sync_wait_s * 1e3:.1f} ms waiting for peers")
    time_ax.set_title(
        f"step {plan.step_time_s * 1e3:.1f} ms" + (f" ({'; '.join(notes)})" if notes else ""),
        fontsize=9,
    )
    time_ax.grid(True, axis="x", alpha=0.3)
    time_ax.legend(fontsize=8)

    mesh = "x".join(map(str, plan.mesh_shape))
    stages = ""
    if plan.pp_size > 1:  # the memory panel's moments are the pp ranks' peaks (the planner writes them so)
        bubble = plan.solver.get("bubble_fraction")
        stages = f", {plan.num_stages} stages, {plan.schedule} x{plan.micro_batches}" + (
            f", bubble {bubble * 100:.0f}%" if bubble is not None else ""
        )
    fig.suptitle(
        title
        or f"{plan.model_class} on {plan.num_devices} x {plan.device}: mesh {mesh}, {plan.dp_mode}{stages}"
    )
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    return out
