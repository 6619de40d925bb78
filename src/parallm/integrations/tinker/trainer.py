"""What every rank does for each work item (:mod:`.dispatch` delivers the items): create / drop a client,
forward and forward_backward with Tinker's losses, the AdamW step, training and sampler checkpoints, and the
parallm sampler's forwards (:mod:`.sampling`).

Each op switches the model to its client first (:class:`.clients.ClientTable`); a full-fine-tuning client (LoRA
rank 0) runs on a model of its own instead (:mod:`.full`). Rollback: a ``forward_backward``
that fails restores the client's gradients as they were before it (every rank, so an input that only parallm's
checks catch leaves the client as it was); a failed checkpoint load restores the client's adapters and
optimizer state. Values come back on rank 0 only (``None`` elsewhere).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile

import torch
import torch.distributed as dist

import parallm
from parallm.model.layers.lora import lora_config_of, set_adapter_rank

from .batch import make_loss_fn, outputs_of, pack
from .clients import SAMPLER_PREFIX, ClientState, ClientTable, clone_state_dict, grads_restore, grads_snapshot
from .cobatch import run_group
from .full import FullClient, SnapshotModel, is_full_snapshot
from .ranks import pad_peft_dir, shrink_peft_dir

__all__ = ["Trainer"]


class Trainer:
    """This rank's model, optimizer and clients. ``execute(item)`` runs one work item."""

    def __init__(self, chunks, optimizer, *, group, max_rows: int | None = None, model_dir: str | None = None,
                 dtype=torch.float32):
        self.chunks, self.optimizer, self.group = chunks, optimizer, group
        self.model_dir, self.dtype = model_dir, dtype
        self.full: FullClient | None = None        # the full-fine-tuning client (at most one: training_routes)
        self.full_snapshots = SnapshotModel(model_dir=model_dir, dtype=dtype)
        self.dims = chunks[0].dims
        spec = chunks[0].spec
        self.num_experts = spec.moe.num_experts if spec.moe is not None else 1
        self.big_rank = lora_config_of(chunks).r     # the adapters' rank (--lora-rank)
        self.table = ClientTable(chunks, optimizer)
        self.max_rows = max_rows
        self.sampler_dir: str | None = None        # the adapter directory now in the model for a sampler op
        self.scaled_rank: int | None = None        # the rank whose scaling the adapters run with (None: as built)

    def execute(self, item: dict):
        return getattr(self, "op_" + item["op"])(**item.get("args", {}))

    # -- clients ---------------------------------------------------------------------------------------------
    def op_create_client(self, *, model_id, lora, base_model, init_dir=None):
        if lora.get("full"):
            if self.full is not None:
                raise ValueError(f"a full-fine-tuning client ({self.full.model_id}) exists already (internal error: "
                                 "the server refuses a second one)")
            if self.model_dir is None:
                raise ValueError("this trainer was built without the model directory: no full fine-tuning")
            self.full = FullClient(ClientState(model_id=model_id, lora=dict(lora), base_model=base_model),
                                   model_dir=self.model_dir, dtype=self.dtype)
            return {"model_id": model_id}
        self.table.deactivate()
        parallm.load_hf_adapter(self.chunks, init_dir)
        self._set_rank(lora["rank"])
        self.table.reset_optimizer()
        self.table.zero_grads()
        self.table.add(ClientState(model_id=model_id, lora=dict(lora), base_model=base_model))
        self.table.active, self.sampler_dir = model_id, None
        return {"model_id": model_id}

    def op_drop_client(self, *, model_id):
        if self.full is not None and self.full.model_id == model_id:
            self.full.close()
            self.full = None
            self.full_snapshots.close()
        self.table.drop(model_id)
        return {"model_id": model_id}

    def _full(self, model_id) -> FullClient | None:
        return self.full if self.full is not None and self.full.model_id == model_id else None

    def _activate(self, model_id):
        self.sampler_dir = None
        st = self.table.activate(model_id)
        self._set_rank(st.lora["rank"])       # its scaling, alpha / r (ranks.py)
        return st

    def _set_rank(self, rank: int) -> None:
        """The adapters' scaling for a rank-``rank`` client; nothing to do when they run at that rank already
        (the common case: one client's requests in a row, or clients of one rank). Only this class sets it."""
        if rank != self.scaled_rank:
            set_adapter_rank(self.chunks, rank)
            self.scaled_rank = rank

    # -- forward / forward_backward -----------------------------------------------------------------------------
    def op_forward(self, *, model_id, loss_fn, config, data, backward):
        full = self._full(model_id)
        if full is None:
            self._activate(model_id)
            chunks, state = self.chunks, self.table.clients[model_id]
            guard, undo = grads_snapshot(self.table.params) if backward else None, \
                lambda g: grads_restore(self.table.params, g)
        else:
            chunks, state = full.chunks, full.state
            guard, undo = full.grads_guard() if backward else None, full.restore_grads
        d = self.dims
        packed = pack(data, dp=d.dp, dp_rank=d.dp_rank, pp=d.pp, max_rows=self.max_rows)
        output = "logprobs" if packed.next_token else None
        captured: list = []
        if backward:
            try:
                parallm.forward_backward(chunks, packed.batch, output=output, num_microbatches=packed.microbatches,
                                         loss_fn=make_loss_fn(packed, loss_fn=loss_fn, config=config, dp=d.dp,
                                                              captured=captured))
            except BaseException:
                undo(guard)
                raise
            state.accumulated += 1
        else:
            with torch.no_grad():
                out = parallm.forward(chunks, packed.batch, output=output,
                                      num_microbatches=packed.microbatches if d.pp > 1 else None)
            outputs_of(out, packed, loss_fn=loss_fn, config=config, captured=captured)
        return self.rows_result(data, captured)

    def op_forward_many(self, *, items):
        """Consecutive ``forward_backward`` requests of different clients in one pass where they can be
        (:mod:`.cobatch`): a list of outcomes, one per item."""
        return run_group(self, items)

    def rows_result(self, data, captured):
        """A request's result on rank 0 (None elsewhere) from the rows its ``loss_fn`` captured."""
        rows = self._gather_rows(captured)
        if rows is None:
            return None
        missing = [i for i in range(len(data)) if i not in rows]
        if missing:
            raise RuntimeError(f"forward: no output for datums {missing[:5]} (internal error)")
        outputs = [{"logprobs": rows[i][0].numpy()} for i in range(len(data))]
        return {"outputs": outputs, "metrics": {"loss:sum": float(sum(rows[i][1] for i in range(len(data))))}}

    def _gather_rows(self, captured):
        """Every replica's captured rows on rank 0 (from one rank per replica: tp rank 0 of the last stage). With
        one replica and one stage that rank is rank 0 itself: no collective (every rank knows it from the
        layout)."""
        d = self.dims
        if d.dp == 1 and d.pp == 1:
            return {i: (tl, loss) for i, tl, loss in captured} if d.rank == 0 else None
        mine = captured if (d.tp_rank == 0 and d.pp_rank == d.pp - 1 and d.cp_rank == 0) else []
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine, group=self.group)
        if d.rank != 0:
            return None
        rows = {}
        for part in everyone:
            for i, tl, loss in part:
                rows.setdefault(i, (tl, loss))
        return rows

    # -- the optimizer -------------------------------------------------------------------------------------------
    def op_optim_step(self, *, model_id, adam):
        full = self._full(model_id)
        st = self._activate(model_id) if full is None else full.state
        if st.accumulated == 0:
            raise ValueError(f"optim_step: {model_id} has no gradients accumulated since its last optim_step (or "
                             "load): run forward_backward first; nothing was changed")
        if full is not None:
            metrics = full.step(adam)
            st.steps += 1
            st.accumulated = 0
            return {"metrics": metrics}
        for group in self.optimizer.param_groups:
            group["lr"] = adam["learning_rate"]
            group["betas"] = (adam["beta1"], adam["beta2"])
            group["eps"] = adam["eps"]
            if group.get("name") != "no_decay":
                group["weight_decay"] = adam["weight_decay"]
        parallm.finalize_grads(self.chunks)
        clip = adam["grad_clip_norm"]
        norm = parallm.clip_grad_norm_(self.chunks, clip if clip > 0 else float("inf"))
        self.optimizer.step()
        self.table.zero_grads()
        st.steps += 1
        st.accumulated = 0
        return {"metrics": {"grad_norm:mean": float(norm)}}

    # -- checkpoints ---------------------------------------------------------------------------------------------
    def op_save_state(self, *, model_id, path, extra, overwrite):
        full = self._full(model_id)
        if full is not None:
            full.save_state(path, extra=extra, overwrite=overwrite)
            return {"path": path}
        st = self._activate(model_id)
        parallm.save_checkpoint(path, self.chunks, self.optimizer, step=st.steps, extra=extra, overwrite=overwrite)
        return {"path": path}

    def op_load_state(self, *, model_id, path, optimizer):
        full = self._full(model_id)
        if full is not None:
            full.state.steps = full.load_state(path, optimizer=optimizer)
            full.state.accumulated = 0
            return {"step": full.state.steps}
        st = self._activate(model_id)
        before = ([p.detach().clone() for p in self.table.params], clone_state_dict(self.optimizer.state_dict()),
                  grads_snapshot(self.table.params))
        try:
            info = parallm.load_checkpoint(path, self.chunks, self.optimizer if optimizer else None)
        except BaseException:
            self._restore(before)
            raise
        if not optimizer:
            self.table.reset_optimizer()
        self.table.zero_grads()
        st.accumulated = 0
        st.steps = int(info.get("step") or 0) if optimizer else 0
        return {"step": st.steps}

    @torch.no_grad()
    def _restore(self, before):
        """The client's adapters, AdamW state and gradients as they were before a failed load."""
        params, optim, grads = before
        for p, v in zip(self.table.params, params):
            p.copy_(v)
        self.optimizer.load_state_dict(optim)
        grads_restore(self.table.params, grads)

    def op_save_sampler(self, *, model_id, path):
        """A PEFT directory of the client's adapter at its own rank (the model's written, then cut by rank 0); a
        full-fine-tuning client's: a Hugging Face checkpoint of its weights."""
        full = self._full(model_id)
        if full is not None:
            full.save_sampler(path)
            self.full_snapshots.note(path, full)
            return {"path": path}
        st = self._activate(model_id)
        parallm.save_hf_adapter(self.chunks, path, overwrite=True)
        if self.dims.rank == 0:
            shrink_peft_dir(path, path, rank=st.lora["rank"], big=self.big_rank, num_experts=self.num_experts)
        return {"path": path}

    def op_push_full(self, *, model_id, url):
        """Push the full-fine-tuning client's weights into the ``--full-engine`` engine at ``url`` (collective:
        ``connect`` once, then ``push_weights`` over ``parallm_shm``); its statistics on rank 0."""
        full = self._full(model_id)
        if full is None:
            raise ValueError(f"{model_id} is not the full-fine-tuning client")
        from ..vllm import connect, push_weights
        if getattr(self, "_full_conn", None) is None:
            self._full_conn = connect([url], backend="parallm_shm")
        stats = push_weights(full.chunks, self._full_conn)
        return {"bytes": stats["bytes"], "seconds": stats["seconds"]} if self.dims.rank == 0 else None

    # -- the parallm sampler (no vLLM): forwards of a sampler snapshot or the base model ------------------------
    def use_sampler(self, adapter_dir: str | None):
        """Put a sampler snapshot's adapter into the model (the active client's values are copied out first);
        ``None``: the base model (the caller runs inside ``parallm.adapters_disabled``)."""
        if adapter_dir is None or self.sampler_dir == adapter_dir:
            return
        self.table.deactivate()
        tmp = tempfile.mkdtemp(prefix="parallm-tinker-pad-")       # this rank's rank-R copy of the snapshot
        try:
            padded = os.path.join(tmp, "adapter")
            rank = pad_peft_dir(adapter_dir, padded, big=self.big_rank, num_experts=self.num_experts)
            parallm.load_hf_adapter(self.chunks, padded)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        self._set_rank(rank)
        self.table.active, self.sampler_dir = SAMPLER_PREFIX + adapter_dir, adapter_dir

    def _sampler_model(self, adapter_dir):
        """``(chunks, context)`` the parallm sampler runs a forward of ``adapter_dir`` with: a full snapshot's
        model (:mod:`.full`), or the served model with the snapshot's adapter (or none: the base)."""
        if is_full_snapshot(adapter_dir):
            return self.full_snapshots.chunks_for(adapter_dir, self.full), contextlib.nullcontext()
        self.use_sampler(adapter_dir)
        return self.chunks, (parallm.adapters_disabled(self.chunks) if adapter_dir is None else
                             contextlib.nullcontext())

    def op_sampler_forward(self, *, adapter_dir, input_ids, attention_mask, output):
        """Log-probs (``output="logprobs"``) or last-position logits (``None``) of a batch, on every rank."""
        chunks, context = self._sampler_model(adapter_dir)
        batch = {"input_ids": torch.as_tensor(input_ids), "attention_mask": torch.as_tensor(attention_mask)}
        if isinstance(output, str) and output.startswith("topk:"):
            return self._topk_forward(chunks, context, batch, int(output[5:]))
        with torch.no_grad(), context:
            out = parallm.forward(chunks, batch, output=output)
        if output is None:
            lengths = batch["attention_mask"].sum(-1) - 1
            out = out[torch.arange(out.shape[0]), lengths]
        return out.float().cpu() if self.dims.rank == 0 else None

    def _topk_forward(self, chunks, context, batch, k: int):
        """Every position's top-k ``(log-probs, ids)`` of the unscaled distribution (full logits, rank 0)."""
        with torch.no_grad(), context:
            logits = parallm.forward(chunks, batch)
        if self.dims.rank != 0:
            return None
        values, index = torch.log_softmax(logits.double(), -1).topk(k, dim=-1)
        return values.float().cpu(), index.cpu()

    def op_noop(self):
        return None

    def op_exists(self, *, path):
        return os.path.exists(path)
