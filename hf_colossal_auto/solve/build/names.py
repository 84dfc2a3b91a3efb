"""ILP node names and labels: ``n<i>`` for a graph op, ``p:<fqn>`` for a parameter, ``rc:<unit>`` for a
recompute decision, ``expert-dp`` for the exchange of expert parallelism over the data-parallel axis; memory rows
by :class:`MemoryRow` (``activation-peak``, ``phase-peak:<phase>``, ``optimizer-step``, ``recompute:<unit>``,
``rerun:<unit>``)."""

from __future__ import annotations

from enum import Enum

from ...strategies.placements import Strategy


class NodeKind(str, Enum):
    """What an ILP node decides (its ``kind``), so that a reader tells an op node from a parameter node by a field,
    never by its name."""

    OP = "op"
    """A forward op's strategy on the tensor-parallel axis (``n<i>``)."""
    PARAM = "param"
    """A parameter's storage placement (``p:<fqn>``)."""
    RECOMPUTE = "recompute"
    """A recompute unit's option (``rc:<unit>``)."""
    HOLD = "hold"
    """Whether a checkpoint holds a storage (``hold:<sid>:<units>``)."""
    EXPERT_EXCHANGE = "expert-exchange"
    """The collectives of expert parallelism over the data-parallel axis (``expert-dp``)."""


class MemoryRow(str, Enum):
    """The moments of the step the builder writes a memory row at (a row's ``kind``). The activation peak and the
    optimizer step are one row each, named by their kind; the other phase's peak is named ``phase-peak:<phase>``
    and a recompute unit has a row of each per-unit kind, named ``<kind>:<unit>`` (:func:`memory_row_name`)."""

    ACTIVATION_PEAK = "activation-peak"
    """The highest point of forward + backward (before sharding)."""
    PHASE_PEAK = "phase-peak"
    """The highest point of the other phase (``phase-peak:backward`` when the activation peak is in the forward,
    ``phase-peak:forward`` when it is in the backward): sharding shrinks the two phases' moments unevenly, so the
    lower one before sharding can be the higher one after it."""
    OPTIMIZER_STEP = "optimizer-step"
    """Parameters, gradients, optimizer state and its temporaries, by parameter placement."""
    RECOMPUTE = "recompute"
    """Inside a recompute unit's backward, at its highest point."""
    RERUN = "rerun"
    """A recompute unit's rerun, as its backward starts."""


def memory_row_name(kind: MemoryRow, of: str | None = None) -> str:
    """The name of the row of ``kind`` (of recompute unit or phase ``of`` for the kinds with one row each)."""
    return kind.value if of is None else f"{kind.value}:{of}"


EXPERT_DP_NODE = "expert-dp"
"""ILP node (one option) holding the collectives of expert parallelism over the data-parallel axis."""


def _node_name(i: int) -> str:
    return f"n{i}"


def _param_node_name(fqn: str) -> str:
    return f"p:{fqn}"


def _recompute_node_name(unit: str) -> str:
    return f"rc:{unit}"


def _label(s: Strategy, axis: int) -> str:
    ins = ",".join(p[axis] if p is not None else "-" for p in s.input_placements)
    outs = ",".join(p[axis] for p in s.output_placements)
    return f"({ins})->({outs})"


def param_storage_options(shape: tuple[int, ...], tp: int) -> list[str]:
    """Replicated, or sharded along any dim the tensor-parallel axis divides."""
    options = ["R"]
    if tp > 1:
        options += [f"S{d}" for d, size in enumerate(shape) if size % tp == 0 and size >= tp]
    return options
