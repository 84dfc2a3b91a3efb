"""Run under torchrun: apply a plan to a tiny model on gloo ranks and compare with the single-process model.

    torchrun --nproc_per_node N tests/multiproc/check_numerics.py --model tiny-llama --mesh 2x2 --out result.json

Several models (``--model tiny-gpt2,tiny-llama``) run one after the other in the same processes (one launch):
the result file then holds a list. ``name@plan`` overrides ``--plan`` for one model; MoE models also take
``experts-tp`` (the config's own HF ``base_model_tp_plan``: attention TP and TP inside every expert) and
``experts-replicated`` (the same without the expert entries) and ``experts-ep`` (that, plus the config's
``base_model_ep_plan``: whole experts per rank). For these and ``megatron``, expert weights are used as
stored (at these tiny widths the solver would gather them for use), so that the split compute runs.
``--dp-mode ddp,fsdp`` runs every model under DDP, then every model under FSDP, in the same launch.

Every rank builds the same seeded model, rank 0 plans and broadcasts, each data-parallel replica gets its own
slice of one global batch, and rank 0 writes the loss and the largest gradient difference against the model
trained on the whole batch in one process (the same quantity DDP computes: the mean of the replicas' losses).

``--checkpoint-save D`` then runs check_checkpoint.py's save phase into ``D`` in the same processes (its resume
phase needs fresh ones): one launch for both.
"""

from __future__ import annotations

import argparse
import copy

import torch
import torch.distributed as dist
import transformers
from torch.distributed.tensor import DTensor

EXPERTS_TP_ENTRIES = {
    "layers.*.mlp.experts.gate_up_proj": "packed_colwise",
    "layers.*.mlp.experts.down_proj": "rowwise",
    "layers.*.mlp.experts": "moe_tp_experts",
}
"""TP inside every fused expert, in HF's plan style: what Mixtral's and Qwen3-MoE's ``base_model_tp_plan`` held up
to transformers 5.24 (5.25 dropped the experts from them: they leave them replicated)."""


def hf_tp_plan(model, with_experts: bool) -> dict[str, str]:
    """The config's own ``base_model_tp_plan``, with or without the entries of the MoE experts (with: the
    config's, else :data:`EXPERTS_TP_ENTRIES`, so that the case splits the experts on every transformers)."""
    plan = dict(model.config.base_model_tp_plan or {})
    if not plan:
        raise ValueError(f"{type(model).__name__} has no base_model_tp_plan")
    attention = {k: v for k, v in plan.items() if ".experts" not in k}
    if not with_experts:
        return attention
    return plan if len(attention) < len(plan) else {**attention, **EXPERTS_TP_ENTRIES}


_PRICED: dict = {}
"""``name@plan`` -> the plan rank 0 priced for it: ``--dp-mode ddp,fsdp`` runs reuse it with another dp mode."""


def moe_runtime_plan(model, batch, kind: str):
    """The 1 x 2 plan the MoE runtime test trains for ``kind`` (tests/multiproc/check_numerics.py): the
    Megatron placements or HF's own ``base_model_tp_plan`` ("experts-tp"), with the expert weights used as
    stored (no ``param_use_placements`` for them) so that the split compute runs. ``"megatron-split"`` uses
    every weight as stored (Qwen2-MoE's shared expert split like a dense MLP, its sigmoid gate multiplying a
    partial sum), re-priced with its uses pinned so that its module outputs are placed for the split compute
    (the Megatron plan's own place them for gathered weights)."""
    from hf_colossal_auto.solve.planner import evaluate_plan

    baseline = "megatron" if kind.startswith("megatron") else hf_tp_plan(model, kind == "experts-tp")
    if kind == "experts-ep":  # attention TP, whole experts per rank (HF's base_model_ep_plan)
        baseline = {**baseline, **model.config.base_model_ep_plan}
    plan = evaluate_plan(model, batch, baseline, num_devices=2, device="cpu", mesh_shape=(1, 2)).plan
    plan.param_use_placements = {
        k: v
        for k, v in plan.param_use_placements.items()
        if ".experts." not in k and kind != "megatron-split"
    }
    if kind == "megatron-split":
        plan = evaluate_plan(model, batch, plan, num_devices=2, device="cpu", pin_uses=True).plan
    return plan


