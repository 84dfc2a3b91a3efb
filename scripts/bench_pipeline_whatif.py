"""What-if: the planner with pipeline stages searched (``pipeline=None``) against without (``pipeline=1``), on
a model preset at cluster scale, and the fastest and leanest pipeline candidate of each pp degree the search
simulated (stage layouts with tensor parallelism, DDP/FSDP/HSDP and recompute inside a stage; candidates whose
lower bound is no faster than the best found are not simulated).

    python scripts/bench_pipeline_whatif.py                       # llama3-70b, 1024 x 4096 on 1024 h100-80gb
    python scripts/bench_pipeline_whatif.py --model tiny-llama --batch 8 --seq 16 --devices 2 --device a100-80gb

Prints the predicted step time and MFU (6 x parameters + 6 x layers x hidden x sequence FLOPs per token over the
devices' dense bf16 peak, as ``scripts/bench_planner.py --scale`` counts) of both plans, and per pp degree its
fastest candidate and its least-memory candidate.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_planner import _model_flops_per_token  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama3-70b")
    p.add_argument("--batch", type=int, default=1024)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--devices", type=int, default=1024)
    p.add_argument("--devices-per-node", type=int, default=8)
    p.add_argument("--device", default="h100-80gb")
    p.add_argument("--mixed-precision", default="bf16")
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args()

    from hf_colossal_auto.hardware import get_device
    from hf_colossal_auto.models import build_model, make_example_inputs
    from hf_colossal_auto.solve.candidates import _Planner
    from hf_colossal_auto.solve.pipeline.search import search_pipelines
    from hf_colossal_auto.solve.planner import plan_model
    from hf_colossal_auto.units import format_bytes

    spec = get_device(args.device)
    model = build_model(args.model, device="meta")
    inputs = make_example_inputs(model, args.batch, args.seq, device="meta")
    flops = _model_flops_per_token(model, args.seq) * args.batch * args.seq
    peak = spec.peak_flops["bfloat16"]
    mixed = None if args.mixed_precision == "no" else args.mixed_precision
    common = dict(
        num_devices=args.devices, device=spec, devices_per_node=args.devices_per_node, mixed_precision=mixed
    )
    out: dict = {"model": args.model, "batch": args.batch, "seq": args.seq, "devices": args.devices}
    for label, pipeline in (("pipeline=1", 1), ("pipeline=None", None)):
        t0 = time.perf_counter()
        plan = plan_model(model, inputs, pipeline=pipeline, **common)
        seconds = time.perf_counter() - t0
        mfu = flops / (plan.step_time_s * args.devices * peak)
        layout = (
            f"pp {plan.pp_size} x dp {plan.dp_size}, {plan.schedule}, m={plan.micro_batches}"
            if plan.pp_size > 1
            else f"{plan.dp_size} x {plan.tp_size} {plan.dp_label}, k={plan.micro_batches}"
        )
        print(
            f"{label:14s} {layout:40s} step {plan.step_time_s:.3f} s  MFU {mfu * 100:.1f} %  peak "
            f"{format_bytes(plan.peak_memory_bytes)}  planned in {seconds:.1f} s"
        )
        out[label] = {
            "layout": layout,
            "step_time_s": plan.step_time_s,
            "mfu": mfu,
            "peak_memory_bytes": plan.peak_memory_bytes,
            "planning_s": seconds,
        }
    planner = _Planner.for_devices(
        model, inputs, args.devices, spec, args.devices_per_node, None, mixed, "adamw", 60.0, "none"
    )
    _, tried = search_pipelines(planner, None)
    out["pp_candidates"] = []
    print(f"pipeline candidates (budget {format_bytes(planner.budget)}):")
    for pp in sorted({c.pp for c in tried}):
        mine = [c for c in tried if c.pp == pp]
        fastest = min(mine, key=lambda c: c.step_time_s)
        leanest = min(mine, key=lambda c: c.peak_bytes)
        for what, c in (("fastest", fastest), ("least memory", leanest)):
            mfu = flops / (c.step_time_s * args.devices * peak)
            print(
                f"  pp {pp:3d} {what:13s} {c.schedule:24s} v={c.virtual} m={c.micro_batches:4d} step "
                f"{c.step_time_s:8.3f} s MFU {mfu * 100:5.1f} %  bubble {c.simulation.bubble_fraction * 100:4.1f} %"
                f"  peak {format_bytes(c.peak_bytes):>11s} (state {format_bytes(max(c.rank_state_bytes))})"
            )
            out["pp_candidates"].append({**c.record(planner.budget), "what": what, "mfu": mfu})
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
