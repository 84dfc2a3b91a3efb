"""An ordinary accelerate training script, used to check AutoParallelAccelerator against plain accelerate.

    python tests/multiproc/check_accelerate.py --out ref/                       # one process, plain accelerate
    ACCELERATE_USE_CPU=1 accelerate launch --config_file recipes/auto_cpu.yaml --multi_gpu --num_processes 2 \
        -m hf_colossal_auto.run tests/multiproc/check_accelerate.py --out par/  # 2 gloo processes, planned

Nothing here knows about hf-colossal-auto: the same global batch (``--global-batch`` split over the processes
as with DDP), AdamW made before ``prepare``, a linear LR schedule, ``clip_grad_norm_``. After ``--save-at``
steps it saves the state, trains on, then loads the state and replays the same batches (the losses must repeat),
evaluates one fixed batch, and writes a consolidated checkpoint with ``save_model``. The main process writes
``result.json`` in ``--out``.

Elastic resume (``--elastic-mesh 2x1 --elastic-dp-mode fsdp --elastic-from DIR ...``, the one part that knows
hf-colossal-auto): afterwards a second accelerator in the same processes, as a fresh job would, plans the given
mesh for a fresh model with other weights, loads each saved state (this run's own ``state`` and every
``--elastic-from``) with ``load_state`` and trains the steps after ``--save-at`` on the global batches the run
drew there (:func:`resume_elsewhere`, also called in one process by the test).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os

import torch
import transformers
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, InitProcessGroupKwargs, set_seed
from torch.utils.data import DataLoader

from hf_colossal_auto.integrations.process_exit import finish
from hf_colossal_auto.models import build_model


def make_samples(vocab: int, args: argparse.Namespace) -> list[dict]:
    data_rng = torch.Generator().manual_seed(1)
    return [
        {"input_ids": ids, "labels": ids.clone()}
        for ids in torch.randint(0, vocab, (args.global_batch * args.steps, args.seq), generator=data_rng)
    ]


def make_scheduler(optimizer: torch.optim.Optimizer, args: argparse.Namespace):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 - step / (2 * args.steps))


def train_step(accelerator: Accelerator, model, optimizer, scheduler, batch: dict) -> float:
    """One optimizer step as an accelerate script writes it (clipping, schedule); the mean loss over processes."""
    loss = model(**batch).loss
    accelerator.backward(loss)
    accelerator.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad()
    return float(accelerator.reduce(loss.detach(), "mean"))


def resume_elsewhere(accelerator: Accelerator, states: list[str], args: argparse.Namespace) -> list[dict]:
    """For each saved state: a fresh model (other weights), AdamW and schedule prepared by ``accelerator`` (its
    own plan, or none in one process), ``load_state``, then the steps after ``--save-at`` on the global batches
    the single-process run draws there (this rank's rows of them). Returns per state the losses (averaged over
    the processes) and the last learning rate."""
    from hf_colossal_auto import shard_batch

    results = []
    for state in states:
        set_seed(5)
        model = build_model(args.model, device="cpu")
        model.eval()
        samples = make_samples(model.config.vocab_size, args)
        per_device = args.global_batch // accelerator.num_processes
        loader = DataLoader(samples, batch_size=per_device)  # what the plan is made from
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        scheduler = make_scheduler(optimizer, args)
        model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
        accelerator.load_state(state)
        module = accelerator.unwrap_model(model)
        planned = hasattr(module, "_hf_colossal_auto_plan")
        # the order of the single-process run (rank 0's shuffling generator), in global batches
        order = DataLoader(
            samples, batch_size=args.global_batch, shuffle=True, generator=torch.Generator().manual_seed(2)
        )
        losses = []
        for step, batch in enumerate(order):
            if step < args.save_at:
                continue
            local = shard_batch(batch, module) if planned else batch
            losses.append(train_step(accelerator, model, optimizer, scheduler, local))
        results.append(
            {
                "state": state,
                "losses": losses,
                "learning_rate": scheduler.get_last_lr()[0],
                "mesh": list(module._hf_colossal_auto_plan.mesh_shape) if planned else None,
                "dp_mode": module._hf_colossal_auto_plan.dp_mode if planned else None,
            }
        )
        accelerator.free_memory(model, optimizer, scheduler, loader)
        accelerator._auto_model = accelerator.auto_plan = None  # the next state gets a fresh model and plan
    return results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="tiny-gpt2")
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=16)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--save-at", type=int, default=3)
    parser.add_argument("--out", required=True)
    parser.add_argument(
        "--split-batches",
        action="store_true",
        help="accelerate's split_batches: the loader yields global batches",
    )
    parser.add_argument("--elastic-mesh", default=None, help="dp x tp of the elastic resume, e.g. 2x1")
    parser.add_argument("--elastic-dp-mode", default=None, help="ddp or fsdp")
    parser.add_argument(
        "--elastic-from", action="append", default=[], help="another saved state to resume elastically"
    )
    args = parser.parse_args()
    transformers.logging.set_verbosity_error()
    accelerator = Accelerator(
        # one scheduler step per optimizer step, whatever the process count (accelerate's default steps it once
        # per process), so that the single-process run has the same learning rates
        step_scheduler_with_optimizer=False,
        kwargs_handlers=[InitProcessGroupKwargs(timeout=datetime.timedelta(seconds=120))],
        dataloader_config=DataLoaderConfiguration(split_batches=args.split_batches),
    )
    set_seed(0)
    model = build_model(args.model, device="cpu")
    model.eval()  # no dropout: the processes' run and the single process' run compare exactly

    samples = make_samples(model.config.vocab_size, args)
    per_device = args.global_batch if args.split_batches else args.global_batch // accelerator.num_processes
    # a different shuffling seed per process: the ranks of one tensor-parallel group must still read the same
    # batches (rank 0's order, which the single-process reference also draws), so the loader's sampler state
    # has to be broadcast at prepare()
    loader = DataLoader(
        samples,
        batch_size=per_device,
        shuffle=True,
        generator=torch.Generator().manual_seed(2 + accelerator.process_index),
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scheduler = make_scheduler(optimizer, args)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    eval_loader = accelerator.prepare(DataLoader(samples[: args.global_batch + 3], batch_size=per_device))

    losses, batches = [], []
    for step, batch in enumerate(loader):
        if step == args.save_at:
            accelerator.save_state(os.path.join(args.out, "state"))
        batches.append({k: v.clone() for k, v in batch.items()})
        losses.append(train_step(accelerator, model, optimizer, scheduler, batch))
    accelerator.load_state(os.path.join(args.out, "state"))
    resumed = [
        train_step(accelerator, model, optimizer, scheduler, batch) for batch in batches[args.save_at :]
    ]

    eval_batch = {k: torch.stack([s[k] for s in samples[: args.global_batch]]) for k in samples[0]}
    with torch.no_grad():
        eval_loss = float(model(**eval_batch).loss)
    seen = []  # what an evaluation loop collects: every sample once
    for batch in eval_loader:
        seen += accelerator.gather_for_metrics(batch["input_ids"][:, 0]).tolist()
    accelerator.save_model(model, os.path.join(args.out, "export"))
    unwrapped = accelerator.unwrap_model(model)
    plan = getattr(unwrapped, "_hf_colossal_auto_plan", None)
    if accelerator.is_main_process:
        result = {
            "processes": accelerator.num_processes,
            "losses": losses,
            "resumed_losses": resumed,
            "eval_loss": eval_loss,
            "eval_first_tokens": seen,
            "model_class": type(model).__name__,
            "mesh": list(plan.mesh_shape) if plan is not None else None,
            "global_batch_planned": plan.global_batch_size if plan is not None else None,
            "sharded_params": sum(1 for p in plan.param_placements.values() if p[-1] != "R") if plan else 0,
            "learning_rate": scheduler.get_last_lr()[0],
        }
        with open(os.path.join(args.out, "result.json"), "w") as f:
            json.dump(result, f)
    if args.elastic_mesh:
        from hf_colossal_auto import AutoParallelPlugin

        plugin = AutoParallelPlugin(
            mesh_shape=args.elastic_mesh,
            dp_modes=args.elastic_dp_mode,
            save_plan_path=os.path.join(args.out, "elastic-plan.json"),
        )
        elastic = type(accelerator)(step_scheduler_with_optimizer=False, auto_parallel_plugin=plugin)
        states = [os.path.join(args.out, "state"), *args.elastic_from]
        resumed_elsewhere = resume_elsewhere(elastic, states, args)
        if accelerator.is_main_process:
            result["elastic"] = resumed_elsewhere
            with open(os.path.join(args.out, "result.json"), "w") as f:
                json.dump(result, f)
    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    main()
    finish()  # the run's gloo groups outlive main(): end before interpreter teardown
