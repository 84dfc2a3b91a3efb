"""Plan a Mixtral-8x7B-class model (or Qwen3-30B-A3B: ``--model``) for 64 H100 (8 per node) and price the MoE
strategies under one cost model.

The auto plan (``plan_model``) against the same plan with the experts replicated (a), split inside every
expert (b) or whole experts per rank (c) (its mesh and data-parallel mode, recompute re-chosen); and, at a
fixed tensor-parallel size with DDP (what ``evaluate_plan`` does with a ``tp_plan`` dict), replicated experts (HF's own
``base_model_tp_plan`` without its expert entries: attention TP only, every rank computes every expert) and
TP inside every expert (the full ``base_model_tp_plan``: gate/up split on the intermediate dim, down on its
input), HF's ``base_model_ep_plan`` (expert parallel), plus DDP and FSDP, and, where the data-parallel size
divides the experts, DDP and FSDP with the experts sharded over the data-parallel axis (all-to-all dispatch). The model is built on ``meta`` from a config (nothing downloaded); routing is
priced under the uniform-load assumption (``hf_colossal_auto.capture.moe``).

    python scripts/bench_moe_planning.py [--json moe.json] [--tp 8] [--devices 64] [--device h100-80gb]
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import time

from transformers import MixtralConfig, Qwen3MoeConfig

from hf_colossal_auto import build_model, evaluate_plan, make_example_inputs, plan_model
from hf_colossal_auto.solve.planner import _expert_dp_offered
from hf_colossal_auto.solve.problem import InfeasibleError

MIXTRAL_8X7B = dict(
    vocab_size=32000,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    num_local_experts=8,
    num_experts_per_tok=2,
    max_position_embeddings=32768,
    output_router_logits=True,
    router_aux_loss_coef=0.02,
    use_cache=False,
    tie_word_embeddings=False,
)

QWEN3_30B_A3B = dict(
    vocab_size=151936,
    hidden_size=2048,
    intermediate_size=6144,
    moe_intermediate_size=768,
    num_hidden_layers=48,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=128,
    num_experts=128,
    num_experts_per_tok=8,
    max_position_embeddings=40960,
    output_router_logits=True,
    use_cache=False,
    tie_word_embeddings=False,
)
MODELS = {"mixtral-8x7b": (MixtralConfig, MIXTRAL_8X7B), "qwen3-30b-a3b": (Qwen3MoeConfig, QWEN3_30B_A3B)}


def _row(name: str, plan, seconds: float) -> dict:
    """The figures of one plan or baseline that the benchmark table shows."""
    choices = sorted(set(plan.moe_layers.values()))
    return {
        "strategy": name,
        "mesh": list(plan.mesh_shape),
        "dp_mode": plan.dp_mode,
        "step_time_s": plan.step_time_s,
        "compute_s": plan.compute_time_s,
        "communication_s": plan.communication_time_s,
        "recompute_s": plan.recompute_time_s,
        "peak_gib": plan.peak_memory_bytes / 2**30,
        "fits": plan.fits,
        "moe": choices,
        "seconds": seconds,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, default=64)
    parser.add_argument("--per-node", type=int, default=8)
    parser.add_argument("--seqs-per-device", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--tp", type=int, default=8, help="tensor-parallel size of the expert baselines")
    parser.add_argument("--device", default="h100-80gb", help="device preset (e.g. h200)")
    parser.add_argument("--model", choices=sorted(MODELS), default="mixtral-8x7b")
    parser.add_argument("--json")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    config_class, config = MODELS[args.model]
    model = build_model(config_class(**config), device="meta")
    batch = make_example_inputs(model, args.seqs_per_device * args.devices, args.seq_len, device="meta")
    common = dict(
        num_devices=args.devices, device=args.device, devices_per_node=args.per_node, mixed_precision="bf16"
    )
    rows = []
    start = time.perf_counter()
    auto = plan_model(model, batch, **common)
    rows.append(_row("auto", auto, time.perf_counter() - start))
    print(auto.summary(max_rows=12), flush=True)
    # (a) and (b) on the auto plan's own mesh and data-parallel mode: its placements with only the experts'
    # changed, recompute re-chosen per block to fit (evaluate_plan pins every parameter a Plan names)
    for name, expert_placement in [
        ("auto mesh, experts replicated", lambda p: "R"),
        ("auto mesh, TP inside every expert", lambda p: "S1" if p.endswith("gate_up_proj") else "S2"),
        ("auto mesh, expert parallel", lambda p: "S0"),
    ]:
        variant = copy.deepcopy(auto)
        for fqn in variant.param_placements:
            if ".experts." in fqn:
                variant.param_placements[fqn] = [variant.param_placements[fqn][0], expert_placement(fqn)]
        variant.moe_layers = {}
        start = time.perf_counter()
        estimate = evaluate_plan(model, batch, variant, recompute="auto", **common)
        rows.append(_row(name, estimate.plan, time.perf_counter() - start))
        print(rows[-1], flush=True)
    tp_plan = dict(model.config.base_model_tp_plan)
    no_experts = {k: v for k, v in tp_plan.items() if ".experts" not in k}
    mesh = (args.devices // args.tp, args.tp)
    for name, baseline, shape in [
        ("experts replicated (attention TP)", no_experts, mesh),
        ("TP inside every expert (HF tp_plan)", tp_plan, mesh),
        ("expert parallel (HF tp_plan + ep_plan)", {**no_experts, **model.config.base_model_ep_plan}, mesh),
        ("ddp", "ddp", None),
        ("fsdp", "fsdp", None),
    ]:
        start = time.perf_counter()
        estimate = evaluate_plan(model, batch, baseline, mesh_shape=shape, recompute="auto", **common)
        rows.append(_row(name, estimate.plan, time.perf_counter() - start))
        print(rows[-1], flush=True)
    if _expert_dp_offered(model, (args.devices, 1)):  # experts over the data-parallel axis: dp divides them
        for key in ("ddp-ep", "fsdp-ep"):  # the other parameters replicated / sharded by FSDP
            name = f"experts over dp ({key}, all-to-all)"
            start = time.perf_counter()
            try:
                plan = plan_model(model, batch, **common, mesh_shape=(args.devices, 1), dp_modes=(key,))
                rows.append(_row(name, plan, time.perf_counter() - start))
            except InfeasibleError as error:  # what it needs is the finding
                rows.append({"strategy": name, "infeasible": str(error)})
            print(rows[-1], flush=True)
    for r in rows:
        if "infeasible" in r:
            print(f"| {r['strategy']} | no plan fits: {r['infeasible']} |")
            continue
        print(
            f"| {r['strategy']} | {r['mesh'][0]}×{r['mesh'][1]} {r['dp_mode']} | {', '.join(r['moe'])} | "
            f"{r['step_time_s']:.3f} s | {r['peak_gib']:.1f} GiB | {'yes' if r['fits'] else 'no'} | "
            f"{r['seconds']:.0f} s |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
