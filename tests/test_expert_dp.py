"""Expert parallelism over the data-parallel axis (issue 14, Build 2(c)): experts sharded over ranks that hold
different tokens, each (token, expert) pair's row sent to its expert's rank and its result sent back by
all-to-all (``apply/moe.py::expert_data_parallel_forward``), planned as the DDP candidate "ddp-ep"."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from multiproc.common import wide_mixtral
from torchrun_launch import run_torchrun, why_it_failed

from hf_colossal_auto.capture.moe import experts_modules
from hf_colossal_auto.models import build_model, load_config, make_example_inputs
from hf_colossal_auto.plan import Plan
from hf_colossal_auto.solve.planner import _expert_dp_offered, evaluate_plan, plan_model

ROOT = Path(__file__).resolve().parents[1]
EXPERT_WEIGHTS = ("experts.gate_up_proj", "experts.down_proj")


def _tiny_mixtral():
    torch.manual_seed(0)
    model = build_model("tiny-mixtral", device="cpu")
    model.eval()
    return model


def _wide_mixtral(intermediate_size: int = 1024):
    """Mixtral at hidden 256, intermediate ``intermediate_size``, 8 experts: experts large against the tokens of a
    small batch."""
    model = wide_mixtral(intermediate_size)
    model.eval()
    return model


def _expert_dp_plan(model, batch) -> Plan:
    return plan_model(model, batch, num_devices=2, device="cpu", mesh_shape=(2, 1), dp_modes=("ddp-ep",))


def test_the_plan_names_it_and_stores_the_experts_split_over_dp():
    model = _tiny_mixtral()
    batch = make_example_inputs(model, 4, 16, seed=0)
    plan = _expert_dp_plan(model, batch)
    layers = sorted(experts_modules(model))
    assert plan.expert_data_parallel == layers
    assert plan.moe_layers == dict.fromkeys(layers, "experts: EP×2 (dp)")
    assert plan.dp_mode == "ddp" and tuple(plan.mesh_shape) == (2, 1)
    for fqn, placements in plan.param_placements.items():
        assert placements == (["S0", "R"] if fqn.endswith(EXPERT_WEIGHTS) else ["R", "R"]), fqn
    assert "experts: EP×2 (dp) in 2 layers" in plan.summary()
    assert plan.dp_label == "ddp, experts over dp" and "data parallel: ddp, experts over dp" in plan.summary()
    assert Plan.from_dict(json.loads(plan.to_json())).expert_data_parallel == layers
    # evaluate_plan prices the plan as it was made
    again = evaluate_plan(model, batch, plan, num_devices=2, device="cpu").plan
    assert again.step_time_s == pytest.approx(plan.step_time_s, rel=1e-9)
    assert again.collectives == plan.collectives and again.collective_bytes == plan.collective_bytes


@pytest.mark.parametrize("preset", ["tiny-qwen3-moe", "tiny-qwen2-moe"])
def test_other_families_run_what_is_predicted(preset):
    """Qwen3-MoE and Qwen2-MoE (a shared expert beside the routed ones): the same exchange, simulated as
    predicted (counts and bytes); DDP all-reduces every trained parameter but the expert weights."""
    from hf_colossal_auto.apply.simulate import simulate_collectives

    torch.manual_seed(0)
    model = build_model(preset, device="cpu")
    model.eval()
    batch = make_example_inputs(model, 4, 16, seed=0)
    plan = _expert_dp_plan(model, batch)
    assert set(plan.moe_layers.values()) == {"experts: EP×2 (dp)"}
    if dist.is_initialized():
        dist.destroy_process_group()
    ran = simulate_collectives(model, plan, {k: v[:2] for k, v in batch.items()})
    predicted = {k.removeprefix("dp_"): int(v) for k, v in plan.collectives.items() if k != "dp_all_reduce"}
    predicted_bytes = {k.removeprefix("dp_"): int(v) for k, v in plan.collective_bytes.items()}
    assert predicted == {"all_to_all": 10}
    assert (dict(ran.counts), dict(ran.bytes)) == (predicted, predicted_bytes)
    expert_weights = sum(1 for n in plan.param_placements if plan.param_placements[n][0] == "S0")
    assert expert_weights == 4
    trained = sum(1 for p in model.parameters() if p.requires_grad)
    assert plan.collectives["dp_all_reduce"] == trained - expert_weights


def test_a_measured_routing_load_prices_the_busiest_replica():
    """Under a measured histogram the grouped GEMMs wait for the data-parallel rank whose experts get the most
    rows: a flat histogram prices as uniform routing, a skewed one (the first rank's experts get 1.56 times the
    mean) more. The collectives one rank hands in are predicted as the mean rank's (exact summed over the
    ranks, whatever the routing), so they are the same; the busiest rank's all-to-alls are priced longer."""
    from hf_colossal_auto.capture.moe import RoutingLoad

    model = _tiny_mixtral()
    batch = make_example_inputs(model, 4, 16, seed=0)
    layers = sorted(experts_modules(model))

    def planned(routing):
        return plan_model(
            model,
            batch,
            num_devices=2,
            device="cpu",
            mesh_shape=(2, 1),
            dp_modes=("ddp-ep",),
            routing=routing,
        )

    uniform = planned(None)
    flat = planned(RoutingLoad({f: (25, 25, 25, 25) for f in layers}))
    skewed = planned(RoutingLoad({f: (60, 40, 20, 8) for f in layers}))
    assert flat.step_time_s == pytest.approx(uniform.step_time_s, rel=1e-12)
    assert skewed.step_time_s > uniform.step_time_s and skewed.moe_load == "measured"
    assert skewed.collectives == uniform.collectives and skewed.collective_bytes == uniform.collective_bytes


