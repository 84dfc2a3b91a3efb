"""``save_state``/``load_state`` of :class:`~hf_colossal_auto.integrations.accelerator.AutoParallelAccelerator`.

Why a module of its own: checkpoints of a planned job are their own job — model and optimizer shards through
``torch.distributed.checkpoint`` (every rank writes its own; accelerate's would save DTensors from the main
process only), the rest (schedulers, samplers, RNG states, the scaler, custom objects) through accelerate's own
helpers, and an elastic ``load_state``: another plan or number of processes than the saving job's, one process
included, and accelerate's own one-process folders. The methods live on :class:`CheckpointState`, a base class
of the accelerator placed before ``accelerate.Accelerator`` (their ``super()`` is accelerate's own, for jobs
without a plan).
"""

from __future__ import annotations

import os
import re
import shutil
from typing import Any

import torch
from accelerate.checkpointing import (
    load_accelerator_state,
    load_custom_state,
    save_accelerator_state,
    save_custom_state,
)
from accelerate.optimizer import AcceleratedOptimizer
from torch import nn

from ..apply.checkpoint import load_sharded

DCP_DIR = "distributed_checkpoint"
"""Sub-directory of a ``save_state`` folder holding the torch.distributed.checkpoint shards."""


def _raw_optimizer(opt: Any) -> torch.optim.Optimizer:
    while isinstance(opt, AcceleratedOptimizer):
        opt = opt.optimizer
    return opt


