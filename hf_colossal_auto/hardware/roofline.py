"""Roofline time model for a single kernel.

A kernel takes ``max(flops / peak_flops[dtype], bytes / memory_bandwidth)``
plus a fixed launch/dispatch overhead: it is limited either by arithmetic or by
moving its operands through device memory, and the two overlap.  The peaks are
datasheet figures, so this is an optimistic lower bound per kernel; the ILP only
needs times that rank strategies correctly, and systematic optimism cancels
between strategies that run the same kernels.

This is called ~10^4 times per plan, so it is plain arithmetic on floats with a
cached dtype-name lookup and no allocation.
"""

from __future__ import annotations

import math
from functools import lru_cache

from hf_colossal_auto.hardware.spec import DeviceSpec, canonical_dtype

__all__ = [
    "peak_flops_for",
    "attention_flops_for",
    "kernel_time",
    "matmul_flops_for",
    "host_time",
    "join_host",
    "step_op_time",
    "compute_time",
    "memory_time",
    "op_time",
    "is_compute_bound",
    "ridge_intensity",
    "op_time_scale",
]


@lru_cache(maxsize=256)
def _canonical(dtype: object) -> str:
    return canonical_dtype(dtype)


@lru_cache(maxsize=4096)
def _op_base(op: str) -> str:
    """``"aten.bernoulli_.float"`` -> ``"bernoulli_"`` (``capture.op_classes.op_base_name``, cached: this module
    must not import the capture stage)."""
    parts = op.split(".")
    return parts[1] if len(parts) >= 2 and parts[0] == "aten" else parts[0]


def op_time_scale(op: str | None, spec: DeviceSpec) -> float:
    """Measured over predicted kernel time of ``op`` in real steps on this machine (``spec.op_time_scale``),
    1.0 for an op the in-step calibration did not see or a spec without one."""
    if not op or not spec.op_time_scale:
        return 1.0
    return spec.op_time_scale.get(_op_base(op), 1.0)


def peak_flops_for(dtype: object, spec: DeviceSpec) -> float:
    """Peak FLOP/s of ``spec`` for ``dtype``.

    Accepts canonical names (``"bfloat16"``), short forms (``"bf16"``) and
    ``torch.dtype`` objects.  A dtype the device lists no rate for (e.g.
    ``bfloat16`` on V100, ``float64`` anywhere, integer types) uses the
    ``float32`` rate rather than failing, since every op must get a time.
    """
    table = spec.peak_flops
    rate = table.get(dtype)  # type: ignore[call-overload]
    if rate is not None:
        return rate
    return table.get(_canonical(dtype)) or table["float32"]


def compute_time(flops: float, dtype: object, spec: DeviceSpec) -> float:
    """Seconds to execute ``flops`` at the dtype's peak rate (no overhead)."""
    return flops / peak_flops_for(dtype, spec)


def memory_time(bytes_moved: float, spec: DeviceSpec) -> float:
    """Seconds to move ``bytes_moved`` (reads + writes) at peak memory bandwidth (no overhead)."""
    return bytes_moved / spec.memory_bandwidth


def op_time(flops: float, bytes_moved: float, dtype: object, spec: DeviceSpec) -> float:
    """Roofline seconds of one kernel: ``max(compute, memory) + spec.kernel_overhead_s``.

    An op with no FLOPs and no bytes (a view/reshape, which launches no
    kernel) costs exactly ``0.0``.

    Raises:
        ValueError: for negative ``flops`` or ``bytes_moved`` (a profiler bug).
    """
    if flops < 0 or bytes_moved < 0:
        raise ValueError(f"op_time needs non-negative work, got flops={flops!r}, bytes_moved={bytes_moved!r}")
    return kernel_time(flops, bytes_moved, dtype, spec)


def attention_flops_for(dtype: object, spec: DeviceSpec) -> float:
    """Achieved FLOP/s of the fused attention kernels (calibrated), else the dtype's peak."""
    table = spec.attention_flops
    if table:
        rate = table.get(_canonical(dtype)) or table.get("float32")
        if rate is not None:
            return rate
    return peak_flops_for(dtype, spec)


