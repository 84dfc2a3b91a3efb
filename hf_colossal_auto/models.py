"""Model presets and builders: HF configs shipped with the package, models built from them (meta or real),
and the example batch one training step of each task consumes."""

from __future__ import annotations

import copy
import json
import os
import warnings
from importlib import resources
from typing import Any

import torch
import transformers
from torch import nn
from transformers import AutoConfig, PretrainedConfig
from transformers.models.auto import modeling_auto

TASKS = ("causal-lm", "masked-lm", "seq2seq-lm")

_TASK_MAPPINGS = {
    "seq2seq-lm": modeling_auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES,
    "masked-lm": modeling_auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    "causal-lm": modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
}
_AUTO_CLASSES = {
    "causal-lm": transformers.AutoModelForCausalLM,
    "masked-lm": transformers.AutoModelForMaskedLM,
    "seq2seq-lm": transformers.AutoModelForSeq2SeqLM,
}
# Share of masked-lm positions that carry a label, as in BERT pre-training.
MLM_PROBABILITY = 0.15


def _presets_dir():
    return resources.files("hf_colossal_auto") / "presets"


def list_presets() -> list[str]:
    return sorted(p.name[: -len(".json")] for p in _presets_dir().iterdir() if p.name.endswith(".json"))


def _config_from_dict(data: dict[str, Any], source: str) -> PretrainedConfig:
    data = dict(data)
    model_type = data.pop("model_type", None)
    if not model_type:
        raise ValueError(f"{source}: config has no 'model_type', so the model family cannot be determined")
    return AutoConfig.for_model(model_type, **data)


def load_config(name_or_path: str | os.PathLike) -> PretrainedConfig:
    """A preset name (see `list_presets()`), a path to a config.json, a directory holding one, or a Hub model id
    already in the local HuggingFace cache (``meta-llama/Meta-Llama-3-8B``: only its ``config.json`` is read;
    nothing is downloaded)."""
    name = os.fspath(name_or_path)
    preset = _presets_dir() / f"{name}.json"
    if os.sep not in name and "/" not in name and preset.is_file():
        return _config_from_dict(json.loads(preset.read_text()), f"preset {name!r}")
    path = os.path.join(name, "config.json") if os.path.isdir(name) else name
    if not os.path.isfile(path):
        path = _cached_hub_config(name) or path
    if os.path.isfile(path):
        with open(path) as f:
            return _config_from_dict(json.load(f), path)
    raise ValueError(
        f"unknown model preset {name!r}; available presets: {', '.join(list_presets())}. "
        "A path to a HuggingFace config.json (or a directory containing one), or a model id whose config is in "
        "the local HuggingFace cache (`huggingface-cli download ID config.json` on a machine with network), "
        "also works."
    )


def _cached_hub_config(model_id: str) -> str | None:
    """The cached ``config.json`` of a Hub model id (``org/name``), or None: never touches the network."""
    if model_id.count("/") != 1 or os.path.exists(model_id):
        return None
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:  # pragma: no cover - transformers depends on it
        return None
    found = try_to_load_from_cache(model_id, "config.json")
    return found if isinstance(found, str) else None


def _config_of(model_or_config: nn.Module | PretrainedConfig | str) -> PretrainedConfig:
    if isinstance(model_or_config, PretrainedConfig):
        return model_or_config
    if isinstance(model_or_config, (str, os.PathLike)):
        return load_config(model_or_config)
    config = getattr(model_or_config, "config", None)
    if isinstance(config, PretrainedConfig):
        return config
    raise TypeError(
        f"expected a HuggingFace model, config or preset name, got {type(model_or_config).__name__}"
    )


def _task_of_class_name(class_name: str) -> str | None:
    for task, mapping in _TASK_MAPPINGS.items():
        if any(class_name == v or (isinstance(v, tuple) and class_name in v) for v in mapping.values()):
            return task
    return None


def task_of(model_or_config: nn.Module | PretrainedConfig | str) -> str:
    """'causal-lm', 'masked-lm' or 'seq2seq-lm': from the model class, else the config's architectures,
    else its model type."""
    if isinstance(model_or_config, nn.Module):
        task = _task_of_class_name(type(model_or_config).__name__)
        if task is not None:
            return task
    config = _config_of(model_or_config)
    for arch in config.architectures or ():
        task = _task_of_class_name(arch)
        if task is not None:
            return task
    model_type = config.model_type
    if config.is_encoder_decoder and model_type in _TASK_MAPPINGS["seq2seq-lm"]:
        return "seq2seq-lm"
    # Encoder families (BERT, RoBERTa...) also register a causal head; without a decoder flag they are MLMs.
    if not getattr(config, "is_decoder", False) and model_type in _TASK_MAPPINGS["masked-lm"]:
        return "masked-lm"
    if model_type in _TASK_MAPPINGS["causal-lm"]:
        return "causal-lm"
    raise ValueError(
        f"cannot tell the training task of model type {model_type!r} "
        f"(architectures={config.architectures}); pass task= one of {TASKS}"
    )


