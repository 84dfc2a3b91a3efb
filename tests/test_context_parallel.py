"""Context parallelism (issue 28, items 2 and 4): a ``cp`` mesh axis splitting each sequence of a replica's rows.

* the plan: ``cp_size`` and the ``("pp", "dp", "cp", "tp")`` axis order, left out of the JSON at 1, refused
  where it contradicts the mesh; :func:`with_context_parallel` adds the axis to a ``(dp, tp)`` plan;
* the balanced layout: each rank a head and a tail chunk, the same causal work per rank;
* refusals by name, in one process (attention implementations without a global-position mask, models that
  are not causal LMs, FSDP and pipeline plans);
* on gloo ranks (one torchrun launch each, ``multiproc/check_context_parallel.py``): cp = 2 on 2 ranks and
  cp x tp, dp x cp on 4 ranks give one process's loss, logits (every token, the chunk boundaries' included) and
  gradients for GPT-2, Llama (padding, packed documents) and Qwen2 (GQA, a sliding window, eager attention),
  causal attention without padding or documents running blocked (no mask) and the rest on the mask path;
  bad inputs stop every rank with the error naming them; an ``AutoParallelAccelerator`` loop from a cp plan
  file trains like one process on the union of the replica's batches;
* the outputs' token-wise fields gathered only when read (:mod:`.context_parallel_outputs`): a step that
  reads the loss runs no logits all-gather (the collectives counted), a read runs one, equal to one process;
  reads unlike on the cp ranks stop by name; under bf16 accelerate (autocast, fp32 outputs) the same.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torchrun_launch import run_torchrun

from hf_colossal_auto.apply.context_parallel import (
    ContextParallelError,
    balanced_positions,
    check_context_parallel_model,
    hand_context_parallel_plan,
    with_context_parallel,
)
from hf_colossal_auto.apply.data import DataParallelInfo
from hf_colossal_auto.plan import ContextParallelPlanError, Plan

ROOT = Path(__file__).resolve().parents[1]
CHECK = str(ROOT / "tests" / "multiproc" / "check_context_parallel.py")


def _plan(**fields) -> Plan:
    base = dict(
        model_class="LlamaForCausalLM",
        num_devices=2,
        device="cpu",
        mesh_shape=(1, 2),
        mesh_axis_names=("dp", "tp"),
        dp_mode="ddp",
        param_placements={"w": ["R", "S0"]},
        activation_placements={"m": ["R", "S1"]},
        global_batch_size=2,
        input_shapes={"input_ids": [2, 16]},
        step_time_s=1.0,
        compute_time_s=1.0,
        communication_time_s=0.0,
        peak_memory_bytes=1,
        memory_budget_bytes=2,
        param_memory_bytes=1,
        activation_memory_bytes=0,
    )
    return Plan(**{**base, **fields})


def test_plan_json_without_cp_is_unchanged_and_with_cp_round_trips():
    plain = _plan()
    assert "cp_size" not in plain.to_dict()  # plans without cp write what they wrote before it existed
    assert Plan.from_dict(plain.to_dict()).cp_size == 1
    cp = with_context_parallel(plain, 2)
    assert cp.mesh_axis_names == ("dp", "cp", "tp") and cp.mesh_shape == (1, 2, 2) and cp.num_devices == 4
    assert cp.param_placements == {"w": ["R", "R", "S0"]} and cp.activation_placements == {
        "m": ["R", "R", "S1"]
    }
    assert cp.global_batch_size == 4 and cp.input_shapes == {"input_ids": [4, 16]}
    assert cp.batch_group_size == 4 and cp.tp_size == 2 and cp.dp_size == 1
    assert cp.step_time_s == 0 and "not priced" in cp.solver["status"]
    again = Plan.from_dict(json.loads(cp.to_json()))
    assert again.cp_size == 2 and again.mesh_axis_names == cp.mesh_axis_names
    assert "context parallel" in cp.summary()


@pytest.mark.parametrize(
    "fields, words",
    [
        (dict(cp_size=2), "axis 'cp' of size 2"),
        (dict(mesh_shape=(1, 2, 2), mesh_axis_names=("dp", "cp", "tp")), "needs cp_size > 1"),
        (dict(cp_size=2, mesh_shape=(2, 1, 2), mesh_axis_names=("cp", "dp", "tp")), "not in the order"),
        (dict(cp_size=0), "whole number"),
    ],
)
def test_plan_refuses_a_cp_degree_its_mesh_contradicts(fields, words):
    with pytest.raises(ContextParallelPlanError, match=words):
        _plan(**fields)


def test_balanced_layout_gives_every_rank_a_head_and_a_tail_chunk():
    for cp in (1, 2, 4):
        parts = [balanced_positions(32, cp, r) for r in range(cp)]
        assert sorted(torch.cat(parts).tolist()) == list(range(32))
        work = {int((p + 1).sum()) for p in parts}  # keys each rank's queries see under a causal mask
        assert len(work) == 1, (cp, work)
    assert balanced_positions(16, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    with pytest.raises(ContextParallelError, match="sequence length of 18 does not divide"):
        balanced_positions(18, 2, 0)


def test_hand_context_parallel_plan_replicates_everything_on_a_dp_cp_mesh():
    from hf_colossal_auto.models import build_model, make_example_inputs

    model = build_model("tiny-llama")
    plan = hand_context_parallel_plan(
        model, make_example_inputs(model, 4, 16, device="meta"), cp_size=2, dp_size=2
    )
    assert (
        plan.mesh_axis_names == ("dp", "cp", "tp") and plan.mesh_shape == (2, 2, 1) and plan.num_devices == 4
    )
    assert plan.shards_nothing and plan.cp_size == 2 and plan.global_batch_size == 4
    assert {tuple(p) for p in plan.param_placements.values()} == {("R", "R", "R")}
    assert Plan.from_dict(json.loads(plan.to_json())).cp_size == 2


def test_data_parallel_info_counts_cp_ranks_in_a_group():
    info = DataParallelInfo(rank=0, size=2, tp_size=2, world_size=8, cp_size=2)
    assert info.group_processes == 4 and info.group_batch_size(3) == 12


def _cp_plan(model, **fields) -> Plan:
    params = {n: ["R", "R", "R"] for n, _ in model.named_parameters()}
    base = dict(
        model_class=type(model).__name__,
        num_devices=2,
        mesh_shape=(1, 2, 1),
        mesh_axis_names=("dp", "cp", "tp"),
        cp_size=2,
        param_placements=params,
        activation_placements={},
    )
    return _plan(**{**base, **fields})


@pytest.mark.parametrize(
    "preset, change, words",
    [
        ("tiny-llama", "flash", "flash_attention_2' cannot take the global-position mask"),
        ("tiny-bert", None, "needs a causal LM"),
        ("tiny-t5", None, "not an encoder-decoder"),
        ("tiny-llama", "hsdp", "the plan has 'hsdp'"),
    ],
)
def test_refusals_name_the_setting(preset, change, words):
    from hf_colossal_auto.models import build_model

    model = build_model(preset)
    fields = {}
    if change == "flash":
        model.config._attn_implementation = "flash_attention_2"
    if change == "hsdp":
        fields = dict(dp_mode="hsdp", dp_shard_size=2, mesh_shape=(4, 2, 1), num_devices=8)
    with pytest.raises(ContextParallelError, match=words):
        check_context_parallel_model(model, _cp_plan(model, **fields))


def _blocked_calls(case: dict) -> int:
    """Attention calls of one forward that ran blocked, the same on every rank."""
    calls = {r["blocked_calls"] for r in case["ranks"]}
    assert len(calls) == 1, case["ranks"]
    return calls.pop()


def _close(case: dict) -> None:
    """Every rank: one process's loss, logits and gradients; the logits gathered only when read."""
    for result in case["ranks"]:
        assert abs(result["loss"] - result["reference_loss"]) <= 1e-5 * result["reference_loss"], result
        assert result["logits_diff"] <= 1e-5 and result["max_grad_diff"] <= 1e-5, result
        _gathered_when_read(result, cp=case["mesh"][1])


