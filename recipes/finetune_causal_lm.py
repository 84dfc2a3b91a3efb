"""Fine-tune a pretrained causal LM on prompt/response pairs or chat messages, parallelized by hf-colossal-auto.

    python recipes/finetune_causal_lm.py --model_name_or_path DIR --train_file data.jsonl --output_dir out/sft
    ACCELERATE_USE_CPU=1 accelerate launch --config_file recipes/auto_cpu.yaml --multi_gpu --num_processes 2 \\
        recipes/finetune_causal_lm.py --model_name_or_path DIR --train_file data.jsonl --output_dir out/sft

``DIR`` is a local checkpoint (config.json, safetensors weights, tokenizer files). The model is built on
``meta`` and each process reads only its own shards of the weights once the plan is applied
(``AutoParallelCallback(pretrained=DIR)``); training is the ``transformers.Trainer`` with that callback, and
the fine-tuned model is exported as a ``from_pretrained`` directory to ``<output_dir>/final``.

Each line of ``--train_file`` is ``{"prompt": ..., "response": ...}`` or ``{"messages": [{"role": ...,
"content": ...}, ...]}``. Conversations are rendered with the tokenizer's chat template; a tokenizer without one
gets :data:`PLAIN_CHAT_TEMPLATE` (saved with the export, so inference renders prompts the same way). The loss
is on the assistant's tokens only (labels -100 elsewhere). See recipes/README.md, "Fine-tuning".
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedTokenizerBase,
    Trainer,
    TrainingArguments,
)

from hf_colossal_auto import AutoParallelCallback, save_pretrained
from hf_colossal_auto.integrations.process_exit import finish
from hf_colossal_auto.run import use_cpu_without_gpus

logger = logging.getLogger("finetune_causal_lm")

IGNORE_INDEX = -100
"""Label of a token the loss skips (transformers' causal LM loss ignores -100)."""

PLAIN_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}### Assistant:\n{{ message['content'] }}{{ eos_token }}\n"
    "{% else %}### {{ message['role'] | capitalize }}:\n{{ message['content'] }}\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}### Assistant:\n{% endif %}"
)
"""The format for a tokenizer without a chat template: ``### User:`` / ``### Assistant:`` headers, each turn
on its own lines, the assistant's turns ended by the EOS token (so that a fine-tuned model learns to stop)."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    data = parser.add_argument_group("model and data")
    data.add_argument(
        "--model_name_or_path",
        required=True,
        help="a local checkpoint directory: config.json, model.safetensors (or an index) and tokenizer files",
    )
    data.add_argument(
        "--train_file", required=True, help="JSON lines: prompt/response pairs or chat messages"
    )
    data.add_argument("--max_seq_len", type=int, default=256, help="tokens per example (longer are cut)")
    data.add_argument(
        "--packing",
        action="store_true",
        help="concatenate examples into blocks of --max_seq_len (default: one example per row, padded)",
    )
    data.add_argument(
        "--freeze",
        help="regular expression: parameters whose name matches it are not trained (e.g. 'embed_tokens')",
    )
    train = parser.add_argument_group("training")
    train.add_argument("--max_steps", type=int, default=100)
    train.add_argument("--per_device_batch_size", type=int, default=4)
    train.add_argument("--gradient_accumulation_steps", type=int, default=1)
    train.add_argument("--lr", type=float, default=2e-5, help="peak learning rate of AdamW")
    train.add_argument("--warmup_steps", type=int, default=0)
    train.add_argument("--weight_decay", type=float, default=0.0)
    train.add_argument("--seed", type=int, default=42)
    train.add_argument("--logging_steps", type=int, default=1)
    train.add_argument("--output_dir", default="out/sft")
    plan = parser.add_argument_group("parallelization")
    plan.add_argument("--device", help="device kind the planner prices (e.g. a100-80gb); default: detected")
    plan.add_argument("--memory_budget", help="per-device memory budget for the planner, e.g. 40GiB")
    plan.add_argument(
        "--mesh_shape", help="force the (dp, tp) mesh, e.g. 1x2 (default: the planner searches)"
    )
    plan.add_argument(
        "--context_parallel",
        help="context parallelism for long sequences: a cp degree (each sequence split over that many ranks of a "
        "replica, which read the same rows; padded rows are padded to a multiple of 2 x cp tokens, --packing "
        "needs a --max_seq_len that is one), 'auto' (searched with the rest) or 1 (none); default: "
        "HF_COLOSSAL_AUTO_CONTEXT_PARALLEL if set, else 1",
    )
    return parser


def context_parallel_degree(value: str | None) -> int | str | None:
    """``--context_parallel`` parsed (an int, ``"auto"``), else ``HF_COLOSSAL_AUTO_CONTEXT_PARALLEL``'s, else None;
    a bad value exits naming the flag, on every process before any work."""
    from hf_colossal_auto.integrations.plugin import (
        ENV_PREFIX,
        PluginConfigError,
        parse_context_parallel,
    )

    source = ("--context_parallel", "the command line", value)
    if value is None:
        key = f"{ENV_PREFIX}CONTEXT_PARALLEL"
        source = (key, "the environment", os.environ.get(key))
    if source[2] is None:
        return None
    try:
        return parse_context_parallel(source[2], source[0], source[1])
    except PluginConfigError as exc:
        raise SystemExit(str(exc)) from None


def row_length(max_seq_len: int, cp: int | str | None, packing: bool) -> int:
    """Tokens per row: ``max_seq_len``; under a fixed cp degree a multiple of ``2 x cp`` (the runtime cuts each
    sequence into that many equal chunks): padded rows are padded up to one, packed blocks (cut from the
    stream, nothing padded) need ``--max_seq_len`` to be one. (``"auto"`` offers only the degrees whose chunks
    the planned rows divide into.)"""
    if not isinstance(cp, int) or cp <= 1 or max_seq_len % (2 * cp) == 0:
        return max_seq_len
    if packing:
        raise SystemExit(
            f"--context_parallel {cp} cuts each sequence into 2 x cp = {2 * cp} equal chunks; --packing cuts "
            f"blocks of --max_seq_len {max_seq_len} tokens, which does not divide. Use a multiple of {2 * cp}, "
            f"e.g. {max_seq_len - max_seq_len % (2 * cp) or 2 * cp}"
        )
    return max_seq_len + (-max_seq_len) % (2 * cp)


# --------------------------------------------------------------------------------------------- data
def read_conversations(path: str | Path) -> list[list[dict[str, str]]]:
    """Every line of a JSON-lines file as a list of chat messages (a prompt/response pair becomes a user and an
    assistant message). Malformed lines are errors naming the line, not skipped."""
    conversations = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        record = json.loads(line)
        if "messages" in record:
            messages = record["messages"]
            if not isinstance(messages, list) or not all(
                isinstance(m, dict) and {"role", "content"} <= m.keys() for m in messages
            ):
                raise ValueError(
                    f"{path}:{number}: 'messages' must be a list of {{'role', 'content'}} objects"
                )
        elif {"prompt", "response"} <= record.keys():
            messages = [
                {"role": "user", "content": record["prompt"]},
                {"role": "assistant", "content": record["response"]},
            ]
        else:
            raise ValueError(
                f"{path}:{number}: expected {{'prompt', 'response'}} or {{'messages': [...]}}, got keys "
                f"{sorted(record)}"
            )
        if not any(m["role"] == "assistant" for m in messages):
            raise ValueError(f"{path}:{number}: no assistant message, so nothing to learn from this line")
        conversations.append(messages)
    if not conversations:
        raise ValueError(f"{path} holds no examples")
    return conversations


def ensure_chat_template(tokenizer: PreTrainedTokenizerBase) -> None:
    """Give a tokenizer without a chat template :data:`PLAIN_CHAT_TEMPLATE`, and one without a padding token its
    EOS token (padding is masked out of attention and loss, so which token it is does not matter)."""
    if not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = PLAIN_CHAT_TEMPLATE
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token


def _render(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]], prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt)


def assistant_spans(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]]) -> tuple[str, list]:
    """The rendered conversation and the character spans of the assistant's turns in it.

    Why render prefixes: a template may add headers, separators or special tokens anywhere; rendering the
    conversation up to each assistant turn (with the generation prompt) and through it tells exactly which
    characters the assistant wrote, whatever the template. A template that does not render conversations as
    prefixes of each other (one that rewrites earlier turns) cannot be labelled this way and is refused."""
    text = _render(tokenizer, messages, prompt=False)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = _render(tokenizer, messages[:i], prompt=True)
        through = _render(tokenizer, messages[: i + 1], prompt=False)
        if not (through.startswith(before) and text.startswith(through)):
            raise ValueError(
                "the tokenizer's chat template does not render a conversation as a prefix of its continuation, "
                "so the assistant's tokens cannot be told apart; use a tokenizer whose template does, or remove "
                "its chat_template to use the plain format of recipes/finetune_causal_lm.py"
            )
        spans.append((len(before), len(through)))
    return text, spans


def tokenize_conversation(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]], max_len: int
) -> dict[str, list[int]]:
    """``input_ids`` and ``labels`` (the token where the assistant wrote it, -100 elsewhere), cut to
    ``max_len``. Tokens are matched to characters by the fast tokenizer's offsets."""
    text, spans = assistant_spans(tokenizer, messages)
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    labels = []
    for token, (start, end) in zip(encoded["input_ids"], encoded["offset_mapping"], strict=True):
        learned = any(a <= start < b or (start == end and a < end <= b) for a, b in spans)
        labels.append(token if learned else IGNORE_INDEX)
    return {"input_ids": encoded["input_ids"][:max_len], "labels": labels[:max_len]}