def test_the_exchange_is_priced_at_the_busiest_rank():
    """The exchange of each layer as the builder prices it: the counts' all-to-all (4 experts' int64 counts)
    and four row exchanges of the 64 (token, expert) pairs' rows (batch 2 x 16, top-2, hidden 64, fp32),
    handed in as the mean rank's bytes; under a measured histogram whose first rank's experts get 100 of 128
    rows the row exchanges are priced at that rank's 1.5625 times, the counts' are not."""
    from hf_colossal_auto.capture import trace_training_step
    from hf_colossal_auto.capture.moe import RoutingLoad
    from hf_colossal_auto.solve.build import expert_exchanges
    from hf_colossal_auto.solve.tied import TiedGraph

    model = _tiny_mixtral()
    graph = trace_training_step(model, make_example_inputs(model, 2, 16, seed=0))
    tied = TiedGraph.build(graph)
    layers = sorted(experts_modules(model))
    uniform = expert_exchanges(graph, tied, 2)
    skewed = expert_exchanges(graph, tied, 2, RoutingLoad({f: (60, 40, 20, 8) for f in layers}))
    rows = 64 * 64 * 4.0
    assert sum(e.layers for e in uniform.values()) == 2
    for module, exchange in uniform.items():
        assert exchange.collectives == [("all_to_all", 32.0, 32.0)] + [("all_to_all", rows, rows)] * 4
        assert exchange.skew == 1.0 and exchange.sender_kernels  # the sender's own kernels are priced
        assert skewed[module].skew == pytest.approx(100 / 64)
        assert (
            skewed[module].collectives
            == [("all_to_all", 32.0, 32.0)] + [("all_to_all", rows, rows * 100 / 64)] * 4
        )


def test_folded_blocks_count_every_layer():
    """Five Mixtral layers, traced once and folded: the exchange is priced and predicted for all five (25
    all-to-alls), as the simulated run issues them, and all ten expert weights are stored
    split over dp and left out of DDP's all-reduces."""
    from hf_colossal_auto.apply.simulate import simulate_collectives

    cfg = load_config("tiny-mixtral")
    cfg.num_hidden_layers = 5
    torch.manual_seed(0)
    model = build_model(cfg, device="cpu")
    model.eval()
    batch = make_example_inputs(model, 4, 16, seed=0)
    plan = _expert_dp_plan(model, batch)
    assert len(plan.expert_data_parallel) == 5
    assert sum(1 for v in plan.param_placements.values() if v[0] == "S0") == 10
    assert plan.collectives["dp_all_reduce"] == sum(1 for _ in model.parameters()) - 10
    if dist.is_initialized():
        dist.destroy_process_group()
    ran = simulate_collectives(model, plan, {k: v[:2] for k, v in batch.items()})
    assert dict(ran.counts) == {"all_to_all": 25}
    assert dict(ran.bytes) == {k.removeprefix("dp_"): int(v) for k, v in plan.collective_bytes.items()}


