"""Single-device check of the profiler's and planner's predictions against a real training step.

For each model (by default GPT-2 large at batch 8x1024 and a ~1B-parameter Llama built from a config at batch
4x2048) in bf16 autocast with AdamW(foreach):

* **memory**: the profiler's liveness peak of a steady-state step vs ``torch.cuda.max_memory_allocated`` (reset
  after the optimizer state exists, so both describe the same steady-state step);
* **time**: the profiler's roofline step time on the device spec vs the measured median step time;
* **runtime**: the same with the model parallelized by our runtime on a one-device job (a plan for
  ``num_devices=1``), to see the cost of running the model on DTensor parameters.

Made for a one-shot run: every model, and within it the profile, the plain measurement and the runtime half,
is guarded (a failure prints its traceback, is recorded in the row as ``*error``, and the script goes on), each
finished row is printed as JSON at once and ``--json`` is rewritten after every model, and the end prints the
table and the JSON of all rows.

Models are preset names or config paths (``hf-colossal-auto presets``), or ``llama-1b`` (below), each
optionally with its own batch shape as ``NAME:BxS`` (``gpt2-large:8x1024``); ``--batch-size``/``--seq-len``
override the shape of every model. The device spec is ``--device-spec PATH`` (JSON of
``DeviceSpec.to_dict()``) when given, else the detected CUDA device (``detect_device()``; a GPU the catalog
does not know falls back to ``--fallback-device`` with this GPU's memory), else the CPU.

Runs on CPU as well (``--device cpu --models tiny-gpt2 tiny-llama --batch-size 2 --seq-len 32``) so that it is
tested where no GPU is lent: ``scripts/gpu_check.sh`` is the prepared GPU command.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time
import traceback

import torch
import transformers

# model name -> default (batch, seq) when the command line names none
DEFAULT_SHAPES = {"gpt2-large": (8, 1024), "llama-1b": (4, 2048)}
DEFAULT_MODELS = ["gpt2-large", "llama-1b"]
FALLBACK_SHAPE = (8, 1024)


def _llama_1b():
    """A ~1B-parameter Llama (hidden 2048, 16 layers, 16 heads, MHA, intermediate 5632, vocab 32000; 0.95B
    parameters with untied embeddings), built from the tiny-llama preset as bench_runtime's ``_model_config``."""
    from hf_colossal_auto.models import load_config

    cfg = load_config("tiny-llama")
    cfg.hidden_size = 2048
    cfg.intermediate_size = 5632
    cfg.num_attention_heads = 16
    cfg.num_key_value_heads = 16
    cfg.head_dim = 2048 // 16
    cfg.num_hidden_layers = 16
    cfg.vocab_size = 32000
    cfg.max_position_embeddings = 4096
    return cfg


CONFIG_BUILDERS = {"llama-1b": _llama_1b}


def _parse_model(arg: str, batch_size: int | None, seq_len: int | None) -> tuple[str, int, int]:
    name, _, shape = arg.partition(":")
    b, s = DEFAULT_SHAPES.get(name, FALLBACK_SHAPE)
    if shape:
        b_text, _, s_text = shape.lower().partition("x")
        b, s = int(b_text), int(s_text)
    return name, batch_size or b, seq_len or s


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _free(device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _training_step(model, batch, device: str):
    """``(optimizer, step)``: AdamW (foreach) and one bf16-autocast training step of ``model`` on ``batch``."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=True)

    def step() -> None:
        with torch.autocast(device, dtype=torch.bfloat16):
            loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return opt, step


def _measure(model, batch, device: str, steps: int) -> tuple[float, int, list[float]]:
    """Median step seconds, peak bytes of a steady-state step (optimizer state already allocated), and every
    timed step's seconds."""
    opt, step = _training_step(model, batch, device)

    try:
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
        return statistics.median(times), peak, times
    finally:  # free the gradients and moments now, even when a traceback keeps this frame alive
        opt.zero_grad(set_to_none=True)
        opt.state.clear()


def _op_breakdown(model, batch, device: str, report) -> list[dict]:
    """One more step under torch.profiler: device seconds per aten op (kernels attributed to the op that launched
    them; CPU: its self time) next to the profiler's predicted seconds for the same op (all its nodes), the 20
    largest. Says where a step-time gap comes from."""
    from collections import defaultdict

    from hf_colossal_auto.capture.op_classes import op_base_name

    opt, step = _training_step(model, batch, device)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    try:
        step()
        _sync(device)
        with torch.profiler.profile(activities=activities) as prof:
            step()
            _sync(device)
    finally:
        opt.zero_grad(set_to_none=True)
        opt.state.clear()
    measured: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)
    for event in prof.key_averages():
        if not event.key.startswith("aten::"):
            continue
        seconds = (event.self_device_time_total if device == "cuda" else event.self_cpu_time_total) / 1e6
        measured[event.key[len("aten::") :]] += seconds
        calls[event.key[len("aten::") :]] += event.count
    predicted: dict[str, float] = defaultdict(float)
    nodes: dict[str, int] = defaultdict(int)
    for node in report.nodes:
        base = op_base_name(node.op)
        predicted[base] += node.time_s * node.count
        nodes[base] += node.count
    names = sorted(
        set(measured) | set(predicted), key=lambda k: -max(measured.get(k, 0), predicted.get(k, 0))
    )
    return [
        {
            "op": k,
            "measured_s": measured.get(k, 0.0),
            "calls": calls.get(k, 0),
            "predicted_s": predicted.get(k, 0.0),
            "nodes": nodes.get(k, 0),
        }
        for k in names[:20]
    ]


