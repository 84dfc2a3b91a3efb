"""Faults and bad input under torchrun: every rank must fail the same way, fast (issue 15, item 2).

    torchrun --nproc_per_node 2 tests/multiproc/check_failures.py --out D --scenario planning
    torchrun --nproc_per_node 2 tests/multiproc/check_failures.py --out D --scenario stuck-peer

``planning``: an impossible memory budget through ``autoparallelize``, the ``AutoParallelAccelerator`` and the
``AutoParallelCallback`` in turn, then a plan that only rank 1's model does not fit. Each rank writes
``D/rank<r>.json``: per case, the error type and message it caught and the seconds it took. Then planning that
outlives its limit (``autoparallelize(timeout=0.1)``: every rank raises ``TookTooLongError``), and work on rank 0
that outlives the collective timeout (every rank receives its result: the others wait in heartbeats). Then a saved 1 x 2
plan applied through every entry point with and without a ``timeout`` setting (``autoparallelize``,
``AutoParallelPlugin(timeout=)``, ``HF_COLOSSAL_AUTO_TIMEOUT``, ``AutoParallelCallback(timeout=)``): the
collective timeout each left on the default group and on the plan's tensor-parallel group, read back from the
process groups, under ``timeouts`` in the same file.

With ``--batch-shapes PATH`` (``planning`` only), the same processes then run check_batch_shapes.py's check
(a batch that does not split like the plan's), its figures to PATH: one launch for both.

``stuck-peer``: a 1 x 2 plan applied with ``timeout=3``; at the third step rank 1 stops answering (sleeps, its
sockets open), rank 0 writes how long its collective waited and what it raised, then exits with status 3.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from common import close_gloo, init_gloo

from hf_colossal_auto.integrations.process_exit import finish

TIMEOUT_S = 3.0
IMPOSSIBLE_BUDGET = 64 * 1024  # bytes: below any model's parameters


def _model(vocab: int | None = None) -> torch.nn.Module:
    from hf_colossal_auto.models import build_model, load_config

    config = load_config("tiny-llama")
    if vocab is not None:
        config.vocab_size = vocab
    torch.manual_seed(0)
    return build_model(config, device="cpu")


def _caught(fn) -> dict:
    """What ``fn()`` raised (type, message), the wall seconds it took and this process's CPU seconds in it (which
    the other jobs on a loaded machine do not inflate)."""
    start, cpu = time.perf_counter(), time.process_time()
    raised = {"type": None, "message": ""}
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - what each rank raised is the result
        raised = {"type": type(exc).__name__, "message": str(exc)}
    return {**raised, "seconds": time.perf_counter() - start, "cpu_seconds": time.process_time() - cpu}


def _autoparallelize_case() -> None:
    from hf_colossal_auto import autoparallelize
    from hf_colossal_auto.models import make_example_inputs

    model = _model()
    autoparallelize(model, make_example_inputs(model, 2, 16), memory_budget=IMPOSSIBLE_BUDGET)


def _prepare_under(plugin) -> None:
    """A fresh model, its AdamW and a 4-row loader prepared by an ``AutoParallelAccelerator`` with ``plugin``
    (which plans, since it names no plan)."""
    from torch.utils.data import DataLoader

    from hf_colossal_auto import AutoParallelAccelerator
    from hf_colossal_auto.models import make_example_inputs

    model = _model()
    batch = make_example_inputs(model, 4, 16)
    rows = [{k: v[i] for k, v in batch.items()} for i in range(4)]
    AutoParallelAccelerator(auto_parallel_plugin=plugin, cpu=True).prepare(
        model, torch.optim.AdamW(model.parameters()), DataLoader(rows, batch_size=2)
    )


def _accelerator_case() -> None:
    from hf_colossal_auto import AutoParallelPlugin

    _prepare_under(AutoParallelPlugin(memory_budget=IMPOSSIBLE_BUDGET, device="cpu"))


def _trainer_with(callback, output_dir: Path) -> None:
    """A ``transformers.Trainer`` of a fresh model on 4 rows with ``callback`` (which plans when it is built)."""
    import transformers

    from hf_colossal_auto.models import make_example_inputs

    model = _model()
    batch = make_example_inputs(model, 4, 16)
    rows = [{k: v[i] for k, v in batch.items()} for i in range(4)]
    args = transformers.TrainingArguments(
        output_dir=str(output_dir), per_device_train_batch_size=2, max_steps=1, report_to=[], use_cpu=True
    )
    transformers.Trainer(model=model, args=args, train_dataset=rows, callbacks=[callback])


def _callback_case(out: Path) -> None:
    from hf_colossal_auto import AutoParallelCallback

    _trainer_with(AutoParallelCallback(memory_budget=IMPOSSIBLE_BUDGET, device="cpu"), out / "trainer")


def _foreign_plan_case() -> None:
    """Rank 0 plans for its model; rank 1's model has another vocabulary, so the plan fits rank 0 only."""
    from hf_colossal_auto import apply_plan, plan_model
    from hf_colossal_auto.apply.runtime import plan_on_one_rank
    from hf_colossal_auto.models import make_example_inputs

    model = _model(vocab=None if dist.get_rank() == 0 else 1000)
    plan = plan_on_one_rank(
        lambda: plan_model(model, make_example_inputs(model, 4, 16), num_devices=2, device="cpu")
    )
    apply_plan(model, plan)


