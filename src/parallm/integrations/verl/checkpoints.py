"""The verl engine's checkpoints: verl's ``save_checkpoint`` / ``load_checkpoint`` over parallm's training checkpoint
(any layout). A mixin of :class:`parallm.integrations.verl.engine.ParallmEngine` (reads its ``chunks``,
``optimizer``, ``lr_scheduler``, ``checkpoint_config``, ``dims``, ``_saved`` and ``_resident``)."""

from __future__ import annotations

import json
import os
import shutil

import torch.distributed as dist

import parallm

__all__ = ["Checkpoints"]


class Checkpoints:
    """verl's checkpoint methods of the engine (see the module docstring)."""

    def save_checkpoint(self, local_path, hdfs_path=None, global_step=0, max_ckpt_to_keep=None, **kwargs):
        """``<local_path>/parallm``: parallm's training checkpoint (model, optimizer, the LR schedule's state in
        ``extra``; loads at any layout); ``<local_path>/huggingface`` too when verl's ``save_contents`` has
        ``hf_model``. Keeps the last ``max_ckpt_to_keep`` of the directories this engine saved."""
        extra = {"lr_scheduler": self.lr_scheduler.state_dict()} if self.lr_scheduler is not None else None
        if extra is not None:
            extra = json.loads(json.dumps(extra))
        with self._resident():
            parallm.save_checkpoint(os.path.join(local_path, "parallm"), self.chunks, self.optimizer,
                                    step=int(global_step), extra=extra, overwrite=True)
            contents = getattr(self.checkpoint_config, "save_contents", None) or []
            if "hf_model" in contents:
                parallm.save_hf_weights(self.chunks, os.path.join(local_path, "huggingface"), overwrite=True)
        self._saved.append(local_path)
        if max_ckpt_to_keep and len(self._saved) > max_ckpt_to_keep and self.dims.rank == 0:
            for old in self._saved[:-max_ckpt_to_keep]:
                shutil.rmtree(old, ignore_errors=True)
        self._saved = self._saved[-max_ckpt_to_keep:] if max_ckpt_to_keep else self._saved
        dist.barrier()

    def load_checkpoint(self, local_path, hdfs_path=None, del_local_after_load=True, **kwargs):
        with self._resident():
            info = parallm.load_checkpoint(os.path.join(local_path, "parallm"), self.chunks, self.optimizer)
        extra = info.get("extra") or {}
        if self.lr_scheduler is not None and "lr_scheduler" in extra:
            self.lr_scheduler.load_state_dict(extra["lr_scheduler"])
        if self.dims.rank == 0:
            print(f"parallm engine: loaded {os.path.join(local_path, 'parallm')} (step {info.get('step')}, "
                  f"{'with' if self.optimizer is not None else 'without'} optimizer)", flush=True)