def _gathered_when_read(result: dict, cp: int) -> None:
    """A step that reads only the loss runs the K/V all-gathers and nothing the logits' size; the first read of
    the logits runs the read tag (3 integers per cp rank) and the logits' gather, later reads none."""
    logits = result["logits_shape"][0] * result["logits_shape"][1] * result["logits_shape"][2]
    assert len(result["gathers_loss_only"]) == result["kv_gathers"], result
    assert max(result["gathers_loss_only"]) < logits, result
    assert result["gathers_first_read"] == [3 * cp, logits], result
    assert result["gathers_read_again"] == [] and result["read_once"], result
    name, base, subclass = result["output_class"]
    assert name == f"ContextParallel{base}" and subclass, result


def _fsdp_close(result: dict, shards: int) -> None:
    """FSDP over ``shards`` = dp x cp ranks: two AdamW steps' losses, gradients and the parameters after equal
    one process's; every rank stores ``1 / shards`` of each parameter's tensor-parallel part."""
    for got, ref in zip(result["losses"], result["ref_losses"], strict=True):
        assert abs(got - ref) <= 1e-5 * ref, result
    assert max(result["grad_diffs"]) <= 1e-5 and result["param_diff_lr"] <= 1e-2, result
    assert result["logits_unread"] == [True] * len(result["losses"]), result  # FSDP's hooks gathered nothing
    for rank in result["ranks"]:
        assert set(rank["fractions"].values()) == {1 / shards}, rank["fractions"]


