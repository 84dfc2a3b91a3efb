"""Context parallelism as a planned axis (issue 28, item 3): the cp degrees offered and refused, the traced step
made a cp rank's (attention FLOPs, gathered K/V kept for backward), the K/V all-gathers and reduce-scatters priced
on the cp link, and cp chosen where only it fits. Symbolic (meta models, no processes)."""

from __future__ import annotations

import dataclasses
import json
import logging
import math

import pytest

from hf_colossal_auto.capture.graph import Phase
from hf_colossal_auto.hardware import ClusterSpec, get_device
from hf_colossal_auto.hardware.comm import collective_time
from hf_colossal_auto.hardware.roofline import host_time
from hf_colossal_auto.models import build_model, load_config, make_example_inputs
from hf_colossal_auto.plan import Plan
from hf_colossal_auto.solve.candidates import _Planner
from hf_colossal_auto.solve.context_parallel_degrees import context_parallel_degrees
from hf_colossal_auto.solve.context_parallel_search import (
    ATTENTION_BACKWARD_KERNELS,
    ATTENTION_FORWARD_KERNELS,
    ContextParallelPlanner,
    _kernel_dropout,
    attention_kernels,
    context_parallel_step,
    logits_value,
)
from hf_colossal_auto.solve.planner import evaluate_plan, plan_model
from hf_colossal_auto.solve.problem import InfeasibleError

DEVICE = "h100-80gb"


def _llama(max_positions: int = 128, attn_implementation: str = "sdpa"):
    config = load_config("tiny-llama")
    config.max_position_embeddings = max_positions
    return build_model(config, attn_implementation=attn_implementation)


def _planner(model, batch, devices: int) -> _Planner:
    return _Planner.for_devices(model, batch, devices, DEVICE, None, None, "bf16", "adamw", 30.0)


def test_degrees_offered_and_refused():
    """None offers every degree dividing the devices and splitting the sequence into 2 cp chunks (none over a fixed
    mesh); a fixed degree that does neither, a bad value, one beside fixed pipeline stages or with a mesh_shape
    that is not the (dp, tp) part is refused with what would do."""
    model = _llama()
    assert context_parallel_degrees(_planner(model, make_example_inputs(model, 2, 128), 4), None) == [2, 4]
    assert context_parallel_degrees(_planner(model, make_example_inputs(model, 1, 40), 8), None) == [2, 4]
    assert context_parallel_degrees(_planner(model, make_example_inputs(model, 1, 40), 8), 4) == [4]
    batch = make_example_inputs(model, 2, 36)
    common = dict(num_devices=4, device=DEVICE, mixed_precision="bf16")
    with pytest.raises(ValueError, match="context_parallel=3 does not divide the 4 devices"):
        plan_model(model, batch, context_parallel=3, **common)
    with pytest.raises(ValueError, match="36 tokens does not split into 8 equal chunks"):
        plan_model(model, batch, context_parallel=4, **common)
    with pytest.raises(ValueError, match="context_parallel must be None"):
        plan_model(model, batch, context_parallel=0, **common)
    with pytest.raises(ValueError, match="not planned together"):
        plan_model(model, batch, context_parallel=2, pipeline=2, **common)
    with pytest.raises(ValueError, match=r"give the \(dp, tp\) part"):
        plan_model(model, make_example_inputs(model, 2, 32), context_parallel=2, mesh_shape=(2, 2), **common)
    fixed_mesh = plan_model(
        model, make_example_inputs(model, 2, 32), context_parallel=None, mesh_shape=(2, 2), **common
    )
    assert fixed_mesh.cp_size == 1 and fixed_mesh.mesh_shape == (2, 2)  # a fixed mesh is not searched over cp


