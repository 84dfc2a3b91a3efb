"""The host at hand and the on-disk cache of what was measured on it.

Every measurement that is cached (the ``cpu`` preset's kernels, a process group's all-reduce fit, a job's
calibration for ``device="calibrate"``) lives in one directory (``$HF_COLOSSAL_AUTO_CACHE``, default
``~/.cache/hf_colossal_auto``), is written atomically (a reader on another rank never sees half a file), and
is found by one key scheme, :func:`cache_key`: the device (kind and model name), torch's thread count and
version, and the facts the caller's figures also depend on (a benchmark version, the job's shape, the message
sizes). Files that hold many entries (:func:`read_entries`, :func:`store_entry`) are ``{"format": N,
"entries": {key: entry}}``; a missing, corrupt or other-format file reads as empty: it is only a cache.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import platform
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hf_colossal_auto.hardware.catalog import STATIC_CPU_SPEC

__all__ = [
    "CACHE_ENV",
    "NO_CALIBRATE_ENV",
    "cache_dir",
    "cache_key",
    "calibration_disabled",
    "cpu_model_name",
    "device_name",
    "host_memory_bytes",
    "read_entries",
    "store_entry",
    "write_json_atomically",
]

logger = logging.getLogger(__name__)

CACHE_ENV = "HF_COLOSSAL_AUTO_CACHE"
NO_CALIBRATE_ENV = "HF_COLOSSAL_AUTO_NO_CALIBRATE"

_FALSE_STRINGS = frozenset({"", "0", "false", "no", "off"})


def cache_dir() -> Path:
    """Directory for all on-disk calibration caches (``$HF_COLOSSAL_AUTO_CACHE`` or ``~/.cache/hf_colossal_auto``)."""
    override = os.environ.get(CACHE_ENV)
    if override:
        return Path(override).expanduser()
    return Path.home() / ".cache" / "hf_colossal_auto"


def calibration_disabled() -> bool:
    """True when ``HF_COLOSSAL_AUTO_NO_CALIBRATE`` is set to anything but ``0/false/no/off/''``."""
    return os.environ.get(NO_CALIBRATE_ENV, "").strip().lower() not in _FALSE_STRINGS


def cpu_model_name() -> str:
    """Human-readable CPU model, e.g. ``"AMD EPYC 7763 64-Core Processor"``.

    Read from ``/proc/cpuinfo`` on Linux (``platform.processor()`` is often empty
    there), falling back to ``platform`` elsewhere.
    """
    with contextlib.suppress(OSError), open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
        for line in f:
            if line.lower().startswith(("model name", "hardware", "cpu model")):
                _, _, value = line.partition(":")
                if value.strip():
                    return value.strip()
    return platform.processor() or platform.machine() or "unknown-cpu"


def device_name(kind: str) -> str:
    """The model of the device of ``kind`` this process runs on: the current GPU's name, or the CPU's."""
    import torch

    return torch.cuda.get_device_name() if kind == "cuda" else cpu_model_name()


def cache_key(kind: str, **facts: object) -> str:
    """The key of every calibration cache: what a measurement depends on.

    Always the device (``kind`` and its model, :func:`device_name`), torch's thread count and torch's version;
    then ``facts``, the caller's own (a benchmark version, the job's world size, message sizes), sorted by
    name, so that two caches never disagree on what makes a host "the same"."""
    import torch

    parts = [kind, device_name(kind), f"threads={torch.get_num_threads()}", f"torch={torch.__version__}"]
    parts += [f"{name}={value}" for name, value in sorted(facts.items())]
    return "|".join(parts)


def _read_int_file(path: str) -> int | None:
    with contextlib.suppress(OSError, ValueError):
        with open(path, encoding="ascii") as f:
            text = f.read().strip()
        if text and text != "max":
            return int(text)
    return None


def host_memory_bytes() -> int:
    """Memory this process may use: physical RAM, capped by a cgroup (container) limit if any."""
    physical: int | None = None
    with contextlib.suppress(ValueError, OSError, AttributeError):
        physical = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if not physical or physical <= 0:
        return STATIC_CPU_SPEC.memory_bytes
    limits = [
        _read_int_file("/sys/fs/cgroup/memory.max"),  # cgroup v2
        _read_int_file("/sys/fs/cgroup/memory/memory.limit_in_bytes"),  # cgroup v1
    ]
    # cgroup v1 reports "no limit" as a huge number near 2**63, which min() ignores.
    return min([physical, *[limit for limit in limits if limit is not None and limit > 0]])


def write_json_atomically(path: Path, data: Any, prefix: str) -> None:
    """Write ``data`` as JSON to ``path`` through a temp file and a rename, so that a reader (another rank,
    another process) never sees a half-written cache. Raises OSError; callers decide whether that matters."""
    fd, tmp = tempfile.mkstemp(prefix=prefix, suffix=".json", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=2, sort_keys=True)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def read_entries(path: Path, file_format: int) -> dict[str, Any]:
    """The entries of a cache file; a missing, corrupt or other-format file is treated as empty (it is only a
    cache)."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        logger.warning("Ignoring unreadable calibration cache %s: %s", path, exc)
        return {}
    if (
        not isinstance(data, dict)
        or data.get("format") != file_format
        or not isinstance(data.get("entries"), dict)
    ):
        return {}
    return data["entries"]


def store_entry(path: Path, key: str, entry: Mapping[str, Any], file_format: int) -> None:
    """Merge one entry into the cache file atomically (temp file + rename).

    Failure to write (read-only home, full disk) only costs a re-run next
    time, so it is logged, not raised.
    """
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        entries = read_entries(path, file_format)
        entries[key] = dict(entry)
        write_json_atomically(path, {"format": file_format, "entries": entries}, f".{path.stem}.")
    except OSError as exc:
        logger.warning("Could not write calibration cache %s: %s", path, exc)
