"""Run under torchrun (2 ranks): a planned Qwen2 with ``use_cache`` on trains, generates, and trains on.

    torchrun --nproc_per_node 2 tests/multiproc/check_generate.py --out result.json

For a tensor-parallel plan (Megatron placements, 1 x 2, every block recomputed) and a data-parallel one
(auto, 2 x 1), each on its own seeded tiny Qwen2 next to an unplanned copy in the same process, the same
sequence runs on both: a training step, greedy ``generate()`` in eval mode, a training step after switching
back, a no-grad eval loss on a batch of another shape, and a training step on that shape. Rank 0 writes the
losses and generated tokens of both; every rank asserts its own generated rows equal the reference's.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import transformers
from common import close_gloo, init_gloo, out_argument, write_results
from torch.distributed.tensor import DTensor
from transformers import Qwen2Config, Qwen2ForCausalLM

VOCAB = 128


def _tiny_qwen2() -> Qwen2ForCausalLM:
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        use_cache=True,  # the default of Qwen2 configs; the runtime must cope with the cache it makes
    )
    torch.manual_seed(0)
    return Qwen2ForCausalLM(config).train()  # dropout 0: exact comparison in train mode


def _batch(rows: int, seq: int, seed: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (rows, seq), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids.clone()}


def _scenario(mesh: tuple[int, int], plan_kind: str) -> dict:
    from hf_colossal_auto import autoparallelize
    from hf_colossal_auto.apply import broadcast_plan
    from hf_colossal_auto.solve.planner import evaluate_plan

    rank = dist.get_rank()
    dp, tp = mesh
    model = _tiny_qwen2()
    reference = copy.deepcopy(model)
    first, other = _batch(4, 16, seed=1), _batch(4, 10, seed=2)  # global batches
    replica = rank // tp

    def local(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        rows = next(iter(batch.values())).shape[0] // dp
        return {k: v[replica * rows : (replica + 1) * rows] for k, v in batch.items()}

    if plan_kind == "megatron":
        made = None
        if rank == 0:
            made = evaluate_plan(model, first, "megatron", num_devices=2, device="cpu", mesh_shape=mesh).plan
            made.recompute = {f"model.layers.{i}": "full" for i in range(len(model.model.layers))}
        autoparallelize(model, plan=broadcast_plan(made))
    else:
        autoparallelize(model, local(first), mesh_shape=mesh, device="cpu")  # one process's batch
    plan = model._hf_colossal_auto_plan
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3)

    def train_step(batch: dict[str, torch.Tensor]) -> tuple[float, float]:
        losses = []
        for m, o, b in ((model, opt, local(batch)), (reference, ref_opt, batch)):
            loss = m(**b).loss
            loss.backward()
            o.step()
            o.zero_grad(set_to_none=True)
            losses.append(_replica_mean(float(loss), dp, tp) if m is model else float(loss))
        return losses[0], losses[1]

    losses, ref_losses = [], []
    for step, batch in (
        ("train", first),
        ("generate", first),
        ("train", first),
        ("eval", other),
        ("train", other),
    ):
        if step == "train":
            model.train()
            reference.train()
            got, want = train_step(batch)
        elif step == "eval":
            model.eval()
            reference.eval()
            with torch.no_grad():
                got = _replica_mean(float(model(**local(batch)).loss), dp, tp)
                want = float(reference(**batch).loss)
        else:
            model.eval()
            reference.eval()
            prompt = batch["input_ids"][:, :6]
            with torch.no_grad():
                tokens = model.generate(local({"p": prompt})["p"], max_new_tokens=5, do_sample=False)
                ref_tokens = local({"p": reference.generate(prompt, max_new_tokens=5, do_sample=False)})["p"]
            assert tokens.shape == (prompt.shape[0] // dp, 11), tokens.shape
            assert torch.equal(tokens, ref_tokens), (rank, tokens.tolist(), ref_tokens.tolist())
            continue
        losses.append(got)
        ref_losses.append(want)
    sharded = sum(
        1 for p in model.parameters() if isinstance(p, DTensor) and any(q.is_shard() for q in p.placements)
    )
    return {
        "mesh": list(plan.mesh_shape),
        "sharded_params": sum(1 for v in plan.param_placements.values() if v[-1] != "R"),
        "sharded_live": sharded,
        "recompute": sorted(set(plan.recompute.values())),
        "losses": losses,
        "reference_losses": ref_losses,
    }


def _replica_mean(value: float, dp: int, tp: int) -> float:
    """DDP's loss: the mean of the data-parallel replicas' losses (one per tensor-parallel group)."""
    values: list[float | None] = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return sum(values[r * tp] for r in range(dp)) / dp


def main() -> None:
    out = out_argument()
    transformers.logging.set_verbosity_error()
    init_gloo(timeout_s=120)
    result = {"tp": _scenario((1, 2), "megatron"), "dp": _scenario((2, 1), "auto")}
    write_results(result, out)
    close_gloo(exit_process=True)


if __name__ == "__main__":
    main()
