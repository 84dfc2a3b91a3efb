"""Local tensor-parallel regions (``Plan.local_modules``, apply/local_tensor_parallel.py): a Megatron plan whose
attention and MLP modules run on local shards trains like one process and like the same plan on DTensors, with
the same collectives and far fewer ops dispatched on DTensors; layouts it cannot run are refused by name."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torchrun_launch import run_torchrun

from hf_colossal_auto._torch_compat import comm_debug_mode, fake_process_group, local_tensor_mode
from hf_colossal_auto.apply import PlanMismatchError, apply_plan, build_mesh, validate_plan
from hf_colossal_auto.models import build_model, load_config, make_example_inputs
from hf_colossal_auto.solve.planner import evaluate_plan

ROOT = Path(__file__).resolve().parents[1]


def _model(name: str) -> nn.Module:
    """A seeded tiny model in eval mode (no dropout: exact comparisons). ``tiny-qwen2``: Qwen2.5's config at
    tiny-llama's sizes (q/k/v biases: column-parallel biases); GPT-2 with no residual dropout (its MLP draws
    it, which a local region refuses)."""
    if name == "tiny-qwen2":
        config = load_config("qwen2.5-7b")
        config.hidden_size, config.intermediate_size, config.head_dim = 64, 128, 16
        config.num_attention_heads, config.num_key_value_heads = 4, 2
        config.num_hidden_layers, config.vocab_size, config.max_position_embeddings = 2, 512, 128
        config.layer_types = config.layer_types[:2] if getattr(config, "layer_types", None) else None
    else:
        config = load_config(name)
    if config.model_type == "gpt2":
        config.resid_pdrop = 0.0
    torch.manual_seed(0)
    model = build_model(config, device="cpu")
    model.eval()
    return model


def _attention_and_mlp(model: nn.Module) -> list[str]:
    """Every block's attention and MLP; GPT-2's MLPs only (its ``c_attn`` splits q, k, v by the global width)."""
    suffixes = (".mlp",) if model.config.model_type == "gpt2" else (".self_attn", ".mlp")
    return [n for n, _ in model.named_modules() if n.endswith(suffixes)]


def _megatron(model: nn.Module, batch: dict, kind: str = "megatron"):
    return evaluate_plan(model, batch, kind, num_devices=2, device="cpu", mesh_shape=(1, 2)).plan


def _step_on_two_simulated_ranks(
    model: nn.Module, plan, batch: dict, autocast: bool = False
) -> tuple[float, dict, dict[str, int]]:
    """``plan`` applied on 2 simulated ranks (LocalTensorMode): the loss, each parameter's full gradient and the
    collectives of one forward (under bf16 autocast with ``autocast``) + backward by kind."""
    if dist.is_initialized():
        dist.destroy_process_group()
    fake_process_group(2)
    try:
        with local_tensor_mode(2):
            apply_plan(model, plan, build_mesh(plan, "cpu"))
            with comm_debug_mode() as comm:
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                    loss = model(**batch).loss
                loss.backward()
            value = (loss.reconcile() if hasattr(loss, "reconcile") else loss).item()
            grads = {}
            for name, p in model.named_parameters():
                grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
                grads[name] = (grad.reconcile() if hasattr(grad, "reconcile") else grad).clone()
    finally:
        dist.destroy_process_group()
    return value, grads, {str(op).split(".")[-1]: n for op, n in comm.get_comm_counts().items()}


@pytest.mark.parametrize(
    ("preset", "kind", "recompute"),
    [
        ("tiny-llama", "megatron", "none"),
        (
            "tiny-llama",
            "megatron-sp",
            "none",
        ),  # sequence parallel: the entry all-gathers, the exit reduce-scatters
        ("tiny-llama", "megatron", "full"),
        ("tiny-llama", "megatron-sp", "selective:pointwise+attention"),
        ("tiny-qwen2", "megatron", "none"),  # column-parallel biases
        ("tiny-gpt2", "megatron", "none"),  # Conv1D (nf local), a row-parallel bias added once
    ],
)
def test_local_regions_match_one_process_and_the_dtensor_run(preset, kind, recompute):
    model = _model(preset)
    batch = make_example_inputs(model, 4, 16)
    reference = copy.deepcopy(model)
    ref_loss = reference(**batch).loss
    ref_loss.backward()
    plan = _megatron(model, batch, kind)
    if recompute != "none":
        plan.recompute = {block: recompute for block in plan.recompute}
    local_plan = copy.deepcopy(plan)
    local_plan.local_modules = _attention_and_mlp(model)
    loss, grads, collectives = _step_on_two_simulated_ranks(copy.deepcopy(model), plan, batch)
    local_loss, local_grads, local_collectives = _step_on_two_simulated_ranks(model, local_plan, batch)
    assert local_loss == pytest.approx(float(ref_loss), abs=1e-6)
    assert local_loss == pytest.approx(loss, abs=1e-6)
    for name, p in reference.named_parameters():
        torch.testing.assert_close(local_grads[name], p.grad, atol=1e-5, rtol=1e-5, msg=name)
        torch.testing.assert_close(local_grads[name], grads[name], atol=1e-6, rtol=1e-5, msg=name)
    # the same collectives as the DTensor run of the plan (kinds and counts), which the planner prices
    assert local_collectives == collectives and sum(collectives.values()) > 0


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-gpt2"])
@pytest.mark.parametrize("how", ["megatron-local", "auto"])
def test_planner_made_local_plans_run_as_predicted(preset, how):
    """The planner's own plans with local modules (the ``megatron-local`` baseline, and ``plan_model`` on a
    ``1 x 2`` mesh, which keeps the local candidate on this CPU's DTensor cost) list what the runtime runs
    locally, train like one process on 2 simulated ranks, and run the collectives they predict (kinds and
    counts)."""
    model = _model(preset)
    batch = make_example_inputs(model, 4, 16)
    reference = copy.deepcopy(model)
    ref_loss = reference(**batch).loss
    ref_loss.backward()
    common = dict(num_devices=2, device="cpu", mesh_shape=(1, 2))
    if how == "auto":
        from hf_colossal_auto.solve.planner import plan_model

        plan = plan_model(model, batch, **common)
    else:
        plan = evaluate_plan(model, batch, how, **common).plan
    assert plan.local_modules == sorted(_attention_and_mlp(model))
    loss, grads, collectives = _step_on_two_simulated_ranks(model, plan, batch)
    assert loss == pytest.approx(float(ref_loss), abs=1e-6)
    for name, p in reference.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, atol=1e-5, rtol=1e-5, msg=name)
    predicted = {kind: round(n) for kind, n in plan.collectives.items() if n}
    measured = {_COLLECTIVE_KINDS.get(kind, kind): n for kind, n in collectives.items()}
    assert measured == predicted, (collectives, plan.summary())


_COLLECTIVE_KINDS = {"all_gather_into_tensor": "all_gather", "reduce_scatter_tensor": "reduce_scatter"}
"""The functional collectives CommDebugMode records under the planner's names for them."""


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-gpt2"])
def test_megatron_sp_local_plans_train_like_one_process_on_local_regions(preset):
    """The ``megatron-sp-local`` baseline (torchtitan's tensor parallelism: Megatron's placements, sequence
    parallelism between the regions, attention and MLP on local shards) lists every attention and MLP module as
    local, returns sequence shards from its blocks, and trains like one process on 2 simulated ranks."""
    model = _model(preset)
    batch = make_example_inputs(model, 4, 16)
    reference = copy.deepcopy(model)
    ref_loss = reference(**batch).loss
    ref_loss.backward()
    plan = evaluate_plan(
        model, batch, "megatron-sp-local", num_devices=2, device="cpu", mesh_shape=(1, 2)
    ).plan
    assert plan.hand_layout == "megatron-sp-local" and plan.local_modules == sorted(_attention_and_mlp(model))
    assert plan.sequence_parallel_blocks
    loss, grads, _ = _step_on_two_simulated_ranks(model, plan, batch)
    assert loss == pytest.approx(float(ref_loss), abs=1e-6)
    for name, p in reference.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, atol=1e-5, rtol=1e-5, msg=name)


