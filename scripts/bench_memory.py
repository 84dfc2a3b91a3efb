"""Benchmark joint sharding + activation recompute under a memory budget (issue 5).

Three parts, each a table (``--parts`` picks them):

``frontier``: for GPT-2 large (global batch 8 x 1024) and Llama-7B (8 x 4096) on 8 x a100-80gb, bf16 autocast,
AdamW: the predicted step time at budgets from the smallest memory any joint plan needs up to the fastest
no-recompute plan's peak x 1.1, for ``auto`` (sharding and per-block recompute in one ILP), ``two-stage``
(shard, then recompute), ``tp-only`` (Megatron, no recompute), ``tp+full-recompute`` and
``fsdp+full-recompute`` (:func:`hf_colossal_auto.solve.frontier.frontier`). Target: wherever TP + full
recompute fits, auto is >= 15 % faster (its step time x 1.15 <= TP + full recompute's).

``layers``: the deepest model (same config, ``num_hidden_layers`` varied on the meta device) each approach fits
at a fixed per-device budget (default: the a100-80gb planning budget, capacity minus the 10 % margin), by
doubling then bisecting the depth; its parameters and predicted step time. Target: auto fits >= 1.5 x the
parameters TP-only fits.

``measured``: real CPU runs on 2 gloo processes (``tests/multiproc/check_recompute.py`` under
``python -m torch.distributed.run``): tiny-gpt2 and tiny-llama planned under budget = fraction x the
no-recompute peak (mesh 1 x 2, batch 8 x 64), applied, and one steady-state step measured with MemTracker:
measured vs predicted per-rank peak, the budget, the recompute chosen, loss and gradient error against one
process.

Everything but ``measured`` is a prediction of the cost model (no GPU involved).

Usage::

    python scripts/bench_memory.py [--quick] [--parts frontier,layers,measured] [--json out.json]
        [--plot-dir plots/] [--layer-budget 72GiB]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_COLOSSAL_AUTO_NO_CALIBRATE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

ROOT = Path(__file__).resolve().parents[1]
CHECK_SCRIPT = ROOT / "tests" / "multiproc" / "check_recompute.py"
DEVICE = "a100-80gb"
NUM_DEVICES = 8
MIXED = "bf16"
SPEEDUP_TARGET = 1.15
PARAMS_TARGET = 1.5
MAX_LAYERS = 4096


@dataclass(frozen=True)
class Case:
    preset: str
    batch: int
    seq: int

    @property
    def label(self) -> str:
        return f"{self.preset} {self.batch}x{self.seq}"


CASES = (Case("gpt2-large", 8, 1024), Case("llama-7b", 8, 4096))
QUICK_CASES = (Case("gpt2-large", 8, 1024),)
MEASURED_MODELS = ("tiny-gpt2", "tiny-llama")
FRACTIONS = (1.0, 0.75, 0.6)
QUICK_FRACTIONS = (1.0, 0.6)


def _gib(n: float | None) -> str:
    return "-" if n is None else f"{n / 2**30:.2f} GiB"


def _ms(s: float | None) -> str:
    return "-" if s is None else f"{s * 1e3:.1f} ms"


def _print_table(header: list[str], rows: list[list[str]]) -> None:
    print("| " + " | ".join(header) + " |")
    print("|" + "|".join("-" * (len(h) + 2) for h in header) + "|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    print(flush=True)


# --------------------------------------------------------------------------------------------- frontier
def run_frontier(case: Case, points: int, approaches: tuple[str, ...], plot_dir: Path | None) -> dict:
    from hf_colossal_auto.models import build_model, make_example_inputs
    from hf_colossal_auto.solve.frontier import PlotUnavailableError, frontier

    model = build_model(case.preset, device="meta")
    batch = make_example_inputs(model, case.batch, case.seq, device="meta")
    t0 = time.perf_counter()
    front = frontier(
        model,
        batch,
        num_devices=NUM_DEVICES,
        device=DEVICE,
        points=points,
        approaches=approaches,
        mixed_precision=MIXED,
        progress=None if sys.stderr.isatty() else False,
        title=f"{case.label}, {NUM_DEVICES} x {DEVICE}, {MIXED}",
    )
    elapsed = time.perf_counter() - t0
    print(f"### Frontier: {case.label} ({elapsed:.0f} s)\n")
    print(front.table())
    print()
    speedups = []
    for b in front.budgets:
        tp_full = front.time_at("tp+full-recompute", b) if "tp+full-recompute" in front.curves else None
        auto = front.time_at("auto", b)
        if tp_full is not None and auto is not None:
            speedups.append({"budget": b, "speedup": tp_full / auto})
    if speedups:
        worst = min(s["speedup"] for s in speedups)
        met = worst >= SPEEDUP_TARGET
        print(
            f"auto vs tp+full-recompute where the latter fits: speedup {worst:.3f}x (worst) .. "
            f"{max(s['speedup'] for s in speedups):.3f}x over {len(speedups)} budgets; "
            f"target >= {SPEEDUP_TARGET}x: {'met' if met else 'NOT met'}\n"
        )
    else:
        print("tp+full-recompute fits none of the budgets: the speed target does not apply\n")
    slower = [
        (name, b)
        for name, curve in front.curves.items()
        if name != "auto"
        for b, p in zip(front.budgets, curve, strict=True)
        if p.fits
        and (front.time_at("auto", b) is None or front.time_at("auto", b) > p.step_time_s * (1 + 1e-9))
    ]
    if slower:
        print(f"WARNING: auto slower than (or not fitting where) a fitting approach: {slower}\n")
    plot = None
    if plot_dir is not None:
        try:
            plot = str(front.plot(plot_dir / f"frontier_{case.preset}.png"))
            print(f"wrote {plot}\n")
        except PlotUnavailableError as exc:
            print(f"no plot: {exc}\n")
    return {
        "case": case.label,
        "seconds": elapsed,
        "frontier": front.to_dict(),
        "speedups_vs_tp_full": speedups,
        "auto_slower_than": slower,
        "plot": plot,
    }


# ----------------------------------------------------------------------------------------------- layers
def _with_layers(preset: str, layers: int):
    from hf_colossal_auto.models import load_config

    config = copy.deepcopy(load_config(preset))
    config.num_hidden_layers = layers
    types = getattr(config, "layer_types", None)
    if isinstance(types, list) and types:
        config.layer_types = [types[i % len(types)] for i in range(layers)]
    return config


def _try_depth(case: Case, approach: str, layers: int, budget: int) -> dict | None:
    """The approach's plan for the model at this depth if it fits the budget, else None."""
    from hf_colossal_auto.models import build_model, make_example_inputs, param_count
    from hf_colossal_auto.solve.frontier import BASELINE_RECIPES
    from hf_colossal_auto.solve.planner import evaluate_plan, plan_model
    from hf_colossal_auto.solve.problem import InfeasibleError

    model = build_model(_with_layers(case.preset, layers), device="meta")
    batch = make_example_inputs(model, case.batch, case.seq, device="meta")
    common = dict(num_devices=NUM_DEVICES, device=DEVICE, memory_budget=budget, mixed_precision=MIXED)
    if approach == "auto":
        try:
            plan = plan_model(model, batch, **common)
        except InfeasibleError:
            return None
        step, peak, mesh, recompute = (
            plan.step_time_s,
            plan.peak_memory_bytes,
            plan.mesh_shape,
            plan.recompute,
        )
    else:
        baseline, mode = BASELINE_RECIPES[approach]
        est = evaluate_plan(model, batch, baseline, recompute=mode, **common)
        if not est.fits:
            return None
        step, peak, mesh, recompute = (
            est.step_time_s,
            est.peak_memory_bytes,
            est.mesh_shape,
            est.plan.recompute,
        )
    counts: dict[str, int] = {}
    for option in recompute.values():
        counts[option] = counts.get(option, 0) + 1
    return {
        "layers": layers,
        "params": param_count(model),
        "step_time_s": step,
        "peak_memory_bytes": peak,
        "mesh": list(mesh),
        "recompute": counts,
    }


