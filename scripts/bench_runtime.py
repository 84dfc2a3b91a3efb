"""Benchmark the runtime: training-step time and per-rank peak memory of an applied plan on 2 CPU gloo ranks.

Variants (same seeded Llama, same global batch, forward + backward + AdamW step):

* ``megatron``: our runtime (``apply_plan``) with ``evaluate_plan(..., "megatron", mesh_shape=(1, 2)).plan``;
* ``auto``: our runtime with our solver's plan forced to 1-D TP (``plan_model(..., mesh_shape=(1, 2),
  dp_modes=("ddp",))``);
* ``hf-tp``: transformers' own tensor parallelism, ``apply_tensor_parallelism(model, tp_mesh, tp_plan)`` with
  the plan ``model._resolve_parallel_plans(DistributedConfig(tp_size=2))`` expands from the config's
  ``base_model_tp_plan`` (plus ``lm_head: colwise_gather_output``);
* ``ddp``: ``torch.nn.parallel.DistributedDataParallel``, the global batch split over the 2 ranks.

In the TP variants every rank gets the whole global batch. Rank 0 plans and broadcasts (``broadcast_plan``).
Each variant runs in its own ``torch.distributed.run`` job (so one variant's memory high-water cannot leak into
another's); ``main()`` launches them and collects the results.

Time: median wall time of ``--steps`` timed steps after ``--warmup`` warm-up steps, each step ended by a
barrier, the max over ranks; also the median *CPU* time of a step (``time.process_time``: the rank's own work
in all its threads, not its waits), less sensitive to other jobs on a shared machine. ``--repeat N`` runs
every variant N times, interleaved and rotated (round r starts with the r-th variant), and reports the medians
over the runs, plus *paired* ratios: the median over rounds of a variant's run divided by hf-tp's run of the
same round (the two met the same machine load). Memory: resident-set high-water
(Linux ``VmHWM``) of each rank, reset through ``/proc/self/clear_refs`` just before one extra measured step,
so it is the peak RSS *during a step* (weights, gradients, optimizer state, activations, freed memory glibc
still holds, plus the process's Python/torch baseline, ~300-400 MB); also the RSS before the model was built,
to subtract. Falls back to the process lifetime high-water (``resource.getrusage``) where clear_refs is not
writable, and says so in the output. RSS depends on glibc's heap policy (run with
``MALLOC_MMAP_THRESHOLD_=65536`` to make it track live bytes); ``--profile DIR`` adds, per variant and rank, a
step under ``torch.profiler`` (CPU self time per op) and one under ``MemTracker`` (live bytes by kind).

Usage::

    python scripts/bench_runtime.py [--variants megatron,auto,hf-tp,ddp] [--repeat 3] [--json runtime.json]
    # time against hf-tp in one job (both models in the same 2 processes, steps alternating): the comparison
    # that other jobs on a shared machine disturb least
    python scripts/bench_runtime.py --ab auto --steps 10
    # one variant by hand:
    python -m torch.distributed.run --standalone --nproc_per_node 2 scripts/bench_runtime.py --worker megatron \
        --worker-out /tmp/megatron.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

VARIANTS = ("megatron", "auto", "hf-tp", "ddp")


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def _reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _model_config(args):
    from hf_colossal_auto.models import load_config

    cfg = load_config("tiny-llama")
    cfg.hidden_size = args.hidden
    cfg.intermediate_size = args.intermediate
    cfg.num_attention_heads = args.heads
    cfg.num_key_value_heads = args.heads
    cfg.head_dim = args.hidden // args.heads
    cfg.num_hidden_layers = args.layers
    cfg.vocab_size = args.vocab
    cfg.max_position_embeddings = max(args.seq, 512)
    return cfg


def _profile_step(args, rank: int, step, model, opt, local) -> None:
    """One more step under ``torch.profiler`` (CPU ops, self time) and one under ``MemTracker`` (live bytes by
    module and kind); both written to ``--profile`` as ``<variant>_rank<r>.txt``."""
    import torch
    import torch.distributed as dist

    from hf_colossal_auto._torch_compat import MemTracker

    os.makedirs(args.profile, exist_ok=True)
    dist.barrier()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        step(model, opt, local)
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=45, max_name_column_width=60)
    dist.barrier()
    tracker = MemTracker()
    tracker.track_external(model, opt)
    with tracker:
        step(model, opt, local)
    peaks = tracker.get_tracker_snapshot("peak")
    lines = []
    for dev, by_kind in peaks.items():
        lines.append(f"{dev}: " + ", ".join(f"{k}={v / 2**20:.1f} MiB" for k, v in by_kind.items() if v))
    with open(os.path.join(args.profile, f"{args.worker}_rank{rank}.txt"), "w") as f:
        f.write(table + "\n\nMemTracker peak:\n" + "\n".join(lines) + "\n")
    dist.barrier()


def _setup(args, variant: str, rank: int, world: int):
    """The seeded model prepared as ``variant``: (model, batch, this rank's batch, sharded parameters, seconds)."""
    import torch

    from hf_colossal_auto.models import build_model, make_example_inputs

    torch.manual_seed(0)
    model = build_model(_model_config(args), device="cpu")
    model.train()
    batch = make_example_inputs(model, args.batch, args.seq, seed=0)
    t0 = time.perf_counter()
    if variant in ("megatron", "auto"):
        from hf_colossal_auto.apply import apply_plan, broadcast_plan

        made = None
        if rank == 0:
            if variant == "megatron":
                from hf_colossal_auto.solve.planner import evaluate_plan

                made = evaluate_plan(
                    model, batch, "megatron", num_devices=world, device="cpu", mesh_shape=(1, world)
                ).plan
            else:
                from hf_colossal_auto.solve.planner import plan_model

                made = plan_model(
                    model, batch, num_devices=world, device="cpu", mesh_shape=(1, world), dp_modes=("ddp",)
                )
        plan = broadcast_plan(made)
        apply_plan(model, plan)
        sharded = sum(1 for v in plan.param_placements.values() if any(p != "R" for p in v))
        local = batch
    elif variant == "hf-tp":
        from torch.distributed.device_mesh import init_device_mesh
        from transformers.distributed import DistributedConfig
        from transformers.distributed.tensor_parallel import apply_tensor_parallelism

        tp_plan, _, _ = model._resolve_parallel_plans(DistributedConfig(tp_size=world))
        apply_tensor_parallelism(model, init_device_mesh("cpu", (world,)), tp_plan)
        sharded = sum(1 for k in tp_plan if k in dict(model.named_parameters()))
        local = batch
    elif variant == "ddp":
        per = args.batch // world
        local = {k: v[rank * per : (rank + 1) * per] for k, v in batch.items()}
        model = torch.nn.parallel.DistributedDataParallel(model)
        sharded = 0
    else:
        raise ValueError(variant)
    return model, batch, local, sharded, time.perf_counter() - t0


def worker(args) -> None:
    import torch
    import torch.distributed as dist
    import transformers

    transformers.logging.set_verbosity_error()
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
    rank, world = dist.get_rank(), dist.get_world_size()
    rss_base_mib = _status_kib("VmRSS") / 1024
    model, batch, local, sharded, setup_s = _setup(args, args.worker, rank, world)
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(model, opt, local) -> float:
        out = model(**local)
        loss = out.loss if hasattr(out, "loss") else out["loss"]
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss)

    times, cpu_times, sys_times, faults, losses = [], [], [], [], []
    for i in range(args.warmup + args.steps):
        dist.barrier()
        t, c, k = time.perf_counter(), time.process_time(), os.times().system
        f = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        losses.append(step(model, opt, local))
        c = time.process_time() - c  # this rank's own work (all its threads), not its waits
        k = os.times().system - k  # of which in the kernel (page faults of fresh allocations, mostly)
        f = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f
        dist.barrier()
        if i >= args.warmup:
            times.append(time.perf_counter() - t)
            cpu_times.append(c)
            sys_times.append(k)
            faults.append(f)
    # memory: one more step with the RSS high-water reset just before it
    dist.barrier()
    reset = _reset_hwm()
    step(model, opt, local)
    peak_mib = (_status_kib("VmHWM") if reset else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) / 1024
    if args.profile:
        _profile_step(args, rank, step, model, opt, local)
    rec = {
        "rank": rank,
        "median_step_s": statistics.median(times),
        "step_times_s": times,
        "median_cpu_s": statistics.median(cpu_times),
        "median_sys_s": statistics.median(sys_times),
        "median_page_faults": statistics.median(faults),
        "peak_rss_mib": peak_mib,
        "rss_before_model_mib": rss_base_mib,
        "peak_method": "VmHWM reset per step" if reset else "ru_maxrss (process lifetime)",
        "losses": losses,
        "setup_s": setup_s,
        "sharded_params": sharded,
        "n_params": n_params,
    }
    gathered = [None] * world
    dist.all_gather_object(gathered, rec)
    if rank == 0:
        with open(args.worker_out, "w") as f:
            json.dump(gathered, f)
    del model, opt
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


