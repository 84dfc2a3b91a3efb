"""Faults and bad input (issue 15): every rank fails the same way and fast, a lost rank ends the job, and a
killed run resumes from its checkpoint with the uninterrupted run's losses. docs/reliability.md lists them."""

from __future__ import annotations

import copy
import json
import logging
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torchrun_launch import accelerate_launch_command, run_torchrun, why_it_failed

from hf_colossal_auto import apply_plan, build_model, make_example_inputs, plan_model
from hf_colossal_auto._torch_compat import fake_process_group, local_tensor_mode
from hf_colossal_auto.apply import build_mesh
from hf_colossal_auto.apply.agree import as_timedelta, describe_error, rebuild_error
from hf_colossal_auto.solve.problem import InfeasibleError

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ROOT / "recipes"
SCRIPT = ROOT / "tests" / "multiproc" / "check_failures.py"
# Bounds on the timings docs/reliability.md states, each below 10x the stated figure (a 10x regression fails)
# and far enough above it to hold on a loaded 2-core machine.
PLANNING_ERROR_WALL_S = 45.0  # documented: each planning error on every rank in 1.3-5.6 s
PLANNING_ERROR_CPU_S = 20.0  # rank 0's CPU seconds per case: 2.2-6.5 s measured
STUCK_PEER_S = 10.0  # documented: raises after 3.0 s (timeout=3)
KILLED_RANK_S = 8.0  # documented: the job exits 0.1-1 s after the kill


# ----------------------------------------------------------------------------------------- in one process
def test_an_error_is_rebuilt_with_its_type_message_and_attributes():
    error = InfeasibleError("no plan fits 1 KiB", min_required=123.0, exact=True, choice={"a": 1})
    rebuilt = rebuild_error(describe_error(error), source_rank=0, what="planning")
    assert type(rebuilt) is InfeasibleError and str(rebuilt) == "no plan fits 1 KiB"
    assert (rebuilt.min_required, rebuilt.exact, rebuilt.choice) == (123.0, True, {"a": 1})
    assert any("raised on rank 0 while planning" in note for note in rebuilt.__notes__)


def test_an_error_class_that_cannot_be_imported_becomes_a_runtime_error_with_its_name():
    class LocalError(Exception):
        pass

    rebuilt = rebuild_error(describe_error(LocalError("boom")), source_rank=1, what="planning")
    assert type(rebuilt) is RuntimeError and "LocalError: boom" in str(rebuilt)


@pytest.mark.parametrize("bad", [0, -1.0])
def test_timeout_must_be_positive(bad):
    with pytest.raises(ValueError, match="positive number of seconds"):
        as_timedelta(bad)


# ----------------------------------------------------------------------------------------- under torchrun
def _failures(*args: str) -> tuple[subprocess.CompletedProcess, float]:
    """``check_failures.py`` on 2 ranks, whatever its exit status, and the seconds the whole launch took."""
    start = time.perf_counter()
    proc = run_torchrun(str(SCRIPT), *args, check=False, env={"ACCELERATE_USE_CPU": "1"})
    return proc, time.perf_counter() - start


