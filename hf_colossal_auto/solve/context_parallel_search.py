"""Context parallelism as a planned axis (issue 28, item 3): the cp degree searched beside the mesh, priced as a
transform of the problem.

What is priced is what the context-parallel runtime runs: a mesh ``("dp", "cp", "tp")``; every token-wise op on
``seq / cp`` tokens of each sequence (load-balanced head + tail chunks, so that causal attention work is even
over the cp ranks); per attention layer the K and V of the rank's tokens all-gathered over cp and its local
queries computed against every key (masked causally by global positions), the K/V gradients reduce-scattered
over cp in backward; parameters replicated over cp, their gradients averaged over ``dp x cp`` ranks (the
gradient synchronisation and FSDP's group are ``dp x cp`` ranks). A plan's per-op placements are those of the
``(dp, tp)`` part; the cp axis's entry is ``"R"`` (the token split is the runtime's, by ``Plan.cp_size``).

How a cp degree ``c`` is priced (:class:`ContextParallelPlanner`): the batch of ``B`` sequences of ``S`` tokens
is planned as ``B x c`` sequences of ``S / c`` tokens on all ``N`` devices, with only the meshes ``(dp', tp)``
whose data-parallel size ``dp'`` is a multiple of ``c`` (``dp' = dp x c``). Every token-wise op of a rank then
has its real shapes, the data-parallel axis is the ``dp x cp`` group the gradients are synchronised (and FSDP
shards) over, on the link that group crosses, and the rest of the search (recompute, micro-batches, FSDP) is the
ordinary one. What the reshaped batch gets wrong is attention, corrected in the traced step
(:func:`context_parallel_step`) and the ILP (:func:`add_kv_collectives`):

* FLOPs: a rank's queries meet ``S`` keys, not ``S / c``: under the balanced layout its share of the causal
  attention is ``1 / c`` of the whole, ``c`` times what the reshaped step traced (whose chunk is causal on its
  own); each attention kernel's FLOPs (forward and backward) and K/V reads are scaled so;
* memory (checked against MemTracker on 2 gloo ranks, ``tests/multiproc/check_context_parallel_costs.py``): the
  runtime's attention keeps K and V of all ``S`` tokens; blocked (:class:`RuntimeAttention`: causal, a kernel
  with a log-sum-exp for the device, dtype and chunk, no dropout) as gathered, at the K/V heads, and no mask;
  on the mask path at the query heads (with a mask transformers' sdpa repeats grouped K/V heads), and the first
  layer the step's additive mask ``[1, 1, S / c, S]``, unless its block is recomputed: added to what the kernel
  keeps alive until its backward (its log-sum-exp output's storage, produced by the kernel and freed by its
  backward, so that recompute frees them with the block);
* communication: per attention layer, forward all-gathers of K and of V over cp (each the full ``S``-token
  tensor at the model's K/V heads, ``(c - 1) / c`` of it crossing the link), backward reduce-scatters of their
  gradients, on the link the cp axis crosses (``(dp, cp, tp)`` row-major: inside a node when ``cp x tp`` fits
  one), added to the attention op's cost per strategy (a strategy splitting heads over tp gathers ``1 / tp``).
  Priced exposed (not overlapped with the attention). Added to the plan after the solve: the recomputed blocks'
  K/V gathers again and two small all-reduces per forward (inputs' agreement, loss).

The step priced is a training step that reads only the loss: the runtime gathers token-wise outputs (logits,
hidden states) over cp only when the caller reads them (``apply/context_parallel_outputs.py``), so neither the
whole sequence's logits nor their all-gather are in the plan; ``solver["context_parallel"]`` says what a read
of the logits would add (``logits_read_bytes``, ``logits_read_s``), and the plan's summary says so.

A batch with a 2-D padding ``attention_mask`` (padded rows, :func:`has_padding`) runs every layer on the mask
path: the runtime keeps the padding mask whole on every rank (every cp rank of a replica is fed the same rows, so
no mask is gathered: only K and V), builds one additive mask ``[rows, 1, S / c, S]`` a step in the queries'
dtype, and hands it to the model's sdpa, whose kernel is the one the trace of the padded chunks picked (a fused
kernel that takes a mask: the CPU's flash kernel, CUDA's memory-efficient one). The traced kernel's mask (its
chunk's ``[rows, 1, S / c, S / c]``, which sdpa converts per layer and keeps for backward) is read ``c`` times
over, forward and backward, and its per-layer copy is dropped for the step's one mask (:attr:`AttentionKernel.
traced_mask`). Priced so on every layer, whether the rows traced are padded or not (the runtime keeps the blocked
path for a step whose rows carry no padding). A 4-D (custom) mask is refused: the runtime cuts none.

Offered only where the traced step's attention is a fused SDPA kernel given no mask besides the padding's (the
runtime builds masks from global positions, it gathers none): eager attention, a mask not from padding (a
sliding window's) or an unknown kernel leaves cp out, with a log line naming why (an error when the cp degree is
fixed).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .._torch_compat import attention_lse_kernel
from ..capture.graph import Phase, StepGraph
from ..capture.op_classes import op_base_name
from ..hardware.roofline import host_time
from ..plan import Plan
from .build.builder import BuiltProblem
from .build.names import NodeKind
from .candidates import _Planner
from .context_parallel_math import (  # noqa: F401 (_kernel_dropout: read here, and by tests from here)
    MathAttention,
    _kernel_dropout,
    math_attention_calls,
    operands,
    scale_math_attention,
)
from .local_tensor_parallel import LocalLayout
from .pricing.comm import AxisComm
from .problem import Solution

logger = logging.getLogger(__name__)

ATTENTION_FORWARD_KERNELS = (
    "aten._scaled_dot_product_flash_attention.default",
    "aten._scaled_dot_product_efficient_attention.default",
    "aten._scaled_dot_product_flash_attention_for_cpu.default",
    "aten._scaled_dot_product_cudnn_attention.default",
)
"""SDPA kernels whose (query, key, value) are their first three inputs and whose second output is the log-sum-exp
kept for backward: the attention context parallelism knows how to price."""

ATTENTION_BACKWARD_KERNELS = tuple(
    op.replace(".default", "_backward.default") for op in ATTENTION_FORWARD_KERNELS
)

CP_MODES = ("ddp", "fsdp")
"""Data-parallel modes offered with context parallelism: the gradient group is ``dp x cp`` ranks, which HSDP's
node-sized shard groups and expert parallelism over the data-parallel axis do not describe yet."""


class ContextParallelUnsupported(ValueError):
    """The model or batch cannot be planned with context parallelism (the message says why)."""


# ------------------------------------------------------------------------------------------- the batch
def sequence_length(example_inputs: Mapping[str, Any]) -> int:
    """Tokens per sequence of the batch: dim 1 of ``input_ids`` (else of the first tensor with two dims)."""
    ids = example_inputs.get("input_ids")
    if not isinstance(ids, torch.Tensor):
        ids = next((v for v in example_inputs.values() if isinstance(v, torch.Tensor) and v.dim() >= 2), None)
    if ids is None or ids.dim() < 2:
        raise ContextParallelUnsupported(
            "the batch has no [batch, sequence] tensor (input_ids) to split over cp"
        )
    return int(ids.shape[1])


def has_padding(example_inputs: Mapping[str, Any]) -> bool:
    """Whether the batch's ``attention_mask`` pads some row (a 0 anywhere): the runtime then runs every layer's
    attention on the mask path. Refused: a mask that is not 2-D (``[batch, sequence]``), which the runtime does
    not cut by sequence positions."""
    mask = example_inputs.get("attention_mask")
    if not isinstance(mask, torch.Tensor):
        return False
    if mask.dim() != 2:
        raise ContextParallelUnsupported(
            f"a {mask.dim()}-D attention_mask of shape {tuple(mask.shape)} (a custom mask) cannot be cut by "
            "sequence positions under context parallelism; pass the 2-D padding mask [batch, sequence] (or "
            "position_ids that restart for packed documents), or plan without context parallelism"
        )
    if mask.is_meta:
        # A shapes-only batch (what-if planning, `make_example_inputs(device="meta")`) carries no values: it is
        # priced as the unpadded rows such a batch stands for (a run whose rows are padded runs the mask path).
        return False
    return not bool(mask.bool().all())


def chunked_inputs(example_inputs: Mapping[str, Any], cp: int) -> dict[str, Any]:
    """The batch as one cp rank's token-wise ops see it: each of ``B`` sequences of ``S`` tokens as ``cp``
    sequences of ``S / cp`` (``[B, S, ...]`` -> ``[B x cp, S / cp, ...]``). Any tensor without the sequence dim
    is refused: its split over cp is not known (a 4-D attention mask by name, :func:`has_padding`)."""
    seq = sequence_length(example_inputs)
    has_padding(example_inputs)
    out: dict[str, Any] = {}
    for key, value in example_inputs.items():
        if not isinstance(value, torch.Tensor) or value.dim() == 0:
            out[key] = value
            continue
        if value.dim() < 2 or value.shape[1] != seq:
            raise ContextParallelUnsupported(
                f"input {key!r} of shape {tuple(value.shape)} has no sequence dim of {seq} tokens after the batch "
                "dim; context parallelism splits every input's sequence"
            )
        out[key] = value.reshape(value.shape[0] * cp, seq // cp, *value.shape[2:])
    return out


def query_head_count(model: nn.Module) -> int | None:
    """The model's query heads (SDPA's math path repeats grouped K/V to them), None where the config does not
    say."""
    return getattr(getattr(model, "config", None), "num_attention_heads", None)


def kv_head_count(model: nn.Module) -> int | None:
    """The model's K/V heads (grouped-query attention gathers them, before they repeat for the queries); None
    where the config does not say."""
    config = getattr(model, "config", None)
    heads = getattr(config, "num_attention_heads", None)
    return getattr(config, "num_key_value_heads", None) or heads


# ----------------------------------------------------------------------------------------- the step
@dataclass(frozen=True)
class AttentionKernel:
    """A forward attention kernel of the step and the K/V a cp rank gathers for it."""

    index: int
    """Graph node index of the forward kernel."""
    gathered_bytes: tuple[float, float]
    """K and V as gathered: all ``S`` tokens of the rank's rows at the K/V heads, heads unsplit by tp."""
    held_bytes: tuple[float, float]
    """K and V as the runtime's attention keeps them for backward: blocked (:attr:`blocked`), as gathered; on
    the mask path all ``S`` tokens at the *query* heads (with a mask, transformers' sdpa takes no grouped-query
    attention: ``repeat_kv`` copies them to every query head)."""
    mask_bytes: float
    """The mask path's additive mask ``[1, 1, S / cp, S]`` in the queries' dtype (one per step, every
    layer's); 0 when blocked."""
    blocked: bool = False
    """The runtime runs this layer's attention blocked, without a mask
    (:mod:`hf_colossal_auto.apply.context_parallel_blocks`)."""
    kept: int = -1
    """Value id on whose storage the K/V held (and the step's mask) are priced: the fused kernel's log-sum-exp,
    the math path's probabilities (each kept from the forward to the backward of its call)."""
    math: MathAttention | None = None
    """The call traced as SDPA's math decomposition (:mod:`.context_parallel_math`), None for a fused kernel."""
    traced_mask: int | None = None
    """Value id of the mask the traced fused kernel was given (padded rows: the chunk's padding and causal mask,
    converted by sdpa for this layer and kept for its backward), None where it was given none."""
    mask_cast: bool = False
    """The kernel runs in another dtype than the attention is called with (autocast casts the queries, e.g.
    Llama's float32 after RoPE, to bfloat16): the runtime's mask is cast per layer too, a ``[rows, 1, s, S]``
    copy kept for the layer's backward (the traced copy, ``cp`` times over), besides the step's mask."""


