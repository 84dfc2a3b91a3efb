"""Run under torchrun (2 ranks): random ops under a tensor-parallel plan draw as one process would.

    torchrun --nproc_per_node 2 tests/multiproc/check_random_ops.py --out result.json

Each rank seeds its generator differently (as ``accelerate.utils.set_seed(seed, device_specific=True)`` does)
and trains models in train mode — dropout on — under a 1 x 2 Megatron plan (attention heads sharded over tp):

* ``gpt2``: tiny-gpt2 with GPT-2's default dropout (embedding, attention probabilities, residuals: 0.1); at
  this width the plan keeps attention replicated, so every mask is drawn on a value the two ranks share;
* ``llama``: tiny-llama at hidden 256 with ``attention_dropout`` 0.1: the plan shards attention over the heads,
  so the attention-probability masks are drawn per shard;
* ``llama-full`` / ``llama-selective``: the same with every block recomputed in backward (a full checkpoint,
  and a selective one that reruns the pointwise ops, dropout among them).

At every step rank 0 also runs the model on the whole batch in one process, from the generator state rank 0
had when the step began: with the tensor-parallel group agreeing on rank 0's generator and each shard drawing
its part of one whole-tensor draw, the losses and gradients are one process's. The result also holds both
ranks' losses, the largest difference of the replicated parameters between the ranks after the last step,
and, for the first step of ``llama``, the attention-probability dropout masks each rank drew for its heads;
for ``llama`` too, the tokens each rank samples with ``generate(do_sample=True)`` afterwards.

``gpt2-p0`` trains with every dropout at 0 (the generators are agreed once, then no more), then sets them to
0.1 for one more step (agreed again before the first draw) — counted broadcasts, and the same comparison.
``ddp`` applies a 2 x 1 plan: without tensor parallelism nothing is installed.
"""

from __future__ import annotations

import argparse
import copy

import torch
import torch.distributed as dist
import transformers
from common import close_gloo, init_gloo, write_results
from torch.distributed.tensor import DTensor, Replicate
from torch.utils._python_dispatch import TorchDispatchMode

DROPOUT = 0.1
WIDTH = 256
"""tiny-llama's hidden size here: wide enough that the plan shards attention over the heads."""


