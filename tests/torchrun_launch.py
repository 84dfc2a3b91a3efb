"""Launch a script under ``torch.distributed.run`` (gloo, offline, no calibration) or ``accelerate launch`` for the
multi-process tests."""

from __future__ import annotations

import os
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
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
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
