"""``profile_model``: capture one training step symbolically and price every op of it."""

from __future__ import annotations

import logging
import math
import time
from collections import defaultdict
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ..capture.graph import OpNode, Phase, StepGraph
from ..capture.op_classes import MATMUL, is_transcendental, op_base_name, op_class
from ..capture.tracer import trace_training_step
from ..hardware import DeviceSpec, get_device
from ..hardware.roofline import kernel_time, step_op_time
from .memory import MemoryProfile, UnrolledStep, _optimizer_copies, memory_profile, unroll
from .report import BlockProfile, ModuleProfile, NodeProfile, ProfileReport

logger = logging.getLogger(__name__)


def node_dtype(graph: StepGraph, node: OpNode) -> str:
    """The dtype that sets a node's FLOP rate: its first floating-point input (matmuls) or output."""
    for vid in (*node.inputs, *node.outputs):
        dtype = graph.values[vid].dtype
        if dtype.startswith(("float", "bfloat")):
            return dtype
    return "float32"


_ATTENTION_KERNEL_PREFIXES = ("_scaled_dot_product", "_flash_attention", "_efficient_attention")


def is_attention_kernel(op: str) -> bool:
    """A fused attention kernel (forward or backward), priced at the device's attention rate."""
    return op_base_name(op).startswith(_ATTENTION_KERNEL_PREFIXES)


def transcendental_elements(graph: StepGraph, node: OpNode) -> float:
    """Elements an elementwise math op (exp, tanh, softmax...) evaluates: its output's; 0 for other ops."""
    if not node.outputs or not is_transcendental(node.op):
        return 0.0
    return float(math.prod(graph.values[node.outputs[0]].shape))


def node_times(graph: StepGraph, spec: DeviceSpec, *, dtensor: bool = False) -> list[float]:
    """Seconds every traced node adds to a step on ``spec`` (:func:`~hardware.roofline.step_op_time`: the
    kernel and the host's per-op overhead, DTensor's too with ``dtensor``). An optimizer op over a
    representative block's parameters also moves the bytes of their twins in the folded blocks (one foreach
    kernel for all)."""
    copies = _optimizer_copies(graph)
    opt_start = graph.phase_range(Phase.OPTIMIZER).start

    def moved(vids) -> int:
        return sum(graph.values[v].nbytes * copies.get(graph.values[v].storage_id, 1) for v in vids)

    return [
        step_op_time(
            n.flops,
            moved(dict.fromkeys(n.inputs)) + moved(n.outputs)
            if copies and n.index >= opt_start
            else n.bytes_read + n.bytes_written,
            node_dtype(graph, n),
            spec,
            view=not n.launches_kernel,
            attention=is_attention_kernel(n.op),
            matmul=op_class(n.op) == MATMUL,
            transcendental_elements=transcendental_elements(graph, n),
            dtensor=dtensor,
            op=n.op,
        )
        for n in graph.nodes
    ]


def node_kernel_time(graph: StepGraph, node: OpNode, spec: DeviceSpec) -> float:
    """Device seconds of one traced node's kernel on ``spec`` (no host overhead; 0 for a view)."""
    if not node.launches_kernel:
        return 0.0
    return kernel_time(
        node.flops,
        node.bytes_read + node.bytes_written,
        node_dtype(graph, node),
        spec,
        attention=is_attention_kernel(node.op),
        matmul=op_class(node.op) == MATMUL,
        transcendental_elements=transcendental_elements(graph, node),
        op=node.op,
    )


def block_units(module_names: list[str], list_children: list[str]) -> dict[str, str]:
    """Map each module FQN to the depth unit ("block") it belongs to.

    Children of a ``ModuleList`` are blocks (the outermost such list wins, so a T5 block's inner ``layer`` list
    does not split it). Outside those, a module belongs to its shallowest ancestor that does not contain a block
    list (``transformer.wte``, ``lm_head``); modules that contain block lists (``transformer``) and the root
    are their own unit.
    """
    containers = set()
    for child in list_children:
        parts = child.split(".")
        for i in range(len(parts) - 1):
            containers.add(".".join(parts[:i]))
    containers.add("")
    mapping: dict[str, str] = {}
    sorted_children = sorted(list_children, key=lambda c: c.count("."))
    for name in module_names:
        unit = None
        for child in sorted_children:
            if name == child or name.startswith(child + "."):
                unit = child
                break
        if unit is None:
            parts = name.split(".") if name else []
            unit = name
            for i in range(1, len(parts) + 1):
                prefix = ".".join(parts[:i])
                if prefix not in containers:
                    unit = prefix
                    break
        mapping[name] = unit
    return mapping


def _module_list_children(model: nn.Module) -> list[str]:
    out = []
    for fqn, module in model.named_modules():
        if isinstance(module, nn.ModuleList):
            out.extend(f"{fqn}.{i}" if fqn else str(i) for i in range(len(module)))
    return out


