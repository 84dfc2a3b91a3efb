"""``plan --plot``: a plan's memory over the step and its time per block, as the Plan predicts them."""

from __future__ import annotations

import pytest

from hf_colossal_auto.cli import main
from hf_colossal_auto.hardware.catalog import STATIC_CPU_SPEC
from hf_colossal_auto.models import build_model, load_config, make_example_inputs
from hf_colossal_auto.plot import plot_plan
from hf_colossal_auto.solve.planner import evaluate_plan, plan_model

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def recomputed_plan():
    model = build_model("tiny-llama", device="meta")
    batch = make_example_inputs(model, 4, 32, device="meta")
    return plan_model(
        model, batch, num_devices=2, device=STATIC_CPU_SPEC, mesh_shape=(1, 2), recompute="full"
    )


def test_plan_carries_what_the_plot_draws(recomputed_plan):
    plan = recomputed_plan
    names = [name for name, _ in plan.memory_moments]
    assert names[0] == "activation-peak" and names[-1] == "optimizer-step"
    assert any(n.startswith("rerun:") for n in names)  # recomputed blocks have their own moments
    assert max(b for _, b in plan.memory_moments) == pytest.approx(plan.peak_memory_bytes, abs=1)
    # the step's time is its parts: compute, exposed communication, recompute, waiting for peers
    total = plan.compute_time_s + plan.communication_time_s + plan.recompute_time_s + plan.sync_wait_s
    assert total == pytest.approx(plan.step_time_s, rel=1e-9)
    assert plan.recompute_time_s > 0
    assert sum(b.recompute_s for b in plan.blocks) == pytest.approx(plan.recompute_time_s, rel=1e-9)


def _drawn(monkeypatch, plan, path):
    """``plot_plan(plan, path)`` and the matplotlib Figure it drew (kept as ``new_figure`` makes it)."""
    import hf_colossal_auto.plot as plot

    made = []
    real = plot.new_figure
    monkeypatch.setattr(plot, "new_figure", lambda *a, **k: made.append(real(*a, **k)) or made[-1])
    out = plot_plan(plan, path)
    (figure,) = made
    return out, figure


def test_plot_shows_the_budget_the_memory_peak_and_one_bar_per_block(recomputed_plan, tmp_path, monkeypatch):
    """What the PNG shows, read from the figure: the memory panel's curve has one point per moment the plan
    constrains and peaks at the plan's predicted peak, under a budget line at the plan's budget; the time
    panel has one bar per block in each of compute, exposed communication and recompute, named by block, whose
    widths are the blocks' times (the recompute bars summing to the plan's recompute time)."""
    plan = recomputed_plan
    out, figure = _drawn(monkeypatch, plan, tmp_path / "sub" / "plan.png")
    assert out.read_bytes()[:8] == PNG_MAGIC
    gib = float(1 << 30)
    memory, time = figure.axes
    (curve,) = [line for line in memory.get_lines() if line.get_label() == "predicted per-device memory"]
    (budget,) = [line for line in memory.get_lines() if line.get_label() == "budget"]
    assert len(curve.get_ydata()) == len(plan.memory_moments)
    assert max(curve.get_ydata()) * gib == pytest.approx(plan.peak_memory_bytes, abs=1)
    assert list(budget.get_ydata()) == pytest.approx([plan.memory_budget_bytes / gib] * 2, rel=1e-12)
    assert max(curve.get_ydata()) <= budget.get_ydata()[0]  # the plan fits its budget, and the figure says so
    labels = [t.get_text() for t in time.get_yticklabels()]
    assert labels == [b.name.rsplit(".", 1)[-1] if b.name else "(model)" for b in plan.blocks]
    compute, communication, rerun = time.containers
    for bars, field in ((compute, "compute_s"), (communication, "communication_s"), (rerun, "recompute_s")):
        assert [bar.get_width() for bar in bars] == pytest.approx(
            [getattr(b, field) * 1e3 for b in plan.blocks]
        )
    assert sum(bar.get_width() for bar in rerun) == pytest.approx(plan.recompute_time_s * 1e3, rel=1e-9)
    assert sum(bar.get_width() for bar in rerun) > 0


def test_cli_plan_plot(tmp_path, capsys):
    png = tmp_path / "plan.png"
    argv = ["-q", "plan", "--model", "tiny-gpt2", "--batch-size", "4", "--seq-len", "32", "--devices", "2"]
    argv += ["--device", "cpu", "--no-baselines", "--plot", str(png)]
    assert main(argv) == 0
    assert png.read_bytes()[:8] == PNG_MAGIC
    assert "wrote" in capsys.readouterr().out


@pytest.fixture(scope="module")
def pipeline_plan():
    """pp 2 on 2 devices, ZB-V: 4 stages, two a rank in a V (ranks 0, 1, 1, 0, so a stage's rank is not its
    index), priced by the planner's pipeline model with each stage's seconds per micro-batch and peak."""
    config = load_config("tiny-llama")
    config.num_hidden_layers = 4
    model = build_model(config, device="meta")
    batch = make_example_inputs(model, 8, 16, device="meta")
    zbv = dict(pipeline=2, mesh_shape=(1, 1), schedule="zbv", micro_batches=4)
    return evaluate_plan(model, batch, "ddp", num_devices=2, device=STATIC_CPU_SPEC, **zbv).plan


def test_pipeline_plot_adds_per_stage_time_and_memory_panels(pipeline_plan, tmp_path, monkeypatch):
    """A pipeline plan's figure keeps the memory and per-block time panels and adds two per-stage panels:
    one bar per stage of its predicted ms per micro-batch, titled with the predicted bubble, and one bar per
    stage of its predicted peak under the budget line, each stage named with the pp rank that runs it."""
    plan = pipeline_plan
    seconds, peaks = plan.solver["stage_s_per_micro_batch"], plan.solver["stage_peak_memory_bytes"]
    assert plan.pp_size == 2 and len(seconds) == len(peaks) == plan.num_stages == 4
    out, figure = _drawn(monkeypatch, plan, tmp_path / "pp.png")
    assert out.read_bytes()[:8] == PNG_MAGIC
    memory, time, stage_time, stage_memory = figure.axes
    (curve,) = [line for line in memory.get_lines() if line.get_label() == "predicted per-device memory"]
    assert len(curve.get_ydata()) == len(plan.memory_moments)  # the pp ranks' peaks, as before
    assert len(time.get_yticklabels()) == len(plan.blocks)
    gib = float(1 << 30)
    (time_bars,) = stage_time.containers
    assert [bar.get_height() for bar in time_bars] == pytest.approx([s * 1e3 for s in seconds], rel=1e-12)
    assert f"bubble {plan.solver['bubble_fraction'] * 100:.1f}%" in stage_time.get_title()
    (peak_bars,) = stage_memory.containers
    assert [bar.get_height() * gib for bar in peak_bars] == pytest.approx(peaks, abs=1)
    (budget,) = [line for line in stage_memory.get_lines() if line.get_label() == "budget"]
    assert list(budget.get_ydata()) == pytest.approx([plan.memory_budget_bytes / gib] * 2, rel=1e-12)
    labels = [t.get_text() for t in stage_memory.get_xticklabels()]
    assert labels == [f"stage {s}\nrank {r}" for s, r in enumerate(plan.stage_ranks())]