@dataclass(frozen=True)
class RuntimeAttention:
    """What decides how the runtime runs a layer's attention, as the planner sees it: the device kind, the
    model's attention modules (causality, sliding window) and the traced kernel (dtype, head dim, dropout).
    Blocked, without a mask, where the runtime's :func:`~hf_colossal_auto.apply.context_parallel_blocks.
    blocked_reason` would say so for the planned batch (never with padded rows: :attr:`padded`)."""

    device_kind: str
    modules: Mapping[str, nn.Module]
    padded: bool = False
    """The batch pads some row (:func:`has_padding`): every layer runs the mask path."""

    def blocked(self, graph: StepGraph, node: Any) -> bool:
        """Whether the attention of forward kernel ``node`` runs blocked. (A sliding window would too, with
        small masks, but its traced kernel is given the window's mask, which leaves cp unoffered.)"""
        module = self.modules.get(node.module)
        query = graph.values[node.inputs[0]]
        if self.padded or module is None or not getattr(module, "is_causal", True) or len(query.shape) != 4:
            return False
        if _kernel_dropout(node):
            return False
        dtype = getattr(torch, query.dtype.replace("torch.", ""), None)
        if not isinstance(dtype, torch.dtype):
            return False
        kernel = attention_lse_kernel(
            torch.device(self.device_kind), dtype, query.shape[-1], query.shape[2] // 2
        )
        return kernel is not None


