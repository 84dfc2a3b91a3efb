"""MoE routing load: a measured routing histogram (``capture.moe.RoutingLoad``) instead of uniform routing.

``measure_routing`` counts the rows each expert receives on one real batch; the planner prices an
expert-parallel grouped GEMM by its busiest rank's rows (time and the bytes of its rows), records the
assumption in the Plan, and refuses a histogram that is not the model's.
"""

from __future__ import annotations

import json

import pytest
import torch

from hf_colossal_auto import Plan, evaluate_plan, plan_model
from hf_colossal_auto.capture import Phase, trace_training_step
from hf_colossal_auto.capture.moe import (
    MEASURED_LOAD,
    UNIFORM_LOAD,
    RoutingLoad,
    busiest_rank_skew,
    measure_routing,
)
from hf_colossal_auto.hardware import ClusterSpec, get_device
from hf_colossal_auto.models import build_model, load_config, make_example_inputs
from hf_colossal_auto.solve.build import build_problem
from hf_colossal_auto.solve.ilp import solve
from hf_colossal_auto.solve.pricing.comm import AxisComm
from hf_colossal_auto.solve.pricing.compute import GROUPED_MM, is_expert_parallel
from hf_colossal_auto.strategies import enumerate_strategies

LAYERS = [f"model.layers.{i}.mlp.experts" for i in range(2)]


def _mixtral(device: str = "meta", layers: int = 2, **widths):
    config = load_config("tiny-mixtral")
    config.num_hidden_layers = layers
    for key, value in widths.items():
        setattr(config, key, value)
    torch.manual_seed(0)
    return build_model(config, device=device)


# ---------------------------------------------------------------------------------------------- measuring
def test_measure_routing_counts_the_rows_the_routers_choose():
    """On a real tiny Mixtral: the histogram equals a hand computation from each MoE block's input (softmax
    of the router's logits, top-k, counted per expert), every token routed ``top_k`` times."""
    model = _mixtral("cpu")
    batch = make_example_inputs(model, 2, 16)
    seen: dict[str, torch.Tensor] = {}
    hooks = [
        layer.mlp.register_forward_pre_hook(
            lambda _m, args, i=i: seen.__setitem__(LAYERS[i], args[0].detach().clone())
        )
        for i, layer in enumerate(model.model.layers)
    ]
    try:
        load = measure_routing(model, batch)
    finally:
        for hook in hooks:
            hook.remove()
    top_k, experts = model.config.num_experts_per_tok, model.config.num_local_experts
    assert list(load.rows_per_expert) == LAYERS
    for i, fqn in enumerate(LAYERS):
        hidden = seen[fqn].reshape(-1, model.config.hidden_size)
        logits = hidden @ model.model.layers[i].mlp.gate.weight.t()
        chosen = torch.topk(torch.softmax(logits.float(), dim=-1), top_k, dim=-1).indices
        by_hand = torch.bincount(chosen.reshape(-1), minlength=experts).tolist()
        assert list(load.rows_per_expert[fqn]) == by_hand
        assert sum(by_hand) == 2 * 16 * top_k
    # the model is left as it was: no hook, no gradient
    assert all(p.grad is None for p in model.parameters())
    assert not any(m._forward_pre_hooks for m in model.modules())


def test_routing_load_round_trips_and_names_the_busiest_rank():
    load = RoutingLoad({LAYERS[0]: [60, 40, 20, 8], LAYERS[1]: (10, 30, 25, 15)})
    assert RoutingLoad.from_dict(json.loads(json.dumps(load.to_dict()))) == load
    assert RoutingLoad.from_dict(load.to_dict()["rows_per_expert"]) == load  # a bare mapping too
    assert load.skew(LAYERS[0], 2) == 100 * 2 / 128  # experts {0, 1} on rank 0
    assert load.skew(LAYERS[1], 2) == 1.0  # 40 rows on each rank, though the experts differ
    assert load.skew(LAYERS[0], 4) == 60 * 4 / 128
    assert busiest_rank_skew([7, 7, 7, 7], 2) == 1.0 and busiest_rank_skew([7, 7, 7, 7], 1) == 1.0
    assert "1.56x" in load.describe(2) and LAYERS[0] in load.describe(2)


