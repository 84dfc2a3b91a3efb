"""Models built on ``meta``: materialised with the model's own init, shard by shard, after planning."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torchrun_launch import run_torchrun

from hf_colossal_auto._torch_compat import fake_process_group
from hf_colossal_auto.apply import (
    MetaInitError,
    apply_plan,
    build_mesh,
    is_meta_model,
    materialize_meta_model,
)
from hf_colossal_auto.models import build_model, make_example_inputs
from hf_colossal_auto.solve.planner import evaluate_plan, plan_model

ROOT = Path(__file__).resolve().parents[1]
PRESETS = ["tiny-gpt2", "tiny-llama", "tiny-bert", "tiny-t5"]


def _aliases(model: nn.Module) -> set[tuple[str, str]]:
    """Pairs of names that hold the same parameter object (the ties)."""
    first: dict[int, str] = {}
    pairs = set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            pairs.add((first[id(p)], name))
        first.setdefault(id(p), name)
    return pairs


@pytest.mark.parametrize("preset", PRESETS)
def test_meta_model_gets_the_models_own_init(preset):
    """One process: every tensor leaves meta; buffers (Llama's inv_freq, BERT's position/token type ids) equal a
    CPU-built model's; parameters have the CPU build's distribution (constants equal, std within 15 %); ties
    are kept; the same RNG state gives the same weights; full-size temporaries stay far below the model."""
    torch.manual_seed(0)
    cpu = build_model(preset, device="cpu")
    meta = build_model(preset, device="meta")
    assert is_meta_model(meta) and not is_meta_model(cpu)
    report = materialize_meta_model(meta, seed=0)
    assert not any(t.is_meta for t in meta.state_dict().values())
    assert report.parameters == len(list(cpu.parameters()))
    for name, buffer in cpu.named_buffers():
        assert torch.equal(dict(meta.named_buffers())[name], buffer), name
    got = meta.state_dict()
    for name, ref in cpu.state_dict().items():
        if not ref.is_floating_point() or ref.numel() < 1024:
            continue
        if float(ref.std()) == 0.0:
            assert torch.equal(got[name], ref), name
        else:
            assert float(got[name].std()) == pytest.approx(float(ref.std()), rel=0.15), name
            assert abs(float(got[name].mean() - ref.mean())) < 0.1 * float(ref.std()), name
    assert _aliases(meta) == _aliases(cpu)
    again = build_model(preset, device="meta")
    materialize_meta_model(again, seed=0)
    assert all(torch.equal(a, b) for a, b in zip(got.values(), again.state_dict().values(), strict=True))
    largest = max(p.numel() * p.element_size() for p in cpu.parameters())
    assert report.full_bytes == sum(p.numel() * p.element_size() for p in cpu.parameters())
    assert report.peak_temporary_bytes <= 2 * largest < report.full_bytes


def test_applied_plan_allocates_only_this_ranks_shards():
    """Rank 0 of a simulated 1 x 2 job (fake process group): a meta Llama plans (the planner traces meta models
    symbolically), every parameter becomes a DTensor whose local tensor has the plan's shard shape, and the
    values are rank 0's part of what one process initialises from the same RNG state. An optimizer made on the
    meta model is pointed at the new parameters."""
    model = build_model("tiny-llama", device="meta")
    batch = make_example_inputs(model, 4, 16)
    auto = plan_model(model, batch, num_devices=2, device="cpu", mesh_shape=(1, 2))
    assert tuple(auto.mesh_shape) == (1, 2) and set(auto.param_placements) == set(
        dict(model.named_parameters())
    )
    plan = evaluate_plan(model, batch, "megatron", num_devices=2, device="cpu", mesh_shape=(1, 2)).plan
    reference = build_model("tiny-llama", device="meta")
    torch.manual_seed(7)
    materialize_meta_model(reference)
    if dist.is_initialized():
        dist.destroy_process_group()
    fake_process_group(2, rank=0)
    try:
        optimizer = torch.optim.AdamW(model.parameters())
        torch.manual_seed(7)
        apply_plan(model, plan, build_mesh(plan, "cpu"), optimizers=[optimizer])
        params = dict(model.named_parameters())
        assert {id(p) for g in optimizer.param_groups for p in g["params"]} == {
            id(p) for p in params.values()
        }
        sharded = 0
        for name, full in reference.named_parameters():
            param = params[name]
            assert isinstance(param, DTensor) and not param.is_meta, name
            placement = plan.param_placements[name][1]
            if placement == "R":
                expected = full
            else:
                sharded += 1
                expected = full.chunk(2, dim=int(placement[1:]))[0]
            assert torch.equal(param.to_local(), expected), name
        assert sharded > 0
        assert torch.equal(model.model.rotary_emb.inv_freq, reference.model.rotary_emb.inv_freq)
    finally:
        dist.destroy_process_group()


class _Scale(nn.Module):
    """A module with a parameter and no reset_parameters: nothing knows how to initialise it."""

    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.empty(8))

    def forward(self, x):
        return x * self.gain


def test_plain_modules_fall_back_to_reset_parameters_and_unknown_ones_are_refused():
    with torch.device("meta"):
        plain = nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.Linear(32, 8))
    report = materialize_meta_model(plain, seed=0)
    assert report.reset_parameters_modules == ["0", "1", "2"]
    bound = 1 / 16**0.5  # nn.Linear's kaiming-uniform bound for fan_in 16
    weight = plain[0].weight.detach()
    assert 0 < float(weight.abs().max()) <= bound and float(weight.std()) > bound / 4
    assert torch.equal(plain[1].weight, torch.ones(32))

    with torch.device("meta"):
        custom = nn.Sequential(nn.Linear(8, 8), _Scale())
    with pytest.raises(MetaInitError, match=r"'1\.gain' of _Scale.*reset_parameters.*load_checkpoint"):
        materialize_meta_model(custom, seed=0)


def test_partly_meta_model_is_refused():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4, device="meta"))
    with pytest.raises(MetaInitError, match="entirely on meta"):
        is_meta_model(model)


@pytest.mark.slow
def test_gloo_meta_models_are_sharded_and_initialised_per_rank(tmp_path):
    """2 gloo processes, tiny-llama and tiny-gpt2 (tied) on a 1 x 2 tensor-parallel plan and a 2 x 1 FSDP plan,
    built on meta: each rank holds exactly its shards, replicated parameters are bit-identical across the
    group, the gathered weights equal one process's initialisation from the same RNG state and have the CPU
    build's statistics, buffers equal the CPU build's, ties hold, and three AdamW steps lower the loss
    (identically on the ranks of a tensor-parallel group). A 2 x 1 DDP plan (sharding nothing) leaves ordinary
    parameters, whole and identical on both ranks, with the same values."""
    out = tmp_path / "result.json"
    run_torchrun(str(ROOT / "tests" / "multiproc" / "check_meta_init.py"), "--out", str(out))
    results = json.loads(out.read_text())
    assert len(results) == 5
    for r in results:
        case = r["case"]
        assert r["local_bytes"] == r["expected_local_bytes"], case
        if r["shards_nothing"]:
            assert r["all_plain"] and r["local_bytes"] == r["full_bytes"], case
        else:
            assert r["all_dtensors"], case
            assert r["local_bytes"] < 0.8 * r["full_bytes"], case
        assert r["replicated_identical"], case
        assert r["differs_from_single_process"] == [], case
        assert r["stats_differ_from_cpu_build"] == [], case
        assert r["buffers_differ"] == [], case
        assert r.get("tied", True), case
        first, last = (sum(step) / len(step) for step in (r["losses"][0], r["losses"][-1]))
        assert last < first - 0.1, case
        if "1x2" in case:
            assert all(len(set(step)) == 1 for step in r["losses"]), case
    assert any(r["buffers_checked"] for r in results)  # Llama's rotary inv_freq