def attention_kernels(
    graph: StepGraph,
    cp: int,
    kv_heads: int | None,
    runtime: RuntimeAttention | None = None,
    query_heads: int | None = None,
    padded: bool = False,
) -> list[AttentionKernel]:
    """The step's forward attention kernels (see :data:`ATTENTION_FORWARD_KERNELS`) with the K/V each gathers
    (``cp x`` the traced chunk, at ``kv_heads`` heads: the traced key input may have them already, the trace
    runs sdpa's grouped-query attention without a mask, or repeated to the query heads) and keeps, blocked or on
    the mask path as ``runtime`` says (None: the mask path). SDPA calls traced as its math decomposition (on a
    CPU target with attention dropout: :mod:`.context_parallel_math`) count as kernels on the mask path, their
    K/V at ``query_heads``. ``padded`` (:func:`has_padding`): the step's mask is ``[rows, 1, s, S]`` (a row's
    padding), not ``[1, 1, s, S]``, and a kernel given the traced chunk's mask is priced (its mask recorded,
    :attr:`AttentionKernel.traced_mask`). Refused where there are none (eager attention: its matmul + softmax
    gets the model's mask) or a kernel is given a mask without padded rows (a sliding window's)."""
    kernels = _math_kernels(graph, cp, kv_heads, query_heads, padded)
    for node in graph.nodes:
        if node.op not in ATTENTION_FORWARD_KERNELS:
            continue
        q, k, v = node.inputs[:3]
        traced_mask = _mask_input(graph, node)
        if traced_mask is not None and not padded:
            raise ContextParallelUnsupported(
                f"attention in {node.module or type(graph).__name__} ({node.op}) is given a mask tensor that is "
                "not a padding mask (a sliding window's, or the model's own); context parallelism builds masks "
                "from global positions for causal attention with padding or packed documents: plan without "
                "context parallelism, or without the model's extra mask"
            )
        query = graph.values[q]
        traced_heads = graph.values[k].shape[1] if len(graph.values[k].shape) == 4 else None
        query_heads = query.shape[1] if len(query.shape) == 4 else None
        gather_ratio = kv_heads / traced_heads if kv_heads and traced_heads else 1.0
        held_ratio = query_heads / traced_heads if query_heads and traced_heads else 1.0
        gathered = tuple(float(graph.values[x].nbytes) * cp * gather_ratio for x in (k, v))
        held = tuple(float(graph.values[x].nbytes) * cp * held_ratio for x in (k, v))
        numel = math.prod(query.shape) or 1
        local = query.shape[-2] if len(query.shape) >= 2 else 0
        rows = query.shape[0] if padded and len(query.shape) == 4 else 1
        itemsize = query.nbytes / numel
        cast = False
        if padded:  # the runtime builds its mask in the dtype the attention is called with (before autocast)
            itemsize, cast = _called_itemsize(graph, node, itemsize)
        mask = float(rows * local * local * cp * itemsize)
        blocked = runtime is not None and runtime.blocked(graph, node)
        if blocked:
            held, mask = gathered, 0.0
        kernels.append(
            AttentionKernel(
                node.index,
                gathered,
                held,
                mask,
                blocked,
                node.outputs[1],  # type: ignore[arg-type]
                traced_mask=traced_mask,
                mask_cast=cast,
            )
        )
    if not kernels:
        raise ContextParallelUnsupported(
            f"no fused attention kernel (scaled_dot_product_attention) in the traced step of {graph.model_class}: "
            "its attention (eager, or a custom implementation) is not one context parallelism can price; load "
            "the model with attn_implementation='sdpa'"
        )
    kernels.sort(key=lambda k: k.index)
    return kernels


