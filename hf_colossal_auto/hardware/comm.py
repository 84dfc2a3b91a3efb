"""Alpha-beta cost model of collectives, and its calibration on a live process group.

Model (ring algorithms, as NCCL and gloo use for large messages).  For a group
of ``p`` ranks over a link with per-device unidirectional bandwidth ``B``
(bytes/s) and per-step latency ``a`` (seconds), and message size ``n`` bytes:

================  =========================================  =====================
collective        time                                       ``n`` is
================  =========================================  =====================
all_reduce        ``2(p-1)·a + 2(p-1)/p · n/B``               the full tensor
all_gather        ``(p-1)·a + (p-1)/p · n/B``                 the gathered output
reduce_scatter    ``(p-1)·a + (p-1)/p · n/B``                 the (unscattered) input
all_to_all        ``(p-1)·a + (p-1)/p · n/B``                 one rank's buffer
broadcast         ``(p-1)·a + n/B``                           the tensor
================  =========================================  =====================

Derivation: a ring all-gather takes ``p-1`` steps, each moving ``n/p`` bytes
over every link at once; reduce-scatter is its mirror image; all-reduce is a
reduce-scatter followed by an all-gather.  All-to-all sends ``(p-1)/p`` of each
buffer to other ranks through the same per-device bandwidth.  Broadcast is a
pipelined chain: the whole tensor crosses each link once, and the pipeline
fills in ``p-1`` steps.  A group of one rank, or an empty message, costs 0.

:class:`CommCalibration` measures ``a`` and ``B`` for a real process group by
timing all-reduces of a few sizes and fitting the model above by least squares.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hf_colossal_auto.hardware.host_cache import cache_dir, cache_key, read_entries, store_entry
from hf_colossal_auto.hardware.spec import LinkSpec
from hf_colossal_auto.units import KiB, MiB

__all__ = [
    "COLLECTIVE_KINDS",
    "canonical_collective",
    "collective_time",
    "collective_coefficients",
    "fit_alpha_beta",
    "CommCalibration",
    "calibrate_link",
    "COMM_CACHE_FILENAME",
    "DEFAULT_CALIBRATION_SIZES",
]

logger = logging.getLogger(__name__)

COLLECTIVE_KINDS: tuple[str, ...] = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast")

# Spellings used by torch.distributed / functional collectives / NCCL, so that
# op names coming out of a captured graph can be passed straight in.
_KIND_ALIASES: dict[str, str] = {
    **{kind: kind for kind in COLLECTIVE_KINDS},
    "allreduce": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "allgather": "all_gather",
    "all_gather_into_tensor": "all_gather",
    "all_gather_tensor": "all_gather",
    "_allgather_base": "all_gather",
    "reducescatter": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter",
    "_reduce_scatter_base": "reduce_scatter",
    "alltoall": "all_to_all",
    "all_to_all_single": "all_to_all",
    "bcast": "broadcast",
}


def canonical_collective(kind: str) -> str:
    """Map a collective name (``"allreduce"``, ``"all_gather_into_tensor"``...) to one of :data:`COLLECTIVE_KINDS`.

    Raises:
        ValueError: for an unknown collective, listing the valid ones.
    """
    canon = _KIND_ALIASES.get(kind)
    if canon is None:
        canon = _KIND_ALIASES.get(str(kind).strip().lower().replace("-", "_"))
    if canon is None:
        raise ValueError(
            f"Unknown collective {kind!r}; expected one of {', '.join(COLLECTIVE_KINDS)} "
            f"(aliases: {', '.join(sorted(set(_KIND_ALIASES) - set(COLLECTIVE_KINDS)))})"
        )
    return canon


def collective_coefficients(kind: str, group_size: int) -> tuple[float, float]:
    """``(latency_steps, bandwidth_factor)`` such that time = steps·a + factor·n/B.

    Exposed so that callers summing many collectives on one link can
    accumulate steps and bytes and evaluate the link once.
    """
    canon = canonical_collective(kind)
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be an int >= 1, got {group_size!r}")
    p = group_size
    if p == 1:
        return 0.0, 0.0
    if canon == "all_reduce":
        return 2.0 * (p - 1), 2.0 * (p - 1) / p
    if canon == "broadcast":
        return float(p - 1), 1.0
    return float(p - 1), (p - 1) / p


def collective_time(
    kind: str, nbytes: int | float, group_size: int, link: LinkSpec, via: str | None = None
) -> float:
    """Seconds for one collective under the ring alpha-beta model (see module docstring for ``n``).

    Raises:
        ValueError: for an unknown ``kind``, ``group_size < 1`` or negative ``nbytes``.
    """
    steps, factor = collective_coefficients(kind, group_size)
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes!r}")
    if steps == 0.0 or nbytes == 0:
        return 0.0
    bandwidth, latency = link.for_collective(canonical_collective(kind), via)
    return steps * latency + factor * nbytes / bandwidth


def fit_alpha_beta(kind: str, sizes: Sequence[float], times: Sequence[float], group_size: int) -> LinkSpec:
    """Fit a :class:`LinkSpec` to measured collective times by weighted least squares.

    Fits ``t = c0 + c1·n`` minimising *relative* residuals (weights ``1/t²``),
    because sizes span orders of magnitude and plain least squares would let
    the large messages decide the intercept alone.  Then ``a = c0/steps`` and
    ``B = factor/c1`` with the coefficients of :func:`collective_coefficients`.
    A negative intercept (noise) is clamped to 0 and the slope refitted; a
    non-positive slope (time did not grow with size) falls back to the most
    conservative slope consistent with the data, ``min(t/n)``.

    For ``group_size == 1`` nothing crosses a link; the fit then uses unit
    coefficients, i.e. it describes the backend's local overhead only.
    """
    if len(sizes) != len(times) or len(sizes) < 2 or len(set(sizes)) < 2:
        raise ValueError("fit_alpha_beta needs at least two distinct sizes with one time each")
    if any(not (math.isfinite(t) and t > 0) for t in times) or any(not (n > 0) for n in sizes):
        raise ValueError(f"sizes and times must be positive and finite, got sizes={sizes}, times={times}")
    steps, factor = collective_coefficients(kind, group_size)
    if steps == 0.0:
        steps, factor = 1.0, 1.0
    ws = [1.0 / (t * t) for t in times]
    sw = sum(ws)
    swn = sum(w * n for w, n in zip(ws, sizes, strict=True))
    swnn = sum(w * n * n for w, n in zip(ws, sizes, strict=True))
    swt = sum(w * t for w, t in zip(ws, times, strict=True))
    swnt = sum(w * n * t for w, n, t in zip(ws, sizes, times, strict=True))
    det = sw * swnn - swn * swn
    c0 = (swnn * swt - swn * swnt) / det
    c1 = (sw * swnt - swn * swt) / det
    if c0 < 0:
        c0 = 0.0
        c1 = swnt / swnn
    if not c1 > 0:
        c1 = min(t / n for n, t in zip(sizes, times, strict=True))
        c0 = max(0.0, min(t - c1 * n for n, t in zip(sizes, times, strict=True)))
        logger.warning(
            "Collective times did not grow with message size; using a conservative bandwidth bound"
        )
    return LinkSpec(bandwidth=factor / c1, latency=c0 / steps)


# Sizes from latency-bound to bandwidth-bound; 32 MiB is past the knee of
# NCCL's ring on NVLink and of gloo on TCP, and keeps the run well under a second.
DEFAULT_CALIBRATION_SIZES: tuple[int, ...] = (4 * KiB, 64 * KiB, 1 * MiB, 32 * MiB)
COMM_CACHE_FILENAME = "comm_calibration.json"
_COMM_CACHE_FORMAT = 1


class CommCalibration:
    """Times all-reduces on an initialised process group and fits a :class:`LinkSpec`.

    Results are memoised in-process and cached on disk in
    ``$HF_COLOSSAL_AUTO_CACHE/comm_calibration.json`` keyed by backend, world
    size, the group's global ranks, device name, torch version and sizes.

    Every rank must call :meth:`calibrate_link` (it issues collectives).  All
    ranks return the same LinkSpec: the cache decision and the measured times
    are taken from / reduced across the group, so plans made from them agree.
    """

    def __init__(
        self,
        sizes: Sequence[int] = DEFAULT_CALIBRATION_SIZES,
        iters: int = 5,
        warmup: int = 2,
        use_disk_cache: bool = True,
    ) -> None:
        self.sizes = self._check_sizes(sizes)
        if iters < 1 or warmup < 0:
            raise ValueError(f"iters must be >= 1 and warmup >= 0, got iters={iters}, warmup={warmup}")
        self.iters = iters
        self.warmup = warmup
        self.use_disk_cache = use_disk_cache
        self._memo: dict[str, LinkSpec] = {}

    @staticmethod
    def _check_sizes(sizes: Sequence[int]) -> tuple[int, ...]:
        out = tuple(int(s) for s in sizes)
        if len(set(out)) < 2 or any(s < 4 for s in out):
            raise ValueError(f"Need at least two distinct sizes of >= 4 bytes, got {sizes!r}")
        return out

    @staticmethod
    def cache_path() -> Path:
        """Location of the on-disk cache."""
        return cache_dir() / COMM_CACHE_FILENAME

    def calibrate_link(
        self, group: Any = None, sizes: Sequence[int] | None = None, force: bool = False
    ) -> LinkSpec:
        """Measure the link used by ``group`` (default: the world group).

        Raises:
            RuntimeError: if torch.distributed is not initialised.
        """
        import torch
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("CommCalibration needs an initialised torch.distributed process group")
        use_sizes = self._check_sizes(sizes) if sizes is not None else self.sizes
        backend = str(dist.get_backend(group))
        group_size = dist.get_world_size(group)
        device = self._device_for(backend)
        key = self._key(backend, dist.get_world_size(), self._group_ranks(group), device, use_sizes)
        if not force and key in self._memo:
            return self._memo[key]

        src = self._group_src(group)
        cached = None if force or not self.use_disk_cache else self._read_disk(key)
        # Group rank 0 decides whether the cache is used, so no rank measures
        # alone while the others wait in a collective that never comes.
        decision = torch.tensor(
            [1.0, cached.bandwidth, cached.latency] if cached is not None else [0.0, 0.0, 0.0],
            dtype=torch.float64,
            device=device,
        )
        dist.broadcast(decision, src=src, group=group)
        hit, bandwidth, latency = (float(v) for v in decision.cpu().tolist())
        if hit:
            link = LinkSpec(bandwidth=bandwidth, latency=latency)
        else:
            times = self._measure(group, device, use_sizes)
            link = fit_alpha_beta("all_reduce", use_sizes, times, group_size)
            if self.use_disk_cache and dist.get_rank(group) == 0:
                self._write_disk(key, link, use_sizes, times)
        self._memo[key] = link
        return link

    # -- measurement -------------------------------------------------------

    @staticmethod
    def _device_for(backend: str) -> Any:
        import torch

        if "nccl" in backend.lower() and torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    @staticmethod
    def _group_ranks(group: Any) -> tuple[int, ...]:
        import torch.distributed as dist

        if group is None:
            return tuple(range(dist.get_world_size()))
        return tuple(dist.get_process_group_ranks(group))

    @staticmethod
    def _group_src(group: Any) -> int:
        """Global rank of the group's rank 0 (``broadcast`` takes global ranks)."""
        import torch.distributed as dist

        if group is None:
            return 0
        return dist.get_global_rank(group, 0)

    def _measure(self, group: Any, device: Any, sizes: Sequence[int]) -> list[float]:
        """Mean seconds per all-reduce for each size, maximised over the group's ranks."""
        import torch
        import torch.distributed as dist

        def sync() -> None:
            if device.type == "cuda":
                torch.cuda.synchronize(device)

        per_size: list[float] = []
        for nbytes in sizes:
            buf = torch.zeros(max(1, nbytes // 4), dtype=torch.float32, device=device)
            for _ in range(self.warmup):
                dist.all_reduce(buf, group=group)
            sync()
            dist.barrier(group=group)
            start = time.perf_counter()
            for _ in range(self.iters):
                dist.all_reduce(buf, group=group)
            sync()
            per_size.append((time.perf_counter() - start) / self.iters)
            del buf
        # The slowest rank defines the collective's time, and taking the max
        # makes every rank fit the same numbers.
        agreed = torch.tensor(per_size, dtype=torch.float64, device=device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=group)
        return [max(float(t), 1e-9) for t in agreed.cpu().tolist()]

    # -- caching -----------------------------------------------------------

    @staticmethod
    def _key(backend: str, world: int, ranks: tuple[int, ...], device: Any, sizes: Sequence[int]) -> str:
        return cache_key(
            device.type,
            backend=backend,
            world=world,
            ranks=",".join(map(str, ranks)),
            sizes=",".join(map(str, sizes)),
        )

    def _read_disk(self, key: str) -> LinkSpec | None:
        entry = read_entries(self.cache_path(), _COMM_CACHE_FORMAT).get(key)
        try:
            return (
                LinkSpec(bandwidth=float(entry["bandwidth"]), latency=float(entry["latency"]))
                if entry
                else None
            )
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            logger.debug("Comm calibration cache miss for %s: %s", key, exc)
            return None

    def _write_disk(self, key: str, link: LinkSpec, sizes: Sequence[int], times: Sequence[float]) -> None:
        """Merge one entry into the cache atomically; failure only costs a re-measure next time."""
        entry = {**link.to_dict(), "sizes": list(sizes), "times": list(times)}
        store_entry(self.cache_path(), key, entry, _COMM_CACHE_FORMAT)


_DEFAULT_CALIBRATION = CommCalibration()


def calibrate_link(group: Any = None, sizes: Sequence[int] | None = None, force: bool = False) -> LinkSpec:
    """Fit a :class:`LinkSpec` for ``group`` with the shared default :class:`CommCalibration`.

    Collective call: every rank of ``group`` must call it.  See
    :meth:`CommCalibration.calibrate_link`.
    """
    return _DEFAULT_CALIBRATION.calibrate_link(group=group, sizes=sizes, force=force)