def test_predicted_collectives_equal_the_simulated_run():
    """One rank's forward + backward under the fake process group: the exchange's 5 all-to-alls per MoE layer
    (the per-expert counts; the pairs' rows out and their results back; in backward the results' gradient
    out and the rows' gradient back), counts and bytes, as predicted (the symbolic run splits the rows as
    uniform routing does); DDP all-reduces every trained parameter but the 4 expert weights (not counted by
    the simulation: plain collectives)."""
    from hf_colossal_auto.apply.simulate import simulate_collectives

    model = _tiny_mixtral()
    batch = make_example_inputs(model, 4, 16, seed=0)
    plan = _expert_dp_plan(model, batch)
    if dist.is_initialized():
        dist.destroy_process_group()
    ran = simulate_collectives(model, plan, {k: v[:2] for k, v in batch.items()})  # one replica's rows
    predicted = {k.removeprefix("dp_"): int(v) for k, v in plan.collectives.items() if k != "dp_all_reduce"}
    predicted_bytes = {k.removeprefix("dp_"): int(v) for k, v in plan.collective_bytes.items()}
    assert predicted == {"all_to_all": 10}
    assert (dict(ran.counts), dict(ran.bytes)) == (predicted, predicted_bytes)
    # batch 2 x 16 rows per replica, top-2: 64 (token, expert) pairs of hidden 64 in fp32, 4 row exchanges,
    # and 4 experts' int64 counts, per layer
    assert predicted_bytes == {"all_to_all": 2 * (4 * 64 * 64 * 4 + 4 * 8)}
    trained = sum(1 for p in model.parameters() if p.requires_grad)
    assert plan.collectives["dp_all_reduce"] == trained - 4


def test_the_planner_chooses_it_where_it_pays_and_prices_it_where_it_does_not():
    """Wide experts (intermediate 2048), few tokens (batch 2 x 8) on cpu/gloo: DDP all-reduces 2 x 8 experts'
    gradients (100 MB) and plain FSDP gathers them per block, the exchange moves a few tens of KB: the planner
    picks it (with FSDP for the other parameters). At intermediate 1024 plain FSDP wins instead: it runs on
    ordinary tensors, the exchange's layers on DTensors (their per-op host cost outweighs the experts'
    gathers there). Tiny Mixtral with more tokens (batch 8 x 64: the exchange's rows grow with them, the
    experts' gradients do not): offered and priced, DDP with replicated experts is faster. Its model state is
    smaller by the experts' share either way."""
    batch = make_example_inputs(_wide_mixtral(), 2, 8, seed=0)
    narrower = plan_model(_wide_mixtral(), batch, num_devices=2, device="cpu", mesh_shape=(2, 1))
    tried = {a["dp_label"]: a["step_time_s"] for a in narrower.alternatives}
    assert narrower.dp_label == "fsdp" and tried["fsdp"] == min(tried.values())
    assert tried["fsdp, experts over dp"] < tried["ddp, experts over dp"] < tried["ddp"]
    model = _wide_mixtral(2048)
    plan = plan_model(model, batch, num_devices=2, device="cpu", mesh_shape=(2, 1))
    tried = {a["dp_label"]: a["step_time_s"] for a in plan.alternatives}
    assert set(tried) >= {"ddp", "ddp, experts over dp", "fsdp", "fsdp, experts over dp"}
    assert plan.expert_data_parallel == sorted(experts_modules(model))
    assert tried["ddp, experts over dp"] < tried["ddp"]
    assert tried["fsdp, experts over dp"] < tried["fsdp"]
    # its few non-expert parameters: FSDP's gathers hide behind the whole step's compute, DDP's all-reduce
    # behind backward only
    assert plan.dp_label == "fsdp, experts over dp"
    assert tried["fsdp, experts over dp"] == min(tried.values()) < tried["ddp, experts over dp"]

    tiny = _tiny_mixtral()
    batch = make_example_inputs(tiny, 8, 64, seed=0)
    ddp = plan_model(tiny, batch, num_devices=2, device="cpu", mesh_shape=(2, 1), dp_modes=("ddp",))
    tried = {a["dp_label"]: a["step_time_s"] for a in ddp.alternatives}
    assert ddp.expert_data_parallel == [] and tried["ddp"] < tried["ddp, experts over dp"]
    ep = _expert_dp_plan(tiny, batch)
    expert_bytes = sum(p.numel() * 4 for n, p in tiny.named_parameters() if n.endswith(EXPERT_WEIGHTS))
    # parameters, AdamW's two states, gradients and the step's temporaries of half the experts
    saved = ddp.param_memory_bytes - ep.param_memory_bytes
    assert 2 * expert_bytes < saved < 3 * expert_bytes


