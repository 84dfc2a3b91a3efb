"""Pretrain a BERT masked language model from scratch, parallelized by hf-colossal-auto.

    python recipes/pretrain_bert.py --model tiny --max_steps 50 --output_dir out/bert
    accelerate launch --config_file recipes/auto.yaml recipes/pretrain_bert.py --model bert-large ...

Each example is ``[CLS]`` + ``--seq_len - 2`` packed tokens + ``[SEP]``; 15% of the ordinary tokens are chosen
(80% of them become ``[MASK]``, 10% a random token, 10% stay) and only those are predicted. Masks are drawn
afresh each epoch. No next-sentence prediction (RoBERTa showed it does not help).
"""

from __future__ import annotations

from argparse import ArgumentParser, Namespace

import numpy as np
from _shared.data import ExampleFn
from _shared.loop import run
from _shared.objectives import mask_tokens
from _shared.recipe import Recipe
from transformers import PretrainedConfig, PreTrainedTokenizerBase

from hf_colossal_auto.integrations.process_exit import finish


def add_arguments(parser: ArgumentParser) -> None:
    parser.add_argument("--mlm_probability", type=float, default=0.15, help="share of tokens to predict")


def example_fn(args: Namespace, tokenizer: PreTrainedTokenizerBase) -> ExampleFn:
    if not 0 < args.mlm_probability < 1:
        raise SystemExit(f"--mlm_probability must be in (0, 1), got {args.mlm_probability}")
    special = list(tokenizer.all_special_ids)
    vocab_size = len(tokenizer)
    cls, sep = tokenizer.cls_token_id, tokenizer.sep_token_id

    def make(block: np.ndarray, rng: np.random.Generator) -> dict[str, np.ndarray]:
        inputs, labels = mask_tokens(
            block,
            rng,
            mask_id=tokenizer.mask_token_id,
            vocab_size=vocab_size,
            special_ids=special,
            probability=args.mlm_probability,
        )
        input_ids = np.concatenate([[cls], inputs, [sep]])
        return {
            "input_ids": input_ids,
            "token_type_ids": np.zeros_like(input_ids),
            "labels": np.concatenate([[-100], labels, [-100]]),
        }

    return make


def block_length(args: Namespace) -> int:
    if args.seq_len < 3:
        raise SystemExit(f"--seq_len must be at least 3 ([CLS], a token, [SEP]), got {args.seq_len}")
    return args.seq_len - 2


def configure(config: PretrainedConfig, tokenizer: PreTrainedTokenizerBase) -> None:
    config.pad_token_id = tokenizer.pad_token_id


BERT = Recipe(
    name="bert",
    description=__doc__.splitlines()[0],
    task="masked-lm",
    presets={"tiny": "tiny-bert", "bert-base": "bert-base", "bert-large": "bert-large"},
    tokenizer_kind="wordpiece",
    learning_rate=1e-4,
    block_length=block_length,
    separator_id=lambda tokenizer: tokenizer.sep_token_id,
    example_fn=example_fn,
    configure=configure,
    add_arguments=add_arguments,
)

if __name__ == "__main__":
    run(BERT)
    # End before interpreter teardown while the model's process groups are alive (gloo's worker threads can
    # abort the exit otherwise: hf_colossal_auto/integrations/process_exit.py)
    finish()