@pytest.mark.xfail(
    strict=True,
    reason="open gap (docs/reliability.md): at 4 x 16 tokens the megatron-sp layouts' predicted collectives "
    "differ from the run's (Llama: one backward all-reduce more; GPT-2: reduce-scatters, all-gathers); at one "
    "sequence of 128 tokens they equal it on real ranks (test_sequence_parallel)",
)
@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-gpt2"])
@pytest.mark.parametrize("how", ["megatron-sp", "megatron-sp-local"])
def test_megatron_sp_collectives_at_a_short_sequence_are_the_predicted_ones(preset, how):
    model = _model(preset)
    batch = make_example_inputs(model, 4, 16)
    plan = evaluate_plan(model, batch, how, num_devices=2, device="cpu", mesh_shape=(1, 2)).plan
    _, _, collectives = _step_on_two_simulated_ranks(model, plan, batch)
    predicted = {kind: round(n) for kind, n in plan.collectives.items() if n}
    assert {_COLLECTIVE_KINDS.get(kind, kind): n for kind, n in collectives.items()} == predicted


def test_local_region_skips_the_plans_hooks_inside_and_restores_its_parameters():
    """After a step the listed modules hold their DTensor parameters again (swapped only for the forward), and
    no placement hook was installed on a module inside them (they act on DTensors); the projections' shared-cast
    hooks (``apply/shared_casts.py``, plain tensors or DTensors alike) are the only ones there."""
    model = _model("tiny-llama")
    batch = make_example_inputs(model, 4, 16)
    plan = _megatron(model, batch)
    plan.local_modules = _attention_and_mlp(model)
    _step_on_two_simulated_ranks(model, plan, batch)
    for fqn in plan.local_modules:
        module = model.get_submodule(fqn)
        assert all(isinstance(p, DTensor) for p in module.parameters()), fqn
        for name, sub in module.named_modules():
            if name:  # the module's own output hook stays: it places the region's output as planned
                pre = [h.__qualname__ for h in sub._forward_pre_hooks.values()]
                assert all(q.startswith("_cast_input_hook.") for q in pre), f"{fqn}.{name}: {pre}"
                assert not sub._forward_hooks, f"{fqn}.{name}"


