"""Pretrain a GPT-2 causal language model from scratch, parallelized by hf-colossal-auto.

    python recipes/pretrain_gpt.py --model tiny --max_steps 50 --output_dir out/gpt
    accelerate launch --config_file recipes/auto.yaml recipes/pretrain_gpt.py --model gpt2-xl ...

Every block of ``--seq_len`` packed tokens is its own target (the model shifts the labels by one).
See recipes/README.md for the multi-process commands.
"""

from __future__ import annotations

from argparse import Namespace

import numpy as np
from _shared.data import ExampleFn
from _shared.loop import run
from _shared.recipe import Recipe
from transformers import PretrainedConfig, PreTrainedTokenizerBase

from hf_colossal_auto.integrations.process_exit import finish


def example_fn(args: Namespace, tokenizer: PreTrainedTokenizerBase) -> ExampleFn:
    del args, tokenizer

    def make(block: np.ndarray, rng: np.random.Generator) -> dict[str, np.ndarray]:
        del rng
        return {"input_ids": block, "attention_mask": np.ones_like(block), "labels": block}

    return make


def configure(config: PretrainedConfig, tokenizer: PreTrainedTokenizerBase) -> None:
    config.bos_token_id = config.eos_token_id = config.pad_token_id = tokenizer.eos_token_id


GPT = Recipe(
    name="gpt",
    description=__doc__.splitlines()[0],
    task="causal-lm",
    presets={
        "tiny": "tiny-gpt2",
        "gpt2": "gpt2",
        "gpt2-medium": "gpt2-medium",
        "gpt2-large": "gpt2-large",
        "gpt2-xl": "gpt2-xl",
    },
    tokenizer_kind="bpe",
    learning_rate=6e-4,
    block_length=lambda args: args.seq_len,
    separator_id=lambda tokenizer: tokenizer.eos_token_id,
    example_fn=example_fn,
    configure=configure,
)

if __name__ == "__main__":
    run(GPT)
    # End before interpreter teardown while the model's process groups are alive (gloo's worker threads can
    # abort the exit otherwise: hf_colossal_auto/integrations/process_exit.py)
    finish()
