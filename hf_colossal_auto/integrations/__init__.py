"""How users reach the planner and runtime: an Accelerate plugin + Accelerator, a Trainer callback.

Imports are lazy so that ``import hf_colossal_auto`` stays cheap and works without accelerate's extras.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "AutoParallelPlugin": ".plugin",
    "AutoParallelAccelerator": ".accelerator",
    "AutoParallelCallback": ".trainer",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module, __name__), name)
