"""Run under torchrun (2 gloo ranks): a pipeline plan the planner chose (``plan_model(pipeline=2)`` on a tiny
Llama, the static CPU spec) runs in the user's loop, its first loss equals one process's, and its measured step
time is set beside the prediction.

    torchrun --nproc_per_node 2 tests/multiproc/check_pipeline_planned.py --out result.json

Every rank plans (the planner is deterministic: the same plan everywhere), builds the same seeded model, applies
the plan and runs ``loss = model(**batch).loss; loss.backward(); optimizer.step()`` for a few steps; steps after
the first are timed between barriers. Rank 0 writes the plan's figures, the losses and the step times.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import time

import torch
import torch.distributed as dist

STEPS = 6


def main() -> None:
    from hf_colossal_auto.apply.runtime import apply_plan
    from hf_colossal_auto.models import build_model, load_config, make_example_inputs
    from hf_colossal_auto.solve.planner import plan_model

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    cfg = load_config("tiny-llama")
    cfg.num_hidden_layers = 4
    meta = build_model(cfg, device="meta")
    plan = plan_model(
        meta, make_example_inputs(meta, 8, 32, device="meta"), num_devices=2, device="cpu", pipeline=2
    )
    torch.manual_seed(0)
    reference_model = build_model(cfg, device="cpu")
    batch = make_example_inputs(reference_model, 8, 32, seed=0)
    reference_loss = reference_model(**batch).loss.item()
    torch.manual_seed(0)
    model = build_model(cfg, device="cpu")
    apply_plan(model, plan)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses, seconds = [], []
    for _ in range(STEPS):
        dist.barrier()
        started = time.perf_counter()
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        dist.barrier()
        seconds.append(time.perf_counter() - started)
        losses.append(loss.item())
    result = {
        "schedule": plan.schedule,
        "micro_batches": plan.micro_batches,
        "stages": [len(s) for s in plan.stages],
        "predicted_step_s": plan.step_time_s,
        "measured_step_s": statistics.median(seconds[1:]),
        "measured_steps_s": seconds,
        "losses": losses,
        "reference_loss": reference_loss,
    }
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    del model, optimizer
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
