"""Run under torchrun: context parallelism (a ``cp`` mesh axis) against one process, several models per launch.

    torchrun --nproc_per_node 2 tests/multiproc/check_context_parallel.py --tp 1 --out result.json
    torchrun --nproc_per_node 4 tests/multiproc/check_context_parallel.py --tp 2 --out result.json

The world is ``cp x tp`` (one data-parallel replica; ``--dp-case`` adds dp 2 x cp). Every rank builds the same
seeded model; the plan is ``hand_context_parallel_plan`` without tp, or the Megatron placements on ``tp`` with a
cp axis of ``world / tp`` ranks added (``with_context_parallel``); every rank of a replica is fed the same whole
rows, as the batch rule says. Rank 0 writes per case: the loss, the one-process loss, the largest
logits and gradient differences (the gathered logits include the chunk-boundary tokens), the per-rank
positions. Cases: GPT-2 (learned positions, tied head), Llama (RoPE, GQA) with padding and labels ignored
around the chunk boundaries, Llama on packed sequences (position ids that restart) with every block
recomputed (attention reruns in backward), Qwen2 (GQA) with a
sliding window shorter than the sequence (blocked and recomputed; again on the mask path), eager attention; causal
attention without padding or documents runs blocked, without a mask (each case reports its calls); then the
refusals (a sequence the balanced layout
cannot cut, flash attention's packed offsets), each raised on every rank.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import functools
import os
import tempfile
import time

import torch
import torch.distributed as dist
from common import close_gloo, init_gloo, write_results
from torch.distributed.tensor import DTensor

from hf_colossal_auto.integrations.process_exit import finish


def qwen2_config(**extra):
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        use_cache=False,
        **extra,
    )


def build(name: str, attention: str = "sdpa"):
    from hf_colossal_auto.models import build_model

    torch.manual_seed(0)
    if name == "tiny-qwen2-window":  # the second layer slides a 6-token window over 16 tokens
        config = qwen2_config(use_sliding_window=True, sliding_window=6, max_window_layers=1)
    elif name == "tiny-qwen2":
        config = qwen2_config()
    else:
        config = name
    model = build_model(config, device="cpu", attn_implementation=attention)
    model.eval()  # no dropout: the comparison is exact
    return model


def make_batch(model, rows: int, seq: int, kind: str) -> dict[str, torch.Tensor]:
    """Token ids and labels; ``padded``: the second row right-padded, labels ignored on both sides of every
    chunk boundary of the first row; ``packed``: documents of 5, 7 and 4 tokens in one row (position ids
    restart, no padding mask)."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (rows, seq), generator=g)
    batch = {"input_ids": ids, "labels": ids.clone()}
    if kind == "padded":
        mask = torch.ones_like(ids)
        mask[1, seq - 5 :] = 0
        batch["labels"][1, seq - 5 :] = -100
        batch["labels"][0, [3, 4, 7, 8]] = -100
        batch["attention_mask"] = mask
    elif kind == "packed":
        lengths = [5, 7, seq - 12]
        batch["position_ids"] = torch.cat([torch.arange(n) for n in lengths])[None].expand(rows, seq)
    return batch


def base_plan(model, batch, tp: int):
    from hf_colossal_auto.solve.planner import evaluate_plan

    batch = {k: v for k, v in batch.items() if k != "position_ids"}  # the plan is the same for packed rows
    return evaluate_plan(model, batch, "megatron", num_devices=tp, device="cpu", mesh_shape=(1, tp)).plan


