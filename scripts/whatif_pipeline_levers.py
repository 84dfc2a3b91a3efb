"""What-if for the scale cases: the plan ``plan_model(pipeline=None)`` makes if the pipeline pricing were given
smaller figures for levers the runtime does not have yet (predicted only; nothing here changes what runs).

    python scripts/whatif_pipeline_levers.py --case llama3-405b --lever partial

Levers (each patches the figures ``solve/pipeline/pricing._Pricer.inner`` hands the search, per inner ILP):

* ``bf16-sends``: a stage sends its hidden states in bf16 (send and receive bytes halved; they are fp32 under
  autocast with fp32 parameters, so this would change what a step computes — priced to show its worth only).
  Sending each tensor-parallel rank's sequence shard, this script's first lever, is built
  (``Plan.sequence_sharded_sends``) and in the baseline;
* ``partial``: selective recompute does not keep the row-parallel projections' partial sums (the ``mm`` outputs
  of ``o_proj`` / ``down_proj``) and pays no rerun for it. Built since as the ``;rerun=`` twin of
  ``selective:pointwise`` (in the baseline), which pays its reruns (``o_proj``'s matmul): this lever now shows
  what those reruns cost;
* ``casts``: a block without recompute keeps no bf16 cast of a projection's weight or input per micro-batch (the
  part built: sibling projections share one cast of their input, ``apply/shared_casts.py``, in the baseline; the
  weight casts are held once a step, not per micro-batch);
* ``cast-first``: a projection input that sibling projections share is cast to bf16 on its shard and gathered
  in bf16 (half the all-gather's bytes, in forward and in a recomputed block's rerun), its gradient still
  reduced once in fp32. Today the runtime gathers the fp32 input and casts the gathered copy (priced so); this
  lever patches the builder's edges (``_EdgesPart._add_activation_use``: the shared copy priced at the cast's
  bytes), not the pipeline pricing;
* ``all``: bf16-sends and partial together; ``baseline``: nothing patched (today's plan).

The split-backward levers of earlier sessions are gone: ``one-rerun`` is built (``apply/shared_rerun``: the
input pass's rerun serves the weight pass, its tensors priced as held until then: ZB-V's middle ranks hold up to
``pp`` micro-batches between the two passes, 32 at 405B, so the scale plans keep interleaved 1F1B), and
``full-backward`` changed nothing.

Forcing a schedule the search rejects, to see what it would need: ``--schedule interleaved-zero-bubble:4`` offers only
that schedule with that many stages a rank, ``--pipeline 16`` fixes the degree, ``--budget 300GiB`` lets it fit,
and ``--weight-pass-rerun F`` scales what a stage holds of its blocks' rerun from the input pass to the weight pass
(``F=0``: none of the rerun's tensors held; the outputs' gradients the weight pass reads and the kept activations
stay). With ``--schedule`` the per-rank peaks are printed too.

Prints the plan (pp, schedule, micro-batches, mesh, recompute counts), its step time and MFU (the model FLOPs of
``bench_planner.py --scale``), its peak, and each pp rank's predicted activation bytes at its peak. Why: the
planner's own cost model says which runtime change is worth building first (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_planner import MIXED, SCALE_CASES, SCALE_DEVICE, _model_flops_per_token  # noqa: E402

from hf_colossal_auto.hardware import get_device  # noqa: E402
from hf_colossal_auto.models import build_model, make_example_inputs  # noqa: E402
from hf_colossal_auto.solve.build.names import MemoryRow, memory_row_name  # noqa: E402
from hf_colossal_auto.solve.pipeline import cut, pricing  # noqa: E402
from hf_colossal_auto.solve.planner import plan_model  # noqa: E402
from hf_colossal_auto.solve.writeup import _real_modules  # noqa: E402

LEVERS = ("baseline", "bf16-sends", "partial", "casts", "cast-first", "all")
GIB = float(1 << 30)


def kept_per_block(inner, keep) -> float:
    """The most any block of ``inner``'s solution keeps for backward in the ops ``keep(op, module)`` selects
    (the activation-peak row's recompute terms, spread over the real blocks as the pricing spreads them)."""
    built, choice = inner.built, inner.solution.choice
    graph = inner.planner.graph(1)
    unit_of, _ = pricing._units_of(inner.planner.model)
    row = built.problem.memory_constraint(memory_row_name(MemoryRow.ACTIVATION_PEAK))
    per_unit: dict[str, float] = defaultdict(float)
    for (src, dst), matrix in row.edge_terms.items():
        if src not in built.recompute_options:
            continue
        node = graph.nodes[built.node_of_name[dst]]
        if keep(node.op, node.module):
            reals = _real_modules(graph, node.module)
            for real in reals:
                per_unit[unit_of(real)] += matrix[choice[src]][choice[dst]] / len(reals)
    return max(per_unit.values(), default=0.0)


def patch(lever: str) -> None:
    """Patch ``_Pricer.inner`` to apply ``lever`` to each inner ILP's figures once."""
    original = pricing._Pricer.inner

    def inner(self, tp: int, rows: int, option: str, lean: bool = False):
        priced = original(self, tp, rows, option, lean)
        if getattr(priced, "_whatif", False):
            return priced
        priced._whatif = True
        if lever in ("bf16-sends", "all"):
            priced.send_bytes //= 2
        cut = 0.0
        if lever in ("partial", "all") and option.startswith("selective"):
            cut = kept_per_block(
                priced,
                lambda op, module: op == "aten.mm.default" and module.endswith(("o_proj", "down_proj")),
            )
        if lever == "casts" and option == "none":
            cut = kept_per_block(
                priced, lambda op, module: op == "aten._to_copy.default" and module.endswith("_proj")
            )
        for name, unit in priced.units.items():
            if cut and ".layers." in name and unit.activation_bytes > cut:
                unit.activation_bytes -= cut
        return priced

    pricing._Pricer.inner = inner


def cast_first() -> None:
    """Price the shared copy of a projection input at the bytes of its low-precision cast (see the module doc)."""
    import dataclasses

    from hf_colossal_auto.solve.build.edges import _EdgesPart

    original = _EdgesPart._add_activation_use

    def use(self, v_idx: int, k: int, vid: int) -> None:
        node, value = self.graph.nodes[v_idx], self.graph.values[vid]
        cast = self.graph.values[node.outputs[0]] if node.outputs else None
        if (v_idx, k) not in self.shared_uses or node.op != "aten._to_copy.default" or cast is None:
            return original(self, v_idx, k, vid)
        if cast.nbytes >= value.nbytes:
            return original(self, v_idx, k, vid)
        self.graph.values[vid] = dataclasses.replace(value, nbytes=cast.nbytes)
        try:
            return original(self, v_idx, k, vid)
        finally:
            self.graph.values[vid] = value

    _EdgesPart._add_activation_use = use


def force_schedule(text: str) -> None:
    """Offer only ``schedule:stages_a_rank`` to the pipeline search."""
    from hf_colossal_auto.solve.pipeline import search

    schedule, _, virtual = text.partition(":")
    offered = search._schedules_for

    def only(num_blocks: int, pp: int, schedules: tuple[str, ...]) -> list[tuple[str, int]]:
        return [o for o in offered(num_blocks, pp, schedules) if o == (schedule, int(virtual or 1))]

    search._schedules_for = only


def scale_weight_pass_rerun(factor: float) -> None:
    """Scale what a stage holds of its blocks' rerun from the input to the weight pass (``cut._stage_rematerialised``,
    read by the schedule simulation's ``weight_grad_bytes``)."""
    original = cut._stage_rematerialised
    cut._stage_rematerialised = lambda costs, counts, levels: [
        x * factor for x in original(costs, counts, levels)
    ]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--case", choices=tuple(SCALE_CASES), default="llama3-405b")
    p.add_argument("--lever", choices=LEVERS, default="baseline")
    p.add_argument("--schedule", help="offer only SCHEDULE:STAGES_A_RANK (e.g. interleaved-zero-bubble:4)")
    p.add_argument("--pipeline", type=int, help="fix the pp degree (default: searched)")
    p.add_argument("--budget", help="per-device memory budget (default: the device's)")
    p.add_argument(
        "--weight-pass-rerun", type=float, default=1.0, help="scale of the rerun held to the weight pass"
    )
    args = p.parse_args()
    patch(args.lever)
    if args.lever == "cast-first":
        cast_first()
    if args.schedule:
        force_schedule(args.schedule)
    if args.weight_pass_rerun != 1.0:
        scale_weight_pass_rerun(args.weight_pass_rerun)
    preset, batch, seq, devices, per_node = SCALE_CASES[args.case]
    model = build_model(preset, device="meta")
    inputs = make_example_inputs(model, batch, seq, device="meta")
    started = time.perf_counter()
    plan = plan_model(model, inputs, pipeline=args.pipeline, num_devices=devices, device=SCALE_DEVICE,
                      devices_per_node=per_node, mixed_precision=MIXED, time_limit_s=60.0,
                      memory_budget=args.budget)  # fmt: skip
    flops = _model_flops_per_token(model, seq) * batch * seq
    mfu = flops / (plan.step_time_s * devices * get_device(SCALE_DEVICE).peak_flops["bfloat16"])
    print(
        f"{args.case} {args.lever}: planned in {time.perf_counter() - started:.1f} s; pp {plan.pp_size} "
        f"{plan.schedule}, {plan.micro_batches} micro-batches, mesh {tuple(plan.mesh_shape)} {plan.dp_label}, "
        f"recompute {dict(Counter(plan.recompute.values()))}; step {plan.step_time_s:.3f} s, MFU {mfu:.1%}, "
        f"peak {plan.peak_memory_bytes / GIB:.1f} GiB"
    )
    activations = plan.solver.get("rank_activation_bytes")
    if activations:
        print("activations at each pp rank's peak, GiB:", [round(b / GIB, 1) for b in activations])
    peaks = plan.solver.get("rank_peak_memory_bytes")
    if args.schedule and peaks:
        print("each pp rank's peak, GiB:", [round(b / GIB, 1) for b in peaks])


if __name__ == "__main__":
    main()
