"""Benchmark: how long symbolic profiling of a full-size model takes, against a plain fake-tensor step.

For each model (default: GPT2-XL at batch 8x1024 and Llama-7B at batch 1x4096) this measures:

* ``build``: ``build_model(preset, device="meta")`` (no storage is allocated);
* ``profile``: ``profile_model(model, batch)`` — capture (fake-tensor trace of forward, backward and the
  AdamW step, with repeated blocks folded) plus analysis (roofline pricing and the liveness peak);
* ``plain fake``: a bare ``FakeTensorMode`` forward + backward of the same *full* model through
  ``torch.func.functional_call`` (no recorder, no folding, no optimizer step): what tracing every block costs;

and the ratio profile / plain fake, two ways:

Times are wall seconds with the process's CPU seconds in brackets: fake-tensor work is single-threaded Python,
so CPU time is what a run costs even when other jobs share the cores, and wall time what a user waits.

* **warm** (one process): the median of ``--repeat`` runs of each, after one warm-up of both on a tiny
  preset and one untimed profile of the model. The fake-tensor dispatch cache is warm for the model's shapes: the
  steady state of a process that profiles the same model again (e.g. for several batch sizes).
* **cold** (``--cold N`` fresh processes per figure): one call per process, after the same tiny warm-up so
  that imports and one-time dispatcher setup are not counted, with the cache cold for the model's shapes:
  what a user's first ``profile_model`` costs, against a first plain fake run.

Usage::

    python scripts/bench_profiler.py                     # both models, table on stdout
    python scripts/bench_profiler.py --json out.json     # also write the figures as JSON
    python scripts/bench_profiler.py --models gpt2-xl:8x1024 --repeat 5 --cold 0
    python scripts/bench_profiler.py --cprofile gpt2-xl.prof   # also save a cProfile of one profile_model

Targets (issue): GPT2-XL profiled in <= 2 s and in <= 0.3x the plain fake run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_COLOSSAL_AUTO_NO_CALIBRATE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402

from hf_colossal_auto.models import build_model, make_example_inputs  # noqa: E402
from hf_colossal_auto.profile import profile_model  # noqa: E402

DEFAULT_MODELS = ("gpt2-xl:8x1024", "llama-7b:1x4096")
TARGET_SECONDS = 2.0
TARGET_RATIO = 0.3


def parse_model(spec: str) -> tuple[str, int, int]:
    """``"gpt2-xl:8x1024"`` -> ("gpt2-xl", 8, 1024)."""
    try:
        name, shape = spec.split(":")
        batch, seq = (int(x) for x in shape.lower().split("x"))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected PRESET:BATCHxSEQ, got {spec!r}") from exc
    return name, batch, seq


def plain_fake_step(model: torch.nn.Module, batch: dict) -> None:
    """Forward + backward of ``model`` on fake tensors, with fake parameters made as the tracer makes them."""
    with FakeTensorMode(allow_non_fake_inputs=False):

        def fake(t: torch.Tensor) -> torch.Tensor:
            return torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=t.dtype, device="cpu")

        params = {n: fake(p).requires_grad_(p.requires_grad) for n, p in model.named_parameters()}
        buffers = {n: fake(b) for n, b in model.named_buffers()}
        inputs = {k: fake(v) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
        out = torch.func.functional_call(model, {**params, **buffers}, args=(), kwargs=inputs)
        out.loss.backward()


def _timed(fn) -> tuple[float, float, object]:
    """(wall seconds, CPU seconds of this process, result). Fake-tensor work is single-threaded Python, so
    CPU time is what the run costs even when other jobs share the cores; wall time is what a user waits."""
    w0, c0 = time.perf_counter(), time.process_time()
    result = fn()
    return time.perf_counter() - w0, time.process_time() - c0, result


def bench_one(name: str, batch_size: int, seq_len: int, *, device: str, repeat: int) -> dict:
    """Warm figures for one model, in this process."""
    builds, captures, analyses = [], [], []
    prof_wall, prof_cpu, plain_wall, plain_cpu = [], [], [], []
    report = None
    model = None
    for _ in range(repeat):
        t_build, _, model = _timed(lambda: build_model(name, device="meta"))
        builds.append(t_build)
    batch = make_example_inputs(model, batch_size, seq_len, device="meta")
    profile_model(model, batch, device=device)  # fills the fake-tensor cache for this model's shapes
    for _ in range(repeat):
        wall, cpu, report = _timed(lambda: profile_model(model, batch, device=device))
        captures.append(report.capture_time_s)
        analyses.append(report.profile_time_s)
        prof_wall.append(wall)
        prof_cpu.append(cpu)
    for _ in range(repeat):
        wall, cpu, _ = _timed(lambda: plain_fake_step(model, batch))
        plain_wall.append(wall)
        plain_cpu.append(cpu)
    med = statistics.median
    return {
        "model": name,
        "batch": [batch_size, seq_len],
        "device": device,
        "num_params": sum(p.numel() for p in model.parameters()),
        "folded_blocks": report.folded_blocks,
        "num_ops": report.num_ops,
        "num_traced_ops": report.num_traced_ops,
        "peak_memory_bytes": report.peak_memory_bytes,
        "build_s": med(builds),
        "capture_s": med(captures),
        "analysis_s": med(analyses),
        "profile_s": med(prof_wall),
        "profile_min_s": min(prof_wall),
        "profile_cpu_s": med(prof_cpu),
        "plain_fake_s": med(plain_wall),
        "plain_fake_min_s": min(plain_wall),
        "plain_fake_cpu_s": med(plain_cpu),
        "ratio": med(prof_wall) / med(plain_wall),
        "ratio_cpu": med(prof_cpu) / med(plain_cpu),
        "runs": {
            "profile_s": prof_wall,
            "profile_cpu_s": prof_cpu,
            "plain_fake_s": plain_wall,
            "plain_fake_cpu_s": plain_cpu,
        },
    }


def _cold_one(kind: str, spec: str, device: str) -> dict:
    """One first call in this (fresh) process, after the tiny warm-up."""
    name, batch_size, seq_len = parse_model(spec)
    warm_up(device)
    model = build_model(name, device="meta")
    batch = make_example_inputs(model, batch_size, seq_len, device="meta")
    if kind == "profile":
        wall, cpu, _ = _timed(lambda: profile_model(model, batch, device=device))
    else:
        wall, cpu, _ = _timed(lambda: plain_fake_step(model, batch))
    return {"wall": wall, "cpu": cpu}


def bench_cold(name: str, batch_size: int, seq_len: int, *, device: str, runs: int) -> dict:
    """Cold figures for one model: each call in a fresh interpreter running this script."""
    times: dict[str, dict[str, list[float]]] = {k: {"wall": [], "cpu": []} for k in ("profile", "plain")}
    spec = f"{name}:{batch_size}x{seq_len}"
    for _ in range(runs):
        for kind, acc in times.items():
            cmd = [sys.executable, __file__, "--cold-one", kind, spec, "--device", device]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            result = json.loads(out.strip().splitlines()[-1])
            acc["wall"].append(result["wall"])
            acc["cpu"].append(result["cpu"])
    med = statistics.median
    prof, plain = times["profile"], times["plain"]
    return {
        "cold_runs": runs,
        "cold_profile_s": med(prof["wall"]),
        "cold_profile_cpu_s": med(prof["cpu"]),
        "cold_plain_fake_s": med(plain["wall"]),
        "cold_plain_fake_cpu_s": med(plain["cpu"]),
        "cold_ratio": med(prof["wall"]) / med(plain["wall"]),
        "cold_ratio_cpu": med(prof["cpu"]) / med(plain["cpu"]),
        "cold_times": times,
    }


def warm_up(device: str) -> None:
    model = build_model("tiny-gpt2", device="meta")
    batch = make_example_inputs(model, 2, 16, device="meta")
    profile_model(model, batch, device=device)
    plain_fake_step(model, batch)


def cpu_model_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _target(r: dict, prefix: str) -> str:
    if r["model"] != "gpt2-xl" or f"{prefix}profile_s" not in r:
        return "-"
    seconds = r[f"{prefix}profile_s"] <= TARGET_SECONDS
    ratios = [r[f"{prefix}ratio"] <= TARGET_RATIO, r[f"{prefix}ratio_cpu"] <= TARGET_RATIO]
    return "met" if seconds and all(ratios) else "met (cpu)" if seconds and ratios[1] else "MISSED"


def format_table(rows: list[dict]) -> str:
    """Times as ``wall (cpu)``; ratios as ``wall (cpu)``."""
    header = ["model", "batch", "build", "capture", "analysis", "profile", "plain fake", "ratio"]
    cold = any("cold_profile_s" in r for r in rows)
    header += ["cold profile", "cold plain fake", "cold ratio"] if cold else []
    header += [f"target (<= {TARGET_SECONDS:g} s, <= {TARGET_RATIO:g}x) warm/cold"]
    lines = []
    for r in rows:
        line = [
            r["model"],
            "x".join(map(str, r["batch"])),
            f"{r['build_s']:.2f} s",
            f"{r['capture_s']:.2f} s",
            f"{r['analysis_s']:.2f} s",
            f"{r['profile_s']:.2f} s ({r['profile_cpu_s']:.2f})",
            f"{r['plain_fake_s']:.2f} s ({r['plain_fake_cpu_s']:.2f})",
            f"{r['ratio']:.3f}x ({r['ratio_cpu']:.3f}x)",
        ]
        if cold:
            line += (
                [
                    f"{r['cold_profile_s']:.2f} s ({r['cold_profile_cpu_s']:.2f})",
                    f"{r['cold_plain_fake_s']:.2f} s ({r['cold_plain_fake_cpu_s']:.2f})",
                    f"{r['cold_ratio']:.3f}x ({r['cold_ratio_cpu']:.3f}x)",
                ]
                if "cold_profile_s" in r
                else ["-", "-", "-"]
            )
        line.append(f"{_target(r, '')}/{_target(r, 'cold_')}")
        lines.append(line)
    widths = [max(len(x[i]) for x in [header, *lines]) for i in range(len(header))]
    out = ["  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True))]
    out.append("  ".join("-" * w for w in widths))
    out += ["  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)) for line in lines]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--models",
        nargs="+",
        type=parse_model,
        default=[parse_model(m) for m in DEFAULT_MODELS],
        metavar="PRESET:BxS",
        help=f"presets and batch shapes (default: {' '.join(DEFAULT_MODELS)})",
    )
    parser.add_argument(
        "--device", default="a100-80gb", help="profile_model target device (default a100-80gb)"
    )
    parser.add_argument("--repeat", type=int, default=5, help="warm runs per figure; the median is reported")
    parser.add_argument("--cold", type=int, default=3, help="fresh processes per cold figure (0: skip)")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--json", type=Path, default=None, help="write the figures to this JSON file")
    parser.add_argument(
        "--cprofile", type=Path, default=None, help="save a cProfile of one profile_model of the first model"
    )
    parser.add_argument("--cold-one", nargs=2, metavar=("KIND", "SPEC"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.cold_one:
        kind, spec = args.cold_one
        print(json.dumps(_cold_one(kind, spec, args.device)))
        return 0
    if args.repeat < 1 or args.cold < 0:
        parser.error("--repeat must be >= 1 and --cold >= 0")

    warm_up(args.device)
    rows = [bench_one(n, b, s, device=args.device, repeat=args.repeat) for n, b, s in args.models]
    if args.cold:
        for row, (n, b, s) in zip(rows, args.models, strict=True):
            row.update(bench_cold(n, b, s, device=args.device, runs=args.cold))
    machine = {
        "cpu": cpu_model_name(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
    }
    print(
        f"machine: {machine['cpu']}, {machine['cpu_count']} CPUs, torch {machine['torch']} "
        f"({machine['torch_threads']} threads), transformers {machine['transformers']}"
    )
    print(
        f"profile_model(device={args.device!r}); times: wall (process CPU) seconds; warm: median of "
        f"{args.repeat} runs in one process; cold: median of {args.cold} fresh processes\n"
    )
    print(format_table(rows))

    if args.cprofile is not None:
        import cProfile

        name, b, s = args.models[0]
        model = build_model(name, device="meta")
        batch = make_example_inputs(model, b, s, device="meta")
        cProfile.runctx(
            "profile_model(model, batch, device=device)",
            {"profile_model": profile_model},
            {"model": model, "batch": batch, "device": args.device},
            filename=str(args.cprofile),
        )
        print(f"\ncProfile of profile_model({name}) saved to {args.cprofile}")
    if args.json is not None:
        args.json.write_text(json.dumps({"machine": machine, "command": sys.argv, "results": rows}, indent=2))
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
