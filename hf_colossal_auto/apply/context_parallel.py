"""Context parallelism: the ranks of a ``cp`` mesh axis split each sequence of a replica's rows.

What a plan with ``cp_size > 1`` runs (Llama 3's context parallelism; every piece works with any attention
kernel, the CPU's included, and composes with the plan's tensor parallelism):

* **Inputs.** Every cp rank of a data-parallel replica is fed the *same* rows, whole sequences (the batch rule
  of :mod:`.data`: the replica consumes its ``cp x tp`` processes' batches). The model's wrapped forward keeps
  this rank's part of each sequence: the sequence is cut into ``2 cp`` equal chunks and rank ``r`` holds chunks
  ``r`` and ``2 cp - 1 - r`` (the head-tail balance torchtitan uses: under a causal mask every rank then has
  the same attention work). Token ids, embeddings, token types, position ids and labels are cut so; position
  ids are made from the global positions when the caller passed none.
* **Labels** are shifted on the whole sequence before the cut (transformers' causal-LM loss takes
  ``shift_labels``), so the token after a chunk boundary is still the label of the one before it, and the loss
  is summed and divided by the replica's whole count of labelled tokens (``num_items_in_batch``): each rank's
  loss is its share of the replica's mean, their sum (all-reduced, the backward of which is the identity) is
  one process's loss on every rank.
* **Attention** is transformers' own (``sdpa`` or ``eager``) through an attention function registered in its
  registry (``ALL_ATTENTION_FUNCTIONS``): keys and values are all-gathered over the cp group (their gradients
  reduce-scattered back) and the mask is built from the queries' and keys' *global* positions: causal, the
  caller's padding mask, the model's sliding window, and the documents of packed sequences (found from the
  position ids, as transformers finds them).
* **Outputs**: the loss is summed over cp in the forward; the fields that run along the sequence (logits,
  hidden states) are all-gathered back into sequence order only when the caller reads them
  (:mod:`.context_parallel_outputs`: a training step that reads only ``.loss`` gathers nothing), so the caller
  sees one process's tensors. A read is a collective over the cp group: every cp rank reads alike. Their
  backward keeps this rank's positions: every rank computes the same thing from them.
* **Gradients**: parameters are replicated over cp; each rank's gradient is its tokens' share, so they are
  summed over cp and averaged over dp — one all-reduce over the ``dp x cp`` ranks (:func:`gradient_group`).
  Under FSDP the parameters are sharded over the ``dp x cp`` ranks instead (FSDP2 over the flattened mesh,
  :func:`.runtime.data_parallel_shard_mesh`), their gradients reduce-scattered as the same sum over cp divided
  by dp (:func:`.runtime.set_context_parallel_gradient_sum`).

Refused by name, on every rank (the forward raises before any collective): a sequence length that ``2 cp``
does not divide, attention implementations that take no global-position mask (flash attention, flex
attention), models whose loss is not transformers' causal-LM loss, models with other sequence-mixing layers
(convolutions), encoder-decoders, a 4-D attention mask, flash attention's packed-sequence arguments
(``cu_seq_lens_*``), a KV cache (generation), ``output_attentions``, pipeline stages, HSDP and
mixture-of-experts plans.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from .._torch_compat import flatten_mesh_axes
from ..plan import Plan, unpriced_plan
from .context_parallel_attention import (
    ATTENTION_NAME,
    CP_ATTR,
    SUPPORTED_ATTENTION,
    ContextParallel,
    ContextParallelError,
    StepLayout,
    local_tensor,
    register_attention,
)
from .context_parallel_outputs import OutputDeferral, install_output_deferral

logger = logging.getLogger(__name__)

TOKEN_INPUTS = ("input_ids", "inputs_embeds", "token_type_ids", "position_ids")
"""Forward arguments split on the sequence dim (dim 1); labels are shifted first."""

FLASH_PACKED_INPUTS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
"""Flash attention's packed-sequence arguments: documents by offsets, which a global-position mask cannot read."""


