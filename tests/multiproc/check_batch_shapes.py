"""A plan that splits the batch over the tensor-parallel axis, fed a batch that does not split (the last,
smaller batch of an epoch or an eval set): the step must still run and equal one process's.

    torchrun --nproc_per_node 2 tests/multiproc/check_batch_shapes.py --out D/result.json

GPT-2 (vocab 768, batch 4 x 64 per process, mesh 1 x 2): the solver keeps the residual stream and the loss
split over the batch on the tensor-parallel axis. Then 3 rows: a no-grad loss and a training step's loss and
gradients, against the unplanned model. Rank 0 writes the figures. ``check`` runs it in a job whose process group
is up already (check_failures.py's ``--batch-shapes``).
"""

from __future__ import annotations

import copy
import json

import torch
import torch.distributed as dist
from common import init_gloo, out_argument
from torch.distributed.tensor import DTensor

from hf_colossal_auto.integrations.process_exit import finish


def check(out: str) -> None:
    """The check on the initialized process group (2 ranks); rank 0 writes the figures to ``out``."""
    from hf_colossal_auto import autoparallelize, build_model, load_config, make_example_inputs

    config = load_config("tiny-gpt2")
    config.vocab_size = 768
    for name in ("resid_pdrop", "embd_pdrop", "attn_pdrop"):
        setattr(config, name, 0.0)  # exact comparison: no dropout
    torch.manual_seed(0)
    model = build_model(config, device="cpu")
    reference = copy.deepcopy(model)
    autoparallelize(model, make_example_inputs(model, 4, 64), mesh_shape=(1, 2), device="cpu")
    plan = model._hf_colossal_auto_plan
    batch_split = sorted(k for k, v in plan.activation_placements.items() if v[1] == "S0")
    odd = make_example_inputs(reference, 3, 64, seed=1)
    with torch.no_grad():
        eval_losses = [float(reference(**odd).loss), float(model(**odd).loss)]
    want, got = reference(**odd).loss, model(**odd).loss
    want.backward()
    got.backward()
    worst = 0.0
    for p_ref, p in zip(reference.parameters(), model.parameters(), strict=True):
        grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        worst = max(worst, float((grad - p_ref.grad).abs().max()))
    if dist.get_rank() == 0:
        result = {
            "batch_split_modules": batch_split,
            "eval_losses": eval_losses,
            "train_losses": [float(want), float(got)],
            "max_grad_diff": worst,
        }
        with open(out, "w") as f:
            json.dump(result, f)
    del model, reference
    dist.barrier()


def main() -> None:
    out = out_argument()
    init_gloo()
    check(out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    finish()  # the run's gloo groups outlive main(): end before interpreter teardown