def _device_spec(args):
    """(spec, how it was chosen)."""
    from hf_colossal_auto.hardware import detect_device, device_from_dict, get_device

    if args.device_spec:
        with open(args.device_spec) as f:
            return device_from_dict(json.load(f)), f"--device-spec {args.device_spec}"
    if args.device != "cuda":
        return get_device("cpu"), "cpu preset"
    try:
        return detect_device(), f"detect_device() from {torch.cuda.get_device_name()!r}"
    except ValueError as error:
        total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
        spec = get_device(args.fallback_device).with_overrides(memory_bytes=int(total))
        return spec, f"--fallback-device {args.fallback_device} with this GPU's memory ({error})"


def _init_process_group(device: str) -> None:
    if not torch.distributed.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29531")
        torch.distributed.init_process_group("nccl" if device == "cuda" else "gloo", rank=0, world_size=1)


def _guarded(name: str, stage: str, row: dict, fn) -> bool:
    """Run ``fn()``; on an exception print its traceback, record it as ``row[stage + "_error"]`` and say so."""
    try:
        fn()
        return True
    except Exception as error:
        row[f"{stage}_error"] = f"{type(error).__name__}: {error}"
        print(f"[{name}] {stage} FAILED:", flush=True)
        traceback.print_exc()
        return False


def _check_model(name: str, batch_size: int, seq_len: int, spec, args, row: dict) -> None:
    """Fill ``row`` for one model. Building the model and batch raises (the caller records it); after that
    the profile, the plain measurement and the runtime half (plan, apply, measure) are each guarded, so one
    failing keeps the others' numbers."""
    from hf_colossal_auto.apply import apply_plan
    from hf_colossal_auto.models import build_model, make_example_inputs
    from hf_colossal_auto.profile import profile_model
    from hf_colossal_auto.solve.planner import plan_model

    device = args.device
    torch.manual_seed(0)
    t0 = time.perf_counter()
    source = CONFIG_BUILDERS[name]() if name in CONFIG_BUILDERS else name
    model = build_model(source, device=device)
    batch = make_example_inputs(model, batch_size, seq_len, device=device)
    row["params"] = sum(p.numel() for p in model.parameters())
    row["build_s"] = time.perf_counter() - t0

    report_box: list = []

    def profile() -> None:
        t0 = time.perf_counter()
        report = profile_model(model, batch, device=spec, mixed_precision="bf16")
        report_box.append(report)
        row["profile_s"] = time.perf_counter() - t0
        row["predicted_peak_bytes"] = report.peak_memory_bytes
        row["predicted_step_s"] = report.estimated_step_time_s
        if args.device != "cpu":  # the datasheet preset's prediction, to show what calibration changed
            from hf_colossal_auto.hardware import detect_device

            preset = profile_model(model, batch, device=detect_device(), mixed_precision="bf16")
            row["predicted_step_s_preset"] = preset.estimated_step_time_s
        print(f"[{name}] profiled in {row['profile_s']:.1f}s", flush=True)

    def plain() -> None:
        step_s, peak, times = _measure(model, batch, device, args.steps)
        row.update(measured_step_s=step_s, measured_peak_bytes=peak, measured_steps_s=times)
        print(f"[{name}] plain step {step_s * 1e3:.1f} ms, peak {peak / 2**30:.2f} GiB", flush=True)
        if report_box:
            row["ops"] = _op_breakdown(model, batch, device, report_box[0])
            for op in row["ops"]:
                print(
                    f"[{name}]   {op['op']:42s} measured {op['measured_s'] * 1e3:8.2f} ms ({op['calls']:5d})"
                    f"  predicted {op['predicted_s'] * 1e3:8.2f} ms ({op['nodes']:5d})",
                    flush=True,
                )

    def runtime() -> None:  # the same model through the runtime, on a one-device job
        _init_process_group(device)
        t0 = time.perf_counter()
        plan = plan_model(model, batch, num_devices=1, device=spec, mixed_precision="bf16")
        row["plan_s"] = time.perf_counter() - t0
        row.update(
            plan_step_s=plan.step_time_s,
            plan_peak_bytes=plan.peak_memory_bytes,
            plan_dp_mode=plan.dp_mode,
            plan_mesh=list(plan.mesh_shape),
            plan_recompute=sorted(set(plan.recompute.values())),
        )
        print(f"[{name}] planned in {row['plan_s']:.1f}s; measuring with the runtime", flush=True)
        apply_plan(model, plan)
        runtime_s, runtime_peak, runtime_times = _measure(model, batch, device, args.steps)
        row.update(runtime_step_s=runtime_s, runtime_peak_bytes=runtime_peak, runtime_steps_s=runtime_times)
        print(
            f"[{name}] runtime step {runtime_s * 1e3:.1f} ms, peak {runtime_peak / 2**30:.2f} GiB", flush=True
        )

    try:
        _guarded(name, "profile", row, profile)
        _guarded(name, "plain", row, plain)
        _free(device)
        _guarded(name, "runtime", row, runtime)
    finally:
        model = batch = None  # drop the model's memory before the next model is built
        _free(device)


