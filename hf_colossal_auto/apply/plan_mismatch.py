"""The error a plan that does not fit the model or the job raises (:class:`PlanMismatchError`).

In a module of its own so that the runtime's parts that check a plan (:mod:`.runtime`, :mod:`.local_tensor_parallel`)
raise one class without importing each other; :mod:`.runtime` re-exports it under its old name."""

from __future__ import annotations


class PlanMismatchError(ValueError):
    """The plan was made for another model or another world size."""
