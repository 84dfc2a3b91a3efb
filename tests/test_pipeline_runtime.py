"""Pipeline stages: the Plan's pipeline fields, the model's cut, the stage modules, and (one torchrun launch
on 2 gloo ranks) every schedule training like one process."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from hf_colossal_auto.apply.pipeline import (
    PipelineRuntimeError,
    StageModule,
    _split_batch,
    check_pipeline_plan,
)
from hf_colossal_auto.models import build_model, load_config, make_example_inputs
from hf_colossal_auto.pipeline_layout import PipelineLayoutError, find_layout, hand_pipeline_plan
from hf_colossal_auto.plan import PIPELINE_FIELDS, PIPELINE_SCHEDULES, PipelinePlanError, Plan

ROOT = Path(__file__).resolve().parents[1]


def _llama(layers: int = 6, device: str = "meta"):
    config = load_config("tiny-llama")
    config.num_hidden_layers = layers
    torch.manual_seed(0)
    return build_model(config, device=device)


def _plan(**changes) -> Plan:
    model = _llama()
    plan = hand_pipeline_plan(
        model, make_example_inputs(model, 8, 16, device="meta"), pp_size=2, schedule="1f1b", micro_batches=4
    )
    return dataclasses.replace(plan, **changes) if changes else plan


# --------------------------------------------------------------------------------------------- the contract
def test_pipeline_plan_round_trips_through_json():
    plan = _plan()
    again = Plan.from_dict(json.loads(plan.to_json()))
    assert again == plan
    assert again.pp_size == 2 and again.schedule == "1f1b" and again.micro_batches == 4
    assert again.stages[0][0] == "model.embed_tokens" and again.stages[-1][-2:] == ["model.norm", "lm_head"]
    assert again.stage_ranks() == [0, 1]
    assert "pipeline" in again.summary() and "schedule 1f1b" in again.summary()


def test_plan_without_pipeline_writes_and_reads_as_before():
    """A plan written before the pipeline fields existed (none of them in its JSON) loads as pp_size 1, and a
    plan without a pipeline writes none of them (golden plans keep their hashes)."""
    plan = _plan()
    plain = dataclasses.replace(
        plan, mesh_shape=(2, 1), mesh_axis_names=("dp", "tp"), pp_size=1, stages=[], schedule="", micro_batches=1,
        param_placements={k: ["R", "R"] for k in plan.param_placements},
    )  # fmt: skip
    data = plain.to_dict()
    assert not set(PIPELINE_FIELDS) & set(data)
    # sequence parallelism's field and context parallelism's degree (at 1), absent from older plans too
    omitted_when_empty = {
        "block_input_placements", "cp_size", "hand_layout", "local_modules", "sequence_sharded_sends",
    }  # fmt: skip
    assert set(data) == {f.name for f in dataclasses.fields(Plan)} - set(PIPELINE_FIELDS) - omitted_when_empty
    old = Plan.from_dict(json.loads(json.dumps(data)))
    assert old.pp_size == 1 and old.stages == [] and old.schedule == "" and old.num_stages == 1


def test_stage_ranks_follow_torchs_placement():
    assert _plan(schedule="interleaved-1f1b", virtual_stages=2, stages=_llama_cut(4)).stage_ranks() == [
        0,
        1,
        0,
        1,
    ]
    assert _plan(schedule="zbv", virtual_stages=2, stages=_llama_cut(4)).stage_ranks() == [0, 1, 1, 0]


def _llama_cut(stages: int) -> list[list[str]]:
    return find_layout(_llama()).even_cut(stages)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"schedule": "pipedream"}, "unknown pipeline schedule 'pipedream'"),
        ({"micro_batches": 1}, "micro_batches >= 2"),
        ({"num_devices": 3, "mesh_shape": (3, 1, 1)}, "pp_size 2 does not divide the 3 devices"),
        ({"mesh_shape": (1, 2, 1), "mesh_axis_names": ("dp", "pp", "tp")}, "leading axis 'pp'"),
        ({"stages": _llama_cut(3)}, "make 2 stages, the plan lists 3"),
        ({"virtual_stages": 2, "stages": _llama_cut(4), "micro_batches": 4}, "runs exactly 1 stage"),
        ({"schedule": "zbv", "virtual_stages": 3, "stages": _llama_cut(6), "micro_batches": 6}, "exactly 2"),
        ({"stages": [["model.embed_tokens", "model.layers.0"], ["model.layers.0", "lm_head"]]}, "in stages 0 and 1"),
        ({"stages": [["model.embed_tokens"], []]}, "must list the FQNs"),
        (
            {"schedule": "interleaved-1f1b", "virtual_stages": 2, "stages": _llama_cut(4), "micro_batches": 5},
            "do not split into 2 equal rounds",
        ),
        ({"pp_size": 1}, "a plan with pp_size 1 has none"),
        ({"sequence_sharded_sends": True}, "has no tensor parallelism"),
        (
            {"pp_size": 1, "stages": [], "schedule": "", "mesh_shape": (2, 1), "mesh_axis_names": ("dp", "tp"),
             "sequence_sharded_sends": True},
            "a plan with pp_size 1 has no stages",
        ),
    ],
)  # fmt: skip
def test_pipeline_fields_that_cannot_run_are_refused(changes, message):
    data = {**_plan().to_dict(), **changes}
    with pytest.raises(PipelinePlanError, match=message.replace("(", r"\(").replace(")", r"\)")):
        Plan.from_dict(data)


# --------------------------------------------------------------------------------------------- the cut
def test_layout_reads_the_models_own_structure():
    layout = find_layout(_llama())
    assert (layout.blocks, layout.num_blocks, layout.before, layout.after) == (
        "model.layers",
        6,
        ("model.embed_tokens",),
        ("model.norm", "lm_head"),
    )
    assert layout.shared == ("model.rotary_emb",)
    gpt2 = find_layout(build_model("tiny-gpt2"))
    assert gpt2.before == ("transformer.wte", "transformer.wpe") and gpt2.dropouts == ("transformer.drop",)
    assert [len(s) for s in layout.stage_modules([1, 5])] == [2, 7]


@pytest.mark.parametrize(
    ("stages", "message"),
    [
        ([["model.embed_tokens", "model.layers.0"], ["model.layers.2", "model.norm", "lm_head"]], "start at block 1"),
        ([["model.embed_tokens", "model.layers.0", "model.layers.1"], ["model.layers.2", "lm_head"]], "in no stage"),
        ([["model.layers.0", "model.layers.1"], ["model.embed_tokens", "model.layers.2", "model.norm", "lm_head"]],
         "belongs to stage 0"),
        ([["model.embed_tokens", "model.layers.0.mlp"], ["model.layers.1", "model.norm", "lm_head"]],
         "cut at whole blocks"),
        ([["model.embed_tokens", "model.layers.1"], ["model.layers.0", "model.norm", "lm_head"]], "start at block 0"),
    ],
)  # fmt: skip
def test_stages_that_do_not_cut_the_model_at_blocks_are_refused(stages, message):
    layout = find_layout(_llama(3))
    with pytest.raises(PipelineLayoutError, match=message):
        layout.block_ranges(stages)


@pytest.mark.parametrize("preset", ["tiny-bert", "tiny-t5"])
def test_models_without_a_causal_lm_layout_are_refused(preset):
    with pytest.raises(PipelineLayoutError, match="causal LM"):
        find_layout(build_model(preset))


def test_what_runs_inside_a_stage_and_what_is_refused():
    """Tensor parallelism, FSDP/HSDP and recompute (selective too under a split-backward schedule) inside a
    stage pass the check; experts split over the data-parallel axis and FSDP of a tie held twice on one rank
    are refused by name, with what to do."""
    llama = _llama()
    check_pipeline_plan(llama, _plan(num_devices=4, mesh_shape=(2, 1, 2)))
    check_pipeline_plan(llama, _plan(num_devices=4, mesh_shape=(2, 2, 1), dp_mode="fsdp"))
    check_pipeline_plan(
        llama, _plan(recompute={"model.layers.0": "full", "model.layers.3": "selective:pointwise"})
    )
    check_pipeline_plan(llama, _plan(num_devices=4, mesh_shape=(2, 2, 1)))  # pp x DDP
    with pytest.raises(PipelineRuntimeError, match="experts split over the data-parallel axis"):
        check_pipeline_plan(llama, _plan(expert_data_parallel=["model.layers.0.mlp"]))
    zbv = {"schedule": "zbv", "virtual_stages": 2, "stages": _llama_cut(4)}
    check_pipeline_plan(llama, _plan(**zbv, recompute={"model.layers.0": "full"}))
    check_pipeline_plan(llama, _plan(**zbv, recompute={"model.layers.0": "selective:pointwise"}))
    config = load_config("tiny-gpt2")
    config.n_layer = 4  # zbv: 2 stages on each of 2 ranks
    gpt2 = build_model(config, device="meta")
    batch = make_example_inputs(gpt2, 8, 16, device="meta")
    tied = dict(pp_size=2, dp_size=2, schedule="zbv", micro_batches=4)
    check_pipeline_plan(gpt2, hand_pipeline_plan(gpt2, batch, **tied))  # DDP: the tie is one parameter
    with pytest.raises(PipelineRuntimeError, match="tied to its embedding.*dp_mode 'ddp'"):
        check_pipeline_plan(gpt2, hand_pipeline_plan(gpt2, batch, **tied, dp_mode="fsdp"))
    check_pipeline_plan(gpt2, hand_pipeline_plan(gpt2, batch, **{**tied, "schedule": "1f1b"}, dp_mode="fsdp"))


def test_pipeline_plan_from_a_stage_plan_keeps_its_placements():
    """pipeline_plan_from: a (dp, tp) plan's placements, recompute and data-parallel mode under a leading pp
    axis, keyed by the whole model's names; the hand plan's FSDP placements are the planner's ("S0" on dp)."""
    from hf_colossal_auto.pipeline_layout import pipeline_plan_from

    model = _llama()
    plan = _plan(num_devices=4, mesh_shape=(2, 2, 1))
    inner = dataclasses.replace(
        plan, num_devices=2, mesh_shape=(1, 2), mesh_axis_names=("dp", "tp"), pp_size=1, stages=[], schedule="",
        virtual_stages=1, micro_batches=1,
        param_placements={k: ["R", "S0" if k.endswith("q_proj.weight") else "R"] for k in plan.param_placements},
        activation_placements={"model.layers.0.self_attn": ["R", "R"]}, recompute={"model.layers.1": "full"},
    )  # fmt: skip
    piped = pipeline_plan_from(
        inner, model, pp_size=2, schedule="1f1b", micro_batches=2, blocks_per_stage=[1, 5]
    )
    assert piped.mesh_axis_names == ("pp", "dp", "tp") and piped.mesh_shape == (2, 1, 2)
    assert piped.num_devices == 4 and piped.tp_size == 2 and piped.pp_size == 2
    assert piped.param_placements["model.layers.0.self_attn.q_proj.weight"] == ["R", "R", "S0"]
    assert piped.activation_placements == {"model.layers.0.self_attn": ["R", "R", "R"]}
    assert piped.recompute == {"model.layers.1": "full"} and piped.stages[0][-1] == "model.layers.0"
    check_pipeline_plan(model, piped)
    fsdp = hand_pipeline_plan(
        model, make_example_inputs(model, 8, 16, device="meta"), pp_size=2, dp_size=2, dp_mode="fsdp",
        schedule="gpipe", micro_batches=2, recompute="full",
    )  # fmt: skip
    assert fsdp.dp_mode == "fsdp" and set(map(tuple, fsdp.param_placements.values())) == {("R", "S0", "R")}
    assert fsdp.recompute == {f"model.layers.{i}": "full" for i in range(6)}


