"""Packing token streams into fixed-length blocks, and the dataset that turns a block into a training example.

Packing (concatenate every document, separator between them, cut into equal blocks) wastes no compute on
padding and gives every batch the same shape — the shape the parallelization plan was made for.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch
from torch.utils.data import Dataset
from transformers import PreTrainedTokenizerBase

# One block of raw token ids and a generator -> the model's keyword arguments for that example.
ExampleFn = Callable[[np.ndarray, np.random.Generator], dict[str, np.ndarray]]


def tokenize(
    tokenizer: PreTrainedTokenizerBase, documents: Sequence[str], chunk: int = 2048
) -> list[list[int]]:
    """Token ids of every document without special tokens (the packer adds the separators)."""
    ids: list[list[int]] = []
    for start in range(0, len(documents), chunk):
        ids.extend(tokenizer(list(documents[start : start + chunk]), add_special_tokens=False)["input_ids"])
    return ids


def pack(
    token_lists: Sequence[Sequence[int]], block_length: int, separator_id: int, what: str = "train"
) -> np.ndarray:
    """``[n_blocks, block_length]`` int64: the documents concatenated, ``separator_id`` after each one, cut
    into blocks; the tail shorter than a block is dropped."""
    if block_length < 1:
        raise ValueError(f"block length must be >= 1, got {block_length}")
    stream = np.fromiter(
        (t for ids in token_lists for t in (*ids, separator_id)),
        dtype=np.int64,
        count=sum(len(ids) + 1 for ids in token_lists),
    )
    n_blocks = len(stream) // block_length
    if n_blocks == 0:
        raise ValueError(
            f"the {what} text has {len(stream)} tokens, fewer than one block of {block_length}; "
            "give more text (--train_file / --synthetic_documents) or a shorter --seq_len"
        )
    return stream[: n_blocks * block_length].reshape(n_blocks, block_length)


class BlockDataset(Dataset):
    """Packed blocks turned into examples by ``make_example``, randomised by (seed, epoch, index) only.

    The same example index gives the same masks in every process (tensor-parallel ranks must see identical
    batches) and in a resumed run; ``set_epoch`` (called by Accelerate's data loader each pass) draws fresh
    masks for the next pass over the data, as dynamic masking does."""

    def __init__(self, blocks: np.ndarray, make_example: ExampleFn, seed: int) -> None:
        self.blocks = blocks
        self.make_example = make_example
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        rng = np.random.default_rng([self.seed, self.epoch, int(index)])
        return {
            k: torch.as_tensor(v, dtype=torch.long)
            for k, v in self.make_example(self.blocks[index], rng).items()
        }
