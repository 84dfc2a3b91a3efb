"""Where a partial sum meets an op in solved plans, and whether the runtime runs it as the plan prices it.

The planner offers no strategy that carries a partial sum (``P``) through an op (``strategies.dtensor_rules.
_keep``): the plan reduces it on the edge into its reader. DTensor, left alone, carries a partial sum through
any op linear in it (views, ``add``, a product with a replicated factor, ``mm`` with a replicated operand,
``einsum``) and reduces it later. Where that op also reads a differentiable non-partial value, the value's
gradient, ``grad x partial``, is partial too: one more reduction in backward than the plan prices. The runtime
reduces the partial factor of a ``mul`` above autograd (``apply/enforce.py::_partial_factors_reduced``); no
other op of the MoE and dense families meets a partial sum that way, which this checks on their solved plans
(Megatron placements with the activations left to the solver, where partial sums flow: row-parallel outputs,
the experts split inside, Qwen2-MoE's shared expert times its gate).
"""

from __future__ import annotations

import pytest

from hf_colossal_auto.capture.graph import Phase, ValueKind
from hf_colossal_auto.models import build_model, load_config, make_example_inputs
from hf_colossal_auto.solve.baselines import megatron_placements
from hf_colossal_auto.solve.build.names import _node_name
from hf_colossal_auto.solve.ilp import solve
from hf_colossal_auto.solve.planner import _Planner
from hf_colossal_auto.solve.rules import _enforced_input
from hf_colossal_auto.solve.tied import TiedGraph, differentiable_values, forward_producers
from hf_colossal_auto.strategies.dtensor_rules import dtensor_choice
from hf_colossal_auto.strategies.enumerate import device_mesh

HANDLED = {"aten.mul.Tensor"}
"""Ops the runtime reduces a partial input of before they run (``_partial_factors_reduced``)."""
PARTIAL, REPLICATE = ("P",), ("R",)


def partial_meetings(graph, built, solution, tp: int) -> list[tuple[str, str, bool, bool]]:
    """Every forward op of a solved plan that a partial sum reaches at run time where the plan has it reduced:
    ``(op, module, carried, next to a differentiable input)``. ``carried``: DTensor's own dispatch, given the
    arriving placements, keeps the partial input (its output is then partial at run time, and followed on to
    its readers); the differentiable input is one DTensor does not make partial alongside. Inputs the runtime
    redistributes in a pre-hook (projections, layer norms) are left out. Conservative: a partial output a
    module-output hook would reduce is followed on as partial."""
    tied = TiedGraph.build(graph)
    producer = forward_producers(graph)
    grads = differentiable_values(graph)
    mesh = device_mesh((tp,))
    at_run: dict[int, tuple[str, ...]] = {}

    def strategy(i: int):
        name = _node_name(tied.canonical[i])
        options = built.strategies.get(name)
        return options[solution.choice[name]] if options else None

    def arriving(vid: int) -> tuple[str, ...]:
        if vid in at_run:
            return at_run[vid]
        made = producer.get(vid)
        chosen = strategy(made[0]) if made is not None else None
        return chosen.output_placements[made[1]] if chosen is not None else REPLICATE

    found = []
    for node in graph.nodes:
        chosen = strategy(node.index) if node.phase is Phase.FORWARD else None
        if chosen is None:
            continue
        planned = [p or REPLICATE for p in chosen.input_placements]
        given = [
            planned[k] if graph.values[v].kind is ValueKind.PARAM else arriving(v)
            for k, v in enumerate(node.inputs)
        ]
        met = [
            k
            for k, v in enumerate(node.inputs)
            if given[k] == PARTIAL and planned[k] != PARTIAL and not _enforced_input(graph, node, v)
        ]
        if not met:
            continue
        ran = dtensor_choice(
            node, graph, mesh, [given[k] if k in met else planned[k] for k in range(len(given))]
        )
        carried = ran is not None and any(ran.input_placements[k] == PARTIAL for k in met)
        beside = any(
            k not in met and v in grads and (ran is None or ran.input_placements[k] != PARTIAL)
            for k, v in enumerate(node.inputs)
        )
        found.append((node.op, node.module, carried, beside))
        if carried and not (node.op in HANDLED and beside):
            for pos, vid in enumerate(node.outputs):
                if ran.output_placements[pos] != chosen.output_placements[pos]:
                    at_run[vid] = ran.output_placements[pos]
    return found


def _model(preset: str):
    """The preset at hidden 256 (vocab 2000): wide enough that the solver splits activations."""
    config = load_config(preset)
    config.hidden_size, config.vocab_size = 256, 2000  # GPT-2's n_embd, T5's d_model
    for attr in (
        "intermediate_size",
        "n_inner",
        "d_ff",
        "moe_intermediate_size",
        "shared_expert_intermediate_size",
    ):
        if getattr(config, attr, None) is not None:
            setattr(config, attr, 512)
    if getattr(config, "head_dim", None) is not None:
        config.head_dim = 256 // config.num_attention_heads
    if getattr(config, "d_kv", None) is not None:
        config.d_kv = 256 // config.num_heads
    return build_model(config, device="meta")


FAMILIES = [
    "tiny-mixtral",
    "tiny-qwen2-moe",
    "tiny-qwen3-moe",
    "tiny-llama",
    "tiny-gpt2",
    "tiny-bert",
    "tiny-t5",
]


@pytest.mark.parametrize("preset", FAMILIES)
def test_no_solved_plan_carries_a_partial_sum_into_an_op_next_to_a_differentiable_input(preset):
    """Megatron placements (the solver placing the activations), 1 x 2 mesh, batch 4 x 32: the only op a
    partial sum reaches, kept partial by DTensor, next to a differentiable input, is a ``mul``, which the
    runtime reduces first (an RMSNorm's weight or a dropout mask times a row-parallel output, expert outputs
    times their routing weights, Qwen2-MoE's shared expert times its gate). Views, ``add`` and scalar products
    carry it with nothing differentiable beside; ``mm``, ``bmm``, ``div`` and ``einsum`` never meet one.

    The solver's own plans were scanned the same way once (2026-12-01, not here for the suite's time): these
    seven families at this width (1 x 2), at their preset width (1 x 2) and at hidden 1024 on 4 x H100 (bf16,
    batch 4 x 256): partial sums reach views, ``transpose``, ``expand``, scalar ``mul``, ``add`` and ``clone``
    (reduced there) with nothing differentiable beside, and ``mul`` next to a differentiable factor."""
    model = _model(preset)
    batch = make_example_inputs(model, 4, 32, device="meta")
    planner = _Planner.for_devices(model, batch, 2, "cpu", None, None, None, "adamw", 60.0, "none")
    graph = planner.graph(1)
    tied = TiedGraph.build(graph)
    megatron = {tied.canonical_param(k): v for k, v in megatron_placements(model).items()}
    found = []
    for fixed in (megatron,):
        built = planner.build((1, 2), "ddp", fixed, pin_unlisted=fixed is not None, recompute_pin="none")
        found += partial_meetings(graph, built, solve(built.problem, time_limit_s=60), 2)
    assert any(carried for _, _, carried, _ in found)  # partial sums do flow through ops at run time
    diverging = sorted(
        {(op, module) for op, module, carried, beside in found if carried and beside and op not in HANDLED}
    )
    assert diverging == [], f"{preset}: a partial sum meets {diverging} next to a differentiable input"
    # what the scan does find there: the products the runtime reduces first
    assert any(op in HANDLED and beside for op, _, _, beside in found)
