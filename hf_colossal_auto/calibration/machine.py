"""``hf-colossal-auto calibrate``: one calibration of this machine, its parts in the order they need.

The per-op overheads come first, on a one-process group of our own (:mod:`.overheads`: they cannot be measured
once the job's group exists); then, under a launcher (``WORLD_SIZE > 1``), the job's process group starts and
every rank joins the kernel and collective measurements (:func:`~.device.calibrate`); rank 0's overheads are
broadcast; last, the in-step op scales of real steps (:mod:`.op_scales`). The command line prints and writes
what :func:`calibrate_machine` yields.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..hardware.spec import DeviceSpec
from .device import calibrate
from .op_scales import StepScales, with_op_time_scales
from .overheads import measure_overheads

__all__ = ["MachineCalibration", "calibrate_machine"]

Stage = Callable[[str], AbstractContextManager[Any]]
"""Wraps each slow part of a calibration, named in words (the command line prints progress with it)."""


@dataclass(frozen=True)
class MachineCalibration:
    """What one calibration measured: the spec, the in-step figures behind its op scales (``None`` without
    step models), and whether this process is the one that reports (rank 0, or the only process)."""

    spec: DeviceSpec
    steps: StepScales | None
    main_process: bool


def _with_overheads(spec: DeviceSpec, overheads: tuple[float, float], launched: bool) -> DeviceSpec:
    """``spec`` with rank 0's per-op overheads (broadcast: every rank writes and plans with the same spec)."""
    payload = [overheads]
    if launched:
        dist.broadcast_object_list(payload, src=0)
    return spec.with_overrides(host_overhead_s=payload[0][0], dtensor_overhead_s=payload[0][1])


@contextlib.contextmanager
def calibrate_machine(
    kind: str | None = None,
    *,
    budget_s: float = 1.0,
    overheads: bool = True,
    step_models: Sequence[Any] = (),
    step_batch_size: int = 4,
    step_seq_len: int = 256,
    stage: Stage = lambda text: contextlib.nullcontext(),
) -> Iterator[MachineCalibration]:
    """Measure this machine (under torchrun/accelerate launch: its collectives too) into a device spec.

    A context manager because a launched job's process group must outlive what the caller does with the
    result (rank 0 writes the file while the others wait at the closing barrier, then the group ends).
    ``kind``: ``"cuda"`` or ``"cpu"`` (default: the GPU if there is one)."""
    launched = int(os.environ.get("WORLD_SIZE", "1")) > 1
    kind = kind or ("cuda" if torch.cuda.is_available() else "cpu")
    measured = None
    if overheads:
        # measured on a one-process group of our own, before the job's group exists
        with stage("per-op overheads (tiny models, eager and planned)"):
            measured = measure_overheads(kind)
    if launched:
        if kind == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if kind == "cuda" else "gloo")
    try:
        with stage(f"{kind} kernels" + (" and collectives" if launched else "")):
            spec = calibrate(kind, budget_s=budget_s, overheads=False)
        if measured is not None:
            spec = _with_overheads(spec, measured, launched)
        steps = None
        if step_models:
            with stage(f"in-step op times ({', '.join(map(str, step_models))})"):
                spec, steps = with_op_time_scales(
                    spec, step_models, batch_size=step_batch_size, seq_len=step_seq_len
                )
        yield MachineCalibration(spec, steps, main_process=not launched or dist.get_rank() == 0)
    finally:
        if launched:
            dist.barrier()
            dist.destroy_process_group()
