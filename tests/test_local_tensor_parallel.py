"""Megatron's tensor parallelism on local shards, the planner side (:mod:`hf_colossal_auto.solve.local_tensor_parallel`).

* which attention / MLP modules qualify, by data flow: tiny-llama's all; GPT-2's attention never (``c_attn``
  split by the global width), its MLP only with dropout off; Mixtral's experts never;
* pricing: the ops inside cost the host an eager op's seconds instead of DTensor's, exactly ``(ops inside) x
  dtensor_overhead_s`` less on a host-bound spec, with the same collectives as the same placements on DTensors;
* where it is used: ``plan_model`` keeps the faster of the two per tensor-parallel candidate (the local one on a
  host-bound spec, the DTensor one on a tie when DTensor's dispatch costs nothing), the ``"megatron-local"`` hand
  layout priced again as it was made (also inside pipeline stages).
"""

from __future__ import annotations

import dataclasses

import pytest
from torch import nn

from hf_colossal_auto.hardware import get_device
from hf_colossal_auto.models import build_model, make_example_inputs
from hf_colossal_auto.plan import Plan
from hf_colossal_auto.solve.build.names import NodeKind
from hf_colossal_auto.solve.candidates import _Planner
from hf_colossal_auto.solve.ilp import solve
from hf_colossal_auto.solve.planner import evaluate_plan, plan_model
from hf_colossal_auto.solve.problem import evaluate

MESH = (1, 2)
SPEC = get_device("h100")
"""A GPU target: the attention kernel DTensor has rules for, and the host's per-op cost above the device's for
tiny models (every block's host stream exposed)."""


def _inputs(model: nn.Module) -> dict:
    return make_example_inputs(model, 2, 32, device="meta")


def _layout(name: str, dropout: bool = True):
    model = build_model(name)
    if not dropout:
        for module in model.modules():
            if isinstance(module, nn.Dropout):
                module.p = 0.0
    planner = _Planner.for_devices(model, _inputs(model), 2, SPEC, None, None, None, "adamw", 60.0)
    return planner.local_layout(*MESH), model


def test_llama_attention_and_mlp_run_locally():
    layout, model = _layout("tiny-llama")
    blocks = [f"model.layers.{i}" for i in range(model.config.num_hidden_layers)]
    assert list(layout.modules) == sorted(f"{b}.{m}" for b in blocks for m in ("self_attn", "mlp"))
    assert not layout.refused
    assert layout.params["model.layers.0.self_attn.q_proj.weight"] == "S0"
    assert layout.params["model.layers.0.self_attn.o_proj.weight"] == "S1"
    assert layout.params["model.layers.1.mlp.down_proj.weight"] == "S1"
    # every pinned op keeps one strategy, and the row-parallel outputs leave as partial sums
    assert layout.nodes and all(len(s) == 1 for s in layout.pins.values())


def test_gpt2_attention_refused_mlp_only_without_dropout():
    layout, _ = _layout("tiny-gpt2")
    assert not layout.modules
    assert all("dropout" in why for why in layout.refused.values())
    layout, _ = _layout("tiny-gpt2", dropout=False)
    assert list(layout.modules) == ["transformer.h.0.mlp", "transformer.h.1.mlp"]
    assert set(layout.refused) == {"transformer.h.0.attn", "transformer.h.1.attn"}
    assert all("split" in why for why in layout.refused.values())  # c_attn split by the global width


def test_mixtral_experts_refused():
    layout, _ = _layout("tiny-mixtral")
    assert layout.modules == ("model.layers.0.self_attn", "model.layers.1.self_attn")
    assert set(layout.refused) == {"model.layers.0.mlp", "model.layers.1.mlp"}
    assert all("experts" in why for why in layout.refused.values())


