"""Launch a script under ``torch.distributed.run`` for the multi-process tests (gloo, offline, no calibration)."""

from __future__ import annotations

import os
import subprocess
import sys


def run_torchrun(script: str, *args: str, nproc: int = 2, timeout: int = 240) -> None:
    """Run ``script args`` on ``nproc`` local ranks; fail the test with the output's tail if it fails."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_COLOSSAL_AUTO_NO_CALIBRATE": "1"}
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
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
