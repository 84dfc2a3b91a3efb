"""In-step calibration: what every kind of op costs inside a real training step on this machine.

The kernel micro-benchmarks (:mod:`hf_colossal_auto.hardware.microbench`) time GEMMs, copies and
elementwise math alone, on operands made for the benchmark. Inside a step some kernels cost more than any of them predicts: dropout's
random numbers (``bernoulli_``: arithmetic, not bandwidth), a CPU ``addmm`` that first copies its bias into
the output, softmaxes over rows of a vocabulary, GEMMs whose operands come cold from the previous op, fresh
pages of a large buffer touched for the first time. Measured on a 2-core CPU, those gaps left every predicted
step time 10-40 % low (docs/benchmarks.md, step-time fidelity).

This module runs a few real forward/backward passes of reference models, times every aten op at the dispatch
level (the level the capture records, so the ops match one for one), prices the same ops of the captured step
with the micro-benchmarked spec, and keeps per op kind ``measured / predicted`` as
:attr:`~hf_colossal_auto.hardware.DeviceSpec.op_time_scale`. The roofline multiplies each kernel by its op's scale; an op kind
the steps did not run keeps 1.0. ``hf-colossal-auto calibrate --step-model NAME`` adds it to a calibration.

Only the forward and backward passes are timed: the optimizer on a CPU runs a per-parameter loop whose ops
differ from the foreach ops the capture records, and its kernels are plain bandwidth.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .._torch_compat import TorchDispatchMode
from ..capture.graph import Phase
from ..capture.op_classes import op_base_name
from ..hardware.spec import DeviceSpec

__all__ = [
    "MIN_OP_SECONDS",
    "MIN_CALL_SECONDS",
    "OpTimes",
    "StepScales",
    "time_step_ops",
    "predicted_step_ops",
    "scales_from",
    "measure_op_time_scales",
    "format_scales",
    "with_op_time_scales",
]

logger = logging.getLogger(__name__)

MIN_OP_SECONDS = 1e-3
"""An op kind whose measured total per step is below this keeps scale 1.0: too little time to measure well."""

MIN_CALL_SECONDS = 50e-6
"""...and so does one whose calls average below this: the host's few microseconds per call would dominate
its measurement, and the host is priced separately (``host_overhead_s``)."""


@dataclass
class OpTimes:
    """Seconds and calls per aten op kind (base name, e.g. ``"mm"``) in one training step."""

    seconds: dict[str, float]
    calls: dict[str, int]

    def add(self, other: OpTimes) -> None:
        for key, value in other.seconds.items():
            self.seconds[key] = self.seconds.get(key, 0.0) + value
        for key, value in other.calls.items():
            self.calls[key] = self.calls.get(key, 0) + value


@dataclass(frozen=True)
class StepScales:
    """The result: ``scales`` (op kind -> measured / predicted) with the figures behind each, for a table."""

    scales: dict[str, float]
    measured: OpTimes
    predicted: dict[str, float]
    models: tuple[str, ...]

    def rows(self) -> list[tuple[str, float, float, int, float | None]]:
        """(op, measured s, predicted s, calls, scale or None when left at 1.0), largest measured first."""
        names = sorted(self.measured.seconds, key=lambda k: -self.measured.seconds[k])
        return [
            (
                name,
                self.measured.seconds[name],
                self.predicted.get(name, 0.0),
                self.measured.calls.get(name, 0),
                self.scales.get(name),
            )
            for name in names
        ]


class _OpTimer(TorchDispatchMode):
    """Times every aten op that reaches dispatch (nested calls inside an op run below the mode and count as the
    op's own time). On a GPU each op is synchronised on both sides: slower than a real step, but each op's
    time is then its own kernel's."""

    def __init__(self, sync: bool) -> None:
        super().__init__()
        self.sync = sync
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.sync:
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        if self.sync:
            torch.cuda.synchronize()
        key = op_base_name(str(func))
        self.seconds[key] += time.perf_counter() - start
        self.calls[key] += 1
        return out


def time_step_ops(
    model: torch.nn.Module, batch: Mapping[str, Any], *, steps: int = 3, warmup: int = 1
) -> OpTimes:
    """Seconds per op kind of one forward + backward of ``model`` on ``batch``: per op kind the median over
    ``steps`` timed passes after ``warmup`` untimed ones (a pass slowed by another process on the machine moves
    no op's figure). In a multi-process job the ranks start each pass together, so that they contend for the
    machine as in a data-parallel step. Gradients are dropped after each pass."""
    device = next(model.parameters()).device
    passes: list[_OpTimer] = []

    def one_pass(timer: _OpTimer | None) -> None:
        if dist.is_initialized():
            dist.barrier()
        if timer is not None:
            with timer:
                model(**batch).loss.backward()
        else:
            model(**batch).loss.backward()
        for p in model.parameters():
            p.grad = None

    model.train()
    for _ in range(warmup):
        one_pass(None)
    for _ in range(steps):
        passes.append(_OpTimer(sync=device.type == "cuda"))
        one_pass(passes[-1])
    names = {k for timer in passes for k in timer.seconds}
    return OpTimes(
        seconds={k: statistics.median(timer.seconds.get(k, 0.0) for timer in passes) for k in names},
        calls={k: passes[-1].calls.get(k, 0) for k in names},
    )


def predicted_step_ops(
    model: torch.nn.Module, batch: Mapping[str, Any], spec: DeviceSpec
) -> dict[str, float]:
    """Kernel seconds per op kind of the same forward + backward, captured and priced on ``spec`` (with the op
    scales it carries: :func:`measure_op_time_scales` passes a spec without any, the micro-benchmarks'
    prediction)."""
    from ..capture.tracer import trace_training_step
    from ..profile.memory import unroll
    from ..profile.profiler import node_kernel_time

    graph = trace_training_step(model, dict(batch), device_kind=spec.kind)
    counts: dict[int, int] = defaultdict(int)
    for i in unroll(graph).order:
        counts[i] += 1
    out: dict[str, float] = defaultdict(float)
    for i, count in counts.items():
        node = graph.nodes[i]
        if node.phase in (Phase.FORWARD, Phase.BACKWARD):
            out[op_base_name(node.op)] += node_kernel_time(graph, node, spec) * count
    return dict(out)


def scales_from(measured: OpTimes, predicted: Mapping[str, float]) -> dict[str, float]:
    """``measured / predicted`` per op kind with enough time to measure (:data:`MIN_OP_SECONDS`,
    :data:`MIN_CALL_SECONDS`) and a prediction to compare with."""
    scales: dict[str, float] = {}
    for name, seconds in measured.seconds.items():
        calls = measured.calls.get(name, 0)
        guess = predicted.get(name, 0.0)
        if seconds < MIN_OP_SECONDS or not calls or seconds / calls < MIN_CALL_SECONDS or guess <= 0:
            continue
        scales[name] = seconds / guess
    return scales


def _mean_over_ranks(times: OpTimes) -> OpTimes:
    """Every rank's figures averaged (the ranks ran the same model on the same batch, so the same op kinds)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return times
    names = [sorted(times.seconds)]
    dist.broadcast_object_list(names, src=0)
    values = torch.tensor([times.seconds.get(n, 0.0) for n in names[0]], dtype=torch.float64)
    dist.all_reduce(values)
    values /= dist.get_world_size()
    return OpTimes(
        seconds=dict(zip(names[0], values.tolist(), strict=True)),
        calls={n: times.calls.get(n, 0) for n in names[0]},
    )


def _label(source: Any) -> str:
    """A model source as the log and the provenance name it: the preset/path, or a config's model type."""
    return source if isinstance(source, str) else getattr(source, "model_type", type(source).__name__)


def measure_op_time_scales(
    models: Sequence[Any],
    spec: DeviceSpec,
    *,
    batch_size: int = 4,
    seq_len: int = 256,
    steps: int = 3,
    device: str | torch.device | None = None,
) -> StepScales:
    """Run each of ``models`` (preset names, config paths or ``PretrainedConfig`` objects, built with random
    weights) for
    ``steps`` timed forward/backward passes at ``batch_size x seq_len`` on every rank, and return the op
    scales of all of them together (times summed over the models per op kind before dividing).

    ``spec`` is the micro-benchmarked device the scales correct; call this on every rank of a running job
    (the passes are timed together and the figures averaged over ranks)."""
    from ..models import build_model, make_example_inputs

    if not models:
        raise ValueError("measure_op_time_scales needs at least one model (a preset name or a config path)")
    if batch_size < 1 or seq_len < 1:
        raise ValueError(f"batch_size and seq_len must be >= 1, got {batch_size} and {seq_len}")
    target = torch.device(device or ("cuda" if spec.kind == "cuda" else "cpu"))
    measured = OpTimes({}, {})
    predicted: dict[str, float] = defaultdict(float)
    unscaled = spec.with_overrides(op_time_scale={})
    for name in models:
        torch.manual_seed(0)
        model = build_model(name, device=target)
        batch = make_example_inputs(model, batch_size, seq_len, device=target, seed=0)
        for key, value in predicted_step_ops(model, batch, unscaled).items():
            predicted[key] += value
        measured.add(_mean_over_ranks(time_step_ops(model, batch, steps=steps)))
        del model, batch
    scales = scales_from(measured, predicted)
    logger.info(
        "in-step calibration on %s: %d op kinds scaled (%s)",
        ", ".join(_label(m) for m in models),
        len(scales),
        ", ".join(
            f"{k} x{v:.2f}" for k, v in sorted(scales.items(), key=lambda kv: -abs(math.log(kv[1])))[:6]
        ),
    )
    return StepScales(
        scales=scales, measured=measured, predicted=dict(predicted), models=tuple(_label(m) for m in models)
    )


def format_scales(result: StepScales, limit: int = 15) -> Iterable[str]:
    """Lines of a table: the op kinds with the most measured time, measured vs predicted, the scale kept."""
    yield f"  {'op':34s} {'measured':>10s} {'predicted':>10s} {'calls':>6s}  scale"
    for name, seconds, guess, calls, scale in result.rows()[:limit]:
        kept = f"x{scale:.2f}" if scale is not None else "-"
        yield f"  {name:34s} {seconds * 1e3:8.1f}ms {guess * 1e3:8.1f}ms {calls:6d}  {kept}"


def with_op_time_scales(
    spec: DeviceSpec, models: Sequence[Any], *, batch_size: int = 4, seq_len: int = 256
) -> tuple[DeviceSpec, StepScales]:
    """``spec`` with the op scales of real steps of ``models`` (every rank runs them together), its provenance
    naming the models and the shape, and the figures behind the scales (for a table)."""
    steps = measure_op_time_scales(models, spec, batch_size=batch_size, seq_len=seq_len)
    provenance = {
        **spec.calibration,
        "step_models": list(steps.models),
        "step_shape": [batch_size, seq_len],
    }
    return spec.with_overrides(op_time_scale=steps.scales, calibration=provenance), steps