def test_scope_is_ddp_on_a_data_parallel_axis_dividing_the_experts():
    from hf_colossal_auto.apply.moe import check_expert_data_parallel

    model = _tiny_mixtral()  # 4 experts
    assert _expert_dp_offered(model, (2, 1)) and _expert_dp_offered(model, (4, 1))
    assert not _expert_dp_offered(model, (1, 2))  # no data-parallel axis
    assert not _expert_dp_offered(model, (2, 2))  # tensor parallelism: not in this runtime's scope
    assert not _expert_dp_offered(model, (8, 1))  # 8 ranks, 4 experts
    plan = plan_model(
        model,
        make_example_inputs(model, 4, 16, seed=0),
        num_devices=2,
        device="cpu",
        mesh_shape=(1, 2),
        dp_modes=("ddp-ep",),
    )
    assert plan.expert_data_parallel == []  # nothing to offer on 1 x 2: the tensor-parallel candidates only
    ep = _expert_dp_plan(model, make_example_inputs(model, 4, 16, seed=0))
    check_expert_data_parallel(model, Plan.from_dict({**ep.to_dict(), "dp_mode": "fsdp"}))  # "fsdp-ep"
    hsdp = Plan.from_dict(ep.to_dict())
    hsdp.dp_mode = "hsdp"  # set by hand (no HSDP shard group divides a data-parallel axis of 2)
    with pytest.raises(ValueError, match=r"DDP or FSDP, not HSDP.*dp_modes=\('fsdp-ep',\)"):
        check_expert_data_parallel(model, hsdp)
    wrong = Plan.from_dict(ep.to_dict())
    name = next(n for n in wrong.param_placements if n.endswith(EXPERT_WEIGHTS))
    wrong.param_placements[name] = ["R", "R"]
    with pytest.raises(ValueError, match="must be stored"):
        check_expert_data_parallel(model, wrong)
    with pytest.raises(ValueError, match="dp_modes"):
        plan_model(
            model, make_example_inputs(model, 4, 16, seed=0), num_devices=2, device="cpu", dp_modes=("ep",)
        )


