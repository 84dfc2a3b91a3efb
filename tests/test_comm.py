"""Alpha-beta collective model, least-squares fit, and calibration on a live (1-process) gloo group."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from hf_colossal_auto.hardware import (
    COLLECTIVE_KINDS,
    CommCalibration,
    LinkSpec,
    calibrate_link,
    canonical_collective,
    collective_time,
    fit_alpha_beta,
    host_cache,
)
from hf_colossal_auto.hardware.skew import measure_rank_skew
from hf_colossal_auto.units import KiB

LINK = LinkSpec(bandwidth=100e9, latency=5e-6)


def test_all_reduce_hand_computed() -> None:
    # p=4, n=1 GB: 2*3*5us + 2*3/4 * 1e9/1e11 = 30us + 15ms
    assert collective_time("all_reduce", 10**9, 4, LINK) == pytest.approx(30e-6 + 0.015)


def test_all_gather_reduce_scatter_all_to_all_hand_computed() -> None:
    # p=8, n=8 GB: 7*5us + 7/8 * 8e9/1e11 = 35us + 70ms
    expected = 35e-6 + 0.07
    for kind in ("all_gather", "reduce_scatter", "all_to_all"):
        assert collective_time(kind, 8 * 10**9, 8, LINK) == pytest.approx(expected)


def test_broadcast_hand_computed() -> None:
    # p=2, n=1 GB: 1*5us + 1e9/1e11
    assert collective_time("broadcast", 10**9, 2, LINK) == pytest.approx(5e-6 + 0.01)


def test_all_reduce_is_reduce_scatter_plus_all_gather() -> None:
    for p in (2, 3, 8, 64):
        n = 123_456_789
        assert collective_time("all_reduce", n, p, LINK) == pytest.approx(
            collective_time("reduce_scatter", n, p, LINK) + collective_time("all_gather", n, p, LINK)
        )


@pytest.mark.parametrize("kind", COLLECTIVE_KINDS)
def test_trivial_cases_are_free(kind: str) -> None:
    assert collective_time(kind, 10**9, 1, LINK) == 0.0
    assert collective_time(kind, 0, 8, LINK) == 0.0


def test_time_grows_with_group_size_and_bytes() -> None:
    for kind in COLLECTIVE_KINDS:
        assert collective_time(kind, 10**6, 4, LINK) < collective_time(kind, 10**6, 8, LINK)
        assert collective_time(kind, 10**6, 4, LINK) < collective_time(kind, 10**7, 4, LINK)


def test_errors() -> None:
    with pytest.raises(ValueError, match="Unknown collective 'gossip'"):
        collective_time("gossip", 1, 1, LINK)  # checked even when p == 1
    with pytest.raises(ValueError, match="group_size"):
        collective_time("all_reduce", 1, 0, LINK)
    with pytest.raises(ValueError, match="nbytes"):
        collective_time("all_reduce", -1, 2, LINK)


@pytest.mark.parametrize(
    ("alias", "canonical"),
    [
        ("allreduce", "all_reduce"),
        ("All-Reduce", "all_reduce"),
        ("all_gather_into_tensor", "all_gather"),
        ("reduce_scatter_tensor", "reduce_scatter"),
        ("all_to_all_single", "all_to_all"),
    ],
)
def test_collective_aliases(alias: str, canonical: str) -> None:
    assert canonical_collective(alias) == canonical


@pytest.mark.parametrize(
    ("kind", "p"), [("all_reduce", 4), ("all_gather", 8), ("broadcast", 3), ("all_reduce", 2)]
)
def test_fit_recovers_exact_parameters(kind: str, p: int) -> None:
    truth = LinkSpec(bandwidth=37e9, latency=7e-6)
    sizes = [4 * KiB, 256 * KiB, 8 << 20, 64 << 20]
    times = [collective_time(kind, n, p, truth) for n in sizes]
    fitted = fit_alpha_beta(kind, sizes, times, p)
    assert fitted.bandwidth == pytest.approx(truth.bandwidth, rel=1e-9)
    assert fitted.latency == pytest.approx(truth.latency, rel=1e-9)


def test_fit_handles_noise_and_degenerate_data() -> None:
    # Intercept that would fit negative is clamped to zero latency.
    fitted = fit_alpha_beta("all_reduce", [1000, 2000, 4000], [1e-6, 2.2e-6, 4.1e-6], 2)
    assert fitted.latency == 0.0 and fitted.bandwidth > 0
    # Times that do not grow with size still give a finite, conservative link.
    flat = fit_alpha_beta("all_reduce", [1000, 10**6], [1e-3, 0.9e-3], 4)
    assert math.isfinite(flat.bandwidth) and flat.bandwidth > 0 and math.isfinite(flat.latency)
    # group_size 1: unit coefficients, still a valid LinkSpec.
    single = fit_alpha_beta("all_reduce", [1000, 2000], [1e-5, 2e-5], 1)
    assert single.bandwidth == pytest.approx(1e8)
    with pytest.raises(ValueError):
        fit_alpha_beta("all_reduce", [1000], [1e-5], 2)
    with pytest.raises(ValueError):
        fit_alpha_beta("all_reduce", [1000, 2000], [0.0, 1e-5], 2)


def test_calibrate_link_requires_process_group() -> None:
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="process group"):
        calibrate_link()


def test_calibrate_link_on_single_process_gloo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(host_cache.CACHE_ENV, str(tmp_path / "cache"))
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        calib = CommCalibration(sizes=(1 * KiB, 64 * KiB), iters=2, warmup=1)
        link = calib.calibrate_link()
        assert isinstance(link, LinkSpec)
        assert math.isfinite(link.bandwidth) and link.bandwidth > 0
        assert math.isfinite(link.latency) and link.latency >= 0
        assert calib.calibrate_link() is link  # memoised
        assert (tmp_path / "cache" / "comm_calibration.json").exists()
        # A fresh calibrator (e.g. the next job) reads the disk cache instead of re-measuring.
        fresh = CommCalibration(sizes=(1 * KiB, 64 * KiB), iters=2, warmup=1)
        monkeypatch.setattr(fresh, "_measure", lambda *a, **k: pytest.fail("should have used the disk cache"))
        assert fresh.calibrate_link() == link
        # Explicit group argument and force re-measurement.
        world = dist.new_group(ranks=[0])
        forced = calib.calibrate_link(group=world, force=True)
        assert math.isfinite(forced.bandwidth) and forced.bandwidth > 0
    finally:
        dist.destroy_process_group()


def _two_rank_worker(rank: int, store: str, cache_root: str, results: dict[int, tuple[float, ...]]) -> None:
    """Each rank calibrates (shared cache dir), then ranks use *different* cache dirs of which only rank 0's is warm."""
    import os

    os.environ[host_cache.CACHE_ENV] = os.path.join(cache_root, "shared")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        sizes = (1 * KiB, 256 * KiB, 4 << 20)
        measured = CommCalibration(sizes=sizes, iters=3, warmup=1).calibrate_link()
        # Rank 1 now looks at an empty cache while rank 0 has a hit: rank 0's decision must
        # win on both, otherwise rank 1 would wait in a collective rank 0 never issues.
        if rank == 1:
            os.environ[host_cache.CACHE_ENV] = os.path.join(cache_root, "empty")
        cached = CommCalibration(sizes=sizes, iters=3, warmup=1).calibrate_link()
        skew = measure_rank_skew(torch.device("cpu"), (0.003, 0.01, 0.03), budget_s=0.15)
        results[rank] = (measured.bandwidth, measured.latency, cached.bandwidth, cached.latency, *skew)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_calibrate_link_two_gloo_ranks_agree(tmp_path: Path) -> None:
    from torchrun_launch import spawn_ranks

    results = spawn_ranks(
        _two_rank_worker,
        str(tmp_path / "store"),
        str(tmp_path),
        what="two-rank calibration (ranks disagreeing on using the cache?)",
    )
    r0, r1 = results[0], results[1]
    assert r0 == r1  # identical plans on every rank need identical links
    bandwidth, latency, cached_bw, cached_lat, skew, exponent = r0
    assert math.isfinite(bandwidth) and bandwidth > 0 and math.isfinite(latency) and latency >= 0
    assert (cached_bw, cached_lat) == (bandwidth, latency)
    # the rank skew fit: the same on both ranks (averaged over them), a wait that grows with the work
    assert math.isfinite(skew) and skew >= 0 and 0.5 <= exponent <= 1.0
