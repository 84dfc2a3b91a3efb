"""``hf-colossal-auto`` command line: profile (and, as the planner lands, plan) models you don't have to own.

Everything here builds models from configs on the ``meta`` device, so it runs on a laptop for 7B+ configs.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections.abc import Sequence

logger = logging.getLogger("hf_colossal_auto")


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model", required=True, help="preset name (see `hf-colossal-auto presets`) or a config.json path"
    )
    p.add_argument(
        "--batch-size",
        type=int,
        default=8,
        help="global batch size: sequences per optimizer step over all devices (a training script's per-process batch x processes)",
    )
    p.add_argument("--seq-len", type=int, default=1024, help="tokens per sequence")
    p.add_argument(
        "--device",
        default="a100-80gb",
        help="hardware preset (see `hf-colossal-auto devices`) or a JSON from `hf-colossal-auto calibrate`",
    )
    p.add_argument(
        "--mixed-precision",
        choices=["no", "bf16", "fp16"],
        default="no",
        help="autocast dtype, as accelerate applies it",
    )
    p.add_argument("--optimizer", choices=["adamw", "adam", "sgd", "none"], default="adamw")
    p.add_argument(
        "--no-fold", action="store_true", help="trace every block instead of reusing identical ones"
    )


class _Stage:
    """Prints a one-line progress note around a slow stage (stderr, so --json output stays clean)."""

    def __init__(self, text: str, quiet: bool = False) -> None:
        self.text, self.quiet = text, quiet

    def __enter__(self) -> _Stage:
        self.t0 = time.perf_counter()
        if not self.quiet:
            print(f"  {self.text} ...", end="", file=sys.stderr, flush=True)
        return self

    def __exit__(self, exc_type, *_) -> None:
        if not self.quiet:
            status = "failed" if exc_type else f"{time.perf_counter() - self.t0:.2f} s"
            print(f" {status}", file=sys.stderr, flush=True)


def cmd_profile(args: argparse.Namespace) -> int:
    from .hardware import get_device
    from .models import build_model, make_example_inputs
    from .profile import profile_model

    spec = get_device(args.device)
    with _Stage(f"building {args.model} on meta", args.quiet):
        model = build_model(args.model, device="meta")
    with _Stage(f"example batch {args.batch_size}x{args.seq_len}", args.quiet):
        batch = make_example_inputs(model, args.batch_size, args.seq_len, device="meta")
    with _Stage("capturing and profiling one training step", args.quiet):
        report = profile_model(
            model,
            batch,
            device=spec,
            mixed_precision=None if args.mixed_precision == "no" else args.mixed_precision,
            optimizer=None if args.optimizer == "none" else args.optimizer,
            fold_blocks=not args.no_fold,
        )
    print(report.summary(max_blocks=args.max_blocks))
    if args.json:
        report.to_json(args.json)
        print(f"\nwrote {args.json}")
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from .hardware import get_device
    from .models import build_model, make_example_inputs
    from .solve.planner import BASELINES, evaluate_plan, plan_model
    from .units import format_bytes, format_seconds

    spec = get_device(args.device)
    mixed = None if args.mixed_precision == "no" else args.mixed_precision
    optimizer = None if args.optimizer == "none" else args.optimizer
    mesh = tuple(int(x) for x in args.mesh.split("x")) if args.mesh else None
    common = dict(
        num_devices=args.devices,
        device=spec,
        memory_budget=args.memory_budget,
        devices_per_node=args.devices_per_node,
        mixed_precision=mixed,
        optimizer=optimizer,
        time_limit_s=args.time_limit,
    )
    if args.routing_histogram:  # MoE: a measured routing load (RoutingLoad JSON) instead of uniform routing
        common["routing"] = args.routing_histogram
    if args.frontier and args.memory_budget is not None:
        raise ValueError("--frontier sweeps the memory budget itself: drop --memory-budget")
    with _Stage(f"building {args.model} on meta", args.quiet):
        model = build_model(args.model, device="meta")
        batch = make_example_inputs(model, args.batch_size, args.seq_len, device="meta")
    if args.frontier:
        return _print_frontier(args, model, batch, mesh, common)
    with _Stage(f"planning for {args.devices} x {spec.name} (capture, strategies, ILP per mesh)", args.quiet):
        pipeline = None if args.pipeline == "auto" else int(args.pipeline)
        cp = None if args.context_parallel == "auto" else int(args.context_parallel)
        plan = plan_model(model, batch, mesh_shape=mesh, pipeline=pipeline, context_parallel=cp, **common)
    print(plan.summary())
    print("\nmeshes tried:")
    for alt in plan.alternatives:
        mesh_txt = "x".join(str(x) for x in alt["mesh"])
        k = alt.get("micro_batches", 1)
        mesh_txt += f" k={k}" if k > 1 else ""
        if "step_time_s" in alt:
            print(
                f"  dp x tp = {mesh_txt:7s} {alt.get('dp_label', alt['dp_mode']):9s} {format_seconds(alt['step_time_s']):>9s}"
                f"  peak {format_bytes(alt['peak_memory_bytes']):>11s}  {'fits' if alt['fits'] else 'does not fit'}"
            )
        elif "min_step_time_s" in alt:
            print(
                f"  dp x tp = {mesh_txt:7s} {alt.get('dp_label', alt['dp_mode']):9s} skipped: >= "
                f"{format_seconds(alt['min_step_time_s'])}"
            )
        else:
            print(
                f"  dp x tp = {mesh_txt:7s} {alt.get('dp_label', alt['dp_mode']):9s} needs >= {format_bytes(alt['min_memory_bytes'])}"
            )
    if not args.no_baselines:
        print("\nbaselines under the same cost model:")
        print(
            f"  {'auto':11s} {format_seconds(plan.step_time_s):>9s}  peak {format_bytes(plan.peak_memory_bytes):>11s}  fits"
        )
        for base in BASELINES:
            with _Stage(f"pricing {base}", True):
                try:
                    est = evaluate_plan(model, batch, base, **common)
                except ValueError as exc:  # megatron-sp/-local without a tensor-parallel axis: say why, go on
                    print(f"  {base:11s} not priced: {exc}")
                    continue
            ratio = est.step_time_s / plan.step_time_s if plan.step_time_s else float("nan")
            print(
                f"  {base:11s} {format_seconds(est.step_time_s):>9s}  peak {format_bytes(est.peak_memory_bytes):>11s}  "
                f"{'fits' if est.fits else 'does NOT fit':12s} mesh {'x'.join(map(str, est.mesh_shape))} "
                f"{est.dp_mode}  ({ratio:.2f}x auto)"
            )
    if args.out:
        plan.save(args.out)
        print(f"\nwrote {args.out}")
    if args.plot:
        from .plot import plot_plan
        from .solve.frontier import PlotUnavailableError

        try:
            print(f"wrote {plot_plan(plan, args.plot)}")
        except PlotUnavailableError as exc:
            print(f"warning: no plot written: {exc}", file=sys.stderr)
    return 0


def _print_frontier(args: argparse.Namespace, model, batch, mesh, common: dict) -> int:
    """``plan --frontier``: step time vs budget for auto and the baselines, as a table (and a PNG)."""
    from .solve.frontier import DEFAULT_APPROACHES, PIPELINE_RECIPES, PlotUnavailableError, frontier

    kwargs = {k: v for k, v in common.items() if k != "memory_budget"}
    title = f"{args.model}, batch {args.batch_size}x{args.seq_len}, {args.devices} x {common['device'].name}"
    approaches = ("auto",) if args.no_baselines else DEFAULT_APPROACHES
    if (
        getattr(args, "pipeline", "1") != "1"
    ):  # pipeline stages searched: the pipeline hand configurations too
        kwargs["pipeline"] = None if args.pipeline == "auto" else int(args.pipeline)
        if not args.no_baselines:
            approaches = (*approaches, *PIPELINE_RECIPES)
    front = frontier(
        model,
        batch,
        points=args.frontier_points,
        approaches=approaches,
        mesh_shape=mesh,
        progress=False if args.quiet else None,
        title=title,
        **kwargs,
    )
    print(front.table())
    if args.plot:
        try:
            print(f"\nwrote {front.plot(args.plot)}")
        except PlotUnavailableError as exc:
            logger.warning("no plot written: %s", exc)
            print(f"warning: no plot written: {exc}", file=sys.stderr)
    return 0


def cmd_devices(args: argparse.Namespace) -> int:
    from .hardware import list_devices
    from .hardware.catalog import static_presets
    from .units import format_bytes, format_flops

    presets = static_presets()
    for name in list_devices():
        spec = presets[name]
        bf16 = spec.peak_flops.get("bfloat16", spec.peak_flops["float32"])
        print(
            f"{name:12s} {format_bytes(spec.memory_bytes):>11s}  bf16 {format_flops(bf16, per_second=True):>14s}"
            f"  HBM {spec.memory_bandwidth / 1e9:7.0f} GB/s  {spec.devices_per_node}/node"
        )
    return 0


def cmd_calibrate(args: argparse.Namespace) -> int:
    """Measure this machine (under torchrun/accelerate launch: its collectives too) into a device JSON."""
    from .calibration.machine import calibrate_machine
    from .calibration.op_scales import format_scales
    from .hardware.spec import save_device_spec

    with calibrate_machine(
        args.kind,
        budget_s=args.budget,
        overheads=not args.no_overheads,
        step_models=args.step_model or (),
        step_batch_size=args.step_batch_size,
        step_seq_len=args.step_seq_len,
        stage=lambda text: _Stage(text, args.quiet),
    ) as result:
        if result.main_process:
            _print_spec(result.spec)
            if result.steps is not None:
                print(f"  in-step op times ({', '.join(result.steps.models)}; forward + backward):")
                print("\n".join(format_scales(result.steps)))
            if args.out:
                save_device_spec(result.spec, args.out)
                print(f"wrote {args.out} (use it as --device {args.out} or device='{args.out}')")
    return 0


def _print_spec(spec) -> None:
    from .units import format_flops

    rows = [("matmul " + k, format_flops(v, per_second=True)) for k, v in spec.peak_flops.items()]
    rows += [("attention " + k, format_flops(v, per_second=True)) for k, v in spec.attention_flops.items()]
    rows += [
        ("elementwise bandwidth", f"{spec.memory_bandwidth / 1e9:.2f} GB/s"),
        *(
            [("elementwise math (exp, tanh...)", f"{spec.transcendental_rate / 1e9:.2f} G elements/s")]
            if spec.transcendental_rate
            else []
        ),
        ("host overhead / op", f"{spec.host_overhead_s * 1e6:.1f} us"),
        ("DTensor overhead / op", f"{spec.dtensor_overhead_s * 1e6:.1f} us"),
        ("collective hidden behind compute", f"{spec.overlap_efficiency:.0%}"),
        *(
            [
                (
                    "rank skew at a sync",
                    f"{spec.rank_skew_s * 1e3:.1f} ms after 1 s of work (x L^{spec.rank_skew_exponent:.2f}, "
                    f"{spec.rank_skew_ranks} ranks)",
                )
            ]
            if spec.rank_skew_s
            else []
        ),
    ]
    for kind, (bandwidth, latency) in spec.intra_node_link.collectives.items():
        rows.append((f"{kind} (intra-node)", f"{latency * 1e6:.1f} us/step, {bandwidth / 1e9:.2f} GB/s"))
    width = max(len(r[0]) for r in rows)
    print(f"{spec.name}: calibrated")
    for name, value in rows:
        print(f"  {name:{width}s}  {value}")


def cmd_presets(args: argparse.Namespace) -> int:
    from .models import list_presets

    print("\n".join(list_presets()))
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    """The main job for a fresh checkout: what 8 x A100 would need for GPT-2 XL (the plan next to the
    baselines, then under a budget that forces activation recompute), then the tiny GPT pretraining recipe on
    2 CPU processes through ``accelerate launch`` with the plan applied."""
    parser = build_parser()
    runs = [
        "plan --model gpt2-xl --batch-size 8 --seq-len 1024 --devices 8 --device a100-80gb --mixed-precision bf16",
        "plan --model gpt2-xl --batch-size 8 --seq-len 1024 --devices 8 --device a100-80gb --mixed-precision bf16"
        " --memory-budget 8GiB --no-baselines",
    ]
    for line in runs:
        print(f"\n$ hf-colossal-auto {line}", flush=True)
        ns = parser.parse_args((["-q"] if args.quiet else []) + line.split())
        try:
            ns.func(ns)
        except ValueError as exc:  # an impossible budget is a result worth showing, not a crash
            print(f"error: {exc}")
    return _demo_training(args.max_steps) if args.max_steps > 0 else 0


def _demo_training(max_steps: int) -> int:
    """Pretrain the tiny GPT for a few dozen steps on 2 gloo processes: recipes/pretrain_gpt.py through
    ``accelerate launch`` with recipes/auto_cpu.yaml, exactly as recipes/README.md documents it."""
    import subprocess
    import tempfile
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    recipe, config = root / "recipes" / "pretrain_gpt.py", root / "recipes" / "auto_cpu.yaml"
    if not recipe.exists() or not config.exists():  # an installed package without the repository's recipes
        return 0
    out = Path(tempfile.mkdtemp(prefix="hf_colossal_auto_demo_"))
    launch = [str(Path(sys.executable).with_name("accelerate")), "launch"]
    if not Path(launch[0]).exists():
        launch = [sys.executable, "-m", "accelerate.commands.launch"]
    cmd = [
        *launch,
        "--config_file",
        str(config),
        "--multi_gpu",
        "--num_processes",
        "2",
        str(recipe),
        "--model",
        "tiny",
        "--max_steps",
        str(max_steps),
        "--output_dir",
        str(out),
    ]
    print(
        "\n$ ACCELERATE_USE_CPU=1 accelerate launch --config_file recipes/auto_cpu.yaml --multi_gpu "
        f"--num_processes 2 recipes/pretrain_gpt.py --model tiny --max_steps {max_steps} --output_dir {out}",
        flush=True,
    )
    env = {**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, env=env, cwd=root, check=False).returncode


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hf-colossal-auto",
        description="Symbolic profiling and automatic parallel planning for HuggingFace models.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress lines")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("profile", help="profile one training step of a model config (no weights, no GPU)")
    _add_model_args(p)
    p.add_argument("--json", metavar="PATH", help="also write the report as JSON")
    p.add_argument(
        "--max-blocks", type=int, default=None, help="show at most this many rows of the block table"
    )
    p.set_defaults(func=cmd_profile)

    p = sub.add_parser("plan", help="plan DP x TP sharding for N devices you may not have")
    _add_model_args(p)
    p.add_argument("--devices", type=int, required=True, help="number of devices")
    p.add_argument(
        "--devices-per-node", type=int, default=None, help="devices per node (default: the preset's)"
    )
    p.add_argument(
        "--memory-budget", default=None, help="per-device budget, e.g. 40GiB (default: memory - margin)"
    )
    p.add_argument("--mesh", default=None, help="force a mesh, e.g. 2x4 (dp x tp) or 8 (tp only)")
    p.add_argument(
        "--pipeline",
        default="1",
        help="pipeline stages (tp, DDP/FSDP/HSDP, recompute inside a stage): 1 none (default), 'auto' searches pp degrees against plans without "
        "stages, an int >= 2 fixes the pp degree",
    )
    p.add_argument(
        "--context-parallel",
        default="1",
        help="context parallelism (each sequence split over a cp axis): 1 none (default), 'auto' searches cp "
        "degrees against plans without it, an int >= 2 fixes the cp degree (--mesh is then dp x tp)",
    )
    p.add_argument("--time-limit", type=float, default=60.0, help="ILP time limit per mesh, seconds")
    p.add_argument(
        "--no-baselines",
        action="store_true",
        help="skip pricing ddp/fsdp/megatron/megatron-sp/megatron-local/megatron-sp-local",
    )
    p.add_argument("--out", metavar="PATH", help="write the plan JSON here")
    p.add_argument(
        "--routing-histogram",
        metavar="PATH",
        help="MoE models: rows per expert per layer measured on a real batch (RoutingLoad JSON, from "
        "measure_routing); expert parallelism is priced by each layer's busiest rank (default: uniform routing)",
    )
    p.add_argument(
        "--frontier",
        action="store_true",
        help="print predicted step time vs per-device budget for auto and the baselines instead of one plan; with "
        "--pipeline auto or <pp>, the pipeline recipes too (fsdp-tp-pp: torchtitan's FSDP x TP x PP, interleaved "
        "1F1B; fsdp-tp-pp-1f1b: the same with 1F1B; llama3-4d: Llama 3's 4-D layout without cp)",
    )
    p.add_argument("--frontier-points", type=int, default=8, help="budgets in the --frontier sweep")
    p.add_argument(
        "--plot",
        metavar="PATH",
        help="write a PNG (matplotlib): the plan's memory over the step and time per block (a pipeline plan's "
        "stages too); with --frontier, the frontier",
    )
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser(
        "calibrate",
        help="measure this machine (GEMMs, bandwidth, attention, per-op overheads; collectives under torchrun)",
    )
    p.add_argument("--out", metavar="PATH", help="write the device spec JSON here (use it as --device PATH)")
    p.add_argument("--kind", choices=["cpu", "cuda"], default=None, help="default: the GPU if there is one")
    p.add_argument("--budget", type=float, default=1.0, help="seconds per kernel benchmark")
    p.add_argument("--no-overheads", action="store_true", help="keep the default per-op overheads")
    p.add_argument(
        "--step-model",
        action="append",
        metavar="NAME",
        help="also time real training steps of this model (preset or config path; repeatable) and scale each "
        "op kind by measured / predicted (DeviceSpec.op_time_scale)",
    )
    p.add_argument(
        "--step-batch-size", type=int, default=4, help="per-process batch of the --step-model steps"
    )
    p.add_argument("--step-seq-len", type=int, default=256, help="sequence length of the --step-model steps")
    p.set_defaults(func=cmd_calibrate)

    p = sub.add_parser("devices", help="list the hardware presets")
    p.set_defaults(func=cmd_devices)
    p = sub.add_parser("presets", help="list the model presets")
    p.set_defaults(func=cmd_presets)
    from .integrations.launch import add_launch_parser

    add_launch_parser(sub)
    p = sub.add_parser("demo", help="the `make demo` job")
    p.add_argument(
        "--max-steps", type=int, default=40, help="steps of the 2-process training run (0: only the plans)"
    )
    p.set_defaults(func=cmd_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )
    if not args.verbose:
        import transformers

        transformers.logging.set_verbosity_error()
    try:
        return args.func(args)
    except (ValueError, TypeError, RuntimeError) as exc:
        if args.verbose:
            raise
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
