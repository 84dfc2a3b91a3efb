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
    process (GPT-2's tied head from the embedding's key), its evaluation logits too."""
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
            assert got["logits_err"] == 0.0, (preset, got)
            # this rank's stages only: what it holds, about half the checkpoint
            assert got["bytes_read"] == got["held_bytes"] < 0.8 * got["checkpoint_bytes"], (preset, got)
    for preset, got in ranks[0]["pretrained"].items():  # together the ranks hold every parameter (tie: both)
        held = sum(r["pretrained"][preset]["held"] for r in ranks)
        assert held == got["reference_params"], (preset, held, got)