def test_stages_send_sequence_shards_where_every_block_returns_them():
    """sends_sequence_shards (the planner's rule, and pipeline_plan_from's): tensor parallelism, a sequence that
    divides over it and every block's output sequence-sharded over tp; then the plan says so, round-trips it
    through JSON, and the runner sends shards for a step whose sequence divides (whole otherwise)."""
    from types import SimpleNamespace

    from hf_colossal_auto.apply.pipeline_runner import PipelineRunner
    from hf_colossal_auto.pipeline_layout import pipeline_plan_from, sends_sequence_shards

    model = _llama()
    layout = find_layout(model)
    sharded = {layout.block(i): ["S0", "S1"] for i in range(layout.num_blocks)}
    assert sends_sequence_shards(layout, sharded, 2, 16)
    assert not sends_sequence_shards(layout, sharded, 1, 16)  # no tensor parallelism
    assert not sends_sequence_shards(layout, sharded, 2, 15)  # a sequence that does not divide
    assert not sends_sequence_shards(layout, {**sharded, "model.layers.5": ["S0", "R"]}, 2, 16)  # one whole
    assert not sends_sequence_shards(
        layout, {k: v for k, v in sharded.items() if k != "model.layers.3"}, 2, 16
    )
    plan = _plan(num_devices=4, mesh_shape=(2, 2, 1))
    inner = dataclasses.replace(
        plan, num_devices=2, mesh_shape=(1, 2), mesh_axis_names=("dp", "tp"), pp_size=1, stages=[], schedule="",
        virtual_stages=1, micro_batches=1, param_placements={k: ["R", "R"] for k in plan.param_placements},
        activation_placements={k: ["R", "S1"] for k in sharded},
    )  # fmt: skip
    piped = pipeline_plan_from(inner, model, pp_size=2, schedule="1f1b", micro_batches=2)
    assert piped.sequence_sharded_sends and Plan.from_dict(json.loads(piped.to_json())).sequence_sharded_sends
    whole = dataclasses.replace(
        inner, activation_placements={**inner.activation_placements, "model.layers.0": ["R", "R"]}
    )
    assert not pipeline_plan_from(
        whole, model, pp_size=2, schedule="1f1b", micro_batches=2
    ).sequence_sharded_sends
    stages = [SimpleNamespace(sequence_shards=None) for _ in range(2)]
    runner = SimpleNamespace(plan=piped, stages=stages)
    for seq, shards in ((16, True), (15, False)):
        PipelineRunner._send_sequence_shards(runner, torch.zeros(4, seq, dtype=torch.long))
        assert [s.sequence_shards for s in stages] == [shards, shards]


