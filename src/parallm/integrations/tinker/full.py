"""Full-fine-tuning clients: a LoRA rank of 0 (``create_lora_training_client(base_model, rank=0)``, the convention
of SkyRL-tx and Arctic) trains every parameter of the base with AdamW.

Such a client gets a model of its own, built and loaded from the server's checkpoint directory when the client is
created (the same layout as the served model: tp / pp / cp / ep), and an optimizer over all of its parameters
(:func:`parallm.build_optimizer`: ``torch.optim.AdamW``'s step, fp32 master weights and moments for bf16 / fp16
parameters, weight decay on every parameter as ``torch.optim.AdamW(model.parameters())`` applies it). The LoRA
model the server holds (its frozen base and adapters) is never changed by it, so base-model sampling and earlier
LoRA snapshots still sample what they did; ``unload_model`` (or the session's end) frees the client's model and
optimizer. Memory while one lives: a second copy of the weights, their gradients and AdamW's two moments (plus
fp32 masters for a bf16 model): about 4x the fp32 weights on top of the served model.

Sampler snapshots (``save_weights_for_sampler``) are Hugging Face checkpoints (``parallm.save_hf_weights``: the
full trained weights, the tokenizer files beside them). The parallm sampler samples them from the client's own
model while the client still holds the weights the snapshot was taken of (a version counter, bumped by every
change of the weights, says so); otherwise from a sampling model (:class:`SnapshotModel`) loaded from the
snapshot's files, built on first use and freed with the client.
"""

from __future__ import annotations

import gc
import os

import torch

import parallm

from .clients import ClientState, clone_state_dict, grads_restore, grads_snapshot

__all__ = ["FullClient", "SnapshotModel", "is_full_snapshot"]


def is_full_snapshot(directory: str | None) -> bool:
    """A sampler snapshot of a full-fine-tuning client: a Hugging Face checkpoint, not a PEFT adapter."""
    return directory is not None and os.path.isfile(os.path.join(directory, "config.json")) and \
        not os.path.isfile(os.path.join(directory, "adapter_config.json"))


def _every_param_decays(name, param) -> bool:
    return False


def _build(model_dir: str, dtype, source: str) -> list:
    chunks = parallm.build_model(model_dir, dtype=dtype)
    parallm.load_hf_weights(chunks, source)
    return chunks


class FullClient:
    """This rank's share of a full-fine-tuning client: its model, optimizer and accumulated gradients."""

    def __init__(self, state: ClientState, *, model_dir: str, dtype):
        self.state, self.model_dir = state, model_dir
        self.chunks = _build(model_dir, dtype, model_dir)
        self.params = [p for c in self.chunks for p in c.parameters() if p.requires_grad]
        self.optimizer = self._new_optimizer()
        self.version = 0            # bumped whenever the weights change (a step, a load)

    @property
    def model_id(self) -> str:
        return self.state.model_id

    def _new_optimizer(self):
        return parallm.build_optimizer(self.chunks, lr=1e-4, betas=(0.9, 0.95), eps=1e-12,
                                       no_decay=_every_param_decays)

    def grads_guard(self):
        """What :meth:`restore_grads` needs to undo a failed ``forward_backward``: nothing when no gradient has
        accumulated since the last step (undo = zero them), else a copy of every gradient."""
        return None if self.state.accumulated == 0 else grads_snapshot(self.params)

    def restore_grads(self, guard) -> None:
        if guard is None:
            self.optimizer.zero_grad(set_to_none=True)
        else:
            grads_restore(self.params, guard)

    def step(self, adam: dict) -> dict:
        for group in self.optimizer.param_groups:
            group["lr"] = adam["learning_rate"]
            group["betas"] = (adam["beta1"], adam["beta2"])
            group["eps"] = adam["eps"]
            group["weight_decay"] = adam["weight_decay"]
        parallm.finalize_grads(self.chunks)
        clip = adam["grad_clip_norm"]
        norm = parallm.clip_grad_norm_(self.chunks, clip if clip > 0 else float("inf"))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.version += 1
        return {"grad_norm:mean": float(norm)}

    def save_state(self, path: str, *, extra: dict, overwrite: bool) -> None:
        parallm.save_checkpoint(path, self.chunks, self.optimizer, step=self.state.steps, extra=extra,
                                overwrite=overwrite)

    def load_state(self, path: str, *, optimizer: bool) -> int:
        """Weights (and AdamW state when ``optimizer``) from a full training checkpoint; the step count. A
        failed load leaves the client as it was (its weights and AdamW state are copied first)."""
        before = ([p.detach().clone() for p in self.params], clone_state_dict(self.optimizer.state_dict()),
                  grads_snapshot(self.params))
        try:
            info = parallm.load_checkpoint(path, self.chunks, self.optimizer if optimizer else None)
        except BaseException:
            with torch.no_grad():
                for p, v in zip(self.params, before[0]):
                    p.copy_(v)
            self.optimizer.load_state_dict(before[1])
            grads_restore(self.params, before[2])
            raise
        del before
        if not optimizer:
            self.optimizer = self._new_optimizer()          # fresh moments, step 0
        self.optimizer.zero_grad(set_to_none=True)
        self.version += 1
        return int(info.get("step") or 0) if optimizer else 0

    def save_sampler(self, path: str) -> None:
        parallm.save_hf_weights(self.chunks, path, overwrite=True, source=self.model_dir)

    def close(self) -> None:
        self.chunks = self.optimizer = self.params = None
        gc.collect()


class SnapshotModel:
    """Which model the parallm sampler runs for a full snapshot: the client's own (when it still holds the
    snapshot's weights) or a sampling model loaded from the snapshot's files (one at a time, kept until another
    snapshot or the client's end)."""

    def __init__(self, *, model_dir: str, dtype):
        self.model_dir, self.dtype = model_dir, dtype
        self.saved: dict[str, tuple[str, int]] = {}     # snapshot directory -> (model id, version) it holds
        self.chunks, self.directory = None, None

    def note(self, directory: str, client: FullClient) -> None:
        self.saved[os.path.realpath(directory)] = (client.model_id, client.version)

    def chunks_for(self, directory: str, client: FullClient | None) -> list:
        real = os.path.realpath(directory)
        if client is not None and self.saved.get(real) == (client.model_id, client.version):
            return client.chunks
        if self.directory != real:
            self.directory = None
            if self.chunks is None:
                self.chunks = _build(self.model_dir, self.dtype, real)
            else:
                parallm.load_hf_weights(self.chunks, real)
            self.directory = real
        return self.chunks

    def close(self) -> None:
        self.chunks, self.directory = None, None
        self.saved.clear()
        gc.collect()
