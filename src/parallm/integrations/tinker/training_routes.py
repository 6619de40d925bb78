"""The training routes: ``create_model``, ``get_info``, ``forward_backward`` (and ``forward``), ``optim_step``,
``save_weights``, ``load_weights``, ``save_weights_for_sampler``. Each checks its request on rank 0 (a malformed
one fails alone, as a user error, before any rank sees it) and hands a work item to the dispatcher in the
client's ``seq_id`` order (:class:`.service.ServiceBase.job`).

LoRA: the server holds adapters of rank ``--lora-rank`` (alpha ``--lora-alpha``) on every attention and MLP
projection; a client asks for any rank up to it (:mod:`.ranks`) and chooses ``train_attn`` / ``train_mlp``.
``train_unembed`` (an adapter on the output head, the SDK's default): the model holds one on the vocab-parallel head
(``--lora-unembed train``, the default; a client with ``train_unembed=False`` keeps it zero); ``--lora-unembed
skip`` builds none (``train_unembed=True`` clients train the other adapters, and every session is told so);
``refuse`` refuses such clients.

Full fine-tuning: a LoRA rank of 0 (``create_lora_training_client(base_model, rank=0)``, SkyRL-tx's and Arctic's
convention) makes a client that trains every parameter with AdamW on a model of its own (:mod:`.full`). One per
server, and never beside LoRA clients: a second full client, a LoRA client while a full one lives, and a full
client while LoRA clients live are refused (a 400: the SDK retries a 409), naming the clients in the way.
"""

from __future__ import annotations

import os
import secrets
import time

import numpy as np

from . import protocol
from .clients import write_initial_adapter
from .losses import LossInputError, check_config, check_inputs
from .protocol import ApiError
from .service import ModelRecord, _types

__all__ = ["TrainingRoutes"]


