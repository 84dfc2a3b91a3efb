"""ZB-V step time on 2 gloo ranks with the runtime's weight pass (one ``autograd.grad`` over every parameter group
where a stage holds checkpointed blocks, ``_torch_compat.merged_weight_groups``) against torch's own (one call per
group, each rerunning a checkpointed block).

    torchrun --nproc_per_node 2 scripts/bench_zero_bubble_weight_pass.py --recompute full
    torchrun --nproc_per_node 2 scripts/bench_zero_bubble_weight_pass.py --recompute none --always-merge

A 4-block Llama (hidden 512, 8 heads, vocab 6000), 4 x 128 tokens, pp 2 ZB-V with 4 micro-batches, fp32, AdamW;
the median of 5 steps after one warm-up, each variant in turn in the same processes. ``--always-merge`` merges on
stages without recompute too (what the runtime does not do: it measured slower). Rank 0 prints seconds a step.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

import hf_colossal_auto._torch_compat as compat
import hf_colossal_auto.apply.pipeline_runner as runner
from hf_colossal_auto.apply import apply_plan
from hf_colossal_auto.models import build_model, load_config, make_example_inputs
from hf_colossal_auto.pipeline_layout import hand_pipeline_plan


def step_seconds(cfg, recompute: str, steps: int = 5) -> float:
    torch.manual_seed(0)
    model = build_model(cfg, device="cpu")
    batch = make_example_inputs(model, 4, 128, seed=0)
    plan = hand_pipeline_plan(model, batch, pp_size=2, schedule="zbv", micro_batches=4, recompute=recompute)
    apply_plan(model, plan)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    times = []
    for _ in range(steps + 1):
        dist.barrier()
        start = time.perf_counter()
        model(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        dist.barrier()
        times.append(time.perf_counter() - start)
    del model, optimizer
    dist.barrier()
    return statistics.median(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recompute", default="full", help="every block's option: none, full, selective:...")
    parser.add_argument("--always-merge", action="store_true", help="merge on stages without recompute too")
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
    runtime_stage, merge = runner.pipeline_stage_with_transient_receive_buffers, compat.merged_weight_groups
    results = {}
    for variant in ("runtime", "torch per group"):
        if variant == "torch per group":
            compat.merged_weight_groups = lambda groups: groups
        elif args.always_merge:

            def always(*a, **k):
                return runtime_stage(*a, **{**k, "merge_weight_pass": True})

            runner.pipeline_stage_with_transient_receive_buffers = always
        results[variant] = step_seconds(cfg, args.recompute)
        compat.merged_weight_groups, compat.pipeline_stage_with_transient_receive_buffers = (
            merge,
            runtime_stage,
        )
    if dist.get_rank() == 0:
        print(f"recompute {args.recompute}{' (merged everywhere)' if args.always_merge else ''}: "
              + ", ".join(f"{k} {v:.3f} s a step" for k, v in results.items()))  # fmt: skip
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
