"""``transformers.Trainer`` integration: one callback plans and applies tensor parallelism for the Trainer.

Usage (launch with ``torchrun --nproc_per_node N train.py`` or ``accelerate launch``)::

    from transformers import Trainer, TrainingArguments
    from hf_colossal_auto import AutoParallelCallback

    trainer = Trainer(
        model=model,
        args=TrainingArguments(output_dir="out", per_device_train_batch_size=8, ...),
        train_dataset=train,
        eval_dataset=valid,
        callbacks=[AutoParallelCallback()],  # or AutoParallelCallback(mesh_shape=(2, 4), memory_budget="60GiB")
    )
    trainer.train()  # resume_from_checkpoint=... works too
    trainer.save_model("export")  # consolidated: AutoModel*.from_pretrained("export") in one process

``Seq2SeqTrainer`` works the same way. Everything happens when the Trainer is built (the callback's
``on_init_end``, the first moment a callback is given the Trainer — found on the call stack):

1. **Conflicts are refused** before anything runs: ``TrainingArguments(fsdp=...)``, ``deepspeed=...``,
   ``parallelism_config=...`` (accelerate's own tensor/context parallelism, ``tp_size``), an accelerate launch
   config enabling DeepSpeed or FSDP, a model already sharded (by transformers' ``tp_plan``, or by our
   ``autoparallelize``: pass the plain model and ``plan_path=``),
   ``model_init`` (the model would be rebuilt unparallelised) and ``auto_find_batch_size``.
   ``gradient_checkpointing``/``activation_checkpointing=True`` is *not* an error, but **the plan wins**: it
   decides which modules recompute their activations, so the Trainer's own checkpointing is turned off with a
   warning.
2. **Plan**: rank 0 collates one *global* batch — ``per_device_train_batch_size x world size`` samples of the
   training set (the eval set when there is none) through the Trainer's own collator and column filter, under
   saved RNG state so that the run's randomness is untouched — and calls
   :func:`~hf_colossal_auto.solve.planner.plan_model` for the job's devices; the plan is broadcast (or loaded
   from ``plan_path`` on every rank).
3. **Apply**: :func:`~hf_colossal_auto.apply.apply_plan` shards the live model (and remaps an optimizer
   passed in ``Trainer(optimizers=...)``) before the Trainer builds its optimizer.
4. **Patch the Trainer instance** (the smallest set of method replacements; a ``Trainer`` subclass keeps its
   own overrides, which are wrapped, not replaced):

   * no DDP wrapping: the runtime averages gradients over the plan's data-parallel axis itself (DDP over
     DTensor parameters would be wrong), via the Trainer's own path for models that manage their own
     parallelism (``is_distributed_loading_by_transformers``);
   * data: the Trainer's accelerator prepares its loaders as for a plain Trainer (the same samples per step,
     epochs, learning-rate schedule and logged losses); under tensor parallelism each process then reads its
     tensor-parallel group's batch, the union of the batches a plain Trainer gives the group's processes
     (:mod:`.data`), and evaluation gathers keep one copy per group;
   * checkpoints (``save_steps``, ``resume_from_checkpoint``; :mod:`.trainer_checkpoints`): model and
     optimizer state go to ``checkpoint-N/hf_colossal_auto_state`` with ``torch.distributed.checkpoint`` (every
     rank writes its shards), next to a consolidated ``from_pretrained``-loadable copy of the weights, the scheduler, RNG and
     trainer state. ``load_best_model_at_end`` and resuming from a ``save_only_model`` checkpoint load the
     sharded state, else the consolidated weights (each rank reading only its slices, ``load_pretrained``);
   * resume is elastic: a checkpoint resumes under another plan or number of processes (DCP reshards; with
     one process the callback, which otherwise leaves the Trainer alone, reads the shards as plain tensors),
     and a one-process checkpoint's ``optimizer.pt`` loads into a planned job (matched by position to the
     optimizer the same Trainer builds, each rank slicing the full tensors). A process whose
     ``rng_state_<rank>.pth`` the checkpoint lacks takes the saving job's first process's. Keep the callback
     in a one-process Trainer that resumes a parallel job's checkpoint: a plain Trainer finds no
     ``optimizer.pt`` there and silently starts with a fresh optimizer and schedule;
   * ``save_model`` (call it on every rank, as any Trainer under torchrun): the full tensors are gathered one
     at a time, the main process writes each safetensors file when complete (no rank holds the whole model);
   * tokens seen and FLOs are counted once per tensor-parallel group.

Under ``python -m hf_colossal_auto.run`` (``accelerate launch ... -m hf_colossal_auto.run train.py``) every
Trainer the script builds gets this callback, with the planner settings of :class:`.AutoParallelPlugin`.

What is left out: ``predict_with_generate`` runs ``generate`` on the sharded model untested; gradient
accumulation under an FSDP plan reduces gradients after every micro-batch (correct, not deferred);
``model_init``/hyper-parameter search is refused. A callback added after the Trainer was built
(``trainer.add_callback``) must be set up by hand: ``callback.setup(trainer)`` before ``train()``.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import itertools
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from ..apply import apply_plan
from ..apply.agree import DEFAULT_TIMEOUT_S, as_timedelta
from ..apply.runtime import plan_on_one_rank
from ..calibration.job import resolve_device
from ..plan import Plan
from .data import follow_plan, preserved_rng
from .trainer_checkpoints import (
    STATE_DIR,
    _consolidated_save,
    _load_model_state,
    _load_rng_state,
    _load_sharded_state,
    _save_sharded_state,
    _unwrap_optimizer,
)

logger = logging.getLogger(__name__)


class AutoParallelCallback(TrainerCallback):
    """Plan tensor parallelism for the Trainer's model and train it under the plan (see the module docstring).

    Args:
        memory_budget: per-device memory the plan must fit in (bytes or ``"40GiB"``); None: the device's
            memory minus a margin.
        device: device kind to plan for (``"a100-80gb"``, ``"cpu"``, ...); None: the running device (``"cpu"``
            under gloo).
        mesh_shape: ``(dp, tp)`` to plan on that mesh only; None: the planner searches the meshes.
        plan_path: a saved :class:`~hf_colossal_auto.plan.Plan` to apply instead of planning.
        save_plan_path: where the main process writes the plan it applied (JSON).
        time_limit_s: the ILP solver's time limit per mesh.
        timeout: seconds a rank waits in a collective for a peer that stopped answering before it fails
            (replaces the process group's timeout, ``TrainingArguments.ddp_timeout``, once the plan is applied),
            and how long planning may take: past it every rank raises ``TookTooLongError`` naming where it was.
        pretrained: a HF safetensors checkpoint (directory) each rank loads its own shards from once the plan is
            applied (:func:`~hf_colossal_auto.apply.pretrained.load_pretrained`), so that a model built on
            ``meta`` is never whole in any process; in a single process the whole checkpoint is loaded. Give the
            Trainer ``TrainingArguments`` whose ``place_model_on_device`` is False for a ``meta`` model (the
            Trainer would otherwise move it before the callback runs).
        pipeline: pipeline stages: ``"auto"`` searches them with the rest (chosen where the cost model predicts a
            faster step; not with ``mesh_shape``, with gradient accumulation, or with a loss computed outside
            the model — ``compute_loss_func``, an overridden ``compute_loss`` — which a pipelined forward cannot
            run), 1 plans without them, an int >= 2 fixes the pp degree. None (the default):
            ``HF_COLOSSAL_AUTO_PIPELINE`` if set, else ``"auto"``.
        context_parallel: context parallelism, for long sequences: an int >= 2 splits each sequence over that
            many ranks of a data-parallel replica (only plans with it; the sequence length must be a multiple
            of ``2 x cp``), ``"auto"`` searches the cp degrees with the rest, 1 plans without it. None (the
            default): ``HF_COLOSSAL_AUTO_CONTEXT_PARALLEL`` if set, else 1. The cp ranks of a replica read the
            same rows (the union of their processes' batches under a plain Trainer) and the model keeps each
            rank's part of every sequence; a fixed degree keeps pipeline stages off.
        **plan_kwargs: further :func:`~hf_colossal_auto.solve.planner.plan_model` arguments
            (``mixed_precision``, ``dp_modes``, ``devices_per_node``, ``optimizer``, ``routing``: for MoE models,
            ``"measure"`` prices expert parallelism under the routing of the example global batch, counted by
            one forward of the Trainer's model on the planning rank, or a histogram's JSON path).
    """

    def __init__(
        self,
        memory_budget: int | str | None = None,
        device: str | None = None,
        mesh_shape: tuple[int, int] | list[int] | None = None,
        plan_path: str | os.PathLike | None = None,
        save_plan_path: str | os.PathLike | None = None,
        time_limit_s: float = 60.0,
        timeout: float = DEFAULT_TIMEOUT_S,
        pretrained: str | os.PathLike | None = None,
        pipeline: int | str | None = None,
        context_parallel: int | str | None = None,
        **plan_kwargs: Any,
    ) -> None:
        _check_settings(memory_budget, device, mesh_shape, plan_path, time_limit_s, plan_kwargs)
        self.pipeline, self.context_parallel = _stages_and_context_parallel(
            _pipeline_setting(pipeline, mesh_shape), _context_parallel_setting(context_parallel)
        )
        if pretrained is not None and not Path(pretrained).is_dir():
            raise FileNotFoundError(
                f"pretrained={str(pretrained)!r} is not a directory; give a checkpoint directory holding "
                "config.json and model.safetensors (or an index), as save_pretrained writes"
            )
        as_timedelta(timeout)  # a bad value fails here, not after planning
        self.memory_budget = memory_budget
        self.device = device
        self.mesh_shape = tuple(mesh_shape) if mesh_shape is not None else None
        self.plan_path = Path(plan_path) if plan_path is not None else None
        self.save_plan_path = Path(save_plan_path) if save_plan_path is not None else None
        self.time_limit_s = time_limit_s
        self.timeout = timeout
        self.plan_kwargs = plan_kwargs
        self.pretrained = Path(pretrained) if pretrained is not None else None
        self.plan: Plan | None = None
        self._trainer: Trainer | None = None

    # --- callback events ---------------------------------------------------------------------------------

    def on_init_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """The Trainer is built (its accelerator and process group too): plan, apply, patch it."""
        trainer = _calling_trainer()
        if trainer is None:
            raise RuntimeError(
                "AutoParallelCallback.on_init_end was not called from a transformers.Trainer's __init__; call "
                "callback.setup(trainer) yourself before training"
            )
        self.setup(trainer)

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self._trainer is None and _is_distributed():
            raise RuntimeError(
                "AutoParallelCallback was added after the Trainer was built (trainer.add_callback), so the model "
                "was not parallelised before the Trainer made its optimizer and data loader. Pass it in "
                "Trainer(callbacks=[AutoParallelCallback()]) or call callback.setup(trainer) before train()."
            )

    # --- setup -------------------------------------------------------------------------------------------

    def setup(self, trainer: Trainer) -> None:
        """Refuse conflicting settings, plan (rank 0) and apply the plan, patch ``trainer``. Idempotent."""
        if self._trainer is trainer:
            return
        check_trainer_compatible(trainer)
        if not _is_distributed():
            logger.warning(
                "AutoParallelCallback: this is a single process (no torch.distributed job), so there is nothing "
                "to parallelise; training as usual. Launch with torchrun/accelerate launch to use the plan."
            )
            if self.pretrained is not None:
                from ..apply.pretrained import load_pretrained

                load_pretrained(trainer.model, self.pretrained)  # a meta model is materialised, then filled
                trainer.model.to(trainer.args.device)
            _patch_resume(trainer)  # checkpoints of a parallel job resume here too
            self._trainer = trainer
            return
        _turn_off_trainer_recompute(trainer.args)
        with preserved_rng():
            self.plan = self._make_plan(trainer)
            optimizers = [_unwrap_optimizer(trainer.optimizer)] if trainer.optimizer is not None else []
            apply_plan(
                trainer.model,
                self.plan,
                optimizers=optimizers,
                timeout=self.timeout,
                pretrained=self.pretrained,
            )
        if self.save_plan_path is not None and dist.get_rank() == 0:
            self.save_plan_path.parent.mkdir(parents=True, exist_ok=True)
            self.plan.save(self.save_plan_path)
        _patch_trainer(trainer, self.plan)
        self._trainer = trainer

    def _make_plan(self, trainer: Trainer) -> Plan:
        """Rank 0 plans for the Trainer's global batch (per-device batch x processes x accumulation steps: the
        batch rule of every entry point, run as ``gradient_accumulation_steps`` micro-batches); every rank gets
        the plan, or the same error when planning fails (naming settings that fit, when some do)."""
        if self.plan_path is not None:
            return Plan.load(self.plan_path)
        # device="calibrate": every rank takes part in measuring the job once (cached for later jobs)
        device = resolve_device(self.device, "cuda" if dist.get_backend() == "nccl" else "cpu")

        def make() -> Plan:
            from ..hardware.cluster import launcher_devices_per_node
            from ..solve.planner import plan_model
            from .accumulation import plan_for_loop

            world = dist.get_world_size()
            per_device = trainer.args.per_device_train_batch_size
            steps = max(1, trainer.args.gradient_accumulation_steps)
            # the global batch of one optimizer step, in the Trainer's accumulation steps as micro-batches
            batch = example_global_batch(trainer, per_device * world * steps)
            kwargs = dict(self.plan_kwargs)
            kwargs.setdefault("mixed_precision", _mixed_precision(trainer.args))
            kwargs.setdefault("devices_per_node", launcher_devices_per_node(world))  # nodes as launched

            def plan(rows: Mapping[str, Any], micro_batches: int | None, pipeline: int | None) -> Plan:
                return plan_model(
                    trainer.model,
                    rows,
                    num_devices=world,
                    device=device or _running_device_kind(),
                    memory_budget=self.memory_budget,
                    mesh_shape=self.mesh_shape,
                    time_limit_s=self.time_limit_s,
                    micro_batches=micro_batches,
                    pipeline=pipeline,
                    context_parallel=self.context_parallel,
                    **kwargs,
                )

            made = plan_for_loop(
                plan,
                batch,
                steps,
                _pipeline_for(trainer, self.pipeline),
                per_device,
                world,
                ("per_device_train_batch_size", "gradient_accumulation_steps"),
            )
            logger.info("AutoParallelCallback plan:\n%s", made.summary())
            return made

        limit = as_timedelta(self.timeout).total_seconds()
        return plan_on_one_rank(make, limit_s=limit, what=f"planning {type(trainer.model).__name__}")


def _pipeline_setting(value: int | str | None, mesh_shape: Any) -> int | None:
    """The callback's ``pipeline`` as ``plan_model`` takes it (None: searched): ``value``, else
    ``HF_COLOSSAL_AUTO_PIPELINE``, else searched; bad values fail at construction."""
    from .plugin import PluginConfigError, parse_pipeline, pipeline_from_env, pipeline_setting

    if value is None:
        return pipeline_from_env(None)
    try:
        pipeline = pipeline_setting(parse_pipeline(value, "pipeline", "AutoParallelCallback"))
    except PluginConfigError as exc:
        raise ValueError(str(exc)) from None
    if pipeline is not None and pipeline > 1 and mesh_shape is not None:
        raise ValueError(
            f"pipeline={pipeline} with mesh_shape={tuple(mesh_shape)}: a pipeline lays out its (pp, dp, tp) mesh "
            "itself; drop mesh_shape, or set pipeline=1 to plan on that mesh"
        )
    return pipeline


def _context_parallel_setting(value: int | str | None) -> int | None:
    """The callback's ``context_parallel`` as ``plan_model`` takes it (None: searched): ``value``, else
    ``HF_COLOSSAL_AUTO_CONTEXT_PARALLEL``, else 1 (none); bad values fail at construction."""
    from .plugin import (
        PluginConfigError,
        context_parallel_from_env,
        context_parallel_setting,
        parse_context_parallel,
    )

    if value is None:
        return context_parallel_from_env(1)
    try:
        return context_parallel_setting(
            parse_context_parallel(value, "context_parallel", "AutoParallelCallback")
        )
    except PluginConfigError as exc:
        raise ValueError(str(exc)) from None


def _stages_and_context_parallel(
    pipeline: int | None, context_parallel: int | None
) -> tuple[int | None, int]:
    """:func:`.plugin.stages_and_context_parallel` with its refusal as the callback's ``ValueError``."""
    from .plugin import PluginConfigError, stages_and_context_parallel

    try:
        return stages_and_context_parallel(pipeline, context_parallel)
    except PluginConfigError as exc:
        raise ValueError(f"AutoParallelCallback: {exc}") from None


def _pipeline_for(trainer: Trainer, pipeline: int | None) -> int | None:
    """``pipeline`` for this Trainer: a search (None) stays off where the loss is computed outside the model
    (``compute_loss_func``, a subclass's ``compute_loss``): a pipelined training forward consumes the logits
    inside its schedule and returns only the model's own loss."""
    custom = getattr(trainer, "compute_loss_func", None) is not None or (
        type(trainer).compute_loss is not Trainer.compute_loss
    )
    if pipeline is None and custom:
        logger.info(
            "AutoParallelCallback: pipeline stages not searched, since %s computes the loss outside the model "
            "(compute_loss_func / compute_loss), which a pipelined forward cannot run",
            type(trainer).__name__,
        )
        return 1
    return pipeline


def callback_from_plugin(plugin: Any = None) -> AutoParallelCallback:
    """The callback the runner gives a Trainer: the planner settings of ``plugin`` (default: an
    :class:`~.plugin.AutoParallelPlugin` read from ``HF_COLOSSAL_AUTO_*`` / ``HF_COLOSSAL_AUTO_CONFIG``), as
    ``AutoParallelAccelerator`` would plan with them."""
    from .plugin import AutoParallelPlugin

    plugin = AutoParallelPlugin() if plugin is None else plugin
    extra = {k: v for k, v in (plugin.plan_kwargs or {}).items() if k in _PLAN_MODEL_KWARGS}
    for name in ("dp_modes", "devices_per_node", "routing"):
        if getattr(plugin, name) is not None:
            extra[name] = getattr(plugin, name)
    return AutoParallelCallback(
        memory_budget=plugin.memory_budget,
        device=plugin.device,
        mesh_shape=plugin.mesh_shape,
        plan_path=plugin.plan_path,
        save_plan_path=plugin.save_plan_path,
        time_limit_s=plugin.time_limit_s if plugin.time_limit_s is not None else 60.0,
        timeout=plugin.timeout if plugin.timeout is not None else DEFAULT_TIMEOUT_S,
        pretrained=plugin.pretrained,
        pipeline=plugin.pipeline,
        context_parallel=plugin.context_parallel,
        **extra,
    )


# --- settings and conflicts ------------------------------------------------------------------------------

_PLAN_MODEL_KWARGS = {"mixed_precision", "dp_modes", "devices_per_node", "optimizer", "routing"}


def _check_settings(
    memory_budget: Any,
    device: Any,
    mesh_shape: Any,
    plan_path: Any,
    time_limit_s: Any,
    plan_kwargs: Mapping[str, Any],
) -> None:
    """Bad constructor arguments fail where they are written, not in the middle of Trainer.__init__."""
    unknown = sorted(set(plan_kwargs) - _PLAN_MODEL_KWARGS)
    if unknown:
        raise TypeError(
            f"AutoParallelCallback got unknown setting(s) {unknown}; the planning settings are memory_budget, "
            f"device, mesh_shape, plan_path, save_plan_path, time_limit_s and {sorted(_PLAN_MODEL_KWARGS)}"
        )
    if memory_budget is not None and (
        isinstance(memory_budget, bool) or not isinstance(memory_budget, int | str)
    ):
        raise TypeError(f"memory_budget must be bytes (int) or a string like '40GiB', got {memory_budget!r}")
    if device is not None and not isinstance(device, str):
        raise TypeError(f"device must be a device kind name such as 'a100-80gb' or 'cpu', got {device!r}")
    if mesh_shape is not None:
        shape = tuple(mesh_shape) if isinstance(mesh_shape, list | tuple) else None
        if shape is None or len(shape) != 2 or not all(isinstance(n, int) and n >= 1 for n in shape):
            raise ValueError(f"mesh_shape must be (dp, tp), two positive integers, got {mesh_shape!r}")
    if plan_path is not None and not Path(plan_path).is_file():
        raise FileNotFoundError(f"plan_path {str(plan_path)!r} does not exist (a Plan saved with plan.save)")
    if isinstance(time_limit_s, bool) or not isinstance(time_limit_s, int | float) or time_limit_s <= 0:
        raise ValueError(f"time_limit_s must be a positive number of seconds, got {time_limit_s!r}")


def check_trainer_compatible(trainer: Trainer) -> None:
    """Refuse Trainer settings that parallelise the model another way, or that the plan cannot follow."""
    args = trainer.args
    problems = []
    if args.fsdp:
        problems.append(f"TrainingArguments(fsdp={args.fsdp!r}): the plan chooses DDP or FSDP per job itself")
    if args.deepspeed:
        problems.append("TrainingArguments(deepspeed=...): DeepSpeed shards the model its own way")
    if getattr(args, "parallelism_config", None) is not None:
        problems.append(
            "TrainingArguments(parallelism_config=...): accelerate's tensor/context parallelism (tp_size) "
            "conflicts with the plan's"
        )
    if getattr(trainer, "is_fsdp_enabled", False) or getattr(trainer, "is_deepspeed_enabled", False):
        problems.append("the accelerate launch config enables FSDP or DeepSpeed")
    if hasattr(trainer.model, "_hf_colossal_auto_plan"):
        problems.append(
            "a model already parallelised by autoparallelize/apply_plan: give the Trainer the plain model, and "
            "a saved plan as AutoParallelCallback(plan_path=...)"
        )
    elif (getattr(trainer.model, "tp_size", None) or 1) > 1 or trainer.is_distributed_loading_by_transformers:
        problems.append("the model was already sharded by transformers (from_pretrained(tp_plan=...))")
    if trainer.model_init is not None:
        problems.append("Trainer(model_init=...): the model would be rebuilt without the plan at train()")
    if args.auto_find_batch_size:
        problems.append("TrainingArguments(auto_find_batch_size=True): the plan is made for one batch size")
    if getattr(args, "n_gpu", 1) > 1:
        problems.append("several GPUs in one process (torch.nn.DataParallel): launch one process per GPU")
    if problems:
        raise ValueError(
            "AutoParallelCallback cannot be used with: "
            + "; ".join(problems)
            + ". Remove these settings (the plan decides data and tensor parallelism), or remove the callback."
        )


def _turn_off_trainer_recompute(args: TrainingArguments) -> None:
    """The plan decides activation recompute per module; the Trainer's blanket checkpointing would override it."""
    if getattr(args, "activation_checkpointing", False) or getattr(args, "gradient_checkpointing", False):
        logger.warning(
            "AutoParallelCallback: gradient_checkpointing/activation_checkpointing=True is ignored: the plan "
            "decides which modules recompute their activations (plan.recompute)."
        )
        for name in ("activation_checkpointing", "gradient_checkpointing"):
            if hasattr(args, name):
                setattr(args, name, False)


# --- planning inputs ---------------------------------------------------------------------------------------


def _calling_trainer() -> Trainer | None:
    """The Trainer whose ``__init__`` is running the callback event (callbacks are not given the Trainer)."""
    frame = inspect.currentframe()
    try:
        for _ in range(16):
            if frame is None:
                return None
            candidate = frame.f_locals.get("self")
            if isinstance(candidate, Trainer):
                return candidate
            frame = frame.f_back
        return None
    finally:
        del frame


def example_global_batch(trainer: Trainer, size: int) -> dict[str, Any]:
    """``size`` samples of the training set (else the eval set), collated as the Trainer's data loader would:
    the Trainer's collator, with the columns the model does not take removed."""
    dataset = trainer.train_dataset if trainer.train_dataset is not None else trainer.eval_dataset
    if isinstance(dataset, Mapping):  # eval_dataset={"name": dataset, ...}
        dataset = next(iter(dataset.values()), None)
    if dataset is None:
        raise ValueError(
            "AutoParallelCallback plans from one batch of the Trainer's train_dataset (or eval_dataset); the "
            "Trainer has neither. Pass a dataset, or a saved plan with plan_path=."
        )
    if isinstance(dataset, torch.utils.data.IterableDataset) or not hasattr(dataset, "__len__"):
        features = list(itertools.islice(iter(dataset), size))
    else:
        features = [dataset[i % len(dataset)] for i in range(size)]
    if not features:
        raise ValueError("AutoParallelCallback: the dataset to plan from is empty")
    collate = trainer.data_collator
    remove_columns = getattr(trainer, "_get_collator_with_removed_columns", None)
    if remove_columns is not None:
        collate = remove_columns(collate, description="planning")
    batch = collate(features)
    return {k: v for k, v in dict(batch).items() if isinstance(v, torch.Tensor)}


def _mixed_precision(args: TrainingArguments) -> str | None:
    return "bf16" if args.bf16 else "fp16" if args.fp16 else None


def _running_device_kind() -> str:
    if dist.get_backend() != "nccl":
        return "cpu"
    from ..hardware import detect_device

    return detect_device().name


def _is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


# --- the Trainer patches -----------------------------------------------------------------------------------


def _patch_trainer(trainer: Trainer, plan: Plan) -> None:
    """Route the Trainer's data, gradient sync, evaluation gathers and checkpoints through the plan's mesh."""
    # No DDP/FSDP wrapping by accelerate; the optimizer is prepared alone (transformers' path for models that
    # manage their own parallelism). Gradient sync is the runtime's, after every micro-batch.
    trainer.is_distributed_loading_by_transformers = True
    trainer._defer_fsdp_gradient_reduction = contextlib.nullcontext
    if plan.pp_size > 1:
        # transformers broadcasts every plain trainable parameter from rank 0 and averages its gradient over all
        # ranks (for adapters next to FSDP2's DTensors); a pipeline rank holds other parameters than rank 0
        trainer._sync_replicated_trainable_parameters = lambda model: None
    _follow_batch_rule(trainer, plan)

    trainer._save = _consolidated_save(trainer, trainer._save)
    trainer._save_optimizer_and_scheduler = functools.partial(_save_sharded_state, trainer)
    trainer._load_from_checkpoint = functools.partial(_load_model_state, trainer)
    trainer._load_optimizer_and_scheduler = functools.partial(_load_sharded_state, trainer)
    trainer._load_rng_state = functools.partial(_load_rng_state, trainer._load_rng_state, trainer.args)
    trainer._load_best_model = lambda: _load_model_state(trainer, trainer.state.best_model_checkpoint)


def _patch_resume(trainer: Trainer) -> None:
    """One process: the Trainer saves as usual (``optimizer.pt``, read back positionally by a parallel job), and
    resumes from a parallel job's checkpoint too: optimizer state from its shards, RNG from its first process."""
    original = trainer._load_optimizer_and_scheduler

    @functools.wraps(original)
    def load_optimizer_and_scheduler(checkpoint: str | None) -> None:
        if checkpoint is not None and (Path(checkpoint) / STATE_DIR).is_dir():
            _load_sharded_state(trainer, checkpoint)
        else:
            original(checkpoint)

    trainer._load_optimizer_and_scheduler = load_optimizer_and_scheduler
    trainer._load_rng_state = functools.partial(_load_rng_state, trainer._load_rng_state, trainer.args)


def _follow_batch_rule(trainer: Trainer, plan: Plan) -> None:
    """The Trainer's loaders are prepared by its accelerator as without the plan (the same samples, order,
    lengths and learning-rate schedule as a plain Trainer); under tensor or context parallelism they are then
    re-cut so that a data-parallel replica's ``tp x cp`` ranks (consecutive) compute on the union of their
    processes' batches, its predictions and losses are gathered once per replica, and tokens and FLOs are
    counted once per replica (:mod:`.data`). Under cp the model keeps each rank's part of every sequence and
    sums the loss over cp; the Trainer's label count (gathered over every process, divided by the processes
    sharing a batch) is the replica's whole count, which the cp runtime normalises by."""
    from .accelerator import AutoParallelAccelerator

    group = plan.batch_group_size  # tp x cp: the consecutive ranks of a replica within a stage
    accelerator = trainer.accelerator
    if isinstance(accelerator, AutoParallelAccelerator):  # under the runner: it adopts the plan and re-cuts
        accelerator._adopt(trainer.model, plan)
    else:
        follow_plan(accelerator, group, plan.pp_size, plan.dp_size)
    # the Trainer bound accelerator.gather_for_metrics at construction (and rebinds it after each evaluation)
    trainer.gather_function = functools.partial(
        accelerator.gather_for_metrics, use_gather_object=trainer.args.eval_use_gather_object
    )
    shared = group * plan.pp_size  # processes computing on one batch
    if shared > 1:
        _trainer_accounting_of_shared_batches(trainer, shared)
        _count_batches_once_per_batch_group(trainer, group, plan.pp_size)
    if plan.pp_size > 1:
        _clip_over_every_stage(trainer)


def _trainer_accounting_of_shared_batches(trainer: Trainer, shared: int) -> None:
    """The Trainer's own tensor-parallel arithmetic (``get_tp_size()``, which reads the model's ``_tp_size``;
    here the processes sharing one batch, ``tp x pp``): the label count it normalises the loss by is gathered
    from every process and divided by ``shared``, and the loss scaled by ``processes / shared`` — right for our
    batches too (each process holds its group's batch), given accelerate's plain gather, not the
    one-copy-per-group gather scripts get; a pipelined model honours that count and averages its gradients
    over dp as DDP does (:mod:`..apply.pipeline_runner`). Its global batch size is the plain Trainer's
    (per-device batch x processes), as the plan keeps it, not ``x dp``."""
    from accelerate.utils import gather

    def with_plain_gather(method):
        @functools.wraps(method)
        def call(*args: Any, **kwargs: Any) -> Any:
            accelerator = trainer.accelerator
            had = "gather" in accelerator.__dict__
            previous = accelerator.__dict__.get("gather")
            accelerator.gather = gather
            try:
                return method(*args, **kwargs)
            finally:
                if had:
                    accelerator.gather = previous
                else:
                    del accelerator.gather

        return call

    def get_total_train_batch_size(args: TrainingArguments) -> int:
        return trainer._train_batch_size * args.gradient_accumulation_steps * args.world_size

    trainer.get_tp_size = lambda: shared
    trainer._get_num_items_in_batch = with_plain_gather(trainer._get_num_items_in_batch)
    trainer._track_num_input_tokens = with_plain_gather(trainer._track_num_input_tokens)
    trainer.get_total_train_batch_size = get_total_train_batch_size


def _clip_over_every_stage(trainer: Trainer) -> None:
    """The Trainer clips (and logs the norm) with ``accelerator.clip_grad_norm_(model.parameters(), ...)``: under
    pipeline stages each rank holds some stages' gradients, so the norm must span the pipeline
    (:meth:`.pipeline_runner.PipelineRunner.clip_grad_norm_`); a gradient scaler's gradients are unscaled first,
    as accelerate does. ``AutoParallelAccelerator`` (under the runner) does this itself."""
    from ..apply.pipeline import pipeline_runner
    from .accelerator import AutoParallelAccelerator

    accelerator = trainer.accelerator
    if isinstance(accelerator, AutoParallelAccelerator):
        return
    runner = pipeline_runner(trainer.model)

    def clip_grad_norm_(parameters: Any, max_norm: float, norm_type: float = 2) -> torch.Tensor:
        accelerator.unscale_gradients()
        return runner.clip_grad_norm_(max_norm, norm_type)

    accelerator.clip_grad_norm_ = clip_grad_norm_


def _count_batches_once_per_batch_group(trainer: Trainer, group_size: int, pp_size: int = 1) -> None:
    """Tokens seen and FLOs are summed over all processes by the Trainer; the ranks of a data-parallel group
    (the ``group_size = tp x cp`` ranks of a replica, :attr:`Plan.batch_group_size`, and its pipeline stages)
    share one batch, so each group's tokens are taken once (the sum divided by ``tp x cp x pp``) and its FLOs
    once per ``tp x cp`` group (divided by ``tp x cp``: each of them counts the whole batch's FLOs): each
    pipeline stage counts its own parameters' FLOs (``model.num_parameters()`` holds this rank's stages), which
    add up to the model's."""

    def once(method, attribute: str, copies: int):
        @functools.wraps(method)
        def counted(*args: Any, **kwargs: Any) -> Any:
            before = getattr(trainer.state, attribute)
            result = method(*args, **kwargs)
            added = getattr(trainer.state, attribute) - before
            setattr(
                trainer.state,
                attribute,
                before + (added // copies if isinstance(added, int) else added / copies),
            )
            return result

        return counted

    tokens = once(trainer._track_num_input_tokens, "num_input_tokens_seen", group_size * pp_size)
    trainer._track_num_input_tokens = tokens
    if group_size > 1:
        trainer.store_flos = once(trainer.store_flos, "total_flos", group_size)
