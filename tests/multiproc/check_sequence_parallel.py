"""Run under torchrun: sequence parallelism (issue 28, item 1) chosen by the planner, applied and measured.

    torchrun --nproc_per_node 2 tests/multiproc/check_sequence_parallel.py --case tiny-llama:0.8 --out r.json

For each ``--case``, rank 0 plans the model (one sequence of 128 tokens: no batch dim to split) on a 1 x 2 mesh,
without recompute, under the case's fraction of the peak of the plan made with the budget lifted: the planner fits it by running blocks
sequence-parallel. Its twin is the same plan (the same parameter placements) priced again with the budget
lifted, which does not. Every rank applies each plan to a fresh copy of one seeded model and runs one forward +
backward under ``torch.profiler`` (c10d's records of every collective: counts and bytes against the plan's
prediction), compares loss and gradients with the model run in one process, takes one AdamW step and measures
the next step's peak with MemTracker. ``<out>.rank<r>`` holds each plan's result.

A case ``preset:megatron-sp`` runs the ``megatron-sp`` baseline (``evaluate_plan``, mesh 1 x 2) and plain
``megatron`` priced alike, in place of the planned pair, run and measured alike.

A case flagged ``dropout`` runs the model in train mode at attention and hidden dropout 0.1. Last, dropout on a
value sharded on the sequence dim against one process's draw (random ops on sequence shards draw the shard's part
of one process's mask).
"""

from __future__ import annotations

import argparse
import copy
import functools
import json

import torch
import torch.distributed as dist
import transformers
from common import close_gloo, init_gloo, write_results
from torch.distributed.tensor import DTensor
from torch.profiler import ProfilerActivity, profile


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {
        name: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        for name, p in model.named_parameters()
        if p.grad is not None
    }


def _model(preset: str, dropout: bool) -> torch.nn.Module:
    from hf_colossal_auto.models import build_model, load_config

    config = load_config(preset)
    if dropout:
        for attr in ("attention_dropout", "attn_pdrop", "resid_pdrop", "embd_pdrop", "hidden_dropout"):
            if hasattr(config, attr):
                setattr(config, attr, 0.1)
    torch.manual_seed(0)
    model = build_model(config, device="cpu")
    return model.train() if dropout else model.eval()


def make_baseline_plans(model: torch.nn.Module, batch: dict, baseline: str) -> list[str]:
    """A hand baseline on the 1 x 2 mesh (``evaluate_plan``) and plain ``megatron`` priced alike, as JSON."""
    from hf_colossal_auto import evaluate_plan

    common = dict(num_devices=2, device="cpu", mesh_shape=(1, 2), recompute="none")
    return [evaluate_plan(model, batch, name, **common).plan.to_json() for name in (baseline, "megatron")]


def make_plans(model: torch.nn.Module, batch: dict, fraction: float) -> list[str]:
    """The sequence-parallel plan and its twin (same parameter placements, budget lifted), as JSON."""
    from common import plan_at_fraction

    from hf_colossal_auto import evaluate_plan

    plan = plan_at_fraction(model, batch, mesh=(1, 2), dp_mode="ddp", fraction=fraction, recompute="none")
    twin = evaluate_plan(
        model, batch, plan, num_devices=2, device="cpu", memory_budget=1 << 40, recompute="none"
    ).plan
    return [plan.to_json(), twin.to_json()]


