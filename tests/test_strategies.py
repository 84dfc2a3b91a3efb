"""Per-node sharding strategies: DTensor rules, custom rules, fallback, filtering, placements."""

from __future__ import annotations

import json
import logging
import time

import pytest
import torch
import torch.distributed as dist

from hf_colossal_auto.capture.graph import OpNode, Phase, StepGraph, TensorRef, ValueInfo, ValueKind
from hf_colossal_auto.capture.tracer import trace_training_step
from hf_colossal_auto.models import build_model, make_example_inputs
from hf_colossal_auto.strategies import (
    Strategy,
    clear_cache,
    device_mesh,
    dtensor_rule_kind,
    enumerate_strategies,
    evenly_sharded,
    fallback_ops,
    from_dtensor,
    is_partial,
    local_shape,
    resolve_op,
    to_dtensor,
)
from hf_colossal_auto.strategies.enumerate import _meshes

FAMILIES = ["tiny-gpt2", "tiny-bert", "tiny-t5", "tiny-llama"]
MESHES = [(2,), (4,), (2, 2)]
ENUM_LOGGER = "hf_colossal_auto.strategies.enumerate"


@pytest.fixture(scope="module", autouse=True)
def _release_process_group():
    """The enumerator starts a fake process group when none exists; other test modules expect none."""
    was_initialized = dist.is_initialized()
    yield
    if not was_initialized and dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def graphs() -> dict[str, StepGraph]:
    out = {}
    for name in FAMILIES:
        torch.manual_seed(0)
        model = build_model(name, device="cpu")
        out[name] = trace_training_step(model, make_example_inputs(model, 4, 16))
    return out


def _check_strategies(graph: StepGraph, result: dict[int, list[Strategy]], phase: Phase, mesh_shape) -> None:
    wanted = [n for n in graph.nodes if n.phase is phase]
    assert sorted(result) == sorted(n.index for n in wanted)
    for node in wanted:
        strategies = result[node.index]
        assert strategies, node.op
        assert len({s.key for s in strategies}) == len(strategies), f"duplicates for {node.op}"
        for s in strategies:
            assert len(s.input_placements) == len(node.inputs), node.op
            assert len(s.output_placements) == len(node.outputs), node.op
            for vid, spec in zip(node.inputs, s.input_placements, strict=True):
                assert spec is None or len(spec) == len(mesh_shape)
                assert evenly_sharded(graph.values[vid].shape, spec, mesh_shape), (node.op, s)
            for vid, spec in zip(node.outputs, s.output_placements, strict=True):
                assert len(spec) == len(mesh_shape)
                assert evenly_sharded(graph.values[vid].shape, spec, mesh_shape), (node.op, s)


# ------------------------------------------------------------------------------------------ real graphs
@pytest.mark.parametrize("mesh_shape", MESHES, ids=str)
@pytest.mark.parametrize("family", FAMILIES)
def test_every_forward_node_gets_strategies(graphs, family, mesh_shape, caplog) -> None:
    graph = graphs[family]
    with caplog.at_level(logging.WARNING, logger=ENUM_LOGGER):
        result = enumerate_strategies(graph, mesh_shape)
    _check_strategies(graph, result, Phase.FORWARD, mesh_shape)
    # Every forward op of the four families has a DTensor or custom rule: nothing falls back.
    assert fallback_ops(result, graph) == []
    assert not [r for r in caplog.records if r.name == ENUM_LOGGER]
    # And the rules are not degenerate: most nodes can be sharded somehow.
    shardable = sum(any(not s.is_replicate() for s in ss) for ss in result.values())
    assert shardable > 0.6 * len(result)


@pytest.mark.parametrize("mesh_shape", [(2,), (2, 2)], ids=str)
@pytest.mark.parametrize("family", ["tiny-gpt2", "tiny-llama"])
def test_backward_nodes_get_strategies(graphs, family, mesh_shape) -> None:
    graph = graphs[family]
    result = enumerate_strategies(graph, mesh_shape, phases=(Phase.BACKWARD,))
    _check_strategies(graph, result, Phase.BACKWARD, mesh_shape)
    assert fallback_ops(result, graph) == []