class _AttentionMasks(TorchDispatchMode):
    """Records the dropout draws (``bernoulli_``) on 4-D DTensors — attention probabilities — with their
    placements and this rank's local mask."""

    def __init__(self) -> None:
        super().__init__()
        self.masks: list[tuple[str, torch.Tensor]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.bernoulli_.float and isinstance(out, DTensor) and out.dim() == 4:
            self.masks.append((str(out.placements), out.to_local().detach().clone()))
        return out


def _model(name: str, dropout: float):
    from hf_colossal_auto.models import build_model, load_config

    config = load_config("tiny-llama" if name.startswith("llama") else "tiny-gpt2")
    if name.startswith("llama"):
        config.attention_dropout = dropout
        # at the preset's width the solver keeps attention replicated (gathers cost less than they save)
        config.hidden_size, config.intermediate_size = WIDTH, 4 * WIDTH
        config.head_dim = WIDTH // config.num_attention_heads
    else:
        config.resid_pdrop = config.embd_pdrop = config.attn_pdrop = dropout
    torch.manual_seed(0)
    model = build_model(config, device="cpu")
    model.train()
    return model


def _set_dropout(model: torch.nn.Module, p: float) -> None:
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = p


def _full_grads(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad for p in model.parameters()]


def _replicated_gap(model: torch.nn.Module) -> float:
    """The largest difference between this rank's replicated parameters and rank 0's."""
    worst = 0.0
    for p in model.parameters():
        if isinstance(p, DTensor) and all(isinstance(q, Replicate) for q in p.placements):
            mine = p.to_local().detach().clone()
            first = mine.clone()
            dist.broadcast(first, src=0)
            worst = max(worst, float((mine - first).abs().max()))
    gaps = [None] * dist.get_world_size()
    dist.all_gather_object(gaps, worst)
    return max(gaps)


def _plan(model, batch, mesh: tuple[int, int], recompute: str | None):
    from hf_colossal_auto.apply import broadcast_plan
    from hf_colossal_auto.solve.planner import evaluate_plan

    made = None
    if dist.get_rank() == 0:
        made = evaluate_plan(model, batch, "megatron", num_devices=2, device="cpu", mesh_shape=mesh).plan
        if recompute:
            blocks = [n for n, m in model.named_modules() if n.count(".") == 2 and n.split(".")[-1].isdigit()]
            made.recompute = {b: recompute for b in blocks}
    return broadcast_plan(made)


class _Counter:
    """Counts calls of a function it wraps (the generator agreements, the whole-tensor draws)."""

    def __init__(self, owner, attr: str) -> None:
        self.owner, self.attr, self.calls = owner, attr, 0
        self.original = getattr(owner, attr)

        def counted(*args, **kwargs):
            self.calls += 1
            return self.original(*args, **kwargs)

        setattr(owner, attr, counted)

    def restore(self) -> None:
        setattr(self.owner, self.attr, self.original)


def train(name: str, args: argparse.Namespace) -> dict:
    """Train ``name`` under a 1 x 2 plan against one process (see the module doc)."""
    from hf_colossal_auto import autoparallelize
    from hf_colossal_auto.apply import rng
    from hf_colossal_auto.models import make_example_inputs

    rank, world = dist.get_rank(), dist.get_world_size()
    recompute = {"full": "full", "selective": "selective:pointwise"}.get(name.partition("-")[2])
    model = _model(name, 0.0 if name == "gpt2-p0" else DROPOUT)
    batch = make_example_inputs(model, args.batch, args.seq, seed=0)
    reference = copy.deepcopy(model)
    autoparallelize(model, plan=_plan(model, batch, (1, 2), recompute))
    torch.manual_seed(1234 + rank)  # device-specific seeds: the ranks' generators differ
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    agreements = _Counter(rng.ModelParallelRNG, "agree")
    whole_draws = _Counter(rng, "_whole_draw")
    losses, ref_losses, worst, masks, agreed_per_step = [], [], 0.0, [], []
    for step in range(args.steps):
        if name == "gpt2-p0" and step == args.steps - 1:  # dropout switched on after forwards without
            _set_dropout(model, DROPOUT)
            _set_dropout(reference, DROPOUT)
        state = torch.get_rng_state()
        before = agreements.calls
        spy = _AttentionMasks() if step == 0 and name == "llama" else None
        if spy is not None:
            with spy:
                loss = model(**batch).loss
            masks = spy.masks
        else:
            loss = model(**batch).loss
        loss.backward()
        agreed_per_step.append(agreements.calls - before)
        grads = _full_grads(model)
        if rank == 0:
            with torch.random.fork_rng():
                torch.set_rng_state(state)  # one process, from rank 0's generator at the step's start
                ref_loss = reference(**batch).loss
            ref_loss.backward()
            worst = max(
                worst,
                max(
                    float((g - r.grad).abs().max())
                    for g, r in zip(grads, reference.parameters(), strict=True)
                ),
            )
            ref_losses.append(float(ref_loss.detach()))
            ref_opt.step()
            ref_opt.zero_grad(set_to_none=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        both = [None] * world
        dist.all_gather_object(both, float(loss.detach()))
        losses.append(both)
    agreements.restore()
    whole_draws.restore()
    sampled = _sampled_tokens(model, batch) if name == "llama" else None
    gathered = [None] * world
    dist.all_gather_object(gathered, [(p, m.tolist()) for p, m in masks])
    result = {
        "model": name,
        "losses": losses,
        "reference_losses": ref_losses,
        "max_grad_diff": worst,
        "replicated_gap": _replicated_gap(model),
        "agreements_per_step": agreed_per_step,
        "whole_draws": whole_draws.calls,
        "recomputed": sorted(k for k, v in model._hf_colossal_auto_plan.recompute.items() if v != "none"),
        "attention_masks": gathered,  # per rank: [(placements, local mask)] of the first step
        "sampled_tokens": sampled,  # per rank: generate(do_sample=True)'s tokens
    }
    del model, opt, reference, ref_opt
    dist.barrier()
    return result


def _sampled_tokens(model, batch) -> list:
    """Every rank's tokens of ``generate(do_sample=True)`` (eval mode, the ranks' generators differing)."""
    model.eval()
    torch.manual_seed(99 + dist.get_rank())
    prompt = batch["input_ids"][:2, :4]
    tokens = model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=True, max_new_tokens=6)
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, tokens[:, 4:].tolist())
    model.train()
    return every


def ddp_installs_nothing(args: argparse.Namespace) -> dict:
    """A 2 x 1 plan (no tensor parallelism): no generator agreement, each rank draws its own masks."""
    from hf_colossal_auto import autoparallelize
    from hf_colossal_auto.apply.rng import rng_of
    from hf_colossal_auto.models import make_example_inputs

    model = _model("gpt2", DROPOUT)
    batch = make_example_inputs(model, args.batch, args.seq, seed=0)
    autoparallelize(model, plan=_plan(model, batch, (2, 1), None))
    torch.manual_seed(1234 + dist.get_rank())
    rows = {k: v[dist.get_rank() :: 2] for k, v in batch.items()}
    loss = float(model(**rows).loss)
    both = [None] * dist.get_world_size()
    dist.all_gather_object(both, loss)
    result = {"model": "ddp", "installed": rng_of(model) is not None, "losses": both}
    del model
    dist.barrier()
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="gpt2,llama,llama-full,llama-selective,gpt2-p0,ddp")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=16)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    transformers.logging.set_verbosity_error()
    init_gloo(timeout_s=120)
    results = [
        ddp_installs_nothing(args) if name == "ddp" else train(name, args) for name in args.models.split(",")
    ]
    write_results(results, args.out)
    close_gloo(exit_process=True)


if __name__ == "__main__":
    main()