class CheckpointState:
    """The checkpoint methods of ``AutoParallelAccelerator`` (a base class before ``accelerate.Accelerator``)."""

    def _training_state(
        self, checkpoint: str | None = None
    ) -> tuple[dict[str, Any], list[tuple[nn.Module, list[torch.optim.Optimizer]]]]:
        """DCP state of every prepared model with the optimizers over its parameters, as a checkpoint holds it
        (pipeline stages included: :func:`~hf_colossal_auto.apply.pipeline_checkpoint.checkpoint_state`);
        ``checkpoint``: the DCP directory to read, whose optimizer state's form the templates take."""
        from ..apply.pipeline_checkpoint import checkpoint_state, saved_format

        optimizers = [_raw_optimizer(o) for o in self._optimizers]
        owner: dict[int, int] = {}
        pairs = []
        for i, model in enumerate(self._models):
            module = self.unwrap_model(model, keep_torch_compile=False)
            ids = {id(p) for p in module.parameters()}
            mine = [o for o in optimizers if all(id(p) in ids for g in o.param_groups for p in g["params"])]
            owner.update({id(o): i for o in mine})
            pairs.append((module, mine))
        orphans = [type(o).__name__ for o in optimizers if id(o) not in owner]
        if orphans:
            raise ValueError(
                f"save_state/load_state: optimizer(s) {orphans} do not belong to one prepared model; "
                "give each optimizer the parameters of a single model passed to prepare()"
            )
        state: dict[str, Any] = {}
        for i, (module, mine) in enumerate(pairs):
            form = saved_format(checkpoint, f"optimizer_{i}") if checkpoint is not None and mine else None
            model_sd, optim_sd = checkpoint_state(module, mine, form)
            state[f"model_{i}"] = model_sd
            if mine:
                state[f"optimizer_{i}"] = optim_sd
        return state, pairs

    def _checkpoint_dir(self, output_dir: str | None) -> str:
        """Where ``save_state`` writes, with accelerate's automatic checkpoint naming and ``total_limit``."""
        config = self.project_configuration
        if not config.automatic_checkpoint_naming:
            if output_dir is None:
                raise ValueError(
                    "save_state needs output_dir (or ProjectConfiguration(automatic_checkpoint_naming))"
                )
            return os.path.expanduser(str(output_dir))
        root = os.path.join(self.project_dir, "checkpoints")
        os.makedirs(root, exist_ok=True)
        folders = sorted(
            (os.path.join(root, f) for f in os.listdir(root)),
            key=lambda f: int(re.findall(r"(\d+)(?=[^/]*$)", f)[0]),
        )
        if config.total_limit is not None and len(folders) + 1 > config.total_limit and self.is_main_process:
            for folder in folders[: len(folders) + 1 - config.total_limit]:
                shutil.rmtree(folder)
        output_dir = os.path.join(root, f"checkpoint_{self.save_iteration}")
        if os.path.exists(output_dir):
            raise ValueError(
                f"checkpoint directory {output_dir} exists; set accelerator.project_configuration.iteration"
            )
        self.wait_for_everyone()
        return output_dir

    def save_state(
        self, output_dir: str | None = None, safe_serialization: bool = True, **kwargs: Any
    ) -> str:
        """Model + optimizer shards through torch.distributed.checkpoint (``<output_dir>/distributed_checkpoint``),
        the rest (schedulers, samplers, RNG, scaler, step, custom objects) as accelerate saves it."""
        if self._auto_model is None:
            return super().save_state(output_dir, safe_serialization, **kwargs)
        import torch.distributed.checkpoint as dcp

        output_dir = self._checkpoint_dir(output_dir)
        os.makedirs(output_dir, exist_ok=True)
        for hook in self._save_model_state_pre_hook.values():
            hook(self._models, [], output_dir)
        state, _ = self._training_state()
        dcp.save(state, checkpoint_id=os.path.join(output_dir, DCP_DIR))
        location = save_accelerator_state(
            output_dir,
            [],
            [],
            self._schedulers,
            self._dataloaders,
            self.state.process_index,
            self.step,
            self.scaler,
            save_on_each_node=self.project_configuration.save_on_each_node,
            safe_serialization=safe_serialization,
        )
        for i, obj in enumerate(self._custom_objects):
            save_custom_state(
                obj, output_dir, i, save_on_each_node=self.project_configuration.save_on_each_node
            )
        self.project_configuration.iteration += 1
        self.wait_for_everyone()
        return location

    def _load_single_process_files(
        self,
        input_dir: str,
        pairs: list[tuple[nn.Module, list[torch.optim.Optimizer]]],
        load_kwargs: dict | None,
    ) -> None:
        """Model and optimizer state from accelerate's own one-process ``save_state`` files, full tensors that
        every rank slices to its shards."""
        from safetensors.torch import load_file
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        from ..apply.checkpoint import load_full_optimizer_state

        optimizers = [_raw_optimizer(o) for o in self._optimizers]
        for i, (module, mine) in enumerate(pairs):
            suffix = "" if i == 0 else f"_{i}"
            safe = os.path.join(input_dir, f"model{suffix}.safetensors")
            pickled = os.path.join(input_dir, f"pytorch_model{suffix}.bin")
            if os.path.isfile(safe):
                weights = load_file(safe)
            elif os.path.isfile(pickled):
                weights = torch.load(pickled, map_location="cpu", weights_only=True)
            else:
                raise ValueError(
                    f"load_state: {input_dir} has neither {DCP_DIR}/ (AutoParallelAccelerator.save_state) nor "
                    f"model{suffix}.safetensors / pytorch_model{suffix}.bin (accelerate's save_state in one "
                    "process or under DDP), so there is nothing here to resume from. Give the folder save_state "
                    "returned. A folder of accelerate's FSDP or DeepSpeed save_state cannot be resharded here: "
                    "consolidate its weights into a save_pretrained directory and start from them with "
                    "AutoParallelPlugin(pretrained=...) (the optimizer starts afresh)"
                )
            # strict=False: safetensors files leave out tied weights, which their partners fill
            set_model_state_dict(
                module, weights, options=StateDictOptions(full_state_dict=True, strict=False)
            )
            for opt in mine:
                j = next(k for k, o in enumerate(optimizers) if o is opt)
                path = os.path.join(input_dir, "optimizer.bin" if j == 0 else f"optimizer_{j}.bin")
                if not os.path.isfile(path):
                    raise ValueError(
                        f"load_state: {input_dir} has the weights but no {os.path.basename(path)} for optimizer "
                        f"{j}; save the state with the same optimizers prepared as this job has"
                    )
                saved = torch.load(path, map_location="cpu", weights_only=True)
                load_full_optimizer_state(module, opt, saved, source=path)

    def _resolve_input_dir(self, input_dir: str | None) -> str | None:
        """``input_dir``, or the latest automatically named checkpoint when it is None and naming is on."""
        naming = self.project_configuration.automatic_checkpoint_naming and self.project_dir is not None
        root = os.path.join(self.project_dir, "checkpoints") if naming else ""
        if input_dir is None and naming and os.path.isdir(root):
            input_dir = max(
                (os.path.join(root, f) for f in os.listdir(root)),
                key=lambda f: int(re.findall(r"(\d+)(?=[^/]*$)", f)[0]),
            )
        return None if input_dir is None else os.path.expanduser(str(input_dir))

    def load_state(
        self, input_dir: str | None = None, load_kwargs: dict | None = None, **kwargs: Any
    ) -> None:
        """Resume what :meth:`save_state` wrote, under this job's plan whatever the saving job's was.

        Elastic: the model and optimizer shards of ``<input_dir>/distributed_checkpoint`` are read back by
        ``torch.distributed.checkpoint``, each rank the slices its own tensors cover, so the saving job may have
        had another plan (tensor parallelism where this one shards data with FSDP, say) or another number of
        processes — one process too, which reads plain tensors. Folders written by accelerate's own
        ``save_state`` in one process (``model.safetensors``, ``optimizer.bin``) load here as well, each rank
        slicing the full tensors (the optimizer must be built as that job built it). Schedulers, samplers, the
        step and the RNG states are accelerate's; a process the saving job did not have takes the main
        process's RNG state."""
        resolved = self._resolve_input_dir(input_dir)
        sharded = resolved is not None and os.path.isdir(os.path.join(resolved, DCP_DIR))
        if self._auto_model is None and not sharded:
            return super().load_state(input_dir, load_kwargs, **kwargs)
        from ..apply.pipeline_checkpoint import restore_state

        if resolved is None:
            raise ValueError(
                "load_state needs input_dir (or ProjectConfiguration(automatic_checkpoint_naming))"
            )
        input_dir = resolved
        for hook in self._load_model_state_pre_hook.values():
            hook(self._models, input_dir)
        state, pairs = self._training_state(os.path.join(input_dir, DCP_DIR) if sharded else None)
        if sharded:
            load_sharded(state, os.path.join(input_dir, DCP_DIR))
            for i, (module, mine) in enumerate(pairs):
                restore_state(module, mine, state[f"model_{i}"], state.get(f"optimizer_{i}", {}))
        else:
            self._load_single_process_files(input_dir, pairs, load_kwargs)
        index = self.state.process_index
        if not os.path.isfile(os.path.join(input_dir, f"random_states_{index}.pkl")):
            index = 0  # saved by fewer processes: continue the main process's streams (and read its step)
        override = load_accelerator_state(
            input_dir,
            [],
            [],
            self._schedulers,
            self._dataloaders,
            index,
            self.scaler,
            kwargs.pop("map_location", "cpu"),
            load_kwargs,
        )
        if "step" in override:
            self.step = override["step"]
        found = [f for f in os.listdir(input_dir) if re.search(r"^custom_checkpoint_\d+\.pkl$", f)]
        if len(found) != len(self._custom_objects):
            raise RuntimeError(
                f"{input_dir} holds {len(found)} custom checkpoints but {len(self._custom_objects)} objects are "
                "registered with register_for_checkpointing; register the same objects as when it was saved"
            )
        for index, obj in enumerate(self._custom_objects):
            load_custom_state(obj, input_dir, index)
