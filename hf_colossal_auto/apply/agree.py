"""Every rank runs the same plan, and every rank fails the same way.

Why a module of its own: planning runs on one rank (a solve per process would cost N times the CPU and could
pick different optima), so every other rank waits for it in a broadcast. If the planning rank raised there
and sent nothing, the others would sit in that broadcast until the process group's timeout (30 minutes by
default) and die with a message that names nothing. Here the planning rank sends either its result or its
error, and every rank raises that error — same type, same message — within seconds. The same goes for
checks that run on every rank (a plan that does not fit the model): if any rank fails, all raise the first
failure, so no rank walks into a collective its peers will never join.

The ``timeout`` of the groups a plan uses is set here too: a peer that stops answering (hung, or stopped
without closing its sockets) ends the job after that many seconds instead of torch's 30-minute default.
"""

from __future__ import annotations

import importlib
import logging
import os
import pickle
import sys
import threading
import time
from collections.abc import Callable, Iterable
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from .._torch_compat import set_group_timeout

logger = logging.getLogger(__name__)

T = TypeVar("T")

DEFAULT_TIMEOUT_S = 300.0
"""How long a rank waits in a collective for a peer that stopped answering (seconds): long enough for a
checkpoint write or an evaluation on one rank, far below torch's 30-minute default."""


def describe_error(error: BaseException) -> dict[str, Any]:
    """What is needed to raise ``error`` again on another rank: its class (by import path), its message, and
    the attributes callers read (``InfeasibleError.min_required``...) that survive pickling."""
    cls = type(error)
    attributes = {}
    for name, value in vars(error).items():
        try:
            pickle.dumps(value)
        except Exception:  # noqa: BLE001 - an attribute that cannot travel is left behind
            continue
        attributes[name] = value
    return {
        "module": cls.__module__,
        "qualname": cls.__qualname__,
        "message": str(error),
        "attributes": attributes,
    }


def rebuild_error(description: dict[str, Any], *, source_rank: int, what: str) -> BaseException:
    """The error :func:`describe_error` described, as an instance of the same class with the same message.

    The class is found by its import path; one that cannot be found (defined in a user's ``__main__``) or not
    an exception becomes a ``RuntimeError`` carrying the class name. A note says where it was raised."""
    message = description["message"]
    error: BaseException
    try:
        cls: Any = importlib.import_module(description["module"])
        for part in description["qualname"].split("."):
            cls = getattr(cls, part)
        if not (isinstance(cls, type) and issubclass(cls, BaseException)):
            raise TypeError(cls)
        error = cls.__new__(cls)
        BaseException.__init__(error, message)
        error.__dict__.update(description["attributes"])
    except Exception:  # noqa: BLE001 - any failure to rebuild falls back to a plain error with the same text
        error = RuntimeError(f"{description['qualname']}: {message}")
    error.add_note(f"(raised on rank {source_rank} while {what}; every rank of the job raises it)")
    return error


HEARTBEAT_S = 10.0
"""While one rank works for all (:func:`run_on_one_rank`), it tells the waiting ranks it is alive this often: each
of their waits is one short broadcast, so a long plan never runs into the process group's collective timeout,
which is left to catch a peer that really stopped answering."""


class TookTooLongError(TimeoutError):
    """The work one rank did for all (planning) did not finish within its limit; every rank raises it."""


def run_on_one_rank(
    fn: Callable[[], T], *, src: int = 0, what: str = "planning", limit_s: float | None = None
) -> T:
    """``fn()`` on rank ``src``; its result (pickled) or its error reaches every rank.

    Every rank returns the same value, or every rank raises the same error: the planning rank its own
    exception (with its traceback), the others a rebuilt copy of it (same type, same message). ``fn`` runs in a
    thread of rank ``src`` while its main thread broadcasts a heartbeat every :data:`HEARTBEAT_S` seconds, so
    the other ranks wait in short collectives however long ``fn`` takes. ``limit_s``: past it, every rank raises
    :class:`TookTooLongError` naming ``what`` and the function ``fn`` was in (the thread cannot be stopped; it
    ends with the process)."""
    payload: list[Any] = [None]
    error: BaseException | None = None
    if dist.get_rank() == src:
        result, error = _run_with_heartbeats(fn, src, what, limit_s)
        payload[0] = ("ok", result) if error is None else ("error", describe_error(error))
        dist.broadcast_object_list(payload, src=src)
        if error is not None:
            raise error
        return result
    while True:
        dist.broadcast_object_list(payload, src=src)
        status, value = payload[0]
        if status == "ok":
            return value
        if status == "error":
            raise rebuild_error(value, source_rank=src, what=what)


