"""Run under torchrun (2 gloo ranks): pipeline plans train like one process.

    torchrun --nproc_per_node 2 tests/multiproc/check_pipeline.py --out result.json

Every schedule the runtime offers (gpipe, 1f1b, interleaved-1f1b, interleaved-zero-bubble with 2 stages a
rank, zbv) on a 6-block tiny Llama with uneven cuts, fp32, no dropout, against one process on the same
batches: the loss and every gradient of the first step, and every parameter after two AdamW steps. The batch
has padding (an attention mask) and -100 labels spread so that micro-batches carry different token counts
(equal weights per micro-batch would be wrong). Also: a model built on ``meta`` materialises this rank's stages
with the whole model's init values; GPT-2, whose head is tied to its embedding, with the tie across ranks
(1f1b) and on one rank (zbv); a cut the model does not have and a batch smaller than the micro-batch count
raise the same error on every rank. Each rank compares its own parameters; rank 0 writes every rank's
results.
"""

from __future__ import annotations

import argparse
import datetime
import json
import time
from typing import Any

import torch
import torch.distributed as dist

LR = 1e-3
CASES = (  # (schedule, blocks per stage, micro-batches): every offered schedule, uneven cuts
    ("gpipe", [1, 5], 4),
    ("1f1b", [4, 2], 4),
    ("interleaved-1f1b", [2, 1, 2, 1], 4),
    ("interleaved-zero-bubble", [1, 2, 1, 2], 4),
    ("zbv", [2, 1, 1, 2], 4),
)


def config(preset: str, layers: int):
    from hf_colossal_auto.models import load_config

    cfg = load_config(preset)
    for attr in ("num_hidden_layers", "n_layer"):
        if hasattr(cfg, attr):
            setattr(cfg, attr, layers)
    for attr in ("resid_pdrop", "embd_pdrop", "attn_pdrop", "attention_dropout"):
        if hasattr(cfg, attr):
            setattr(cfg, attr, 0.0)
    return cfg


