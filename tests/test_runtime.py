"""The runtime: a plan applied with DTensor gives the single-process model's loss and gradients."""

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

from hf_colossal_auto._torch_compat import fake_process_group, local_tensor_mode
from hf_colossal_auto.apply import PlanMismatchError, apply_plan, build_mesh, validate_plan
from hf_colossal_auto.models import build_model, make_example_inputs
from hf_colossal_auto.solve.planner import evaluate_plan, plan_model

ROOT = Path(__file__).resolve().parents[1]


def _fresh_fake_group(world: int) -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
    fake_process_group(world)


def _tiny(preset: str) -> nn.Module:
    torch.manual_seed(0)
    model = build_model(preset, device="cpu")
    model.eval()  # no dropout, so that sharded and single-process runs are comparable exactly
    return model


def _collectives_of_a_step(model: nn.Module, plan, batch) -> dict[str, int]:
    """Apply ``plan`` on 2 simulated ranks and count the collectives of one forward + backward by kind."""
    from hf_colossal_auto._torch_compat import comm_debug_mode

    _fresh_fake_group(2)
    try:
        with local_tensor_mode(2):
            apply_plan(model, plan, build_mesh(plan, "cpu"))
            with comm_debug_mode() as comm:
                model(**batch).loss.backward()
    finally:
        dist.destroy_process_group()
    names = {"all_gather_into_tensor": "all_gather", "reduce_scatter_tensor": "reduce_scatter"}
    return {
        names.get(str(op).split(".")[-1], str(op).split(".")[-1]): n
        for op, n in comm.get_comm_counts().items()
    }


def test_plan_for_another_model_or_world_is_refused():
    gpt2, llama = _tiny("tiny-gpt2"), _tiny("tiny-llama")
    batch = make_example_inputs(gpt2, 4, 16)
    plan = plan_model(gpt2, batch, num_devices=2, device="cpu", mesh_shape=(1, 2))
    with pytest.raises(PlanMismatchError, match="another model"):
        validate_plan(llama, plan, 2)
    with pytest.raises(PlanMismatchError, match="needs 2 processes, the job has 4"):
        validate_plan(gpt2, plan, 4)


@pytest.mark.parametrize("preset", ["tiny-gpt2", "tiny-llama", "tiny-t5", "tiny-bert"])
@pytest.mark.parametrize("plan_kind", ["auto", "megatron"])
def test_tensor_parallel_matches_single_process(preset, plan_kind):
    """Two simulated ranks (LocalTensorMode) on a 1-D tensor-parallel mesh: same loss, same gradients."""
    model = _tiny(preset)
    batch = make_example_inputs(model, 4, 16)
    reference = copy.deepcopy(model)
    ref_loss = reference(**batch).loss
    ref_loss.backward()
    if plan_kind == "auto":
        plan = plan_model(model, batch, num_devices=2, device="cpu", mesh_shape=(1, 2))
    else:
        plan = evaluate_plan(model, batch, "megatron", num_devices=2, device="cpu", mesh_shape=(1, 2)).plan
        assert any(p[1] != "R" for p in plan.param_placements.values())
    _fresh_fake_group(2)
    try:
        with local_tensor_mode(2):
            apply_plan(model, plan, build_mesh(plan, "cpu"))
            loss = model(**batch).loss
            loss.backward()
            assert torch.allclose(
                loss.reconcile() if hasattr(loss, "reconcile") else loss, ref_loss, atol=1e-6
            )
            for (name, p_ref), (_, p) in zip(
                reference.named_parameters(), model.named_parameters(), strict=True
            ):
                # a plan that shards nothing (the auto plan of T5 here) keeps ordinary parameters
                grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
                grad = grad.reconcile() if hasattr(grad, "reconcile") else grad
                torch.testing.assert_close(grad, p_ref.grad, atol=1e-5, rtol=1e-5, msg=name)
    finally:
        dist.destroy_process_group()


def _torchrun(nproc: int, *args: str, tmp_path: Path, timeout: int = 240) -> dict:
    out = tmp_path / "result.json"
    run_torchrun(
        str(ROOT / "tests" / "multiproc" / "check_numerics.py"),
        *args,
        "--out",
        str(out),
        nproc=nproc,
        timeout=timeout,
    )
    return json.loads(out.read_text())


FAMILIES = "tiny-gpt2,tiny-bert,tiny-llama,tiny-t5"


def _tracks_single_process(results: list[dict]) -> None:
    assert [r["model"] for r in results] == FAMILIES.split(",")
    for result in results:
        name = result["model"]
        assert result["sharded_params"] > 0, name
        assert result["max_grad_diff"] < 1e-5, name
        for got, want in zip(result["losses"], result["reference_losses"], strict=True):
            assert got == pytest.approx(want, abs=1e-5), name