def _input_shapes(inputs: Mapping[str, Any]) -> dict[str, list[int]]:
    return {k: list(v.shape) for k, v in inputs.items() if isinstance(v, torch.Tensor)}


def profile_model(
    model: nn.Module,
    example_inputs: Mapping[str, Any],
    *,
    device: str | DeviceSpec = "a100-80gb",
    mixed_precision: str | None = None,
    optimizer: str | None = "adamw",
    fold_blocks: bool = True,
) -> ProfileReport:
    """Profile one training step of ``model`` on ``example_inputs`` without running it.

    Args:
        model: any ``nn.Module`` whose forward takes the batch as keyword arguments and returns a loss
            (HF models with ``labels``). It may live on ``meta``: only shapes are read.
        example_inputs: one batch, e.g. ``{"input_ids": ..., "labels": ...}`` (real or meta tensors).
        device: a hardware catalog name (``hf_colossal_auto.hardware.list_devices()``) or a ``DeviceSpec``;
            sets the roofline times and which device's attention kernels are traced (a GPU target gets the
            flash/memory-efficient kernels even when profiling on a CPU host).
        mixed_precision: ``None``/``"no"``, ``"bf16"`` or ``"fp16"`` (autocast, as accelerate applies it).
        optimizer: ``"adamw"`` (default), ``"adam"``, ``"sgd"`` or None; its state counts as already allocated.
        fold_blocks: trace one representative of each run of identical blocks and reuse its figures.
    """
    spec = get_device(device)
    t0 = time.perf_counter()
    graph = trace_training_step(
        model,
        example_inputs,
        mixed_precision=mixed_precision,
        optimizer=optimizer,
        fold_blocks=fold_blocks,
        device_kind=spec.kind,
    )
    t1 = time.perf_counter()
    report = build_report(model, graph, spec, example_inputs)
    t2 = time.perf_counter()
    report.capture_time_s = t1 - t0
    report.profile_time_s = t2 - t1
    logger.info("profiled %s: capture %.2fs, analysis %.2fs", type(model).__name__, t1 - t0, t2 - t1)
    return report


def build_report(
    model: nn.Module, graph: StepGraph, spec: DeviceSpec, example_inputs: Mapping[str, Any]
) -> ProfileReport:
    """Price a captured step: FLOPs and times per node, block and module, and the liveness peak."""
    step = unroll(graph)
    mem = memory_profile(graph, step)
    times = node_times(graph, spec)
    counts, flops, phase_time = _phase_totals(graph, step, times)
    modules, real_module = _module_profiles(graph, step, times, mem)
    params = dict(model.named_parameters())
    block_list = _block_profiles(model, graph, step, times, mem, real_module, params)
    grad_bytes = sum(graph.param_bytes[p] for p, t in params.items() if t.requires_grad)
    nodes = _node_profiles(graph, times, mem, counts)
    return ProfileReport(
        model_class=graph.model_class,
        device=spec.name,
        mixed_precision=graph.mixed_precision,
        optimizer=graph.optimizer,
        input_shapes=_input_shapes(example_inputs),
        total_flops=flops[Phase.FORWARD] + flops[Phase.BACKWARD],
        forward_flops=flops[Phase.FORWARD],
        backward_flops=flops[Phase.BACKWARD],
        num_params=sum(p.numel() for p in params.values()),
        param_bytes=graph.total_param_bytes,
        grad_bytes=grad_bytes,
        optimizer_state_bytes=graph.total_optimizer_state_bytes,
        buffer_bytes=graph.buffer_bytes,
        input_bytes=graph.input_bytes,
        activation_bytes=mem.activation_bytes,
        peak_activation_bytes=mem.peak_activation_bytes,
        peak_memory_bytes=mem.peak_bytes,
        peak_phase=mem.peak_phase.value,
        peak_breakdown=mem.peak_by_kind,
        forward_time_s=phase_time[Phase.FORWARD],
        backward_time_s=phase_time[Phase.BACKWARD],
        optimizer_time_s=phase_time[Phase.OPTIMIZER],
        num_ops=len(step.order),
        num_traced_ops=len(graph.nodes),
        folded_blocks=sum(r.repeat for r in graph.block_runs),
        capture_time_s=0.0,
        profile_time_s=0.0,
        blocks=block_list,
        modules=sorted(modules.values(), key=lambda m: m.name),
        nodes=nodes,
        graph=graph,
    )


def _phase_totals(
    graph: StepGraph, step: UnrolledStep, times: list[float]
) -> tuple[dict[int, int], dict[Phase, int], dict[Phase, float]]:
    """How often each traced node runs in the unrolled step, and the step's FLOPs and seconds per phase."""
    counts: dict[int, int] = defaultdict(int)
    for i in step.order:
        counts[i] += 1

    flops = {p: 0 for p in Phase}
    phase_time = {p: 0.0 for p in Phase}
    for i, c in counts.items():
        n = graph.nodes[i]
        flops[n.phase] += n.flops * c
        phase_time[n.phase] += times[i] * c
    return counts, flops, phase_time


