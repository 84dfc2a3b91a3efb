"""What a calibration of a device kind measures and starts from: the device, and the spec its figures replace
(the GPU's datasheet preset for its links and memory, or the CPU template)."""

from __future__ import annotations

import logging

import torch

from ..hardware.catalog import STATIC_CPU_SPEC, device_from_cuda_name, get_device
from ..hardware.host_cache import host_memory_bytes
from ..hardware.spec import DeviceSpec

__all__ = ["base_spec", "target_device"]

logger = logging.getLogger(__name__)


def target_device(kind: str) -> torch.device:
    """The device a calibration of ``kind`` measures: the current GPU, or the CPU."""
    if kind == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def base_spec(kind: str) -> DeviceSpec:
    """The spec calibration starts from: the preset of this GPU (links, memory), or the CPU template."""
    if kind == "cpu":
        return STATIC_CPU_SPEC.with_overrides(memory_bytes=host_memory_bytes())
    index = torch.cuda.current_device()
    name = torch.cuda.get_device_name(index)
    total = int(torch.cuda.get_device_properties(index).total_memory)
    try:
        return device_from_cuda_name(name, total)
    except ValueError:
        logger.warning("no preset for %s: its links keep PCIe/Ethernet defaults until measured", name)
        return get_device("l4").with_overrides(name=name.lower().replace(" ", "-"), memory_bytes=total)