def _math_kernels(
    graph: StepGraph, cp: int, kv_heads: int | None, query_heads: int | None, padded: bool = False
) -> list[AttentionKernel]:
    """SDPA calls of ``graph`` traced as the math path, as kernels on the runtime's mask path: K/V gathered at
    ``kv_heads`` (the math path's operands are at ``query_heads``) and held at the query heads, the step's mask
    ``[1, 1, s, S]``. Refused by name: one that adds a mask from outside its attention module (eager attention's
    causal mask, a padding mask), or one without dropout (whose kernel on the runtime's device the trace did
    not pick). Padded rows on the math path (a CPU target with attention dropout) are refused too: the pricing
    of a padding mask added to the scores is the fused kernels'."""
    kernels = []
    for call in math_attention_calls(graph):
        if padded:
            raise ContextParallelUnsupported(
                f"attention in {call.module or graph.model_class} runs scaled_dot_product_attention's unfused math "
                "path (attention dropout on a CPU target) with a padding mask, which context parallelism does not "
                "price; train without attention dropout (config attention_dropout=0), pack the rows (all-ones "
                "mask), or plan for a CUDA device"
            )
        if call.outside_mask:
            raise ContextParallelUnsupported(
                "no fused attention kernel (scaled_dot_product_attention) without a mask in the traced step: "
                f"attention in {call.module or graph.model_class} adds a mask tensor from outside the attention "
                "(eager attention's causal mask, or a padding mask); context parallelism gathers K and V only: "
                "load the model with attn_implementation='sdpa' and train without a padding mask"
            )
        if not call.dropout:
            raise ContextParallelUnsupported(
                f"attention in {call.module or graph.model_class} was traced as scaled_dot_product_attention's "
                "unfused math path without dropout, whose kernel under context parallelism is not known here; "
                "trace for a device with fused SDPA kernels (float32/bfloat16 on CPU, any on CUDA)"
            )
        q, k, v = operands(graph, call)
        ratio = kv_heads / query_heads if kv_heads and query_heads else 1.0
        gathered = tuple(float(graph.values[x].nbytes) * cp * ratio for x in (k, v))
        held = tuple(float(graph.values[x].nbytes) * cp for x in (k, v))
        query = graph.values[q]
        local = query.shape[-2] if len(query.shape) >= 2 else 0
        mask = float(local * local * cp * (query.nbytes / max(math.prod(query.shape), 1)))
        kept = graph.nodes[call.softmax].outputs[0]
        kernels.append(AttentionKernel(call.scores_matmul, gathered, held, mask, False, kept, call))  # type: ignore[arg-type]
    return kernels


def _called_itemsize(graph: StepGraph, node: Any, itemsize: float) -> tuple[float, bool]:
    """Bytes per element of the queries the attention of kernel ``node`` was called with, and whether the kernel
    got them cast (a ``_to_copy`` in the attention module: autocast's, or the CUDA tracing's cast as autocast
    does); ``itemsize``, False where not cast."""
    producer = graph.values[node.inputs[0]].producer
    if producer is None:
        return itemsize, False
    cast = graph.nodes[producer]
    if op_base_name(cast.op) != "_to_copy" or cast.module != node.module or not cast.inputs:
        return itemsize, False
    source = graph.values[cast.inputs[0]]
    source_itemsize = source.nbytes / (math.prod(source.shape) or 1)
    return source_itemsize, source_itemsize != itemsize


def _mask_input(graph: StepGraph, node) -> int | None:
    """The tensor an attention kernel gets besides q, k, v (a mask or bias), None where it gets none."""
    return next((x for x in node.inputs[3:] if x in graph.values and len(graph.values[x].shape) >= 2), None)


