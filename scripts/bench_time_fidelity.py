"""Predicted vs measured step time of candidate plans, on 2 gloo CPU ranks: does the cost model rank plans the way
the machine runs them?

For each family (Llama, GPT-2, BERT by default, each at a size where one step takes well over 0.3 s on one
thread per rank) rank 0 makes the candidates, each with its predicted step time under the device spec:

* ``ddp`` / ``fsdp`` (2x1) and ``megatron`` (1x2): the baselines, ``evaluate_plan``; ``megatron-local``: the
  same placements with every attention / MLP module that qualifies run on local tensor shards
  (``Plan.local_modules``; left out, saying why, where none does: GPT-2's attention, dropout inside);
* ``auto``: ``plan_model`` free to choose; ``auto-1x2``: forced to 1-D tensor parallelism;
* ``auto-full-rc``: with full recompute of every block; ``two-stage``: shard first, then recompute;
* ``ddp-ep`` (mixture-of-experts families, ``--families mixtral``): DDP with the experts sharded over the
  data-parallel axis, tokens dispatched by all-to-all;
* ``pp-<schedule>-m<count>`` (causal LMs: Llama, GPT-2): pipeline stages, pp 2 x dp 1, under GPipe and 1F1B
  at 2 and 4 micro-batches, interleaved 1F1B and ZB-V (two stages a rank) at 4; the cut and the prediction are
  the pipeline search's for that schedule and count (``--no-pipeline`` leaves them out; counts the global
  batch does not divide are left out); ``pp-zbv-m4-full-rc``: ZB-V at 4 with every block recomputed
  (``evaluate_plan(pipeline=2, recompute="full")``): the split backward's reruns (input pass, then the
  runtime's one weight-pass ``autograd.grad``) as priced; ``pp-interleaved-1f1b-m4-v4``: interleaved 1F1B with
  4 stages a rank at 4 micro-batches, fewer than its 8 stages (a hand pipeline, even cut; models of 8 blocks
  or more, e.g. ``--layers 8``).

``--long`` (issue 28): long sequences, Llama at 2 x 2048 tokens (hidden 256, 4 layers, vocab 512 unless given),
with two more candidates, each priced and measured like the rest:

* ``cp2``: ``plan_model(context_parallel=2)``, each sequence split over 2 cp ranks (head + tail chunks), K/V
  all-gathered per attention layer;
* ``sp``: ``plan_model`` forced to mesh ``1 x 2`` with one sequence a micro-batch (``micro_batches`` = the
  global batch): at one sequence per piece the solver runs blocks sequence-parallel (norms and residual
  stream sharded on the sequence dim between tensor-parallel regions; with two sequences in one piece it runs
  none). The worker prints the plan's ``sequence parallel`` line and leaves the candidate out, saying so, if no
  block runs so;
* ``megatron-sp``: ``evaluate_plan("megatron-sp")`` on ``1 x 2``, Megatron-LM's placements with sequence
  parallelism on every block (what Megatron-LM and torchtitan run), always in, whatever the solver picks: the
  +-20 % target is measured on a sequence-parallel plan even where ``sp`` is left out.

Every rank builds each candidate from the same seed and applies its plan (our runtime), then the timed steps
interleave the candidates (round r starts with the r-th), each step between barriers, the max over ranks;
the median of ``--steps`` per candidate is its measurement. Machine noise thus meets all candidates alike.

The device spec comes from ``hf-colossal-auto calibrate`` run first on the same 2 ranks (``--device FILE``
to reuse one, ``--device cpu`` for the uncalibrated preset). Targets (issue "step-time fidelity"): every plan
within +-20 % of its measurement; among pairs whose measurements differ by > 10 %, >= 85 % ordered alike; the
solver's choice within 5 % of the fastest candidate.

The op time scales (``DeviceSpec.op_time_scale``: what each op kind costs inside a real step over what the
micro-benchmarks predict) are measured held out: each family is predicted with scales from real passes of the
*other* two families at another shape (hidden 384, 2 layers, vocab 6000, 4x128 per rank by default), so that
no family is priced from its own measurement (``--step-calibration none``: micro-benchmarks alone).

Usage::

    python scripts/bench_time_fidelity.py [--families llama,gpt2,bert] [--steps 5] [--json out.json]
    python scripts/bench_time_fidelity.py --long [--seq 2048] [--json long.json]
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

CANDIDATES = ("ddp", "fsdp", "megatron", "auto", "auto-1x2", "auto-full-rc", "two-stage")

PIPELINE_CANDIDATES = (
    ("gpipe", 2),
    ("gpipe", 4),
    ("1f1b", 2),
    ("1f1b", 4),
    ("interleaved-1f1b", 4),
    ("zbv", 4),
)
"""(schedule, micro-batches) of the pp=2 candidates (causal LMs only: the pipeline runtime's scope), each as the
pipeline search cuts and prices it (``pp-<schedule>-m<count>``)."""

RECOMPUTED_PIPELINE = ("zbv", 4)
"""The pp=2 candidate with every block recomputed (``pp-zbv-m4-full-rc``): a hand pipeline, ``evaluate_plan``."""

FOUR_A_RANK_PIPELINE = ("interleaved-1f1b", 4, 4)
"""(schedule, micro-batches, stages a rank) of ``pp-interleaved-1f1b-m4-v4``: a hand pipeline, ``evaluate_plan``,
where the model has a block for each of its stages."""


LONG_DEFAULTS = {"families": "llama", "hidden": 256, "layers": 4, "vocab": 512, "batch": 2, "seq": 2048}
"""``--long``'s shape (one step about 1-3 s on one thread per rank, 2 gloo ranks); what is given explicitly wins."""

SHORT_DEFAULTS = {
    "families": "llama,gpt2,bert",
    "hidden": 512,
    "layers": 4,
    "vocab": 8000,
    "batch": 8,
    "seq": 256,
}


def _config(family: str, args):
    from hf_colossal_auto.models import load_config

    if family == "llama":
        cfg = load_config("tiny-llama")
        cfg.hidden_size, cfg.intermediate_size = args.hidden, args.hidden * 11 // 4
        cfg.num_attention_heads = cfg.num_key_value_heads = 8
        cfg.head_dim = args.hidden // 8
        cfg.num_hidden_layers, cfg.max_position_embeddings = args.layers, max(args.seq, 512)
    elif family == "gpt2":
        cfg = load_config("tiny-gpt2")
        cfg.n_embd, cfg.n_head, cfg.n_layer, cfg.n_positions = args.hidden, 8, args.layers, max(args.seq, 512)
    elif family == "bert":
        cfg = load_config("tiny-bert")
        cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads = args.hidden, 4 * args.hidden, 8
        cfg.num_hidden_layers, cfg.max_position_embeddings = args.layers, max(args.seq, 512)
    elif family == "mixtral":  # mixture of experts: 8 experts, top-2, each half a dense MLP's width
        cfg = load_config("tiny-mixtral")
        cfg.hidden_size, cfg.intermediate_size = args.hidden, args.hidden * 11 // 8
        cfg.num_attention_heads = cfg.num_key_value_heads = 8
        cfg.head_dim = args.hidden // 8
        cfg.num_local_experts, cfg.num_experts_per_tok = 8, 2
        cfg.num_hidden_layers, cfg.max_position_embeddings = args.layers, max(args.seq, 512)
    else:
        raise ValueError(f"unknown family {family!r}")
    cfg.vocab_size = args.vocab
    return cfg


def _pipeline_candidate(model, batch, spec, world: int, schedule: str, micro_batches: int):
    """The pipeline search's plan for ``schedule`` at ``micro_batches`` on pp = ``world`` (no data parallelism);
    None where the model has no pipeline layout."""
    from hf_colossal_auto.pipeline_layout import PipelineLayoutError
    from hf_colossal_auto.solve.candidates import _Planner
    from hf_colossal_auto.solve.pipeline.plan import search_pipeline_plan

    planner = _Planner.for_devices(model, batch, world, spec, None, None, None, "adamw", 60.0, "none")
    try:
        return search_pipeline_plan(planner, world, schedules=(schedule,), micro_batches=micro_batches)
    except PipelineLayoutError:
        return None


def _long_candidates(model, batch, spec, world: int) -> dict[str, tuple[object, float]]:
    """``--long``'s extra candidates: context parallelism over all ``world`` ranks (``cp2`` on 2), a
    ``1 x world`` tensor-parallel plan at one sequence a micro-batch, where the solver runs blocks
    sequence-parallel (``sp``; left out, saying so, if it runs none), and the ``megatron-sp`` baseline on
    ``1 x world`` (every block sequence-parallel, always in)."""
    from hf_colossal_auto.solve.planner import evaluate_plan, plan_model

    out: dict[str, tuple[object, float]] = {}
    plan = plan_model(model, batch, num_devices=world, device=spec, context_parallel=world)
    out[f"cp{world}"] = (plan, plan.step_time_s)
    rows = next(iter(batch.values())).shape[0]
    plan = plan_model(model, batch, num_devices=world, device=spec, mesh_shape=(1, world), micro_batches=rows)
    if plan.sequence_parallel_blocks:
        print(f"sp: {_sequence_parallel_line(plan)}", flush=True)
        out["sp"] = (plan, plan.step_time_s)
    else:
        print(
            f"sp left out: the 1 x {world} plan at one sequence a micro-batch runs no block sequence-parallel",
            flush=True,
        )
    est = evaluate_plan(model, batch, "megatron-sp", num_devices=world, device=spec, mesh_shape=(1, world))
    print(f"megatron-sp: {_sequence_parallel_line(est.plan)}", flush=True)
    out["megatron-sp"] = (est.plan, est.step_time_s)
    return out


def _sequence_parallel_line(plan) -> str:
    """The plan summary's ``sequence parallel`` line (which blocks run so)."""
    return next((line for line in plan.summary().splitlines() if line.startswith("sequence parallel")), "")


def _candidates(
    model, batch, spec, world: int, pipeline: bool = True, long: bool = False
) -> dict[str, tuple[object, float]]:
    """name -> (plan, predicted seconds), made on one rank."""
    from hf_colossal_auto.capture.moe import experts_modules
    from hf_colossal_auto.pipeline_layout import PipelineLayoutError
    from hf_colossal_auto.solve.planner import evaluate_plan, plan_model

    out: dict[str, tuple[object, float]] = {}
    for name in ("ddp", "fsdp"):
        est = evaluate_plan(model, batch, name, num_devices=world, device=spec, mesh_shape=(world, 1))
        out[name] = (est.plan, est.step_time_s)
    est = evaluate_plan(model, batch, "megatron", num_devices=world, device=spec, mesh_shape=(1, world))
    out["megatron"] = (est.plan, est.step_time_s)
    try:  # the same placements with the attention / MLP modules on local shards, where any qualifies
        est = evaluate_plan(
            model, batch, "megatron-local", num_devices=world, device=spec, mesh_shape=(1, world)
        )
        out["megatron-local"] = (est.plan, est.step_time_s)
    except ValueError as exc:
        print(f"megatron-local left out: {exc}", flush=True)
    kwargs = {"num_devices": world, "device": spec}
    for name, extra in (
        ("auto", {}),
        ("auto-1x2", {"mesh_shape": (1, world)}),
        ("auto-full-rc", {"recompute": "full"}),
        ("two-stage", {"recompute": "two-stage"}),
    ):
        plan = plan_model(model, batch, **kwargs, **extra)
        out[name] = (plan, plan.step_time_s)
    if experts_modules(model):  # a mixture of experts: its experts sharded over the data-parallel axis too
        plan = plan_model(model, batch, **kwargs, mesh_shape=(world, 1), dp_modes=("ddp-ep",))
        out["ddp-ep"] = (plan, plan.step_time_s)
    rows = next(iter(batch.values())).shape[0]
    for schedule, micro_batches in PIPELINE_CANDIDATES if pipeline else ():
        if rows % micro_batches:  # a micro-batch of whole rows
            continue
        plan = _pipeline_candidate(model, batch, spec, world, schedule, micro_batches)
        if plan is not None:
            out[f"pp-{schedule}-m{micro_batches}"] = (plan, plan.step_time_s)
    if pipeline and not rows % RECOMPUTED_PIPELINE[1] and "pp-zbv-m4" in out:  # a causal LM, as above
        schedule, micro_batches = RECOMPUTED_PIPELINE
        est = evaluate_plan(model, batch, "ddp", num_devices=world, device=spec, mesh_shape=(1, 1),
                            pipeline=world, schedule=schedule, micro_batches=micro_batches, recompute="full")  # fmt: skip
        out[f"pp-{schedule}-m{micro_batches}-full-rc"] = (est.plan, est.step_time_s)
    schedule, micro_batches, virtual = FOUR_A_RANK_PIPELINE
    if pipeline and not rows % micro_batches and "pp-zbv-m4" in out:
        try:
            est = evaluate_plan(model, batch, "ddp", num_devices=world, device=spec, mesh_shape=(1, 1),
                                pipeline=world, schedule=schedule, micro_batches=micro_batches,
                                virtual_stages=virtual)  # fmt: skip
            out[f"pp-{schedule}-m{micro_batches}-v{virtual}"] = (est.plan, est.step_time_s)
        except PipelineLayoutError as exc:  # fewer blocks than stages
            print(f"pp-{schedule}-m{micro_batches}-v{virtual} left out: {exc}", flush=True)
    if long:
        out.update(_long_candidates(model, batch, spec, world))
    return out


def _local_batch(batch: dict, plan, rank: int) -> dict:
    """This rank's batch under ``plan``: its data-parallel slice (the ``cp x tp`` ranks of a replica share it;
    context parallelism cuts the sequences itself)."""
    dp = plan.dp_size
    if dp == 1:
        return batch
    per = next(iter(batch.values())).shape[0] // dp
    i = rank // (plan.num_devices // dp)
    return {k: v[i * per : (i + 1) * per] for k, v in batch.items()}


def _kernel_sample() -> dict:
    """This device's kernel rates now (float32: GEMMs by size, elementwise bandwidth and math, attention)."""
    import torch

    from hf_colossal_auto.calibration.kernels import attention_rate
    from hf_colossal_auto.hardware.microbench import (
        elementwise_bandwidth,
        matmul_curve,
        transcendental_rate,
    )

    device = torch.device("cpu")
    with torch.no_grad():
        curve = matmul_curve(device, torch.float32, budget_s=0.4)
        bandwidth = elementwise_bandwidth(device, nbytes=64 * 2**20, budget_s=0.1)
        math_rate = transcendental_rate(device, budget_s=0.2)
    return {
        "curve": curve,
        "bandwidth": bandwidth,
        "math": math_rate,
        "attention": attention_rate(device, torch.float32, budget_s=0.2),
    }


def _median_sample(samples: list[dict]) -> dict:
    """DeviceSpec overrides from the median of the in-job kernel samples."""
    med = statistics.median
    curve = tuple(
        (samples[0]["curve"][i][0], med(s["curve"][i][1] for s in samples))
        for i in range(len(samples[0]["curve"]))
    )
    return {
        "matmul_flops": {"float32": curve},
        "peak_flops": {"float32": curve[-1][1]},
        "memory_bandwidth": med(s["bandwidth"] for s in samples),
        "transcendental_rate": med(s["math"] for s in samples),
        "attention_flops": {"float32": med(s["attention"] for s in samples)},
    }


def step_worker(args) -> None:
    """On every rank: in-step calibration (op time scales) of the spec in ``--device`` from real passes of the
    ``--step-worker`` families at the calibration shape; rank 0 writes the scaled spec to ``--worker-out``."""
    import torch
    import torch.distributed as dist
    import transformers

    from hf_colossal_auto.calibration.op_scales import format_scales, measure_op_time_scales
    from hf_colossal_auto.hardware import get_device
    from hf_colossal_auto.hardware.catalog import save_device_spec

    transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=1200))
    spec = get_device(args.device)
    shape = argparse.Namespace(
        hidden=args.step_hidden, layers=args.step_layers, vocab=args.step_vocab, seq=args.step_seq
    )
    families = args.step_worker.split(",")
    result = measure_op_time_scales(
        [_config(f, shape) for f in families], spec, batch_size=args.step_batch, seq_len=args.step_seq
    )
    if dist.get_rank() == 0:
        provenance = {**spec.calibration, "step_models": families, "step_shape": vars(shape)}
        save_device_spec(
            spec.with_overrides(op_time_scale=result.scales, calibration=provenance), args.worker_out
        )
        print(f"in-step calibration on {families} ({vars(shape)}, batch {args.step_batch}):", flush=True)
        print("\n".join(format_scales(result, 12)), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def worker(args) -> None:
    import torch
    import torch.distributed as dist
    import transformers

    from hf_colossal_auto.apply import apply_plan
    from hf_colossal_auto.apply.micro_batch import accumulate
    from hf_colossal_auto.hardware import get_device
    from hf_colossal_auto.models import build_model, make_example_inputs
    from hf_colossal_auto.plan import Plan
    from hf_colossal_auto.solve.planner import evaluate_plan

    transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=1200))
    rank, world = dist.get_rank(), dist.get_world_size()
    spec = get_device(args.device)
    cfg = _config(args.worker, args)
    torch.manual_seed(0)
    reference = build_model(cfg, device="cpu")
    batch = make_example_inputs(reference, args.batch, args.seq, seed=0)
    payload = [None]
    if rank == 0:
        t0 = time.perf_counter()
        made = _candidates(reference, batch, spec, world, args.pipeline, args.long)
        payload = [{k: (p.to_json(), t) for k, (p, t) in made.items()}]
        print(
            f"[{args.worker}] planned {len(made)} candidates in {time.perf_counter() - t0:.1f} s", flush=True
        )
    dist.broadcast_object_list(payload, src=0)
    del reference
    prepared = {}
    for name, (plan_json, predicted) in payload[0].items():
        plan = Plan.from_dict(json.loads(plan_json))
        torch.manual_seed(0)
        model = build_model(cfg, device="cpu")
        model.train()
        apply_plan(model, plan)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        prepared[name] = (model, opt, _local_batch(batch, plan, rank), predicted, plan)

    def timed(name: str) -> float:
        model, opt, local, _, plan = prepared[name]
        dist.barrier()
        t = time.perf_counter()
        if plan.pp_size == 1 and plan.micro_batches > 1:  # the plan's pieces, gradients synchronised once
            for micro in accumulate(model, local):
                (model(**micro.inputs).loss * micro.weight).backward()
        else:  # one piece (a pipeline's schedule runs its micro-batches itself)
            model(**local).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        dist.barrier()
        return time.perf_counter() - t

    names = list(prepared)
    times: dict[str, list[float]] = {n: [] for n in names}
    samples: list[dict] = []
    for r in range(args.warmup + args.steps):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            seconds = timed(name)
            if r >= args.warmup:
                times[name].append(seconds)
        if r >= args.warmup and args.in_job_kernels:
            dist.barrier()  # both ranks at once, as in a step and in `calibrate`
            samples.append(_kernel_sample())
    mine = torch.tensor([statistics.median(times[n]) for n in names], dtype=torch.float64)
    dist.all_reduce(mine, op=dist.ReduceOp.MAX)
    in_job: dict[str, float] = {}
    if rank == 0 and samples:
        # the same plans re-priced with the kernel rates measured between the timed rounds: the machine's drift
        # between `calibrate` and the steps no longer counts as the model's error
        drifted = spec.with_overrides(**_median_sample(samples))
        meta = build_model(cfg, device="meta")
        meta_batch = make_example_inputs(meta, args.batch, args.seq, device="meta")
        for n in names:
            plan = prepared[n][4]
            if plan.pp_size > 1 and not n.endswith("-full-rc"):  # the search's, at the drifted rates
                again = _pipeline_candidate(
                    meta, meta_batch, drifted, world, plan.schedule, plan.micro_batches
                )
                in_job[n] = again.step_time_s
                continue
            est = evaluate_plan(meta, meta_batch, plan, num_devices=world, device=drifted)
            in_job[n] = est.step_time_s
    if rank == 0:
        rows = []
        for n, measured in zip(names, mine.tolist(), strict=True):
            plan = prepared[n][4]
            rc = sorted(set(plan.recompute.values())) if getattr(plan, "recompute", None) else ["none"]
            same = (
                list(plan.mesh_shape),
                plan.dp_mode,
                sorted(plan.param_placements.items()),
                plan.recompute,
                *((plan.schedule, plan.micro_batches, plan.stages) if plan.pp_size > 1 else ()),
                *(
                    ("micro_batches", plan.micro_batches)
                    if plan.pp_size == 1 and plan.micro_batches > 1
                    else ()
                ),
                *(
                    ("activations", sorted(plan.activation_placements.items()))
                    if plan.cp_size > 1 or plan.sequence_parallel_blocks
                    else ()
                ),
            )
            rows.append(
                {
                    "family": args.worker,
                    "candidate": n,
                    "plan_key": hashlib.sha1(json.dumps(same, sort_keys=True).encode()).hexdigest()[:12],
                    "mesh": list(plan.mesh_shape),
                    "mesh_axes": list(plan.mesh_axis_names),
                    "dp_mode": plan.dp_mode,
                    "micro_batches": plan.micro_batches,
                    "sequence_parallel_blocks": len(plan.sequence_parallel_blocks),
                    "recompute": rc,
                    "predicted_s": prepared[n][3],
                    "predicted_in_job_s": in_job.get(n),
                    "measured_s": measured,
                }
            )
        with open(args.worker_out, "w") as f:
            json.dump(rows, f)
    prepared.clear()
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


