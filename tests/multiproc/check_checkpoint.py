"""Run under torchrun: train a parallelized tiny model, checkpoint it, resume in fresh processes.

    torchrun --nproc_per_node 2 tests/multiproc/check_checkpoint.py --phase save --dir D
    torchrun --nproc_per_node 2 tests/multiproc/check_checkpoint.py --phase resume --dir D

Each phase goes through three layouts in turn, so that two launches cover them all: ``tp`` (Megatron
placements on a 1 x N mesh), ``ddp`` and ``fsdp`` (N x 1, the data-parallel axis replicated or sharded). Each
data-parallel rank feeds its own rows of the global batches (``shard_batch``).

``save``, per layout: rank 0 plans and writes the plan to ``D/<layout>/plan.json``; two AdamW steps; sharded
training state to ``D/<layout>/state`` (torch.distributed.checkpoint); then the uninterrupted run goes on: the
loss of batch 2, an optimizer step on it, and the loss of batch 3 after that step, per rank in
``D/<layout>/expected.rank<r>.json``. For ``tp`` also a consolidated HF export to ``D/export``, the
single-process reference weights after the two steps to ``D/reference.pt``, and the full-batch loss of batch 2
to ``D/expected.json``.

``resume``, per layout: fresh processes build the model (other initial weights), apply the saved plan, load
the state into a new AdamW and do the same step on batch 2 and the loss of batch 3
(``D/<layout>/resumed.rank<r>.json``). The loss of batch 3 depends on AdamW's moments and step count: a
control that loads the model but starts a fresh AdamW (``fresh_optimizer_next_loss``) shows that the
optimizer state was needed to match it. Rank 0 also writes the ``tp`` full-batch loss to ``D/resumed.json``.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import transformers
from common import init_gloo

from hf_colossal_auto.integrations.process_exit import finish

LAYOUTS = {"tp": ("megatron", "tp"), "ddp": ("ddp", "dp"), "fsdp": ("fsdp", "dp")}
"""Layout -> (evaluate_plan baseline, the mesh axis the world goes on)."""
LR = 1e-3


def _parallel_model(name: str, seed: int, plan: Any) -> torch.nn.Module:
    """A fresh tiny model (weights from ``seed``, no dropout) parallelized per ``plan``."""
    from hf_colossal_auto import autoparallelize
    from hf_colossal_auto.models import build_model

    torch.manual_seed(seed)
    model = build_model(name, device="cpu")
    model.eval()
    autoparallelize(model, plan=plan)
    return model


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, batch: dict) -> float:
    """One training step on this rank's rows of ``batch``; returns its loss (before the update)."""
    from hf_colossal_auto import shard_batch

    loss = model(**shard_batch(batch, model)).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(loss)


def _next_loss(model: torch.nn.Module, batch: dict) -> float:
    from hf_colossal_auto import shard_batch

    return float(model(**shard_batch(batch, model)).loss)


def _save(layout: str, model_name: str, out: Path, batches: list[dict], rank: int, world: int) -> None:
    from hf_colossal_auto.apply import broadcast_plan
    from hf_colossal_auto.apply.checkpoint import save_checkpoint, save_pretrained
    from hf_colossal_auto.models import build_model
    from hf_colossal_auto.solve.planner import evaluate_plan

    baseline, axis = LAYOUTS[layout]
    mesh_shape = (1, world) if axis == "tp" else (world, 1)
    (out / layout).mkdir(parents=True, exist_ok=True)
    made = None
    if rank == 0:
        planning = build_model(model_name, device="meta")
        made = evaluate_plan(
            planning, batches[0], baseline, num_devices=world, device="cpu", mesh_shape=mesh_shape
        ).plan
        assert made.dp_mode == ("fsdp" if layout == "fsdp" else "ddp"), made.dp_mode
        made.save(out / layout / "plan.json")
    model = _parallel_model(model_name, 0, broadcast_plan(made))
    reference = None
    if layout == "tp" and rank == 0:
        torch.manual_seed(0)
        reference = build_model(model_name, device="cpu")
        reference.eval()
        ref_opt = torch.optim.AdamW(reference.parameters(), lr=LR)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    for step in range(2):
        _step(model, opt, batches[step])
        if reference is not None:
            reference(**batches[step]).loss.backward()
            ref_opt.step()
            ref_opt.zero_grad(set_to_none=True)
    save_checkpoint(model, opt, out / layout / "state")
    if layout == "tp":
        save_pretrained(model, out / "export")
        loss = float(model(**batches[2]).loss)  # every rank of a 1 x N mesh reads the whole batch
        if rank == 0:
            torch.save(reference.state_dict(), out / "reference.pt")
            (out / "expected.json").write_text(json.dumps({"loss": loss}))
    expected = {"loss": _step(model, opt, batches[2]), "next_loss": _next_loss(model, batches[3])}
    (out / layout / f"expected.rank{rank}.json").write_text(json.dumps(expected))


def _resume(layout: str, model_name: str, out: Path, batches: list[dict], rank: int) -> None:
    from hf_colossal_auto.apply.checkpoint import load_checkpoint
    from hf_colossal_auto.plan import Plan

    plan = Plan.load(out / layout / "plan.json")
    model = _parallel_model(model_name, 1, plan)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    load_checkpoint(model, opt, out / layout / "state")
    if layout == "tp":
        loss = float(model(**batches[2]).loss)
        if rank == 0:
            (out / "resumed.json").write_text(json.dumps({"loss": loss}))
    resumed = {"loss": _step(model, opt, batches[2]), "next_loss": _next_loss(model, batches[3])}
    # Control: the same weights, a fresh AdamW (no moments, step count 0).
    control = _parallel_model(model_name, 1, plan)
    load_checkpoint(control, None, out / layout / "state")
    fresh = torch.optim.AdamW(control.parameters(), lr=LR)
    _step(control, fresh, batches[2])
    resumed["fresh_optimizer_next_loss"] = _next_loss(control, batches[3])
    (out / layout / f"resumed.rank{rank}.json").write_text(json.dumps(resumed))


def run_phase(
    phase: str, out: Path, model_name: str = "tiny-llama", layouts: str = ",".join(LAYOUTS)
) -> None:
    """``phase`` for every layout of ``layouts`` on the initialized process group (check_numerics.py's
    ``--checkpoint-save`` runs the save phase in its own launch so)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    from hf_colossal_auto.models import build_model, make_example_inputs

    shapes = build_model(model_name, device="meta")
    batches = [make_example_inputs(shapes, 4, 16, seed=s, device="cpu") for s in range(4)]
    for layout in layouts.split(","):
        if phase == "save":
            _save(layout, model_name, out, batches, rank, world)
        else:
            _resume(layout, model_name, out, batches, rank)
        dist.barrier()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--phase", choices=["save", "resume"], required=True)
    parser.add_argument("--dir", required=True)
    parser.add_argument("--model", default="tiny-llama")
    parser.add_argument(
        "--layouts", default=",".join(LAYOUTS), help="comma-separated, of " + ", ".join(LAYOUTS)
    )
    args = parser.parse_args()
    transformers.logging.set_verbosity_error()
    init_gloo(timeout_s=120)
    run_phase(args.phase, Path(args.dir), args.model, args.layouts)
    dist.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    main()
    finish()  # the run's gloo groups outlive main(): end before interpreter teardown
