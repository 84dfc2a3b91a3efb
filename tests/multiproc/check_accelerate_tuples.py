"""A plain accelerate script whose loader yields tuples (``TensorDataset``), as many training loops are written.

    python tests/multiproc/check_accelerate_tuples.py --out ref/                 # one process, plain accelerate
    ACCELERATE_USE_CPU=1 accelerate launch --config_file recipes/auto_cpu.yaml --multi_gpu --num_processes 2 \
        -m hf_colossal_auto.run tests/multiproc/check_accelerate_tuples.py --out par/

Nothing here knows about hf-colossal-auto. The batch is a tuple, so it cannot be planned from at ``prepare()``;
the model is called as ``model(input_ids=x, labels=x)``. A no-grad evaluation runs before the first training
step (the model is not planned yet) and after the last one; predictions are collected with
``gather_for_metrics``. ``--grad-accum N`` trains under ``accelerator.accumulate(model)`` with
``Accelerator(gradient_accumulation_steps=N)``. The main process writes ``result.json`` in ``--out``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os

import torch
import transformers
from accelerate import Accelerator
from accelerate.utils import InitProcessGroupKwargs, set_seed
from torch.utils.data import DataLoader, TensorDataset

from hf_colossal_auto.integrations.process_exit import finish
from hf_colossal_auto.models import build_model


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="tiny-llama")
    parser.add_argument("--global-batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=16)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--grad-accum", type=int, default=1, help="Accelerator(gradient_accumulation_steps)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    transformers.logging.set_verbosity_error()
    accelerator = Accelerator(
        gradient_accumulation_steps=args.grad_accum,
        kwargs_handlers=[InitProcessGroupKwargs(timeout=datetime.timedelta(seconds=120))],
    )
    set_seed(0)
    model = build_model(args.model, device="cpu")
    model.eval()  # no dropout: the processes' run and the single process' run compare exactly
    vocab = model.config.vocab_size
    ids = torch.randint(
        0, vocab, (args.global_batch * args.steps, args.seq), generator=torch.Generator().manual_seed(1)
    )
    per_device = args.global_batch // accelerator.num_processes
    loader = DataLoader(TensorDataset(ids), batch_size=per_device)
    eval_loader = DataLoader(TensorDataset(ids[: args.global_batch]), batch_size=per_device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model, optimizer, loader, eval_loader = accelerator.prepare(model, optimizer, loader, eval_loader)

    def evaluate() -> tuple[float, list[int]]:
        losses, predicted = [], []
        with torch.no_grad():
            for (x,) in eval_loader:
                out = model(input_ids=x, labels=x)
                assert out.logits.shape[:2] == x.shape, (out.logits.shape, x.shape)  # this process's rows
                losses.append(float(accelerator.reduce(out.loss, "mean")))
                predicted += accelerator.gather_for_metrics(out.logits[:, -1].argmax(-1)).tolist()
        return sum(losses) / len(losses), predicted

    before = evaluate()
    losses = []
    for (x,) in loader:
        with accelerator.accumulate(model):
            loss = model(input_ids=x, labels=x).loss
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        losses.append(float(accelerator.reduce(loss.detach(), "mean")))
    after = evaluate()
    plan = getattr(accelerator.unwrap_model(model), "_hf_colossal_auto_plan", None)
    if accelerator.is_main_process:
        result = {
            "processes": accelerator.num_processes,
            "losses": losses,
            "eval_before": before,
            "eval_after": after,
            "mesh": list(plan.mesh_shape) if plan is not None else None,
            "micro_batches": plan.micro_batches if plan is not None else None,
            "sharded_params": sum(1 for p in plan.param_placements.values() if p[-1] != "R") if plan else 0,
        }
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "result.json"), "w") as f:
            json.dump(result, f)
    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    main()
    finish()  # the run's gloo groups outlive main(): end before interpreter teardown
