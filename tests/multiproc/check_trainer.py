"""A transformers Trainer script with AutoParallelCallback (under torchrun), or its single-process reference.

    torchrun --nproc_per_node 2 tests/multiproc/check_trainer.py --out D/run.json --output-dir D/run \\
        --mesh 1x2 --save-steps 3 --export D/export --save-plan D/plan.json
    torchrun --nproc_per_node 2 tests/multiproc/check_trainer.py --out D/resumed.json --output-dir D/run \\
        --plan D/plan.json --resume D/run/checkpoint-3
    python tests/multiproc/check_trainer.py --out D/ref.json --output-dir D/ref --per-device 4 \\
        --eval-export D/export

A seeded tiny model without dropout, a generated token dataset, fp32 on CPU (gloo), ``logging_steps=1``. Under
torchrun the Trainer gets ``callbacks=[AutoParallelCallback(...)]``; without it (one process) it is the plain
Trainer, whose per-device batch should then be the distributed run's global batch. Rank 0 writes to ``--out``:
the loss of every step, the eval loss after training, tokens seen and FLOs, the plan's mesh; ``--eval-export`` adds the eval loss of
that directory loaded with ``from_pretrained`` in this process. Several runs go in one launch (or one process),
their arguments separated by ``--and-then``; each writes its own ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import transformers
from torch.utils.data import Dataset


class TokenDataset(Dataset):
    """Rows of one generated batch (token ids in [0, vocab), labels as the model's task wants them)."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def __len__(self) -> int:
        return len(next(iter(self.tensors.values())))

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {k: v[i] for k, v in self.tensors.items()}


def build(preset: str) -> torch.nn.Module:
    from hf_colossal_auto.models import build_model, load_config

    config = load_config(preset)
    for name in ("dropout_rate", "resid_pdrop", "embd_pdrop", "attn_pdrop", "hidden_dropout_prob"):
        if hasattr(config, name):
            setattr(config, name, 0.0)  # exact comparisons: no dropout
    if hasattr(config, "output_router_logits"):  # MoE: the router's balancing loss is in the trained loss
        config.output_router_logits = True
    torch.manual_seed(0)
    return build_model(config, device="cpu")


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="tiny-llama")
    parser.add_argument("--out", required=True)
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--per-device", type=int, default=2)
    parser.add_argument("--seq", type=int, default=16)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--grad-accum", type=int, default=1)
    parser.add_argument("--save-steps", type=int, default=0, help="0: no checkpoints")
    parser.add_argument("--mesh", default=None, help="dp x tp, e.g. 1x2; default: the planner searches")
    parser.add_argument("--plan", default=None, help="a saved plan to apply")
    parser.add_argument("--save-plan", default=None)
    parser.add_argument(
        "--routing", default=None, help="the callback's routing setting (MoE): 'measure' or a path"
    )
    parser.add_argument(
        "--context-parallel", type=int, default=None, help="the callback's context_parallel (a cp degree)"
    )
    parser.add_argument("--resume", default=None)
    parser.add_argument("--export", default=None, help="trainer.save_model() here after training")
    parser.add_argument(
        "--eval-export", default=None, help="evaluate this save_model() output in one process"
    )
    parser.add_argument("--seq2seq", action="store_true", help="Seq2SeqTrainer")
    parser.add_argument(
        "--then-resume",
        default=None,
        help="afterwards, a fresh model and Trainer (with the callback, also in one process) resume from this "
        "checkpoint (saved under any plan or process count); its losses and learning rates go to --out",
    )
    return parser.parse_args(argv)


