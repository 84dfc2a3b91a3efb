"""The recipes' command line: one parser for all three, with each recipe's own options added by its hook."""

from __future__ import annotations

import argparse
from pathlib import Path

from transformers import PretrainedConfig

from hf_colossal_auto.models import load_config, max_positions

from .recipe import Recipe

SCHEDULERS = ("cosine", "linear", "constant_with_warmup")
TINY_VOCAB = 1024
FULL_VOCAB = 32000
TINY_SEQ_LEN = 128
# A tiny model (2 layers, width 64) learns fast at a rate that would diverge for a full-size one.
TINY_LR = 1e-3


def build_parser(recipe: Recipe) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=recipe.description, formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    model = parser.add_argument_group("model and data")
    model.add_argument(
        "--model",
        default="tiny",
        help=f"model preset ({', '.join(recipe.presets)}) or a path to a config.json; built from the config, "
        "never downloaded",
    )
    model.add_argument(
        "--train_file",
        help="training text: .txt (one document per line) or .json/.jsonl; default: a synthetic corpus built offline",
    )
    model.add_argument(
        "--eval_file", help="evaluation text; default: --validation_split_percentage of the training text"
    )
    model.add_argument("--text_column", default="text", help="field holding the text in .json/.jsonl files")
    model.add_argument("--validation_split_percentage", type=float, default=5.0)
    model.add_argument("--synthetic_documents", type=int, default=2000, help="size of the default corpus")
    model.add_argument(
        "--tokenizer",
        help="a saved tokenizer directory; default: train one on the corpus (cached in output_dir)",
    )
    model.add_argument(
        "--vocab_size",
        type=int,
        help=f"upper bound for a trained tokenizer (default {TINY_VOCAB} for tiny, {FULL_VOCAB} otherwise)",
    )
    model.add_argument(
        "--seq_len",
        type=int,
        help="tokens per example (default: the model's positions, at most 1024; 128 for tiny)",
    )

    train = parser.add_argument_group("training")
    train.add_argument("--max_steps", type=int, default=1000, help="optimizer steps")
    train.add_argument("--per_device_batch_size", type=int, default=8)
    train.add_argument("--gradient_accumulation_steps", type=int, default=1)
    train.add_argument(
        "--lr",
        type=float,
        help=f"peak learning rate of AdamW (default {recipe.learning_rate:g}; {TINY_LR:g} for tiny models)",
    )
    train.add_argument("--weight_decay", type=float, default=0.01)
    train.add_argument("--lr_scheduler", choices=SCHEDULERS, default="cosine")
    train.add_argument("--warmup_steps", type=int, help="default: 5%% of --max_steps")
    train.add_argument("--max_grad_norm", type=float, default=1.0, help="0 disables clipping")
    train.add_argument(
        "--mixed_precision", choices=("no", "bf16", "fp16"), help="default: the accelerate config's setting"
    )
    train.add_argument("--seed", type=int, default=42)
    train.add_argument("--logging_steps", type=int, default=1)
    train.add_argument(
        "--eval_steps", type=int, default=200, help="evaluate every N steps and at the end; 0: end only"
    )
    train.add_argument("--max_eval_batches", type=int, default=20, help="per process")
    train.add_argument("--save_steps", type=int, default=0, help="write a resumable checkpoint every N steps")
    train.add_argument(
        "--resume_from_checkpoint", help="a checkpoint directory, or 'latest' for the newest in output_dir"
    )
    train.add_argument("--output_dir", default=f"out/{recipe.name}")

    plan = parser.add_argument_group("parallelization")
    plan.add_argument("--device", help="device kind the planner prices (e.g. a100-80gb); default: detected")
    plan.add_argument("--memory_budget", help="per-device memory budget for the planner, e.g. 40GiB")
    plan.add_argument(
        "--mesh_shape", help="force the (dp, tp) mesh, e.g. 1x2 (default: the planner searches)"
    )
    plan.add_argument(
        "--pipeline",
        help="pipeline stages: 'auto' (searched with the rest), 1 (none) or a pp degree; default: "
        "HF_COLOSSAL_AUTO_PIPELINE if set, else auto",
    )
    plan.add_argument(
        "--context_parallel",
        help="context parallelism for long sequences: a cp degree (each sequence split over that many ranks of a "
        "replica, which read the same rows; --seq_len must be a multiple of 2 x cp; causal LMs only), 'auto' "
        "(searched with the rest) or 1 (none); default: HF_COLOSSAL_AUTO_CONTEXT_PARALLEL if set, else 1",
    )
    plan.add_argument(
        "--no_auto_parallel",
        action="store_true",
        help="use a plain accelerate.Accelerator (DDP) instead of the auto-parallel one, to compare",
    )
    recipe.add_arguments(parser)
    return parser