SLOW_PLANNING_S = 4.0
"""How long the slow-planning case's work takes: twice the collective timeout it runs under."""


def _slow_planning_case() -> dict:
    """Rank 0 works for all for longer than the default group's collective timeout (2 s, heartbeats every 0.5 s):
    every rank gets its result, none times out. Returns the value every rank received."""
    import datetime

    from hf_colossal_auto._torch_compat import set_group_timeout
    from hf_colossal_auto.apply import agree

    heartbeat, agree.HEARTBEAT_S = agree.HEARTBEAT_S, 0.5
    set_group_timeout(datetime.timedelta(seconds=2), None)
    try:
        got = agree.run_on_one_rank(lambda: time.sleep(SLOW_PLANNING_S) or "slow plan", what="planning")
    finally:
        agree.HEARTBEAT_S = heartbeat
        set_group_timeout(datetime.timedelta(minutes=30), None)
    return {"value": got}


def _join_planning_threads() -> None:
    """Rank 0's planning thread cannot be stopped past its limit: wait for it, so the next case runs alone."""
    import threading

    for thread in threading.enumerate():
        if thread.name.startswith("hf_colossal_auto planning"):
            thread.join()


def _planning_limit_case() -> None:
    """``autoparallelize(timeout=0.1)``: planning tiny-llama takes longer (about 0.5 s on the 2-core machine; a
    limit it met before its planning got faster), so every rank raises TookTooLongError naming the model and
    where rank 0's planning was."""
    from hf_colossal_auto import autoparallelize
    from hf_colossal_auto.models import make_example_inputs

    model = _model()
    try:
        autoparallelize(
            model, make_example_inputs(model, 2, 16), mesh_shape=(1, 2), device="cpu", timeout=0.1
        )
    finally:
        _join_planning_threads()


def _accelerator_limit_case() -> None:
    """``AutoParallelPlugin(timeout=0.1)`` bounds the accelerator's planning as autoparallelize's does."""
    from hf_colossal_auto import AutoParallelPlugin

    try:
        _prepare_under(AutoParallelPlugin(mesh_shape=(1, 2), device="cpu", timeout=0.1))
    finally:
        _join_planning_threads()


def _callback_limit_case(out: Path) -> None:
    """``AutoParallelCallback(timeout=0.1)`` bounds the Trainer's planning as autoparallelize's does."""
    from hf_colossal_auto import AutoParallelCallback

    try:
        _trainer_with(
            AutoParallelCallback(mesh_shape=(1, 2), device="cpu", timeout=0.1), out / "trainer_limit"
        )
    finally:
        _join_planning_threads()


def _timeouts_left(model: torch.nn.Module) -> list[float]:
    """Seconds of the collective timeout of the default group and of the group a sharded parameter of ``model``
    lives on, read back from the process groups; both set back to torch's 30 minutes for the next case."""
    import datetime

    from torch.distributed.tensor import DTensor

    from hf_colossal_auto._torch_compat import group_timeout, set_group_timeout

    param = next(
        p for p in model.parameters() if isinstance(p, DTensor) and not p.placements[-1].is_replicate()
    )
    groups = [None, param.device_mesh.get_group(param.device_mesh.ndim - 1)]
    seen = [group_timeout(g).total_seconds() for g in groups]
    for group in groups:
        set_group_timeout(datetime.timedelta(minutes=30), group)
    return seen


