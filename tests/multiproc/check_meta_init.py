"""Run under torchrun (2 gloo ranks): models built on ``meta`` are planned, sharded and initialised per rank.

    torchrun --standalone --nproc_per_node 2 tests/multiproc/check_meta_init.py --out result.json

For each case (model, mesh, data-parallel mode) every rank builds the model on meta, rank 0 plans (Megatron
placements, so that the tensor-parallel mesh really shards) and broadcasts, and ``autoparallelize`` allocates
and initialises only this rank's shards. Rank 0 writes what the test asserts: parameter bytes per rank against
the plan's shard bytes and the full model, whether replicated parameters are bit-identical across the
tensor-parallel group, the gathered parameters against one process's meta initialisation from the same RNG
state and against a CPU-built model's statistics, buffers against a CPU-built model, and three AdamW steps.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import transformers
from common import close_gloo, init_gloo, out_argument, write_results
from torch.distributed.tensor import DTensor

CASES = (
    ("tiny-llama", (1, 2), "ddp"),
    ("tiny-gpt2", (1, 2), "ddp"),  # tied lm_head / wte
    ("tiny-llama", (2, 1), "fsdp"),
    ("tiny-gpt2", (2, 1), "fsdp"),
    ("tiny-llama", (2, 1), "ddp"),  # shards nothing: ordinary parameters, full tensors on every rank
)
SEED = 1234


def _plan(model, batch, mesh: tuple[int, int], dp_mode: str):
    from hf_colossal_auto.apply import broadcast_plan
    from hf_colossal_auto.solve.planner import evaluate_plan

    made = None
    if dist.get_rank() == 0:
        made = evaluate_plan(
            model, batch, "megatron", num_devices=dist.get_world_size(), device="cpu", mesh_shape=mesh
        ).plan
        made.dp_mode = dp_mode
    return broadcast_plan(made)


def _expected_local_bytes(model, plan) -> int:
    """This rank's parameter bytes if it held exactly its shards per the plan (ceil for uneven splits)."""
    total = 0
    params = dict(model.named_parameters())
    for fqn, placements in plan.param_placements.items():
        numel = params[fqn].numel()
        shape = list(params[fqn].shape)
        for axis, p in enumerate(placements):
            if p.startswith("S"):
                d = int(p[1:])
                shape[d] = math.ceil(shape[d] / plan.mesh_shape[axis])
        if plan.dp_mode == "fsdp" and plan.dp_size > 1 and placements[0] == "R":
            shape[0] = math.ceil(shape[0] / plan.dp_size)  # FSDP2 shards dim 0 over the replicas
        numel = math.prod(shape)
        total += numel * params[fqn].element_size()
    return total


def _local_bytes(model) -> int:
    local = (p.to_local() if isinstance(p, DTensor) else p for p in model.parameters())
    return sum(t.numel() * t.element_size() for t in local)


def _replicated_identical(model, plan) -> bool:
    """Every parameter the plan replicates on the tensor-parallel axis holds the same bits on all its ranks."""
    ok = True
    for fqn, param in model.named_parameters():
        if plan.param_placements[fqn][1] != "R" or plan.dp_mode == "fsdp":
            continue
        local = (param.to_local() if isinstance(param, DTensor) else param).detach().contiguous()
        gathered = [torch.empty_like(local) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, local)
        ok &= all(torch.equal(g, gathered[0]) for g in gathered)
    return ok


def _compare_stats(full: dict, cpu_model) -> list[str]:
    """Parameters whose mean/std differ from a CPU-built model's (the same init distribution, other draws)."""
    bad = []
    for fqn, ref in cpu_model.state_dict().items():
        got = full[fqn]
        if ref.numel() < 1024 or not ref.is_floating_point():
            continue
        if float(ref.std()) == 0.0:
            if not torch.equal(got, ref):
                bad.append(fqn)
        elif abs(float(got.std()) / float(ref.std()) - 1) > 0.15 or abs(
            float(got.mean() - ref.mean())
        ) > 0.1 * float(ref.std()):
            bad.append(fqn)
    return bad


def run_case(preset: str, mesh: tuple[int, int], dp_mode: str) -> dict:
    from hf_colossal_auto import autoparallelize
    from hf_colossal_auto.apply import consolidated_state_dict
    from hf_colossal_auto.apply.materialize import materialize_meta_model
    from hf_colossal_auto.models import build_model, make_example_inputs

    rank, world = dist.get_rank(), dist.get_world_size()
    dp, tp = mesh
    model = build_model(preset, device="meta")
    global_batch = make_example_inputs(model, 4, 16, seed=0)
    plan = _plan(model, global_batch, mesh, dp_mode)
    per_replica = 4 // dp
    replica = rank // tp
    batch = {k: v[replica * per_replica : (replica + 1) * per_replica] for k, v in global_batch.items()}
    early = [torch.optim.AdamW(model.parameters(), lr=1e-3)] if dp_mode == "fsdp" else []  # remapped
    expected = _expected_local_bytes(model, plan)
    full_bytes = sum(p.numel() * p.element_size() for p in model.parameters())

    torch.manual_seed(SEED)  # the same on every rank here; materialisation uses rank 0's state anyway
    autoparallelize(model, plan=plan, optimizers=early)
    result = {
        "case": f"{preset} {dp}x{tp} {dp_mode}",
        "local_bytes": _local_bytes(model),
        "expected_local_bytes": expected,
        "full_bytes": full_bytes,
        "all_dtensors": all(isinstance(p, DTensor) and not p.is_meta for p in model.parameters()),
        "all_plain": all(
            type(p) is torch.nn.Parameter and not isinstance(p, DTensor) and not p.is_meta
            for p in model.parameters()
        ),
        "shards_nothing": plan.shards_nothing,
        "replicated_identical": _replicated_identical(model, plan),
        "sharded_params": sum(1 for v in plan.param_placements.values() if "S" in "".join(v)),
    }
    full = consolidated_state_dict(model)  # collective

    torch.manual_seed(SEED)
    reference = build_model(preset, device="meta")
    materialize_meta_model(reference)  # one process's init from the same RNG state (collective broadcast)
    torch.manual_seed(0)
    cpu_model = build_model(preset, device="cpu")
    reference_sd = reference.state_dict()
    result["differs_from_single_process"] = [
        k for k, v in reference_sd.items() if not torch.equal(full[k], v)
    ]
    result["stats_differ_from_cpu_build"] = _compare_stats(full, cpu_model)
    cpu_buffers = dict(cpu_model.named_buffers())
    result["buffers_checked"] = sorted(cpu_buffers)
    result["buffers_differ"] = [
        n for n, b in model.named_buffers() if not torch.equal(b.cpu(), cpu_buffers[n])
    ]
    if preset == "tiny-gpt2":
        result["tied"] = model.lm_head.weight is model.transformer.wte.weight

    model.eval()  # no dropout: the ranks of a tensor-parallel group see exactly the same computation
    optimizer = early[0] if early else torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(3):
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        every = [None] * world
        dist.all_gather_object(every, float(loss))
        losses.append(every)
    result["losses"] = losses
    del model, optimizer, early, reference, cpu_model, full
    dist.barrier()
    return result


def main() -> None:
    out = out_argument()
    transformers.logging.set_verbosity_error()
    init_gloo(timeout_s=120)
    results = [run_case(*case) for case in CASES]
    write_results(results, out, indent=1)
    close_gloo(exit_process=True)


if __name__ == "__main__":
    main()