def test_mm_has_exactly_the_four_1d_strategies(graphs) -> None:
    graph = graphs["tiny-llama"]
    result = enumerate_strategies(graph, (2,))
    mms = [n for n in graph.nodes if n.op == "aten.mm.default" and n.phase is Phase.FORWARD]
    assert mms
    expected = {
        ((("R",), ("R",)), (("R",),)),
        ((("S1",), ("S0",)), (("P",),)),
        ((("S0",), ("R",)), (("S0",),)),
        ((("R",), ("S1",)), (("S1",),)),
    }
    for node in mms:
        assert {s.key for s in result[node.index]} == expected
        assert all(s.source == "dtensor" for s in result[node.index])


def test_addmm_keeps_row_parallel_with_partial_bias(graphs) -> None:
    """A partial input next to sharded ones (the bias of a row-parallel linear) is kept; pure deferrals
    such as mm(P, R) -> P are not (checked above)."""
    graph = graphs["tiny-gpt2"]
    result = enumerate_strategies(graph, (2,))
    node = next(n for n in graph.nodes if n.op == "aten.addmm.default")
    keys = {s.key for s in result[node.index]}
    assert ((("P",), ("S1",), ("S0",)), (("P",),)) in keys
    assert ((("R",), ("S0",), ("R",)), (("S0",),)) in keys


def test_two_dim_mesh_combines_rules_per_mesh_dim(graphs) -> None:
    graph = graphs["tiny-llama"]
    result = enumerate_strategies(graph, (2, 2))
    node = next(n for n in graph.nodes if n.op == "aten.mm.default")
    keys = {s.key for s in result[node.index]}
    # data parallel on mesh dim 0, column-parallel on mesh dim 1 (2-D "DP x TP")
    assert ((("S0", "R"), ("R", "S1")), (("S0", "S1"),)) in keys
    # both mesh dims on the batch dim: (4*16) rows split four ways
    assert ((("S0", "S0"), ("R", "R")), (("S0", "S0"),)) in keys
    assert len(keys) == 16  # 4 rules per mesh dim, all evenly shardable here


def test_flash_attention_cpu_uses_custom_heads_and_batch_rule() -> None:
    # A padded batch keeps its mask (an all-ones mask is dropped, as eager transformers skips it).
    model = build_model("tiny-llama", device="cpu")
    batch = make_example_inputs(model, 4, 16)
    batch["attention_mask"][0, -1] = 0
    graph = trace_training_step(model, batch)
    fwd_op = "aten._scaled_dot_product_flash_attention_for_cpu.default"
    bwd_op = "aten._scaled_dot_product_flash_attention_for_cpu_backward.default"
    result = enumerate_strategies(graph, (2,), phases=(Phase.FORWARD, Phase.BACKWARD))
    fwd = next(n for n in graph.nodes if n.op == fwd_op)
    bwd = next(n for n in graph.nodes if n.op == bwd_op)
    mask_shape = graph.values[fwd.inputs[3]].shape
    assert mask_shape[1] == 1  # the causal mask broadcasts over heads
    keys = {s.key: s.source for s in result[fwd.index]}
    heads = ((("S1",),) * 3 + (("R",),), (("S1",), ("S1",)))
    batch = ((("S0",),) * 4, (("S0",), ("S0",)))
    assert keys.get(heads) == "custom" and keys.get(batch) == "custom"
    bwd_keys = {s.key for s in result[bwd.index]}
    assert ((("S1",),) * 6 + (("R",),), (("S1",),) * 3) in bwd_keys


def test_cache_returns_same_strategies(graphs) -> None:
    graph = graphs["tiny-bert"]
    clear_cache()
    first = enumerate_strategies(graph, (2, 2))
    again = enumerate_strategies(graph, (2, 2))
    assert first == again


def test_gpt2_small_forward_enumerates_fast() -> None:
    model = build_model("gpt2", device="meta")
    graph = trace_training_step(model, make_example_inputs(model, 8, 512, device="meta"))
    clear_cache()
    start = time.perf_counter()
    result = enumerate_strategies(graph, (4,))
    elapsed = time.perf_counter() - start
    assert len(result) > 300
    assert elapsed < 2.0, f"{elapsed:.2f}s for {len(result)} nodes"


