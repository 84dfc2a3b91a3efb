"""What one transformer block keeps for backward per micro-batch, op by op, as the pipeline search prices it.

    python scripts/inspect_block_memory.py --model llama3-405b --tp 8 --devices 128 --seq 8192

Builds the model on ``meta`` with a few layers (the block's shapes are the model's), takes the inner ILP the
pipeline search solves for one stage layout (``solve/pipeline/pricing._Pricer.inner``: tensor parallelism
``--tp``, ``--rows`` rows of ``--seq`` tokens per micro-batch, each recompute option), and prints, for the
first block, every op whose kept bytes (its term in the activation-peak row, the recompute choice applied)
exceed ``--min-mib``, with its module and the strategy the ILP chose, then the block's total. Why: the search
picks recompute by these figures (a block's bytes times the micro-batches a schedule keeps in flight), so they
say which runtime change would let a stage keep more — the per-micro-batch bf16 weight casts, the gathered
inputs each projection casts again, the partial sums a selective policy keeps.
"""

from __future__ import annotations

import argparse

from hf_colossal_auto.models import build_model, load_config, make_example_inputs
from hf_colossal_auto.pipeline_layout import find_layout
from hf_colossal_auto.solve.build.names import MemoryRow, memory_row_name
from hf_colossal_auto.solve.candidates import _Planner
from hf_colossal_auto.solve.pipeline.pricing import _Pricer

MIB = float(1 << 20)


def kept_by_op(
    pricer: _Pricer, tp: int, rows: int, option: str, block: str
) -> list[tuple[float, str, str, str]]:
    """(bytes, op, module, strategy) of every op of ``block`` that keeps bytes for backward under ``option``."""
    inner = pricer.inner(tp, rows, option)
    built, choice = inner.built, inner.solution.choice
    graph = inner.planner.graph(1)
    row = built.problem.memory_constraint(memory_row_name(MemoryRow.ACTIVATION_PEAK))
    out = []

    def add(name: str, nbytes: float) -> None:
        node = graph.nodes[built.node_of_name[name]]
        if nbytes and (node.module == block or node.module.startswith(f"{block}.")):
            out.append((nbytes, node.op, node.module, choice[name]))

    for name in built.strategies:
        terms = row.terms.get(name)
        if terms:
            add(name, terms[choice[name]])
    for (src, dst), matrix in row.edge_terms.items():
        if src in built.recompute_options:
            add(dst, matrix[choice[src]][choice[dst]])
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama3-405b", help="preset or config path")
    p.add_argument(
        "--layers", type=int, default=2, help="layers built (the block's shapes do not depend on it)"
    )
    p.add_argument("--tp", type=int, default=8)
    p.add_argument("--devices", type=int, default=128, help="devices the planner is made for (>= tp)")
    p.add_argument("--devices-per-node", type=int, default=8)
    p.add_argument("--device", default="h100-80gb")
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--rows", type=int, default=1, help="rows (sequences) per micro-batch")
    p.add_argument("--options", default="none,selective:pointwise,full")
    p.add_argument("--min-mib", type=float, default=1.0)
    p.add_argument(
        "--local",
        choices=("auto", "yes", "no"),
        default="auto",
        help="attention and MLP on local shards: as the search prices it (the faster way), or fixed",
    )
    args = p.parse_args()

    config = load_config(args.model)
    config.num_hidden_layers = args.layers
    model = build_model(config, device="meta")
    inputs = make_example_inputs(model, args.devices // args.tp, args.seq, device="meta")
    planner = _Planner.for_devices(
        model, inputs, args.devices, args.device, args.devices_per_node, None, "bf16", "adamw", 60.0, "auto"
    )
    layout = find_layout(model)
    pricer = _Pricer(planner, layout, local={"auto": None, "yes": True, "no": False}[args.local])
    block = f"{layout.blocks}.0"  # the block list (ModuleList) and its first block
    for option in args.options.split(","):
        kept = kept_by_op(pricer, args.tp, args.rows, option, block)
        local = pricer.inner(args.tp, args.rows, option).local
        print(f"== {block}, recompute {option}, tp {args.tp}, {'local regions' if local else 'DTensors'}")
        for nbytes, op, module, strategy in kept:
            if nbytes >= args.min_mib * MIB:
                print(f"{nbytes / MIB:10.1f} MiB  {op:48s} {module:48s} strategy {strategy}")
        print(f"{sum(k[0] for k in kept) / MIB:10.1f} MiB  kept by the block per micro-batch\n")


if __name__ == "__main__":
    main()
