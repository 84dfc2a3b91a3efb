"""The typed output of the profile stage, with a readable table and JSON."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any

from ..capture.graph import StepGraph
from ..units import format_bytes, format_flops, format_seconds


@dataclass
class NodeProfile:
    """One traced op with its cost; ``count`` is how many ops of the full step it stands for."""

    index: int
    op: str
    module: str
    phase: str
    flops: int
    bytes_read: int
    bytes_written: int
    output_bytes: int
    saved_bytes: int
    time_s: float
    count: int = 1


@dataclass
class ModuleProfile:
    """Costs aggregated over the ops whose innermost module is this FQN (or inside it, for ``total_*``)."""

    name: str
    forward_flops: int = 0
    backward_flops: int = 0
    forward_time_s: float = 0.0
    backward_time_s: float = 0.0
    saved_bytes: int = 0


@dataclass
class BlockProfile:
    """A unit of the model's depth: an embedding, one transformer block, the final norm, the head..."""

    name: str
    num_params: int
    param_bytes: int
    forward_flops: int
    backward_flops: int
    forward_time_s: float
    backward_time_s: float
    saved_bytes: int
    """Activation bytes this block keeps from forward for backward."""
    output_bytes: int
    """Bytes the block's forward allocated in total (saved or transient)."""
    traced_as: str | None = None
    """For a folded block: the traced block whose figures it reuses."""


def _plain(value: Any) -> Any:
    """``dataclasses.asdict`` for one field's value (dataclasses, lists and dicts of them)."""
    if is_dataclass(value) and not isinstance(value, type):
        return asdict(value)
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


