"""The Accelerate integration: plugin settings, refusals before training, data layout, the runner, and a
2-process ``accelerate launch`` run that matches plain accelerate in one process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch.utils.data import DataLoader
from torchrun_launch import accelerate_launch_command, why_it_failed

from hf_colossal_auto.integrations.plugin import AutoParallelPlugin, PluginConfigError

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def clean_env(monkeypatch):
    """No plugin settings inherited from the caller's environment."""
    for key in list(os.environ):
        if key.startswith("HF_COLOSSAL_AUTO_") and key != "HF_COLOSSAL_AUTO_NO_CALIBRATE":
            monkeypatch.delenv(key)
    return monkeypatch


@pytest.fixture
def accelerate_state():
    """Accelerate keeps process-wide singletons: start and end each test that builds an Accelerator clean."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


def _yaml(tmp_path: Path, text: str) -> str:
    path = tmp_path / "auto.yaml"
    path.write_text(text)
    return str(path)


# ------------------------------------------------------------------------------------------- settings
def test_precedence_constructor_then_env_then_yaml_then_default(clean_env, tmp_path):
    clean_env.setenv(
        "HF_COLOSSAL_AUTO_CONFIG",
        _yaml(tmp_path, "mesh_shape: [2, 1]\nmemory_budget: 2GiB\ntime_limit_s: 5\ndp_modes: [fsdp]\n"),
    )
    clean_env.setenv("HF_COLOSSAL_AUTO_MEMORY_BUDGET", "3GiB")
    clean_env.setenv("HF_COLOSSAL_AUTO_MESH_SHAPE", "1x2")
    plugin = AutoParallelPlugin(mesh_shape="4x1")
    assert plugin.mesh_shape == (4, 1)  # constructor beats environment and file
    assert plugin.memory_budget == 3 * 2**30  # environment beats file
    assert plugin.time_limit_s == 5.0 and plugin.dp_modes == ("fsdp",)  # file beats default
    assert plugin.device is None and plugin.num_devices is None  # automatic
    clean_env.setenv("HF_COLOSSAL_AUTO_PLAN_KWARGS", '{"optimizer": "sgd"}')
    kwargs = AutoParallelPlugin().planner_kwargs()
    assert kwargs == {
        "mesh_shape": (1, 2),
        "memory_budget": 3 * 2**30,
        "dp_modes": ("fsdp",),
        "time_limit_s": 5.0,
        "optimizer": "sgd",
    }


@pytest.mark.parametrize(
    ("where", "key", "value", "message"),
    [
        ("yaml", "mesh_shap", "[1, 2]", r"unknown setting\(s\) \['mesh_shap'\]; allowed: num_devices"),
        ("yaml", "example_inputs", "{}", r"unknown setting\(s\) \['example_inputs'\]"),
        ("yaml", "mesh_shape", "[2]", r"mesh_shape from .*expected \(dp, tp\)"),
        ("yaml", "num_devices", "two", r"num_devices from .*expected an integer >= 1, got 'two'"),
        ("env", "MESHSHAPE", "1x2", r"unknown setting HF_COLOSSAL_AUTO_MESHSHAPE"),
        ("env", "NUM_DEVICES", "0", r"num_devices from environment variable HF_COLOSSAL_AUTO_NUM_DEVICES"),
        ("env", "DP_MODES", "zero3", r"dp_modes .*subset of \('ddp', 'fsdp', 'hsdp', 'ddp-ep', 'fsdp-ep'\)"),
        ("env", "MEMORY_BUDGET", "lots", r"memory_budget .*'40GiB'"),
        ("env", "PLAN_KWARGS", "{recompute: yes}", r"plan_kwargs .*JSON object"),
        ("env", "TIME_LIMIT_S", "-1", r"time_limit_s .*positive number"),
    ],
)
def test_unknown_or_ill_typed_settings_name_the_key(clean_env, tmp_path, where, key, value, message):
    if where == "yaml":
        clean_env.setenv("HF_COLOSSAL_AUTO_CONFIG", _yaml(tmp_path, f"{key}: {value}\n"))
    else:
        clean_env.setenv(f"HF_COLOSSAL_AUTO_{key}", value)
    with pytest.raises(PluginConfigError, match=message):
        AutoParallelPlugin()


def test_combined_file_section_and_missing_file(clean_env, tmp_path):
    clean_env.setenv(
        "HF_COLOSSAL_AUTO_CONFIG",
        _yaml(tmp_path, "distributed_type: MULTI_GPU\nauto_parallel:\n  device: h100\n"),
    )
    assert AutoParallelPlugin().device == "h100"
    clean_env.setenv("HF_COLOSSAL_AUTO_CONFIG", str(tmp_path / "nope.yaml"))
    with pytest.raises(PluginConfigError, match="no such file"):
        AutoParallelPlugin()


def test_launch_splits_a_combined_config(clean_env, tmp_path):
    from hf_colossal_auto.integrations.launch import prepare_launch

    config = _yaml(
        tmp_path, "distributed_type: MULTI_GPU\nnum_processes: 2\nauto_parallel:\n  mesh_shape: 1x2\n"
    )
    cmd, env = prepare_launch(config, "train.py", ["--lr", "1"], tmp_path)
    assert cmd[-7:] == [
        "--config_file",
        str(tmp_path / "accelerate.yaml"),
        "-m",
        "hf_colossal_auto.run",
        "train.py",
        "--lr",
        "1",
    ]
    assert "auto_parallel" not in (tmp_path / "accelerate.yaml").read_text()
    assert env["HF_COLOSSAL_AUTO_CONFIG"] == str(tmp_path / "auto_parallel.yaml")
    bad = _yaml(tmp_path, "num_processes: 2\nauto_parallel:\n  mesh: 1x2\n")
    with pytest.raises(PluginConfigError, match=r"section auto_parallel: .*unknown setting\(s\) \['mesh'\]"):
        prepare_launch(bad, "train.py", [], tmp_path)


# ------------------------------------------------------------------------------------------- refusals
@pytest.mark.parametrize(
    ("kwargs", "env", "named"),
    [
        ({"fsdp_plugin": object()}, {}, "FSDP"),
        ({"deepspeed_plugin": object()}, {}, "DeepSpeed"),
        ({"parallelism_config": object()}, {}, "ParallelismConfig"),
        ({}, {"ACCELERATE_USE_DEEPSPEED": "true"}, "DeepSpeed"),
        ({}, {"ACCELERATE_USE_FSDP": "true"}, "FSDP"),
    ],
)
def test_other_parallelism_plugins_are_refused(clean_env, kwargs, env, named):
    from hf_colossal_auto.integrations import AutoParallelAccelerator

    for key, value in env.items():
        clean_env.setenv(key, value)
    with pytest.raises(ValueError, match=f"plans data and tensor parallelism itself, but .*{named}"):
        AutoParallelAccelerator(**kwargs)


def test_saved_plan_for_another_world_size_is_refused_at_construction(clean_env, tmp_path, accelerate_state):
    from hf_colossal_auto.apply import PlanMismatchError
    from hf_colossal_auto.integrations import AutoParallelAccelerator
    from hf_colossal_auto.models import build_model, make_example_inputs
    from hf_colossal_auto.solve.planner import plan_model

    model = build_model("tiny-gpt2", device="cpu")
    plan = plan_model(
        model, make_example_inputs(model, 4, 16), num_devices=2, device="cpu", mesh_shape=(1, 2)
    )
    plan.save(tmp_path / "plan.json")
    plugin = AutoParallelPlugin(plan_path=str(tmp_path / "plan.json"))
    with pytest.raises(PlanMismatchError, match=r"1x2 \(dp x tp\) mesh of 2 processes, this job has 1"):
        AutoParallelAccelerator(cpu=True, auto_parallel_plugin=plugin)
    with pytest.raises(ValueError, match="num_devices=4 but this job has 1 processes"):
        AutoParallelAccelerator(cpu=True, auto_parallel_plugin=AutoParallelPlugin(num_devices=4))


# ------------------------------------------------------------------------------------------- data
def _batches(loader) -> list[list[int]]:
    return [batch.tolist() for batch in loader]


def test_peeking_the_first_batch_moves_no_random_state():
    from hf_colossal_auto.integrations.accelerator import peek_batch

    samples = [{"input_ids": torch.full((4,), i)} for i in range(10)]
    gen = torch.Generator().manual_seed(3)
    loader = DataLoader(samples, batch_size=4, shuffle=True, generator=gen)
    state, global_state = gen.get_state(), torch.get_rng_state()
    batch = peek_batch(loader)
    assert batch["input_ids"].shape == (4, 4)
    assert torch.equal(gen.get_state(), state) and torch.equal(torch.get_rng_state(), global_state)


# ------------------------------------------------------------------------------------------- runner
def test_run_swaps_the_accelerator_for_an_unmodified_script(monkeypatch, tmp_path):
    import accelerate
    import accelerate.accelerator

    from hf_colossal_auto import run

    monkeypatch.setattr(accelerate, "Accelerator", accelerate.Accelerator)
    monkeypatch.setattr(accelerate.accelerator, "Accelerator", accelerate.accelerator.Accelerator)
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    script = tmp_path / "train.py"
    out = tmp_path / "seen.json"
    script.write_text(
        "import json, sys\nfrom accelerate import Accelerator\n"
        f"json.dump([Accelerator.__name__, sys.argv], open({str(out)!r}, 'w'))\n"
    )
    assert run.main([str(script), "--lr", "1"]) == 0
    assert json.loads(out.read_text()) == ["AutoParallelAccelerator", [str(script), "--lr", "1"]]
    assert run.main([str(tmp_path / "missing.py")]) == 2


def test_run_sets_cpu_for_multi_process_jobs_without_gpus():
    from hf_colossal_auto.run import use_cpu_without_gpus

    env = {"WORLD_SIZE": "2"}
    assert use_cpu_without_gpus(env) == (not torch.cuda.is_available())
    assert use_cpu_without_gpus({"WORLD_SIZE": "1"}) is False


def test_load_state_without_a_state_to_resume_says_what_to_do(clean_env, accelerate_state, tmp_path):
    """A planned job's load_state of a folder with neither our shards nor accelerate's one-process files (e.g.
    accelerate's FSDP save_state) names what it needs and the way to start from consolidated weights."""
    from hf_colossal_auto.integrations import AutoParallelAccelerator

    accelerator = AutoParallelAccelerator(cpu=True)
    (tmp_path / "pytorch_model_fsdp_0").mkdir()
    with pytest.raises(
        ValueError, match=r"nothing here to resume from.*AutoParallelPlugin\(pretrained=\.\.\.\)"
    ):
        accelerator._load_single_process_files(str(tmp_path), [(torch.nn.Linear(2, 2), [])], None)


def test_load_state_finds_the_latest_automatically_named_checkpoint(clean_env, accelerate_state, tmp_path):
    from accelerate.utils import ProjectConfiguration

    from hf_colossal_auto.integrations import AutoParallelAccelerator

    config = ProjectConfiguration(project_dir=str(tmp_path), automatic_checkpoint_naming=True)
    accelerator = AutoParallelAccelerator(cpu=True, project_config=config)
    assert accelerator._resolve_input_dir(None) is None  # nothing saved yet: accelerate's own error follows
    for i in (0, 2, 10):
        (tmp_path / "checkpoints" / f"checkpoint_{i}").mkdir(parents=True)
    assert accelerator._resolve_input_dir(None) == str(tmp_path / "checkpoints" / "checkpoint_10")
    assert accelerator._resolve_input_dir("~/x") == os.path.expanduser("~/x")


# ------------------------------------------------------------------------------------------- 2 processes
@pytest.mark.slow
def test_accelerate_launch_two_gloo_processes_match_one_process(tmp_path, accelerate_state):
    """``accelerate launch`` (the documented CPU command) of an unmodified accelerate script through
    ``hf_colossal_auto.run`` on a 1x2 (tensor-parallel) plan: the losses of one process on the same global
    batch, save_state/load_state repeats them, and save_model loads with from_pretrained in one process.
    Elastic: the state saved under the 1x2 plan, and the one plain accelerate saved in one process, resume with
    load_state under a 2x1 FSDP plan (fresh model, other weights) — and the 1x2 state in one process — with the
    run's next losses and learning rate (the second step's loss depends on AdamW's restored moments)."""
    script = str(ROOT / "tests" / "multiproc" / "check_accelerate.py")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env = {
        k: v for k, v in env.items() if not k.startswith("HF_COLOSSAL_AUTO_") or k.endswith("NO_CALIBRATE")
    }
    ref = subprocess.run(
        [sys.executable, script, "--out", str(tmp_path / "ref")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert ref.returncode == 0, why_it_failed(ref)
    env.update(
        ACCELERATE_USE_CPU="1",
        HF_COLOSSAL_AUTO_MESH_SHAPE="1x2",
        HF_COLOSSAL_AUTO_SAVE_PLAN_PATH=str(tmp_path / "plan.json"),
    )
    cmd = accelerate_launch_command("-m", "hf_colossal_auto.run", script, "--out", str(tmp_path / "par"))
    elastic = [
        "--elastic-mesh",
        "2x1",
        "--elastic-dp-mode",
        "fsdp",
        "--elastic-from",
        str(tmp_path / "ref" / "state"),
    ]
    par = subprocess.run([*cmd, *elastic], env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert par.returncode == 0, why_it_failed(par)
    assert "Plan for GPT2LMHeadModel on 2 x cpu: mesh dp=1 x tp=2" in par.stdout  # summary printed once
    assert par.stdout.count("Plan for GPT2LMHeadModel on 2 x cpu: mesh dp=1 x tp=2") == 1
    one = json.loads((tmp_path / "ref" / "result.json").read_text())
    two = json.loads((tmp_path / "par" / "result.json").read_text())
    assert one["processes"] == 1 and two["processes"] == 2
    assert two["mesh"] == [1, 2] and two["sharded_params"] > 0
    assert two["model_class"] == "GPT2LMHeadModel"  # not wrapped in DDP
    assert two["losses"] == pytest.approx(one["losses"], abs=1e-5)
    assert two["losses"][-1] != two["losses"][0]
    assert two["resumed_losses"] == pytest.approx(two["losses"][3:], abs=1e-6)
    assert two["learning_rate"] == pytest.approx(one["learning_rate"])
    assert (tmp_path / "plan.json").is_file()
    from multiproc.check_accelerate import resume_elsewhere

    from hf_colossal_auto.integrations import AutoParallelAccelerator

    settings = SimpleNamespace(model="tiny-gpt2", global_batch=8, seq=16, steps=5, save_at=3)
    alone = resume_elsewhere(
        AutoParallelAccelerator(step_scheduler_with_optimizer=False),
        [str(tmp_path / "par" / "state")],
        settings,
    )
    assert [r["mesh"] for r in two["elastic"]] == [[2, 1], [2, 1]]
    assert {r["dp_mode"] for r in two["elastic"]} == {"fsdp"}
    for case in [*two["elastic"], *alone]:
        assert case["losses"] == pytest.approx(two["losses"][3:], abs=1e-5), case["state"]
        assert case["learning_rate"] == pytest.approx(one["learning_rate"]), case["state"]
    # split_batches: the loader yields global batches, the plan is made for that size, the losses are the same
    split = subprocess.run(
        [*cmd[:-2], "--out", str(tmp_path / "split"), "--split-batches"],
        env=env, capture_output=True, text=True, timeout=300, cwd=ROOT,
    )  # fmt: skip
    assert split.returncode == 0, why_it_failed(split)
    three = json.loads((tmp_path / "split" / "result.json").read_text())
    assert three["mesh"] == [1, 2] and three["global_batch_planned"] == 8
    assert three["losses"] == pytest.approx(one["losses"], abs=1e-5)

    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "par" / "export").eval()
    samples = torch.randint(
        0, loaded.config.vocab_size, (8 * 5, 16), generator=torch.Generator().manual_seed(1)
    )
    with torch.no_grad():
        eval_loss = float(loaded(input_ids=samples[:8], labels=samples[:8]).loss)
    assert eval_loss == pytest.approx(two["eval_loss"], abs=1e-5)
    assert two["eval_loss"] == pytest.approx(one["eval_loss"], abs=1e-5)
    assert two["eval_first_tokens"] == one["eval_first_tokens"] == samples[:11, 0].tolist()


def test_pipeline_setting_from_constructor_environment_and_yaml(clean_env, tmp_path):
    """``pipeline``: unset searches stages (plan_model's None, the accelerator's default), 'auto' too, 1 forbids
    them, >= 2 fixes the degree; from the constructor, HF_COLOSSAL_AUTO_PIPELINE or the YAML; bad values and a
    fixed degree beside mesh_shape are refused naming the setting."""
    assert "pipeline" not in AutoParallelPlugin().planner_kwargs()
    clean_env.setenv("HF_COLOSSAL_AUTO_PIPELINE", "auto")
    assert AutoParallelPlugin().planner_kwargs()["pipeline"] is None
    clean_env.setenv("HF_COLOSSAL_AUTO_PIPELINE", "1")
    assert AutoParallelPlugin().planner_kwargs()["pipeline"] == 1
    assert AutoParallelPlugin(pipeline=2).planner_kwargs()["pipeline"] == 2
    clean_env.setenv("HF_COLOSSAL_AUTO_PIPELINE", "two")
    with pytest.raises(PluginConfigError, match="HF_COLOSSAL_AUTO_PIPELINE.*'auto'"):
        AutoParallelPlugin()
    clean_env.delenv("HF_COLOSSAL_AUTO_PIPELINE")
    clean_env.setenv("HF_COLOSSAL_AUTO_CONFIG", _yaml(tmp_path, "pipeline: 4\n"))
    assert AutoParallelPlugin().planner_kwargs()["pipeline"] == 4
    with pytest.raises(PluginConfigError, match="drop mesh_shape"):
        AutoParallelPlugin(mesh_shape="1x2")


def test_pipeline_stages_are_planned_for_the_loop_that_runs_them():
    """``plan_for_loop``: without accumulation the stages are searched (or fixed) on the step's batch, the
    plan without stages in one piece; with accumulation a search keeps to plans without stages (k micro-batches
    on the whole batch) and a fixed degree plans one forward's part (each forward runs the schedule)."""
    from hf_colossal_auto.integrations.accumulation import plan_for_loop

    calls = []

    def plan(batch, micro_batches, pipeline):
        calls.append((batch["input_ids"].shape[0], micro_batches, pipeline))
        return SimpleNamespace(micro_batches=micro_batches)

    batch = {"input_ids": torch.zeros(8, 4, dtype=torch.long), "labels": torch.zeros(8, 4, dtype=torch.long)}
    settings = ("batch_size", "steps")
    for steps, pipeline, want in [
        (1, None, (8, 1, None)),
        (1, 2, (8, 1, 2)),
        (1, 1, (8, 1, 1)),
        (2, None, (8, 2, 1)),
        (2, 2, (4, 1, 2)),
    ]:
        calls.clear()
        plan_for_loop(plan, batch, steps, pipeline, 8 // (2 * steps), 2, settings)
        assert calls == [want], (steps, pipeline, calls)


def test_accumulation_steps_are_planned_as_micro_batches(clean_env, accelerate_state, monkeypatch):
    """Accelerator(gradient_accumulation_steps=2): the plan is made for the optimizer step's global batch (two
    loader batches per process) as 2 micro-batches, the loop accelerate's accumulate runs (one process here:
    planning only, with rank 0's call made directly)."""
    from hf_colossal_auto.integrations import AutoParallelAccelerator
    from hf_colossal_auto.integrations import accelerator as accelerator_module
    from hf_colossal_auto.models import build_model, make_example_inputs

    monkeypatch.setattr(accelerator_module, "plan_on_one_rank", lambda make, **_: make())
    model = build_model("tiny-gpt2", device="cpu")
    plugin = AutoParallelPlugin(device="cpu", example_inputs=make_example_inputs(model, 4, 16))
    accelerator = AutoParallelAccelerator(
        cpu=True, gradient_accumulation_steps=2, auto_parallel_plugin=plugin
    )
    plan = accelerator._make_plan(model, [], [])
    assert plan.micro_batches == 2 and plan.global_batch_size == 8


def test_routing_setting_reaches_the_planner_and_is_checked(
    clean_env, accelerate_state, monkeypatch, tmp_path
):
    """``routing`` (constructor, ``HF_COLOSSAL_AUTO_ROUTING`` or YAML): "measure" or a histogram file, refused
    otherwise where it is set; with "measure" the first-call plan of a MoE model is priced under the routing
    of its planning batch (one process here: planning only, rank 0's call made directly)."""
    from hf_colossal_auto.integrations import AutoParallelAccelerator
    from hf_colossal_auto.integrations import accelerator as accelerator_module
    from hf_colossal_auto.models import build_model, make_example_inputs

    with pytest.raises(PluginConfigError, match="neither 'measure' nor a file"):
        AutoParallelPlugin(routing=str(tmp_path / "missing.json"))
    clean_env.setenv("HF_COLOSSAL_AUTO_ROUTING", "measure")
    assert AutoParallelPlugin().planner_kwargs()["routing"] == "measure"

    monkeypatch.setattr(accelerator_module, "plan_on_one_rank", lambda make, **_: make())
    torch.manual_seed(0)
    model = build_model("tiny-mixtral", device="cpu")
    plugin = AutoParallelPlugin(device="cpu", example_inputs=make_example_inputs(model, 4, 16))
    accelerator = AutoParallelAccelerator(cpu=True, auto_parallel_plugin=plugin)
    plan = accelerator._make_plan(model, [], [])
    assert plan.moe_load == "measured" and set(plan.moe_routing) == {
        f"model.layers.{i}.mlp.experts" for i in range(model.config.num_hidden_layers)
    }


def test_dp_modes_are_the_planners(clean_env):
    """The plugin takes every data-parallel mode ``plan_model`` does, "ddp-ep" and "fsdp-ep" by name included."""
    from hf_colossal_auto.integrations.plugin import DP_MODES
    from hf_colossal_auto.solve.planner import DP_MODES as PLANNER_DP_MODES
    from hf_colossal_auto.solve.planner import EXPERT_DP_KEY, EXPERT_DP_KEYS, EXPERT_FSDP_KEY

    assert set(EXPERT_DP_KEYS) == {EXPERT_DP_KEY, EXPERT_FSDP_KEY}
    assert set(DP_MODES) == {*PLANNER_DP_MODES, EXPERT_DP_KEY, EXPERT_FSDP_KEY}
    clean_env.setenv("HF_COLOSSAL_AUTO_DP_MODES", "ddp-ep")
    assert AutoParallelPlugin().planner_kwargs()["dp_modes"] == ("ddp-ep",)
    clean_env.setenv("HF_COLOSSAL_AUTO_DP_MODES", "fsdp-ep")
    assert AutoParallelPlugin().planner_kwargs()["dp_modes"] == ("fsdp-ep",)


def test_context_parallel_setting_from_constructor_environment_and_yaml(clean_env, tmp_path):
    """``context_parallel``: unset plans without cp (the default), 'auto' searches the cp degrees (plan_model's
    None), >= 2 fixes the degree; from the constructor, HF_COLOSSAL_AUTO_CONTEXT_PARALLEL or the YAML. A fixed
    degree keeps the pipeline search off (the runtime runs them apart), beside a fixed pp degree it is refused,
    as are bad values, naming the setting."""
    from hf_colossal_auto.integrations.plugin import stages_and_context_parallel

    assert "context_parallel" not in AutoParallelPlugin().planner_kwargs()
    clean_env.setenv("HF_COLOSSAL_AUTO_CONTEXT_PARALLEL", "auto")
    assert AutoParallelPlugin().planner_kwargs()["context_parallel"] is None
    assert AutoParallelPlugin(context_parallel=2).planner_kwargs()["context_parallel"] == 2
    clean_env.setenv("HF_COLOSSAL_AUTO_CONTEXT_PARALLEL", "0")
    with pytest.raises(PluginConfigError, match="HF_COLOSSAL_AUTO_CONTEXT_PARALLEL.*cp degree"):
        AutoParallelPlugin()
    clean_env.delenv("HF_COLOSSAL_AUTO_CONTEXT_PARALLEL")
    clean_env.setenv("HF_COLOSSAL_AUTO_CONFIG", _yaml(tmp_path, "context_parallel: 4\n"))
    assert AutoParallelPlugin().planner_kwargs()["context_parallel"] == 4
    with pytest.raises(PluginConfigError, match="both fixed.*set one of them to 1"):
        AutoParallelPlugin(pipeline=2)
    assert stages_and_context_parallel(None, 2) == (1, 2)  # stages not searched beside a fixed cp
    assert stages_and_context_parallel(2, None) == (2, 1)
    assert stages_and_context_parallel(None, None) == (None, None)  # both searched: the planner's, each alone


@pytest.mark.slow
def test_accelerate_loop_and_gpt_recipe_under_context_parallelism(tmp_path):
    """One ``accelerate launch`` of 2 CPU processes (tests/multiproc/check_accelerate_cp.py): an accelerate loop
    under ``AutoParallelPlugin(context_parallel=2)`` reads, on both processes, the union of the two batches plain
    accelerate gives them at each step (one replica: ``data_parallel_info`` says so) and trains like plain
    accelerate (every step's loss within 1e-5); a sequence that 2 x cp chunks cannot cut raises on both ranks,
    saying what to do; the GPT recipe's default preset (dropout on: attention 0.1, planned from CPU SDPA's math
    path) runs with ``--context_parallel 2 --seq_len 64`` under a cp 2 plan."""
    script = str(ROOT / "tests" / "multiproc" / "check_accelerate_cp.py")
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("HF_COLOSSAL_AUTO_") or k.endswith("CALIBRATE")
    }
    env.update(ACCELERATE_USE_CPU="1", OMP_NUM_THREADS="1", HF_COLOSSAL_AUTO_NO_CALIBRATE="1")
    cmd = accelerate_launch_command(script, "--out", str(tmp_path), "--recipe-out", str(tmp_path / "gpt"))
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for rank in ranks:
        assert rank["cp_size"] == 2 and rank["mesh"] == [1, 2, 1], rank["mesh"]
        assert rank["info"] == {"rank": 0, "size": 1, "cp_size": 2, "group": 2}
        union = [a + b for a, b in zip(ranks[0]["plain_rows"], ranks[1]["plain_rows"], strict=True)]
        assert rank["cp_rows"] == union
        assert rank["cp_losses"] == pytest.approx(ranks[0]["plain_losses"], abs=1e-5)
        assert "2 x cp = 4 equal chunks" in rank["bad_length_error"]
    from hf_colossal_auto.plan import Plan

    assert Plan.load(tmp_path / "gpt" / "plan.json").cp_size == 2
    records = [json.loads(line) for line in (tmp_path / "gpt" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3]
    assert records[0]["tokens"] == 2 * 2 * 64  # both processes' rows, each read by both cp ranks, once
