"""What-if: long sequences with context parallelism planned (issue 28, item 3), predicted by the cost model.

For a preset, a global batch of sequences and a cluster, prints

* the plan without context parallelism (``context_parallel=1``; sequence parallelism and recompute are the
  ILP's to choose), or the least memory any such plan needs where none fits the budget;
* the plan with the cp degree searched (``context_parallel=None``), and each cp degree's fastest plan or the
  least memory it needs;
* torchtitan's published long-context configuration (docs/performance.md, Table 2: Llama 3.1 8B on 8 H100,
  FSDP 2 x CP 4, local batch 1 — a global batch of 2 sequences —, full activation checkpointing, 131,072 tokens;
  on more devices the same layout replicated: FSDP n/4 x CP 4, n/4 sequences) priced by the same model at its
  own batch, its budget lifted so that its peak is reported whether or not it fits.

MFU: 6 x parameters + 6 x layers x hidden x sequence FLOPs per token (``scripts/bench_planner.py``'s count)
over the devices' dense bf16 peak. Usage::

    python scripts/bench_context_parallel.py                       # llama3-8b, 1 x 131072 tokens on 8 h100-80gb
    python scripts/bench_context_parallel.py --devices 64          # 8 x 131072 tokens on 64
    python scripts/bench_context_parallel.py --model tiny-llama --seq 128 --batch 2 --devices 4 --max-positions 128
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_COLOSSAL_AUTO_NO_CALIBRATE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_planner import _model_flops_per_token  # noqa: E402

TORCHTITAN_CP = 4
"""torchtitan's published 131,072-token Llama 3.1 8B configuration: FSDP 2 x CP 4 on 8 GPUs, local batch 1."""


def _layout(plan) -> str:
    recompute = sorted(set(plan.recompute.values())) or ["none"]
    return (
        f"dp {plan.dp_size} x cp {plan.cp_size} x tp {plan.tp_size} {plan.dp_mode}, k={plan.micro_batches}, "
        f"recompute {'/'.join(recompute)}, SP blocks {len(plan.sequence_parallel_blocks)}"
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama3-8b")
    p.add_argument("--batch", type=int, default=None, help="global batch of sequences (default devices / 8)")
    p.add_argument("--seq", type=int, default=131072)
    p.add_argument("--max-positions", type=int, default=None, help="raise the config's max positions to this")
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--devices-per-node", type=int, default=8)
    p.add_argument("--device", default="h100-80gb")
    p.add_argument(
        "--budget", default=None, help="per device (default: the device's memory minus the margin)"
    )
    p.add_argument("--time-limit", type=float, default=60.0)
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)

    from hf_colossal_auto.hardware import get_device
    from hf_colossal_auto.hardware.catalog import memory_budget_default
    from hf_colossal_auto.models import build_model, load_config, make_example_inputs
    from hf_colossal_auto.solve.planner import plan_model
    from hf_colossal_auto.solve.problem import InfeasibleError
    from hf_colossal_auto.units import format_bytes, parse_bytes

    spec = get_device(args.device)
    config = load_config(args.model)
    config.max_position_embeddings = max(args.max_positions or args.seq, config.max_position_embeddings)
    model = build_model(config, device="meta")
    batch = args.batch or max(1, args.devices // 8)
    inputs = make_example_inputs(model, batch, args.seq, device="meta")
    per_sequence = _model_flops_per_token(model, args.seq) * args.seq
    peak = spec.peak_flops["bfloat16"]
    budget = parse_bytes(args.budget) if args.budget else memory_budget_default(spec)
    common = dict(
        num_devices=args.devices,
        device=spec,
        devices_per_node=args.devices_per_node,
        mixed_precision="bf16",
        time_limit_s=args.time_limit,
    )
    print(
        f"{args.model}: {batch} x {args.seq} tokens on {args.devices} x {spec.name} ({args.devices_per_node} per "
        f"node), bf16, AdamW, budget {format_bytes(budget)}"
    )
    out: dict = {
        "model": args.model,
        "batch": batch,
        "seq": args.seq,
        "devices": args.devices,
        "budget": budget,
    }

    def row(label: str, plan, seconds: float) -> None:
        mfu = per_sequence * plan.global_batch_size / (plan.step_time_s * args.devices * peak)
        cp = plan.solver.get("context_parallel", {})
        kv = cp.get("kv_all_gather_s", 0.0) + cp.get("kv_reduce_scatter_s", 0.0)
        print(
            f"  {label:26s} {_layout(plan)}\n  {'':26s} step {plan.step_time_s:.2f} s (comm "
            f"{plan.communication_time_s:.2f} s, K/V {kv:.2f} s)  MFU {mfu * 100:.1f} %  peak "
            f"{format_bytes(plan.peak_memory_bytes)}  planned in {seconds:.0f} s"
        )
        out[label] = {
            "layout": _layout(plan),
            "step_time_s": plan.step_time_s,
            "communication_s": plan.communication_time_s,
            "kv_collectives_s": kv,
            "mfu": mfu,
            "peak_memory_bytes": plan.peak_memory_bytes,
            "planning_s": seconds,
            "fits": plan.peak_memory_bytes <= budget,
        }

    for label, cp in (("context_parallel=1", 1), ("context_parallel=None", None)):
        t0 = time.perf_counter()
        try:
            plan = plan_model(model, inputs, memory_budget=budget, context_parallel=cp, **common)
        except InfeasibleError as exc:
            print(f"  {label:26s} no plan fits: the least any needs is {format_bytes(exc.min_required)}")
            out[label] = {"fits": False, "min_required_bytes": exc.min_required}
            continue
        row(label, plan, time.perf_counter() - t0)
        degrees = plan.solver.get("context_parallel_degrees", {})
        for c, figures in sorted(degrees.items(), key=lambda kv: int(kv[0])):
            if figures["fits"]:
                mfu = per_sequence * batch / (figures["step_time_s"] * args.devices * peak)
                print(
                    f"    cp {c:>3s}: mesh {figures['mesh']} {figures['dp_mode']} k={figures['micro_batches']} "
                    f"recompute {'/'.join(figures['recompute'])}  step {figures['step_time_s']:.2f} s  MFU "
                    f"{mfu * 100:.1f} %  peak {format_bytes(figures['peak_memory_bytes'])}"
                )
            elif figures["fits"] is None:  # pruned: no plan of it beats the one found before it
                print(f"    cp {c:>3s}: pruned, no plan faster than {figures['min_step_time_s']:.2f} s")
            else:
                print(
                    f"    cp {c:>3s}: no plan fits, the least needs {format_bytes(figures['min_required_bytes'])}"
                )
        if degrees:
            out[label]["per_degree"] = degrees
    if args.devices % TORCHTITAN_CP == 0:
        dp = args.devices // TORCHTITAN_CP
        t0 = time.perf_counter()
        plan = plan_model(
            model,
            make_example_inputs(model, dp, args.seq, device="meta"),
            memory_budget=1 << 50,
            context_parallel=TORCHTITAN_CP,
            mesh_shape=(dp, 1),
            dp_modes=("fsdp",),
            recompute="full",
            micro_batches=1,
            **common,
        )
        row(f"torchtitan FSDP {dp}xCP {TORCHTITAN_CP}, {dp} seq", plan, time.perf_counter() - t0)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
