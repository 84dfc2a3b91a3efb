"""Capture: one training step as an aten-level graph with module paths, phases and a memory timeline."""

from .graph import BlockRun, MemoryEvent, OpNode, Phase, StepGraph, TensorRef, ValueInfo, ValueKind
from .inputs import CaptureError
from .tracer import trace_training_step

__all__ = [
    "BlockRun",
    "CaptureError",
    "MemoryEvent",
    "OpNode",
    "Phase",
    "StepGraph",
    "TensorRef",
    "ValueInfo",
    "ValueKind",
    "trace_training_step",
]