def _timed_step(model, opt, local) -> tuple[float, float]:
    """One training step between barriers: (wall seconds, this rank's CPU seconds)."""
    import torch.distributed as dist

    dist.barrier()
    t, c = time.perf_counter(), time.process_time()
    out = model(**local)
    (out.loss if hasattr(out, "loss") else out["loss"]).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    c = time.process_time() - c
    dist.barrier()
    return time.perf_counter() - t, c


def ab_worker(args) -> None:
    """``--ab VARIANT``: VARIANT and hf-tp built in the *same* processes, their steps alternating (each goes
    first in every other round), so that whatever else the machine runs meets both alike. Time only: the two
    models share the processes' memory, so peaks are not comparable here."""
    import torch
    import torch.distributed as dist
    import transformers

    transformers.logging.set_verbosity_error()
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
    rank, world = dist.get_rank(), dist.get_world_size()
    names = (args.worker_ab, "hf-tp")
    prepared = {}
    for name in names:
        model, _, local, _, _ = _setup(args, name, rank, world)
        prepared[name] = (model, torch.optim.AdamW(model.parameters(), lr=1e-4), local)
    walls: dict[str, list[float]] = {n: [] for n in names}
    cpus: dict[str, list[float]] = {n: [] for n in names}
    for i in range(args.warmup + args.steps):
        for name in names if i % 2 == 0 else names[::-1]:
            wall, cpu = _timed_step(*prepared[name])
            if i >= args.warmup:
                walls[name].append(wall)
                cpus[name].append(cpu)
    rec = {
        n: {"median_step_s": statistics.median(walls[n]), "median_cpu_s": statistics.median(cpus[n])}
        for n in names
    }
    gathered = [None] * world
    dist.all_gather_object(gathered, rec)
    if rank == 0:
        with open(args.worker_out, "w") as f:
            json.dump(gathered, f)
    del prepared
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


