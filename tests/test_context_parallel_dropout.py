"""Dropout under context parallelism (apply/rng.py): one launch of 4 gloo ranks,
tests/multiproc/check_context_parallel_dropout.py.

The cp ranks of a replica hold different tokens of the same rows with tensors of the same shapes; seeded alike
(accelerate's ``set_seed(seed)``), they would draw the same masks for different tokens. One process's masks are
independent over the tokens: the cp ranks must draw from streams of their own (two independent masks at
p = 0.1 drop the same element at a rate of p^2 = 0.01, identical ones at p), the tensor-parallel ranks of one cp
rank the same masks, and recomputed blocks the forward's masks. Unit: the streams derived per cp rank.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torchrun_launch import run_torchrun

from hf_colossal_auto.apply.rng import stream_states

ROOT = Path(__file__).resolve().parents[1]
DROPOUT = 0.1


def test_each_cp_rank_draws_from_its_own_stream():
    """cp rank 0 draws from the agreed generator itself, the others from streams that differ from it and from
    each other, follow the agreed state (a later state, another stream) and are the same for the same inputs."""
    torch.manual_seed(3)
    agreed = [torch.get_rng_state()]
    assert stream_states(agreed, None, 0) is agreed
    draws = []
    for stream in range(3):
        torch.set_rng_state(stream_states(agreed, None, stream)[0])
        draws.append(torch.rand(1000))
    assert not torch.equal(draws[0], draws[1]) and not torch.equal(draws[1], draws[2])
    assert torch.equal(stream_states(agreed, None, 1)[0], stream_states(agreed, None, 1)[0])
    torch.set_rng_state(agreed[0])
    torch.rand(1)  # the first rank's generator advanced: the next step's streams are new
    assert not torch.equal(
        stream_states([torch.get_rng_state()], None, 1)[0], stream_states(agreed, None, 1)[0]
    )


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("cp_dropout") / "result.json"
    run_torchrun(
        str(ROOT / "tests" / "multiproc" / "check_context_parallel_dropout.py"),
        "--out",
        str(out),
        nproc=4,
        timeout=400,
    )
    return json.loads(out.read_text())


def _masks(rank: dict) -> list[tuple[str, torch.Tensor]]:
    return [(placement, torch.tensor(mask)) for placement, mask in rank["masks"]]


def _by_coords(ranks: list[dict]) -> dict[tuple[int, int, int], dict]:
    return {(r["dp"], r["cp"], r["tp"]): r for r in ranks}


@pytest.mark.slow
@pytest.mark.parametrize("mesh", ["dp2-cp2", "cp2-tp2"])
def test_cp_ranks_draw_independent_masks(results, mesh):
    """Every dropout of the forward (embeddings, attention probabilities, residuals: 7 in tiny GPT-2) draws on
    each cp rank a mask independent of the other cp rank's, at the dropout's rate."""
    ranks = _by_coords(results[mesh])
    pairs = [(r, ranks[(d, 1, t)]) for (d, c, t), r in ranks.items() if c == 0]
    assert pairs
    for first, second in pairs:
        masks, others = _masks(first), _masks(second)
        assert len(masks) == len(others) == 7
        for (_, a), (_, b) in zip(masks, others, strict=True):
            assert a.shape == b.shape
            dropped_a, dropped_b = (~a).float().mean().item(), (~b).float().mean().item()
            both = ((~a) & (~b)).float().mean().item()
            assert abs(dropped_a - DROPOUT) < 0.03 and abs(dropped_b - DROPOUT) < 0.03
            assert both < 3 * DROPOUT**2, (mesh, both)  # identical masks: both == dropped (0.1)


@pytest.mark.slow
def test_tensor_parallel_ranks_of_a_cp_rank_agree(results):
    """cp 2 x tp 2: the tp ranks of each cp rank draw the same masks on the values they share."""
    ranks = _by_coords(results["cp2-tp2"])
    for cp in (0, 1):
        first, second = _masks(ranks[(0, cp, 0)]), _masks(ranks[(0, cp, 1)])
        replicated = [(a, b) for (p, a), (_, b) in zip(first, second, strict=True) if "Replicate" in p]
        assert replicated
        assert all(torch.equal(a, b) for a, b in replicated)


@pytest.mark.slow
@pytest.mark.parametrize("mesh", ["dp2-cp2", "cp2-tp2"])
def test_recomputed_blocks_and_generators(results, mesh):
    """Every block recomputed: the same masks and gradients as without. After the forward only the replica's
    first rank has advanced its generator (as one process would); the others have theirs back."""
    for rank in results[mesh]:
        assert rank["recompute_same_masks"], rank["rank"]
        assert rank["recompute_grad_diff"] == 0.0, rank["rank"]
        first = rank["cp"] == 0 and rank["tp"] == 0
        assert rank["generator_unchanged"] is not first, rank["rank"]