def deepest(case: Case, approach: str, budget: int, start: int) -> tuple[dict | None, int]:
    """Largest depth that fits (doubling from ``start``, then bisection), and how many depths were planned."""
    tried = 0
    fit: dict | None = None
    lo, hi = 0, None  # lo fits (0: nothing known), hi does not
    depth = start
    while hi is None:
        tried += 1
        got = _try_depth(case, approach, depth, budget)
        if got is None:
            hi = depth
        else:
            fit, lo = got, depth
            if depth >= MAX_LAYERS:
                return fit, tried
            depth = min(depth * 2, MAX_LAYERS)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        tried += 1
        got = _try_depth(case, approach, mid, budget)
        if got is None:
            hi = mid
        else:
            fit, lo = got, mid
    return fit, tried


def run_layers(case: Case, approaches: tuple[str, ...], budget: int) -> dict:
    from hf_colossal_auto.models import load_config

    start = load_config(case.preset).num_hidden_layers
    rows, out = [], {}
    t0 = time.perf_counter()
    for approach in approaches:
        fit, tried = deepest(case, approach, budget, start)
        out[approach] = fit
        if fit is None:
            rows.append([approach, "none fits", "-", "-", "-", "-", str(tried)])
        else:
            rows.append(
                [
                    approach,
                    str(fit["layers"]),
                    f"{fit['params'] / 1e9:.2f} B",
                    _ms(fit["step_time_s"]),
                    _gib(fit["peak_memory_bytes"]),
                    "x".join(map(str, fit["mesh"]))
                    + " "
                    + ", ".join(f"{k} x{v}" for k, v in fit["recompute"].items()),
                    str(tried),
                ]
            )
    elapsed = time.perf_counter() - t0
    print(f"### Deepest model at {_gib(budget)} per device: {case.label} ({elapsed:.0f} s)\n")
    _print_table(
        ["approach", "layers", "params", "step time", "peak", "plan (mesh, recompute)", "depths planned"],
        rows,
    )
    ratio = None
    if out.get("auto") and out.get("tp-only"):
        ratio = out["auto"]["params"] / out["tp-only"]["params"]
        print(
            f"auto fits {ratio:.2f}x the parameters TP-only fits; target >= {PARAMS_TARGET}x: "
            f"{'met' if ratio >= PARAMS_TARGET else 'NOT met'}\n"
        )
    return {"case": case.label, "budget": budget, "seconds": elapsed, "deepest": out, "params_ratio": ratio}


