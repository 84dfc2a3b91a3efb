"""Micro-benchmarks of the device at hand: what its kernels and its collectives achieve, in FLOP/s, bytes/s and
seconds, for :mod:`hf_colossal_auto.calibration` to write into a :class:`DeviceSpec`. Each function here is one
measurement; :mod:`hf_colossal_auto.calibration.kernels` runs the kernel benchmarks of a calibration together
(and times attention, whose FLOPs it counts as the capture does).

Each benchmark times real work of the shapes a transformer training step runs, not a vendor's best case:

* matmuls: the *median* FLOP/s over projection-shaped GEMMs (``tokens x hidden x 4 hidden`` and its
  transposes). A square matmul small enough to stay in cache runs ~1.5x faster on a CPU than the model's
  GEMMs do, and the roofline must price the latter;
* elementwise: bytes/s of ``a + b`` on tensors far larger than the caches (two reads, one write);
* collectives: every kind DTensor and FSDP issue, on a live process group, a few sizes each, fitted per kind
  to the alpha-beta model of :mod:`.comm` (gloo's all-gather is not a ring, NCCL's all-reduce is two).

Timings take the median of repetitions after a warm-up (sustained rates, not a lucky best), synchronise a GPU
before reading the clock, and stay within a budget of seconds per benchmark.
"""

from __future__ import annotations

import itertools
import logging
import math
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

from .comm import fit_alpha_beta
from .spec import LinkSpec

__all__ = [
    "time_call",
    "matmul_rate",
    "matmul_curve",
    "elementwise_bandwidth",
    "transcendental_rate",
    "collective_fits",
    "dtensor_collective_fits",
    "overlap_efficiency",
    "MATMUL_SHAPES",
]

logger = logging.getLogger(__name__)

# (tokens, hidden, ffn) of the GEMMs a calibration times, per device kind: a 1-thread CPU must finish them in
# well under a second each, a GPU needs them big enough to fill its SMs.
MATMUL_SHAPES: dict[str, tuple[int, int, int]] = {"cpu": (1024, 512, 1408), "cuda": (8192, 4096, 11008)}
# Bytes of GEMM operands cycled through so that each call finds its operands out of cache: a few times a
# server CPU's L3 (32-256 MiB) and a GPU's L2 (50-60 MiB on H100/H200).
COLD_CACHE_BYTES: dict[str, int] = {"cpu": 256 * 2**20, "cuda": 512 * 2**20}


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


def _gemm_shapes(kind: str, scale: float = 1.0) -> list[tuple[int, int, int]]:
    """``(m, k, n)`` of a block's projections, forward and backward: up (t x h -> 4h), down (t x 4h -> h), the
    attention projection (t x h -> h) and the weight gradients (h x t -> 4h); ``scale`` shrinks the hidden
    sizes (a smaller model, or a tensor-parallel shard of this one)."""
    t, h, f = MATMUL_SHAPES[kind]
    h, f = max(16, int(h * scale)), max(16, int(f * scale))
    return [(t, h, f), (t, f, h), (t, h, h), (h, t, f)]