def cp_plan(model, batch, tp: int, cp: int, dp: int = 1):
    """Without tp the hand-made plan (no trace); with it the Megatron placements on tp, a cp axis added."""
    from hf_colossal_auto.apply.context_parallel import hand_context_parallel_plan, with_context_parallel

    if tp == 1:
        return hand_context_parallel_plan(model, batch, cp_size=cp, dp_size=dp)
    return with_context_parallel(base_plan(model, batch, tp), cp)


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def run_case(
    name: str,
    kind: str,
    attention: str,
    tp: int,
    seq: int,
    dp: int = 1,
    recompute: bool = False,
    blocked: bool = True,
) -> dict:
    """One model on a ``dp x cp x tp`` mesh: each replica's loss, logits and the gradients (DDP's: the mean of
    the replicas' losses) against one process on the replica's or the global rows. ``blocked`` False keeps
    every attention call on the mask path (the blocked, mask-free path is the default where it applies)."""
    from common import all_gathers, ddp_reference_loss  # this script's folder is on the path under torchrun

    from hf_colossal_auto.apply import apply_plan, broadcast_plan
    from hf_colossal_auto.apply.context_parallel import balanced_positions
    from hf_colossal_auto.apply.data import data_parallel_info, shard_batch

    world, rank = dist.get_world_size(), dist.get_rank()
    cp = world // (tp * dp)
    model = build(name, attention)
    batch = make_batch(model, 2 * dp, seq, kind)
    reference = copy.deepcopy(model)
    plan = cp_plan(model, batch, tp, cp, dp) if rank == 0 else None
    plan = broadcast_plan(plan)
    if recompute:  # every block checkpointed: attention reruns in backward, K/V gathered again
        plan.recompute = {f"model.layers.{i}": "full" for i in range(model.config.num_hidden_layers)}
    apply_plan(model, plan)
    model._hf_colossal_auto_context_parallel.blocked = blocked
    info = data_parallel_info(model)
    assert (info.size, info.cp_size, info.tp_size, info.group_processes) == (dp, cp, tp, cp * tp), info
    assert info.rank == rank // (cp * tp), info
    mine = shard_batch(batch, model)  # the replica's rows, whole sequences, on each of its cp x tp ranks
    assert all(torch.equal(v, batch[k][2 * info.rank : 2 * info.rank + 2]) for k, v in mine.items())
    ref = reference(**mine)
    windowless = None
    if name.endswith("-window"):  # the window changes one process's result, so the test sees it
        windowless = float((build("tiny-qwen2", attention)(**mine).logits - ref.logits).abs().max())
    ddp_reference_loss(reference, batch, dp).backward()
    with all_gathers() as loss_only:  # what a training step reads: the K/V gathers only, no logits
        out = model(**mine)
        layout = model._hf_colossal_auto_context_parallel.layout
        calls = {"attention_calls": layout.attention_calls, "blocked_calls": layout.blocked_calls}
        out.loss.backward()
    grad_diff = max(
        float((full(p.grad) - p_ref.grad).abs().max())
        for p, p_ref in zip(model.parameters(), reference.parameters(), strict=True)
    )
    with all_gathers() as first_read:  # the read tag, then the logits
        logits = out.logits
    with all_gathers() as reads_again:  # every other way of reading them: gathered once
        same = out["logits"] is logits and out[1] is logits and out.to_tuple()[1] is logits
        same = same and dict(out)["logits"] is logits and out.get("logits") is logits
    cp_rank = model._hf_colossal_auto_mesh.get_local_rank("cp")
    result = {
        "model": name,
        "kind": kind,
        "attention": attention,
        "mesh": list(plan.mesh_shape),
        "loss": float(out.loss),
        "reference_loss": float(ref.loss),
        "logits_diff": float((logits - ref.logits).abs().max()),
        "logits_shape": list(logits.shape),
        "gathers_loss_only": loss_only,
        "gathers_first_read": first_read,
        "gathers_read_again": reads_again,
        "read_once": same,
        "kv_gathers": 2 * model.config.num_hidden_layers * (2 if recompute else 1),
        "output_class": [type(out).__name__, type(ref).__name__, isinstance(out, type(ref))],
        "max_grad_diff": grad_diff,
        "positions": balanced_positions(seq, cp, cp_rank).tolist(),
        "sharded_params": sum(isinstance(p, DTensor) for p in model.parameters()),
        "window_effect": windowless,
        "blocked": blocked,
        **calls,
        "recomputed": sorted(
            n for n, m in model.named_modules() if getattr(m, "_hf_colossal_auto_recompute", None)
        ),
    }
    gathered = [None] * world
    dist.all_gather_object(gathered, result)
    del model, reference, out, ref, logits
    dist.barrier()
    return {**gathered[0], "ranks": gathered}


