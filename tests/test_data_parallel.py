"""Plans that shard nothing run on ordinary parameters (apply/data_parallel.py), FSDP without tensor parallelism
on ordinary tensors (FSDP2 on the plain module), and both are priced so."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from hf_colossal_auto._torch_compat import TorchDispatchMode
from hf_colossal_auto.models import build_model, make_example_inputs
from hf_colossal_auto.plan import Plan
from hf_colossal_auto.solve.planner import evaluate_plan, plan_model


def _regression_model() -> torch.nn.Module:
    from accelerate.test_utils.training import RegressionModel

    return RegressionModel(a=1, b=2)


def test_data_parallel_plans_are_priced_on_ordinary_tensors():
    """accelerate's 2-parameter RegressionModel on 2 CPU processes: DDP on 2x1 shards nothing, runs on ordinary
    tensors and is priced without DTensor's per-op host cost (its time does not move with it), so it beats the
    1x2 plan that repeats the whole batch on DTensors (priced with that cost: the ILP of a tensor-parallel mesh
    prices every choice so) although it pays a gradient all-reduce the 1x2 plan does not."""
    from hf_colossal_auto.hardware import get_device

    model, batch = _regression_model(), {"x": torch.randn(16)}
    plan = plan_model(model, batch, num_devices=2, device="cpu")
    assert tuple(plan.mesh_shape) == (2, 1) and plan.dp_mode == "ddp" and plan.shards_nothing
    assert plan.communication_time_s > 0
    tensor_parallel = plan_model(model, batch, num_devices=2, device="cpu", mesh_shape=(1, 2))
    assert tensor_parallel.shards_nothing and tensor_parallel.communication_time_s == 0
    assert plan.step_time_s < tensor_parallel.step_time_s
    costlier = get_device("cpu").with_overrides(dtensor_overhead_s=10 * get_device("cpu").dtensor_overhead_s)
    again = plan_model(model, batch, num_devices=2, device=costlier, mesh_shape=(2, 1))
    assert again.step_time_s == pytest.approx(plan.step_time_s, rel=1e-12)
    dearer = plan_model(model, batch, num_devices=2, device=costlier, mesh_shape=(1, 2))
    assert dearer.step_time_s > tensor_parallel.step_time_s


def test_fsdp_without_tensor_parallelism_is_priced_on_ordinary_tensors(monkeypatch):
    """tiny-llama, FSDP on a 2x1 mesh: the runtime runs FSDP2 on the plain module (Plan.runs_on_plain_tensors),
    so the planner prices its ops without DTensor's per-op host cost. Its predicted compute is the same
    candidate's priced on DTensors (the rule forced off, as every FSDP plan was priced before) on a device
    whose DTensor cost is 0, lower by that cost on the calibrated device — the DTensor term, linear in
    ``dtensor_overhead_s`` (twice it: twice the drop) — and does not move with ``dtensor_overhead_s``."""
    from hf_colossal_auto.hardware import get_device
    from hf_colossal_auto.solve import candidates

    model = build_model("tiny-llama", device="cpu")
    batch = make_example_inputs(model, 4, 16)
    spec = get_device("cpu")
    assert spec.dtensor_overhead_s > 0

    def compute(dtensor_overhead_s: float) -> float:
        device = spec.with_overrides(dtensor_overhead_s=dtensor_overhead_s)
        plan = evaluate_plan(model, batch, "fsdp", num_devices=2, device=device, mesh_shape=(2, 1)).plan
        assert plan.dp_mode == "fsdp" and plan.runs_on_plain_tensors
        return plan.compute_time_s

    d = spec.dtensor_overhead_s
    plain = compute(d)
    assert compute(10 * d) == pytest.approx(plain, rel=1e-12)
    with monkeypatch.context() as forced:
        forced.setattr(candidates, "layout_runs_on_plain_tensors", lambda *args: False)
        on_dtensors, without_cost, twice = compute(d), compute(0.0), compute(2 * d)
    assert without_cost == pytest.approx(plain, rel=1e-9)
    drop = on_dtensors - plain
    assert drop > 0.1 * plain  # several times an eager op's host cost per op, on hundreds of ops
    assert twice - plain == pytest.approx(2 * drop, rel=1e-6)


def _all_replicated(plan: Plan) -> Plan:
    """``plan`` with every placement replicated and no tensor-parallel collective (a plan that shards nothing on
    its tensor-parallel mesh)."""
    out = copy.deepcopy(plan)
    out.param_placements = {fqn: ["R", "R"] for fqn in plan.param_placements}
    out.param_use_placements = {}
    out.activation_placements = {m: ["R", "R"] for m in plan.activation_placements}
    out.collectives = {k: v for k, v in plan.collectives.items() if k.startswith("dp_")}
    return out


def _own_rows_gradient_diff(model, reference, batch: dict, rank: int) -> float:
    """Largest gap between one process's gradient of ``mean(logits**2)`` over the batch and the planned model's,
    fed per-process rows as a model planned from its first call is in its first epoch (the group's batch
    gathered, this rank's rows of the logits handed back) with the loss taken from those rows only."""
    from hf_colossal_auto.integrations.first_call import TensorParallelBatch

    params = list(reference.parameters())
    wanted = torch.autograd.grad(reference(**batch).logits.pow(2).mean(), params)
    model.zero_grad()
    group = TensorParallelBatch(model)
    mine = {k: v[rank * 2 : (rank + 1) * 2] for k, v in batch.items()}
    gathered, rows = group.gather(mine)
    group.own_rows(model(**gathered), rows).logits.pow(2).mean().backward()
    names = [n for n, _ in reference.named_parameters()]
    planned = dict(model.named_parameters())

    def full(t: torch.Tensor) -> torch.Tensor:
        return t.full_tensor() if isinstance(t, torch.distributed.tensor.DTensor) else t

    return max(float((full(planned[n].grad) - g).abs().max()) for n, g in zip(names, wanted, strict=True))


class _DTensorOps(TorchDispatchMode):
    """Counts the aten ops that reach a DTensor (each then runs as DTensor's dispatch runs it: the mode steps
    aside, as CommDebugMode does)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            self.ops += 1
            return NotImplemented
        return func(*args, **(kwargs or {}))


def _layout(t: torch.Tensor) -> str:
    """How a parameter or gradient is stored: "plain", or a DTensor's mesh axes and placements."""
    if not isinstance(t, DTensor):
        return "plain"
    return f"{t.device_mesh.mesh_dim_names} {tuple(repr(p) for p in t.placements)}"


def _worker(rank: int, store: str, plans: list[str], results: dict) -> None:
    """Each plan applied to tiny-llama built from this rank's own seed (DDP must start every replica from rank
    0's weights); one backward on the rank's rows of the global batch; then, for DDP, a backward inside
    ``no_sync`` and one after it."""
    from hf_colossal_auto.apply import apply_plan, build_mesh

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        out = []
        for text in plans:
            plan = Plan.from_dict(json.loads(text))
            torch.manual_seed(0)
            reference = build_model("tiny-llama", device="cpu").eval()
            torch.manual_seed(rank)
            model = build_model("tiny-llama", device="cpu").eval()
            batch = make_example_inputs(reference, 4, 16, seed=3)
            reference(**batch).loss.backward()
            apply_plan(model, plan, build_mesh(plan, "cpu"))
            rows = 4 // plan.dp_size
            local = {
                k: v[rank * rows : (rank + 1) * rows] if plan.dp_size > 1 else v for k, v in batch.items()
            }
            with _DTensorOps() as counted:  # every aten op of forward and backward
                model(**local).loss.backward()
            params = dict(model.named_parameters())

            def full(t: torch.Tensor) -> torch.Tensor:
                return t.full_tensor() if isinstance(t, torch.distributed.tensor.DTensor) else t

            diff = max(
                float((full(params[n].grad) - p.grad).abs().max()) for n, p in reference.named_parameters()
            )
            result = {
                "plain": not any(isinstance(p, torch.distributed.tensor.DTensor) for p in params.values()),
                "parameter_type": {type(p).__name__ for p in params.values()} == {"Parameter"},
                "grad_diff": diff,
                "dtensor_ops": counted.ops,
                "stored": sorted({_layout(t) for p in params.values() for t in (p, p.grad)}),
            }
            if plan.tp_size > 1:  # a loss from this rank's rows of the group's output: the group's gradient
                result["own_rows_diff"] = _own_rows_gradient_diff(model, reference, batch, rank)
            if plan.dp_size > 1 and plan.shards_nothing:
                model.zero_grad()
                with model.no_sync():
                    model(**local).loss.backward()
                local_diff = max(
                    float((params[n].grad - p.grad).abs().max()) for n, p in reference.named_parameters()
                )
                model(**local).loss.backward()  # synchronises what accumulated: twice the batch's gradient
                synced = max(
                    float((params[n].grad - 2 * p.grad).abs().max()) for n, p in reference.named_parameters()
                )
                result.update(no_sync_diff=local_diff, synced_diff=synced)
            out.append(result)
            del model
            dist.barrier()
        results[rank] = out
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_pure_data_parallel_keeps_plain_parameters_and_one_process_gradients(tmp_path: Path) -> None:
    """2 gloo processes, tiny-llama: DDP on 2x1 and a 1x2 plan that replicates everything leave ordinary
    ``nn.Parameter`` tensors, Megatron on 1x2 DTensors; each gives one process's gradients on the global batch,
    although every rank built its model from its own seed (DDP's broadcast of rank 0's weights; FSDP on 2x1 too,
    before sharding). DDP, the replicated plan and FSDP on 2x1 (FSDP2 on the plain module) run no aten op of
    forward or backward on a DTensor, Megatron does; FSDP stores parameters and gradients as its Shard(0) DTensors
    on the data-parallel mesh alone; and under DDP
    a backward inside ``no_sync`` keeps each rank's own gradient, the next one averages what accumulated. On
    the 1x2 plans, per-process rows gathered into the group's batch (a model planned from its first call, in its
    first epoch) with a loss each rank takes from its own rows of the output give one process's gradient of
    the batch's mean loss (without the gathered gradient each rank got only its rows')."""
    from torchrun_launch import spawn_ranks

    model = build_model("tiny-llama", device="cpu")
    batch = make_example_inputs(model, 4, 16)
    ddp = evaluate_plan(model, batch, "ddp", num_devices=2, device="cpu").plan
    megatron = evaluate_plan(model, batch, "megatron", num_devices=2, device="cpu", mesh_shape=(1, 2)).plan
    replicated = _all_replicated(megatron)
    fsdp = evaluate_plan(model, batch, "fsdp", num_devices=2, device="cpu").plan
    assert ddp.shards_nothing and replicated.shards_nothing and not megatron.shards_nothing
    assert not fsdp.shards_nothing and fsdp.runs_on_plain_tensors and not megatron.runs_on_plain_tensors
    plans = [p.to_json() for p in (ddp, megatron, replicated, fsdp)]
    results = spawn_ranks(_worker, str(tmp_path / "store"), plans, timeout=240, what="plain-parameter ranks")
    for rank in (0, 1):
        ddp_run, megatron_run, replicated_run, fsdp_run = results[rank]
        assert ddp_run["plain"] and ddp_run["parameter_type"] and replicated_run["plain"], rank
        assert not megatron_run["plain"] and not fsdp_run["plain"], rank
        # forward and backward on ordinary tensors wherever the plan runs on them: FSDP2 on the plain module
        # gathers its parameters as ordinary tensors; only Megatron's ops reach DTensors
        for run in (ddp_run, replicated_run, fsdp_run):
            assert run["dtensor_ops"] == 0, (rank, run)
        assert megatron_run["dtensor_ops"] > 0, rank
        # FSDP stores parameters and gradients as its shards over the data-parallel mesh alone (no
        # tensor-parallel axis of one rank, as the DTensor runtime's 2-D DTensors had)
        assert fsdp_run["stored"] == ["('dp',) ('Shard(dim=0)',)"], (rank, fsdp_run)
        assert ddp_run["stored"] == ["plain"], (rank, ddp_run)
        for run in (ddp_run, megatron_run, replicated_run, fsdp_run):  # every runtime starts from rank 0's
            assert run["grad_diff"] < 1e-5, (rank, run)
        for run in (megatron_run, replicated_run):  # each rank's own rows' loss: the group's gradient
            assert run["own_rows_diff"] < 1e-5, (rank, run)
        assert ddp_run["no_sync_diff"] > 1e-3, ddp_run  # this rank's rows only
        assert ddp_run["synced_diff"] < 1e-5, ddp_run
