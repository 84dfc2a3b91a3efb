"""Run under torchrun: train a parallelized tiny model, checkpoint it, resume in fresh processes.

    torchrun --nproc_per_node 2 tests/multiproc/check_checkpoint.py --phase save --dir D
    torchrun --nproc_per_node 2 tests/multiproc/check_checkpoint.py --phase resume --dir D

``save``: rank 0 plans (Megatron placements on a 1 x N mesh) and writes the plan; two AdamW steps; sharded
training state to ``D/state`` (torch.distributed.checkpoint), a consolidated HF export to ``D/export``, the
single-process reference weights after the same steps to ``D/reference.pt``, and the loss of the third step to
``D/expected.json``. ``resume``: fresh processes build the model, apply the saved plan, load ``D/state`` and
run the third step; rank 0 writes its loss to ``D/resumed.json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
import transformers


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--phase", choices=["save", "resume"], required=True)
    parser.add_argument("--dir", required=True)
    parser.add_argument("--model", default="tiny-llama")
    args = parser.parse_args()
    transformers.logging.set_verbosity_error()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    from hf_colossal_auto.apply import autoparallelize, broadcast_plan
    from hf_colossal_auto.apply.checkpoint import load_checkpoint, save_checkpoint, save_pretrained
    from hf_colossal_auto.models import build_model, make_example_inputs
    from hf_colossal_auto.plan import Plan
    from hf_colossal_auto.solve.planner import evaluate_plan

    out = Path(args.dir)
    torch.manual_seed(0)
    model = build_model(args.model, device="cpu")
    model.eval()
    batches = [make_example_inputs(model, 4, 16, seed=s) for s in range(3)]
    if args.phase == "save":
        reference = build_model(args.model, device="cpu") if rank == 0 else None
        if reference is not None:
            reference.load_state_dict(model.state_dict())
            reference.eval()
        made = None
        if rank == 0:
            made = evaluate_plan(
                model, batches[0], "megatron", num_devices=world, device="cpu", mesh_shape=(1, world)
            ).plan
            made.save(out / "plan.json")
        autoparallelize(model, plan=broadcast_plan(made))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3) if reference is not None else None
        for step in range(2):
            model(**batches[step]).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if reference is not None:
                reference(**batches[step]).loss.backward()
                ref_opt.step()
                ref_opt.zero_grad(set_to_none=True)
        save_checkpoint(model, opt, out / "state")
        save_pretrained(model, out / "export")
        loss = float(model(**batches[2]).loss)
        if rank == 0:
            torch.save(reference.state_dict(), out / "reference.pt")
            (out / "expected.json").write_text(json.dumps({"loss": loss}))
        del opt
    else:
        plan = Plan.load(out / "plan.json")
        autoparallelize(model, plan=plan)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        load_checkpoint(model, opt, out / "state")
        loss = float(model(**batches[2]).loss)
        if rank == 0:
            (out / "resumed.json").write_text(json.dumps({"loss": loss}))
        del opt
    del model
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    main()
