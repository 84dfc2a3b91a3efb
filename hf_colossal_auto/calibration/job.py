"""``device="calibrate"``: the integrations measure the machine of the running job once, then reuse it.

``hf-colossal-auto calibrate --out cluster.json`` is the explicit way; a job launched with
``AutoParallelPlugin(device="calibrate")`` (``HF_COLOSSAL_AUTO_DEVICE=calibrate``) or
``AutoParallelCallback(device="calibrate")`` gets the same spec without a separate command: the first job on a
machine measures its kernels and, on the job's own process group, its collectives (every rank takes part), and
writes the result to the calibration cache (``$HF_COLOSSAL_AUTO_CACHE``, default ``~/.cache/hf_colossal_auto``);
later jobs of the same shape on the same machine read it. The cache key is what the figures depend on
(:func:`~hf_colossal_auto.hardware.host_cache.cache_key`): the device, torch's thread count and version, the
number of processes and of processes per node. Per-op host
overheads need a process group of one process and are measured only in a one-process job (defaults otherwise,
as ``calibrate()`` says).
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path

import torch.distributed as dist

from ..hardware.host_cache import cache_dir, cache_key, write_json_atomically

__all__ = ["CALIBRATE", "calibrated_device", "calibration_cache_path", "resolve_device"]

logger = logging.getLogger(__name__)

CALIBRATE = "calibrate"
"""The ``device`` value that asks for the running job's own calibration."""

_BUDGET_S = 0.5  # seconds per kernel benchmark: about 10-20 s in all, once per machine and job shape


def _world() -> tuple[int, int]:
    world = dist.get_world_size() if dist.is_initialized() else 1
    return world, int(os.environ.get("LOCAL_WORLD_SIZE", world))


def calibration_cache_path(kind: str) -> Path:
    """Where the calibration of this machine, for a job of this shape, is cached."""
    world, local = _world()
    key = cache_key(kind, world=world, local=local)
    return cache_dir() / f"cluster-{hashlib.sha1(key.encode()).hexdigest()[:16]}.json"


def calibrated_device(kind: str, *, refresh: bool = False) -> str:
    """The path of a device spec measured on this machine for this job (collective: call it on every rank).

    Rank 0 decides whether the cache holds one (``refresh`` measures again); when it does not, every rank joins
    :func:`~hf_colossal_auto.calibration.calibrate` (the collectives are timed on the job's group) and rank 0
    writes the spec. Every rank returns the same path."""
    from . import calibrate  # looked up when called: a test (or a user) may replace it

    path = calibration_cache_path(kind)
    launched = dist.is_initialized() and dist.get_world_size() > 1
    decision = [refresh or not path.exists()]
    if launched:
        dist.broadcast_object_list(decision, src=0)
    if decision[0]:
        logger.info("calibrating this %s job once (cached as %s)", kind, path)
        spec = calibrate(kind, budget_s=_BUDGET_S, overheads=not launched)
        if not launched or dist.get_rank() == 0:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_json_atomically(path, spec.to_dict(), prefix="cluster-")
        if launched:
            dist.barrier()  # the file exists before any rank reads it
    else:
        logger.info("using the cached calibration %s", path)
    return str(path)


def resolve_device(device: str | None, kind: str) -> str | None:
    """``device`` itself, unless it is ``"calibrate"``: then the cached (or freshly measured) spec's path.
    Collective when it calibrates: every rank of the job calls it with the same ``device``."""
    if device is None or device.strip().lower() != CALIBRATE:
        return device
    return calibrated_device(kind)