@pytest.fixture(scope="module")
def dp_x_tp_results(tmp_path_factory) -> dict[str, list[dict]]:
    """Every family under DDP x TP, then under FSDP x TP (the AdamW made before parallelizing there), on 4 gloo
    processes, mesh 2 x 2, Megatron placements, four steps: one launch for both data-parallel modes, since
    starting 4 processes on 2 cores and warming up the planner in each costs more than a family's run. Mode
    -> its results, in family order."""
    results = _torchrun(
        4,
        "--model", FAMILIES, "--mesh", "2x2", "--plan", "megatron", "--steps", "4",
        "--dp-mode", "ddp,fsdp", "--optimizer-before", "fsdp",
        tmp_path=tmp_path_factory.mktemp("dp_x_tp"),
    )  # fmt: skip
    families = len(FAMILIES.split(","))
    assert len(results) == 2 * families
    return {"ddp": results[:families], "fsdp": results[families:]}


@pytest.mark.slow
def test_gloo_dp_x_tp_training_tracks_single_process(dp_x_tp_results):
    """4 gloo processes, mesh 2 x 2 (DDP over tensor-parallel groups), Megatron placements (GPT-2's fused
    c_attn, T5's shared relative position bias and encoder-decoder, tied embeddings included): for each family,
    one after the other in one launch, the first step's gradients and four AdamW steps' losses match one process."""
    results = dp_x_tp_results["ddp"]
    _tracks_single_process(results)
    assert all(result["dp_mode"] == "ddp" for result in results)


@pytest.mark.slow
def test_gloo_fsdp_x_tp_training_tracks_single_process(dp_x_tp_results):
    """4 gloo processes, mesh 2 x 2 with FSDP2 on the data-parallel axis over Megatron tensor parallelism
    (parameters become 2-D DTensors), every family in one launch (T5's nested per-block lists included):
    gradients and four AdamW steps match one process — with the AdamW made before parallelizing, so it must follow the parameters through both
    replacements (DTensor, then FSDP)."""
    results = dp_x_tp_results["fsdp"]
    _tracks_single_process(results)
    for result in results:
        assert result["dp_mode"] == "fsdp"
        assert any("Shard(dim=0), Shard(dim=1)" in p for p in result["param_placements"]), result["model"]


# MoE models in the same launch (tests/test_moe.py has their capture): the solver's own choice, and each
# strategy of an MoE layer the planner prices, named as the plan names it.
MOE_CASES = {
    "tiny-mixtral": None,  # auto: whatever the solver chose
    "tiny-mixtral@experts-tp": "experts: TP×2",
    "tiny-mixtral@experts-replicated": "experts: replicated",
    "tiny-qwen3-moe@experts-tp": "experts: TP×2",
    "tiny-qwen2-moe@megatron": "experts: TP×2",  # and its shared expert (a dense MLP) Megatron-split
    "tiny-mixtral@experts-ep": "experts: EP×2",  # the runtime's expert-parallel region
    "tiny-qwen3-moe@experts-ep": "experts: EP×2",
}


RANK0_MODELS = ",".join(["tiny-llama", *MOE_CASES])


@pytest.fixture(scope="module")
def two_rank_launch(tmp_path_factory) -> tuple[list[dict], Path]:
    """One launch of 2 gloo processes for two tests: check_numerics.py's runs of
    ``test_autoparallelize_plans_on_rank0_and_broadcasts`` (their results), then, in the same processes,
    check_checkpoint.py's save phase into the returned folder (``--checkpoint-save``) for
    ``test_checkpoint_resume_and_consolidated_export``, whose resume needs fresh processes (its own launch):
    starting two processes and importing torch/transformers costs more than a tiny model's run."""
    root = tmp_path_factory.mktemp("two_ranks")
    checkpoint = root / "checkpoint"
    results = _torchrun(
        2, "--model", RANK0_MODELS, "--mesh", "1x2", "--plan", "auto", "--steps", "2",
        "--checkpoint-save", str(checkpoint), tmp_path=root, timeout=400,
    )  # fmt: skip
    return results, checkpoint


@pytest.mark.slow
def test_autoparallelize_plans_on_rank0_and_broadcasts(two_rank_launch):
    """2 gloo processes: rank 0 plans inside the job (the planner must not build collective meshes), every
    rank applies the broadcast plan, and training matches one process. Then, in the same processes, Mixtral
    (router, aux loss in the loss) under the auto plan, replicated experts, tensor parallelism inside every
    expert (HF's own tp_plan) and expert parallelism (HF's ep_plan: whole experts per rank, the runtime's
    dispatch region), Qwen3-MoE under the last two, and Qwen2-MoE's shared expert and its gate under Megatron: two AdamW steps'
    losses and every first-step gradient equal one process's in fp32."""
    models = RANK0_MODELS
    results, _ = two_rank_launch
    assert [r["model"] for r in results] == [m.split("@")[0] for m in models.split(",")]
    for result, (spec, choice) in zip(results, [("tiny-llama", None), *MOE_CASES.items()], strict=True):
        assert result["max_grad_diff"] < 1e-5, spec
        for got, want in zip(result["losses"], result["reference_losses"], strict=True):
            assert got == pytest.approx(want, abs=1e-5), spec
        if spec.startswith("tiny-llama"):
            assert result["moe_layers"] == {}
            continue
        assert len(result["moe_layers"]) == 2, (spec, result["moe_layers"])  # one choice per MoE layer
        assert choice is None or set(result["moe_layers"].values()) == {choice}, (spec, result["moe_layers"])
        expert_parallel = spec.endswith("@experts-ep")
        assert bool(result["expert_parallel_layers"]) == expert_parallel, (
            spec,
            result["expert_parallel_layers"],
        )


