"""The training half of `make demo`: a tiny Llama trained for a few dozen steps on 2 CPU processes (gloo) with
a plan made on rank 0 and applied by the runtime. Launched by `hf-colossal-auto demo` through torchrun."""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist
import transformers


def main() -> None:
    transformers.logging.set_verbosity_error()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank = dist.get_rank()
    from hf_colossal_auto.apply import autoparallelize
    from hf_colossal_auto.models import build_model, make_example_inputs

    torch.manual_seed(0)
    model = build_model("tiny-llama", device="cpu")
    batches = [make_example_inputs(model, 8, 32, seed=s) for s in range(4)]
    autoparallelize(model, batches[0], device="cpu")
    plan = model._hf_colossal_auto_plan
    if rank == 0:
        sharded = sum(1 for p in plan.param_placements.values() if p[1] != "R")
        print(
            f"plan: mesh {tuple(plan.mesh_shape)} ({plan.dp_mode}), {sharded} of {len(plan.param_placements)} "
            f"parameters sharded; predicted step {plan.step_time_s * 1e3:.2f} ms on cpu",
            flush=True,
        )
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for step in range(30):
        loss = model(**batches[step % len(batches)]).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if rank == 0 and step % 5 == 0:
            print(f"step {step:3d}  loss {loss.detach().item():.4f}", flush=True)
    del model, optimizer
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    main()
