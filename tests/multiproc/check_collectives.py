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
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

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


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def count_collectives(prof) -> tuple[dict[str, int], dict[str, int]]:
    """Counts and bytes per kind from c10d's own records in a profile."""
    counts: dict[str, int] = defaultdict(int)
    nbytes: dict[str, int] = defaultdict(int)
    for event in prof.events():
        if event.name not in _C10D:
            continue
        kind = _C10D[event.name]
        caller = event.cpu_parent
        assert caller is not None and caller.name.startswith("_c10d_functional::"), (event.name, caller)
        shape = caller.input_shapes[0]
        counts[kind] += 1
        nbytes[kind] += _numel(shape) * FLOAT32_BYTES
    return dict(counts), dict(nbytes)


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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--cases", default="tiny-gpt2,tiny-bert,tiny-t5,tiny-llama")
    parser.add_argument("--shapes", default="tiny,wide", help="tiny: the presets; wide: hidden 256 (no T5)")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    cases = [
        (preset, kind, shapes == "wide")
        for shapes in args.shapes.split(",")
        for preset in args.cases.split(",")
        for kind in ("megatron", "auto")
        if not (shapes == "wide" and preset == "tiny-t5")
    ]
    plans = plan_every_case(cases)
    results = [run_case(*case, plan) for case, plan in zip(cases, plans, strict=True)]
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
