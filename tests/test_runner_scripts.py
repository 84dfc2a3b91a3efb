"""Scripts that know nothing of hf-colossal-auto, run under ``python -m hf_colossal_auto.run`` on 2 gloo
processes: a Trainer script in the shape of transformers' run_clm.py, and accelerate's own distributed test
scripts (what ``accelerate test`` runs)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from torchrun_launch import accelerate_launch_command, why_it_failed

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_COLOSSAL_AUTO_")}
    return {
        **env,
        "OMP_NUM_THREADS": "1",
        "HF_COLOSSAL_AUTO_NO_CALIBRATE": "1",
        "ACCELERATE_USE_CPU": "1",
        **extra,
    }


def _launch(*args: str, env: dict[str, str], runner: bool) -> subprocess.CompletedProcess:
    command = accelerate_launch_command(*(("-m", "hf_colossal_auto.run") if runner else ()), *args)
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)


def test_a_trainer_script_under_the_runner_trains_like_the_plain_trainer(tmp_path):
    """run_clm's shape (tokenized text grouped into blocks in a datasets.Dataset, Trainer + TrainingArguments,
    shuffled, fp32, no dropout) through the runner with a forced 1x2 plan: the Trainer gets our accelerator and
    the callback's plan although it prepares its loader before its model, and logs the plain Trainer's losses
    (2 processes under plain accelerate) at every step, and its eval loss."""
    script = str(ROOT / "tests" / "multiproc" / "train_clm.py")
    plain = _launch(script, "--out", str(tmp_path / "plain.json"), env=_env(), runner=False)
    assert plain.returncode == 0, why_it_failed(plain)
    ours = _launch(
        script, "--out", str(tmp_path / "ours.json"), env=_env(HF_COLOSSAL_AUTO_MESH_SHAPE="1x2"), runner=True
    )
    assert ours.returncode == 0, why_it_failed(ours)
    reference = json.loads((tmp_path / "plain.json").read_text())
    result = json.loads((tmp_path / "ours.json").read_text())
    assert reference["mesh"] is None and result["mesh"] == [1, 2]
    assert result["accelerator"] == "AutoParallelAccelerator" and result["processes"] == 2
    assert result["steps"] == reference["steps"] == len(result["losses"])
    assert result["losses"] == pytest.approx(reference["losses"], abs=1e-5)
    assert result["losses"][-1] != result["losses"][0]
    assert result["eval_loss"] == pytest.approx(reference["eval_loss"], abs=1e-5)


ACCELERATE_SCRIPTS = Path(__import__("accelerate").__file__).parent / "test_utils" / "scripts"


def test_accelerates_own_test_scripts_under_the_runner():
    """accelerate's own distributed test scripts (what ``accelerate test`` runs) pass whole under the runner with
    the planner's own choice: test_ops.py; test_script.py — its data-loader checks (loaders prepared before and
    without a model, seedable samplers, dataloader breaks), then its trainings of the RegressionModel planned
    from the model's first call (``model(batch["x"])``), DDP on 2x1, whose parameters, ordinary tensors since
    the plan shards nothing, it compares with one process's through ``torch.testing.assert_close`` (which
    refuses DTensors); and test_sync.py, whose premise (each process computes on its own batch, so gradients
    differ until synchronised) the DDP plan keeps: the model planned inside ``no_sync``, ``accumulate``,
    ``trigger_sync_in_backward``."""
    ops = _launch(str(ACCELERATE_SCRIPTS / "test_ops.py"), env=_env(), runner=True)
    assert ops.returncode == 0, why_it_failed(ops)
    script = _launch(str(ACCELERATE_SCRIPTS / "test_script.py"), env=_env(), runner=True)
    assert script.returncode == 0, why_it_failed(script)
    assert (
        "Training yielded the same results on one CPU or distributed setup with batch split." in script.stdout
    )
    assert "**Test reinstantiated state**" in script.stdout  # its last section
    assert (
        "Plan for RegressionModel on 2 x cpu: mesh dp=2 x tp=1" in script.stdout
    )  # planned from the first call
    sync = _launch(str(ACCELERATE_SCRIPTS / "test_sync.py"), env=_env(), runner=True)
    assert sync.returncode == 0, why_it_failed(sync)
    assert "**Test Distributed `no_sync` context manager with multiple forwards**" in sync.stdout
    assert "Plan for RegressionModel on 2 x cpu: mesh dp=2 x tp=1" in sync.stdout