def test_gloo_cp2_equals_one_process_and_refuses_on_every_rank(tmp_path):
    """cp = 2 on 2 ranks (~30-50 s): five model cases, FSDP over the cp ranks (a hand-made plan, two AdamW steps;
    and the planner's cp FSDP plan), the refusals, and an accelerate loop from a plan file, DDP and FSDP."""
    out = tmp_path / "cp2.json"
    run_torchrun(
        CHECK, "--refusals", "--accelerate", "ddp,fsdp", "--fsdp", "1:1", "--planned-fsdp", "--reads", "--out",
        str(out), nproc=2, timeout=600,
    )  # fmt: skip
    results = json.loads(out.read_text())
    cases = [r for r in results if "model" in r]
    assert [(c["model"], c["kind"]) for c in cases] == [
        ("tiny-gpt2", "plain"),
        ("tiny-llama", "padded"),
        ("tiny-llama", "packed"),
        ("tiny-qwen2-window", "plain"),
        ("tiny-qwen2", "padded"),
        ("tiny-qwen2-window", "plain"),
    ]
    # causal attention without padding or documents ran blocked (no mask), the rest on the mask path; the
    # last case is the window on the mask path
    assert [_blocked_calls(c) for c in cases] == [2, 0, 0, 2, 0, 0]
    assert not cases[5]["blocked"]
    for case in cases:
        _close(case)
        assert case["mesh"] == [1, 2, 1] and case["logits_shape"] == [2, 16, 512]
        assert [r["positions"] for r in case["ranks"]] == [
            [0, 1, 2, 3, 12, 13, 14, 15],
            [4, 5, 6, 7, 8, 9, 10, 11],
        ]
    assert cases[3]["window_effect"] > 1e-3  # the window changes one process's logits: it was masked
    assert cases[2]["recomputed"] == cases[3]["recomputed"] == ["model.layers.0", "model.layers.1"]
    refusals = {r["refusal"]: r["messages"] for r in results if "refusal" in r}
    assert all("sequence length of 14 does not divide" in m for m in refusals["odd-length"])
    assert all("'flash_attention_2' cannot take" in m for m in refusals["flash"])
    assert all("cu_seq_lens_q" in m for m in refusals["offsets"])
    odd = refusals["one-rank-odd"]  # only rank 1's rows were cut: rank 0 stops too, saying why
    assert "sequence length of 15" in odd[1] and "another rank's inputs were refused" in odd[0], odd
    first = next(r for r in results if "first_call_union" in r)
    assert first["first_call_union"] and first["first_call_rows"] == 2
    fsdp = next(r["fsdp"] for r in results if "fsdp" in r)
    assert fsdp["fsdp_mesh"] == [1, 2, 1]
    _fsdp_close(fsdp, 2)
    planned = next(r for r in results if "planned" in r)
    assert planned["planned"] == {"mesh": [1, 2, 1], "dp_mode": "fsdp", "cp": 2, "kind": "plain"}, planned
    assert planned["sharded"], planned
    assert abs(planned["loss"] - planned["reference_loss"]) <= 1e-5 * planned["reference_loss"], planned
    assert planned["max_grad_diff"] <= 1e-5, planned
    loops = [r["accelerate"] for r in results if "accelerate" in r]
    assert [loop["plan_dp_mode"] for loop in loops] == ["ddp", "fsdp"]
    for loop in loops:
        assert loop["plan_cp"] == 2 and loop["gathered_equal"], loop
        for got, ref in zip(
            loop["losses"] + loop["norms"], loop["ref_losses"] + loop["ref_norms"], strict=True
        ):
            assert abs(got - ref) <= 1e-5 * abs(ref), loop
        assert loop["param_err_lr"] <= 1e-2, loop
    reads = next(r for r in results if "uneven_reads" in r)
    mismatch = [m["mismatch"] for m in reads["uneven_reads"]]
    assert all("'logits' of forward" in m and "'hidden_states' of forward" in m for m in mismatch), mismatch
    alone = reads["uneven_reads"][0]
    assert "did not read it" in alone["alone"] and 2 <= alone["waited"] < 30, alone
    assert reads["alike_logits_diff"] <= 1e-5, reads
    bf16 = next(r["mixed_precision"] for r in results if "mixed_precision" in r)
    vocab_sized = 2 * 16 * bf16["vocab"]
    assert len(bf16["bf16_gathers_loss_only"]) == bf16["kv_gathers"], bf16
    assert max(bf16["bf16_gathers_loss_only"]) < vocab_sized, bf16
    assert bf16["bf16_gathers_first_read"] == [6, vocab_sized], bf16
    assert bf16["bf16_logits"] == ["torch.float32", [2, 16, bf16["vocab"]]], bf16
    assert bf16["bf16_logits_err"] <= 2e-2 and bf16["bf16_wrapped"] == [True, True], bf16