_SHAPE_ARGS = (
    "hidden",
    "intermediate",
    "heads",
    "layers",
    "vocab",
    "batch",
    "seq",
    "warmup",
    "steps",
    "threads",
)


def _worker_run(args, flag: str, variant: str, out: str) -> subprocess.CompletedProcess:
    """Run this script's ``flag`` worker (``--worker`` / ``--worker-ab``) for ``variant`` under torch.distributed."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(args.nproc)]
    cmd += [os.path.abspath(__file__), flag, variant, "--worker-out", out]
    for k in _SHAPE_ARGS:
        cmd += [f"--{k}", str(getattr(args, k))]
    if args.profile and flag == "--worker":
        cmd += ["--profile", os.path.abspath(args.profile)]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)


def _write_json(args, key: str, value) -> None:
    with open(args.json, "w") as f:
        json.dump(
            {"config": {k: v for k, v in vars(args).items() if not k.startswith("worker")}, key: value},
            f,
            indent=1,
        )


def _launch(variant: str, args, out: str) -> dict:
    proc = _worker_run(args, "--worker", variant, out)
    if proc.returncode != 0 or not os.path.exists(out):
        tail = (proc.stdout + proc.stderr).strip().splitlines()
        errs = [ln for ln in tail if "Error" in ln or "error" in ln] or tail
        return {"variant": variant, "error": errs[-1][:400] if errs else f"exit {proc.returncode}"}
    with open(out) as f:
        ranks = json.load(f)
    return {
        "variant": variant,
        "median_step_s": max(r["median_step_s"] for r in ranks),
        "median_cpu_s": max(r["median_cpu_s"] for r in ranks),
        "median_sys_s": max(r["median_sys_s"] for r in ranks),
        "median_page_faults": max(r["median_page_faults"] for r in ranks),
        "peak_rss_mib": [round(r["peak_rss_mib"], 1) for r in ranks],
        "peak_over_base_mib": [round(r["peak_rss_mib"] - r["rss_before_model_mib"], 1) for r in ranks],
        "peak_method": ranks[0]["peak_method"],
        "loss_first_last": [ranks[0]["losses"][0], ranks[0]["losses"][-1]],
        "setup_s": round(ranks[0]["setup_s"], 2),
        "sharded_params": ranks[0]["sharded_params"],
        "n_params": ranks[0]["n_params"],
        "ranks": ranks,
    }


def _run_ab(args) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "ab.json")
        proc = _worker_run(args, "--worker-ab", args.ab, out)
        if proc.returncode != 0 or not os.path.exists(out):
            raise SystemExit(f"A/B run failed: {(proc.stdout + proc.stderr).strip().splitlines()[-1:]}")
        with open(out) as f:
            ranks = json.load(f)
    print(
        f"A/B in one job: {args.ab} vs hf-tp, Llama h{args.hidden} L{args.layers}, global batch {args.batch}x"
        f"{args.seq}, median of {args.steps} alternating steps per variant"
    )
    for r, rec in enumerate(ranks):
        mine, ref = rec[args.ab], rec["hf-tp"]
        print(
            f"rank {r}: {args.ab} {mine['median_step_s']:.3f} s (cpu {mine['median_cpu_s']:.3f}), hf-tp "
            f"{ref['median_step_s']:.3f} s (cpu {ref['median_cpu_s']:.3f}): wall x"
            f"{mine['median_step_s'] / ref['median_step_s']:.3f}, cpu x{mine['median_cpu_s'] / ref['median_cpu_s']:.3f}"
        )
    if args.json:
        _write_json(args, "ranks", ranks)


def _aggregate(variant: str, runs: list[dict]) -> dict:
    """One row per variant: the median over its runs of each figure (per rank for memory)."""
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return runs[-1]
    row = dict(ok[-1])
    for key in ("median_step_s", "median_cpu_s"):
        row[key] = statistics.median(r[key] for r in ok)
        row[key.replace("median_", "runs_")] = [r[key] for r in ok]
    for key in ("peak_rss_mib", "peak_over_base_mib"):
        row[key] = [round(statistics.median(r[key][i] for r in ok), 1) for i in range(len(ok[0][key]))]
    row["runs"], row["failed_runs"] = len(ok), len(runs) - len(ok)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--intermediate", type=int, default=2816)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8000)
    p.add_argument("--batch", type=int, default=4, help="global batch (sequences)")
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument(
        "--repeat", type=int, default=1, help="runs of every variant, interleaved; medians reported"
    )
    p.add_argument("--timeout", type=int, default=900, help="seconds per variant")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--profile", help="directory: per variant and rank, a profiled step (CPU ops, MemTracker)")
    p.add_argument(
        "--ab",
        choices=("megatron", "auto", "ddp"),
        help="time this variant against hf-tp in the same processes, steps alternating (see ab_worker)",
    )
    p.add_argument("--worker-ab", choices=VARIANTS, help=argparse.SUPPRESS)
    p.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)
    p.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker_ab:
        ab_worker(args)
        return
    if args.worker:
        worker(args)
        return
    if args.ab:
        _run_ab(args)
        return
    variants = args.variants.split(",")
    runs: dict[str, list[dict]] = {v: [] for v in variants}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.repeat):  # interleaved, so that a busy spell on the machine hits every variant
            shift = rep % len(
                variants
            )  # and rotated, so that no variant always runs first or last in a round
            for v in variants[shift:] + variants[:shift]:
                r = _launch(v, args, os.path.join(tmp, f"{v}-{rep}.json"))
                runs[v].append(r)
                said = r.get("error") or round(r["median_step_s"], 3)
                print(f"done {v} (run {rep + 1}/{args.repeat}): {said}", file=sys.stderr, flush=True)
    results = [_aggregate(v, runs[v]) for v in variants]
    ref = next((r for r in results if r["variant"] == "hf-tp" and "error" not in r), None)
    if ref:  # paired: each run against hf-tp's run of the same round, which met the same machine load
        for r in results:
            pairs = [
                (a["median_step_s"] / b["median_step_s"], a["median_cpu_s"] / b["median_cpu_s"])
                for a, b in zip(runs[r["variant"]], runs["hf-tp"], strict=True)
                if "error" not in a and "error" not in b
            ]
            if pairs:
                r["paired_time_vs_hf_tp"] = round(statistics.median(p[0] for p in pairs), 3)
                r["paired_cpu_vs_hf_tp"] = round(statistics.median(p[1] for p in pairs), 3)
    print(
        f"Llama h{args.hidden} i{args.intermediate} heads{args.heads} L{args.layers} V{args.vocab}, global batch "
        f"{args.batch}x{args.seq}, {args.nproc} gloo ranks x {args.threads} thread(s), median of {args.steps} steps"
        f", median of {args.repeat} run(s)"
    )
    print(
        f"{'variant':<10} {'step s':>8} {'vs hf-tp':>9} {'cpu s':>7} {'vs hf':>6} {'peak RSS MiB/rank':>20} "
        f"{'peak-base MiB/rank':>20} {'mem vs hf':>9} {'paired t':>8} {'paired cpu':>10}  sharded"
    )
    for r in results:
        if "error" in r:
            print(f"{r['variant']:<10} FAILED: {r['error']}")
            continue
        t_ratio = c_ratio = m_ratio = ""
        if ref:
            t_ratio = f"{r['median_step_s'] / ref['median_step_s']:.3f}"
            c_ratio = f"{r['median_cpu_s'] / ref['median_cpu_s']:.3f}"
            m_ratio = f"{max(r['peak_rss_mib']) / max(ref['peak_rss_mib']):.3f}"
            r["time_vs_hf_tp"], r["cpu_vs_hf_tp"] = float(t_ratio), float(c_ratio)
            r["mem_vs_hf_tp"] = float(m_ratio)
        print(
            f"{r['variant']:<10} {r['median_step_s']:>8.3f} {t_ratio:>9} {r['median_cpu_s']:>7.3f} {c_ratio:>6} "
            f"{str(r['peak_rss_mib']):>20} {str(r['peak_over_base_mib']):>20} {m_ratio:>9} "
            f"{r.get('paired_time_vs_hf_tp', ''):>8} {r.get('paired_cpu_vs_hf_tp', ''):>10}  {r['sharded_params']}"
        )
    if args.json:
        _write_json(args, "results", results)


if __name__ == "__main__":
    main()
