"""Run under torchrun (2 gloo ranks): training-state checkpoints of pipeline stages resume under another plan.

    torchrun --nproc_per_node 2 tests/multiproc/check_pipeline_checkpoint.py --dir D --out result.json

A 4-block tiny Llama and a 2-block GPT-2 (head tied to the embedding, the tie across the two ranks), fp32, no
dropout. The uninterrupted run: two AdamW steps, then the loss of a third step and the loss of a fourth batch
after it (the "next loss", which depends on AdamW's moments and step count). Per model:

* ``pp``: a pipeline plan (pp 2, 1f1b) trains two steps, ``save_checkpoint`` writes ``D/<model>/pp`` (each
  rank its stages), then goes on: its third and next losses.
* ``tp``: a tensor-parallel plan (mesh 1 x 2) trains two steps and writes ``D/<model>/tp`` (nested optimizer
  state, as every plan without stages writes it).
* ``pp <- tp`` and ``tp <- pp``: a fresh model (other initial weights) under the one plan loads the other's
  checkpoint into a new AdamW, then its third and next losses; ``pp <- pp`` too, and a control that loads the
  pp checkpoint's weights with a fresh AdamW (it must differ). ``pp <- one-process optimizer``: a one-process
  run's positional ``optimizer.state_dict()`` (two param groups, as the Trainer's ``optimizer.pt``) loaded under
  the pipeline plan.
* ``accelerate``: ``AutoParallelAccelerator`` with the pipeline plan file saves its state after two steps,
  another accelerator over a fresh model loads it: the next losses.
* ``pretrained``: rank 0 saves a model with ``save_pretrained`` (several files); a model built on ``meta``
  under the pipeline plan with ``pretrained=`` that directory reads only its stages' tensors, equal to
  ``from_pretrained``'s in one process (the tied head from the embedding's key), and evaluates to its logits;
  the Trainer's consolidated load (``load_best_model_at_end``) into a pipelined model too.

* ``bf16``: ``AutoParallelAccelerator(mixed_precision="bf16")`` with the pipeline plan file: two steps' losses
  against one process under bf16 autocast on the same micro-batches.

The test compares each with one process's uninterrupted run (in the test's process, which also resumes
``D/<model>/pp`` in one process without a plan). Rank 0 writes every rank's results.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from check_pipeline import LR, build, config  # noqa: E402
from common import init_gloo, write_every_rank_and_close  # noqa: E402

from hf_colossal_auto.integrations.process_exit import finish

MODELS = {"tiny-llama": 4, "tiny-gpt2": 2}
"""Preset -> blocks (two stages of equal blocks)."""


def data(cfg) -> list[dict[str, torch.Tensor]]:
    """Four seeded batches of 8 rows."""
    from hf_colossal_auto.models import make_example_inputs

    model = build(cfg, "meta")
    return [make_example_inputs(model, 8, 16, seed=seed) for seed in range(4)]


def step(model, optimizer, batch: dict) -> float:
    loss = model(**batch).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(loss)


def next_losses(model, optimizer, batches: list[dict]) -> dict[str, float]:
    """The third step's loss and the loss of the fourth batch after it."""
    third = step(model, optimizer, batches[2])
    return {"loss": third, "next_loss": float(model(**batches[3]).loss)}


def pp_plan(model, batch: dict):
    from hf_colossal_auto.pipeline_layout import hand_pipeline_plan

    return hand_pipeline_plan(model, batch, pp_size=2, schedule="1f1b", micro_batches=4)


def tp_plan(preset: str, batch: dict):
    from hf_colossal_auto.models import build_model
    from hf_colossal_auto.solve.planner import evaluate_plan

    planning = build_model(config(preset, MODELS[preset]), device="meta")
    return evaluate_plan(planning, batch, "megatron", num_devices=2, device="cpu", mesh_shape=(1, 2)).plan


def planned(cfg, plan, seed: int):
    from hf_colossal_auto.apply.runtime import apply_plan

    model = build(cfg, "cpu", seed=seed)
    apply_plan(model, plan)
    return model


