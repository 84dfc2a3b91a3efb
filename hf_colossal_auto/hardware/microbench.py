"""Micro-benchmarks of the device at hand: what its kernels and its collectives achieve, in FLOP/s, bytes/s and
seconds, for :mod:`hf_colossal_auto.calibration` to write into a :class:`DeviceSpec`.

Each benchmark times real work of the shapes a transformer training step runs, not a vendor's best case:

* matmuls: the *median* FLOP/s over projection-shaped GEMMs (``tokens x hidden x 4 hidden`` and its
  transposes). A square matmul small enough to stay in cache runs ~1.5x faster on a CPU than the model's
  GEMMs do, and the roofline must price the latter;
* elementwise: bytes/s of ``a + b`` on tensors far larger than the caches (two reads, one write);
* attention: FLOP/s of the fused scaled-dot-product kernel, forward and backward, counted as the profiler
  counts it (:mod:`hf_colossal_auto.capture.flops`);
* collectives: every kind DTensor and FSDP issue, on a live process group, a few sizes each, fitted per kind
  to the alpha-beta model of :mod:`.comm` (gloo's all-gather is not a ring, NCCL's all-reduce is two).

Timings take the median of repetitions after a warm-up (sustained rates, not a lucky best), synchronise a GPU
before reading the clock, and stay within a budget of seconds per benchmark.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

from .catalog import LinkSpec
from .comm import fit_alpha_beta

__all__ = [
    "time_call",
    "matmul_rate",
    "elementwise_bandwidth",
    "attention_rate",
    "collective_fits",
    "MATMUL_SHAPES",
]

logger = logging.getLogger(__name__)

# (tokens, hidden, ffn) of the GEMMs a calibration times, per device kind: a 1-thread CPU must finish them in
# well under a second each, a GPU needs them big enough to fill its SMs.
MATMUL_SHAPES: dict[str, tuple[int, int, int]] = {"cpu": (1024, 512, 1408), "cuda": (8192, 4096, 11008)}


def _sync(device: Any) -> None:
    import torch

    if getattr(device, "type", str(device)) == "cuda":
        torch.cuda.synchronize(device)


def time_call(fn: Callable[[], object], device: Any, *, budget_s: float = 0.5, min_reps: int = 3) -> float:
    """Median seconds of ``fn`` after one warm-up call, repeated until ``budget_s`` is spent (at least
    ``min_reps`` times, at most 50). The GPU is synchronised around every call."""
    fn()
    _sync(device)
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < 50 and (len(times) < min_reps or time.perf_counter() - start < budget_s):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return max(statistics.median(times), 1e-9)


def _gemm_shapes(kind: str) -> list[tuple[int, int, int]]:
    """``(m, k, n)`` of a block's projections, forward and backward: up (t x h -> 4h), down (t x 4h -> h), the
    attention projection (t x h -> h) and the weight gradients (h x t -> 4h)."""
    t, h, f = MATMUL_SHAPES[kind]
    return [(t, h, f), (t, f, h), (t, h, h), (h, t, f)]


def matmul_rate(device: Any, dtype: Any, *, budget_s: float = 1.0) -> float:
    """Median achieved FLOP/s of projection-shaped GEMMs of ``dtype`` on ``device``."""
    import torch

    shapes = _gemm_shapes(getattr(device, "type", str(device)))
    generator = torch.Generator(device="cpu").manual_seed(0)
    rates = []
    start = time.perf_counter()
    for m, k, n in shapes:
        a = torch.randn(m, k, generator=generator).to(device=device, dtype=dtype)
        b = torch.randn(k, n, generator=generator).to(device=device, dtype=dtype)
        seconds = time_call(
            lambda a=a, b=b: torch.mm(a, b), device, budget_s=budget_s / len(shapes), min_reps=2
        )
        rates.append(2.0 * m * n * k / seconds)
        del a, b
        if time.perf_counter() - start > 2 * budget_s:
            break  # an emulated dtype (bf16 on a CPU without it): one shape says enough, and fast
    return statistics.median(rates)


def elementwise_bandwidth(device: Any, *, nbytes: int, budget_s: float = 0.5) -> float:
    """Bytes/s of ``out = a + b`` in float32 on buffers of ``nbytes`` each (read twice, written once)."""
    import torch

    n = max(1, nbytes // 4)
    a = torch.ones(n, device=device)
    b = torch.ones(n, device=device)
    out = torch.empty_like(a)
    seconds = time_call(lambda: torch.add(a, b, out=out), device, budget_s=budget_s)
    return 3.0 * n * 4 / seconds


def attention_rate(device: Any, dtype: Any, *, budget_s: float = 1.0) -> float:
    """FLOP/s of causal scaled-dot-product attention, forward and backward, as the profiler counts its FLOPs
    (the full ``S x S`` product, so a causal kernel's skipped half shows as a lower rate)."""
    import torch
    import torch.nn.functional as F
    from torch.utils.flop_counter import FlopCounterMode

    from ..capture.flops import EXTRA_FLOP_FORMULAS

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


# Collective kinds the runtime issues, by the torch.distributed call that issues them.
COLLECTIVE_SIZES: tuple[int, ...] = (16 * 1024, 256 * 1024, 4 * 2**20, 32 * 2**20)


def _collective_call(kind: str, group: Any, world: int, nbytes: int, device: Any) -> Callable[[], object]:
    """A closure issuing one collective of ``kind`` whose model size (:mod:`.comm`) is ``nbytes``."""
    import torch
    import torch.distributed as dist

    n = max(world, (nbytes // 4) // world * world)
    if kind == "all_reduce":
        buf = torch.zeros(n, device=device)
        return lambda: dist.all_reduce(buf, group=group)
    if kind == "all_gather":
        out = torch.zeros(n, device=device)
        inp = torch.zeros(n // world, device=device)
        return lambda: dist.all_gather_into_tensor(out, inp, group=group)
    if kind == "reduce_scatter":
        inp = torch.zeros(n, device=device)
        out = torch.zeros(n // world, device=device)
        return lambda: dist.reduce_scatter_tensor(out, inp, group=group)
    if kind == "all_to_all":
        inp = torch.zeros(n, device=device)
        out = torch.zeros(n, device=device)
        return lambda: dist.all_to_all_single(out, inp, group=group)
    if kind == "broadcast":
        buf = torch.zeros(n, device=device)
        src = dist.get_global_rank(group, 0) if group is not None else 0
        return lambda: dist.broadcast(buf, src=src, group=group)
    raise ValueError(f"no benchmark for collective {kind!r}")


def collective_fits(
    group: Any,
    device: Any,
    kinds: Sequence[str] = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all"),
    sizes: Sequence[int] = COLLECTIVE_SIZES,
    iters: int = 5,
) -> dict[str, LinkSpec]:
    """Alpha-beta fits per collective kind on ``group`` (a collective call: every rank of it calls this).

    Every rank times the same calls; the slowest rank's time counts (a collective ends when its last rank
    does) and all ranks fit the same numbers. A kind the backend lacks (gloo has no all-to-all of tensors on
    some builds) is skipped on every rank, with a log line naming it.
    """
    import torch
    import torch.distributed as dist

    world = dist.get_world_size(group)
    fits: dict[str, LinkSpec] = {}
    for kind in kinds:
        times: list[float] = []
        try:
            for nbytes in sizes:
                call = _collective_call(kind, group, world, nbytes, device)
                for _ in range(2):
                    call()
                _sync(device)
                dist.barrier(group=group)
                t0 = time.perf_counter()
                for _ in range(iters):
                    call()
                _sync(device)
                times.append((time.perf_counter() - t0) / iters)
            ok = 1.0
        except (RuntimeError, NotImplementedError) as exc:  # the backend lacks this collective
            logger.info(
                "calibration: %s not available on this backend (%s); it keeps the link's fit", kind, exc
            )
            times, ok = [0.0] * len(sizes), 0.0
        agreed = torch.tensor([ok, *times], dtype=torch.float64, device=device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=group)
        if agreed[0].item() < 1.0:
            continue
        agreed = torch.tensor(times, dtype=torch.float64, device=device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=group)
        measured = [max(float(t), 1e-9) for t in agreed.cpu().tolist()]
        fits[kind] = fit_alpha_beta(kind, list(sizes), measured, world)
        if not all(math.isfinite(x) for x in (fits[kind].bandwidth, fits[kind].latency)):
            del fits[kind]
    return fits
