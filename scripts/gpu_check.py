"""Single-device check of the profiler's and planner's predictions against a real training step.

For each model (GPT-2 medium and large by default) in bf16 autocast with AdamW(foreach):

* **memory**: the profiler's liveness peak of a steady-state step vs ``torch.cuda.max_memory_allocated`` (reset
  after the optimizer state exists, so both describe the same steady-state step);
* **time**: the profiler's roofline step time on the detected device vs the measured median step time;
* **runtime**: the same with the model parallelized by our runtime on a one-device job (a plan for
  ``num_devices=1``), to see the cost of running the model on DTensor parameters.

Prints one table; ``--json`` writes it too. Runs on CPU as well (``--device cpu --models tiny-gpt2``) so that it
is tested where no GPU is lent: ``scripts/gpu_check.sh`` is the prepared GPU command.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import transformers


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _measure(model, batch, device: str, steps: int) -> tuple[float, int]:
    """Median step seconds and peak bytes of a steady-state step (optimizer state already allocated)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=True)

    def step() -> None:
        with torch.autocast(device, dtype=torch.bfloat16):
            loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(2):
        step()
    _sync(device)
    peak = 0
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        step()
        _sync(device)
        peak = torch.cuda.max_memory_allocated()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models", nargs="+", default=["gpt2-medium", "gpt2-large"])
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    transformers.logging.set_verbosity_error()
    from hf_colossal_auto.apply import apply_plan
    from hf_colossal_auto.hardware import detect_device
    from hf_colossal_auto.models import build_model, make_example_inputs
    from hf_colossal_auto.profile import profile_model
    from hf_colossal_auto.solve.planner import plan_model

    spec = detect_device() if args.device == "cuda" else "cpu"
    rows = []
    for name in args.models:
        torch.manual_seed(0)
        model = build_model(name, device=args.device)
        batch = make_example_inputs(model, args.batch_size, args.seq_len, device=args.device)
        report = profile_model(model, batch, device=spec, mixed_precision="bf16")
        step_s, peak = _measure(model, batch, args.device, args.steps)
        row = {
            "model": name,
            "predicted_peak_bytes": report.peak_memory_bytes,
            "measured_peak_bytes": peak,
            "predicted_step_s": report.estimated_step_time_s,
            "measured_step_s": step_s,
        }
        # the same model through the runtime, on a one-device job
        if not torch.distributed.is_initialized():
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", "29531")
            torch.distributed.init_process_group(
                "nccl" if args.device == "cuda" else "gloo", rank=0, world_size=1
            )
        plan = plan_model(model, batch, num_devices=1, device=spec, mixed_precision="bf16")
        apply_plan(model, plan)
        runtime_s, runtime_peak = _measure(model, batch, args.device, args.steps)
        row.update(runtime_step_s=runtime_s, runtime_peak_bytes=runtime_peak, plan_step_s=plan.step_time_s)
        rows.append(row)
        del model
        if args.device == "cuda":
            torch.cuda.empty_cache()
    gib = 2**30
    print(
        f"device: {spec if isinstance(spec, str) else spec.name}, batch {args.batch_size}x{args.seq_len}, bf16, AdamW"
    )
    print(
        f"{'model':12s} {'peak pred':>10s} {'peak meas':>10s} {'err':>7s} {'step pred':>10s} {'step meas':>10s}"
        f" {'runtime step':>12s} {'runtime peak':>12s}"
    )
    for r in rows:
        err = (
            (r["predicted_peak_bytes"] - r["measured_peak_bytes"]) / r["measured_peak_bytes"]
            if r["measured_peak_bytes"]
            else float("nan")
        )
        print(
            f"{r['model']:12s} {r['predicted_peak_bytes'] / gib:9.2f}G {r['measured_peak_bytes'] / gib:9.2f}G {err:7.1%}"
            f" {r['predicted_step_s'] * 1e3:8.1f}ms {r['measured_step_s'] * 1e3:8.1f}ms"
            f" {r['runtime_step_s'] * 1e3:10.1f}ms {r['runtime_peak_bytes'] / gib:11.2f}G"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
