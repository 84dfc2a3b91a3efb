"""Rank skew: the wait at synchronising collectives, its fit, and where plans pay it."""

from __future__ import annotations

import json

import pytest

from hf_colossal_auto.hardware.catalog import STATIC_CPU_SPEC, device_from_dict
from hf_colossal_auto.hardware.skew import expected_slowest, fit_rank_skew, sync_wait
from hf_colossal_auto.models import build_model, make_example_inputs
from hf_colossal_auto.solve.planner import evaluate_plan

SKEWED = STATIC_CPU_SPEC.with_overrides(rank_skew_s=0.03, rank_skew_exponent=0.7, rank_skew_ranks=2)


def test_expected_slowest_matches_the_known_values():
    assert expected_slowest(1) == 0.0
    assert expected_slowest(2) == pytest.approx(1 / 3.141592653589793**0.5, abs=1e-6)  # 1/sqrt(pi)
    assert expected_slowest(4) == pytest.approx(1.029375, abs=1e-5)
    assert expected_slowest(8) == pytest.approx(1.423600, abs=1e-5)


def test_sync_wait_grows_with_the_work_and_the_group():
    assert sync_wait(SKEWED, 1.0, 2) == pytest.approx(0.03)
    assert sync_wait(SKEWED, 0.1, 2) == pytest.approx(0.03 * 0.1**0.7)
    assert sync_wait(SKEWED, 0.1, 8) == pytest.approx(
        0.03 * 0.1**0.7 * expected_slowest(8) / expected_slowest(2)
    )
    assert sync_wait(SKEWED, 1.0, 1) == 0.0  # nobody to wait for
    assert sync_wait(STATIC_CPU_SPEC, 1.0, 8) == 0.0  # no measured skew


def test_fit_recovers_a_power_law_and_clamps_its_exponent():
    lengths = [0.003, 0.01, 0.03, 0.1, 0.3]
    skew, exponent = fit_rank_skew(lengths, [0.02 * L**0.8 for L in lengths])
    assert (skew, exponent) == pytest.approx((0.02, 0.8))
    _, flat = fit_rank_skew(lengths, [0.001] * 5)  # a constant wait is a collective's cost, not skew
    assert flat == 0.5
    assert fit_rank_skew(lengths, [0.0] * 5) == (0.0, 1.0)


def test_rank_skew_round_trips_and_is_validated():
    assert device_from_dict(json.loads(json.dumps(SKEWED.to_dict()))) == SKEWED
    with pytest.raises(ValueError, match="rank_skew_exponent"):
        STATIC_CPU_SPEC.with_overrides(rank_skew_exponent=1.5)
    with pytest.raises(ValueError, match="rank_skew_ranks"):
        STATIC_CPU_SPEC.with_overrides(rank_skew_ranks=1)
    data = SKEWED.to_dict()
    for key in ("rank_skew_s", "rank_skew_exponent", "rank_skew_ranks"):
        del data[key]
    assert device_from_dict(data).rank_skew_s == 0.0  # files written before load without skew


@pytest.fixture(scope="module")
def llama():
    model = build_model("tiny-llama", device="meta")
    return model, make_example_inputs(model, 4, 64, device="meta")


def test_a_data_parallel_step_waits_once_for_the_whole_step(llama):
    model, batch = llama
    plain = evaluate_plan(model, batch, "ddp", num_devices=2, device=STATIC_CPU_SPEC).plan
    plan = evaluate_plan(model, batch, "ddp", num_devices=2, device=SKEWED).plan
    assert plain.sync_wait_s == 0.0
    # one synchronisation (the gradient sync) after all of the step's work
    work = plain.compute_time_s
    assert plan.sync_wait_s == pytest.approx(sync_wait(SKEWED, work, 2), rel=0.02)
    assert plan.step_time_s == pytest.approx(plain.step_time_s + plan.sync_wait_s, rel=1e-9)


def test_tensor_parallel_plans_wait_at_every_synchronising_collective(llama):
    """Megatron's all-reduces cut the step into many segments: with a concave wait it pays more than one
    synchronisation of the whole step, and never more than a wait per collective on the whole step's work."""
    model, batch = llama
    ddp = evaluate_plan(model, batch, "ddp", num_devices=2, device=SKEWED).plan
    megatron = evaluate_plan(model, batch, "megatron", num_devices=2, device=SKEWED, mesh_shape=(1, 2)).plan
    syncs = sum(v for k, v in megatron.collectives.items() if not k.startswith("dp_"))
    assert syncs >= 4
    assert megatron.sync_wait_s > ddp.sync_wait_s
    assert megatron.sync_wait_s < syncs * sync_wait(SKEWED, megatron.compute_time_s, 2)
    assert "waiting for peers" in megatron.summary()
