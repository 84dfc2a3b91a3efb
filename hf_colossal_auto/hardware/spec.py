"""The device model: :class:`DeviceSpec` and :class:`LinkSpec` (what one accelerator and its links achieve), and
their JSON form (what ``hf-colossal-auto calibrate --out`` writes and every ``device=`` argument reads).

Every number is in SI base units (FLOP/s, bytes/s, bytes, seconds). The datasheet presets built from these
classes are in :mod:`hf_colossal_auto.hardware.catalog`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from hf_colossal_auto.units import parse_bytes

__all__ = [
    "LinkSpec",
    "DeviceSpec",
    "DEVICE_KINDS",
    "canonical_dtype",
    "device_from_dict",
    "load_device_spec",
    "save_device_spec",
]

DEVICE_KINDS: tuple[str, ...] = ("cuda", "cpu")

# Default per-kernel launch overhead.  ~5 us is the usual figure for a CUDA
# kernel launch plus the framework dispatch in eager PyTorch on a datacenter
# GPU (CUDA launch latency is 2-4 us; ATen dispatch adds a few us more); on CPU
# there is no launch, only ATen dispatch + OpenMP fork/join, ~2 us.
_DEFAULT_KERNEL_OVERHEAD_S: dict[str, float] = {"cuda": 5e-6, "cpu": 2e-6}

# Default host (CPU-side) seconds per op of a training step: Python, autograd bookkeeping, ATen dispatch,
# module hooks, averaged over every aten op of a step (views included). On a GPU the host runs ahead of the
# device, so an op costs max(device time, host time); on a CPU the two add up. Measured by
# ``hf-colossal-auto calibrate`` (a tiny model's training step over its op count); these defaults are such
# measurements (docs/hardware.md, "Per-op overheads"), used for what-if planning on hardware not at hand:
# cuda on the host of an H200 (torch 2.11, docs/measurements/h200_calibration.json), cpu on the 2-core dev
# machine with one thread per rank (torchrun, 2 gloo ranks; the median of four calibrations, 11-17 us and
# 67-114 us: the machine is shared).
_DEFAULT_HOST_OVERHEAD_S: dict[str, float] = {"cuda": 14e-6, "cpu": 16e-6}
# Extra host seconds per op when the step runs on DTensors (sharding propagation, redistribution bookkeeping,
# the runtime's hooks): every op of a planned model does, so this is what our runtime adds to an eager step.
_DEFAULT_DTENSOR_OVERHEAD_S: dict[str, float] = {"cuda": 60e-6, "cpu": 79e-6}
# Share of a collective that runs hidden behind concurrent compute (0: none, 1: all of it). NCCL runs on its own
# stream and SMs: the presets assume the ideal, as their peaks do. gloo's collective thread competes with the
# compute thread for the cores: measured by ``hf-colossal-auto calibrate`` under torchrun (docs/hardware.md;
# the median of three calibrations on the 2-core dev machine, 5-61 %).
_DEFAULT_OVERLAP_EFFICIENCY: dict[str, float] = {"cuda": 1.0, "cpu": 0.53}

# Canonical dtype names are torch's names (``str(torch.bfloat16)`` minus the
# ``torch.`` prefix), plus ``tf32`` which is not a storage dtype but the
# tensor-core math mode used for float32 matmuls when
# ``torch.backends.cuda.matmul.allow_tf32`` is set, and ``float8`` for both FP8
# formats (the tensor cores run e4m3 and e5m2 at the same rate).
_DTYPE_ALIASES: dict[str, str] = {
    "float32": "float32",
    "fp32": "float32",
    "float": "float32",
    "f32": "float32",
    "single": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
    "f16": "float16",
    "tf32": "tf32",
    "tensorfloat32": "tf32",
    "float8": "float8",
    "fp8": "float8",
    "float8_e4m3fn": "float8",
    "float8_e4m3fnuz": "float8",
    "float8_e5m2": "float8",
    "float8_e5m2fnuz": "float8",
}


def canonical_dtype(dtype: object) -> str:
    """Map a dtype spelling (``"bf16"``, ``torch.bfloat16``, ``"torch.half"``) to its catalog key.

    Unknown dtypes are returned lower-cased and without a ``torch.`` prefix so
    that callers can still look them up (and fall back) without crashing.
    """
    text = str(dtype).strip().lower()
    if text.startswith("torch."):
        text = text[len("torch.") :]
    return _DTYPE_ALIASES.get(text, text)


class _FrozenTable(dict):  # type: ignore[type-arg]
    """An immutable, hashable ``dict`` for the tables of :class:`DeviceSpec` and :class:`LinkSpec`.

    A plain dict would let one caller mutate a shared preset for everyone;
    ``MappingProxyType`` would break pickling and ``copy.deepcopy`` (specs are
    shipped to worker processes and stored in plans).  Subclassing ``dict``
    keeps ``isinstance(x, dict)`` and ``json.dumps`` working.
    """

    def _readonly(self, *args: object, **kwargs: object) -> None:
        raise TypeError("DeviceSpec/LinkSpec tables are read-only; use DeviceSpec.with_overrides(...)")

    __setitem__ = _readonly  # type: ignore[assignment]
    __delitem__ = _readonly  # type: ignore[assignment]
    clear = _readonly  # type: ignore[assignment]
    pop = _readonly  # type: ignore[assignment]
    popitem = _readonly  # type: ignore[assignment]
    setdefault = _readonly  # type: ignore[assignment]
    update = _readonly  # type: ignore[assignment]
    __ior__ = _readonly  # type: ignore[assignment]

    def __hash__(self) -> int:  # type: ignore[override]
        return hash(tuple(sorted(self.items())))

    def __reduce__(self) -> tuple[type, tuple[dict[str, float]]]:
        return (type(self), (dict(self),))


def _check_positive(name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be positive and finite, got {value!r}")


@dataclass(frozen=True)
class LinkSpec:
    """One interconnect as seen by a single device.

    Attributes:
        bandwidth: unidirectional bytes/s available *per device* (the "bus
            bandwidth" in NCCL-tests terms), i.e. what one rank can push into
            the ring at the same time as every other rank does.  For a NIC
            shared by several GPUs this is the NIC rate divided by the GPUs
            sharing it.
        latency: seconds of fixed cost per communication step (alpha in the
            alpha-beta model).
        collectives: measured ``(bandwidth, latency)`` per collective kind
            (``"all_gather"``...), fitted by calibration for kinds whose
            implementation differs from the ring model (gloo's all-gather is
            not a ring), and per kind as a DTensor redistribution issues it
            (``"dtensor:all_gather"``: with its copies and Python); kinds not
            listed use ``bandwidth`` and ``latency``.
    """

    bandwidth: float
    latency: float
    collectives: Mapping[str, tuple[float, float]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _check_positive("LinkSpec.bandwidth", self.bandwidth)
        if (
            isinstance(self.latency, bool)
            or not isinstance(self.latency, (int, float))
            or not math.isfinite(self.latency)
            or self.latency < 0
        ):
            raise ValueError(f"LinkSpec.latency must be a finite number >= 0, got {self.latency!r}")
        object.__setattr__(self, "bandwidth", float(self.bandwidth))
        object.__setattr__(self, "latency", float(self.latency))
        per_kind: dict[str, tuple[float, float]] = {}
        for kind, value in dict(self.collectives).items():
            bandwidth, latency = (float(v) for v in value)
            _check_positive(f"LinkSpec.collectives[{kind!r}] bandwidth", bandwidth)
            if not math.isfinite(latency) or latency < 0:
                raise ValueError(f"LinkSpec.collectives[{kind!r}] latency must be >= 0, got {latency!r}")
            per_kind[str(kind)] = (bandwidth, latency)
        object.__setattr__(self, "collectives", _FrozenTable(per_kind))

    def for_collective(self, kind: str, via: str | None = None) -> tuple[float, float]:
        """``(bandwidth, latency)`` of one collective kind on this link (measured where calibrated). ``via``:
        the layer that issues it (``"dtensor"``: a DTensor redistribution, whose fit ``"dtensor:<kind>"``
        includes its copies and bookkeeping), when that was measured."""
        if self.measured_through(via, kind):
            return self.collectives[f"{via}:{kind}"]
        return self.collectives.get(kind, (self.bandwidth, self.latency))

    def measured_through(self, via: str | None, kind: str) -> bool:
        """Whether calibration fitted ``kind`` as issued through ``via`` (e.g. DTensor's redistribute)."""
        return via is not None and f"{via}:{kind}" in self.collectives

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready representation (``collectives`` only when calibrated)."""
        out: dict[str, Any] = {"bandwidth": self.bandwidth, "latency": self.latency}
        if self.collectives:
            out["collectives"] = {k: {"bandwidth": b, "latency": a} for k, (b, a) in self.collectives.items()}
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> LinkSpec:
        """Inverse of :meth:`to_dict`; rejects missing or unknown keys to catch typos."""
        keys = set(data)
        if not {"bandwidth", "latency"} <= keys <= {"bandwidth", "latency", "collectives"}:
            raise ValueError(
                "LinkSpec dict must have the keys 'bandwidth' and 'latency' (and optionally 'collectives'), "
                f"got {sorted(keys)}"
            )
        per_kind = {
            str(k): (float(v["bandwidth"]), float(v["latency"]))
            for k, v in data.get("collectives", {}).items()
        }
        return cls(bandwidth=float(data["bandwidth"]), latency=float(data["latency"]), collectives=per_kind)


@dataclass(frozen=True)
class DeviceSpec:
    """Peak capabilities of one accelerator and how it is wired to its peers.

    Attributes:
        name: catalog name (``"a100-80gb"``) or a user-chosen label.
        peak_flops: dense peak FLOP/s per dtype, keyed by canonical dtype name
            (``"float32"``, ``"bfloat16"``, ``"float16"``, ``"tf32"``,
            ``"float8"``).  ``"float32"`` is mandatory because it is the fallback
            for dtypes the device has no fast path for.  Reduced-precision
            entries are tensor-core rates, which only matmul-like ops reach;
            elementwise ops are memory-bound so the roofline is unaffected.
        memory_bandwidth: peak device-memory bandwidth, bytes/s.
        memory_bytes: device memory capacity, bytes.
        intra_node_link: link used by collectives whose ranks share a node.
        inter_node_link: link used by collectives spanning nodes.
        devices_per_node: devices in one node (the NVLink/PCIe domain).
        kind: ``"cuda"`` or ``"cpu"``.
        kernel_overhead_s: fixed seconds added to every kernel by the
            roofline (launch + dispatch).  ``None`` selects the default for
            ``kind`` (5 us on cuda, 2 us on cpu).
        host_overhead_s: host seconds per op of an eager training step
            (Python, autograd, dispatch), averaged over a step's aten ops.
            ``None``: the default for ``kind``. See :func:`hardware.roofline.step_op_time`.
        dtensor_overhead_s: extra host seconds per op when the step runs on
            DTensors, as every op of a planned model does. ``None``: the default.
        overlap_efficiency: share of data-parallel communication that runs
            hidden behind concurrent computation, in ``[0, 1]``. ``None``: the default.
        transcendental_rate: elements/s of elementwise math (exp, tanh, softmax,
            ...), whose FLOPs nobody counts: on a CPU it, not bandwidth, bounds
            those ops. ``None``: unbounded (GPUs: memory-bound anyway).
        matmul_flops: achieved FLOP/s of GEMMs by size, per dtype: points
            ``(FLOPs of one GEMM, FLOP/s)`` smallest first, interpolated in
            log-FLOPs (small GEMMs, e.g. tensor-parallel shards, run slower);
            a dtype not listed uses ``peak_flops``.
        attention_flops: achieved FLOP/s of the fused attention kernels per
            dtype (they reach far less than a matmul on some devices);
            empty: ``peak_flops``.
        op_time_scale: measured over predicted kernel seconds per aten op
            (base name, e.g. ``"bernoulli_"``), from real training steps on
            this machine (:mod:`hf_colossal_auto.calibration.op_scales`): what a
            kernel costs inside a step that the micro-benchmarks miss (random
            numbers, a bias copied before a GEMM, pages touched the first
            time). Empty: every op as the roofline prices it.
        rank_skew_s: mean seconds a rank waits, at a collective that
            synchronises it with its peers, for the slowest of them after one
            second of the same work on every rank: ranks drift apart (a shared
            host's other processes, caches, clocks). ``rank_skew_exponent``:
            how the wait grows with the work since the previous synchronisation,
            ``rank_skew_s * (seconds ** exponent)``; ``rank_skew_ranks``: the
            group size it was measured with (larger groups wait for a slower
            slowest, :func:`hardware.roofline.sync_wait`). Measured by
            calibration; 0 on presets (GPU kernels run alike on every rank).
        calibration: provenance of measured figures (host, date, torch
            version, the command): empty for datasheet presets.
    """

    name: str
    peak_flops: Mapping[str, float]
    memory_bandwidth: float
    memory_bytes: int
    intra_node_link: LinkSpec
    inter_node_link: LinkSpec
    devices_per_node: int
    kind: str
    kernel_overhead_s: float = field(default=None)  # type: ignore[assignment]
    host_overhead_s: float = field(default=None)  # type: ignore[assignment]
    dtensor_overhead_s: float = field(default=None)  # type: ignore[assignment]
    overlap_efficiency: float = field(default=None)  # type: ignore[assignment]
    matmul_flops: Mapping[str, tuple[tuple[float, float], ...]] = field(default_factory=dict)
    transcendental_rate: float | None = None
    attention_flops: Mapping[str, float] = field(default_factory=dict)
    op_time_scale: Mapping[str, float] = field(default_factory=dict)
    rank_skew_s: float = 0.0
    rank_skew_exponent: float = 1.0
    rank_skew_ranks: int = 2
    calibration: Mapping[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"DeviceSpec.name must be a non-empty string, got {self.name!r}")
        if self.kind not in DEVICE_KINDS:
            raise ValueError(f"DeviceSpec.kind must be one of {DEVICE_KINDS}, got {self.kind!r}")
        if not isinstance(self.peak_flops, Mapping) or not self.peak_flops:
            raise ValueError(f"DeviceSpec.peak_flops must be a non-empty mapping, got {self.peak_flops!r}")
        flops: dict[str, float] = {}
        for key, value in self.peak_flops.items():
            canon = canonical_dtype(key)
            _check_positive(f"DeviceSpec.peak_flops[{key!r}]", value)
            if canon in flops:
                raise ValueError(f"DeviceSpec.peak_flops has two entries for dtype {canon!r}")
            flops[canon] = float(value)
        if "float32" not in flops:
            raise ValueError(
                "DeviceSpec.peak_flops must contain a 'float32' entry (the fallback for unlisted dtypes); "
                f"got keys {sorted(flops)}"
            )
        object.__setattr__(self, "peak_flops", _FrozenTable(flops))
        _check_positive("DeviceSpec.memory_bandwidth", self.memory_bandwidth)
        object.__setattr__(self, "memory_bandwidth", float(self.memory_bandwidth))
        if (
            isinstance(self.memory_bytes, bool)
            or not isinstance(self.memory_bytes, int)
            or self.memory_bytes <= 0
        ):
            raise ValueError(
                f"DeviceSpec.memory_bytes must be a positive int (use parse_bytes for strings), got {self.memory_bytes!r}"
            )
        for link_name in ("intra_node_link", "inter_node_link"):
            if not isinstance(getattr(self, link_name), LinkSpec):
                raise ValueError(
                    f"DeviceSpec.{link_name} must be a LinkSpec, got {getattr(self, link_name)!r}"
                )
        if (
            isinstance(self.devices_per_node, bool)
            or not isinstance(self.devices_per_node, int)
            or self.devices_per_node < 1
        ):
            raise ValueError(
                f"DeviceSpec.devices_per_node must be an int >= 1, got {self.devices_per_node!r}"
            )
        if self.kernel_overhead_s is None:
            object.__setattr__(self, "kernel_overhead_s", _DEFAULT_KERNEL_OVERHEAD_S[self.kind])
        elif (
            isinstance(self.kernel_overhead_s, bool)
            or not isinstance(self.kernel_overhead_s, (int, float))
            or not math.isfinite(self.kernel_overhead_s)
            or self.kernel_overhead_s < 0
        ):
            raise ValueError(
                f"DeviceSpec.kernel_overhead_s must be a finite number >= 0, got {self.kernel_overhead_s!r}"
            )
        else:
            object.__setattr__(self, "kernel_overhead_s", float(self.kernel_overhead_s))
        for name, defaults in (
            ("host_overhead_s", _DEFAULT_HOST_OVERHEAD_S),
            ("dtensor_overhead_s", _DEFAULT_DTENSOR_OVERHEAD_S),
        ):
            value = getattr(self, name)
            if value is None:
                value = defaults[self.kind]
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
                raise ValueError(f"DeviceSpec.{name} must be a finite number >= 0, got {value!r}")
            object.__setattr__(self, name, float(value))
        overlap = self.overlap_efficiency
        if overlap is None:
            overlap = _DEFAULT_OVERLAP_EFFICIENCY[self.kind]
        if isinstance(overlap, bool) or not isinstance(overlap, (int, float)) or not 0.0 <= overlap <= 1.0:
            raise ValueError(f"DeviceSpec.overlap_efficiency must be in [0, 1], got {overlap!r}")
        object.__setattr__(self, "overlap_efficiency", float(overlap))
        attention: dict[str, float] = {}
        for key, value in dict(self.attention_flops).items():
            _check_positive(f"DeviceSpec.attention_flops[{key!r}]", value)
            attention[canonical_dtype(key)] = float(value)
        object.__setattr__(self, "attention_flops", _FrozenTable(attention))
        if self.transcendental_rate is not None:
            _check_positive("DeviceSpec.transcendental_rate", self.transcendental_rate)
            object.__setattr__(self, "transcendental_rate", float(self.transcendental_rate))
        curves: dict[str, tuple[tuple[float, float], ...]] = {}
        for key, points in dict(self.matmul_flops).items():
            curve = tuple(sorted((float(f), float(r)) for f, r in points))
            if not curve or any(not (f > 0 and r > 0 and math.isfinite(f * r)) for f, r in curve):
                raise ValueError(
                    f"DeviceSpec.matmul_flops[{key!r}] must be (flops, rate) pairs > 0, got {points!r}"
                )
            curves[canonical_dtype(key)] = curve
        object.__setattr__(self, "matmul_flops", _FrozenTable(curves))
        scales: dict[str, float] = {}
        for key, value in dict(self.op_time_scale).items():
            _check_positive(f"DeviceSpec.op_time_scale[{key!r}]", value)
            scales[str(key)] = float(value)
        object.__setattr__(self, "op_time_scale", _FrozenTable(scales))
        self._check_rank_skew()
        object.__setattr__(self, "calibration", _FrozenTable(dict(self.calibration)))

    def _check_rank_skew(self) -> None:
        skew, exponent, ranks = self.rank_skew_s, self.rank_skew_exponent, self.rank_skew_ranks
        if isinstance(skew, bool) or not isinstance(skew, (int, float)) or not 0 <= skew < math.inf:
            raise ValueError(f"DeviceSpec.rank_skew_s must be a finite number >= 0, got {skew!r}")
        if isinstance(exponent, bool) or not isinstance(exponent, (int, float)) or not 0 < exponent <= 1:
            raise ValueError(f"DeviceSpec.rank_skew_exponent must be in (0, 1], got {exponent!r}")
        if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 2:
            raise ValueError(f"DeviceSpec.rank_skew_ranks must be an int >= 2, got {ranks!r}")
        object.__setattr__(self, "rank_skew_s", float(skew))
        object.__setattr__(self, "rank_skew_exponent", float(exponent))

    def with_overrides(self, **overrides: Any) -> DeviceSpec:
        """Return a copy with some fields replaced, e.g. ``spec.with_overrides(memory_bytes="40GiB")``.

        Convenience coercions (so that overrides can come straight from a CLI or
        JSON): ``memory_bytes`` may be a size string, links may be dicts.
        ``peak_flops`` replaces the whole table (it is not merged) so that a
        stale entry can never survive silently.
        """
        valid = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(overrides) - valid)
        if unknown:
            raise ValueError(f"Unknown DeviceSpec field(s) {unknown}; valid fields: {sorted(valid)}")
        return dataclasses.replace(self, **_coerce_fields(overrides))

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready representation; :func:`device_from_dict` is the inverse."""
        return {
            "name": self.name,
            "peak_flops": dict(self.peak_flops),
            "memory_bandwidth": self.memory_bandwidth,
            "memory_bytes": self.memory_bytes,
            "intra_node_link": self.intra_node_link.to_dict(),
            "inter_node_link": self.inter_node_link.to_dict(),
            "devices_per_node": self.devices_per_node,
            "kind": self.kind,
            "kernel_overhead_s": self.kernel_overhead_s,
            "host_overhead_s": self.host_overhead_s,
            "dtensor_overhead_s": self.dtensor_overhead_s,
            "overlap_efficiency": self.overlap_efficiency,
            "matmul_flops": {k: [list(p) for p in v] for k, v in self.matmul_flops.items()},
            "transcendental_rate": self.transcendental_rate,
            "attention_flops": dict(self.attention_flops),
            "op_time_scale": dict(self.op_time_scale),
            "rank_skew_s": self.rank_skew_s,
            "rank_skew_exponent": self.rank_skew_exponent,
            "rank_skew_ranks": self.rank_skew_ranks,
            "calibration": dict(self.calibration),
        }


def _coerce_fields(values: Mapping[str, Any]) -> dict[str, Any]:
    """Turn JSON/CLI-friendly field values into the types DeviceSpec stores."""
    out = dict(values)
    if "memory_bytes" in out:
        out["memory_bytes"] = parse_bytes(out["memory_bytes"])
    for link_name in ("intra_node_link", "inter_node_link"):
        if link_name in out and isinstance(out[link_name], Mapping):
            out[link_name] = LinkSpec.from_dict(out[link_name])
    return out


def load_device_spec(path: str | os.PathLike[str]) -> DeviceSpec:
    """A :class:`DeviceSpec` from a JSON file (``hf-colossal-auto calibrate --out`` or hand-written).

    Raises:
        ValueError: naming the file, when it is missing, not JSON or not a device spec.
    """
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError as exc:
        raise ValueError(
            f"Device spec file {os.fspath(path)!r} does not exist; write one with `hf-colossal-auto calibrate "
            "--out FILE` or pass a preset name (`hf-colossal-auto devices`)"
        ) from exc
    except (OSError, ValueError) as exc:
        raise ValueError(f"Device spec file {os.fspath(path)!r} is not readable JSON: {exc}") from exc
    if not isinstance(data, Mapping):
        raise ValueError(f"Device spec file {os.fspath(path)!r} holds {type(data).__name__}, not an object")
    try:
        return device_from_dict(data)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"Device spec file {os.fspath(path)!r}: {exc}") from exc


def save_device_spec(spec: DeviceSpec, path: str | os.PathLike[str]) -> None:
    """Write ``spec`` as JSON (what :func:`load_device_spec` and every ``device=`` argument read)."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump(spec.to_dict(), f, indent=2, sort_keys=True)
        f.write("\n")


def device_from_dict(data: Mapping[str, Any]) -> DeviceSpec:
    """Build a :class:`DeviceSpec` from :meth:`DeviceSpec.to_dict` output (or hand-written JSON).

    The overheads, ``attention_flops`` and ``calibration`` are optional; ``memory_bytes`` may be a size
    string such as ``"80GiB"``.  Missing or unknown keys raise ``ValueError`` naming them.
    """
    valid = {f.name for f in dataclasses.fields(DeviceSpec)}
    required = valid - {
        "kernel_overhead_s",
        "host_overhead_s",
        "dtensor_overhead_s",
        "overlap_efficiency",
        "matmul_flops",
        "transcendental_rate",
        "attention_flops",
        "op_time_scale",
        "rank_skew_s",
        "rank_skew_exponent",
        "rank_skew_ranks",
        "calibration",
    }
    missing = sorted(required - set(data))
    unknown = sorted(set(data) - valid)
    if missing or unknown:
        raise ValueError(
            f"Invalid device dict: missing keys {missing}, unknown keys {unknown}; expected keys {sorted(valid)}"
        )
    return DeviceSpec(**_coerce_fields(data))
