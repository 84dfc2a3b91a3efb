"""Sequence parallelism in the planner (issue 28, item 1): what the ILP picks, and what each residual-stream
layout costs against the others.

For a model, global batch and tensor-parallel mesh ``1 x N`` under a per-device budget (no data parallelism,
one piece per step), prints

* the plan ``plan_model`` makes (predicted step time, peak, recompute, the blocks it runs sequence-parallel);
* the same ILP with every residual add of the blocks pinned to one layout of the ``[batch, seq, hidden]``
  residual stream — ``R`` (replicated), ``S0`` (batch-sharded), ``S1`` (sequence-sharded: Megatron-LM's
  sequence parallelism), ``S2`` (hidden-sharded) — the rest (projections, norms, attention, recompute) left to
  the solver: predicted step time, communication, peak, or "no plan" where none fits.

Everything is the cost model's prediction (no device involved). Usage::

    python scripts/bench_sequence_parallel.py --preset llama-7b --batch 8 --seq 4096 --tp 8 --budget 40GiB
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time

os.environ.setdefault("HF_COLOSSAL_AUTO_NO_CALIBRATE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

LAYOUTS = ("R", "S0", "S1", "S2")


def _residual_adds(built, graph) -> list[str]:
    """ILP nodes of the residual adds of the blocks: ``add`` ops of a numbered block's own code on 3-D values."""
    out = []
    for name, i in built.node_of_name.items():
        node = graph.nodes[i]
        if (
            node.op == "aten.add.Tensor"
            and node.module.rpartition(".")[2].isdigit()
            and len(graph.values[node.outputs[0]].shape) == 3
            and name in built.strategies
        ):
            out.append(name)
    return out


def pinned(planner, mesh: tuple[int, int], layout: str) -> str:
    """The ILP with every residual add taking ``layout`` for both inputs and its output."""
    from hf_colossal_auto.solve.ilp import solve
    from hf_colossal_auto.solve.problem import InfeasibleError, memory_usage

    built = planner.build(mesh, "ddp")
    graph = planner.graph(mesh[0], 1)
    fixed = dict(built.problem.fixed)
    for name in _residual_adds(built, graph):
        ok = [
            k
            for k, st in enumerate(built.strategies[name])
            if st.output_placements[0][0] == layout
            and all(p is None or p[0] == layout for p in st.input_placements)
        ]
        if not ok:
            return f"{layout:3s} not offered"
        fixed[name] = ok[0]
    problem = dataclasses.replace(built.problem, fixed=fixed)
    try:
        solution = solve(problem, time_limit_s=120)
    except InfeasibleError:
        return f"{layout:3s} no plan fits"
    if not solution.choice:
        return f"{layout:3s} no solution ({solution.status})"
    peak = memory_usage(problem, solution.choice)["activation-peak"]
    recompute = sorted({built.recompute_options[k][solution.choice[k]].name for k in built.recompute_options})
    return (
        f"{layout:3s} step {solution.objective_s * 1e3:8.1f} ms  activation-moment peak {peak / 2**30:6.2f} GiB  "
        f"recompute {','.join(recompute)}"
    )


def main() -> None:
    from hf_colossal_auto import plan_model
    from hf_colossal_auto.models import build_model, make_example_inputs
    from hf_colossal_auto.solve.candidates import _Planner

    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="llama-7b")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--tp", type=int, default=8)
    parser.add_argument("--budget", default="40GiB")
    parser.add_argument("--device", default="a100-80gb")
    parser.add_argument("--mixed-precision", default="bf16")
    args = parser.parse_args()
    model = build_model(args.preset)
    batch = make_example_inputs(model, args.batch, args.seq, device="meta")
    common = dict(
        num_devices=args.tp,
        device=args.device,
        memory_budget=args.budget,
        mixed_precision=None if args.mixed_precision == "none" else args.mixed_precision,
    )
    start = time.perf_counter()
    plan = plan_model(model, batch, mesh_shape=(1, args.tp), dp_modes=("ddp",), micro_batches=1, **common)
    print(plan.summary(max_rows=12))
    print(
        f"sequence-parallel blocks: {len(plan.sequence_parallel_blocks)}; planned in {time.perf_counter() - start:.1f} s"
    )
    planner = _Planner.for_devices(
        model, batch, args.tp, args.device, None, args.budget, common["mixed_precision"], "adamw", 120.0
    )
    planner.routing = None
    print("residual stream pinned (the rest solved):")
    for layout in LAYOUTS:
        print("  " + pinned(planner, (1, args.tp), layout))


if __name__ == "__main__":
    main()
