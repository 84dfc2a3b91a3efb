"""hf-colossal-auto: automatic tensor parallelism and activation recompute for HuggingFace models.

The pipeline (see docs/ARCHITECTURE.md): capture -> profile -> strategies -> solve -> apply -> integrations.
"""

from .calibration.cpu import cpu_device_spec as _cpu_device_spec
from .capture import CaptureError, StepGraph, trace_training_step
from .hardware import DeviceSpec, get_device, list_devices, set_cpu_spec_provider
from .models import build_model, list_presets, load_config, make_example_inputs
from .profile import ProfileReport, profile_model

__version__ = "0.1.0"

# get_device("cpu") is this host measured (once, cached): calibration does the measuring, which hardware/
# cannot import, so the package installs it here, before any caller can ask.
set_cpu_spec_provider(_cpu_device_spec)

# public name -> the module that defines it; loaded on first use (the solver imports pulp, the runtime
# torch.distributed, the integrations accelerate and transformers' Trainer)
_LAZY = {
    "Plan": ".plan",
    "plan_model": ".solve.planner",
    "evaluate_plan": ".solve.planner",
    "Estimate": ".solve.planner",
    "InfeasibleError": ".solve.problem",
    "RoutingLoad": ".capture.moe",
    "measure_routing": ".capture.moe",
    "autoparallelize": ".integrations.autoparallelize",
    "apply_plan": ".apply",
    "PlanMismatchError": ".apply",
    "load_pretrained": ".apply.pretrained",
    "save_pretrained": ".apply.pretrained",
    "save_checkpoint": ".apply.checkpoint",
    "load_checkpoint": ".apply.checkpoint",
    "data_parallel_info": ".apply.data",
    "DataParallelInfo": ".apply.data",
    "shard_batch": ".apply.data",
    "accumulate": ".apply.micro_batch",
    "micro_batches": ".apply.micro_batch",
    "MicroBatch": ".apply.micro_batch",
    "no_gradient_sync": ".apply.micro_batch",
    "pipeline_runner": ".apply.pipeline",
    "hand_pipeline_plan": ".pipeline_layout",
    "with_context_parallel": ".apply.context_parallel",
    "hand_context_parallel_plan": ".apply.context_parallel",
    "ContextParallelError": ".apply.context_parallel",
    "pipeline_plan_from": ".pipeline_layout",
    "data_parallel_loader": ".integrations.data",
    "calibrate": ".calibration",
    "AutoParallelPlugin": ".integrations",
    "AutoParallelAccelerator": ".integrations",
    "AutoParallelCallback": ".integrations",
}


def __getattr__(name: str):
    """The planner, the runtime and the integrations load on first use."""
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "AutoParallelAccelerator",
    "AutoParallelCallback",
    "AutoParallelPlugin",
    "DataParallelInfo",
    "Estimate",
    "InfeasibleError",
    "MicroBatch",
    "Plan",
    "PlanMismatchError",
    "RoutingLoad",
    "accumulate",
    "apply_plan",
    "autoparallelize",
    "calibrate",
    "data_parallel_info",
    "data_parallel_loader",
    "evaluate_plan",
    "load_checkpoint",
    "load_pretrained",
    "measure_routing",
    "micro_batches",
    "no_gradient_sync",
    "hand_pipeline_plan",
    "with_context_parallel",
    "hand_context_parallel_plan",
    "ContextParallelError",
    "pipeline_plan_from",
    "pipeline_runner",
    "plan_model",
    "save_checkpoint",
    "save_pretrained",
    "shard_batch",
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