def matmul_flops_for(flops: float, dtype: object, spec: DeviceSpec) -> float:
    """Achieved FLOP/s of one GEMM of ``flops`` FLOPs: the calibrated curve, interpolated in log-FLOPs and held
    flat beyond its ends, else the dtype's peak."""
    curve = spec.matmul_flops.get(_canonical(dtype)) if spec.matmul_flops else None
    if not curve:
        return peak_flops_for(dtype, spec)
    if flops <= curve[0][0]:
        return curve[0][1]
    if flops >= curve[-1][0]:
        return curve[-1][1]
    x = math.log(flops)
    for (f0, r0), (f1, r1) in zip(curve, curve[1:], strict=False):
        if flops <= f1:
            w = (x - math.log(f0)) / (math.log(f1) - math.log(f0))
            return r0 + w * (r1 - r0)
    return curve[-1][1]


def kernel_time(
    flops: float,
    bytes_moved: float,
    dtype: object,
    spec: DeviceSpec,
    *,
    attention: bool = False,
    matmul: bool = False,
    transcendental_elements: float = 0.0,
    op: str | None = None,
) -> float:
    """Device seconds of one kernel: the roofline on the (calibrated) rates plus ``kernel_overhead_s``; an
    attention kernel runs at :func:`attention_flops_for`, a GEMM at :func:`matmul_flops_for` of its size, an
    elementwise math op over ``transcendental_elements`` elements no faster than ``spec.transcendental_rate``;
    all of it times :func:`op_time_scale` of ``op`` (the aten overload) where the spec measured one.
    0 for an op with no work (a view)."""
    if flops == 0 and bytes_moved == 0:
        return 0.0
    if attention:
        rate = attention_flops_for(dtype, spec)
    elif matmul:
        rate = matmul_flops_for(flops, dtype, spec)
    else:
        rate = peak_flops_for(dtype, spec)
    compute = flops / rate
    if transcendental_elements and spec.transcendental_rate:
        compute = max(compute, transcendental_elements / spec.transcendental_rate)
    memory = bytes_moved / spec.memory_bandwidth
    roofline = compute if compute > memory else memory
    return (roofline + spec.kernel_overhead_s) * op_time_scale(op, spec)


def host_time(spec: DeviceSpec, *, dtensor: bool = False) -> float:
    """Host seconds one op of a training step costs: eager overhead, plus DTensor's under a plan."""
    return spec.host_overhead_s + (spec.dtensor_overhead_s if dtensor else 0.0)


def step_op_time(
    flops: float,
    bytes_moved: float,
    dtype: object,
    spec: DeviceSpec,
    *,
    view: bool = False,
    attention: bool = False,
    matmul: bool = False,
    transcendental_elements: float = 0.0,
    dtensor: bool = False,
    op: str | None = None,
) -> float:
    """Seconds one op adds to a training step, host and device together.

    A CPU runs the host code and the kernel one after the other: they add. A GPU's host enqueues kernels
    ahead of the device, so an op costs whichever is longer (a step of tiny ops is host-bound, a step of big
    ones device-bound); views launch nothing and hide behind the device there.
    """
    device = (
        0.0
        if view
        else kernel_time(
            flops,
            bytes_moved,
            dtype,
            spec,
            attention=attention,
            matmul=matmul,
            transcendental_elements=transcendental_elements,
            op=op,
        )
    )
    return join_host(device, host_time(spec, dtensor=dtensor), spec, view=view)


def join_host(device_s: float, host_s: float, spec: DeviceSpec, *, view: bool = False) -> float:
    """Seconds of work that costs the device ``device_s`` and the host ``host_s``: the sum on a CPU (one
    runs after the other), the longer of the two on a GPU (the host enqueues ahead of the device), where a
    view, which launches nothing, hides behind the device entirely."""
    if spec.kind == "cpu":
        return device_s + host_s
    if view:
        return device_s
    return device_s if device_s > host_s else host_s


def ridge_intensity(dtype: object, spec: DeviceSpec) -> float:
    """Arithmetic intensity (FLOP per byte) above which a kernel is compute-bound."""
    return peak_flops_for(dtype, spec) / spec.memory_bandwidth


def is_compute_bound(flops: float, bytes_moved: float, dtype: object, spec: DeviceSpec) -> bool:
    """True when the compute term of the roofline dominates the memory term."""
    return flops / peak_flops_for(dtype, spec) > bytes_moved / spec.memory_bandwidth
