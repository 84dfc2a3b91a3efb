"""The kernel benchmarks of a calibration, run together: GEMMs per dtype and by size, elementwise bandwidth
and math, fused attention (:func:`measure_kernels`), for ``hf-colossal-auto calibrate`` (:mod:`.device`) and the
``cpu`` preset's automatic calibration (:mod:`.cpu`).

Attention is timed here, not in :mod:`hf_colossal_auto.hardware.microbench`, because its FLOPs are counted
as the profiler counts them (:mod:`hf_colossal_auto.capture.flops`), which hardware/ may not import.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..capture.flops import EXTRA_FLOP_FORMULAS
from ..hardware.microbench import (
    _sync,
    elementwise_bandwidth,
    matmul_curve,
    matmul_rate,
    time_call,
    transcendental_rate,
)

__all__ = ["EMULATED_DTYPE_SHARE", "KernelRates", "RankSync", "attention_rate", "measure_kernels"]

logger = logging.getLogger(__name__)


def attention_rate(device: Any, dtype: Any, *, budget_s: float = 1.0) -> float:
    """FLOP/s of causal scaled-dot-product attention, forward and backward, as the profiler counts its FLOPs
    (the full ``S x S`` product, so a causal kernel's skipped half shows as a lower rate)."""
    import torch
    import torch.nn.functional as F
    from torch.utils.flop_counter import FlopCounterMode

    kind = getattr(device, "type", str(device))
    batch, heads, seq, head_dim = (2, 8, 256, 64) if kind == "cpu" else (8, 32, 2048, 128)
    generator = torch.Generator(device="cpu").manual_seed(0)

    def tensor() -> Any:
        x = torch.randn(batch, heads, seq, head_dim, generator=generator)
        return x.to(device=device, dtype=dtype).requires_grad_()

    q, k, v = tensor(), tensor(), tensor()
    grad = torch.ones(batch, heads, seq, head_dim, device=device, dtype=dtype)

    def step() -> None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out.backward(grad)
        q.grad = k.grad = v.grad = None

    counter = FlopCounterMode(display=False, custom_mapping=EXTRA_FLOP_FORMULAS)
    with counter:
        step()
    flops = counter.get_total_flops()
    seconds = time_call(step, device, budget_s=budget_s)
    return flops / seconds


@dataclass(frozen=True)
class RankSync:
    """How the ranks of a multi-process job run the kernel benchmarks together: ``start`` (a barrier) before
    each benchmark, so that every rank times the same kernel at the same moment, and ``agree`` (rank 0's value
    on every rank) for each decision taken from a timing, so that every rank takes the same path and reaches the
    same barriers (a decision each rank took from its own timing once left one rank waiting at a barrier the
    other had skipped)."""

    start: Callable[[], object]
    agree: Callable[[bool], bool]


# A reduced-precision dtype slower than this share of float32 is emulated (bf16 on a CPU without it): it keeps
# its probe's rate and gets no curve, so that it cannot blow the calibration's time.
EMULATED_DTYPE_SHARE = 0.2


@dataclass(frozen=True)
class KernelRates:
    """What the device's kernels achieve, as :class:`~.catalog.DeviceSpec` fields: GEMM FLOP/s per dtype and by
    GEMM size (``matmul_flops``), elementwise bytes/s, elementwise math (CPU), fused attention FLOP/s."""

    peak_flops: dict[str, float]
    matmul_flops: dict[str, tuple[tuple[float, float], ...]] = field(default_factory=dict)
    memory_bandwidth: float = 0.0
    transcendental_rate: float | None = None
    attention_flops: dict[str, float] = field(default_factory=dict)


def _square_probe(device: Any, dtype: Any, generator: Any) -> float:
    """FLOP/s of one 256 x 256 matmul after a warm-up: cheap even for an emulated dtype, which it exposes."""
    import torch

    a = torch.randn(256, 256, generator=generator).to(device=device, dtype=dtype)
    b = torch.randn(256, 256, generator=generator).to(device=device, dtype=dtype)
    torch.mm(a, b)
    _sync(device)
    start = time.perf_counter()
    torch.mm(a, b)
    _sync(device)
    return 2.0 * 256**3 / max(time.perf_counter() - start, 1e-9)


def measure_kernels(
    device: Any,
    dtypes: Mapping[str, Any],
    *,
    budget_s: float = 1.0,
    nbytes: int,
    elementwise_math: bool,
    curves: bool = True,
    ranks: RankSync | None = None,
) -> KernelRates:
    """Every kernel benchmark of a calibration, in one place for the ``calibrate`` command and for the cpu
    preset's automatic calibration (which passes a smaller ``budget_s``).

    ``dtypes``: name -> dtype, float32 first. float32 gets the projection-GEMM rate and the GEMM-size curve;
    another dtype is probed with one small matmul first and, unless emulated (below
    :data:`EMULATED_DTYPE_SHARE` of float32), measured like float32; a dtype without a kernel is skipped with a
    warning. ``budget_s`` is per benchmark; ``nbytes`` sizes the elementwise buffers (beyond the caches);
    ``elementwise_math`` adds the transcendental rate (CPUs; a GPU's is memory-bound); ``curves=False`` skips
    the GEMM-size curves (four sizes more, each with its own cold operands). Runs under ``no_grad``
    with a private RNG: the caller's seeded global RNG is untouched. ``ranks`` (a multi-process job where every
    rank calls this): each benchmark starts on every rank together, so that the ranks time the same kernel at
    the same moment, sharing the machine's caches and memory as in a training step, instead of one rank's GEMMs
    timed while another rank idles or does something else; whether a dtype is emulated is rank 0's verdict."""
    import torch

    sync = ranks.start if ranks is not None else None
    start = sync or (lambda: None)
    agree = ranks.agree if ranks is not None else (lambda flag: flag)
    generator = torch.Generator(device="cpu").manual_seed(0)
    flops: dict[str, float] = {}
    curve: dict[str, tuple[tuple[float, float], ...]] = {}
    attention: dict[str, float] = {}
    fused: list[str] = []  # dtypes measured as kernels of their own (not emulated, not missing), agreed
    with torch.no_grad():
        for name, dtype in dtypes.items():
            try:
                if name != "float32":
                    start()
                    probe = _square_probe(device, dtype, generator)
                    if agree(probe < EMULATED_DTYPE_SHARE * flops["float32"]):
                        flops[name] = probe
                        continue
                start()
                flops[name] = matmul_rate(device, dtype, budget_s=budget_s)
                if curves:
                    curve[name] = matmul_curve(device, dtype, budget_s=budget_s, sync=sync)
                fused.append(name)
            except RuntimeError as exc:  # a dtype without a matmul kernel in this build (alike on every rank)
                if name == "float32":
                    raise
                logger.warning(
                    "calibration: %s matmul failed on %s (%s); it falls back to float32", name, device, exc
                )
        start()
        bandwidth = elementwise_bandwidth(device, nbytes=nbytes, budget_s=budget_s / 2)
        start()
        math_rate = transcendental_rate(device, budget_s=budget_s / 2) if elementwise_math else None
    for name in fused:  # an emulated or missing dtype's fused kernel is no better
        try:
            start()
            attention[name] = attention_rate(device, dtypes[name], budget_s=budget_s)
        except RuntimeError as exc:
            logger.warning("calibration: %s attention failed on %s (%s)", name, device, exc)
    return KernelRates(
        peak_flops=flops,
        matmul_flops=curve,
        memory_bandwidth=bandwidth,
        transcendental_rate=math_rate,
        attention_flops=attention,
    )
