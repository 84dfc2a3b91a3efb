"""Run under torchrun (4 gloo ranks): pipeline stages x data or tensor parallelism train like one process.

    torchrun --nproc_per_node 4 tests/multiproc/check_pipeline_dp.py --out result.json

Mesh pp 2 x dp 2 under DDP: a 6-block tiny Llama under 1f1b and GPT-2 (head tied to the embedding, a tie
group per pipeline) under zbv; pp 2 x dp 2 under FSDP inside each stage (Llama, and GPT-2 with its tie
across ranks: both copies sharded alike, 1f1b); pp 2 x tp 2 (Llama,
1f1b) with the planner's Megatron-LM placements of mesh (dp 1, tp 2) and full recompute
(``evaluate_plan`` + ``pipeline_plan_from``). fp32, no dropout, in the user's loop: each data-parallel group
reads its rows of one global batch (``shard_batch``), whose label token counts differ between the groups (the
loss is normalised by the global batch's tokens, the gradients summed over dp). Against one process on the
global batch: the loss and every gradient of the first step, the clipping norm, every parameter after two
AdamW steps, the evaluation logits (the group's rows) and loss; then saved with ``save_pretrained`` (only the
first replica's pipeline sends; sharded stages gathered) and reloaded in one process. Also
``data_parallel_loader``: the two ranks of a pipeline read the same rows, the two groups together plain
accelerate's rows of each step. Rank 0 writes every rank's results.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from check_pipeline import (  # noqa: E402
    LR,
    batches,
    build,
    config,
    grad_norm,
    relative,
    reloaded_equal,
    write_every_rank_and_close,
)


def reference(model, batch: dict, steps: int = 2) -> dict[str, Any]:
    """One process on the global batch: first step's loss, gradients and norm, parameters after ``steps``
    AdamW steps, then the evaluation logits and loss."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    out: dict[str, Any] = {}
    for i in range(steps):
        loss = model(**batch).loss
        loss.backward()
        if i == 0:
            out["loss"], out["norm"] = loss.item(), grad_norm(model)
            out["grads"] = {n: p.grad.clone() for n, p in model.named_parameters(remove_duplicate=False)}
        optimizer.step()
        optimizer.zero_grad()
    out["params"] = {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}
    model.eval()
    with torch.no_grad():
        evaluated = model(**batch)
    out["eval_loss"], out["eval_logits"] = evaluated.loss.item(), evaluated.logits
    return out


