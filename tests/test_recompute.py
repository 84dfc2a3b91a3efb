"""Joint sharding + activation recompute: options per block, the ILP's choices, and the runtime running them.

What is held against what:

* the planner's predicted peak against the peak of the *same* recompute traced symbolically (the tracer runs
  the checkpointed model's backward, recompute included; the profiler's peaks are the measured ones within
  0.11 %, tests/test_profiler_accuracy.py), for the four families on one device;
* on 2 gloo ranks, the measured per-rank peak (MemTracker, real tensors) against the budget and the plan;
* the recomputing model's loss and gradients against the model without recompute;
* the joint plan against the two-stage plan (shard, then recompute) and against full recompute everywhere.
"""

from __future__ import annotations

import copy
import json
import logging
import weakref
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from torch._ops import OpOverload
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torchrun_launch import run_torchrun

from hf_colossal_auto.apply.recompute import apply_recompute
from hf_colossal_auto.capture import trace_training_step
from hf_colossal_auto.capture.op_classes import ATTENTION, CLASSES, MATMUL, POINTWISE, op_class
from hf_colossal_auto.models import build_model, load_config, make_example_inputs
from hf_colossal_auto.profile.memory import memory_profile
from hf_colossal_auto.profile.profiler import _module_list_children
from hf_colossal_auto.solve.planner import plan_model
from hf_colossal_auto.solve.problem import InfeasibleError
from hf_colossal_auto.solve.recompute import FULL_RECOMPUTE, NO_RECOMPUTE, find_units, parse_option, selective

ROOT = Path(__file__).resolve().parents[1]
FAMILIES = ["tiny-gpt2", "tiny-bert", "tiny-t5", "tiny-llama"]


# Bounds on the plan's predicted peak / the traced peak of its recompute - 1 (docs/ARCHITECTURE.md: within
# 1.6 %). Measured (both sides are symbolic, so exact from run to run): GPT-2 -1.570 % (selective:pointwise: the
# known gap, 128 KiB = one 8 x 64 x 64 fp32 activation unpriced), BERT +0.150 %, T5 and Llama 0. An
# under-prediction lets a plan break its budget: no more than the known gap is allowed on that side.
TRACED_UNDER = 0.016
TRACED_OVER = 0.002


def _meta(preset: str):
    model = build_model(preset, device="meta")
    model.eval()
    return model


def _cpu_plan_kwargs(n: int = 1, **kw):
    return dict(num_devices=n, device="cpu", **kw)


def _free_peak(model, batch, n: int = 1, **kw) -> int:
    return plan_model(
        model, batch, memory_budget=1 << 40, recompute="none", **_cpu_plan_kwargs(n, **kw)
    ).peak_memory_bytes


def _reference_batch_and_plan(preset: str):
    """A CPU model in eval mode (seeded), a 2 x 16 batch and a one-device plan recomputing every block in full
    (whose ``recompute`` the runtime checks overwrite)."""
    torch.manual_seed(0)
    reference = build_model(preset, device="cpu")
    reference.eval()
    batch = make_example_inputs(reference, 2, 16, seed=0)
    plan = plan_model(_meta(preset), batch, memory_budget=1 << 40, recompute="full", **_cpu_plan_kwargs())
    return reference, batch, plan


def test_op_classes_and_options_round_trip():
    assert op_class("aten.addmm.default") == MATMUL
    assert op_class("aten._scaled_dot_product_flash_attention_for_cpu.default") == ATTENTION
    assert op_class("aten.gelu.default") == POINTWISE
    for option in (NO_RECOMPUTE, FULL_RECOMPUTE, selective([ATTENTION, POINTWISE])):
        assert parse_option(option.name) == option
    assert selective([ATTENTION, POINTWISE]).name == "selective:pointwise+attention"
    with pytest.raises(ValueError, match="unknown op classes"):
        parse_option("selective:convolutions")
    with pytest.raises(ValueError, match="unknown recompute option"):
        parse_option("half")
    twin = selective([POINTWISE], ["mlp.down_proj", "self_attn.o_proj"])
    assert twin.name == "selective:pointwise;rerun=mlp.down_proj,self_attn.o_proj"
    assert parse_option("selective:pointwise;rerun=self_attn.o_proj,mlp.down_proj") == twin
    with pytest.raises(ValueError, match="no module after"):
        parse_option("selective:pointwise;rerun=")