def _gib(value, width: int = 10) -> str:
    return f"{'-':>{width}s}" if value is None else f"{value / 2**30:{width - 1}.2f}G"


def _ms(value, width: int = 10) -> str:
    return f"{'-':>{width}s}" if value is None else f"{value * 1e3:{width - 2}.1f}ms"


def _print_table(rows: list[dict], spec_name: str) -> None:
    print(f"\ndevice spec: {spec_name}; bf16 autocast, AdamW(foreach); rt = with our runtime (1-device plan)")
    print(
        f"{'model':12s} {'batch':>9s} {'peak pred':>10s} {'peak meas':>10s} {'err':>7s} {'step pred':>10s}"
        f" {'step meas':>10s} {'plan step':>10s} {'rt step':>10s} {'rt peak':>10s}  error"
    )
    for r in rows:
        pred, meas = r.get("predicted_peak_bytes"), r.get("measured_peak_bytes")
        err = f"{(pred - meas) / meas:7.1%}" if pred is not None and meas else f"{'-':>7s}"
        errors = "; ".join(f"{k}: {v}" for k, v in r.items() if k.endswith("error"))
        print(
            f"{r['model']:12s} {r['batch_size']:>4d}x{r['seq_len']:<4d} {_gib(pred)} {_gib(meas)} {err}"
            f" {_ms(r.get('predicted_step_s'))} {_ms(r.get('measured_step_s'))} {_ms(r.get('plan_step_s'))}"
            f" {_ms(r.get('runtime_step_s'))} {_gib(r.get('runtime_peak_bytes'))}  {errors[:160]}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--models", nargs="+", default=DEFAULT_MODELS, help="NAME or NAME:BxS (e.g. gpt2-large:8x1024)"
    )
    parser.add_argument("--batch-size", type=int, default=None, help="override every model's batch size")
    parser.add_argument("--seq-len", type=int, default=None, help="override every model's sequence length")
    parser.add_argument(
        "--steps", type=int, default=5, help="timed steps (after 2 warm-up steps and 1 peak step)"
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--device-spec", default=None, help="JSON of DeviceSpec.to_dict() used for the predictions"
    )
    parser.add_argument(
        "--fallback-device", default="h200", help="catalog preset when detect_device() does not know the GPU"
    )
    parser.add_argument("--json", default=None, help="write the rows here (rewritten after every model)")
    args = parser.parse_args()
    transformers.logging.set_verbosity_error()
    started = time.perf_counter()

    spec, how = _device_spec(args)
    spec_name = spec if isinstance(spec, str) else spec.name
    print(f"device spec: {spec_name} ({how})", flush=True)
    print(f"  {json.dumps(spec.to_dict())}", flush=True)

    rows: list[dict] = []

    def write_json() -> None:
        if args.json:
            with open(args.json, "w") as f:
                json.dump(
                    {
                        "device_spec": spec.to_dict(),
                        "device_spec_source": how,
                        "torch": torch.__version__,
                        "transformers": transformers.__version__,
                        "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None,
                        "rows": rows,
                    },
                    f,
                    indent=2,
                )

    for arg in args.models:
        name, batch_size, seq_len = _parse_model(arg, args.batch_size, args.seq_len)
        row: dict = {"model": name, "batch_size": batch_size, "seq_len": seq_len}
        print(
            f"[{name}] batch {batch_size}x{seq_len} ({time.perf_counter() - started:.0f}s elapsed)",
            flush=True,
        )
        t0 = time.perf_counter()
        try:
            _check_model(name, batch_size, seq_len, spec, args, row)
        except Exception as error:
            row["error"] = f"{type(error).__name__}: {error}"
            print(f"[{name}] FAILED:", flush=True)
            traceback.print_exc()
        _free(args.device)
        row["total_s"] = time.perf_counter() - t0
        rows.append(row)
        print(f"[{name}] row: {json.dumps(row)}", flush=True)
        write_json()

    _print_table(rows, spec_name)
    print(f"\nrows (JSON), {time.perf_counter() - started:.0f}s in all:")
    print(json.dumps(rows, indent=2))
    write_json()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
