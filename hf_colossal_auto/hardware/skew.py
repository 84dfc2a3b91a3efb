"""Rank skew: what a collective that synchronises ranks costs beyond moving its bytes.

Ranks that run the same work do not finish it together: on a shared host the other processes, caches and
clock changes slow one rank now and another later. A collective that every rank must enter before any can
leave (a tensor-parallel all-reduce the next op needs, the data-parallel gradient sync at the end of a step)
makes each rank wait for the slowest. Measured on the 2-core CPU machine, 2 gloo ranks: a rank waits about
1 ms after 10 ms of identical work, 6 ms after 100 ms, 35 ms after a second — so a Megatron BERT step with
~100 synchronising collectives waited ~230 ms per rank (7 % of the step) where a DDP step of the same model,
synchronised once, waits ~40 ms.

Model: after ``L`` seconds of work since the previous synchronisation, a rank waits on average
``rank_skew_s * L ** rank_skew_exponent`` (:class:`~.catalog.DeviceSpec` fields, fitted by calibration on the
job's ranks). For a group of another size the wait scales as the expected maximum of that many normal
deviates (a slower slowest among more ranks): :func:`expected_slowest`. GPUs run kernels alike on every rank;
their presets carry no skew, and ``hf-colossal-auto calibrate`` measures what a real job has.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Sequence
from functools import cache
from typing import Any

from .spec import DeviceSpec

__all__ = ["SKEW_SEGMENTS_S", "expected_slowest", "sync_wait", "fit_rank_skew", "measure_rank_skew"]

SKEW_SEGMENTS_S = (0.003, 0.01, 0.03, 0.1, 0.3)
"""Lengths of work between synchronisations that calibration times (a tensor-parallel block's segments are a
few to tens of milliseconds; a data-parallel step's one segment, the whole step)."""


@cache
def expected_slowest(ranks: int) -> float:
    """E[max of ``ranks`` standard normal deviates]: how far the slowest of ``ranks`` lies above the mean, in
    standard deviations (0 for one rank, 0.564 for 2, 1.029 for 4, 1.424 for 8). Trapezoid rule on
    ``x * d/dx Phi(x)^n`` over [-9, 9]: exact to 1e-6, no SciPy needed."""
    if ranks < 2:
        return 0.0
    steps = 3600
    lo, hi = -9.0, 9.0
    h = (hi - lo) / steps
    total = 0.0
    for i in range(steps + 1):
        x = lo + i * h
        pdf = math.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)
        cdf = 0.5 * (1 + math.erf(x / math.sqrt(2)))
        value = x * ranks * pdf * cdf ** (ranks - 1)
        total += value * (0.5 if i in (0, steps) else 1.0)
    return total * h


def sync_wait(spec: DeviceSpec, segment_s: float, ranks: int) -> float:
    """Mean seconds a rank waits at a collective synchronising ``ranks`` ranks after ``segment_s`` seconds of
    work since their previous synchronisation (0 for one rank, or on a device without measured skew)."""
    if ranks < 2 or segment_s <= 0 or spec.rank_skew_s <= 0:
        return 0.0
    spread = expected_slowest(ranks) / expected_slowest(spec.rank_skew_ranks)
    return spec.rank_skew_s * segment_s**spec.rank_skew_exponent * spread


def fit_rank_skew(segments_s: Sequence[float], waits_s: Sequence[float]) -> tuple[float, float]:
    """``(rank_skew_s, rank_skew_exponent)`` of ``wait = s * L ** e`` fitted by least squares in log space to
    measured waits (those above 0); the exponent clamped to [0.5, 1] (independent per-op noise grows as the
    square root of the work, one slow spell over all of it linearly). ``(0, 1)`` when no wait was seen."""
    points = [(math.log(L), math.log(w)) for L, w in zip(segments_s, waits_s, strict=True) if L > 0 and w > 0]
    if not points:
        return 0.0, 1.0
    if len(points) == 1:
        x, y = points[0]
        return math.exp(y - 0.75 * x), 0.75
    mx = statistics.fmean(x for x, _ in points)
    my = statistics.fmean(y for _, y in points)
    sxx = sum((x - mx) ** 2 for x, _ in points)
    slope = sum((x - mx) * (y - my) for x, y in points) / sxx if sxx > 0 else 0.75
    exponent = min(1.0, max(0.5, slope))
    # the intercept that fits best with the exponent clamped
    log_s = statistics.fmean(y - exponent * x for x, y in points)
    return math.exp(log_s), exponent


def measure_rank_skew(
    device: Any, segments_s: Sequence[float] = SKEW_SEGMENTS_S, *, budget_s: float = 0.8
) -> tuple[float, float]:
    """Time, on every rank of the running job, ``segments_s`` of the same GEMM-and-elementwise work between
    barriers and then a one-element all-reduce; the wait inside the all-reduce beyond its cost with nothing
    before it is the skew. About ``budget_s`` of work per segment length. Returns the fit of
    :func:`fit_rank_skew` (every rank the same figures, averaged over ranks)."""
    import torch
    import torch.distributed as dist

    generator = torch.Generator(device="cpu").manual_seed(0)
    a = torch.randn(256, 256, generator=generator).to(device)
    b = torch.randn(256, 512, generator=generator).to(device)
    x = torch.randn(256, 1024, generator=generator).to(device)
    flag = torch.zeros(1, device=device)
    is_cuda = getattr(device, "type", str(device)) == "cuda"

    def sync() -> None:
        if is_cuda:
            torch.cuda.synchronize()

    def unit() -> None:
        torch.nn.functional.gelu(a @ b)
        (x * 1.5).sum()

    for _ in range(3):
        unit()
    sync()
    t0 = time.perf_counter()
    for _ in range(10):
        unit()
    sync()
    per_unit = max((time.perf_counter() - t0) / 10, 1e-6)

    def bare_all_reduce() -> float:
        dist.barrier()
        t = time.perf_counter()
        dist.all_reduce(flag)
        sync()
        return time.perf_counter() - t

    base = statistics.median(bare_all_reduce() for _ in range(10))
    lengths, waits = [], []
    for target in segments_s:
        units = max(1, round(target / per_unit))
        reps = max(4, min(100, round(budget_s / target)))
        work, wait = [], []
        for _ in range(reps):
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(units):
                unit()
            sync()
            t1 = time.perf_counter()
            dist.all_reduce(flag)
            sync()
            work.append(t1 - t0)
            wait.append(time.perf_counter() - t1)
        lengths.append(statistics.fmean(work))
        waits.append(max(0.0, statistics.fmean(wait) - base))
    agreed = torch.tensor([*lengths, *waits], dtype=torch.float64)
    dist.all_reduce(agreed)
    agreed /= dist.get_world_size()
    n = len(segments_s)
    values = agreed.tolist()
    return fit_rank_skew(values[:n], values[n:])