def _refusal(plan, model) -> str:
    with pytest.raises(PlanMismatchError) as caught:
        validate_plan(model, plan, 2)
    return str(caught.value)


@pytest.fixture(scope="module")
def llama_plan():
    model = _model("tiny-llama")
    return model, _megatron(model, make_example_inputs(model, 4, 16))


def test_refuses_a_module_that_is_not_a_column_then_row_pair(llama_plan):
    model, megatron = llama_plan
    plan = copy.deepcopy(megatron)
    plan.local_modules = ["model.layers.0.mlp"]
    for proj in ("gate_proj", "up_proj"):  # every projection row-parallel
        plan.param_placements[f"model.layers.0.mlp.{proj}.weight"] = ["R", "S1"]
    message = _refusal(plan, model)
    assert "model.layers.0.mlp" in message and "0 column-parallel projections" in message
    assert "gate_proj.weight: S1" in message  # the placements found


def test_refuses_a_module_the_model_lacks_nested_modules_and_context_parallelism(llama_plan):
    model, megatron = llama_plan
    plan = copy.deepcopy(megatron)
    plan.local_modules = ["model.layers.7.self_attn"]
    assert "no such module" in _refusal(plan, model)
    plan.local_modules = ["model.layers.0.self_attn", "model.layers.0.self_attn.q_proj"]
    assert "inside model.layers.0.self_attn" in _refusal(plan, model)
    plan.local_modules = ["model.layers.0.self_attn"]
    plan.cp_size = 2
    assert "context parallelism" in _refusal(plan, model)


def test_refuses_dropout_and_split_heads(llama_plan):
    model, megatron = llama_plan
    plan = copy.deepcopy(megatron)
    plan.local_modules = ["model.layers.0.self_attn"]
    attention = model.get_submodule("model.layers.0.self_attn")
    attention.attention_dropout = 0.1
    try:
        assert "attention_dropout=0.1" in _refusal(plan, model)
    finally:
        attention.attention_dropout = 0.0
    gpt2 = _model("tiny-gpt2")
    gpt2_plan = _megatron(gpt2, make_example_inputs(gpt2, 4, 16))
    gpt2_plan.local_modules = ["transformer.h.0.mlp"]
    gpt2.get_submodule("transformer.h.0.mlp.dropout").p = 0.1
    assert "dropout (p=0.1)" in _refusal(gpt2_plan, gpt2)
    # a column split inside a head (64 wide here): the local views would mix heads
    attention.head_dim = 64
    try:
        assert "not whole heads of 64" in _refusal(plan, model)
    finally:
        attention.head_dim = 16


def test_refuses_moe_experts():
    model = _model("tiny-mixtral")
    plan = _megatron(model, make_example_inputs(model, 4, 16))
    moe = next(n for n, m in model.named_modules() if n.endswith((".mlp", ".block_sparse_moe")))
    plan.local_modules = [moe]
    assert "MoE experts" in _refusal(plan, model)


def _launch(nproc: int, *args: str, tmp_path: Path) -> list[dict]:
    out = tmp_path / "result.json"
    run_torchrun(
        str(ROOT / "tests" / "multiproc" / "check_local_tensor_parallel.py"),
        *args,
        "--out",
        str(out),
        nproc=nproc,
    )
    return json.loads(out.read_text())


