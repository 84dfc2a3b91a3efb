"""One step at many batch sizes from three traces: the captured step is affine in the batch rows.

The planner needs the step at every local batch its candidates run (global batch / (dp × micro-batches) rows:
eleven sizes, 1 to 1024 rows, for Llama-3-70B on 1024 devices), and a trace of a large model costs seconds
even under fake tensors. Yet the traces differ only in numbers: with static shapes the same ops run in the
same order on tensors whose sizes grow with the rows, and every recorded number — a dimension, a byte count, a
FLOP count, a memory event's size — is ``c0 + c1 × rows`` (a flattened ``rows × seq`` dimension included). So
two traces at ``a`` and ``b`` rows give every other size by interpolation, exactly, in integers.

That is a property of the model, not a law: a model could branch on its batch size, or record a count that grows
faster than the rows (a contrastive loss's ``rows × rows`` logits). :class:`TracesByRows` therefore checks it
before relying on it: the third size asked for is traced too and compared, field for field, with the
interpolation; only when they are equal are later sizes interpolated. Otherwise every size is traced, as
before. One row is always traced: dimensions of size 1 take other paths through broadcasting and stride rules
(a ``contiguous()`` that copies at 2 rows is a no-op at 1).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from collections.abc import Callable
from enum import Enum
from typing import Any

import torch

from .graph import StepGraph

logger = logging.getLogger(__name__)


_LEAVES = (str, bytes, bool, float, Enum, torch.dtype, torch.device, torch.layout)
"""Recorded values that interpolation carries only unchanged (a float that changes as a count is handled first)
and that :func:`same_step` compares as they are."""


class NotAffine(ValueError):
    """Two traces differ in a way interpolation cannot carry: their structure, or a number that is not a whole
    affine function of the rows."""


def interpolate_step(a: StepGraph, rows_a: int, b: StepGraph, rows_b: int, rows: int) -> StepGraph:
    """The step at ``rows`` batch rows, from its traces at ``rows_a`` and ``rows_b`` rows (``rows_a != rows_b``).

    Every number the traces share stays; every integer that differs is interpolated (and must land on an integer
    >= 0); anything else that differs raises :class:`NotAffine`. Objects that do not change are shared with
    ``a`` (captured steps are not mutated after capture), so an interpolated step costs little memory.
    """
    if rows_a == rows_b:
        raise ValueError("interpolate_step needs traces at two different batch sizes")
    scale = _Scale(rows_a, rows_b, rows)
    values = {
        f.name: scale(getattr(a, f.name), getattr(b, f.name), f.name) for f in dataclasses.fields(StepGraph)
    }
    return StepGraph(
        **values
    )  # a fresh object: caches kept on the traced steps (``__dict__``) do not carry over


class _Scale:
    """The affine map through ``(rows_a, x_a)`` and ``(rows_b, x_b)``, applied to whole nested objects."""

    def __init__(self, rows_a: int, rows_b: int, rows: int) -> None:
        self.rows_a, self.span, self.offset = rows_a, rows_b - rows_a, rows - rows_a

    def __call__(self, x: Any, y: Any, where: str) -> Any:
        if x is y:
            return x
        if type(x) is not type(y):
            raise NotAffine(f"{where}: {type(x).__name__} at one size, {type(y).__name__} at the other")
        if type(x) is int:
            return x if x == y else self._number(x, y, where)
        if type(x) is float and x != y and x.is_integer() and y.is_integer():  # a count passed as a float
            return float(self._number(int(x), int(y), where))
        if isinstance(x, _LEAVES) or x is None:
            if x != y:
                raise NotAffine(f"{where}: {x!r} at one size, {y!r} at the other")
            return x
        if isinstance(x, (list, tuple)):
            return self._sequence(x, y, where)
        if isinstance(x, dict):
            return self._mapping(x, y, where)
        if dataclasses.is_dataclass(x):
            return self._dataclass(x, y, where)
        if not _opaque_equal(
            x, y
        ):  # anything else in op arguments (a memory format, a slice) must not change
            raise NotAffine(f"{where}: {x!r} at one size, {y!r} at the other")
        return x

    def _number(self, x: int, y: int, where: str) -> int:
        step, rest = divmod((y - x) * self.offset, self.span)
        if rest:
            raise NotAffine(f"{where}: {x} and {y} give no whole number at the asked size")
        return x + step

    def _sequence(self, x: list | tuple, y: list | tuple, where: str) -> list | tuple:
        if len(x) != len(y):
            raise NotAffine(f"{where}: {len(x)} items at one size, {len(y)} at the other")
        items = [self(p, q, where) for p, q in zip(x, y, strict=True)]
        if all(i is p for i, p in zip(items, x, strict=True)):
            return x
        if isinstance(x, list):
            return items
        return type(x)(items) if type(x) in (tuple, torch.Size) else type(x)(*items)  # named tuples by field

    def _mapping(self, x: dict, y: dict, where: str) -> dict:
        if x.keys() != y.keys():
            raise NotAffine(f"{where}: different keys at the two sizes")
        items = {k: self(v, y[k], where) for k, v in x.items()}
        return x if all(items[k] is v for k, v in x.items()) else type(x)(items)

    def _dataclass(self, x: Any, y: Any, where: str) -> Any:
        changed = {}
        for f in dataclasses.fields(x):
            old = getattr(x, f.name)
            new = self(old, getattr(y, f.name), f"{where}.{f.name}")
            if new is not old:
                changed[f.name] = new
        if not changed:
            return x
        out = copy.copy(x)
        for name, value in changed.items():
            object.__setattr__(out, name, value)  # frozen dataclasses (MemoryEvent, TensorRef) too
        return out


def _opaque_equal(x: Any, y: Any) -> bool:
    """Equality of an op argument the walk does not open. Handles that cannot be compared (the
    ``_RecordFunction`` a ``record_function`` region passes from its enter op to its exit op) are equal when
    their types are: they carry no size."""
    try:
        equal = x == y
    except (NotImplementedError, RuntimeError, TypeError):
        return True
    return equal if isinstance(equal, bool) else True


def same_step(a: Any, b: Any) -> bool:
    """Whether two recorded steps (or parts of them) hold the same numbers in the same structure, with
    :func:`_opaque_equal` for handles: ``StepGraph.__eq__`` would fail on those."""
    if a is b:
        return True
    if type(a) is not type(b):
        return False
    try:  # the common case, at C speed: only a handle somewhere inside makes ``==`` fail
        equal = a == b
        if isinstance(equal, bool):
            return equal
    except (NotImplementedError, RuntimeError, TypeError):
        pass
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same_step(p, q) for p, q in zip(a, b, strict=True))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same_step(v, b[k]) for k, v in a.items())
    if dataclasses.is_dataclass(a):
        return all(same_step(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a))
    if isinstance(a, (int, *_LEAVES)) or a is None:
        return a == b
    return _opaque_equal(a, b)


class TracesByRows:
    """The step at each batch size the planner asks for, traced as few times as the step allows.

    ``trace(rows)`` records the step at ``rows`` batch rows. Sizes of 2 rows or more are traced until three of
    them agree with one affine map (the third compared with its interpolation from the first two); from then on
    they are interpolated. ``traced`` counts the real traces, for logs and benchmarks.
    """

    def __init__(self, trace: Callable[[int], StepGraph]) -> None:
        self._trace = trace
        self._steps: dict[int, StepGraph] = {}
        self._bases: list[tuple[int, StepGraph]] = []
        self._affine: bool | None = None
        """None until the third size has been compared, then whether interpolation held."""
        self.traced = 0

    def __contains__(self, rows: int) -> bool:
        return rows in self._steps

    @property
    def sizes(self) -> int:
        """Batch sizes at hand, traced or interpolated."""
        return len(self._steps)

    def any(self) -> StepGraph | None:
        """A step already at hand (traced or interpolated), if any."""
        return next(iter(self._steps.values()), None)

    def get(self, rows: int) -> StepGraph:
        if rows not in self._steps:
            self._steps[rows] = self._from_bases(rows) or self._traced(rows)
        return self._steps[rows]

    def _from_bases(self, rows: int) -> StepGraph | None:
        """The interpolated step, once interpolation has held, for 2 rows or more; None to trace instead (also
        where the asked size puts a number between integers, which a step traced there would not)."""
        if not self._affine or rows < 2:
            return None
        try:
            return self._interpolated(rows)
        except NotAffine:
            return None

    def _traced(self, rows: int) -> StepGraph:
        step = self._trace(rows)
        self.traced += 1
        if rows < 2 or self._affine is False:
            return step
        if len(self._bases) < 2:
            self._bases.append((rows, step))
        elif self._affine is None:
            self._affine = self._agrees(rows, step)
        return step

    def _agrees(self, rows: int, step: StepGraph) -> bool:
        try:
            agrees = same_step(self._interpolated(rows), step)
            reason = "a recorded number is not affine in them"
        except NotAffine as exc:
            agrees, reason = False, str(exc)
        if agrees:
            logger.debug("the step is affine in the batch rows: further batch sizes are interpolated")
        else:
            logger.info(
                "the traced step does not scale linearly with the batch (%s): tracing every size", reason
            )
        return agrees

    def _interpolated(self, rows: int) -> StepGraph:
        (rows_a, a), (rows_b, b) = self._bases
        return interpolate_step(a, rows_a, b, rows_b, rows)
