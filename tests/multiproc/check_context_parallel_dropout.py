"""Run under torchrun (4 ranks): dropout under context parallelism draws as one process would, in distribution.

    torchrun --nproc_per_node 4 tests/multiproc/check_context_parallel_dropout.py --out result.json

Tiny GPT-2 with its default dropout (embeddings, attention probabilities, residuals: 0.1), in train mode, on two
meshes of the 4 ranks: dp 2 x cp 2 (no tensor parallelism: plain tensors) and cp 2 x tp 2 (the Megatron
placements, a cp axis added). Every rank seeds its generator alike (``set_seed(seed)`` without
``device_specific``: the case where a cp rank left to itself draws the other cp rank's masks for its different
tokens). Each plan runs one forward + backward, without and with every block recomputed, recording every
dropout draw (``bernoulli_``, the CPU dropout's mask) with its placement and this rank's local mask. Rank 0
writes, per mesh, every rank's coordinates, masks, whether its generator came back unchanged, and the
largest gradient difference between the recomputed run and the other.
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist
import transformers
from common import close_gloo, init_gloo, out_argument, write_results
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from hf_colossal_auto.integrations.process_exit import finish

DROPOUT = 0.1
SEQ = 64
ROWS = 2  # per replica
SEED = 1234


class DropoutMasks(TorchDispatchMode):
    """Every ``bernoulli_`` draw (the mask of CPU dropout) of the forward: its placement and this rank's local
    mask (True where kept)."""

    def __init__(self) -> None:
        super().__init__()
        self.masks: list[tuple[str, torch.Tensor]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket is torch.ops.aten.bernoulli_:
            placement = str(out.placements) if isinstance(out, DTensor) else "plain"
            local = out.to_local() if isinstance(out, DTensor) else out
            self.masks.append((placement, local.detach().bool().clone()))
        return out


def _model():
    from hf_colossal_auto.models import build_model, load_config

    config = load_config("tiny-gpt2")
    config.resid_pdrop = config.embd_pdrop = config.attn_pdrop = DROPOUT
    torch.manual_seed(0)
    return build_model(config, device="cpu").train()


def _plan(model, batch, dp: int, cp: int, tp: int):
    from hf_colossal_auto.apply import broadcast_plan
    from hf_colossal_auto.apply.context_parallel import hand_context_parallel_plan, with_context_parallel
    from hf_colossal_auto.solve.planner import evaluate_plan

    made = None
    if dist.get_rank() == 0:
        if tp == 1:
            made = hand_context_parallel_plan(model, batch, cp_size=cp, dp_size=dp)
        else:
            base = evaluate_plan(model, batch, "megatron", num_devices=tp, device="cpu", mesh_shape=(1, tp))
            made = with_context_parallel(base.plan, cp)
    return broadcast_plan(made)


def _grads(model) -> list[torch.Tensor]:
    return [p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad for p in model.parameters()]


def run(dp: int, cp: int, tp: int, recompute: bool) -> dict:
    """One forward + backward of the planned model from one seed on every rank: the masks drawn, the gradients,
    whether this rank's generator is back where it was."""
    from hf_colossal_auto.apply import apply_plan
    from hf_colossal_auto.apply.data import shard_batch
    from hf_colossal_auto.models import make_example_inputs

    model = _model()
    batch = make_example_inputs(model, ROWS * dp, SEQ, seed=0)
    plan = _plan(model, batch, dp, cp, tp)
    if recompute:
        plan.recompute = {f"transformer.h.{i}": "full" for i in range(model.config.n_layer)}
    apply_plan(model, plan)
    mesh = model._hf_colossal_auto_mesh
    names = mesh.mesh_dim_names
    coords = {n: (mesh.get_local_rank(n) if n in names else 0) for n in ("dp", "cp", "tp")}
    local = shard_batch(batch, model)
    torch.manual_seed(SEED)  # alike on every rank
    before = torch.get_rng_state()
    spy = DropoutMasks()
    with spy:
        loss = model(**local).loss
    loss.backward()
    result = {
        **coords,
        "rank": dist.get_rank(),
        "masks": [(p, m.tolist()) for p, m in spy.masks],
        "generator_unchanged": torch.equal(before, torch.get_rng_state()),
        "grads": _grads(model),
    }
    del model, loss
    dist.barrier()
    return result


def case(dp: int, cp: int, tp: int) -> list[dict]:
    """Both runs of one mesh on every rank; each rank's record (masks of the run without recompute, the largest
    gradient and mask difference of the recomputed run against it), gathered."""
    plain = run(dp, cp, tp, recompute=False)
    again = run(dp, cp, tp, recompute=True)
    record = {k: v for k, v in plain.items() if k != "grads"}
    record["recompute_grad_diff"] = max(
        float((a - b).abs().max()) for a, b in zip(plain["grads"], again["grads"], strict=True)
    )
    record["recompute_same_masks"] = plain["masks"] == again["masks"]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, record)
    return gathered


def main() -> None:
    out = out_argument()
    transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)
    init_gloo(timeout_s=300)
    started = time.perf_counter()
    results = {"dp2-cp2": case(2, 2, 1), "cp2-tp2": case(1, 2, 2)}
    results["seconds"] = time.perf_counter() - started
    write_results(results, out)
    close_gloo()


if __name__ == "__main__":
    os.environ.setdefault("HF_COLOSSAL_AUTO_NO_CALIBRATE", "1")
    main()
    finish()  # the run's gloo groups outlive main(): end before interpreter teardown
