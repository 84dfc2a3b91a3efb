"""The step-time vs budget frontier: auto against the fixed recipes, its table, plot and CLI."""

from __future__ import annotations

import importlib.util
import sys

import pytest

from hf_colossal_auto.models import build_model, load_config, make_example_inputs
from hf_colossal_auto.solve.frontier import (
    DEFAULT_APPROACHES,
    PIPELINE_RECIPES,
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


@pytest.fixture(scope="module")
def pipeline_front():
    """The pipeline recipes alone, at a budget nothing fits and one everything does: tiny Llama with 4 blocks on
    8 CPU devices, 2 a node (so tensor parallelism is 2 wide), batch 8 x 16. Interleaved 1F1B runs two stages a
    rank, so 4 blocks allow it pp 2 (dp 2, FSDP); 1F1B runs one, so torchtitan's 1F1B layout reaches pp 4."""
    config = load_config("tiny-llama")
    config.num_hidden_layers = 4
    model = build_model(config, device="meta")
    batch = make_example_inputs(model, 8, 16, device="meta")
    return frontier(model, batch, num_devices=8, device="cpu", devices_per_node=2, budgets=["1KiB", "1GiB"],
                    approaches=tuple(PIPELINE_RECIPES), progress=False)  # fmt: skip


def test_frontier_prices_every_pipeline_recipe(pipeline_front):
    """Each pipeline hand configuration (torchtitan's FSDP x TP x PP interleaved and 1F1B, Llama 3's 4-D) gets a
    point per budget, priced by the pipeline model: its layout (pp x dp x tp, FSDP where dp > 1), schedule,
    micro-batches (a row each) and recompute, a predicted step time where it fits its budget and none where it
    does not; the table tells the two torchtitan layouts apart by their mesh and schedule."""
    front = pipeline_front
    assert list(front.curves) == ["fsdp-tp-pp", "fsdp-tp-pp-1f1b", "llama3-4d"] and not front.unavailable
    layouts = {
        "fsdp-tp-pp": ((2, 2, 2), "fsdp", "interleaved-1f1b", 4, "full x4"),
        "fsdp-tp-pp-1f1b": ((4, 1, 2), "ddp", "1f1b", 8, "full x4"),
        "llama3-4d": ((2, 2, 2), "fsdp", "interleaved-1f1b", 4, "selective:pointwise x4"),
    }
    for name, points in front.curves.items():
        tight, roomy = points
        for p in points:
            assert (p.mesh_shape, p.dp_mode, p.schedule, p.micro_batches, p.recompute) == layouts[name]
            assert p.fits == (p.peak_memory_bytes <= p.budget_bytes)
        assert not tight.fits and tight.step_time_s is None and tight.peak_memory_bytes > 1024
        assert roomy.fits and roomy.step_time_s > 0 and roomy.peak_memory_bytes == tight.peak_memory_bytes
    assert front.time_at("fsdp-tp-pp", 1 << 30) != front.time_at("fsdp-tp-pp-1f1b", 1 << 30)
    text = front.table()
    assert "  fsdp-tp-pp: pp 2 x 2x2 fsdp, interleaved-1f1b x4 micro-batches, full x4, peak" in text
    assert "  fsdp-tp-pp-1f1b: pp 4 x 1x2 ddp, 1f1b x8 micro-batches, full x4, peak" in text


def test_cli_frontier_with_pipeline_hands_over_the_pipeline_recipes(monkeypatch, capsys):
    """``plan --frontier --pipeline auto`` sweeps with stages searched and adds every pipeline recipe to auto and
    the baselines, and prints each priced or why not: on tiny Llama's 2 blocks over 2 devices torchtitan's 1F1B
    layout is pp 2, the interleaved ones (two stages a rank) do not fit and say so. Only the recipes are priced
    here, at two budgets (auto's sweep under stages takes half a minute; the fixtures test auto and baselines)."""
    from hf_colossal_auto.cli import main
    from hf_colossal_auto.solve import frontier as module

    real, asked = module.frontier, {}

    def recipes_only(model, batch, **kwargs):
        asked.update(kwargs)
        return real(model, batch, **{**kwargs, "approaches": tuple(PIPELINE_RECIPES), "budgets": ["1GiB"]})

    monkeypatch.setattr(module, "frontier", recipes_only)
    argv = ["-q", "plan", "--model", "tiny-llama", "--devices", "2", "--device", "cpu", "--batch-size", "4"]
    assert main([*argv, "--seq-len", "16", "--frontier", "--pipeline", "auto"]) == 0
    assert asked["approaches"] == (*DEFAULT_APPROACHES, *PIPELINE_RECIPES) and asked["pipeline"] is None
    out = capsys.readouterr().out
    assert "  fsdp-tp-pp-1f1b: pp 2 x 1x1 ddp, 1f1b x4 micro-batches, full x2, peak" in out
    for name in ("fsdp-tp-pp", "llama3-4d"):
        assert f"  {name}: not priced: {name}: no pp degree of at least 2 fits 2 devices and 2 blocks" in out


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
