"""``calibrate()``: measure the machine at hand into a :class:`~hf_colossal_auto.hardware.DeviceSpec`.

The presets hold datasheet peaks, which a real step never reaches; the planner minimises predicted step time,
so what it is told a kernel, an op and a collective cost must be what they cost here. ``calibrate`` measures,
in a few seconds each:

1. the device (:mod:`.kernels`): projection-shaped GEMM FLOP/s per dtype (``peak_flops``) and
   by GEMM size (``matmul_flops``: the curve the roofline prices each matmul on, so that a tensor-parallel
   shard's smaller GEMM runs slower), elementwise bandwidth, elementwise math (exp, tanh, softmax: on a CPU
   bound by arithmetic, not bandwidth), fused attention FLOP/s;
2. the per-op host overheads (:mod:`.overheads`): one training step of tiny models (whose kernels cost next
   to nothing) divided by its op count, eager (``host_overhead_s``) and again with our runtime applied for
   one device, which runs every op on DTensors with the plan's hooks (``dtensor_overhead_s``: the difference per op);
3. every collective on the running process group, per kind (``intra_node_link.collectives``), and how much
   of a collective hides behind concurrent GEMMs (``overlap_efficiency``), and how long a rank waits for its
   peers at a synchronising collective after a stretch of the same work (``rank_skew_s``,
   :mod:`hf_colossal_auto.hardware.skew`), when the job has more than one process; all ranks must call it
   then, and all get the same spec.

The result is written as JSON (``hf-colossal-auto calibrate --out cluster.json``) that every ``device=``
argument and ``--device`` flag accepts. It carries its provenance (host, date, torch, command).
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import platform
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

from ..hardware.host_cache import device_name, host_memory_bytes
from ..hardware.microbench import collective_fits, dtensor_collective_fits, overlap_efficiency
from ..hardware.skew import measure_rank_skew
from ..hardware.spec import DeviceSpec, LinkSpec
from .base import base_spec, target_device
from .kernels import RankSync, measure_kernels
from .overheads import measure_overheads

__all__ = ["calibrate", "measure_device"]

logger = logging.getLogger(__name__)


def _dtypes(kind: str) -> dict[str, torch.dtype]:
    if kind == "cuda":
        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _rank_sync() -> RankSync:
    """The job's barrier, and rank 0's verdict broadcast (a one-element tensor on the group's device)."""
    device = target_device("cuda" if dist.get_backend() == "nccl" else "cpu")

    def agree(flag: bool) -> bool:
        verdict = torch.tensor([1 if flag else 0], device=device)
        dist.broadcast(verdict, src=0)
        return bool(verdict.item())

    return RankSync(start=dist.barrier, agree=agree)


def measure_device(kind: str, budget_s: float = 1.0) -> dict[str, Any]:
    """GEMM FLOP/s per dtype (and by size), elementwise bandwidth and math, attention FLOP/s of this device, as
    :class:`DeviceSpec` fields (:func:`~.kernels.measure_kernels`). In a multi-process job every rank measures,
    each benchmark started together (a barrier), so that rank 0's figures are those of a machine whose every
    rank computes, as in a training step."""
    nbytes = 256 * 2**20 if kind == "cuda" else min(64 * 2**20, max(8 * 2**20, host_memory_bytes() // 64))
    together = _rank_sync() if dist.is_initialized() and dist.get_world_size() > 1 else None
    rates = measure_kernels(
        target_device(kind),
        _dtypes(kind),
        budget_s=budget_s,
        nbytes=nbytes,
        elementwise_math=kind == "cpu",
        ranks=together,
    )
    return dataclasses.asdict(rates)


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
    base = base_spec(kind)
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
        fields.update(_node_links(base, target_device(kind)))
    fields["calibration"] = {
        "host": platform.node(),
        "device": device_name(kind),
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