# ---------------------------------------------------------------------------------------------- refusing
@pytest.mark.parametrize(
    "rows,message",
    [
        ({LAYERS[0]: [1, 2, 3, 4]}, "no counts for MoE layer 'model.layers.1.mlp.experts'"),
        ({**{f: [1, 2, 3, 4] for f in LAYERS}, "model.layers.7.mlp.experts": [1, 2, 3, 4]}, "layers.7"),
        ({LAYERS[0]: [1, 2, 3, 4], LAYERS[1]: [1, 2, 3]}, "'model.layers.1.mlp.experts' has 3 counts for 4"),
    ],
)
def test_a_histogram_of_another_model_is_refused_naming_the_layer(rows, message):
    model = _mixtral()
    batch = make_example_inputs(model, 4, 16, device="meta")
    with pytest.raises(ValueError, match="measure_routing") as info:
        plan_model(model, batch, num_devices=2, device="cpu", mesh_shape=(1, 2), routing=rows)
    assert message in str(info.value)


@pytest.mark.parametrize(
    "counts,message",
    [([5, -1, 3, 2], "not whole numbers >= 0"), ([0, 0, 0, 0], "routes no rows"), ([1.5, 2, 3, 4], "whole")],
)
def test_bad_counts_are_refused_naming_the_layer(counts, message):
    with pytest.raises(ValueError, match=message) as info:
        RoutingLoad({LAYERS[0]: counts})
    assert LAYERS[0] in str(info.value)


def test_measuring_a_meta_model_is_refused_with_the_way_out():
    model = _mixtral()
    with pytest.raises(ValueError, match="real weights.*RoutingLoad.load"):
        measure_routing(model, make_example_inputs(model, 2, 16, device="meta"))


# ---------------------------------------------------------------------------------------------- pricing
@pytest.fixture(scope="module")
def tiny_graph():
    model = _mixtral()
    return trace_training_step(model, make_example_inputs(model, 4, 16, device="meta"))


def _build(graph, routing, strategies=None, budget: float = 1e12, tp: int = 2):
    spec = get_device("cpu")
    mesh = (1, tp)
    cluster = ClusterSpec(spec, tp)
    return build_problem(
        graph,
        strategies if strategies is not None else enumerate_strategies(graph, (tp,), phases=(Phase.FORWARD,)),
        spec=spec,
        mesh_shape=mesh,
        tp_comm=AxisComm(tp, cluster.axis_link(mesh, 1)),
        dp_comm=AxisComm(1, cluster.axis_link(mesh, 0)),
        dp_mode="ddp",
        budget=budget,
        routing=routing,
    )


def _grouped(graph, built) -> list[str]:
    return [name for name, i in built.node_of_name.items() if graph.nodes[i].op == GROUPED_MM]


def test_a_skewed_histogram_prices_expert_parallelism_by_the_busiest_rank(tiny_graph):
    """Expert-parallel grouped GEMMs cost more (time and the bytes of their rows held for backward) under a
    skewed histogram; every other strategy and op costs what it costs under uniform routing."""
    graph = tiny_graph
    uniform = _build(graph, None)
    skewed = _build(graph, RoutingLoad({f: (60, 40, 20, 8) for f in LAYERS}))
    peak_u, peak_s = (b.problem.memory_constraint("activation-peak") for b in (uniform, skewed))
    compared = 0
    for node_u, node_s in zip(uniform.problem.nodes, skewed.problem.nodes, strict=True):
        assert node_u.name == node_s.name
        strats = uniform.strategies.get(node_u.name, [])
        for j, (cost_u, cost_s) in enumerate(zip(node_u.costs, node_s.costs, strict=True)):
            node = graph.nodes[uniform.node_of_name[node_u.name]] if strats else None
            if node is not None and is_expert_parallel(graph, node, strats[j], 0):
                assert cost_s > cost_u, (node_u.name, cost_u, cost_s)
                held_u, held_s = peak_u.terms.get(node_u.name), peak_s.terms.get(node_u.name)
                if held_u and held_s and strats[j].output_placements[0] == ("S0",):
                    assert held_s[j] == pytest.approx(held_u[j] * 1.5625)
                compared += 1
            else:
                assert cost_s == cost_u, node_u.name
    assert compared >= 4  # two layers x (gate_up, down)