def _metrics(rows: list[dict], key: str = "predicted_s") -> dict:
    rows = [r for r in rows if r.get(key) is not None]
    if not rows:
        return {}
    errors = [r[key] / r["measured_s"] - 1 for r in rows]
    pairs = ordered = 0
    by_family: dict[str, list[dict]] = {}
    for r in rows:
        by_family.setdefault(r["family"], []).append(r)
    choice_gap = {}
    same_plan = {}
    for fam, rs in by_family.items():
        for a, b in itertools.combinations(rs, 2):
            if max(a["measured_s"], b["measured_s"]) / min(a["measured_s"], b["measured_s"]) <= 1.10:
                continue
            pairs += 1
            ordered += (a["measured_s"] < b["measured_s"]) == (a[key] < b[key])
        auto = next(r for r in rs if r["candidate"] == "auto")
        fastest = min(rs, key=lambda r: r["measured_s"])
        choice_gap[fam] = auto["measured_s"] / fastest["measured_s"] - 1
        # the same plan under two names (auto often is ddp): their measured gap is the machine's noise
        same_plan[fam] = auto.get("plan_key") is not None and auto.get("plan_key") == fastest.get("plan_key")
    return {
        "max_abs_error": max(abs(e) for e in errors),
        "within_20pct": sum(abs(e) <= 0.20 for e in errors),
        "plans": len(rows),
        "pairs_over_10pct": pairs,
        "pairs_ordered": ordered,
        "choice_vs_fastest": choice_gap,
        "choice_is_the_fastest_plan": same_plan,
    }


