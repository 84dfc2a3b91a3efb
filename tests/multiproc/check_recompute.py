"""Run under torchrun: a plan whose memory budget forces activation recompute, applied and measured.

    torchrun --nproc_per_node 2 tests/multiproc/check_recompute.py --case tiny-gpt2:1x2:ddp:0.6 \
        --case tiny-llama:2x1:ddp:0.7 --out r.json

Each ``--case`` (model, mesh, data-parallel mode, budget fraction) runs one after the other in the same
processes: one launch, whose process start and imports cost more than a tiny case, pays for all. For each, rank
0 prices the model without recompute, sets the budget to ``--fraction`` of that peak and plans jointly
(sharding + recompute) under it; every rank applies the broadcast plan, runs one warm-up step (so that the
optimizer state exists, the steady state the planner prices) and one step under ``MemTracker``. Each rank
writes its measured peak, the plan's prediction, and the loss / largest gradient difference against the
same model run on the whole batch in one process: ``<out>.rank<r>`` holds the list of its cases' results.
"""

from __future__ import annotations

import argparse
import copy
import functools

import torch
import torch.distributed as dist
import transformers
from common import close_gloo, init_gloo, write_results
from torch.distributed.tensor import DTensor


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        if p.grad is not None:
            g = p.grad
            out[name] = g.full_tensor() if isinstance(g, DTensor) else g
    return out


def run_case(spec: str, args: argparse.Namespace) -> dict:
    """Plan ``spec`` (``model:DPxTP:dp_mode:fraction``) under its budget, apply it, and measure a step."""
    from common import measured_step_peak, plan_at_fraction

    from hf_colossal_auto.apply import apply_plan
    from hf_colossal_auto.apply.runtime import plan_on_one_rank
    from hf_colossal_auto.models import build_model, make_example_inputs

    name, mesh, dp_mode, fraction = spec.split(":")
    rank, world = dist.get_rank(), dist.get_world_size()
    dp, tp = (int(x) for x in mesh.split("x"))
    torch.manual_seed(0)
    model = build_model(name, device="cpu")
    model.eval()  # no dropout: the comparison with one process is exact
    batch = make_example_inputs(model, args.batch, args.seq, seed=0)
    reference = copy.deepcopy(model)
    plan = plan_on_one_rank(
        functools.partial(
            plan_at_fraction,
            model,
            batch,
            mesh=(dp, tp),
            dp_mode=dp_mode,
            fraction=float(fraction),
            recompute=args.recompute,
        )
    )
    per_replica = args.batch // dp
    replica = rank // tp
    # copies, as a data loader hands each rank its rows: a view keeps the whole global batch's storage alive, which
    # the measured peak counted (6,144 B at tiny Llama's 8 x 64 batch: three int64 inputs twice their size)
    local = {k: v[replica * per_replica : (replica + 1) * per_replica].clone() for k, v in batch.items()}
    apply_plan(model, plan)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)

    ref_loss = reference(**batch).loss
    ref_loss.backward()
    ref_grads = _grads(reference)

    loss = model(**local).loss  # warm-up step: the optimizer state comes to exist
    loss.backward()
    grads = _grads(model)
    loss_value = loss.detach().clone()
    dist.all_reduce(loss_value)
    loss_value /= world  # tensor-parallel ranks hold the same loss; the mean over data-parallel replicas
    del loss
    grad_err = max((grads[k] - ref_grads[k]).abs().max().item() for k in ref_grads)
    opt.step()
    opt.zero_grad(set_to_none=True)

    # The lowest of three steps' peaks (measured_step_peak says why: gloo's worker releases a collective's tensors
    # late on a loaded machine; a 1 MiB backward temporary still alive at one rank's peak in about one run in ten)
    peaks = [measured_step_peak(model, opt, local, repeats=1) for _ in range(3)]
    peak = min(peaks)
    result = {
        "case": spec,
        "rank": rank,
        "measured_peak": peak,
        "measured_peaks": peaks,
        "predicted_peak": plan.peak_memory_bytes,
        "budget": plan.memory_budget_bytes,
        "recompute": plan.recompute,
        "mesh": list(plan.mesh_shape),
        "loss": loss_value.item(),
        "ref_loss": ref_loss.item(),
        "max_grad_err": grad_err,
        "step_time_s": plan.step_time_s,
    }
    del model, opt, reference, grads, ref_grads
    dist.barrier()
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--case",
        action="append",
        required=True,
        help="model:DPxTP:ddp|fsdp:fraction (budget / peak without recompute); repeat for several",
    )
    parser.add_argument("--batch", type=int, default=8, help="global batch")
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--recompute", default="auto", help="planner recompute mode")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)
    init_gloo(timeout_s=300)
    results = [run_case(spec, args) for spec in args.case]
    write_results(results, args.out, per_rank=True)
    close_gloo(exit_process=True)


if __name__ == "__main__":
    main()
