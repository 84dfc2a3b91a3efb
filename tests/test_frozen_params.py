"""Frozen parameters (``requires_grad=False``): no gradient, optimizer state, optimizer step or data-parallel
synchronisation in the profile, the plan or its predicted collectives. (That the runtime leaves them untouched
on 2 real ranks is checked by the fine-tuning recipe's 2-process run in tests/test_recipes.py, and below with
peft's LoRA adapters, whose base weights are all frozen.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from torchrun_launch import run_torchrun

from hf_colossal_auto.capture import trace_training_step
from hf_colossal_auto.models import build_model, load_config, make_example_inputs
from hf_colossal_auto.profile import profile_model
from hf_colossal_auto.solve.planner import plan_model
from hf_colossal_auto.solve.pricing.memory import _optimizer_temp_ratio

DEVICE = "a100-80gb"
ROOT = Path(__file__).resolve().parents[1]


def _tiny_llama(frozen: str | None):
    """tiny-llama on meta with the parameters whose name contains ``frozen`` frozen."""
    model = build_model("tiny-llama", device="meta")
    for name, param in model.named_parameters():
        if frozen is not None and frozen in name:
            param.requires_grad_(False)
    return model, make_example_inputs(model, 8, 32, device="meta")


def _plan(model, batch, dp_mode: str):
    return plan_model(
        model, batch, num_devices=2, device=DEVICE, mesh_shape=(2, 1), dp_modes=(dp_mode,), micro_batches=1
    )


@pytest.fixture(scope="module")
def frozen_embeddings():
    """(model, batch) with everything trained, and the same with the token embedding frozen."""
    return _tiny_llama(None), _tiny_llama("embed_tokens")


def test_the_profile_counts_no_gradient_or_optimizer_state_for_frozen_parameters(frozen_embeddings):
    (full, batch), (frozen, _) = frozen_embeddings
    frozen_bytes = sum(p.numel() * p.element_size() for p in frozen.parameters() if not p.requires_grad)
    assert frozen_bytes > 0
    a = profile_model(full, batch, device=DEVICE)
    b = profile_model(frozen, batch, device=DEVICE)
    assert b.param_bytes == a.param_bytes  # the weights are still there
    assert a.grad_bytes - b.grad_bytes == frozen_bytes
    # AdamW: two moments per trained element (and a step counter per parameter)
    assert a.optimizer_state_bytes - b.optimizer_state_bytes >= 2 * frozen_bytes


@pytest.mark.parametrize("dp_mode", ["ddp", "fsdp"])
def test_plan_memory_drops_by_the_frozen_parameters_training_state_and_their_syncs_go(
    frozen_embeddings, dp_mode
):
    """Predicted parameter memory (weights, gradients, optimizer state and its step's temporaries, per device)
    falls by exactly what the frozen embedding's training state is: its gradient, its optimizer state and its
    share of the optimizer step's temporaries (divided over the replicas under FSDP); its weight stays. The
    data-parallel gradient synchronisation runs for the trained parameters only (FSDP still gathers all)."""
    (full, batch), (frozen, _) = frozen_embeddings
    graph_a = trace_training_step(full, batch, device_kind="cuda")
    graph_b = trace_training_step(frozen, batch, device_kind="cuda")
    assert graph_b.frozen_params == {"model.embed_tokens.weight"} and not graph_a.frozen_params
    fqn = "model.embed_tokens.weight"
    pbytes = graph_a.param_bytes[fqn]
    state = graph_a.optimizer_state_bytes[fqn]
    assert graph_b.optimizer_state_bytes[fqn] == 0 and state > 0
    # the optimizer step's temporaries: per trained byte, about the same with and without the embedding
    temps_a = _optimizer_temp_ratio(graph_a) * graph_a.trainable_param_bytes
    temps_b = _optimizer_temp_ratio(graph_b) * graph_b.trainable_param_bytes
    assert graph_a.trainable_param_bytes - graph_b.trainable_param_bytes == pbytes
    assert temps_a - temps_b == pytest.approx(pbytes, rel=1e-4)
    shard = 2 if dp_mode == "fsdp" else 1
    expected = (pbytes + state + temps_a - temps_b) / shard  # gradient, optimizer state, temporaries

    a, b = _plan(full, batch, dp_mode), _plan(frozen, batch, dp_mode)
    assert a.param_memory_bytes - b.param_memory_bytes == pytest.approx(expected, abs=2)
    n_params = len(graph_a.param_names)
    if dp_mode == "fsdp":
        assert a.collectives["dp_reduce_scatter"] == n_params
        assert b.collectives["dp_reduce_scatter"] == n_params - 1
        assert a.collectives["dp_all_gather"] == b.collectives["dp_all_gather"]
    else:
        assert a.collectives["dp_all_reduce"] == n_params
        assert b.collectives["dp_all_reduce"] == n_params - 1
    assert b.peak_memory_bytes < a.peak_memory_bytes


def test_frozen_blocks_are_not_folded_with_trained_ones():
    """Identical blocks are traced once; a frozen block is not identical to a trained one (no gradients, no
    optimizer step), so freezing all but the last layers must be seen in the per-parameter state."""
    config = load_config("tiny-llama")
    config.num_hidden_layers = 6
    model = build_model(config, device="meta")
    for name, param in model.named_parameters():
        if not name.startswith(("model.layers.5.", "lm_head")):
            param.requires_grad_(False)
    batch = make_example_inputs(model, 4, 32, device="meta")
    graph = trace_training_step(model, batch, device_kind="cuda")
    trained = {n for n in graph.param_names if graph.is_trainable(n)}
    assert trained == {n for n, p in model.named_parameters() if p.requires_grad}
    for name in graph.param_names:
        assert (graph.optimizer_state_bytes[name] > 0) == (name in trained), name


@pytest.mark.slow
def test_peft_lora_model_is_planned_and_trained_on_two_ranks(tmp_path):
    """A peft LoRA-wrapped tiny Llama (the optional ``lora`` extra, in the test extra too): planned and trained
    on 2 gloo ranks under DDP (2 x 1) and tensor parallelism (1 x 2). Losses equal one process's on the same
    batch; only the adapters change (the frozen base weights are bit-identical); DDP all-reduces the 8 adapter
    gradients only, as predicted; under 1 x 2 the collectives c10d ran equal the plan's prediction."""
    pytest.importorskip("peft")
    out = tmp_path / "lora.json"
    run_torchrun(str(ROOT / "tests" / "multiproc" / "check_lora.py"), "--out", str(out), nproc=2)
    ddp, tp = json.loads(out.read_text())
    for result in (ddp, tp):
        assert result["losses"] == pytest.approx(result["reference"], rel=1e-6), result["mesh"]
        assert result["losses"][-1] < result["losses"][0]
        assert result["changed"] == result["trained"], result["mesh"]  # adapters moved, nothing else
        assert len(result["trained"]) == 8 and all(".lora_" in n for n in result["trained"])
    assert ddp["dp_mode"] == "ddp" and ddp["collectives"] == {"c10d::allreduce_": 8}
    assert ddp["predicted"] == {"dp_all_reduce": 8.0}
    names = {"all_reduce": "c10d::allreduce_", "all_gather": "c10d::allgather_into_tensor_coalesced_"}
    names["reduce_scatter"] = "c10d::reduce_scatter_tensor_coalesced_"
    # plus the tensor-parallel group's generator agreement (apply/rng.py): one broadcast in a first training
    # step, whatever the dropout; the plan does not price it (about a millisecond a step)
    expected = {names[k]: v for k, v in tp["predicted"].items()} | {"c10d::broadcast_": 1}
    assert expected == tp["collectives"]