def _step_batch(model, rows: int, seq: int, step: int) -> dict[str, torch.Tensor]:
    """Step ``step``'s rows: the padded batch with other tokens each step (so AdamW's second step differs)."""
    batch = make_batch(model, rows, seq, "padded")
    batch["input_ids"] = (batch["input_ids"] + 7 * step) % model.config.vocab_size
    batch["labels"] = torch.where(batch["labels"] == -100, -100, batch["input_ids"])
    return batch


def _shard_layout(model) -> dict:
    """This rank's share of every parameter under FSDP: per parameter, the fraction of its tensor-parallel part
    (the whole parameter, or its shard on tp) this rank stores, and its local elements."""
    fractions, local = {}, {}
    for name, p in model.named_parameters():
        mine = p.to_local().numel() if isinstance(p, DTensor) else p.numel()
        names = p.device_mesh.mesh_dim_names if isinstance(p, DTensor) else ()
        tp_split = 1
        if "tp" in names and p.placements[names.index("tp")].is_shard():
            tp_split = p.device_mesh.size(names.index("tp"))
        local[name] = mine
        fractions[name] = mine * tp_split / p.numel()
    return {"fractions": fractions, "local_numel": local}


def run_fsdp_case(
    seq: int, dp: int, tp: int = 1, steps: int = 2, lr: float = 1e-2, eps: float = 1e-6
) -> dict:
    """Llama (padded rows) under FSDP over the ``dp x cp`` ranks (:func:`cp_plan` with dp_mode "fsdp"; with
    ``tp`` > 1 the parameters are 2-D DTensors, FSDP's over dp x cp and the Megatron placements on tp):
    ``steps`` AdamW steps; each step's loss and gradients, and the parameters after, against one process on the
    global rows (DDP's loss: the mean of the replicas' mean losses); how much of each parameter a rank stores."""
    from dataclasses import replace

    from common import ddp_reference_loss

    from hf_colossal_auto.apply import apply_plan, broadcast_plan
    from hf_colossal_auto.apply.data import shard_batch

    world, rank = dist.get_world_size(), dist.get_rank()
    cp = world // (dp * tp)
    model = build("tiny-llama")
    reference = copy.deepcopy(model)
    first = _step_batch(model, 2 * dp, seq, 0)
    plan = cp_plan(model, first, tp, cp, dp) if rank == 0 else None
    plan = broadcast_plan(replace(plan, dp_mode="fsdp") if plan is not None else None)
    apply_plan(model, plan)
    # AdamW's eps above fp32's rounding of near-zero gradients, which its first step would blow up to +-lr
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, eps=eps)
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=lr, eps=eps)
    layout = _shard_layout(model)
    losses, ref_losses, grad_diffs, unread = [], [], [], []
    for step in range(steps):
        batch = _step_batch(model, 2 * dp, seq, step)
        out = model(**shard_batch(batch, model))
        out.loss.backward()
        # FSDP2's post-forward hooks visit every output tensor: they saw this rank's, not the lazy logits
        unread.append(type(out.__dict__["logits"]).__name__ == "PendingField")
        ref_loss = ddp_reference_loss(reference, batch, dp)
        ref_loss.backward()
        grad_diffs.append(
            max(
                float((full(p.grad) - p_ref.grad).abs().max())
                for p, p_ref in zip(model.parameters(), reference.parameters(), strict=True)
            )
        )
        # the replica's loss (every cp rank's is the replica's): its mean over dp is the reference's
        loss = out.loss.detach().clone()
        dist.all_reduce(loss)
        losses.append(float(loss) / world)
        ref_losses.append(float(ref_loss))
        for opt in (optimizer, ref_optimizer):
            opt.step()
            opt.zero_grad()
    param_diff_lr = max(  # in units of the learning rate (what one step may move a parameter)
        float((full(p.detach()) - p_ref.detach()).abs().max()) / lr
        for p, p_ref in zip(model.parameters(), reference.parameters(), strict=True)
    )
    result = {
        "fsdp_mesh": list(plan.mesh_shape),
        "logits_unread": unread,
        "losses": losses,
        "ref_losses": ref_losses,
        "grad_diffs": grad_diffs,
        "param_diff_lr": param_diff_lr,
        "fractions": layout["fractions"],
        "numel": {n: p.numel() for n, p in model.named_parameters()},
        "local_numel": layout["local_numel"],
    }
    gathered = [None] * world
    dist.all_gather_object(gathered, result)
    del model, reference, optimizer, ref_optimizer, out
    dist.barrier()
    return {**gathered[0], "ranks": gathered}


