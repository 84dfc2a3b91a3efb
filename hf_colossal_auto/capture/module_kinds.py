"""What a module of the model is, read from its class and attributes: the facts the planner and the runtime must
read alike (a module the planner prices as a projection, or as drawing no random numbers, the runtime runs so).

* :func:`projection_dims`: which dims of a projection's weight are its output and input features —
  ``nn.Linear`` stores ``[out, in]``, GPT-2's ``Conv1D`` ``[in, out]``;
* :func:`drawn_dropouts`: the dropouts inside a module that draw random numbers in training.
"""

from __future__ import annotations

import torch
from torch import nn

PROJECTION_TYPES = ("Linear", "Conv1D")
"""The class names (``StepGraph.module_types``) of the modules :func:`projection_dims` recognises: what the
runtime's projection hooks act on (redistributed inputs, shared casts) and the planner prices as projections."""

_DROPOUTS = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)


def projection_dims(module: nn.Module | None) -> tuple[int, int] | None:
    """(output-features dim, input-features dim) of a projection's weight: ``(0, 1)`` for ``nn.Linear``,
    ``(1, 0)`` for GPT-2's ``Conv1D``; None for any other module (and for None)."""
    if isinstance(module, nn.Linear):
        return 0, 1
    if type(module).__name__ == "Conv1D" and isinstance(getattr(module, "weight", None), torch.Tensor):
        return 1, 0
    return None


def drawn_dropouts(module: nn.Module) -> list[str]:
    """The dropouts inside ``module`` that draw: ``nn.Dropout`` modules with ``p > 0`` (``"name (p=0.1)"``), and
    the float ``*dropout*`` attributes HF attention modules pass to their kernels (``"name.attention_dropout=0.1"``,
    e.g. Llama's). Names are relative to ``module`` (``"."`` for itself)."""
    found = []
    for name, sub in module.named_modules():
        if isinstance(sub, _DROPOUTS) and sub.p > 0:
            found.append(f"{name or '.'} (p={sub.p})")
        for attr, value in vars(sub).items():
            if "dropout" in attr and isinstance(value, float) and value > 0:
                found.append(f"{name + '.' if name else ''}{attr}={value}")
    return found