@pytest.fixture(scope="module")
def planning_launch(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    """``check_failures.py --scenario planning --batch-shapes`` on 2 ranks: the planning errors, then in the
    same processes check_batch_shapes.py's check (its figures to ``batch_shapes.json``): starting two processes
    and importing torch/transformers costs more than either check. The launch and its output folder."""
    out = tmp_path_factory.mktemp("planning")
    proc, _ = _failures(
        "--out", str(out), "--scenario", "planning", "--batch-shapes", str(out / "batch_shapes.json")
    )
    return proc, out


@pytest.mark.slow
def test_planning_errors_reach_every_rank_with_the_same_type_and_message(planning_launch):
    """An impossible budget through autoparallelize, the accelerator and the callback; a plan only rank 1's
    model does not fit. Before: rank 1 waited in the plan broadcast for the 30-minute process-group timeout."""
    proc, out = planning_launch
    assert proc.returncode == 0, why_it_failed(proc)
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    for case in ("autoparallelize", "accelerator", "callback"):
        assert ranks[0][case]["type"] == ranks[1][case]["type"] == "InfeasibleError", case
        assert ranks[0][case]["message"] == ranks[1][case]["message"]
        assert "the smallest per-device memory any plan needs is" in ranks[0][case]["message"]
    for rank in ranks:
        assert rank["foreign_plan"]["type"] == "PlanMismatchError"
        assert "lm_head.weight" in rank["foreign_plan"]["message"]
        # each error arrived in seconds instead of a hang until the process-group timeout (30 minutes by
        # default): documented 1.3-5.6 s wall; the bound catches a 10x regression yet holds on a loaded machine
        for case in ("autoparallelize", "accelerator", "callback", "foreign_plan"):
            assert rank[case]["seconds"] < PLANNING_ERROR_WALL_S, (case, rank[case])
    # rank 0 plans, so its CPU time is the work (2.2-6.5 s measured), which other jobs do not inflate
    for case in ("autoparallelize", "accelerator", "callback", "foreign_plan"):
        assert ranks[0][case]["cpu_seconds"] < PLANNING_ERROR_CPU_S, (case, ranks[0][case])
    assert "Running HiGHS" not in proc.stdout + proc.stderr  # the solver's banner goes to the debug log


@pytest.mark.slow
def test_planning_past_its_limit_fails_on_every_rank_and_slow_planning_outlives_the_collective_timeout(
    planning_launch,
):
    """``autoparallelize(timeout=0.1)`` (and the plugin's and callback's ``timeout=0.1``): every rank raises the
    same TookTooLongError naming the model and where rank 0's planning was (before: rank 1 timed out in the plan broadcast with a message naming nothing, as
    xLSTM did in the coverage sweep). And work on rank 0 twice as long as the 2 s collective timeout reaches
    every rank: the others wait in heartbeats, not in one broadcast."""
    proc, out = planning_launch
    assert proc.returncode == 0, why_it_failed(proc)
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    limit = [rank["planning_limit"] for rank in ranks]
    assert limit[0]["type"] == limit[1]["type"] == "TookTooLongError", limit
    assert limit[0]["message"] == limit[1]["message"]
    assert "planning LlamaForCausalLM on rank 0 did not finish within 0.1 s" in limit[0]["message"]
    assert "(it was in hf_colossal_auto/" in limit[0]["message"]
    for case in (
        "accelerator_limit",
        "callback_limit",
    ):  # the plugin's and the callback's timeout= bound it too
        got = [rank[case] for rank in ranks]
        assert got[0]["type"] == got[1]["type"] == "TookTooLongError", got
        assert got[0]["message"] == got[1]["message"]
        assert "planning LlamaForCausalLM on rank 0 did not finish within 0.1 s" in got[0]["message"], got
    for rank in ranks:
        slow = rank["slow_planning"]
        assert slow["type"] is None and slow["value"] == "slow plan", slow
        assert slow["seconds"] >= 4.0, slow


@pytest.mark.slow
def test_every_timeout_setting_reaches_the_process_groups(planning_launch):
    """A saved plan applied through each entry point on 2 gloo ranks: the collective timeout of the default group
    and of the plan's tensor-parallel group, read back from the groups, is ``autoparallelize(timeout=)``,
    ``AutoParallelPlugin(timeout=)``, ``HF_COLOSSAL_AUTO_TIMEOUT``, ``AutoParallelCallback(timeout=)`` when
    given and 300 s when not (torch's own is 1800 s, which each case starts from)."""
    proc, out = planning_launch
    assert proc.returncode == 0, why_it_failed(proc)
    want = {
        "autoparallelize": 11.0,
        "autoparallelize default": 300.0,
        "plugin": 12.0,
        "environment": 13.0,
        "plugin default": 300.0,
        "callback": 14.0,
        "callback default": 300.0,
    }
    for rank in (0, 1):
        seen = json.loads((out / f"rank{rank}.json").read_text())["timeouts"]
        assert seen == {case: [seconds, seconds] for case, seconds in want.items()}, rank


@pytest.mark.slow
def test_a_peer_that_stops_answering_ends_the_job_after_the_timeout(tmp_path):
    proc, seconds = _failures("--out", str(tmp_path), "--scenario", "stuck-peer")
    assert proc.returncode != 0
    result = json.loads((tmp_path / "rank0.json").read_text())
    assert result["step"] == 2 and "Timed out waiting 3000ms" in result["message"], result
    # it waited out its 3 s timeout, then ended instead of hanging (documented: after 3.0 s; a 10x longer wait
    # fails)
    assert 3.0 <= result["seconds"] < STUCK_PEER_S, result
    assert seconds < 600


def _gpt_recipe(out: Path, *extra: str) -> list[str]:
    return [
        *accelerate_launch_command(),
        str(RECIPES / "pretrain_gpt.py"), "--model", "tiny", "--per_device_batch_size", "4", "--seq_len", "64",
        "--synthetic_documents", "300", "--warmup_steps", "1", "--lr", "3e-3", "--eval_steps", "0", "--max_eval_batches", "2",
        "--mesh_shape", "1x2", "--output_dir", str(out), *extra,
    ]  # fmt: skip


def _metrics(out: Path) -> dict[int, float]:
    path = out / "metrics.jsonl"
    if not path.is_file():
        return {}
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip().endswith("}")]
    return {r["step"]: r["loss"] for r in rows}