class SFTDataset(torch.utils.data.Dataset):
    """Fixed-length rows of ``input_ids``, ``attention_mask`` and ``labels``: one conversation per row, padded
    (the plan is made for one shape), or with ``packing`` conversations laid end to end and cut into rows."""

    def __init__(self, examples: Sequence[dict[str, list[int]]], max_len: int, pad_id: int, packing: bool):
        self.rows: list[dict[str, torch.Tensor]] = []
        if packing:
            ids = [t for e in examples for t in e["input_ids"]]
            labels = [t for e in examples for t in e["labels"]]
            for start in range(0, len(ids) - max_len + 1, max_len):
                self._add(ids[start : start + max_len], labels[start : start + max_len], max_len, pad_id)
        else:
            for e in examples:
                self._add(e["input_ids"], e["labels"], max_len, pad_id)
        self.rows = [r for r in self.rows if (r["labels"] != IGNORE_INDEX).any()]
        if not self.rows:
            raise ValueError(
                "no example keeps an assistant token within --max_seq_len; raise --max_seq_len or shorten prompts"
            )

    def _add(self, ids: list[int], labels: list[int], max_len: int, pad_id: int) -> None:
        pad = max_len - len(ids)
        self.rows.append(
            {
                "input_ids": torch.tensor(ids + [pad_id] * pad),
                "attention_mask": torch.tensor([1] * len(ids) + [0] * pad),
                "labels": torch.tensor(labels + [IGNORE_INDEX] * pad),
            }
        )

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return self.rows[index]


