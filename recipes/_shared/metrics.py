"""``<output_dir>/metrics.jsonl``: one JSON object per logged step, written by the main process only."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any


class MetricsLog:
    """Append-only JSON lines, flushed per line so a crash or a tail -f sees every logged step.

    A fresh run truncates the file; a resumed run keeps the lines up to the step it resumes from and drops
    later ones (written after the checkpoint by the run that stopped), so the file reads as one run."""

    def __init__(self, path: Path, enabled: bool, resume_step: int | None = None) -> None:
        self.path = path
        self.enabled = enabled
        if not enabled:
            return
        kept = []
        if resume_step is not None and path.is_file():
            kept = [
                line
                for line in path.read_text().splitlines()
                if json.loads(line).get("step", 0) <= resume_step
            ]
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w") as f:
            f.writelines(line + "\n" for line in kept)

    def write(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        with open(self.path, "a") as f:
            f.write(json.dumps(clean) + "\n")


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl file, in order."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