def context_parallel_step(
    graph: StepGraph,
    cp: int,
    kv_heads: int | None,
    runtime: RuntimeAttention | None = None,
    query_heads: int | None = None,
    padded: bool = False,
) -> StepGraph:
    """``graph`` (the step traced on the cp-chunked batch) made what a cp rank runs, in place: each attention
    kernel's FLOPs (forward and backward) ``cp`` times (its queries meet all keys), its K/V reads (and its
    backward's K/V gradient writes) those of the gathered K/V, and what the runtime holds beyond the trace (:func:`_grow`): per kernel the K/V it keeps
    (all ``S`` tokens at the query heads, :attr:`AttentionKernel.held_bytes`) from the forward kernel to its
    backward, on its log-sum-exp's storage; the step's one additive mask, on the first kernel's (freed by the
    last backward kernel, where the runtime's lives to the next forward). The logits stay the chunk's: a step
    that reads only the loss gathers no output (:mod:`~hf_colossal_auto.apply.context_parallel_outputs`). A
    call traced as SDPA's math path (:mod:`.context_parallel_math`) has its score ops and matmuls, forward and
    backward, and its score tensors scaled to the key length instead, its K/V and the mask on its
    probabilities' storage. ``padded`` (:func:`has_padding`): a kernel given the traced chunk's mask reads
    ``cp`` times it, forward and backward (the runtime's ``[rows, 1, s, S]``), and the per-layer copy sdpa made
    of it in the attention module is dropped (the runtime's one mask, already priced as the step's, is handed
    to every layer as it is)."""
    kernels = attention_kernels(graph, cp, kv_heads, runtime, query_heads, padded)
    grown: dict[int, int] = {}
    traced_masks = {k.traced_mask for k in kernels if k.traced_mask is not None}
    done: set[int] = set()
    masked = [k for k in kernels if not k.blocked]
    step_mask = {masked[0].index: int(masked[0].mask_bytes)} if masked else {}  # on its first user's storage
    for kernel in kernels:
        node = graph.nodes[kernel.index]
        if kernel.math is not None:
            traced_kv = sum(graph.values[x].nbytes for x in operands(graph, kernel.math)[1:])
            scale_math_attention(graph, kernel.math, cp, grown)
        else:
            traced_kv = sum(graph.values[x].nbytes for x in node.inputs[1:3])
            node.flops *= cp
            node.bytes_read += (cp - 1) * (traced_kv + _mask_read(graph, node, traced_masks))
        extra = int(sum(kernel.held_bytes)) - traced_kv + step_mask.get(kernel.index, 0)
        _grow(graph, kernel.kept, extra, grown)
        if kernel.traced_mask is not None:
            _layer_mask(graph, kernel.traced_mask, node.module, cp if kernel.mask_cast else 0, grown, done)
    backward = [n for n in graph.nodes if n.op in ATTENTION_BACKWARD_KERNELS]
    for node in backward:
        node.flops *= cp
        kv = sum(graph.values[x].nbytes for x in node.inputs[2:4])
        node.bytes_read += (cp - 1) * (kv + _mask_read(graph, node, traced_masks))
        node.bytes_written += (cp - 1) * sum(graph.values[x].nbytes for x in node.outputs[1:3])  # dK, dV
    for sid, extra in grown.items():
        storage = graph.storages[sid]
        graph.storages[sid] = dataclasses.replace(storage, nbytes=storage.nbytes + extra)
    events = []
    for event in graph.memory_events:
        extra = grown.get(event.storage_id, 0)
        if extra:
            event = dataclasses.replace(event, delta=event.delta + (extra if event.delta > 0 else -extra))
        events.append(event)
    graph.memory_events = events
    return graph


def _mask_read(graph: StepGraph, node: Any, masks: set[int]) -> int:
    """Bytes of the traced masks (``masks``) that attention kernel ``node`` reads."""
    return sum(graph.values[x].nbytes for x in node.inputs if x in masks)


def _layer_mask(
    graph: StepGraph, mask: int, module: str, scale: int, grown: dict[int, int], done: set[int]
) -> None:
    """The storage of the mask a traced kernel of ``module`` was given, where ``module`` made it (sdpa's
    per-layer conversion of the model's boolean mask, kept for the kernel's backward), made ``scale`` times its
    size: 0 (dropped) where the runtime hands every layer its one additive mask as it is, ``cp`` where the kernel
    gets it cast (:attr:`AttentionKernel.mask_cast`: a per-layer copy of ``[rows, 1, s, S]``). A mask made
    outside the module (the model's, shared by the layers) is left: the runtime builds no such mask, but it is
    the size of a layer's copy at most (boolean)."""
    info = graph.values[mask]
    producer = info.producer
    if producer is None or graph.nodes[producer].module != module or info.storage_id in done:
        return
    done.add(info.storage_id)
    grown[info.storage_id] = (
        grown.get(info.storage_id, 0) + (scale - 1) * graph.storages[info.storage_id].nbytes
    )


def _grow(graph: StepGraph, value: int, extra: int, grown: dict[int, int]) -> None:
    """Record ``extra`` bytes more on ``value``'s storage (applied to storages and events by the caller)."""
    info = graph.values[value]
    grown[info.storage_id] = grown.get(info.storage_id, 0) + extra
    graph.values[value] = dataclasses.replace(info, nbytes=info.nbytes + extra)


def logits_value(graph: StepGraph, module: str | None) -> int | None:
    """The value id of the logits: the last forward output of the output embeddings ``module`` (None if the
    step has none; the runtime all-gathers them over cp when the caller reads them)."""
    if not module:
        return None
    found = None
    for node in graph.nodes:
        if node.module == module and node.phase == Phase.FORWARD and not node.is_view and node.outputs:
            found = node.outputs[0]
    return found


