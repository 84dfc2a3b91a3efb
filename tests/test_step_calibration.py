"""In-step calibration and in-place ops: what a real step's kernels cost, op kind by op kind.

No timed assertion: the properties are that the measured ops are the captured ops and that the scales are applied
wherever a kernel is priced. (That a spec carrying the scales reproduces the step they were measured on is true by
construction, scale = measured / predicted, and is not tested.)
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from hf_colossal_auto.calibration.op_scales import (
    MIN_CALL_SECONDS,
    MIN_OP_SECONDS,
    OpTimes,
    scales_from,
    time_step_ops,
)
from hf_colossal_auto.capture.graph import Phase
from hf_colossal_auto.capture.op_classes import op_base_name
from hf_colossal_auto.capture.tracer import trace_training_step
from hf_colossal_auto.hardware.catalog import STATIC_CPU_SPEC, device_from_dict
from hf_colossal_auto.hardware.roofline import kernel_time
from hf_colossal_auto.models import build_model, make_example_inputs
from hf_colossal_auto.profile.memory import unroll
from hf_colossal_auto.profile.profiler import node_kernel_time, node_times


def _gpt2(device: str = "cpu"):
    torch.manual_seed(0)
    model = build_model("tiny-gpt2", device=device)
    return model, make_example_inputs(model, 4, 64, device=device, seed=0)


def test_in_place_ops_cost_time_views_do_not():
    """Dropout's ``bernoulli_`` aliases its input like a view, yet runs a kernel over it: it moves its bytes and
    costs device time; a real view (``t``, ``view``) costs none."""
    model, batch = _gpt2("meta")
    graph = trace_training_step(model, batch)
    times = node_times(graph, STATIC_CPU_SPEC)
    dropout = [n for n in graph.nodes if op_base_name(n.op) == "bernoulli_"]
    views = [n for n in graph.nodes if op_base_name(n.op) in ("t", "view")]
    assert dropout and views
    for node in dropout:
        assert node.is_view and node.mutates and node.launches_kernel
        assert node.bytes_written == graph.values[node.outputs[0]].nbytes > 0
        assert node_kernel_time(graph, node, STATIC_CPU_SPEC) > STATIC_CPU_SPEC.kernel_overhead_s
        assert times[node.index] > node_kernel_time(graph, node, STATIC_CPU_SPEC)  # plus the host's share
    for node in views:
        assert not node.launches_kernel and node.bytes_read == node.bytes_written == 0
        assert node_kernel_time(graph, node, STATIC_CPU_SPEC) == 0.0


def test_op_time_scale_multiplies_the_roofline_of_its_op_only():
    spec = STATIC_CPU_SPEC.with_overrides(op_time_scale={"bernoulli_": 4.0})
    base = kernel_time(0, 8e6, "float32", STATIC_CPU_SPEC, op="aten.bernoulli_.float")
    scaled = kernel_time(0, 8e6, "float32", spec, op="aten.bernoulli_.float")
    assert scaled == pytest.approx(4.0 * base)
    assert kernel_time(0, 8e6, "float32", spec, op="aten.add.Tensor") == pytest.approx(base)
    assert kernel_time(0, 8e6, "float32", spec) == pytest.approx(base)  # no op named: unscaled


def test_op_time_scale_round_trips_and_rejects_nonsense():
    spec = STATIC_CPU_SPEC.with_overrides(op_time_scale={"mm": 1.25, "bernoulli_": 9.5})
    again = device_from_dict(spec.to_dict())
    assert again == spec and dict(again.op_time_scale) == {"mm": 1.25, "bernoulli_": 9.5}
    with pytest.raises(ValueError, match=r"op_time_scale\['mm'\]"):
        STATIC_CPU_SPEC.with_overrides(op_time_scale={"mm": 0.0})
    with pytest.raises(TypeError, match="read-only"):
        spec.op_time_scale["mm"] = 2.0  # type: ignore[index]


def test_scales_keep_only_op_kinds_with_enough_time_to_measure():
    measured = OpTimes(
        seconds={"mm": 0.5, "tiny_total": MIN_OP_SECONDS / 2, "tiny_calls": 0.01, "unpredicted": 0.1},
        calls={"mm": 10, "tiny_total": 1, "tiny_calls": int(0.01 / MIN_CALL_SECONDS) + 5, "unpredicted": 2},
    )
    predicted = {"mm": 0.4, "tiny_total": 1e-4, "tiny_calls": 1e-3}
    assert scales_from(measured, predicted) == {"mm": pytest.approx(1.25)}


def test_the_timed_ops_are_the_captured_ops():
    """The dispatch-level timer sees what the capture records: every GEMM and every dropout of the forward and
    backward passes, one call per captured node (so a scale compares like with like)."""
    model, batch = _gpt2()
    measured = time_step_ops(model, batch, steps=1, warmup=0)
    graph = trace_training_step(model, batch)
    captured = Counter(
        op_base_name(graph.nodes[i].op)
        for i in unroll(graph).order
        if graph.nodes[i].phase in (Phase.FORWARD, Phase.BACKWARD)
    )
    for kind in ("mm", "addmm", "bernoulli_", "_log_softmax", "_log_softmax_backward_data"):
        assert measured.calls.get(kind) == captured[kind] > 0, kind
    assert all(p.grad is None for p in model.parameters())  # the timed passes leave no gradients behind