# --------------------------------------------------------------------------------------------- model
class _MetaModelArguments(TrainingArguments):
    """The Trainer must not move the model: it is on ``meta`` until the callback loads each rank's shards."""

    @property
    def place_model_on_device(self) -> bool:
        return False


def build_meta_model(path: str | Path) -> torch.nn.Module:
    """The checkpoint's model class on ``meta`` (no memory): its weights come in after the plan is applied."""
    config = AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def freeze(model: torch.nn.Module, pattern: str | None) -> list[str]:
    """Stop training the parameters whose name matches ``pattern``; return their names. A pattern that matches
    nothing is an error (a typo would silently train everything)."""
    if pattern is None:
        return []
    names = [n for n, p in model.named_parameters() if re.search(pattern, n)]
    if not names:
        raise SystemExit(
            f"--freeze {pattern!r} matches no parameter; names look like {next(iter(dict(model.named_parameters())))}"
        )
    for name, param in model.named_parameters():
        if name in names:
            param.requires_grad_(False)
    return names


# --------------------------------------------------------------------------------------------- run
def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    cp = context_parallel_degree(args.context_parallel)
    rows = row_length(args.max_seq_len, cp, args.packing)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    use_cpu_without_gpus()  # accelerate picks gloo for CPU processes only with ACCELERATE_USE_CPU
    source = Path(args.model_name_or_path)
    if not (source / "config.json").is_file():
        raise SystemExit(
            f"--model_name_or_path {source}: no config.json there; give a local checkpoint directory"
        )
    tokenizer = AutoTokenizer.from_pretrained(source)
    if not tokenizer.is_fast:
        raise SystemExit(
            "the recipe needs a fast tokenizer (token offsets tell the assistant's tokens apart)"
        )
    ensure_chat_template(tokenizer)
    examples = [
        tokenize_conversation(tokenizer, m, args.max_seq_len) for m in read_conversations(args.train_file)
    ]
    train = SFTDataset(examples, rows, tokenizer.pad_token_id, args.packing)

    model = build_meta_model(source)
    frozen = freeze(model, args.freeze)
    training = _MetaModelArguments(
        output_dir=args.output_dir,
        max_steps=args.max_steps,
        per_device_train_batch_size=args.per_device_batch_size,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        learning_rate=args.lr,
        warmup_steps=args.warmup_steps,
        weight_decay=args.weight_decay,
        lr_scheduler_type="constant_with_warmup",
        logging_steps=args.logging_steps,
        save_strategy="no",
        report_to=[],
        seed=args.seed,
        data_seed=args.seed,
        dataloader_drop_last=True,
        disable_tqdm=True,
    )
    mesh = tuple(int(n) for n in args.mesh_shape.lower().split("x")) if args.mesh_shape else None
    callback = AutoParallelCallback(
        memory_budget=args.memory_budget,
        device=args.device,
        mesh_shape=mesh,
        pretrained=source,
        context_parallel=cp,
    )
    trainer = Trainer(model=model, args=training, train_dataset=train, callbacks=[callback])
    trainer.train()
    final = Path(args.output_dir) / "final"
    export(trainer, tokenizer, final)
    summary = {
        "examples": len(examples),
        "rows": len(train),
        "frozen": frozen,
        "losses": [r["loss"] for r in trainer.state.log_history if "loss" in r],
        "plan": None if callback.plan is None else list(callback.plan.mesh_shape),
        "dp_mode": None if callback.plan is None else callback.plan.dp_mode,
    }
    report = getattr(trainer.model, "_hf_colossal_auto_load_report", None)  # what this rank read
    if report is not None:
        summary.update(bytes_read=report.bytes_read, checkpoint_bytes=report.checkpoint_bytes)
    if trainer.args.should_save:
        (Path(args.output_dir) / "summary.json").write_text(json.dumps(summary, indent=1))
    logger.info("fine-tuned %d steps, exported to %s", trainer.state.global_step, final)


def export(trainer: Trainer, tokenizer: PreTrainedTokenizerBase, final: Path) -> None:
    """The fine-tuned weights streamed by every rank into one ``from_pretrained`` directory (no process holds
    the whole model), with the tokenizer (its chat template included) written by the main process."""
    save_pretrained(trainer.model, final)
    if trainer.args.should_save:
        tokenizer.save_pretrained(final)
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


if __name__ == "__main__":
    main(sys.argv[1:])
    # End before interpreter teardown while the model's process groups are alive (gloo's worker threads can
    # abort the exit otherwise: hf_colossal_auto/integrations/process_exit.py)
    finish()
