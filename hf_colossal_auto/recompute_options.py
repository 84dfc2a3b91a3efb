"""The recompute options a Plan names per block (``"none"``, ``"full"``, ``"selective:<op classes>"``): the
contract between the planner, which chooses them (:mod:`hf_colossal_auto.solve.recompute`), and the runtime,
which applies them (:mod:`hf_colossal_auto.apply.recompute`). Next to :mod:`hf_colossal_auto.plan` so that the
runtime reads them without importing the planner."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .capture.op_classes import ATTENTION, CLASSES, MATMUL, POINTWISE, op_class

if TYPE_CHECKING:
    from .capture.graph import OpNode


@dataclass(frozen=True)
class RecomputeOption:
    """One way to run a unit: which op classes it recomputes in backward."""

    name: str
    recomputed: frozenset[str]

    @property
    def is_none(self) -> bool:
        return not self.recomputed

    @property
    def is_full(self) -> bool:
        return self.name == "full"

    def recomputes(self, node: OpNode) -> bool:
        """Does backward run this forward op again?"""
        if self.is_full:
            return True
        return op_class(node.op) in self.recomputed

    def caches(self, node: OpNode) -> bool:
        """Does a selective policy keep this op's output (views never: they would pin their base)?"""
        return not self.is_none and not self.is_full and not node.is_view and not self.recomputes(node)


NO_RECOMPUTE = RecomputeOption("none", frozenset())
FULL_RECOMPUTE = RecomputeOption("full", frozenset(CLASSES))


def selective(classes: Iterable[str]) -> RecomputeOption:
    ordered = [c for c in (POINTWISE, ATTENTION, MATMUL) if c in set(classes)]
    return RecomputeOption("selective:" + "+".join(ordered), frozenset(ordered))


def parse_option(text: str) -> RecomputeOption:
    """``"none"``, ``"full"`` or ``"selective:pointwise+attention"`` (as written in a Plan)."""
    if text == "none":
        return NO_RECOMPUTE
    if text == "full":
        return FULL_RECOMPUTE
    if text.startswith("selective:"):
        classes = [c for c in text.split(":", 1)[1].split("+") if c]
        unknown = sorted(set(classes) - set(CLASSES))
        if not classes or unknown:
            raise ValueError(
                f"recompute option {text!r}: unknown op classes {unknown}; known: {list(CLASSES)}"
            )
        return selective(classes)
    raise ValueError(f"unknown recompute option {text!r}; use 'none', 'full' or 'selective:<classes>'")