@dataclass
class ProfileReport:
    """What one training step costs, from a symbolic (fake-tensor) run.

    ``total_flops`` counts forward and backward exactly as ``FlopCounterMode`` does on a real run (plus the CPU
    flash-attention kernels it has no formula for; see :mod:`hf_colossal_auto.profile.flops`).
    ``peak_memory_bytes`` is the liveness peak of one steady-state step: forward, backward and
    ``optimizer.step()`` with the optimizer state already allocated.
    """

    model_class: str
    device: str
    mixed_precision: str | None
    optimizer: str | None
    input_shapes: dict[str, list[int]]
    total_flops: int
    forward_flops: int
    backward_flops: int
    num_params: int
    param_bytes: int
    grad_bytes: int
    optimizer_state_bytes: int
    buffer_bytes: int
    input_bytes: int
    activation_bytes: int
    """Activation bytes alive at the end of forward (kept for backward)."""
    peak_activation_bytes: int
    peak_memory_bytes: int
    peak_phase: str
    peak_breakdown: dict[str, int]
    forward_time_s: float
    backward_time_s: float
    optimizer_time_s: float
    num_ops: int
    """Ops of the full step (folded blocks counted at full depth)."""
    num_traced_ops: int
    folded_blocks: int
    """Blocks whose figures were reused from a traced twin instead of being traced."""
    capture_time_s: float
    profile_time_s: float
    blocks: list[BlockProfile] = field(default_factory=list)
    modules: list[ModuleProfile] = field(default_factory=list)
    nodes: list[NodeProfile] = field(default_factory=list)
    graph: StepGraph | None = field(default=None, repr=False, compare=False)

    @property
    def estimated_step_time_s(self) -> float:
        """Roofline compute time of the step on one device (no communication)."""
        return self.forward_time_s + self.backward_time_s + self.optimizer_time_s

    # ------------------------------------------------------------------ output
    def to_dict(self, include_nodes: bool = False) -> dict[str, Any]:
        """The report's figures as JSON-ready data. The captured ``graph`` is left out — and never copied:
        ``asdict`` deep-copies every field, and the graph holds profiler objects that cannot be copied."""
        skip = {"graph"} if include_nodes else {"graph", "nodes"}
        data = {f.name: _plain(getattr(self, f.name)) for f in fields(self) if f.name not in skip}
        data["estimated_step_time_s"] = self.estimated_step_time_s
        return data

    def to_json(self, path: str | Path | None = None, include_nodes: bool = False) -> str:
        text = json.dumps(self.to_dict(include_nodes=include_nodes), indent=2)
        if path is not None:
            Path(path).write_text(text)
        return text

    def summary(self, max_blocks: int | None = None) -> str:
        """A per-block table and the totals, as plain text."""
        header = ("block", "params", "fwd FLOPs", "bwd FLOPs", "saved act.", "fwd time", "bwd time")
        rows = []
        blocks = self.blocks
        i = 0
        while i < len(blocks):
            b = blocks[i]
            j = i
            while j + 1 < len(blocks) and blocks[j + 1].traced_as and blocks[j + 1].traced_as == b.traced_as:
                j += 1
            name = b.name or "(model)"
            if j > i:
                name = f"{name} .. {blocks[j].name.rsplit('.', 1)[-1]} (x{j - i + 1})"
            rows.append(
                (
                    name + (" *" if b.traced_as else ""),
                    _count(b.num_params),
                    format_flops(b.forward_flops),
                    format_flops(b.backward_flops),
                    format_bytes(b.saved_bytes),
                    format_seconds(b.forward_time_s),
                    format_seconds(b.backward_time_s),
                )
            )
            i = j + 1
        if max_blocks is not None and len(rows) > max_blocks:
            head = max_blocks // 2
            hidden = len(rows) - max_blocks
            rows = [
                *rows[:head],
                (f"... {hidden} more rows ...", "", "", "", "", "", ""),
                *rows[-(max_blocks - head) :],
            ]
        widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
        lines = [
            f"Profile of {self.model_class} on {self.device}"
            f" (mixed precision: {self.mixed_precision or 'no'}, optimizer: {self.optimizer or 'none'})",
            "inputs: " + ", ".join(f"{k}{tuple(v)}" for k, v in self.input_shapes.items()),
            "",
            "  ".join(
                h.ljust(w) if i == 0 else h.rjust(w)
                for i, (h, w) in enumerate(zip(header, widths, strict=False))
            ),
            "  ".join("-" * w for w in widths),
        ]
        for r in rows:
            lines.append(
                "  ".join(
                    c.ljust(w) if i == 0 else c.rjust(w)
                    for i, (c, w) in enumerate(zip(r, widths, strict=False))
                )
            )
        if self.folded_blocks:
            lines.append(
                f"* figures reused from an identical traced block ({self.folded_blocks} blocks folded)"
            )
        lines += [
            "",
            f"parameters          {_count(self.num_params)} ({format_bytes(self.param_bytes)}),"
            f" grads {format_bytes(self.grad_bytes)}, optimizer state {format_bytes(self.optimizer_state_bytes)}",
            f"FLOPs per step      {format_flops(self.total_flops)}"
            f" (fwd {format_flops(self.forward_flops)}, bwd {format_flops(self.backward_flops)})",
            f"activations         {format_bytes(self.activation_bytes)} kept for backward",
            f"peak memory         {format_bytes(self.peak_memory_bytes)} in {self.peak_phase} ("
            + ", ".join(f"{k} {format_bytes(v)}" for k, v in self.peak_breakdown.items() if v)
            + ")",
            f"est. step time      {format_seconds(self.estimated_step_time_s)} on one {self.device}"
            f" (fwd {format_seconds(self.forward_time_s)}, bwd {format_seconds(self.backward_time_s)},"
            f" optimizer {format_seconds(self.optimizer_time_s)}; roofline, no communication)",
            f"ops                 {self.num_ops} in the step, {self.num_traced_ops} traced;"
            f" capture {format_seconds(self.capture_time_s)}, profile {format_seconds(self.profile_time_s)}",
        ]
        return "\n".join(lines)


def _count(n: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(n)
