"""AutoParallelAccelerator plans from the model's first call when the loader's batches are tuples (and with
gradient accumulation, as micro-batches)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torchrun_launch import accelerate_launch_command, why_it_failed

from hf_colossal_auto.integrations.first_call import named_arguments

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = str(ROOT / "tests" / "multiproc" / "check_accelerate_tuples.py")


def test_named_arguments_reads_a_call_as_keyword_arguments():
    def forward(input_ids, attention_mask=None, labels=None, **kwargs):
        return None

    x = torch.zeros(2, 3)
    assert named_arguments(forward, (x,), {"labels": x, "return_dict": True}) == {
        "input_ids": x,
        "labels": x,
        "return_dict": True,
    }

    def varargs(*tensors):
        return None

    with pytest.raises(TypeError, match="no names to plan with; pass them as keyword arguments"):
        named_arguments(varargs, (x,), {})


def _env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env = {
        k: v for k, v in env.items() if not k.startswith("HF_COLOSSAL_AUTO_") or k.endswith("NO_CALIBRATE")
    }
    return {**env, **extra}


def _launch(out: Path, *args: str, **extra: str) -> subprocess.CompletedProcess:
    cmd = accelerate_launch_command("-m", "hf_colossal_auto.run", SCRIPT, "--out", str(out), *args)
    env = _env(ACCELERATE_USE_CPU="1", **extra)
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)


@pytest.mark.slow
def test_tuple_batches_train_under_a_tensor_parallel_plan_like_one_process(tmp_path):
    """``TensorDataset`` batches, ``model(input_ids=x, labels=x)``, 2 gloo processes through
    ``hf_colossal_auto.run`` on a 1x2 plan made from the first training call: an evaluation before it (unplanned),
    the training losses and an evaluation after it equal one process's on the same global batches, and
    ``gather_for_metrics`` collects every sample once."""
    ref = subprocess.run(
        [sys.executable, SCRIPT, "--out", str(tmp_path / "ref")],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert ref.returncode == 0, why_it_failed(ref)
    par = _launch(tmp_path / "par", HF_COLOSSAL_AUTO_MESH_SHAPE="1x2")
    assert par.returncode == 0, why_it_failed(par)
    assert par.stdout.count("Plan for LlamaForCausalLM on 2 x cpu: mesh dp=1 x tp=2") == 1
    one = json.loads((tmp_path / "ref" / "result.json").read_text())
    two = json.loads((tmp_path / "par" / "result.json").read_text())
    assert two["processes"] == 2 and two["mesh"] == [1, 2] and two["sharded_params"] > 0
    assert two["losses"] == pytest.approx(one["losses"], abs=1e-5)
    for key in ("eval_before", "eval_after"):
        assert two[key][0] == pytest.approx(one[key][0], abs=1e-5), key
        assert two[key][1] == one[key][1], key  # predictions of the 4 samples, each once, in order
    assert two["eval_after"][0] != pytest.approx(two["eval_before"][0], abs=1e-3)  # it trained


@pytest.mark.slow
def test_accumulation_is_planned_as_micro_batches_and_trains_like_one_process(tmp_path):
    """``Accelerator(gradient_accumulation_steps=2)`` and ``with accelerator.accumulate(model)`` in the loop,
    2 gloo processes on a 1x2 mesh: the plan made at the first call runs the optimizer step's batch as 2
    micro-batches (the loader's batches), and every micro-batch's loss and the evaluation after training equal
    plain accelerate's in one process with the same accumulation."""
    ref = subprocess.run(
        [sys.executable, SCRIPT, "--out", str(tmp_path / "ref"), "--grad-accum", "2"],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert ref.returncode == 0, why_it_failed(ref)
    par = _launch(tmp_path / "par", "--grad-accum", "2", HF_COLOSSAL_AUTO_MESH_SHAPE="1x2")
    assert par.returncode == 0, why_it_failed(par)
    assert "2 micro-batches of 4 per replica (gradients synced once)" in par.stdout
    one = json.loads((tmp_path / "ref" / "result.json").read_text())
    two = json.loads((tmp_path / "par" / "result.json").read_text())
    assert two["processes"] == 2 and two["mesh"] == [1, 2] and two["micro_batches"] == 2
    assert two["losses"] == pytest.approx(one["losses"], abs=1e-5)
    assert two["eval_after"][0] == pytest.approx(one["eval_after"][0], abs=1e-5)
    assert two["eval_after"][1] == one["eval_after"][1]
    assert one["eval_after"][0] != pytest.approx(one["eval_before"][0], abs=1e-3)  # it trained


@pytest.mark.slow
def test_planning_error_at_the_first_call_reaches_every_rank(tmp_path):
    """Planning from the first call fails on rank 0 (a budget no plan fits): both processes raise its error."""
    par = _launch(tmp_path / "bad", HF_COLOSSAL_AUTO_MEMORY_BUDGET="1KiB")
    assert par.returncode != 0
    for rank in (0, 1):
        assert (
            f"[rank{rank}]: hf_colossal_auto.solve.problem.InfeasibleError: No plan for LlamaForCausalLM"
            in (par.stderr + par.stdout)
        ), par.stderr[-3000:]