# --------------------------------------------------------------------------------------------- measured
def _first_error(output: str) -> str:
    """The first exception line a rank printed (torchrun's own summary hides it), else the output's tail."""
    for line in output.splitlines():
        text = line.strip()
        failed = "Error:" in text or "Exception:" in text
        if failed and not text.startswith("File ") and "ChildFailedError" not in text:
            return text
    return output[-2000:]


def run_measured(models: tuple[str, ...], fractions: tuple[float, ...], timeout_s: float) -> list[dict]:
    results = []
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory(prefix="bench_memory_") as tmp:
        for model in models:
            for fraction in fractions:
                out = Path(tmp) / f"{model}_{fraction}.json"
                cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
                cmd += [str(CHECK_SCRIPT), "--case", f"{model}:1x2:ddp:{fraction}", "--out", str(out)]
                t0 = time.perf_counter()
                try:
                    proc = subprocess.run(
                        cmd, env=env, capture_output=True, text=True, timeout=timeout_s, cwd=ROOT
                    )
                    rc, tail = proc.returncode, _first_error(proc.stdout + proc.stderr)
                except subprocess.TimeoutExpired:
                    rc, tail = -1, f"timed out after {timeout_s} s"
                ranks = []
                for k in range(2):
                    path = Path(f"{out}.rank{k}")
                    if path.exists():
                        ranks.append(json.loads(path.read_text())[0])  # one case per launch
                entry = {"model": model, "fraction": fraction, "rc": rc, "seconds": time.perf_counter() - t0}
                if rc != 0 or len(ranks) != 2:
                    entry["error"] = tail
                else:
                    entry["ranks"] = ranks
                results.append(entry)
    rows = []
    for e in results:
        if "ranks" not in e:
            last = e["error"].strip().splitlines()[-1:] or ["?"]
            rows.append([e["model"], f"{e['fraction']:.2f}", "failed: " + last[0][:120], *["-"] * 6])
            continue
        r0 = e["ranks"][0]
        measured = max(r["measured_peak"] for r in e["ranks"])
        predicted = r0["predicted_peak"]
        err = (measured - predicted) / predicted
        recompute = (
            ", ".join(f"{k.rsplit('.', 1)[-1]}: {v}" for k, v in sorted(r0["recompute"].items())) or "none"
        )
        rows.append(
            [
                e["model"],
                f"{e['fraction']:.2f}",
                f"{r0['budget'] / 2**20:.3f} MiB",
                f"{predicted / 2**20:.3f} MiB",
                f"{measured / 2**20:.3f} MiB",
                f"{err * 100:+.1f} %",
                "yes" if measured <= r0["budget"] else "NO",
                recompute,
                f"{abs(r0['loss'] - r0['ref_loss']):.1e} / {max(r['max_grad_err'] for r in e['ranks']):.1e}",
            ]
        )
    print("### Measured peaks on CPU (2 gloo ranks, mesh 1x2, batch 8x64, one steady-state step)\n")
    _print_table(
        [
            "model",
            "fraction",
            "budget",
            "predicted peak",
            "measured peak (max rank)",
            "error",
            "<= budget",
            "recompute per block",
            "loss / grad err vs 1 process",
        ],
        rows,
    )
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="GPT-2 only, fewer points and fractions")
    parser.add_argument("--parts", default="frontier,layers,measured")
    parser.add_argument("--points", type=int, default=None, help="budgets per frontier (default 8; quick 4)")
    parser.add_argument("--layer-budget", default=None, help="per-device budget of the layers part")
    parser.add_argument("--plot-dir", type=Path, default=None, help="write frontier PNGs here (matplotlib)")
    parser.add_argument("--json", type=Path, default=None, help="write every result here")
    parser.add_argument("--measure-timeout", type=float, default=600.0)
    args = parser.parse_args(argv)
    import torch
    import transformers

    from hf_colossal_auto.hardware import get_device
    from hf_colossal_auto.hardware.catalog import memory_budget_default
    from hf_colossal_auto.units import parse_bytes

    transformers.logging.set_verbosity_error()
    parts = {p.strip() for p in args.parts.split(",") if p.strip()}
    unknown = parts - {"frontier", "layers", "measured"}
    if unknown:
        parser.error(f"unknown --parts {sorted(unknown)}; use frontier, layers, measured")
    cases = QUICK_CASES if args.quick else CASES
    points = args.points or (4 if args.quick else 8)
    frontier_approaches = ("auto", "tp-only", "tp+full-recompute", "fsdp+full-recompute")
    if not args.quick:
        frontier_approaches = ("auto", "two-stage", *frontier_approaches[1:])
    budget = (
        parse_bytes(args.layer_budget) if args.layer_budget else memory_budget_default(get_device(DEVICE))
    )
    print(
        f"machine: {platform.machine()} {os.cpu_count()} cores, Python {platform.python_version()}, "
        f"torch {torch.__version__}, transformers {transformers.__version__}\n"
    )
    results: dict[str, Any] = {"device": DEVICE, "num_devices": NUM_DEVICES, "mixed_precision": MIXED}
    if "frontier" in parts:
        results["frontier"] = [run_frontier(c, points, frontier_approaches, args.plot_dir) for c in cases]
    if "layers" in parts:
        layer_approaches = ("auto", "tp-only", "tp+full-recompute", "fsdp+full-recompute")
        results["layers"] = [run_layers(c, layer_approaches, budget) for c in cases]
    if "measured" in parts:
        results["measured"] = run_measured(
            MEASURED_MODELS, QUICK_FRACTIONS if args.quick else FRACTIONS, args.measure_timeout
        )
    if args.json:
        args.json.write_text(json.dumps(results, indent=1, default=str))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