def test_step_made_a_cp_ranks():
    """The chunked step's attention kernels run ``cp`` times the FLOPs (forward and backward) and keep, until
    their backward, what the runtime's attention keeps beyond the trace: blocked (causal, a kernel with a
    log-sum-exp for the device), K and V of all tokens as gathered, at the K/V heads, and no mask; on the mask
    path K and V at the query heads (transformers repeats grouped K/V heads when sdpa is given a mask), the first
    one the step's additive mask; the logits stay this rank's chunk (a training step reads only the loss: the
    runtime gathers no output); nothing else changes."""
    model = _llama()
    cfg = model.config
    batch = make_example_inputs(model, 2, 128)
    outer = _planner(model, batch, 4)
    cp = ContextParallelPlanner(outer, 2)
    rows = cp.batch // 2
    plain = _Planner._trace(cp, rows)  # the chunked step as traced
    made = cp._trace(rows)
    masked = context_parallel_step(_Planner._trace(cp, rows), 2, cp.kv_heads, runtime=None)
    assert [n.op for n in plain.nodes] == [n.op for n in made.nodes]
    forward = [n.index for n in plain.nodes if n.op in ATTENTION_FORWARD_KERNELS]
    backward = [n.index for n in plain.nodes if n.op in ATTENTION_BACKWARD_KERNELS]
    assert len(forward) == len(backward) == model.config.num_hidden_layers
    for a, b in zip(plain.nodes, made.nodes, strict=True):
        assert b.flops == (2 * a.flops if a.index in forward + backward else a.flops)
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    gathered = 2 * rows * 128 * cfg.num_key_value_heads * head_dim * 2  # K and V, 128 tokens, K/V heads, bf16
    held = 2 * rows * 128 * cfg.num_attention_heads * head_dim * 2  # K and V, 128 tokens, query heads, bf16
    mask = 64 * 128 * 2  # [1, 1, 64 local queries, 128 keys], bf16
    assert all(k.blocked for k in attention_kernels(plain, 2, cp.kv_heads, cp.runtime_attention()))
    for i in forward:
        node = plain.nodes[i]
        kv = sum(plain.values[x].nbytes for x in node.inputs[1:3])
        lse = plain.values[node.outputs[1]].storage_id
        for graph, expected in (
            (made, gathered - kv),
            (masked, held - kv + (mask if i == forward[0] else 0)),
        ):
            assert graph.storages[lse].nbytes == plain.storages[lse].nbytes + expected
            grown = [e for e in graph.memory_events if e.storage_id == lse]
            assert sorted(e.delta for e in grown) == [-graph.storages[lse].nbytes, graph.storages[lse].nbytes]
    logits = logits_value(plain, "lm_head")
    assert (
        math.prod(plain.values[logits].shape) == rows * 64 * cfg.vocab_size
    )  # this rank's 64 tokens' logits
    sid = plain.values[logits].storage_id
    assert made.storages[sid].nbytes == plain.storages[sid].nbytes  # not gathered: only the loss is read
    assert sum(e.delta for e in made.memory_events) == sum(e.delta for e in plain.memory_events)
    assert {n.phase for n in made.nodes if n.index in backward} == {Phase.BACKWARD}


def test_runtime_attention_says_which_layers_run_blocked():
    """Blocked where the runtime would run it so: a kernel with a log-sum-exp for the device and dtype (CUDA:
    chunks a multiple of 32 queries), no dropout in the traced kernel."""
    model = _llama()
    for seq, blocked in ((128, True), (96, False)):  # chunks of 32 and of 24 tokens at cp 2
        cp = ContextParallelPlanner(_planner(model, make_example_inputs(model, 2, seq), 4), 2)
        graph = _Planner._trace(cp, 1)
        kernels = attention_kernels(graph, 2, cp.kv_heads, cp.runtime_attention())
        assert {k.blocked for k in kernels} == {blocked}, seq
        assert {k.mask_bytes > 0 for k in kernels} == {not blocked}, seq
    node = graph.nodes[kernels[0].index]
    dropped = dataclasses.replace(node, args=((*node.args[0][:3], 0.1, *node.args[0][4:]), node.args[1]))
    assert _kernel_dropout(dropped) == 0.1 and _kernel_dropout(node) == 0.0
    assert not cp.runtime_attention().blocked(graph, dropped)


