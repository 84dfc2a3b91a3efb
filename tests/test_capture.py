"""The captured step graph: its structure, and the errors bad inputs get."""

from __future__ import annotations

import gc

import pytest
import torch
from torch import nn

from hf_colossal_auto.capture import CaptureError, Phase, TensorRef, trace_training_step
from hf_colossal_auto.capture import tracer as tracer_module
from hf_colossal_auto.hardware import list_devices
from hf_colossal_auto.models import build_model, load_config, make_example_inputs
from hf_colossal_auto.profile import profile_model

PHASE_ORDER = {Phase.FORWARD: 0, Phase.BACKWARD: 1, Phase.OPTIMIZER: 2}


def _gpt2(layers: int):
    config = load_config("tiny-gpt2")
    config.n_layer = layers
    model = build_model(config, device="meta")
    return model, make_example_inputs(model, 2, 16, device="meta")


@pytest.fixture(scope="module")
def gpt2_graphs():
    """A 6-block GPT-2 traced with folding (4 blocks traced) and without."""
    model, batch = _gpt2(6)
    folded = trace_training_step(model, batch)
    full = trace_training_step(model, batch, fold_blocks=False)
    return model, batch, folded, full


# ------------------------------------------------------------------------------------------- structure
@pytest.mark.parametrize("which", ["folded", "full"])
def test_phases_are_set_and_ordered(gpt2_graphs, which):
    graph = gpt2_graphs[2] if which == "folded" else gpt2_graphs[3]
    assert graph.nodes
    assert all(isinstance(n.phase, Phase) for n in graph.nodes)
    ranks = [PHASE_ORDER[n.phase] for n in graph.nodes]
    assert ranks == sorted(ranks), "forward ops must precede backward ops, which precede optimizer ops"
    assert set(ranks) == {0, 1, 2}
    assert [n.index for n in graph.nodes] == list(range(len(graph.nodes)))
    for phase in Phase:
        seg = graph.phase_range(phase)
        assert all(graph.nodes[i].phase is phase for i in range(seg.start, seg.end))


def test_module_paths(gpt2_graphs):
    _, _, folded, full = gpt2_graphs
    for graph in (folded, full):
        fwd = {n.module for n in graph.nodes if n.phase is Phase.FORWARD}
        bwd = {n.module for n in graph.nodes if n.phase is Phase.BACKWARD}
        assert any(m == "transformer.h.0.attn" or m.startswith("transformer.h.0.attn.") for m in fwd)
        assert any(m.startswith("transformer.h.0.attn") for m in bwd)
        assert "lm_head" in fwd
        assert "transformer.wte" in fwd
    # Folding traced blocks 0..3 only (block 3 standing for the last block).
    traced = {m.split(".")[2] for m in (n.module for n in folded.nodes) if m.startswith("transformer.h.")}
    assert traced == {"0", "1", "2", "3"}
    traced_full = {m.split(".")[2] for m in (n.module for n in full.nodes) if m.startswith("transformer.h.")}
    assert traced_full == {str(i) for i in range(6)}
    assert all(n.module == "" for n in full.nodes if n.phase is Phase.OPTIMIZER)


def test_values_and_args_are_consistent(gpt2_graphs):
    for graph in gpt2_graphs[2:]:
        for n in graph.nodes:
            for v in (*n.inputs, *n.outputs):
                assert v in graph.values
            for v in n.inputs:
                producer = graph.values[v].producer
                assert producer is None or producer < n.index
            for v in n.outputs:
                assert graph.values[v].producer == n.index
                assert graph.values[v].storage_id in graph.storages
            refs = [a for a in torch.utils._pytree.tree_leaves(n.args) if isinstance(a, TensorRef)]
            assert all(r.value_id in n.inputs for r in refs)
            assert not any(isinstance(a, torch.Tensor) for a in torch.utils._pytree.tree_leaves(n.args))
            if (
                not n.launches_kernel
            ):  # a pure view moves nothing; an in-place op (bernoulli_) moves its bytes
                assert n.bytes_read == n.bytes_written == 0
            elif n.mutates:
                assert n.bytes_written == sum(graph.values[v].nbytes for v in n.outputs)
            assert n.flops >= 0
        assert any(n.is_view for n in graph.nodes)


