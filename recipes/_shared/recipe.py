"""What differs between the recipes, as data: the ``Recipe`` each script fills in and hands to the loop."""

from __future__ import annotations

from argparse import ArgumentParser, Namespace
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from transformers import PretrainedConfig, PreTrainedTokenizerBase

from .data import ExampleFn


def _no_arguments(parser: ArgumentParser) -> None:
    del parser


@dataclass(frozen=True)
class Recipe:
    """One pretraining objective: model family, tokenizer family, and how a packed block becomes an example.

    ``block_length(args)`` is the number of raw tokens cut per example (``--seq_len`` for GPT, ``--seq_len``
    minus [CLS]/[SEP] for BERT, more than ``--seq_len`` for T5, whose corruption shortens the input);
    ``example_fn(args, tokenizer)`` builds the function from a block to the model's inputs;
    ``configure(config, tokenizer)`` points the model config at the tokenizer's special tokens."""

    name: str
    description: str
    task: str
    presets: Mapping[str, str]
    tokenizer_kind: str
    learning_rate: float
    block_length: Callable[[Namespace], int]
    separator_id: Callable[[PreTrainedTokenizerBase], int]
    example_fn: Callable[[Namespace, PreTrainedTokenizerBase], ExampleFn]
    configure: Callable[[PretrainedConfig, PreTrainedTokenizerBase], None]
    num_sentinels: int = 0
    add_arguments: Callable[[ArgumentParser], None] = field(default=_no_arguments)
