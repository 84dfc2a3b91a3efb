"""Micro-benchmark calibration of the ``cpu`` device, cached on disk: what ``get_device("cpu")`` returns.

There is no datasheet for "whatever CPU this is", and CPU matmul throughput
varies by two orders of magnitude between hosts and dtypes (fp16 matmul on a CPU
without native fp16 support can be 100x slower than fp32).  So the ``cpu``
preset is measured: a few matmuls per dtype for FLOP/s and one large copy for
memory bandwidth, about one second in total, using the thread count torch will
actually use.

The result is cached as JSON in ``$HF_COLOSSAL_AUTO_CACHE/cpu_calibration.json``
(default ``~/.cache/hf_colossal_auto/cpu_calibration.json``), keyed by CPU
model, ``torch.get_num_threads()``, torch version and benchmark version
(:func:`~hf_colossal_auto.hardware.host_cache.cache_key`), so it runs once per host
configuration.  Set ``HF_COLOSSAL_AUTO_NO_CALIBRATE=1`` to skip measurement and use
:data:`~hf_colossal_auto.hardware.catalog.STATIC_CPU_SPEC` (deterministic; what the test-suite uses).

Collective bandwidth/latency are *not* measured here (that needs a process
group, see :mod:`hf_colossal_auto.hardware.comm`); the cpu links keep their
documented gloo-over-loopback defaults.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from ..hardware.catalog import STATIC_CPU_SPEC
from ..hardware.host_cache import (
    cache_dir,
    cache_key,
    calibration_disabled,
    host_memory_bytes,
    read_entries,
    store_entry,
)
from ..hardware.spec import DeviceSpec
from ..units import MiB

__all__ = [
    "CPU_CACHE_FILENAME",
    "CPU_BENCHMARK_VERSION",
    "CpuBenchmarkResult",
    "cpu_cache_path",
    "cpu_cache_key",
    "run_cpu_benchmark",
    "cpu_device_spec",
    "clear_cpu_calibration_memo",
]

logger = logging.getLogger(__name__)

CPU_CACHE_FILENAME = "cpu_calibration.json"
# Bump when the benchmark changes in a way that changes its numbers, so stale
# cache entries are ignored instead of mixed with new ones.
CPU_BENCHMARK_VERSION = 3
_CACHE_FORMAT = 1


def cpu_cache_path() -> Path:
    """Path of the cpu calibration JSON file."""
    return cache_dir() / CPU_CACHE_FILENAME


def cpu_cache_key() -> str:
    """Cache key: CPU model, torch thread count, torch version and benchmark version."""
    return cache_key("cpu", bench=CPU_BENCHMARK_VERSION)


@dataclass(frozen=True)
class CpuBenchmarkResult:
    """Measured peaks of this host.

    Attributes:
        peak_flops: best observed matmul FLOP/s per canonical dtype name;
            always has ``"float32"``; a dtype whose matmul failed is omitted
            (the roofline then falls back to float32).
        memory_bandwidth: best observed copy bandwidth, bytes/s (read + write).
        seconds: wall time the benchmark took.
    """

    peak_flops: dict[str, float]
    memory_bandwidth: float
    seconds: float = field(default=0.0)
    attention_flops: dict[str, float] = field(default_factory=dict)
    transcendental_rate: float | None = None
    matmul_flops: dict[str, tuple[tuple[float, float], ...]] = field(default_factory=dict)
    """``(FLOPs of one GEMM, FLOP/s)`` by GEMM size per dtype, as ``DeviceSpec.matmul_flops``."""


def run_cpu_benchmark(time_budget_s: float = 1.2) -> CpuBenchmarkResult:
    """This host's kernel rates for the ``cpu`` preset, in about ``time_budget_s`` seconds: the benchmarks of
    ``hf-colossal-auto calibrate`` (:func:`~.microbench.measure_kernels`: projection GEMMs per dtype, an
    emulated reduced-precision dtype caught by a small probe, elementwise bandwidth and math, attention), each
    with a share of the budget. Uses ``torch.get_num_threads()`` threads.

    Without the GEMM-size curve: four more GEMM sizes with cold operands take seconds, not a share of one, and
    at a few repetitions each they are noise on a shared host. ``device="cpu"`` then prices every GEMM at the
    projection rate; a file from ``hf-colossal-auto calibrate`` carries the curve."""
    import torch

    from .kernels import measure_kernels

    t0 = time.perf_counter()
    nbytes = int(min(64 * MiB, max(8 * MiB, host_memory_bytes() // 64)))
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    # a quarter each: float32's GEMMs, a native reduced dtype's, bandwidth + math, attention
    rates = measure_kernels(
        torch.device("cpu"),
        dtypes,
        budget_s=time_budget_s / 4,
        nbytes=nbytes,
        elementwise_math=True,
        curves=False,
    )
    return CpuBenchmarkResult(
        peak_flops=rates.peak_flops,
        memory_bandwidth=rates.memory_bandwidth,
        seconds=time.perf_counter() - t0,
        attention_flops=rates.attention_flops,
        transcendental_rate=rates.transcendental_rate,
        matmul_flops=rates.matmul_flops,
    )


def _entry_to_result(entry: Any) -> CpuBenchmarkResult | None:
    """Validate one cache entry; anything malformed is a cache miss, never a crash."""
    try:
        flops = {str(k): float(v) for k, v in entry["peak_flops"].items()}
        bandwidth = float(entry["memory_bandwidth"])
    except (KeyError, TypeError, ValueError, AttributeError):
        return None
    values = [*flops.values(), bandwidth]
    if "float32" not in flops or not all(math.isfinite(v) and v > 0 for v in values):
        return None
    try:
        attention = {str(k): float(v) for k, v in entry.get("attention_flops", {}).items()}
        math_rate = entry.get("transcendental_rate")
        math_rate = float(math_rate) if math_rate is not None else None
    except (TypeError, ValueError, AttributeError):
        return None
    if math_rate is not None and not (math.isfinite(math_rate) and math_rate > 0):
        return None
    try:
        curves = {
            str(k): tuple((float(f), float(r)) for f, r in points)
            for k, points in entry.get("matmul_flops", {}).items()
        }
    except (TypeError, ValueError, AttributeError):
        return None
    if not all(math.isfinite(x) and x > 0 for points in curves.values() for point in points for x in point):
        return None
    return CpuBenchmarkResult(
        matmul_flops=curves,
        peak_flops=flops,
        memory_bandwidth=bandwidth,
        seconds=float(entry.get("seconds", 0.0)),
        attention_flops=attention,
        transcendental_rate=math_rate,
    )


def _load_average() -> float | None:
    with contextlib.suppress(OSError, AttributeError):
        return os.getloadavg()[0]
    return None


def _store_cache(path: Path, key: str, result: CpuBenchmarkResult) -> None:
    """Merge one entry into the cache file (:func:`~hf_colossal_auto.hardware.host_cache.store_entry`: atomic;
    a failure to write only costs a re-run next time)."""
    entry = {
        "peak_flops": result.peak_flops,
        "attention_flops": result.attention_flops,
        "transcendental_rate": result.transcendental_rate,
        "matmul_flops": {k: [list(p) for p in v] for k, v in result.matmul_flops.items()},
        "memory_bandwidth": result.memory_bandwidth,
        "seconds": result.seconds,
        # Recorded for diagnosis: a calibration taken on a busy host is slow.
        "load_average_1min": _load_average(),
        "measured_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    store_entry(path, key, entry, _CACHE_FORMAT)


# In-process memo so repeated get_device("cpu") calls do not re-read the file.
# Keyed by (cache path, cache key) so a changed env var or thread count is honoured.
_MEMO: dict[tuple[str, str], DeviceSpec] = {}


def clear_cpu_calibration_memo() -> None:
    """Forget in-process results (the on-disk cache is kept); for tests and after changing threads."""
    _MEMO.clear()


def cpu_device_spec(force: bool = False) -> DeviceSpec:
    """The ``cpu`` :class:`DeviceSpec` for this host.

    With ``HF_COLOSSAL_AUTO_NO_CALIBRATE`` set, returns
    :data:`STATIC_CPU_SPEC` unchanged.  Otherwise returns the cached
    calibration for this host/thread-count/torch version, running
    :func:`run_cpu_benchmark` once (about a second) and caching it if missing
    or if ``force`` is true.  ``memory_bytes`` is always the live host memory
    (it is cheap to read and may change with container limits).
    """
    if calibration_disabled():
        return STATIC_CPU_SPEC
    path = cpu_cache_path()
    key = cpu_cache_key()
    memo_key = (str(path), key)
    if not force and memo_key in _MEMO:
        return _MEMO[memo_key]
    result = None if force else _entry_to_result(read_entries(path, _CACHE_FORMAT).get(key))
    if result is None:
        result = run_cpu_benchmark()
        logger.info(
            "Calibrated cpu in %.2f s: %s FLOP/s, %.3g B/s memory bandwidth (cached in %s)",
            result.seconds,
            {k: f"{v:.3g}" for k, v in result.peak_flops.items()},
            result.memory_bandwidth,
            path,
        )
        _store_cache(path, key, result)
    spec = STATIC_CPU_SPEC.with_overrides(
        peak_flops=result.peak_flops,
        matmul_flops=result.matmul_flops,
        attention_flops=result.attention_flops,
        **({"transcendental_rate": result.transcendental_rate} if result.transcendental_rate else {}),
        memory_bandwidth=result.memory_bandwidth,
        memory_bytes=host_memory_bytes(),
    )
    _MEMO[memo_key] = spec
    return spec
