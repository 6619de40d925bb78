"""The verl engine's checkpoints: verl's ``save_checkpoint`` / ``load_checkpoint`` over parallm's training checkpoint
(any layout). A mixin of :class:`parallm.integrations.verl.engine.ParallmEngine` (reads its ``chunks``,
``optimizer``, ``lr_scheduler``, ``checkpoint_config``, ``dims``, ``device_type``, ``_saved`` and ``_resident``).

verl's ``checkpoint.save_contents`` / ``load_contents`` (default ``["model", "optimizer", "extra"]``) are read as
verl's FSDP checkpoint manager reads them: ``model`` is required (a parallm checkpoint always holds the model;
leaving it out is refused), ``optimizer`` saves / loads the optimizer's state, ``extra`` the LR schedule's state
and every rank's random number generators (torch's CPU generator, the accelerator's when the model lives on one,
numpy's and Python's: what verl's managers save as ``rng``), ``hf_model`` (save only) adds an HF export.
The generators are stored per rank as JSON (``parallm_rng/rank_{r}_of_{world}.json``, nothing pickled) and
restored when the loading job has the same number of ranks (a job at another world size keeps its own).
``max_ckpt_to_keep`` counts the directories this engine object saved (as verl's managers count theirs: the
directories of an earlier process are never deleted); rank 0 deletes, so the directories must be on a filesystem
every rank shares, as the checkpoint itself must be.
"""

from __future__ import annotations

import json
import os
import random
import shutil

import numpy as np
import torch
import torch.distributed as dist

import parallm
from parallm.parallel.errors import run_local

__all__ = ["Checkpoints", "load_rng_state", "rng_state"]

DEFAULT_CONTENTS = ("model", "optimizer", "extra")


def rng_state(device_type: str) -> dict:
    """This process's generators as JSON values (verl's ``get_rng_state``: cpu, numpy, random, the device's)."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    version, internal, gauss_next = random.getstate()
    state = {"cpu": torch.get_rng_state().tolist(), "numpy": [name, keys.tolist(), pos, has_gauss, cached],
             "random": [version, list(internal), gauss_next]}
    if device_type == "cuda" and torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state().tolist()
    return state


def load_rng_state(state: dict) -> None:
    """Restore what :func:`rng_state` returned."""
    torch.set_rng_state(torch.tensor(state["cpu"], dtype=torch.uint8))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    version, internal, gauss_next = state["random"]
    random.setstate((version, tuple(internal), gauss_next))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(torch.tensor(state["cuda"], dtype=torch.uint8))


class Checkpoints:
    """verl's checkpoint methods of the engine (see the module docstring)."""

    def _contents(self, key: str) -> set:
        contents = set(getattr(self.checkpoint_config, key, None) or DEFAULT_CONTENTS)
        if "model" not in contents:
            raise NotImplementedError(f"parallm engine: checkpoint.{key}={sorted(contents)}; a parallm checkpoint "
                                      "always holds the model: 'model' must be listed")
        return contents

    def _rng_path(self, local_path: str) -> str:
        return os.path.join(local_path, "parallm_rng", f"rank_{self.dims.rank}_of_{self.dims.world}.json")

    def save_checkpoint(self, local_path, hdfs_path=None, global_step=0, max_ckpt_to_keep=None, **kwargs):
        """``<local_path>/parallm``: parallm's training checkpoint (model, and per verl's ``save_contents`` the
        optimizer, the LR schedule's state in ``extra``; loads at any layout), each rank's generators
        (``extra``), ``<local_path>/huggingface`` when ``save_contents`` has ``hf_model``. Keeps the last
        ``max_ckpt_to_keep`` of the directories this engine saved (module docstring)."""
        contents = run_local(lambda: self._contents("save_contents"), what="parallm engine: save_checkpoint")
        extra = None
        if "extra" in contents and self.lr_scheduler is not None:
            extra = json.loads(json.dumps({"lr_scheduler": self.lr_scheduler.state_dict()}))
        with self._resident():
            parallm.save_checkpoint(os.path.join(local_path, "parallm"), self.chunks,
                                    self.optimizer if "optimizer" in contents else None,
                                    step=int(global_step), extra=extra, overwrite=True)
            if "hf_model" in contents:
                parallm.save_hf_weights(self.chunks, os.path.join(local_path, "huggingface"), overwrite=True)
        if "extra" in contents:
            def write():
                os.makedirs(os.path.dirname(self._rng_path(local_path)), exist_ok=True)
                with open(self._rng_path(local_path), "w") as f:
                    json.dump(rng_state(self.device_type), f)
            run_local(write, what="parallm engine: save_checkpoint (random generators)")
        self._saved.append(local_path)
        if max_ckpt_to_keep and len(self._saved) > max_ckpt_to_keep and self.dims.rank == 0:
            for old in self._saved[:-max_ckpt_to_keep]:
                shutil.rmtree(old, ignore_errors=True)
        self._saved = self._saved[-max_ckpt_to_keep:] if max_ckpt_to_keep else self._saved
        dist.barrier()

    def load_checkpoint(self, local_path, hdfs_path=None, del_local_after_load=True, **kwargs):
        """The model, and per verl's ``load_contents`` the optimizer's state, the LR schedule's state and this
        rank's generators (when saved by a job of as many ranks), from :meth:`save_checkpoint`'s directory."""
        contents = run_local(lambda: self._contents("load_contents"), what="parallm engine: load_checkpoint")
        optimizer = self.optimizer if "optimizer" in contents else None
        with self._resident():
            info = parallm.load_checkpoint(os.path.join(local_path, "parallm"), self.chunks, optimizer)
        extra = info.get("extra") or {}
        rng = None
        if "extra" in contents:
            if self.lr_scheduler is not None and "lr_scheduler" in extra:
                state = extra["lr_scheduler"]
                if "num_steps" in state and not hasattr(self.lr_scheduler, "wd_incr_style"):
                    raise ValueError("parallm engine: the checkpoint's LR-schedule state is megatron-core's (saved "
                                     "with verl's Megatron schedule keys, e.g. optim.lr_decay_style); this engine "
                                     "runs verl's FSDP schedule: resume with the same optim keys, or leave 'extra' "
                                     "out of checkpoint.load_contents")
                self.lr_scheduler.load_state_dict(state)
            path = self._rng_path(local_path)
            rng = os.path.exists(path)
            if rng:
                with open(path) as f:
                    load_rng_state(json.load(f))
        if self.dims.rank == 0:
            print(f"parallm engine: loaded {os.path.join(local_path, 'parallm')} (step {info.get('step')}, "
                  f"{'with' if optimizer is not None else 'without'} optimizer"
                  + ("" if rng is None else ", random generators " + ("restored" if rng else
                     f"not restored (none saved for {self.dims.world} ranks)")) + ")", flush=True)
