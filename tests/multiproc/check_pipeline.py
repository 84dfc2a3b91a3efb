"""Run under torchrun (2 gloo ranks): pipeline plans train like one process, in the user's own loop.

    torchrun --nproc_per_node 2 tests/multiproc/check_pipeline.py --out result.json

Every schedule the runtime offers (gpipe, 1f1b, interleaved-1f1b, interleaved-zero-bubble with 2 stages a rank,
zbv) on a 6-block tiny Llama with uneven cuts (and the interleaved ones with 4 stages a rank and fewer micro-batches
than stages on a 10-block one), fp32, no dropout, against one process on the same batches, trained
with the ordinary loop (``loss = model(**batch).loss; loss.backward(); optimizer.step()``): the loss and every
gradient of the first step, every parameter after two AdamW steps, the gradient norm the runner clips by, and an
evaluation forward (``model.eval()``, ``torch.no_grad()``: logits on every rank, the loss with labels) after the
two steps. The batch has padding (an attention mask) and -100 labels spread so that micro-batches carry different
token counts (equal weights per micro-batch would be wrong). Also: gradient recompute inside the stages (full
and selective under zbv, the latter also rerunning two projections, selective under interleaved zero bubble
and 1f1b); gradient accumulation (``loss / 2`` over two half batches) and a loss scaled by
3 (what a gradient scaler does); a term on the logits set as the model's loss function (a z-loss; the training
output's logits are refused); a model built on ``meta`` materialises this rank's stages with the whole model's
init values; GPT-2, whose head is tied to its embedding, under every schedule (uneven under gpipe) with the tie
across ranks (all but zbv) and on one rank (zbv), saved with ``save_pretrained`` (1f1b) and reloaded in one
process; ``AutoParallelAccelerator`` with a pipeline plan file (``HF_COLOSSAL_AUTO_PLAN_PATH``) and gradient
accumulation, saving with ``save_model``; a cut the model does not have, a batch smaller than the micro-batch
count, a training forward without labels and a consolidated state dict raise on every rank. A 5-block tiny Mixtral
with its router load-balancing loss (``output_router_logits``, whose routers live on both ranks) under every
schedule with uneven cuts, and without it under 1f1b; with router jitter it is refused by name. Stages planned in
the job: ``autoparallelize(model, batch, pipeline=2)`` (over ``HF_COLOSSAL_AUTO_PIPELINE=1``) and
``HF_COLOSSAL_AUTO_PIPELINE=2`` alone train like one process; ``pipeline=3`` and ``HF_COLOSSAL_AUTO_PIPELINE=two``
are refused on every rank.
Each rank compares its own parameters; rank 0 writes every rank's results.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
from common import init_gloo, out_argument, write_every_rank_and_close

from hf_colossal_auto.integrations.process_exit import finish

LR = 1e-3
EPS = 1e-6
"""AdamW's epsilon here (torch's default is 1e-8). Adam's first update of an element is ``g / (|g| + eps)``: for an
element whose gradient is near zero, a rounding difference of 1e-10 between the pipelined and the one-process
gradient moves it by 1 % of an update at eps 1e-8 (measured: Llama's ``layers.0.mlp.gate_proj`` on a meta-built
model, 1.4 % on this machine and under 1 % on another, where the gradients agree to 4e-7 of their size). At 1e-6
every parameter of every case here ends within 1e-3 of an update of one process's (measured: 3e-4 for that one),
while a missed or doubled update still moves a parameter by a whole one."""
CASES = (  # (schedule, blocks per stage, micro-batches): every offered schedule, uneven cuts
    ("gpipe", [1, 5], 4),
    ("1f1b", [4, 2], 4),
    ("interleaved-1f1b", [2, 1, 2, 1], 4),
    ("interleaved-zero-bubble", [1, 2, 1, 2], 4),
    ("zbv", [2, 1, 1, 2], 4),
)

FOUR_A_RANK = (  # (schedule, blocks per stage, micro-batches): 8 stages on 2 ranks, fewer micro-batches than stages
    ("interleaved-1f1b", [2, 1, 1, 1, 1, 1, 2, 1], 4),
    ("interleaved-zero-bubble", [1, 2, 1, 1, 2, 1, 1, 1], 4),
    ("interleaved-1f1b", [1, 1, 2, 1, 1, 2, 1, 1], 2),
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


def grad_norm(model) -> float:
    """The total 2-norm of the gradients, each parameter once (a tied one too)."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    return float(torch.sqrt(sum((g.double() ** 2).sum() for g in grads)))