def test_kv_collectives_priced_on_the_cp_link():
    """A fixed cp degree: per attention layer, all-gathers of the whole sequence's K and V at the K/V heads (each
    rank receiving 2 x K/V bytes x (cp - 1) / cp) and their gradients' reduce-scatters, priced on the cp axis's
    link (mesh_shape fixing the (dp, tp) part); cp_size in the plan (and its JSON), left out of a plan without it."""
    model = _llama()
    cfg = model.config
    batch = make_example_inputs(model, 2, 128)
    plan = plan_model(
        model,
        batch,
        num_devices=4,
        device=DEVICE,
        mixed_precision="bf16",
        context_parallel=2,
        mesh_shape=(2, 1),
    )
    assert plan.cp_size == 2 and plan.mesh_axis_names == ("dp", "cp", "tp") and plan.mesh_shape == (2, 2, 1)
    dp, cp, tp = plan.mesh_shape
    assert all(p[1] == "R" and len(p) == 3 for p in plan.param_placements.values())
    layers = cfg.num_hidden_layers
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    # one of K, V as gathered: this replica's sequences, all 128 tokens, the K/V heads (bf16)
    k_bytes = (2 // dp) * 128 * cfg.num_key_value_heads * head_dim * 2
    split = 1  # no tensor parallelism: every rank gathers all K/V heads
    record = plan.solver["context_parallel"]
    # what the runtime runs besides: the inputs' agreement and the loss's all-reduce; the logits' all-gather
    # only if the caller reads them (recorded, not priced: a training step reads the loss)
    logits = (2 // dp) * 128 * cfg.vocab_size * 2
    assert plan.collectives["cp_reduce_scatter"] == 2 * layers
    assert plan.collectives["cp_all_gather"] == 2 * layers and plan.collectives["cp_all_reduce"] == 2
    # and the generator agreement's broadcast (apply/rng.py): the CPU generator's state and the CUDA device's
    import torch

    from hf_colossal_auto.solve.context_parallel_search import CUDA_GENERATOR_STATE_BYTES

    assert plan.collectives["cp_broadcast"] == 1
    assert plan.collective_bytes["cp_broadcast"] == torch.get_rng_state().numel() + CUDA_GENERATOR_STATE_BYTES
    assert plan.collective_bytes["cp_reduce_scatter"] == pytest.approx(layers * 2 * k_bytes / split)
    assert plan.collective_bytes["cp_all_gather"] == pytest.approx(layers * 2 * k_bytes / split)
    assert record["outputs"] == "loss only" and record["logits_read_bytes"] == pytest.approx(logits)
    assert record["logits_read_s"] > 0
    assert record["kv_wire_bytes"] == pytest.approx(layers * 2 * k_bytes * (cp - 1) / cp)  # received per rank
    spec = get_device(DEVICE)
    link = ClusterSpec(spec, 4).axis_link((dp, cp, tp), 1)
    overhead = spec.kernel_overhead_s + host_time(spec, dtensor=False)
    one = collective_time("all_gather", k_bytes / split, cp, link) + overhead
    assert record["kv_all_gather_s"] == pytest.approx(2 * layers * one)
    assert record["kv_reduce_scatter_s"] == pytest.approx(
        2 * layers * (collective_time("reduce_scatter", k_bytes / split, cp, link) + overhead)
    )
    assert plan.communication_time_s >= record["kv_all_gather_s"] + record["kv_reduce_scatter_s"]
    assert Plan.from_dict(plan.to_dict()).cp_size == 2
    assert "reads only the loss" in plan.summary()  # renders with the cp axis and says what it prices
    again = evaluate_plan(model, batch, plan, num_devices=4, device=DEVICE, mixed_precision="bf16")
    assert again.step_time_s == pytest.approx(plan.step_time_s, rel=1e-6)
    assert again.peak_memory_bytes == plan.peak_memory_bytes and again.plan.cp_size == 2
    without = dataclasses.replace(plan, cp_size=1, mesh_shape=(4, 1), mesh_axis_names=("dp", "tp"))
    assert "cp_size" not in without.to_dict() and Plan.from_dict(without.to_dict()).cp_size == 1


def test_cp_not_chosen_where_it_needs_more_than_tp():
    """A short sequence (1 row of 64 tokens) on 2 devices under DDP: cp = 2 replicates the weights, their
    gradients and AdamW's state where tensor parallelism shards them, and the activations it splits are small,
    so it needs more memory than the best plan without cp: under a budget between the two, context_parallel=None
    returns the plan without cp and records why (cp's least memory); a fixed cp = 2 fails naming what it
    needs."""
    model = _llama(max_positions=2048)
    batch = make_example_inputs(model, 1, 64)
    common = dict(
        num_devices=2,
        device=DEVICE,
        mixed_precision="bf16",
        recompute="none",
        micro_batches=1,
        dp_modes=("ddp",),
    )
    need = {}
    for cp in (1, 2):
        with pytest.raises(InfeasibleError) as info:
            plan_model(model, batch, memory_budget=1000, context_parallel=cp, **common)
        need[cp] = info.value.min_required
    assert need[2] > need[1]
    budget = int((need[1] + need[2]) / 2)
    plan = plan_model(model, batch, memory_budget=budget, context_parallel=None, **common)
    assert plan.cp_size == 1 and plan.peak_memory_bytes <= budget
    assert plan.solver["context_parallel_degrees"]["2"]["fits"] is False
    with pytest.raises(InfeasibleError, match="context_parallel=2"):
        plan_model(model, batch, memory_budget=budget, context_parallel=2, **common)


def test_unknown_attention_not_offered(caplog):
    """Eager attention (no fused kernel in the step): a fixed cp degree is refused naming why; None plans
    without cp and logs why."""
    model = _llama(attn_implementation="eager")
    batch = make_example_inputs(model, 2, 64)
    common = dict(num_devices=2, device=DEVICE, mixed_precision="bf16")
    with pytest.raises(ValueError, match="no fused attention kernel"):
        plan_model(model, batch, context_parallel=2, **common)
    with caplog.at_level(logging.INFO, logger="hf_colossal_auto.solve.context_parallel_degrees"):
        plan = plan_model(model, batch, context_parallel=None, **common)
    assert plan.cp_size == 1
    assert "context parallelism not searched" in caplog.text and "no fused attention kernel" in caplog.text


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA device to ask")
def test_cuda_generator_state_bytes_is_the_devices():
    """The CUDA generator state the plan prices the agreement's broadcast with (a constant: planning need not
    touch CUDA) is what ``torch.cuda.get_rng_state()`` returns, the tensor the runtime broadcasts."""
    import torch

    from hf_colossal_auto.solve.context_parallel_search import CUDA_GENERATOR_STATE_BYTES

    state = torch.cuda.get_rng_state()
    assert state.numel() * state.element_size() == CUDA_GENERATOR_STATE_BYTES


# ------------------------------------------------------------------------------- against a measured step
MEMORY_BOUND = 0.05
"""A planner-made cp = 2 plan's measured per-rank peak (MemTracker) is within this fraction of its prediction
(docs/reliability.md, Llama hidden 128, GQA, 2 x 512 tokens on 2 gloo ranks: blocked attention +0.5 % without
recompute, -2.7 % with the solver's; attention dropout's math path +0.2 % and +1.8 %; padded rows +0.5 % and
+3.7 %)."""


@pytest.fixture(scope="module")
def measured_cp_step(tmp_path_factory) -> list[dict]:
    """One torchrun launch (~10-20 s): every plan of ``multiproc/check_context_parallel_costs.py``, every rank's."""
    from pathlib import Path

    from torchrun_launch import run_torchrun

    root = Path(__file__).resolve().parents[1]
    out = tmp_path_factory.mktemp("cpcosts") / "r.json"
    run_torchrun(str(root / "tests/multiproc/check_context_parallel_costs.py"), f"--out={out}", timeout=600)
    return [r for rank in (0, 1) for r in json.loads(Path(f"{out}.rank{rank}").read_text()) if "plan" in r]


MEASURED_PLANS = ("free", "tight", "dropout", "dropout-tight", "padded", "padded-tight")
"""The plans the check runs: the plain model and rows, with attention dropout 0.1 (SDPA's math path on CPU) and
with padded rows (every layer on the mask path), each with the budget lifted and under 0.75 of that peak."""


def test_cp_plan_collectives_are_the_runs(measured_cp_step):
    """Every rank's collectives of one training step that reads only the loss (c10d's records): the K/V
    all-gathers (again for each recomputed block) and the K/V gradients' reduce-scatters, counts and bytes, as
    the plan says (no logits' all-gather: the runtime gathers outputs only when read); the all-reduces are the
    gradients' plus the two small ones (inputs' agreement, loss); the one broadcast is the generator agreement's
    (``cp_broadcast``: its bytes as sent), with and without attention dropout and padding."""
    assert sorted(r["plan"] for r in measured_cp_step) == sorted(MEASURED_PLANS * 2)
    for r in measured_cp_step:
        for kind in ("cp_all_gather", "cp_reduce_scatter"):
            assert r["counted"][kind] == r["predicted"][kind], r
            assert r["counted_bytes"][kind] == r["predicted_bytes"][kind], r
        assert (
            r["counted"]["all_reduce"] == r["predicted"]["dp_all_reduce"] + r["predicted"]["cp_all_reduce"]
        ), r
        assert r["counted"]["broadcast"] == r["predicted"]["cp_broadcast"], r
        assert r["counted_bytes"]["broadcast"] == r["predicted_bytes"]["cp_broadcast"], r
    by_plan = {r["plan"]: r for r in measured_cp_step}
    for free, tight in (("free", "tight"), ("dropout", "dropout-tight"), ("padded", "padded-tight")):
        recomputed = set(by_plan[tight]["recompute"]) - {"none"}
        assert recomputed, by_plan[tight]  # the budget made the solver recompute
        assert by_plan[tight]["counted"]["cp_all_gather"] > by_plan[free]["counted"]["cp_all_gather"]


def test_cp_plan_runs_the_attention_it_was_priced_for(measured_cp_step):
    """What makes the dropout and padded plans worth measuring happened: plain rows ran blocked attention on
    every layer and drew nothing; with attention dropout every layer ran the mask path, the agreed generator
    advanced and SDPA's math path drew a dropout mask per layer (and again per recomputed attention); padded
    rows ran every layer on the mask path."""
    for r in measured_cp_step:
        layers = r["attention_calls"]
        assert layers == 2, r
        kind = r["plan"].removesuffix("-tight")
        assert r["blocked_calls"] == (layers if kind in ("free", "tight") else 0), r
        assert r["generator_advanced"] == (kind == "dropout"), r
        if kind == "dropout":
            assert r["bernoulli_calls"] >= layers, r
        else:
            assert r["bernoulli_calls"] == 0, r


def test_cp_plan_peak_is_the_measured_one(measured_cp_step):
    """MemTracker's per-rank peak of a step within :data:`MEMORY_BOUND` of ``plan.peak_memory_bytes``, with and
    without recompute (the recomputed plan's prediction within its budget), with attention dropout (the math
    path's probabilities and dropout masks) and with padded rows (the step's ``[rows, 1, s, S]`` mask)."""
    for r in measured_cp_step:
        assert abs(r["measured_peak"] - r["predicted_peak"]) <= MEMORY_BOUND * r["predicted_peak"], r
        assert r["predicted_peak"] <= r["budget"]


# ------------------------------------------------------------------------- attention dropout on a CPU target
def _dropout_models():
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    gpt2 = GPT2Config(
        vocab_size=256, n_positions=64, n_embd=64, n_layer=2, n_head=4, attn_pdrop=0.1, attn_implementation="sdpa"
    )  # fmt: skip
    llama = LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, attention_dropout=0.1, attn_implementation="sdpa",
    )  # fmt: skip
    return {"gpt2": lambda: GPT2LMHeadModel(gpt2), "llama": lambda: LlamaForCausalLM(llama)}


def _gathered_attention(cp: int):
    """transformers' sdpa attention as the runtime's mask path runs it on one cp rank: K and V of all ``cp``
    ranks (``cat`` standing for the all-gather) and one additive ``[1, 1, s, S]`` mask shared by the layers."""
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    masks = {}

    def attention(module, q, k, v, mask, **kwargs):
        k, v = torch.cat([k] * cp, dim=2), torch.cat([v] * cp, dim=2)
        key = (q.shape[2], k.shape[2], q.dtype)
        if key not in masks:
            masks[key] = torch.zeros(1, 1, *key[:2], dtype=q.dtype)
        kwargs.pop("is_causal", None)
        return sdpa_attention_forward(module, q, k, v, masks[key], is_causal=False, **kwargs)

    return attention


def _peak(graph, before=None) -> int:
    """The step's peak live bytes; with ``before`` (a phase), up to that phase's first op."""
    end = next((n.index for n in graph.nodes if n.phase == before), len(graph.nodes) + 1)
    now = peak = 0
    for event in sorted(graph.memory_events, key=lambda e: (e.position, e.delta < 0)):
        if event.position >= end:
            break
        now += event.delta
        peak = max(peak, now)
    return peak


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_math_path_attention_made_a_cp_ranks(name):
    """Attention dropout on a CPU target: SDPA runs its unfused math path (no fused CPU kernel takes dropout),
    which the step made a cp rank's recognises and scales to the key length: the same FLOPs and bytes, call by
    call and over the step, as a trace of the runtime's mask path (all ranks' K/V, a [1, 1, s, S] mask), and its
    peak short of that trace's by at most the step's mask (priced freed at the last backward; the runtime keeps
    it to the next forward)."""
    import torch
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from hf_colossal_auto.capture.tracer import trace_training_step
    from hf_colossal_auto.solve.context_parallel_math import math_attention_calls
    from hf_colossal_auto.solve.context_parallel_search import kv_head_count, query_head_count

    cp = 2
    torch.manual_seed(0)
    model = _dropout_models()[name]()
    model.train()
    ids = torch.randint(0, 256, (2, 16))  # one cp rank's 2 rows of s = 16 of S = 32 tokens
    batch = {"input_ids": ids, "labels": ids}
    plain = trace_training_step(model, batch, fold_blocks=False)
    assert not [n for n in plain.nodes if n.op in ATTENTION_FORWARD_KERNELS]  # the math path, not a kernel
    made = context_parallel_step(plain, cp, kv_head_count(model), None, query_head_count(model))
    ALL_ATTENTION_FUNCTIONS.register("cp_test_gathered", _gathered_attention(cp))
    try:
        model.config._attn_implementation = "cp_test_gathered"
        truth = trace_training_step(model, batch, fold_blocks=False)
    finally:
        model.config._attn_implementation = "sdpa"
    calls, true_calls = math_attention_calls(made), math_attention_calls(truth)
    assert len(calls) == len(true_calls) == 2 and all(c.dropout for c in calls)

    def priced(graph, call):
        nodes = [graph.nodes[i] for i in {*call.score_nodes, *call.matmuls}]
        return sum(n.flops for n in nodes), sum(n.bytes_read + n.bytes_written for n in nodes)

    for call, true_call in zip(calls, true_calls, strict=True):
        assert priced(made, call) == priced(truth, true_call)
    assert sum(n.flops for n in made.nodes) == sum(n.flops for n in truth.nodes)
    mask = 16 * 32 * 4  # [1, 1, 16, 32] float32
    assert 0 <= _peak(truth) - _peak(made) <= mask


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_plan_with_attention_dropout_on_cpu(name):
    """plan_model(context_parallel=2) on a CPU target for a model with attention dropout 0.1: planned, K/V
    all-gathered per layer at the K/V heads (Llama's 2 of 4: half of GPT-2's), the mask path's cost priced."""
    import torch

    model = _dropout_models()[name]()
    model.train()
    ids = torch.randint(0, 256, (2, 32))
    plan = plan_model(
        model, {"input_ids": ids, "labels": ids}, num_devices=2, device="cpu", context_parallel=2
    )
    assert plan.cp_size == 2 and plan.mesh_shape == (1, 2, 1)
    info = plan.solver["context_parallel"]
    kv_heads = {"gpt2": 4, "llama": 2}[name]
    assert info["attention_layers"] == 2
    assert info["kv_gathered_bytes"] == 2 * 2 * (
        2 * 32 * kv_heads * 16 * 4
    )  # layers x (K, V) x rows x tokens
    assert info["kv_all_gather_s"] > 0 and plan.collectives["cp_all_gather"] == 4


# ------------------------------------------------------------------------------------------- padded rows
def _padded_gathered_attention(cp: int, rows: int):
    """transformers' sdpa attention as the runtime's mask path runs it on one cp rank of padded rows: K and V of
    all ``cp`` ranks (``cat`` standing for the all-gather) and one additive ``[rows, 1, s, S]`` mask (a row's
    padding) shared by the layers."""
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    masks = {}

    def attention(module, q, k, v, mask, **kwargs):
        k, v = torch.cat([k] * cp, dim=2), torch.cat([v] * cp, dim=2)
        key = (q.shape[2], k.shape[2], q.dtype)
        if key not in masks:
            masks[key] = torch.zeros(rows, 1, *key[:2], dtype=q.dtype)
        kwargs.pop("is_causal", None)
        return sdpa_attention_forward(module, q, k, v, masks[key], is_causal=False, **kwargs)

    return attention


@pytest.mark.parametrize(("device_kind", "precision"), [("cpu", None), ("cuda", "bf16")])
def test_padded_rows_made_a_cp_ranks(device_kind, precision):
    """Padded rows (a 2-D padding mask): the traced chunk's fused kernel is given its chunk's mask; the step
    made a cp rank's prices every layer on the mask path: forward and backward kernels with the same FLOPs and
    bytes, call by call, as a trace of the runtime's (all ranks' K/V, one [rows, 1, s, S] mask; under bf16
    autocast a per-layer cast copy of it), its forward-and-backward peak that trace's and its
    step's peak short of it by at most the step's mask (priced freed at the last backward; kept to the next forward)."""
    import torch
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from hf_colossal_auto.capture.tracer import trace_training_step
    from hf_colossal_auto.solve.context_parallel_search import kv_head_count, query_head_count

    cp, rows, s = 2, 2, 16
    model = _llama()
    model.train()
    ids = torch.randint(0, 256, (rows, s))  # one cp rank's 2 rows of s = 16 of S = 32 tokens
    mask = torch.ones_like(ids)
    mask[1, 11:] = 0  # the second row's chunk ends in padding
    trace = dict(fold_blocks=False, device_kind=device_kind, mixed_precision=precision)
    plain = trace_training_step(model, {"input_ids": ids, "labels": ids, "attention_mask": mask}, **trace)
    forward = [n for n in plain.nodes if n.op in ATTENTION_FORWARD_KERNELS]
    assert forward and all(len(n.inputs) > 3 for n in forward)  # the fused kernel is given the chunk's mask
    with pytest.raises(Exception, match="not a padding mask"):
        attention_kernels(plain, cp, kv_head_count(model))
    made = context_parallel_step(plain, cp, kv_head_count(model), None, query_head_count(model), padded=True)
    ALL_ATTENTION_FUNCTIONS.register("cp_test_gathered_padded", _padded_gathered_attention(cp, rows))
    try:
        model.config._attn_implementation = "cp_test_gathered_padded"
        truth = trace_training_step(model, {"input_ids": ids, "labels": ids}, **trace)
    finally:
        model.config._attn_implementation = "sdpa"
    kernels = ATTENTION_FORWARD_KERNELS + ATTENTION_BACKWARD_KERNELS
    priced = [(n.op, n.flops, n.bytes_read, n.bytes_written) for n in made.nodes if n.op in kernels]
    ran = [(n.op, n.flops, n.bytes_read, n.bytes_written) for n in truth.nodes if n.op in kernels]
    assert len(priced) == 2 * model.config.num_hidden_layers and priced == ran
    step_mask = rows * s * cp * s * 4  # [rows, 1, s, S] in float32: Llama calls attention with RoPE's float32
    assert 0 <= _peak(truth) - _peak(made) <= step_mask, (_peak(truth), _peak(made))
    training = _peak(truth, Phase.OPTIMIZER) - _peak(made, Phase.OPTIMIZER)  # forward and backward only
    assert training == 0, training


def test_plan_with_padded_rows():
    """plan_model(context_parallel=2) on tiny Llama with padded rows plans cp (every layer on the mask path, not
    blocked); a 4-D mask and padded rows on SDPA's math path (CPU attention dropout) are refused saying what to
    do."""
    import torch

    model = _llama()
    ids = torch.randint(0, 256, (2, 64))
    mask = torch.ones_like(ids)
    mask[1, 40:] = 0
    batch = {"input_ids": ids, "labels": ids, "attention_mask": mask}
    common = dict(num_devices=2, device=DEVICE, mixed_precision="bf16")
    plan = plan_model(model, batch, context_parallel=2, **common)
    assert plan.cp_size == 2 and plan.mesh_shape == (1, 2, 1)
    info = plan.solver["context_parallel"]
    assert info["attention_layers"] == model.config.num_hidden_layers and info["kv_all_gather_s"] > 0
    cp = ContextParallelPlanner(_planner(model, batch, 2), 2)
    assert cp.padded and not any(
        k.blocked for k in attention_kernels(cp.graph(2), 2, cp.kv_heads, cp.runtime_attention(), padded=True)
    )
    square = {**batch, "attention_mask": torch.ones(2, 1, 64, 64)}
    with pytest.raises(ValueError, match="4-D attention_mask.*pass the 2-D padding mask"):
        plan_model(model, square, context_parallel=2, **common)
    dropout = _dropout_models()["llama"]()
    dropout.train()
    with pytest.raises(ValueError, match="math path.*padding mask.*attention_dropout=0"):
        plan_model(dropout, batch, num_devices=2, device="cpu", context_parallel=2)