def test_fsdp_ep_shards_the_rest_with_fsdp_and_leaves_the_experts_out():
    """FSDP ("fsdp-ep") for every parameter but the experts, which are split over dp as under "ddp-ep". The
    plan names it, stores every parameter split over dp, predicts FSDP's gathers and reduce-scatters for the
    other parameters only plus the exchange's all-to-alls (the symbolic run's, counts and bytes), and
    evaluate_plan prices it as made. Its peak is below plain FSDP's: the experts are never gathered."""
    from hf_colossal_auto.apply.simulate import simulate_collectives

    model = _tiny_mixtral()
    batch = make_example_inputs(model, 4, 16, seed=0)
    plan = plan_model(model, batch, num_devices=2, device="cpu", mesh_shape=(2, 1), dp_modes=("fsdp-ep",))
    layers = sorted(experts_modules(model))
    assert (plan.dp_mode, plan.expert_data_parallel, plan.dp_shard_size) == ("fsdp", layers, 2)
    assert plan.moe_layers == dict.fromkeys(layers, "experts: EP×2 (dp)")
    assert (
        plan.dp_label == "fsdp, experts over dp" and "data parallel: fsdp, experts over dp" in plan.summary()
    )
    assert [a["dp_label"] for a in plan.alternatives] == ["fsdp, experts over dp"]
    assert all(placements == ["S0", "R"] for placements in plan.param_placements.values())
    trained = sum(1 for p in model.parameters() if p.requires_grad)
    assert {k: v for k, v in plan.collectives.items() if v} == {
        "dp_all_gather": 2 * (trained - 4),  # forward and backward, every parameter but the 4 expert weights
        "dp_reduce_scatter": trained - 4,
        "dp_all_to_all": 10,
    }
    assert plan.collective_bytes == {"dp_all_to_all": 2 * (4 * 64 * 64 * 4 + 4 * 8)}
    again = evaluate_plan(model, batch, plan, num_devices=2, device="cpu").plan
    assert again.step_time_s == pytest.approx(plan.step_time_s, rel=1e-9)
    assert again.peak_memory_bytes == plan.peak_memory_bytes
    assert again.collectives == plan.collectives and again.collective_bytes == plan.collective_bytes
    # offered with "fsdp" (where dp divides the experts), beside plain FSDP with the experts gathered per block
    fsdp = plan_model(model, batch, num_devices=2, device="cpu", mesh_shape=(2, 1), dp_modes=("fsdp",))
    tried = {a["dp_label"]: a for a in fsdp.alternatives}
    assert set(tried) == {"fsdp", "fsdp, experts over dp"}
    assert tried["fsdp, experts over dp"]["peak_memory_bytes"] == plan.peak_memory_bytes
    assert plan.peak_memory_bytes < tried["fsdp"]["peak_memory_bytes"]
    # one rank's step under the fake process group: the exchange as predicted (FSDP's collectives are plain
    # ones, which the simulation does not count: the two-rank test counts them)
    if dist.is_initialized():
        dist.destroy_process_group()
    ran = simulate_collectives(model, plan, {k: v[:2] for k, v in batch.items()})
    assert dict(ran.counts) == {"all_to_all": 10}
    assert dict(ran.bytes) == {"all_to_all": int(plan.collective_bytes["dp_all_to_all"])}