def run_model(spec: str, args: argparse.Namespace, dp_mode: str) -> dict:
    """Plan, apply and train one model (``name`` or ``name@plan``) under ``args`` with ``dp_mode`` on the
    data-parallel axis; the losses and gradient gap against one process."""
    from common import ddp_reference_loss  # here: tests import this script in-process, without its folder

    name, _, plan_kind = spec.partition("@")
    plan_kind = plan_kind or args.plan
    rank, world = dist.get_rank(), dist.get_world_size()
    from hf_colossal_auto import autoparallelize, data_parallel_info, data_parallel_loader, shard_batch
    from hf_colossal_auto.apply import broadcast_plan
    from hf_colossal_auto.models import build_model, make_example_inputs
    from hf_colossal_auto.solve.planner import evaluate_plan
    from hf_colossal_auto.strategies.moe import moe_layer_choices

    dp, tp = (int(x) for x in args.mesh.split("x"))
    torch.manual_seed(0)
    model = build_model(name, device="cpu")
    model.eval()  # no dropout: the comparison is exact
    batch = make_example_inputs(model, args.batch, args.seq, seed=0)
    reference = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    per_replica = args.batch // dp
    replica = rank // tp
    local = {k: v[replica * per_replica : (replica + 1) * per_replica] for k, v in batch.items()}
    before = args.optimizer_before in ("all", dp_mode)
    early = [torch.optim.AdamW(model.parameters(), lr=1e-3)] if before else []
    if plan_kind != "auto":
        made = None
        if rank == 0:
            baseline = "megatron" if plan_kind == "megatron" else hf_tp_plan(model, plan_kind == "experts-tp")
            if plan_kind == "experts-ep":  # attention TP, whole experts per rank (HF's base_model_ep_plan)
                baseline = {**baseline, **model.config.base_model_ep_plan}
            if spec not in _PRICED:  # one pricing per model: the dp modes differ only on the dp axis
                _PRICED[spec] = evaluate_plan(
                    model, batch, baseline, num_devices=world, device="cpu", mesh_shape=(dp, tp)
                ).plan
            made = copy.deepcopy(_PRICED[spec])
            made.dp_mode = dp_mode  # the same placements, the data-parallel axis as asked
            made.dp_shard_size = {"fsdp": dp, "hsdp": args.dp_shard}.get(dp_mode, 1)
            if plan_kind in ("experts-ep", "experts-tp", "megatron"):
                # at these tiny widths the solver gathers stored-split expert weights for use (latency wins);
                # use them as stored, so that the split compute runs
                made.param_use_placements = {
                    k: v for k, v in made.param_use_placements.items() if ".experts." not in k
                }
                made.moe_layers = moe_layer_choices(
                    model, made.param_placements, tp, made.param_use_placements
                )
        autoparallelize(model, plan=broadcast_plan(made), optimizers=early)
    else:  # the batch rule: each process passes its own share of the global batch, as DDP would feed it
        per_process = {k: v[: args.batch // world] for k, v in batch.items()}
        autoparallelize(model, per_process, mesh_shape=(dp, tp), device="cpu", optimizers=early)
    # the group's rows of the global batch, as the documented helpers cut them
    info = data_parallel_info(model)
    assert (info.rank, info.size, info.tp_size) == (replica, dp, tp), info
    assert all(torch.equal(shard_batch(batch, model)[k], local[k]) for k in batch)
    rows = [{k: v[i] for k, v in batch.items()} for i in range(args.batch)]
    loader = data_parallel_loader(torch.utils.data.DataLoader(rows, batch_size=args.batch // world), model)
    assert all(torch.equal(next(iter(loader))[k], local[k]) for k in batch)
    opt = early[0] if early else torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses, ref_losses, worst = [], [], 0.0
    for step in range(args.steps):
        # reference: DDP's loss is the mean of the replicas' mean losses
        ref_loss = ddp_reference_loss(reference, batch, dp)
        ref_loss.backward()
        loss = model(**local).loss
        loss.backward()
        if step == 0:
            for p_ref, p in zip(reference.parameters(), model.parameters(), strict=True):
                grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
                worst = max(worst, float((grad - p_ref.grad).abs().max()))
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        all_losses = [None] * world
        dist.all_gather_object(all_losses, float(loss))
        losses.append(sum(all_losses[r * tp] for r in range(dp)) / dp)
        ref_losses.append(float(ref_loss))
    plan = model._hf_colossal_auto_plan
    result = {
        "model": name,
        "plan": plan_kind,
        "moe_layers": plan.moe_layers,
        "expert_parallel_layers": sorted(
            n for n, m in model.named_modules() if n.endswith(".experts") and "forward" in m.__dict__
        ),
        "mesh": [dp, tp],
        "losses": losses,
        "reference_losses": ref_losses,
        "max_grad_diff": worst,
        "sharded_params": sum(1 for v in plan.param_placements.values() if v[1] != "R"),
        "world": world,
        "param_placements": sorted({str(p.placements) for p in model.parameters() if isinstance(p, DTensor)}),
        "dp_mode": plan.dp_mode,
        "dp_shard_mesh": (
            model._hf_colossal_auto_dp_mesh.mesh.tolist()
            if hasattr(model, "_hf_colossal_auto_dp_mesh")
            else None
        ),
    }
    del model, opt, reference, ref_opt
    dist.barrier()
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="tiny-llama", help="a preset, or several separated by commas")
    parser.add_argument("--mesh", default="1x2")
    parser.add_argument("--batch", type=int, default=4, help="global batch")
    parser.add_argument("--seq", type=int, default=16)
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument(
        "--plan",
        choices=["auto", "megatron", "experts-tp", "experts-replicated", "experts-ep"],
        default="auto",
        help="plan to apply",
    )
    parser.add_argument(
        "--dp-mode",
        default="ddp",
        help="ddp, fsdp, hsdp, or several ('ddp,fsdp': every model under each, in turn)",
    )
    parser.add_argument(
        "--optimizer-before",
        nargs="?",
        const="all",
        choices=["all", "ddp", "fsdp", "hsdp"],
        help="make the optimizer before parallelizing (remapped): for every run, or for that dp mode's only",
    )
    parser.add_argument(
        "--dp-shard", type=int, default=2, help="HSDP: ranks of a shard group (--dp-mode hsdp)"
    )
    parser.add_argument("--out", required=True)
    parser.add_argument(
        "--checkpoint-save",
        default=None,
        help="afterwards, check_checkpoint.py's save phase into this folder",
    )
    args = parser.parse_args()
    # here, not at the top: tests import this module from tests/, where this folder is not on sys.path
    from common import close_gloo, init_gloo, write_results

    transformers.logging.set_verbosity_error()
    init_gloo(timeout_s=120)
    results = [
        run_model(name, args, mode) for mode in args.dp_mode.split(",") for name in args.model.split(",")
    ]
    write_results(results if len(results) > 1 else results[0], args.out)
    if args.checkpoint_save:
        from pathlib import Path

        from check_checkpoint import run_phase  # this folder is on sys.path under torchrun

        run_phase("save", Path(args.checkpoint_save))
    close_gloo(exit_process=True)


if __name__ == "__main__":
    main()
