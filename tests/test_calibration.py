"""Calibration: the device JSON's schema and round trip, per-kind collective fits, and the per-op host model."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from hf_colossal_auto.hardware import LinkSpec, collective_time, get_device
from hf_colossal_auto.hardware.catalog import (
    STATIC_CPU_SPEC,
    device_from_dict,
    load_device_spec,
    save_device_spec,
)
from hf_colossal_auto.hardware.roofline import kernel_time, step_op_time


def test_link_collectives_round_trip_and_pricing():
    link = LinkSpec(2e9, 50e-6, collectives={"all_gather": (0.5e9, 1e-3)})
    assert LinkSpec.from_dict(json.loads(json.dumps(link.to_dict()))) == link
    # the measured kind uses its own fit, the others the link's
    assert collective_time("all_gather", 1e6, 2, link) == pytest.approx(1e-3 + 0.5 * 1e6 / 0.5e9)
    assert collective_time("all_reduce", 1e6, 2, link) == pytest.approx(2 * 50e-6 + 1e6 / 2e9)
    assert collective_time("allgather", 1e6, 2, link) == collective_time("all_gather", 1e6, 2, link)
    with pytest.raises(ValueError):
        LinkSpec(2e9, 50e-6, collectives={"all_gather": (0.0, 1e-3)})
    with pytest.raises(ValueError):
        LinkSpec.from_dict({"bandwidth": 1, "latency": 0, "typo": 1})


def test_device_spec_json_round_trip(tmp_path):
    spec = STATIC_CPU_SPEC.with_overrides(
        host_overhead_s=20e-6,
        dtensor_overhead_s=90e-6,
        attention_flops={"float32": 40e9},
        intra_node_link=LinkSpec(1e9, 1e-3, collectives={"reduce_scatter": (0.3e9, 1e-3)}),
        calibration={"host": "test", "command": "pytest"},
    )
    path = tmp_path / "cluster.json"
    save_device_spec(spec, path)
    loaded = get_device(str(path))
    assert loaded == spec
    assert loaded.calibration["command"] == "pytest"
    assert loaded.intra_node_link.for_collective("reduce_scatter") == (0.3e9, 1e-3)
    # older files without the new keys still load, with the defaults
    data = json.loads(path.read_text())
    for key in ("host_overhead_s", "dtensor_overhead_s", "attention_flops", "calibration"):
        del data[key]
    assert device_from_dict(data).host_overhead_s == STATIC_CPU_SPEC.host_overhead_s


def test_device_spec_file_errors_name_the_file(tmp_path):
    with pytest.raises(ValueError, match="calibrate"):
        get_device(str(tmp_path / "missing.json"))
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2]")
    with pytest.raises(ValueError, match="bad.json"):
        load_device_spec(bad)
    bad.write_text(json.dumps({"name": "x"}))
    with pytest.raises(ValueError, match="missing keys"):
        load_device_spec(bad)
    with pytest.raises(ValueError, match="dtensor_overhead_s"):
        STATIC_CPU_SPEC.with_overrides(dtensor_overhead_s=-1.0)


def test_step_op_time_adds_host_on_cpu_and_takes_the_longer_on_gpu():
    cpu = STATIC_CPU_SPEC.with_overrides(host_overhead_s=10e-6, dtensor_overhead_s=50e-6)
    device = kernel_time(1e6, 1e6, "float32", cpu)
    assert step_op_time(1e6, 1e6, "float32", cpu) == pytest.approx(device + 10e-6)
    assert step_op_time(1e6, 1e6, "float32", cpu, dtensor=True) == pytest.approx(device + 60e-6)
    assert step_op_time(0, 0, "float32", cpu, view=True) == pytest.approx(10e-6)  # a view costs the host

    gpu = get_device("h100").with_overrides(host_overhead_s=10e-6, dtensor_overhead_s=50e-6)
    big = kernel_time(1e12, 1e9, "bfloat16", gpu)
    assert step_op_time(1e12, 1e9, "bfloat16", gpu, dtensor=True) == pytest.approx(big)  # device-bound
    assert step_op_time(10, 10, "bfloat16", gpu) == pytest.approx(10e-6)  # host-bound
    assert step_op_time(10, 10, "bfloat16", gpu, dtensor=True) == pytest.approx(60e-6)
    assert step_op_time(0, 0, "bfloat16", gpu, view=True) == 0.0  # hides behind the device


def test_attention_kernels_run_at_the_calibrated_rate():
    spec = STATIC_CPU_SPEC.with_overrides(
        attention_flops={"float32": STATIC_CPU_SPEC.peak_flops["float32"] / 4}
    )
    flops = 1e10
    assert kernel_time(flops, 0, "float32", spec, attention=True) == pytest.approx(
        4 * kernel_time(flops, 0, "float32", spec) - 3 * spec.kernel_overhead_s
    )


@pytest.mark.slow
def test_calibrate_cli_writes_a_spec_every_entry_point_reads(tmp_path):
    """One process: kernels and per-op overheads measured (no collectives: one rank), written, read back."""
    out = tmp_path / "cpu.json"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "hf_colossal_auto.cli",
            "calibrate",
            "--kind",
            "cpu",
            "--budget",
            "0.1",
            "--out",
            str(out),
        ],
        check=True,
        capture_output=True,
        env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
        timeout=300,
    )
    spec = get_device(str(out))
    assert spec.kind == "cpu" and spec.name == "cpu"
    assert spec.peak_flops["float32"] > 1e9 and spec.memory_bandwidth > 1e8
    assert spec.attention_flops["float32"] > 1e8
    # a planned (DTensor) step costs the host more per op than an eager one, and both cost something
    assert 0 < spec.host_overhead_s < spec.dtensor_overhead_s < 1e-2
    assert spec.calibration["threads"] == 1 and spec.calibration["world_size"] == 1
    assert "calibrate" in spec.calibration["command"]


def test_planned_step_time_carries_the_per_op_overheads():
    """A tensor-parallel plan's predicted time grows by the DTensor overhead once per op of the step (its ops
    run on DTensors), a one-device plan's not at all (it shards nothing: ordinary tensors), and full recompute
    (which reruns the forward) is predicted slower than none."""
    from hf_colossal_auto.capture.tracer import trace_training_step
    from hf_colossal_auto.models import build_model, make_example_inputs
    from hf_colossal_auto.solve.planner import evaluate_plan, plan_model

    model = build_model("tiny-llama", device="meta")
    batch = make_example_inputs(model, 2, 16, device="meta")
    ops = sum(trace_training_step(model, batch).repeat_of_node())
    base = STATIC_CPU_SPEC.with_overrides(dtensor_overhead_s=50e-6)
    more = base.with_overrides(dtensor_overhead_s=150e-6)

    def megatron(spec) -> float:
        return evaluate_plan(
            model, batch, "megatron", num_devices=2, device=spec, mesh_shape=(1, 2)
        ).step_time_s

    assert megatron(more) - megatron(base) == pytest.approx(100e-6 * ops, rel=0.05)
    t_one = plan_model(model, batch, num_devices=1, device=base).step_time_s
    assert plan_model(model, batch, num_devices=1, device=more).step_time_s == t_one
    full = plan_model(model, batch, num_devices=1, device=base, recompute="full").step_time_s
    assert full > t_one


def test_elementwise_math_is_bound_by_its_rate_not_bandwidth():
    """exp/tanh/softmax-class ops: FlopCounterMode counts no FLOPs for them, but a CPU core evaluates only so
    many a second; an add of the same size stays bandwidth-bound."""
    from hf_colossal_auto.capture.op_classes import is_transcendental

    spec = STATIC_CPU_SPEC.with_overrides(transcendental_rate=1e9, memory_bandwidth=100e9)
    elements, nbytes = 1e7, 8e7
    assert kernel_time(0, nbytes, "float32", spec, transcendental_elements=elements) == pytest.approx(
        elements / 1e9 + spec.kernel_overhead_s
    )
    assert kernel_time(0, nbytes, "float32", spec) == pytest.approx(nbytes / 100e9 + spec.kernel_overhead_s)
    assert is_transcendental("aten._log_softmax_backward_data.default") and is_transcendental(
        "aten.silu.default"
    )
    assert not is_transcendental("aten.add.Tensor") and not is_transcendental("aten.mm.default")
    unbounded = spec.with_overrides(transcendental_rate=None)
    assert kernel_time(0, nbytes, "float32", unbounded, transcendental_elements=elements) == pytest.approx(
        nbytes / 100e9 + spec.kernel_overhead_s
    )


def test_data_parallel_sync_hides_behind_backward_as_the_device_allows():
    """A DDP plan priced with no overlap pays its all-reduces in full; with a perfect one it is never cheaper
    than its compute alone nor than its communication alone (``max(compute, comm)``); a partial overlap lands
    in between."""
    from hf_colossal_auto.models import build_model, make_example_inputs
    from hf_colossal_auto.solve.planner import evaluate_plan

    model = build_model("tiny-llama", device="meta")
    batch = make_example_inputs(model, 4, 32, device="meta")
    slow_link = LinkSpec(5e7, 1e-3)  # make the gradient all-reduce comparable to the step's compute
    steps = {}
    for efficiency in (0.0, 0.5, 1.0):
        spec = STATIC_CPU_SPEC.with_overrides(
            overlap_efficiency=efficiency, intra_node_link=slow_link, inter_node_link=slow_link
        )
        plan = evaluate_plan(model, batch, "ddp", num_devices=2, device=spec).plan
        steps[efficiency] = plan
        exposed, hidden = plan.communication_time_s, plan.overlapped_communication_s
        assert exposed >= 0 and hidden >= 0
        if efficiency == 0.0:
            assert hidden == pytest.approx(0.0, abs=1e-12)
    serial, half, perfect = steps[0.0], steps[0.5], steps[1.0]
    total_comm = serial.communication_time_s
    assert perfect.step_time_s < half.step_time_s < serial.step_time_s
    assert perfect.step_time_s >= max(perfect.compute_time_s, total_comm) * (1 - 1e-9)
    assert half.communication_time_s >= 0.5 * total_comm * (1 - 1e-9)


def test_gemm_curve_is_the_median_of_interleaved_rounds_each_started_together(monkeypatch):
    """Each size of the GEMM curve is timed once a round, the rounds interleaved and each point their median
    (a drifting machine moves one round, not one size); ``sync`` (the job's barrier) runs before every timing,
    so that the ranks time the same GEMM at once, as a training step's ranks compute at once."""
    from hf_colossal_auto.hardware import microbench

    events: list[object] = []
    rates = iter([10.0, 20.0, 30.0, 40.0, 99.0, 21.0, 31.0, 41.0, 11.0, 22.0, 5.0, 42.0])

    def fake_rate(device, dtype, *, budget_s, scale):
        events.append(scale)
        return next(rates)

    monkeypatch.setattr(microbench, "matmul_rate", fake_rate)
    curve = microbench.matmul_curve("cpu", torch.float32, rounds=3, sync=lambda: events.append("sync"))
    scales = list(microbench.CURVE_SCALES)
    assert events == ["sync", scales[0], "sync", scales[1], "sync", scales[2], "sync", scales[3]] * 3
    assert [rate for _, rate in curve] == [11.0, 21.0, 30.0, 41.0]
    assert [flops for flops, _ in curve] == sorted(flops for flops, _ in curve)


def test_every_rank_takes_rank_0s_path_through_the_kernel_benchmarks(monkeypatch):
    """Whether bf16 is emulated is read off a timing, which differs between ranks: each rank deciding for itself
    once left one rank at a barrier the other had skipped (a hung calibration). With ``ranks`` the verdict is
    rank 0's, so a rank whose own probe says "emulated" still runs rank 0's benchmarks and barriers."""
    from hf_colossal_auto.calibration import kernels

    monkeypatch.setattr(kernels, "matmul_rate", lambda *a, **k: 100.0)
    monkeypatch.setattr(kernels, "matmul_curve", lambda *a, sync=None, **k: (sync(), ((1.0, 100.0),))[1])
    monkeypatch.setattr(kernels, "elementwise_bandwidth", lambda *a, **k: 1.0)
    monkeypatch.setattr(kernels, "transcendental_rate", lambda *a, **k: 1.0)
    monkeypatch.setattr(kernels, "attention_rate", lambda *a, **k: 50.0)

    def run(probe: float, rank0_says_emulated: bool) -> tuple[int, kernels.KernelRates]:
        starts = []
        monkeypatch.setattr(kernels, "_square_probe", lambda *a: probe)
        ranks = kernels.RankSync(start=lambda: starts.append(1), agree=lambda flag: rank0_says_emulated)
        dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16}
        rates = kernels.measure_kernels("cpu", dtypes, nbytes=1024, elementwise_math=True, ranks=ranks)
        return len(starts), rates

    fused, fused_rates = run(probe=90.0, rank0_says_emulated=False)
    slow_here, slow_rates = run(probe=1.0, rank0_says_emulated=False)  # this rank's probe was unlucky
    assert slow_here == fused and slow_rates == fused_rates
    assert set(fused_rates.attention_flops) == {"float32", "bfloat16"}
    emulated, emulated_rates = run(probe=90.0, rank0_says_emulated=True)
    assert emulated < fused and set(emulated_rates.attention_flops) == {"float32"}
    assert emulated_rates.peak_flops["bfloat16"] == 90.0