def test_local_pricing_saves_dtensor_dispatch_with_the_same_collectives():
    """The same placements and strategies priced on DTensors and on local shards, at one choice: the step differs
    by DTensor's per-op cost on every op inside the modules (forward and its backward ops), the collectives not at
    all (local execution moves what DTensor would on those placements)."""
    model = build_model("tiny-llama")
    planner = _Planner.for_devices(model, _inputs(model), 2, SPEC, None, None, None, "adamw", 60.0)
    layout = planner.local_layout(*MESH)
    local = planner.build(MESH, "ddp", recompute_pin="none", local=True)
    same = planner.build(
        MESH,
        "ddp",
        fixed_params=planner._local_parts(*MESH, 1)[2],
        recompute_pin="none",
        strategy_pins=layout.pins,
    )
    solution = solve(local.problem, time_limit_s=60)
    choice = solution.choice
    dtensor_s, _, feasible = evaluate(same.problem, choice)
    assert feasible
    problem = local.problem
    # host-bound: every block's host stream exceeds its device seconds, so the host's seconds are the step's
    streams = [o for o in problem.overlaps if o.name.startswith("host-stream")]
    assert streams and all(o.exposed(problem, choice) > 0 for o in streams)
    ops_inside = sum(
        n.multiplicity * (1.0 + local.backward_ratios.of(local.block_of[n.name])[1])
        for n in problem.nodes
        if n.kind == NodeKind.OP and local.node_of_name[n.name] in layout.nodes
    )
    assert dtensor_s - solution.objective_s == pytest.approx(ops_inside * SPEC.dtensor_overhead_s, rel=1e-9)
    local_plan = planner.to_plan(MESH, "ddp", local, solution)
    dtensor_plan = planner.to_plan(MESH, "ddp", same, dataclasses.replace(solution, objective_s=dtensor_s))
    assert local_plan.local_modules == list(layout.modules) and not dtensor_plan.local_modules
    assert local_plan.collectives == dtensor_plan.collectives and local_plan.collectives.get("all_reduce")
    assert local_plan.collective_bytes == dtensor_plan.collective_bytes
    assert dtensor_plan.compute_time_s - local_plan.compute_time_s == pytest.approx(
        ops_inside * SPEC.dtensor_overhead_s, rel=1e-9
    )


def test_auto_plan_runs_locally_where_dispatch_costs():
    model = build_model("tiny-llama")
    plan = plan_model(model, _inputs(model), num_devices=2, device=SPEC, mesh_shape=MESH)
    assert plan.local_modules == list(_layout("tiny-llama")[0].modules)


def test_auto_plan_keeps_dtensor_on_a_tie():
    """With DTensor's dispatch free, local execution only pins a layout the free ILP could choose too: it is never
    faster, and on a tie the DTensor plan is kept."""
    spec = SPEC.with_overrides(dtensor_overhead_s=0.0)
    model = build_model("tiny-llama")
    plan = plan_model(model, _inputs(model), num_devices=2, device=spec, mesh_shape=MESH)
    assert plan.local_modules == []
    planner = _Planner.for_devices(model, _inputs(model), 2, spec, None, None, None, "adamw", 60.0)
    local = solve(planner.build(MESH, "ddp", local=True).problem, time_limit_s=60)
    assert local.objective_s >= plan.step_time_s - 1e-12


def test_megatron_local_round_trip():
    model = build_model("tiny-llama")
    inputs = _inputs(model)
    estimate = evaluate_plan(model, inputs, "megatron-local", num_devices=2, device=SPEC)
    plan = estimate.plan
    assert plan.hand_layout == "megatron-local" and plan.local_modules
    on_dtensors = evaluate_plan(model, inputs, "megatron", num_devices=2, device=SPEC)
    assert estimate.step_time_s < on_dtensors.step_time_s and not on_dtensors.plan.local_modules
    again = Plan.from_dict(plan.to_dict())
    assert again.hand_layout == "megatron-local" and again.local_modules == plan.local_modules
    repriced = evaluate_plan(model, inputs, again, num_devices=2, device=SPEC)
    assert repriced.plan.local_modules == plan.local_modules
    assert repriced.step_time_s == pytest.approx(estimate.step_time_s, rel=1e-9)


def test_megatron_local_refused_without_a_qualifying_module():
    model = build_model("tiny-gpt2")  # dropout on: every candidate draws per rank
    with pytest.raises(ValueError, match="dropout"):
        evaluate_plan(model, _inputs(model), "megatron-local", num_devices=2, device=SPEC)


def test_megatron_local_inside_pipeline_stages():
    model = build_model("tiny-llama")
    inputs = make_example_inputs(model, 4, 32, device="meta")
    kwargs = dict(num_devices=4, device=SPEC, pipeline=2, mesh_shape=MESH, micro_batches=2)
    local = evaluate_plan(model, inputs, "megatron-local", **kwargs)
    plain = evaluate_plan(model, inputs, "megatron", **kwargs)
    assert local.plan.local_modules and not plain.plan.local_modules
    assert local.step_time_s < plain.step_time_s
    repriced = evaluate_plan(model, inputs, local.plan, num_devices=4, device=SPEC)
    assert repriced.plan.local_modules == local.plan.local_modules
    assert repriced.step_time_s == pytest.approx(local.step_time_s, rel=1e-9)
