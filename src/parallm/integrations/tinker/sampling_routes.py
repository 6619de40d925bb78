"""The sampling routes: ``create_sampling_session`` (a base model, or a sampler snapshot's ``tinker://`` path),
``asample`` (which ``sample`` and ``compute_logprobs`` both use), ``samplers/<id>``. Samples run on a thread
pool of rank 0, beside the training work, through the configured sampler (:mod:`.sampling`).

Not offered (a 400 naming the parameter): top-k log-probs, ``target_prompt_logprobs``, ``prompt_alt_tokens_k``,
``prompt_logprobs_last_n``, image / audio chunks. ``record_stability_info``: the samples' ids and tokens recorded
(:mod:`.stability`).
"""

from __future__ import annotations

import concurrent.futures
import logging
import math
import os
import secrets
import shutil
import urllib.parse

from . import protocol
from .protocol import ApiError
from .sampling import TOPK_MAX, SampleInputError, SampleJob, SamplerDead
from .full import is_full_snapshot
from .router import FULL_PUSH
from .service import _types

__all__ = ["SamplingRoutes"]

log = logging.getLogger("parallm.tinker")


class SamplingRoutes:
    def _pool(self):
        if getattr(self, "_sample_pool", None) is None:
            self._sample_pool = concurrent.futures.ThreadPoolExecutor(max_workers=32,
                                                                      thread_name_prefix="tinker-sample")
        return self._sample_pool

    def new_sampling_session(self, session_id: str, seq_id, model_path: str | None, adapter_dir: str | None) -> str:
        with self.lock:
            sid = f"{session_id}:sample:{seq_id if seq_id is not None else len(self.samplers)}"
            if sid in self.samplers:
                sid = f"{sid}.{len(self.samplers)}"
            self.samplers[sid] = {"base_model": self.config["model_name"], "model_path": model_path,
                                  "adapter_dir": adapter_dir, "session_id": session_id}
        return sid

    # -- ephemeral snapshots: in memory, never in the checkpoint directory ---------------------------------------
    def save_to_memory(self, rec, req, *, error=None) -> dict:
        """The SDK's ephemeral save (``save_weights_and_get_sampling_client``: no name) of a LoRA client: the
        trainer gathers the adapter (``export_adapter_tensors``, the gather of ``push_adapter``) and rank 0 writes
        it as a PEFT directory under the server's memory root (a tmpfs: ``/dev/shm``), nothing under
        ``--checkpoint-dir``; the engines load it from there (:meth:`.router.EngineRouter.preload`). No
        ``tinker://`` path names it: the sampling session is its only handle. The newest
        ``--keep-sampler-snapshots`` of a client are kept; older ones are unloaded from every engine and freed."""
        version = os.path.join(self.config["memory_root"],
                               f"{urllib.parse.quote(rec.model_id, safe='')}-{secrets.token_hex(8)}")
        item = {"op": "save_sampler", "args": {"model_id": rec.model_id, "path": version}}

        def result(v):
            self.keep_in_memory(rec.model_id, version)
            sid = self.new_sampling_session(rec.session_id, req.sampling_session_seq_id, None, version)
            return ("json", {"path": None, "sampling_session_id": sid, "type": "save_weights_for_sampler"})
        return self.job("save_weights_for_sampler", item, result, model_id=rec.model_id, seq_id=req.seq_id,
                        error=error, on_error=lambda: self.drop_from_memory(version))

    def push_full(self, rec, req, *, error=None) -> dict:
        """The ephemeral save of a full-fine-tuning client with ``--full-engine``: its weights pushed into that
        engine (``push_weights`` over a ``parallm_shm`` connection, collective over the trainer ranks), nothing
        written; the sampling session names the push (:data:`.router.FULL_PUSH`), which stays sampleable until
        the next push."""
        engine = self.sampler.full_engine
        state = engine.wait()
        if state != "ready" and error is None:
            error = f"save_weights_for_sampler: the full-fine-tuning engine is not usable ({state})"
        with self.lock:
            self._full_pushes = getattr(self, "_full_pushes", 0) + 1
            handle = f"{FULL_PUSH}{rec.model_id}:{self._full_pushes}"
        self.sampler.full_current = None          # sessions of the snapshot it held are refused from now on
        item = {"op": "push_full", "args": {"model_id": rec.model_id, "url": engine.url}}

        def result(v):
            self.sampler.full_current = handle
            sid = self.new_sampling_session(rec.session_id, req.sampling_session_seq_id, None, handle)
            return ("json", {"path": None, "sampling_session_id": sid, "type": "save_weights_for_sampler"})
        return self.job("save_weights_for_sampler", item, result, model_id=rec.model_id, seq_id=req.seq_id,
                        error=error)

    def keep_in_memory(self, model_id: str, directory: str) -> None:
        with self.lock:
            mine = self.__dict__.setdefault("memory_snapshots", {}).setdefault(model_id, [])
            mine.append(directory)
            keep = self.config.get("keep_sampler_snapshots", 0)
            retired = mine[:-keep] if keep and len(mine) > keep else []
            del mine[:len(retired)]
        if hasattr(self.sampler, "preload"):
            self.sampler.preload(directory)
        for old in retired:
            self.drop_from_memory(old)

    def drop_from_memory(self, directory: str) -> None:
        """An in-memory snapshot retired: unloaded from the engines, its memory freed."""
        self.release_snapshot(directory)
        shutil.rmtree(directory, ignore_errors=True)
        shutil.rmtree(directory.rstrip("/") + "-engine", ignore_errors=True)

    def route_create_sampling_session(self, body):
        req = protocol.parse(_types().CreateSamplingSessionRequest, body, route="create_sampling_session")
        self.session(req.session_id)
        adapter_dir = None
        if req.model_path is not None:
            _, _, _, adapter_dir = self.checkpoints.resolve(req.model_path, want="sampler_weights")
            self._check_full_snapshot(adapter_dir, req.model_path)
        elif req.base_model is not None:
            self._check_base(req.base_model)
        else:
            raise ApiError(400, "create_sampling_session: give model_path or base_model")
        sid = self.new_sampling_session(req.session_id, req.sampling_session_seq_id, req.model_path, adapter_dir)
        return {"type": "create_sampling_session", "sampling_session_id": sid}

    def _check_full_snapshot(self, directory, name) -> None:
        """A full-fine-tuning snapshot (a Hugging Face checkpoint) is sampled by the parallm sampler only."""
        if is_full_snapshot(directory) and not getattr(self.sampler, "serves_full", False):
            raise ApiError(400, f"{name or 'this snapshot'} holds a full-fine-tuning client's weights (a Hugging "
                                f"Face checkpoint at {directory}); this server's {type(self.sampler).__name__} "
                                "samples LoRA snapshots and the base only: start the server with --sampler parallm, "
                                "or with --full-engine and sample an ephemeral snapshot "
                                "(save_weights_and_get_sampling_client: pushed into that engine), or serve the "
                                "directory with vLLM (vllm serve <directory>)")

    def route_get_sampler(self, body, sampler_id):
        s = self.samplers.get(sampler_id)
        if s is None:
            raise ApiError(404, f"unknown sampler {sampler_id!r}")
        return {"sampler_id": sampler_id, "base_model": s["base_model"], "model_path": s["model_path"]}

    def _sample_target(self, req) -> str | None:
        if req.sampling_session_id is not None:
            s = self.samplers.get(req.sampling_session_id)
            if s is None:
                raise ApiError(404, f"unknown sampling session {req.sampling_session_id!r}")
            if s["adapter_dir"] is not None and s["adapter_dir"].startswith(FULL_PUSH):
                return s["adapter_dir"]             # the router refuses it once a newer push replaced it
            if s["adapter_dir"] is not None and not os.path.isdir(s["adapter_dir"]):
                raise ApiError(404, f"the snapshot sampling session {req.sampling_session_id} was created from "
                                    f"({s['model_path'] or 'an unnamed snapshot'}) is gone: saved again under the "
                                    "same name, deleted, expired (ttl_seconds) or retired (--keep-sampler-snapshots "
                                    "keeps the newest unnamed snapshots of a client, on disk or in memory); a "
                                    "sampling client never "
                                    "samples other weights than it was created from: create a new one")
            self._check_full_snapshot(s["adapter_dir"], s["model_path"])
            return s["adapter_dir"]
        if req.model_path is not None:
            directory = self.checkpoints.resolve(req.model_path, want="sampler_weights")[3]
            self._check_full_snapshot(directory, req.model_path)
            return directory
        if req.base_model is not None:
            self._check_base(req.base_model)
            return None
        raise ApiError(400, "asample: give sampling_session_id, model_path or base_model")

    def _check_sample(self, req) -> list:
        for name in ("topk_prompt_logprobs", "topk_sample_logprobs"):
            k = getattr(req, name)
            if not 0 <= k <= TOPK_MAX:
                raise ApiError(400, f"asample: {name}={k}: this server returns 0 to {TOPK_MAX} log-probs per position")
        unsupported = [name for name, on in (("target_prompt_logprobs", req.target_prompt_logprobs is not None),
                                             ("prompt_alt_tokens_k", req.prompt_alt_tokens_k),
                                             ("prompt_logprobs_last_n", req.prompt_logprobs_last_n is not None)) if on]
        if unsupported:
            raise ApiError(400, f"asample: {', '.join(unsupported)} not offered by parallm's Tinker server")
        if req.num_samples < 1:
            raise ApiError(400, f"asample: num_samples must be at least 1, got {req.num_samples}")
        tokens = []
        for chunk in req.prompt.chunks:
            if getattr(chunk, "type", None) != "encoded_text":
                raise ApiError(400, f"asample: {getattr(chunk, 'type', type(chunk).__name__)} chunks are not "
                                    "offered (text chunks only)")
            tokens.extend(int(t) for t in chunk.tokens)
        vocab = self.config["vocab"]
        if not tokens:
            raise ApiError(400, "asample: empty prompt")
        bad = [t for t in tokens if not 0 <= t < vocab]
        if bad:
            raise ApiError(400, f"asample: prompt token {bad[0]} is outside the vocabulary [0, {vocab})")
        if len(tokens) >= self.config["max_context"]:
            raise ApiError(400, f"asample: the prompt has {len(tokens)} tokens; the context is "
                                f"{self.config['max_context']}")
        self._check_params(req, room=self.config["max_context"] - len(tokens))
        return tokens

    def _check_params(self, req, *, room: int) -> None:
        """Every field of the SDK's SamplingParams is honoured by both samplers; values they cannot honour are
        refused here, never ignored; ``num_samples x max_tokens`` is capped (``--max-sample-tokens``)."""
        p = req.sampling_params
        bad = []
        if not (math.isfinite(p.temperature) and p.temperature >= 0):
            bad.append(f"temperature {p.temperature} (0 for greedy, or positive)")
        if not (math.isfinite(p.top_p) and 0 < p.top_p <= 1):
            bad.append(f"top_p {p.top_p} (in (0, 1])")
        if p.top_k < -1:
            bad.append(f"top_k {p.top_k} (-1 or 0 for all, or a positive count)")
        if p.max_tokens is not None and p.max_tokens < 1:
            bad.append(f"max_tokens {p.max_tokens} (at least 1, or None for the rest of the context)")
        if bad:
            raise ApiError(400, f"asample: sampling_params out of range: {'; '.join(bad)}")
        tokens = req.num_samples * min(room, p.max_tokens or room)
        cap = self.config.get("max_sample_tokens", 1 << 20)
        if tokens > cap:
            raise ApiError(400, f"asample: num_samples x max_tokens = {req.num_samples} x "
                                f"{min(room, p.max_tokens or room)} = {tokens} tokens; this server samples at most "
                                f"{cap} per request (parallm serve-tinker --max-sample-tokens): send fewer samples "
                                "or a smaller max_tokens")

    def route_asample(self, body):
        req = protocol.parse(_types().SampleRequest, body, route="asample")
        if self.sampler is None:
            raise ApiError(400, "this server has no sampler (started with --sampler none)")
        adapter_dir = self._sample_target(req)
        tokens = self._check_sample(req)
        params = req.sampling_params.model_dump()
        job = SampleJob(prompt=tokens, num_samples=req.num_samples, params=params,
                        prompt_logprobs=bool(req.prompt_logprobs), adapter_dir=adapter_dir,
                        max_model_len=self.config["max_context"], topk_prompt=req.topk_prompt_logprobs,
                        topk_sample=req.topk_sample_logprobs, session=req.sampling_session_id)
        ids = self.stability_ids(req, tokens)           # record_stability_info: recorded ids (stability.py)
        rid = self.futures.create("sample")
        self._pool().submit(self._run_sample, rid, job, ids)
        return {"request_id": rid, "model_id": None,
                "sample_sequence_ids": ids or [f"{rid}.{k}" for k in range(req.num_samples)]}

    def stability_ids(self, req, tokens) -> list | None:
        if not req.record_stability_info:
            return None
        s = self.samplers.get(req.sampling_session_id) if req.sampling_session_id is not None else None
        if s is None or s.get("session_id") is None:
            raise ApiError(400, "asample: record_stability_info needs a sampling session (a SamplingClient): the "
                                "records are session-scoped")
        self.session(s["session_id"])
        return self.stability.assign(s["session_id"], tokens, req.num_samples)

    def _run_sample(self, rid: str, job: SampleJob, ids=None) -> None:
        try:
            res = self.sampler.sample(job)
            self.stability.sampled(ids, [seq[0] for seq in res.sequences])     # before the client can name them
            self.futures.resolve(rid, ("proto", protocol.encode_sample_response(
                res.sequences, res.prompt_logprobs, topk_sampled=res.topk_sampled, topk_prompt=res.topk_prompt)))
        except SamplerDead as e:
            self.futures.fail(rid, str(e), category="server")
        except SampleInputError as e:
            self.futures.fail(rid, f"asample: {e}", category="user")
        except Exception as e:  # noqa: BLE001 - every error reaches the request
            log.exception("sampling failed")
            self.futures.fail(rid, f"sampling failed: {type(e).__name__}: {e}", category="server")
        finally:
            self.stability.settle(ids)