def run(args: argparse.Namespace, distributed: bool) -> None:
    """One Trainer run (and what its flags add after it); rank 0 writes its result to ``args.out``."""
    from hf_colossal_auto.integrations.trainer import AutoParallelCallback
    from hf_colossal_auto.models import make_example_inputs

    model = build(args.model)
    train = TokenDataset(make_example_inputs(model, 64, args.seq, seed=1))
    valid = TokenDataset(make_example_inputs(model, 8, args.seq, seed=2))
    arg_cls, trainer_cls = (
        (transformers.Seq2SeqTrainingArguments, transformers.Seq2SeqTrainer)
        if args.seq2seq
        else (transformers.TrainingArguments, transformers.Trainer)
    )
    training_args = arg_cls(
        output_dir=args.output_dir,
        per_device_train_batch_size=args.per_device,
        # as the training batch: a step's rows are the plain Trainer's, which a tensor-parallel group computes in
        # one batch, so the one-process reference evaluates the same global batches (a MoE model's balancing
        # loss depends on what is batched together)
        per_device_eval_batch_size=args.per_device,
        max_steps=args.steps,
        gradient_accumulation_steps=args.grad_accum,
        learning_rate=1e-3,
        warmup_steps=2,
        logging_steps=1,
        save_strategy="steps" if args.save_steps else "no",
        save_steps=args.save_steps or 500,
        report_to=[],
        use_cpu=True,
        seed=0,
        ddp_timeout=120,
        disable_tqdm=True,
        dataloader_num_workers=0,
        include_num_input_tokens_seen="all",
    )
    callbacks = []
    if distributed:
        mesh = tuple(int(x) for x in args.mesh.split("x")) if args.mesh else None
        callbacks.append(
            AutoParallelCallback(
                mesh_shape=mesh,
                plan_path=args.plan,
                save_plan_path=args.save_plan,
                **({"routing": args.routing} if args.routing else {}),
                **({"context_parallel": args.context_parallel} if args.context_parallel else {}),
            )
        )
    trainer = trainer_cls(
        model=model, args=training_args, train_dataset=train, eval_dataset=valid, callbacks=callbacks
    )
    trainer.train(resume_from_checkpoint=args.resume)
    result = {
        "losses": {str(e["step"]): e["loss"] for e in trainer.state.log_history if "loss" in e},
        "learning_rates": {
            str(e["step"]): e["learning_rate"] for e in trainer.state.log_history if "loss" in e
        },
        "eval_loss": trainer.evaluate()["eval_loss"],
        "tokens_seen": trainer.state.num_input_tokens_seen,
        "total_flos": trainer.state.total_flos,
    }
    if distributed:
        plan = model._hf_colossal_auto_plan
        result["mesh"] = list(plan.mesh_shape)
        result["cp_size"] = plan.cp_size
        result["sharded_params"] = sum(1 for p in plan.param_placements.values() if p[-1] != "R")
        result["moe_layers"] = plan.moe_layers
        result["moe_load"] = plan.moe_load
    if args.export:
        trainer.save_model(args.export)
    if args.eval_export:
        exported = type(model).from_pretrained(args.eval_export)
        result["export_eval_loss"] = trainer_cls(
            model=exported, args=training_args, eval_dataset=valid
        ).evaluate()["eval_loss"]
    again = None
    if args.then_resume:
        fresh = build(args.model)
        with torch.no_grad():
            for param in fresh.parameters():
                param.add_(0.5)  # other weights than the checkpoint's: the resume must load them
        mesh = tuple(int(x) for x in args.mesh.split("x")) if args.mesh else None
        again = trainer_cls(
            model=fresh,
            args=training_args,
            train_dataset=train,
            eval_dataset=valid,
            callbacks=[AutoParallelCallback(mesh_shape=mesh, plan_path=args.plan)],
        )
        again.args.output_dir = f"{args.output_dir}-then-resumed"
        again.train(resume_from_checkpoint=args.then_resume)
        history = [e for e in again.state.log_history if "loss" in e]
        result["then_resumed_losses"] = {str(e["step"]): e["loss"] for e in history}
        result["then_resumed_learning_rates"] = {str(e["step"]): e["learning_rate"] for e in history}
    if trainer.is_world_process_zero():
        with open(args.out, "w") as f:
            json.dump(result, f)


def main() -> None:
    """The runs that ``--and-then`` separates on the command line, one after the other in this process (or
    these processes): starting processes and importing torch/transformers cost more than a tiny run."""
    from accelerate.state import AcceleratorState, GradientState

    transformers.logging.set_verbosity_error()
    distributed = "LOCAL_RANK" in os.environ
    argv, runs = sys.argv[1:], [[]]
    for arg in argv:
        if arg == "--and-then":
            runs.append([])
        else:
            runs[-1].append(arg)
    for i, run_argv in enumerate(runs):
        if i:  # the next Trainer's Accelerator starts from the settings of its own arguments
            AcceleratorState._reset_state()
            GradientState._reset_state()
        run(parse(run_argv), distributed)
    if distributed:
        from common import close_gloo  # this folder is on sys.path under torchrun

        close_gloo(exit_process=True)


if __name__ == "__main__":
    main()
