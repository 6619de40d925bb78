"""The training-checkpoint functions under the module name ``parallm/__init__.py`` and older code import them
from; they live in :mod:`parallm.checkpoint.training`."""

from .training import (AsyncCheckpointSave, checkpoint_to_hf, load_checkpoint, read_tensors, save_checkpoint,
                       wait_for_pending_saves)

__all__ = ["AsyncCheckpointSave", "checkpoint_to_hf", "load_checkpoint", "read_tensors", "save_checkpoint",
           "wait_for_pending_saves"]
