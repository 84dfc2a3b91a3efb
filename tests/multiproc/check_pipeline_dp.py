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
accelerate's rows of each step. Also gradient accumulation with the first micro-step inside ``model.no_sync()``:
the dp all-reduce deferred to the last backward, the gradients one process's; and the Trainer's contract
(``num_items_in_batch`` of the window, the loss times dp). Rank 0 writes every rank's results.
"""

from __future__ import annotations

import contextlib
import math
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
)
from common import init_gloo, out_argument, p2p_by_peer, write_every_rank_and_close  # noqa: E402

from hf_colossal_auto._torch_compat import recording_point_to_point
from hf_colossal_auto.integrations.process_exit import finish


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


PRICED_INSIDE: dict[str, tuple[str, dict[str, Any]]] = {
    "hsdp": ("fsdp", {"mesh_shape": (4, 1), "dp_mode": "hsdp", "dp_shard_size": 2}),
    "fsdp-tp": ("megatron", {"mesh_shape": (2, 2), "dp_mode": "fsdp", "recompute": "full"}),
    "tp-sp": ("megatron-sp-local", {"mesh_shape": (1, 2), "recompute": "full"}),
}
"""Stage layouts priced with the pipeline by ``evaluate_plan``: on 8 ranks (``check_pipeline_8.py``) HSDP over
dp 4 (shard groups of 2, two replicas), and FSDP over dp 2 times Megatron-LM tensor parallelism over tp 2; on 4,
Megatron-LM's tensor parallelism with its sequence parallelism over tp 2, attention and MLP on local shards
(torchtitan's TP plan, and the kind of layout the planner chooses at scale): its blocks return sequence shards,
so the stages send them (``Plan.sequence_sharded_sends``)."""


def stage_plan(cfg, batch: dict, inside: str, schedule: str, cut: list[int]):
    """The pp 2 plan of the case: ``inside`` each stage "ddp" or "fsdp" over dp 2 (hand-made), "tp": the
    planner's Megatron-LM plan of mesh (dp 1, tp 2) (``evaluate_plan``, on rank 0) given the stages, or one of
    :data:`PRICED_INSIDE` (8 ranks), priced with its stages by ``evaluate_plan``."""
    from hf_colossal_auto.apply.runtime import plan_on_one_rank
    from hf_colossal_auto.pipeline_layout import hand_pipeline_plan, pipeline_plan_from
    from hf_colossal_auto.solve.planner import evaluate_plan

    model = build(cfg, "meta")
    stages = {"pp_size": 2, "schedule": schedule, "micro_batches": len(cut), "blocks_per_stage": cut}
    if inside in PRICED_INSIDE:
        baseline, options = PRICED_INSIDE[inside]

        def priced():
            return evaluate_plan(
                model,
                batch,
                baseline,
                num_devices=2 * math.prod(options["mesh_shape"]),
                device="cpu",
                pipeline=2,
                schedule=schedule,
                micro_batches=len(cut),
                blocks_per_stage=cut,
                **options,
            ).plan

        return plan_on_one_rank(priced, what=f"pricing the {inside} stage plan")
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


def full_state_dict_equal(model, cfg) -> dict[str, bool]:
    """``consolidated_state_dict`` of the pipelined model (stages sharded by FSDP or tp gathered whole): one
    process's keys in order, and each tensor this rank holds equal to its own gathered one (the ranks together
    check every key)."""
    from hf_colossal_auto.apply import consolidated_state_dict

    full = consolidated_state_dict(model)
    held = {k: whole(v) for k, v in model.state_dict().items()}
    return {
        "keys_in_order": list(full) == list(build(cfg, "meta").state_dict()),
        "equal": all(torch.equal(full[k], v) for k, v in held.items()),
    }


def local_fraction(model) -> float:
    """The share of this rank's stage parameters' elements it stores (1: all whole; FSDP over 2: about 1/2)."""
    from torch.distributed.tensor import DTensor

    params = list(model.parameters())
    local = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in params)
    return local / sum(p.numel() for p in params)


@contextlib.contextmanager
def gathers_before_forward(model):
    """Yields ``[FSDP units, units whose all-gather was issued (async) before any unit's training forward]``,
    filled in as the context exits: the pipeline runtime issues every stage's gathers as the schedule starts."""
    from torch.distributed.fsdp import FSDPModule

    from hf_colossal_auto import pipeline_runner

    stages = pipeline_runner(model).stages  # each an FSDP root over its blocks' units
    units = [m for stage in stages for m in stage.modules() if isinstance(m, FSDPModule)]
    issued: set[int] = set()
    forwarded: list[bool] = [False]
    original = FSDPModule.unshard

    def unshard(self, async_op: bool = False):
        if async_op and not forwarded[0]:
            issued.add(id(self))
        return original(self, async_op=async_op)

    def training_forward(*_: object) -> None:  # not the MoE counting pass's (no gradients, resharded after)
        forwarded[0] = forwarded[0] or torch.is_grad_enabled()

    hooks = [m.register_forward_pre_hook(training_forward) for m in units]
    counts = [len(units), 0]
    FSDPModule.unshard = unshard
    try:
        yield counts
    finally:
        FSDPModule.unshard = original
        for hook in hooks:
            hook.remove()
        counts[1] = len(issued)


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
    recorder = recording_point_to_point()
    for i in range(2):
        second = i == 1  # the second step: shapes inferred, FSDP2 set up
        with (
            recorder if second else contextlib.nullcontext(),
            gathers_before_forward(model) if second else contextlib.nullcontext() as gathers,
        ):
            loss = model(**local).loss
        if gathers is not None:
            out["gathered_before_forward"] = gathers
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
    errors = {
        n: (whole(p.detach()) - ref["params"][n]).abs().max().item() / LR for n, p in model.named_parameters()
    }
    if "point_to_point" in plan.solver:  # a priced plan: its sends and receives by peer, as simulated
        out["sequence_sharded_sends"] = plan.sequence_sharded_sends
        out["measured_p2p"], out["predicted_p2p"] = p2p_by_peer(
            recorder.records, plan.solver["point_to_point"], model
        )
    out["local_modules"] = len(plan.local_modules)
    out["param_err_lr"] = max(errors.values())
    out["param_err_at"] = max(errors, key=errors.get)  # which parameter, for a failure's message
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
        out["full_state_dict"] = full_state_dict_equal(model, cfg)
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


def deferred_accumulation(results: dict) -> None:
    """Gradient accumulation over two micro-steps, the first inside ``model.no_sync()`` (what
    ``accelerator.accumulate`` enters): no gradient is all-reduced over dp until the second step's backward,
    which reduces both; the gradients equal one process's on the same global halves (``loss / 2`` each)."""
    from hf_colossal_auto import data_parallel_info, pipeline_runner, shard_batch
    from hf_colossal_auto.apply.runtime import apply_plan
    from hf_colossal_auto.pipeline_layout import hand_pipeline_plan

    cfg = config("tiny-llama", 4)
    batch = batches(build(cfg, "meta"))[0]
    model = build(cfg, "cpu")
    plan = hand_pipeline_plan(model, batch, pp_size=2, dp_size=2, schedule="1f1b", micro_batches=2)
    apply_plan(model, plan)
    info, runner = data_parallel_info(model), pipeline_runner(model)
    local = shard_batch(batch, model)
    rows = local["input_ids"].shape[0] // 2
    halves = [{k: v[:rows] for k, v in local.items()}, {k: v[rows:] for k, v in local.items()}]
    # one process on the global halves: half i is every replica's local half i, in replica order
    size = batch["input_ids"].shape[0] // info.size
    reference = build(cfg, "cpu")
    for i in range(2):
        picked = [g * size + i * rows + r for g in range(info.size) for r in range(rows)]
        (reference(**{k: v[picked] for k, v in batch.items()}).loss / 2).backward()
    want = dict(reference.named_parameters())
    reduced: list[int] = []
    all_reduce = dist.all_reduce

    def counting(tensor, *args, **kwargs):  # gradient-sized all-reduces over dp
        if kwargs.get("group") is runner.dp_group and tensor.dim() > 0:
            reduced.append(tensor.numel())
        return all_reduce(tensor, *args, **kwargs)

    dist.all_reduce = counting
    try:
        with model.no_sync():
            (model(**halves[0]).loss / 2).backward()
        unsynced = (len(reduced), sum(p.grad is not None for p in model.parameters()))
        (model(**halves[1]).loss / 2).backward()
    finally:
        dist.all_reduce = all_reduce
    results["deferred accumulation"] = {
        "during_no_sync": unsynced,
        "reduced": len(reduced),
        "params": len(list(model.parameters())),
        "grad_err": max(relative(p.grad, want[n].grad) for n, p in model.named_parameters()),
    }


def trainer_contract(results: dict) -> None:
    """What transformers' Trainer does under a pp x dp plan: ``num_items_in_batch`` = the label tokens of the
    whole accumulation window over every replica, each micro-step's loss multiplied by the replicas (DDP's
    averaging undone), the first micro-step inside ``no_sync``. The gradients equal one process's on the global
    batch, and the replicas' mean of the summed micro-step losses is its loss (what the Trainer logs)."""
    from hf_colossal_auto import data_parallel_info, shard_batch
    from hf_colossal_auto.apply.runtime import apply_plan
    from hf_colossal_auto.pipeline_layout import hand_pipeline_plan

    cfg = config("tiny-llama", 4)
    batch = batches(build(cfg, "meta"))[1]
    reference = build(cfg, "cpu")
    ref_loss = reference(**batch).loss
    ref_loss.backward()
    want = dict(reference.named_parameters())
    model = build(cfg, "cpu")
    plan = hand_pipeline_plan(model, batch, pp_size=2, dp_size=2, schedule="gpipe", micro_batches=2)
    apply_plan(model, plan)
    dp = data_parallel_info(model).size
    local = shard_batch(batch, model)
    rows = local["input_ids"].shape[0] // 2
    halves = [{k: v[:rows] for k, v in local.items()}, {k: v[rows:] for k, v in local.items()}]
    count = (batch["labels"][:, 1:] != -100).sum()  # the Trainer gathers it from every process
    logged = torch.zeros(())
    for i, half in enumerate(halves):
        context = model.no_sync() if i == 0 else contextlib.nullcontext()
        with context:
            loss = model(**half, num_items_in_batch=count).loss * dp
            loss.backward()
        logged += loss.detach()
    dist.all_reduce(logged)  # the Trainer's mean over processes: each replica's value on its pp ranks
    results["trainer contract"] = {
        "logged": logged.item() / dist.get_world_size(),
        "ref_loss": ref_loss.item(),
        "grad_err": max(relative(p.grad, want[n].grad) for n, p in model.named_parameters()),
    }


def main() -> None:
    out = out_argument()
    init_gloo(timeout_s=120)
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
        # sequence parallelism: the stages send each tp rank's sequence shard (half the hidden states)
        "llama tp-sp 1f1b": pipelined("tiny-llama", "1f1b", [2, 2], None, inside="tp-sp"),
        # GPT-2: a later stage adds zeros for the positions to the shard it receives; its head tied across ranks
        "gpt2 tied tp-sp 1f1b": pipelined("tiny-gpt2", "1f1b", [1, 1], None, inside="tp-sp"),
        "gpt2 tied fsdp 1f1b": pipelined("tiny-gpt2", "1f1b", [1, 1], directory[3], inside="fsdp"),
        # MoE with its router aux loss: counts over both dp groups, the aux loss on DTensors in the last stage
        "mixtral fsdp interleaved-zero-bubble": pipelined(
            "tiny-mixtral", "interleaved-zero-bubble", [1, 1, 1, 1], None, inside="fsdp"
        ),
    }
    loader_rows(results)
    deferred_accumulation(results)
    trainer_contract(results)
    results["total_seconds"] = time.perf_counter() - started
    write_every_rank_and_close(results, out)


if __name__ == "__main__":
    main()
    finish()  # the run's gloo groups outlive main(): end before interpreter teardown
