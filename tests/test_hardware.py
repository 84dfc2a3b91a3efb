"""Device catalog, cpu calibration cache, roofline and cluster/mesh layout."""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import pickle
from pathlib import Path

import pytest
import torch

from hf_colossal_auto.calibration import cpu as cpu_calibration
from hf_colossal_auto.calibration.cpu import CpuBenchmarkResult
from hf_colossal_auto.hardware import (
    STATIC_CPU_SPEC,
    ClusterSpec,
    DeviceSpec,
    LinkSpec,
    compute_time,
    detect_device,
    device_from_cuda_name,
    device_from_dict,
    get_device,
    host_cache,
    is_compute_bound,
    list_devices,
    memory_budget_default,
    mesh_shapes,
    op_time,
    peak_flops_for,
    ridge_intensity,
    static_presets,
)
from hf_colossal_auto.units import GB, GiB, MiB


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Every test gets its own cache dir, calibration disabled, and no in-process memo."""
    cache = tmp_path / "cache"
    monkeypatch.setenv(host_cache.CACHE_ENV, str(cache))
    monkeypatch.setenv(host_cache.NO_CALIBRATE_ENV, "1")
    cpu_calibration.clear_cpu_calibration_memo()
    yield cache
    cpu_calibration.clear_cpu_calibration_memo()


# --------------------------------------------------------------------------- catalog


def test_list_devices_has_required_presets() -> None:
    names = list_devices()
    for required in ("a100-40gb", "a100-80gb", "h100-80gb", "h200", "v100-32gb", "l4", "cpu"):
        assert required in names
    assert names == sorted(names)


@pytest.mark.parametrize("name", list_devices())
def test_every_preset_loads_with_positive_numbers(name: str) -> None:
    spec = get_device(name)
    assert spec.name == name
    assert spec.kind in ("cuda", "cpu")
    assert "float32" in spec.peak_flops
    assert all(v > 0 and math.isfinite(v) for v in spec.peak_flops.values())
    assert spec.memory_bandwidth > 0
    assert spec.memory_bytes > 0
    for link in (spec.intra_node_link, spec.inter_node_link):
        assert link.bandwidth > 0 and link.latency >= 0
    assert spec.devices_per_node >= 1
    assert spec.kernel_overhead_s > 0
    assert 0 < memory_budget_default(spec) < spec.memory_bytes


def test_datasheet_figures() -> None:
    a100 = get_device("a100-80gb")
    assert a100.peak_flops["bfloat16"] == 312e12
    assert a100.peak_flops["float32"] == 19.5e12
    assert a100.peak_flops["tf32"] == 156e12
    assert a100.memory_bandwidth == 2039 * GB
    assert get_device("a100-40gb").memory_bandwidth == 1555 * GB
    assert a100.intra_node_link.bandwidth == 300 * GB
    assert a100.inter_node_link.bandwidth == 25 * GB
    h100 = get_device("h100-80gb")
    assert h100.peak_flops["bfloat16"] == 989e12
    assert h100.peak_flops["float32"] == 67e12
    assert h100.memory_bandwidth == 3350 * GB
    assert h100.intra_node_link.bandwidth == 450 * GB
    assert h100.inter_node_link.bandwidth == 50 * GB
    h200 = get_device("h200")
    assert h200.peak_flops == h100.peak_flops
    assert h200.memory_bandwidth == 4800 * GB
    assert h200.memory_bytes == 141 * GiB
    v100 = get_device("v100-32gb")
    assert v100.peak_flops["float16"] == 125e12 and v100.peak_flops["float32"] == 15.7e12
    assert v100.intra_node_link.bandwidth == 150 * GB
    l4 = get_device("l4")
    assert l4.peak_flops["bfloat16"] == 121e12 and l4.memory_bandwidth == 300 * GB
    assert l4.intra_node_link.bandwidth == 32 * GB
    for name in ("a100-80gb", "h100-80gb", "h200", "v100-32gb", "l4"):
        spec = get_device(name)
        assert spec.devices_per_node == 8 and spec.kind == "cuda"
        assert spec.kernel_overhead_s == 5e-6
        # The network must never be modelled as faster than the in-node link.
        assert spec.inter_node_link.bandwidth < spec.intra_node_link.bandwidth
        assert spec.inter_node_link.latency >= spec.intra_node_link.latency


@pytest.mark.parametrize(
    ("alias", "canonical"),
    [
        ("a100", "a100-80gb"),
        ("A100", "a100-80gb"),
        ("h100", "h100-80gb"),
        ("H100-SXM5", "h100-80gb"),
        ("a100_40gb", "a100-40gb"),
        ("A100 40GB", "a100-40gb"),
        ("NVIDIA H200", "h200"),
        ("v100", "v100-32gb"),
        ("L4", "l4"),
        ("CPU", "cpu"),
    ],
)
def test_aliases_and_case(alias: str, canonical: str) -> None:
    assert get_device(alias).name == canonical


def test_get_device_passes_specs_through() -> None:
    spec = get_device("h100").with_overrides(name="my-h100")
    assert get_device(spec) is spec


def test_unknown_device_lists_every_valid_name() -> None:
    with pytest.raises(ValueError) as excinfo:
        get_device("tpu-v5")
    message = str(excinfo.value)
    assert "'tpu-v5'" in message
    for name in list_devices():
        assert name in message


def test_cpu_without_calibration_is_static() -> None:
    spec = get_device("cpu")
    assert spec == STATIC_CPU_SPEC
    assert spec.devices_per_node == 1
    assert spec.kernel_overhead_s == 2e-6
    assert spec.intra_node_link == LinkSpec(bandwidth=2 * GB, latency=50e-6)


def test_specs_are_immutable_hashable_and_picklable() -> None:
    spec = get_device("a100-80gb")
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.memory_bytes = 1  # type: ignore[misc]
    with pytest.raises(TypeError):
        spec.peak_flops["bfloat16"] = 1.0  # type: ignore[index]
    with pytest.raises(TypeError):
        spec.peak_flops.update(bfloat16=1.0)  # type: ignore[attr-defined]
    assert isinstance(spec.peak_flops, dict)
    assert hash(spec) == hash(get_device("a100"))
    assert {spec: 1}[get_device("a100")] == 1
    assert pickle.loads(pickle.dumps(spec)) == spec
    assert copy.deepcopy(spec) == spec


def test_with_overrides_coerces_and_validates() -> None:
    base = get_device("a100-80gb")
    custom = base.with_overrides(
        name="a100-smaller", memory_bytes="40GiB", inter_node_link={"bandwidth": 12.5e9, "latency": 1e-5}
    )
    assert custom.memory_bytes == 40 * GiB
    assert custom.inter_node_link == LinkSpec(12.5e9, 1e-5)
    assert custom.peak_flops == base.peak_flops
    assert base.memory_bytes == 80 * GiB  # the preset itself is untouched
    # Aliased dtype keys are canonicalised.
    assert base.with_overrides(peak_flops={"fp32": 1e12, "bf16": 2e12}).peak_flops == {
        "float32": 1e12,
        "bfloat16": 2e12,
    }
    with pytest.raises(ValueError, match="Unknown DeviceSpec field"):
        base.with_overrides(memory=1)
    with pytest.raises(ValueError, match="float32"):
        base.with_overrides(peak_flops={"bfloat16": 1e12})
    with pytest.raises(ValueError, match="memory_bandwidth"):
        base.with_overrides(memory_bandwidth=-1.0)
    with pytest.raises(ValueError, match="kind"):
        base.with_overrides(kind="tpu")
    with pytest.raises(ValueError, match="bandwidth"):
        LinkSpec(bandwidth=0.0, latency=1e-6)
    with pytest.raises(ValueError, match="latency"):
        LinkSpec(bandwidth=1e9, latency=-1.0)


def test_kernel_overhead_defaults_by_kind_and_can_be_set() -> None:
    spec = DeviceSpec(
        name="x",
        peak_flops={"float32": 1e12},
        memory_bandwidth=1e11,
        memory_bytes=GiB,
        intra_node_link=LinkSpec(1e10, 1e-6),
        inter_node_link=LinkSpec(1e9, 1e-5),
        devices_per_node=4,
        kind="cuda",
    )
    assert spec.kernel_overhead_s == 5e-6
    assert spec.with_overrides(kernel_overhead_s=0).kernel_overhead_s == 0.0


@pytest.mark.parametrize("name", sorted(static_presets()))
def test_dict_json_round_trip(name: str) -> None:
    spec = static_presets()[name]
    assert device_from_dict(json.loads(json.dumps(spec.to_dict()))) == spec


def test_device_from_dict_errors_and_string_memory() -> None:
    data = get_device("l4").to_dict()
    data["memory_bytes"] = "22.5GiB"
    del data["kernel_overhead_s"]
    spec = device_from_dict(data)
    assert spec.memory_bytes == int(22.5 * GiB)
    assert spec.kernel_overhead_s == 5e-6
    del data["kind"]
    data["colour"] = "green"
    with pytest.raises(ValueError, match=r"missing keys \['kind'\], unknown keys \['colour'\]"):
        device_from_dict(data)


def test_memory_budget_default() -> None:
    a100 = get_device("a100-80gb")
    assert memory_budget_default(a100) == 80 * GiB - 8 * GiB
    small = a100.with_overrides(memory_bytes=4 * GiB)
    assert memory_budget_default(small) == 3 * GiB  # the 1 GiB floor beats 10%
    tiny = a100.with_overrides(memory_bytes=100 * MiB)
    assert memory_budget_default(tiny) == 75 * MiB  # floor capped at a quarter
    cpu = STATIC_CPU_SPEC
    assert memory_budget_default(cpu) == cpu.memory_bytes - math.ceil(cpu.memory_bytes * 0.1)


@pytest.mark.parametrize(
    ("cuda_name", "preset"),
    [
        ("NVIDIA A100-SXM4-80GB", "a100-80gb"),
        ("NVIDIA A100-SXM4-40GB", "a100-40gb"),
        ("NVIDIA H100 80GB HBM3", "h100-80gb"),
        ("NVIDIA H200", "h200"),
        ("Tesla V100-SXM2-32GB", "v100-32gb"),
        ("NVIDIA L4", "l4"),
    ],
)
def test_device_from_cuda_name(cuda_name: str, preset: str) -> None:
    spec = device_from_cuda_name(cuda_name, total_memory=12345 * MiB)
    assert spec.name == preset
    assert spec.memory_bytes == 12345 * MiB
    assert device_from_cuda_name(cuda_name).memory_bytes == get_device(preset).memory_bytes


@pytest.mark.parametrize(
    "cuda_name", ["NVIDIA L40S", "NVIDIA A100 80GB PCIe", "NVIDIA H100 PCIe", "NVIDIA GeForce RTX 4090"]
)
def test_device_from_cuda_name_refuses_unknown_parts(cuda_name: str) -> None:
    with pytest.raises(ValueError, match="No catalog entry"):
        device_from_cuda_name(cuda_name)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU fallback")
def test_detect_device_on_cpu_host() -> None:
    assert detect_device() == STATIC_CPU_SPEC


# --------------------------------------------------------------------------- calibration


def _fake_result() -> CpuBenchmarkResult:
    return CpuBenchmarkResult(
        peak_flops={"float32": 1.25e11, "bfloat16": 3e11}, memory_bandwidth=2e10, seconds=0.5
    )


@pytest.fixture
def counted_benchmark(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Enable calibration and replace the benchmark with a counting fake."""
    monkeypatch.delenv(host_cache.NO_CALIBRATE_ENV)
    calls: list[int] = []

    def fake(time_budget_s: float = 1.2) -> CpuBenchmarkResult:
        calls.append(1)
        return _fake_result()

    monkeypatch.setattr(cpu_calibration, "run_cpu_benchmark", fake)
    return calls