class TrainingRoutes:
    # -- create ---------------------------------------------------------------------------------------------------
    def _check_lora(self, lora) -> dict:
        c = self.config
        if lora is None:
            raise ApiError(400, "create_model without a LoRA config: full fine-tuning is a client of LoRA rank 0 "
                                "(create_lora_training_client(base_model, rank=0))")
        if lora.rank == 0 and not isinstance(lora.rank, bool):
            return self._check_full(lora)
        if isinstance(lora.rank, bool) or not isinstance(lora.rank, int) or not 1 <= lora.rank <= c["lora_rank"]:
            raise ApiError(400, f"LoRA rank {lora.rank}: this server trains LoRA adapters of rank 1 to "
                                f"{c['lora_rank']} (parallm serve-tinker --lora-rank {c['lora_rank']}, the largest); "
                                f"create the client with a rank <= {c['lora_rank']} or start the server with a "
                                "larger --lora-rank")
        if lora.train_unembed and c["lora_unembed"] == "refuse":
            raise ApiError(400, "train_unembed=True: this server was started with --lora-unembed refuse; create "
                                "the client with train_unembed=False (or restart the server with --lora-unembed "
                                "train, the default)")
        head = bool(lora.train_unembed) and c["lora_unembed"] == "train"
        if not (lora.train_attn or lora.train_mlp or head):
            raise ApiError(400, "train_attn, train_mlp and train_unembed are all False (or the head's adapter is "
                                "off: --lora-unembed skip): nothing to train")
        seed = lora.seed if lora.seed is not None else secrets.randbits(62)
        return {"rank": lora.rank, "alpha": c["lora_alpha"], "seed": int(seed), "train_mlp": bool(lora.train_mlp),
                "train_attn": bool(lora.train_attn), "train_unembed": bool(lora.train_unembed)}

    def _check_full(self, lora) -> dict:
        off = [k for k in ("train_attn", "train_mlp", "train_unembed") if not getattr(lora, k)]
        if off:
            raise ApiError(400, f"LoRA rank 0 (full fine-tuning) trains every parameter of the model; {off} = False "
                                "would freeze some: not offered (use a LoRA client for that)")
        return {"rank": 0, "full": True, "alpha": None, "seed": None, "train_mlp": True, "train_attn": True,
                "train_unembed": True}

    def _check_exclusive(self, lora) -> None:
        """One full-fine-tuning client per server, alone: called under the lock."""
        full = sorted(m for m, r in self.models.items() if r.lora.get("full"))
        if full:
            kind = "a second full-fine-tuning client" if lora.get("full") else "a LoRA client"
            raise ApiError(400, f"{kind} is refused: the full-fine-tuning client {full[0]} lives on this server "
                                "(one per server; it changes the base model, so LoRA clients cannot share it): "
                                "unload it first (TrainingClient.unload_model / its session's end)")
        if lora.get("full") and self.models:
            names = sorted(self.models)
            shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
            raise ApiError(400, f"a full-fine-tuning client (rank 0) is refused: {len(names)} LoRA client(s) live "
                                f"on this server's base model ({shown}); "
                                "a full client changes every weight of the base they share: unload them first")

    def _check_base(self, base_model):
        if base_model is not None and base_model not in self.config["model_names"]:
            raise ApiError(400, f"this server serves {self.config['model_name']!r}, not {base_model!r}")

    def _check_optimizer(self, cfg):
        kind = getattr(cfg, "type", "adamw") if cfg is not None else "adamw"
        if kind == "dimuon":
            raise ApiError(400, "optimizer 'dimuon' is not offered by parallm's Tinker server: the tinker SDK 0.38 "
                                "names it (DimuonOptimizerConfig version 1, DimuonParams: learning_rate, beta1, "
                                "grad_clip_norm) but neither the SDK, Tinker's documentation nor tinker-cookbook "
                                "0.6.1 defines its update, so no implementation could be checked against it; use "
                                "AdamW (the default)")
        if kind != "adamw":
            raise ApiError(400, f"optimizer {kind!r} is not offered by parallm's Tinker server (AdamW only)")

    def _new_model(self, session_id, model_seq_id, lora, user_metadata) -> tuple[str, dict]:
        """Register a model and write its initial adapter; the model id and the ``create_client`` item."""
        model_id = f"{session_id}:train:{model_seq_id}"
        with self.lock:
            if model_id in self.models:
                raise ApiError(409, f"model {model_id} exists already")
            self._check_exclusive(lora)
            self.models[model_id] = ModelRecord(model_id=model_id, session_id=session_id, lora=lora,
                                                created=time.time(), user_metadata=user_metadata)
        self.records.save_run(model_id, {"session_id": session_id, "lora": lora, "created": time.time(),
                                         "base_model": self.config["model_name"], "user_metadata": user_metadata})
        if lora.get("full"):
            return model_id, {"op": "create_client", "args": {"model_id": model_id, "lora": lora,
                                                              "base_model": self.config["model_name"]}}
        init_dir = os.path.join(self.checkpoints.root, "_parallm_init", model_id.replace(":", "_"))
        write_initial_adapter(self.config["adapter_template"], init_dir, seed=lora["seed"],
                              train_mlp=lora["train_mlp"], train_attn=lora["train_attn"],
                              train_unembed=lora["train_unembed"] and self.config["lora_unembed"] == "train",
                              rank=lora["rank"],
                              big=self.config["lora_rank"], num_experts=self.config["num_experts"])
        return model_id, {"op": "create_client", "args": {"model_id": model_id, "lora": lora, "init_dir": init_dir,
                                                          "base_model": self.config["model_name"]}}

    def route_create_model(self, body):
        req = protocol.parse(_types().CreateModelRequest, body, route="create_model")
        self.session(req.session_id)
        self._check_base(req.base_model)
        self._check_optimizer(req.optimizer_config)
        lora = self._check_lora(req.lora_config)
        model_id, item = self._new_model(req.session_id, req.model_seq_id, lora, req.user_metadata)
        out = self.job("create_model", item, lambda v: ("json", {"model_id": model_id, "type": "create_model"}),
                       on_error=lambda: self.forget_model(model_id))
        return dict(out, model_id=model_id)

    def route_get_info(self, body):
        req = protocol.parse(_types().GetInfoRequest, body, route="get_info")
        rec = self.model(req.model_id)
        c = self.config
        full = bool(rec.lora.get("full"))
        return {"type": "get_info", "model_id": rec.model_id, "is_lora": not full,
                "lora_rank": None if full else rec.lora["rank"],
                "model_name": c["model_name"], "optimizer_config": {"type": "adamw"},
                "model_data": {"arch": c["arch"], "model_name": c["model_name"], "tokenizer_id": c["tokenizer_id"]}}

    # -- forward / forward_backward -------------------------------------------------------------------------------
    def _check_data(self, req) -> str | None:
        """The request's loss, config and data against the model; the message of the first problem, or None."""
        c = self.config
        try:
            if not req.data:
                raise LossInputError("forward_backward: no data")
            config = check_config(req.loss_fn, req.loss_fn_config)
            widths = set()
            for i, d in enumerate(req.data):
                n = len(d.tokens)
                if n == 0:
                    raise LossInputError(f"datum {i}: empty model input")
                if n + 1 > c["max_context"]:
                    raise LossInputError(f"datum {i}: {n} tokens; the model's context is {c['max_context']}")
                if d.tokens.min() < 0 or d.tokens.max() >= c["vocab"]:
                    bad = int(d.tokens.min()) if d.tokens.min() < 0 else int(d.tokens.max())
                    raise LossInputError(f"datum {i}: input token {bad} is outside the vocabulary [0, {c['vocab']})")
                check_inputs(req.loss_fn, config, d.inputs, length=n, vocab=c["vocab"], index=i)
                widths.add(np.asarray(d.inputs["target_tokens"]).shape[1:])
            if len(widths) > 1:
                raise LossInputError("2-D target_tokens must have the same width K in every datum of a request")
        except LossInputError as e:
            return str(e)
        req.loss_fn_config = config
        return None

    def route_forward_backward(self, raw: bytes, encoding: str | None):
        req = protocol.decode_forward_backward(raw, encoding=encoding, max_body=self.config["max_body"])
        try:
            rec = self.model(req.model_id)
            self.stability.check(rec.session_id, req.data)      # provenance spans (stability.py); renews them
        except ApiError as e:
            e.ids = (req.model_id, req.seq_id)
            raise
        error = self._check_data(req)
        item = {"op": "forward", "args": {"model_id": req.model_id, "loss_fn": req.loss_fn,
                                          "config": req.loss_fn_config, "data": req.data,
                                          "backward": not req.forward_only}}
        kind = "forward" if req.forward_only else "forward_backward"
        return self.job(kind, item, lambda v: ("proto", protocol.encode_forward_backward_output(v["outputs"],
                                                                                              v["metrics"])),
                        model_id=req.model_id, seq_id=req.seq_id, error=error)

    # -- optim_step -----------------------------------------------------------------------------------------------
    def route_optim_step(self, body):
        req = protocol.parse(_types().OptimStepRequest, body, route="optim_step")
        self.model(req.model_id)
        p = req.optim_params
        error = None
        if not isinstance(p, _types().AdamParams):
            error = f"optim_step: {type(p).__name__} is not offered by parallm's Tinker server (AdamParams only)"
            adam = {}
        else:
            adam = {k: float(getattr(p, k)) for k in ("learning_rate", "beta1", "beta2", "eps", "weight_decay",
                                                       "grad_clip_norm")}
            bad = [k for k, v in adam.items() if not np.isfinite(v) or v < 0] + \
                [k for k in ("beta1", "beta2") if adam[k] >= 1]
            if bad:
                error = f"optim_step: AdamParams {bad} out of range: {adam}"
        item = {"op": "optim_step", "args": {"model_id": req.model_id, "adam": adam}}
        return self.job("optim_step", item, lambda v: _json({"metrics": v["metrics"]}), model_id=req.model_id,
                        seq_id=req.seq_id, error=error)

    # -- checkpoints ----------------------------------------------------------------------------------------------
    def _meta(self, rec, **more) -> dict:
        return {"base_model": self.config["model_name"], "model_id": rec.model_id, "lora": rec.lora,
                "held_rank": self.config["lora_rank"], "head_adapter": self.config["lora_unembed"] == "train",
                **more}

    def route_save_weights(self, body):
        req = protocol.parse(_types().SaveWeightsRequest, body, route="save_weights")
        rec = self.model(req.model_id)
        name = req.path or f"step-{int(time.time() * 1000)}"
        directory = self.checkpoints.path(rec.model_id, "weights", name)
        error = _ttl_error(req.ttl_seconds)
        if os.path.exists(directory) and not req.overwrite:
            error = f"checkpoint {self.checkpoints.tinker_path(rec.model_id, 'weights', name)} exists (overwrite=True)"
        meta = self._meta(rec, user_metadata=req.user_metadata)
        item = {"op": "save_state", "args": {"model_id": rec.model_id, "path": directory, "overwrite": req.overwrite,
                                             "extra": {"tinker": meta}}}

        def result(v):
            self.checkpoints.write_meta(directory, meta, ttl_seconds=_ttl(req.ttl_seconds))
            return _json({"path": self.checkpoints.tinker_path(rec.model_id, "weights", name),
                          "type": "save_weights"})
        return self.job("save_weights", item, result, model_id=rec.model_id, seq_id=req.seq_id, error=error)

    def route_load_weights(self, body):
        req = protocol.parse(_types().LoadWeightsRequest, body, route="load_weights")
        if req.weights_access_token is not None:
            raise ApiError(400, "load_weights: weights_access_token is not offered by parallm's Tinker server (it "
                                "loads checkpoints under its own --checkpoint-dir only)")
        _, _, _, directory = self.checkpoints.resolve(req.path, want="weights")
        meta = self.checkpoints.meta(directory)
        if meta["base_model"] not in self.config["model_names"]:
            raise ApiError(400, f"{req.path} was trained on {meta['base_model']!r}; this server serves "
                                f"{self.config['model_name']!r}")
        self._check_base(req.base_model)
        self._check_optimizer(req.optimizer_config)
        if meta["lora"].get("full"):
            return self._load_full(req, directory, meta)
        held = meta.get("held_rank", meta["lora"]["rank"])
        if held != self.config["lora_rank"]:
            raise ApiError(400, f"{req.path} was saved by a server whose adapters hold rank {held} (--lora-rank); "
                                f"this server's hold rank {self.config['lora_rank']}: a training checkpoint loads "
                                f"on a server with --lora-rank {held} (its sampler weights, a PEFT directory of "
                                f"rank {meta['lora']['rank']}, load anywhere)")
        head = self.config["lora_unembed"] == "train"
        if meta.get("head_adapter", False) != head:
            raise ApiError(400, f"{req.path} was saved by a server {'with' if meta.get('head_adapter') else 'without'}"
                                f" an adapter on the output head; this one runs --lora-unembed "
                                f"{self.config['lora_unembed']}: a training checkpoint loads on a server with "
                                f"--lora-unembed {'train' if meta.get('head_adapter') else 'skip'} (its sampler "
                                "weights, plain PEFT, load anywhere)")
        load = {"op": "load_state", "args": {"path": directory, "optimizer": bool(req.optimizer)}}
        to_result = lambda model_id: lambda v: _json({"path": req.path, "model_id": model_id,  # noqa: E731
                                                     "type": "load_weights"})
        if req.model_id is not None:          # an existing client loads a checkpoint
            rec = self.model(req.model_id)
            if rec.lora.get("full"):
                raise ApiError(400, f"{req.path} holds LoRA adapters (rank {meta['lora']['rank']}); {rec.model_id} "
                                    "is a full-fine-tuning client: it loads full training checkpoints only")
            if rec.lora["rank"] != meta["lora"]["rank"]:
                raise ApiError(400, f"{req.path} holds rank-{meta['lora']['rank']} adapters; {rec.model_id} has "
                                    f"rank {rec.lora['rank']}")
            load["args"]["model_id"] = rec.model_id
            return self.job("load_weights", load, to_result(rec.model_id), model_id=rec.model_id, seq_id=req.seq_id)
        if req.session_id is None or req.model_seq_id is None:
            raise ApiError(400, "load_weights: give model_id and seq_id, or session_id and model_seq_id")
        self.session(req.session_id)
        lora = dict(meta["lora"], seed=0)
        model_id, create = self._new_model(req.session_id, req.model_seq_id, lora, req.user_metadata)
        self.job("create_model", create, lambda v: None, on_error=lambda: self.forget_model(model_id))
        load["args"]["model_id"] = model_id
        return self.job("load_weights", load, to_result(model_id))

    def _load_full(self, req, directory, meta):
        """A full-fine-tuning training checkpoint into its client, or into a new one (the SDK's
        ``create_training_client_from_state``)."""
        load = {"op": "load_state", "args": {"path": directory, "optimizer": bool(req.optimizer)}}
        to_result = lambda model_id: lambda v: _json({"path": req.path, "model_id": model_id,  # noqa: E731
                                                     "type": "load_weights"})
        if req.model_id is not None:
            rec = self.model(req.model_id)
            if not rec.lora.get("full"):
                raise ApiError(400, f"{req.path} is a full-fine-tuning checkpoint (every weight); {rec.model_id} is a "
                                    f"LoRA client (rank {rec.lora['rank']}): load it into a client of rank 0")
            load["args"]["model_id"] = rec.model_id
            return self.job("load_weights", load, to_result(rec.model_id), model_id=rec.model_id, seq_id=req.seq_id)
        if req.session_id is None or req.model_seq_id is None:
            raise ApiError(400, "load_weights: give model_id and seq_id, or session_id and model_seq_id")
        self.session(req.session_id)
        model_id, create = self._new_model(req.session_id, req.model_seq_id, dict(meta["lora"]), req.user_metadata)
        self.job("create_model", create, lambda v: None, on_error=lambda: self.forget_model(model_id))
        load["args"]["model_id"] = model_id
        return self.job("load_weights", load, to_result(model_id))

    def route_save_for_sampler(self, body):
        req = protocol.parse(_types().SaveWeightsForSamplerRequest, body, route="save_weights_for_sampler")
        rec = self.model(req.model_id)
        error = None
        if req.kind != "snapshot":
            error = f"save_weights_for_sampler: kind={req.kind!r} is not offered (snapshot only)"
        if req.path is None and rec.lora.get("full") and getattr(self.sampler, "full_engine", None) is not None:
            return self.push_full(rec, req, error=error)           # sampling_routes.py: pushed, not written
        if req.path is None and self.config.get("memory_root") and not rec.lora.get("full"):
            return self.save_to_memory(rec, req, error=error)       # sampling_routes.py: no directory on disk
        name = req.path or f"sampler-{secrets.token_hex(6)}"
        version = self.checkpoints.new_version(rec.model_id, name)     # immutable: a new directory per save
        tinker_path = self.checkpoints.tinker_path(rec.model_id, "sampler_weights", name)
        meta = self._meta(rec, user_metadata=req.user_metadata, ephemeral=req.path is None)
        item = {"op": "save_sampler", "args": {"model_id": rec.model_id, "path": version}}

        def result(v):
            self.checkpoints.write_meta(version, meta, ttl_seconds=_ttl(req.ttl_seconds))
            self.release_snapshot(self.checkpoints.publish(rec.model_id, name, version))
            self.retain_snapshots(rec.model_id)
            if req.path is not None:
                return _json({"path": tinker_path, "type": "save_weights_for_sampler"})
            sid = self.new_sampling_session(rec.session_id, req.sampling_session_seq_id, tinker_path, version)
            return _json({"path": None, "sampling_session_id": sid, "type": "save_weights_for_sampler"})
        return self.job("save_weights_for_sampler", item, result, model_id=rec.model_id, seq_id=req.seq_id,
                        error=error or _ttl_error(req.ttl_seconds))


def _ttl(ttl_seconds) -> int | None:
    return None if ttl_seconds is None else int(ttl_seconds)


def _ttl_error(ttl_seconds) -> str | None:
    if ttl_seconds is not None and ttl_seconds < 1:
        return f"ttl_seconds must be at least 1 (None: never expires), got {ttl_seconds}"
    return None


def _json(d: dict) -> tuple:
    return ("json", d)
