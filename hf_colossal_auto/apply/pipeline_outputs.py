"""What a training forward under a pipeline plan returns: the step's loss, and a clear refusal for the rest.

A pipelined training forward runs the whole step's schedule (every micro-batch's forward and backward,
:mod:`.pipeline_runner`); the logits of each micro-batch are consumed by the loss on the last stage inside the
schedule, and the hidden states never leave their stage. So the output carries the loss only. A loop that reads
``outputs.logits`` of a training step (an accuracy it logs, a term it adds to the loss) would otherwise meet
``None`` and fail far from the cause (``unsupported operand type(s) for *: 'NoneType' ...``), or silently skip
its own code; reading any other field of a causal LM's output raises :class:`PipelineOutputError`, which says
why and what to do. ``hasattr(outputs, "logits")`` is False (the error is an ``AttributeError``), as for an
output that lacks the field, so library code that probes for it goes on; ``outputs["loss"]``, ``outputs[0]``
and ``outputs.loss`` work as on any ``ModelOutput`` (the Trainer reads them so).

Imported lazily (transformers is not imported with the runtime).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from transformers.modeling_outputs import CausalLMOutputWithPast, MoeCausalLMOutputWithPast
from transformers.utils import ModelOutput

_WITHHELD = frozenset(
    f.name
    for output in (CausalLMOutputWithPast, MoeCausalLMOutputWithPast)
    for f in dataclasses.fields(output)
) - {"loss"}
"""The fields of a (mixture-of-experts) causal LM's output that a pipelined training step does not return."""


class PipelineOutputError(AttributeError):
    """A field of a pipelined training step's output that the step does not return (see the module doc)."""


def _refusal(name: str) -> PipelineOutputError:
    return PipelineOutputError(
        f"outputs.{name} of a training step under a pipeline plan: the training forward runs the whole step's "
        "schedule (every micro-batch's forward and backward) and the logits are consumed by the loss on the last "
        f"stage, so it returns the loss only. To train on a loss built from the {name}, set it as the model's "
        "loss function (`model.loss_function = fn`: called per micro-batch on the last stage as fn(logits=..., "
        "labels=..., vocab_size=..., num_items_in_batch=...), it sums over the micro-batch's tokens and divides "
        "by num_items_in_batch, the whole batch's count, as transformers' losses do), or plan without pipeline "
        "stages (pipeline=1, HF_COLOSSAL_AUTO_PIPELINE=1). To read the logits, run an evaluation forward "
        "(model.eval() or torch.no_grad()): it returns them on every rank."
    )


@dataclass
class PipelineTrainingOutput(ModelOutput):
    """A pipelined training step's output: ``loss`` (on every rank; its backward applies the step's gradients).
    Reading a causal LM's other fields raises :class:`PipelineOutputError`."""

    loss: torch.FloatTensor | None = None

    def __getattr__(self, name: str) -> Any:
        if name in _WITHHELD:
            raise _refusal(name)
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, str) and key in _WITHHELD:
            raise _refusal(key)
        return super().__getitem__(key)