def _mesh_text(row: dict) -> str:
    """``2x1`` for a ``(dp, tp)`` mesh; with more axes their names too (``pp2xdp1xtp1``, ``dp1xcp2xtp1``)."""
    sizes, names = row["mesh"], row.get("mesh_axes") or []
    if len(sizes) <= 2 or len(names) != len(sizes):
        return "x".join(map(str, sizes))
    return "x".join(f"{n}{s}" for n, s in zip(names, sizes, strict=True))


def _table(rows: list[dict]) -> str:
    lines = [
        "| family | candidate | mesh | dp | recompute | predicted ms | measured ms | error | re-priced in job ms | error |",
        "|---|---|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        err = r["predicted_s"] / r["measured_s"] - 1
        again = r.get("predicted_in_job_s")
        in_job = f"{again * 1e3:.0f} | {again / r['measured_s'] - 1:+.1%}" if again else "- | -"
        lines.append(
            f"| {r['family']} | {r['candidate']} | {_mesh_text(r)} | {r['dp_mode']} | "
            f"{','.join(r['recompute'])} | {r['predicted_s'] * 1e3:.0f} | {r['measured_s'] * 1e3:.0f} | {err:+.1%} | "
            f"{in_job} |"
        )
    return "\n".join(lines)


def _torchrun(extra: list[str], env: dict) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", *extra]
    subprocess.run(cmd, env=env, check=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--families", default=None, help="default llama,gpt2,bert; --long: llama")
    p.add_argument("--hidden", type=int, default=None, help="default 512; --long: 256")
    p.add_argument("--layers", type=int, default=None, help="default 4")
    p.add_argument("--vocab", type=int, default=None, help="default 8000; --long: 512")
    p.add_argument("--batch", type=int, default=None, help="global batch (sequences); default 8, --long: 2")
    p.add_argument("--seq", type=int, default=None, help="default 256; --long: 2048")
    p.add_argument(
        "--long",
        action="store_true",
        help="long sequences (issue 28): Llama at 2 x 2048 tokens, with a cp = 2 (cp2), a solver-chosen "
        "sequence-parallel (sp) and a Megatron-SP baseline (megatron-sp) candidate besides the others",
    )
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--device", default=None, help="device spec (preset or JSON); default: calibrate first")
    p.add_argument("--json", help="write rows and metrics here")
    p.add_argument(
        "--no-pipeline",
        dest="pipeline",
        action="store_false",
        help="leave out the pipeline candidates (pp 2: GPipe, 1F1B, interleaved 1F1B, ZB-V)",
    )
    p.add_argument(
        "--no-in-job-kernels",
        dest="in_job_kernels",
        action="store_false",
        help="skip sampling kernel rates between the timed rounds (and the re-priced column)",
    )
    p.add_argument(
        "--step-calibration",
        choices=["held-out", "none"],
        default="held-out",
        help="held-out: each family is predicted with op time scales measured in real steps of the *other* "
        "families at another shape (--step-hidden/--step-layers/--step-vocab/--step-batch/--step-seq); "
        "none: the kernel micro-benchmarks alone",
    )
    p.add_argument("--step-hidden", type=int, default=384)
    p.add_argument("--step-layers", type=int, default=2)
    p.add_argument("--step-vocab", type=int, default=6000)
    p.add_argument("--step-batch", type=int, default=4, help="per-process batch of the calibration steps")
    p.add_argument("--step-seq", type=int, default=128)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--step-worker", help=argparse.SUPPRESS)
    p.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = p.parse_args()
    for key, value in (LONG_DEFAULTS if args.long else SHORT_DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.worker:
        worker(args)
        return
    if args.step_worker:
        step_worker(args)
        return
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    tmp = tempfile.mkdtemp(prefix="time_fidelity_")
    device = args.device
    if device is None:
        device = os.path.join(tmp, "cluster.json")
        t0 = time.perf_counter()
        _torchrun(["-m", "hf_colossal_auto.cli", "calibrate", "--out", device], env)
        print(f"calibrated in {time.perf_counter() - t0:.0f} s", flush=True)
    rows: list[dict] = []
    shape = ["--hidden", args.hidden, "--layers", args.layers, "--vocab", args.vocab, "--batch", args.batch]
    shape += ["--seq", args.seq, "--warmup", args.warmup, "--steps", args.steps, "--device", device]
    if not args.in_job_kernels:
        shape.append("--no-in-job-kernels")
    if not args.pipeline:
        shape.append("--no-pipeline")
    if args.long:
        shape.append("--long")
    families = args.families.split(",")
    for family in families:
        out = os.path.join(tmp, f"{family}.json")
        family_shape = shape
        if args.step_calibration == "held-out":
            others = ",".join(f for f in ("llama", "gpt2", "bert") if f != family)  # mixtral: all three
            scaled = os.path.join(tmp, f"cluster_without_{family}.json")
            step = ["--device", device, "--step-hidden", args.step_hidden, "--step-layers", args.step_layers]
            step += [
                "--step-vocab",
                args.step_vocab,
                "--step-batch",
                args.step_batch,
                "--step-seq",
                args.step_seq,
            ]
            _torchrun(
                [os.path.abspath(__file__), "--step-worker", others, "--worker-out", scaled, *map(str, step)],
                env,
            )
            at = shape.index("--device") + 1
            family_shape = [*shape[:at], scaled, *shape[at + 1 :]]
        _torchrun(
            [os.path.abspath(__file__), "--worker", family, "--worker-out", out, *map(str, family_shape)], env
        )
        with open(out) as f:
            rows += json.load(f)
        print(_table([r for r in rows if r["family"] == family]), flush=True)
    metrics = {"calibrated": _metrics(rows), "re-priced in job": _metrics(rows, "predicted_in_job_s")}
    print(
        f"\nmachine: {os.cpu_count()} cores, 2 gloo ranks x 1 thread; global batch {args.batch}x{args.seq}, "
        f"hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}; device spec {args.device or 'calibrated'}"
    )
    print(_table(rows))
    print(json.dumps(metrics, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "metrics": metrics, "args": vars(args)}, f, indent=2)


if __name__ == "__main__":
    main()