# ------------------------------------------------------------------------------------------ synthetic graphs
def _graph(nodes: list[tuple[str, list[tuple[int, ...]], list[tuple[int, ...]], tuple]]) -> StepGraph:
    """A StepGraph of independent nodes: (op, input shapes, output shapes, args with ``"$i"`` for input i)."""
    values: dict[int, ValueInfo] = {}
    op_nodes: list[OpNode] = []

    def new_value(shape: tuple[int, ...]) -> int:
        vid = len(values)
        values[vid] = ValueInfo(
            vid, shape, "float32", 4 * int(torch.Size(shape).numel()), vid, ValueKind.ACTIVATION
        )
        return vid

    for index, (op, in_shapes, out_shapes, args) in enumerate(nodes):
        ins = [new_value(s) for s in in_shapes]
        outs = [new_value(s) for s in out_shapes]
        recorded = tuple(
            TensorRef(ins[int(a[1:])]) if isinstance(a, str) and a.startswith("$") else a for a in args
        )
        op_nodes.append(OpNode(index, op, Phase.FORWARD, "", ins, outs, 0, 0, 0, args=(recorded, {})))
    return StepGraph(
        model_class="Synthetic",
        nodes=op_nodes,
        values=values,
        storages={},
        initial_storages=[],
        memory_events=[],
        param_names=[],
        param_bytes={},
        param_shapes={},
        optimizer_state_bytes={},
        buffer_bytes=0,
        input_bytes=0,
    )


def test_replicate_fallback_warns_once_per_op_and_names_it(caplog) -> None:
    assert dtensor_rule_kind(resolve_op("aten._cdist_forward.default")) is None
    graph = _graph(
        [
            ("aten._cdist_forward.default", [(2, 8, 4), (2, 6, 4)], [(2, 8, 6)], ("$0", "$1", 2.0, None)),
            ("aten._cdist_forward.default", [(2, 8, 4), (2, 6, 4)], [(2, 8, 6)], ("$0", "$1", 2.0, None)),
            ("mylib.not_an_op.default", [(4, 4)], [(4, 4)], ("$0",)),
        ]
    )
    with caplog.at_level(logging.WARNING, logger=ENUM_LOGGER):
        result = enumerate_strategies(graph, (2,))
    warnings = [r.getMessage() for r in caplog.records if r.name == ENUM_LOGGER]
    assert len(warnings) == 2
    assert sum("aten._cdist_forward.default" in w for w in warnings) == 1
    assert sum("mylib.not_an_op.default" in w for w in warnings) == 1
    for strategies in result.values():
        assert len(strategies) == 1
        assert strategies[0].source == "replicate-fallback" and strategies[0].is_replicate()
    assert fallback_ops(result, graph) == ["aten._cdist_forward.default", "mylib.not_an_op.default"]


def test_uneven_shards_are_dropped() -> None:
    # rows: 6 (not divisible by 4), contraction: 8, columns: 4
    graph = _graph([("aten.mm.default", [(6, 8), (8, 4)], [(6, 4)], ("$0", "$1"))])
    keys = {s.key for s in enumerate_strategies(graph, (4,))[0]}
    assert keys == {
        ((("R",), ("R",)), (("R",),)),
        ((("S1",), ("S0",)), (("P",),)),
        ((("R",), ("S1",)), (("S1",),)),
    }  # (S0, R) -> S0 would split 6 rows four ways
    keys_2x2 = {s.key for s in enumerate_strategies(graph, (2, 2))[0]}
    assert ((("S0", "R"), ("R", "R")), (("S0", "R"),)) in keys_2x2  # 6 rows two ways is fine
    assert ((("S0", "S0"), ("R", "R")), (("S0", "S0"),)) not in keys_2x2  # but not four ways


