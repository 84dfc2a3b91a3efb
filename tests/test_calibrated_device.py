"""``device="calibrate"``: the integrations measure the running job's machine once and reuse the cached spec."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hf_colossal_auto.calibration import job as calibrated
from hf_colossal_auto.hardware import get_device
from hf_colossal_auto.hardware.catalog import STATIC_CPU_SPEC


@pytest.fixture
def fake_calibrate(monkeypatch, tmp_path):
    """A stand-in for calibrate() that records its calls (the real one is tested in test_calibration.py)."""
    calls = []

    def calibrate(kind, *, budget_s, overheads):
        calls.append((kind, budget_s, overheads))
        return STATIC_CPU_SPEC.with_overrides(host_overhead_s=1e-5 * len(calls))

    monkeypatch.setenv("HF_COLOSSAL_AUTO_CACHE", str(tmp_path))
    monkeypatch.setattr("hf_colossal_auto.calibration.calibrate", calibrate)
    return calls


def test_calibrate_measures_once_then_reads_the_cache(fake_calibrate, tmp_path):
    first = calibrated.resolve_device("calibrate", "cpu")
    assert fake_calibrate == [("cpu", calibrated._BUDGET_S, True)]  # one process: overheads measured too
    assert first.startswith(str(tmp_path)) and first.endswith(".json")
    assert get_device(first).host_overhead_s == pytest.approx(1e-5)
    again = calibrated.resolve_device("Calibrate", "cpu")
    assert again == first and len(fake_calibrate) == 1  # cached: no second measurement
    calibrated.calibrated_device("cpu", refresh=True)
    assert len(fake_calibrate) == 2 and get_device(first).host_overhead_s == pytest.approx(2e-5)
    assert json.loads(Path(first).read_text())["name"] == STATIC_CPU_SPEC.name


def test_other_devices_pass_through_and_the_key_follows_the_job(fake_calibrate, monkeypatch):
    assert calibrated.resolve_device(None, "cpu") is None
    assert calibrated.resolve_device("a100-80gb", "cpu") == "a100-80gb"
    assert fake_calibrate == []
    one = calibrated.calibration_cache_path("cpu")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")  # another job shape: another cache entry
    assert calibrated.calibration_cache_path("cpu") != one


# --- 2 ranks: one decision, every rank measures, one file --------------------------------------------------


def _joint_calibrate(kind, *, budget_s, overheads):
    """A stand-in for calibrate() that, like the real one, needs every rank: it times nothing but runs one
    collective, so a rank that skipped it would leave the other waiting."""
    import torch.distributed as dist

    joined = torch.ones(1)
    dist.all_reduce(joined)
    return STATIC_CPU_SPEC.with_overrides(host_overhead_s=1e-6 * float(joined) + 1e-6 * overheads)


def _calibrating_rank(rank: int, store: str, cache_root: str, results: dict) -> None:
    import os

    import torch.distributed as dist

    import hf_colossal_auto.calibration

    hf_colossal_auto.calibration.calibrate = _joint_calibrate
    os.environ["HF_COLOSSAL_AUTO_CACHE"] = os.path.join(cache_root, "shared")
    os.environ["LOCAL_WORLD_SIZE"] = "2"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        first = calibrated.resolve_device("calibrate", "cpu")
        # rank 1 now sees an empty cache, rank 0 a warm one: rank 0's decision (read it) holds on both,
        # else rank 1 would wait in a calibration collective rank 0 never joins
        if rank == 1:
            os.environ["HF_COLOSSAL_AUTO_CACHE"] = os.path.join(cache_root, "empty")
        hf_colossal_auto.calibration.calibrate = lambda *a, **k: pytest.fail("the cache was warm")
        second = calibrated.resolve_device("calibrate", "cpu")
        results[rank] = (first, second, get_device(first).host_overhead_s)
    finally:
        dist.destroy_process_group()


def test_two_ranks_calibrate_together_and_share_one_cached_spec(tmp_path):
    """A 2-process job: both ranks join one calibration (its collectives run on the job's group), rank 0 writes
    it, both get the same path — and the next call reads it on every rank, because rank 0 decides."""
    from torchrun_launch import spawn_ranks

    results = spawn_ranks(
        _calibrating_rank,
        str(tmp_path / "store"),
        str(tmp_path),
        what="two-rank calibration (the ranks disagreeing on using the cache?)",
    )
    (first0, second0, overhead0), (first1, second1, overhead1) = results[0], results[1]
    assert first0 == first1 and str(tmp_path / "shared") in first0
    assert second1 == first1.replace("shared", "empty")  # rank 1 names its own cache dir's entry ...
    assert not Path(second1).exists()  # ... which nobody wrote: it took rank 0's decision, not its own
    assert second0 == first0
    # both ranks joined the collective (sum 2) and, in a launched job, no per-op overheads (one process only)
    assert overhead0 == overhead1 == pytest.approx(2e-6)
