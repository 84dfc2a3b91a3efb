"""Resumable checkpoints: ``accelerator.save_state`` for model, optimizer and RNG states, plus the loop's own
position (step, tokens) and the LR scheduler, which the recipes step themselves rather than through
``accelerator.prepare`` (so one optimizer step is one scheduler step whatever the process count).

A checkpoint is complete when its loop state (``recipe_state.json``) exists and every file it lists has the
size it had when the checkpoint was written: the state is written last (atomically), so a run killed while
writing leaves a directory ``latest`` skips and an explicit ``--resume_from_checkpoint`` refuses by name.
Nothing in a checkpoint is unpickled as code: the scheduler state is read with ``torch.load(weights_only=True)``
(plain containers and numbers), the loop state is JSON."""

from __future__ import annotations

import json
import os
import pickle
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


def _file_sizes(path: Path) -> dict[str, int]:
    """Every file under ``path`` (but the loop state) by its path relative to ``path``, with its size in bytes."""
    return {
        str(file.relative_to(path)): file.stat().st_size
        for file in sorted(path.rglob("*"))
        if file.is_file() and file.name != _STATE_FILE
    }


def incomplete(path: Path) -> str | None:
    """Why ``path`` is not a complete checkpoint written by :func:`save` (None when it is one): no or an unreadable
    loop state, or a file it lists missing or of another size than when it was written (truncated)."""
    state_file = path / _STATE_FILE
    if not state_file.is_file():
        return f"no {_STATE_FILE} (written last: the checkpoint was interrupted while being written)"
    try:
        state = json.loads(state_file.read_text())
    except (OSError, ValueError) as exc:
        return f"{_STATE_FILE} is unreadable ({exc})"
    for name, size in state.get("files", {}).items():
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        if file.stat().st_size != size:
            return f"{name} has {file.stat().st_size} bytes, {size} were written (truncated or overwritten)"
    return None


def latest_checkpoint(output_dir: Path) -> Path | None:
    """The complete checkpoint with the highest step under ``output_dir/checkpoints`` (None if there is none).
    A directory that :func:`incomplete` finds wanting was interrupted while being written and is skipped."""
    root = output_dir / "checkpoints"
    found = []
    for path in root.iterdir() if root.is_dir() else ():
        match = _STEP_DIR.match(path.name)
        if match and incomplete(path) is None:
            found.append((int(match.group(1)), path))
    return max(found)[1] if found else None


def save(accelerator: Accelerator, path: Path, state: LoopState, scheduler) -> None:
    """Collective: every process calls it. The loop state is written last (atomically, after every process has
    written its files), with the size of every file of the checkpoint: its presence marks the checkpoint complete,
    and the sizes tell a file truncated afterwards."""
    accelerator.save_state(str(path))
    if accelerator.is_main_process:
        torch.save(scheduler.state_dict(), path / _SCHEDULER_FILE)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        partial = path / (_STATE_FILE + ".partial")
        partial.write_text(json.dumps({**asdict(state), "files": _file_sizes(path)}))
        os.replace(partial, path / _STATE_FILE)
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
    why = incomplete(path)
    if why is not None:
        raise SystemExit(
            f"--resume_from_checkpoint {spec!r} is not a complete checkpoint written by this recipe: {why}; "
            f"checkpoints are under {output_dir / 'checkpoints'} (`latest` picks the last complete one)"
        )
    return path


def read_scheduler_state(path: Path) -> dict:
    """The scheduler state :func:`save` wrote, read without running code from the file (``weights_only``): a
    file that needs more than tensors, numbers and containers to unpickle is refused naming it."""
    file = path / _SCHEDULER_FILE
    try:
        return torch.load(file, weights_only=True)
    except pickle.UnpicklingError as exc:
        reason = next((line for line in str(exc).splitlines() if "GLOBAL" in line), "not plain data")
        raise SystemExit(
            f"refusing to resume from {file}: it is not a scheduler state this recipe wrote but a pickle that "
            f"would run code on load ({reason.strip()}); loading never runs code from a checkpoint directory"
        ) from exc


def load(accelerator: Accelerator, path: Path, scheduler) -> LoopState:
    """Collective: restore what :func:`save` wrote into the prepared model/optimizer and ``scheduler``."""
    scheduler_state = read_scheduler_state(path)
    accelerator.load_state(str(path))
    scheduler.load_state_dict(scheduler_state)
    state = json.loads((path / _STATE_FILE).read_text())
    return LoopState(step=state["step"], tokens=state["tokens"])
