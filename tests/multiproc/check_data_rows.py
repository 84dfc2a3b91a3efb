"""The rows of every step, under plain accelerate and under plans (one torchrun launch, 2 gloo processes).

    python -m torch.distributed.run --nproc_per_node 2 tests/multiproc/check_data_rows.py --out result.json

The same accelerate training loop (a shuffled loader whose sampler accelerate seeds from the global RNG, an
uneven last batch, AdamW, ``accelerator.accumulate``) runs with plain ``accelerate.Accelerator`` and with
``AutoParallelAccelerator`` on forced meshes: 1x2 and 2x1, and 1x2 with ``gradient_accumulation_steps=2``
(planned as 2 micro-batches) next to plain accelerate with the same setting. Every step records the rows the
processes trained on (``accelerator.gather`` of each sample's row id: each sample once), the mean loss over the
processes, the number of batches, and an evaluation pass's ``gather_for_metrics``. The main process writes
them per run.
"""

from __future__ import annotations

import argparse
import datetime
import json

import torch
import transformers
from accelerate import Accelerator
from accelerate.state import GradientState
from accelerate.utils import InitProcessGroupKwargs, set_seed
from torch.utils.data import DataLoader

from hf_colossal_auto.integrations import AutoParallelAccelerator, AutoParallelPlugin
from hf_colossal_auto.integrations.process_exit import finish
from hf_colossal_auto.models import build_model

PER_PROCESS, SEQ = 4, 8


def samples(vocab: int, rows: int) -> list[dict]:
    """Row ``i`` starts with token ``i``: the first column of a batch names its rows."""
    ids = torch.randint(0, vocab, (rows, SEQ), generator=torch.Generator().manual_seed(1))
    ids[:, 0] = torch.arange(rows)
    return [{"input_ids": row, "labels": row.clone()} for row in ids]


def train(accelerator: Accelerator, rows: int) -> dict:
    set_seed(0)  # the same model, and the same global RNG from which accelerate seeds the sampler
    model = build_model("tiny-gpt2", device="cpu")
    model.eval()  # no dropout: the runs compare exactly
    data = samples(model.config.vocab_size, rows)
    loader = DataLoader(data, batch_size=PER_PROCESS, shuffle=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    steps, losses = [], []
    for batch in loader:
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        steps.append(accelerator.gather(batch["input_ids"][:, 0]).tolist())
        losses.append(float(accelerator.reduce(loss.detach(), "mean")))
    evaluation = accelerator.prepare(DataLoader(data[:11], batch_size=PER_PROCESS))
    seen = []
    with torch.no_grad():
        for batch in evaluation:
            seen += accelerator.gather_for_metrics(batch["input_ids"][:, 0]).tolist()
    plan = getattr(accelerator.unwrap_model(model), "_hf_colossal_auto_plan", None)
    result = {
        "rows": steps,
        "losses": losses,
        "batches": len(loader),
        "eval_rows": seen,
        "mesh": list(plan.mesh_shape) if plan is not None else None,
        "micro_batches": plan.micro_batches if plan is not None else None,
    }
    accelerator.free_memory(model, optimizer, loader, evaluation)
    GradientState._reset_state()
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    transformers.logging.set_verbosity_error()
    handlers = [InitProcessGroupKwargs(timeout=datetime.timedelta(seconds=120))]
    world = Accelerator(kwargs_handlers=handlers).num_processes
    rows = PER_PROCESS * world * args.steps + 3  # an uneven last step, completed as accelerate does
    runs = {}
    for accumulation in (1, 2):
        runs[f"plain/{accumulation}"] = train(
            Accelerator(kwargs_handlers=handlers, gradient_accumulation_steps=accumulation), rows
        )
        meshes = ("1x2", "2x1") if accumulation == 1 else ("1x2",)
        for mesh in meshes:
            plugin = AutoParallelPlugin(mesh_shape=mesh, device="cpu")
            accelerator = AutoParallelAccelerator(
                kwargs_handlers=handlers,
                gradient_accumulation_steps=accumulation,
                auto_parallel_plugin=plugin,
            )
            runs[f"{mesh}/{accumulation}"] = train(accelerator, rows)
    if accelerator.is_main_process:
        with open(args.out, "w") as f:
            json.dump(runs, f)
    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    main()
    finish()  # the run's gloo groups outlive main(): end before interpreter teardown
