"""Hardware model: device catalog, roofline, interconnect/collective costs and cluster layout, and single
measurements of the device at hand. Imports nothing of the project but ``units`` (what to measure and when is
:mod:`hf_colossal_auto.calibration`'s job).

Everything here is in seconds, bytes and FLOP(/s).  Typical use::

    from hf_colossal_auto.hardware import ClusterSpec, get_device, op_time

    cluster = ClusterSpec(get_device("a100"), num_devices=16)
    for shape in cluster.mesh_shapes():
        link = cluster.axis_link(shape, axis=len(shape) - 1)
"""

from hf_colossal_auto.hardware.catalog import (
    STATIC_CPU_SPEC,
    DeviceSpec,
    LinkSpec,
    canonical_dtype,
    detect_device,
    device_aliases,
    device_from_cuda_name,
    device_from_dict,
    get_device,
    list_devices,
    memory_budget_default,
    set_cpu_spec_provider,
    static_presets,
)
from hf_colossal_auto.hardware.cluster import ClusterSpec, axis_spans_nodes, mesh_shapes
from hf_colossal_auto.hardware.comm import (
    COLLECTIVE_KINDS,
    CommCalibration,
    calibrate_link,
    canonical_collective,
    collective_coefficients,
    collective_time,
    fit_alpha_beta,
)
from hf_colossal_auto.hardware.host_cache import CACHE_ENV, NO_CALIBRATE_ENV, cache_dir, calibration_disabled
from hf_colossal_auto.hardware.roofline import (
    compute_time,
    is_compute_bound,
    memory_time,
    op_time,
    peak_flops_for,
    ridge_intensity,
)

__all__ = [
    "CACHE_ENV",
    "COLLECTIVE_KINDS",
    "NO_CALIBRATE_ENV",
    "STATIC_CPU_SPEC",
    "ClusterSpec",
    "CommCalibration",
    "DeviceSpec",
    "LinkSpec",
    "axis_spans_nodes",
    "cache_dir",
    "calibrate_link",
    "calibration_disabled",
    "canonical_collective",
    "canonical_dtype",
    "collective_coefficients",
    "collective_time",
    "compute_time",
    "detect_device",
    "device_aliases",
    "device_from_cuda_name",
    "device_from_dict",
    "fit_alpha_beta",
    "get_device",
    "is_compute_bound",
    "list_devices",
    "memory_budget_default",
    "memory_time",
    "mesh_shapes",
    "op_time",
    "peak_flops_for",
    "ridge_intensity",
    "set_cpu_spec_provider",
    "static_presets",
]