@pytest.mark.slow
def test_checkpoint_resume_and_consolidated_export(two_rank_launch):
    """Sharded state saved with torch.distributed.checkpoint resumes in fresh processes: on a tensor-parallel
    1 x 2 mesh, a DDP 2 x 1 and an FSDP 2 x 1 one, every rank's loss of the next step and, after AdamW's update,
    of the step after it equal the uninterrupted run's (the latter only with the optimizer state restored: a
    fresh AdamW misses it). The consolidated export loads with from_pretrained in one process and gives the
    next-step loss too. (The save phase runs in ``two_rank_launch``, the resume in fresh processes here.)"""
    from transformers import AutoModelForCausalLM

    _, tmp_path = two_rank_launch
    script = str(ROOT / "tests" / "multiproc" / "check_checkpoint.py")
    run_torchrun(script, "--phase", "resume", "--dir", str(tmp_path))
    for layout in ("tp", "ddp", "fsdp"):
        for rank in range(2):
            want = json.loads((tmp_path / layout / f"expected.rank{rank}.json").read_text())
            got = json.loads((tmp_path / layout / f"resumed.rank{rank}.json").read_text())
            where = f"{layout} rank {rank}: {got} vs {want}"
            # exact: the same plan on the same ranks runs the same kernels and reductions
            assert got["loss"] == want["loss"], where
            assert got["next_loss"] == want["next_loss"], where
            # the check can tell: without AdamW's moments and step count the update differs
            assert abs(got["fresh_optimizer_next_loss"] - want["next_loss"]) > 1e-4, where
    expected = json.loads((tmp_path / "expected.json").read_text())["loss"]
    resumed = json.loads((tmp_path / "resumed.json").read_text())["loss"]
    assert resumed == pytest.approx(expected, abs=1e-6)

    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "export")
    exported.eval()
    batch = make_example_inputs(exported, 4, 16, seed=2)
    assert float(exported(**batch).loss) == pytest.approx(expected, abs=1e-5)
    reference = torch.load(tmp_path / "reference.pt")
    for name, value in exported.state_dict().items():
        torch.testing.assert_close(value, reference[name], atol=1e-4, rtol=0, msg=name)


def test_optimizer_made_before_parallelization_is_remapped():
    """An AdamW created before apply_plan (passed in ``optimizers``) trains like one created after it."""
    losses = {}
    priced = _tiny("tiny-llama")
    batch = make_example_inputs(priced, 4, 16)
    megatron = evaluate_plan(priced, batch, "megatron", num_devices=2, device="cpu", mesh_shape=(1, 2)).plan
    for when in ("before", "after"):
        model = _tiny("tiny-llama")  # the same seeded weights each time
        plan = copy.deepcopy(megatron)
        _fresh_fake_group(2)
        try:
            with local_tensor_mode(2):
                early = torch.optim.AdamW(model.parameters(), lr=1e-2) if when == "before" else None
                apply_plan(model, plan, build_mesh(plan, "cpu"), optimizers=[early] if early else [])
                opt = early or torch.optim.AdamW(model.parameters(), lr=1e-2)
                assert all(
                    isinstance(p, torch.distributed.tensor.DTensor)
                    for g in opt.param_groups
                    for p in g["params"]
                )
                steps = []
                for _ in range(3):
                    loss = model(**batch).loss
                    loss.backward()
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                    steps.append(float(loss.reconcile() if hasattr(loss, "reconcile") else loss))
                losses[when] = steps
        finally:
            dist.destroy_process_group()
    assert losses["before"] == pytest.approx(losses["after"], abs=1e-6)
    assert losses["after"][-1] < losses["after"][0]


@pytest.mark.parametrize("preset", ["tiny-gpt2", "tiny-bert"])
def test_symbolic_runtime_issues_the_collectives_of_a_real_run(preset):
    """simulate_collectives (fake tensors, fake process group) counts what the runtime runs on real values
    (LocalTensorMode, CommDebugMode) — the cheap way to price what the runtime will do."""
    from hf_colossal_auto.apply.simulate import simulate_collectives

    model = _tiny(preset)
    batch = make_example_inputs(model, 4, 16)
    plan = evaluate_plan(model, batch, "megatron", num_devices=2, device="cpu", mesh_shape=(1, 2)).plan
    simulated = simulate_collectives(model, plan, batch)
    assert simulated.counts and all(simulated.bytes[k] > 0 for k in simulated.counts)
    assert simulated.counts == _collectives_of_a_step(model, plan, batch)
