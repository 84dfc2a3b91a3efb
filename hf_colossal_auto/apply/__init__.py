"""Apply a Plan to the live model (DTensor parameters on a DP x TP mesh)."""

from .checkpoint import consolidated_state_dict, load_checkpoint, save_checkpoint, save_pretrained
from .dtensor_rules import register_runtime_rules
from .materialize import MaterializeReport, MetaInitError, is_meta_model, materialize_meta_model
from .pretrained import LoadReport, PretrainedLoadError, SaveCollectiveError, SaveReport, load_pretrained
from .runtime import (
    PlanMismatchError,
    apply_plan,
    broadcast_plan,
    build_mesh,
    distribute_parameters,
    remap_optimizer,
    validate_plan,
)
from .simulate import SimulatedComm, simulate_collectives

__all__ = [
    "LoadReport",
    "PretrainedLoadError",
    "SaveCollectiveError",
    "SaveReport",
    "load_pretrained",
    "MaterializeReport",
    "MetaInitError",
    "PlanMismatchError",
    "apply_plan",
    "broadcast_plan",
    "build_mesh",
    "consolidated_state_dict",
    "load_checkpoint",
    "save_checkpoint",
    "save_pretrained",
    "distribute_parameters",
    "is_meta_model",
    "materialize_meta_model",
    "register_runtime_rules",
    "remap_optimizer",
    "SimulatedComm",
    "simulate_collectives",
    "validate_plan",
]
