"""Find runs of identical transformer blocks and trace only a few of them.

A transformer is a stack of N blocks that run the same ops on same-shaped tensors. Tracing all N costs N
times the work and tells nothing new, so we keep the first four blocks of each run. The first and the last
block of a stack are special (the first frees what the embeddings made, in backward the first block is where
tensors shared by all blocks — rotary tables, masks — die; the last feeds the head); the two middle copies
are ordinary blocks with a block on each side, like every block we do not trace. The tracer checks that the
two middle copies recorded the same ops and memory deltas, and the second one (the *representative*) then
stands for every untraced block. Profiling cost grows with the number of distinct blocks, not with depth.

Two blocks are identical when they have the same class, the same parameter and buffer names, shapes and
dtypes (and the same parameters frozen), the same per-layer config entries (``config.layer_types`` distinguishes e.g. sliding-window from
full attention layers that look alike structurally) and the same submodule classes. Only a run that
reaches the end of its ``ModuleList`` is folded, so that the kept blocks keep their indices (and hence
their parameter FQNs). The tracer verifies afterwards that the two kept copies really recorded the same op
sequence and memory deltas, and traces the full depth otherwise.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass

from torch import nn

from .graph import BlockRun

logger = logging.getLogger(__name__)

KEPT = 4
"""Blocks traced per run: first, two middle copies (compared with each other), last."""
MIN_RUN = KEPT + 1
"""Runs of at most ``KEPT`` blocks are traced in full: folding would save nothing."""


def _signature(module: nn.Module) -> tuple:
    # requires_grad too: a frozen block has no gradients or optimizer step, so it cannot stand for a trained one
    params = tuple(
        (n, tuple(p.shape), p.dtype, p.requires_grad)
        for n, p in module.named_parameters(remove_duplicate=False)
    )
    buffers = tuple((n, tuple(b.shape), b.dtype) for n, b in module.named_buffers(remove_duplicate=False))
    classes = tuple((n, type(m).__qualname__) for n, m in module.named_modules())
    return (type(module).__qualname__, params, buffers, classes)


def _layer_type(model: nn.Module, index: int) -> object:
    config = getattr(model, "config", None)
    layer_types = getattr(config, "layer_types", None)
    if isinstance(layer_types, (list, tuple)) and index < len(layer_types):
        return layer_types[index]
    return None


@dataclass
class _Fold:
    container_fqn: str
    container: nn.ModuleList
    run: BlockRun
    keep_upto: int  # number of children of the container kept while tracing


def find_block_runs(model: nn.Module) -> list[BlockRun]:
    """Runs of >= ``MIN_RUN`` identical blocks at the tail of each ModuleList, as :class:`BlockRun`s."""
    runs: list[BlockRun] = []
    for fqn, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) < MIN_RUN:
            continue
        children = list(module)
        sigs = [(_signature(c), _layer_type(model, i)) for i, c in enumerate(children)]
        start = len(children) - 1
        while start > 0 and sigs[start - 1] == sigs[-1]:
            start -= 1
        if len(children) - start < MIN_RUN:
            continue
        names = [f"{fqn}.{i}" if fqn else str(i) for i in range(len(children))]
        runs.append(BlockRun(container=fqn, all_blocks=names[start:], traced=names[start : start + KEPT]))
    return runs


@contextlib.contextmanager
def folded(model: nn.Module, runs: list[BlockRun]) -> Iterator[None]:
    """Temporarily cut each run's ModuleList after its kept blocks; restores the model on exit."""
    folds: list[_Fold] = []
    modules = dict(model.named_modules())
    for run in runs:
        container = modules[run.container]
        assert isinstance(container, nn.ModuleList)
        keep_upto = int(run.traced[-1].rsplit(".", 1)[-1]) + 1  # the traced copies are a prefix
        folds.append(_Fold(run.container, container, run, keep_upto))
    saved = {id(f.container): dict(f.container._modules) for f in folds}
    try:
        for f in folds:
            kept = list(f.container._modules.items())[: f.keep_upto]
            f.container._modules.clear()
            f.container._modules.update(kept)
        yield
    finally:
        for f in folds:
            f.container._modules.clear()
            f.container._modules.update(saved[id(f.container)])