def test_gloo_planned_cp2_on_padded_rows_equals_one_process(tmp_path):
    """The planner's cp = 2 plan for padded rows (a padding mask: every layer on the mask path), applied on 2
    gloo ranks: one process's loss and gradients."""
    out = tmp_path / "cp2-padded.json"
    run_torchrun(
        CHECK, "--cases", "", "--no-first-call", "--planned-padded", "--out", str(out), nproc=2, timeout=300
    )
    planned = next(r for r in json.loads(out.read_text()) if "planned" in r)
    assert planned["planned"] == {"mesh": [1, 2, 1], "dp_mode": "ddp", "cp": 2, "kind": "padded"}, planned
    assert abs(planned["loss"] - planned["reference_loss"]) <= 1e-5 * planned["reference_loss"], planned
    assert planned["max_grad_diff"] <= 1e-5, planned


def test_gloo_cp_times_tp_and_dp_times_cp_equal_one_process(tmp_path):
    """cp 2 x tp 2 on 4 ranks (GPT-2, Llama with padding, Qwen2 GQA with a window, Qwen2 GQA eager; DTensor tensor parallelism inside
    each cp rank) and dp 2 x cp 2 (gradients summed over cp, averaged over dp); FSDP over dp 2 x cp 2 and over
    cp 2 (x tp 2: 2-D parameters), two AdamW steps each: ~55-75 s."""
    out = tmp_path / "cp4.json"
    run_torchrun(
        CHECK, "--tp", "2", "--cases", "0,1,3,4", "--dp-case", "--fsdp", "2:1,1:2", "--out", str(out), nproc=4,
        timeout=600,
    )  # fmt: skip
    results = json.loads(out.read_text())
    cases = [r for r in results if "model" in r]
    assert [(c["model"], c["mesh"]) for c in cases] == [
        ("tiny-gpt2", [1, 2, 2]),
        ("tiny-llama", [1, 2, 2]),
        ("tiny-qwen2-window", [1, 2, 2]),
        ("tiny-qwen2", [1, 2, 2]),
        ("tiny-llama", [2, 2, 1]),
    ]
    for case in cases:
        _close(case)
    assert all(c["sharded_params"] > 0 for c in cases[:4])  # tensor parallelism really split the weights
    # blocked on DTensor heads (GPT-2; Qwen2 GQA with a window, recomputed); with dp 2 x cp 2 the second
    # replica's rows have no padding: blocked there, masked on the first
    assert [_blocked_calls(c) for c in cases[:4]] == [2, 0, 2, 0]
    assert [r["blocked_calls"] for r in cases[4]["ranks"]] == [0, 0, 2, 2]
    fsdp = [r["fsdp"] for r in results if "fsdp" in r]
    assert [f["fsdp_mesh"] for f in fsdp] == [[2, 2, 1], [1, 2, 2]]
    _fsdp_close(fsdp[0], 4)
    _fsdp_close(fsdp[1], 2)
    first = next(r for r in results if "first_call_union" in r)
    assert first["first_call_union"]
