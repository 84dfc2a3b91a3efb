"""Benchmark the planner: end-to-end planning time, and auto plans against DDP / FSDP / Megatron on a grid.

``--timing``: one ``plan_model`` call (capture + profile + strategies + ILP, for every mesh and data-parallel
mode it tries) per model, each in a *fresh* Python process (so no trace, dispatcher or import cache carries
over from an earlier call), repeated ``--repeat`` times; the median, min and max wall time of the call, the
number of (mesh, DP mode) ILPs tried and the distinct meshes, and a per-stage split measured by wrapping the
planner's internal stages with timers (capture, strategy enumeration, ILP build, ILP solve, plan write-up).
Defaults: GPT2-XL at 8x1024 on 8 devices and Llama-7B at 64x2048 on 64 devices, a100-80gb, bf16, AdamW.
Targets: <= 10 s and <= 30 s.

``--grid``: for each model x device count x per-device memory budget, ``plan_model`` ("auto") against the
``ddp``, ``fsdp`` and ``megatron`` baselines of ``evaluate_plan`` (same cost model): predicted step time,
per-device peak and whether it fits, and two checks per cell:

* ``auto<=best``: auto is no slower than the fastest baseline that fits (n/a when none fits);
* ``auto feasible``: auto found a plan whenever at least one baseline fits.

The global batch is a whole number of sequences per device (so it divides by every data-parallel size of the
device count): 4 sequences of 1024 tokens for GPT-2, 4 of 512 for BERT, 4 of 512 (targets 128) for T5, and 1 of
2048 for Llama-7B (at 4 x 2048 per device no plan and no baseline fits 80 GB without activation recompute, which
the planner does not model yet; ``--llama-seqs-per-device 4`` shows it).
``evaluate_plan`` prices a baseline with the memory budget lifted and only compares its peak with the budget
afterwards, so a baseline's time and peak do not depend on the budget: each baseline is priced once per
(model, devices) and its ``fits`` is re-read against every budget (``--no-baseline-cache`` re-prices it per
cell). A cell that raises records the error text instead of stopping the grid.

``--scale``: the planner at cluster scale, on h100-80gb (8 per node, default budget), bf16, AdamW: Llama-3-70B
at 1024 x 4096 on 1024 devices and Llama-3-405B at 2048 x 8192 (16M tokens, Llama 3 405B's batch in its
8192-token phase) on 8192 devices. Each case runs in a fresh process: one ``plan_model`` call (its wall time is
the planning time; target <= 30 s on the 2-core machine), then hand configurations priced by ``evaluate_plan``
under the same cost model, tensor parallelism 8 inside a node with Megatron's column/row placements:

* ``fsdp-tp-full`` (torchtitan's Llama-3 70B/405B setting): FSDP x TP, full recompute of every block, the fewest
  micro-batches that fit;
* ``fsdp-tp-sel`` (torchtitan's selective policy): FSDP x TP, selective recompute (``selective:pointwise``: matmul and attention
  outputs kept, the pointwise ops recomputed), the fewest micro-batches that fit;
* ``hsdp-tp-sel``: the same on HSDP, shard groups of the fewest data-parallel ranks (a power of two) whose share
  of the parameters and optimizer state is at most a quarter of the budget;
* ``megatron-mb1``: TP x DP (DDP), one sequence per micro-batch, no recompute (Megatron's selective recompute
  is attention's, which the fused kernel already does).

Hand configurations are priced under the budget (activation placements chosen to fit, ``fit_budget``) and, where
their pinned choices cannot fit, with it lifted and reported as not fitting. Checks: auto <= the best hand
configuration that fits, and strictly better in some case. MFU counts 6 x parameters + causal attention
(6 x layers x hidden x sequence) FLOPs per token over the device's dense bf16 peak.

Usage::

    python scripts/bench_planner.py --timing [--repeat 3] [--json timing.json]
    python scripts/bench_planner.py --grid --quick [--json grid-quick.json]
    python scripts/bench_planner.py --grid [--models gpt2,llama-7b] [--devices 8,64] [--budgets default,20GiB]
    python scripts/bench_planner.py --scale [--scale-cases llama3-70b] [--json scale.json]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
from collections import defaultdict
from pathlib import Path

os.environ.setdefault("HF_COLOSSAL_AUTO_NO_CALIBRATE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

DEVICE = "a100-80gb"
MIXED = "bf16"
BASELINES = ("ddp", "fsdp", "megatron")

TIMING_CASES = (("gpt2-xl", 8, 1024, 8), ("llama-7b", 64, 2048, 64))
TIMING_TARGETS_S = {"gpt2-xl": 10.0, "llama-7b": 30.0}

GRID_MODELS = ("gpt2", "gpt2-xl", "bert-base", "bert-large", "t5-small", "t5-large", "llama-7b")
GRID_DEVICES = (8, 16, 64)
GRID_BUDGETS = ("default", "40GiB", "20GiB")
QUICK_MODELS = ("gpt2", "bert-base", "t5-small", "llama-7b")
QUICK_DEVICES = (8, 64)
QUICK_BUDGETS = ("default", "20GiB")
SEQ_LEN = {"gpt2": 1024, "bert": 512, "t5": 512, "llama": 2048}
SEQS_PER_DEVICE = {"gpt2": 4, "bert": 4, "t5": 4, "llama": 1}
SCALE_DEVICE = "h100-80gb"
SCALE_CASES = {
    # name: (model preset, global batch, sequence length, devices, devices per node)
    "llama3-70b": ("llama3-70b", 1024, 4096, 1024, 8),
    "llama3-405b": ("llama3-405b", 2048, 8192, 8192, 8),
}
SCALE_TARGET_S = 30.0
SCALE_TP = 8
SCALE_HAND_LAYOUT = "megatron-sp-local"
"""The hand configurations' tensor parallelism: Megatron's placements with the attention and MLP modules run on
local shards (``Plan.local_modules``) and the ops between them on sequence shards, as torchtitan's
``ColwiseParallel``/``RowwiseParallel`` with ``SequenceParallel`` norms and Megatron-LM with
``--sequence-parallel`` run them (Llama 3's 4-D layout too), so that they are priced as fast and as lean as our
runtime runs those layouts; their pipeline stages then send sequence shards. ``--scale-hand-layout
megatron-local`` prices them without sequence parallelism (the rows before 2026-12-07)."""
SCALE_MAX_MICRO_BATCHES = 4
"""Hand configurations try 1, 2, ... micro-batches (divisors of the replica's batch) up to this many tries."""
SCALE_PIPELINE: str | None = "auto"
"""``plan_model``'s pipeline for the scale cases: "auto" (None: pipeline stages searched beside the plans
without) or "1" (no stages), from ``--scale-pipeline``."""
PP_HAND = {
    # name: (pp degree, schedule, data-parallel mode inside a stage, recompute options tried in turn)
    "fsdp-tp-pp8-1f1b": (8, "1f1b", "fsdp", ("full",)),
    "fsdp-tp-pp8-interleaved": (8, "interleaved-1f1b", "fsdp", ("full",)),
    "llama3-4d": (16, "interleaved-1f1b", "fsdp", ("none", "selective:pointwise", "full")),
}
"""Pipeline hand configurations at scale, tensor parallelism 8 inside a node (Megatron's placements) and one
sequence per micro-batch: torchtitan's FSDP x TP x PP (pp 8, 1F1B and interleaved 1F1B, full recompute) and
Llama 3's 4-D layout without context parallelism (tp 8, pp 16, data parallel over the rest with parameters not
resharded after forward, interleaved 1F1B), the least recompute that fits."""
REL_TOL = 1e-6
"""Relative slack of the ``auto<=best`` check (the ILP is solved to a zero gap; this only absorbs rounding)."""


def _seq_len(model: str) -> int:
    return SEQ_LEN[model.split("-")[0]]


def _seqs_per_device(model: str) -> int:
    return SEQS_PER_DEVICE[model.split("-")[0]]


def _machine() -> dict:
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    import torch

    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "git": _git_state(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
    }


def _git_state() -> str:
    """Where the measured ``hf_colossal_auto`` was imported from, and its commit (the figures depend on it).

    In a git checkout: HEAD and the tracked files modified in the working tree. In an exported snapshot
    (``git archive``), the commit written to ``SNAPSHOT_COMMIT`` next to the package, if any.
    """
    import hf_colossal_auto

    root = Path(hf_colossal_auto.__file__).resolve().parent.parent
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=root,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split("\n")
    except (OSError, subprocess.CalledProcessError):
        marker = root / "SNAPSHOT_COMMIT"
        label = marker.read_text().strip() if marker.exists() else "not a git checkout"
        return f"{root}: snapshot {label}"
    modified = [line[3:] for line in dirty if line.strip()]
    return f"{root}: {head}" + (f" + modified {', '.join(modified)}" if modified else "")


def _gib(n: float | None) -> str:
    return "-" if n is None else f"{n / 2**30:.1f}G"


def _ms(s: float | None) -> str:
    return "-" if s is None else f"{s * 1e3:.1f}ms"


# ------------------------------------------------------------------------------------------------ timing
def _timing_child(model_name: str, batch: int, seq: int, devices: int) -> dict:
    """Runs in a fresh process: one plan_model call, with its stages timed by wrapping them."""
    t0 = time.perf_counter()
    from hf_colossal_auto.models import build_model, make_example_inputs
    from hf_colossal_auto.solve import planner as planner_mod

    t_import = time.perf_counter() - t0
    stages: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)

    def timed(stage: str, fn):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                stages[stage] += time.perf_counter() - start
                counts[stage] += 1

        return wrapper

    # Capture and strategies are cached per planner; wrap the uncached work only.
    cls = planner_mod._Planner  # re-exported from solve/candidates.py
    orig_graph, orig_strat = cls.graph, cls.strategies

    def graph(self, dp, micro_batches=1):
        if self.batch // (dp * micro_batches) in self._graphs:  # cached by micro-batch rows
            return orig_graph(self, dp, micro_batches)
        return timed("capture", orig_graph)(self, dp, micro_batches)

    def strategies(self, dp, tp, micro_batches=1):
        if tp == 1 or (self.batch // (dp * micro_batches), tp) in self._strategies:
            return orig_strat(self, dp, tp, micro_batches)
        self.graph(dp, micro_batches)  # charge a first capture to "capture", not to "strategies"
        return timed("strategies", orig_strat)(self, dp, tp, micro_batches)

    cls.graph, cls.strategies = graph, strategies
    from hf_colossal_auto.solve import candidates as candidates_mod
    from hf_colossal_auto.solve import search as search_mod

    candidates_mod.build_problem = timed("ilp_build", candidates_mod.build_problem)
    for module in (candidates_mod, search_mod, planner_mod):  # every module that solves an ILP
        module.solve = timed("ilp_solve", module.solve)
    candidates_mod._make_plan = timed("plan_writeup", candidates_mod._make_plan)

    t0 = time.perf_counter()
    model = build_model(model_name, device="meta")
    inputs = make_example_inputs(model, batch, seq, device="meta")
    t_build = time.perf_counter() - t0
    load = os.getloadavg()[0]
    t0, c0 = time.perf_counter(), time.process_time()
    plan = planner_mod.plan_model(model, inputs, num_devices=devices, device=DEVICE, mixed_precision=MIXED)
    t_plan, c_plan = time.perf_counter() - t0, time.process_time() - c0
    stages["other"] = t_plan - sum(stages.values())
    return {
        "import_s": t_import,
        "build_s": t_build,
        "plan_s": t_plan,
        "plan_cpu_s": c_plan,
        "loadavg_1m_before": load,
        "total_planning_s": plan.solver.get("total_planning_s"),
        "stages_s": dict(stages),
        "stage_calls": dict(counts),
        "ilps_tried": len(plan.alternatives),
        "meshes_tried": len({tuple(a["mesh"]) for a in plan.alternatives}),
        "alternatives": plan.alternatives,
        "mesh": list(plan.mesh_shape),
        "dp_mode": plan.dp_mode,
        "step_time_s": plan.step_time_s,
        "peak_memory_bytes": plan.peak_memory_bytes,
        "solver": plan.solver,
    }


def run_timing(repeat: int) -> list[dict]:
    results = []
    for name, batch, seq, devices in TIMING_CASES:
        runs = []
        for r in range(repeat):
            cmd = [sys.executable, __file__, "--_timing-child", f"{name}:{batch}x{seq}:{devices}"]
            proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if proc.returncode != 0:
                raise RuntimeError(f"timing child failed for {name}:\n{proc.stderr[-4000:]}")
            run = json.loads(proc.stdout.strip().splitlines()[-1])
            runs.append(run)
            print(
                f"  [{name} run {r + 1}/{repeat}] plan_model {run['plan_s']:.2f} s wall, "
                f"{run['plan_cpu_s']:.2f} s CPU (import {run['import_s']:.2f} s, build {run['build_s']:.2f} s, "
                f"load avg before {run['loadavg_1m_before']:.2f})",
                file=sys.stderr,
                flush=True,
            )
        plan_s = [r["plan_s"] for r in runs]
        med = statistics.median(plan_s)
        mid = runs[plan_s.index(sorted(plan_s)[len(plan_s) // 2])]
        results.append(
            {
                "model": name,
                "batch": batch,
                "seq_len": seq,
                "devices": devices,
                "device": DEVICE,
                "mixed_precision": MIXED,
                "plan_s_median": med,
                "plan_s_min": min(plan_s),
                "plan_s_max": max(plan_s),
                "plan_cpu_s_median": statistics.median(r["plan_cpu_s"] for r in runs),
                "target_s": TIMING_TARGETS_S[name],
                "meets_target": med <= TIMING_TARGETS_S[name],
                "median_run": mid,
                "runs": [{k: v for k, v in r.items() if k != "alternatives"} for r in runs],
            }
        )
    return results


def print_timing(results: list[dict]) -> None:
    print(
        f"{'model':9s} {'batch':>8s} {'dev':>4s} {'plan_model (median [min-max])':>30s} {'target':>7s} "
        f"{'CPU s':>6s} {'ILPs':>5s} {'meshes':>6s}  best plan"
    )
    for r in results:
        m = r["median_run"]
        span = f"{r['plan_s_median']:.2f} s [{r['plan_s_min']:.2f}-{r['plan_s_max']:.2f}]"
        print(
            f"{r['model']:9s} {r['batch']:>3d}x{r['seq_len']:<4d} {r['devices']:>4d} {span:>30s} "
            f"{'<=' + str(int(r['target_s'])) + ' s':>7s} {r['plan_cpu_s_median']:>6.2f} {m['ilps_tried']:>5d} {m['meshes_tried']:>6d}  "
            f"{'x'.join(map(str, m['mesh']))} {m['dp_mode']} {_ms(m['step_time_s'])} {_gib(m['peak_memory_bytes'])}"
            f"  {'OK' if r['meets_target'] else 'MISSES TARGET'}"
        )
        split = ", ".join(
            f"{k} {v:.2f} s ({m['stage_calls'].get(k, '-')}x)" if k != "other" else f"other {v:.2f} s"
            for k, v in m["stages_s"].items()
        )
        print(f"{'':9s} stages of the median run: {split}")


# ------------------------------------------------------------------------------------------------ grid
def _grid_cells(models, devices, budgets):
    return [(m, n, b) for m in models for n in devices for b in budgets]


def _budget_arg(budget: str):
    return None if budget == "default" else budget


def run_grid(models, devices, budgets, *, time_limit_s: float, cache_baselines: bool) -> dict:
    from hf_colossal_auto.hardware import get_device
    from hf_colossal_auto.hardware.catalog import memory_budget_default
    from hf_colossal_auto.models import build_model, make_example_inputs
    from hf_colossal_auto.solve import InfeasibleError
    from hf_colossal_auto.solve.planner import evaluate_plan, plan_model
    from hf_colossal_auto.units import parse_bytes

    spec = get_device(DEVICE)
    budget_bytes = {b: memory_budget_default(spec) if b == "default" else parse_bytes(b) for b in budgets}
    cells = _grid_cells(models, devices, budgets)
    rows: list[dict] = []
    t_start = time.perf_counter()
    done = 0
    for model_name in models:
        try:
            model = build_model(model_name, device="meta")
        except Exception as exc:  # noqa: BLE001 - a model that does not build is one row of errors
            for n in devices:
                for b in budgets:
                    done += 1
                    rows.append(_error_row(model_name, n, b, None, f"build_model: {exc!r}"))
            continue
        seq = _seq_len(model_name)
        for n in devices:
            batch = _seqs_per_device(model_name) * n
            inputs = make_example_inputs(model, batch, seq, device="meta")
            common = dict(num_devices=n, device=DEVICE, mixed_precision=MIXED, time_limit_s=time_limit_s)
            base_cache: dict[str, dict] = {}
            for b in budgets:
                done += 1
                t_cell = time.perf_counter()
                row = {
                    "model": model_name,
                    "devices": n,
                    "budget": b,
                    "budget_bytes": budget_bytes[b],
                    "batch": batch,
                    "seq_len": seq,
                }
                t0 = time.perf_counter()
                try:
                    plan = plan_model(model, inputs, memory_budget=_budget_arg(b), **common)
                    row["auto"] = {
                        "step_time_s": plan.step_time_s,
                        "peak_memory_bytes": plan.peak_memory_bytes,
                        "fits": plan.fits,
                        "mesh": list(plan.mesh_shape),
                        "dp_mode": plan.dp_mode,
                        "ilps_tried": len(plan.alternatives),
                        "solver_status": plan.solver.get("status"),
                        "alternatives": plan.alternatives,
                    }
                except InfeasibleError as exc:
                    row["auto"] = {"infeasible": True, "min_required_bytes": _finite(exc.min_required)}
                except Exception as exc:  # noqa: BLE001
                    row["auto"] = {"error": _err(exc)}
                row["auto"]["planning_s"] = time.perf_counter() - t0
                for base in BASELINES:
                    t0 = time.perf_counter()
                    if cache_baselines and base in base_cache:
                        est = dict(base_cache[base])
                        est["cached"] = True
                        est["pricing_s"] = 0.0
                    else:
                        try:
                            e = evaluate_plan(model, inputs, base, memory_budget=_budget_arg(b), **common)
                            est = {
                                "step_time_s": e.step_time_s,
                                "peak_memory_bytes": e.peak_memory_bytes,
                                "mesh": list(e.mesh_shape),
                                "dp_mode": e.dp_mode,
                            }
                        except Exception as exc:  # noqa: BLE001
                            est = {"error": _err(exc)}
                        est["pricing_s"] = time.perf_counter() - t0
                        base_cache[base] = est
                    if "error" not in est:
                        est["fits"] = est["peak_memory_bytes"] <= budget_bytes[b]
                    row[base] = est
                _checks(row)
                row["cell_s"] = time.perf_counter() - t_cell
                rows.append(row)
                gc.collect()
                print(
                    f"  [{done}/{len(cells)}] {model_name} x{n} budget={b}: {_auto_text(row['auto'])}; "
                    f"checks {row['check_faster']}/{row['check_feasible']} ({row['cell_s']:.1f} s, "
                    f"elapsed {time.perf_counter() - t_start:.0f} s)",
                    file=sys.stderr,
                    flush=True,
                )
            del inputs
        del model
        gc.collect()
    return {
        "device": DEVICE,
        "mixed_precision": MIXED,
        "seqs_per_device": {m: _seqs_per_device(m) for m in models},
        "baseline_cache": cache_baselines,
        "time_limit_s": time_limit_s,
        "elapsed_s": time.perf_counter() - t_start,
        "rows": rows,
        "failures": [
            {k: r[k] for k in ("model", "devices", "budget", "check_faster", "check_feasible")}
            for r in rows
            if r["check_faster"] == "FAIL" or r["check_feasible"] == "FAIL" or "error" in r["auto"]
        ],
    }


def _finite(x):
    return None if x is None or (isinstance(x, float) and not math.isfinite(x)) else int(x)


def _err(exc: BaseException) -> str:
    tb = traceback.extract_tb(exc.__traceback__)
    where = f" at {Path(tb[-1].filename).name}:{tb[-1].lineno}" if tb else ""
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}{where}"[:300]


def _error_row(model, n, b, budget_bytes, text) -> dict:
    row = {"model": model, "devices": n, "budget": b, "budget_bytes": budget_bytes, "auto": {"error": text}}
    for base in BASELINES:
        row[base] = {"error": text}
    row["check_faster"] = row["check_feasible"] = "error"
    return row


def _checks(row: dict) -> None:
    auto = row["auto"]
    feasible = [row[b]["step_time_s"] for b in BASELINES if row[b].get("fits")]
    auto_ok = "step_time_s" in auto and auto.get("fits")
    if "error" in auto:
        row["check_faster"] = row["check_feasible"] = "error"
    else:
        row["check_feasible"] = "ok" if auto_ok or not feasible else "FAIL"
        if not feasible:
            row["check_faster"] = "n/a"
        else:
            best = min(feasible)
            row["best_baseline_s"] = best
            if auto_ok:
                row["auto_over_best"] = auto["step_time_s"] / best
                row["check_faster"] = "ok" if auto["step_time_s"] <= best * (1 + REL_TOL) else "FAIL"
            else:
                row["check_faster"] = "FAIL"


def _auto_text(auto: dict) -> str:
    if "error" in auto:
        return f"ERROR {auto['error']}"
    if auto.get("infeasible"):
        return f"infeasible (needs >= {_gib(auto['min_required_bytes'])})"
    return (
        f"{'x'.join(map(str, auto['mesh']))} {auto['dp_mode']} {_ms(auto['step_time_s'])} "
        f"{_gib(auto['peak_memory_bytes'])} ({auto['planning_s']:.1f} s)"
    )


def _base_text(est: dict) -> str:
    if "error" in est:
        return "ERROR"
    mesh = "x".join(map(str, est["mesh"]))
    return (
        f"{_ms(est['step_time_s'])} {_gib(est['peak_memory_bytes'])} {'fits' if est['fits'] else 'NO'} {mesh}"
    )


def print_grid(result: dict) -> None:
    head = (
        f"{'model':10s} {'dev':>3s} {'budget':>7s} | {'auto: mesh mode time peak (plan s)':38s} | "
        + " | ".join(f"{b + ': time peak fits mesh':26s}" for b in BASELINES)
        + " | auto<=best feasible  auto/best"
    )
    print(head)
    print("-" * len(head))
    for r in result["rows"]:
        ratio = f"{r['auto_over_best']:.3f}" if "auto_over_best" in r else "-"
        print(
            f"{r['model']:10s} {r['devices']:>3d} {r['budget']:>7s} | {_auto_text(r['auto']):38s} | "
            + " | ".join(f"{_base_text(r[b]):26s}" for b in BASELINES)
            + f" | {r['check_faster']:>10s} {r['check_feasible']:>8s}  {ratio:>9s}"
        )
    errors = [(r, k) for r in result["rows"] for k in ("auto", *BASELINES) if "error" in r[k]]
    for r, k in errors:
        print(f"ERROR {r['model']} x{r['devices']} {r['budget']} {k}: {r[k]['error']}")
    n = len(result["rows"])
    fails = result["failures"]
    print(
        f"\n{n} cells in {result['elapsed_s']:.0f} s; "
        f"auto<=best failures: {sum(r['check_faster'] == 'FAIL' for r in result['rows'])}, "
        f"feasibility failures: {sum(r['check_feasible'] == 'FAIL' for r in result['rows'])}, "
        f"errors: {sum(r['check_faster'] == 'error' for r in result['rows'])}"
    )
    for f in fails:
        print(
            f"  failing: {f['model']} x{f['devices']} {f['budget']}: {f['check_faster']}/{f['check_feasible']}"
        )


# ------------------------------------------------------------------------------------------------ scale
def _model_flops_per_token(model, seq: int) -> float:
    """6 x parameters (forward + backward) + causal attention's 6 x layers x hidden x sequence (PaLM's count,
    halved for the causal mask)."""
    cfg = model.config
    params = sum(p.numel() for p in model.parameters())
    return 6.0 * params + 6.0 * cfg.num_hidden_layers * cfg.hidden_size * seq


def _recompute_text(recompute: dict) -> str:
    """A plan's recompute per unit, condensed ("full", "none", or "selective:pointwise x1, none x1")."""
    counts: dict[str, int] = defaultdict(int)
    for option in recompute.values():
        counts[option] += 1
    if not counts:
        return "none"
    if len(counts) == 1:
        return next(iter(counts))
    return ", ".join(f"{k} x{v}" for k, v in sorted(counts.items()))


def _hsdp_shard(state_bytes: int, tp: int, dp: int, budget: int) -> int:
    """The fewest data-parallel ranks (a power of two dividing dp, more than 1 and fewer than dp) whose share of
    the parameters + optimizer state is at most a quarter of the budget."""
    shard = 2
    while shard < dp and (dp % shard or state_bytes / (tp * shard) > budget / 4):
        shard *= 2
    return min(shard, dp // 2)


def _estimate_row(est, flops: float, devices: int, peak: float, budget: int) -> dict:
    plan = est.plan
    return {
        "mesh": list(est.mesh_shape),
        "dp_mode": est.dp_mode,
        "dp_label": plan.dp_label if plan is not None else est.dp_mode,
        "micro_batches": plan.micro_batches if plan is not None else 1,
        "recompute": _recompute_text(plan.recompute) if plan is not None else "-",
        "step_time_s": est.step_time_s,
        "peak_memory_bytes": est.peak_memory_bytes,
        "fits": est.peak_memory_bytes <= budget,
        "mfu": flops / (est.step_time_s * devices * peak),
    }


def _scale_child(case: str, time_limit_s: float) -> dict:
    """Runs in a fresh process: plan_model (timed), then the hand configurations under the same cost model."""
    from hf_colossal_auto.hardware import get_device
    from hf_colossal_auto.hardware.catalog import memory_budget_default
    from hf_colossal_auto.models import build_model, make_example_inputs
    from hf_colossal_auto.solve.planner import Estimate, evaluate_plan, plan_model

    preset, batch, seq, devices, per_node = SCALE_CASES[case]
    spec = get_device(SCALE_DEVICE)
    budget = memory_budget_default(spec)
    peak = spec.peak_flops["bfloat16"]
    model = build_model(preset, device="meta")
    inputs = make_example_inputs(model, batch, seq, device="meta")
    flops = _model_flops_per_token(model, seq) * batch * seq
    common = dict(
        num_devices=devices,
        device=SCALE_DEVICE,
        devices_per_node=per_node,
        mixed_precision=MIXED,
        time_limit_s=time_limit_s,
    )
    out: dict = {
        "case": case,
        "hand_layout": SCALE_HAND_LAYOUT,
        "model": preset,
        "batch": batch,
        "seq_len": seq,
        "devices": devices,
        "devices_per_node": per_node,
        "device": SCALE_DEVICE,
        "budget_bytes": budget,
        "model_flops_per_step": flops,
        "loadavg_1m_before": os.getloadavg()[0],
    }
    t0, c0 = time.perf_counter(), time.process_time()
    pipeline = None if SCALE_PIPELINE == "auto" else int(SCALE_PIPELINE or 1)
    plan = plan_model(model, inputs, pipeline=pipeline, **common)
    planning_s, planning_cpu_s = time.perf_counter() - t0, time.process_time() - c0
    auto = _estimate_row(
        Estimate(
            "auto", plan.step_time_s, plan.peak_memory_bytes, budget, plan.mesh_shape, plan.dp_mode, plan
        ),
        flops,
        devices,
        peak,
        budget,
    )
    auto.update(planning_s=planning_s, planning_cpu_s=planning_cpu_s, ilps_tried=len(plan.alternatives))
    auto.update(_pipeline_fields(plan))
    out["auto"] = auto
    out["loadavg_1m_after_planning"] = os.getloadavg()[0]
    print(
        f"  [{case}] auto planned in {planning_s:.1f} s ({planning_cpu_s:.1f} s CPU): "
        f"{'x'.join(map(str, auto['mesh']))} {auto['dp_label']} k={auto['micro_batches']} "
        f"{auto['recompute']} {auto['step_time_s']:.3f} s",
        file=sys.stderr,
        flush=True,
    )

    tp = SCALE_TP
    dp = devices // tp
    local = batch // dp
    options = [k for k in range(1, local + 1) if local % k == 0][:SCALE_MAX_MICRO_BATCHES]
    state = sum(p.numel() for p in model.parameters()) * 12  # fp32 parameters + AdamW's two fp32 moments
    shard = _hsdp_shard(state, tp, dp, budget)
    hand = {
        "fsdp-tp-full": dict(dp_mode="fsdp", recompute="full", micro=options),
        "fsdp-tp-sel": dict(dp_mode="fsdp", recompute="selective:pointwise", micro=options),
        "hsdp-tp-sel": dict(
            dp_mode="hsdp", dp_shard_size=shard, recompute="selective:pointwise", micro=options
        ),
        "megatron-mb1": dict(dp_mode="ddp", recompute="none", micro=[local]),
    }
    out["hand"] = {}
    for name, cfg in hand.items():
        tries = []
        t0 = time.perf_counter()
        for k in cfg["micro"]:
            try:
                est = evaluate_plan(
                    model,
                    inputs,
                    SCALE_HAND_LAYOUT,
                    mesh_shape=(dp, tp),
                    recompute=cfg["recompute"],
                    micro_batches=k,
                    dp_mode=cfg["dp_mode"],
                    dp_shard_size=cfg.get("dp_shard_size"),
                    fit_budget=True,
                    **common,
                )
                row = _estimate_row(est, flops, devices, peak, budget)
            except Exception as exc:  # noqa: BLE001 - one configuration's error is one row
                row = {"error": _err(exc), "micro_batches": k}
            tries.append(row)
            if row.get("fits"):
                break
        fitting = [r for r in tries if r.get("fits")]
        priced = [r for r in tries if "error" not in r]
        # the fewest micro-batches that fit; where none does, the try that came closest (least memory)
        chosen = (
            fitting[0] if fitting else min(priced, key=lambda r: r["peak_memory_bytes"], default=tries[-1])
        )
        chosen = dict(
            chosen,
            pricing_s=time.perf_counter() - t0,
            micro_batches_tried=[r["micro_batches"] for r in tries],
        )
        if cfg.get("dp_shard_size"):
            chosen["dp_shard_size"] = cfg["dp_shard_size"]
        out["hand"][name] = chosen
        print(
            f"  [{case}] {name}: {_scale_text(chosen)} ({chosen['pricing_s']:.1f} s)",
            file=sys.stderr,
            flush=True,
        )
    for name, (pp, schedule, mode, options) in PP_HAND.items():
        t0 = time.perf_counter()
        tries = []
        for option in options:
            try:
                est = evaluate_plan(
                    model,
                    inputs,
                    SCALE_HAND_LAYOUT,
                    pipeline=pp,
                    mesh_shape=(devices // (pp * tp), tp),
                    dp_mode=mode,
                    schedule=schedule,
                    recompute=option,
                    micro_batches=batch // (devices // (pp * tp)),
                    **common,
                )
                row = _estimate_row(est, flops, devices, peak, budget)
                row.update(_pipeline_fields(est.plan))
            except Exception as exc:  # noqa: BLE001 - one configuration's error is one row
                row = {"error": _err(exc), "recompute": option}
            tries.append(row)
            if row.get("fits"):
                break
        priced = [r for r in tries if "error" not in r]
        chosen = next((r for r in tries if r.get("fits")), None) or min(
            priced, key=lambda r: r["peak_memory_bytes"], default=tries[-1]
        )
        chosen = dict(chosen, pricing_s=time.perf_counter() - t0)
        out["hand"][name] = chosen
        print(
            f"  [{case}] {name}: {_scale_text(chosen)} ({chosen['pricing_s']:.1f} s)",
            file=sys.stderr,
            flush=True,
        )
    fitting = [r["step_time_s"] for r in out["hand"].values() if r.get("fits")]
    out["best_hand_s"] = min(fitting) if fitting else None
    out["auto_le_best"] = out["best_hand_s"] is None or auto["step_time_s"] <= out["best_hand_s"] * (
        1 + REL_TOL
    )
    out["auto_strictly_better"] = out["best_hand_s"] is None or auto["step_time_s"] < out["best_hand_s"] * (
        1 - REL_TOL
    )
    out["loadavg_1m_after"] = os.getloadavg()[0]
    return out


def _pipeline_fields(plan) -> dict:
    """A pipeline plan's schedule, stages and predicted bubble (empty for a plan without stages)."""
    if plan.pp_size == 1:
        return {}
    return {
        "pp": plan.pp_size,
        "schedule": plan.schedule,
        "virtual_stages": plan.virtual_stages,
        "blocks_per_stage": [len(s) for s in plan.stages],
        "bubble_fraction": plan.solver.get("bubble_fraction"),
        "stage_layout": plan.solver.get("stage_layout"),
    }


def _scale_text(row: dict) -> str:
    if "error" in row:
        return f"ERROR {row['error']}"
    pp = (
        f"pp {row['pp']} {row['schedule']} bubble {row['bubble_fraction'] * 100:.0f}% "
        if row.get("pp")
        else ""
    )
    return (
        f"{pp}{'x'.join(map(str, row['mesh']))} {row['dp_label']} k={row['micro_batches']} {row['recompute']} "
        f"{row['step_time_s']:.3f} s {_gib(row['peak_memory_bytes'])} {'fits' if row['fits'] else 'DOES NOT FIT'} "
        f"MFU {row['mfu'] * 100:.1f}%"
    )


def run_scale(
    cases: tuple[str, ...], time_limit_s: float, pipeline: str = "auto", hand_layout: str = SCALE_HAND_LAYOUT
) -> list[dict]:
    results = []
    for case in cases:
        cmd = [sys.executable, __file__, f"--_scale-child={case}", "--time-limit", str(time_limit_s)]
        cmd += ["--scale-pipeline", pipeline, "--scale-hand-layout", hand_layout]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        sys.stderr.write(proc.stderr[-4000:] if proc.returncode else proc.stderr)
        if proc.returncode:
            results.append({"case": case, "error": proc.stderr.strip().splitlines()[-1:]})
            continue
        result = json.loads(proc.stdout.strip().splitlines()[-1])
        result["process_s"] = time.perf_counter() - t0
        results.append(result)
    return results


def print_scale(results: list[dict]) -> None:
    for r in results:
        if "error" in r:
            print(f"{r['case']}: ERROR {r['error']}")
            continue
        a = r["auto"]
        print(
            f"\n{r['model']}: {r['batch']}x{r['seq_len']} on {r['devices']} x {r['device']} ({r['devices_per_node']} per "
            f"node), budget {_gib(r['budget_bytes'])}, {r['model_flops_per_step'] / 1e18:.2f} EFLOP per step"
        )
        print(
            f"  planning {a['planning_s']:.1f} s wall, {a['planning_cpu_s']:.1f} s CPU, {a['ilps_tried']} ILPs "
            f"(target <= {SCALE_TARGET_S:.0f} s: {'met' if a['planning_s'] <= SCALE_TARGET_S else 'MISSED'}; load "
            f"{r['loadavg_1m_before']:.2f} before, {r['loadavg_1m_after_planning']:.2f} after)"
        )
        print(f"  {'auto':14s} {_scale_text(a)}")
        for name, row in r["hand"].items():
            print(f"  {name:14s} {_scale_text(row)}")
        best = r["best_hand_s"]
        print(
            f"  auto <= best fitting hand config ({'-' if best is None else f'{best:.3f} s'}): "
            f"{'ok' if r['auto_le_best'] else 'FAIL'}; strictly better: {'yes' if r['auto_strictly_better'] else 'no'}"
        )


# ------------------------------------------------------------------------------------------------ main
def _csv(text: str, cast=str) -> tuple:
    return tuple(cast(x) for x in text.split(",") if x)


def main(argv: list[str] | None = None) -> int:
    global SCALE_PIPELINE, SCALE_HAND_LAYOUT
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--timing", action="store_true", help="end-to-end plan_model time in fresh processes")
    p.add_argument("--repeat", type=int, default=3, help="fresh-process runs per timing case (median)")
    p.add_argument("--grid", action="store_true", help="auto vs ddp / fsdp / megatron over a grid")
    p.add_argument("--quick", action="store_true", help="grid subset: 4 models x {8, 64} x {default, 20GiB}")
    p.add_argument("--models", type=_csv, help="comma-separated grid models (overrides the default set)")
    p.add_argument("--devices", type=lambda s: _csv(s, int), help="comma-separated device counts")
    p.add_argument("--budgets", type=_csv, help='comma-separated budgets ("default" or e.g. 40GiB)')
    p.add_argument("--time-limit", type=float, default=60.0, help="ILP time limit per mesh (s)")
    p.add_argument(
        "--llama-seqs-per-device",
        type=int,
        default=None,
        help="grid batch of Llama-7B per device (default 1)",
    )
    p.add_argument("--no-baseline-cache", action="store_true", help="re-price each baseline per budget")
    p.add_argument("--json", metavar="PATH", help="write the figures as JSON")
    p.add_argument(
        "--scale", action="store_true", help="Llama-3 70B/405B at 1024/8192 H100: auto vs hand configs"
    )
    p.add_argument("--scale-cases", type=_csv, default=tuple(SCALE_CASES), help="comma-separated scale cases")
    p.add_argument(
        "--scale-pipeline",
        default="auto",
        help='plan_model pipeline at scale: "auto" (stages searched, the default) or "1" (no stages)',
    )
    p.add_argument(
        "--scale-hand-layout",
        default=SCALE_HAND_LAYOUT,
        choices=("megatron-sp-local", "megatron-local"),
        help="the scale hand configurations' tensor parallelism (default: with sequence parallelism)",
    )
    p.add_argument("--_timing-child", dest="timing_child", help=argparse.SUPPRESS)
    p.add_argument("--_scale-child", dest="scale_child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    SCALE_PIPELINE = args.scale_pipeline
    SCALE_HAND_LAYOUT = args.scale_hand_layout
    if args.scale_child:
        print(json.dumps(_scale_child(args.scale_child, args.time_limit), default=str))
        return 0

    if args.timing_child:
        name, shape, devices = args.timing_child.split(":")
        batch, seq = (int(x) for x in shape.split("x"))
        print(json.dumps(_timing_child(name, batch, seq, int(devices))))
        return 0
    if not (args.timing or args.grid or args.scale):
        p.error("pass --timing, --grid and/or --scale")

    load_start = os.getloadavg()[0]
    out: dict = {"machine": _machine(), "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]])}
    print(
        f"machine: {out['machine']['cpu']}, {out['machine']['cores']} cores, torch {out['machine']['torch']}"
    )
    if args.timing:
        print("\n== planning time (one plan_model call per fresh process) ==")
        out["timing"] = run_timing(args.repeat)
        print_timing(out["timing"])
    if args.llama_seqs_per_device:
        SEQS_PER_DEVICE["llama"] = args.llama_seqs_per_device
    if args.grid:
        models = args.models or (QUICK_MODELS if args.quick else GRID_MODELS)
        devices = args.devices or (QUICK_DEVICES if args.quick else GRID_DEVICES)
        budgets = args.budgets or (QUICK_BUDGETS if args.quick else GRID_BUDGETS)
        print(f"\n== auto vs baselines: {len(models)} models x {devices} devices x {budgets} ==")
        out["grid"] = run_grid(
            models,
            devices,
            budgets,
            time_limit_s=args.time_limit,
            cache_baselines=not args.no_baseline_cache,
        )
        print_grid(out["grid"])
    if args.scale:
        print(f"\n== scale: {', '.join(args.scale_cases)} (one fresh process each) ==")
        out["scale"] = run_scale(
            args.scale_cases, args.time_limit, args.scale_pipeline, args.scale_hand_layout
        )
        print_scale(out["scale"])
    out["loadavg_1m_start_end"] = [load_start, os.getloadavg()[0]]
    print(f"\n1-minute load average: {load_start:.2f} at start, {os.getloadavg()[0]:.2f} at end (2 cores)")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1, default=str))
        print(f"\nwrote {args.json}")
    ok_timing = all(r["meets_target"] for r in out.get("timing", []))
    ok_grid = not out.get("grid", {}).get("failures")
    scale = out.get("scale", [])
    ok_scale = all("error" not in r and r["auto_le_best"] for r in scale) and (
        not scale or any(r.get("auto_strictly_better") for r in scale)
    )
    ok_scale_time = all(r["auto"]["planning_s"] <= SCALE_TARGET_S for r in scale if "auto" in r)
    return 0 if ok_timing and ok_grid and ok_scale and ok_scale_time else 1


if __name__ == "__main__":
    sys.exit(main())