def stage_plan(cfg, batch: dict, inside: str, schedule: str, cut: list[int]):
    """The pp 2 plan of the case: ``inside`` each stage "ddp" or "fsdp" over dp 2 (hand-made), or "tp": the
    planner's Megatron-LM plan of mesh (dp 1, tp 2) (``evaluate_plan``, on rank 0) given the stages."""
    from hf_colossal_auto.apply.runtime import plan_on_one_rank
    from hf_colossal_auto.pipeline_layout import hand_pipeline_plan, pipeline_plan_from
    from hf_colossal_auto.solve.planner import evaluate_plan

    model = build(cfg, "meta")
    stages = {"pp_size": 2, "schedule": schedule, "micro_batches": len(cut), "blocks_per_stage": cut}
    if inside != "tp":
        return hand_pipeline_plan(model, batch, dp_size=2, dp_mode=inside, **stages)

    def planned():
        inner = evaluate_plan(
            model, batch, "megatron", num_devices=2, device="cpu", mesh_shape=(1, 2), recompute="full"
        ).plan
        return pipeline_plan_from(inner, model, **stages)

    return plan_on_one_rank(planned, what="pricing the Megatron-LM stage plan")


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor (a parameter sharded by tensor parallelism or FSDP) gathered; a tensor itself."""
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def local_fraction(model) -> float:
    """The share of this rank's stage parameters' elements it stores (1: all whole; FSDP over 2: about 1/2)."""
    from torch.distributed.tensor import DTensor

    params = list(model.parameters())
    local = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in params)
    return local / sum(p.numel() for p in params)


def pipelined(
    preset: str, schedule: str, cut: list[int], directory: str | None, inside: str = "ddp"
) -> dict[str, Any]:
    """The pp 2 model (x dp 2 under DDP or FSDP, x tp 2) in the user's loop on its group's rows, against one
    process."""
    from hf_colossal_auto import data_parallel_info, pipeline_runner, shard_batch
    from hf_colossal_auto.apply.runtime import apply_plan

    started = time.perf_counter()
    cfg = config(preset, sum(cut))
    batch = batches(build(cfg, "meta"))[0]
    ref = reference(build(cfg, "cpu"), batch)
    model = build(cfg, "cpu")
    plan = stage_plan(cfg, batch, inside, schedule, cut)
    apply_plan(model, plan)
    info = data_parallel_info(model)
    local = shard_batch(batch, model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    out: dict[str, Any] = {"info": [info.rank, info.size, info.tp_size, info.pp_size, info.world_size]}
    for i in range(2):
        loss = model(**local).loss
        loss.backward()
        if i == 0:
            out["loss"], out["ref_loss"] = loss.item(), ref["loss"]
            out["grad_err"] = max(
                relative(whole(p.grad), ref["grads"][n]) for n, p in model.named_parameters()
            )
            out["recomputed"] = sum(
                bool(getattr(m, "_hf_colossal_auto_recompute", None)) for m in model.modules()
            )
            out["local_fraction"] = local_fraction(model)
            out["norm"], out["ref_norm"] = float(pipeline_runner(model).clip_grad_norm_(1e9)), ref["norm"]
        optimizer.step()
        optimizer.zero_grad()
    out["param_err_lr"] = max(
        (whole(p.detach()) - ref["params"][n]).abs().max().item() / LR for n, p in model.named_parameters()
    )
    model.eval()
    with torch.no_grad():
        evaluated = model(**local)
    rows = local["input_ids"].shape[0]
    mine = ref["eval_logits"][info.rank * rows : (info.rank + 1) * rows]
    out["eval_loss"], out["ref_eval_loss"] = evaluated.loss.item(), ref["eval_loss"]
    out["eval_logits_err"] = relative(evaluated.logits, mine)
    if directory is not None:
        model.save_pretrained(directory)
        out["saved"] = reloaded_equal(model, directory)
    out["seconds"] = time.perf_counter() - started
    return out


def loader_rows(results: dict) -> None:
    """``data_parallel_loader`` of 32 rows, 2 per process: the rows of this rank's first two steps."""
    from torch.utils.data import DataLoader

    from hf_colossal_auto import data_parallel_loader
    from hf_colossal_auto.apply.runtime import apply_plan
    from hf_colossal_auto.pipeline_layout import hand_pipeline_plan

    cfg = config("tiny-llama", 2)
    model = build(cfg, "cpu")
    plan = hand_pipeline_plan(
        model, batches(model)[0], pp_size=2, dp_size=2, schedule="gpipe", micro_batches=2
    )
    apply_plan(model, plan)
    loader = data_parallel_loader(DataLoader(list(range(32)), batch_size=2), model)
    steps = iter(loader)
    results["loader rows"] = [next(steps).tolist() for _ in range(2)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    started = time.perf_counter()
    saving = ("gpt2 tied zbv", "llama fsdp 1f1b", "llama tp 1f1b", "gpt2 tied fsdp 1f1b")
    directory = [
        tempfile.mkdtemp(prefix="pipeline-dp-save-") if dist.get_rank() == 0 else None for _ in saving
    ]
    dist.broadcast_object_list(directory)
    results: dict[str, Any] = {
        "llama 1f1b": pipelined("tiny-llama", "1f1b", [4, 2], None),
        "gpt2 tied zbv": pipelined("tiny-gpt2", "zbv", [1, 1, 1, 1], directory[0]),
        "llama fsdp 1f1b": pipelined("tiny-llama", "1f1b", [2, 1], directory[1], inside="fsdp"),
        "llama tp 1f1b": pipelined("tiny-llama", "1f1b", [1, 2], directory[2], inside="tp"),
        "gpt2 tied fsdp 1f1b": pipelined("tiny-gpt2", "1f1b", [1, 1], directory[3], inside="fsdp"),
    }
    loader_rows(results)
    results["total_seconds"] = time.perf_counter() - started
    write_every_rank_and_close(results, args.out)


if __name__ == "__main__":
    main()
