"""``plan --plot``: a plan's memory over the step and its time per block, as the Plan predicts them."""

from __future__ import annotations

import pytest

from hf_colossal_auto.cli import main
from hf_colossal_auto.hardware.catalog import STATIC_CPU_SPEC
from hf_colossal_auto.models import build_model, make_example_inputs
from hf_colossal_auto.plot import plot_plan
from hf_colossal_auto.solve.planner import plan_model

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


def test_plot_plan_writes_a_png(recomputed_plan, tmp_path):
    out = plot_plan(recomputed_plan, tmp_path / "sub" / "plan.png")
    assert out.read_bytes()[:8] == PNG_MAGIC


def test_cli_plan_plot(tmp_path, capsys):
    png = tmp_path / "plan.png"
    argv = ["-q", "plan", "--model", "tiny-gpt2", "--batch-size", "4", "--seq-len", "32", "--devices", "2"]
    argv += ["--device", "cpu", "--no-baselines", "--plot", str(png)]
    assert main(argv) == 0
    assert png.read_bytes()[:8] == PNG_MAGIC
    assert "wrote" in capsys.readouterr().out
