"""The training loop all recipes share: data, tokenizer, model, accelerator, steps, eval, checkpoints, export.

A recipe script only describes its objective (a :class:`~_shared.recipe.Recipe`) and calls :func:`run`.
"""

from __future__ import annotations

import logging
import math
import time
from argparse import Namespace
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.logging import get_logger
from accelerate.utils import DataLoaderConfiguration, GradientAccumulationPlugin, set_seed
from torch.utils.data import DataLoader, Subset
from tqdm.auto import tqdm
from transformers import PreTrainedTokenizerBase, get_scheduler

from hf_colossal_auto.models import build_model
from hf_colossal_auto.run import use_cpu_without_gpus

from . import checkpoints
from .cli import build_parser, finalize_args, resolve_model_config
from .corpus import load_text_file, split_documents, synthetic_corpus
from .data import BlockDataset, pack, tokenize
from .metrics import MetricsLog
from .recipe import Recipe
from .tokenizer import load_or_train_tokenizer, padded_vocab_size

logger = get_logger(__name__)


def make_accelerator(args: Namespace) -> Accelerator:
    """AutoParallelAccelerator (plans DP x TP at prepare) unless ``--no_auto_parallel`` asks for plain
    accelerate (DDP), the baseline to compare with. Gradient accumulation counts micro-batches across epoch
    boundaries (``sync_with_dataloader=False``) so that a resumed run stays aligned with the saved one, and
    the sampler is seeded per epoch so a resumed run sees the same order."""
    kwargs: dict[str, Any] = {
        "gradient_accumulation_plugin": GradientAccumulationPlugin(
            num_steps=args.gradient_accumulation_steps, sync_with_dataloader=False
        ),
        "dataloader_config": DataLoaderConfiguration(use_seedable_sampler=True),
        "mixed_precision": args.mixed_precision,
    }
    # accelerate starts CPU processes with torchrun but gives them gloo only with ACCELERATE_USE_CPU set
    use_cpu_without_gpus()
    if args.no_auto_parallel:
        return Accelerator(**kwargs)
    from hf_colossal_auto.integrations import AutoParallelAccelerator, AutoParallelPlugin

    plugin = AutoParallelPlugin(
        device=args.device,
        memory_budget=args.memory_budget,
        mesh_shape=args.mesh_shape,
        pipeline=getattr(args, "pipeline", None),
        context_parallel=getattr(args, "context_parallel", None),
    )
    return AutoParallelAccelerator(auto_parallel_plugin=plugin, **kwargs)


def _documents(args: Namespace, output_dir: Path) -> tuple[list[str], list[str], str]:
    """Training and evaluation documents, and a description of where they came from (for the tokenizer
    cache). A bad file is a one-line error, not a traceback."""
    cache = output_dir / "datasets_cache"
    try:
        if args.train_file:
            documents = load_text_file(args.train_file, args.text_column, cache)
            stat = Path(args.train_file).stat()
            source = (
                f"{Path(args.train_file).resolve()}:{stat.st_size}:{int(stat.st_mtime)}:{args.text_column}"
            )
        else:
            # One fixed corpus (not --seed's): runs with other seeds share data and the cached tokenizer.
            documents = synthetic_corpus(args.synthetic_documents, seed=0)
            source = f"synthetic:{args.synthetic_documents}"
        if args.eval_file:
            return documents, load_text_file(args.eval_file, args.text_column, cache), source
    except (OSError, ValueError) as exc:
        raise SystemExit(str(exc)) from exc
    train, held_out = split_documents(documents, args.validation_split_percentage)
    return train, held_out, f"{source}:split{args.validation_split_percentage}"


