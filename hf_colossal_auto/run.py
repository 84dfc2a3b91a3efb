"""Run an unmodified accelerate script with :class:`AutoParallelAccelerator` in place of ``Accelerator``::

    accelerate launch --config_file recipes/auto_cpu.yaml -m hf_colossal_auto.run train.py [script args]
    python -m hf_colossal_auto.run -m my_package.train [script args]

Why a runner rather than an import in the script: the script stays an ordinary accelerate script (it constructs
``accelerate.Accelerator(...)``) and runs the same under plain ``accelerate launch``. ``accelerate.Accelerator``
and ``accelerate.accelerator.Accelerator`` are replaced before the script runs, so both ``import accelerate``
and ``from accelerate import Accelerator`` get ours; the script sees its own path in ``sys.argv[0]`` and runs
as ``__main__``. Planner settings come from ``HF_COLOSSAL_AUTO_*`` variables or ``HF_COLOSSAL_AUTO_CONFIG``.

A ``transformers.Trainer`` (or subclass) the script builds is planned as
:class:`~hf_colossal_auto.integrations.trainer.AutoParallelCallback` plans it: the runner adds that callback,
with the same settings, to every Trainer that does not have one (when ``transformers.trainer`` is imported,
so that scripts without a Trainer do not pay for importing it). Its accelerator is ours too.

When the script has finished (returned, or ``sys.exit(0)``) and process groups may still be alive, the
process ends right after the exit steps that matter (non-daemon threads joined, ``atexit`` functions, files
flushed) and before interpreter teardown, where those threads can abort it
(:mod:`hf_colossal_auto.integrations.process_exit` says why).
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import inspect
import logging
import os
import runpy
import sys
from collections.abc import Sequence
from types import ModuleType

from .integrations.process_exit import finish

logger = logging.getLogger(__name__)

USAGE = "usage: python -m hf_colossal_auto.run (SCRIPT.py | -m MODULE) [script args ...]"


def use_cpu_without_gpus(environ: dict[str, str] | os._Environ = os.environ) -> bool:
    """On a machine without GPUs, a multi-process launch needs ``ACCELERATE_USE_CPU`` for accelerate to pick
    gloo (with ``distributed_type: MULTI_GPU`` accelerate starts the processes with torchrun and does not pass
    the config's ``use_cpu`` on); without it every process would train alone. Returns whether it was set."""
    import torch

    processes = int(environ.get("WORLD_SIZE", "1"))
    flag = environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true", "yes")
    if processes > 1 and not flag and not torch.cuda.is_available():
        environ["ACCELERATE_USE_CPU"] = "true"
        return True
    return False


def install() -> type:
    """Make ``accelerate.Accelerator`` our accelerator (idempotent); returns the class that was there."""
    import accelerate
    import accelerate.accelerator

    from .integrations.accelerator import AutoParallelAccelerator

    original = accelerate.accelerator.Accelerator
    accelerate.Accelerator = AutoParallelAccelerator
    accelerate.accelerator.Accelerator = AutoParallelAccelerator
    if "transformers.trainer" in sys.modules:
        plan_trainers(sys.modules["transformers.trainer"])
    elif not any(isinstance(f, _TrainerImportHook) for f in sys.meta_path):
        sys.meta_path.insert(0, _TrainerImportHook())
    return original


def plan_trainers(module: ModuleType) -> None:
    """Make ``module`` (``transformers.trainer``) build its Trainers with our accelerator and an
    ``AutoParallelCallback`` carrying the plugin's settings (idempotent)."""
    from .integrations.accelerator import AutoParallelAccelerator

    module.Accelerator = AutoParallelAccelerator  # bound by `from accelerate import Accelerator` at import
    trainer_class = module.Trainer
    original = trainer_class.__init__
    if getattr(original, "_hf_colossal_auto", False):
        return
    signature = inspect.signature(original)

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):  # noqa: N807 - the Trainer's own __init__, wrapped
        from .integrations.trainer import AutoParallelCallback, callback_from_plugin

        bound = signature.bind(self, *args, **kwargs)
        callbacks = list(bound.arguments.get("callbacks") or [])
        if not any(c is AutoParallelCallback or isinstance(c, AutoParallelCallback) for c in callbacks):
            callbacks.append(callback_from_plugin())
        bound.arguments["callbacks"] = callbacks
        original(*bound.args, **bound.kwargs)

    __init__._hf_colossal_auto = True
    trainer_class.__init__ = __init__


class _TrainerImportHook(importlib.abc.MetaPathFinder):
    """Calls :func:`plan_trainers` once ``transformers.trainer`` has been imported."""

    def find_spec(self, name: str, path: Sequence[str] | None, target: ModuleType | None = None):
        if name != "transformers.trainer":
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        execute = spec.loader.exec_module

        def exec_module(module: ModuleType) -> None:
            execute(module)
            plan_trainers(module)

        spec.loader.exec_module = exec_module
        return spec


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(USAGE)
        print(__doc__)
        return 0 if args else 2
    if args[0] == "-m":
        if len(args) < 2:
            print(USAGE, file=sys.stderr)
            return 2
        target, rest, as_module = args[1], args[2:], True
    else:
        target, rest, as_module = args[0], args[1:], False
        if not os.path.isfile(target):
            print(f"error: no such script: {target}\n{USAGE}", file=sys.stderr)
            return 2
    if use_cpu_without_gpus():
        logger.info("no GPU here: ACCELERATE_USE_CPU=true so that the processes train together on gloo")
    install()
    sys.argv = [target, *rest]
    try:
        if as_module:
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            sys.path.insert(0, os.path.dirname(os.path.abspath(target)))
            runpy.run_path(target, run_name="__main__")
    except SystemExit as done:
        if done.code not in (None, 0):
            raise
    return 0


if __name__ == "__main__":
    status = main()
    finish(status)  # the process's own end only: main() called as a function returns
    sys.exit(status)
