"""A causal-LM fine-tuning script in the shape of transformers' ``examples/pytorch/language-modeling/
run_clm_no_trainer.py``: written for plain accelerate, not for this project, and run unchanged under
``accelerate launch`` and under ``accelerate launch -m hf_colossal_auto.run``.

It keeps what the example does (``datasets`` text files, a tokenizer from a directory, ``group_texts``,
``default_data_collator``, a shuffled loader, AdamW with the no-decay groups, ``get_scheduler``,
``accelerator.accumulate``, evaluation with ``gather_for_metrics``, the example's save lines) and leaves out the
Hub, tracking and checkpointing options. Two additions serve the tests: ``--log_file`` (written by the main
process: each step's mean loss over processes, and a digest of the rows each step trained on) and the model
built from ``--config_name`` only, as the example does without ``--model_name_or_path``.
"""

import argparse
import hashlib
import json
import math
from itertools import chain

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from datasets import load_dataset
from torch.utils.data import DataLoader
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    default_data_collator,
    get_scheduler,
)


def parse_args():
    parser = argparse.ArgumentParser(
        description="Finetune a transformers model on a causal language modeling task"
    )
    parser.add_argument("--train_file", type=str, required=True)
    parser.add_argument("--validation_file", type=str, required=True)
    parser.add_argument("--config_name", type=str, required=True)
    parser.add_argument("--tokenizer_name", type=str, required=True)
    parser.add_argument("--per_device_train_batch_size", type=int, default=4)
    parser.add_argument("--per_device_eval_batch_size", type=int, default=4)
    parser.add_argument("--learning_rate", type=float, default=5e-4)
    parser.add_argument("--weight_decay", type=float, default=0.0)
    parser.add_argument("--max_train_steps", type=int, default=6)
    parser.add_argument("--gradient_accumulation_steps", type=int, default=1)
    parser.add_argument("--lr_scheduler_type", type=str, default="linear")
    parser.add_argument("--num_warmup_steps", type=int, default=0)
    parser.add_argument("--output_dir", type=str, required=True)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--block_size", type=int, default=32)
    parser.add_argument("--log_file", type=str, default=None)
    return parser.parse_args()


def row_digest(input_ids: torch.Tensor) -> list[str]:
    return [hashlib.sha1(row.cpu().numpy().tobytes()).hexdigest()[:12] for row in input_ids]


def main():
    args = parse_args()
    accelerator = Accelerator(gradient_accumulation_steps=args.gradient_accumulation_steps)
    if args.seed is not None:
        set_seed(args.seed)

    raw_datasets = load_dataset(
        "text", data_files={"train": args.train_file, "validation": args.validation_file}
    )
    config = AutoConfig.from_pretrained(args.config_name)
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_name)
    model = AutoModelForCausalLM.from_config(config)

    embedding_size = model.get_input_embeddings().weight.shape[0]
    if len(tokenizer) > embedding_size:
        model.resize_token_embeddings(len(tokenizer))

    column_names = raw_datasets["train"].column_names
    text_column_name = "text" if "text" in column_names else column_names[0]

    def tokenize_function(examples):
        return tokenizer(examples[text_column_name])

    with accelerator.main_process_first():
        tokenized_datasets = raw_datasets.map(tokenize_function, batched=True, remove_columns=column_names)

    block_size = args.block_size

    def group_texts(examples):
        concatenated_examples = {k: list(chain(*examples[k])) for k in examples.keys()}  # noqa: SIM118 (as the example writes it)
        total_length = len(concatenated_examples[list(examples.keys())[0]])
        total_length = (total_length // block_size) * block_size
        result = {
            k: [t[i : i + block_size] for i in range(0, total_length, block_size)]
            for k, t in concatenated_examples.items()
        }
        result["labels"] = result["input_ids"].copy()
        return result

    with accelerator.main_process_first():
        lm_datasets = tokenized_datasets.map(group_texts, batched=True)

    train_dataset = lm_datasets["train"]
    eval_dataset = lm_datasets["validation"]

    train_dataloader = DataLoader(
        train_dataset,
        shuffle=True,
        collate_fn=default_data_collator,
        batch_size=args.per_device_train_batch_size,
    )
    eval_dataloader = DataLoader(
        eval_dataset, collate_fn=default_data_collator, batch_size=args.per_device_eval_batch_size
    )

    no_decay = ["bias", "layer_norm.weight"]
    optimizer_grouped_parameters = [
        {
            "params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)],
            "weight_decay": args.weight_decay,
        },
        {
            "params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)],
            "weight_decay": 0.0,
        },
    ]
    optimizer = torch.optim.AdamW(optimizer_grouped_parameters, lr=args.learning_rate)

    lr_scheduler = get_scheduler(
        name=args.lr_scheduler_type,
        optimizer=optimizer,
        num_warmup_steps=args.num_warmup_steps * accelerator.num_processes,
        num_training_steps=args.max_train_steps * accelerator.num_processes,
    )

    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader, lr_scheduler
    )

    log = {"losses": [], "rows": []}
    completed_steps = 0
    model.train()
    for batch in train_dataloader:
        with accelerator.accumulate(model):
            outputs = model(**batch)
            loss = outputs.loss
            log["losses"].append(accelerator.gather(loss.detach().reshape(1)).mean().item())
            digests = [None] * accelerator.num_processes
            torch.distributed.all_gather_object(digests, row_digest(batch["input_ids"]))
            log["rows"].append(sorted(set(chain(*digests))))
            accelerator.backward(loss)
            optimizer.step()
            lr_scheduler.step()
            optimizer.zero_grad()
        if accelerator.sync_gradients:
            completed_steps += 1
        if completed_steps >= args.max_train_steps:
            break

    model.eval()
    losses = []
    for batch in eval_dataloader:
        with torch.no_grad():
            outputs = model(**batch)
        loss = outputs.loss
        losses.append(accelerator.gather_for_metrics(loss.repeat(args.per_device_eval_batch_size)))
    losses = torch.cat(losses)
    eval_loss = torch.mean(losses)
    try:
        perplexity = math.exp(eval_loss)
    except OverflowError:
        perplexity = float("inf")
    accelerator.print(f"perplexity: {perplexity} eval_loss: {eval_loss}")
    log.update(eval_loss=eval_loss.item(), perplexity=perplexity, eval_samples=len(losses))

    accelerator.wait_for_everyone()
    unwrapped_model = accelerator.unwrap_model(model)
    unwrapped_model.save_pretrained(
        args.output_dir, is_main_process=accelerator.is_main_process, save_function=accelerator.save
    )
    if accelerator.is_main_process:
        tokenizer.save_pretrained(args.output_dir)
        if args.log_file is not None:
            with open(args.log_file, "w") as f:
                json.dump(log, f)
    accelerator.end_training()


if __name__ == "__main__":
    main()
