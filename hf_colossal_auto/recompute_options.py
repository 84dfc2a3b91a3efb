"""The recompute options a Plan names per block (``"none"``, ``"full"``, ``"selective:<op classes>"``, and
``"selective:<op classes>;rerun=<module>,<module>"``): the contract between the planner, which chooses them
(:mod:`hf_colossal_auto.solve.recompute`), and the runtime, which applies them
(:mod:`hf_colossal_auto.apply.recompute`). Next to :mod:`hf_colossal_auto.plan` so that the runtime reads them
without importing the planner.

``;rerun=``: a selective policy keeps every output of the classes it does not recompute, whether or not a
backward reads it. The outputs of a sub-layer's last projection (Llama's ``o_proj`` and ``down_proj``, GPT-2's
``c_proj``) are read by nothing but the residual add and, under tensor parallelism, the reduce-scatter of the
partial sum: 2 x 256 MiB a Llama-3-405B block a micro-batch at tp 8. The modules named (paths inside the block)
have their ops recomputed as well, so nothing of theirs is kept. Where such a module's op comes after the last
tensor the block's backward reads (``down_proj``), the rerun stops before it (non-reentrant checkpoint stops
once every saved tensor is back) and it costs nothing; otherwise (``o_proj``) it reruns its matmul."""

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
    rerun_modules: frozenset[str] = frozenset()
    """Module paths inside the block whose ops are recomputed whatever their class (``;rerun=``)."""

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
        return op_class(node.op) in self.recomputed or any(
            in_module(node.module, path) for path in self.rerun_modules
        )

    def caches(self, node: OpNode) -> bool:
        """Does a selective policy keep this op's output (views never: they would pin their base; a shared cast
        is kept, or not, as the cast it aliases)?"""
        return (
            not self.is_none
            and not self.is_full
            and not node.is_view
            and node.shared_with is None
            and not self.recomputes(node)
        )


NO_RECOMPUTE = RecomputeOption("none", frozenset())
FULL_RECOMPUTE = RecomputeOption("full", frozenset(CLASSES))


RERUN = ";rerun="
"""What separates a selective option's classes from the modules it reruns as well."""


def selective(classes: Iterable[str], rerun_modules: Iterable[str] = ()) -> RecomputeOption:
    ordered = [c for c in (POINTWISE, ATTENTION, MATMUL) if c in set(classes)]
    modules = sorted(set(rerun_modules))
    name = "selective:" + "+".join(ordered) + (RERUN + ",".join(modules) if modules else "")
    return RecomputeOption(name, frozenset(ordered), frozenset(modules))


def in_module(module: str, path: str) -> bool:
    """Whether an op run in module ``module`` (a full FQN) is inside the module at ``path`` of its block: the
    block-relative ``path`` ends ``module`` or one of its parents (``model.layers.3.mlp.down_proj`` is in
    ``mlp.down_proj`` and in ``mlp``)."""
    return f".{module}.".find(f".{path}.") >= 0


def parse_option(text: str) -> RecomputeOption:
    """``"none"``, ``"full"``, ``"selective:pointwise+attention"`` or
    ``"selective:pointwise;rerun=self_attn.o_proj,mlp.down_proj"`` (as written in a Plan)."""
    if text == "none":
        return NO_RECOMPUTE
    if text == "full":
        return FULL_RECOMPUTE
    if text.startswith("selective:"):
        spec, _, rerun = text.split(":", 1)[1].partition(RERUN)
        classes = [c for c in spec.split("+") if c]
        unknown = sorted(set(classes) - set(CLASSES))
        modules = [m for m in rerun.split(",") if m]
        if not classes or unknown or (RERUN in text and not modules):
            raise ValueError(
                f"recompute option {text!r}: unknown op classes {unknown} or no module after {RERUN!r}; "
                f"known classes: {list(CLASSES)}"
            )
        return selective(classes, modules)
    raise ValueError(
        f"unknown recompute option {text!r}; use 'none', 'full', 'selective:<classes>' or "
        f"'selective:<classes>{RERUN}<module>,<module>'"
    )
