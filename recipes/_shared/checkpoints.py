"""Resumable checkpoints: ``accelerator.save_state`` for model, optimizer and RNG states, plus the loop's own
position (step, tokens) and the LR scheduler, which the recipes step themselves rather than through
``accelerator.prepare`` (so one optimizer step is one scheduler step whatever the process count)."""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from accelerate import Accelerator

_STATE_FILE = "recipe_state.json"
_SCHEDULER_FILE = "lr_scheduler.pt"
_STEP_DIR = re.compile(r"^step_(\d+)$")


@dataclass
class LoopState:
    step: int = 0
    tokens: int = 0


def checkpoint_dir(output_dir: Path, step: int) -> Path:
    return output_dir / "checkpoints" / f"step_{step}"


def latest_checkpoint(output_dir: Path) -> Path | None:
    """The complete checkpoint with the highest step under ``output_dir/checkpoints`` (None if there is none).
    A directory without the loop state was interrupted while being written and is skipped."""
    root = output_dir / "checkpoints"
    found = []
    for path in root.iterdir() if root.is_dir() else ():
        match = _STEP_DIR.match(path.name)
        if match and (path / _STATE_FILE).is_file():
            found.append((int(match.group(1)), path))
    return max(found)[1] if found else None


def save(accelerator: Accelerator, path: Path, state: LoopState, scheduler) -> None:
    """Collective: every process calls it. The loop state is written last, so its presence marks the
    checkpoint complete."""
    accelerator.save_state(str(path))
    if accelerator.is_main_process:
        torch.save(scheduler.state_dict(), path / _SCHEDULER_FILE)
        (path / _STATE_FILE).write_text(json.dumps(asdict(state)))
    accelerator.wait_for_everyone()


def resolve(output_dir: Path, spec: str) -> Path:
    """``--resume_from_checkpoint``: 'latest' or a directory; an error that says what is missing."""
    if spec == "latest":
        path = latest_checkpoint(output_dir)
        if path is None:
            raise SystemExit(
                f"--resume_from_checkpoint latest: no complete checkpoint under {output_dir / 'checkpoints'}"
            )
        return path
    path = Path(spec)
    if not (path / _STATE_FILE).is_file():
        raise SystemExit(
            f"--resume_from_checkpoint {spec!r} is not a checkpoint written by this recipe (no {_STATE_FILE}); "
            f"checkpoints are under {output_dir / 'checkpoints'}"
        )
    return path


def load(accelerator: Accelerator, path: Path, scheduler) -> LoopState:
    """Collective: restore what :func:`save` wrote into the prepared model/optimizer and ``scheduler``."""
    accelerator.load_state(str(path))
    scheduler.load_state_dict(torch.load(path / _SCHEDULER_FILE, weights_only=False))
    return LoopState(**json.loads((path / _STATE_FILE).read_text()))