def output_embeddings_name(model: nn.Module) -> str | None:
    """The name of ``model``'s output embeddings (the LM head), or None."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    if head is None:
        return None
    return next((name for name, m in model.named_modules() if m is head), None)


# ------------------------------------------------------------------------------------- the collectives
@dataclass
class KvCollectives:
    """Per strategy of one attention node: seconds and bytes (the gathered tensors, as collectives are given)
    of its K/V all-gathers (forward) and reduce-scatters (backward), per step of one copy of the node."""

    gather_s: list[float]
    scatter_s: list[float]
    nbytes: list[float]
    count: int
    """Collectives of each kind per step of one copy (K and V, times the micro-batches)."""


def kv_wire_bytes(gathered_bytes: float, cp: int) -> float:
    """Bytes one rank receives in the ring all-gather of a ``gathered_bytes`` tensor over ``cp`` ranks (and sends
    in the reduce-scatter of its gradient): ``(cp - 1) / cp`` of it."""
    return gathered_bytes * (cp - 1) / cp


def add_kv_collectives(
    built: BuiltProblem,
    graph: StepGraph,
    cp_comm: AxisComm,
    cp: int,
    kv_heads: int | None,
    tp: int,
    query_heads: int | None = None,
    padded: bool = False,
) -> dict[str, KvCollectives]:
    """Every attention op node of ``built`` costs, per strategy and micro-batch, the all-gathers of its K and V
    over cp and the reduce-scatters of their gradients (:func:`attention_kernels`; a strategy that splits the
    key input over tp gathers ``1 / tp``). Returns them by ILP node name, for the plan's figures."""
    micro = built.micro_batches
    kernels = {
        k.index: k for k in attention_kernels(graph, cp, kv_heads, query_heads=query_heads, padded=padded)
    }
    added: dict[str, KvCollectives] = {}
    for name, index in built.node_of_name.items():
        kernel = kernels.get(index)
        if kernel is None:
            continue
        node = next(n for n in built.problem.nodes if n.name == name and n.kind == NodeKind.OP)
        strategies = built.strategies.get(name) or [None] * len(node.costs)
        record = KvCollectives([], [], [], 2 * micro)
        for choice, strategy in enumerate(strategies):
            split = 1
            if strategy is not None and strategy.input_placements[1] is not None:
                split = tp if strategy.input_placements[1][0].startswith("S") else 1
            local = [b / split for b in kernel.gathered_bytes]
            gather = micro * sum(cp_comm.time("all_gather", b) for b in local)
            scatter = micro * sum(cp_comm.time("reduce_scatter", b) for b in local)
            node.costs[choice] += gather + scatter
            record.gather_s.append(gather)
            record.scatter_s.append(scatter)
            record.nbytes.append(micro * sum(local))
        added[name] = record
    return added


SMALL_ALL_REDUCE_BYTES = (8, 4)
"""The runtime's two small all-reduces per forward: the one-integer (int64) agreement that every rank's inputs
were accepted (over the job), and the scalar float32 loss summed over cp."""

CUDA_GENERATOR_STATE_BYTES = 16
"""``torch.cuda.get_rng_state()``'s size (uint8): the Philox generator's int64 seed and int64 offset. A constant,
not asked of a device: a plan for CUDA is often made on a host without one, and asking would initialise CUDA in
the planning process."""


def generator_state_bytes(device_kind: str) -> int:
    """What the runtime's generator agreement broadcasts once per training forward under cp (``apply/rng.py``:
    the replica's first rank sends its generator states to the replica's ``cp x tp`` ranks, whether or not the
    model then draws: under cp it agrees up front): the CPU generator's state, and the CUDA device's where the
    mesh is on CUDA. Why priced: it is a collective of every step, which a check of the plan's collectives
    against c10d's records counts."""
    nbytes = torch.Generator().get_state().numel()  # uint8
    if device_kind == "cuda":
        nbytes += CUDA_GENERATOR_STATE_BYTES
    return nbytes


@dataclass(frozen=True)
class StepExtras:
    """What the runtime runs per micro-batch besides the K/V collectives the ILP prices, from the traced step."""

    logits_read_bytes: float
    """What reading the logits all-gathers per forward (the whole sequence's, ``cp`` times the traced chunk's),
    0 without an LM head. Not priced: a training step reads only the loss."""
    attention_modules: tuple[str, ...]
    """The module of each attention kernel: a block recomputed in backward gathers its K and V again."""
    micro_batches: int


def step_extras(
    graph: StepGraph, cp: int, logits_module: str | None, micro_batches: int, padded: bool = False
) -> StepExtras:
    """:class:`StepExtras` of a cp rank's step ``graph`` (made by :func:`context_parallel_step`: its logits are
    the chunk's)."""
    logits = logits_value(graph, logits_module)
    gathered = float(graph.values[logits].nbytes) * cp if logits is not None else 0.0
    modules = tuple(graph.nodes[k.index].module for k in attention_kernels(graph, cp, None, padded=padded))
    return StepExtras(gathered, modules, micro_batches)


