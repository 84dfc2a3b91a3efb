"""Pretrain a T5 encoder-decoder with span corruption from scratch, parallelized by hf-colossal-auto.

    python recipes/pretrain_t5.py --model tiny --max_steps 50 --output_dir out/t5
    accelerate launch --config_file recipes/auto.yaml recipes/pretrain_t5.py --model t5-large ...

As in the T5 paper: 15% of the tokens, in spans of mean length 3, are replaced in the encoder input by one
sentinel each (``<extra_id_0>``, ``<extra_id_1>``, ...); the decoder predicts ``<extra_id_0> span_0
<extra_id_1> span_1 ... </s>``. ``--seq_len`` is the encoder length; the raw tokens cut per example and the
target length follow from it (512 -> 568 raw tokens, 114 target tokens).
"""

from __future__ import annotations

from argparse import ArgumentParser, Namespace

import numpy as np
from _shared.data import ExampleFn
from _shared.loop import run
from _shared.objectives import noise_span_count, span_corrupt, t5_lengths
from _shared.recipe import Recipe
from _shared.tokenizer import sentinel_ids
from transformers import PretrainedConfig, PreTrainedTokenizerBase

from hf_colossal_auto.integrations.process_exit import finish

NUM_SENTINELS = 100


def add_arguments(parser: ArgumentParser) -> None:
    parser.add_argument("--noise_density", type=float, default=0.15, help="share of tokens corrupted")
    parser.add_argument("--mean_noise_span_length", type=float, default=3.0)


def _check(args: Namespace) -> None:
    if not 0 < args.noise_density < 1:
        raise SystemExit(f"--noise_density must be in (0, 1), got {args.noise_density}")
    if args.mean_noise_span_length < 1:
        raise SystemExit(f"--mean_noise_span_length must be >= 1, got {args.mean_noise_span_length}")


def block_length(args: Namespace) -> int:
    _check(args)
    return t5_lengths(args.seq_len, args.noise_density, args.mean_noise_span_length)[0]


def example_fn(args: Namespace, tokenizer: PreTrainedTokenizerBase) -> ExampleFn:
    length = block_length(args)
    sentinels = sentinel_ids(
        tokenizer, noise_span_count(length, args.noise_density, args.mean_noise_span_length)
    )

    def make(block: np.ndarray, rng: np.random.Generator) -> dict[str, np.ndarray]:
        input_ids, labels = span_corrupt(
            block,
            rng,
            sentinel_ids=sentinels,
            eos_id=tokenizer.eos_token_id,
            noise_density=args.noise_density,
            mean_span_length=args.mean_noise_span_length,
        )
        return {"input_ids": input_ids, "labels": labels}

    return make


def configure(config: PretrainedConfig, tokenizer: PreTrainedTokenizerBase) -> None:
    config.pad_token_id = config.decoder_start_token_id = tokenizer.pad_token_id
    config.eos_token_id = tokenizer.eos_token_id


T5 = Recipe(
    name="t5",
    description=__doc__.splitlines()[0],
    task="seq2seq-lm",
    presets={"tiny": "tiny-t5", "t5-small": "t5-small", "t5-base": "t5-base", "t5-large": "t5-large"},
    tokenizer_kind="unigram",
    learning_rate=5e-4,
    block_length=block_length,
    separator_id=lambda tokenizer: tokenizer.eos_token_id,
    example_fn=example_fn,
    configure=configure,
    num_sentinels=NUM_SENTINELS,
    add_arguments=add_arguments,
)

if __name__ == "__main__":
    run(T5)
    # End before interpreter teardown while the model's process groups are alive (gloo's worker threads can
    # abort the exit otherwise: hf_colossal_auto/integrations/process_exit.py)
    finish()