def test_evenly_sharded_and_local_shape() -> None:
    assert not evenly_sharded((6, 4), ("S0",), (4,))
    assert evenly_sharded((8, 4), ("S0",), (4,))
    assert evenly_sharded((6, 4), ("R",), (4,))
    assert evenly_sharded((6, 4), ("P",), (4,))
    assert evenly_sharded((8, 6), ("S0", "S1"), (2, 2))
    assert not evenly_sharded((6, 8), ("S0", "S0"), (2, 2))  # one dim split by both mesh dims: 6 % 4
    assert not evenly_sharded((6,), ("S1",), (2,))  # no such dim
    assert evenly_sharded((6,), None, (2,))
    assert local_shape((8, 6), ("S0", "S1"), (2, 2)) == (4, 3)
    assert local_shape((8, 6), ("S0", "S0"), (2, 2)) == (2, 6)


# ------------------------------------------------------------------------------------------ placements
@pytest.mark.parametrize("p", ["R", "P", "S0", "S3", "P(avg)", "P(max)", "P(min)"])
def test_placement_round_trips_through_dtensor(p: str) -> None:
    assert from_dtensor(to_dtensor(p)) == p


def test_dtensor_placements_convert() -> None:
    from torch.distributed.tensor import Partial, Replicate, Shard

    from hf_colossal_auto._torch_compat import MaskPartial, StridedShard

    assert from_dtensor(Shard(2)) == "S2" and to_dtensor("S2") == Shard(2)
    assert from_dtensor(Replicate()) == "R" and to_dtensor("R") == Replicate()
    assert from_dtensor(Partial()) == "P" and to_dtensor("P") == Partial()
    assert from_dtensor(Partial("avg")) == "P(avg)" and is_partial("P(avg)")
    mask = MaskPartial(offset_shape=torch.Size([16, 8]), offset_dim=0)
    assert from_dtensor(mask) == "P"  # the vocab-parallel embedding's output
    assert from_dtensor(mask, as_input=True) == "R"  # its ids: replicated, masked locally
    with pytest.raises(ValueError):
        from_dtensor(StridedShard(0, split_factor=2))
    for bad in ["S", "S-1", "X", "P(foo)", "s0", ""]:
        with pytest.raises(ValueError):
            to_dtensor(bad)


def test_strategy_json_round_trip() -> None:
    s = Strategy((("S0", "R"), None, ("R", "S1")), (("S0", "S1"), ("P", "R")), "custom")
    assert Strategy.from_dict(json.loads(json.dumps(s.to_dict()))) == s
    assert s.mesh_ndim == 2 and not s.is_replicate()
    with pytest.raises(ValueError):
        Strategy((("S0",),), (("S0", "R"),))  # specs for meshes of different rank
    with pytest.raises(ValueError):
        Strategy((("Q",),), (("R",),))
    with pytest.raises(ValueError):
        Strategy((("R",),), (("R",),), "guess")  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------------ process groups
def test_mesh_over_fake_group_of_another_size() -> None:
    device_mesh((2,))  # starts the fake group if nothing did yet
    assert dist.get_backend() == "fake"
    world = dist.get_world_size()
    other = (world * 2, 3)
    mesh = device_mesh(other)
    assert tuple(mesh.shape) == other
    assert device_mesh(other) is mesh  # cached


def test_real_group_gets_a_detached_mesh(tmp_path) -> None:
    """Inside a training job only one rank plans: strategies must not build real (collective) meshes."""
    if dist.is_initialized():  # this module's own fake group; it is re-created on demand afterwards
        assert dist.get_backend() == "fake"
        dist.destroy_process_group()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        graph = _graph([("aten.mm.default", [(4, 4), (4, 4)], [(4, 4)], ("$0", "$1"))])
        result = enumerate_strategies(graph, (1,))
        assert result[0]
        mesh = device_mesh((2,))  # larger than the real group: a shape-only mesh, no process groups
        assert tuple(mesh.shape) == (2,)
        assert len(enumerate_strategies(graph, (2,))[0]) > 1
    finally:
        dist.destroy_process_group()
    # A fresh fake group afterwards, and no stale mesh from the destroyed group.
    mesh = device_mesh((2,))
    assert dist.get_backend() == "fake" and tuple(mesh.shape) == (2,)
    assert _meshes[((2,), dist.get_world_size(), "fake")][0] is dist.group.WORLD
