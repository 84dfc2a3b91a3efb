"""Training state under pipeline stages: DCP checkpoints written per stage that resume under another plan (and
one process), and the reverse; the optimizer state's two forms and the tied head's names."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "multiproc"))


def _uninterrupted(preset: str) -> dict[str, float]:
    """One process, no plan: two AdamW steps, then the third step's loss and the next batch's loss."""
    from check_pipeline_checkpoint import LR, MODELS, build, config, data, next_losses, step

    cfg = config(preset, MODELS[preset])
    batches = data(cfg)
    model = build(cfg, "cpu", seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    for batch in batches[:2]:
        step(model, optimizer, batch)
    return next_losses(model, optimizer, batches)


def _resumed_in_one_process(preset: str, directory: Path) -> dict[str, float]:
    """A fresh model (other weights) in one process, no plan, loads a checkpoint: the next losses."""
    from check_pipeline_checkpoint import LR, MODELS, build, config, data, next_losses

    from hf_colossal_auto.apply.checkpoint import load_checkpoint

    cfg = config(preset, MODELS[preset])
    model = build(cfg, "cpu", seed=1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    load_checkpoint(model, optimizer, directory)
    return next_losses(model, optimizer, data(cfg))


@pytest.mark.slow
def test_pipeline_checkpoint_resumes_under_another_plan_and_the_reverse(tmp_path):
    """2 gloo ranks: Llama and GPT-2 (tie across the ranks) under pp 2 write DCP checkpoints, each rank its
    stages; resumed under tensor parallelism, under the same pipeline plan and in one process without a plan,
    and a tensor-parallel checkpoint resumed under pp, each gives the uninterrupted run's third and next
    losses (one process's); AutoParallelAccelerator's save_state/load_state under a pipeline plan file too. A
    control loading the weights with a fresh AdamW differs (the optimizer state is what makes them equal).
    Then ``apply_plan(model on meta, pipeline plan, pretrained=dir)``: each rank reads only its stages' bytes
    of a local save_pretrained checkpoint (several files), its tensors equal from_pretrained's in one
    process (GPT-2's tied head from the embedding's key), its evaluation logits too; the Trainer's
    consolidated load (load_best_model_at_end) into a pipelined model gives the same tensors. A one-process
    positional optimizer state (two param groups, as optimizer.pt) under pp; AutoParallelAccelerator with
    mixed_precision="bf16" under the pp plan gives one process's bf16 losses on the same micro-batches."""
    from torchrun_launch import run_torchrun

    out = tmp_path / "result.json"
    script = str(ROOT / "tests" / "multiproc" / "check_pipeline_checkpoint.py")
    run_torchrun(script, "--dir", str(tmp_path), "--out", str(out), nproc=2, timeout=400)
    ranks = json.loads(out.read_text())
    for preset in ("tiny-llama", "tiny-gpt2"):
        want = _uninterrupted(preset)
        one = _resumed_in_one_process(preset, tmp_path / preset / "pp")
        for cases in (*(r[preset] for r in ranks), {"one process <- pp": one}):
            for case, losses in cases.items():
                if case in ("seconds", "fresh optimizer"):
                    continue
                for key in ("loss", "next_loss"):
                    assert losses[key] == pytest.approx(want[key], rel=1e-6), (preset, case, losses, want)
        for r in ranks:  # the check can tell: without AdamW's moments and step count the update differs
            assert abs(r[preset]["fresh optimizer"]["next_loss"] - want["next_loss"]) > 1e-4, (preset, r)
    accelerate = ranks[0]["accelerate"]
    want = _uninterrupted("tiny-llama")
    for phase in ("saved", "resumed"):
        for key in ("loss", "next_loss"):
            assert accelerate[phase][key] == pytest.approx(want[key], rel=1e-6), (phase, accelerate, want)
    for results in ranks:
        for preset, got in results["pretrained"].items():
            assert got["equal"] and not got["on_meta"] and got["files"] > 1, (preset, got)
            assert got["consolidated_equal"], (preset, got)
            assert got["logits_err"] == 0.0, (preset, got)
            # this rank's stages only: what it holds, about half the checkpoint
            assert got["bytes_read"] == got["held_bytes"] < 0.8 * got["checkpoint_bytes"], (preset, got)
    for results in ranks:  # every stage under accelerate's bf16 autocast: one process's micro-batched losses
        bf16 = results["bf16"]
        for got, want in zip(bf16["losses"], bf16["ref_losses"], strict=True):
            assert got == pytest.approx(want, rel=1e-6), bf16
        assert abs(bf16["losses"][0] - bf16["fp32_first_loss"]) > 1e-5, bf16  # the control: fp32 differs
    for preset, got in ranks[0]["pretrained"].items():  # together the ranks hold every parameter (tie: both)
        held = sum(r["pretrained"][preset]["held"] for r in ranks)
        assert held == got["reference_params"], (preset, held, got)


def _trainer(*args: str, nproc: int | None) -> None:
    """``check_trainer.py args`` on ``nproc`` gloo ranks (None: one plain process)."""
    import os
    import subprocess

    from torchrun_launch import why_it_failed

    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_COLOSSAL_AUTO_NO_CALIBRATE": "1"}
    launcher = (
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
        if nproc
        else [sys.executable]
    )
    script = str(ROOT / "tests" / "multiproc" / "check_trainer.py")
    proc = subprocess.run([*launcher, script, *args], env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, why_it_failed(proc)


@pytest.mark.slow
def test_trainer_under_a_pipeline_plan_trains_checkpoints_and_resumes_like_one_process(tmp_path):
    """The Trainer with AutoParallelCallback(plan_path=) of a pp 2 plan (1f1b, 2 micro-batches) on 2 gloo ranks,
    per-device batch 2, gradient accumulation 2, clipping at 1 (the Trainer's default), a checkpoint every 2
    steps, save_model at the end: its four losses, learning rates, tokens seen, FLOs and eval loss equal the
    plain one-process Trainer's with batch 4 (the Trainer's token-count normalisation and loss scaling,
    clipping over both stages). The export loads with from_pretrained in one process to the same eval loss;
    checkpoint-2 (DCP, each rank its stage) resumed by a fresh model under the same pipeline plan and by one
    process without a plan continues with the uninterrupted losses and learning rates."""
    from hf_colossal_auto.models import build_model, make_example_inputs
    from hf_colossal_auto.pipeline_layout import hand_pipeline_plan

    model = build_model("tiny-llama", device="meta")
    plan = hand_pipeline_plan(
        model, make_example_inputs(model, 4, 16), pp_size=2, schedule="1f1b", micro_batches=2
    )
    plan.save(tmp_path / "pp.json")
    run, resumed, ref = (tmp_path / name for name in ("run", "resumed", "ref"))
    common = ["--model", "tiny-llama", "--steps", "4", "--grad-accum", "2"]
    _trainer(
        *common, "--plan", str(tmp_path / "pp.json"), "--out", f"{run}.json", "--output-dir", str(run),
        "--save-steps", "2", "--export", f"{run}-export", "--then-resume", f"{run}/checkpoint-2",
        nproc=2,
    )  # fmt: skip
    _trainer(
        *common, "--per-device", "4", "--out", f"{ref}.json", "--output-dir", str(ref),
        "--eval-export", f"{run}-export", "--then-resume", f"{run}/checkpoint-2",
        nproc=None,
    )  # fmt: skip
    got, want = (json.loads(Path(f"{p}.json").read_text()) for p in (run, ref))
    assert got["mesh"] == [2, 1, 1]
    assert sorted(got["losses"], key=int) == ["1", "2", "3", "4"]
    for step, loss in want["losses"].items():
        assert got["losses"][step] == pytest.approx(loss, abs=1e-5), step
        assert got["learning_rates"][step] == pytest.approx(want["learning_rates"][step], rel=1e-6), step
    assert got["tokens_seen"] == want["tokens_seen"]
    assert got["total_flos"] == pytest.approx(want["total_flos"])
    assert got["eval_loss"] == pytest.approx(want["eval_loss"], abs=1e-5)
    assert want["export_eval_loss"] == pytest.approx(got["eval_loss"], abs=1e-5)
    assert (run / "checkpoint-2" / "hf_colossal_auto_state").is_dir()
    continued = {
        "pp -> pp": (got["then_resumed_losses"], got["then_resumed_learning_rates"]),
        "pp -> one process": (want["then_resumed_losses"], want["then_resumed_learning_rates"]),
    }
    for case, (losses, rates) in continued.items():
        for step in ("3", "4"):
            assert losses[step] == pytest.approx(got["losses"][step], abs=1e-5), (case, step)
            assert rates[step] == pytest.approx(got["learning_rates"][step], rel=1e-6), (case, step)