@pytest.mark.slow
def test_two_ranks_train_like_one_process_and_run_what_was_predicted(tmp_path):
    """2 gloo ranks (``tests/multiproc/check_expert_dp.py``): tiny Mixtral under the "ddp-ep" plan and the wide
    Mixtral under "fsdp-ep", tiny Qwen2-MoE (shared expert) under "ddp-ep". Two AdamW steps' losses, every first-step gradient and
    the gradient norms ``clip_grad_norm_`` clips by equal one process's (fp32); every rank stores half the experts; the collectives a rank runs in a step —
    the exchange's all-to-alls and DDP's all-reduces — are the plan's prediction, their bytes (one rank's
    share follows the routing) on average over the ranks; the consolidated export (``save_pretrained``) is the trained model, loads with
    ``from_pretrained`` and equals the one-process model. Then tiny Mixtral planned for 2 micro-batches per
    replica: one accumulated step's gradients equal one process's on the same pieces, its collectives the
    plan's. Then a HF checkpoint loaded under the plan into a meta model gives one process's losses, and the
    sharded state saved after a step and loaded into a fresh model gives the uninterrupted run's next losses.
    Then the exchange alone with every pair routed to one rank's experts (the other receives nothing). Last,
    tiny Mixtral under "fsdp-ep" (FSDP for every parameter but the experts): the same comparisons, its micro-
    batched step, HF checkpoint and resume, and FSDP's gathers and reduce-scatters leaving the experts out."""
    out = tmp_path / "result.json"
    run_torchrun(str(ROOT / "tests" / "multiproc" / "check_expert_dp.py"), "--out", str(out), timeout=600)
    results = json.loads(out.read_text())
    results, micro, pretrained, resume, one_sided, fsdp = (
        results[:3],
        results[3],
        results[4],
        results[5],
        results[6],
        results[7:],
    )
    _fsdp_ep_trains_like_one_process_and_runs_what_was_predicted(*fsdp)
    # every pair routed to rank 0's experts: rank 1 receives no rows, and both ranks still get one process's
    # outputs and gradients
    assert [g["rows_received"] for g in one_sided["gaps"]] == [24, 0]
    for gaps in one_sided["gaps"]:
        assert max(v for k, v in gaps.items() if k != "rows_received") < 1e-6, gaps
    # sharded state saved and resumed (torch.distributed.checkpoint, optimizer state included): the same losses
    for uninterrupted, resumed in resume["ranks"]:
        assert resumed == uninterrupted
    # a HF checkpoint loaded into a meta model under the plan: each rank reads its half of the experts
    assert (pretrained["local_experts"], pretrained["experts"]) == (2, 4)
    for got, want in pretrained["losses"]:
        assert got == want
    assert pretrained["max_grad_diff"] < 1e-5
    assert [r["model"] for r in results] == ["tiny-mixtral", "wide-mixtral", "tiny-qwen2-moe"]
    # 2 micro-batches per replica through accumulate: the exchange per piece, the experts' gradients divided
    # by dp once, after the last piece
    assert (micro["micro_batches"], micro["pieces"], micro["weights"]) == (2, 2, [0.5, 0.5])
    assert micro["expert_data_parallel"] == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    assert micro["max_grad_diff"] < 1e-5
    assert micro["ran"]["counts"] == {"all_to_all": 20}
    assert micro["ran"]["counts"] == {
        k.removeprefix("dp_"): v for k, v in micro["predicted"]["counts"].items() if k != "dp_all_reduce"
    }
    assert micro["ran"]["bytes_mean"] == {
        k.removeprefix("dp_"): v for k, v in micro["predicted"]["bytes"].items()
    }
    for result in results:
        name = result["model"]
        assert result["expert_data_parallel"] == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
        assert set(result["moe_layers"].values()) == {"experts: EP×2 (dp)"}
        assert result["max_grad_diff"] < 1e-5, name
        for got, want in zip(result["losses"], result["reference_losses"], strict=True):
            assert got == pytest.approx(want, abs=1e-5), name
        for got, want, alone in result["grad_norms"]:  # torch's clip_grad_norm_ over gradients on two meshes
            assert got == pytest.approx(want, rel=1e-5), name
            assert alone == got, name  # torch.nn.utils.get_total_norm: the same norm
        weight = result["expert_weight"]
        assert weight["placements"] == ["S(0)", "R"] and weight["local_shape"][0] * 2 == weight["shape"][0]
        predicted, ran = result["predicted"], result["ran"]
        assert ran["counts"] == {
            "all_to_all": predicted["counts"]["dp_all_to_all"],
            "all_reduce (DDP)": predicted["counts"].get("dp_all_reduce", 0),
        }, name
        if result["dp_mode"] == "fsdp":  # the wide Mixtral under "fsdp-ep"
            assert predicted["counts"]["dp_all_to_all"] == 10 and "dp_all_reduce" not in predicted["counts"]
            _fsdp_gathers_and_reduces_all_but_the_experts(
                ran["fsdp"]["forward_all_gather"],
                ran["fsdp"]["reduce_scatter"],
                result["fsdp_shards"],
                predicted["counts"],
                1,
            )
        else:
            assert result["dp_mode"] == "ddp" and ran["fsdp"] == {}, name
            assert predicted["counts"]["dp_all_reduce"] > 0, name
        # a rank's share of the all-to-alls follows the routing; the mean over the ranks is the prediction's
        assert ran["bytes_mean"] == {"all_to_all": predicted["bytes"]["dp_all_to_all"]}, name
        assert result["export_names"] and result["export_diff"] == 0.0, name
        assert result["reference_diff"] < 1e-4, name
    # asked for by name (at this width the planner's own choice is plain FSDP, on ordinary tensors:
    # test_the_planner_chooses_it_where_it_pays_and_prices_it_where_it_does_not)
    assert set(results[1]["alternatives"]) == {"fsdp, experts over dp"}
    assert [r["dp_label"] for r in results] == ["ddp, experts over dp", "fsdp, experts over dp"] + [
        "ddp, experts over dp"
    ]