def test_memory_events_are_consistent(gpt2_graphs):
    for graph in gpt2_graphs[2:]:
        initial = set(graph.initial_storages)
        allocated: dict[int, int] = {}
        freed: set[int] = set()
        last = -1
        for e in graph.memory_events:
            assert e.position >= last, "events are chronological"
            last = e.position
            assert 0 <= e.position <= len(graph.nodes)
            assert abs(e.delta) == graph.storages[e.storage_id].nbytes
            if e.delta > 0:
                assert e.storage_id not in allocated and e.storage_id not in initial
                allocated[e.storage_id] = e.position
            else:
                # A storage made outside the dispatcher (a Python scalar lifted to a tensor) counts as initial.
                assert e.storage_id in allocated or e.storage_id in initial
                assert e.storage_id not in freed
                assert e.position > allocated.get(e.storage_id, -1)
                freed.add(e.storage_id)
        kinds = {graph.storages[s].kind.value for s in initial}
        assert {"param", "input", "optimizer_state"} <= kinds
        # One gradient per parameter that was traced (tied weights counted once).
        grads = [s for s in graph.storages.values() if s.kind.value == "grad"]
        assert len(grads) == sum(1 for p in graph.param_names if _traced(graph, p))


def _traced(graph, param: str) -> bool:
    if not param.startswith("transformer.h."):
        return True
    traced = {b for run in graph.block_runs for b in run.traced}
    return not graph.block_runs or ".".join(param.split(".")[:3]) in traced


def test_node_flops_sum_to_total(gpt2_graphs):
    model, batch, folded, full = gpt2_graphs
    report = profile_model(model, batch, device="cpu")
    train = (Phase.FORWARD, Phase.BACKWARD)
    full_sum = sum(n.flops for n in full.nodes if n.phase in train)
    counts = folded.repeat_of_node()
    folded_sum = sum(n.flops * c for n, c in zip(folded.nodes, counts, strict=True) if n.phase in train)
    assert full_sum == folded_sum == report.total_flops > 0
    assert sum(n.flops * n.count for n in report.nodes if n.phase != "optimizer") == report.total_flops
    assert sum(n.flops for n in folded.nodes if n.phase is Phase.OPTIMIZER) == 0


def test_block_segments_of_folded_runs(gpt2_graphs):
    _, _, folded, full = gpt2_graphs
    assert full.block_runs == [] and full.block_segments == {}
    assert len(folded.block_runs) == 1
    run = folded.block_runs[0]
    assert run.container == "transformer.h"
    assert run.all_blocks == [f"transformer.h.{i}" for i in range(6)]
    assert run.traced == [f"transformer.h.{i}" for i in range(4)]
    assert run.repeat == 2 and run.representative == "transformer.h.2"
    assert set(folded.block_segments) == set(run.traced)
    fwd_starts, bwd_starts = [], []
    for block in run.traced:
        segs = folded.block_segments[block]
        assert set(segs) == {Phase.FORWARD, Phase.BACKWARD}
        for phase, seg in segs.items():
            assert seg.start < seg.end
            nodes = folded.nodes[seg.start : seg.end]
            assert all(n.phase is phase for n in nodes)
            assert all(n.module == block or n.module.startswith(block + ".") for n in nodes)
        fwd_starts.append(segs[Phase.FORWARD].start)
        bwd_starts.append(segs[Phase.BACKWARD].start)
    assert fwd_starts == sorted(fwd_starts)
    assert bwd_starts == sorted(bwd_starts, reverse=True)
    # The two middle copies recorded the same ops (the tracer's own check; here from the outside).
    a, b = (folded.block_segments[f"transformer.h.{i}"][Phase.BACKWARD] for i in (1, 2))
    assert [n.op for n in folded.nodes[a.start : a.end]] == [n.op for n in folded.nodes[b.start : b.end]]
    counts = folded.repeat_of_node()
    rep = folded.block_segments[run.representative][Phase.FORWARD]
    assert set(counts[rep.start : rep.end]) == {1 + run.repeat}
    assert counts.count(1) == len(counts) - sum(
        s.end - s.start for s in folded.block_segments[run.representative].values()
    )


