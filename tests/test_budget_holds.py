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
def measured(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("budget") / "budget.json"
    run_torchrun(str(ROOT / "tests/multiproc/check_budget.py"), f"--out={out}", timeout=600)
    return json.loads(out.read_text())


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
    """On a data-parallel mesh the prediction is the measured peak for the decoder-only families (measured 4
    bytes below it); BART is over-predicted by ~1 %, tensor-parallel plans by up to ~10 % (the moment's
    transient is priced unsharded): bounds, never a miss."""
    for r in measured:
        if r["mesh"] == "2x1" and r["family"] != "bart":
            assert abs(r["measured_peak"] - r["predicted_peak"]) <= 16, r
        assert r["measured_peak"] <= r["predicted_peak"] + 16, r
