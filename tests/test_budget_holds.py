"""A budget is a promise: plans made under it keep a real step under it, for families the suite has no preset
for (OPT, Qwen2, GPT-NeoX, BART).

Each case plans at 0.6x the no-recompute peak of its mesh (so the plan recomputes), applies the plan on 2 gloo
ranks, feeds every rank the rows the planner priced for it (data-parallel replicas their own half of the
global batch, tensor-parallel ranks the same batch) and measures one steady-state step with MemTracker.
One torchrun launch runs every case (tests/multiproc/check_budget.py). Figures: docs/reliability.md, "Memory
budget on real steps".
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from torchrun_launch import run_torchrun

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def launch(tmp_path_factory) -> tuple[list[dict], list[dict]]:
    """One launch: every case's records, then the ``autoparallelize`` loop's (one per rank)."""
    root = tmp_path_factory.mktemp("budget")
    out, auto = root / "budget.json", root / "autoparallelize.json"
    run_torchrun(
        str(ROOT / "tests/multiproc/check_budget.py"),
        f"--out={out}",
        f"--autoparallelize-out={auto}",
        timeout=700,
    )
    return json.loads(out.read_text()), json.loads(auto.read_text())


@pytest.fixture(scope="module")
def measured(launch) -> list[dict]:
    return launch[0]


@pytest.mark.slow
def test_every_case_ran_on_both_ranks_with_recompute(measured):
    """The cases the file promises, both ranks each, each plan on its mesh and recomputing something (a plan
    without recompute would not test the recompute memory model)."""
    cases = {(r["family"], r["mesh"]) for r in measured}
    assert cases == {("opt", "2x1"), ("qwen2", "2x1"), ("gpt_neox", "2x1"), ("bart", "2x1"), ("opt", "1x2")}
    assert len(measured) == 2 * len(cases)
    for r in measured:
        assert r["plan_mesh"] == [int(x) for x in r["mesh"].split("x")], r
        assert any(v != "none" for v in r["recompute"].values()), r
        dp = r["plan_mesh"][0]
        assert r["rows"][1] - r["rows"][0] == 16 // dp, r  # a replica's share of the global batch of 16


@pytest.mark.slow
def test_measured_peak_per_rank_stays_under_the_budget(measured):
    failures = [r for r in measured if r["measured_peak"] > r["budget"]]
    assert not failures, failures


@pytest.mark.slow
def test_data_parallel_prediction_is_the_measured_peak(measured):
    """On a data-parallel mesh the prediction bounds the measured peak tightly for the decoder-only families;
    BART is over-predicted by ~1 %, tensor-parallel plans by up to ~10 % (the moment's transient is priced
    unsharded): bounds, never a miss.

    The decoder-only dp=2 plans run on ordinary tensors (apply/data_parallel.py) and measure 4 bytes below the
    prediction, as they did on DTensors. (They once seemed 16-24 KiB below: the measurement missed the batch,
    which the planner counts and MemTracker saw only when the DTensor runtime viewed it; it is now named to the
    tracker, ``common.measured_step_peak``.)"""
    for r in measured:
        if r["mesh"] == "2x1" and r["family"] != "bart":
            assert 0 <= r["predicted_peak"] - r["measured_peak"] <= 16, r
        assert r["measured_peak"] <= r["predicted_peak"] + 16, r


@pytest.mark.slow
def test_autoparallelize_hands_the_plain_loop_a_plan_within_its_budget(launch):
    """``autoparallelize(model, batch, memory_budget=0.6 x the free plan's peak)`` (OPT, 2 ranks, no mesh, mode
    or micro-batch count given) followed by the README's loop — one forward, one backward per batch: the plan
    runs the batch in one piece and the measured peak stays under the budget (issue 25: it chose FSDP with two
    micro-batches and the loop peaked at 1.6x the budget) — or planning refuses with InfeasibleError."""
    records = launch[1]
    assert [r["rank"] for r in records] == [0, 1]
    for r in records:
        if "infeasible" in r:
            assert "budget" in r["infeasible"] or "memory" in r["infeasible"], r
            continue
        assert r["micro_batches"] == 1, r
        assert r["rows"] * r["plan_mesh"][0] == 16, r  # the global batch of 16, in one piece per group
        assert r["measured_peak"] <= r["budget"], r


@pytest.mark.slow
def test_whole_batch_into_a_micro_batched_plan_is_refused_by_name(launch):
    """The same plan with ``micro_batches=2``: a training forward of the group's whole batch raises
    WholeBatchError naming ``accumulate`` (instead of running over the budget); under no_grad it runs, and the
    ``accumulate`` loop runs its two pieces."""
    for r in launch[1]:
        if "infeasible" in r:
            continue
        assert r["whole_batch_error"] is not None, r
        assert "accumulate" in r["whole_batch_error"] and "2 micro-batches" in r["whole_batch_error"], r
        assert r["accumulate_pieces"] == 2, r
