"""ILP node names and labels: ``n<i>`` for a graph op, ``p:<fqn>`` for a parameter, ``rc:<unit>`` for a
recompute decision, ``expert-dp`` for the exchange of expert parallelism over the data-parallel axis."""

from __future__ import annotations

from ...strategies.placements import Strategy

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