def test_a_pipelined_steps_backward_applies_its_gradients_in_place_once():
    """The loss's backward scales the step's gradients in place and hands them to ``.grad`` (no copy: a copy per
    parameter held the rank's gradients twice at the end of backward), adds them where ``.grad`` holds some, and
    refuses a second backward of the same loss (the gradients are applied)."""
    from hf_colossal_auto.apply.pipeline_runner import _StepGradients

    fresh, accumulated = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))
    accumulated.grad = torch.full((2,), 10.0)
    grads = [(fresh, torch.tensor([1.0, 2.0, 3.0])), (accumulated, torch.tensor([1.0, 1.0]))]
    made = grads[0][1]
    anchor = torch.zeros((), requires_grad=True)
    loss = _StepGradients.apply(torch.tensor(4.0), anchor, grads)
    (loss * 0.5).backward(retain_graph=True)
    assert fresh.grad is made and fresh.grad.tolist() == [0.5, 1.0, 1.5]
    assert accumulated.grad.tolist() == [10.5, 10.5]
    with pytest.raises(PipelineRuntimeError, match="backpropagated a second time"):
        loss.backward()


def test_forward_keywords_of_a_pipelined_model():
    from hf_colossal_auto.apply.pipeline_runner import _forward_batch

    ids = torch.zeros(2, 4, dtype=torch.long)
    assert set(_forward_batch("M", (ids,), {"labels": ids, "use_cache": False, "return_dict": True})) == {
        "input_ids",
        "labels",
    }
    with pytest.raises(PipelineRuntimeError, match="return_dict=False"):
        _forward_batch("M", (), {"input_ids": ids, "return_dict": False})
    with pytest.raises(PipelineRuntimeError, match="KV cache"):
        _forward_batch("M", (), {"input_ids": ids, "use_cache": True})