def _fsdp_gathers_and_reduces_all_but_the_experts(
    forward_gathers: list, reduce_scatters: list, shards: dict, predicted: dict, micro: int
) -> None:
    """FSDP2's collectives against the plan's prediction, which counts them per parameter: one forward's
    all-gathers (one per FSDP unit: the two blocks and the root) gather every parameter but the experts once
    (each rank's padded shard, in elements), the step's reduce-scatters (one per unit, after the last
    micro-batch) every trained one once; the experts sharded over dp are in neither."""
    assert predicted["dp_all_gather"] == 2 * micro * shards["params"]
    assert predicted["dp_reduce_scatter"] == shards["trained"] == shards["params"]
    assert len(forward_gathers) == 3 and sum(forward_gathers) == shards["shard_numel"]
    assert len(reduce_scatters) == 3 and sum(reduce_scatters) == shards["shard_numel"]


def _fsdp_ep_trains_like_one_process_and_runs_what_was_predicted(case, micro, pretrained, resume) -> None:
    """The "fsdp-ep" runs of ``check_expert_dp.py``: FSDP shards every parameter but the experts, which stay
    split over dp as under "ddp-ep"."""
    layers = ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    assert (case["model"], case["dp_mode"], case["dp_label"]) == (
        "tiny-mixtral",
        "fsdp",
        "fsdp, experts over dp",
    )
    assert case["expert_data_parallel"] == layers and case["alternatives"] == ["fsdp, experts over dp"]
    assert set(case["moe_layers"].values()) == {"experts: EP×2 (dp)"}
    # the experts: whole experts per rank, on the whole mesh; the others: FSDP's shards on the dp mesh
    weight = case["expert_weight"]
    assert weight["placements"] == ["S(0)", "R"] and weight["local_shape"][0] * 2 == weight["shape"][0]
    assert case["other_weight"] == {"placements": ["S(0)", "R"], "mesh": 2}
    assert case["max_grad_diff"] < 1e-5
    for got, want in zip(case["losses"], case["reference_losses"], strict=True):
        assert got == pytest.approx(want, abs=1e-5)
    for got, want, alone in case["grad_norms"]:  # gradients on FSDP's mesh and on the whole mesh
        assert got == pytest.approx(want, rel=1e-5) and alone == got
    ran, predicted = case["ran"], case["predicted"]
    # the exchange's all-to-alls as predicted (counts; bytes on average over the ranks); no DDP all-reduce
    assert ran["counts"] == {"all_to_all": predicted["counts"]["dp_all_to_all"], "all_reduce (DDP)": 0}
    assert ran["counts"]["all_to_all"] == 10
    assert ran["bytes_mean"] == {"all_to_all": predicted["bytes"]["dp_all_to_all"]}
    assert set(predicted["counts"]) == {"dp_all_gather", "dp_all_to_all", "dp_reduce_scatter"}
    fsdp = ran["fsdp"]
    _fsdp_gathers_and_reduces_all_but_the_experts(
        fsdp["forward_all_gather"], fsdp["reduce_scatter"], case["fsdp_shards"], predicted["counts"], 1
    )
    assert fsdp["backward_all_gather"] == fsdp["forward_all_gather"][1:]  # the blocks again, not the root
    assert case["export_names"] and case["export_diff"] == 0.0 and case["reference_diff"] < 1e-4
    # 2 micro-batches: FSDP gathers for each piece, reduce-scatters once; the experts divided by dp once
    assert (micro["dp_mode"], micro["micro_batches"], micro["pieces"]) == ("fsdp", 2, 2)
    assert micro["max_grad_diff"] < 1e-5
    assert (
        micro["ran"]["counts"]
        == {"all_to_all": micro["predicted"]["counts"]["dp_all_to_all"]}
        == {"all_to_all": 20}
    )
    assert micro["ran"]["bytes_mean"] == {"all_to_all": micro["predicted"]["bytes"]["dp_all_to_all"]}
    gathers = micro["fsdp"]["step_all_gather"]  # per piece: 3 in forward, the 2 blocks again in backward
    assert len(gathers) == 10 and gathers[:5] == gathers[5:]
    _fsdp_gathers_and_reduces_all_but_the_experts(
        gathers[:3], micro["fsdp"]["reduce_scatter"], micro["fsdp_shards"], micro["predicted"]["counts"], 2
    )
    # a HF checkpoint into a meta model, and a sharded checkpoint resumed, under the "fsdp-ep" plan
    assert (pretrained["dp_mode"], pretrained["local_experts"], pretrained["experts"]) == ("fsdp", 2, 4)
    for got, want in pretrained["losses"]:
        assert got == want
    assert pretrained["max_grad_diff"] < 1e-5
    assert resume["dp_mode"] == "fsdp"
    for uninterrupted, resumed in resume["ranks"]:
        assert resumed == uninterrupted


