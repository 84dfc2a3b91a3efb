"""``device="calibrate"``: the integrations measure the running job's machine once and reuse the cached spec."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hf_colossal_auto.hardware import get_device
from hf_colossal_auto.hardware.catalog import STATIC_CPU_SPEC
from hf_colossal_auto.integrations import calibrated


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
