"""``calibrate()``: measure the machine at hand into a :class:`~hf_colossal_auto.hardware.DeviceSpec`.

The presets hold datasheet peaks, which a real step never reaches; the planner minimises predicted step time,
so what it is told a kernel, an op and a collective cost must be what they cost here. ``calibrate`` measures,
in a few seconds each:

1. the device (:mod:`.hardware.microbench`): projection-shaped GEMM FLOP/s per dtype (``peak_flops``) and
   by GEMM size (``matmul_flops``: the curve the roofline prices each matmul on, so that a tensor-parallel
   shard's smaller GEMM runs slower), elementwise bandwidth, elementwise math (exp, tanh, softmax: on a CPU
   bound by arithmetic, not bandwidth), fused attention FLOP/s;
2. the per-op host overheads: one training step of tiny models (whose kernels cost next to nothing) divided by
   its op count, eager (``host_overhead_s``) and again with our runtime applied for one device, which runs
   every op on DTensors with the plan's hooks (``dtensor_overhead_s``: the difference per op);
3. every collective on the running process group, per kind (``intra_node_link.collectives``), and how much
   of a collective hides behind concurrent GEMMs (``overlap_efficiency``), and how long a rank waits for its
   peers at a synchronising collective after a stretch of the same work (``rank_skew_s``,
   :mod:`.hardware.skew`), when the job has more than one process; all ranks must call it then, and all get
   the same spec.

The result is written as JSON (``hf-colossal-auto calibrate --out cluster.json``) that every ``device=``
argument and ``--device`` flag accepts. It carries its provenance (host, date, torch, command).
"""

from __future__ import annotations

import copy
import dataclasses
import datetime
import logging
import os
import platform
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

from .hardware import DeviceSpec, LinkSpec, get_device
from .hardware.calibrate import cpu_model_name, host_memory_bytes
from .hardware.catalog import STATIC_CPU_SPEC, device_from_cuda_name
from .hardware.microbench import collective_fits, dtensor_collective_fits, measure_kernels, overlap_efficiency
from .hardware.skew import measure_rank_skew

__all__ = ["calibrate", "measure_overheads", "OVERHEAD_MODELS"]

logger = logging.getLogger(__name__)

OVERHEAD_MODELS: tuple[str, ...] = ("tiny-llama", "tiny-gpt2")
"""Tiny models whose training step measures the per-op overheads (two families: their mean is used)."""


def _device(kind: str) -> torch.device:
    if kind == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _base_spec(kind: str) -> DeviceSpec:
    """The spec calibration starts from: the preset of this GPU (links, memory), or the CPU template."""
    if kind == "cpu":
        return STATIC_CPU_SPEC.with_overrides(memory_bytes=host_memory_bytes())
    index = torch.cuda.current_device()
    name = torch.cuda.get_device_name(index)
    total = int(torch.cuda.get_device_properties(index).total_memory)
    try:
        return device_from_cuda_name(name, total)
    except ValueError:
        logger.warning("no preset for %s: its links keep PCIe/Ethernet defaults until measured", name)
        return get_device("l4").with_overrides(name=name.lower().replace(" ", "-"), memory_bytes=total)


def _dtypes(kind: str) -> dict[str, torch.dtype]:
    if kind == "cuda":
        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}