def test_cpu_calibration_runs_once_and_is_cached(counted_benchmark: list[int], _isolated_cache: Path) -> None:
    first = get_device("cpu")
    assert len(counted_benchmark) == 1
    assert first.peak_flops == {"float32": 1.25e11, "bfloat16": 3e11}
    assert first.memory_bandwidth == 2e10
    assert first.memory_bytes == host_cache.host_memory_bytes()
    assert first.intra_node_link == STATIC_CPU_SPEC.intra_node_link
    assert get_device("cpu") is first  # in-process memo
    assert len(counted_benchmark) == 1

    cpu_calibration.clear_cpu_calibration_memo()
    assert get_device("cpu") == first  # from disk this time
    assert len(counted_benchmark) == 1

    data = json.loads((_isolated_cache / cpu_calibration.CPU_CACHE_FILENAME).read_text())
    (key,) = data["entries"]
    assert key == cpu_calibration.cpu_cache_key()
    assert f"threads={torch.get_num_threads()}" in key and torch.__version__ in key

    cpu_calibration.cpu_device_spec(force=True)
    assert len(counted_benchmark) == 2


def test_cpu_calibration_key_includes_thread_count(
    counted_benchmark: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    get_device("cpu")
    monkeypatch.setattr(torch, "get_num_threads", lambda: 977)
    get_device("cpu")
    assert len(counted_benchmark) == 2


def test_no_calibrate_env_is_respected(counted_benchmark: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(host_cache.NO_CALIBRATE_ENV, "1")
    assert get_device("cpu") == STATIC_CPU_SPEC
    assert counted_benchmark == []
    monkeypatch.setenv(host_cache.NO_CALIBRATE_ENV, "0")  # "0" means calibrate
    assert get_device("cpu") != STATIC_CPU_SPEC
    assert len(counted_benchmark) == 1


def test_corrupt_cache_is_recalibrated(counted_benchmark: list[int], _isolated_cache: Path) -> None:
    _isolated_cache.mkdir(parents=True)
    (_isolated_cache / cpu_calibration.CPU_CACHE_FILENAME).write_text("{not json")
    assert get_device("cpu").memory_bandwidth == 2e10
    assert len(counted_benchmark) == 1
    assert json.loads((_isolated_cache / cpu_calibration.CPU_CACHE_FILENAME).read_text())["format"] == 1


def test_unwritable_cache_still_returns_spec(
    counted_benchmark: list[int],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv(host_cache.CACHE_ENV, str(blocker))  # a file where a directory should be
    assert get_device("cpu").memory_bandwidth == 2e10
    assert "Could not write calibration cache" in caplog.text


def test_every_cache_is_keyed_by_the_one_scheme(_isolated_cache: Path) -> None:
    """The cpu preset, the comm link fit and the job cache all key on host_cache.cache_key: the device, torch's
    threads and version first, then their own facts; entry files merge, and another format reads as empty."""
    import hashlib

    from hf_colossal_auto.calibration import job
    from hf_colossal_auto.hardware.comm import CommCalibration

    host = host_cache.cache_key("cpu")
    assert f"threads={torch.get_num_threads()}" in host and torch.__version__ in host
    assert cpu_calibration.cpu_cache_key() == f"{host}|bench={cpu_calibration.CPU_BENCHMARK_VERSION}"
    comm = CommCalibration._key("gloo", 2, (0, 1), torch.device("cpu"), (4, 8))
    assert comm == f"{host}|backend=gloo|ranks=0,1|sizes=4,8|world=2"
    digest = hashlib.sha1(host_cache.cache_key("cpu", local=1, world=1).encode()).hexdigest()[:16]
    assert job.calibration_cache_path("cpu").name == f"cluster-{digest}.json"

    path = _isolated_cache / "entries.json"
    host_cache.store_entry(path, "a", {"x": 1}, 7)
    host_cache.store_entry(path, "b", {"x": 2}, 7)
    assert host_cache.read_entries(path, 7) == {"a": {"x": 1}, "b": {"x": 2}}
    assert host_cache.read_entries(path, 8) == {}


def test_cpu_without_a_provider_is_the_static_spec(counted_benchmark: list[int]) -> None:
    """hardware/ measures nothing itself: without calibration's provider "cpu" is the static template."""
    from hf_colossal_auto.hardware.catalog import set_cpu_spec_provider

    set_cpu_spec_provider(None)
    try:
        assert get_device("cpu") == STATIC_CPU_SPEC and counted_benchmark == []
    finally:
        set_cpu_spec_provider(cpu_calibration.cpu_device_spec)
    assert get_device("cpu") != STATIC_CPU_SPEC and len(counted_benchmark) == 1


def test_real_cpu_benchmark_is_sane() -> None:
    """Rates measured, positive and finite (how long it took is recorded, not asserted: a loaded machine is
    slower, and speed targets live in the benchmarks)."""
    result = cpu_calibration.run_cpu_benchmark(time_budget_s=0.4)
    assert "float32" in result.peak_flops
    assert all(v > 0 and math.isfinite(v) for v in result.peak_flops.values())
    assert result.memory_bandwidth > 0
    assert result.seconds > 0


def test_benchmark_leaves_global_rng_alone() -> None:
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    cpu_calibration.run_cpu_benchmark(time_budget_s=0.1)
    assert torch.equal(torch.rand(3), expected)


# --------------------------------------------------------------------------- roofline


def test_roofline_compute_bound_matmul() -> None:
    a100 = get_device("a100-80gb")
    n = 4096
    flops = 2.0 * n**3
    nbytes = 3.0 * n * n * 2
    assert is_compute_bound(flops, nbytes, "bfloat16", a100)
    assert op_time(flops, nbytes, "bfloat16", a100) == pytest.approx(flops / 312e12 + 5e-6)


def test_roofline_memory_bound_elementwise() -> None:
    h100 = get_device("h100-80gb")
    nbytes = 3 * 2**28 * 2.0  # a + b -> c over 2**28 bf16 elements
    flops = 2.0**28
    assert not is_compute_bound(flops, nbytes, "bfloat16", h100)
    assert op_time(flops, nbytes, "bfloat16", h100) == pytest.approx(nbytes / 3350e9 + 5e-6)


def test_roofline_ridge_point_is_the_crossover() -> None:
    a100 = get_device("a100-40gb")
    ridge = ridge_intensity("bfloat16", a100)
    assert ridge == pytest.approx(312e12 / 1555e9)
    nbytes = 1e9
    assert is_compute_bound(nbytes * ridge * 1.01, nbytes, "bfloat16", a100)
    assert not is_compute_bound(nbytes * ridge * 0.99, nbytes, "bfloat16", a100)


def test_roofline_dtype_aliases_and_fallbacks() -> None:
    a100 = get_device("a100-80gb")
    for spelling in ("bfloat16", "bf16", "BF16", torch.bfloat16, "torch.bfloat16"):
        assert peak_flops_for(spelling, a100) == 312e12
    for spelling in ("float16", "fp16", "half", torch.float16):
        assert peak_flops_for(spelling, a100) == 312e12
    for spelling in ("float32", "fp32", torch.float32, "tf32-nope", "float64", torch.int64, "complex64"):
        assert peak_flops_for(spelling, a100) == 19.5e12
    assert peak_flops_for("tf32", a100) == 156e12
    # Volta has no bf16 tensor cores: falls back to fp32 rather than crashing.
    assert peak_flops_for(torch.bfloat16, get_device("v100")) == 15.7e12
    assert compute_time(15.7e12, "bfloat16", get_device("v100")) == pytest.approx(1.0)


def test_roofline_zero_and_negative_work() -> None:
    spec = get_device("l4")
    assert op_time(0, 0, "float32", spec) == 0.0
    assert op_time(0, 1, "float32", spec) == pytest.approx(1 / 300e9 + 5e-6)
    with pytest.raises(ValueError):
        op_time(-1, 0, "float32", spec)


# --------------------------------------------------------------------------- cluster


def test_mesh_shapes_order() -> None:
    assert mesh_shapes(8) == [(8,), (1, 8), (2, 4), (4, 2), (8, 1)]
    assert mesh_shapes(1) == [(1,), (1, 1)]
    assert mesh_shapes(12) == [(12,), (1, 12), (2, 6), (3, 4), (4, 3), (6, 2), (12, 1)]
    assert mesh_shapes(7) == [(7,), (1, 7), (7, 1)]
    with pytest.raises(ValueError):
        mesh_shapes(0)
    assert ClusterSpec(get_device("a100"), 8).mesh_shapes() == mesh_shapes(8)


def test_axis_link_16_devices_8_per_node() -> None:
    a100 = get_device("a100-80gb")
    cluster = ClusterSpec(a100, 16)
    intra, inter = a100.intra_node_link, a100.inter_node_link
    assert cluster.devices_per_node == 8 and cluster.num_nodes == 2
    assert cluster.axis_link((2, 8), 1) == intra
    assert cluster.axis_link((2, 8), 0) == inter
    assert cluster.axis_link((4, 4), 1) == intra
    assert cluster.axis_link((4, 4), 0) == inter
    assert cluster.axis_link((16,), 0) == inter
    assert cluster.axis_link((8, 2), 1) == intra
    assert cluster.axis_link((8, 2), 0) == inter
    assert cluster.axis_link((1, 16), 1) == inter
    assert cluster.axis_link((16, 1), 0) == inter
    assert cluster.axis_link((4, 4), -1) == intra
    # 3-D: (nodes, 2, 4): the last two axes stay inside a node.
    assert cluster.axis_link((2, 2, 4), 2) == intra
    assert cluster.axis_link((2, 2, 4), 1) == intra
    assert cluster.axis_link((2, 2, 4), 0) == inter


def test_axis_link_single_node_is_always_intra() -> None:
    cluster = ClusterSpec(get_device("h100"), 4)
    assert cluster.devices_per_node == 4  # capped at num_devices
    for shape in cluster.mesh_shapes():
        for axis in range(len(shape)):
            assert cluster.axis_link(shape, axis) == get_device("h100").intra_node_link


def test_axis_link_uneven_groups_use_the_slow_link() -> None:
    # 12 devices, 4 per node; mesh (2, 6): the row [0..5] straddles nodes 0 and 1.
    cluster = ClusterSpec(get_device("a100"), 12, devices_per_node=4)
    assert cluster.axis_link((2, 6), 1) == get_device("a100").inter_node_link
    assert cluster.axis_link((6, 2), 1) == get_device("a100").intra_node_link


def test_cluster_validation() -> None:
    a100 = get_device("a100")
    with pytest.raises(ValueError, match="multiple"):
        ClusterSpec(a100, 12)
    with pytest.raises(ValueError, match="num_devices"):
        ClusterSpec(a100, 0)
    with pytest.raises(ValueError, match="has 8 devices"):
        ClusterSpec(a100, 16).axis_link((2, 4), 0)
    with pytest.raises(ValueError, match="out of range"):
        ClusterSpec(a100, 16).axis_link((2, 8), 2)
    assert ClusterSpec(a100, 16, devices_per_node=2).num_nodes == 8


def test_cluster_collective_time_uses_axis_link() -> None:
    from hf_colossal_auto.hardware import collective_time

    a100 = get_device("a100")
    cluster = ClusterSpec(a100, 16)
    nbytes = 1 << 30
    assert cluster.collective_time("all_reduce", nbytes, (2, 8), 1) == collective_time(
        "all_reduce", nbytes, 8, a100.intra_node_link
    )
    assert cluster.collective_time("all_reduce", nbytes, (2, 8), 0) == collective_time(
        "all_reduce", nbytes, 2, a100.inter_node_link
    )
    # TP inside the node must be cheaper than the same TP degree across nodes.
    assert cluster.collective_time("all_reduce", nbytes, (8, 2), 1) < cluster.collective_time(
        "all_reduce", nbytes, (2, 8), 0
    )


def test_nodes_come_from_the_launcher(monkeypatch) -> None:
    """torchrun and accelerate launch set LOCAL_WORLD_SIZE on every process: 16 processes, 8 a node, is 2 nodes;
    nothing set, or a figure that cannot split the job, leaves the device preset's own."""
    from hf_colossal_auto.hardware.cluster import launcher_devices_per_node

    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert launcher_devices_per_node(16) is None
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert launcher_devices_per_node(16) == 8
    assert launcher_devices_per_node(12) is None  # 12 processes cannot be nodes of 8
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "eight")
    assert launcher_devices_per_node(16) is None
