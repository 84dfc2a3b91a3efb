"""Ending a process whose gloo process groups are still alive, without the abort interpreter teardown can hit.

Why: a gloo worker thread frees each collective's work object a moment *after* the collective has completed and
the caller's ``wait()`` has returned. When that object holds the last reference to a tensor whose Python object
the caller has already dropped, freeing it takes the GIL. If the interpreter is finalizing by then, Python 3.11
ends the thread with ``pthread_exit``, and the forced unwind through gloo's destructor calls ``std::terminate``:
"terminate called without an active exception", SIGABRT, exit code -6, after the script has finished and written
its results. A core dump of one such exit shows it: ``ProcessGroupGloo::runLoop`` -> ``~AsyncAllgatherWork`` ->
``TensorImpl::decref_pyobject`` -> ``gil_scoped_acquire`` -> ``take_gil`` -> ``PyThread_exit_thread`` (torch
issue 190489 reports the same abort). It needs only a worker thread descheduled for a few milliseconds at the end
of the script (a loaded machine) and the groups alive at exit, which they are whenever the model is: its DTensors
and FSDP states hold the device mesh, and ``destroy_process_group`` does not stop a group still referenced.

What: once a script is done, if process groups may still be alive, do what a normal exit does before
finalization (join the non-daemon threads, run the ``atexit`` functions, logging's shutdown among them, flush every
open file) and end the process with ``os._exit``. Where no group is up and no gloo thread alive, nothing changes.
"""

from __future__ import annotations

import atexit
import gc
import io
import logging
import os
import sys
import threading

logger = logging.getLogger(__name__)

GLOO_WORKER_THREAD = "pt_gloo_runloop"
"""The name ``ProcessGroupGloo`` gives its worker threads (``/proc/<pid>/task/<tid>/comm``)."""


def gloo_worker_threads() -> int:
    """How many of gloo's worker threads this process has (0 where ``/proc`` cannot tell: not Linux)."""
    tasks = f"/proc/{os.getpid()}/task"
    try:
        tids = os.listdir(tasks)
    except OSError:
        return 0
    count = 0
    for tid in tids:
        try:
            with open(f"{tasks}/{tid}/comm") as f:
                count += f.read().strip() == GLOO_WORKER_THREAD
        except OSError:  # the thread ended while we listed
            continue
    return count


def process_groups_may_be_alive() -> bool:
    """Whether collectives' worker threads may outlive the script: gloo's are running (by name; a thread names
    itself once it runs, so a group made a moment ago may not show yet), or the default group is still up."""
    import torch.distributed as dist

    return gloo_worker_threads() > 0 or (dist.is_available() and dist.is_initialized())


def finish(status: int = 0) -> None:
    """End the process now with ``status`` if process groups may be alive (:func:`process_groups_may_be_alive`),
    after everything a normal exit does before interpreter finalization; otherwise return, and Python exits as
    usual.

    Call it from the main thread when the work is done (the runner calls it once the script has returned)."""
    if not process_groups_may_be_alive():
        return
    logger.debug("process groups may be alive at exit: ending the process before interpreter teardown")
    _join_non_daemon_threads()
    atexit._run_exitfuncs()
    _flush_open_files()
    os._exit(status)


def _join_non_daemon_threads() -> None:
    """What ``threading._shutdown`` does at a normal exit: wait for every non-daemon thread."""
    current = threading.current_thread()
    for thread in threading.enumerate():
        if thread is not current and not thread.daemon and thread is not threading.main_thread():
            thread.join()


def _flush_open_files() -> None:
    """Flush every open Python file object, as finalization would when it frees them (a script that wrote to a
    file it never closed keeps its lines), then the standard streams."""
    for obj in gc.get_objects():
        if isinstance(obj, io.IOBase):
            try:
                if not obj.closed and obj.writable():
                    obj.flush()
            except (OSError, ValueError):  # a broken pipe, a file closed under us: as finalization, go on
                continue
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        try:
            if stream is not None:
                stream.flush()
        except (OSError, ValueError):
            continue
