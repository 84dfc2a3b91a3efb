"""Hybrid sharded data parallelism (HSDP): FSDP inside a node, the shards all-reduced across nodes — priced,
planned, written to JSON and run (issue #12, item 3)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from hf_colossal_auto.hardware import ClusterSpec, get_device
from hf_colossal_auto.hardware.catalog import LinkSpec
from hf_colossal_auto.models import build_model, make_example_inputs
from hf_colossal_auto.plan import Plan
from hf_colossal_auto.solve.planner import evaluate_plan, plan_model

SLOW_NETWORK = LinkSpec(bandwidth=1e8, latency=1e-4)
"""An inter-node link far slower than the node's own: where HSDP's layout matters."""


def _two_nodes_of_two():
    """A tiny GPT-2, a global batch of 8, and a device whose network is slow (2 nodes x 2 devices)."""
    torch.manual_seed(0)
    model = build_model("tiny-gpt2", device="cpu")
    model.eval()
    batch = make_example_inputs(model, 8, 16)
    spec = dataclasses.replace(get_device("a100-80gb"), inter_node_link=SLOW_NETWORK)
    return model, batch, spec


@pytest.fixture(scope="module")
def plans():
    """One plan per data-parallel mode on the data-parallel mesh (4, 1) of 2 nodes x 2 devices."""
    model, batch, spec = _two_nodes_of_two()
    return {
        mode: plan_model(
            model,
            batch,
            num_devices=4,
            device=spec,
            devices_per_node=2,
            mesh_shape=(4, 1),
            dp_modes=(mode,),
            micro_batches=1,
        )
        for mode in ("ddp", "fsdp", "hsdp")
    }


def test_shard_group_is_one_nodes_data_parallel_ranks():
    cluster = ClusterSpec(get_device("a100-80gb"), 16, devices_per_node=4)
    assert cluster.hybrid_shard_size((16, 1)) == 4
    assert cluster.hybrid_shard_size((8, 2)) == 2
    # one data-parallel rank per node: nothing to shard in it
    assert cluster.hybrid_shard_size((4, 4)) is None
    assert cluster.hybrid_shard_size((2, 8)) is None  # tensor parallelism wider than a node
    assert ClusterSpec(get_device("a100-80gb"), 4, devices_per_node=4).hybrid_shard_size((4, 1)) is None
    # the replicate axis of (replicate, shard, tp) crosses nodes, the shard axis does not
    replicate, shard = cluster.hybrid_links((8, 2), 2)
    assert replicate == cluster.device.inter_node_link
    assert shard == cluster.device.intra_node_link


def test_hsdp_beats_fsdp_over_a_slow_network_with_memory_between_ddp_and_fsdp(plans):
    ddp, fsdp, hsdp = plans["ddp"], plans["fsdp"], plans["hsdp"]
    assert (hsdp.dp_mode, hsdp.dp_shard_size, hsdp.dp_replicate_size) == ("hsdp", 2, 2)
    assert hsdp.step_time_s < fsdp.step_time_s
    assert fsdp.param_memory_bytes < hsdp.param_memory_bytes < ddp.param_memory_bytes
    # parameters, gradients and optimizer state split over 2 ranks instead of 4
    assert hsdp.param_memory_bytes == pytest.approx(2 * fsdp.param_memory_bytes, rel=1e-6)


def test_hsdp_collectives_are_fsdps_in_the_node_plus_one_all_reduce_per_shard(plans):
    fsdp, hsdp = plans["fsdp"], plans["hsdp"]
    n = len(hsdp.param_placements)
    assert fsdp.collectives["dp_all_gather"] == hsdp.collectives["dp_all_gather"] == 2 * n
    assert fsdp.collectives["dp_reduce_scatter"] == hsdp.collectives["dp_reduce_scatter"] == n
    assert hsdp.collectives["dp_all_reduce"] == n
    assert "dp_all_reduce" not in fsdp.collectives


def test_planner_picks_hsdp_over_a_slow_network_and_prices_it_again(plans):
    model, batch, spec = _two_nodes_of_two()
    best = plan_model(
        model, batch, num_devices=4, device=spec, devices_per_node=2, mesh_shape=(4, 1), micro_batches=1
    )
    assert best.dp_label == "hsdp 2x2"
    assert "hsdp 2x2" in {alt["dp_label"] for alt in best.alternatives}
    again = evaluate_plan(model, batch, best, num_devices=4, device=spec, devices_per_node=2)
    assert again.step_time_s == pytest.approx(best.step_time_s, rel=1e-9)


def test_plan_json_round_trip_and_plans_written_before(plans):
    hsdp = plans["hsdp"]
    again = Plan.from_dict(json.loads(hsdp.to_json()))
    assert (again.dp_mode, again.dp_shard_size, again.dp_label) == ("hsdp", 2, "hsdp 2x2")
    assert "data parallel: hsdp 2x2" in again.summary()
    older = hsdp.to_dict()
    del older["dp_shard_size"]
    for mode, shard in (("fsdp", 4), ("ddp", 1)):
        assert Plan.from_dict({**older, "dp_mode": mode}).dp_shard_size == shard
    assert Plan.from_dict({**hsdp.to_dict(), "dp_mode": "fsdp"}).dp_shard_size == 4  # the mode decides
    with pytest.raises(ValueError, match="needs dp_shard_size"):
        Plan.from_dict(older)
    with pytest.raises(ValueError, match="must divide the data-parallel axis"):
        Plan.from_dict({**older, "dp_shard_size": 3})


def _runtime_collectives(model, plan, batch) -> tuple[dict[str, int], list[list[int]]]:
    """Apply ``plan`` on 4 fake ranks (one process, the fake process group: shapes and collectives real,
    values not) and count the collectives one forward + backward issues, by kind; and the ranks of the
    (replicate, shard) mesh FSDP2 was given."""
    import torch.distributed as dist

    from hf_colossal_auto._torch_compat import comm_debug_mode, fake_process_group
    from hf_colossal_auto.apply import apply_plan, build_mesh

    if dist.is_initialized():
        dist.destroy_process_group()
    fake_process_group(plan.num_devices)
    try:
        apply_plan(model, plan, build_mesh(plan, "cpu"))
        with comm_debug_mode() as comm:
            model(**batch).loss.backward()
        dp_mesh = model._hf_colossal_auto_dp_mesh
        ranks = dp_mesh.mesh.tolist()
    finally:
        dist.destroy_process_group()
    names = {
        "_allgather_base_": "all_gather",
        "_reduce_scatter_base_": "reduce_scatter",
        "allreduce_": "all_reduce",
    }
    counts = {
        names[str(op).split(".")[-1]]: n
        for op, n in comm.get_comm_counts().items()
        if str(op).split(".")[-1] in names
    }
    assert dp_mesh.mesh_dim_names == (("dp_replicate", "dp_shard") if plan.dp_mode == "hsdp" else ("dp",))
    return counts, ranks


def test_runtime_shards_inside_nodes_and_all_reduces_each_shard_across_them(plans):
    """FSDP2 on the plan's (replicate, shard) mesh, 2 nodes x 2: shard groups are a node's ranks, replicate groups
    cross nodes; HSDP runs plain FSDP's gathers and reduce-scatters (the same units, in the node) and all-reduces
    across the nodes exactly the shards of the parameters the plan prices an all-reduce for — which plain FSDP
    never runs."""
    model, batch, _ = _two_nodes_of_two()
    local = {k: v[:2] for k, v in batch.items()}  # one replica's rows
    counts, ranks = _runtime_collectives(model, plans["hsdp"], local)
    per_node = 2
    assert ranks == [[0, 1], [2, 3]]  # rows: shard groups; columns: replicate groups
    assert all(len({r // per_node for r in group}) == 1 for group in ranks)  # a shard group stays in a node
    assert all(
        len({r // per_node for r in group}) == 2 for group in zip(*ranks, strict=True)
    )  # replicas: not
    model, _, _ = _two_nodes_of_two()
    fsdp_counts, _ = _runtime_collectives(model, plans["fsdp"], local)
    assert "all_reduce" not in fsdp_counts
    assert (
        fsdp_counts["reduce_scatter"] == counts["reduce_scatter"] > 0
    )  # the same units, only the groups differ
    assert fsdp_counts["all_gather"] == counts["all_gather"] > 0
    model, _, _ = _two_nodes_of_two()
    ran = _collectives_with_groups(model, plans["hsdp"], local, rank=0)
    all_reduced = sum(nbytes for kind, _, nbytes in ran if kind == "all_reduce")
    assert all_reduced == _planned_all_reduce_bytes(model, plans["hsdp"])


class _GroupRecorder:
    """Every c10d collective a step issues (``c10d.*`` ops, seen by a dispatch mode: what FSDP2 and DTensor hand
    the process group), with the global ranks of the group it ran on and the bytes this rank handed in (a
    reduce-scatter's whole input, an all-gather's or an all-reduce's local tensor)."""

    KINDS = {
        "c10d._allgather_base_.default": "all_gather",
        "c10d._reduce_scatter_base_.default": "reduce_scatter",
        "c10d.allreduce_.default": "all_reduce",
    }

    def __init__(self) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        recorded = self.recorded = []
        kinds = self.KINDS

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                import torch.distributed as dist

                kind = str(func)
                if kind.startswith("c10d."):
                    assert kind in kinds, f"a collective the test does not expect: {kind}"
                    (group,) = [
                        dist.ProcessGroup.unbox(a)
                        for a in args
                        if isinstance(a, torch.ScriptObject) and "ProcessGroup" in str(a._type())
                    ]
                    tensors = [t for a in args for t in (a if isinstance(a, list) else [a])]
                    handed = tensors[1] if kinds[kind] == "reduce_scatter" else tensors[0]
                    ranks = tuple(dist.get_process_group_ranks(group))
                    recorded.append((kinds[kind], ranks, handed.numel() * handed.element_size()))
                return func(*args, **(kwargs or {}))

        self.mode = Mode()


def _collectives_with_groups(model, plan, batch, rank: int) -> list[tuple[str, tuple[int, ...], int]]:
    """Apply ``plan`` as rank ``rank`` of the fake process group (one process; shapes, groups and collectives
    real, values not) and record the collectives of one forward + backward with their groups' ranks."""
    import torch.distributed as dist

    from hf_colossal_auto._torch_compat import fake_process_group
    from hf_colossal_auto.apply import apply_plan, build_mesh

    if dist.is_initialized():
        dist.destroy_process_group()
    fake_process_group(plan.num_devices, rank)
    try:
        apply_plan(model, plan, build_mesh(plan, "cpu"))
        recorder = _GroupRecorder()
        with recorder.mode:
            model(**batch).loss.backward()
    finally:
        dist.destroy_process_group()
    return recorder.recorded


def _planned_all_reduce_bytes(model, plan) -> int:
    """The bytes the plan says one rank all-reduces across the replicas in a step: one all-reduce per parameter
    it prices (``dp_all_reduce``), of that parameter's shard (dim 0 split over the shard group, padded up as
    FSDP2 pads it), in float32."""
    shapes = {name: p.shape for name, p in model.named_parameters()}
    assert plan.collectives["dp_all_reduce"] == len(plan.param_placements)
    shard = plan.dp_shard_size
    return sum(
        -(-shapes[name][0] // shard) * (shapes[name].numel() // shapes[name][0]) * 4
        for name in plan.param_placements
    )


@pytest.mark.parametrize("per_node", [4, 2])
def test_hsdp_groups_follow_the_node_layout_on_a_non_square_mesh(per_node):
    """8 ranks on a 8 x 1 mesh, ``per_node`` devices per node (the planner lays HSDP out as 2 x 4, then 4 x 2):
    as seen from a rank of the first node and one of another, every all-gather and reduce-scatter runs on
    exactly that rank's node, every all-reduce on the ranks at the same place in every node (one per node),
    and the all-reduces move the shards of every parameter the plan prices one for. A square 2 x 2 mesh
    cannot tell the shard axis from the replicate axis; this one can."""
    model, batch, spec = _two_nodes_of_two()
    plan = plan_model(
        model, batch, num_devices=8, device=spec, devices_per_node=per_node, mesh_shape=(8, 1),
        dp_modes=("hsdp",), micro_batches=1,
    )  # fmt: skip
    nodes = 8 // per_node
    assert (plan.dp_shard_size, plan.dp_replicate_size) == (per_node, nodes)
    local = {k: v[:1] for k, v in batch.items()}  # one replica's rows
    for rank in (0, 5):
        ran = _collectives_with_groups(_two_nodes_of_two()[0], plan, local, rank)
        node = rank // per_node
        in_node = tuple(range(node * per_node, (node + 1) * per_node))
        across = tuple(rank % per_node + n * per_node for n in range(nodes))
        groups = {(kind, ranks) for kind, ranks, _ in ran}
        assert groups == {("all_gather", in_node), ("reduce_scatter", in_node), ("all_reduce", across)}, rank
        all_reduced = sum(nbytes for kind, _, nbytes in ran if kind == "all_reduce")
        assert all_reduced == _planned_all_reduce_bytes(model, plan), rank


@pytest.mark.slow
def test_gloo_hsdp_training_tracks_single_process(tmp_path):
    """4 gloo processes, mesh 4 x 1 under HSDP (2 replicas of shard groups of 2): the first step's gradients and
    three AdamW steps' losses equal one process trained on the whole batch (fp32), and FSDP2 ran on the
    (replicate, shard) mesh whose shard groups are consecutive ranks (a node's, ranks numbered node by node)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from torchrun_launch import run_torchrun

    out = tmp_path / "result.json"
    script = Path(__file__).parent / "multiproc" / "check_numerics.py"
    run_torchrun(
        str(script), "--model", "tiny-llama", "--mesh", "4x1", "--plan", "megatron", "--steps", "3",
        "--dp-mode", "hsdp", "--dp-shard", "2", "--optimizer-before", "hsdp", "--out", str(out), nproc=4,
    )  # fmt: skip
    result = json.loads(out.read_text())
    assert result["dp_mode"] == "hsdp"
    assert result["dp_shard_mesh"] == [[0, 1], [2, 3]]
    assert result["max_grad_diff"] < 1e-5
    for got, want in zip(result["losses"], result["reference_losses"], strict=True):
        assert got == pytest.approx(want, abs=1e-5)


def test_mesh_search_skips_hsdp_where_model_state_alone_cannot_fit(plans, monkeypatch):
    """The lower bound (parameters + optimizer state over tp x shard ranks) holds for the plan HSDP makes, and
    under a budget below it the planner never builds an HSDP ILP (nor micro-batches it)."""
    from hf_colossal_auto.capture.tracer import trace_training_step
    from hf_colossal_auto.solve import candidates, search
    from hf_colossal_auto.solve.problem import InfeasibleError

    model, batch, spec = _two_nodes_of_two()
    hsdp = plans["hsdp"]
    floor = search._model_state_floor(
        trace_training_step(model, {k: v[:2] for k, v in batch.items()}), hsdp.dp_shard_size
    )
    assert 0 < floor <= hsdp.peak_memory_bytes
    built: list[str] = []
    real_build = candidates._Planner.build
    monkeypatch.setattr(
        candidates._Planner,
        "build",
        lambda self, mesh, mode, *a, **kw: built.append(mode) or real_build(self, mesh, mode, *a, **kw),
    )
    with pytest.raises(InfeasibleError):
        plan_model(
            model,
            batch,
            num_devices=4,
            device=spec,
            devices_per_node=2,
            mesh_shape=(4, 1),
            dp_modes=("hsdp",),
            memory_budget=floor - 1,
        )
    assert built == []
    plan_model(
        model, batch, num_devices=4, device=spec, devices_per_node=2, mesh_shape=(4, 1), dp_modes=("hsdp",),
        memory_budget=hsdp.peak_memory_bytes, micro_batches=1,
    )  # fmt: skip
    assert built == ["hsdp"]
