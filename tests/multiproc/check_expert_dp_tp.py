"""Run under torchrun (4 gloo ranks): expert parallelism over the data-parallel axis of a 2 x 2 mesh, with the
attention split Megatron-style over the tensor-parallel axis — a hand-made plan (the planner offers expert
parallelism over dp on (dp, 1) meshes only).

    torchrun --nproc_per_node 4 tests/multiproc/check_expert_dp_tp.py --out result.json

Rank 0 writes every rank's loss and largest first-step gradient difference against one process on the whole
batch (the mean of the replicas' losses).
"""

from __future__ import annotations

import copy
import json

import torch
import torch.distributed as dist
import transformers
from common import close_gloo, ddp_reference_loss, every_rank, init_gloo, out_argument
from torch.distributed.tensor import DTensor


def main() -> None:
    out = out_argument()
    transformers.logging.set_verbosity_error()
    init_gloo(timeout_s=120)
    from hf_colossal_auto import autoparallelize
    from hf_colossal_auto.apply import broadcast_plan
    from hf_colossal_auto.capture.moe import experts_modules
    from hf_colossal_auto.models import build_model, make_example_inputs
    from hf_colossal_auto.solve.planner import evaluate_plan

    rank, dp, tp = dist.get_rank(), 2, 2
    torch.manual_seed(0)
    model = build_model("tiny-mixtral", device="cpu")
    model.eval()
    reference = copy.deepcopy(model)
    batch = make_example_inputs(model, 4, 16, seed=0)
    made = None
    if rank == 0:
        made = evaluate_plan(model, batch, "megatron", num_devices=4, device="cpu", mesh_shape=(dp, tp)).plan
        made.expert_data_parallel = sorted(experts_modules(model))
        for fqn in made.expert_data_parallel:
            for name in ("gate_up_proj", "down_proj"):
                made.param_placements[f"{fqn}.{name}"] = ["S0", "R"]
        made.param_use_placements = {
            k: v for k, v in made.param_use_placements.items() if ".experts." not in k
        }
    autoparallelize(model, plan=broadcast_plan(made))
    replica = rank // tp
    local = {k: v[replica * 2 : (replica + 1) * 2] for k, v in batch.items()}
    loss = model(**local).loss
    loss.backward()
    ref_loss = ddp_reference_loss(reference, batch, dp)
    ref_loss.backward()
    worst = 0.0
    for p_ref, p in zip(reference.parameters(), model.parameters(), strict=True):
        grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        worst = max(worst, float((grad - p_ref.grad).abs().max()))
    gathered = every_rank({"loss": float(loss.detach()), "max_grad_diff": worst})
    if rank == 0:
        with open(out, "w") as f:
            json.dump(
                {"ranks": gathered, "reference_loss": float(ref_loss), "moe_layers": made.moe_layers}, f
            )
    close_gloo(exit_process=True)


if __name__ == "__main__":
    main()
