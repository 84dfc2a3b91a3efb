"""Hand configurations priced by ``evaluate_plan`` (the scale benchmark's torchtitan-style FSDP x TP with selective
recompute, HSDP x TP, Megatron TP x DP with micro-batches) and the planner's pruned search (issue #12).

A hand configuration is the planner's own ILP with placements, data-parallel mode, recompute and micro-batches
pinned, so its estimate must be reproduced by pricing the Plan it writes, and the planner, which searches all of
them, is never slower than one that fits."""

from __future__ import annotations

import pytest

from hf_colossal_auto.models import build_model, make_example_inputs
from hf_colossal_auto.solve.planner import evaluate_plan, plan_model

DEVICE = "h100-80gb"


@pytest.fixture(scope="module")
def llama():
    model = build_model("tiny-llama", device="meta")
    return model, make_example_inputs(model, 16, 64, device="meta")


@pytest.mark.parametrize(
    ("dp_mode", "shard", "recompute", "micro_batches"),
    [
        ("fsdp", None, "selective:pointwise", 1),
        ("hsdp", 2, "selective:pointwise", 2),
        ("ddp", None, "none", 4),
    ],
)
def test_hand_config_equals_pricing_the_plan_it_writes(llama, dp_mode, shard, recompute, micro_batches):
    """Megatron placements on a 4 x 2 mesh of 4 nodes x 2 devices, under each data-parallel mode the scale
    benchmark uses; ``selective:pointwise`` is pinned even where the unit's ranked levels do not list it."""
    model, batch = llama
    common = dict(num_devices=8, device=DEVICE, devices_per_node=2, mixed_precision="bf16")
    est = evaluate_plan(
        model,
        batch,
        "megatron",
        mesh_shape=(4, 2),
        dp_mode=dp_mode,
        dp_shard_size=shard,
        recompute=recompute,
        micro_batches=micro_batches,
        fit_budget=True,
        **common,
    )
    plan = est.plan
    assert (est.mesh_shape, est.dp_mode, plan.micro_batches) == ((4, 2), dp_mode, micro_batches)
    assert set(plan.recompute.values()) <= {recompute}
    if shard:
        assert plan.dp_shard_size == shard and plan.dp_label == "hsdp 2x2"
    again = evaluate_plan(model, batch, plan, **common)
    assert again.step_time_s == pytest.approx(est.step_time_s, rel=1e-9)
    assert again.peak_memory_bytes == est.peak_memory_bytes


def test_hand_config_arguments_are_checked(llama):
    model, batch = llama
    common = dict(num_devices=8, device=DEVICE, devices_per_node=2)
    with pytest.raises(ValueError, match="dp_mode"):
        evaluate_plan(model, batch, "ddp", dp_mode="fsdp", **common)
    with pytest.raises(ValueError, match="shard group"):
        evaluate_plan(model, batch, "megatron", dp_shard_size=2, **common)
    with pytest.raises(ValueError, match="recompute option"):
        evaluate_plan(model, batch, "megatron", recompute="selective:nothing", **common)


def test_pruned_search_is_no_slower_than_any_hand_config_that_fits(llama):
    """The search skips candidates by lower bounds (model state over the budget, the relaxation's optimum no
    faster than the best plan so far); what it returns still beats every configuration it could have tried."""
    model, batch = llama
    common = dict(num_devices=8, device=DEVICE, devices_per_node=2, mixed_precision="bf16")
    plan = plan_model(model, batch, **common)
    assert any("min_step_time_s" in alt for alt in plan.alternatives)  # something was pruned by time
    for mesh in ((8, 1), (4, 2)):  # Megatron's tensor parallelism divides the 2 KV heads
        for mode in ("ddp", "fsdp"):
            est = evaluate_plan(
                model, batch, "megatron", mesh_shape=mesh, dp_mode=mode, fit_budget=True, **common
            )
            assert plan.step_time_s <= est.step_time_s * (1 + 1e-9), (mesh, mode)
