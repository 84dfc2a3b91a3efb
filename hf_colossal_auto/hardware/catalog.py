"""Device catalog: peak compute, memory and interconnect figures per accelerator.

Every number is in SI base units (FLOP/s, bytes/s, bytes, seconds) and comes
from the vendor datasheet of the *dense* (no structured sparsity) figure; the
source of each one is recorded next to it and in ``docs/hardware.md``.  The
planner's cost model is only as good as these figures, so they are peaks, not
"achievable" guesses: achievable efficiency is the profiler's and the
calibration's job, and mixing fudge factors in here would hide where an
estimate went wrong.

The ``cpu`` entry is special: it describes the machine we are running on, so
:func:`get_device` returns the spec the installed provider measures (see
:func:`set_cpu_spec_provider`; :mod:`hf_colossal_auto.calibration.cpu` installs it) instead of a static one.

The spec classes and their JSON form live in :mod:`hf_colossal_auto.hardware.spec`; they are importable from
here too, where most callers have always found them.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable

from hf_colossal_auto.hardware.spec import (
    DEVICE_KINDS,
    DeviceSpec,
    LinkSpec,
    canonical_dtype,
    device_from_dict,
    load_device_spec,
    save_device_spec,
)
from hf_colossal_auto.units import GB, GiB

__all__ = [
    "LinkSpec",
    "DeviceSpec",
    "DEVICE_KINDS",
    "canonical_dtype",
    "get_device",
    "list_devices",
    "device_aliases",
    "device_from_dict",
    "load_device_spec",
    "save_device_spec",
    "device_from_cuda_name",
    "detect_device",
    "memory_budget_default",
    "set_cpu_spec_provider",
    "static_presets",
    "STATIC_CPU_SPEC",
    "MEMORY_MARGIN_FRACTION",
    "MEMORY_MARGIN_MIN_BYTES_GPU",
]

# ---------------------------------------------------------------------------
# Presets.  Sources (see docs/hardware.md for the full table):
#   [A100-DS]  NVIDIA A100 Tensor Core GPU datasheet (SXM4 columns, dense figures).
#   [H100-DS]  NVIDIA H100 Tensor Core GPU datasheet (H100 SXM column; the
#              datasheet's tensor figures include sparsity, dense = half).
#   [H200-DS]  NVIDIA H200 Tensor Core GPU datasheet (H200 SXM column; same
#              GH100 compute as H100 SXM, sparsity halved as above).
#   [V100-DS]  NVIDIA Tesla V100 datasheet (V100 SXM2 column).
#   [L4-DS]    NVIDIA L4 Tensor Core GPU datasheet (dense = half the sparse figures).
#   [DGX]      DGX-1 (V100: 4x EDR 100 Gb/s IB per 8 GPUs), DGX A100 (8x HDR
#              200 Gb/s, one per GPU), DGX H100 / H200 (8x NDR 400 Gb/s, one per GPU)
#              system user guides.
#   [NCCL-LAT] NCCL src/graph/tuning.cc hwLat table, Ring/Simple protocol:
#              3.4 us per step over NVLink, 5.7 us over PCIe, 9.6 us over the network.
# NVLink figures in datasheets are bidirectional totals; LinkSpec wants one
# direction, so they are halved.  Memory capacities are the nominal GiB sizes of
# the HBM/GDDR stacks; the driver exposes slightly less, which the margin in
# memory_budget_default absorbs.
# ---------------------------------------------------------------------------

_NVLINK_STEP_LATENCY_S = 3.4e-6  # [NCCL-LAT] NVLink, Ring/Simple
_PCIE_STEP_LATENCY_S = 5.7e-6  # [NCCL-LAT] PCI, Ring/Simple
_NET_STEP_LATENCY_S = 9.6e-6  # [NCCL-LAT] NET, Ring/Simple

_HDR_IB_PER_GPU = LinkSpec(bandwidth=25 * GB, latency=_NET_STEP_LATENCY_S)  # [DGX] 200 Gb/s per GPU
_NDR_IB_PER_GPU = LinkSpec(bandwidth=50 * GB, latency=_NET_STEP_LATENCY_S)  # [DGX] 400 Gb/s per GPU

_A100_FLOPS = {
    "float32": 19.5e12,  # [A100-DS] FP32
    "tf32": 156e12,  # [A100-DS] TF32 Tensor Core, dense
    "bfloat16": 312e12,  # [A100-DS] BFLOAT16 Tensor Core, dense
    "float16": 312e12,  # [A100-DS] FP16 Tensor Core, dense
}
_A100_NVLINK3 = LinkSpec(
    bandwidth=300 * GB, latency=_NVLINK_STEP_LATENCY_S
)  # [A100-DS] 600 GB/s bidirectional

_H100_FLOPS = {
    "float32": 67e12,  # [H100-DS] FP32 (SXM)
    "tf32": 494.5e12,  # [H100-DS] TF32 Tensor Core 989 TFLOPS with sparsity -> dense half
    "bfloat16": 989e12,  # [H100-DS] BF16 Tensor Core 1,979 TFLOPS with sparsity -> dense half
    "float16": 989e12,  # [H100-DS] FP16 Tensor Core 1,979 TFLOPS with sparsity -> dense half
    "float8": 1979e12,  # [H100-DS] FP8 Tensor Core 3,958 TFLOPS with sparsity -> dense half
}
_H100_NVLINK4 = LinkSpec(
    bandwidth=450 * GB, latency=_NVLINK_STEP_LATENCY_S
)  # [H100-DS] 900 GB/s bidirectional

_PRESETS: dict[str, DeviceSpec] = {
    "a100-40gb": DeviceSpec(
        name="a100-40gb",
        peak_flops=_A100_FLOPS,
        memory_bandwidth=1555 * GB,  # [A100-DS] HBM2, 40GB SXM4
        memory_bytes=40 * GiB,  # [A100-DS] 40GB HBM2
        intra_node_link=_A100_NVLINK3,
        inter_node_link=_HDR_IB_PER_GPU,
        devices_per_node=8,  # [DGX] DGX A100 / HGX A100 8-GPU
        kind="cuda",
    ),
    "a100-80gb": DeviceSpec(
        name="a100-80gb",
        peak_flops=_A100_FLOPS,
        memory_bandwidth=2039 * GB,  # [A100-DS] HBM2e, 80GB SXM4
        memory_bytes=80 * GiB,  # [A100-DS] 80GB HBM2e
        intra_node_link=_A100_NVLINK3,
        inter_node_link=_HDR_IB_PER_GPU,
        devices_per_node=8,  # [DGX]
        kind="cuda",
    ),
    "h100-80gb": DeviceSpec(
        name="h100-80gb",
        peak_flops=_H100_FLOPS,
        memory_bandwidth=3350 * GB,  # [H100-DS] HBM3 3.35 TB/s (SXM)
        memory_bytes=80 * GiB,  # [H100-DS] 80GB HBM3
        intra_node_link=_H100_NVLINK4,
        inter_node_link=_NDR_IB_PER_GPU,
        devices_per_node=8,  # [DGX] DGX H100 / HGX H100 8-GPU
        kind="cuda",
    ),
    "h200": DeviceSpec(
        name="h200",
        peak_flops=_H100_FLOPS,  # [H200-DS] identical GH100 compute to H100 SXM
        memory_bandwidth=4800 * GB,  # [H200-DS] HBM3e 4.8 TB/s
        memory_bytes=141 * GiB,  # [H200-DS] 141GB HBM3e
        intra_node_link=_H100_NVLINK4,  # [H200-DS] NVLink 900 GB/s bidirectional
        inter_node_link=_NDR_IB_PER_GPU,
        devices_per_node=8,  # [DGX] DGX H200 / HGX H200 8-GPU
        kind="cuda",
    ),
    "v100-32gb": DeviceSpec(
        name="v100-32gb",
        peak_flops={
            "float32": 15.7e12,  # [V100-DS] single precision, SXM2
            "float16": 125e12,  # [V100-DS] tensor performance, SXM2
            # No bfloat16 / tf32 hardware on Volta: those dtypes fall back to float32.
        },
        memory_bandwidth=900 * GB,  # [V100-DS] HBM2 900 GB/s
        memory_bytes=32 * GiB,  # [V100-DS] 32GB HBM2
        intra_node_link=LinkSpec(
            bandwidth=150 * GB, latency=_NVLINK_STEP_LATENCY_S
        ),  # [V100-DS] 300 GB/s bidir
        inter_node_link=LinkSpec(
            bandwidth=6.25 * GB, latency=_NET_STEP_LATENCY_S
        ),  # [DGX] 4x100 Gb/s / 8 GPUs
        devices_per_node=8,  # [DGX] DGX-1
        kind="cuda",
    ),
    "l4": DeviceSpec(
        name="l4",
        peak_flops={
            "float32": 30.3e12,  # [L4-DS] FP32
            "tf32": 60e12,  # [L4-DS] TF32 Tensor Core 120 TFLOPS with sparsity -> dense half
            "bfloat16": 121e12,  # [L4-DS] BF16 Tensor Core 242 TFLOPS with sparsity -> dense half
            "float16": 121e12,  # [L4-DS] FP16 Tensor Core 242 TFLOPS with sparsity -> dense half
            "float8": 242.5e12,  # [L4-DS] FP8 Tensor Core 485 TFLOPS with sparsity -> dense half
        },
        memory_bandwidth=300 * GB,  # [L4-DS] GDDR6 300 GB/s
        memory_bytes=24 * GiB,  # [L4-DS] 24GB GDDR6
        # [L4-DS] PCIe Gen4 x16 64 GB/s bidirectional; no NVLink.
        intra_node_link=LinkSpec(bandwidth=32 * GB, latency=_PCIE_STEP_LATENCY_S),
        # 8x L4 cloud nodes (GCP g2-standard-96, AWS g6.48xlarge) share one 100 Gb/s
        # NIC: 12.5 GB/s / 8 GPUs per device.
        inter_node_link=LinkSpec(bandwidth=12.5 * GB / 8, latency=_NET_STEP_LATENCY_S),
        devices_per_node=8,
        kind="cuda",
    ),
}

# Static description of "a CPU" used when calibration is disabled
# (HF_COLOSSAL_AUTO_NO_CALIBRATE=1) or as the template calibration fills in.
# Deliberately conservative for a small 2-4 core x86 VM, so that tests and CI
# are deterministic and no plan made without calibration is over-optimistic.
# Collective figures model gloo over loopback TCP: ~2 GB/s and ~50 us per step.
STATIC_CPU_SPEC = DeviceSpec(
    name="cpu",
    peak_flops={
        "float32": 50e9,
        # CPUs without AVX512-BF16/AMX emulate bf16 and fp16 matmuls; fp16 in
        # particular can be 100x slower than fp32 on such hosts.
        "bfloat16": 10e9,
        "float16": 1e9,
    },
    memory_bandwidth=10 * GB,
    memory_bytes=16 * GiB,
    # median elements/s of exp, tanh, silu, gelu, sigmoid, softmax, log_softmax on one thread of the 2-core
    # dev VM (0.18-0.91 G/s; `calibrate` measures it)
    transcendental_rate=0.6e9,
    intra_node_link=LinkSpec(bandwidth=2 * GB, latency=50e-6),
    inter_node_link=LinkSpec(bandwidth=2 * GB, latency=50e-6),
    devices_per_node=1,
    kind="cpu",
)

_CANONICAL_NAMES: tuple[str, ...] = tuple(sorted([*_PRESETS, "cpu"]))

_ALIASES: dict[str, str] = {
    "a100": "a100-80gb",
    "a100-80g": "a100-80gb",
    "a100-sxm": "a100-80gb",
    "a100-sxm4": "a100-80gb",
    "a100-sxm4-80gb": "a100-80gb",
    "a100-sxm-80gb": "a100-80gb",
    "a100-40g": "a100-40gb",
    "a100-sxm4-40gb": "a100-40gb",
    "a100-sxm-40gb": "a100-40gb",
    "h100": "h100-80gb",
    "h100-sxm": "h100-80gb",
    "h100-sxm5": "h100-80gb",
    "h100-sxm-80gb": "h100-80gb",
    "h100-sxm5-80gb": "h100-80gb",
    "h100-80gb-hbm3": "h100-80gb",
    "h200-sxm": "h200",
    "h200-141gb": "h200",
    "h200-sxm-141gb": "h200",
    "v100": "v100-32gb",
    "v100-sxm2": "v100-32gb",
    "v100-sxm2-32gb": "v100-32gb",
    "l4-24gb": "l4",
    "host": "cpu",
}


def _normalize_name(name: str) -> str:
    text = re.sub(r"[\s_]+", "-", name.strip().lower())
    for prefix in ("nvidia-", "tesla-"):
        if text.startswith(prefix):
            text = text[len(prefix) :]
    return text


def list_devices() -> list[str]:
    """Canonical names of every catalog device, sorted."""
    return list(_CANONICAL_NAMES)


def device_aliases() -> dict[str, str]:
    """Alias -> canonical name mapping accepted by :func:`get_device`."""
    return dict(_ALIASES)


_cpu_spec_provider: Callable[[], DeviceSpec] | None = None


def set_cpu_spec_provider(provider: Callable[[], DeviceSpec] | None) -> None:
    """Install what ``get_device("cpu")`` returns: this host's measured spec.

    Why a hook: measuring the host is calibration's job (:mod:`hf_colossal_auto.calibration.cpu` benchmarks
    its kernels and caches the result), and calibration needs the capture's FLOP counting, which hardware/
    may not import. Loading ``hf_colossal_auto`` installs
    :func:`~hf_colossal_auto.calibration.cpu.cpu_device_spec`; ``None`` (or no provider) makes ``"cpu"`` the static :data:`STATIC_CPU_SPEC`."""
    global _cpu_spec_provider
    _cpu_spec_provider = provider


def get_device(name: str | DeviceSpec) -> DeviceSpec:
    """Look up a device by name (case-insensitive; ``_``/spaces count as ``-``; aliases allowed), or load a
    calibrated spec from a ``.json`` file written by ``hf-colossal-auto calibrate``.

    ``"cpu"`` returns the calibrated spec of this host (the provider :func:`set_cpu_spec_provider`
    installed: :func:`hf_colossal_auto.calibration.cpu.cpu_device_spec`).  A
    :class:`DeviceSpec` is returned unchanged so callers can accept either.

    Raises:
        ValueError: for an unknown name, listing every valid name and alias.
    """
    if isinstance(name, DeviceSpec):
        return name
    if isinstance(name, os.PathLike) or (isinstance(name, str) and name.lower().endswith(".json")):
        return load_device_spec(name)
    if not isinstance(name, str):
        raise ValueError(f"Device name must be a string or DeviceSpec, got {name!r}")
    key = _normalize_name(name)
    key = _ALIASES.get(key, key)
    if key == "cpu":
        return _cpu_spec_provider() if _cpu_spec_provider is not None else STATIC_CPU_SPEC
    spec = _PRESETS.get(key)
    if spec is None:
        raise ValueError(
            f"Unknown device {name!r}. Valid names: {', '.join(_CANONICAL_NAMES)}. "
            f"Aliases: {', '.join(f'{a} -> {c}' for a, c in sorted(_ALIASES.items()))}. "
            "For other hardware build a DeviceSpec (e.g. get_device('a100-80gb').with_overrides(...) "
            "or device_from_dict)."
        )
    return spec


# (pattern on the lower-cased CUDA device name, preset).  Only SXM parts map to
# the SXM presets: PCIe variants have lower clocks/bandwidth and no NVSwitch,
# so silently using SXM figures for them would overestimate them.
_CUDA_NAME_PATTERNS: tuple[tuple[str, str], ...] = (
    (r"\bh200\b(?!.*\bnvl\b)", "h200"),
    (r"\bh100\b.*(\bsxm|\bhbm3\b)", "h100-80gb"),
    (r"\ba100\b.*\bsxm.*\b80\s*gb\b", "a100-80gb"),
    (r"\ba100\b.*\bsxm.*\b40\s*gb\b", "a100-40gb"),
    (r"\bv100\b.*\bsxm2\b.*\b32\s*gb\b", "v100-32gb"),
    (r"\bl4\b", "l4"),
)


def device_from_cuda_name(cuda_name: str, total_memory: int | None = None) -> DeviceSpec:
    """Map a ``torch.cuda.get_device_name()`` string to a preset.

    ``total_memory`` (``torch.cuda.get_device_properties(i).total_memory``)
    replaces the nominal capacity, because the driver-visible size is what the
    allocator can actually hand out.

    Raises:
        ValueError: when no preset matches, so an unlisted GPU is never planned
            with another GPU's figures.
    """
    lowered = cuda_name.lower()
    for pattern, preset in _CUDA_NAME_PATTERNS:
        if re.search(pattern, lowered):
            spec = _PRESETS[preset]
            if total_memory is not None:
                spec = spec.with_overrides(memory_bytes=int(total_memory))
            return spec
    raise ValueError(
        f"No catalog entry matches CUDA device {cuda_name!r}. Known devices: {', '.join(_CANONICAL_NAMES)}. "
        "Pass a DeviceSpec built with get_device(...).with_overrides(...) or device_from_dict(...)."
    )


def detect_device() -> DeviceSpec:
    """Spec of the device this process would train on: the current CUDA device, else the CPU."""
    import torch

    if torch.cuda.is_available():
        index = torch.cuda.current_device()
        props = torch.cuda.get_device_properties(index)
        return device_from_cuda_name(torch.cuda.get_device_name(index), int(props.total_memory))
    return get_device("cpu")


# Reserved share of device memory that the planner must not plan into.  On GPUs
# it covers: the CUDA context and cuBLAS/cuDNN workspaces (several hundred MiB,
# allocated outside the caching allocator), NCCL communicator buffers
# (NCCL_BUFFSIZE x channels x peers, again hundreds of MiB), caching-allocator
# fragmentation (typically 5-10% of peak reserved memory), and the gap between
# nominal and driver-visible capacity (e.g. 40 GiB nominal vs 39.5 GiB visible on
# A100-40GB).  The 1 GiB floor covers the fixed-size part of that on small GPUs
# where 10% would not.  On CPU the margin leaves room for the OS and the
# Python/torch runtime of the process itself.
MEMORY_MARGIN_FRACTION = 0.10
MEMORY_MARGIN_MIN_BYTES_GPU = 1 * GiB


def memory_budget_default(spec: DeviceSpec) -> int:
    """Bytes the planner may use per device: capacity minus a safety margin.

    The margin is ``max(10% of capacity, 1 GiB)`` on GPUs and 10% on CPUs (see
    ``MEMORY_MARGIN_FRACTION`` for why).  The 1 GiB floor is capped at a quarter
    of the capacity so that deliberately tiny custom specs (used to force
    sharding in tests) still get a positive budget.
    """
    capacity = spec.memory_bytes
    margin = math.ceil(capacity * MEMORY_MARGIN_FRACTION)
    if spec.kind == "cuda":
        margin = max(margin, min(MEMORY_MARGIN_MIN_BYTES_GPU, capacity // 4))
    return capacity - margin


def static_presets() -> dict[str, DeviceSpec]:
    """Every catalog entry without running calibration (``cpu`` is :data:`STATIC_CPU_SPEC`).

    For tests and documentation tooling that must not depend on the host.
    """
    return {**_PRESETS, "cpu": STATIC_CPU_SPEC}