def _optimizer(model: torch.nn.Module, args: Namespace) -> torch.optim.Optimizer:
    """AdamW; no weight decay on biases and norm weights (1-D parameters), as GPT-2/BERT/T5 recipes do."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": args.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=args.lr, betas=(0.9, 0.95), eps=1e-8)


def _micro_batches(loader: DataLoader, accelerator: Accelerator, consumed: int) -> Iterator[dict]:
    """Batches forever, epoch after epoch, starting after the first ``consumed`` (a resumed run)."""
    per_epoch = len(loader)
    if per_epoch == 0:
        raise SystemExit(
            "the training set gives no full batch per process; give more text, or lower "
            "--per_device_batch_size / --seq_len"
        )
    epoch, skip = divmod(consumed, per_epoch)
    while True:
        loader.set_epoch(epoch)
        source = accelerator.skip_first_batches(loader, skip) if skip else loader
        if skip:
            source.set_epoch(epoch)
        iterator = iter(source)
        # Starting a pass draws a seed from the global RNG (torch's DataLoader base seed). Keep that draw off
        # the stream dropout uses, so a resumed run (which starts a pass mid-epoch) repeats the same steps.
        with torch.random.fork_rng(devices=[]):
            first = next(iterator)
        yield first
        yield from iterator
        epoch, skip = epoch + 1, 0


@torch.no_grad()
def evaluate(model: torch.nn.Module, loader: DataLoader | None, accelerator: Accelerator) -> float | None:
    """Mean loss over the (already size-limited) eval loader, averaged over processes."""
    if loader is None:
        return None
    model.eval()
    total, count = torch.zeros((), device=accelerator.device), 0
    with torch.random.fork_rng(devices=[]):  # evaluating must not change the training run's random stream
        for batch in loader:
            total += model(**batch).loss.detach().float()
            count += 1
    model.train()
    mean = total / max(count, 1)
    return accelerator.reduce(mean, "mean").item()


def _data_parallel_size(model: torch.nn.Module, accelerator: Accelerator) -> int:
    """Processes that see distinct samples: the plan's dp (tensor-parallel ranks share a batch), else all."""
    plan = getattr(accelerator.unwrap_model(model), "_hf_colossal_auto_plan", None)
    return plan.dp_size if plan is not None else accelerator.num_processes


def _export(
    accelerator: Accelerator, model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase, path: Path
) -> None:
    """Consolidated ``save_pretrained`` model (collective) and the tokenizer, loadable in one process."""
    accelerator.wait_for_everyone()
    state = accelerator.get_state_dict(model)  # full tensors on every rank, gathered from the shards if any
    accelerator.unwrap_model(model).save_pretrained(
        path, is_main_process=accelerator.is_main_process, save_function=accelerator.save, state_dict=state
    )
    if accelerator.is_main_process:
        tokenizer.save_pretrained(path)
    accelerator.wait_for_everyone()


def _setup_logging(accelerator: Accelerator) -> None:
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO)
    if not accelerator.is_main_process:
        logging.getLogger().setLevel(logging.WARNING)


def run(recipe: Recipe, argv: list[str] | None = None) -> None:
    """Parse the command line and pretrain ``recipe``'s model; see ``--help``."""
    args = build_parser(recipe).parse_args(argv)
    config = resolve_model_config(recipe, args.model)
    args = finalize_args(args, config, recipe)
    accelerator = make_accelerator(args)
    _setup_logging(accelerator)
    set_seed(args.seed)
    output_dir = Path(args.output_dir)
    if accelerator.is_main_process:
        output_dir.mkdir(parents=True, exist_ok=True)

    train_docs, eval_docs, source = _documents(args, output_dir)
    with accelerator.main_process_first():
        tokenizer = load_or_train_tokenizer(
            recipe.tokenizer_kind,
            train_docs,
            output_dir / "tokenizer",
            args.vocab_size,
            recipe.num_sentinels,
            args.tokenizer,
            source,
        )
    config.vocab_size = padded_vocab_size(tokenizer)
    recipe.configure(config, tokenizer)
    model = build_model(config, device="cpu", task=recipe.task)

    make_example = recipe.example_fn(args, tokenizer)
    block, separator = recipe.block_length(args), recipe.separator_id(tokenizer)
    train_set = BlockDataset(pack(tokenize(tokenizer, train_docs), block, separator), make_example, args.seed)
    train_loader = DataLoader(train_set, batch_size=args.per_device_batch_size, shuffle=True, drop_last=True)
    eval_loader = None
    if eval_docs and args.max_eval_batches > 0:
        eval_set = BlockDataset(
            pack(tokenize(tokenizer, eval_docs), block, separator, "eval"), make_example, args.seed
        )
        keep = min(
            len(eval_set), args.max_eval_batches * args.per_device_batch_size * accelerator.num_processes
        )
        eval_loader = DataLoader(Subset(eval_set, range(keep)), batch_size=args.per_device_batch_size)

    optimizer = _optimizer(model, args)
    scheduler = get_scheduler(
        args.lr_scheduler, optimizer, num_warmup_steps=args.warmup_steps, num_training_steps=args.max_steps
    )
    if eval_loader is not None:
        model, optimizer, train_loader, eval_loader = accelerator.prepare(
            model, optimizer, train_loader, eval_loader
        )
    else:
        model, optimizer, train_loader = accelerator.prepare(model, optimizer, train_loader)
    dp_size = _data_parallel_size(model, accelerator)
    n_params = sum(p.numel() for p in accelerator.unwrap_model(model).parameters())
    accelerator.print(
        f"{recipe.name}: {args.model} ({n_params / 1e6:.1f}M parameters, vocab {config.vocab_size}), "
        f"{len(train_set)} training blocks of {block} tokens, {accelerator.num_processes} process(es), "
        f"data-parallel size {dp_size}, global batch {args.per_device_batch_size * accelerator.num_processes} "
        f"x {args.gradient_accumulation_steps} accumulation"
    )

    state = checkpoints.LoopState()
    resume_from = (
        checkpoints.resolve(output_dir, args.resume_from_checkpoint) if args.resume_from_checkpoint else None
    )
    if resume_from is not None:
        state = checkpoints.load(accelerator, resume_from, scheduler)
        accelerator.print(f"resumed from {resume_from} at step {state.step}")
    metrics = MetricsLog(
        output_dir / "metrics.jsonl", accelerator.is_main_process, state.step if resume_from else None
    )

    _train(args, accelerator, model, optimizer, scheduler, train_loader, eval_loader, metrics, state, dp_size)

    final = output_dir / "final"
    _export(accelerator, model, tokenizer, final)
    accelerator.print(f"saved the model and tokenizer to {final}")
    accelerator.end_training()


