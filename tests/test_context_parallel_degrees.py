"""The walk over cp degrees (``solve/context_parallel_degrees.py``) prunes against the fastest plan found so far and
still returns what the exhaustive walk returns: the same plan (every field but what the search recorded of what it
tried) and the same step time, on a tiny Llama (a later degree wins, earlier ones pruned) and on Llama-3-8B at
131,072 tokens on 8 H100 (a golden made by the exhaustive walk). The bounds it prunes by hold: what every plan gets
after its solve (``fixed_added_s``) is no more than what a plan got, and the parameter floors read off the step
without cp are those of the degree's own step. Symbolic (meta models, no processes)."""

from __future__ import annotations

import functools
import json
import math
import os
from pathlib import Path
from typing import Any

import pytest

import hf_colossal_auto.solve.planner as planner_module
from hf_colossal_auto.hardware import get_device
from hf_colossal_auto.hardware.catalog import memory_budget_default
from hf_colossal_auto.models import build_model, load_config, make_example_inputs
from hf_colossal_auto.solve.candidates import _Planner
from hf_colossal_auto.solve.context_parallel_degrees import with_context_parallel
from hf_colossal_auto.solve.context_parallel_search import ContextParallelPlanner
from hf_colossal_auto.solve.search import _accumulation_floor, _model_state_floor

GOLDEN = Path(__file__).parent / "goldens" / "context_parallel_131k.json"
REGENERATE = os.environ.get("HF_COLOSSAL_AUTO_REGEN_GOLDENS") == "1"
DEVICE = "h100-80gb"


def _llama(max_positions: int):
    config = load_config("tiny-llama")
    config.max_position_embeddings = max_positions
    return build_model(config, device="meta")


def _plan(model, inputs, exhaustive: bool, monkeypatch: pytest.MonkeyPatch, **kwargs: Any):
    """``plan_model(context_parallel=None)`` with the cp walk exhaustive (every degree in full, nothing to beat)
    or pruned (the default)."""
    monkeypatch.setattr(
        planner_module,
        "with_context_parallel",
        functools.partial(with_context_parallel, exhaustive=exhaustive),
    )
    return planner_module.plan_model(model, inputs, context_parallel=None, mixed_precision="bf16", **kwargs)


def _chosen(plan) -> dict[str, Any]:
    """A plan as it runs and is priced: every field of its JSON but what the search recorded about the other
    candidates (``solver``, ``alternatives``)."""
    out = plan.to_dict()
    for key in ("solver", "alternatives"):
        out.pop(key, None)
    return out


def test_pruned_walk_returns_the_exhaustive_plan(monkeypatch):
    """Tiny Llama, 1 x 512 tokens on 8 devices (4 per node): the exhaustive walk's fastest is cp 8, behind cp 2
    and cp 4; the pruned walk returns the same plan and step, records cp 4 as no faster than its bound (at least
    cp 8's step: it was pruned against cp 2's plan) and solves fewer candidates."""
    model = _llama(512)
    inputs = make_example_inputs(model, 1, 512, device="meta")
    common = dict(num_devices=8, device=DEVICE, devices_per_node=4)
    full = _plan(model, inputs, True, monkeypatch, **common)
    pruned = _plan(model, inputs, False, monkeypatch, **common)
    assert full.cp_size == 8  # a later degree wins: the walk must not stop at the first plan it finds
    assert pruned.step_time_s == full.step_time_s
    assert _chosen(pruned) == _chosen(full)
    degrees = pruned.solver["context_parallel_degrees"]
    skipped = [c for c, figures in degrees.items() if figures["fits"] is None]
    assert skipped, degrees
    for c in skipped:
        exhaustive = full.solver["context_parallel_degrees"][c]
        assert degrees[c]["min_step_time_s"] <= exhaustive.get("step_time_s", math.inf)
        assert degrees[c]["min_step_time_s"] >= full.step_time_s
    solved = sum(1 for t in pruned.alternatives if "step_time_s" in t)
    assert solved <= sum(1 for t in full.alternatives if "step_time_s" in t)


def test_fixed_added_is_a_floor_of_what_plans_get():
    """What the search adds to its bounds (the logits' all-gathers and the small all-reduces, whatever the choices)
    is positive and no more than what a cp plan was given after its solve; in k pieces it is no less than in one
    (the micro-batch bound relies on that)."""
    model = _llama(256)
    inputs = make_example_inputs(model, 2, 256, device="meta")
    plan = planner_module.plan_model(
        model,
        inputs,
        num_devices=2,
        device=DEVICE,
        mixed_precision="bf16",
        context_parallel=2,
        micro_batches=1,
    )
    outer = _Planner.for_devices(model, inputs, 2, DEVICE, None, None, "bf16", None, 30.0)
    cp = ContextParallelPlanner(outer, 2)
    mesh = (plan.mesh_shape[0] * 2, plan.mesh_shape[2])
    fixed = cp.fixed_added_s(mesh, 1)
    assert 0 < fixed <= plan.solver["context_parallel"]["added_after_solve_s"]
    assert cp.fixed_added_s(mesh, 2) >= fixed


def test_parameter_floors_read_off_the_step_without_cp():
    """Before a degree traces anything its floors come from the step the planner without cp traced, and equal
    those of the degree's own step (the chunking changes no parameter)."""
    model = _llama(256)
    inputs = make_example_inputs(model, 2, 256, device="meta")
    outer = _Planner.for_devices(model, inputs, 4, DEVICE, None, None, "bf16", None, 30.0)
    flat = outer.graph(1)
    cp = ContextParallelPlanner(outer, 2)
    assert cp.any_graph(2) is flat and cp._graphs.traced == 0
    own = cp.graph(2)
    assert cp.any_graph(2) is own
    for ranks in (1, 2, 4):
        assert _model_state_floor(flat, ranks) == _model_state_floor(own, ranks)
        assert _accumulation_floor(flat, 2, ranks) == _accumulation_floor(own, 2, ranks)
    assert flat.param_names == own.param_names and flat.param_bytes == own.param_bytes


@pytest.mark.slow
def test_llama3_8b_131k_on_8_is_the_exhaustive_plan(monkeypatch):
    """Llama-3-8B, 1 x 131,072 tokens on 8 H100 (``scripts/bench_context_parallel.py``): the pruned walk returns
    the plan the exhaustive walk returned when the golden was made (``HF_COLOSSAL_AUTO_REGEN_GOLDENS=1`` runs the
    exhaustive walk and rewrites it: needed when the cp pricing changes)."""
    spec = get_device(DEVICE)
    config = load_config("llama3-8b")
    config.max_position_embeddings = 131072
    model = build_model(config, device="meta")
    inputs = make_example_inputs(model, 1, 131072, device="meta")
    common = dict(num_devices=8, device=spec, devices_per_node=8, memory_budget=memory_budget_default(spec))
    plan = _plan(model, inputs, REGENERATE, monkeypatch, time_limit_s=60.0, **common)
    found = {
        "step_time_s": plan.step_time_s.hex(),
        "peak_memory_bytes": plan.peak_memory_bytes,
        "mesh": list(plan.mesh_shape),
        "dp_mode": plan.dp_mode,
        "micro_batches": plan.micro_batches,
        "recompute": sorted(set(plan.recompute.values())),
        "step_time": plan.step_time_s,
    }
    if REGENERATE:
        GOLDEN.write_text(json.dumps({"exhaustive": found}, indent=1) + "\n")
    assert found == json.loads(GOLDEN.read_text())["exhaustive"]