def test_the_rerun_twins_name_the_projections_whose_kept_outputs_no_backward_reads():
    """Each selective level comes with a ``;rerun=`` twin naming the leaf modules whose every kept output is read
    by no backward: a sub-layer's last projection (its output goes to the residual add), the projections
    feeding rotary embeddings (the position tables' multiplications save the tables only) or split into heads
    before a recomputed attention; never one whose output a kept op saves (v_proj before a kept attention
    kernel, gate / up before the activation)."""
    from hf_colossal_auto.solve.candidates import _Planner

    # (named, never named): GPT-2's c_attn output is what its attention kernel saves (q, k, v are views of it)
    want = {
        "tiny-llama": ({"mlp.down_proj", "self_attn.k_proj", "self_attn.o_proj", "self_attn.q_proj"},
                       {"self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"}),
        "tiny-gpt2": ({"attn.c_proj", "mlp.c_proj"}, {"attn.c_attn", "mlp.c_fc"}),
    }  # fmt: skip
    for preset, (named, never) in want.items():
        model = _meta(preset)
        inputs = make_example_inputs(model, 4, 32, device="meta")
        planner = _Planner.for_devices(model, inputs, 1, "cpu", 1, 1 << 40, None, "adamw", 60.0)
        built = planner.build((1, 1), "ddp", budget=1 << 40)
        for options in built.recompute_options.values():
            names = [o.name for o in options]
            levels = [o for o in options if o.name.startswith("selective") and not o.rerun_modules]
            assert levels, (preset, names)
            for level in levels:
                twin = options[options.index(level) + 1]
                assert twin.recomputed == level.recomputed, (preset, names)
                if POINTWISE in level.recomputed:
                    assert twin.rerun_modules == named, (preset, names)
                assert named <= twin.rerun_modules and not twin.rerun_modules & never, (preset, names)


def test_one_decision_per_block_and_nested_lists_go_with_their_block():
    """T5's blocks hold a ModuleList of sub-layers: the unit is the block; what the next block reads is kept."""
    model = _meta("tiny-t5")
    graph = trace_training_step(model, make_example_inputs(model, 2, 16))
    units = find_units(graph, {n.index: n.index for n in graph.nodes}, _module_list_children(model))
    assert [u.name for u in units] == [
        "encoder.block.0",
        "encoder.block.1",
        "decoder.block.0",
        "decoder.block.1",
    ]
    for unit in units:
        assert unit.escaping, unit.name  # the residual stream leaves every block
        assert unit.escaping < set(unit.nodes)


def test_a_folded_run_is_one_decision_for_all_its_blocks():
    config = load_config("tiny-gpt2")
    config.n_layer = 7  # >= 5 identical blocks: traced once, replayed
    model = build_model(config, device="meta")
    batch = make_example_inputs(model, 8, 64)
    budget = int(_free_peak(model, batch) * 0.6)
    # one piece: micro-batches can meet the budget as well, and this test is about recompute
    plan = plan_model(model, batch, memory_budget=budget, micro_batches=1, **_cpu_plan_kwargs())
    assert sorted(plan.recompute) == [f"transformer.h.{i}" for i in range(7)]
    assert len(set(plan.recompute.values())) == 1 and plan.recompute["transformer.h.0"] != "none"
    assert plan.peak_memory_bytes <= budget


@pytest.mark.parametrize("fraction", [0.75, 0.65])
def test_joint_plan_beats_two_stage_and_full_recompute(fraction):
    """At the same budget the joint ILP is never predicted slower than sharding first and recomputing after,
    nor than checkpointing every block; the budget forces recompute."""
    model = _meta("tiny-gpt2")
    batch = make_example_inputs(model, 8, 64)
    kw = _cpu_plan_kwargs(2, mesh_shape=(1, 2))
    budget = int(_free_peak(model, batch, 2, mesh_shape=(1, 2)) * fraction)
    joint = plan_model(model, batch, memory_budget=budget, **kw)
    two_stage = plan_model(model, batch, memory_budget=budget, recompute="two-stage", **kw)
    full = plan_model(model, batch, memory_budget=budget, recompute="full", **kw)
    assert joint.peak_memory_bytes <= budget
    assert any(v != "none" for v in joint.recompute.values())
    assert joint.step_time_s <= two_stage.step_time_s * (1 + 1e-9)
    assert joint.step_time_s <= full.step_time_s * (1 + 1e-9)
    assert set(full.recompute.values()) == {"full"}
    assert "recompute" in joint.summary()