def planned_case(seq: int, kind: str = "plain", dp_modes: tuple[str, ...] = ("fsdp",)) -> dict:
    """A plan the planner makes with cp over every rank (``plan_model(context_parallel=world, dp_modes=...)``)
    for ``kind`` rows (``padded``: a padding mask, every layer on the mask path), applied: one process's loss
    and gradients."""
    from hf_colossal_auto.apply import apply_plan
    from hf_colossal_auto.apply.data import shard_batch
    from hf_colossal_auto.apply.runtime import plan_on_one_rank
    from hf_colossal_auto.solve.planner import plan_model

    world = dist.get_world_size()
    model = build("tiny-llama")
    reference = copy.deepcopy(model)
    batch = make_batch(model, 2, seq, kind)
    make = functools.partial(  # a copy: the model applied stays as built (plan_model traces its own)
        plan_model, copy.deepcopy(model), batch, num_devices=world, device="cpu", context_parallel=world,
        dp_modes=dp_modes,
    )  # fmt: skip
    plan = plan_on_one_rank(make)
    apply_plan(model, plan)
    out = model(**shard_batch(batch, model))
    out.loss.backward()
    ref = reference(**batch)
    ref.loss.backward()
    result = {
        "planned": {"mesh": list(plan.mesh_shape), "dp_mode": plan.dp_mode, "cp": plan.cp_size, "kind": kind},
        "loss": float(out.loss),
        "reference_loss": float(ref.loss),
        "max_grad_diff": max(
            float((full(p.grad) - p_ref.grad).abs().max())
            for p, p_ref in zip(model.parameters(), reference.parameters(), strict=True)
        ),
        "sharded": all(isinstance(p, DTensor) for p in model.parameters()),
    }
    del model, reference, out
    dist.barrier()
    return result


