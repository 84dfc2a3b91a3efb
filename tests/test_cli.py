"""Every CLI subcommand the README shows, run as a user runs it (``hf-colossal-auto <command>`` through
``cli.main``): what it prints and what it writes. ``calibrate`` is in test_calibration.py, ``launch``'s config
split in test_accelerate_plugin.py, ``plan --frontier`` in test_frontier.py, ``plan --plot`` in test_plot.py."""

from __future__ import annotations

import json

import pytest

from hf_colossal_auto.cli import main
from hf_colossal_auto.hardware import list_devices
from hf_colossal_auto.models import build_model, list_presets, make_example_inputs
from hf_colossal_auto.plan import Plan
from hf_colossal_auto.profile import profile_model

TINY = ["--model", "tiny-llama", "--batch-size", "4", "--seq-len", "32", "--device", "cpu"]


def test_profile_prints_the_report_and_writes_its_json(tmp_path, capsys):
    path = tmp_path / "profile.json"
    assert main(["-q", "profile", *TINY, "--json", str(path)]) == 0
    printed = capsys.readouterr().out
    written = json.loads(path.read_text())
    model = build_model("tiny-llama", device="meta")
    report = profile_model(
        model, make_example_inputs(model, 4, 32, device="meta"), device="cpu", optimizer="adamw"
    )
    assert written["model_class"] == "LlamaForCausalLM" and written["input_shapes"]["input_ids"] == [4, 32]
    assert (written["total_flops"], written["peak_memory_bytes"]) == (
        report.total_flops,
        report.peak_memory_bytes,
    )
    assert "LlamaForCausalLM" in printed and f"wrote {path}" in printed


def test_plan_prints_the_summary_and_baselines_and_writes_a_plan_that_loads(tmp_path, capsys):
    path = tmp_path / "plan.json"
    assert main(["-q", "plan", *TINY, "--devices", "2", "--out", str(path)]) == 0
    printed = capsys.readouterr().out
    plan = Plan.load(path)
    assert plan.model_class == "LlamaForCausalLM" and plan.num_devices == 2
    assert "Plan for LlamaForCausalLM" in printed
    for baseline in ("ddp", "fsdp", "megatron", "megatron-sp", "megatron-local", "megatron-sp-local"):
        assert f"  {baseline} " in printed


def test_plan_with_an_impossible_budget_is_an_error_naming_the_minimum(capsys):
    assert main(["-q", "plan", *TINY, "--devices", "2", "--memory-budget", "1KiB", "--no-baselines"]) == 2
    assert "smallest per-device memory any plan needs" in capsys.readouterr().err


def test_devices_and_presets_list_every_name(capsys):
    assert main(["devices"]) == 0
    devices = capsys.readouterr().out
    assert all(name in devices for name in list_devices())
    assert main(["presets"]) == 0
    assert capsys.readouterr().out.split() == list_presets()


@pytest.mark.slow
def test_demo_plans_gpt2_xl_for_eight_a100s_with_and_without_a_budget(capsys, monkeypatch):
    """``demo --max-steps 0``: the two plans of ``make demo`` (the training run is the recipes' tests'); the
    budgeted one was made for 8 GiB and its predicted peak fits it (where the unbudgeted plan's does not:
    the budget changed the plan), and the summary printed is that plan's."""
    from hf_colossal_auto.solve import planner

    made = []
    real = planner.plan_model
    monkeypatch.setattr(planner, "plan_model", lambda *a, **k: made.append(real(*a, **k)) or made[-1])
    assert main(["-q", "demo", "--max-steps", "0"]) == 0
    printed = capsys.readouterr().out
    assert printed.count("Plan for GPT2LMHeadModel") == 2
    assert "--memory-budget 8GiB" in printed
    free, budgeted = made
    assert budgeted.memory_budget_bytes == 8 * 2**30
    assert budgeted.peak_memory_bytes <= 8 * 2**30 < free.peak_memory_bytes
    assert budgeted.summary() in printed


def test_launch_dry_run_prints_the_accelerate_command(tmp_path, capsys):
    config = tmp_path / "combined.yaml"
    config.write_text("distributed_type: NO\nnum_processes: 1\nauto_parallel:\n  mesh_shape: 1x1\n")
    assert main(["launch", "--config", str(config), "--dry-run", "train.py", "--lr", "1"]) == 0
    printed = capsys.readouterr().err  # the command goes to stderr, beside the launched job's own output
    assert "accelerate" in printed and "hf_colossal_auto.run train.py --lr 1" in printed


@pytest.mark.slow
def test_launch_runs_the_script_with_its_auto_parallel_settings(tmp_path):
    """``hf-colossal-auto launch --config combined.yaml train.py``: accelerate launches the script (one process
    here), whose ``Accelerator`` is ours and whose plugin reads the ``auto_parallel:`` section."""
    config = tmp_path / "combined.yaml"
    config.write_text("distributed_type: NO\nnum_processes: 1\nauto_parallel:\n  memory_budget: 3GiB\n")
    out = tmp_path / "seen.json"
    script = tmp_path / "train.py"
    script.write_text(
        "import json, sys\n"
        "from accelerate import Accelerator\n"
        "from hf_colossal_auto import AutoParallelPlugin\n"
        "accelerator = Accelerator()\n"
        f"json.dump([type(accelerator).__name__, AutoParallelPlugin().memory_budget, sys.argv[1:]], open({str(out)!r}, 'w'))\n"
    )
    assert main(["launch", "--config", str(config), str(script), "--lr", "1"]) == 0
    assert json.loads(out.read_text()) == ["AutoParallelAccelerator", 3 * 2**30, ["--lr", "1"]]
