"""``AutoParallelAccelerator``: an ``accelerate.Accelerator`` whose ``prepare`` plans and applies the plan (data,
context and tensor parallelism on a ``dp x cp x tp`` mesh, pipeline stages).

What it changes, and why; everything else is accelerate's (mixed precision, gradient accumulation,
``clip_grad_norm_`` — already DTensor-aware —, logging, trackers):

* **the model** (``prepare``/``prepare_model``): rank 0 plans from the first batch's shapes (peeked from a data
  loader passed to the same ``prepare`` call, or ``plugin.example_inputs``) or every rank loads
  ``plugin.plan_path``; the plan is applied with :func:`hf_colossal_auto.apply.apply_plan` and optimizers from
  the same call are pointed at the new parameters. The model is **not** wrapped in DDP: the runtime averages
  gradients over the data-parallel axis itself. When the loader's batches are not keyword arguments (tuples of
  a ``TensorDataset``, a dict the loop unpacks itself) or no loader was prepared, the plan is made from the
  model's first training call instead (:mod:`.first_call`): its arguments are what the step needs. A model
  already planned (by the Trainer callback) is adopted; a second model is prepared by accelerate as usual.
* **the data** (``prepare_data_loader``): loaders are prepared by accelerate itself, exactly as without a plan
  (before the model, or with no model at all, too); a plan with tensor or context parallelism (or pipeline
  stages) then re-cuts them so that the ``tp x cp`` processes of a replica (and its stages) compute on the
  union of the batches plain accelerate gives them: the rows
  of every step are plain accelerate's under any mesh (:mod:`.data`). ``gather``/``gather_for_metrics``
  keep what a group's processes share once, so that they return what they return under plain accelerate.
* **checkpoints** (``save_state``/``load_state``, :mod:`.accelerator_state`): model and optimizer through
  ``torch.distributed.checkpoint`` (every rank writes its shards; accelerate's own would save DTensors from the
  main process only);
  schedulers, samplers, RNG states, the scaler and custom objects through accelerate's own helpers.
  ``load_state`` is elastic: another plan or number of processes than the saving job's, one process
  included, and accelerate's own one-process folders into a planned job.
  ``get_state_dict``/``save_model`` give consolidated tensors / a ``from_pretrained`` directory.

With one process there is nothing to parallelize and it behaves as ``accelerate.Accelerator``, except that
``load_state`` also reads the shards a parallel job saved.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import os
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.data_loader import IterableDatasetShard
from accelerate.utils import DistributedType
from torch import nn
from torch.utils.data import BatchSampler, DataLoader, IterableDataset

from ..apply import PlanMismatchError, apply_plan, build_mesh, consolidated_state_dict, remap_optimizer
from ..apply.agree import DEFAULT_TIMEOUT_S, as_timedelta
from ..apply.data import global_batch
from ..apply.pretrained import save_pretrained
from ..apply.runtime import plan_on_one_rank
from ..calibration.job import resolve_device
from ..hardware.cluster import launcher_devices_per_node
from ..plan import Plan
from .accelerator_state import CheckpointState, _raw_optimizer
from .data import gather_for_metrics as data_gather_for_metrics
from .data import group_batch_rows, group_members, one_copy_per_group, preserved_rng, regroup_loader
from .plugin import AutoParallelPlugin, stages_and_context_parallel

logger = logging.getLogger(__name__)

_OTHER_PLUGINS = {
    "deepspeed_plugin": "DeepSpeed",
    "deepspeed_plugins": "DeepSpeed",
    "fsdp_plugin": "FSDP",
    "megatron_lm_plugin": "Megatron-LM",
    "torch_tp_plugin": "accelerate's tensor parallelism (TorchTensorParallelPlugin)",
    "parallelism_config": "accelerate's ParallelismConfig",
}
_OTHER_ENV = {
    "ACCELERATE_USE_DEEPSPEED": "DeepSpeed",
    "ACCELERATE_USE_FSDP": "FSDP",
    "ACCELERATE_USE_MEGATRON_LM": "Megatron-LM",
    "ACCELERATE_USE_PARALLELISM_CONFIG": "accelerate's ParallelismConfig",
}


def check_no_other_parallelism(kwargs: Mapping[str, Any], environ: Mapping[str, str] = os.environ) -> None:
    """Refuse to start next to another parallelism plugin: two planners would shard the same model twice."""
    found = [name for key, name in _OTHER_PLUGINS.items() if kwargs.get(key) is not None]
    found += [
        f"{name} (environment {key}=true, e.g. from an accelerate config)"
        for key, name in _OTHER_ENV.items()
        if environ.get(key, "false").lower() in ("1", "true", "yes")
    ]
    if found:
        raise ValueError(
            f"AutoParallelAccelerator plans data and tensor parallelism itself, but {', '.join(found)} is enabled "
            "too. Use an accelerate config with distributed_type MULTI_GPU (or MULTI_CPU) and no DeepSpeed/FSDP/"
            "Megatron-LM/parallelism section (see recipes/auto.yaml), and pass no other parallelism plugin."
        )


# ----------------------------------------------------------------------------------------- planning input
@contextlib.contextmanager
def _rng_preserved(*objects: Any) -> Iterator[None]:
    """Peeking a batch must not move any random state the training run will use (global RNG, samplers')."""
    generators = [g for o in objects if isinstance(g := getattr(o, "generator", None), torch.Generator)]
    states = [g.get_state() for g in generators]
    with torch.random.fork_rng(devices=[]):
        yield
    for g, s in zip(generators, states, strict=True):
        g.set_state(s)


def _batch_size(batch: Mapping[str, Any]) -> int:
    """Rows of a batch (its first batched tensor's dim 0; 1 when nothing is batched)."""
    for value in batch.values():
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return int(value.shape[0])
    return 1


def _batch_sampler_chain(loader: DataLoader) -> list[Any]:
    """The loader's batch sampler and those it wraps (accelerate's ``BatchSamplerShard`` wraps the user's)."""
    chain, probe = [], getattr(loader, "batch_sampler", None)
    if isinstance(getattr(loader, "sampler", None), BatchSampler):
        probe = loader.sampler  # DataLoader(sampler=BatchSampler(...), batch_size=None)
    while probe is not None and len(chain) < 4:
        chain.append(probe)
        probe = getattr(probe, "batch_sampler", None)
    return chain


def peek_batch(loader: DataLoader) -> Any:
    """The first batch's contents (its shapes are what planning needs) without iterating ``loader``, which
    would draw from its sampler's RNG. Works on a loader accelerate already prepared, too."""
    dataset = loader.dataset
    if isinstance(dataset, IterableDatasetShard):
        dataset = dataset.dataset
    chain = _batch_sampler_chain(loader)
    samplers = [getattr(b, "sampler", None) for b in chain]
    with _rng_preserved(loader.sampler, *samplers, dataset):
        if isinstance(dataset, IterableDataset):
            size = loader.batch_size or max((getattr(b, "batch_size", None) or 0 for b in chain), default=0)
            items = list(itertools.islice(iter(dataset), size or 1))
            return loader.collate_fn(items) if size else loader.collate_fn(items[0])
        if not chain:
            return loader.collate_fn(dataset[0])
        size = loader.batch_size or next(
            (b.batch_size for b in chain if getattr(b, "batch_size", None)), None
        )
        indices = range(min(size, len(dataset))) if size else next(iter(chain[-1]))
        return loader.collate_fn([dataset[i] for i in indices])


def _takes_keywords(model: nn.Module, batch: Mapping[str, Any]) -> bool:
    """Whether ``model(**batch)`` is a valid call: every key is a parameter of ``forward`` (or it takes
    ``**kwargs``). A batch the loop unpacks itself (``model(batch["x"])``) is not."""
    import inspect

    try:
        parameters = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return True
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return True
    return all(key in parameters for key in batch)


def _optimizer_kind(optimizers: list[torch.optim.Optimizer]) -> str | None:
    """The planner's optimizer-state model for the optimizer the user made (None: keep the planner's default)."""
    for opt in optimizers:
        kind = type(opt).__name__.lower()
        if kind in ("adamw", "adam", "sgd"):
            return kind
    return None


class AutoParallelAccelerator(CheckpointState, Accelerator):
    """``accelerate.Accelerator`` that plans DP x TP for the model given to :meth:`prepare` and applies it.

    ``auto_parallel_plugin`` holds the planner's settings (default: :class:`AutoParallelPlugin` read from the
    environment / ``HF_COLOSSAL_AUTO_CONFIG``); every other argument is accelerate's. Another parallelism
    plugin (DeepSpeed, FSDP, Megatron-LM, accelerate's TP / ``ParallelismConfig``) is refused.
    """

    def __init__(
        self, *args: Any, auto_parallel_plugin: AutoParallelPlugin | None = None, **kwargs: Any
    ) -> None:
        plugin = auto_parallel_plugin if auto_parallel_plugin is not None else AutoParallelPlugin()
        if not isinstance(plugin, AutoParallelPlugin):
            raise TypeError(
                f"auto_parallel_plugin must be an AutoParallelPlugin, got {type(plugin).__name__}"
            )
        check_no_other_parallelism(kwargs)
        super().__init__(*args, **kwargs)
        if self.distributed_type in (
            DistributedType.DEEPSPEED,
            DistributedType.FSDP,
            DistributedType.MEGATRON_LM,
        ):
            raise ValueError(
                f"AutoParallelAccelerator cannot run under accelerate's {self.distributed_type.value}: an earlier "
                "Accelerator in this process set it up; create only AutoParallelAccelerator"
            )
        self.auto_parallel_plugin = plugin
        self.auto_plan: Plan | None = None
        self._auto_model: nn.Module | None = None
        if plugin.num_devices is not None and plugin.num_devices != self.num_processes:
            raise ValueError(
                f"AutoParallelPlugin.num_devices={plugin.num_devices} but this job has {self.num_processes} "
                f"processes: a plan is applied to the processes that run it. Launch {plugin.num_devices} processes "
                "or unset num_devices (plan for other device counts with `hf-colossal-auto plan`)."
            )
        if plugin.plan_path is not None:
            self.auto_plan = self._load_plan(plugin.plan_path)

    # ----------------------------------------------------------------------------------- plan
    @property
    def _parallel(self) -> bool:
        return self.num_processes > 1 and dist.is_available() and dist.is_initialized()

    def _load_plan(self, path: str) -> Plan:
        try:
            plan = Plan.load(path)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ValueError(
                f"AutoParallelPlugin.plan_path={path}: cannot read a plan there ({exc})"
            ) from exc
        needed = math.prod(plan.mesh_shape)
        if needed != self.num_processes:
            raise PlanMismatchError(
                f"the plan in {path} is for a {'x'.join(map(str, plan.mesh_shape))} "
                f"({' x '.join(plan.mesh_axis_names)}) mesh of {needed} "
                f"processes, this job has {self.num_processes}. Launch {needed} processes, or re-plan for "
                f"{self.num_processes} (unset plan_path to plan at prepare time)."
            )
        return plan

    def _example_inputs(self, loaders: list[DataLoader]) -> Mapping[str, Any]:
        plugin = self.auto_parallel_plugin
        if plugin.example_inputs is not None:
            batch = plugin.example_inputs
        elif loaders or self._dataloaders:  # this prepare() call's loader, else the first prepared before it
            batch = peek_batch((loaders or self._dataloaders)[0])
        else:
            raise ValueError(
                "AutoParallelAccelerator plans from one batch: pass the training DataLoader to the same "
                "prepare() call as the model, or set AutoParallelPlugin(example_inputs=...) or plan_path"
            )
        if not isinstance(batch, Mapping):
            raise ValueError(
                f"the planner calls model(**batch), but the batch is a {type(batch).__name__}; make the DataLoader "
                "yield dicts of model.forward keyword arguments, or set AutoParallelPlugin(example_inputs=...)"
            )
        return batch

    def _make_plan(self, model: nn.Module, loaders: list[DataLoader], optimizers: list) -> Plan:
        """Rank 0 plans for this job (its processes, its device), every rank receives the same plan — or, if
        planning fails, raises the same error."""
        # device="calibrate": every rank takes part in measuring the job once (cached for later jobs)
        device_spec = resolve_device(self.auto_parallel_plugin.device, self.device.type)

        def make() -> Plan:
            from ..solve.planner import plan_model
            from .accumulation import plan_for_loop

            batch = self._example_inputs(loaders)
            device = next(model.parameters()).device
            # a loader batch is one process's, except with split_batches (then it is the global one); an optimizer
            # step consumes gradient_accumulation_steps of them, which the plan runs as as many micro-batches
            per_process = self.auto_parallel_plugin.example_inputs is not None or not self.split_batches
            steps = max(1, int(self.gradient_accumulation_steps))
            rows = _batch_size(batch)
            batch = global_batch(batch, (self.num_processes if per_process else 1) * steps, device)
            kwargs: dict[str, Any] = {
                "num_devices": self.num_processes,
                "device": self._device_kind(),
                "devices_per_node": launcher_devices_per_node(self.num_processes) or self.num_processes,
                "mixed_precision": None if self.mixed_precision == "no" else self.mixed_precision,
            }
            kind = _optimizer_kind([_raw_optimizer(o) for o in optimizers])
            if kind is not None:
                kwargs["optimizer"] = kind
            kwargs.update(self.auto_parallel_plugin.planner_kwargs())
            if device_spec is not None:
                kwargs["device"] = device_spec
            # pipeline stages searched unless the plugin (HF_COLOSSAL_AUTO_PIPELINE) fixes or forbids them;
            # context parallelism off unless it (HF_COLOSSAL_AUTO_CONTEXT_PARALLEL) fixes or searches it
            pipeline, kwargs["context_parallel"] = stages_and_context_parallel(
                kwargs.pop("pipeline", None), kwargs.pop("context_parallel", 1)
            )
            if "micro_batches" in kwargs:  # set by the user in plan_kwargs: theirs to match to their loop
                return plan_model(model, batch, pipeline=pipeline if steps == 1 else 1, **kwargs)
            per_device = rows if per_process else rows // self.num_processes
            return plan_for_loop(
                lambda rows, k, pp: plan_model(model, rows, micro_batches=k, pipeline=pp, **kwargs),
                batch,
                steps,
                pipeline,
                per_device,
                self.num_processes,
                ("the DataLoader's batch_size", "Accelerator(gradient_accumulation_steps)"),
            )

        timeout = self.auto_parallel_plugin.timeout
        limit = as_timedelta(DEFAULT_TIMEOUT_S if timeout is None else timeout).total_seconds()
        return plan_on_one_rank(make, limit_s=limit, what=f"planning {type(model).__name__}")

    def _device_kind(self) -> str:
        if self.device.type == "cuda":
            from ..hardware import detect_device

            return detect_device().name
        return "cpu"

    def _parallelize(self, model: nn.Module, loaders: list[DataLoader], optimizers: list) -> None:
        """Plan (or load the plan) and apply it to ``model``, point ``optimizers`` at the new parameters and
        re-cut the loaders prepared so far. Under saved random state: accelerate seeds a shuffling loader's
        generator from the global RNG when it prepares it, so planning must not move that RNG (the data
        order would differ from plain accelerate's)."""
        with preserved_rng():
            plan = (
                self.auto_plan if self.auto_plan is not None else self._make_plan(model, loaders, optimizers)
            )
            first = next(model.parameters())
            if self.device.type != "cpu" and not first.is_meta and first.device != self.device:
                model.to(self.device)
            names = {id(p): n for n, p in model.named_parameters()}
            mesh = build_mesh(plan, self.device.type)
            timeout = self.auto_parallel_plugin.timeout
            apply_plan(
                model,
                plan,
                mesh,
                timeout=DEFAULT_TIMEOUT_S if timeout is None else timeout,
                pretrained=self.auto_parallel_plugin.pretrained,
            )
        # point optimizers made before prepare() at the new parameters, by name (FSDP replaces them twice); under
        # pipeline stages only this rank's stages' parameters remain
        new = dict(model.named_parameters())
        kept = {id(p) for p in new.values()}
        for opt in optimizers:
            raw = _raw_optimizer(opt)
            replaced = {
                id(p): new[names[id(p)]]
                for group in raw.param_groups
                for p in group["params"]
                if id(p) in names and names[id(p)] in new
            }
            remap_optimizer(raw, replaced)
            if plan.pp_size > 1:
                for group in raw.param_groups:
                    group["params"] = [p for p in group["params"] if id(p) in kept]
        self._adopt(model, plan)
        if self.is_main_process:
            path = self.auto_parallel_plugin.save_plan_path
            if path is not None:
                plan.save(path)
            self.print(plan.summary())

    def _adopt(self, model: nn.Module, plan: Plan) -> None:
        """``model`` (planned with ``plan``) is this job's: loaders prepared so far, and every later one, give
        its tensor-parallel groups their members' batches (:mod:`.data`)."""
        self.auto_plan, self._auto_model = plan, model
        for loader in self._dataloaders:
            self._regroup(loader)

    def _regroup(self, loader: Any) -> None:
        plan = self.auto_plan
        if plan is not None and plan.batch_group_size * plan.pp_size > 1 and self._parallel:
            # a replica's tp x cp ranks are consecutive in the row-major mesh: they read one union of batches
            members = group_members(self.process_index, plan.batch_group_size, plan.pp_size, plan.dp_size)
            regroup_loader(loader, members)

    def _is_other_model(self, model: nn.Module) -> bool:
        """A second model: accelerate prepares it (DDP), as it would without us; one model is planned per job."""
        if self._auto_model is None or model is self._auto_model:
            return False
        logger.warning(
            "AutoParallelAccelerator plans one model per job and has planned %s; %s is prepared by accelerate "
            "as usual (DDP, not planned)",
            type(self._auto_model).__name__,
            type(model).__name__,
        )
        return True

    # ----------------------------------------------------------------------------------- prepare
    def prepare(self, *args: Any, device_placement: list[bool] | None = None) -> Any:
        models = [a for a in args if isinstance(a, nn.Module) and not hasattr(a, "_hf_colossal_auto_plan")]
        planned = [a for a in args if isinstance(a, nn.Module) and hasattr(a, "_hf_colossal_auto_plan")]
        if self._parallel and planned and self._auto_model is None:
            self._adopt(
                planned[0], planned[0]._hf_colossal_auto_plan
            )  # planned elsewhere (the Trainer callback)
        models = [m for m in models if not self._is_other_model(m)]
        if self._parallel and models:
            if len(models) > 1:
                raise ValueError(
                    f"AutoParallelAccelerator.prepare got {len(models)} models; it parallelizes one per job"
                )
            loaders = [a for a in args if isinstance(a, DataLoader)]
            optimizers = [a for a in args if isinstance(a, torch.optim.Optimizer)]
            if self._batches_are_not_keyword_arguments(models[0], loaders):
                self._parallelize_on_first_call(models[0], optimizers)
            else:
                self._parallelize(models[0], loaders, optimizers)
        return super().prepare(*args, device_placement=device_placement)

    def _batches_are_not_keyword_arguments(self, model: nn.Module, loaders: list[DataLoader]) -> bool:
        """Whether the plan must come from the model's first call: it is still to be made, and the loader's
        batch is not a mapping of ``model.forward`` keyword arguments (tuples of a ``TensorDataset``, or a dict
        the loop unpacks itself, ``model(batch["x"])``), or there is no loader to plan from."""
        if self.auto_plan is not None or self.auto_parallel_plugin.example_inputs is not None:
            return False
        loaders = loaders or list(self._dataloaders)
        if not loaders:
            return True
        batch = peek_batch(loaders[0])
        return not isinstance(batch, Mapping) or not _takes_keywords(model, batch)

    def _parallelize_on_first_call(self, model: nn.Module, optimizers: list) -> None:
        """Wrap ``model`` so that its first training call plans from that call's arguments (one process's batch,
        the same rule as a loader's dict batch) on rank 0, and every rank applies the plan and remaps the
        optimizers prepared by then — or raises rank 0's planning error."""
        from .first_call import plan_on_first_call

        if self.device.type != "cpu" and next(model.parameters()).device != self.device:
            model.to(self.device)  # calls before planning run the whole model, where the batches are
        plugin = self.auto_parallel_plugin

        def parallelize(module: nn.Module, batch: dict[str, Any]) -> None:
            # the optimizers of this prepare() call and any prepared since, once each
            every = {id(_raw_optimizer(o)): o for o in [*optimizers, *self._optimizers]}
            plugin.example_inputs = batch  # what _make_plan plans from: one process's batch
            try:
                self._parallelize(module, [], list(every.values()))
            finally:
                plugin.example_inputs = None

        plan_on_first_call(model, parallelize)
        self._auto_model = model

    def prepare_model(
        self, model: nn.Module, device_placement: bool | None = None, evaluation_mode: bool = False
    ) -> nn.Module:
        """Parallelize (when not already done by :meth:`prepare`), then let accelerate add mixed precision and
        compilation — but no DDP: the runtime synchronises gradients over the data-parallel axis."""
        ours = hasattr(model, "_hf_colossal_auto_plan") or hasattr(
            model, "_hf_colossal_auto_plans_on_first_call"
        )
        if not self._parallel or (not ours and self._is_other_model(model)):
            return super().prepare_model(
                model, device_placement=device_placement, evaluation_mode=evaluation_mode
            )
        if not ours and self._batches_are_not_keyword_arguments(model, []):
            self._parallelize_on_first_call(model, [])
        elif not ours:
            self._parallelize(model, [], [])
        elif self._auto_model is None:
            self._adopt(model, model._hf_colossal_auto_plan)
        return super().prepare_model(model, device_placement=False, evaluation_mode=True)

    def prepare_data_loader(
        self, data_loader: DataLoader, device_placement: bool | None = None, slice_fn_for_dispatch: Any = None
    ) -> DataLoader:
        """Accelerate's own preparation (the same batches, lengths and random draws as plain accelerate), then,
        under a plan with tensor parallelism, each process reads its tensor-parallel group's batches: the union
        of the batches plain accelerate gives the group's processes (:mod:`.data`). A loader prepared before
        the plan exists is re-cut when the plan is made."""
        prepared = super().prepare_data_loader(data_loader, device_placement, slice_fn_for_dispatch)
        self._regroup(prepared)
        return prepared

    # ----------------------------------------------------------------------------------- metrics
    def _tensor_parallel_copies(self) -> tuple[int, int]:
        """The plan's ``(tp x cp, pp)``: how many processes hold each batch is their product ((1, 1) without a
        plan or in one process)."""
        plan = self.auto_plan
        return (plan.batch_group_size, plan.pp_size) if self._parallel and plan is not None else (1, 1)

    def gather(self, tensor: Any) -> Any:
        """Accelerate's, each sample once: what the processes of a data-parallel group (its tensor-parallel
        ranks and pipeline stages) computed from their shared batch (equal on all of them) is kept once per
        group, in rank order, as plain accelerate gathers the processes' own batches
        (:func:`.data.one_copy_per_group`)."""
        tp, pp = self._tensor_parallel_copies()
        rows = group_batch_rows(self.gradient_state.active_dataloader, tp * pp)
        return one_copy_per_group(super().gather(tensor), self.num_processes, tp, group_rows=rows, pp_size=pp)

    def gather_for_metrics(self, input_data: Any, use_gather_object: bool = False) -> Any:
        """Accelerate's, each sample once (see :meth:`gather`); the last batch's padding is cut as accelerate
        cuts it (:func:`.data.gather_for_metrics`)."""
        tp, pp = self._tensor_parallel_copies()
        if tp * pp == 1:
            return super().gather_for_metrics(input_data, use_gather_object)
        return data_gather_for_metrics(self, input_data, tp, use_gather_object, pp_size=pp)

    def clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float = 2) -> torch.Tensor:
        """Accelerate's, but for a pipelined model the norm spans every stage (each rank holds some stages'
        gradients): :meth:`.pipeline_runner.PipelineRunner.clip_grad_norm_`."""
        from ..apply.pipeline import is_pipelined, pipeline_runner

        model = self._auto_model
        if model is not None and is_pipelined(model):
            self.unscale_gradients()  # a gradient scaler's, as accelerate's own clipping does first
            return pipeline_runner(model).clip_grad_norm_(max_norm, norm_type)
        return super().clip_grad_norm_(parameters, max_norm, norm_type)

    # ----------------------------------------------------------------------------------- models out
    def unwrap_model(self, model: nn.Module, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True):
        """The model itself. Accelerate's unwrapping would re-bind the runtime's forward wrapper as a method
        when it strips the autocast wrapper, so ours restores the runtime's forward directly."""
        base = getattr(model, "_orig_mod", model)
        if not hasattr(base, "_hf_colossal_auto_plan"):
            return super().unwrap_model(model, keep_fp32_wrapper, keep_torch_compile)
        if not keep_fp32_wrapper and "_original_forward" in base.__dict__:
            base.forward = base.__dict__.pop("_original_forward")
        return model if keep_torch_compile else base

    def _is_auto(self, model: nn.Module) -> bool:
        return hasattr(getattr(model, "_orig_mod", model), "_hf_colossal_auto_plan")

    def get_state_dict(self, model: nn.Module, unwrap: bool = True) -> dict[str, torch.Tensor]:
        """Full, ordinary tensors on every rank, as accelerate gives them under DDP (collective: call on all
        ranks). Each rank then holds the whole model once more: to write a checkpoint, ``save_model`` or the
        model's ``save_pretrained`` stream it instead."""
        if not self._is_auto(model):
            return super().get_state_dict(model, unwrap)
        return consolidated_state_dict(self.unwrap_model(model, keep_torch_compile=False))

    def save(self, obj: Any, f: Any, safe_serialization: bool = False) -> None:
        """Accelerate's ``save`` (the main process writes), for objects that hold the planned model's tensors
        too — ``accelerator.save(unwrapped.state_dict(), path)``: each DTensor is saved as the full plain tensor,
        which loads in one process. A replicated one (a DDP plan's parameters) is the tensor it holds; sharded
        ones are gathered one at a time, which needs every rank to call ``save`` (as accelerate's docs do): a
        main process that came alone raises ``SaveCollectiveError`` after the plan's timeout, saying so."""
        from ..apply.pretrained import gathered_for_saving, save_timeout_s

        every_node = self.project_configuration.save_on_each_node  # then each node's main process writes too
        full = gathered_for_saving(obj, timeout_s=save_timeout_s(self._auto_model), every_rank=every_node)
        super().save(full, f, safe_serialization=safe_serialization)

    def save_model(
        self,
        model: nn.Module,
        save_directory: str | os.PathLike,
        max_shard_size: int | str = "10GB",
        safe_serialization: bool = True,
    ) -> None:
        """A consolidated checkpoint; for a transformers model with its config, so that ``from_pretrained``
        loads it in one process (collective: call on all ranks). Streamed: tensors are gathered one at a time
        and the main process writes each file when complete (:func:`..apply.pretrained.save_pretrained`), in
        safetensors whatever ``safe_serialization`` says (as transformers 5's ``save_pretrained``)."""
        module = self.unwrap_model(model, keep_torch_compile=False) if self._is_auto(model) else None
        if module is None or not hasattr(module, "save_pretrained"):
            return super().save_model(model, save_directory, max_shard_size, safe_serialization)
        save_pretrained(module, save_directory, max_shard_size=max_shard_size)
