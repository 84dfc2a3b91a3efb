"""Fidelity against an independent counter (issue 16, item 1; issue 29): on 2 real gloo processes, the collectives
c10d itself records under ``torch.profiler`` (kind, and the tensor each rank hands in) equal the plan's prediction,
counts and bytes, for every family and plan kind tests/test_fidelity.py covers — the project's own recorder
(``apply/simulate.py``) plays no part. MoE included: tiny Mixtral with TP inside every expert, whole experts per
tensor-parallel rank, and whole experts per data-parallel rank, whose all-to-alls' split sizes (as c10d recorded
its arguments) are the ones each rank's routing in one process implies."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from torchrun_launch import run_torchrun

ROOT = Path(__file__).resolve().parents[1]
MOE = ("tiny-mixtral-experts-tp", "tiny-mixtral-experts-ep", "tiny-mixtral-ddp-ep")


@pytest.mark.slow
def test_predicted_collectives_equal_what_c10d_records_on_real_ranks(tmp_path):
    out = tmp_path / "result.json"
    script = ROOT / "tests" / "multiproc" / "check_collectives.py"
    run_torchrun(str(script), "--out", str(out), "--moe", timeout=500)
    results = json.loads(out.read_text())
    dense, moe = results[:-3], {r["case"]: r for r in results[-3:]}
    assert len(dense) == 14  # 4 families x 2 plans at the tiny shapes, 3 x 2 at hidden 256
    assert tuple(moe) == MOE
    assert any(r["counted"] for r in dense), "no collectives counted: the counter itself is broken"
    wrong = [
        r["case"]
        for r in [*dense, moe[MOE[0]], moe[MOE[1]]]
        if (r["counted"], r["counted_bytes"]) != (r["predicted"], r["predicted_bytes"])
    ]
    assert not wrong, [r for r in results if r["case"] in wrong]
    _experts_over_dp_ran_as_predicted_and_as_routed(moe["tiny-mixtral-ddp-ep"])


def _experts_over_dp_ran_as_predicted_and_as_routed(case: dict) -> None:
    """2 x 1, each rank its rows, the experts split over the ranks: c10d ran the plan's all-to-alls (count; bytes
    on average over the ranks: one rank's share follows the routing) and its DDP all-reduces (count), and each
    all-to-all moved the rows the routing sends: its split sizes are those of the one-process model's routing
    of every rank's rows, which is uneven here."""
    assert case["dp_label"] == "ddp, experts over dp"
    predicted, counted = case["predicted"], case["counted"]
    assert counted == {
        "all_to_all": predicted["dp_all_to_all"],
        "all_reduce (plain)": predicted["dp_all_reduce"],
    }
    by_rank = [ranked["all_to_all"] for ranked in case["counted_bytes_by_rank"]]
    assert sum(by_rank) / len(by_rank) == case["predicted_bytes"]["dp_all_to_all"]
    assert by_rank[0] != by_rank[1]  # uneven routing: the ranks' shares differ
    assert case["splits_by_rank"] == case["expected_splits_by_rank"]
    uneven = [s for splits in case["splits_by_rank"] for s in splits if len(set(s[0])) > 1 or s[0] != s[1]]
    assert uneven, "the routing was even: the split sizes were not tried"
