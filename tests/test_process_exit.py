"""How a process ends while gloo's worker threads are alive (``integrations/process_exit.py``, used by the runner):
everything a normal exit does before interpreter teardown still happens (non-daemon threads joined, ``atexit``
functions run, files that were never closed flushed), the exit status is the script's, and nothing changes for a
process without process groups."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PRELUDE = """
import atexit, os, sys, threading, time
import torch.distributed as dist
from hf_colossal_auto.integrations.process_exit import finish, gloo_worker_threads

OUT = sys.argv[1]


def gloo_world_of_one():
    before = gloo_worker_threads()
    dist.init_process_group("gloo", init_method="file://" + OUT + "/store", rank=0, world_size=1)
    deadline = time.monotonic() + 30  # a worker names itself once it runs: on a loaded machine, a moment later
    while gloo_worker_threads() < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    print("gloo threads before/after init:", before, gloo_worker_threads())


def exit_steps():
    unclosed = open(OUT + "/unclosed.txt", "w")  # never closed nor flushed: only a flush at exit writes it
    unclosed.write("a line still in the buffer")
    atexit.register(lambda: open(OUT + "/atexit.txt", "w").write("ran"))

    def late():
        time.sleep(0.3)
        open(OUT + "/thread.txt", "w").write("joined")

    threading.Thread(target=late).start()
    return unclosed
"""


def _run(
    body: str, tmp_path: Path, *, runner: bool = False, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(PRELUDE) + textwrap.dedent(body))
    command = [
        sys.executable,
        *(["-m", "hf_colossal_auto.run"] if runner else []),
        str(script),
        str(tmp_path),
    ]
    env = {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", **(env or {})}
    return subprocess.run(command, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)


def _exit_steps_happened(tmp_path: Path) -> None:
    assert (tmp_path / "unclosed.txt").read_text() == "a line still in the buffer"
    assert (tmp_path / "atexit.txt").read_text() == "ran"
    assert (tmp_path / "thread.txt").read_text() == "joined"


def test_with_gloo_threads_alive_finish_ends_the_process_after_the_exit_steps(tmp_path):
    done = _run(
        """
        gloo_world_of_one()
        unclosed = exit_steps()
        print("printed without a flush", end="")
        finish(7)
        print("not reached")
        """,
        tmp_path,
    )
    assert done.returncode == 7, done.stderr
    assert "gloo threads before/after init: 0 2" in done.stdout
    assert done.stdout.endswith("printed without a flush") and "not reached" not in done.stdout
    _exit_steps_happened(tmp_path)


def test_without_gloo_threads_finish_returns_and_python_exits_as_usual(tmp_path):
    done = _run(
        """
        unclosed = exit_steps()
        finish(7)
        print("finish returned")
        """,
        tmp_path,
    )
    assert done.returncode == 0, done.stderr
    assert "finish returned" in done.stdout
    _exit_steps_happened(tmp_path)


def test_the_runner_ends_a_finished_script_with_its_status(tmp_path):
    """A script that leaves its gloo group alive (as a Trainer script does) and ends with ``sys.exit(0)``: the
    runner ends the process with status 0 after the exit steps; ``sys.exit(3)`` keeps its status."""
    body = """
        gloo_world_of_one()
        unclosed = exit_steps()
        sys.exit(int(os.environ.get("STATUS", "0")))
        """
    done = _run(body, tmp_path, runner=True)
    assert done.returncode == 0, done.stderr
    _exit_steps_happened(tmp_path)
    failed = _run(body, tmp_path, runner=True, env={"STATUS": "3"})
    assert failed.returncode == 3, failed.stderr
