"""Operations routes (issue 58): unloading a client, sessions and training runs that outlive a restart, every
checkpoint of the server, a checkpoint's TTL changed, a checkpoint downloaded as one archive.

Persistent record: each training run writes ``<root>/<model id>/run.json`` when it is created (its session, LoRA
settings, base model, creation time, user metadata) and each session ``<root>/_parallm_sessions/<id>.json``; a
restarted server lists and describes those runs (``loaded: false`` until a client is created from one of their
checkpoints) and sessions, and loads their checkpoints (they were always on disk).
"""

from __future__ import annotations

import os
import tarfile
import time

from . import protocol
from .protocol import ApiError
from .service import _iso, _types

__all__ = ["OperationsRoutes"]



class OperationsRoutes:
    def route_unload_model(self, body):
        """The SDK's ``UnloadModelRequest``: the client's adapters, AdamW state and gradients are dropped on every
        rank (a full-fine-tuning client's whole model and optimizer are freed); its checkpoints stay (a new client
        loads them)."""
        req = protocol.parse(_types().UnloadModelRequest, body, route="unload_model")
        self.model(req.model_id)
        with self.lock:
            self.models.pop(req.model_id, None)
        return self.job("unload_model", {"op": "drop_client", "args": {"model_id": req.model_id}},
                        lambda v: ("json", {"model_id": req.model_id, "type": "unload_model"}))

    def route_list_sessions(self, body):
        ids = sorted(set(self.records.sessions()) | set(self.sessions))
        return {"sessions": ids}

    def route_get_session(self, body, sid):
        rec = self.sessions.get(sid) or self.records.sessions().get(sid)
        if rec is None:
            raise ApiError(404, f"unknown session {sid!r}")
        runs = sorted(m for m, r in self.records.runs().items() if r.get("session_id") == sid)
        samplers = sorted(s for s in self.samplers if s.startswith(f"{sid}:"))
        return {"training_run_ids": runs, "sampler_ids": samplers, "user_metadata": rec.get("user_metadata"),
                "display_name": rec.get("display_name")}

    def route_all_checkpoints(self, body):
        out = []
        for model_id in self.checkpoints.run_ids():
            try:
                out.extend(self.checkpoints.listing(model_id))
            except ApiError:
                continue
        out.sort(key=lambda c: c["time"])
        return {"checkpoints": out, "cursor": {"offset": 0, "limit": len(out), "total_count": len(out)}}

    def route_checkpoint_ttl(self, body, model_id, checkpoint_id):
        ttl = (body or {}).get("ttl_seconds")
        if ttl is not None and (isinstance(ttl, bool) or not isinstance(ttl, int) or ttl < 1):
            raise ApiError(400, f"ttl_seconds must be a positive integer or null, got {ttl!r}")
        segment, _, name = checkpoint_id.partition("/")
        if segment not in ("weights", "sampler_weights"):
            raise ApiError(400, f"checkpoint id {checkpoint_id!r}: expected weights/<name> or sampler_weights/<name>")
        _, _, _, directory = self.checkpoints.resolve(self.checkpoints.tinker_path(model_id, segment, name))
        meta = self.checkpoints.meta(directory)
        meta["expires"] = None if ttl is None else time.time() + ttl
        self.checkpoints.write_meta_raw(directory, meta)
        return {}

    def route_checkpoint_archive(self, body, model_id, checkpoint_id):
        """One checkpoint as a gzipped tar (``<name>/...``), streamed: the route checks the id and finds the
        directory (errors are JSON answers); the tar is then written chunk by chunk while the client reads it
        (:mod:`.http_app`), so an archive of any size costs the server a few MiB. Links are left out."""
        segment, _, name = checkpoint_id.partition("/")
        if segment not in ("weights", "sampler_weights"):
            raise ApiError(400, f"checkpoint id {checkpoint_id!r}: expected weights/<name> or sampler_weights/<name>")
        _, _, _, directory = self.checkpoints.resolve(self.checkpoints.tinker_path(model_id, segment, name))
        files = [os.path.join(d, f) for d, _, fs in sorted(os.walk(directory)) for f in sorted(fs)]
        return ("stream", lambda out: write_archive(out, directory, name, files))

    def training_runs_on_disk(self) -> list[dict]:
        """Runs recorded on disk whose clients are not in this server's memory (an earlier start's)."""
        out = []
        for model_id, rec in self.records.runs().items():
            if model_id in self.models:
                continue
            out.append(self.run_response(model_id, rec, loaded=False))
        return out

    def run_response(self, model_id: str, rec: dict, *, loaded: bool) -> dict:
        ckpts = self.checkpoints.listing(model_id)
        full = bool(rec["lora"].get("full"))          # a full-fine-tuning run (LoRA rank 0)
        last = lambda kind: next((c for c in reversed(ckpts) if c["checkpoint_type"] == kind), None)  # noqa: E731
        return {"training_run_id": model_id, "base_model": rec.get("base_model", self.config["model_name"]),
                "model_owner": rec.get("session_id"), "is_lora": not full,
                "lora_rank": None if full else rec["lora"]["rank"],
                "last_request_time": _iso(rec.get("last_request") or rec.get("created") or 0.0),
                "last_checkpoint": last("training"), "last_sampler_checkpoint": last("sampler"),
                "user_metadata": rec.get("user_metadata"), "loaded": loaded}


def write_archive(out, directory: str, name: str, files: list[str]) -> None:
    """The gzipped tar of ``files`` (under ``directory``, named ``<name>/<relative path>``) written to the
    file-like ``out`` as a stream (tarfile's ``w|gz``: nothing seeks back, nothing is held whole)."""
    with tarfile.open(fileobj=out, mode="w|gz") as tar:
        for path in files:
            if os.path.islink(path) or not os.path.isfile(path):
                continue
            tar.add(path, arcname=os.path.join(name, os.path.relpath(path, directory)))
