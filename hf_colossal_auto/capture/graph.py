"""The captured training step: the typed output of the capture stage.

A :class:`StepGraph` is the aten-level record of one training step (forward, backward and optimizer step) as
it really executed under a fake-tensor dispatcher. Every later stage reads it:

* the profiler prices each :class:`OpNode` (FLOPs, bytes, roofline time) and replays its
  :class:`MemoryEvent` timeline to find the liveness peak;
* the planner asks DTensor's sharding rules for strategies of each node, using the recorded arguments.

Values (tensors) are named by integer ids; the storages they live in are named separately because views
share storage and memory is a property of storages, not of tensors.

When identical transformer blocks were folded (see :mod:`hf_colossal_auto.capture.blocks`) the graph holds
only the traced blocks; :class:`BlockRun` says which block stands for how many. :meth:`StepGraph.unrolled`
gives the full-depth node sequence and memory timeline without tracing again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any


class Phase(str, Enum):
    """Which part of the training step an op belongs to."""

    FORWARD = "forward"
    BACKWARD = "backward"
    OPTIMIZER = "optimizer"


class ValueKind(str, Enum):
    """What a tensor value is, for memory accounting and for the planner."""

    PARAM = "param"
    BUFFER = "buffer"
    INPUT = "input"
    ACTIVATION = "activation"
    GRAD = "grad"
    OPTIMIZER_STATE = "optimizer_state"


@dataclass(frozen=True)
class TensorRef:
    """Placeholder for a tensor argument inside :attr:`OpNode.args`: the id of the value it carries."""

    value_id: int


@dataclass
class ValueInfo:
    """One tensor value seen during the step."""

    id: int
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    storage_id: int
    kind: ValueKind
    producer: int | None = None
    """Index of the node that produced it; None for parameters, buffers, inputs and pre-existing state."""
    name: str | None = None
    """Parameter/buffer FQN, input key, or ``"<param fqn>.grad"`` for gradients."""
    requires_grad: bool = False


@dataclass
class OpNode:
    """One aten op call."""

    index: int
    op: str
    """Overload name, e.g. ``"aten.mm.default"``."""
    phase: Phase
    module: str
    """FQN of the innermost module running when the op ran (``""`` for the model's own forward)."""
    inputs: list[int]
    """Value ids of the tensor arguments, in flattened argument order."""
    outputs: list[int]
    flops: int
    bytes_read: int
    bytes_written: int
    args: Any = None
    """The op's (args, kwargs) with tensors replaced by :class:`TensorRef`; lets the planner rebuild the call."""
    is_view: bool = False
    """True when every output aliases an input (no new memory)."""
    mutates: bool = False
    """An in-place op (``bernoulli_``, ``add_``, ``copy_``): its outputs alias its inputs, yet it runs a kernel
    over them, so it costs time where a view costs none."""
    shared_with: int | None = None
    """A sibling projection's cast of the same input that the runtime makes once and shares (the index of the
    node that makes it, :mod:`hf_colossal_auto.capture.shared_casts`): this one allocates nothing and runs no
    kernel, its output an alias in that node's storage."""

    @property
    def launches_kernel(self) -> bool:
        """False for a pure view (``view``, ``t``, ``detach``) and a shared cast: no kernel, no time on the
        device."""
        return (self.mutates or not self.is_view) and self.shared_with is None


@dataclass(frozen=True)
class MemoryEvent:
    """A storage coming to life or dying, placed on the op timeline.

    ``position`` is the number of ops recorded before the event: an allocation by node ``i`` has position
    ``i`` and counts from node ``i`` on; a free with position ``p`` takes effect after node ``p - 1``.
    """

    position: int
    storage_id: int
    delta: int
    """+nbytes on allocation, -nbytes on free."""

    @property
    def slot(self) -> int:
        """The node the event belongs to: the allocating node, or the node after which a free happened
        (-1 for a free before the first node)."""
        return self.position if self.delta > 0 else self.position - 1


@dataclass
class StorageInfo:
    """A storage and what it holds, for the memory categories of the report."""

    id: int
    nbytes: int
    kind: ValueKind
    name: str | None = None
    owner: str | None = None
    """Parameter FQN this storage belongs to (the parameter, its grad, its optimizer state, and the optimizer
    step's temporaries for it); lets folded blocks replay the optimizer step per parameter."""


@dataclass
class BlockRun:
    """A run of identical consecutive blocks in a ``ModuleList`` of which only some were traced.

    ``traced`` are the FQNs of the traced copies: the first blocks of the run, in order. The last traced copy
    ran as the last block of the (cut) stack and stands for ``all_blocks[-1]``; the one before it, the
    *representative*, stands for itself and for the ``repeat`` middle blocks that were not traced.
    """

    container: str
    all_blocks: list[str]
    traced: list[str]

    @property
    def repeat(self) -> int:
        return len(self.all_blocks) - len(self.traced)

    @property
    def representative(self) -> str:
        return self.traced[-2]

    @property
    def untraced(self) -> list[str]:
        """Real blocks the representative's copies stand for, in forward order."""
        return self.all_blocks[len(self.traced) - 1 : -1]

    def real_block(self, traced_block: str) -> str:
        """The real block a traced copy stands for when it is not a copy of the representative."""
        return self.all_blocks[-1] if traced_block == self.traced[-1] else traced_block


@dataclass
class Segment:
    """A contiguous slice ``[start, end)`` of the node list, with the memory events inside it."""

    start: int
    end: int


@dataclass
class StepGraph:
    """The recorded training step.

    ``initial_storages`` are storages alive before the step began (parameters, buffers, optimizer state, the
    batch); they form the memory floor. ``memory_events`` are the allocations and frees during the step.
    """

    model_class: str
    nodes: list[OpNode]
    values: dict[int, ValueInfo]
    storages: dict[int, StorageInfo]
    initial_storages: list[int]
    memory_events: list[MemoryEvent]
    param_names: list[str]
    """FQNs of every parameter of the *full* model (also those of folded blocks)."""
    param_bytes: dict[str, int]
    param_shapes: dict[str, tuple[int, ...]]
    optimizer_state_bytes: dict[str, int]
    """Bytes of optimizer state per parameter FQN, for every parameter of the full model."""
    buffer_bytes: int
    input_bytes: int
    block_runs: list[BlockRun] = field(default_factory=list)
    block_segments: dict[str, dict[Phase, Segment]] = field(default_factory=dict)
    """For each traced block FQN, its forward and backward node ranges."""
    mixed_precision: str | None = None
    optimizer: str | None = None
    module_types: dict[str, str] = field(default_factory=dict)
    """Module FQN -> class name (``Linear``, ``Conv1D``, ...): which ops run inside a projection."""
    output_values: list[int] = field(default_factory=list)
    """Value ids of the tensors the model's forward returns (loss, logits, ...): the runtime hands them to the
    caller as ordinary tensors, so a sharded one is gathered there."""
    block_args: dict[str, list[int]] = field(default_factory=dict)
    """Traced ``ModuleList`` child FQN -> storages of the tensors its forward was called with (positional and
    keyword, used or not): what a checkpoint of that block holds until the block's backward."""
    frozen_params: frozenset[str] = frozenset()
    """FQNs of the parameters with ``requires_grad=False`` (a frozen embedding, the base weights under LoRA):
    they get no gradient, no optimizer state and no data-parallel synchronisation, and the planner prices none."""

    # ------------------------------------------------------------------ queries
    def phase_range(self, phase: Phase) -> Segment:
        """The node range of one phase; the recorder keeps the phases in order."""
        idx = [n.index for n in self.nodes if n.phase is phase]
        if not idx:
            start = 0 if phase is Phase.FORWARD else len(self.nodes)
            return Segment(start, start)
        return Segment(idx[0], idx[-1] + 1)

    def made_inside(self, vid: int, module: str) -> bool:
        """Whether value ``vid`` was made by an op of ``module`` or of a module inside it: not one of that
        module's inputs (the value a projection's runtime hooks act on is its module input)."""
        producer = self.values[vid].producer
        if producer is None:
            return False
        made_in = self.nodes[producer].module
        return made_in == module or made_in.startswith(module + ".")

    def repeat_of_node(self) -> list[int]:
        """How many blocks each traced node stands for (1, or ``1 + repeat`` inside a representative)."""
        counts = [1] * len(self.nodes)
        for run in self.block_runs:
            segs = self.block_segments.get(run.representative, {})
            for seg in segs.values():
                for i in range(seg.start, seg.end):
                    counts[i] = 1 + run.repeat
        return counts

    @property
    def total_param_bytes(self) -> int:
        return sum(self.param_bytes.values())

    @property
    def total_optimizer_state_bytes(self) -> int:
        return sum(self.optimizer_state_bytes.values())

    def is_trainable(self, fqn: str) -> bool:
        """Whether parameter ``fqn`` is trained (``requires_grad``): only those have gradients to store and sync."""
        return fqn not in self.frozen_params

    @property
    def trainable_param_bytes(self) -> int:
        """Bytes of the trained parameters: what gradients, optimizer state and its step are proportional to."""
        return sum(b for n, b in self.param_bytes.items() if n not in self.frozen_params)