def _train(
    args: Namespace,
    accelerator: Accelerator,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler,
    train_loader: DataLoader,
    eval_loader: DataLoader | None,
    metrics: MetricsLog,
    state: checkpoints.LoopState,
    dp_size: int,
) -> None:
    output_dir = Path(args.output_dir)
    batches = _micro_batches(train_loader, accelerator, state.step * args.gradient_accumulation_steps)
    progress = tqdm(
        total=args.max_steps, initial=state.step, desc="train", disable=not accelerator.is_local_main_process
    )
    loss_sum = torch.zeros((), device=accelerator.device)
    micro_steps = 0
    grad_norm = None
    start, start_tokens = time.perf_counter(), state.tokens
    model.train()
    while state.step < args.max_steps:
        batch = next(batches)
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            if accelerator.sync_gradients and args.max_grad_norm > 0:
                grad_norm = accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
            optimizer.step()
            optimizer.zero_grad()
        loss_sum += loss.detach().float()
        micro_steps += 1
        state.tokens += batch["input_ids"].numel() * dp_size
        if not accelerator.sync_gradients:
            continue
        scheduler.step()
        state.step += 1
        progress.update(1)
        last = state.step == args.max_steps
        evaluate_now = last or (args.eval_steps and state.step % args.eval_steps == 0)
        if state.step % args.logging_steps == 0 or evaluate_now:
            record = {
                "step": state.step,
                "loss": accelerator.reduce(loss_sum / micro_steps, "mean").item(),
                "lr": scheduler.get_last_lr()[0],
                "tokens": state.tokens,
                "tokens_per_s": (state.tokens - start_tokens) / max(time.perf_counter() - start, 1e-9),
            }
            if grad_norm is not None:
                record["grad_norm"] = float(grad_norm)
            if evaluate_now:
                eval_loss = evaluate(model, eval_loader, accelerator)
                if eval_loss is not None:
                    record["eval_loss"] = eval_loss
                    record["eval_perplexity"] = math.exp(min(eval_loss, 50.0))
            metrics.write(record)
            progress.set_postfix(loss=f"{record['loss']:.3f}", lr=f"{record['lr']:.2e}")
            loss_sum.zero_()
            micro_steps = 0
        if args.save_steps and state.step % args.save_steps == 0:
            path = checkpoints.checkpoint_dir(output_dir, state.step)
            checkpoints.save(accelerator, path, state, scheduler)
            logger.info("saved a resumable checkpoint to %s", path, main_process_only=True)
    progress.close()