def test_optimizer_state_covers_every_parameter(gpt2_graphs):
    model, _, folded, full = gpt2_graphs
    names = [n for n, _ in model.named_parameters()]
    assert folded.param_names == full.param_names == names
    assert folded.optimizer_state_bytes == full.optimizer_state_bytes
    for n, p in model.named_parameters():
        # AdamW: exp_avg and exp_avg_sq like the parameter, plus a scalar step counter.
        assert folded.optimizer_state_bytes[n] >= 2 * p.numel() * p.element_size()


def test_memory_timeline_does_not_depend_on_cyclic_gc(monkeypatch):
    """Frees are recorded when storages die. If any died only through the cyclic collector, the timeline would
    depend on when it happens to run; with it off, and with it run after every allocation, it must be the same."""
    model, batch = _gpt2(2)
    enabled = gc.isenabled()
    gc.disable()
    try:
        quiet = trace_training_step(model, batch)
    finally:
        if enabled:
            gc.enable()
    original = tracer_module._trace_once

    def with_aggressive_gc(*args, **kwargs):
        thresholds = gc.get_threshold()
        gc.enable()
        gc.set_threshold(1, 1, 1)
        try:
            return original(*args, **kwargs)
        finally:
            gc.set_threshold(*thresholds)

    monkeypatch.setattr(tracer_module, "_trace_once", with_aggressive_gc)
    noisy = trace_training_step(model, batch)
    timeline = [(e.position, e.delta) for e in quiet.memory_events]
    assert timeline == [(e.position, e.delta) for e in noisy.memory_events]
    assert [n.op for n in quiet.nodes] == [n.op for n in noisy.nodes]


# ------------------------------------------------------------------------------------------- bad input
def test_unknown_device_lists_valid_names():
    model, batch = _gpt2(2)
    with pytest.raises(ValueError, match="tpu-v9") as info:
        profile_model(model, batch, device="tpu-v9")
    for name in list_devices():
        assert name in str(info.value)


class _TwoArgs(nn.Module):
    """A model whose forward requires both keys."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.head = nn.Linear(8, 16)

    def forward(self, input_ids, labels):
        logits = self.head(self.emb(input_ids))
        return {"loss": nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())}


def _ids_and_labels() -> dict[str, torch.Tensor]:
    """A 2 x 4 batch of token ids and labels for the toy models here."""
    return {"input_ids": torch.zeros(2, 4, dtype=torch.long), "labels": torch.zeros(2, 4, dtype=torch.long)}


def test_custom_model_traces():
    batch = _ids_and_labels()
    graph = trace_training_step(_TwoArgs(), batch)
    assert {n.module for n in graph.nodes if n.phase is Phase.FORWARD} >= {"emb", "head"}


class _SharedScale(nn.Module):
    """A module object outside any model's tree, called from every block's forward: what the ``kernels``
    package makes of a function transformers decorates with ``@use_kernel_forward_from_hub`` (Llama's
    ``apply_rotary_pos_emb`` on transformers >= 5.25)."""

    def forward(self, x):
        return x * 2.0 + 1.0


_SHARED_SCALE = _SharedScale()


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        return x + _SHARED_SCALE(self.proj(x))


class _StackCallingAForeignModule(nn.Module):
    def __init__(self, depth: int = 6):
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.blocks = nn.ModuleList(_Block() for _ in range(depth))
        self.head = nn.Linear(8, 16)

    def forward(self, input_ids, labels):
        x = self.emb(input_ids)
        for block in self.blocks:
            x = block(x)
        logits = self.head(x)
        return {"loss": nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())}


def test_ops_of_a_module_outside_the_model_belong_to_the_module_calling_it():
    batch = _ids_and_labels()
    graph = trace_training_step(_StackCallingAForeignModule(), batch)
    assert len(graph.block_runs) == 1, "the blocks fold: the shared module does not split them"
    scaled = [
        n for n in graph.nodes if n.phase is Phase.FORWARD and n.op in ("aten.mul.Tensor", "aten.add.Tensor")
    ]
    assert scaled and all(n.module.startswith("blocks.") for n in scaled)
    assert {n.module for n in scaled} == {f"blocks.{i}" for i in range(4)}  # the traced copies


def test_comm_debug_mode_runs_a_module_called_from_every_block_and_leaves_no_hook():
    """torch's own CommDebugMode leaves a hook on a module object per extra call, which breaks every later
    forward of the process; the adapter's keeps one per module and removes it."""
    from hf_colossal_auto._torch_compat import comm_debug_mode

    model = _StackCallingAForeignModule()
    batch = _ids_and_labels()
    for _ in range(2):
        with comm_debug_mode() as comm:
            model(**batch)["loss"].backward()
        assert comm.get_total_counts() == 0
        assert not _SHARED_SCALE._forward_hooks
    model(**batch)  # no stale hook fires outside the mode


