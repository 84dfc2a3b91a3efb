"""The collectives a plan predicts, against the process group's own accounting on real ranks (issue 16, item 1).

    torchrun --nproc_per_node 2 tests/multiproc/check_collectives.py --out D/result.json [--shapes tiny,wide]

For GPT-2, BERT, T5 and Llama under the Megatron and the solver's plan on a 1 x 2 mesh (the tiny presets at
batch 4 x 16, and GPT-2, BERT and Llama at hidden 256, batch 4 x 64: test_fidelity's cases), one forward + backward
on 2 gloo processes under ``torch.profiler``: c10d records every collective it runs (``c10d::allreduce_``,
``c10d::_allgather_base_``, ...) with its tensors' shapes. Those records are the reference — neither the
planner nor the project's own recorder (``apply/simulate.py``) is involved. Rank 0 writes, per case, the
predicted counts and bytes per kind (``Plan.collectives``/``collective_bytes`` without ``dp_*``) and the counted
ones. Bytes are what each rank hands the collective (an all-gather's local shard, a reduce-scatter's whole
input), in float32: the models run in float32.

With ``--moe``, then tiny Mixtral (batch 4 x 16) under TP inside every expert and whole experts per tensor-parallel
rank (1 x 2, the plans test_fidelity's MoE runtime cases price with their uses pinned), and under "ddp-ep" (2 x 1,
each rank its 2 rows, whole experts per data-parallel rank): there every rank also writes the split sizes of each
all-to-all as c10d recorded them, and the ones the routing of every rank's rows in one process implies.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict

import torch
import torch.distributed as dist
from common import close_gloo, init_gloo, write_results
from torch.profiler import ProfilerActivity, profile

from hf_colossal_auto.integrations.process_exit import finish

# c10d's profiler record -> the plan's kind (DTensor calls them through the functional collectives, whose
# record above c10d's holds the tensor handed in: c10d's own takes tensor lists, recorded without shapes)
_C10D = {
    "c10d::allreduce_": "all_reduce",
    "c10d::allreduce_coalesced_": "all_reduce",
    "c10d::allgather_into_tensor_coalesced_": "all_gather",
    "c10d::_allgather_base_": "all_gather",
    "c10d::reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "c10d::_reduce_scatter_base_": "reduce_scatter",
    "c10d::alltoall_base_": "all_to_all",
    "c10d::broadcast_": "broadcast",
}
FLOAT32_BYTES = 4
_ELEMENT_BYTES = {"float": 4, "long int": 8}  # c10d's dtype names: the rows, the per-expert counts


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def count_collectives(prof) -> tuple[dict[str, int], dict[str, int]]:
    """Counts and bytes per kind from c10d's own records in a profile. A collective called directly (not through
    the functional collectives: DDP's gradient all-reduce) is counted as ``"<kind> (plain)"``, without bytes
    (c10d records its tensor list without shapes); an all-to-all by the input c10d records for its own call
    (the functional one's backward calls c10d directly)."""
    counts: dict[str, int] = defaultdict(int)
    nbytes: dict[str, int] = defaultdict(int)
    for event in prof.events():
        if event.name not in _C10D:
            continue
        kind = _C10D[event.name]
        caller = event.cpu_parent
        if kind == "all_to_all":  # c10d records the tensors of its own call: (output, input, ...)
            counts[kind] += 1
            nbytes[kind] += _numel(event.input_shapes[1]) * _ELEMENT_BYTES[event.input_dtypes[1]]
            continue
        if caller is None or not caller.name.startswith("_c10d_functional::"):
            counts[f"{kind} (plain)"] += 1
            continue
        shape = caller.input_shapes[0]
        counts[kind] += 1
        nbytes[kind] += _numel(shape) * FLOAT32_BYTES
    return dict(counts), dict(nbytes)


def all_to_all_splits(prof) -> list[list]:
    """``[input_split_sizes, output_split_sizes]`` of every all-to-all, as c10d recorded its arguments
    (``c10d::alltoall_base_(output, input, group, output_split_sizes, input_split_sizes, ...)``), in order."""
    return [
        [list(event.concrete_inputs[4]), list(event.concrete_inputs[3])]
        for event in prof.events()
        if event.name == "c10d::alltoall_base_"
    ]


def _model(preset: str, wide: bool) -> torch.nn.Module:
    from common import wider_model

    from hf_colossal_auto.models import build_model

    if wide:
        return wider_model(preset)
    torch.manual_seed(0)
    model = build_model(preset, device="cpu")
    model.eval()  # no dropout: the trace's decisions and the run's agree
    return model


def _batch(model: torch.nn.Module, wide: bool) -> dict:
    from hf_colossal_auto.models import make_example_inputs

    return make_example_inputs(model, 4, 64 if wide else 16, seed=0)


def make_plan(preset: str, kind: str, wide: bool) -> str:
    """The case's plan (JSON), made on the calling rank alone."""
    from hf_colossal_auto import evaluate_plan, plan_model

    model = _model(preset, wide)
    batch = _batch(model, wide)
    if kind == "megatron":
        plan = evaluate_plan(model, batch, "megatron", num_devices=2, device="cpu", mesh_shape=(1, 2)).plan
    elif kind in ("experts-tp", "experts-ep"):  # MoE: TP inside every expert / whole experts per tp rank
        from check_numerics import moe_runtime_plan

        runs = moe_runtime_plan(model, batch, kind)
        plan = evaluate_plan(model, batch, runs, num_devices=2, device="cpu", pin_uses=True).plan
    elif kind == "ddp-ep":  # MoE: whole experts per data-parallel rank, tokens exchanged by all-to-all
        plan = plan_model(model, batch, num_devices=2, device="cpu", mesh_shape=(2, 1), dp_modes=("ddp-ep",))
    else:
        plan = plan_model(model, batch, num_devices=2, device="cpu", mesh_shape=(1, 2))
    return plan.to_json()


def plan_every_case(cases: list[tuple[str, str, bool]]) -> list:
    """Each rank plans its share of the cases (case i on rank i mod world), then every rank gets every plan:
    the ranks plan side by side instead of waiting for rank 0 to plan them all."""
    from hf_colossal_auto import Plan

    rank, world = dist.get_rank(), dist.get_world_size()
    mine = {i: make_plan(*case) for i, case in enumerate(cases) if i % world == rank}
    gathered: list = [None] * world
    dist.all_gather_object(gathered, mine)
    made = {i: text for share in gathered for i, text in share.items()}
    return [Plan.from_dict(json.loads(made[i])) for i in range(len(cases))]


def run_case(preset: str, kind: str, wide: bool, plan) -> dict:
    from hf_colossal_auto import apply_plan

    model = _model(preset, wide)
    batch = _batch(model, wide)
    if kind == "ddp-ep":
        return run_expert_data_parallel(model, batch, plan)
    apply_plan(model, plan)
    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        model(**batch).loss.backward()
    counted, counted_bytes = count_collectives(prof)
    dist.barrier()
    return {
        "case": f"{preset}-{kind}{'-wide' if wide else ''}",
        "predicted": {k: int(v) for k, v in plan.collectives.items() if not k.startswith("dp_") and v},
        "predicted_bytes": {
            k: int(v) for k, v in plan.collective_bytes.items() if not k.startswith("dp_") and v
        },
        "counted": counted,
        "counted_bytes": counted_bytes,
    }


def _routing(model: torch.nn.Module, rows: dict) -> list[list[int]]:
    """The experts each (token, choice) pair of ``rows`` is routed to, per MoE layer, in one process (the
    ``top_k_index`` every experts module is called with)."""
    from hf_colossal_auto.capture.moe import experts_modules

    seen: list[list[int]] = []
    hooks = [
        module.register_forward_pre_hook(lambda _m, args: seen.append(args[1].reshape(-1).tolist()))
        for module in experts_modules(model).values()
    ]
    try:
        with torch.no_grad():
            model(**rows)
    finally:
        for hook in hooks:
            hook.remove()
    return seen


def _expected_splits(routings: list[list[list[int]]], rank: int, per_rank: int) -> list[list]:
    """The ``[input, output]`` split sizes of every row exchange ``rank`` runs in a forward + backward, from each
    rank's routing alone: per layer, the dispatch sends each rank the pairs routed to its experts and receives
    the pairs the others routed to this rank's; the combine returns them; backward runs both in reverse."""
    world = len(routings)
    expected = []
    for layer in range(len(routings[rank])):
        expected.append([[per_rank] * world] * 2)  # the per-expert counts: every rank its experts' counts
        sent = [
            [sum(1 for e in routings[r][layer] if e // per_rank == j) for j in range(world)]
            for r in range(world)
        ]
        out, back = sent[rank], [sent[j][rank] for j in range(world)]
        expected += [[out, back], [back, out], [out, back], [back, out]]  # dispatch, combine, their gradients
    return sorted(expected)


def run_expert_data_parallel(model: torch.nn.Module, batch: dict, plan) -> dict:
    """The "ddp-ep" case (2 x 1, each rank its own rows, experts split over the ranks): c10d's records of one
    forward + backward — the all-to-alls (count; bytes on average over the ranks, as the plan prices them; the
    split sizes of each against the routing the one-process model takes on every rank's rows) and DDP's
    all-reduces (count)."""
    import copy

    from hf_colossal_auto import apply_plan

    rank, world = dist.get_rank(), dist.get_world_size()
    per = batch["input_ids"].shape[0] // world
    pieces = [{k: v[r * per : (r + 1) * per] for k, v in batch.items()} for r in range(world)]
    reference = copy.deepcopy(model)
    routings = [_routing(reference, piece) for piece in pieces]
    per_rank = model.config.num_local_experts // world
    apply_plan(model, plan)
    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        model(**pieces[rank]).loss.backward()
    counted, counted_bytes = count_collectives(prof)
    splits = all_to_all_splits(prof)
    dist.barrier()
    every: list = [None] * world
    dist.all_gather_object(every, {"bytes": counted_bytes, "splits": splits})
    return {
        "case": "tiny-mixtral-ddp-ep",
        "dp_label": plan.dp_label,
        "predicted": {k: int(v) for k, v in plan.collectives.items() if v},
        "predicted_bytes": {k: int(v) for k, v in plan.collective_bytes.items() if v},
        "counted": counted,
        "counted_bytes_by_rank": [r["bytes"] for r in every],
        "splits_by_rank": [sorted(r["splits"]) for r in every],
        "expected_splits_by_rank": [_expected_splits(routings, r, per_rank) for r in range(world)],
        "moe_layers": len(routings[0]),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--cases", default="tiny-gpt2,tiny-bert,tiny-t5,tiny-llama")
    parser.add_argument("--shapes", default="tiny,wide", help="tiny: the presets; wide: hidden 256 (no T5)")
    parser.add_argument(
        "--moe", action="store_true", help="then tiny Mixtral's experts TP, EP over tp and over dp"
    )
    args = parser.parse_args()
    init_gloo()
    cases = [
        (preset, kind, shapes == "wide")
        for shapes in args.shapes.split(",")
        for preset in args.cases.split(",")
        for kind in ("megatron", "auto")
        if not (shapes == "wide" and preset == "tiny-t5")
    ]
    if args.moe:  # TP inside every expert, whole experts per tp rank, whole experts per dp rank (all-to-all)
        cases += [("tiny-mixtral", kind, False) for kind in ("experts-tp", "experts-ep", "ddp-ep")]
    plans = plan_every_case(cases)
    results = [run_case(*case, plan) for case, plan in zip(cases, plans, strict=True)]
    write_results(results, args.out)
    close_gloo()


if __name__ == "__main__":
    main()
    finish()  # the run's gloo groups outlive main(): end before interpreter teardown
