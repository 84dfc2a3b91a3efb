"""Which blocks of the gathered keys a context-parallel rank's causal queries attend to, and how (the planner
prices what the runtime's blocked attention keeps; both read it here).

Under the balanced layout rank ``r`` of ``cp`` holds chunk ``r`` (its head) and chunk ``2 cp - 1 - r`` (its
tail) of ``2 cp`` chunks of ``c`` tokens. The runtime (:mod:`hf_colossal_auto.apply.context_parallel_blocks`)
gathers every rank's head chunks into one buffer (chunks ``0 .. cp - 1`` in order) and every rank's tail chunks
into another (chunks ``2 cp - 1 .. cp``), so that a query chunk's fully visible keys are the fewest contiguous
slices of the two; the diagonal chunk runs under the kernel's causal flag, and chunks a sliding window cuts get a
``[c, c]`` mask that depends only on their distance in chunks.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Block:
    """One kernel call of a rank's attention: a query chunk against a contiguous slice of one key buffer."""

    query: int
    """0: this rank's head chunk (local rows ``[0, c)``), 1: its tail chunk (``[c, 2c)``)."""
    buffer: int
    """0: the gathered head chunks (chunks ``0 .. cp - 1`` in order), 1: the tail chunks (``2 cp - 1 .. cp``)."""
    start: int
    stop: int
    """Key rows of the buffer."""
    causal: bool
    """The diagonal chunk (the query chunk's own keys) under the kernel's causal flag."""
    offset: int | None
    """A chunk the sliding window cuts: the query chunk's distance from it in chunks (its ``[c, c]`` mask,
    :func:`window_mask`); None: no mask."""


def _slot(chunk_index: int, cp: int) -> tuple[int, int]:
    """Where global chunk ``chunk_index`` lies in the gathered buffers: (buffer, slot)."""
    return (0, chunk_index) if chunk_index < cp else (1, 2 * cp - 1 - chunk_index)


def _visibility(distance: int, chunk: int, window: int | None) -> str:
    """How a query chunk sees the key chunk ``distance`` chunks before it (>= 1): ``"full"``, ``"partial"``
    (the window cuts it) or ``"none"`` (wholly outside the window: ``k > q - window`` for no pair)."""
    if window is None or window >= (distance + 1) * chunk:
        return "full"
    if window <= (distance - 1) * chunk + 1:
        return "none"
    return "partial"


def causal_blocks(cp: int, rank: int, chunk: int, window: int | None = None) -> tuple[Block, ...]:
    """The blocks of rank ``rank``'s causal attention (chunks of ``chunk`` tokens, an optional sliding
    ``window``): per query chunk the fully visible key chunks as the fewest contiguous slices, the chunks the
    window cuts, and the diagonal."""
    blocks: list[Block] = []
    for query, g in ((0, rank), (1, 2 * cp - 1 - rank)):
        full: dict[int, list[int]] = {0: [], 1: []}
        for j in range(g):
            seen = _visibility(g - j, chunk, window)
            buffer, slot = _slot(j, cp)
            if seen == "full":
                full[buffer].append(slot)
            elif seen == "partial":
                blocks.append(Block(query, buffer, slot * chunk, (slot + 1) * chunk, False, g - j))
        for buffer, slots in full.items():
            for first, last in _runs(sorted(slots)):
                blocks.append(Block(query, buffer, first * chunk, (last + 1) * chunk, False, None))
        buffer, slot = _slot(g, cp)
        banded = window is not None and window < chunk  # the window cuts the diagonal chunk too
        blocks.append(
            Block(query, buffer, slot * chunk, (slot + 1) * chunk, not banded, 0 if banded else None)
        )
    return tuple(blocks)


def _runs(slots: list[int]) -> list[tuple[int, int]]:
    """Consecutive runs of sorted slot numbers, as (first, last)."""
    runs: list[tuple[int, int]] = []
    for s in slots:
        if runs and runs[-1][1] == s - 1:
            runs[-1] = (runs[-1][0], s)
        else:
            runs.append((s, s))
    return runs
