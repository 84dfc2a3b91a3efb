"""Fidelity against an independent counter (issue 16, item 1): on 2 real gloo processes, the collectives c10d
itself records under ``torch.profiler`` (kind, and the tensor each rank hands in) equal the plan's prediction,
counts and bytes, for every family and plan kind tests/test_fidelity.py covers — the project's own recorder
(``apply/simulate.py``) plays no part."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from torchrun_launch import run_torchrun

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_predicted_collectives_equal_what_c10d_records_on_real_ranks(tmp_path):
    out = tmp_path / "result.json"
    run_torchrun(str(ROOT / "tests" / "multiproc" / "check_collectives.py"), "--out", str(out), timeout=400)
    results = json.loads(out.read_text())
    assert len(results) == 14  # 4 families x 2 plans at the tiny shapes, 3 x 2 at hidden 256
    assert any(r["counted"] for r in results), "no collectives counted: the counter itself is broken"
    wrong = [
        r["case"]
        for r in results
        if (r["counted"], r["counted_bytes"]) != (r["predicted"], r["predicted_bytes"])
    ]
    assert not wrong, [r for r in results if r["case"] in wrong]