def test_a_budget_below_any_plan_states_the_minimum():
    model = _meta("tiny-llama")
    batch = make_example_inputs(model, 8, 64)
    with pytest.raises(InfeasibleError, match="smallest per-device memory any plan needs") as caught:
        plan_model(model, batch, memory_budget=1 << 20, **_cpu_plan_kwargs())
    minimum = caught.value.min_required
    assert minimum > 1 << 20
    plan = plan_model(model, batch, memory_budget=int(minimum * 1.001) + 1, **_cpu_plan_kwargs())
    # every block recomputes at the minimum (in full, or selectively rerunning its unread projections where
    # that fits as well and reruns less)
    assert plan.fits and "none" not in plan.recompute.values()


@pytest.mark.parametrize("preset", FAMILIES)
def test_predicted_peak_matches_the_traced_recompute(preset):
    """The plan's peak against the profiler's peak of the same model with the plan's recompute applied (the
    tracer runs the checkpointed backward symbolically)."""
    model = _meta(preset)
    batch = make_example_inputs(model, 8, 64)
    budget = int(_free_peak(model, batch) * 0.7)
    plan = plan_model(model, batch, memory_budget=budget, **_cpu_plan_kwargs())
    assert any(v != "none" for v in plan.recompute.values())
    recomputing = _meta(preset)
    apply_recompute(recomputing, plan)
    traced = memory_profile(trace_training_step(recomputing, batch, device_kind="cpu")).peak_bytes
    error = plan.peak_memory_bytes / traced - 1
    options = sorted(set(plan.recompute.values()))
    message = f"{preset} {options}: predicted {plan.peak_memory_bytes} B, traced {traced} B ({error:+.4%})"
    assert -TRACED_UNDER <= error <= TRACED_OVER, message


@pytest.mark.parametrize(
    ("preset", "option"),
    [
        ("tiny-llama", "selective:pointwise;rerun=mlp.down_proj,self_attn.o_proj"),
        ("tiny-llama", "selective:pointwise+attention;rerun=mlp.down_proj,self_attn.k_proj,self_attn.o_proj,self_attn.q_proj"),
        ("tiny-gpt2", "selective:pointwise;rerun=attn.c_proj,mlp.c_proj"),
    ],
)  # fmt: skip
def test_the_predicted_peak_of_a_rerun_twin_matches_its_trace(preset, option):
    """A ``;rerun=`` option on every block, priced (:func:`evaluate_plan`) against the profiler's peak of the model
    with that option applied (the tracer runs the checkpointed backward, its early stop included)."""
    from hf_colossal_auto.solve.planner import evaluate_plan

    model = _meta(preset)
    batch = make_example_inputs(model, 8, 64)
    plan = plan_model(model, batch, memory_budget=1 << 40, recompute="full", **_cpu_plan_kwargs())
    plan.recompute = dict.fromkeys(plan.recompute, option)
    predicted = evaluate_plan(
        model, batch, plan, memory_budget=1 << 40, **_cpu_plan_kwargs()
    ).peak_memory_bytes
    recomputing = _meta(preset)
    apply_recompute(recomputing, plan)
    traced = memory_profile(trace_training_step(recomputing, batch, device_kind="cpu")).peak_bytes
    error = predicted / traced - 1
    assert -TRACED_UNDER <= error <= TRACED_OVER, (
        f"{preset} {option}: predicted {predicted} B, traced {traced} B"
    )


@pytest.mark.parametrize("preset", FAMILIES)
def test_recomputing_blocks_changes_no_loss_or_gradient(preset):
    reference, batch, plan = _reference_batch_and_plan(preset)
    blocks = sorted(plan.recompute)
    ref_loss = reference(**batch).loss
    ref_loss.backward()
    for option in ("full", "selective:pointwise", "selective:pointwise+attention"):
        model = copy.deepcopy(reference)
        model.zero_grad(set_to_none=True)
        plan.recompute = {b: option if i % 2 == 0 else "full" for i, b in enumerate(blocks)}
        assert apply_recompute(model, plan)
        loss = model(**batch).loss
        loss.backward()
        assert torch.equal(loss, ref_loss), option
        for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
            if q.grad is not None:
                torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-6, msg=f"{option}: {name}")


