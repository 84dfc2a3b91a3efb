"""AutoParallelCallback: a transformers Trainer trained, evaluated, checkpointed and exported under a plan.

The multi-process tests run ``tests/multiproc/check_trainer.py`` on 2 gloo ranks and compare with the plain
single-process Trainer on the same global batch; the others check the errors and helpers without processes.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch.utils.data import Dataset
from torchrun_launch import why_it_failed
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

from hf_colossal_auto.integrations.trainer import (
    AutoParallelCallback,
    _turn_off_trainer_recompute,
    check_trainer_compatible,
    example_global_batch,
)
from hf_colossal_auto.integrations.trainer_checkpoints import load_consolidated
from hf_colossal_auto.models import build_model, make_example_inputs

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "multiproc" / "check_trainer.py"


class _Rows(Dataset):
    def __init__(self, rows: list[dict]) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        return self.rows[i]


def _token_rows(model, n: int, seq: int = 16, *, extra_text: bool = False) -> _Rows:
    batch = make_example_inputs(model, n, seq, seed=1)
    rows = [{k: v[i] for k, v in batch.items()} for i in range(n)]
    if extra_text:
        for i, row in enumerate(rows):
            row["text"] = f"sample {i}"  # a column the model does not take: the Trainer drops it
    return _Rows(rows)


def _args(tmp_path: Path, **overrides) -> TrainingArguments:
    defaults = dict(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=2,
        max_steps=1,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        save_strategy="no",
    )
    return TrainingArguments(**{**defaults, **overrides})


# --- bad input, without processes ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"mesh": (1, 2)}, TypeError, "unknown setting"),
        ({"mesh_shape": (2,)}, ValueError, r"\(dp, tp\)"),
        ({"mesh_shape": (0, 2)}, ValueError, r"\(dp, tp\)"),
        ({"memory_budget": 1.5}, TypeError, "memory_budget"),
        ({"device": 3}, TypeError, "device kind"),
        ({"time_limit_s": 0}, ValueError, "time_limit_s"),
        ({"plan_path": "/nonexistent/plan.json"}, FileNotFoundError, "plan_path"),
        ({"pipeline": "sometimes"}, ValueError, "'auto'"),
        ({"pipeline": 0}, ValueError, "pp degree"),
        ({"pipeline": 2, "mesh_shape": (1, 2)}, ValueError, "drop mesh_shape"),
    ],
)
def test_bad_settings_fail_at_construction(kwargs, error, match):
    with pytest.raises(error, match=match):
        AutoParallelCallback(**kwargs)


def test_pipeline_setting_is_searched_by_default_and_kept_off_for_a_loss_outside_the_model(
    tiny_model, tmp_path, monkeypatch
):
    """The callback searches pipeline stages by default (None for plan_model), HF_COLOSSAL_AUTO_PIPELINE or
    pipeline= fix or forbid them; a Trainer computing its loss outside the model (compute_loss_func, an
    overridden compute_loss), which a pipelined training forward cannot run, keeps a search off."""
    from hf_colossal_auto.integrations.trainer import _pipeline_for

    monkeypatch.delenv("HF_COLOSSAL_AUTO_PIPELINE", raising=False)
    assert AutoParallelCallback().pipeline is None
    assert AutoParallelCallback(pipeline="auto").pipeline is None
    monkeypatch.setenv("HF_COLOSSAL_AUTO_PIPELINE", "1")
    assert AutoParallelCallback().pipeline == 1
    assert AutoParallelCallback(pipeline=2).pipeline == 2  # the argument wins
    model = tiny_model()
    plain = Trainer(model=model, args=_args(tmp_path), train_dataset=_token_rows(model, 4))
    assert _pipeline_for(plain, None) is None
    custom = Trainer(
        model=model,
        args=_args(tmp_path),
        train_dataset=_token_rows(model, 4),
        compute_loss_func=lambda outputs, labels, num_items_in_batch=None: outputs.logits.sum(),
    )
    assert _pipeline_for(custom, None) == 1 and _pipeline_for(custom, 2) == 2  # a fixed degree is the user's

    class Subclassed(Trainer):
        def compute_loss(self, model, inputs, **kwargs):
            return super().compute_loss(model, inputs, **kwargs)

    subclassed = Subclassed(model=model, args=_args(tmp_path), train_dataset=_token_rows(model, 4))
    assert _pipeline_for(subclassed, None) == 1


@pytest.mark.parametrize(
    ("setting", "value", "match"),
    [
        ("fsdp", "full_shard", "fsdp="),
        ("deepspeed", {"zero_optimization": {"stage": 2}}, "deepspeed="),
        ("parallelism_config", object(), "parallelism_config="),
        ("auto_find_batch_size", True, "auto_find_batch_size"),
    ],
)
def test_conflicting_trainer_settings_are_refused(tiny_model, tmp_path, setting, value, match):
    """Another parallelism (or a setting the plan cannot follow) in the Trainer's arguments: a clear error that
    names the setting, before any training."""
    model = tiny_model("tiny-llama")
    trainer = Trainer(model=model, args=_args(tmp_path), train_dataset=_token_rows(model, 4))
    object.__setattr__(trainer.args, setting, value)
    with pytest.raises(ValueError, match=match) as info:
        check_trainer_compatible(trainer)
    assert "remove the callback" in str(info.value)


def test_a_model_parallelised_before_the_trainer_is_refused(tiny_model, tmp_path):
    model = tiny_model("tiny-llama")
    trainer = Trainer(model=model, args=_args(tmp_path), train_dataset=_token_rows(model, 4))
    model._hf_colossal_auto_plan = object()  # what apply_plan leaves on the model
    with pytest.raises(ValueError, match="plan_path"):
        check_trainer_compatible(trainer)


def test_callback_in_the_trainer_constructor_checks_the_trainer(tiny_model, tmp_path):
    """The one-line usage reaches the Trainer from the callback's on_init_end: model_init is refused there."""
    model = tiny_model("tiny-llama")
    with pytest.raises(ValueError, match="model_init"):
        Trainer(
            model_init=lambda: tiny_model("tiny-llama"),
            args=_args(tmp_path),
            train_dataset=_token_rows(model, 4),
            callbacks=[AutoParallelCallback()],
        )