def measure_device(kind: str, budget_s: float = 1.0) -> dict[str, Any]:
    """GEMM FLOP/s per dtype (and by size), elementwise bandwidth and math, attention FLOP/s of this device, as
    :class:`DeviceSpec` fields (:func:`~hf_colossal_auto.hardware.microbench.measure_kernels`)."""
    nbytes = 256 * 2**20 if kind == "cuda" else min(64 * 2**20, max(8 * 2**20, host_memory_bytes() // 64))
    rates = measure_kernels(
        _device(kind), _dtypes(kind), budget_s=budget_s, nbytes=nbytes, elementwise_math=kind == "cpu"
    )
    return dataclasses.asdict(rates)


def _step_seconds(model: torch.nn.Module, batch: dict[str, Any], device: torch.device, steps: int) -> float:
    """Median seconds of a training step (forward, backward, AdamW) after warm-up."""
    from .hardware.microbench import _sync

    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step() -> None:
        model(**batch).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(3):
        step()
    times = []
    for _ in range(steps):
        _sync(device)
        t0 = time.perf_counter()
        step()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _one_device_group() -> tuple[Any, bool]:
    """A process group of this process alone for the runtime to build its mesh on: a temporary one when no
    job is running; otherwise the running job's world when it is this process alone."""
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        return None, True
    if dist.get_world_size() == 1:
        return None, False
    raise RuntimeError(
        "measure_overheads runs before the job's process group starts (or in a one-process job)"
    )


def measure_overheads(kind: str, spec: DeviceSpec | None = None, steps: int = 15) -> tuple[float, float]:
    """``(host_overhead_s, dtensor_overhead_s)``: seconds per op of a tiny model's training step, eager, and
    what our DTensor runtime (a one-device plan forced onto DTensors, the plan's hooks) adds per op."""
    from .apply import apply_plan
    from .capture.tracer import trace_training_step
    from .models import build_model, load_config, make_example_inputs
    from .solve.planner import evaluate_plan

    device = _device(kind)
    eager_per_op, extra_per_op = [], []
    _, temporary = _one_device_group()
    try:
        for name in OVERHEAD_MODELS:
            torch.manual_seed(0)
            config = load_config(name)
            if getattr(config, "num_key_value_heads", None):
                # one KV head per head: grouped-query SDPA has no FLOP formula in some torch releases (2.11)
                config.num_key_value_heads = config.num_attention_heads
            model = build_model(config, device=device)
            model.train()
            batch = make_example_inputs(model, 1, 8, device=device, seed=0)
            ops = sum(trace_training_step(model, batch).repeat_of_node())
            eager = _step_seconds(model, batch, device, steps)
            plan = evaluate_plan(model, batch, "ddp", num_devices=1, device=spec or _base_spec(kind)).plan
            # on DTensors although one device shards nothing: the cost a plan that shards pays per op
            planned = apply_plan(copy.deepcopy(model), plan, dtensors=True)
            runtime = _step_seconds(planned, batch, device, steps)
            eager_per_op.append(eager / ops)
            extra_per_op.append(max(0.0, runtime - eager) / ops)
            del model, planned
    finally:
        if temporary:
            dist.destroy_process_group()
    return statistics.mean(eager_per_op), statistics.mean(extra_per_op)


def _node_links(base: DeviceSpec, device: torch.device) -> dict[str, Any]:
    """Per-kind collective fits of the running job (intra-node: all its ranks on one node), else nothing."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return {}
    local = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
    if local != dist.get_world_size():
        logger.warning(
            "calibration: a job over %d nodes measures its whole world as one link (the slowest hop, "
            "inter-node); run it on one node for the intra-node link",
            dist.get_world_size() // max(local, 1),
        )
    fits = collective_fits(None, device)
    fits.update(dtensor_collective_fits(device))
    efficiency = overlap_efficiency(None, device)
    skew, exponent = measure_rank_skew(device)
    skew_fields = {
        "rank_skew_s": skew,
        "rank_skew_exponent": exponent,
        "rank_skew_ranks": dist.get_world_size(),
    }
    if not fits:
        return {"overlap_efficiency": efficiency, **skew_fields}
    base_fit = fits.get("all_reduce") or fits["dtensor:all_reduce"]
    link = LinkSpec(
        bandwidth=base_fit.bandwidth,
        latency=base_fit.latency,
        collectives={k: (f.bandwidth, f.latency) for k, f in fits.items()},
    )
    key = "intra_node_link" if local == dist.get_world_size() else "inter_node_link"
    out: dict[str, Any] = {key: link, "overlap_efficiency": efficiency, **skew_fields}
    if key == "intra_node_link" and base.kind == "cpu":
        out["devices_per_node"] = dist.get_world_size()
        out["inter_node_link"] = link
    return out


def calibrate(
    device: str | None = None, *, budget_s: float = 1.0, overheads: bool = True, collectives: bool = True
) -> DeviceSpec:
    """Measure this machine (and, in a multi-process job, its collectives) into a :class:`DeviceSpec`.

    ``device``: ``"cuda"`` or ``"cpu"`` (default: the GPU if there is one). In a running ``torch.distributed``
    job every rank must call this (collectives are timed together); rank 0's device figures are broadcast so
    every rank returns the same spec. The per-op overheads need a process group of one process: they are
    measured before the job's group exists (``hf-colossal-auto calibrate`` does that under torchrun) or in a
    one-process job, and skipped (defaults kept, with a warning) otherwise.
    """
    kind = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if kind not in ("cpu", "cuda"):
        raise ValueError(f"calibrate measures 'cpu' or 'cuda', got {device!r}")
    if kind == "cuda" and not torch.cuda.is_available():
        raise ValueError("calibrate(device='cuda') needs a visible GPU; this process sees none")
    start = time.perf_counter()
    base = _base_spec(kind)
    fields: dict[str, Any] = measure_device(kind, budget_s)
    if overheads:
        if dist.is_initialized() and dist.get_world_size() > 1:
            logger.warning(
                "calibration: per-op overheads are measured before the job's process group starts; keeping "
                "the defaults (%.1f us eager, %.1f us DTensor)",
                base.host_overhead_s * 1e6,
                base.dtensor_overhead_s * 1e6,
            )
        else:
            fields["host_overhead_s"], fields["dtensor_overhead_s"] = measure_overheads(kind, base)
    if dist.is_initialized() and dist.get_world_size() > 1:
        payload = [fields]
        dist.broadcast_object_list(payload, src=0)  # every rank plans with rank 0's figures
        fields = payload[0]
    if collectives:
        fields.update(_node_links(base, _device(kind)))
    fields["calibration"] = {
        "host": platform.node(),
        "device": torch.cuda.get_device_name() if kind == "cuda" else cpu_model_name(),
        "threads": torch.get_num_threads(),
        "world_size": dist.get_world_size() if dist.is_initialized() else 1,
        "backend": str(dist.get_backend()) if dist.is_initialized() else None,
        "torch": torch.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(sys.argv),
        "seconds": round(time.perf_counter() - start, 2),
    }
    spec = base.with_overrides(**fields)
    logger.info(
        "calibrated %s in %.1f s: matmul %s, %.3g B/s, host %.1f us/op, DTensor +%.1f us/op",
        spec.name,
        time.perf_counter() - start,
        {k: f"{v:.3g}" for k, v in spec.peak_flops.items()},
        spec.memory_bandwidth,
        spec.host_overhead_s * 1e6,
        spec.dtensor_overhead_s * 1e6,
    )
    return spec
