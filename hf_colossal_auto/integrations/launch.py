"""``hf-colossal-auto launch --config combined.yaml train.py [args]``: one YAML for accelerate and the planner.

Why: ``accelerate launch`` rejects keys it does not know, so a job needs two files (accelerate's config and
ours, named by ``HF_COLOSSAL_AUTO_CONFIG``). A combined file is an accelerate config plus one
``auto_parallel:`` section of :class:`~hf_colossal_auto.integrations.AutoParallelPlugin` fields::

    distributed_type: MULTI_GPU
    num_processes: 8
    mixed_precision: bf16
    auto_parallel:
      memory_budget: 60GiB
      save_plan_path: plan.json

This splits it into the two files (checking our section before anything starts) and runs
``accelerate launch --config_file <accelerate part> -m hf_colossal_auto.run train.py [args]``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

SECTION = "auto_parallel"


def split_config(path: str | Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(accelerate settings, our settings)`` of a combined YAML file."""
    import yaml

    if not Path(path).is_file():
        raise ValueError(f"--config {path}: no such file")
    with open(path) as f:
        data = yaml.safe_load(f) or {}
    if not isinstance(data, dict):
        raise ValueError(
            f"--config {path}: expected a mapping (an accelerate config), got {type(data).__name__}"
        )
    ours = data.pop(SECTION, None) or {}
    if not isinstance(ours, dict):
        raise ValueError(
            f"--config {path}: the {SECTION}: section must be a mapping of AutoParallelPlugin fields"
        )
    return data, ours


def _local_gpus(config: str | Path) -> int:
    """``num_processes: -1`` (or none) in a MULTI_GPU config means every GPU of this machine."""
    import torch

    count = torch.cuda.device_count()
    if count < 1:
        raise ValueError(
            f"--config {config}: num_processes -1 means all local GPUs, and this machine has none; set "
            "num_processes (and use_cpu: true for CPU processes, see recipes/auto_cpu.yaml)"
        )
    return count


def prepare_launch(
    config: str | Path, script: str, script_args: list[str], workdir: str | Path
) -> tuple[list[str], dict[str, str]]:
    """Write the two files under ``workdir``, check our settings, return the command and its environment."""
    import yaml

    from .plugin import CONFIG_ENV, AutoParallelPlugin, PluginConfigError

    accelerate_cfg, ours = split_config(config)
    if (
        accelerate_cfg.get("distributed_type") == "MULTI_GPU"
        and accelerate_cfg.get("num_processes", -1) == -1
    ):
        accelerate_cfg["num_processes"] = _local_gpus(config)
    workdir = Path(workdir)
    accelerate_path, ours_path = workdir / "accelerate.yaml", workdir / "auto_parallel.yaml"
    accelerate_path.write_text(yaml.safe_dump(accelerate_cfg))
    ours_path.write_text(yaml.safe_dump(ours))
    env = {**os.environ, CONFIG_ENV: str(ours_path)}
    previous = os.environ.get(CONFIG_ENV)
    os.environ[CONFIG_ENV] = str(ours_path)
    try:
        AutoParallelPlugin()  # unknown or ill-typed settings fail here, before any process starts
    except PluginConfigError as exc:
        where = f"{ours_path} (via {CONFIG_ENV})"
        message = str(exc).replace(where, "the section")
        raise PluginConfigError(f"--config {config}, section {SECTION}: {message}") from None
    finally:
        if previous is None:
            del os.environ[CONFIG_ENV]
        else:
            os.environ[CONFIG_ENV] = previous
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(accelerate_path)]
    cmd += ["-m", "hf_colossal_auto.run", script, *script_args]
    return cmd, env


def cmd_launch(args: argparse.Namespace) -> int:
    """The ``launch`` subcommand of ``hf-colossal-auto``."""
    with tempfile.TemporaryDirectory(prefix="hf-colossal-auto-launch-") as workdir:
        cmd, env = prepare_launch(args.config, args.script, list(args.script_args), workdir)
        print("$ " + " ".join(cmd), file=sys.stderr, flush=True)
        if args.dry_run:
            return 0
        return subprocess.run(cmd, env=env, check=False).returncode


def add_launch_parser(sub: Any) -> None:
    p = sub.add_parser(
        "launch",
        help="accelerate launch a training script under AutoParallelAccelerator, from one combined YAML",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--config", required=True, help="accelerate config with an auto_parallel: section")
    p.add_argument("--dry-run", action="store_true", help="check the config and print the command only")
    p.add_argument("script", help="the accelerate training script")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")
    p.set_defaults(func=cmd_launch)