def test_single_process_trains_as_usual_with_a_warning(tiny_model, tmp_path, caplog):
    model = tiny_model("tiny-llama")
    with caplog.at_level(logging.WARNING, logger="hf_colossal_auto.integrations.trainer"):
        trainer = Trainer(
            model=model,
            args=_args(tmp_path, max_steps=2),
            train_dataset=_token_rows(model, 8),
            callbacks=[AutoParallelCallback()],
        )
    assert "nothing to parallelise" in caplog.text
    assert trainer.train().global_step == 2
    assert not hasattr(model, "_hf_colossal_auto_plan")


def test_trainer_recompute_is_turned_off_in_favour_of_the_plan(tmp_path, caplog):
    args = _args(tmp_path, gradient_checkpointing=True)
    assert args.activation_checkpointing
    with caplog.at_level(logging.WARNING, logger="hf_colossal_auto.integrations.trainer"):
        _turn_off_trainer_recompute(args)
    assert not args.activation_checkpointing and not args.gradient_checkpointing
    assert "plan decides" in caplog.text


# --- helpers, without processes -----------------------------------------------------------------------------


def test_example_global_batch_is_collated_like_the_trainer_and_keeps_rng(tiny_model, tmp_path):
    """The planning batch: n samples through the Trainer's collator with unused columns removed; the run's
    random streams are not advanced by building it."""
    model = tiny_model("tiny-llama")
    trainer = Trainer(model=model, args=_args(tmp_path), train_dataset=_token_rows(model, 6, extra_text=True))
    torch.manual_seed(3)
    expected_next = torch.rand(1)
    torch.manual_seed(3)
    from hf_colossal_auto.integrations.data import preserved_rng

    with preserved_rng():
        batch = example_global_batch(trainer, 8)  # more than the dataset holds: it wraps around
        torch.rand(5)
    assert torch.equal(torch.rand(1), expected_next)
    assert set(batch) == {"input_ids", "attention_mask", "labels"}
    assert batch["input_ids"].shape == (8, 16)
    assert torch.equal(batch["input_ids"][6], batch["input_ids"][0])


