"""2 gloo ranks: a peft LoRA-wrapped tiny Llama planned and trained by ``autoparallelize`` (DDP on 2 x 1, tensor
parallel on 1 x 2), against the same model trained in one process.

    torchrun --nproc_per_node 2 tests/multiproc/check_lora.py --out result.json

Per mesh, rank 0 writes: the losses of 4 AdamW steps and one process's on the same batch, which parameters
changed (only the LoRA adapters may), the collectives c10d ran in one step (``torch.profiler`` records) and
the plan's predicted ones, and the number of trained parameters.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from common import init_gloo, out_argument, write_results
from torch.distributed.tensor import DTensor
from torch.profiler import ProfilerActivity, profile

from hf_colossal_auto.integrations.process_exit import finish

STEPS = 4


def lora_model() -> torch.nn.Module:
    """tiny-llama with rank-4 LoRA adapters on q and v (gaussian init: B is not zero, so every adapter gets a
    gradient from the first step on), seeded: every rank builds the same model."""
    from peft import LoraConfig, get_peft_model

    from hf_colossal_auto.models import build_model

    torch.manual_seed(0)
    model = build_model("tiny-llama", device="cpu")
    config = LoraConfig(
        r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, init_lora_weights="gaussian"
    )
    return get_peft_model(model, config)


def train(model: torch.nn.Module, batch: dict, profile_first: bool = False) -> tuple[list[float], dict]:
    """``STEPS`` AdamW steps on ``batch``; the collectives of the first one when asked."""
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses, counts = [], {}
    for step in range(STEPS):
        with (
            profile(activities=[ProfilerActivity.CPU]) if profile_first and step == 0 else _nothing() as prof
        ):
            loss = model(**batch).loss
            loss.backward()
        if prof is not None:
            for event in prof.events():
                if event.name.startswith("c10d::") and event.name != "c10d::barrier":
                    counts[event.name] = counts.get(event.name, 0) + 1
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss))
    return losses, counts


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def run_mesh(mesh: tuple[int, int]) -> dict:
    from hf_colossal_auto import autoparallelize
    from hf_colossal_auto.models import make_example_inputs

    model = lora_model()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    torch.manual_seed(1)
    batch = make_example_inputs(model.base_model.model, 4, 32, device="cpu")
    # every rank feeds the same batch, so the global batch (replicas' or TP ranks' batches together) has the
    # same mean loss as one process on it
    reference, _ = train(copy.deepcopy(model), batch)
    modes = {"dp_modes": ("ddp",)} if mesh[0] > 1 else {}  # DDP: one all-reduce per trained parameter
    model = autoparallelize(model, batch, mesh_shape=mesh, micro_batches=1, **modes)
    losses, counts = train(model, batch, profile_first=True)
    changed = {}
    for name, param in model.named_parameters():
        full = param.full_tensor() if isinstance(param, DTensor) else param
        changed[name] = not torch.equal(full.detach(), before[name])
    plan = model._hf_colossal_auto_plan
    return {
        "mesh": list(mesh),
        "dp_mode": plan.dp_mode,
        "losses": losses,
        "reference": reference,
        "changed": sorted(n for n, c in changed.items() if c),
        "trained": sorted(n for n, p in model.named_parameters() if p.requires_grad),
        "collectives": counts,
        "predicted": plan.collectives,
        "sharded": sorted(n for n, p in plan.param_placements.items() if any(x.startswith("S") for x in p)),
    }


def main() -> None:
    out = out_argument()
    init_gloo()
    results = [run_mesh((2, 1)), run_mesh((1, 2))]
    write_results(results, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    finish()  # the run's gloo groups outlive main(): end before interpreter teardown
