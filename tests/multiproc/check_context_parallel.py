"""Run under torchrun: context parallelism (a ``cp`` mesh axis) against one process, several models per launch.

    torchrun --nproc_per_node 2 tests/multiproc/check_context_parallel.py --tp 1 --out result.json
    torchrun --nproc_per_node 4 tests/multiproc/check_context_parallel.py --tp 2 --out result.json

The world is ``cp x tp`` (one data-parallel replica). Every rank builds the same seeded model, a plan for the
``(1, tp)`` part (DDP on one device, or the Megatron placements on ``tp``) gets a cp axis of ``world / tp``
ranks (:func:`~hf_colossal_auto.apply.context_parallel.with_context_parallel`), and every rank is fed the same
whole rows, as the batch rule says. Rank 0 writes per case: the loss, the one-process loss, the largest
logits and gradient differences (the gathered logits include the chunk-boundary tokens), the per-rank
positions. Cases: GPT-2 (learned positions, tied head), Llama (RoPE, GQA) with padding and labels ignored
around the chunk boundaries, Llama on packed sequences (position ids that restart), Qwen2 (GQA) with a
sliding window shorter than the sequence, eager attention; then the refusals (a sequence the balanced layout
cannot cut, flash attention's packed offsets), each raised on every rank.
"""

from __future__ import annotations

import argparse
import copy
import json
import os

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


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
    if tp == 1:
        return evaluate_plan(model, batch, "ddp", num_devices=1, device="cpu").plan
    return evaluate_plan(model, batch, "megatron", num_devices=tp, device="cpu", mesh_shape=(1, tp)).plan


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def run_case(name: str, kind: str, attention: str, tp: int, seq: int) -> dict:
    from hf_colossal_auto.apply import apply_plan, broadcast_plan
    from hf_colossal_auto.apply.context_parallel import balanced_positions, with_context_parallel
    from hf_colossal_auto.apply.data import data_parallel_info, shard_batch

    world, rank = dist.get_world_size(), dist.get_rank()
    cp = world // tp
    model = build(name, attention)
    batch = make_batch(model, 2, seq, kind)
    reference = copy.deepcopy(model)
    ref = reference(**batch)
    windowless = None
    if name.endswith("-window"):  # the window changes one process's result, so the test sees it
        windowless = float((build("tiny-qwen2", attention)(**batch).logits - ref.logits).abs().max())
    ref.loss.backward()
    plan = with_context_parallel(base_plan(model, batch, tp), cp) if rank == 0 else None
    plan = broadcast_plan(plan)
    apply_plan(model, plan)
    info = data_parallel_info(model)
    assert (info.size, info.cp_size, info.tp_size, info.group_processes) == (1, cp, tp, world), info
    assert all(torch.equal(shard_batch(batch, model)[k], v) for k, v in batch.items())  # cp ranks: same rows
    out = model(**batch)
    out.loss.backward()
    grad_diff = max(
        float((full(p.grad) - p_ref.grad).abs().max())
        for p, p_ref in zip(model.parameters(), reference.parameters(), strict=True)
    )
    cp_rank = model._hf_colossal_auto_mesh.get_local_rank("cp")
    result = {
        "model": name,
        "kind": kind,
        "attention": attention,
        "mesh": list(plan.mesh_shape),
        "loss": float(out.loss),
        "reference_loss": float(ref.loss),
        "logits_diff": float((out.logits - ref.logits).abs().max()),
        "logits_shape": list(out.logits.shape),
        "max_grad_diff": grad_diff,
        "positions": balanced_positions(seq, cp, cp_rank).tolist(),
        "sharded_params": sum(isinstance(p, DTensor) for p in model.parameters()),
        "window_effect": windowless,
    }
    gathered = [None] * world
    dist.all_gather_object(gathered, result)
    del model, reference, out, ref
    dist.barrier()
    return {**gathered[0], "ranks": gathered}


def refused(name: str, tp: int, seq: int, what: str) -> dict:
    """Apply a cp plan and feed (or set) what must be refused; every rank's error message."""
    from hf_colossal_auto.apply import apply_plan, broadcast_plan
    from hf_colossal_auto.apply.context_parallel import with_context_parallel

    world = dist.get_world_size()
    model = build(name)
    batch = make_batch(model, 2, seq, "plain")
    plan = broadcast_plan(
        with_context_parallel(base_plan(model, batch, tp), world // tp) if dist.get_rank() == 0 else None
    )
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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--seq", type=int, default=16)
    parser.add_argument("--refusals", action="store_true")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    cases = [
        ("tiny-gpt2", "plain", "sdpa"),
        ("tiny-llama", "padded", "sdpa"),
        ("tiny-llama", "packed", "sdpa"),
        ("tiny-qwen2-window", "plain", "sdpa"),
        ("tiny-qwen2", "padded", "eager"),
    ]
    results = [run_case(name, kind, attention, args.tp, args.seq) for name, kind, attention in cases]
    if args.refusals:
        for what, seq in (("odd-length", args.seq - 2), ("flash", args.seq), ("offsets", args.seq)):
            results.append(refused("tiny-llama", args.tp, seq, what))
        results.append(refused("tiny-llama", args.tp, args.seq, "one-rank-odd"))
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("HF_COLOSSAL_AUTO_NO_CALIBRATE", "1")
    main()