def _module_profiles(
    graph: StepGraph, step: UnrolledStep, times: list[float], mem: MemoryProfile
) -> tuple[dict[str, ModuleProfile], list[str]]:
    """FLOPs, seconds and saved bytes per real module, and the real module of each op of the unrolled step."""
    # Per real module: translate a copy's module path from the traced block to the real block it stands for.
    modules: dict[str, ModuleProfile] = {}
    real_module: list[str] = []
    for pos, i in enumerate(step.order):
        n = graph.nodes[i]
        label, source = step.block_of[pos], step.source_of[pos]
        name = n.module
        if label is not None and source is not None and (name == source or name.startswith(source + ".")):
            name = label + name[len(source) :]
        real_module.append(name)
        mp = modules.setdefault(name, ModuleProfile(name))
        if n.phase is Phase.FORWARD:
            mp.forward_flops += n.flops
            mp.forward_time_s += times[i]
            mp.saved_bytes += mem.saved_bytes_per_node.get(i, 0)
        elif n.phase is Phase.BACKWARD:
            mp.backward_flops += n.flops
            mp.backward_time_s += times[i]
    return modules, real_module


def _block_profiles(
    model: nn.Module,
    graph: StepGraph,
    step: UnrolledStep,
    times: list[float],
    mem: MemoryProfile,
    real_module: list[str],
    params: dict[str, nn.Parameter],
) -> list[BlockProfile]:
    """Per block (each ``ModuleList`` child, the rest of the model in units around them): parameters, FLOPs,
    seconds, saved and output bytes, in model order; blocks with nothing to report left out."""
    list_children = _module_list_children(model)
    unit_of = block_units(sorted(set(real_module) | {n for n, _ in model.named_modules()}), list_children)
    blocks: dict[str, BlockProfile] = {}
    order: list[str] = []
    for name in [n for n, _ in model.named_modules()]:
        unit = unit_of.get(name, name)
        if unit not in blocks:
            order.append(unit)
            blocks[unit] = BlockProfile(unit, 0, 0, 0, 0, 0.0, 0.0, 0, 0)
    for fqn, p in params.items():
        unit = unit_of.get(fqn.rsplit(".", 1)[0] if "." in fqn else "", "")
        blocks[unit].num_params += p.numel()
        blocks[unit].param_bytes += p.numel() * p.element_size()
    out_bytes_per_node = _forward_alloc_bytes(graph)
    for pos, i in enumerate(step.order):
        n = graph.nodes[i]
        unit = unit_of.get(real_module[pos], real_module[pos])
        if unit not in blocks:
            order.append(unit)
            blocks[unit] = BlockProfile(unit, 0, 0, 0, 0, 0.0, 0.0, 0, 0)
        b = blocks[unit]
        if n.phase is Phase.FORWARD:
            b.forward_flops += n.flops
            b.forward_time_s += times[i]
            b.saved_bytes += mem.saved_bytes_per_node.get(i, 0)
            b.output_bytes += out_bytes_per_node.get(i, 0)
        elif n.phase is Phase.BACKWARD:
            b.backward_flops += n.flops
            b.backward_time_s += times[i]
    for run in graph.block_runs:
        for b in run.untraced:
            blocks[b].traced_as = run.representative
        blocks[run.all_blocks[-1]].traced_as = run.traced[-1]
    block_list = [
        blocks[u]
        for u in order
        if blocks[u].forward_flops
        or blocks[u].num_params
        or blocks[u].backward_flops
        or blocks[u].forward_time_s
    ]
    return block_list


def _node_profiles(
    graph: StepGraph, times: list[float], mem: MemoryProfile, counts: dict[int, int]
) -> list[NodeProfile]:
    """One row per traced node: its op, module, phase, FLOPs, bytes, seconds and how often the step runs it."""
    nodes = [
        NodeProfile(
            index=n.index,
            op=n.op,
            module=n.module,
            phase=n.phase.value,
            flops=n.flops,
            bytes_read=n.bytes_read,
            bytes_written=n.bytes_written,
            output_bytes=sum(graph.values[v].nbytes for v in n.outputs) if n.launches_kernel else 0,
            saved_bytes=mem.saved_bytes_per_node.get(n.index, 0),
            time_s=times[n.index],
            count=counts.get(n.index, 1),
        )
        for n in graph.nodes
    ]
    return nodes


def _forward_alloc_bytes(graph: StepGraph) -> dict[int, int]:
    out: dict[int, int] = defaultdict(int)
    for e in graph.memory_events:
        if e.delta > 0 and graph.nodes[e.slot].phase is Phase.FORWARD:
            out[e.slot] += e.delta
    return dict(out)
