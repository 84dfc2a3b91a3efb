"""Run under ``accelerate launch`` (2 CPU processes): an accelerate loop under a forced cp = 2 plan against plain
accelerate in the same processes, then the GPT recipe with ``--context_parallel 2``.

    ACCELERATE_USE_CPU=1 accelerate launch --config_file recipes/auto_cpu.yaml --multi_gpu --num_processes 2 \\
        tests/multiproc/check_accelerate_cp.py --out DIR [--recipe-out DIR/gpt]

1. plain ``accelerate.Accelerator`` (DDP): a seeded GPT-2 without dropout, a shuffled loader of per-process
   batch 2 (16 tokens), AdamW; the loss of every step (mean over processes) and the rows each process read;
2. ``AutoParallelAccelerator(auto_parallel_plugin=AutoParallelPlugin(context_parallel=2))``: the same model,
   data and seed; the plan splits each sequence over both processes (one replica), so each reads the union of
   plain accelerate's two batches of the step; its losses, rows and ``data_parallel_info`` are recorded, then
   a 15-token batch (which 2 x cp = 4 chunks cannot cut) must raise on every rank;
3. with ``--recipe-out``: ``recipes/pretrain_gpt.py --model tiny --context_parallel 2`` (the default preset,
   dropout on) run as its script would (last: its
   ``end_training`` ends the process group).

Each process writes ``rank<r>.json`` in ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
from torch.utils.data import DataLoader

from hf_colossal_auto.integrations.process_exit import finish

ROOT = Path(__file__).resolve().parents[2]


def build_model() -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=256, n_positions=64, n_embd=64, n_layer=2, n_head=4,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    return GPT2LMHeadModel(config)


def train(accelerator) -> tuple[torch.nn.Module, list[float], list[list[int]]]:
    """Four steps of an ordinary accelerate loop; the losses (mean over processes) and each batch's rows (their
    first tokens)."""
    from accelerate.utils import set_seed

    set_seed(0)
    model = build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 256, (16, 16), generator=torch.Generator().manual_seed(1))
    samples = [{"input_ids": row, "labels": row.clone()} for row in ids]
    loader = DataLoader(samples, batch_size=2, shuffle=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    losses, rows = [], []
    for batch in loader:
        loss = model(**batch).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(accelerator.reduce(loss.detach(), "mean")))
        rows.append(batch["input_ids"][:, 0].tolist())
    return model, losses, rows


def reset() -> None:
    """A fresh script's accelerate singletons; the process group stays (the next Accelerator uses it)."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--recipe-out", default=None)
    args = parser.parse_args()
    from accelerate import Accelerator

    from hf_colossal_auto import data_parallel_info
    from hf_colossal_auto.apply.context_parallel_attention import ContextParallelError
    from hf_colossal_auto.integrations import AutoParallelAccelerator, AutoParallelPlugin

    result: dict = {}
    _, result["plain_losses"], result["plain_rows"] = train(Accelerator())
    reset()
    accelerator = AutoParallelAccelerator(auto_parallel_plugin=AutoParallelPlugin(context_parallel=2))
    model, result["cp_losses"], result["cp_rows"] = train(accelerator)
    plan = accelerator.auto_plan
    result["mesh"], result["cp_size"] = list(plan.mesh_shape), plan.cp_size
    info = data_parallel_info(model)
    result["info"] = {
        "rank": info.rank,
        "size": info.size,
        "cp_size": info.cp_size,
        "group": info.group_processes,
    }
    bad = torch.randint(0, 256, (4, 15), generator=torch.Generator().manual_seed(2))
    try:
        model(input_ids=bad, labels=bad)
        result["bad_length_error"] = None
    except ContextParallelError as exc:
        result["bad_length_error"] = str(exc)
    rank = accelerator.process_index
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    if args.recipe_out:
        reset()
        sys.path.insert(0, str(ROOT / "recipes"))
        import pretrain_gpt
        from _shared.loop import run

        # the default preset, dropout on (attention 0.1: CPU SDPA runs its math path, planned as such)
        Path(args.recipe_out).mkdir(parents=True, exist_ok=True)
        os.environ["HF_COLOSSAL_AUTO_SAVE_PLAN_PATH"] = str(Path(args.recipe_out) / "plan.json")
        run(pretrain_gpt.GPT, [
            "--model", "tiny", "--vocab_size", "1024", "--context_parallel", "2", "--seq_len", "64", "--max_steps", "3",
            "--per_device_batch_size", "2", "--synthetic_documents", "200", "--eval_steps", "0",
            "--max_eval_batches", "1", "--output_dir", args.recipe_out,
        ])  # fmt: skip


if __name__ == "__main__":
    main()
    finish()  # the run's gloo groups outlive main(): end before interpreter teardown
