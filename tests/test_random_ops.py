"""Random ops under tensor parallelism (apply/rng.py): one launch of 2 gloo ranks, tests/multiproc/check_random_ops.py.

The ranks seed their generators differently (``set_seed(seed, device_specific=True)``) and train with dropout on
under a 1 x 2 plan; rank 0 runs each step in one process too, from its generator state at the step's start.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from torchrun_launch import run_torchrun

ROOT = Path(__file__).resolve().parents[1]
DROPOUT = 0.1
pytestmark = pytest.mark.slow  # one 2-process launch


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, dict]:
    out = tmp_path_factory.mktemp("random_ops") / "result.json"
    run_torchrun(str(ROOT / "tests" / "multiproc" / "check_random_ops.py"), "--out", str(out), timeout=400)
    return {r["model"]: r for r in json.loads(out.read_text())}


def _one_process(result: dict) -> None:
    """Both ranks report the same loss at every step, the replicated parameters are bit-identical across the
    group after the steps, and losses and gradients are those of one process drawing from rank 0's generator."""
    name = result["model"]
    for both in result["losses"]:
        assert both[0] == both[1], (name, result["losses"])
    assert result["replicated_gap"] == 0.0, name
    assert result["max_grad_diff"] < 1e-5, name
    for (got, _), want in zip(result["losses"], result["reference_losses"], strict=True):
        assert got == pytest.approx(want, abs=1e-5), name


@pytest.mark.parametrize("model", ["gpt2", "llama"])
def test_tensor_parallel_group_draws_as_one_process(results, model):
    """GPT-2's default dropout (attention replicated at this width: every mask on a shared value) and Llama's
    attention dropout (heads sharded over tp), 3 AdamW steps under device-specific seeds."""
    result = results[model]
    _one_process(result)
    assert result["agreements_per_step"] == [1, 1, 1]
    assert len(result["losses"]) == 3


def test_attention_dropout_on_sharded_heads_draws_per_shard(results):
    """The attention-probability masks of heads sharded over tp: each rank draws its own heads' part (the
    shards' masks differ), and together they drop at the configured rate."""
    result = results["llama"]
    assert result["whole_draws"] > 0
    rank0, rank1 = result["attention_masks"]
    assert rank0 and len(rank0) == len(rank1)
    for (placement0, mask0), (placement1, mask1) in zip(rank0, rank1, strict=True):
        assert placement0 == placement1 == "(Shard(dim=1),)"
        assert mask0 != mask1
        values = _flatten(mask0) + _flatten(mask1)
        dropped = sum(1 for v in values if v == 0) / len(values)
        sigma = math.sqrt(DROPOUT * (1 - DROPOUT) / len(values))
        assert abs(dropped - DROPOUT) < 5 * sigma, dropped


def _flatten(nested) -> list[float]:
    if isinstance(nested, list):
        return [v for item in nested for v in _flatten(item)]
    return [nested]


@pytest.mark.parametrize("model", ["llama-full", "llama-selective"])
def test_recomputed_blocks_replay_the_masks(results, model):
    """Every block recomputed in backward (a full checkpoint; a selective one rerunning the pointwise ops):
    the rerun draws the forward's masks — gradients as without recompute, and the draws made twice."""
    result = results[model]
    assert result["recomputed"] == ["model.layers.0", "model.layers.1"]
    _one_process(result)
    assert result["losses"] == results["llama"]["losses"]
    assert result["whole_draws"] == 2 * results["llama"]["whole_draws"]


def test_without_random_ops_the_agreement_is_skipped(results):
    """Dropout 0: the generators are agreed in the first training forward only; once dropout is switched on,
    the group agrees again before the first draw, and the step is still one process's."""
    result = results["gpt2-p0"]
    assert result["agreements_per_step"] == [1, 0, 1]
    _one_process(result)


def test_plans_without_tensor_parallelism_change_nothing(results):
    """A 2 x 1 plan (data parallelism only): no agreement installed; each replica draws from its own stream."""
    assert results["ddp"]["installed"] is False


def test_sampling_generate_picks_the_same_tokens_on_the_group(results):
    """``generate(do_sample=True)`` samples outside the forward; the group's ranks, seeded differently, pick
    the same tokens (they feed them to the next forward as one replicated batch)."""
    rank0, rank1 = results["llama"]["sampled_tokens"]
    assert len(rank0[0]) == 6
    assert rank0 == rank1
