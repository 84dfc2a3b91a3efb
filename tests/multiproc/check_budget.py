"""Run under torchrun: for several model families and meshes, a plan under a budget below the no-recompute
peak, applied and measured on a real step.

    torchrun --nproc_per_node 2 tests/multiproc/check_budget.py --out budget.json [--cases opt:2x1,opt:1x2]

For each family and mesh, rank 0 prices the model without recompute on that mesh, sets the budget to
``--fraction`` of that peak and plans jointly (sharding + recompute) under it; every rank applies the
broadcast plan to the same model and feeds it what the planner priced: the planner takes the *global* batch, so
on a ``dp x tp`` mesh data-parallel replica ``d`` runs rows ``d*B/dp .. (d+1)*B/dp`` and the ``tp`` ranks of a
replica run the same rows. One warm-up step makes the optimizer state exist (the steady state the planner
prices), then one step runs under ``MemTracker``. Rank 0 writes every rank's measured peak next to the plan's
prediction and budget. One launch covers every case: a process group costs seconds on a shared CPU box.
"""

from __future__ import annotations

import argparse
import functools

import torch
import torch.distributed as dist
import transformers
from common import close_gloo, every_rank, init_gloo, write_results
from transformers import PretrainedConfig

# Small configs of families the planner has no preset for, each with a block shape of its own: OPT (learned
# positions with an offset, blocks ending in a view), Qwen2 (grouped-query attention with q/k/v biases),
# GPT-NeoX (fused qkv, parallel residual, partial rotary), BART (encoder-decoder, learned positions).
# Dropout off: DTensor's random ops refuse CPU generators, and a tensor-parallel run could not drop the same
# units on both ranks.
FAMILIES = ("opt", "qwen2", "gpt_neox", "bart")
# Every family data-parallel; OPT (the family the issue saw over its budget) also tensor-parallel. A
# tensor-parallel plan takes ~40 s to solve on a shared 2-core box, so the others are left to ``--cases``.
CASES = (*(f"{family}:2x1" for family in FAMILIES), "opt:1x2")
SEQ = {"bart": 256}  # BART's targets are a quarter of the source: a longer source makes recompute pay off


def family_config(family: str) -> PretrainedConfig:
    """A 4-block model of ``family`` (2 encoder + 2 decoder blocks for BART), width 64, vocabulary 512."""
    common = dict(vocab_size=512, max_position_embeddings=256)
    if family == "opt":
        return transformers.OPTConfig(
            hidden_size=64,
            num_hidden_layers=4,
            ffn_dim=256,
            num_attention_heads=4,
            word_embed_proj_dim=64,
            dropout=0.0,
            attention_dropout=0.0,
            **common,
        )
    if family == "qwen2":
        return transformers.Qwen2Config(
            hidden_size=64,
            num_hidden_layers=4,
            intermediate_size=256,
            num_attention_heads=4,
            num_key_value_heads=2,
            **common,
        )
    if family == "gpt_neox":
        return transformers.GPTNeoXConfig(
            hidden_size=64, num_hidden_layers=4, intermediate_size=256, num_attention_heads=4, **common
        )
    if family == "bart":
        return transformers.BartConfig(
            d_model=64,
            encoder_layers=2,
            decoder_layers=2,
            encoder_attention_heads=4,
            decoder_attention_heads=4,
            encoder_ffn_dim=256,
            decoder_ffn_dim=256,
            dropout=0.0,
            attention_dropout=0.0,
            activation_dropout=0.0,
            **common,
        )
    raise ValueError(f"unknown family {family!r}; known: {FAMILIES}")


def run_case(family: str, mesh: str, batch_size: int, seq: int, fraction: float) -> dict:
    """Plan ``family`` on ``mesh`` at ``fraction`` of its no-recompute peak, run one measured step; this
    rank's figures."""
    from common import measured_step_peak, plan_at_fraction

    from hf_colossal_auto.apply import apply_plan
    from hf_colossal_auto.apply.runtime import plan_on_one_rank
    from hf_colossal_auto.models import build_model, make_example_inputs

    rank = dist.get_rank()
    dp, tp = (int(x) for x in mesh.split("x"))
    torch.manual_seed(0)
    model = build_model(family_config(family), device="cpu")
    batch = make_example_inputs(model, batch_size, SEQ.get(family, seq), seed=0)
    plan = plan_on_one_rank(
        functools.partial(
            plan_at_fraction, model, batch, mesh=(dp, tp), dp_mode="ddp", fraction=fraction, recompute="auto"
        )
    )
    per_replica = batch_size // dp
    replica = rank // tp
    # This rank's rows in storages of their own, as a loader would hand them over: a slice would keep (and
    # MemTracker would count, once the runtime views it) the whole global batch's storage.
    local = {k: v[replica * per_replica : (replica + 1) * per_replica].clone() for k, v in batch.items()}
    del batch
    apply_plan(model, plan)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)

    model(**local).loss.backward()  # warm-up step: the optimizer state comes to exist
    opt.step()
    opt.zero_grad(set_to_none=True)

    peak = measured_step_peak(model, opt, local)
    return {
        "family": family,
        "mesh": mesh,
        "rank": rank,
        "rows": [replica * per_replica, (replica + 1) * per_replica],
        "measured_peak": peak,
        "predicted_peak": plan.peak_memory_bytes,
        "budget": plan.memory_budget_bytes,
        "recompute": plan.recompute,
        "plan_mesh": list(plan.mesh_shape),
    }


