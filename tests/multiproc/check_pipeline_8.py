"""Run under torchrun (8 gloo ranks): pipeline stages with HSDP, and with FSDP x tensor parallelism, inside them
train like one process.

    torchrun --nproc_per_node 8 tests/multiproc/check_pipeline_8.py --out result.json

Mesh pp 2 x dp 4 under HSDP (shard groups of 2, two replicas of each stage) and pp 2 x dp 2 x tp 2 (FSDP over
dp, the Megatron-LM placements over tp, full recompute), both priced with their stages by ``evaluate_plan``, a
4-block tiny Llama under 1F1B in the user's loop on each replica's rows of one global batch, against one process
on that batch: the loss, every gradient, the clipping norm, every parameter after two AdamW steps, the
evaluation logits and loss; then ``save_pretrained`` reloaded in one process (``check_pipeline_dp.pipelined``).
Rank 0 writes every rank's results.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from typing import Any

import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from check_pipeline_dp import pipelined  # noqa: E402
from common import init_gloo, out_argument, write_every_rank_and_close  # noqa: E402

from hf_colossal_auto.integrations.process_exit import finish


def main() -> None:
    out = out_argument()
    init_gloo(timeout_s=300)
    started = time.perf_counter()
    directory = [
        tempfile.mkdtemp(prefix="pipeline-8-save-") if dist.get_rank() == 0 else None for _ in range(2)
    ]
    dist.broadcast_object_list(directory)
    results: dict[str, Any] = {
        "llama hsdp 1f1b": pipelined("tiny-llama", "1f1b", [2, 2], directory[0], inside="hsdp"),
        "llama fsdp-tp 1f1b": pipelined("tiny-llama", "1f1b", [2, 2], directory[1], inside="fsdp-tp"),
    }
    results["total_seconds"] = time.perf_counter() - started
    write_every_rank_and_close(results, out)


if __name__ == "__main__":
    main()
    finish()  # the run's gloo groups outlive main(): end before interpreter teardown