def reference(model, data: list[dict]) -> dict[str, Any]:
    """One process: first step's loss, gradients and gradient norm, parameters after two AdamW steps (by every
    FQN, tied aliases included), then the evaluation outputs on the first batch."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    out: dict[str, Any] = {}
    for i, batch in enumerate(data):
        loss = model(**batch).loss
        loss.backward()
        if i == 0:
            out["loss"] = loss.item()
            out["grads"] = {n: p.grad.clone() for n, p in model.named_parameters(remove_duplicate=False)}
            out["norm"] = grad_norm(model)
        optimizer.step()
        optimizer.zero_grad()
    out["params"] = {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}
    model.eval()
    with torch.no_grad():
        evaluated = model(**data[0])
    model.train()
    out["eval_loss"], out["eval_logits"] = evaluated.loss.item(), evaluated.logits
    return out


def accumulated_reference(model, batch: dict, scale: float) -> dict[str, torch.Tensor]:
    """One process: ``loss x scale`` backward on each half of ``batch`` (gradient accumulation with a scaled
    loss, as accelerate's backward under a gradient scaler does); the summed gradients."""
    for half in halves(batch):
        (model(**half).loss * scale).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters(remove_duplicate=False)}


def halves(batch: dict) -> list[dict]:
    rows = batch["input_ids"].shape[0] // 2
    return [{k: v[:rows] for k, v in batch.items()}, {k: v[rows:] for k, v in batch.items()}]


def own_rows(batch: dict) -> dict:
    """This process's rows of a global batch, what it passes as plain DDP would feed it."""
    rows = batch["input_ids"].shape[0] // dist.get_world_size()
    start = dist.get_rank() * rows
    return {k: v[start : start + rows] for k, v in batch.items()}


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    scale = b.abs().max().item()
    return (a - b).abs().max().item() / scale if scale else (a - b).abs().max().item()


