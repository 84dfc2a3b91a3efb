"""HuggingFace checkpoints in and out of a planned model, with no rank holding the full model.

- :mod:`.load`: :func:`load_pretrained`, every rank reading only the slices of a safetensors checkpoint it owns;
- :mod:`.save`: :func:`save_pretrained`, the streamed ``from_pretrained`` export, and the model's own
  ``save_pretrained`` made that writer (:func:`install_save_pretrained`);
- :mod:`.stream`: how each full tensor reaches the writer, one at a time, in blocks;
- :mod:`.collective`: a sharded save is collective (every rank arrives, or every rank raises), and
  ``accelerator.save``'s gather of DTensors (:func:`gathered_for_saving`).
"""

from .collective import SAVE_WAIT_WARN_S, SaveCollectiveError, gathered_for_saving, save_timeout_s
from .load import (
    SAFE_WEIGHTS_INDEX_NAME,
    SAFE_WEIGHTS_NAME,
    LoadReport,
    PretrainedLoadError,
    checkpoint_files,
    load_pretrained,
)
from .save import SaveReport, install_save_pretrained, planned_save_pretrained, save_pretrained
from .stream import STREAM_BLOCK_BYTES

__all__ = [
    "SAFE_WEIGHTS_INDEX_NAME",
    "SAFE_WEIGHTS_NAME",
    "SAVE_WAIT_WARN_S",
    "STREAM_BLOCK_BYTES",
    "LoadReport",
    "PretrainedLoadError",
    "SaveCollectiveError",
    "SaveReport",
    "checkpoint_files",
    "gathered_for_saving",
    "install_save_pretrained",
    "load_pretrained",
    "planned_save_pretrained",
    "save_pretrained",
    "save_timeout_s",
]