def refused(name: str, tp: int, seq: int, what: str) -> dict:
    """Apply a cp plan and feed (or set) what must be refused; every rank's error message."""
    from hf_colossal_auto.apply import apply_plan, broadcast_plan

    world = dist.get_world_size()
    model = build(name)
    batch = make_batch(model, 2, seq, "plain")
    plan = broadcast_plan(cp_plan(model, batch, tp, world // tp) if dist.get_rank() == 0 else None)
    message = None
    try:
        if what == "flash":
            model.config._attn_implementation = "flash_attention_2"
            apply_plan(model, plan)
        else:
            apply_plan(model, plan)
            if what == "offsets":
                batch["cu_seq_lens_q"] = torch.tensor([0, seq])
            elif what == "one-rank-odd" and dist.get_rank() == 1:  # only rank 1's are cut: all must stop
                batch = {k: v[:, :-1] for k, v in batch.items()}
            model(**batch)
    except ValueError as exc:
        message = f"{type(exc).__name__}: {exc}"
    messages = [None] * world
    dist.all_gather_object(messages, message)
    del model
    dist.barrier()
    return {"refusal": what, "messages": messages}


def first_call_batches(tp: int) -> dict:
    """The batch a replica computes on when a plan is made from the model's first call: every rank's own rows
    gathered over the replica's cp x tp ranks (``TensorParallelBatch``), whole sequences."""
    from hf_colossal_auto.apply import apply_plan, broadcast_plan
    from hf_colossal_auto.integrations.first_call import TensorParallelBatch

    world, rank = dist.get_world_size(), dist.get_rank()
    model = build("tiny-llama")
    batch = make_batch(model, 2, 16, "plain")
    plan = broadcast_plan(cp_plan(model, batch, tp, world // tp) if rank == 0 else None)
    apply_plan(model, plan)
    mine = {"input_ids": batch["input_ids"] + rank, "labels": batch["labels"] + rank}
    gathered, rows = TensorParallelBatch(model).gather(mine)
    again, _ = TensorParallelBatch(model).gather(mine)  # a second group over the same mesh
    expected = torch.cat([batch["input_ids"] + r for r in range(world)])
    del model
    dist.barrier()
    return {
        "first_call_rows": rows,
        "first_call_union": torch.equal(gathered["input_ids"], expected)
        and torch.equal(again["input_ids"], expected),
    }


LR = 1e-2


def accelerator_loop(directory: str, dp_mode: str = "ddp") -> dict:
    """An ordinary accelerate loop under ``AutoParallelAccelerator`` with a cp plan file
    (``HF_COLOSSAL_AUTO_PLAN_PATH``): per-process batches of 2 rows of 16 tokens, gradient accumulation 2,
    clipping, two optimizer steps, an evaluation gathered for metrics; against one process on the union of
    the processes' batches (what the replica's cp ranks compute on). ``dp_mode``: the plan's (FSDP: sharded
    over the cp ranks, accumulation by FSDP2's deferred gradient sync)."""
    from common import accumulating_loop  # this script's folder is on the path under torchrun
    from torch.utils.data import DataLoader, default_collate

    from hf_colossal_auto import AutoParallelAccelerator

    world = dist.get_world_size()
    model = build("tiny-llama")
    model.train()
    ids = torch.randint(0, model.config.vocab_size, (16, 16), generator=torch.Generator().manual_seed(2))
    rows = [{"input_ids": r, "labels": r.clone()} for r in ids]
    path = os.path.join(directory, "plan.json")
    if dist.get_rank() == 0:
        plan = cp_plan(model, default_collate(rows[: 2 * world]), 1, world)
        dataclasses.replace(plan, dp_mode=dp_mode).save(path)
    dist.barrier()
    os.environ["HF_COLOSSAL_AUTO_PLAN_PATH"] = path
    reference = copy.deepcopy(model)
    accelerator = AutoParallelAccelerator(cpu=True, gradient_accumulation_steps=2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    loader = DataLoader(rows, batch_size=2, collate_fn=default_collate)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    losses, norms, seen, batch = accumulating_loop(accelerator, model, optimizer, loader)
    model.eval()
    with torch.no_grad():
        argmax = accelerator.gather_for_metrics(model(**batch).logits.argmax(-1))
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=LR)
    ref_losses, ref_norms = [], []
    group = 2 * world
    for step in range(len(rows) // group):
        ref_batch = default_collate(rows[step * group : (step + 1) * group])
        loss = reference(**ref_batch).loss
        (loss / 2).backward()
        ref_losses.append(loss.item())
        if step % 2 == 1:
            ref_norms.append(float(torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)))
            ref_opt.step()
            ref_opt.zero_grad()
    reference.eval()
    with torch.no_grad():
        ref_argmax = reference(**ref_batch).logits.argmax(-1)
    unwrapped = accelerator.unwrap_model(model)
    ref_params = dict(reference.named_parameters())
    result = {
        "losses": losses,
        "ref_losses": ref_losses,
        "norms": norms,
        "ref_norms": ref_norms,
        "param_err_lr": max(
            float((p.detach() - ref_params[n]).abs().max()) / LR for n, p in unwrapped.named_parameters()
        ),
        "gathered_equal": torch.equal(argmax, ref_argmax),
        "rows": seen,
        "plan_cp": accelerator.auto_plan.cp_size,
        "plan_dp_mode": accelerator.auto_plan.dp_mode,
    }
    del model, optimizer, loader, unwrapped
    accelerator.wait_for_everyone()
    return result


def uneven_reads(seq: int) -> dict:
    """Lazy outputs read unlike on the cp ranks, each stopped by name: rank 0 reads the logits where rank 1
    reads the hidden states (both raise, naming both); then only rank 0 reads (logging on the main process):
    it raises after ``HF_COLOSSAL_AUTO_CP_READ_TIMEOUT_S``, and rank 1 then completes its pending exchange
    (over a side group, so that the launch goes on); then both read alike and get one process's logits."""
    from hf_colossal_auto.apply import apply_plan, broadcast_plan
    from hf_colossal_auto.apply.context_parallel_attention import CP_ATTR, ContextParallelError

    world, rank = dist.get_world_size(), dist.get_rank()
    model = build("tiny-llama")
    reference = copy.deepcopy(model)
    batch = make_batch(model, 2, seq, "plain")
    plan = broadcast_plan(cp_plan(model, batch, 1, world) if rank == 0 else None)
    apply_plan(model, plan)
    out = model(**batch, output_hidden_states=True)
    mismatch = None
    try:
        _ = out.logits if rank == 0 else out.hidden_states
    except ContextParallelError as exc:
        mismatch = str(exc)
    side = dist.new_group(backend="gloo")
    out = model(**batch)
    alone, waited = None, None
    os.environ["HF_COLOSSAL_AUTO_CP_READ_TIMEOUT_S"] = "2"
    try:
        if rank == 0:
            started = time.perf_counter()
            try:
                _ = out.logits
            except ContextParallelError as exc:
                alone, waited = str(exc), time.perf_counter() - started
            dist.barrier(group=side)
        else:
            dist.barrier(group=side)  # rank 0 has given up: complete the exchange it left pending
            tag = torch.zeros(3, dtype=torch.int64)
            dist.all_gather_into_tensor(tag.new_empty(3 * world), tag, group=getattr(model, CP_ATTR).group)
    finally:
        del os.environ["HF_COLOSSAL_AUTO_CP_READ_TIMEOUT_S"]
    out = model(**batch)
    alike = float((out.logits - reference(**batch).logits).abs().max())
    messages = [None] * world
    dist.all_gather_object(messages, {"mismatch": mismatch, "alone": alone, "waited": waited})
    del model, reference, out
    dist.barrier()
    return {"uneven_reads": messages, "alike_logits_diff": alike}


def mixed_precision_reads(directory: str) -> dict:
    """``AutoParallelAccelerator(mixed_precision="bf16")`` with a cp plan file: accelerate wraps the forward in
    autocast and ``convert_outputs_to_fp32`` (which reads every field); the outputs are deferred after it, so
    a step that reads only the loss gathers no logits, and the logits read are fp32, whole, one process's."""
    from accelerate.state import AcceleratorState, GradientState
    from common import all_gathers  # this script's folder is on the path under torchrun
    from torch.utils.data import default_collate

    from hf_colossal_auto import AutoParallelAccelerator

    world = dist.get_world_size()
    AcceleratorState._reset_state()  # the earlier loops' accelerator ran without mixed precision
    GradientState._reset_state()
    model = build("tiny-llama")
    reference = copy.deepcopy(model)
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(3))
    batch = {"input_ids": ids, "labels": ids.clone()}
    path = os.path.join(directory, "plan-bf16.json")
    if dist.get_rank() == 0:
        cp_plan(
            model, default_collate([{k: v[i] for k, v in batch.items()} for i in range(2)]), 1, world
        ).save(path)
    dist.barrier()
    os.environ["HF_COLOSSAL_AUTO_PLAN_PATH"] = path
    accelerator = AutoParallelAccelerator(cpu=True, mixed_precision="bf16")
    model = accelerator.prepare(model)
    with all_gathers() as loss_only:
        out = model(**batch)
        accelerator.backward(out.loss)
    with all_gathers() as first_read:
        logits = out.logits
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = reference(**batch)
    result = {
        "bf16_gathers_loss_only": loss_only,
        "bf16_gathers_first_read": first_read,
        "bf16_logits": [str(logits.dtype), list(logits.shape)],
        "bf16_logits_err": float((logits - ref.logits.float()).abs().max() / ref.logits.float().abs().max()),
        "bf16_loss": [float(out.loss), float(ref.loss)],
        # accelerate's autocast and fp32 wrapper inside the model's call (they see this rank's output)
        "bf16_wrapped": [accelerator.native_amp, "_original_forward" in model.__dict__],
        "kv_gathers": 2 * reference.config.num_hidden_layers,
        "vocab": reference.config.vocab_size,
    }
    del model, out, logits
    accelerator.wait_for_everyone()
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--dp-case", action="store_true", help="also Llama (padded) on dp 2 x cp (world / 2)")
    parser.add_argument("--seq", type=int, default=16)
    parser.add_argument("--refusals", action="store_true")
    parser.add_argument("--cases", default="all", help="'all' or a comma list of indices into the cases")
    parser.add_argument(
        "--accelerate",
        default="",
        help="also the AutoParallelAccelerator loop, per dp_mode in this comma list (ddp, fsdp)",
    )
    parser.add_argument(
        "--fsdp",
        default="",
        help="also Llama under FSDP: a comma list of DP:TP meshes (cp: the rest of the world)",
    )
    parser.add_argument("--planned-fsdp", action="store_true", help="also a planner-made cp plan under FSDP")
    parser.add_argument(
        "--planned-padded", action="store_true", help="also a planner-made cp plan for padded rows (DDP)"
    )
    parser.add_argument("--no-first-call", action="store_true", help="skip the first-call batches check")
    parser.add_argument(
        "--reads",
        action="store_true",
        help="also reads unlike on the cp ranks, and reads under bf16 accelerate",
    )
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    init_gloo()
    cases = [  # model, inputs, attention, every block recomputed, blocked (mask-free) attention where it applies
        ("tiny-gpt2", "plain", "sdpa", False, True),
        ("tiny-llama", "padded", "sdpa", False, True),
        ("tiny-llama", "packed", "sdpa", True, True),
        ("tiny-qwen2-window", "plain", "sdpa", True, True),
        ("tiny-qwen2", "padded", "eager", False, True),
        ("tiny-qwen2-window", "plain", "sdpa", False, False),
    ]
    if args.cases != "all":
        cases = [cases[int(i)] for i in args.cases.split(",") if i]
    started = time.perf_counter()
    results = [
        run_case(name, kind, attention, args.tp, args.seq, recompute=recompute, blocked=blocked)
        for name, kind, attention, recompute, blocked in cases
    ]
    if args.dp_case:
        results.append(run_case("tiny-llama", "padded", "sdpa", 1, args.seq, dp=2))
    for mesh in filter(None, args.fsdp.split(",")):
        dp, tp = (int(n) for n in mesh.split(":"))
        results.append({"fsdp": run_fsdp_case(args.seq, dp, tp)})
    if args.planned_fsdp:
        results.append(planned_case(args.seq))
    if args.planned_padded:
        results.append(planned_case(args.seq, "padded", ("ddp",)))
    if not args.no_first_call:
        results.append(first_call_batches(args.tp))
    if args.refusals:
        for what, seq in (("odd-length", args.seq - 2), ("flash", args.seq), ("offsets", args.seq)):
            results.append(refused("tiny-llama", args.tp, seq, what))
        results.append(refused("tiny-llama", args.tp, args.seq, "one-rank-odd"))
    for dp_mode in filter(None, args.accelerate.split(",")):
        directory = [tempfile.mkdtemp(prefix="cp-plan-") if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(directory)
        results.append({"accelerate": accelerator_loop(directory[0], dp_mode)})
    if args.reads:
        results.append(uneven_reads(args.seq))
        directory = [tempfile.mkdtemp(prefix="cp-plan-") if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(directory)
        results.append({"mixed_precision": mixed_precision_reads(directory[0])})
    results.append({"total_seconds": time.perf_counter() - started})
    write_results(results, args.out)
    close_gloo()


if __name__ == "__main__":
    os.environ.setdefault("HF_COLOSSAL_AUTO_NO_CALIBRATE", "1")
    main()
    finish()  # the run's gloo groups outlive main(): end before interpreter teardown
