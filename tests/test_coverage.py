"""A fast sample of the coverage sweep (scripts/bench_coverage.py, docs/benchmarks.md "Architecture coverage"):
a few diverse families, each from its small config, planned and trained one step under a forced 1 x 2 and a
forced 2 x 1 mesh on 2 gloo ranks, against one process — in one launch.

Falcon with ``new_decoder_architecture`` adds the attention output into the MLP's output *in place*
(``mlp_output += attention_output``): the runtime's hook on that module output must allow it (issue 25: it
crashed with "Output 0 of _ReducePartialGradient is a view and is being modified inplace")."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from torchrun_launch import run_torchrun

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = (
    "falcon+new_decoder_architecture:FalconForCausalLM",  # in-place add into a hooked module output
    "gpt_neox:GPTNeoXForCausalLM",  # fused qkv, parallel residual, partial rotary
    "bert:BertForMaskedLM",  # encoder, masked-LM labels
    "qwen2:Qwen2ForCausalLM",  # grouped-query attention with q/k/v biases
)


@pytest.fixture(scope="module")
def records(tmp_path_factory) -> list[dict]:
    progress = tmp_path_factory.mktemp("coverage") / "progress.jsonl"
    run_torchrun(
        str(ROOT / "scripts" / "bench_coverage.py"),
        "--worker", "--meshes", "1x2,2x1", "--archs", ",".join(SAMPLE), "--progress", str(progress),
        "--collective-timeout", "120",
        timeout=300,
    )  # fmt: skip
    return [r for r in map(json.loads, progress.read_text().splitlines()) if "started" not in r]


@pytest.mark.slow
def test_sampled_families_train_exactly_on_both_meshes(records):
    """Every sampled family on both meshes: loss, every gradient and every SGD-updated weight within 1e-5 of
    one process training the whole global batch (the tolerance of tests/multiproc/check_numerics.py's tests)."""
    assert sorted((r["architecture"], r["mesh"]) for r in records) == sorted(
        (a, m) for a in SAMPLE for m in ("1x2", "2x1")
    )
    for r in records:
        assert r["outcome"] == "exact", r
        assert max(r["loss_gap"], r["grad_gap"], r["weight_gap"]) <= 1e-5, r


@pytest.mark.slow
def test_tensor_parallel_mesh_shards_something(records):
    """On the 1 x 2 mesh the sample is a tensor-parallel run, not only a replicated one: the planner stores
    BERT's and Qwen2's projections split at these widths (the tiny Falcon and GPT-NeoX it keeps whole, their
    module outputs still placed and hooked)."""
    sharded = {
        r["architecture"].split(":")[0] for r in records if r["mesh"] == "1x2" and r["sharded_params"] > 0
    }
    assert {"bert", "qwen2"} <= sharded, records
