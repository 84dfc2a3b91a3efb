"""The step-time vs budget frontier: auto against the fixed recipes, its table, plot and CLI."""

from __future__ import annotations

import importlib.util
import sys

import pytest

from hf_colossal_auto.models import build_model, make_example_inputs
from hf_colossal_auto.solve.frontier import (
    TOP_MARGIN,
    PlotUnavailableError,
    default_budgets,
    frontier,
)

REL_TOL = 1e-9
MATPLOTLIB_MODULES = ("matplotlib", "matplotlib.figure", "matplotlib.backends.backend_agg")


def _tiny():
    model = build_model("tiny-llama", device="meta")
    return model, make_example_inputs(model, 4, 64, device="meta")


@pytest.fixture(scope="module")
def front():
    """Tiny Llama on 2 CPU devices in one node (so Megatron is tensor-parallel over both), the default sweep;
    auto chooses among every mesh, as the baselines' meshes are among them. The batch in one piece
    (micro_batches=1): a sweep down to what micro-batches reach doubles this fixture's time, and micro-batching
    has its own tests (test_planner.py, test_micro_batches.py)."""
    model, batch = _tiny()
    return frontier(
        model,
        batch,
        num_devices=2,
        device="cpu",
        devices_per_node=2,
        points=3,
        progress=False,
        micro_batches=1,
    )


def test_sweep_spans_min_memory_to_no_recompute_peak(front):
    assert front.budgets[0] == pytest.approx(front.min_feasible_bytes, abs=1)
    assert front.budgets[-1] == pytest.approx(front.no_recompute_peak_bytes * TOP_MARGIN, abs=1)
    assert list(front.curves) == ["auto", "tp-only", "tp+full-recompute", "fsdp+full-recompute"]
    assert all(len(points) == len(front.budgets) for points in front.curves.values())
    top = front.curves["auto"][-1]
    assert top.fits and top.recompute == "none"  # slack budget: the fastest plan recomputes nothing


def test_auto_never_slower_than_a_baseline_that_fits(front):
    compared = 0
    for name, points in front.curves.items():
        if name == "auto":
            continue
        for auto, base in zip(front.curves["auto"], points, strict=True):
            if base.fits:
                assert base.peak_memory_bytes <= base.budget_bytes
                assert auto.fits, f"auto found no plan at {auto.budget_bytes} B where {name} fits"
                assert auto.step_time_s <= base.step_time_s * (1 + REL_TOL), (name, auto, base)
                compared += 1
    assert compared > 0


def test_auto_time_non_increasing_with_budget(front):
    times = [p.step_time_s for p in front.curves["auto"]]
    assert times[0] is not None, "auto must fit at the smallest memory it reported as feasible"
    for smaller, larger in zip(times, times[1:], strict=False):
        assert larger <= smaller * (1 + REL_TOL)
    assert times[-1] < times[0]  # the sweep shows a trade-off, not a flat line


def test_baselines_are_budget_independent(front):
    for name in ("tp-only", "tp+full-recompute", "fsdp+full-recompute"):
        points = front.curves[name]
        assert len({p.peak_memory_bytes for p in points}) == 1
        for p in points:
            assert p.fits == (p.peak_memory_bytes <= p.budget_bytes)
    assert front.curves["tp-only"][0].mesh_shape == (1, 2)  # Megatron over both devices of the node
    assert front.curves["tp-only"][0].recompute == "none"
    assert front.curves["tp+full-recompute"][0].recompute.startswith("full")
    assert front.curves["fsdp+full-recompute"][0].dp_mode == "fsdp"


def test_table_renders_every_budget_and_approach(front):
    text = front.table()
    for name in front.curves:
        assert name in text
    lines = text.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("budget / device"))
    rows = lines[header + 2 : header + 2 + len(front.budgets)]
    assert len(rows) == len(front.budgets)
    fits = sum(p.fits for points in front.curves.values() for p in points)
    cells = len(front.budgets) * len(front.curves)
    assert text.count("does not fit") >= cells - fits
    assert "predictions" in text


def test_plot_written_when_matplotlib_present(front, tmp_path):
    assert importlib.util.find_spec("matplotlib") is not None, "the test extra installs matplotlib"
    out = front.plot(tmp_path / "sub" / "frontier.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_explains_missing_matplotlib(front, tmp_path, monkeypatch):
    for name in MATPLOTLIB_MODULES:
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(PlotUnavailableError, match="pip install"):
        front.plot(tmp_path / "frontier.png")
    assert not (tmp_path / "frontier.png").exists()


def test_default_budgets_and_bad_input():
    budgets = default_budgets(100, 1600, 5)
    assert budgets == [100, 200, 400, 800, 1600]
    with pytest.raises(ValueError, match="at least 2"):
        default_budgets(100, 1600, 1)
    model, batch = _tiny()
    with pytest.raises(ValueError, match="unknown frontier approaches"):
        frontier(model, batch, num_devices=2, device="cpu", approaches=("auto", "magic"))
    with pytest.raises(ValueError, match="empty"):
        frontier(model, batch, num_devices=2, device="cpu", budgets=[])


def test_cli_frontier_without_matplotlib(tmp_path, monkeypatch, capsys):
    from hf_colossal_auto.cli import main

    for name in MATPLOTLIB_MODULES:
        monkeypatch.setitem(sys.modules, name, None)
    png = tmp_path / "frontier.png"
    argv = ["-q", "plan", "--model", "tiny-llama", "--devices", "2", "--device", "cpu", "--batch-size", "4"]
    argv += ["--seq-len", "64", "--mesh", "1x2", "--frontier", "--frontier-points", "2", "--plot", str(png)]
    assert main([*argv, "--no-baselines"]) == 0  # the baselines' columns are the fixture's tests
    captured = capsys.readouterr()
    assert "Step time vs per-device memory budget: tiny-llama, batch 4x64, 2 x cpu" in captured.out
    assert "auto @" in captured.out and "tp-only" not in captured.out
    assert "no plot written" in captured.err and "matplotlib" in captured.err
    assert not png.exists()


def test_cli_frontier_refuses_conflicting_flags(capsys):
    from hf_colossal_auto.cli import main

    base = ["-q", "plan", "--model", "tiny-gpt2", "--devices", "2", "--device", "cpu"]
    assert main([*base, "--frontier", "--memory-budget", "1GiB"]) == 2
    assert "--memory-budget" in capsys.readouterr().err


def test_auto_point_of_a_pipeline_plan_names_its_stages_and_schedule():
    """Where auto plans stages (``--frontier --pipeline 2``), its point carries the plan's schedule and
    micro-batches, and the table writes its mesh as pp x dp x tp with the schedule, as for the recipes."""
    from hf_colossal_auto.solve.frontier import Frontier, _planned_point
    from hf_colossal_auto.solve.pipeline.schedules import OFFERED_SCHEDULES

    model = build_model("tiny-llama", device="meta")
    batch = make_example_inputs(model, 8, 16, device="meta")
    point = _planned_point(model, batch, 1 << 30, "auto", dict(num_devices=2, device="cpu", pipeline=2))
    assert point.fits and point.mesh_shape == (2, 1, 1) and point.schedule in OFFERED_SCHEDULES
    assert point.micro_batches >= 2  # at least a micro-batch a stage
    table = Frontier("t", [1 << 30], {"auto": [point]}).table()
    assert (
        f"auto @ 1.00 GiB: pp 2 x 1x1 ddp, {point.schedule} x{point.micro_batches} micro-batches, none"
        in table
    )
