"""Run under torchrun (2 gloo ranks): micro-batches with deferred gradient sync equal the one-piece step.

    torchrun --nproc_per_node 2 tests/multiproc/check_micro_batches.py --out result.json

For DDP and FSDP on a 2 x 1 mesh, one model each (the plan priced by rank 0 with ``micro_batches=2``), the same
replica batch runs as 1, 2 and 4 micro-batches through :func:`hf_colossal_auto.accumulate`: rank 0 writes, per
mode and k, the loss (summed weighted pieces, averaged over the replicas) against the model trained on the whole
batch in one process, the largest gradient difference, and the collectives each step issued (c10d's own
records under ``torch.profiler``, as tests/multiproc/check_collectives.py counts them).
The labels have -100s in one replica's first rows only, so pieces carry different token counts and equal
weights would be wrong.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses

import torch
import torch.distributed as dist
import transformers
from common import close_gloo, ddp_reference_loss, init_gloo, write_results
from torch.distributed.tensor import DTensor
from torch.profiler import ProfilerActivity, profile


def make_batch(model, rows: int, seq: int) -> dict[str, torch.Tensor]:
    """A seeded global batch whose label counts differ between rows (padding as -100)."""
    from hf_colossal_auto.models import make_example_inputs

    batch = make_example_inputs(model, rows, seq, seed=0)
    labels = batch["labels"].clone()
    labels[0, : seq // 2] = -100  # replica 0, first micro-batch at every k
    labels[1, 3:] = -100
    batch["labels"] = labels
    return batch


def reference_grads(model, batch: dict, dp: int) -> tuple[float, dict[str, torch.Tensor]]:
    """One process, whole batch: the mean over replicas of each replica's mean loss (what DDP averages)."""
    loss = ddp_reference_loss(model, batch, dp)
    loss.backward()
    return float(loss), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def collective_counts(prof) -> dict[str, int]:
    """Collectives c10d ran, by its record name (``c10d::allreduce_``, ``c10d::_reduce_scatter_base_``...)."""
    counts: dict[str, int] = {}
    for event in prof.events():
        if event.name.startswith("c10d::") and event.name != "c10d::barrier":
            counts[event.name] = counts.get(event.name, 0) + 1
    return counts


def make_plan(name: str, args: argparse.Namespace):
    """Rank 0 prices DDP on the 2 x 1 mesh with ``micro_batches=2`` (the planner's own Plan); every rank gets it."""
    from hf_colossal_auto.apply import broadcast_plan
    from hf_colossal_auto.models import build_model
    from hf_colossal_auto.solve.planner import evaluate_plan

    plan = None
    if dist.get_rank() == 0:
        model = build_model(name, device="meta")
        batch = make_batch(build_model(name, device="cpu"), args.batch, args.seq)
        plan = evaluate_plan(model, batch, "ddp", num_devices=2, device="cpu", micro_batches=2).plan
    return broadcast_plan(plan)


def step_with_no_sync(model, batch: dict, k: int) -> float:
    """A step as accelerate's ``accumulate``/the Trainer run it: every piece but the last inside
    ``model.no_sync()`` (what ``Accelerator.no_sync`` looks up), losses weighted by token counts."""
    from hf_colossal_auto.apply.micro_batch import count_loss_items, split_batch

    pieces = split_batch(batch, k)
    counts = [count_loss_items(p, shift=True) for p in pieces]
    total = 0.0
    for i, piece in enumerate(pieces):
        with model.no_sync() if i < k - 1 else contextlib.nullcontext():
            loss = model(**piece).loss * (counts[i] / sum(counts))
            loss.backward()
        total += float(loss.detach())
    return total


def run_mode(name: str, dp_mode: str, plan, args: argparse.Namespace) -> list[dict]:
    """Apply ``plan`` with ``dp_mode`` on the data-parallel axis; one step per k in 1, 2, 4 through
    :func:`accumulate`, and k = 4 through ``model.no_sync``."""
    from hf_colossal_auto import accumulate, autoparallelize, micro_batches
    from hf_colossal_auto.models import build_model

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = build_model(name, device="cpu")
    model.eval()  # no dropout: the comparison is exact
    batch = make_batch(model, args.batch, args.seq)
    reference = copy.deepcopy(model)
    ref_loss, ref_grads = reference_grads(reference, batch, world)
    autoparallelize(model, plan=dataclasses.replace(plan, dp_mode=dp_mode))
    assert model._hf_colossal_auto_plan.micro_batches == 2
    per = args.batch // world
    local = {k: v[rank * per : (rank + 1) * per] for k, v in batch.items()}
    assert len(micro_batches(local, model)) == 2
    results = []
    for k, via in ((1, "accumulate"), (2, "accumulate"), (4, "accumulate"), (4, "no_sync")):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            total = 0.0
            if via == "accumulate":
                for micro in accumulate(model, local, micro_batches=None if k == 2 else k):
                    loss = model(**micro.inputs).loss * micro.weight
                    loss.backward()
                    total += float(loss.detach())
            else:
                total = step_with_no_sync(model, local, k)
        worst = 0.0
        for n, p in model.named_parameters():
            grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            worst = max(worst, float((grad - ref_grads[n]).abs().max()))
            p.grad = None
        losses = [None] * world
        dist.all_gather_object(losses, total)
        results.append(
            {
                "model": name,
                "dp_mode": dp_mode,
                "k": k,
                "via": via,
                "loss": sum(losses) / world,
                "reference_loss": ref_loss,
                "max_grad_diff": worst,
                "collectives": collective_counts(prof),
                "params": sum(1 for _ in model.parameters()),
            }
        )
    del model, reference
    dist.barrier()
    return results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="tiny-gpt2")
    parser.add_argument("--batch", type=int, default=8, help="global batch (4 rows per replica)")
    parser.add_argument("--seq", type=int, default=16)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    transformers.logging.set_verbosity_error()
    init_gloo(timeout_s=120)
    plan = make_plan(args.model, args)
    results = [r for mode in ("ddp", "fsdp") for r in run_mode(args.model, mode, plan, args)]
    write_results(results, args.out)
    close_gloo(exit_process=True)


if __name__ == "__main__":
    main()