def balanced_positions(seq_len: int, cp: int, rank: int) -> torch.Tensor:
    """The global positions rank ``rank`` of ``cp`` holds of a ``seq_len`` sequence: chunk ``rank`` and chunk
    ``2 cp - 1 - rank`` of ``2 cp`` equal chunks (head and tail: equal causal-attention work per rank)."""
    check_sequence_length(seq_len, cp)
    chunk = seq_len // (2 * cp)
    head = torch.arange(rank * chunk, (rank + 1) * chunk)
    tail = torch.arange((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk)
    return torch.cat([head, tail])


def check_sequence_length(seq_len: int, cp: int) -> None:
    """Refuse a sequence the balanced layout cannot cut: ``2 cp`` equal chunks."""
    if seq_len % (2 * cp):
        raise ContextParallelError(
            f"context parallelism over cp={cp} ranks cuts each sequence into 2 x cp = {2 * cp} equal chunks (a "
            f"head and a tail chunk per rank); a sequence length of {seq_len} does not divide. Pad or cut the "
            f"sequences to a multiple of {2 * cp} (e.g. the recipes' --seq_len, or pad_to_multiple_of={2 * cp})"
        )


# ------------------------------------------------------------------------------------------- the model
def check_context_parallel_model(model: nn.Module, plan: Plan) -> str:
    """Refuse, by name, what context parallelism cannot run exactly; return the attention implementation it
    wraps."""
    name = type(model).__name__
    config = getattr(model, "config", None)
    if plan.pp_size > 1:
        raise ContextParallelError(
            "Plan: context parallelism (cp_size > 1) with pipeline stages is not run yet; plan one or the other"
        )
    if plan.dp_mode not in ("ddp", "fsdp"):
        raise ContextParallelError(
            f"Plan: context parallelism runs with dp_mode 'ddp' (parameters replicated over dp x cp) or 'fsdp' "
            f"(sharded over dp x cp); the plan has {plan.dp_mode!r}, whose node-sized shard groups are not "
            "laid out over the cp axis yet: plan with dp_modes=('ddp', 'fsdp')"
        )
    if plan.moe_layers or plan.expert_data_parallel:
        raise ContextParallelError(
            f"{name}: mixture-of-experts models under context parallelism are not run yet (their load-balancing "
            "loss reads every token of a sequence); plan without cp"
        )
    if config is None or getattr(config, "is_encoder_decoder", False):
        raise ContextParallelError(
            f"{name}: context parallelism runs decoder-only causal LMs with a transformers config; not an "
            "encoder-decoder"
        )
    loss = getattr(model, "loss_function", None)
    causal_lm = name.endswith(("ForCausalLM", "LMHeadModel"))
    if not causal_lm or getattr(loss, "__name__", "") != "ForCausalLMLoss":
        raise ContextParallelError(
            f"{name}: context parallelism needs a causal LM whose loss is transformers' ForCausalLMLoss (it "
            "takes pre-shifted labels, so the loss at chunk boundaries is exact)"
        )
    convs = [n for n, m in model.named_modules() if isinstance(m, nn.Conv1d | nn.Conv2d)]
    if convs:
        raise ContextParallelError(
            f"{name}: {convs[0]} is a convolution, which mixes neighbouring positions across the chunks context "
            "parallelism splits sequences into; plan without cp"
        )
    attention = getattr(config, "_attn_implementation", None) or "eager"
    if attention == ATTENTION_NAME:
        raise ContextParallelError(f"{name} already runs context-parallel attention (plan applied twice?)")
    if attention not in SUPPORTED_ATTENTION:
        raise ContextParallelError(
            f"{name}: attn_implementation {attention!r} cannot take the global-position mask context "
            f"parallelism needs; load the model with attn_implementation in {SUPPORTED_ATTENTION}"
        )
    if attention == "eager" and getattr(config, "reorder_and_upcast_attn", False):
        raise ContextParallelError(
            f"{name}: reorder_and_upcast_attn bypasses transformers' attention registry; use sdpa or turn it off"
        )
    return attention


def gradient_group(mesh: DeviceMesh) -> tuple[dist.ProcessGroup | None, int]:
    """The group a replicated parameter's gradient is all-reduced over, and what the sum is divided by: the
    data-parallel axis (divided by dp), or with a ``cp`` axis the ``dp x cp`` ranks (cp ranks hold parts of
    one replica's gradient: summed; divided by dp). ``(None, 1)`` with one rank."""
    names = tuple(mesh.mesh_dim_names or ())
    dp = mesh.size(names.index("dp")) if "dp" in names else 1
    cp = mesh.size(names.index("cp")) if "cp" in names else 1
    if cp > 1:
        if dp > 1:
            return flatten_mesh_axes(mesh, ("dp", "cp"), "dp_cp").get_group(), dp
        return mesh.get_group(names.index("cp")), 1
    if dp > 1:
        return mesh.get_group(names.index("dp")), dp
    return None, 1


def install_context_parallel(model: nn.Module, plan: Plan, mesh: DeviceMesh) -> ContextParallel:
    """Run ``model`` context-parallel over the mesh's ``cp`` axis: its attention through
    :func:`context_parallel_attention`, its forward splitting sequences (:func:`wrap_context_parallel_forward`).
    Call after the rest of the runtime has wrapped the forward (this wrapper is the outermost)."""
    from .data_parallel import mesh_device  # it imports gradient_group from here

    base = check_context_parallel_model(model, plan)
    names = tuple(mesh.mesh_dim_names or ())
    axis = names.index("cp")
    cp = ContextParallel(
        group=mesh.get_group(axis),
        size=mesh.size(axis),
        rank=mesh.get_local_rank("cp"),
        base_attention=base,
        device=mesh_device(mesh),
    )
    register_attention()
    model.config._attn_implementation = ATTENTION_NAME
    for module in model.modules():
        setattr(module, CP_ATTR, cp)
    wrap_context_parallel_forward(model, cp)
    logger.info("context parallelism over %d ranks (attention: %s with K/V all-gathered)", cp.size, base)
    return cp


def wrap_context_parallel_forward(model: nn.Module, cp: ContextParallel) -> None:
    """``model(**whole_rows)`` runs on this rank's part of each sequence and returns one process's outputs: the
    loss summed over cp, token-wise fields all-gathered when read (:mod:`.context_parallel_outputs`)."""
    original = model.forward
    signature = inspect.signature(original)

    @functools.wraps(original)
    def forward(*args: Any, **kwargs: Any) -> Any:
        if args:  # positional inputs (``model(input_ids)``) by their names
            kwargs = _by_name(signature, args, kwargs)
        error, split = None, None
        try:
            split = split_inputs(model, cp, kwargs)
        except ContextParallelError as exc:
            error = exc
        _refuse_on_every_rank(error, cp.device)
        local, length, rows = split
        output = original(**local)
        if cp.layout.attention_calls == 0:
            raise ContextParallelError(
                f"{type(model).__name__}'s attention did not go through transformers' attention registry, so "
                "context parallelism cannot mask it in global positions; plan without cp"
            )
        return outputs.finish(output, cp, length, rows)

    outputs = OutputDeferral()
    model.forward = forward
    install_output_deferral(model, outputs)


def _refuse_on_every_rank(error: ContextParallelError | None, device: torch.device) -> None:
    """Collective (one integer over the job): if any rank's inputs were refused, every rank raises, instead of
    the others waiting for it at the next collective (replicas' batches differ; a cp group's are the same)."""
    if dist.is_initialized() and dist.get_backend() != "fake" and dist.get_world_size() > 1:
        flag = torch.tensor([0 if error is None else 1], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if error is None and flag.item():
            raise ContextParallelError(
                "another rank's inputs were refused under context parallelism (its error names why); this rank "
                "stops with it"
            )
    if error is not None:
        raise error


def _by_name(signature: inspect.Signature, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """Positional and keyword arguments of a call as keywords (the ``**kwargs`` ones flattened)."""
    bound = signature.bind_partial(*args, **kwargs)
    named: dict[str, Any] = {}
    for key, value in bound.arguments.items():
        if signature.parameters[key].kind is inspect.Parameter.VAR_KEYWORD:
            named.update(value)
        else:
            named[key] = value
    return named


def _sequence_shape(model: nn.Module, kwargs: Mapping[str, Any]) -> tuple[int, int]:
    source = kwargs.get("input_ids")
    if source is None:
        source = kwargs.get("inputs_embeds")
    if not isinstance(source, torch.Tensor) or source.dim() < 2:
        raise ContextParallelError(
            f"{type(model).__name__} under context parallelism needs input_ids or inputs_embeds of shape "
            "[batch, sequence, ...]"
        )
    return int(source.shape[0]), int(source.shape[1])


def split_inputs(
    model: nn.Module, cp: ContextParallel, kwargs: dict[str, Any]
) -> tuple[dict[str, Any], int, int]:
    """This rank's forward arguments from the whole rows' (and the step's :class:`StepLayout` set on ``cp``):
    token-wise inputs cut to this rank's positions, labels shifted on the whole sequence first and the loss
    normalised by the replica's labelled tokens, position ids from global positions, the padding mask and the
    packed documents kept whole for the attention's mask. Returns (arguments, sequence length, rows)."""
    name = type(model).__name__
    if kwargs.get("past_key_values") is not None:
        raise ContextParallelError(
            f"{name}: a KV cache (generation) under context parallelism is not run; generate with a model "
            "without the cp plan"
        )
    flash = [k for k in FLASH_PACKED_INPUTS if kwargs.get(k) is not None]
    if flash:
        raise ContextParallelError(
            f"{name}: packed sequences given by {flash[0]} (flash attention's offsets) have no per-position "
            "document ids for the global-position mask; pass position_ids that restart at 0 for each document "
            "instead (DataCollatorWithFlattening(return_position_ids=True), no cu_seq_lens)"
        )
    if kwargs.get("output_attentions"):
        raise ContextParallelError(
            f"{name}: output_attentions under context parallelism would return each rank's rows of the weights "
            "only; ask for them without the cp plan"
        )
    rows, length = _sequence_shape(model, kwargs)
    check_sequence_length(length, cp.size)
    device = (
        kwargs.get("input_ids") if kwargs.get("input_ids") is not None else kwargs["inputs_embeds"]
    ).device
    mine = balanced_positions(length, cp.size, cp.rank).to(device)
    every = torch.cat([balanced_positions(length, cp.size, r) for r in range(cp.size)]).to(device)
    padding = kwargs.pop("attention_mask", None)
    if padding is not None:
        padding = local_tensor(padding)
        if padding.dim() != 2:
            raise ContextParallelError(
                f"{name}: a {padding.dim()}-D attention_mask cannot be cut by sequence positions under context "
                "parallelism; pass the 2-D padding mask (or none)"
            )
        padding = padding.to(device=device, dtype=torch.bool)
        padding = None if bool(padding.all()) else padding
    positions = kwargs.get("position_ids")
    documents = None
    if positions is None:
        kwargs["position_ids"] = torch.arange(length, device=device)[None].expand(rows, length)
    elif (
        padding is None
    ):  # packed sequences: transformers' documents (only without a padding mask, as it does)
        documents = _documents(local_tensor(positions).expand(rows, length))
    labels = kwargs.get("labels")
    shifted = kwargs.pop("shift_labels", None)
    if labels is not None or shifted is not None:
        if shifted is None:
            shifted = nn.functional.pad(local_tensor(labels), (0, 1), value=-100)[..., 1:]
        kwargs["labels"] = shifted  # not read: the loss takes shift_labels
        kwargs["shift_labels"] = shifted
        if kwargs.get("num_items_in_batch") is None:
            kwargs["num_items_in_batch"] = (shifted != -100).sum()
    out = dict(kwargs)
    for key in (*TOKEN_INPUTS, "labels", "shift_labels"):
        value = out.get(key)
        if isinstance(value, torch.Tensor) and value.dim() >= 2:
            out[key] = _cut(name, key, local_tensor(value), rows, length, mine)
    others = [
        k
        for k, v in out.items()
        if k not in (*TOKEN_INPUTS, "labels", "shift_labels")
        and isinstance(v, torch.Tensor)
        and v.dim() >= 2
        and tuple(v.shape[:2]) == (rows, length)
    ]
    if others:
        raise ContextParallelError(
            f"{name}: input {others[0]!r} runs along the sequence, and context parallelism does not know how to "
            "cut it; pass it without cp, or ask for its support"
        )
    out["use_cache"] = False
    cp.layout = StepLayout(
        query_positions=mine,
        key_positions=every,
        order=torch.argsort(every),
        padding=padding,
        documents=documents,
    )
    return out, length, rows


def _cut(
    name: str, key: str, value: torch.Tensor, rows: int, length: int, mine: torch.Tensor
) -> torch.Tensor:
    """``value`` ``[rows or 1, length, ...]`` at this rank's positions (position ids given once for every row
    are expanded first)."""
    if value.shape[0] == 1 and rows > 1:
        value = value.expand(rows, *value.shape[1:])
    if tuple(value.shape[:2]) != (rows, length):
        raise ContextParallelError(
            f"{name}: {key} has shape {tuple(value.shape)}, not [{rows}, {length}, ...] like the input ids; "
            "context parallelism cuts every token-wise input at the same positions"
        )
    return value.index_select(1, mine)


def _documents(positions: torch.Tensor) -> torch.Tensor | None:
    """transformers' packed-sequence detection (``find_packed_sequence_indices``): a new document wherever the
    position does not follow the previous one; None when every row is one document."""
    first = positions[:, :1] - 1
    documents = (torch.diff(positions, prepend=first, dim=-1) != 1).cumsum(-1)
    return None if bool((documents[:, -1] == 0).all()) else documents


# ------------------------------------------------------------------------------------------- plans
def hand_context_parallel_plan(
    model: nn.Module, batch: Mapping[str, Any], *, cp_size: int, dp_size: int = 1
) -> Plan:
    """A context-parallel plan written by hand for ``model``: ``dp_size`` DDP replicas of ``cp_size`` ranks
    each (mesh ``(dp, cp, 1)``), every parameter replicated. ``batch`` is one step's rows (its shapes are
    recorded). For running context parallelism before the planner prices it, like
    :func:`~hf_colossal_auto.pipeline_layout.hand_pipeline_plan`: its predictions are 0 and
    ``solver["status"]`` says so. With tensor parallelism: :func:`with_context_parallel` on a ``(dp, tp)`` plan."""
    if cp_size < 2 or dp_size < 1:
        raise ContextParallelError(
            f"hand_context_parallel_plan needs cp_size >= 2 and dp_size >= 1, got {cp_size} and {dp_size}"
        )
    params = dict(model.named_parameters())
    shapes = {k: list(v.shape) for k, v in batch.items() if isinstance(v, torch.Tensor) and v.dim() > 0}
    rows = next(iter(shapes.values()))[0] if shapes else 0
    return unpriced_plan(
        model_class=type(model).__name__,
        num_devices=dp_size * cp_size,
        mesh_shape=(dp_size, cp_size, 1),
        mesh_axis_names=("dp", "cp", "tp"),
        dp_mode="ddp",
        param_placements={fqn: ["R", "R", "R"] for fqn in params},
        global_batch_size=rows,
        input_shapes=shapes,
        solver={"status": "hand-made context-parallel plan, not priced"},
        param_shapes={fqn: list(p.shape) for fqn, p in params.items()},
        cp_size=cp_size,
    )


def with_context_parallel(plan: Plan, cp_size: int) -> Plan:
    """``plan`` (a ``(dp, tp)`` plan) with a ``cp`` axis of ``cp_size`` ranks added before ``tp``: the same
    placements on the other axes, replicated on cp, ``cp_size`` times the devices and rows per step (each
    process's batch unchanged, the batch rule of :mod:`.data`). For running context parallelism before the
    planner prices it and for tests: its predictions are zeroed and ``solver["status"]`` says so."""
    from dataclasses import replace

    if cp_size < 2 or plan.cp_size != 1 or plan.pp_size != 1:
        raise ContextParallelError(
            f"with_context_parallel adds a cp axis of >= 2 ranks to a plan without one and without pipeline "
            f"stages (got cp_size={cp_size} for a plan with cp_size={plan.cp_size}, pp_size={plan.pp_size})"
        )
    names = list(plan.mesh_axis_names)
    at = names.index("tp") if "tp" in names else len(names)

    def widened(placements: dict[str, list[str]]) -> dict[str, list[str]]:
        return {k: [*v[:at], "R", *v[at:]] for k, v in placements.items()}

    shape = list(plan.mesh_shape)
    return replace(
        plan,
        num_devices=plan.num_devices * cp_size,
        mesh_shape=(*shape[:at], cp_size, *shape[at:]),
        mesh_axis_names=(*names[:at], "cp", *names[at:]),
        cp_size=cp_size,
        param_placements=widened(plan.param_placements),
        activation_placements=widened(plan.activation_placements),
        param_use_placements=widened(plan.param_use_placements),
        block_input_placements=widened(plan.block_input_placements),
        global_batch_size=plan.global_batch_size * cp_size,
        input_shapes={k: [v[0] * cp_size, *v[1:]] if v else v for k, v in plan.input_shapes.items()},
        step_time_s=0.0,
        compute_time_s=0.0,
        communication_time_s=0.0,
        peak_memory_bytes=0,
        param_memory_bytes=0,
        activation_memory_bytes=0,
        recompute_time_s=0.0,
        overlapped_communication_s=0.0,
        memory_moments=[],
        blocks=[],
        collectives={},
        collective_bytes={},
        alternatives=[],
        solver={"status": f"context parallelism (cp={cp_size}) added by hand, not priced"},
    )
