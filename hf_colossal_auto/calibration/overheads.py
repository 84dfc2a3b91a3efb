"""Per-op host overheads: what the host costs per op of a training step, eager and under our runtime.

This is the only calibration module that runs the planner and the runtime: a tiny model's step is timed as
it is, and again with a one-device plan applied (every op on DTensors, the plan's hooks); the difference per
op is ``dtensor_overhead_s``.
"""

from __future__ import annotations

import copy
import logging
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from ..hardware.spec import DeviceSpec
from .base import base_spec, target_device

__all__ = ["OVERHEAD_MODELS", "measure_overheads"]

logger = logging.getLogger(__name__)

OVERHEAD_MODELS: tuple[str, ...] = ("tiny-llama", "tiny-gpt2")
"""Tiny models whose training step measures the per-op overheads (two families: their mean is used)."""


def _step_seconds(model: torch.nn.Module, batch: dict[str, Any], device: torch.device, steps: int) -> float:
    """Median seconds of a training step (forward, backward, AdamW) after warm-up."""
    from ..hardware.microbench import _sync

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
    from ..apply import apply_plan
    from ..capture.tracer import trace_training_step
    from ..models import build_model, load_config, make_example_inputs
    from ..solve.planner import evaluate_plan

    device = target_device(kind)
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
            plan = evaluate_plan(model, batch, "ddp", num_devices=1, device=spec or base_spec(kind)).plan
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