def test_a_histogram_with_even_ranks_prices_exactly_as_uniform(tiny_graph):
    """Uneven experts whose ranks still get the same rows (and a flat histogram) give exactly the default's
    prices: every node cost and memory term."""
    graph = tiny_graph
    uniform = _build(graph, None)
    for rows in ((10, 30, 25, 15), (5, 5, 5, 5)):
        even = _build(graph, RoutingLoad({f: rows for f in LAYERS}))
        assert [n.costs for n in even.problem.nodes] == [n.costs for n in uniform.problem.nodes]
        assert [c.terms for c in even.problem.memory_constraints] == [
            c.terms for c in uniform.problem.memory_constraints
        ]
        assert even.problem.edges == uniform.problem.edges


def test_a_skewed_histogram_can_change_the_solvers_choice():
    """Wide experts, each grouped GEMM either expert-parallel (c) or tensor-parallel inside every expert (b,
    the weight split on its intermediate dim): under uniform routing the solver takes expert parallelism; with
    every row routed to one rank's experts that rank does all the work and the solver takes (b)."""
    intermediate = 2048
    model = _mixtral(hidden_size=512, intermediate_size=intermediate, num_local_experts=8)
    graph = trace_training_step(model, make_example_inputs(model, 8, 128, device="meta"))
    strategies = enumerate_strategies(graph, (2,), phases=(Phase.FORWARD,))
    for i, options in strategies.items():
        node = graph.nodes[i]
        if node.op == GROUPED_MM:
            # gate_up reads (E, H, 2I), down (E, I, H): the intermediate dim is 2, resp. 1
            dim = 2 if graph.values[node.inputs[1]].shape[-1] == 2 * intermediate else 1
            strategies[i] = [
                s
                for s in options
                if is_expert_parallel(graph, node, s, 0) or s.input_placements[1] == (f"S{dim}",)
            ]

    def expert_parallel(routing) -> list[bool]:
        built = _build(graph, routing, strategies)
        choice = solve(built.problem, time_limit_s=60).choice
        return [
            is_expert_parallel(graph, graph.nodes[built.node_of_name[n]], built.strategies[n][choice[n]], 0)
            for n in _grouped(graph, built)
        ]

    assert all(expert_parallel(None))
    assert not any(expert_parallel(RoutingLoad({f: (100, 100, 100, 100, 0, 0, 0, 0) for f in LAYERS})))


# ---------------------------------------------------------------------------------------------- the Plan
def test_the_plan_records_its_load_assumption():
    """``Plan.moe_load`` / ``moe_routing`` (stable names: experts module FQNs) and a summary line; a plan
    priced again keeps its histogram; dense models record none."""
    model = _mixtral()
    batch = make_example_inputs(model, 4, 16, device="meta")
    kwargs = dict(num_devices=2, device="cpu", mesh_shape=(1, 2), recompute="none", micro_batches=1)
    uniform = plan_model(model, batch, **kwargs)
    assert (uniform.moe_load, uniform.moe_routing) == (UNIFORM_LOAD, {})
    assert "MoE load              uniform over experts" in uniform.summary()
    rows = {f: [60, 40, 20, 8] for f in LAYERS}
    measured = plan_model(model, batch, **kwargs, routing=RoutingLoad(rows))
    assert (measured.moe_load, measured.moe_routing) == (MEASURED_LOAD, rows)
    assert "measured routing histogram" in measured.summary()
    again = Plan.from_dict(json.loads(measured.to_json()))
    assert (again.moe_load, again.moe_routing) == (MEASURED_LOAD, rows)
    repriced = evaluate_plan(model, batch, again, num_devices=2, device="cpu").plan
    assert repriced.moe_routing == rows
    dense = build_model(load_config("tiny-llama"), device="meta")
    plan = plan_model(
        dense, make_example_inputs(dense, 2, 16, device="meta"), num_devices=1, device="cpu", micro_batches=1
    )
    assert plan.moe_load == "" and "MoE load" not in plan.summary()


