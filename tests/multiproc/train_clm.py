"""A Trainer script in the shape of transformers' run_clm.py, knowing nothing of hf-colossal-auto.

    ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 train_clm.py --out plain.json
    ACCELERATE_USE_CPU=1 HF_COLOSSAL_AUTO_MESH_SHAPE=1x2 accelerate launch --config_file recipes/auto_cpu.yaml \\
        --multi_gpu --num_processes 2 -m hf_colossal_auto.run train_clm.py --out planned.json

Text is tokenized (a word-level tokenizer trained here), grouped into blocks of ``--block-size`` tokens as
run_clm's ``group_texts`` does, held in a ``datasets.Dataset``; ``Trainer`` + ``TrainingArguments`` (shuffled
training set, ``logging_steps=1``, an evaluation at the end) train a seeded tiny model without dropout in fp32.
The main process writes every logged loss, the eval loss and the number of steps to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import random

import torch
import transformers
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Trainer, TrainingArguments, default_data_collator

from hf_colossal_auto.models import build_model, load_config

WORDS = [
    "the",
    "a",
    "model",
    "data",
    "step",
    "batch",
    "plan",
    "mesh",
    "rank",
    "loss",
    "token",
    "block",
    "shard",
    "group",
    "sample",
    "train",
]


def corpus(lines: int) -> list[str]:
    rng = random.Random(0)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 30))) for _ in range(lines)]


def tokenizer_for(texts: list[str]) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(texts, trainers.WordLevelTrainer(special_tokens=["[UNK]", "[PAD]"]))
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]")


def group_texts(examples: dict, block_size: int) -> dict:
    """run_clm's: concatenate, cut into blocks, labels = input_ids."""
    joined = {k: sum(examples[k], []) for k in examples}
    total = (len(joined["input_ids"]) // block_size) * block_size
    out = {k: [t[i : i + block_size] for i in range(0, total, block_size)] for k, t in joined.items()}
    out["labels"] = out["input_ids"].copy()
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--output-dir", default=None)
    parser.add_argument("--model", default="tiny-llama")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-steps", type=int, default=4)
    args = parser.parse_args()
    transformers.logging.set_verbosity_error()
    texts = corpus(200)
    tokenizer = tokenizer_for(texts)
    raw = Dataset.from_dict({"text": texts})
    tokenized = raw.map(lambda b: tokenizer(b["text"]), batched=True, remove_columns=["text"])
    blocks = tokenized.map(lambda b: group_texts(b, args.block_size), batched=True)
    # 16 evaluation blocks fill the last batch of both processes: no rows padded in (see integrations/data.py)
    train, valid = blocks.select(range(len(blocks) - 16)), blocks.select(range(len(blocks) - 16, len(blocks)))

    config = load_config(args.model)
    config.vocab_size = len(tokenizer)
    torch.manual_seed(0)
    model = build_model(config, device="cpu")
    training_args = TrainingArguments(
        output_dir=args.output_dir or args.out + ".d",
        per_device_train_batch_size=4,
        per_device_eval_batch_size=4,
        max_steps=args.max_steps,
        learning_rate=1e-3,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=0,
        disable_tqdm=True,
    )
    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=train,
        eval_dataset=valid,
        processing_class=tokenizer,
        data_collator=default_data_collator,
    )
    trainer.train()
    metrics = trainer.evaluate()
    plan = getattr(trainer.model, "_hf_colossal_auto_plan", None)
    if trainer.is_world_process_zero():
        losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
        with open(args.out, "w") as f:
            json.dump(
                {
                    "losses": losses,
                    "eval_loss": metrics["eval_loss"],
                    "steps": trainer.state.global_step,
                    "processes": trainer.args.world_size,
                    "mesh": list(plan.mesh_shape) if plan is not None else None,
                    "accelerator": type(trainer.accelerator).__name__,
                },
                f,
            )


if __name__ == "__main__":
    main()
