"""Launch a script under ``torch.distributed.run`` (gloo, offline, no calibration) or ``accelerate launch`` for the
multi-process tests."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

CPU_CONFIG = Path(__file__).resolve().parents[1] / "recipes" / "auto_cpu.yaml"


def free_port() -> int:
    """A local TCP port nobody listens on now: each launch gets its own rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def accelerate_launch_command(*script_and_args: str, processes: int = 2) -> list[str]:
    """The README's CPU command: ``accelerate launch --config_file recipes/auto_cpu.yaml --multi_gpu
    --num_processes N`` (on a free port) of ``script_and_args``; run it with ``ACCELERATE_USE_CPU=1``."""
    return [
        sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CPU_CONFIG),
        "--multi_gpu", "--num_processes", str(processes), "--main_process_port", str(free_port()),
        *script_and_args,
    ]  # fmt: skip


CAUSE = re.compile(
    r"terminate called|what\(\)|enforce fail|\w(Error|Exception|Interrupt)\b:|Fatal Python error|Segmentation fault"
    r"|double free|corrupted|Killed"
)
"""Lines that name why a rank died: C++ aborts (gloo's ``terminate called ... what(): [enforce fail ...]``),
Python exceptions, fatal signals. The launcher's own summary (which only says "Signal 6 received") ends the
output, so a tail alone can push them out of the failure message."""


def why_it_failed(proc: subprocess.CompletedProcess, tail: int = 3000) -> str:
    """A failed launch's story for an assertion message: every line of its output naming a cause (deduplicated,
    with the line after it, which holds an abort's ``what()``, or faulthandler's stack after a fatal error), then
    the tails of stdout and stderr."""
    text = f"{proc.stdout or ''}\n{proc.stderr or ''}".splitlines()
    causes: list[str] = []
    for index, line in enumerate(text):
        if CAUSE.search(line):
            # faulthandler's report: the aborting thread's Python stack follows the line
            after = 30 if "Fatal Python error" in line else 2
            for kept in text[index : index + after]:
                if kept not in causes:
                    causes.append(kept)
    excerpt = "\n".join(causes[:60])
    return (
        f"exit code {proc.returncode}\n--- lines naming a cause ---\n{excerpt}\n"
        f"--- stdout tail ---\n{(proc.stdout or '')[-tail // 2 :]}\n--- stderr tail ---\n{(proc.stderr or '')[-tail:]}"
    )


def run_torchrun(
    script: str,
    *args: str,
    nproc: int = 2,
    timeout: int = 240,
    check: bool = True,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess:
    """Run ``script args`` on ``nproc`` local ranks; with ``check``, fail the test with the output's tail if it
    fails. ``env`` adds variables to the launch's environment."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_COLOSSAL_AUTO_NO_CALIBRATE": "1", **(env or {})}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        script,
        *args,
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if check:
        assert proc.returncode == 0, why_it_failed(proc)
    return proc


def spawn_ranks(worker, *args, nprocs: int = 2, timeout: float = 120, what: str = "the ranks") -> dict:
    """``worker(rank, *args, results)`` in ``nprocs`` spawned processes (each sets up its own process group);
    returns ``results``, a shared dict the workers fill. Fails the test if they have not all ended after
    ``timeout`` seconds (a hang: the ranks waiting on each other), killing what is left."""
    import time

    import pytest
    import torch.multiprocessing as mp

    results = mp.Manager().dict()
    context = mp.spawn(worker, args=(*args, results), nprocs=nprocs, join=False)
    deadline = time.monotonic() + timeout
    try:
        while not context.join(timeout=1.0):
            if time.monotonic() > deadline:
                pytest.fail(f"{what} hung")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
    return results