def resolve_model_config(recipe: Recipe, model: str) -> PretrainedConfig:
    """The model config for ``--model``: a recipe preset, or a config.json path."""
    preset = recipe.presets.get(model)
    if preset is None and not Path(model).exists():
        raise SystemExit(
            f"--model {model!r}: unknown preset for the {recipe.name} recipe; choose one of "
            f"{', '.join(recipe.presets)} or give a path to a config.json"
        )
    return load_config(preset or model)


def finalize_args(args: argparse.Namespace, config: PretrainedConfig, recipe: Recipe) -> argparse.Namespace:
    """Fill the defaults that depend on the model, and reject settings that cannot work, before any work."""
    limit = max_positions(config)
    if args.seq_len is None:
        args.seq_len = min(limit or 512, 1024, TINY_SEQ_LEN if args.model == "tiny" else 1024)
    if limit is not None and args.seq_len > limit:
        raise SystemExit(f"--seq_len {args.seq_len} exceeds the {args.model} model's {limit} positions")
    if args.vocab_size is None:
        args.vocab_size = TINY_VOCAB if args.model == "tiny" else FULL_VOCAB
    if args.lr is None:
        args.lr = TINY_LR if args.model == "tiny" else recipe.learning_rate
    if args.warmup_steps is None:
        args.warmup_steps = args.max_steps // 20
    for name in (
        "max_steps",
        "per_device_batch_size",
        "gradient_accumulation_steps",
        "logging_steps",
        "seq_len",
    ):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name} must be >= 1, got {getattr(args, name)}")
    for name in ("eval_steps", "save_steps", "warmup_steps"):
        if getattr(args, name) < 0:
            raise SystemExit(f"--{name} must be >= 0, got {getattr(args, name)}")
    _check_context_parallel(args, recipe)
    return args


def _check_context_parallel(args: argparse.Namespace, recipe: Recipe) -> None:
    """A fixed ``--context_parallel`` the run cannot use fails here, on every process before any work: another
    objective than causal LM (the cp runtime runs decoder-only causal LMs), a ``--seq_len`` the balanced layout
    (2 x cp equal chunks per sequence) cannot cut. Unset, the variable the plugin reads decides."""
    from hf_colossal_auto.integrations.plugin import PluginConfigError, parse_context_parallel

    if getattr(args, "context_parallel", None) is None:
        return
    try:
        cp = parse_context_parallel(args.context_parallel, "--context_parallel", "the command line")
    except PluginConfigError as exc:
        raise SystemExit(str(exc)) from None
    if not isinstance(cp, int) or cp == 1:
        return
    if recipe.task != "causal-lm":
        raise SystemExit(
            f"--context_parallel {cp}: context parallelism runs decoder-only causal LMs; the {recipe.name} "
            f"recipe trains a {recipe.task} model. Drop --context_parallel"
        )
    if args.seq_len % (2 * cp):
        raise SystemExit(
            f"--context_parallel {cp} cuts each sequence into 2 x cp = {2 * cp} equal chunks; --seq_len "
            f"{args.seq_len} does not divide. Use a multiple of {2 * cp}, e.g. {args.seq_len - args.seq_len % (2 * cp) or 2 * cp}"
        )
