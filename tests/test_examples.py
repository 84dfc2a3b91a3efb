"""Scripts in the shape users already have, run unchanged: transformers' ``run_clm_no_trainer.py`` example loop
(``tests/examples/run_clm_no_trainer.py``) under plain ``accelerate launch`` and under the runner with the
planner's choice, a forced 1x2 tensor-parallel plan and a forced 2x1 FSDP plan, on 2 gloo processes.

What a plan must not change: the rows of every step, the loss of every step, the eval loss, and a checkpoint
written by the example's own save lines that ``from_pretrained`` loads in one process with the same eval loss."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torchrun_launch import accelerate_launch_command, why_it_failed

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "examples" / "run_clm_no_trainer.py"
STEPS = 5
BLOCK = 32  # the example's default --block_size
EVAL_BATCH = 4  # its default --per_device_eval_batch_size
RUNS = {  # name -> planner settings; None: plain accelerate, no runner
    "plain": None,
    "auto": {},
    "tp": {"HF_COLOSSAL_AUTO_MESH_SHAPE": "1x2"},
    "fsdp": {"HF_COLOSSAL_AUTO_MESH_SHAPE": "2x1", "HF_COLOSSAL_AUTO_DP_MODES": "fsdp"},
}


def _write_inputs(folder: Path) -> dict[str, str]:
    """Text files, a locally trained byte-level BPE tokenizer and a tiny GPT-2 config (dropout off: the fp32
    comparison is exact only without random masks) for the example's arguments."""
    sys.path.insert(0, str(ROOT / "recipes"))
    from _shared.corpus import synthetic_corpus
    from _shared.tokenizer import train_tokenizer

    from hf_colossal_auto.models import load_config

    documents = synthetic_corpus(num_documents=60, seed=1)
    tokenizer = train_tokenizer("bpe", documents, vocab_size=300)
    (folder / "train.txt").write_text("\n".join(documents[:48]) + "\n")
    (folder / "validation.txt").write_text("\n".join(_full_eval_batches(documents[48:], tokenizer)) + "\n")
    tokenizer.save_pretrained(str(folder / "tokenizer"))
    config = load_config("tiny-gpt2")
    config.vocab_size = len(tokenizer)
    config.n_positions = 64
    config.resid_pdrop = config.embd_pdrop = config.attn_pdrop = 0.0
    config.save_pretrained(str(folder / "config"))
    return {
        "--train_file": str(folder / "train.txt"),
        "--validation_file": str(folder / "validation.txt"),
        "--tokenizer_name": str(folder / "tokenizer"),
        "--config_name": str(folder / "config"),
    }


def _full_eval_batches(documents: list[str], tokenizer) -> list[str]:
    """``documents`` with the last one cut to a length whose blocks fill every evaluation batch of both
    processes: accelerate pads a short last batch with repeated rows, where a tensor-parallel group's loss (the
    mean over the group's rows, padding included) is not the mean of the two processes' losses the example
    gathers — the one difference the batch rule leaves (docs/ARCHITECTURE.md, the batch rule)."""
    head = sum(len(tokenizer(d)["input_ids"]) for d in documents[:-1])
    words = documents[-1].split(" ")
    for keep in range(len(words), 0, -1):
        last = " ".join(words[:keep])
        if ((head + len(tokenizer(last)["input_ids"])) // BLOCK) % (2 * EVAL_BATCH) == 0:
            return [*documents[:-1], last]
    raise AssertionError("no cut of the last document fills the evaluation batches")


def _launch(folder: Path, inputs: dict[str, str], name: str, settings: dict[str, str] | None) -> dict:
    out = folder / name
    args = [*(x for kv in inputs.items() for x in kv), "--output_dir", str(out), "--seed", "7"]
    args += ["--max_train_steps", str(STEPS), "--log_file", str(folder / f"{name}.json")]
    runner = [] if settings is None else ["-m", "hf_colossal_auto.run"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_COLOSSAL_AUTO_")}
    env.update(
        ACCELERATE_USE_CPU="1", OMP_NUM_THREADS="1", HF_COLOSSAL_AUTO_NO_CALIBRATE="1", **(settings or {})
    )
    proc = subprocess.run(
        accelerate_launch_command(*runner, str(SCRIPT), *args),
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, f"{name}: " + why_it_failed(proc)
    return json.loads((folder / f"{name}.json").read_text())


@pytest.fixture(scope="module")
def example_runs(tmp_path_factory) -> tuple[Path, dict[str, str], dict[str, dict]]:
    folder = tmp_path_factory.mktemp("run_clm")
    inputs = _write_inputs(folder)
    return folder, inputs, {name: _launch(folder, inputs, name, s) for name, s in RUNS.items()}


@pytest.mark.parametrize("name", [n for n in RUNS if n != "plain"])
def test_a_plan_trains_on_plain_accelerates_rows_with_its_losses(example_runs, name):
    _, _, runs = example_runs
    plain, run = runs["plain"], runs[name]
    assert len(run["rows"]) == len(plain["rows"]) == STEPS
    for step, (mine, theirs) in enumerate(zip(run["rows"], plain["rows"], strict=True)):
        assert mine == theirs, f"{name}: step {step} trained on other rows than plain accelerate"
    torch.testing.assert_close(
        torch.tensor(run["losses"]), torch.tensor(plain["losses"]), rtol=1e-5, atol=1e-6
    )
    assert run["eval_samples"] == plain["eval_samples"]
    assert run["eval_loss"] == pytest.approx(plain["eval_loss"], rel=1e-5)


@pytest.mark.parametrize("name", [n for n in RUNS if n != "plain"])
def test_the_examples_save_lines_write_a_checkpoint_one_process_loads(example_runs, name):
    from transformers import AutoModelForCausalLM

    folder, _, runs = example_runs
    saved = AutoModelForCausalLM.from_pretrained(str(folder / name))
    reference = AutoModelForCausalLM.from_pretrained(str(folder / "plain"))
    mine, theirs = saved.state_dict(), reference.state_dict()
    assert mine.keys() == theirs.keys()
    for key in theirs:
        torch.testing.assert_close(mine[key], theirs[key], rtol=1e-4, atol=1e-5, msg=f"{name}: {key}")
    assert (folder / name / "tokenizer.json").is_file()