def test_a_training_steps_output_refuses_its_logits_and_says_what_to_do():
    """A pipelined training step returns the loss only (the schedule consumed the logits on the last stage):
    reading the logits, by attribute or key, raises an ``AttributeError`` naming the two ways out; the loss reads
    as on any output (attribute, key, index: what the Trainer reads); probing with ``hasattr`` says False."""
    from accelerate.utils import convert_to_fp32

    from hf_colossal_auto.apply.pipeline_outputs import PipelineOutputError, PipelineTrainingOutput

    loss = torch.tensor(2.5, requires_grad=True)
    out = PipelineTrainingOutput(loss=loss)
    assert out.loss is loss and out["loss"] is loss and out[0] is loss and list(out.keys()) == ["loss"]
    for field in ("logits", "hidden_states", "router_logits", "aux_loss"):
        with pytest.raises(
            PipelineOutputError, match=rf"outputs\.{field} of a training step under a pipeline"
        ):
            getattr(out, field)
        assert not hasattr(out, field)
    with pytest.raises(PipelineOutputError, match=r"model\.loss_function = fn.*pipeline=1"):
        out["logits"] * 2.0
    with pytest.raises(AttributeError, match="no attribute 'other'") as plain:
        _ = out.other
    assert not isinstance(plain.value, PipelineOutputError)
    # accelerate's mixed-precision wrapper rebuilds the output around its converted loss
    converted = convert_to_fp32(PipelineTrainingOutput(loss=torch.tensor(1.0, dtype=torch.bfloat16)))
    assert type(converted) is PipelineTrainingOutput and converted.loss.dtype == torch.float32
    with pytest.raises(PipelineOutputError):
        _ = converted.logits


def test_one_copy_per_group_under_pipeline_stages():
    """Mesh (pp 2, dp 2, tp 1): ranks 0 and 2 share group 0's rows, 1 and 3 group 1's; a gather keeps each
    group's once, in group order, as plain accelerate's rank order gives them; values that differ within a
    group are kept from every rank."""
    from hf_colossal_auto.integrations.data import group_members, one_copy_per_group

    rows = {0: torch.tensor([[0], [1]]), 1: torch.tensor([[2], [3]])}
    gathered = torch.cat([rows[0], rows[1], rows[0], rows[1]])  # ranks 0..3: group 0, 1, 0, 1
    assert one_copy_per_group(gathered, 4, 1, pp_size=2).flatten().tolist() == [0, 1, 2, 3]
    per_rank = torch.arange(4).reshape(4, 1)
    assert torch.equal(one_copy_per_group(per_rank, 4, 1, pp_size=2), per_rank)
    assert one_copy_per_group(["a", "b", "a", "b"], 4, 1, objects=True, pp_size=2) == ["a", "b"]
    # the processes whose batches each group reads: contiguous, the same for every rank of the group
    assert [group_members(r, 1, 2, 2) for r in range(4)] == [(0, 1), (2, 3), (0, 1), (2, 3)]
    assert group_members(3, 2, 1, 2) == (2, 3)  # without a pipeline: the tensor-parallel group


def test_batch_keys_the_stages_would_not_see_are_refused():
    batch = {"input_ids": torch.zeros(4, 8, dtype=torch.long), "labels": torch.zeros(4, 8, dtype=torch.long)}
    with pytest.raises(PipelineRuntimeError, match="token_type_ids"):
        _split_batch({**batch, "token_type_ids": batch["labels"]}, 2, torch.device("cpu"))
    with pytest.raises(PipelineRuntimeError, match="fewer than the plan's 8 micro-batches"):
        _split_batch(batch, 8, torch.device("cpu"))


def _sliding_qwen2():
    """A tiny Qwen2 whose last two layers attend in a window of 4 (``layer_types`` full, full, sliding,
    sliding): a stage must read its own layers' entries, not the first ones."""
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, use_sliding_window=True, sliding_window=4, max_window_layers=2,
        bos_token_id=1, eos_token_id=2, use_cache=False,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("preset", "cut"), [("tiny-llama", [1, 2, 1]), ("tiny-gpt2", [2, 1, 1]), ("sliding-qwen2", [1, 2, 1])]
)
def test_stage_modules_in_a_row_compute_the_models_logits(preset, cut):
    """In one process, the stages run one after another (hidden states handed on) give the whole model's
    logits on a padded batch: each stage's copy of the model builds the same mask, positions and rotary
    tables, and reads its own layers' per-layer config."""
    config = _sliding_qwen2() if preset == "sliding-qwen2" else load_config(preset)
    for attr in ("num_hidden_layers", "n_layer"):
        if hasattr(config, attr):
            setattr(config, attr, 4)
    torch.manual_seed(0)
    model = build_model(config, device="cpu").eval()
    batch = make_example_inputs(model, 4, 12)
    batch["attention_mask"][1, 7:] = 0
    layout = find_layout(model)
    ranges = layout.block_ranges(layout.stage_modules(cut))
    stages = [StageModule(model, layout, s, len(cut), ranges[s]) for s in range(len(cut))]
    x = batch["input_ids"]
    for stage in stages:
        x = stage(x, attention_mask=batch["attention_mask"])
    with torch.no_grad():
        expected = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    torch.testing.assert_close(x, expected, rtol=1e-5, atol=1e-6)
    assert sum(1 for _ in model.parameters()) == sum(1 for s in stages for _ in s.parameters()) - (
        preset == "tiny-gpt2"  # the tied embedding: in the first and in the last stage
    )


def test_offered_schedules_are_the_runtimes():
    from hf_colossal_auto.apply.pipeline import _SCHEDULES

    assert set(_SCHEDULES) == set(PIPELINE_SCHEDULES)