def test_example_global_batch_needs_a_dataset(tiny_model, tmp_path):
    model = tiny_model("tiny-llama")
    trainer = Trainer(model=model, args=_args(tmp_path))
    with pytest.raises(ValueError, match="train_dataset"):
        example_global_batch(trainer, 4)


def test_consolidated_weights_load_through_the_sharded_reader(tmp_path):
    """A save_pretrained directory (what save_model writes) loads through load_pretrained, which reads each
    rank's slices only (sharded under a plan on 2 gloo ranks: the elastic resume test's one-process checkpoint
    loaded by the FSDP job); a directory without weights is refused with the way out, a missing key named."""
    torch.manual_seed(1)
    source = build_model("tiny-llama", device="cpu")
    source.save_pretrained(tmp_path / "export")
    torch.manual_seed(0)
    model = build_model("tiny-llama", device="cpu")
    load_consolidated(model, tmp_path / "export")
    for name, value in source.state_dict().items():
        torch.testing.assert_close(model.state_dict()[name], value, msg=name)
    with pytest.raises(FileNotFoundError, match=r"not a checkpoint.*pretrained=\.\.\."):
        load_consolidated(model, tmp_path)
    from safetensors.torch import load_file, save_file

    weights = load_file(tmp_path / "export" / "model.safetensors")
    del weights["model.norm.weight"]
    save_file(weights, tmp_path / "export" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(Exception, match="model.norm.weight"):
        load_consolidated(model, tmp_path / "export")


def test_rng_state_of_another_world_size_is_taken(tmp_path):
    """A process whose own RNG file the checkpoint lacks (saved by another number of processes) gets the saving
    job's first process's (one process: ``rng_state_0.pth``; N processes: ``rng_state.pth``)."""
    from hf_colossal_auto.integrations.trainer_checkpoints import _load_rng_state

    seen = []

    def original(checkpoint):
        seen.append(sorted((p.name, p.resolve().name) for p in Path(checkpoint).iterdir()))

    (tmp_path / "rng_state_0.pth").write_bytes(b"")
    (tmp_path / "rng_state_1.pth").write_bytes(b"")
    _load_rng_state(original, SimpleNamespace(world_size=1, process_index=0), str(tmp_path))
    assert seen.pop() == [("rng_state.pth", "rng_state_0.pth")]
    _load_rng_state(original, SimpleNamespace(world_size=2, process_index=1), str(tmp_path))
    assert seen.pop()[1] == ("rng_state_1.pth", "rng_state_1.pth")  # its own: the Trainer's usual path
    single = tmp_path / "single"
    single.mkdir()
    (single / "rng_state.pth").write_bytes(b"")
    _load_rng_state(original, SimpleNamespace(world_size=4, process_index=3), str(single))
    assert seen.pop() == [("rng_state_3.pth", "rng_state.pth")]


def test_one_process_optimizer_state_is_matched_by_position():
    """load_full_optimizer_state reads a one-process optimizer.state_dict() into an optimizer built the same way,
    and refuses one built otherwise, naming what differs."""
    from hf_colossal_auto.apply.checkpoint import load_full_optimizer_state

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    groups = [{"params": [model[0].weight, model[1].weight]}, {"params": [model[0].bias, model[1].bias]}]
    saving = torch.optim.AdamW(groups, lr=0.1)
    model(torch.randn(5, 4)).sum().backward()
    saving.step()
    saved = saving.state_dict()
    same = torch.optim.AdamW(
        [{"params": [model[0].weight, model[1].weight]}, {"params": [model[0].bias, model[1].bias]}], lr=0.1
    )
    load_full_optimizer_state(model, same, saved)
    torch.testing.assert_close(
        same.state[model[1].weight]["exp_avg"], saving.state[model[1].weight]["exp_avg"]
    )
    other = torch.optim.AdamW(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"param groups of \[2, 2\] parameters, this optimizer \[4\]"):
        load_full_optimizer_state(model, other, saved)
    swapped = torch.optim.AdamW(
        [{"params": [model[1].weight, model[0].weight]}, {"params": [model[0].bias, model[1].bias]}], lr=0.1
    )
    with pytest.raises(ValueError, match=r"has shape \(3, 4\), but the parameter in that place, 1.weight"):
        load_full_optimizer_state(model, swapped, saved)


# --- 2 gloo processes ---------------------------------------------------------------------------------------


def _run(*args: str, nproc: int | None = 2) -> None:
    """``check_trainer.py args`` on ``nproc`` gloo ranks (None: in one plain process); several runs go in one
    launch, separated by ``--and-then``."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_COLOSSAL_AUTO_NO_CALIBRATE": "1"}
    launcher = (
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
        if nproc
        else [sys.executable]
    )
    proc = subprocess.run(
        [*launcher, str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=400
    )
    assert proc.returncode == 0, why_it_failed(proc)


def _result(path: Path) -> dict:
    return json.loads(path.read_text())


SIX_STEPS = ["--model", "tiny-llama", "--steps", "6"]
# Seq2SeqTrainer with tiny T5, the plan made from the dataset for a 1 x 2 mesh, 2 accumulated micro-batches
SEQ2SEQ = ["--model", "tiny-t5", "--seq2seq", "--steps", "3", "--grad-accum", "2"]
# tiny Mixtral, its MoE layers planned under the routing measured on the planning batch
MOE = ["--model", "tiny-mixtral", "--steps", "3"]


@pytest.fixture(scope="module")
def trainer_runs(tmp_path_factory) -> Path:
    """The distributed runs of the three Trainer cases in ONE torchrun launch of 2 gloo ranks (check_trainer.py
    runs them one after the other, ``--and-then``), then their single-process references in one plain process:
    starting processes and importing torch/transformers cost more than a tiny run. Each case writes
    ``<case>.json`` (2 ranks) and ``<case>-ref.json`` (one process) here, and trains in its own directory.

    Llama (``run``): Megatron placements on a 1 x 2 mesh from a saved plan, checkpoints every 3 steps, exported
    at the end; its reference (batch 4) also checkpoints, evaluates the export and resumes from ``run``'s
    checkpoint-3. The FSDP resume of both checkpoints is ``test_trainer_tracks_single_process_...``'s own
    launch (fresh processes: it needs both checkpoints)."""
    from hf_colossal_auto.solve.planner import evaluate_plan

    root = tmp_path_factory.mktemp("trainer")
    torch.manual_seed(0)
    model = build_model("tiny-llama", device="cpu")
    batch = make_example_inputs(model, 4, 16)
    for name, baseline, mesh in (("plan", "megatron", (1, 2)), ("fsdp-plan", "fsdp", (2, 1))):
        made = evaluate_plan(model, batch, baseline, num_devices=2, device="cpu", mesh_shape=mesh).plan
        made.save(root / f"{name}.json")
    run, seq2seq, moe = (root / name for name in ("run", "seq2seq", "moe"))
    _run(
        *SIX_STEPS, "--plan", str(root / "plan.json"), "--out", f"{run}.json", "--output-dir", str(run),
        "--save-steps", "3", "--export", f"{run}-export",
        "--and-then", *SEQ2SEQ, "--mesh", "1x2", "--out", f"{seq2seq}.json", "--output-dir", str(seq2seq),
        "--save-plan", f"{seq2seq}-plan.json",
        "--and-then", *MOE, "--mesh", "1x2", "--routing", "measure", "--out", f"{moe}.json",
        "--output-dir", str(moe),
    )  # fmt: skip
    _run(
        *SIX_STEPS, "--per-device", "4", "--out", f"{run}-ref.json", "--output-dir", f"{run}-ref",
        "--save-steps", "3", "--eval-export", f"{run}-export", "--then-resume", f"{run}/checkpoint-3",
        "--and-then", *SEQ2SEQ, "--per-device", "4", "--out", f"{seq2seq}-ref.json",
        "--output-dir", f"{seq2seq}-ref",
        "--and-then", *MOE, "--per-device", "4", "--out", f"{moe}-ref.json", "--output-dir", f"{moe}-ref",
        nproc=None,
    )  # fmt: skip
    return root


@pytest.mark.slow
def test_trainer_tracks_single_process_resumes_elastically_and_exports(trainer_runs):
    """tiny Llama, Megatron placements on a 1 x 2 mesh (both ranks read the same batches), per-device batch 2:
    the first six losses equal the plain single-process Trainer's with batch 4; save_model's output loads with
    from_pretrained in one process and gives the distributed run's eval loss. Elastic resume, each a fresh
    model with other weights: checkpoint-3 of the 1 x 2 tensor-parallel run resumed by a 2 x 1 FSDP job and by
    one process, and the one-process reference's checkpoint-3 (``optimizer.pt``) by the FSDP job, all continue
    with the uninterrupted run's losses and learning rates (optimizer moments, step count and schedule
    restored; at steps 5 and 6 the losses depend on them). The FSDP job's save_model exports the weights the
    tensor-parallel run exported."""
    root = trainer_runs
    assert _result(root / "fsdp-plan.json")["dp_mode"] == "fsdp"
    run, resumed, ref = root / "run", root / "resumed", root / "run-ref"
    _run(
        *SIX_STEPS, "--plan", str(root / "fsdp-plan.json"), "--out", f"{resumed}.json",
        "--output-dir", str(resumed), "--resume", f"{run}/checkpoint-3", "--then-resume", f"{ref}/checkpoint-3",
        "--export", f"{resumed}-export",
    )  # fmt: skip

    got, want = _result(root / "run.json"), _result(root / "run-ref.json")
    assert got["mesh"] == [1, 2] and got["sharded_params"] > 0
    assert sorted(got["losses"], key=int) == [str(s) for s in range(1, 7)]
    for step, loss in want["losses"].items():
        assert got["losses"][step] == pytest.approx(loss, abs=1e-5), step
    assert want["losses"]["6"] < want["losses"]["1"]
    assert got["tokens_seen"] == want["tokens_seen"] == 6 * 4 * 16  # counted once per tensor-parallel group
    assert got["total_flos"] == pytest.approx(want["total_flos"])
    assert (run / "checkpoint-3" / "hf_colossal_auto_state").is_dir()
    assert (ref / "checkpoint-3" / "optimizer.pt").is_file()
    elastic = _result(root / "resumed.json")
    assert elastic["mesh"] == [2, 1]
    continued = {
        "tp -> fsdp": (elastic["losses"], elastic["learning_rates"]),
        "tp -> one process": (want["then_resumed_losses"], want["then_resumed_learning_rates"]),
        "one process -> fsdp": (elastic["then_resumed_losses"], elastic["then_resumed_learning_rates"]),
    }
    for case, (losses, rates) in continued.items():
        assert sorted(losses, key=int) == [str(s) for s in range(1, 7)], case  # 1-3: the checkpoint's log
        for step in ("4", "5", "6"):
            assert losses[step] == pytest.approx(got["losses"][step], abs=1e-5), (case, step)
            assert rates[step] == pytest.approx(got["learning_rates"][step], rel=1e-6), (case, step)
    assert want["export_eval_loss"] == pytest.approx(got["eval_loss"], abs=1e-5)
    assert want["eval_loss"] == pytest.approx(got["eval_loss"], abs=1e-5)
    # save_model under the FSDP plan (after an evaluation, which leaves FSDP's root parameters unsharded): the
    # weights the tensor-parallel run exported, which it continued to the same losses
    under_tp = AutoModelForCausalLM.from_pretrained(f"{run}-export").state_dict()
    under_fsdp = AutoModelForCausalLM.from_pretrained(f"{resumed}-export").state_dict()
    assert under_fsdp.keys() == under_tp.keys()
    for name, value in under_tp.items():
        torch.testing.assert_close(
            under_fsdp[name], value, rtol=0, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}"
        )


@pytest.mark.slow
def test_seq2seq_trainer_plans_from_the_dataset(trainer_runs):
    """Seq2SeqTrainer with tiny T5: rank 0 plans from a batch of the training set (mesh 1 x 2 asked), the plan
    is broadcast and applied, and three steps of two accumulated micro-batches give the single-process
    Trainer's losses and eval loss."""
    got, want = _result(trainer_runs / "seq2seq.json"), _result(trainer_runs / "seq2seq-ref.json")
    assert got["mesh"] == [1, 2]
    saved = _result(trainer_runs / "seq2seq-plan.json")
    # the Trainer's accumulation steps are the plan's micro-batches, over the global batch of one optimizer step
    assert saved["mesh_shape"] == [1, 2] and saved["micro_batches"] == 2
    assert saved["global_batch_size"] == 2 * 2 * 2  # per-device 2 x 2 processes x 2 accumulation steps
    for step, loss in want["losses"].items():
        assert got["losses"][step] == pytest.approx(loss, abs=1e-5), step
    assert got["eval_loss"] == pytest.approx(want["eval_loss"], abs=1e-5)


