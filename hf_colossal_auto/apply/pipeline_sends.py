"""The input gradients a pipeline rank sent back, held until the schedule's order proves them received.

Why: torch's multi-stage runtime keeps every send's work, and with it the tensor sent, to the end of the step;
for the gradients a rank sends back that is one hidden-state-sized buffer per micro-batch and stage, all held at
once by the cooldown (priced before as kept to the step's end: about 32 GiB a rank of Llama 3's 4-D layout at
405B). :func:`hf_colossal_auto.pipeline_receipts.gradient_send_releases` says from the schedule's own order at
which later action a rank knows a gradient it sent has arrived; there the send's work is waited (it has
completed: the receiver has the data) and the tensor's storage freed. Sends nothing proves received are waited
at the step's end, as torch would.

The schedule's stages (``_torch_compat.pipeline_stage_with_transient_receive_buffers``) issue their gradient
sends through :meth:`GradientSends.issue` instead of returning them to torch's schedule, and call
:meth:`GradientSends.starting` as each forward or backward starts; the runner calls
:meth:`GradientSends.wait_all` after the step. The schedule's pricing holds each sent gradient's bytes to the
same action (:mod:`hf_colossal_auto.solve.pricing.pipeline_schedule`).
"""

from __future__ import annotations

from typing import Any

import torch

from .._torch_compat import free_whole_storages, isend_point_to_point_ops
from ..pipeline_receipts import Action, GradientSend


class GradientSends:
    """One rank's sent gradients in flight, shared by its stages; ``releases`` from
    :func:`~hf_colossal_auto.pipeline_receipts.gradient_send_releases` over the schedule's compute actions."""

    def __init__(self, releases: dict[Action, list[GradientSend]] | None = None) -> None:
        self.releases: dict[Action, list[GradientSend]] = releases or {}
        self._in_flight: dict[GradientSend, tuple[list[Any], list[torch.Tensor]]] = {}

    @property
    def in_flight(self) -> int:
        """How many sends are issued and not yet freed."""
        return len(self._in_flight)

    def issue(self, stage: int, micro_batch: int, ops: list[Any]) -> None:
        """Send ``ops`` (the backward sends of ``stage`` for ``micro_batch``) now, holding their works."""
        self._in_flight[(stage, micro_batch)] = (isend_point_to_point_ops(ops), [op.tensor for op in ops])

    def starting(self, action: Action) -> None:
        """``action`` is starting, its received input waited: free the sends that proves received."""
        for key in self.releases.get(action, ()):
            sent = self._in_flight.pop(key, None)
            if sent is not None:
                _wait_and_free(*sent)

    def wait_all(self) -> None:
        """The step is over: wait every send still held and free its tensors."""
        while self._in_flight:
            _wait_and_free(*self._in_flight.popitem()[1])


def _wait_and_free(works: list[Any], tensors: list[torch.Tensor]) -> None:
    for work in works:
        work.wait()
    free_whole_storages(tensors)
