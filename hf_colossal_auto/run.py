"""Run an unmodified accelerate script with :class:`AutoParallelAccelerator` in place of ``Accelerator``::

    accelerate launch --config_file recipes/auto_cpu.yaml -m hf_colossal_auto.run train.py [script args]
    python -m hf_colossal_auto.run -m my_package.train [script args]

Why a runner rather than an import in the script: the script stays an ordinary accelerate script (it constructs
``accelerate.Accelerator(...)``) and runs the same under plain ``accelerate launch``. ``accelerate.Accelerator``
and ``accelerate.accelerator.Accelerator`` are replaced before the script runs, so both ``import accelerate``
and ``from accelerate import Accelerator`` get ours; the script sees its own path in ``sys.argv[0]`` and runs
as ``__main__``. Planner settings come from ``HF_COLOSSAL_AUTO_*`` variables or ``HF_COLOSSAL_AUTO_CONFIG``.
"""

from __future__ import annotations

import logging
import os
import runpy
import sys
from collections.abc import Sequence

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
    return original


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
    if as_module:
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        sys.path.insert(0, os.path.dirname(os.path.abspath(target)))
        runpy.run_path(target, run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
