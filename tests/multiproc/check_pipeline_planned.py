"""Run under torchrun (2 gloo ranks): pipeline plans the planner made run in the user's loop and do what the
plan predicts.

    torchrun --nproc_per_node 2 tests/multiproc/check_pipeline_planned.py --out result.json

Every rank plans (the planner is deterministic: the same plan everywhere) and builds the same seeded tiny Llama
(4 blocks; 8 for 4 stages a rank) or tiny GPT-2 (batch 8 x 32, the static CPU spec).

* ``plan_model(pipeline=2)``'s own choice runs ``loss = model(**batch).loss; loss.backward();
  optimizer.step()`` for a few steps; its first loss is set beside one process's, its measured step time
  (steps after the first, between barriers) beside the prediction.
* Per schedule (Llama: GPipe, 1F1B, interleaved 1F1B with 2 and with 4 stages a rank, ZB-V; GPT-2, tied across the ranks: 1F1B; the schedule and the micro-batch count fixed, the cut and the
  predictions the search's; and Llama under ZB-V with every block recomputed, a hand pipeline): two steps from a fresh optimizer, the first a warm-up (torch's shape inference
  and the optimizer state happen there); the second runs under the point-to-point recorder. Each rank reports
  its sends and receives by peer (count, bytes) beside the simulated schedule's (``solver["point_to_point"]``),
  and each step's peak memory (the profiler's memory events: ``MemTracker`` cannot follow stages that share
  submodules with the model) beside the plan's prediction for its rank (``solver["rank_peak_memory_bytes"]``).

Rank 0 writes every rank's results.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import init_gloo, out_argument, write_every_rank_and_close  # noqa: E402

from hf_colossal_auto.integrations.process_exit import finish

STEPS = 6
BATCH, SEQ = 8, 32
SCHEDULES = (
    ("tiny-llama", "gpipe", 2, "none"),
    ("tiny-llama", "1f1b", 4, "none"),
    ("tiny-llama", "interleaved-1f1b", 4, "none"),
    ("tiny-gpt2", "1f1b", 4, "none"),
    ("tiny-llama", "zbv", 4, "none"),
    ("tiny-llama", "zbv", 4, "full"),
    ("tiny-llama-8", "interleaved-1f1b", 4, "none"),
    ("tiny-llama", "interleaved-1f1b", 4, "bf16"),
)
"""(preset, schedule, micro-batches, variant: a recompute option or a mixed precision) whose traffic and memory
are measured, by result key ``preset schedule`` (the variant appended unless "none"; `` full``: every block
recomputed, a hand pipeline, ``evaluate_plan``): GPT-2's head is
tied to its embedding across the two ranks (a copy each, the gradient all-reduced); ZB-V's split backward holds
the gradients its input pass hands the weight pass, and with recompute the one rerun's tensors, between them.
``tiny-llama-8`` (8 blocks): 4 stages a rank, a hand pipeline (``evaluate_plan``), with fewer micro-batches
than its 8 stages. ``bf16`` instead of a recompute option: planned for bf16 mixed precision, the forward under
``torch.autocast`` as accelerate wraps it (the blocks' weight casts kept once a step: autocast's cache)."""

MIXED_PRECISION = ("bf16",)
"""Variants that plan for mixed precision (no recompute) and run the forward under ``torch.autocast``."""

FOUR_A_RANK = {"tiny-llama-8": 4}
"""Presets measured with 4 stages a rank (a hand pipeline of one block a stage)."""


def _config(preset: str = "tiny-llama"):
    from hf_colossal_auto.models import load_config

    cfg = load_config(preset.removesuffix("-8"))
    if preset.startswith("tiny-llama"):
        cfg.num_hidden_layers = 8 if preset.endswith("-8") else 4
    return cfg


def planned_choice() -> dict[str, Any]:
    """``plan_model(pipeline=2)``'s plan in the user's loop: losses and step times beside the prediction."""
    from hf_colossal_auto.apply.runtime import apply_plan
    from hf_colossal_auto.models import build_model, make_example_inputs
    from hf_colossal_auto.solve.planner import plan_model

    cfg = _config()
    meta = build_model(cfg, device="meta")
    plan = plan_model(
        meta, make_example_inputs(meta, BATCH, SEQ, device="meta"), num_devices=2, device="cpu", pipeline=2
    )
    torch.manual_seed(0)
    reference_model = build_model(cfg, device="cpu")
    batch = make_example_inputs(reference_model, BATCH, SEQ, seed=0)
    reference_loss = reference_model(**batch).loss.item()
    del reference_model
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
    return {
        "schedule": plan.schedule,
        "micro_batches": plan.micro_batches,
        "stages": [len(s) for s in plan.stages],
        "predicted_step_s": plan.step_time_s,
        "measured_step_s": statistics.median(seconds[1:]),
        "measured_steps_s": seconds,
        "losses": losses,
        "reference_loss": reference_loss,
    }


def measured_schedule(
    preset: str, schedule: str, micro_batches: int, variant: str = "none"
) -> dict[str, Any]:
    """The search's plan for ``schedule`` at ``micro_batches`` (``variant`` a recompute option other than
    "none": the hand pipeline recomputing every block so, priced by ``evaluate_plan``; a mixed precision: the
    search's plan for it, run under autocast): one measured step's peak memory and point-to-point ops on this
    rank, beside the plan's predictions."""
    from common import p2p_by_peer, step_peaks

    from hf_colossal_auto._torch_compat import recording_point_to_point
    from hf_colossal_auto.apply.runtime import apply_plan
    from hf_colossal_auto.models import build_model, make_example_inputs
    from hf_colossal_auto.solve.candidates import _Planner
    from hf_colossal_auto.solve.pipeline.plan import search_pipeline_plan
    from hf_colossal_auto.solve.planner import evaluate_plan

    cfg = _config(preset)
    mixed = variant if variant in MIXED_PRECISION else None
    recompute = "none" if mixed else variant
    meta = build_model(cfg, device="meta")
    inputs = make_example_inputs(meta, BATCH, SEQ, device="meta")
    if recompute == "none" and preset not in FOUR_A_RANK:
        planner = _Planner.for_devices(meta, inputs, 2, "cpu", None, None, mixed, "adamw", 60.0, "none")
        plan = search_pipeline_plan(planner, 2, schedules=(schedule,), micro_batches=micro_batches)
    else:
        plan = evaluate_plan(meta, inputs, "ddp", num_devices=2, device="cpu", mesh_shape=(1, 1), pipeline=2,
                             schedule=schedule, micro_batches=micro_batches, recompute=recompute,
                             virtual_stages=FOUR_A_RANK.get(preset)).plan  # fmt: skip
    assert plan is not None, f"no {schedule} plan at {micro_batches} micro-batches"
    torch.manual_seed(0)
    model = build_model(cfg, device="cpu")
    batch = make_example_inputs(model, BATCH, SEQ, seed=0)
    apply_plan(model, plan)
    if mixed:  # accelerate's forward wrapper
        model.forward = torch.autocast("cpu", dtype=torch.bfloat16)(model.forward)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    dist.barrier()
    warm_up, recorder = recording_point_to_point(), recording_point_to_point()
    warm_up_peak, peak = step_peaks(model, optimizer, batch, [warm_up, recorder])
    rank = dist.get_rank()
    sent, predicted = p2p_by_peer(recorder.records, plan.solver["point_to_point"], model)
    out = {
        "schedule": schedule,
        "micro_batches": micro_batches,
        "stages": [len(s) for s in plan.stages],
        "rank": rank,
        "measured_peak_bytes": peak,
        "measured_warm_up_peak_bytes": warm_up_peak,
        "measured_p2p_warm_up_ops": len(warm_up.records),
        "predicted_peak_bytes": plan.solver["rank_peak_memory_bytes"][rank],
        "predicted_state_bytes": plan.solver["rank_state_bytes"][rank],
        "predicted_activation_bytes": plan.solver["rank_activation_bytes"][rank],
        "measured_p2p": sent,
        "predicted_p2p": predicted,
    }
    del model, optimizer
    dist.barrier()
    return out


def main() -> None:
    out = out_argument()
    init_gloo(timeout_s=120)
    started = time.perf_counter()
    results: dict[str, Any] = {"planned": planned_choice()}
    for preset, schedule, micro_batches, variant in SCHEDULES:
        key = f"{preset} {schedule}" + ("" if variant == "none" else f" {variant}")
        results[key] = measured_schedule(preset, schedule, micro_batches, variant)
    results["total_seconds"] = time.perf_counter() - started
    write_every_rank_and_close(results, out)


if __name__ == "__main__":
    main()
    finish()  # the run's gloo groups outlive main(): end before interpreter teardown