def two_groups(model) -> list[dict]:
    """Two AdamW param groups split as the Trainer splits them (matrices, the rest), with AdamW's default
    hyper-parameters (the uninterrupted run's single group trains the same)."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [{"params": [p for p in params if p.dim() >= 2]}, {"params": [p for p in params if p.dim() < 2]}]


def positional(cfg, plan, batches: list[dict]) -> dict[str, float]:
    """A one-process run's ``optimizer.state_dict()`` (parameters numbered by position, as the Trainer's
    ``optimizer.pt``) with its weights into a fresh model under ``plan``: the next losses."""
    from hf_colossal_auto.apply.checkpoint import load_full_optimizer_state

    plain = build(cfg, "cpu", seed=0)
    plain_optimizer = torch.optim.AdamW(two_groups(plain), lr=LR)
    for batch in batches[:2]:
        step(plain, plain_optimizer, batch)
    model = planned(cfg, plan, seed=1)
    model.load_state_dict(plain.state_dict(), strict=False)  # this rank's stages' entries
    optimizer = torch.optim.AdamW(two_groups(model), lr=LR)
    load_full_optimizer_state(model, optimizer, plain_optimizer.state_dict(), source="optimizer.pt")
    return next_losses(model, optimizer, batches)


def one_model(preset: str, root: Path) -> dict[str, Any]:
    from hf_colossal_auto.apply.checkpoint import load_checkpoint, save_checkpoint

    started = time.perf_counter()
    cfg = config(preset, MODELS[preset])
    batches = data(cfg)
    plans = {"pp": pp_plan(build(cfg, "meta"), batches[0]), "tp": tp_plan(preset, batches[0])}
    out: dict[str, Any] = {}
    for name, plan in plans.items():  # two steps, save, go on
        model = planned(cfg, plan, seed=0)
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
        for batch in batches[:2]:
            step(model, optimizer, batch)
        save_checkpoint(model, optimizer, root / preset / name)
        out[name] = next_losses(model, optimizer, batches)
        del model, optimizer
    for target, source in (("pp", "tp"), ("tp", "pp"), ("pp", "pp")):
        model = planned(cfg, plans[target], seed=1)
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
        load_checkpoint(model, optimizer, root / preset / source)
        out[f"{target} <- {source}"] = next_losses(model, optimizer, batches)
    out["pp <- one-process optimizer"] = positional(cfg, plans["pp"], batches)
    model = planned(cfg, plans["pp"], seed=1)  # control: the weights without the optimizer's state
    load_checkpoint(model, None, root / preset / "pp")
    out["fresh optimizer"] = next_losses(model, torch.optim.AdamW(model.parameters(), lr=LR), batches)
    out["seconds"] = time.perf_counter() - started
    return out


def accelerate_state(root: Path) -> dict[str, Any]:
    """``save_state`` after two steps under a pipeline plan file, ``load_state`` into a fresh model and
    optimizer under a second accelerator: the next losses."""
    from hf_colossal_auto import AutoParallelAccelerator

    cfg = config("tiny-llama", MODELS["tiny-llama"])
    batches = data(cfg)
    path = root / "plan.json"
    if dist.get_rank() == 0:
        pp_plan(build(cfg, "meta"), batches[0]).save(path)
    dist.barrier()
    os.environ["HF_COLOSSAL_AUTO_PLAN_PATH"] = str(path)
    out: dict[str, Any] = {}
    for phase, seed in (("saved", 0), ("resumed", 1)):
        accelerator = AutoParallelAccelerator(cpu=True)
        model = build(cfg, "cpu", seed=seed)
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
        model, optimizer = accelerator.prepare(model, optimizer)
        if phase == "saved":
            for batch in batches[:2]:
                step(model, optimizer, batch)
            accelerator.save_state(str(root / "accelerate"))
        else:
            accelerator.load_state(str(root / "accelerate"))
        out[phase] = next_losses(model, optimizer, batches)
        del model, optimizer, accelerator
    del os.environ["HF_COLOSSAL_AUTO_PLAN_PATH"]
    return out


def pretrained_stages(root: Path) -> dict[str, Any]:
    """``apply_plan(model on meta, pipeline plan, pretrained=dir)`` of a checkpoint rank 0 wrote with
    ``save_pretrained`` (several files): each rank's tensors equal ``from_pretrained``'s in one process, it
    read only its stages' bytes, and the evaluation logits equal the one-process model's."""
    from transformers import AutoModelForCausalLM

    from hf_colossal_auto.apply.runtime import apply_plan
    from hf_colossal_auto.integrations.trainer_checkpoints import load_consolidated

    out: dict[str, Any] = {}
    for preset in MODELS:
        cfg = config(preset, MODELS[preset])
        batch = data(cfg)[0]
        directory = root / f"pretrained-{preset}"
        if dist.get_rank() == 0:
            build(cfg, "cpu", seed=2).save_pretrained(directory, max_shard_size="200KB")
        dist.barrier()
        reference = AutoModelForCausalLM.from_pretrained(directory)
        model = build(cfg, "meta")
        apply_plan(model, pp_plan(model, batch), pretrained=directory)
        state = reference.state_dict()
        report = model._hf_colossal_auto_load_report
        model.eval()
        reference.eval()
        with torch.no_grad():
            logits, want = model(**batch).logits, reference(**batch).logits
        again = planned(cfg, pp_plan(build(cfg, "meta"), batch), seed=3)  # the Trainer's best-model load
        load_consolidated(again, directory)
        out[preset] = {
            "equal": all(torch.equal(p, state[n]) for n, p in model.named_parameters(remove_duplicate=False)),
            "consolidated_equal": all(
                torch.equal(p, state[n]) for n, p in again.named_parameters(remove_duplicate=False)
            ),
            "on_meta": [n for n, p in model.named_parameters() if p.is_meta],
            "held": len(list(model.parameters())),
            "reference_params": len(list(reference.named_parameters(remove_duplicate=False))),
            "files": len(report.files),
            "bytes_read": report.bytes_read,
            "checkpoint_bytes": report.checkpoint_bytes,
            "held_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
            "logits_err": (logits - want).abs().max().item(),
        }
    return out


def micro_batched_bf16(cfg, batches: list[dict], micro: int) -> list[float]:
    """One process under bf16 autocast, each batch as ``micro`` accumulated micro-batches normalised by the
    batch's label tokens (what the pipeline computes), an AdamW step per batch: the batches' losses."""
    model = build(cfg, "cpu")
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for batch in batches:
        count = (batch["labels"][:, 1:] != -100).sum()
        total = 0.0
        for part in zip(*(v.tensor_split(micro) for v in batch.values()), strict=True):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(**dict(zip(batch, part, strict=True)), num_items_in_batch=count).loss
            loss.backward()
            total += loss.item()
        losses.append(total)
        optimizer.step()
        optimizer.zero_grad()
    return losses


def mixed_precision(root: Path) -> dict[str, Any]:
    """``AutoParallelAccelerator(mixed_precision="bf16")`` with a pipeline plan file: accelerate's autocast
    wraps the pipelined forward, so every stage computes under it. Two steps' losses against one process under
    bf16 autocast on the same micro-batches, and the fp32 loss of the first batch (the control)."""
    from accelerate.state import AcceleratorState, GradientState

    from hf_colossal_auto import AutoParallelAccelerator

    cfg = config("tiny-llama", MODELS["tiny-llama"])
    batches = data(cfg)[:2]
    path = root / "plan-bf16.json"
    if dist.get_rank() == 0:
        pp_plan(build(cfg, "meta"), batches[0]).save(path)
    dist.barrier()
    os.environ["HF_COLOSSAL_AUTO_PLAN_PATH"] = str(path)
    AcceleratorState._reset_state()
    GradientState._reset_state()
    accelerator = AutoParallelAccelerator(cpu=True, mixed_precision="bf16")
    model = build(cfg, "cpu")
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=LR))
    losses = []
    for batch in batches:
        loss = model(**batch).loss
        accelerator.backward(loss)
        losses.append(loss.item())
        optimizer.step()
        optimizer.zero_grad()
    del os.environ["HF_COLOSSAL_AUTO_PLAN_PATH"], model, optimizer, accelerator
    return {
        "losses": losses,
        "ref_losses": micro_batched_bf16(cfg, batches, micro=4),
        "fp32_first_loss": float(build(cfg, "cpu")(**batches[0]).loss),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    init_gloo(timeout_s=120)
    started = time.perf_counter()
    root = Path(args.dir)
    results: dict[str, Any] = {preset: one_model(preset, root) for preset in MODELS}
    results["accelerate"] = accelerate_state(root)
    results["pretrained"] = pretrained_stages(root)
    results["bf16"] = mixed_precision(root)
    results["total_seconds"] = time.perf_counter() - started
    write_every_rank_and_close(results, args.out)


if __name__ == "__main__":
    main()
    finish()  # the run's gloo groups outlive main(): end before interpreter teardown
