"""hf-colossal-auto: automatic tensor parallelism and activation recompute for HuggingFace models.

The pipeline (see docs/ARCHITECTURE.md): capture -> profile -> strategies -> solve -> apply -> integrations.
"""

from .capture import CaptureError, StepGraph, trace_training_step
from .hardware import DeviceSpec, get_device, list_devices
from .models import build_model, list_presets, load_config, make_example_inputs
from .profile import ProfileReport, profile_model

__version__ = "0.1.0"

_LAZY = {
    "AutoParallelPlugin",
    "AutoParallelAccelerator",
    "AutoParallelCallback",
    "autoparallelize",
    "calibrate",
}


def __getattr__(name: str):
    """Integrations and the runtime load on first use (they import accelerate / torch.distributed)."""
    if name == "autoparallelize":
        from .apply import autoparallelize

        return autoparallelize
    if name == "calibrate":
        from .calibration import calibrate

        return calibrate
    if name in _LAZY:
        from . import integrations

        return getattr(integrations, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "AutoParallelAccelerator",
    "AutoParallelCallback",
    "AutoParallelPlugin",
    "autoparallelize",
    "calibrate",
    "CaptureError",
    "DeviceSpec",
    "ProfileReport",
    "StepGraph",
    "build_model",
    "get_device",
    "list_devices",
    "list_presets",
    "load_config",
    "make_example_inputs",
    "profile_model",
    "trace_training_step",
]