def run_autoparallelize_case(batch_size: int, seq: int, fraction: float) -> dict:
    """The README's torchrun loop under ``autoparallelize(model, batch, memory_budget=...)`` at ``fraction`` of
    the free plan's peak (OPT; no mesh, mode or micro-batch count given): the plan it hands over must run one
    forward and one backward per batch under the budget — or planning must raise InfeasibleError. Then the same
    plan with ``micro_batches=2``: a training forward of the whole batch must raise WholeBatchError naming
    ``accumulate``, and the ``accumulate`` loop must run. This rank's figures."""
    import dataclasses

    from common import measured_step_peak

    from hf_colossal_auto import InfeasibleError, accumulate, autoparallelize, shard_batch
    from hf_colossal_auto.apply.micro_batch import WholeBatchError
    from hf_colossal_auto.apply.runtime import plan_on_one_rank
    from hf_colossal_auto.solve.planner import plan_model

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = build_opt()
    global_batch = make_inputs(model, batch_size, seq)
    per_process = {
        k: v[rank * batch_size // world : (rank + 1) * batch_size // world] for k, v in global_batch.items()
    }
    free = plan_on_one_rank(
        functools.partial(
            plan_model, model, global_batch, num_devices=world, device="cpu", memory_budget=1 << 40,
            recompute="none", micro_batches=1,
        )
    )  # fmt: skip
    budget = int(free.peak_memory_bytes * fraction)
    record: dict = {"rank": rank, "budget": budget, "free_peak": free.peak_memory_bytes}
    fresh = build_opt()
    try:
        autoparallelize(model, per_process, memory_budget=budget)
    except InfeasibleError as exc:
        return {**record, "infeasible": str(exc)}
    plan = model._hf_colossal_auto_plan
    local = {k: v.clone() for k, v in shard_batch(global_batch, model).items()}  # data_parallel_loader's rows
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    model(**local).loss.backward()  # warm-up step: the optimizer state comes to exist
    opt.step()
    opt.zero_grad(set_to_none=True)
    record.update(
        measured_peak=measured_step_peak(model, opt, local),
        predicted_peak=plan.peak_memory_bytes,
        micro_batches=plan.micro_batches,
        plan_mesh=list(plan.mesh_shape),
        dp_mode=plan.dp_mode,
        rows=_rows(local),
    )
    del model, opt
    autoparallelize(fresh, plan=dataclasses.replace(plan, micro_batches=2))
    try:
        fresh(**local).loss.backward()
        record["whole_batch_error"] = None
    except WholeBatchError as exc:
        record["whole_batch_error"] = str(exc)
    with torch.no_grad():
        fresh(**local)  # evaluation of the whole batch is not training: allowed
    pieces = 0
    for micro in accumulate(fresh, local):
        (fresh(**micro.inputs).loss * micro.weight).backward()
        pieces += 1
    record["accumulate_pieces"] = pieces
    del fresh
    dist.barrier()
    return record


def build_opt():
    """The OPT of :func:`family_config`, seeded, on CPU."""
    from hf_colossal_auto.models import build_model

    torch.manual_seed(0)
    return build_model(family_config("opt"), device="cpu")


def make_inputs(model, batch_size: int, seq: int) -> dict:
    from hf_colossal_auto.models import make_example_inputs

    return make_example_inputs(model, batch_size, seq, seed=0)


def _rows(batch: dict) -> int:
    return next(v.shape[0] for v in batch.values() if isinstance(v, torch.Tensor))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--cases", default=",".join(CASES), help="family:dpxtp, comma-separated ('' for none)"
    )
    parser.add_argument("--batch", type=int, default=16, help="global batch")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--fraction", type=float, default=0.6, help="budget / peak without recompute")
    parser.add_argument("--out", required=True)
    parser.add_argument(
        "--autoparallelize-out", default=None, help="then run_autoparallelize_case, its records here"
    )
    args = parser.parse_args()
    transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)
    init_gloo(timeout_s=300)
    results = []
    for case in filter(None, args.cases.split(",")):
        family, mesh = case.split(":")
        results.append(run_case(family, mesh, args.batch, args.seq, args.fraction))
    write_results([r for per_rank in every_rank(results) for r in per_rank], args.out, indent=1)
    if args.autoparallelize_out:
        record = run_autoparallelize_case(args.batch, args.seq, args.fraction)
        write_results(every_rank(record), args.autoparallelize_out, indent=1)
    close_gloo(exit_process=True)


if __name__ == "__main__":
    main()
