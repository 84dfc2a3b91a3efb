"""The Trainer's checkpoints under a plan: what :class:`~.trainer.AutoParallelCallback` puts in place of the
Trainer's own save and load methods (``_save``, ``_save_optimizer_and_scheduler``, ``_load_from_checkpoint``,
``_load_optimizer_and_scheduler``, ``_load_rng_state``).

Why a module of its own: the checkpoint format is its own job. Model and optimizer state go to
``checkpoint-N/hf_colossal_auto_state`` with ``torch.distributed.checkpoint`` (every rank writes its shards),
the weights also as a consolidated ``from_pretrained`` directory streamed by every rank; loading is elastic
(another plan or number of processes, a one-process checkpoint's ``optimizer.pt``, the first process's RNG
state for a process the saving job did not have).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from transformers import Trainer, TrainingArguments

from ..apply import load_checkpoint, save_checkpoint
from ..apply.checkpoint import load_full_optimizer_state
from ..apply.pretrained import save_pretrained

logger = logging.getLogger(__name__)

STATE_DIR = "hf_colossal_auto_state"
"""Sub-directory of a Trainer checkpoint holding the sharded (torch.distributed.checkpoint) training state."""

_SCHEDULER_NAME = "scheduler.pt"  # transformers.trainer.SCHEDULER_NAME
_OPTIMIZER_NAME = "optimizer.pt"  # transformers.trainer.OPTIMIZER_NAME


def _unwrap_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The torch optimizer under accelerate's ``AcceleratedOptimizer`` wrapper (checkpoints need the real one)."""
    from accelerate.optimizer import AcceleratedOptimizer

    while isinstance(optimizer, AcceleratedOptimizer):
        optimizer = optimizer.optimizer
    return optimizer


def _consolidated_save(trainer: Trainer, original_save):
    """``save_model`` (and the weights of every checkpoint): the weights (or the ``state_dict`` passed) streamed
    by every rank (:func:`~hf_colossal_auto.apply.pretrained.save_pretrained`: one full tensor at a time, the
    main process writes each file when complete), then the Trainer's own ``_save`` on the main process for the
    rest (tokenizer, training arguments) with the model's own ``save_pretrained`` silenced, the weights being
    there."""

    @functools.wraps(original_save)
    def save(output_dir: str | None = None, state_dict: dict | None = None) -> None:
        directory = output_dir if output_dir is not None else trainer.args.output_dir
        save_pretrained(trainer.model, directory, state_dict=state_dict, write=trainer.args.should_save)
        if trainer.args.should_save:
            with _weights_already_written(trainer.model):
                original_save(output_dir)
        dist.barrier()

    return save


@contextlib.contextmanager
def _weights_already_written(model: nn.Module):
    """``model.save_pretrained`` does nothing for the duration (the weights and config are written); then the
    method it had is back — the planned model's own streamed one is an instance attribute too."""
    before = model.__dict__.get("save_pretrained")
    model.save_pretrained = lambda *args, **kwargs: None
    try:
        yield
    finally:
        if before is None:
            del model.save_pretrained
        else:
            model.save_pretrained = before


def _save_sharded_state(trainer: Trainer, output_dir: str) -> None:
    """Model + optimizer shards with torch.distributed.checkpoint (every rank), the scheduler from the main one."""
    save_checkpoint(trainer.model, _unwrap_optimizer(trainer.optimizer), Path(output_dir) / STATE_DIR)
    if trainer.args.should_save:
        torch.save(trainer.lr_scheduler.state_dict(), os.path.join(output_dir, _SCHEDULER_NAME))


def _load_model_state(trainer: Trainer, checkpoint: str, model: nn.Module | None = None) -> None:
    """Model weights from a checkpoint: its sharded state if it has one, else its consolidated weights."""
    model = trainer.model if model is None else model
    sharded = Path(checkpoint) / STATE_DIR
    if sharded.is_dir():
        load_checkpoint(model, None, sharded)
    else:
        load_consolidated(model, checkpoint)
    logger.info("AutoParallelCallback: loaded model weights from %s", checkpoint)


def _load_sharded_state(trainer: Trainer, checkpoint: str | None) -> None:
    """Optimizer (with the model, as saved together) and scheduler state when resuming, under this job's plan
    whatever the saving job's was: from the sharded state (resharded by torch.distributed.checkpoint), or from
    a one-process checkpoint's ``optimizer.pt`` (each rank slicing the full tensors)."""
    if checkpoint is None:
        return
    sharded = Path(checkpoint) / STATE_DIR
    single = Path(checkpoint) / _OPTIMIZER_NAME
    scheduler = Path(checkpoint) / _SCHEDULER_NAME
    optimizer = _unwrap_optimizer(trainer.optimizer)
    if sharded.is_dir():
        load_checkpoint(trainer.model, optimizer, sharded)
    elif single.is_file():
        saved = torch.load(single, map_location="cpu", weights_only=True)
        load_full_optimizer_state(trainer.model, optimizer, saved, source=str(single))
    else:
        logger.warning(
            "AutoParallelCallback: %s has neither %s nor %s (saved with save_only_model=True?): resuming with a "
            "fresh optimizer and schedule",
            checkpoint,
            STATE_DIR,
            _OPTIMIZER_NAME,
        )
        return
    if scheduler.is_file():
        trainer.lr_scheduler.load_state_dict(torch.load(scheduler, weights_only=True))


def _load_rng_state(original, args: TrainingArguments, checkpoint: str | None) -> None:
    """The Trainer's RNG restore, also across world sizes: a checkpoint of N processes holds
    ``rng_state_<rank>.pth`` and one of a single process ``rng_state.pth``; a process whose own file is not
    there continues the saving job's first process's streams (the Trainer would only log and skip)."""
    if checkpoint is None:
        return original(checkpoint)
    own = f"rng_state_{args.process_index}.pth" if args.world_size > 1 else "rng_state.pth"
    other = Path(checkpoint) / ("rng_state.pth" if args.world_size > 1 else "rng_state_0.pth")
    if (Path(checkpoint) / own).is_file() or not other.is_file():
        return original(checkpoint)
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        os.symlink(other.resolve(), os.path.join(tmp, own))
        original(tmp)


def load_consolidated(model: nn.Module, directory: str | os.PathLike) -> None:
    """Load a ``save_pretrained`` directory (safetensors, one file or an index) into a parallelised model, each
    rank reading only the slices its placements cover (:func:`~hf_colossal_auto.apply.pretrained.load_pretrained`:
    no rank holds the full model; missing or mis-shaped keys are errors naming them). Collective: call on every
    rank."""
    from ..apply.pipeline import is_pipelined
    from ..apply.pipeline_checkpoint import load_stage_weights
    from ..apply.pretrained import load_pretrained

    directory = Path(directory)
    if (
        not (directory / "model.safetensors.index.json").is_file()
        and not (directory / "model.safetensors").is_file()
    ):
        raise FileNotFoundError(
            f"{directory} has neither {STATE_DIR}/ (sharded state) nor model.safetensors; it is not a checkpoint "
            "written by a Trainer with AutoParallelCallback or a plain (one process or DDP) Trainer. The shards of "
            "a Trainer under FSDP or DeepSpeed cannot be resharded here: consolidate the weights into a "
            "save_pretrained directory and start from it with AutoParallelCallback(pretrained=...) instead of "
            "resume_from_checkpoint"
        )
    if is_pipelined(model):  # cut to this rank's stages: their tensors only, the tied head from its key
        load_stage_weights(model, directory)
    else:
        load_pretrained(model, directory)
