"""Pretraining objectives on one packed block of token ids: BERT's masked LM and T5's span corruption.

Both take an explicit ``numpy.random.Generator`` and no global state: the datasets seed it from (seed, epoch,
example index), so every process that draws example i in an epoch builds the same masks. Tensor-parallel
ranks must see identical batches, which random masking in each process would silently break.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def mask_tokens(
    ids: np.ndarray,
    rng: np.random.Generator,
    *,
    mask_id: int,
    vocab_size: int,
    special_ids: Sequence[int],
    probability: float = 0.15,
) -> tuple[np.ndarray, np.ndarray]:
    """BERT's masking: choose ``probability`` of the non-special positions; of those 80% become ``mask_id``,
    10% a random token, 10% stay. Returns ``(input_ids, labels)`` with labels -100 at unchosen positions.

    At least one position is chosen, so the loss of a short sequence is never a 0/0."""
    ids = np.asarray(ids, dtype=np.int64)
    candidates = ~np.isin(ids, np.asarray(list(special_ids), dtype=np.int64))
    chosen = (rng.random(ids.shape) < probability) & candidates
    if not chosen.any() and candidates.any():
        chosen[rng.choice(np.flatnonzero(candidates))] = True
    labels = np.where(chosen, ids, -100)
    inputs = ids.copy()
    action = rng.random(ids.shape)
    inputs[chosen & (action < 0.8)] = mask_id
    randomized = chosen & (action >= 0.8) & (action < 0.9)
    inputs[randomized] = rng.integers(0, vocab_size, size=int(randomized.sum()))
    return inputs, labels


def _corrupted_lengths(
    tokens_length: int, noise_density: float, mean_span_length: float
) -> tuple[int, int, int]:
    """(noise tokens, noise spans, non-noise tokens) of a span-corrupted block of ``tokens_length`` tokens."""
    num_noise = min(max(int(round(tokens_length * noise_density)), 1), tokens_length - 1)
    num_spans = max(int(round(num_noise / mean_span_length)), 1)
    return num_noise, num_spans, tokens_length - num_noise


def noise_span_count(tokens_length: int, noise_density: float = 0.15, mean_span_length: float = 3.0) -> int:
    """Noise spans (so sentinels) in a corrupted block of ``tokens_length`` tokens."""
    num_noise, num_spans, num_kept = _corrupted_lengths(tokens_length, noise_density, mean_span_length)
    return min(num_spans, num_noise, num_kept)


def t5_lengths(
    inputs_length: int, noise_density: float = 0.15, mean_span_length: float = 3.0
) -> tuple[int, int]:
    """``(tokens_length, targets_length)``: how many raw tokens to cut per example so that after span
    corruption the encoder input is at most ``inputs_length`` long (each span becomes one sentinel, plus EOS),
    and the decoder target length that results (each span's tokens behind its sentinel, plus EOS).

    As ``compute_input_and_target_lengths`` of the T5 paper's code: the largest raw length that fits."""
    if inputs_length < 3:
        raise ValueError(f"--seq_len must be at least 3 for span corruption, got {inputs_length}")

    def corrupted(length: int) -> tuple[int, int]:
        num_noise, num_spans, num_kept = _corrupted_lengths(length, noise_density, mean_span_length)
        return num_kept + num_spans + 1, num_noise + num_spans + 1

    tokens_length = inputs_length
    while corrupted(tokens_length + 1)[0] <= inputs_length:
        tokens_length += 1
    return tokens_length, corrupted(tokens_length)[1]


def _random_segmentation(num_items: int, num_segments: int, rng: np.random.Generator) -> np.ndarray:
    """``num_segments`` positive lengths summing to ``num_items``, uniformly over such splits."""
    cuts = np.sort(rng.choice(np.arange(1, num_items), size=num_segments - 1, replace=False))
    return np.diff(np.concatenate([[0], cuts, [num_items]]))


def random_spans_noise_mask(
    length: int, rng: np.random.Generator, noise_density: float = 0.15, mean_span_length: float = 3.0
) -> np.ndarray:
    """Boolean mask of ``length``: ``round(length * noise_density)`` noise tokens in spans of mean length
    ``mean_span_length``, alternating with kept spans, starting with a kept span (T5's noise mask)."""
    num_noise, _, num_kept = _corrupted_lengths(length, noise_density, mean_span_length)
    num_spans = noise_span_count(length, noise_density, mean_span_length)
    noise_spans = _random_segmentation(num_noise, num_spans, rng)
    kept_spans = _random_segmentation(num_kept, num_spans, rng)
    span_lengths = np.stack([kept_spans, noise_spans], axis=1).reshape(-1)
    is_noise = np.tile([False, True], num_spans)
    return np.repeat(is_noise, span_lengths)


def _replace_spans(ids: np.ndarray, spans: np.ndarray, sentinels: Sequence[int], eos_id: int) -> np.ndarray:
    """``ids`` with each run of True in ``spans`` replaced by the next sentinel, then ``eos_id``."""
    starts = spans & ~np.concatenate([[False], spans[:-1]])
    out = np.where(starts, -1, ids)[~spans | starts]
    out[out == -1] = np.asarray(sentinels[: int(starts.sum())], dtype=np.int64)
    return np.concatenate([out, [eos_id]])


def span_corrupt(
    ids: np.ndarray,
    rng: np.random.Generator,
    *,
    sentinel_ids: Sequence[int],
    eos_id: int,
    noise_density: float = 0.15,
    mean_span_length: float = 3.0,
) -> tuple[np.ndarray, np.ndarray]:
    """T5 span corruption of one block of raw token ids: ``(input_ids, labels)``.

    The input keeps the non-noise tokens with ``<extra_id_k>`` (``sentinel_ids[k]``) in place of the k-th
    noise span; the labels are ``<extra_id_0> span_0 <extra_id_1> span_1 ...``; both end with ``eos_id``. For
    a block of ``t5_lengths(L)[0]`` tokens the lengths are exactly ``L`` and ``t5_lengths(L)[1]``."""
    ids = np.asarray(ids, dtype=np.int64)
    noise = random_spans_noise_mask(len(ids), rng, noise_density, mean_span_length)
    n_spans = int((noise & ~np.concatenate([[False], noise[:-1]])).sum())
    if n_spans > len(sentinel_ids):
        raise ValueError(
            f"span corruption made {n_spans} noise spans but the tokenizer has {len(sentinel_ids)} sentinel "
            "tokens; use a shorter --seq_len or a tokenizer with more <extra_id_N> tokens"
        )
    inputs = _replace_spans(ids, noise, sentinel_ids, eos_id)
    # The labels are the same operation on the complement: kept spans (the first one leads) become sentinels.
    labels = _replace_spans(ids, ~noise, sentinel_ids, eos_id)
    return inputs, labels