@pytest.mark.slow
def test_trainer_trains_a_mixture_of_experts_model_like_one_process(trainer_runs):
    """tiny Mixtral (router load-balancing loss in the trained loss) under the callback on 2 gloo ranks, the
    planner choosing each MoE layer's strategy on a 1 x 2 mesh under the routing it measured on the planning
    batch (``routing="measure"``): three steps give the plain single-process Trainer's losses (batch 4) and
    eval loss, and the plan names one choice per MoE layer."""
    got, want = _result(trainer_runs / "moe.json"), _result(trainer_runs / "moe-ref.json")
    assert got["mesh"] == [1, 2] and got["moe_load"] == "measured"
    assert len(got["moe_layers"]) == 2 and all(v.startswith("experts: ") for v in got["moe_layers"].values())
    assert sorted(want["losses"], key=int) == ["1", "2", "3"]
    for step, loss in want["losses"].items():
        assert got["losses"][step] == pytest.approx(loss, abs=1e-5), step
    assert got["eval_loss"] == pytest.approx(want["eval_loss"], abs=1e-5)


def test_trainer_under_context_parallelism_trains_like_the_plain_trainer(tmp_path):
    """``AutoParallelCallback(context_parallel=2)`` on 2 gloo ranks (tiny Llama, per-device batch 2, 16 tokens):
    the plan splits each sequence over both ranks (one replica, cp 2), which read the same rows, the union of
    the plain Trainer's two per-process batches; its losses, eval loss and tokens seen are the plain Trainer's
    on the same global batch of 4 in one process (the label count the loss is normalised by is the replica's
    whole count, gathered as the plain Trainer gathers it)."""
    steps = ["--model", "tiny-llama", "--steps", "4"]
    _run(
        *steps,
        "--context-parallel",
        "2",
        "--out",
        f"{tmp_path}/cp.json",
        "--output-dir",
        str(tmp_path / "cp"),
    )
    _run(
        *steps,
        "--per-device",
        "4",
        "--out",
        f"{tmp_path}/ref.json",
        "--output-dir",
        str(tmp_path / "ref"),
        nproc=None,
    )
    got, want = _result(tmp_path / "cp.json"), _result(tmp_path / "ref.json")
    assert got["cp_size"] == 2 and got["mesh"] == [1, 2, 1], got["mesh"]
    assert got["losses"].keys() == want["losses"].keys() and len(want["losses"]) == 4
    for step, loss in want["losses"].items():
        assert got["losses"][step] == pytest.approx(loss, abs=1e-5), step
    assert got["eval_loss"] == pytest.approx(want["eval_loss"], abs=1e-5)
    assert got["tokens_seen"] == want["tokens_seen"]