@pytest.mark.slow
def test_the_trainer_trains_under_it_as_under_ddp(tmp_path):
    """The Trainer callback (``tests/multiproc/check_trainer.py``, tiny Mixtral, per-device batch 2, three
    steps, gradients clipped to norm 1 by the Trainer) on 2 gloo ranks under the "ddp-ep" plan, the "fsdp-ep"
    plan and DDP with replicated experts: the same losses, learning rates and eval loss. (Not one process's:
    the router's load-balancing loss is each replica's own under DDP whatever the experts do.)"""
    import os
    import subprocess
    import sys

    model = _tiny_mixtral()
    batch = make_example_inputs(model, 4, 16, seed=0)
    _expert_dp_plan(model, batch).save(tmp_path / "ep.json")
    plan_model(model, batch, num_devices=2, device="cpu", mesh_shape=(2, 1), dp_modes=("fsdp-ep",)).save(
        tmp_path / "fsdp-ep.json"
    )
    evaluate_plan(model, batch, "ddp", num_devices=2, device="cpu", mesh_shape=(2, 1)).plan.save(
        tmp_path / "ddp.json"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_COLOSSAL_AUTO_NO_CALIBRATE": "1"}
    results = {}
    for name in ("ep", "fsdp-ep", "ddp"):
        out = tmp_path / f"{name}.result.json"
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc_per_node=2",
                str(ROOT / "tests" / "multiproc" / "check_trainer.py"),
                "--model",
                "tiny-mixtral",
                "--steps",
                "3",
                "--mesh",
                "2x1",
                "--plan",
                str(tmp_path / f"{name}.json"),
                "--out",
                str(out),
                "--output-dir",
                str(tmp_path / name),
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0, why_it_failed(proc)
        results[name] = json.loads(out.read_text())
    ddp = results["ddp"]
    assert set(ddp["moe_layers"].values()) == {"experts: replicated"}
    for name in ("ep", "fsdp-ep"):
        ep = results[name]
        assert set(ep["moe_layers"].values()) == {"experts: EP×2 (dp)"}, name
        assert sorted(ep["losses"], key=int) == ["1", "2", "3"], name
        for step, loss in ddp["losses"].items():
            assert ep["losses"][step] == pytest.approx(loss, abs=1e-5), (name, step)
        assert ep["learning_rates"] == ddp["learning_rates"], name
        assert ep["eval_loss"] == pytest.approx(ddp["eval_loss"], abs=1e-5), name


@pytest.mark.slow
def test_a_hand_made_plan_on_a_dp_x_tp_mesh_runs_like_one_process(tmp_path):
    """4 gloo ranks, mesh 2 x 2: the attention split Megatron-style over tp, the experts over dp (every tp
    rank of a replica runs the same exchange). The planner does not offer this mesh for it; the runtime runs
    it: each replica's loss and every first-step gradient equal one process's."""
    out = tmp_path / "result.json"
    run_torchrun(
        str(ROOT / "tests" / "multiproc" / "check_expert_dp_tp.py"), "--out", str(out), nproc=4, timeout=600
    )
    result = json.loads(out.read_text())
    losses = [r["loss"] for r in result["ranks"]]
    assert losses[0] == losses[1] and losses[2] == losses[3]  # the tp ranks of one replica
    assert sum(losses[::2]) / 2 == pytest.approx(result["reference_loss"], abs=1e-6)
    assert max(r["max_grad_diff"] for r in result["ranks"]) < 1e-5