def _trains_alike(results: list[dict]) -> None:
    """Pairs (DTensor run, local run) per model: both track one process; the local one has the DTensor run's
    collectives, dispatches no DTensor op inside its listed modules and fewer overall than the DTensor run did
    outside their forwards (Llama: under half)."""
    for dtensor, local in zip(results[::2], results[1::2], strict=True):
        name = local["model"]
        assert dtensor["local_modules"] == 0 and local["local_modules"] > 0, name
        for run in (dtensor, local):
            assert run["max_grad_diff"] < 1e-5, name
            assert run["losses"] == pytest.approx(run["reference_losses"], abs=1e-5), name
        assert local["losses"] == pytest.approx(dtensor["losses"], abs=1e-6), name
        assert local["collectives"] == dtensor["collectives"], name
        assert dtensor["dtensor_ops_in_listed_forwards"] > 0
        assert local["dtensor_ops_in_listed_forwards"] == 0, name
        # the listed modules' forward ops on DTensors are gone, and so are their backward ops
        assert local["dtensor_ops"] < dtensor["dtensor_ops"] - dtensor["dtensor_ops_in_listed_forwards"], name
        if name == "tiny-llama":  # every block's attention and MLP listed: most of the step
            assert local["dtensor_ops"] < dtensor["dtensor_ops"] / 2


def test_two_gloo_ranks_train_local_regions_like_one_process(tmp_path):
    """Real gloo ranks, tensor parallelism 2: tiny Llama (attention and MLP) and GPT-2 (MLP), two AdamW steps."""
    results = _launch(2, "--model", "tiny-llama,tiny-gpt2", tmp_path=tmp_path)
    assert [r["model"] for r in results] == ["tiny-llama"] * 2 + ["tiny-gpt2"] * 2
    _trains_alike(results)
    assert results[1]["collectives"] == {
        "all_reduce": 8
    }  # per block: 2 forward (exits), 2 backward (entries)


def test_fsdp_times_tensor_parallel_with_recompute_runs_local_regions(tmp_path):
    """4 gloo ranks, FSDP over dp 2 x tensor parallelism 2, every block fully recomputed: the unsharded
    parameters FSDP gathers are taken local inside the regions, also in the recomputed forward."""
    results = _launch(4, "--mesh", "2x2", "--dp-mode", "fsdp", "--recompute", "full", tmp_path=tmp_path)
    _trains_alike(results)
    assert (
        results[1]["collectives"].get("_reduce_scatter_base_", 0) > 0
    )  # FSDP's gradient reduce-scatters ran


def test_pipeline_stages_run_local_regions(tmp_path):
    """pp 2 x tp 2 (1f1b, one block a stage, full recompute): each stage's listed modules run locally, with the
    DTensor run's collectives (rank 0's stage)."""
    results = _launch(4, "--pp", "2", "--recompute", "full", tmp_path=tmp_path)
    for dtensor, local in zip(results[::2], results[1::2], strict=True):
        for run in (dtensor, local):
            assert run["max_grad_diff"] < 1e-5
            assert run["losses"] == pytest.approx(run["reference_losses"], abs=1e-5)
        assert local["collectives"] == dtensor["collectives"] and local["collectives"], local["collectives"]
        assert dtensor["dtensor_ops_in_listed_forwards"] > 0 and local["dtensor_ops_in_listed_forwards"] == 0
        assert local["dtensor_ops"] < dtensor["dtensor_ops"] / 2


@pytest.mark.parametrize("local", [False, True], ids=["dtensors", "local-regions"])
def test_a_tensor_parallel_step_under_autocast_is_unchanged_by_the_shared_casts(local, monkeypatch):
    """Megatron's layout under bf16 autocast, on DTensors and on local shards: the projections' shared casts
    (``apply/shared_casts.py``) leave the loss and every gradient bit for bit as the same plan without them."""
    from hf_colossal_auto.apply import runtime

    reference = _model("tiny-llama")
    batch = make_example_inputs(reference, 4, 16, seed=0)
    plan = _megatron(reference, batch)
    if local:
        plan.local_modules = _attention_and_mlp(reference)
    model = copy.deepcopy(reference)
    shared = _step_on_two_simulated_ranks(model, plan, batch, autocast=True)
    hooks = [h.__qualname__ for h in model.model.layers[0].self_attn.k_proj._forward_pre_hooks.values()]
    assert any(q.startswith("_cast_input_hook.") for q in hooks)  # the shared casts ran
    monkeypatch.setattr(runtime, "share_sibling_casts", lambda model: 0)
    plain = _step_on_two_simulated_ranks(copy.deepcopy(reference), plan, batch, autocast=True)
    assert shared[0] == plain[0] and shared[2] == plain[2]
    for name, grad in plain[1].items():
        torch.testing.assert_close(shared[1][name], grad, rtol=0, atol=0, msg=name)