def test_autoparallelize_pipeline_setting_from_argument_and_environment(monkeypatch):
    """What ``autoparallelize(model, batch)`` hands the planner: ``pipeline=`` where given (None or "auto":
    searched, 1: no stages, >= 2: that pp degree), else ``HF_COLOSSAL_AUTO_PIPELINE``, else 1; the argument wins,
    and a bad variable it overrides is not read (``context_parallel`` likewise). A bad argument or variable is
    refused before planning, naming the setting and what is allowed. One gloo rank, the planner stubbed (the
    2-rank plans and their training: ``test_gloo_every_schedule_trains_like_one_process``)."""
    import torch.distributed as dist

    import hf_colossal_auto.solve.planner as planner
    from hf_colossal_auto import autoparallelize
    from hf_colossal_auto.integrations.plugin import PluginConfigError

    class Planned(Exception):
        """The stub's answer: (pipeline, context_parallel) as plan_model got them."""

    def plan_model(model, batch, **kwargs):
        raise Planned(kwargs["pipeline"], kwargs["context_parallel"])

    def handed(env: str | None = None, cp_env: str | None = None, **kwargs) -> tuple:
        for name, value in (("PIPELINE", env), ("CONTEXT_PARALLEL", cp_env)):
            if value is None:
                monkeypatch.delenv(f"HF_COLOSSAL_AUTO_{name}", raising=False)
            else:
                monkeypatch.setenv(f"HF_COLOSSAL_AUTO_{name}", value)
        with pytest.raises(Planned) as planned:
            autoparallelize(torch.nn.Linear(2, 2), {"x": torch.zeros(1, 2)}, **kwargs)
        return planned.value.args

    monkeypatch.setattr(planner, "plan_model", plan_model)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert handed() == (1, 1)  # the default: no stages
        assert handed(env="2") == (2, 1)
        assert handed(env="auto") == (None, 1)
        assert handed(env="1") == (1, 1)
        assert handed(pipeline=2) == (2, 1)
        assert handed(pipeline="auto") == (None, 1)
        assert handed(env="1", pipeline=2) == (2, 1)  # the argument wins
        assert handed(env="2", pipeline=1) == (1, 1)
        assert handed(env="2", pipeline=None) == (None, 1)
        assert handed(env="two", pipeline=2) == (2, 1)  # a variable the argument overrides is not read
        assert handed(cp_env="two", context_parallel=1) == (1, 1)
        with pytest.raises(
            PluginConfigError, match=r"HF_COLOSSAL_AUTO_PIPELINE: expected 'auto'.*pp degree >= 2"
        ):
            handed(env="two")
        for bad in ("two", 0):
            with pytest.raises(
                PluginConfigError, match=r"pipeline from autoparallelize: expected 'auto'.*>= 2"
            ):
                handed(pipeline=bad)
    finally:
        dist.destroy_process_group()