def test_cli_plan_takes_a_routing_histogram(tmp_path, capsys):
    """``hf-colossal-auto plan --routing-histogram file.json``: the plan is priced under it and records it; a
    histogram for another model is an error naming the layer."""
    from hf_colossal_auto.cli import main

    histogram, out = tmp_path / "routing.json", tmp_path / "plan.json"
    rows = {f: [60, 40, 20, 8] for f in LAYERS}
    RoutingLoad(rows).save(histogram)
    model = ["--model", "tiny-mixtral", "--batch-size", "4", "--seq-len", "16", "--device", "cpu"]
    command = ["-q", "plan", *model, "--devices", "2", "--mesh", "1x2", "--no-baselines"]
    assert main([*command, "--routing-histogram", str(histogram), "--out", str(out)]) == 0
    assert "MoE load              measured routing histogram" in capsys.readouterr().out
    assert Plan.load(out).moe_routing == rows
    RoutingLoad({LAYERS[0]: [1, 2, 3, 4]}).save(histogram)
    assert main([*command, "--routing-histogram", str(histogram)]) != 0
    assert "model.layers.1.mlp.experts" in capsys.readouterr().err


def test_the_solvers_own_plan_leaves_expert_parallelism_under_a_skewed_load():
    """The solver's own plan for Mixtral at hidden 256 with 8 experts (batch 4 x 64, 1 x 2 mesh; the fidelity
    test's expert-parallel plan) runs every layer expert-parallel under uniform routing and under a flat
    histogram (the same plan, the same prediction); with a quarter more rows on one rank's experts it splits
    every expert instead, predicted slower than the uniform plan."""
    config = load_config("tiny-mixtral")
    config.hidden_size, config.intermediate_size, config.num_local_experts = 256, 1024, 8
    config.head_dim = config.hidden_size // config.num_attention_heads
    model = build_model(config, device="meta")
    batch = make_example_inputs(model, 4, 64, device="meta")

    def plan(routing):
        return plan_model(model, batch, num_devices=2, device="cpu", mesh_shape=(1, 2), routing=routing)

    uniform, flat = plan(None), plan({f: [9] * 8 for f in LAYERS})
    skewed = plan({f: [100] * 4 + [60] * 4 for f in LAYERS})
    assert set(uniform.moe_layers.values()) == {"experts: EP×2"}
    assert (flat.moe_layers, flat.step_time_s) == (uniform.moe_layers, uniform.step_time_s)
    assert set(skewed.moe_layers.values()) == {"experts: TP×2"}
    assert skewed.step_time_s > uniform.step_time_s


def test_routing_measure_counts_the_example_batch_and_needs_real_data():
    """``routing="measure"`` (what the Trainer and accelerate paths pass): the plan carries the histogram
    ``measure_routing`` counts on the same model and batch; a meta batch or model is refused with the way out."""
    model = _mixtral("cpu")
    batch = make_example_inputs(model, 4, 16)
    kwargs = dict(num_devices=2, device="cpu", mesh_shape=(1, 2), recompute="none", micro_batches=1)
    plan = plan_model(model, batch, **kwargs, routing="measure")
    assert plan.moe_load == MEASURED_LOAD
    assert plan.moe_routing == {k: list(v) for k, v in measure_routing(model, batch).rows_per_expert.items()}
    with pytest.raises(ValueError, match="needs a real batch"):
        plan_model(model, make_example_inputs(model, 4, 16, device="meta"), **kwargs, routing="measure")
    with pytest.raises(ValueError, match='routing="measure": measure_routing needs the model.s real weights'):
        plan_model(_mixtral(), batch, **kwargs, routing="measure")
