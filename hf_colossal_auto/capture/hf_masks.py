"""Make transformers decide on attention masks under fake tensors the way it does in eager mode.

transformers skips building a causal mask (and lets SDPA use ``is_causal``, hence the flash kernel) when it
can read from the tensors that nothing is masked. Under fake tensors its ``is_tracing`` guard says "tracing"
and it always builds a ``batch x 1 x seq x seq`` mask instead — also for ``q_offset`` (a tensor from
``cache_position``) when no padding mask is given at all. The traced step would then not be the step that
runs: the mask and the float copy SDPA makes of it per layer would be counted, and the flash kernel never
chosen.

Without a padding mask transformers also looks for packed sequences in the position ids (a data-dependent
check that, under fake tensors, always answers "packed"). The capture has already dropped attention masks
that mask nothing (:func:`.inputs.drop_all_ones_masks`), and a training step runs without a KV cache, so the
decisions only depend on shapes and on values we can read before tracing:

* the causal mask is skipped when there is no padding mask, no sliding window covers the sequence, and
  queries and keys are aligned (``q_length == kv_length``, or a single query);
* sequences count as packed only when the caller's real ``position_ids`` say so (position ids the model
  makes itself are a plain ``arange``; ``meta`` ones carry no values and are taken as not packed).

Masks with padding and packed sequences are still built, as in eager. This patches two private functions of
transformers for the duration of a capture; if a release renames them, the capture keeps working and only
loses this refinement (logged once).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Mapping
from typing import Any

import torch

logger = logging.getLogger(__name__)
_warned = False


def _ignore_causal_mask_from_shapes(
    padding_mask, q_length, kv_length, q_offset, kv_offset, local_attention_size=None
) -> bool:
    if padding_mask is not None:
        return False
    if local_attention_size is not None and kv_length >= local_attention_size:
        return False
    return q_length == 1 or kv_length == q_length


def _not_packed(position_ids) -> None:
    return None


@contextlib.contextmanager
def eager_mask_decisions(example_inputs: Mapping[str, Any]) -> Iterator[None]:
    """Within the block, transformers' mask shortcuts decide as in eager mode for ``example_inputs``."""
    global _warned
    try:
        from transformers import masking_utils
    except ImportError:  # pragma: no cover - transformers is a dependency
        yield
        return
    patches: dict[str, Any] = {"_ignore_causal_mask_sdpa": _ignore_causal_mask_from_shapes}
    find_packed = getattr(masking_utils, "find_packed_sequence_indices", None)
    position_ids = example_inputs.get("position_ids")
    real_positions = isinstance(position_ids, torch.Tensor) and position_ids.device.type != "meta"
    if find_packed is not None and not (real_positions and find_packed(position_ids) is not None):
        patches["find_packed_sequence_indices"] = _not_packed
    originals = {name: getattr(masking_utils, name, None) for name in patches}
    missing = [name for name, fn in originals.items() if fn is None]
    if missing and not _warned:
        logger.warning(
            "transformers.masking_utils has no %s; attention masks are traced as transformers builds them under "
            "fake tensors (memory may be over-predicted)",
            missing,
        )
        _warned = True
    for name, fn in patches.items():
        if originals[name] is not None:
            setattr(masking_utils, name, fn)
    try:
        yield
    finally:
        for name, fn in originals.items():
            if fn is not None:
                setattr(masking_utils, name, fn)
