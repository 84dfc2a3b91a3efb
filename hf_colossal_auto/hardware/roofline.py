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

from functools import lru_cache

from hf_colossal_auto.hardware.catalog import DeviceSpec, canonical_dtype

__all__ = [
    "peak_flops_for",
    "compute_time",
    "memory_time",
    "op_time",
    "is_compute_bound",
    "ridge_intensity",
]


@lru_cache(maxsize=256)
def _canonical(dtype: object) -> str:
    return canonical_dtype(dtype)


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
    if flops == 0 and bytes_moved == 0:
        return 0.0
    compute = flops / peak_flops_for(dtype, spec)
    memory = bytes_moved / spec.memory_bandwidth
    return (compute if compute > memory else memory) + spec.kernel_overhead_s


def ridge_intensity(dtype: object, spec: DeviceSpec) -> float:
    """Arithmetic intensity (FLOP per byte) above which a kernel is compute-bound."""
    return peak_flops_for(dtype, spec) / spec.memory_bandwidth


def is_compute_bound(flops: float, bytes_moved: float, dtype: object, spec: DeviceSpec) -> bool:
    """True when the compute term of the roofline dominates the memory term."""
    return flops / peak_flops_for(dtype, spec) > bytes_moved / spec.memory_bandwidth