def added_after_solve_s(micro_batches: int, cp_comm: AxisComm) -> float:
    """Seconds a plan gets after the solve whatever its choices (:func:`context_parallel_plan` adds them): the
    two small all-reduces and the generator agreement's broadcast (:func:`generator_state_bytes`; its group is
    the replica's ``cp x tp`` ranks, priced on the cp axis's link) of every micro-batch (a step that reads only
    the loss gathers no logits, so nothing here depends on the traced step). Why here: the search adds them to
    its lower bounds (:meth:`ContextParallelPlanner.fixed_added_s`), so they are written once."""
    small = sum(cp_comm.time("all_reduce", b) for b in SMALL_ALL_REDUCE_BYTES)
    return micro_batches * (small + cp_comm.time("broadcast", generator_state_bytes(cp_comm.device_kind)))


def recomputed_attention_layers(extras: StepExtras, recompute: Mapping[str, str]) -> int:
    """Attention layers inside a block the plan recomputes (fully or selectively: both rerun the block's forward,
    the K/V all-gathers included)."""
    blocks = [b for b, option in recompute.items() if option != "none"]
    return sum(any(m == b or m.startswith(b + ".") for b in blocks) for m in extras.attention_modules)


# ----------------------------------------------------------------------------------------- the planner
class ContextParallelPlanner(_Planner):
    """The planner of one cp degree: the batch chunked over cp (:func:`chunked_inputs`) on every device, meshes
    whose data-parallel size is ``dp x cp``, traces made cp ranks' steps (:func:`context_parallel_step`), ILPs
    with the K/V collectives (:func:`add_kv_collectives`), and Plans written on the mesh ``(dp, cp, tp)``."""

    def __init__(self, outer: _Planner, cp: int) -> None:
        super().__init__(
            outer.model,
            chunked_inputs(outer.inputs, cp),
            outer.cluster,
            outer.budget,
            outer.mixed_precision,
            outer.optimizer,
            outer.time_limit_s,
            outer.recompute,
        )
        self.routing = outer.routing
        self.cp = cp
        self.kv_heads = kv_head_count(outer.model)
        self.query_heads = query_head_count(outer.model)
        self.padded = has_padding(outer.inputs)
        self.logits_module = output_embeddings_name(outer.model)
        self.outer = outer
        self._kv: dict[int, dict[str, KvCollectives]] = {}
        """id of a built problem -> its attention nodes' K/V collectives."""
        self._extras: dict[int, StepExtras] = {}
        """id of a built problem -> the step's other cp collectives and the attention layers by module."""

    def _trace(self, rows: int) -> StepGraph:
        return context_parallel_step(
            super()._trace(rows),
            self.cp,
            self.kv_heads,
            self.runtime_attention(),
            self.query_heads,
            self.padded,
        )

    def local_layout(self, dp: int, tp: int, micro_batches: int = 1) -> LocalLayout:
        """None: the runtime runs no module on local tensor shards under context parallelism (the cp collectives
        sit inside the attention)."""
        return LocalLayout()

    def runtime_attention(self) -> RuntimeAttention:
        """How the runtime's attention runs on this cluster's devices (blocked or masked, per layer)."""
        return RuntimeAttention(self.spec.kind, dict(self.outer.model.named_modules()), self.padded)

    def any_graph(self, dp: int, micro_batches: int = 1) -> StepGraph:
        """A step at hand for what does not depend on the batch (parameters, their optimizer state, the ops that
        read them): this degree's own, else one the planner without cp traced (the same model: the chunking
        changes no parameter), else this degree's at ``(dp, micro_batches)``. Why: the search's state,
        gradient and synchronisation floors then rule candidates out before their step is traced."""
        return self._graphs.any() or self.outer._graphs.any() or self.graph(dp, micro_batches)

    def fixed_added_s(self, mesh: tuple[int, int], micro_batches: int) -> float:
        """Seconds every plan of ``(mesh, micro_batches)`` gets after its solve, whatever its choices
        (:func:`added_after_solve_s`): what the search adds to the lower bounds it prunes candidates by. Needs no
        trace."""
        return added_after_solve_s(micro_batches, self.cp_comm(mesh)) * (1 - 1e-12)  # never above the plan's

    def offers_mesh(self, mesh: tuple[int, int]) -> bool:
        """Only meshes whose data-parallel size is ``dp x cp`` for a whole dp."""
        return mesh[0] % self.cp == 0

    def cp_comm(self, mesh: tuple[int, int]) -> AxisComm:
        """The cp axis's collectives on mesh ``(dp, cp, tp)``: plain collectives (an eager op and a launch)."""
        full = (mesh[0] // self.cp, self.cp, mesh[1])
        overhead = self.spec.kernel_overhead_s + host_time(self.spec, dtensor=False)
        return AxisComm(self.cp, self.cluster.axis_link(full, 1), self.spec.kind, overhead)

    def build(self, mesh: tuple[int, int], dp_mode: str, *args: Any, **kwargs: Any) -> BuiltProblem:
        built = super().build(mesh, dp_mode, *args, **kwargs)
        graph = self.graph(mesh[0], built.micro_batches)
        self._kv[id(built)] = add_kv_collectives(
            built, graph, self.cp_comm(mesh), self.cp, self.kv_heads, mesh[1], self.query_heads, self.padded
        )
        self._extras[id(built)] = step_extras(
            graph, self.cp, self.logits_module, built.micro_batches, self.padded
        )
        return built

    def to_plan(self, mesh: tuple[int, int], dp_mode: str, built: BuiltProblem, solution: Solution) -> Plan:
        plan = super().to_plan(mesh, dp_mode, built, solution)
        kv = self._kv.get(id(built), {})
        extras = self._extras.get(id(built))
        return context_parallel_plan(
            plan, self.outer, self.cp, kv, built, solution, extras, self.cp_comm(mesh)
        )


def _with_cp_axis(placements: dict[str, list[str]]) -> dict[str, list[str]]:
    """``[dp, tp]`` placements with the cp axis's ``"R"`` between them."""
    return {k: [p[0], "R", *p[1:]] for k, p in placements.items()}


def context_parallel_plan(
    plan: Plan,
    outer: _Planner,
    cp: int,
    kv: Mapping[str, KvCollectives],
    built: BuiltProblem,
    solution: Solution,
    extras: StepExtras | None = None,
    cp_comm: AxisComm | None = None,
) -> Plan:
    """The Plan of a chunked-batch solution on mesh ``(dp x cp, tp)`` as the runtime runs it: mesh
    ``(dp, cp, tp)``, the cp axis ``"R"`` in every placement, the user's batch, ``cp_size``, and the K/V
    collectives moved from compute to communication (``cp_all_gather`` / ``cp_reduce_scatter``). Added after
    the solve (``extras``, priced on ``cp_comm``; the ILP does not see them): per micro-batch the two small
    all-reduces (``cp_all_reduce``: the inputs' agreement, the loss) and the generator agreement's broadcast
    (``cp_broadcast``: :func:`generator_state_bytes`), and the K/V all-gathers again for each
    attention layer of a recomputed block. A step that reads only the loss: the logits' all-gather, which a
    read adds, is recorded (``logits_read_bytes`` / ``logits_read_s``), not priced."""
    multiplicity = {n.name: n.multiplicity for n in built.problem.nodes}
    gather_s = scatter_s = nbytes = count = 0.0
    for name, record in kv.items():
        choice = solution.choice[name]
        m = multiplicity[name]
        gather_s += m * record.gather_s[choice]
        scatter_s += m * record.scatter_s[choice]
        nbytes += m * record.nbytes[choice]
        count += m * record.count
    layers = sum(multiplicity[n] for n in kv)
    dp, tp = plan.mesh_shape
    collectives = dict(plan.collectives)
    collective_bytes = dict(plan.collective_bytes)
    collectives["cp_reduce_scatter"], collective_bytes["cp_reduce_scatter"] = count, nbytes
    added_s, rerun, read_bytes, read_s = 0.0, 0, 0.0, 0.0
    gathers, gathered = count, nbytes
    if extras is not None and cp_comm is not None:
        micro = extras.micro_batches
        reduce_s = added_after_solve_s(micro, cp_comm)
        rerun = recomputed_attention_layers(extras, plan.recompute)
        if rerun and layers:  # a recomputed layer gathers its K and V again (the mean layer's bytes and time)
            gathers += count * rerun / layers
            gathered += nbytes * rerun / layers
            added_s += gather_s * rerun / layers
        if extras.logits_read_bytes:  # not in the step: only a caller that reads the logits gathers them
            read_bytes = micro * extras.logits_read_bytes
            read_s = micro * cp_comm.time("all_gather", extras.logits_read_bytes)
        collectives["cp_all_reduce"] = micro * len(SMALL_ALL_REDUCE_BYTES)
        collective_bytes["cp_all_reduce"] = micro * sum(SMALL_ALL_REDUCE_BYTES)
        collectives["cp_broadcast"] = micro
        collective_bytes["cp_broadcast"] = micro * generator_state_bytes(cp_comm.device_kind)
        added_s += reduce_s
    collectives["cp_all_gather"], collective_bytes["cp_all_gather"] = gathers, gathered
    solver = dict(plan.solver)
    solver["context_parallel"] = {
        "cp": cp,
        "kv_all_gather_s": gather_s,
        "kv_reduce_scatter_s": scatter_s,
        "kv_gathered_bytes": nbytes,
        "kv_wire_bytes": kv_wire_bytes(nbytes, cp),
        "attention_layers": layers,
        "recomputed_attention_layers": rerun,
        "added_after_solve_s": added_s,
        "gradient_group": dp,
        "outputs": "loss only",
        "logits_read_bytes": read_bytes,
        "logits_read_s": read_s,
    }
    return dataclasses.replace(
        plan,
        mesh_shape=(dp // cp, cp, tp),
        mesh_axis_names=("dp", "cp", "tp"),
        cp_size=cp,
        param_placements=_with_cp_axis(plan.param_placements),
        activation_placements=_with_cp_axis(plan.activation_placements),
        param_use_placements=_with_cp_axis(plan.param_use_placements),
        block_input_placements=_with_cp_axis(plan.block_input_placements),
        global_batch_size=outer.batch,
        input_shapes={k: list(v.shape) for k, v in outer.inputs.items() if isinstance(v, torch.Tensor)},
        step_time_s=plan.step_time_s + added_s,
        compute_time_s=plan.compute_time_s - gather_s - scatter_s,
        communication_time_s=plan.communication_time_s + gather_s + scatter_s + added_s,
        collectives=collectives,
        collective_bytes=collective_bytes,
        solver=solver,
    )