def test_llama_blocks_fold():
    """Llama's blocks fold whether or not transformers turned its rotary function into a module object."""
    config = load_config("tiny-llama")
    config.num_hidden_layers = 6
    model = build_model(config, device="meta")
    graph = trace_training_step(model, make_example_inputs(model, 2, 16, device="meta"))
    assert len(graph.block_runs) == 1
    assert not [
        n for n in graph.nodes if n.phase is Phase.FORWARD and n.module == "" and n.op == "aten.neg.default"
    ]


def test_missing_required_key_is_named():
    with pytest.raises(ValueError, match="labels"):
        trace_training_step(_TwoArgs(), {"input_ids": torch.zeros(2, 4, dtype=torch.long)})


def test_unknown_key_is_named():
    batch = _ids_and_labels()
    with pytest.raises(ValueError, match="pixel_values"):
        trace_training_step(_TwoArgs(), {**batch, "pixel_values": torch.zeros(2, 3)})


def test_t5_without_labels_is_named():
    model = build_model("tiny-t5", device="meta")
    batch = make_example_inputs(model, 2, 16, device="meta")
    del batch["labels"]
    with pytest.raises(ValueError, match="labels"):
        trace_training_step(model, batch)
    with pytest.raises(ValueError, match="labels"):
        profile_model(model, batch)


def test_model_without_loss_says_to_pass_labels():
    model, batch = _gpt2(2)
    del batch["labels"]
    with pytest.raises(CaptureError) as info:
        trace_training_step(model, batch)
    message = str(info.value)
    assert "GPT2LMHeadModel" in message
    assert "labels" in message


@pytest.mark.parametrize("bad", [[1, 2], ("input_ids",), "input_ids", None])
def test_non_dict_inputs_raise_type_error(bad):
    model, batch = _gpt2(2)
    with pytest.raises(TypeError, match="dict"):
        trace_training_step(model, bad)
    with pytest.raises(TypeError, match="dict"):
        profile_model(model, [batch["input_ids"]])


def test_empty_inputs():
    model, _ = _gpt2(2)
    with pytest.raises(ValueError, match="empty"):
        trace_training_step(model, {})


def test_unknown_mixed_precision_and_optimizer():
    model, batch = _gpt2(2)
    with pytest.raises(ValueError, match="fp8"):
        trace_training_step(model, batch, mixed_precision="fp8")
    # A ValueError up front, not a CaptureError from inside the trace blaming the inputs.
    with pytest.raises(ValueError, match="lion"):
        trace_training_step(model, batch, optimizer="lion")
    assert trace_training_step(model, batch, optimizer="SGD").phase_range(Phase.OPTIMIZER).end > 0
    graph = trace_training_step(model, batch, optimizer=None)
    assert graph.phase_range(Phase.OPTIMIZER).start == graph.phase_range(Phase.OPTIMIZER).end


class _DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        y = self.lin(x)
        if y.sum() > 0:  # needs the data: impossible on fake tensors
            y = y * 2
        return {"loss": y.mean()}


def test_data_dependent_model_gets_capture_error_with_hint():
    with pytest.raises(CaptureError) as info:
        trace_training_step(_DataDependent(), {"x": torch.zeros(2, 4)})
    message = str(info.value)
    assert "_DataDependent" in message
    assert "test_capture.py" in message  # where it failed, in the user's code
    assert "ata-dependent" in message
    assert isinstance(info.value.__cause__, Exception)


def test_wrong_input_dtype_gets_capture_error():
    model, batch = _gpt2(2)
    batch["input_ids"] = torch.empty(2, 16, device="meta")  # float ids
    with pytest.raises(CaptureError, match="GPT2LMHeadModel"):
        trace_training_step(model, batch)
