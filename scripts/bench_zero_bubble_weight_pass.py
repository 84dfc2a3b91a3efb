"""ZB-V step time on 2 gloo ranks with the runtime's recompute (one shared rerun a micro-batch serving the input
and the weight pass, ``apply/shared_rerun.py``) against torch's checkpoint (what torch alone does: a rerun in the
input pass and one in each parameter group's ``autograd.grad`` of the weight pass). Both run torch's own weight
pass, one call per parameter group.

    torchrun --nproc_per_node 2 scripts/bench_zero_bubble_weight_pass.py --recompute full
    torchrun --nproc_per_node 2 scripts/bench_zero_bubble_weight_pass.py --recompute selective:pointwise

A 4-block Llama (hidden 512, 8 heads, vocab 6000), 4 x 128 tokens, pp 2 ZB-V with 4 micro-batches, fp32, AdamW;
the median of 5 steps after one warm-up, each variant in turn in the same processes, twice over. Rank 0 prints
seconds a step (the slower rank's; the faster round, and each round's) and the most attention calls a block made
in a step (4 forwards + its reruns). torch's selective checkpoint cannot run under ZB-V (its cache serves one
backward pass: the weight pass's rerun raises), which the line says instead of a time.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import Counter

import torch
import torch.distributed as dist

import hf_colossal_auto.apply.recompute as recompute
from hf_colossal_auto.apply import apply_plan
from hf_colossal_auto.models import build_model, load_config, make_example_inputs
from hf_colossal_auto.pipeline_layout import hand_pipeline_plan

VARIANTS = {"shared rerun": recompute.SPLIT_BACKWARD_SCHEDULES, "torch checkpoint": frozenset()}
"""Variant -> the schedules ``apply_recompute`` gives the shared rerun (none: torch's checkpoint everywhere)."""
ROUNDS = 2


def step_seconds(cfg, option: str, steps: int = 5) -> tuple[float, int]:
    """The median step time and the most attention calls a block of this rank made in the last step."""
    torch.manual_seed(0)
    model = build_model(cfg, device="cpu")
    batch = make_example_inputs(model, 4, 128, seed=0)
    plan = hand_pipeline_plan(model, batch, pp_size=2, schedule="zbv", micro_batches=4, recompute=option)
    apply_plan(model, plan)
    calls: Counter[str] = Counter()
    for name, module in model.named_modules():
        if name.endswith("self_attn"):
            module.register_forward_pre_hook(lambda *_, name=name: calls.update([name]))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    times = []
    for _ in range(steps + 1):
        calls.clear()
        dist.barrier()
        start = time.perf_counter()
        model(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        dist.barrier()
        times.append(time.perf_counter() - start)
    del model, optimizer
    dist.barrier()
    return statistics.median(times[1:]), max(calls.values(), default=0)


def run_variant(cfg, option: str, schedules: frozenset[str]) -> tuple[float, int]:
    """One variant's slowest rank's step time and the most attention calls a block made on any rank."""
    recompute.SPLIT_BACKWARD_SCHEDULES = schedules
    every: list[tuple[float, int] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(every, step_seconds(cfg, option))
    return max(s for s, _ in every), max(c for _, c in every)


def runs(schedules: frozenset[str], option: str) -> bool:
    """torch's selective checkpoint under ZB-V is not run: its weight pass's rerun raises on one rank while the
    other waits for it (``tests/test_recompute.py`` holds that behaviour)."""
    return bool(schedules) or not option.startswith("selective")


def _phrase(rounds: list[tuple[float, int]]) -> str:
    """A variant's figures: the faster round's step time, each round's, the attention calls a block a step."""
    if not rounds:
        return "not run (torch's selective cache serves one backward pass: the weight pass's rerun raises)"
    each = ", ".join(f"{s:.3f}" for s, _ in rounds)
    return f"{min(s for s, _ in rounds):.3f} s a step (rounds {each}), {rounds[0][1]} attention calls a block a step"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recompute", default="full", help="every block's option: none, full, selective:...")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    cfg = load_config("tiny-llama")
    cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers, cfg.vocab_size = (
        512,
        512 * 11 // 4,
        4,
        6000,
    )
    cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim = 8, 8, 64
    original = recompute.SPLIT_BACKWARD_SCHEDULES
    results: dict[str, list[tuple[float, int]]] = {name: [] for name in VARIANTS}
    try:
        for _ in range(ROUNDS):  # the variants in turn, again: a transient load shows as one slow round
            for name, schedules in VARIANTS.items():
                if runs(schedules, args.recompute):
                    results[name].append(run_variant(cfg, args.recompute, schedules))
    finally:
        recompute.SPLIT_BACKWARD_SCHEDULES = original
    if dist.get_rank() == 0:
        phrases = "; ".join(f"{name}: {_phrase(got)}" for name, got in results.items())
        print(f"recompute {args.recompute}: {phrases}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