class _OpsAndStorages(TorchDispatchMode):
    """Counts the aten ops that run under it and remembers, weakly, every storage they return: after a forward,
    the storages still alive are what the step holds for backward (autograd's saved tensors and a selective
    policy's cache alike, which ``saved_tensors_hooks`` would not see inside a checkpoint)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[OpOverload] = Counter()
        self.storages: dict[int, tuple[StorageWeakRef, int, OpOverload]] = {}

    def __torch_dispatch__(
        self, func: OpOverload, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        self.ops[func] += 1
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                self.storages.setdefault(storage._cdata, (StorageWeakRef(storage), storage.nbytes(), func))
        return out

    def held_bytes(self, classes: frozenset[str] = frozenset(CLASSES)) -> int:
        """Bytes of the storages made by ops of ``classes`` that are still alive."""
        return sum(
            n
            for ref, n, func in self.storages.values()
            if not ref.expired() and op_class(str(func)) in classes
        )


def _step(model: torch.nn.Module, batch: dict) -> tuple[_OpsAndStorages, Counter[OpOverload], torch.Tensor]:
    """One forward (recorded) and its backward (ops counted); the recorded forward is read before backward."""
    with _OpsAndStorages() as forward:
        loss = model(**batch).loss
    held = forward.held_bytes(), forward.held_bytes(frozenset({ATTENTION}))
    with _OpsAndStorages() as backward:
        loss.backward()
    return held, backward.ops, loss.detach()


@pytest.mark.parametrize("preset", ["tiny-gpt2", "tiny-llama"])
def test_recompute_frees_activations_and_reruns_only_the_chosen_op_classes(preset):
    """Loss and gradients alone would not notice an ``apply_recompute`` that did nothing. For full recompute and
    every selective policy the planner can emit (pointwise and attention are its levels, matmuls are only
    rerun by ``full``), with every block recomputing: (a) less is held for backward at the end of forward, and
    (b) backward runs forward ops again: under ``full`` ops of every class, under a selective policy allocating
    ops of exactly the chosen classes (views of kept outputs are rerun too: they allocate nothing, and keeping
    one would pin its base)."""
    reference, batch, plan = _reference_batch_and_plan(preset)
    (none_held, none_attention), none_backward, ref_loss = _step(copy.deepcopy(reference), batch)
    assert none_attention > 0  # the attention outputs are saved without recompute
    held = {}
    for option in ("full", "selective:pointwise", "selective:attention", "selective:pointwise+attention"):
        model = copy.deepcopy(reference)
        plan.recompute = dict.fromkeys(plan.recompute, option)
        assert apply_recompute(model, plan) == plan.recompute
        (held[option], attention_held), backward, loss = _step(model, batch)
        assert torch.equal(loss, ref_loss), option
        # Backward itself is unchanged; what it runs in addition is the recompute (checkpoint's own detaches
        # of the recomputed tensors aside).
        assert not none_backward - backward, option
        rerun = backward - none_backward
        del rerun[torch.ops.aten.detach.default]
        classes = {op_class(str(op)) for op in rerun if not op.is_view}
        recomputed = parse_option(option).recomputed
        assert classes == set(recomputed), (option, rerun)
        assert all(op_class(str(op)) in recomputed or op.is_view for op in rerun), (option, rerun)
        if ATTENTION in recomputed:
            # the attention kernel's outputs (its result, its logsumexp) are not held until backward
            assert attention_held == 0, (option, attention_held)
    # A selective policy caches every kept op's output whether autograd needs it or not (as the planner prices
    # it): recomputing the attention kernel alone holds more than no recompute at these sizes (it frees only
    # its outputs, checked above), so the planner only picks it where that pays; the others hold less.
    for option in ("full", "selective:pointwise", "selective:pointwise+attention"):
        assert held[option] < none_held, (option, held[option], none_held)
    assert held["full"] < min(v for k, v in held.items() if k != "full"), held


@pytest.mark.parametrize(
    ("preset", "last", "earlier", "matmul"),
    [
        ("tiny-llama", "mlp.down_proj", "self_attn.o_proj", torch.ops.aten.mm.default),
        ("tiny-gpt2", "mlp.c_proj", "attn.c_proj", torch.ops.aten.addmm.default),
    ],
)
def test_rerun_modules_keep_nothing_and_rerun_only_what_the_backward_needs(preset, last, earlier, matmul):
    """``;rerun=`` on top of a selective policy: each named module's output (``2 x 16 x 64`` fp32 here) is no
    longer held at the end of forward, the loss and gradients are unchanged, and backward reruns the matmul of
    the module before the block's last saved tensor (the attention's output projection: the norm and the MLP
    after it are replayed) and not that of the block's last projection (the replay stops once every saved tensor
    is back, before it), as the planner prices them (:attr:`RecomputeUnit.last_saved`)."""
    reference, batch, plan = _reference_batch_and_plan(preset)
    blocks = len(plan.recompute)
    output_bytes = 2 * 16 * reference.config.hidden_size * 4
    _, none_backward, ref_loss = _step(copy.deepcopy(reference), batch)
    ref_grads = None
    held, reruns = {}, {}
    for modules in ((), (last,), (last, earlier)):
        option = selective([POINTWISE], modules).name
        model = copy.deepcopy(reference)
        plan.recompute = dict.fromkeys(plan.recompute, option)
        apply_recompute(model, plan)
        (held[modules], _), backward, loss = _step(model, batch)
        assert torch.equal(loss, ref_loss), option
        grads = [p.grad for p in model.parameters()]
        if ref_grads is None:
            ref_grads = grads
        assert all(torch.equal(g, r) for g, r in zip(grads, ref_grads, strict=True)), option
        reruns[modules] = (backward - none_backward)[matmul]
    assert held[()] - held[(last,)] == blocks * output_bytes, held
    assert held[(last,)] - held[(last, earlier)] == blocks * output_bytes, held
    assert reruns[()] == reruns[(last,)] == 0 and reruns[(last, earlier)] == blocks, reruns


def test_a_rerun_twin_with_dropout_on_gives_the_loss_and_gradients_without_recompute():
    """GPT-2 in train mode (dropout 0.1 in attention and MLP): the twin's reruns replay the same masks
    (checkpoint restores the RNG state), so loss and gradients are those of the same step without recompute."""
    torch.manual_seed(0)
    reference = build_model("tiny-gpt2", device="cpu")
    reference.train()
    batch = make_example_inputs(reference, 2, 16, seed=0)
    plan = plan_model(
        _meta("tiny-gpt2"), batch, memory_budget=1 << 40, recompute="full", **_cpu_plan_kwargs()
    )
    results = []
    for option in ("none", "selective:pointwise;rerun=attn.c_proj,mlp.c_proj"):
        model = copy.deepcopy(reference)
        plan.recompute = dict.fromkeys(plan.recompute, option)
        apply_recompute(model, plan)
        torch.manual_seed(1)
        loss = model(**batch).loss
        loss.backward()
        results.append((loss.detach(), [p.grad for p in model.parameters()]))
    (loss, grads), (twin_loss, twin_grads) = results
    assert torch.equal(twin_loss, loss)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(twin_grads, grads, strict=True))


def test_the_summary_shows_a_rerun_twin_by_its_modules_short_names():
    plan = plan_model(_meta("tiny-llama"), make_example_inputs(_meta("tiny-llama"), 2, 16), memory_budget=1 << 40,
                      recompute="full", **_cpu_plan_kwargs())  # fmt: skip
    for block in plan.blocks:
        if block.recompute == "full":
            block.recompute = "selective:pointwise;rerun=mlp.down_proj,self_attn.o_proj"
    assert "pointwise (rerun down_proj, o_proj)" in plan.summary()


class _WeightCasts(TorchDispatchMode):
    """Remembers, weakly, every bf16 copy ``_to_copy`` makes of a tensor shaped like one of ``shapes``."""

    def __init__(self, shapes: set[tuple[int, ...]]) -> None:
        super().__init__()
        self.shapes = shapes
        self.casts: list[weakref.ref] = []

    def __torch_dispatch__(
        self, func: OpOverload, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        bf16_copy = func is torch.ops.aten._to_copy.default and out.dtype == torch.bfloat16
        if bf16_copy and tuple(out.shape) in self.shapes:
            self.casts.append(weakref.ref(out))
        return out

    def alive(self) -> int:
        return sum(ref() is not None for ref in self.casts)


@pytest.mark.parametrize("option", ["full", "selective:pointwise"])
def test_a_recomputed_block_holds_no_autocast_weight_copy_to_the_end_of_forward(option):
    """Under ``torch.autocast`` torch caches each fp32 parameter's bf16 cast until the outermost autocast exits
    (after the whole forward; a pipeline runs its whole schedule inside it): a recomputed block kept every
    weight's copy to that point, where the planner prices it keeping its inputs (full) or its kept outputs
    (selective) only. The runtime runs recomputed blocks without that cache: at the end of forward, still inside
    autocast, no copy of a recomputed block's weights is alive (every one was made), and the loss and gradients
    equal the same blocks run without recompute under the same autocast."""
    torch.manual_seed(0)
    reference = build_model("tiny-llama", device="cpu")
    batch = make_example_inputs(reference, 2, 16, seed=0)
    plan = plan_model(
        _meta("tiny-llama"), batch, memory_budget=1 << 40, recompute="full", **_cpu_plan_kwargs()
    )
    plan.recompute = dict.fromkeys(plan.recompute, option)
    model = copy.deepcopy(reference)
    assert apply_recompute(model, plan) == plan.recompute
    blocks = tuple(f"{b}." for b in plan.recompute)
    shapes = {tuple(p.shape) for n, p in model.named_parameters() if n.startswith(blocks) and p.dim() == 2}
    assert shapes
    results = []
    for m in (reference, model):
        casts = _WeightCasts(shapes)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            with casts:
                loss = m(**batch).loss
            made, alive = len(casts.casts), casts.alive()
        loss.backward()
        results.append((made, alive, loss.detach(), {n: p.grad for n, p in m.named_parameters()}))
    (_, kept_without_recompute, ref_loss, ref_grads), (made, alive, loss, grads) = results
    assert kept_without_recompute > 0  # saved for backward without recompute: the copies exist to be freed
    assert made >= kept_without_recompute and alive == 0, (option, made, alive)
    assert torch.equal(loss, ref_loss)
    for name, grad in ref_grads.items():
        if grad is not None:
            torch.testing.assert_close(grads[name], grad, rtol=0, atol=0, msg=name)


def test_hf_gradient_checkpointing_yields_to_the_plan(caplog):
    model = build_model("tiny-llama", device="cpu")
    model.train()
    model.gradient_checkpointing_enable()
    batch = make_example_inputs(model, 2, 16)
    plan = plan_model(
        _meta("tiny-llama"), batch, memory_budget=1 << 40, recompute="full", **_cpu_plan_kwargs()
    )
    with caplog.at_level(logging.WARNING):
        apply_recompute(model, plan)
        model.gradient_checkpointing_enable()
    assert not model.is_activation_checkpointing
    assert "gradient_checkpointing_enable() ignored" in caplog.text
    model(**batch).loss.backward()  # still trains, with the plan's recompute


# Bounds on predicted / measured - 1 per rank. Measured (same on both ranks, 2026-12-07, after the check's
# rows became copies: a view of the global batch had kept its whole storage, 6,144 B more at every peak of Llama
# 2 x 1): Llama 2 x 1 +0.0001 % (its plan: full, and the pointwise+attention level rerunning its unread
# projections). An under-prediction is what would break a budget: 0.1 % allowed there. Open gap (2026-12-02,
# docs/reliability.md): GPT-2 1 x 2 over-predicts by +9.137 % (measured 4,797,056 B, predicted 5,235,381 B): its
# moments price the loss's and the MLP's gradients in flight unsharded, which also covers two copies the model
# misses (the head's gathered input, the output logits gathered for the caller at the end of forward); pricing
# the transient sharded alone would under-predict by ~6 %. Its bound is that figure, named; it must come back
# down, never grow.
RANKS_UNDER = 1e-3
# case (model:mesh:dp_mode:budget fraction) -> the most the prediction may be over the measured peak
TWO_RANK_CASES = {"tiny-gpt2:1x2:ddp:0.6": 0.092, "tiny-llama:2x1:ddp:0.7": 0.001}


@pytest.fixture(scope="module")
def two_rank_results(tmp_path_factory) -> dict[str, list[dict]]:
    """Every two-rank case in one torchrun launch (check_recompute runs them one after the other): starting
    two processes and importing torch costs more than a tiny case, so the cases share it. Case -> per-rank
    results."""
    out = tmp_path_factory.mktemp("recompute") / "result"
    cases = [arg for case in TWO_RANK_CASES for arg in ("--case", case)]
    run_torchrun(str(ROOT / "tests/multiproc/check_recompute.py"), *cases, f"--out={out}", timeout=600)
    ranks = [json.loads(Path(f"{out}.rank{r}").read_text()) for r in range(2)]
    return {case: [rank[i] for rank in ranks] for i, case in enumerate(TWO_RANK_CASES)}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(TWO_RANK_CASES))
def test_measured_peak_on_two_ranks_stays_under_the_budget(case, two_rank_results):
    """A budget below the no-recompute peak: the plan recomputes, every rank's measured peak (MemTracker, real
    tensors, steady-state step) stays under the budget, the prediction is at most ``RANKS_UNDER`` under it
    and the case's bound over it, and loss and gradients equal the single-process model's."""
    max_over = TWO_RANK_CASES[case]
    results = two_rank_results[case]
    assert [r["rank"] for r in results] == [0, 1]
    for r in results:
        assert r["case"] == case
        assert r["mesh"] == [int(x) for x in case.split(":")[1].split("x")], r
        assert any(v != "none" for v in r["recompute"].values()), r
        assert r["measured_peak"] <= r["budget"], r
        error = r["predicted_peak"] / r["measured_peak"] - 1
        assert -RANKS_UNDER <= error <= max_over, (f"{error:+.4%}", r)
        assert abs(r["loss"] - r["ref_loss"]) <= 1e-5, r
        assert r["max_grad_err"] <= 1e-5, r


def _block(dropout: float = 0.0) -> torch.nn.Sequential:
    """A small block (seeded): two linears around a GELU, dropout after it when ``dropout`` (train mode)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Dropout(dropout), torch.nn.Linear(8, 8)
    )