# --------------------------------------------------------------------------------------------- 2 gloo ranks
def test_gloo_every_schedule_trains_like_one_process(tmp_path):
    """The user's loop (``model(**batch).loss.backward()``) under every offered schedule, uneven cuts included, for
    tiny Llama (the interleaved schedules also with 4 stages a rank and fewer micro-batches than stages), GPT-2 (its head tied to its embedding: across ranks, on one rank under zbv) and Mixtral (with
    its router load-balancing loss, whose layers are on both ranks; without it under 1f1b), and a model built on
    meta: loss, gradients and gradient norm of one step equal one process (fp32), no receive buffer holds memory
    between steps, parameters after two AdamW steps within 1 % of one update (Adam divides by the gradient's
    size: a near-zero gradient's rounding moves its update by up to its whole size, 1e-3 of one update is what
    was measured); the evaluation forward's logits and loss equal one process's on both ranks; gradient
    accumulation with a scaled loss; a z-loss on the logits set as the model's loss function (the training
    output refuses its logits, saying to); save_pretrained reloads in one process with identical tensors;
    AutoParallelAccelerator with a pipeline plan file trains like one process on the global batches; router
    jitter with the router loss is refused; a cut inside a block, a batch too small for the micro-batches and a
    training forward without labels raise on both ranks; ``consolidated_state_dict`` gives one process's full
    state dict (tied GPT-2 included) on every rank, or on rank 0 alone. Stages planned in the job,
    ``autoparallelize(model, batch, pipeline=2)`` (over ``HF_COLOSSAL_AUTO_PIPELINE=1``: the argument wins) and
    ``HF_COLOSSAL_AUTO_PIPELINE=2`` alone, give 2 stages that train like one process; ``pipeline=3`` and
    ``HF_COLOSSAL_AUTO_PIPELINE=two`` are refused on both ranks naming the setting."""
    from torchrun_launch import run_torchrun

    out = tmp_path / "pipeline.json"
    run_torchrun(str(ROOT / "tests" / "multiproc" / "check_pipeline.py"), "--out", str(out), nproc=2)
    ranks = json.loads(out.read_text())
    trained = [k for k, v in ranks[0].items() if isinstance(v, dict) and "ref_loss" in v]
    for model in ("llama", "gpt2 tied", "mixtral aux"):  # each model under every offered schedule
        for schedule in PIPELINE_SCHEDULES:
            assert any(c.startswith(f"{model} {schedule} [") for c in trained), (model, schedule)
    four = [c for c in trained if c.startswith("llama four a rank ")]  # 8 stages, 4 or 2 micro-batches
    assert {c.split()[4] for c in four} == {"interleaved-1f1b", "interleaved-zero-bubble"}, trained
    assert {c.split()[5] for c in four} == {"m4", "m2"}, trained
    cuts = [json.loads(c[c.index("[") :]) for c in trained if c.startswith("gpt2 tied") and c.endswith("]")]
    assert any(len(set(cut)) > 1 for cut in cuts), cuts  # GPT-2 under an uneven cut
    for results in ranks:
        for case in trained:
            got = results[case]
            assert abs(got["loss"] - got["ref_loss"]) <= 1e-5 * abs(got["ref_loss"]), (case, got)
            assert got["grad_err"] <= 1e-5, (case, got)
            assert got["param_err_lr"] <= 1e-2, (case, got)
            assert abs(got["norm"] - got["ref_norm"]) <= 1e-5 * got["ref_norm"], (case, got)
            assert abs(got["eval_loss"] - got["ref_eval_loss"]) <= 1e-5 * got["ref_eval_loss"], (case, got)
            assert got["eval_logits_err"] <= 1e-5 and got["unlabeled_equal"], (case, got)
            assert got["live_receive_buffers"] == 0, (case, got)
            if got["gradient_sends"] is not None:  # multi-stage: sent gradients freed as the pricing has it
                assert got["gradient_sends"]["in_flight_after_step"] == 0, (case, got)
                assert got["gradient_sends"]["releases_as_priced"], (case, got)
                assert got["gradient_sends"]["freed_early"] > 0, (case, got)
            else:
                assert {"gpipe", "1f1b"} & set(case.split()), (case, got)
        assert results["accumulation 1f1b"]["grad_err"] <= 1e-5
        z_loss = results["llama z-loss 1f1b"]  # trained like one process above; its term is a visible part
        assert z_loss["ref_loss"] - z_loss["plain_ref_loss"] > 1e-2 * z_loss["plain_ref_loss"], z_loss
        moe = [c for c in trained if c.startswith("mixtral aux")]  # the routers' term is a visible part
        assert len(moe) == len(PIPELINE_SCHEDULES) and all(results[c]["ref_aux"] > 1e-3 for c in moe), moe
        assert any(c.startswith("mixtral no-aux") for c in trained)
        jitter = results["mixtral jitter"]
        assert jitter.startswith("PipelineRuntimeError") and "router_jitter_noise" in jitter, jitter
        for case in (
            "llama recompute 1f1b selective:pointwise",
            "llama recompute zbv full",
            "llama recompute zbv selective:pointwise",
            "llama recompute zbv selective:pointwise;rerun=mlp.down_proj,self_attn.o_proj",
            "llama recompute interleaved-zero-bubble selective:pointwise",
        ):
            assert case in trained and results[case]["recomputed"], case
            # one rerun a micro-batch (4), split backward or not: torch's checkpoint reran a block in the input
            # pass and in each parameter group's autograd.grad of the weight pass (9 in a Llama block)
            runs = results[case]["attention_runs"]
            assert runs and set(runs) == {2 * 4}, (case, runs)
        saved = results["save gpt2"]
        assert saved["equal"] and saved["tied"] and len(saved["files"]) > 1, saved
        assert results["bad cut"].startswith("PipelineLayoutError") and "whole blocks" in results["bad cut"]
        assert results["small batch"].startswith("PipelineRuntimeError")
        # planned in the job (autoparallelize): pipeline=2 over HF_COLOSSAL_AUTO_PIPELINE=1, and the variable
        # alone, each a plan of 2 stages (trained like one process above); bad settings refused by name
        planned = {c.split()[2]: results[c] for c in trained if c.startswith("llama planned ")}
        assert sorted(planned) == ["argument", "environment"], trained
        for how, got in planned.items():
            assert got["pp_size"] == 2 and got["info"] == [0, 1, 2], (how, got)
        wrong = results["pipeline=3"]
        assert wrong.startswith("ValueError") and "pipeline=3" in wrong and "divide the 2 devices" in wrong, (
            wrong
        )
        wrong = results["pipeline variable two"]
        assert wrong.startswith("PluginConfigError"), wrong
        assert "HF_COLOSSAL_AUTO_PIPELINE" in wrong and "'auto'" in wrong and "pp degree >= 2" in wrong, wrong
        assert (
            results["no labels"].startswith("PipelineRuntimeError") and "model.eval()" in results["no labels"]
        )
        for case in ("tiny-llama 1f1b", "tiny-gpt2 1f1b", "tiny-gpt2 zbv"):  # one process's full state dict
            got = results[f"state dict {case}"]
            assert got["keys_in_order"] and got["equal"] and got["plain_cpu"] and got["rank0_only"], (
                case,
                got,
            )
            assert got["tie_kept"] is not False, (case, got)
        accelerate = results["accelerate"]
        for got, want in [*zip(accelerate["losses"], accelerate["ref_losses"], strict=True),
                          *zip(accelerate["norms"], accelerate["ref_norms"], strict=True)]:  # fmt: skip
            assert abs(got - want) <= 1e-5 * want, accelerate
        # clipped AdamW steps: a near-zero gradient's rounding moves its update by up to its whole size
        assert accelerate["param_err_lr"] <= 5e-2, accelerate
        assert accelerate["gathered_equal"] and accelerate["saved"]["equal"], accelerate
    # the two ranks of the pipeline read the same rows: both processes' batches, as plain accelerate's step
    assert ranks[0]["accelerate"]["rows"] == ranks[1]["accelerate"]["rows"]
    assert len(ranks[0]["accelerate"]["rows"][0]) == 8
    for case in trained:  # each rank holds only its stages' parameters, together all of them
        held = [set(r[case]["held"]) for r in ranks]
        if "gpt2" not in case:
            assert not held[0] & held[1], case
        blocks = 10 if "four a rank" in case else 6 if "llama" in case else 5 if "mixtral" in case else None
        expected = blocks * 9 + 3 if blocks else None
        if expected:
            assert len(held[0] | held[1]) == expected, case
        if "recompute" in case:  # every block recomputed, each on the rank that holds it
            recomputed = [set(r[case]["recomputed"]) for r in ranks]
            assert recomputed[0] | recomputed[1] == {f"model.layers.{i}" for i in range(6)}, case
            assert not recomputed[0] & recomputed[1], case