def pipelined(model, plan, data: list[dict], ref: dict[str, Any], **planning: Any) -> dict[str, Any]:
    """The pipelined model in the user's loop against ``ref``: first-step loss, gradients and norm, parameters
    after two steps, then an evaluation forward with and without labels. ``plan`` None: planned in the job,
    ``autoparallelize(model, batch, **planning)`` from this process's rows of the first (global) batch."""
    from hf_colossal_auto import autoparallelize, data_parallel_info
    from hf_colossal_auto.apply.pipeline import pipeline_runner

    started = time.perf_counter()
    if plan is None:
        autoparallelize(model, own_rows(data[0]), **planning)
        plan = model._hf_colossal_auto_plan
    else:
        autoparallelize(model, plan=plan)  # the torchrun entry point with a fixed plan
    runner = pipeline_runner(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    info = data_parallel_info(model)
    out: dict[str, Any] = {
        "held": sorted(n for n, _ in model.named_parameters()),
        "pp_size": plan.pp_size,
        "schedule": plan.schedule,
        "info": [info.rank, info.size, info.pp_size],
    }
    for i, batch in enumerate(data):
        outputs = model(**batch)
        # a loss built on the logits must fail, not train on something else, and say what to do
        try:
            _ = outputs.logits
        except AttributeError as refused:
            assert "model.loss_function" in str(refused) and not hasattr(outputs, "hidden_states"), refused
        else:
            raise AssertionError("a pipelined training step returned logits")
        outputs.loss.backward()
        if i == 0:
            out["loss"], out["ref_loss"] = outputs.loss.item(), ref["loss"]
            out["grad_err"] = max(relative(p.grad, ref["grads"][n]) for n, p in model.named_parameters())
            out["norm"], out["ref_norm"] = float(runner.clip_grad_norm_(1e9)), ref["norm"]
        optimizer.step()
        optimizer.zero_grad()
    out["live_receive_buffers"] = live_receive_buffers(runner)
    out.update(gradient_sends_state(runner, plan))
    # parameters after two steps, the difference in units of the learning rate (one AdamW update's size)
    errors = {n: (p.detach() - ref["params"][n]).abs().max().item() / LR for n, p in model.named_parameters()}
    out["param_err_lr"] = max(errors.values())
    out["param_err_worst"] = max(errors, key=errors.__getitem__)
    model.eval()
    with torch.no_grad():
        evaluated = model(**data[0])
    unlabeled = model(input_ids=data[0]["input_ids"], attention_mask=data[0]["attention_mask"])
    model.train()
    out["eval_loss"], out["ref_eval_loss"] = evaluated.loss.item(), ref["eval_loss"]
    out["eval_logits_err"] = relative(evaluated.logits, ref["eval_logits"])
    out["unlabeled_equal"] = unlabeled.loss is None and torch.equal(unlabeled.logits, evaluated.logits)
    out["seconds"] = time.perf_counter() - started
    return out


def attention_runs(model, batch: dict) -> list[int]:
    """How many times each held block's attention runs in one more training step (shapes already inferred):
    its forward per micro-batch, plus its reruns where the block is recomputed."""
    from collections import Counter

    runs: Counter[str] = Counter()
    hooks = [
        module.register_forward_pre_hook(lambda *_, name=name: runs.update([name]))
        for name, module in model.named_modules()
        if name.endswith("self_attn")
    ]
    model(**batch).loss.backward()
    model.zero_grad()
    for hook in hooks:
        hook.remove()
    return sorted(runs.values())


def live_receive_buffers(runner) -> int:
    """How many of the stages' receive buffers hold memory between training steps (torch's own stage keeps one
    per micro-batch and direction; ours drops each after its micro-batch's backward). Test-only peek at the
    runner's built schedule and torch's stage fields."""
    schedule = runner._built.schedule
    stages = getattr(schedule, "_stages", None) or [schedule._stage]
    infos = [
        i for st in stages for row in (*st.args_recv_info.values(), *st.grad_recv_info.values()) for i in row
    ]
    return sum(
        1 for i in infos if not i.is_root_arg and isinstance(i.buffer, torch.Tensor) and not i.buffer.is_meta
    )


def gradient_sends_state(runner, plan) -> dict[str, Any]:
    """Under a multi-stage schedule: how many sent gradients the stages still hold after the step (0: the runner
    waited and freed the rest), how many the schedule's order frees before the step's end, and whether the
    runtime frees them where the schedule's pricing does (the same releases, from torch's built schedule and
    from the pricing's action lists). Test-only peek at the runner's built schedule."""
    from hf_colossal_auto.pipeline_receipts import gradient_send_releases
    from hf_colossal_auto.solve.pricing.pipeline_schedule import schedule_actions

    sends = runner._built.gradient_sends
    if sends is None:
        return {"gradient_sends": None}
    priced = gradient_send_releases(
        schedule_actions(plan.schedule, plan.pp_size, plan.micro_batches, plan.virtual_stages),
        plan.stage_ranks(),
    )
    return {
        "gradient_sends": {
            "in_flight_after_step": sends.in_flight,
            "freed_early": sum(map(len, sends.releases.values())),
            "releases_as_priced": sends.releases == priced,
        }
    }


def accumulation(results: dict, cfg, batch: dict) -> None:
    """Two half batches, each ``loss x 3 / 2`` (accumulation over 2 with a scaler's factor 3), one optimizer
    step's gradients: equal to one process's on the same halves and scale."""
    from hf_colossal_auto.apply.runtime import apply_plan
    from hf_colossal_auto.pipeline_layout import hand_pipeline_plan

    ref = accumulated_reference(build(cfg, "cpu"), batch, 1.5)
    model = build(cfg, "cpu")
    plan = hand_pipeline_plan(model, batch, pp_size=2, schedule="1f1b", micro_batches=4)
    apply_plan(model, plan)
    for half in halves(batch):
        (model(**half).loss * 1.5).backward()
    results["accumulation 1f1b"] = {
        "grad_err": max(relative(p.grad, ref[n]) for n, p in model.named_parameters())
    }


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
    # four stages a rank with fewer micro-batches than stages (torch's interleaving in rounds of pp, as the search
    # offers it): a 10-block Llama, uneven cuts, 4 and 2 micro-batches for 8 stages
    cfg10 = config("tiny-llama", 10)
    data10 = batches(build(cfg10, "meta"))
    ref10 = reference(build(cfg10, "cpu"), data10)
    for schedule, cut, micro in FOUR_A_RANK:
        model = build(cfg10, "cpu")
        plan = hand_pipeline_plan(
            model, data10[0], pp_size=2, schedule=schedule, micro_batches=micro, virtual_stages=4,
            blocks_per_stage=cut,
        )  # fmt: skip
        results[f"llama four a rank {schedule} m{micro} {cut}"] = pipelined(model, plan, data10, ref10)
    # recompute inside the stages: under zbv and interleaved zero bubble (their split backward: input gradients
    # first, weight gradients later, one rerun of each recomputed block serving both) full and selective,
    # selective under 1f1b
    for schedule, cut, option in (
        ("zbv", [2, 1, 1, 2], "full"),
        ("zbv", [2, 1, 1, 2], "selective:pointwise"),
        ("zbv", [2, 1, 1, 2], "selective:pointwise;rerun=mlp.down_proj,self_attn.o_proj"),
        ("interleaved-zero-bubble", [2, 1, 1, 2], "selective:pointwise"),
        ("1f1b", [4, 2], "selective:pointwise"),
    ):
        model = build(cfg, "cpu")
        plan = hand_pipeline_plan(
            model, data[0], pp_size=2, schedule=schedule, micro_batches=4, blocks_per_stage=cut,
            recompute=option,
        )  # fmt: skip
        results[f"llama recompute {schedule} {option}"] = got = pipelined(model, plan, data, ref)
        got["recomputed"] = sorted(
            name
            for name, module in model.named_modules()
            if getattr(module, "_hf_colossal_auto_recompute", None)
        )
        got["attention_runs"] = attention_runs(model, data[0])
    # built on meta: this rank's stages get the values the whole model's init gives (rank 0's RNG state)
    model = build(cfg, "meta")
    plan = hand_pipeline_plan(model, data[0], pp_size=2, schedule="1f1b", micro_batches=2)
    torch.manual_seed(0)
    results["llama meta 1f1b"] = pipelined(model, plan, data, reference_from_meta(cfg, data))
    # planned in the job: autoparallelize(model, batch, pipeline=2) under HF_COLOSSAL_AUTO_PIPELINE=1 (the
    # argument wins), then HF_COLOSSAL_AUTO_PIPELINE=2 alone; the plan's schedule is the planner's
    for how, variable, planning in (("argument", "1", {"pipeline": 2}), ("environment", "2", {})):
        os.environ["HF_COLOSSAL_AUTO_PIPELINE"] = variable
        try:
            got = pipelined(build(cfg, "cpu"), None, data, ref, **planning)
        finally:
            del os.environ["HF_COLOSSAL_AUTO_PIPELINE"]
        results[f"llama planned {how} {got['schedule']}"] = got
    accumulation(results, cfg, data[0])
    custom_loss(results, cfg, data, ref)


def z_loss(logits, labels, vocab_size, num_items_in_batch=None, **kwargs):
    """transformers' causal-LM loss plus 1e-2 x each label token's squared log-partition (PaLM's z-loss), both
    normalised by the batch's label tokens as transformers' losses are: a term on the logits, which a pipelined
    training step honours only as the model's loss function (its output has no logits)."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    kept = labels[..., 1:] != -100
    count = num_items_in_batch if num_items_in_batch is not None else kept.sum()
    partition = torch.logsumexp(logits[..., :-1, :].float(), dim=-1)
    loss = ForCausalLMLoss(logits, labels, vocab_size, num_items_in_batch=count, **kwargs)
    return loss + 1e-2 * (partition[kept] ** 2).sum() / count


def custom_loss(results: dict, cfg, data: list[dict], plain: dict[str, Any]) -> None:
    """``model.loss_function = z_loss`` (what a training step's refused ``outputs.logits`` tells the user to do)
    under 1f1b against one process with the same loss function; ``plain``: the reference without it."""
    from hf_colossal_auto.pipeline_layout import hand_pipeline_plan

    reference_model = build(cfg, "cpu")
    reference_model.loss_function = z_loss
    ref = reference(reference_model, data)
    model = build(cfg, "cpu")
    model.loss_function = z_loss
    plan = hand_pipeline_plan(model, data[0], pp_size=2, schedule="1f1b", micro_batches=4)
    results["llama z-loss 1f1b"] = pipelined(model, plan, data, ref)
    results["llama z-loss 1f1b"]["plain_ref_loss"] = plain["loss"]


def reference_from_meta(cfg, data: list[dict]) -> dict[str, Any]:
    """The one-process reference of a model built on meta and materialised whole from seed 0's RNG state."""
    from hf_colossal_auto.apply.materialize import materialize_meta_model

    model = build(cfg, "meta")
    torch.manual_seed(0)
    materialize_meta_model(model)
    return reference(model, data)


MIXTRAL_CASES = (  # (schedule, blocks per stage, router aux loss on): every offered schedule, uneven cuts
    ("gpipe", [2, 3], True),
    ("1f1b", [4, 1], True),
    ("interleaved-1f1b", [1, 1, 1, 2], True),
    ("interleaved-zero-bubble", [2, 1, 1, 1], True),
    ("zbv", [1, 1, 2, 1], True),
    ("1f1b", [2, 3], False),
)


def mixtral(results: dict) -> None:
    """MoE under pipeline stages: the loss with the routers' load-balancing term (summed over every layer of
    the whole batch, layers on both ranks) and its gradients equal one process; router jitter with the term on
    is refused."""
    from hf_colossal_auto.apply.runtime import apply_plan
    from hf_colossal_auto.pipeline_layout import hand_pipeline_plan

    for aux in (True, False):
        cfg = config("tiny-mixtral", 5)
        cfg.output_router_logits = aux
        data = batches(build(cfg, "meta"))
        ref = reference(build(cfg, "cpu"), data)
        for schedule, cut, on in MIXTRAL_CASES:
            if on != aux:
                continue
            model = build(cfg, "cpu")
            plan = hand_pipeline_plan(
                model, data[0], pp_size=2, schedule=schedule, micro_batches=4, virtual_stages=len(cut) // 2,
                blocks_per_stage=cut,
            )  # fmt: skip
            case = f"mixtral {'aux' if aux else 'no-aux'} {schedule} {cut}"
            results[case] = pipelined(model, plan, data, ref)
            results[case]["ref_aux"] = aux_term(cfg, data[0]) if aux else 0.0
    cfg = config("tiny-mixtral", 2)
    cfg.router_jitter_noise = 0.1
    model = build(cfg, "cpu")
    plan = hand_pipeline_plan(model, batches(model)[0], pp_size=2, schedule="1f1b", micro_batches=2)
    results["mixtral jitter"] = error_of(lambda: apply_plan(model, plan))


def aux_term(cfg, batch: dict) -> float:
    """One process's ``router_aux_loss_coef x aux_loss`` on ``batch``: the part of the loss the stages add."""
    with torch.no_grad():
        return cfg.router_aux_loss_coef * build(cfg, "cpu")(**batch).aux_loss.item()


GPT2_CASES = (  # (schedule, blocks per stage) of a 4-block GPT-2: every offered schedule
    ("gpipe", [3, 1]),  # uneven
    ("1f1b", [2, 2]),
    ("interleaved-1f1b", [1, 1, 1, 1]),
    ("interleaved-zero-bubble", [1, 1, 1, 1]),
    ("zbv", [1, 1, 1, 1]),
)
"""The first and last stages hold the tied embedding: on two ranks under every schedule but zbv (its V puts
both on rank 0); under the interleaved ones the ranks each run a second stage."""


def tied_gpt2(results: dict, directory: str) -> None:
    """GPT-2's head tied to its embedding, on two ranks (gpipe, 1f1b, interleaved 1f1b and zero bubble) and on
    one (zbv); the 1f1b one then saved with ``save_pretrained`` in several files and reloaded in one process:
    every tensor equal."""
    from hf_colossal_auto.pipeline_layout import hand_pipeline_plan

    cfg = config("tiny-gpt2", 4)
    data = batches(build(cfg, "meta"))
    ref = reference(build(cfg, "cpu"), data)
    for schedule, cut in GPT2_CASES:
        model = build(cfg, "cpu")
        plan = hand_pipeline_plan(
            model, data[0], pp_size=2, schedule=schedule, micro_batches=4, virtual_stages=len(cut) // 2,
            blocks_per_stage=cut,
        )  # fmt: skip
        results[f"gpt2 tied {schedule} {cut}"] = pipelined(model, plan, data, ref)
        if schedule == "1f1b":
            model.save_pretrained(directory, max_shard_size="300KB")
            results["save gpt2"] = reloaded_equal(model, directory)


def reloaded_equal(model, directory: str) -> dict[str, Any]:
    """The checkpoint in ``directory`` loaded in one process: whether each of this rank's tensors is equal,
    the files written, and whether the reloaded head is tied to the embedding."""
    import os

    from torch.distributed.tensor import DTensor
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(directory)
    state = loaded.state_dict()
    mine = {
        n: p.detach().full_tensor() if isinstance(p, DTensor) else p.detach()
        for n, p in model.named_parameters(remove_duplicate=False)
    }
    return {
        "equal": all(torch.equal(state[n], p) for n, p in mine.items()),
        "compared": len(mine),
        "files": sorted(f for f in os.listdir(directory) if f.endswith(".safetensors")),
        "tied": loaded.get_output_embeddings().weight is loaded.get_input_embeddings().weight,
    }


def refusals(results: dict) -> None:
    """A cut inside a block, a batch with fewer rows than micro-batches, a training forward without labels,
    ``autoparallelize(pipeline=3)`` on 2 ranks, ``HF_COLOSSAL_AUTO_PIPELINE=two``: the same error on every rank."""
    from hf_colossal_auto import autoparallelize
    from hf_colossal_auto.apply.runtime import apply_plan
    from hf_colossal_auto.pipeline_layout import hand_pipeline_plan

    cfg = config("tiny-llama", 2)
    model = build(cfg, "cpu")
    data = batches(model)
    plan = hand_pipeline_plan(model, data[0], pp_size=2, schedule="gpipe", micro_batches=2)
    bad = type(plan).from_dict({**plan.to_dict(), "stages": [["model.embed_tokens", "model.layers.0.mlp"],
                                                            plan.stages[1]]})  # fmt: skip
    results["bad cut"] = error_of(lambda: apply_plan(model, bad))
    apply_plan(model, plan)
    results["small batch"] = error_of(lambda: model(**{k: v[:1] for k, v in data[0].items()}))
    results["no labels"] = error_of(lambda: model(input_ids=data[0]["input_ids"]))
    # planning in the job: a pp degree the 2 ranks cannot hold, a variable that is no setting
    results["pipeline=3"] = error_of(
        lambda: autoparallelize(build(cfg, "cpu"), own_rows(data[0]), pipeline=3)
    )
    os.environ["HF_COLOSSAL_AUTO_PIPELINE"] = "two"
    try:
        results["pipeline variable two"] = error_of(
            lambda: autoparallelize(build(cfg, "cpu"), own_rows(data[0]))
        )
    finally:
        del os.environ["HF_COLOSSAL_AUTO_PIPELINE"]


def full_state_dicts(results: dict) -> None:
    """``consolidated_state_dict`` of a pipelined model against one process's ``state_dict()`` of the same
    model: tiny Llama (1f1b) and GPT-2 with its head tied to the embedding across the ranks (1f1b) and on one
    rank (zbv); on every rank, and with ``rank0_only`` on rank 0 (``{}`` elsewhere)."""
    from hf_colossal_auto.apply import consolidated_state_dict
    from hf_colossal_auto.apply.runtime import apply_plan
    from hf_colossal_auto.pipeline_layout import hand_pipeline_plan

    for preset, schedule, cut in (("tiny-llama", "1f1b", [1, 1]), ("tiny-gpt2", "1f1b", [1, 1]),
                                  ("tiny-gpt2", "zbv", [1, 1, 1, 1])):  # fmt: skip
        model = build(config(preset, sum(cut)), "cpu")
        one = {k: v.clone() for k, v in model.state_dict().items()}
        tied = [k for k in one if k.endswith("lm_head.weight")]
        plan = hand_pipeline_plan(
            model, batches(model)[0], pp_size=2, schedule=schedule, micro_batches=4, blocks_per_stage=cut
        )
        apply_plan(model, plan)
        full = consolidated_state_dict(model)
        first = consolidated_state_dict(model, rank0_only=True)
        results[f"state dict {preset} {schedule}"] = {
            "keys_in_order": list(full) == list(one),
            "equal": all(torch.equal(full[k], v) for k, v in one.items()),
            "plain_cpu": all(type(v) is torch.Tensor and v.device.type == "cpu" for v in full.values()),
            "tie_kept": all(full[k] is full[k.replace("lm_head", "transformer.wte")] for k in tied)
            if preset == "tiny-gpt2"
            else None,
            "rank0_only": (list(first) == list(one) and all(torch.equal(first[k], v) for k, v in one.items()))
            if dist.get_rank() == 0
            else first == {},
        }


def error_of(call) -> str:
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - the test reads the type and message
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def accelerator_loop(results: dict, directory: str) -> None:
    """An ordinary accelerate loop under ``AutoParallelAccelerator`` with a pipeline plan file
    (``HF_COLOSSAL_AUTO_PLAN_PATH``): per-process batches of 4 rows, gradient accumulation 2, clipping,
    two optimizer steps; then an evaluation gathered for metrics and ``save_model``. Against one process on
    the global batches (both processes' rows: the pipeline computes on their union)."""
    import os

    from accelerate import Accelerator  # noqa: F401 - the state singleton is made by ours
    from common import accumulating_loop  # this script's folder is on the path under torchrun
    from torch.utils.data import DataLoader

    from hf_colossal_auto import AutoParallelAccelerator
    from hf_colossal_auto.pipeline_layout import hand_pipeline_plan

    cfg = config("tiny-llama", 4)
    rows = [dict(zip(b, values, strict=True)) for b in batches(build(cfg, "meta"), rows=16)
            for values in zip(*b.values(), strict=True)]  # fmt: skip
    model = build(cfg, "cpu")
    plan = hand_pipeline_plan(
        model, batches(model)[0], pp_size=2, schedule="interleaved-1f1b", micro_batches=4
    )
    path = os.path.join(directory, "plan.json")
    if dist.get_rank() == 0:
        plan.save(path)
    dist.barrier()
    os.environ["HF_COLOSSAL_AUTO_PLAN_PATH"] = path
    accelerator = AutoParallelAccelerator(cpu=True, gradient_accumulation_steps=2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    loader = DataLoader(rows, batch_size=4, collate_fn=torch.utils.data.default_collate)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    losses, norms, seen, batch = accumulating_loop(accelerator, model, optimizer, loader)
    model.eval()
    with torch.no_grad():
        logits = model(**batch).logits
    gathered = accelerator.gather_for_metrics(logits.argmax(-1))
    ref = accelerator_reference(cfg, rows)
    unwrapped = accelerator.unwrap_model(model)
    accelerator.save_model(model, os.path.join(directory, "accelerate"))
    results["accelerate"] = {
        "losses": losses, "ref_losses": ref["losses"], "norms": norms, "ref_norms": ref["norms"],
        "param_err_lr": max((p.detach() - ref["params"][n]).abs().max().item() / LR
                            for n, p in unwrapped.named_parameters()),
        "gathered_equal": torch.equal(gathered, ref["argmax"]), "rows": seen,
        "saved": reloaded_equal(unwrapped, os.path.join(directory, "accelerate")),
    }  # fmt: skip


def accelerator_reference(cfg, rows: list[dict]) -> dict[str, Any]:
    """One process: the global batches of 8 rows (both processes' 4), each a half of an accumulated step
    (``loss / 2``), clipped to 1, two AdamW steps; the last batch's argmax logits."""
    from torch.utils.data import default_collate

    model = build(cfg, "cpu")
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    losses, norms = [], []
    for step in range(len(rows) // 8):
        batch = default_collate(rows[step * 8 : (step + 1) * 8])
        loss = model(**batch).loss
        (loss / 2).backward()
        losses.append(loss.item())
        if step % 2 == 1:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)))
            optimizer.step()
            optimizer.zero_grad()
    model.eval()
    with torch.no_grad():
        argmax = model(**batch).logits.argmax(-1)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "norms": norms, "params": params, "argmax": argmax}


def main() -> None:
    out = out_argument()
    init_gloo(timeout_s=120)
    started = time.perf_counter()
    results: dict[str, Any] = {}
    directory = [tempfile.mkdtemp(prefix="pipeline-save-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(directory)
    every_schedule(results)
    tied_gpt2(results, directory[0])
    mixtral(results)
    refusals(results)
    full_state_dicts(results)
    accelerator_loop(results, directory[0])
    results["total_seconds"] = time.perf_counter() - started
    write_every_rank_and_close(results, out)


if __name__ == "__main__":
    main()
    finish()  # the run's gloo groups outlive main(): end before interpreter teardown