def batches(model, rows: int = 8, seq: int = 16) -> list[dict[str, torch.Tensor]]:
    """Two seeded batches with padding and uneven label counts per micro-batch."""
    from hf_colossal_auto.models import make_example_inputs

    out = []
    for seed in (0, 1):
        batch = make_example_inputs(model, rows, seq, seed=seed)
        batch["attention_mask"][2, seq - 5 :] = 0  # a padded row: the mask every stage must build
        labels = batch["labels"].clone()
        labels[2, seq - 5 :] = -100
        labels[0, : seq // 2] = -100
        labels[5, 3:] = -100
        batch["labels"] = labels
        out.append(batch)
    return out


def build(cfg, device: str, seed: int = 0):
    from hf_colossal_auto.models import build_model

    torch.manual_seed(seed)
    return build_model(cfg, device=device)


def reference(model, data: list[dict]) -> dict[str, Any]:
    """One process: first step's loss and gradients, parameters after two AdamW steps (by every FQN, tied
    aliases included)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    out: dict[str, Any] = {}
    for i, batch in enumerate(data):
        loss = model(**batch).loss
        loss.backward()
        if i == 0:
            out["loss"] = loss.item()
            out["grads"] = {n: p.grad.clone() for n, p in model.named_parameters(remove_duplicate=False)}
        optimizer.step()
        optimizer.zero_grad()
    out["params"] = {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}
    return out


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    scale = b.abs().max().item()
    return (a - b).abs().max().item() / scale if scale else (a - b).abs().max().item()


def pipelined(model, plan, data: list[dict], ref: dict[str, Any]) -> dict[str, Any]:
    """The pipelined model against ``ref``: first-step loss and gradients, parameters after two steps."""
    from hf_colossal_auto.apply.pipeline import pipeline_runner
    from hf_colossal_auto.apply.runtime import apply_plan

    started = time.perf_counter()
    apply_plan(model, plan)
    runner = pipeline_runner(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    out: dict[str, Any] = {"held": sorted(n for n, _ in model.named_parameters())}
    for i, batch in enumerate(data):
        loss = runner.step(batch)
        if i == 0:
            out["loss"], out["ref_loss"] = loss.item(), ref["loss"]
            out["grad_err"] = max(relative(p.grad, ref["grads"][n]) for n, p in model.named_parameters())
        optimizer.step()
        optimizer.zero_grad()
    # parameters after two steps, the difference in units of the learning rate (one AdamW update's size)
    out["param_err_lr"] = max(
        (p.detach() - ref["params"][n]).abs().max().item() / LR for n, p in model.named_parameters()
    )
    out["seconds"] = time.perf_counter() - started
    return out


def every_schedule(results: dict) -> None:
    from hf_colossal_auto.pipeline_layout import hand_pipeline_plan

    cfg = config("tiny-llama", 6)
    probe = build(cfg, "meta")
    data = batches(probe)
    ref = reference(build(cfg, "cpu"), data)
    for schedule, cut, micro in CASES:
        model = build(cfg, "cpu")
        virtual = len(cut) // 2
        plan = hand_pipeline_plan(
            model, data[0], pp_size=2, schedule=schedule, micro_batches=micro, virtual_stages=virtual,
            blocks_per_stage=cut,
        )  # fmt: skip
        plan = type(plan).from_dict(json.loads(plan.to_json()))  # the plan as a file carries it
        results[f"llama {schedule} {cut}"] = pipelined(model, plan, data, ref)
    # built on meta: this rank's stages get the values the whole model's init gives (rank 0's RNG state)
    model = build(cfg, "meta")
    plan = hand_pipeline_plan(model, data[0], pp_size=2, schedule="1f1b", micro_batches=2)
    torch.manual_seed(0)
    results["llama meta 1f1b"] = pipelined(model, plan, data, reference_from_meta(cfg, data))


def reference_from_meta(cfg, data: list[dict]) -> dict[str, Any]:
    """The one-process reference of a model built on meta and materialised whole from seed 0's RNG state."""
    from hf_colossal_auto.apply.materialize import materialize_meta_model

    model = build(cfg, "meta")
    torch.manual_seed(0)
    materialize_meta_model(model)
    return reference(model, data)


def tied_gpt2(results: dict) -> None:
    from hf_colossal_auto.pipeline_layout import hand_pipeline_plan

    cfg = config("tiny-gpt2", 4)
    data = batches(build(cfg, "meta"))
    ref = reference(build(cfg, "cpu"), data)
    for schedule, cut in (("1f1b", [2, 2]), ("zbv", [1, 1, 1, 1])):
        model = build(cfg, "cpu")
        plan = hand_pipeline_plan(
            model, data[0], pp_size=2, schedule=schedule, micro_batches=4, blocks_per_stage=cut
        )
        results[f"gpt2 tied {schedule}"] = pipelined(model, plan, data, ref)


def refusals(results: dict) -> None:
    """A cut inside a block, and a batch with fewer rows than micro-batches: the same error on every rank."""
    from hf_colossal_auto.apply.pipeline import pipeline_runner
    from hf_colossal_auto.apply.runtime import apply_plan
    from hf_colossal_auto.pipeline_layout import hand_pipeline_plan

    cfg = config("tiny-llama", 2)
    model = build(cfg, "cpu")
    data = batches(model)
    plan = hand_pipeline_plan(model, data[0], pp_size=2, schedule="gpipe", micro_batches=2)
    bad = type(plan).from_dict({**plan.to_dict(), "stages": [["model.embed_tokens", "model.layers.0.mlp"],
                                                            plan.stages[1]]})  # fmt: skip
    try:
        apply_plan(model, bad)
        results["bad cut"] = "no error"
    except Exception as exc:  # noqa: BLE001 - the test reads the type and message
        results["bad cut"] = f"{type(exc).__name__}: {exc}"
    apply_plan(model, plan)
    try:
        pipeline_runner(model).step({k: v[:1] for k, v in data[0].items()})
        results["small batch"] = "no error"
    except Exception as exc:  # noqa: BLE001
        results["small batch"] = f"{type(exc).__name__}: {exc}"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    started = time.perf_counter()
    results: dict[str, Any] = {}
    every_schedule(results)
    tied_gpt2(results)
    refusals(results)
    results["total_seconds"] = time.perf_counter() - started
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, results)
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(gathered, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