# --------------------------------------------------------------------------------------------- 4 gloo ranks
def test_gloo_pipeline_times_ddp_trains_like_one_process(tmp_path):
    """pp 2 x dp 2 (Llama under 1f1b, GPT-2 with its tie under zbv) under DDP, pp 2 x dp 2 under FSDP (Llama;
    GPT-2 with its tie across ranks), pp 2 x tp 2 (Llama, the planner's Megatron-LM placements and full
    recompute inside the stages): each data-parallel group on its rows of one global batch whose groups hold
    different token counts; the loss is the global batch's and the gradients, clipping norm, parameters after
    two AdamW steps and evaluation outputs are one process's on it; save_pretrained reloads with identical
    tensors; data_parallel_loader gives a pipeline's ranks the same rows and the groups together plain
    accelerate's rows of each step. Accumulation with a micro-step inside model.no_sync() defers the dp
    all-reduce to the last backward (each gradient reduced once) and gives one process's gradients; so does the
    Trainer's contract (num_items_in_batch of the window, loss x dp), whose logged loss is one process's. A tiny
    Mixtral with its router load-balancing loss under pp 2 x FSDP 2 (interleaved zero bubble) too. And pp 2 x tp
    2 under Megatron-LM's sequence parallelism with attention and MLP on local shards, priced with its stages: it
    trains like one process while each tp rank sends its sequence shard, the step's sends and receives the
    simulated schedule's."""
    from torchrun_launch import run_torchrun

    out = tmp_path / "pipeline_dp.json"
    run_torchrun(str(ROOT / "tests" / "multiproc" / "check_pipeline_dp.py"), "--out", str(out), nproc=4)
    ranks = json.loads(out.read_text())
    for rank, results in enumerate(ranks):
        group = rank % 2  # mesh (pp, dp, tp) = (2, 2, 1): rank = pp_index * 2 + dp_index
        cases = {  # data_parallel_info: (dp rank, dp size, tp size, pp size, world)
            "llama 1f1b": [group, 2, 1, 2, 4],
            "gpt2 tied zbv": [group, 2, 1, 2, 4],
            "llama fsdp 1f1b": [group, 2, 1, 2, 4],
            "llama tp 1f1b": [0, 1, 2, 2, 4],  # mesh (2, 1, 2): the tensor-parallel pair reads the same rows
            "gpt2 tied fsdp 1f1b": [group, 2, 1, 2, 4],
            "mixtral fsdp interleaved-zero-bubble": [group, 2, 1, 2, 4],  # with its router aux loss
        }
        for case, info in cases.items():
            got = results[case]
            assert got["info"] == info, (rank, case, got["info"])
            assert abs(got["loss"] - got["ref_loss"]) <= 1e-5 * got["ref_loss"], (case, got)
            assert got["grad_err"] <= 1e-5 and got["param_err_lr"] <= 1e-2, (case, got)
            assert abs(got["norm"] - got["ref_norm"]) <= 1e-5 * got["ref_norm"], (case, got)
            assert abs(got["eval_loss"] - got["ref_eval_loss"]) <= 1e-5 * got["ref_eval_loss"], (case, got)
            assert got["eval_logits_err"] <= 1e-5, (case, got)
        # what each rank stores: whole stages under DDP, about half under FSDP over 2, the Megatron-LM
        # projections' halves under tp 2; recompute on the tp case's blocks (1 on pp rank 0, 2 on pp rank 1)
        assert results["llama 1f1b"]["local_fraction"] == 1.0
        assert 0.45 <= results["llama fsdp 1f1b"]["local_fraction"] <= 0.55, results["llama fsdp 1f1b"]
        assert 0.5 < results["llama tp 1f1b"]["local_fraction"] < 0.9, results["llama tp 1f1b"]
        assert results["llama tp 1f1b"]["recomputed"] == 1 + rank // 2
        assert results["llama fsdp 1f1b"]["recomputed"] == 0
        for case in ("llama fsdp 1f1b", "gpt2 tied fsdp 1f1b", "mixtral fsdp interleaved-zero-bubble"):
            units, issued = results[case]["gathered_before_forward"]  # every unit's, as the step starts
            assert units > 1 and issued == units, (case, units, issued)
        assert results["llama 1f1b"]["gathered_before_forward"] == [0, 0]
        for case in ("gpt2 tied zbv", "llama fsdp 1f1b", "llama tp 1f1b", "gpt2 tied fsdp 1f1b"):
            saved = results[case]["saved"]
            assert saved["equal"] and saved["tied"] == ("gpt2" in case), (case, saved)
            full = results[case]["full_state_dict"]  # gathered from sharded stages too
            assert full["keys_in_order"] and full["equal"], (case, full)
        deferred = results["deferred accumulation"]  # no_sync: nothing reduced over dp, nothing in .grad yet
        assert deferred["during_no_sync"] == [0, 0], deferred
        assert deferred["reduced"] == deferred["params"], deferred  # then each gradient once
        assert deferred["grad_err"] <= 1e-5, deferred
        contract = results["trainer contract"]  # num_items_in_batch and loss x dp, as the Trainer runs it
        assert contract["grad_err"] <= 1e-5, contract
        assert abs(contract["logged"] - contract["ref_loss"]) <= 1e-5 * contract["ref_loss"], contract
        # pp 2 x tp 2 with Megatron-LM's sequence parallelism and local regions (megatron-sp-local, priced with
        # its stages): the blocks return
        # sequence shards, so each tp rank sends and receives its half of the hidden states — the simulated
        # schedule's sends and receives by peer, in count and bytes (whole tensors would be twice the bytes)
        for case, blocks in (("llama tp-sp 1f1b", 2), ("gpt2 tied tp-sp 1f1b", 1)):
            sp = results[case]
            assert sp["info"] == [0, 1, 2, 2, 4], (case, sp["info"])
            assert sp["sequence_sharded_sends"] is True and sp["local_modules"] > 0, (case, sp)
            assert sp["measured_p2p"] == sp["predicted_p2p"] and sp["predicted_p2p"], (case, rank, sp)
            assert abs(sp["loss"] - sp["ref_loss"]) <= 1e-5 * sp["ref_loss"], (case, sp)
            assert sp["grad_err"] <= 1e-5 and abs(sp["norm"] - sp["ref_norm"]) <= 1e-5 * sp["ref_norm"], (
                case,
                sp,
            )
            assert abs(sp["eval_loss"] - sp["ref_eval_loss"]) <= 1e-5 * sp["ref_eval_loss"], (case, sp)
            assert sp["eval_logits_err"] <= 1e-5 and sp["recomputed"] == blocks, (case, sp)
            # AdamW's first steps divide each gradient element by its own magnitude: an element whose gradient
            # is near zero moves by a share of lr for a reduction-order difference (sequence parallelism's
            # reduce-scatters; measured 3.3 % of lr, the same with whole sends); a wrong state moves by lr or more
            assert sp["param_err_lr"] <= 5e-2, (case, sp)
        assert results["loader rows"] == [
            [4 * group + i for i in range(4)],
            [8 + 4 * group + i for i in range(4)],
        ]