def timeouts(out: Path) -> dict:
    """A saved 1 x 2 plan applied through each entry point, with a timeout setting of its own or none: the
    timeouts each left on the process groups (the 300 s default where none is given)."""
    import transformers

    from hf_colossal_auto import (
        AutoParallelAccelerator,
        AutoParallelCallback,
        AutoParallelPlugin,
        autoparallelize,
    )
    from hf_colossal_auto.apply.runtime import plan_on_one_rank
    from hf_colossal_auto.models import make_example_inputs
    from hf_colossal_auto.solve.planner import evaluate_plan

    model = _model()
    batch = make_example_inputs(model, 4, 16)
    plan = plan_on_one_rank(
        lambda: evaluate_plan(model, batch, "megatron", num_devices=2, device="cpu", mesh_shape=(1, 2)).plan
    )
    path = out / "plan.json"
    if dist.get_rank() == 0:
        plan.save(path)
    dist.barrier()
    rows = [{k: v[i] for k, v in batch.items()} for i in range(4)]

    def accelerator(**settings) -> list[float]:
        prepared = AutoParallelAccelerator(
            auto_parallel_plugin=AutoParallelPlugin(plan_path=str(path), **settings), cpu=True
        ).prepare(_model())
        return _timeouts_left(prepared)

    def callback(**settings) -> list[float]:
        args = transformers.TrainingArguments(
            output_dir=str(out / "trainer"),
            per_device_train_batch_size=2,
            max_steps=1,
            report_to=[],
            use_cpu=True,
        )
        trainer = transformers.Trainer(
            model=_model(),
            args=args,
            train_dataset=rows,
            callbacks=[AutoParallelCallback(plan_path=path, **settings)],
        )
        return _timeouts_left(trainer.model)

    def environment() -> list[float]:
        os.environ["HF_COLOSSAL_AUTO_TIMEOUT"] = "13"
        try:
            return accelerator()
        finally:
            del os.environ["HF_COLOSSAL_AUTO_TIMEOUT"]

    cases = {
        "autoparallelize": lambda: _timeouts_left(autoparallelize(_model(), plan=plan, timeout=11)),
        "autoparallelize default": lambda: _timeouts_left(autoparallelize(_model(), plan=plan)),
        "plugin": lambda: accelerator(timeout=12),
        "environment": environment,
        "plugin default": accelerator,
        "callback": lambda: callback(timeout=14),
        "callback default": callback,
    }
    seen = {}
    for name, case in cases.items():
        seen[name] = case()
        dist.barrier()
    return seen


def planning(out: Path) -> None:
    cases = {
        "autoparallelize": _autoparallelize_case,
        "accelerator": _accelerator_case,
        "callback": lambda: _callback_case(out),
        "foreign_plan": _foreign_plan_case,
        "planning_limit": _planning_limit_case,
        "accelerator_limit": _accelerator_limit_case,
        "callback_limit": lambda: _callback_limit_case(out),
    }
    results = {}
    for name, case in cases.items():
        results[name] = _caught(case)
        dist.barrier()  # the next case starts together on both ranks: each case's time is its own
    slow: dict = {}
    results["slow_planning"] = {**_caught(lambda: slow.update(_slow_planning_case())), **slow}
    dist.barrier()
    results["timeouts"] = timeouts(out)
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(results))


def stuck_peer(out: Path) -> None:
    from hf_colossal_auto import autoparallelize
    from hf_colossal_auto.apply.runtime import plan_on_one_rank
    from hf_colossal_auto.models import make_example_inputs
    from hf_colossal_auto.solve.planner import plan_model

    model = _model()
    batch = make_example_inputs(model, 2, 16)
    # Planned first, with no limit: autoparallelize's timeout also bounds planning, which a loaded machine can
    # take past 3 s (then every rank raises TookTooLongError before the step this scenario is about).
    plan = plan_on_one_rank(lambda: plan_model(model, batch, num_devices=2, mesh_shape=(1, 2), device="cpu"))
    autoparallelize(model, batch, plan=plan, timeout=TIMEOUT_S)
    for step in range(3):
        if step == 2 and dist.get_rank() == 1:
            time.sleep(120)  # alive, sockets open, not answering
        result = _caught(lambda: model(**batch).loss.backward())
        if result["type"] is not None:
            (out / f"rank{dist.get_rank()}.json").write_text(json.dumps({"step": step, **result}))
            sys.stdout.flush()
            os._exit(3)  # a broken group cannot be torn down cleanly; torchrun stops the other rank


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--scenario", choices=("planning", "stuck-peer"), required=True)
    parser.add_argument("--batch-shapes", default=None, help="planning: then check_batch_shapes.py to here")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    init_gloo()
    if args.scenario == "planning":
        planning(out)
        if args.batch_shapes:
            from check_batch_shapes import check  # this folder is on sys.path under torchrun

            check(args.batch_shapes)
    else:
        stuck_peer(out)
    close_gloo()


if __name__ == "__main__":
    main()
    finish()  # the run's gloo groups outlive main(): end before interpreter teardown
