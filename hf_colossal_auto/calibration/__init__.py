"""Calibration: the machine at hand measured into a :class:`~hf_colossal_auto.hardware.DeviceSpec`.

hardware/ holds the device model and single measurements; this package decides what to measure, in which
order, on which process group, and where the result is kept:

* :mod:`.device`: ``calibrate()``, kernels (:mod:`.kernels`), per-op overheads and collectives into one spec;
* :mod:`.overheads`: per-op host overheads (the only module here that runs the planner and the runtime);
* :mod:`.op_scales`: in-step op scales from real forward/backward passes (``calibrate --step-model``);
* :mod:`.machine`: ``hf-colossal-auto calibrate`` (overheads first, then the job's group, then the rest);
* :mod:`.cpu`: the ``cpu`` preset, measured once per host and cached (what ``get_device("cpu")`` returns);
* :mod:`.job`: ``device="calibrate"`` for the integrations, one cached spec per machine and job shape.
"""

from .cpu import CpuBenchmarkResult, clear_cpu_calibration_memo, cpu_device_spec, run_cpu_benchmark
from .device import calibrate, measure_device
from .job import CALIBRATE, calibrated_device, calibration_cache_path, resolve_device
from .machine import MachineCalibration, calibrate_machine
from .op_scales import StepScales, format_scales, measure_op_time_scales, with_op_time_scales
from .overheads import OVERHEAD_MODELS, measure_overheads

__all__ = [
    "CALIBRATE",
    "OVERHEAD_MODELS",
    "CpuBenchmarkResult",
    "MachineCalibration",
    "StepScales",
    "calibrate",
    "calibrate_machine",
    "calibrated_device",
    "calibration_cache_path",
    "clear_cpu_calibration_memo",
    "cpu_device_spec",
    "format_scales",
    "measure_device",
    "measure_op_time_scales",
    "measure_overheads",
    "resolve_device",
    "run_cpu_benchmark",
    "with_op_time_scales",
]