@pytest.mark.parametrize(
    ("preset", "changes", "message"),
    [
        ("tiny-mixtral", {}, None),  # the router aux loss is split over the stages
        ("tiny-qwen2-moe", {}, None),  # the same load_balancing_loss_func
        ("tiny-mixtral", {"router_jitter_noise": 0.1}, "router_jitter_noise"),
        ("tiny-mixtral", {"router_jitter_noise": 0.1, "output_router_logits": False}, None),  # no aux loss
        ("tiny-mixtral", {"router_jitter_noise": 0.1, "router_aux_loss_coef": 0.0}, None),
    ],
)
def test_moe_router_aux_loss_under_pipeline_stages(preset, changes, message):
    """An MoE model's load-balancing loss runs under pipeline stages (its expert counts from a forward pass
    before the schedule's); random ops in a training forward with it on are refused with what to do."""
    config = load_config(preset)
    config.num_hidden_layers = 2
    for key, value in changes.items():
        setattr(config, key, value)
    model = build_model(config, device="meta")
    plan = hand_pipeline_plan(
        model, make_example_inputs(model, 8, 16, device="meta"), pp_size=2, schedule="1f1b", micro_batches=4
    )
    if message is None:
        check_pipeline_plan(model, plan)
    else:
        with pytest.raises(PipelineRuntimeError, match=f"{message}.*output_router_logits=False"):
            check_pipeline_plan(model, plan)


def test_gloo_pipeline_with_hsdp_or_fsdp_times_tp_inside_the_stages_trains_like_one_process(tmp_path):
    """8 ranks: pp 2 x dp 4 under HSDP (shard groups of 2) and pp 2 x dp 2 x tp 2 (FSDP x Megatron-LM, full
    recompute), each priced with its stages by evaluate_plan; a 4-block Llama under 1F1B equals one process
    (loss, gradients, clipping norm, evaluation), parameters after two AdamW steps within 5 % of the learning
    rate (AdamW's first steps divide each gradient element by its own magnitude, so an element whose gradient is
    near zero moves by a share of lr for a reduction-order difference; a wrongly mapped optimizer state moves
    by lr or more), and save_pretrained reloads equal tensors in one process."""
    from torchrun_launch import run_torchrun

    out = tmp_path / "pipeline_8.json"
    run_torchrun(str(ROOT / "tests" / "multiproc" / "check_pipeline_8.py"), "--out", str(out), nproc=8)
    ranks = json.loads(out.read_text())
    for rank, results in enumerate(ranks):
        pp, inner = divmod(rank, 4)  # mesh (pp, dp, tp): rank = pp * 4 + dp * tp_size + tp
        cases = {  # data_parallel_info: (dp rank, dp size, tp size, pp size, world); share of parameters held
            "llama hsdp 1f1b": ([inner, 4, 1, 2, 8], (0.45, 0.55), 0),
            "llama fsdp-tp 1f1b": ([inner // 2, 2, 2, 2, 8], (0.2, 0.45), 2),
        }
        for case, (info, (low, high), recomputed) in cases.items():
            got = results[case]
            assert got["info"] == info, (rank, case, got["info"])
            assert abs(got["loss"] - got["ref_loss"]) <= 1e-5 * got["ref_loss"], (case, got)
            assert got["grad_err"] <= 1e-5 and got["param_err_lr"] <= 5e-2, (case, got)
            assert abs(got["norm"] - got["ref_norm"]) <= 1e-5 * got["ref_norm"], (case, got)
            assert abs(got["eval_loss"] - got["ref_eval_loss"]) <= 1e-5 * got["ref_eval_loss"], (case, got)
            assert got["eval_logits_err"] <= 1e-5, (case, got)
            assert low <= got["local_fraction"] <= high, (rank, case, got["local_fraction"])
            assert got["recomputed"] == recomputed, (rank, case, got["recomputed"])
            assert got["saved"]["equal"], (case, got["saved"])