def _resolve_model_class(config: PretrainedConfig, task: str | None) -> type[nn.Module]:
    if task is not None and task not in TASKS:
        raise ValueError(f"unknown task {task!r}; expected one of {TASKS}")
    arch = (config.architectures or [None])[0]
    arch_cls = getattr(transformers, arch, None) if arch else None
    if arch_cls is not None and (task is None or _task_of_class_name(arch) in (task, None)):
        return arch_cls
    if task is None:
        task = task_of(config)
    class_name = _TASK_MAPPINGS[task].get(config.model_type)
    if isinstance(class_name, tuple):
        class_name = class_name[0]
    cls = getattr(transformers, class_name, None) if class_name else None
    if cls is None:
        raise ValueError(f"transformers has no {task} model for model type {config.model_type!r}")
    return cls


def build_model(
    config_or_name: PretrainedConfig | str | os.PathLike,
    *,
    device: str | torch.device = "meta",
    dtype: torch.dtype | str | None = None,
    task: str | None = None,
    attn_implementation: str = "sdpa",
) -> nn.Module:
    """Instantiate the training head model for a config or preset, in train mode.

    `device="meta"` allocates no storage (shapes only, for symbolic profiling); any other device builds a real
    model initialised with transformers' init functions from the caller's RNG state. `dtype=None` means the
    torch default dtype (float32), not a dtype the config file may record. The caller's config is not modified.
    """
    if isinstance(config_or_name, PretrainedConfig):
        config = copy.deepcopy(config_or_name)
    else:
        config = load_config(config_or_name)
    if hasattr(config, "use_cache"):
        config.use_cache = False
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    cls = _resolve_model_class(config, task)
    if attn_implementation == "sdpa" and not getattr(cls, "_supports_sdpa", False):
        warnings.warn(f"{cls.__name__} does not support sdpa attention; using eager", stacklevel=2)
        attn_implementation = "eager"
    with torch.device(device):
        model = cls._from_config(
            config, dtype=dtype or torch.get_default_dtype(), attn_implementation=attn_implementation
        )
    return model.train()


def max_positions(model_or_config: nn.Module | PretrainedConfig | str) -> int | None:
    """Longest sequence the model's position embeddings allow; None for relative-position models (T5)."""
    config = _config_of(model_or_config)
    for attr in ("n_positions", "max_position_embeddings"):
        value = getattr(config, attr, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def _random_ids(shape: tuple[int, ...], vocab_size: int, generator: torch.Generator) -> torch.Tensor:
    return torch.randint(0, vocab_size, shape, generator=generator, dtype=torch.int64)


def make_example_inputs(
    model_or_config: nn.Module | PretrainedConfig | str,
    batch_size: int,
    seq_len: int,
    *,
    device: str | torch.device = "cpu",
    seed: int = 0,
) -> dict[str, torch.Tensor]:
    """The keyword arguments of one training step for the model's task (labels included, so the model
    returns a loss). Token ids are int64 in [0, vocab_size), deterministic in `seed`; on "meta" the tensors
    only have shapes. seq2seq targets are seq_len // 4 long (at least 1), as in T5 span corruption, and
    decoder inputs are left to the model to derive from the labels."""
    config = _config_of(model_or_config)
    task = task_of(model_or_config)
    if batch_size < 1 or seq_len < 1:
        raise ValueError(f"batch_size and seq_len must be >= 1, got {batch_size} and {seq_len}")
    limit = max_positions(config)
    if limit is not None and seq_len > limit:
        raise ValueError(
            f"seq_len={seq_len} exceeds the model's maximum of {limit} positions "
            f"(n_positions / max_position_embeddings of {config.model_type})"
        )
    vocab_size = config.vocab_size
    target_len = max(1, seq_len // 4)
    shapes = {"input_ids": (batch_size, seq_len), "attention_mask": (batch_size, seq_len)}
    if task == "masked-lm" and getattr(config, "type_vocab_size", None):
        shapes["token_type_ids"] = (batch_size, seq_len)
    shapes["labels"] = (batch_size, target_len) if task == "seq2seq-lm" else (batch_size, seq_len)

    device = torch.device(device)
    if device.type == "meta":
        return {k: torch.empty(shape, dtype=torch.int64, device="meta") for k, shape in shapes.items()}

    generator = torch.Generator().manual_seed(seed)
    input_ids = _random_ids(shapes["input_ids"], vocab_size, generator)
    batch = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)}
    if "token_type_ids" in shapes:
        batch["token_type_ids"] = torch.zeros_like(input_ids)
    if task == "causal-lm":
        batch["labels"] = input_ids.clone()
    elif task == "masked-lm":
        # The same number of labelled positions in every row, at least one, so the loss is always defined.
        n_labelled = max(1, round(MLM_PROBABILITY * seq_len))
        positions = torch.rand(shapes["labels"], generator=generator).argsort(dim=1)[:, :n_labelled]
        labels = torch.full_like(input_ids, -100)
        labels.scatter_(1, positions, input_ids.gather(1, positions))
        batch["labels"] = labels
    else:
        batch["labels"] = _random_ids(shapes["labels"], vocab_size, generator)
    return {k: v.to(device) for k, v in batch.items()}


def param_count(model: nn.Module) -> int:
    """Distinct parameters (tied weights counted once), as model cards report them."""
    return sum(p.numel() for p in model.parameters())