def _worker(launcher_pid: int, local_rank: int) -> int:
    """The pid of the launcher's worker process with ``LOCAL_RANK=local_rank``."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            environ = (entry / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        if parent == launcher_pid and f"LOCAL_RANK={local_rank}".encode() in environ:
            return int(entry.name)
    raise AssertionError(f"no worker with LOCAL_RANK={local_rank} under pid {launcher_pid}")


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="finds the worker to kill through /proc")
def test_a_killed_rank_ends_the_job_and_the_recipe_resumes_with_the_same_losses(tmp_path):
    """The GPT recipe on a 1 x 2 plan, checkpointing every 2 steps; rank 1 is SIGKILLed once step 3 is logged.
    The job must end with an error naming the lost rank; resuming from the checkpoint of step 2 must give the
    killed run's own step-3 loss (the uninterrupted run up to that point) exactly."""
    env = {
        **os.environ,
        "ACCELERATE_USE_CPU": "1",
        "OMP_NUM_THREADS": "1",
        "HF_COLOSSAL_AUTO_NO_CALIBRATE": "1",
    }
    first, second = tmp_path / "first", tmp_path / "second"
    launcher = subprocess.Popen(
        _gpt_recipe(first, "--max_steps", "40", "--save_steps", "2"),
        env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 300
        while 3 not in _metrics(first):
            assert launcher.poll() is None, launcher.stdout.read()[-4000:]
            assert time.monotonic() < deadline, "the recipe did not reach step 3"
            time.sleep(0.1)
        os.kill(_worker(launcher.pid, 1), signal.SIGKILL)
        killed = time.monotonic()
        output, _ = launcher.communicate(timeout=120)
        ended = time.monotonic() - killed
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode != 0
    assert ended < KILLED_RANK_S, ended  # documented 0.1-1 s
    assert "local_rank: 1" in output and "SIGKILL" in output, output[-3000:]
    straight = _metrics(first)
    checkpoint = first / "checkpoints" / "step_2"
    assert (checkpoint / "recipe_state.json").is_file()
    resumed_run = subprocess.run(
        _gpt_recipe(second, "--max_steps", "3", "--resume_from_checkpoint", str(checkpoint)),
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert resumed_run.returncode == 0, why_it_failed(resumed_run)
    assert _metrics(second) == {3: straight[3]}


@pytest.mark.slow
def test_a_batch_that_does_not_split_like_the_plans_still_trains_exactly(planning_launch):
    """The plan splits GPT-2's residual stream and loss over the batch on the tensor-parallel axis (made for 8
    rows); 3 rows do not split in two. Before: DTensor refused to flatten the uneven shard (the recipes' last
    eval batch crashed). Now the batch is kept whole there, and loss and gradients equal one process's. (Run by
    check_batch_shapes.py in the planning launch.)"""
    proc, out = planning_launch
    assert proc.returncode == 0, why_it_failed(proc)
    result = json.loads((out / "batch_shapes.json").read_text())
    assert result["batch_split_modules"], (
        "the plan must split the batch over tp for this test to mean anything"
    )
    assert result["eval_losses"][1] == pytest.approx(result["eval_losses"][0], abs=1e-5)
    assert result["train_losses"][1] == pytest.approx(result["train_losses"][0], abs=1e-5)
    assert result["max_grad_diff"] < 1e-5


# ----------------------------------------------------------------------------------------- unknown ops
@torch.library.custom_op("hfca_test::mystery_act", mutates_args=())
def _mystery_act(x: torch.Tensor) -> torch.Tensor:
    """SiLU as an opaque custom op: DTensor has no sharding rule for it, nor does the planner."""
    return torch.nn.functional.silu(x)


@_mystery_act.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def _mystery_setup(ctx, inputs, output) -> None:
    ctx.save_for_backward(inputs[0])


def _mystery_backward(ctx, grad: torch.Tensor) -> torch.Tensor:
    (x,) = ctx.saved_tensors
    s = torch.sigmoid(x)
    return grad * s * (1 + x * (1 - s))


_mystery_act.register_autograd(_mystery_backward, setup_context=_mystery_setup)


class _MysteryActivation(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _mystery_act(x)


def test_an_unknown_op_in_a_real_model_is_planned_and_run_replicated_with_warnings(caplog):
    """A Llama whose MLP activation is a custom op no rule covers: the planner warns and prices it replicated,
    the runtime warns and runs it replicated (it raised "does not have a sharding strategy registered"), and
    a step on 2 simulated ranks gives one process's loss and gradients."""
    torch.manual_seed(0)
    model = build_model("tiny-llama", device="cpu")
    model.eval()
    for layer in model.model.layers:
        layer.mlp.act_fn = _MysteryActivation()
    batch = make_example_inputs(model, 4, 16)
    reference = copy.deepcopy(model)
    want = reference(**batch).loss
    want.backward()
    with caplog.at_level(logging.WARNING):
        plan = plan_model(model, batch, num_devices=2, device="cpu", mesh_shape=(1, 2))
    assert plan.replicated_ops == ["hfca_test.mystery_act.default"]
    if dist.is_initialized():
        dist.destroy_process_group()
    fake_process_group(2)
    try:
        with caplog.at_level(logging.WARNING), local_tensor_mode(2):
            apply_plan(model, plan, build_mesh(plan, "cpu"))
            got = model(**batch).loss
            got.backward()
            for name, p in model.named_parameters():
                grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
                for rank_grad in grad._local_tensors.values() if hasattr(grad, "_local_tensors") else [grad]:
                    torch.testing.assert_close(rank_grad, reference.get_parameter(name).grad, msg=name)
            losses = got._local_tensors.values() if hasattr(got, "_local_tensors") else [got]
    finally:
        dist.destroy_process_group()
    for loss in losses:
        assert float(loss.detach()) == pytest.approx(float(want), abs=1e-6)
    warned = [r.getMessage() for r in caplog.records if "hfca_test.mystery_act.default" in r.getMessage()]
    assert any("running it replicated" in w for w in warned)  # the planner
    assert any("the plan runs it replicated" in w for w in warned)  # the runtime
