"""Symbolic profiler: FLOPs, bytes, roofline time and the liveness peak of one training step."""

from ..capture.flops import EXTRA_FLOP_FORMULAS
from .profiler import profile_model
from .report import BlockProfile, ModuleProfile, NodeProfile, ProfileReport

__all__ = [
    "EXTRA_FLOP_FORMULAS",
    "BlockProfile",
    "ModuleProfile",
    "NodeProfile",
    "ProfileReport",
    "profile_model",
]
