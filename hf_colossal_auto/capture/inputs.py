"""Checks on the example batch, and the error raised when a model cannot be captured."""

from __future__ import annotations

import inspect
import traceback
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn


class CaptureError(RuntimeError):
    """A model could not be traced; the message names the model, the failing module/op and what to try."""

    @classmethod
    def from_exception(cls, model: nn.Module, exc: BaseException) -> CaptureError:
        frames = traceback.extract_tb(exc.__traceback__)
        where = ""
        for frame in reversed(frames):
            if "/torch/" not in frame.filename and "hf_colossal_auto" not in frame.filename:
                where = f" at {frame.filename}:{frame.lineno} ({frame.name})"
                break
        hint = (
            "Data-dependent Python control flow (e.g. `if tensor.any():`, `.item()`, `.tolist()`) cannot run on "
            "fake tensors; pass inputs that avoid that path (e.g. drop an all-ones attention_mask) or "
            "set use_cache=False."
        )
        if "DataDependent" not in type(exc).__name__ and "data-dependent" not in str(exc).lower():
            hint = "Check that the example inputs have the shapes and dtypes the model's forward expects."
        return cls(
            f"Could not capture a training step of {type(model).__name__}{where}: "
            f"{type(exc).__name__}: {exc}. {hint}"
        )


def _required_forward_args(model: nn.Module) -> list[str]:
    try:
        sig = inspect.signature(model.forward)
    except (TypeError, ValueError):
        return []
    return [
        name
        for name, p in sig.parameters.items()
        if p.default is inspect.Parameter.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    ]


def validate_inputs(model: nn.Module, example_inputs: Mapping[str, Any]) -> None:
    """Fail early, with the key's name, on batches the model cannot train on."""
    if not isinstance(example_inputs, Mapping):
        raise TypeError(
            f"example_inputs must be a dict of tensors (one batch, as the model's forward takes keyword "
            f"arguments), got {type(example_inputs).__name__}."
        )
    if not example_inputs:
        raise ValueError("example_inputs is empty: pass one batch, e.g. {'input_ids': ..., 'labels': ...}.")
    missing = [k for k in _required_forward_args(model) if k not in example_inputs]
    if missing:
        raise ValueError(f"example_inputs for {type(model).__name__} are missing required keys: {missing}.")
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        params = {}
    takes_kwargs = any(p.kind is p.VAR_KEYWORD for p in params.values())
    if params and not takes_kwargs:
        unknown = [k for k in example_inputs if k not in params]
        if unknown:
            raise ValueError(
                f"example_inputs has keys {unknown} that {type(model).__name__}.forward does not take; "
                f"it takes {list(params)}."
            )
    config = getattr(model, "config", None)
    is_encoder_decoder = config is not None and getattr(config, "is_encoder_decoder", False)
    if is_encoder_decoder and "labels" not in example_inputs and "decoder_input_ids" not in example_inputs:
        raise ValueError(
            f"{type(model).__name__} is an encoder-decoder model: example_inputs need `labels` "
            "(or `decoder_input_ids`) for the decoder."
        )
    for k, v in example_inputs.items():
        if isinstance(v, torch.Tensor) and v.dim() == 0 and k in ("input_ids", "labels"):
            raise ValueError(f"example_inputs[{k!r}] is a scalar; it needs a batch dimension.")


MASK_KEYS = ("attention_mask", "decoder_attention_mask")


def drop_all_ones_masks(example_inputs: Mapping[str, Any]) -> dict[str, Any]:
    """The batch as eager transformers would run it: an attention mask with no padding is the same as none.

    Eager transformers checks the mask's values and, when nothing is masked, passes no mask to SDPA (so the
    flash kernel can run with ``is_causal``). Under fake tensors it cannot look at values and always builds a
    ``batch x 1 x seq x seq`` mask, which the attention kernel then converts and saves per layer: the traced
    step would not be the step that runs. We look at the values here instead (a ``meta`` mask has none and is
    taken as all ones, which is what :func:`hf_colossal_auto.models.make_example_inputs` builds) and drop
    masks that mask nothing; masks with padding are kept.
    """
    out = dict(example_inputs)
    for key in MASK_KEYS:
        mask = out.get(key)
        if not isinstance(mask, torch.Tensor):
            continue
        if mask.device.type == "meta" or bool(mask.bool().all()):
            del out[key]
    return out