def matmul_rate(device: Any, dtype: Any, *, budget_s: float = 1.0, scale: float = 1.0) -> float:
    """Median achieved FLOP/s of projection-shaped GEMMs of ``dtype`` on ``device`` (hidden sizes times
    ``scale``)."""
    import torch

    shapes = _gemm_shapes(getattr(device, "type", str(device)), scale)
    generator = torch.Generator(device="cpu").manual_seed(0)
    rates = []
    start = time.perf_counter()
    for m, k, n in shapes:
        # several operand sets, together beyond the last-level cache, used in turn: in a training step a
        # GEMM's operands come from memory, not from the cache the previous repetition left them in
        size = torch.tensor([], dtype=dtype).element_size() * (m * k + k * n + m * n)
        sets = max(1, min(16, -(-COLD_CACHE_BYTES[getattr(device, "type", str(device))] // size)))
        operands = [
            (
                torch.randn(m, k, generator=generator).to(device=device, dtype=dtype),
                torch.randn(k, n, generator=generator).to(device=device, dtype=dtype),
            )
            for _ in range(sets)
        ]
        turn = itertools.cycle(operands)

        def call(turn=turn) -> object:
            a, b = next(turn)
            return torch.mm(a, b)

        seconds = time_call(call, device, budget_s=budget_s / len(shapes), min_reps=2)
        rates.append(2.0 * m * n * k / seconds)
        del operands, turn
        if time.perf_counter() - start > 2 * budget_s:
            break  # an emulated dtype (bf16 on a CPU without it): one shape says enough, and fast
    return statistics.median(rates)


# Hidden-size scales of the GEMM curve: the calibration shape, and smaller models or tensor-parallel shards.
CURVE_SCALES: tuple[float, ...] = (0.125, 0.25, 0.5, 1.0)


def matmul_curve(
    device: Any,
    dtype: Any,
    *,
    budget_s: float = 1.0,
    rounds: int = 3,
    sync: Callable[[], object] | None = None,
) -> tuple[tuple[float, float], ...]:
    """``(FLOPs of one GEMM, achieved FLOP/s)`` at each of :data:`CURVE_SCALES`, smallest first: small GEMMs
    (a narrow model, a tensor-parallel shard) reach a lower rate than big ones on every device.

    The sizes are visited in ``rounds`` interleaved rounds and each point is the median over them: a machine
    whose speed drifts for a second (another process, a frequency step) then moves every point of one round,
    which the median drops, instead of bending the curve at whichever size it was timing. ``sync`` (a
    barrier in a multi-process job) runs before each measurement so that every rank times the same GEMM at
    the same moment, contending for the shared caches and memory as the ranks of a training step do."""
    kind = getattr(device, "type", str(device))
    rounds = max(1, rounds)
    share = budget_s / (len(CURVE_SCALES) * rounds)
    samples: list[list[float]] = [[] for _ in CURVE_SCALES]
    for _ in range(rounds):
        for i, scale in enumerate(CURVE_SCALES):
            if sync is not None:
                sync()
            samples[i].append(matmul_rate(device, dtype, budget_s=share, scale=scale))
    points = []
    for scale, rates in zip(CURVE_SCALES, samples, strict=True):
        m, k, n = _gemm_shapes(kind, scale)[0]
        points.append((2.0 * m * k * n, statistics.median(rates)))
    return tuple(points)


def elementwise_bandwidth(device: Any, *, nbytes: int, budget_s: float = 0.5) -> float:
    """Bytes/s of ``out = a + b`` in float32 on buffers of ``nbytes`` each (read twice, written once)."""
    import torch

    n = max(1, nbytes // 4)
    a = torch.ones(n, device=device)
    b = torch.ones(n, device=device)
    out = torch.empty_like(a)
    seconds = time_call(lambda: torch.add(a, b, out=out), device, budget_s=budget_s)
    return 3.0 * n * 4 / seconds


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


def overlap_efficiency(group: Any, device: Any, *, nbytes: int = 8 * 2**20, repeats: int = 5) -> float:
    """Share of a collective hidden behind concurrent compute, in ``[0, 1]`` (a collective call).

    Times an all-reduce of ``nbytes`` alone (started asynchronously, waited for), a block of projection GEMMs
    sized to last about as long alone, and both together (the all-reduce started, the GEMMs run, then waited
    for): ``(comm + compute - both) / min(comm, compute)``. 1: the collective costs nothing behind compute
    (separate engines); 0: the two serialise (one core, or a collective thread that takes the compute's).
    Medians over ``repeats`` rounds; every rank returns the slowest rank's figure.
    """
    import torch
    import torch.distributed as dist

    buf = torch.zeros(max(1, nbytes // 4), device=device)
    t, h, f = MATMUL_SHAPES[getattr(device, "type", str(device))]
    generator = torch.Generator(device="cpu").manual_seed(0)
    a = torch.randn(t, h, generator=generator).to(device)
    b = torch.randn(h, f, generator=generator).to(device)

    def comm() -> None:
        dist.all_reduce(buf, group=group, async_op=True).wait()

    def timed(fn: Callable[[], object]) -> float:
        dist.barrier(group=group)
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        return time.perf_counter() - t0

    comm()
    t_comm = statistics.median(timed(comm) for _ in range(repeats))
    t_mm = max(timed(lambda: torch.mm(a, b)), 1e-9)
    reps = max(1, round(t_comm / t_mm))

    def compute() -> None:
        for _ in range(reps):
            torch.mm(a, b)

    def both() -> None:
        work = dist.all_reduce(buf, group=group, async_op=True)
        compute()
        work.wait()

    t_compute = statistics.median(timed(compute) for _ in range(repeats))
    t_both = statistics.median(timed(both) for _ in range(repeats))
    hidden = (t_comm + t_compute - t_both) / max(min(t_comm, t_compute), 1e-9)
    agreed = torch.tensor([min(1.0, max(0.0, hidden))], dtype=torch.float64, device=device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=group)
    return float(agreed.item())


def _redistribution(kind: str, mesh: Any, world: int, nbytes: int, device: Any) -> Callable[[], object]:
    """A closure running the DTensor redistribution that issues ``kind`` on a ``[rows, 1024]`` float32 tensor
    whose model size (:mod:`.comm`) is ``nbytes``: sharded on its last dim, as tensor parallelism shards
    activations (so an all-gather also pays DTensor's re-layout of the gathered chunks)."""
    import torch
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    cols = 1024
    rows = max(world, (nbytes // 4 // cols) // world * world)
    if kind == "all_reduce":
        src, dst, shape = [Partial()], [Replicate()], (rows, cols)
    elif kind == "all_gather":
        src, dst, shape = [Shard(1)], [Replicate()], (rows, cols // world)
    elif kind == "reduce_scatter":
        src, dst, shape = [Partial()], [Shard(1)], (rows, cols)
    elif kind == "all_to_all":  # n is one rank's buffer
        src, dst, shape = [Shard(0)], [Shard(1)], (rows, cols)
    else:
        raise ValueError(f"no DTensor redistribution issues {kind!r}")
    local = torch.zeros(*shape, device=device)
    tensor = DTensor.from_local(local, mesh, src, run_check=False)
    return lambda: tensor.redistribute(mesh, dst).to_local()


def dtensor_collective_fits(
    device: Any,
    kinds: Sequence[str] = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all"),
    sizes: Sequence[int] = COLLECTIVE_SIZES,
    iters: int = 5,
) -> dict[str, LinkSpec]:
    """Alpha-beta fits per collective kind *as a DTensor redistribution issues it* on the whole job (a
    collective call): the collective, its copies and re-layouts, and DTensor's bookkeeping; what a
    tensor-parallel resharding costs at run time. Keys are ``"dtensor:<kind>"``."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    mesh = init_device_mesh(getattr(device, "type", str(device)), (world,))
    fits: dict[str, LinkSpec] = {}
    for kind in kinds:
        times: list[float] = []
        for nbytes in sizes:
            call = _redistribution(kind, mesh, world, nbytes, device)
            for _ in range(2):
                call()
            _sync(device)
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(iters):
                call()
            _sync(device)
            times.append((time.perf_counter() - t0) / iters)
        agreed = torch.tensor(times, dtype=torch.float64)
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
        measured = [max(float(t), 1e-9) for t in agreed.tolist()]
        fits[f"dtensor:{kind}"] = fit_alpha_beta(kind, list(sizes), measured, world)
    return fits


def transcendental_rate(device: Any, *, budget_s: float = 0.5) -> float:
    """Elements/s of elementwise math, the median over exp, tanh, sigmoid, silu, gelu, softmax and log_softmax
    on a float32 tensor beyond the caches: what bounds those ops where arithmetic, not bandwidth, is the limit
    (a CPU core evaluates 0.2-0.9 G of them a second against ~2 G elements/s of an add)."""
    import torch
    import torch.nn.functional as F

    kind = getattr(device, "type", str(device))
    generator = torch.Generator(device="cpu").manual_seed(0)  # the caller's seeded RNG stays untouched
    x = torch.randn(1024, 8192 if kind == "cpu" else 65536, generator=generator).to(device)
    ops: list[Callable[[], object]] = [
        lambda: torch.exp(x),
        lambda: torch.tanh(x),
        lambda: torch.sigmoid(x),
        lambda: F.silu(x),
        lambda: F.gelu(x),
        lambda: torch.softmax(x, -1),
        lambda: torch.log_softmax(x, -1),
    ]
    rates = [x.numel() / time_call(op, device, budget_s=budget_s / len(ops)) for op in ops]
    return statistics.median(rates)