def _run_with_heartbeats(
    fn: Callable[[], T], src: int, what: str, limit_s: float | None
) -> tuple[T | None, BaseException | None]:
    """On rank ``src``: ``fn()`` in a thread, a heartbeat broadcast every :data:`HEARTBEAT_S` seconds until it
    ends; its result or its error, or :class:`TookTooLongError` past ``limit_s``."""
    outcome: dict[str, Any] = {}
    grad_enabled = torch.is_grad_enabled()  # thread-local: the worker computes as the caller would

    def work() -> None:
        try:
            with torch.set_grad_enabled(grad_enabled):
                outcome["result"] = fn()
        except BaseException as exc:  # noqa: BLE001 - carried to the main thread, which raises it
            outcome["error"] = exc

    worker = threading.Thread(target=work, name=f"hf_colossal_auto {what}", daemon=True)
    started = time.monotonic()
    worker.start()
    while True:
        wait = HEARTBEAT_S if limit_s is None else min(HEARTBEAT_S, limit_s - (time.monotonic() - started))
        worker.join(max(wait, 0.0))
        if not worker.is_alive():
            return outcome.get("result"), outcome.get("error")
        if limit_s is not None and time.monotonic() - started >= limit_s:
            return None, TookTooLongError(
                f"{what} on rank {src} did not finish within {limit_s:g} s (it was in {_where(worker)}); raise "
                "the timeout, fix the mesh with mesh_shape, or plan once offline with hf_colossal_auto.plan_model "
                "and pass the plan"
            )
        dist.broadcast_object_list([("wait", None)], src=src)


def _where(thread: threading.Thread) -> str:
    """The innermost function of this package ``thread`` is running (file:line function), else its innermost."""
    frame = sys._current_frames().get(thread.ident or -1)
    innermost = None
    while frame is not None:
        code = frame.f_code
        here = f"{code.co_filename}:{frame.f_lineno} {code.co_name}"
        innermost = innermost or here
        if f"{os.sep}hf_colossal_auto{os.sep}" in code.co_filename:
            package = code.co_filename.rsplit(f"{os.sep}hf_colossal_auto{os.sep}", 1)[1]
            return f"hf_colossal_auto/{package}:{frame.f_lineno} {code.co_name}"
        frame = frame.f_back
    return innermost or "an unknown place"


def raise_if_any_rank_failed(error: BaseException | None, *, what: str) -> None:
    """Collective: every rank passes its own error (or None); if any rank has one, every rank raises the
    lowest failing rank's error (its own where it failed)."""
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, None if error is None else describe_error(error))
    failed = [(rank, d) for rank, d in enumerate(gathered) if d is not None]
    if not failed:
        return
    rank, description = failed[0]
    if rank == dist.get_rank() and error is not None:
        raise error
    raise rebuild_error(description, source_rank=rank, what=what)


def as_timedelta(timeout: float | timedelta) -> timedelta:
    """Seconds or a ``timedelta``; must be positive."""
    value = timeout if isinstance(timeout, timedelta) else timedelta(seconds=float(timeout))
    if value.total_seconds() <= 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    return value


def set_timeout(timeout: float | timedelta, groups: Iterable[Any] = ()) -> None:
    """Give the default process group and ``groups`` (a mesh's) ``timeout``: a collective that waits longer
    for a peer raises on this rank (gloo: "Timed out waiting ... for recv operation"; NCCL's watchdog aborts)."""
    value = as_timedelta(timeout)
    seen: set[int] = set()
    for group in (None, *groups):
        key = id(group)
        if key in seen:
            continue
        seen.add(key)
        set_group_timeout(value, group)
    logger.debug("collective timeout set to %.0f s", value.total_seconds())