def run_plan(name: str, plan, model: torch.nn.Module, batch: dict) -> dict:
    """One profiled forward + backward (collectives, numerics against one process), one AdamW step, then the
    measured peak of the next step."""
    from check_collectives import count_collectives
    from common import measured_step_peak

    from hf_colossal_auto.apply import apply_plan

    reference = copy.deepcopy(model)
    rng = torch.get_rng_state()
    ref_loss = reference(**batch).loss
    ref_loss.backward()
    ref_grads = _grads(reference)
    torch.set_rng_state(
        rng
    )  # the planned forward draws what the reference drew (its group agrees on rank 0's)
    apply_plan(model, plan)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        loss = model(**batch).loss
        loss.backward()
    counted, counted_bytes = count_collectives(prof)
    grads = _grads(model)
    result = {
        "plan": name,
        "rank": dist.get_rank(),
        "sequence_parallel_blocks": plan.sequence_parallel_blocks,
        "summary": plan.summary(),
        "activation_placements": {k: v[1] for k, v in plan.activation_placements.items()},
        "loss": loss.item(),
        "ref_loss": ref_loss.item(),
        "max_grad_err": max((grads[k] - ref_grads[k]).abs().max().item() for k in ref_grads),
        "grads_compared": len(ref_grads),
        "predicted": {k: int(v) for k, v in plan.collectives.items() if not k.startswith("dp_") and v},
        "predicted_bytes": {
            k: int(v) for k, v in plan.collective_bytes.items() if not k.startswith("dp_") and v
        },
        "counted": counted,
        "counted_bytes": counted_bytes,
        "predicted_peak": plan.peak_memory_bytes,
        "step_time_s": plan.step_time_s,
    }
    del loss, grads, ref_grads, reference
    opt.step()
    opt.zero_grad(set_to_none=True)
    result["measured_peak"] = measured_step_peak(model, opt, batch)
    del model, opt
    dist.barrier()
    return result


def run_case(spec: str, seq: int) -> list[dict]:
    """``preset:fraction[:dropout]``: both plans of one model, planned on rank 0, run on every rank;
    ``preset:<baseline>`` (``megatron-sp``): that baseline and plain ``megatron``."""
    from hf_colossal_auto import Plan
    from hf_colossal_auto.apply.agree import run_on_one_rank
    from hf_colossal_auto.models import make_example_inputs

    preset, fraction, *flags = spec.split(":")
    dropout = "dropout" in flags
    model = _model(preset, dropout)
    batch = make_example_inputs(model, 1, seq, seed=0)
    if fraction.startswith("megatron"):  # a named baseline against plain Megatron
        names, made = (fraction, "megatron"), functools.partial(make_baseline_plans, model, batch, fraction)
    else:
        names, made = (
            ("sequence-parallel", "twin"),
            functools.partial(make_plans, model, batch, float(fraction)),
        )
    texts = json.loads(run_on_one_rank(lambda: json.dumps(made()), what="planning"))
    results = []
    for name, text in zip(names, texts, strict=True):
        result = run_plan(name, Plan.from_dict(json.loads(text)), _model(preset, dropout), batch)
        results.append({"case": spec, **result})
    return results


def sequence_sharded_dropout() -> dict:
    """Dropout on a ``[batch, seq, hidden]`` value sharded on the sequence dim, after a plan has registered the
    runtime's random-op handlers (``apply/rng.py``): each rank's shard of the result is its part of the mask one
    process draws from the same generator state (the largest difference over the whole value)."""
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from hf_colossal_auto.apply.rng import register_random_op_handlers

    register_random_op_handlers()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    x = torch.randn(2, 128, 64)
    torch.manual_seed(1)
    expected = F.dropout(x, 0.1, training=True)
    torch.manual_seed(1)
    got = F.dropout(distribute_tensor(x, mesh, [Shard(1)]), 0.1, training=True)
    return {
        "dropout_placement": str(got.placements[0]),
        "dropout_err": float((got.full_tensor() - expected).abs().max()),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--case",
        action="append",
        required=True,
        help="preset:budget fraction[:dropout] or preset:megatron-sp; repeat for several",
    )
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)
    init_gloo(timeout_s=300)
    results = [r for spec in args.case for r in run_case(spec, args.seq)]
    results.append({"case": "dropout", "plan": "none", **sequence_sharded_dropout()})
    write_results(results, args.out, per_rank=True)
    close_gloo(exit_process=True)


if __name__ == "__main__":
    main()