def _split_backward(block: torch.nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    """One forward of ``block`` and its backward as torch's zero-bubble schedules run it: the input pass
    (``stage_backward_input``, the graph retained), then the weight pass (``stage_backward_weight``, one
    ``autograd.grad`` per parameter group: here one per linear). Returns the output, the input's gradient and
    the parameters' gradients."""
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

    out = block(x)
    _, groups = stage_backward_input([out], [torch.ones_like(out)], [x], block.parameters())
    assert len(groups) == 2
    stage_backward_weight(block.parameters(), groups)
    return [out.detach(), x.grad, *(p.grad for p in block.parameters())]


def _checkpointed(block: torch.nn.Module, option: str | None, passes: int) -> torch.nn.Module:
    from hf_colossal_auto.apply.recompute import checkpoint_module

    if option is not None:
        checkpoint_module(block, parse_option(option), passes, "the block")
    return block


SPLIT_OPTIONS = ["full", "selective:pointwise", "selective:pointwise;rerun=0"]
"""Full, selective, and selective rerunning the first linear too (its twin)."""


@pytest.mark.parametrize("option", SPLIT_OPTIONS)
def test_a_checkpointed_block_reruns_once_for_both_passes_of_a_split_backward(option):
    """Under the zero-bubble schedules (``plan.SPLIT_BACKWARD_SCHEDULES``) torch runs a stage's backward as an
    input-gradient pass and a later weight-gradient pass over the retained graph (``torch.distributed.
    pipelining``'s own two functions, called here as its schedules call them). The runtime's checkpoint
    (``passes=2``: :func:`~hf_colossal_auto.apply.shared_rerun.checkpoint_with_shared_rerun`) reruns the block
    once for both, with the gradients of the block run without checkpoint. torch's own (``passes=1``) reruns it
    in the input pass and again in each ``autograd.grad`` of the weight pass (one per parameter group), and its
    selective cache serves one pass only (the second to read a kept output raises): if torch changes that, this
    fails and the shared rerun may no longer be needed."""
    runs: list[int] = []

    def step(option: str | None, passes: int) -> list[torch.Tensor]:
        block = _checkpointed(_block(), option, passes)
        block[0].register_forward_pre_hook(lambda *_: runs.append(1))
        torch.manual_seed(1)
        return _split_backward(block, torch.randn(4, 8, requires_grad=True))

    reference = step(None, 1)
    runs.clear()
    shared = step(option, 2)
    assert len(runs) == 2, runs  # the forward and one rerun
    for got, want in zip(shared, reference, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    runs.clear()
    if option == "selective:pointwise":  # the first linear's kept output is read by the rerun of each pass
        with pytest.raises(RuntimeError, match="backward an extra time"):
            step(option, 1)
    else:  # the twin reruns that linear: no kept output is read before its reruns stop
        step(option, 1)  # torch: the forward, a rerun in the input pass and one per parameter group
        assert len(runs) == 4, runs


@pytest.mark.parametrize("option", SPLIT_OPTIONS)
def test_the_shared_rerun_replays_the_forwards_dropout(option):
    """A block with dropout in train mode: the rerun restores the forward's RNG state, so the output and every
    gradient of a split backward are bitwise those of the block without checkpoint at the same seed, and the
    caller's RNG state after the step is the same too (the rerun forks it)."""
    results = []
    for name in (None, option):
        block = _checkpointed(_block(dropout=0.5), name, 2).train()
        torch.manual_seed(1)
        x = torch.randn(4, 8, requires_grad=True)
        results.append((_split_backward(block, x), torch.get_rng_state()))
    (reference, reference_rng), (shared, rng) = results
    block = _block(dropout=0.5).eval()
    torch.manual_seed(1)
    with torch.no_grad():  # dropout dropped something
        assert not torch.equal(reference[0], block(torch.randn(4, 8)))
    for got, want in zip(shared, reference, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert torch.equal(rng, reference_rng)


@pytest.mark.parametrize("option", SPLIT_OPTIONS)
def test_the_rerun_tensors_live_from_the_input_pass_to_the_weight_pass(option):
    """What the pipeline pricing holds from a micro-batch's I action to its W action: the tensors the rerun
    rematerialises (the first linear's output, the GELU's: new storages of the block's forward ops) are made in
    the input pass, are alive when it ends, and are freed once the weight pass has run. torch's checkpoint
    frees them inside the input pass (and reruns in the weight pass)."""
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

    forward_ops = {torch.ops.aten.addmm.default, torch.ops.aten.gelu.default}

    def alive(ops: _OpsAndStorages) -> int:
        return sum(not ref.expired() for ref, _, func in ops.storages.values() if func in forward_ops)

    counts = {}
    for passes in (2, 1):
        block = _checkpointed(_block(), option, passes)
        recorded = _OpsAndStorages()
        x = torch.randn(4, 8, requires_grad=True)
        out = block(x)
        with recorded:
            _, groups = stage_backward_input([out], [torch.ones_like(out)], [x], block.parameters())
        counts[passes] = alive(recorded)
        if passes == 2:
            stage_backward_weight(block.parameters(), groups)
            assert alive(recorded) == 0, option
    rematerialised = 1 if option == "selective:pointwise" else 2  # the kept addmm output is not a new storage
    assert counts == {2: rematerialised, 1: 0}, counts


@pytest.mark.parametrize("option", ["full", "selective:pointwise"])
def test_the_shared_rerun_runs_under_the_forwards_autocast(option):
    """Under CPU bf16 autocast the shared rerun (split backward) gives the gradients of torch's checkpoint (one
    backward): the rerun casts as the forward did (autocast restored, its weight-cast cache off as the runtime
    runs recomputed blocks)."""
    results = []
    for passes in (1, 2):
        block = _checkpointed(_block(), option, passes)
        torch.manual_seed(1)
        x = torch.randn(4, 8, requires_grad=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            if passes == 2:
                results.append(_split_backward(block, x))
                continue
            out = block(x)
        out.backward(torch.ones_like(out))
        results.append([out.detach(), x.grad, *(p.grad for p in block.parameters())])
    assert results[0][0].dtype == torch.bfloat16
    for got, want in zip(results[1], results[0], strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def _saves_fewer(rerun: list[bool], x: torch.Tensor) -> torch.Tensor:
    return x.sin() * 2 if rerun else x.sin().cos()  # the forward saves x and sin(x), the rerun x only


def _saves_more(rerun: list[bool], x: torch.Tensor) -> torch.Tensor:
    y = x.sin()
    try:  # a fallback that swallows the rerun's stop at its last saved tensor
        z = y.cos()
    except Exception:
        z = y.tan()
    return z * 2


def _saves_another_dtype(rerun: list[bool], x: torch.Tensor) -> torch.Tensor:
    return (x.double() if rerun else x).sin()


def _backward_inside_forward(rerun: list[bool], x: torch.Tensor) -> torch.Tensor:
    y = x.sin()
    (grad,) = torch.autograd.grad(y.sum(), x, retain_graph=True)
    return y * grad


@pytest.mark.parametrize(
    ("fn", "message"),
    [
        (_saves_fewer, "saved 1 tensors for backward where its forward saved 2"),
        (_saves_more, "saved more tensors for backward than its forward"),
        (_saves_another_dtype, "torch.float64"),
        (_backward_inside_forward, "before its forward finished"),
    ],
)
def test_a_rerun_that_does_not_save_what_the_forward_saved_is_refused_by_name(fn, message):
    """As torch's checkpoint guards its rerun: a rerun that saves fewer tensors than the forward, more (a block
    whose fallback swallows the rerun's stop), one of another dtype (or shape, or device), or a backward over the block
    inside its own forward raise, naming the block, instead of training on the wrong tensors."""
    from hf_colossal_auto.apply.shared_rerun import SharedRerunError, checkpoint_with_shared_rerun

    rerun: list[bool] = []
    x = torch.randn(4, requires_grad=True)
    with pytest.raises(SharedRerunError, match=f"the block.*{message}"):
        out = checkpoint_with_shared_rerun(fn, rerun, x, region_name="the block")
        rerun.append(True)
        out.sum().backward()
