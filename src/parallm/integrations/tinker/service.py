"""The server's state on rank 0 and the routes that need no model: sessions and heartbeats, client config,
capabilities, futures, training runs and checkpoint listings. Training routes: :mod:`.training_routes`; sampling:
:mod:`.sampling_routes`. The HTTP plumbing (:mod:`.http`) maps ``(method, path)`` to the ``route_*`` methods.

Sessions expire after ``session_timeout_s`` without a heartbeat (the SDK sends one every 10 s): their training
clients are dropped from the model (their checkpoints stay on disk), and their recorded samples
(:mod:`.stability`) are forgotten.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import secrets
import threading
import time

from . import protocol
from .futures import FutureStore
from .records import RunRecords
from .protocol import ApiError
from .stability import DAY_S, StabilityStore

__all__ = ["ModelRecord", "ServiceBase"]

log = logging.getLogger("parallm.tinker")
GAP_S = 60.0            # a missing seq id older than this is skipped (a client that died mid-submission)
SEEN_KEEP = 1024        # seq ids remembered per client for deduplicating retried submissions


@dataclasses.dataclass
class ModelRecord:
    model_id: str
    session_id: str
    lora: dict
    created: float                  # wall-clock seconds
    next_seq: int = 1
    pending: dict = dataclasses.field(default_factory=dict)       # seq_id -> (item | error, done)
    seen: dict = dataclasses.field(default_factory=dict)          # seq_id -> request id (retried submissions)
    gap_since: float | None = None
    last_request: float = 0.0
    user_metadata: dict | None = None


class ServiceBase:
    """Sessions, models, futures and the ordering of each model's requests (the SDK numbers them: ``seq_id``
    1, 2, ...; the server runs them in that order whatever order they arrive in)."""

    def __init__(self, *, leader, config: dict, checkpoints, sampler=None, session_timeout_s: float = 600.0):
        self.leader, self.config, self.checkpoints, self.sampler = leader, config, checkpoints, sampler
        self.futures = FutureStore()
        self.lock = threading.RLock()
        self.sessions: dict[str, dict] = {}
        self.models: dict[str, ModelRecord] = {}
        self.samplers: dict[str, dict] = {}
        self.session_timeout_s = session_timeout_s
        self._ids = itertools.count(1)
        self._run = secrets.token_hex(3)        # session ids (and the model ids and checkpoint paths made from
        #                                         them) differ from one server start to the next
        self.records = RunRecords(checkpoints)   # runs and sessions on disk (operations.py)
        self.stability = StabilityStore(ttl=config.get("stability_ttl_s", DAY_S),   # record_stability_info samples
                                        max_tokens=config.get("stability_max_tokens", 1 << 28))

    # -- futures and ordering ------------------------------------------------------------------------------------
    def job(self, kind: str, item: dict, to_result, *, model_id: str | None = None, seq_id: int | None = None,
            error: str | None = None, on_error=None) -> dict:
        """Accept one unit of work: a request id now, the work on the dispatcher (in ``seq_id`` order for a
        model's requests), the result through the future. ``error``: refused after acceptance (the future fails
        with it, a user error, and the model's ordering moves on)."""
        rec = self.models.get(model_id) if model_id is not None else None
        with self.lock:
            if rec is not None and seq_id is not None and seq_id in rec.seen:
                return {"request_id": rec.seen[seq_id], "model_id": model_id}
            rid = self.futures.create(kind, model_id=model_id)

            def done(ok, value, category):
                if not ok:
                    if on_error is not None:
                        on_error()
                    self.futures.fail(rid, value, category=category or "server")
                    return
                try:
                    self.futures.resolve(rid, to_result(value))
                except Exception as e:  # noqa: BLE001 - an encoding bug must not leave the future pending
                    log.exception("%s: building the response failed", kind)
                    self.futures.fail(rid, f"{type(e).__name__}: {e}", category="server")

            if rec is None or seq_id is None:
                if error is not None:
                    done(False, error, "user")
                else:
                    self.leader.submit(item, done)
            else:
                rec.seen[seq_id] = rid
                rec.last_request = time.time()
                rec.pending[seq_id] = (item, error, done)
                self._pump(rec)
        return {"request_id": rid, "model_id": model_id}

    def refuse(self, model_id, seq_id, message: str) -> None:
        """A request of ``model_id`` numbered ``seq_id`` was refused before it ran (a bad name, a missing path, a
        malformed body): its seq id is consumed with the error, so the client's next request runs at once
        instead of waiting :data:`GAP_S` for it. A resubmission of that seq id gets the same error."""
        with self.lock:
            rec = self.models.get(model_id) if isinstance(model_id, str) else None
            if rec is None or not isinstance(seq_id, int) or seq_id in rec.seen or seq_id < rec.next_seq:
                return
            rid = self.futures.create("refused", model_id=model_id)
            self.futures.fail(rid, message, category="user")
            rec.seen[seq_id] = rid
            rec.pending[seq_id] = (None, message, lambda ok, value, category: None)
            self._pump(rec)

    def _pump(self, rec: ModelRecord) -> None:
        if rec.pending and min(rec.pending) < rec.next_seq:          # a seq id behind the model's position
            for s in [s for s in rec.pending if s < rec.next_seq]:
                _, _, done = rec.pending.pop(s)
                done(False, f"request seq_id {s} of {rec.model_id} arrived after seq_id {rec.next_seq - 1} ran "
                            "(requests of one training client run in seq_id order)", "user")
        while rec.next_seq in rec.pending:
            item, error, done = rec.pending.pop(rec.next_seq)
            rec.next_seq += 1
            if error is not None:
                done(False, error, "user")
            else:
                self.leader.submit(item, done)
        rec.gap_since = time.monotonic() if rec.pending else None
        if len(rec.seen) > 2 * SEEN_KEEP:             # retries come within moments: keep the newest seq ids only
            for s in [s for s in rec.seen if s < rec.next_seq - SEEN_KEEP]:
                del rec.seen[s]

    def skip_gaps(self) -> None:
        """A seq id that never arrived (its client died mid-submission) holds its model for :data:`GAP_S`."""
        with self.lock:
            now = time.monotonic()
            for rec in self.models.values():
                if rec.pending and rec.gap_since is not None and now - rec.gap_since > GAP_S:
                    log.warning("%s: seq_id %d never arrived; running seq_id %d", rec.model_id, rec.next_seq,
                                min(rec.pending))
                    rec.next_seq = min(rec.pending)
                    self._pump(rec)

    def expire_sessions(self) -> None:
        with self.lock:
            now = time.monotonic()
            dead = [sid for sid, s in self.sessions.items()
                    if not s["finished"] and now - s["heartbeat"] > self.session_timeout_s]
        for sid in dead:
            log.warning("session %s sent no heartbeat for %.0f s: its training clients are dropped", sid,
                        self.session_timeout_s)
            self.finish_session(sid)

    def finish_session(self, sid: str) -> None:
        with self.lock:
            s = self.sessions.get(sid)
            if s is None or s["finished"]:
                return
            s["finished"] = True
            mine = [m for m, rec in self.models.items() if rec.session_id == sid]
            for mid in mine:
                self.models.pop(mid)
        self.stability.end_session(sid)
        for mid in mine:
            self.leader.submit({"op": "drop_client", "args": {"model_id": mid}}, lambda ok, v, c: None)

    def forget_model(self, model_id: str) -> None:
        with self.lock:
            self.models.pop(model_id, None)

    def session(self, sid: str) -> dict:
        s = self.sessions.get(sid)
        if s is None:
            raise ApiError(404, f"unknown session {sid!r} (this server has {len(self.sessions)} sessions; it "
                                "forgets them when it restarts)")
        if s["finished"]:
            raise ApiError(410, f"session {sid} has finished")
        return s

    def model(self, model_id: str) -> ModelRecord:
        rec = self.models.get(model_id)
        if rec is None:
            raise ApiError(404, f"unknown model {model_id!r}: create it with create_lora_training_client (models "
                                "are dropped when their session ends or the server restarts; their "
                                "checkpoints stay)")
        return rec

    # -- routes without a model ------------------------------------------------------------------------------------
    def route_healthz(self, body):
        """``status`` (the SDK reads only that), the sampler's state (``ready``, ``starting``, ``failed: why`` or
        ``none``) and the leader's co-batching counts (``cobatch``: passes that ran several clients' requests,
        and the requests they ran)."""
        state = self.sampler.state() if self.sampler is not None and hasattr(self.sampler, "state") else \
            ("ready" if self.sampler is not None else "none")
        counts = getattr(self.leader, "cobatched", None)
        return {"status": "ok", "sampler": state, "cobatch": dict(counts) if counts is not None else None}

    def route_client_config(self, body):
        req = protocol.parse(_types().ClientConfigRequest, body, route="client/config")
        protocol.check_sdk_version(req.sdk_version)
        return {"pjwt_auth_enabled": False, "credential_default_source": "api_key", "use_pyqwest_transport": False,
                "proto_compress_fwdbwd": False, "parallel_fwdbwd_chunks": False, "fwdbwd_max_chunk_len": 4096,
                "fwdbwd_max_chunk_bytes_count": self.config.get("max_body", protocol.DEFAULT_MAX_BODY) // 2, "sample_use_retrieve_futures": False,
                "custom_loss_server_side": False, "sample_join_sampling_session": False,
                "sample_no_retries": False}

    def route_dynamic_config(self, body):
        return {"refresh_interval_sec": 300, "sample_cancel_enabled": False}

    def route_telemetry(self, body):
        return {"status": "accepted"}

    def route_cancel_future(self, body):
        return {}

    def route_capabilities(self, body):
        c = self.config
        return {"supported_models": [{"model_name": c["model_name"], "max_context_length": c["max_context"],
                                      "trainable": True, "sampleable": self.sampler is not None}]}

    def route_create_session(self, body):
        req = protocol.parse(_types().CreateSessionRequest, body, route="create_session")
        protocol.check_sdk_version(req.sdk_version)
        with self.lock:
            sid = f"session-{self._run}-{next(self._ids)}"
            self.sessions[sid] = {"created": time.time(), "heartbeat": time.monotonic(), "finished": False,
                                  "user_metadata": req.user_metadata, "display_name": req.display_name}
        self.records.save_session(sid, {"session_id": sid, "created": time.time(),
                                        "user_metadata": req.user_metadata, "display_name": req.display_name})
        warn = self.config.get("session_warning")
        return {"type": "create_session", "session_id": sid, "warning_message": warn}

    def route_heartbeat(self, body):
        req = protocol.parse(_types().SessionHeartbeatRequest, body, route="session_heartbeat")
        self.session(req.session_id)["heartbeat"] = time.monotonic()
        return {"type": "session_heartbeat"}

    def route_finish_session(self, body, sid):
        if sid not in self.sessions:
            raise ApiError(404, f"unknown session {sid!r}")
        self.finish_session(sid)
        return {}

    def route_retrieve_future(self, body):
        req = protocol.parse(_types().FutureRetrieveRequest, body, route="retrieve_future")
        e = self.futures.wait(req.request_id)
        if e is None:
            raise ApiError(404, f"unknown request id {req.request_id!r} (results are kept one hour)")
        if not e.done:
            return {"type": "try_again", "request_id": req.request_id, "queue_state": "active"}
        if e.error is not None:
            return {"error": e.error[0], "category": e.error[1]}
        return e.result

    def route_training_run(self, body, model_id):
        rec = self.models.get(model_id)
        if rec is None:
            saved = self.records.run(model_id)
            if saved is None:
                self.model(model_id)                 # the 404
            return self.run_response(model_id, saved, loaded=False)
        return self.run_response(model_id, {"session_id": rec.session_id, "lora": rec.lora, "created": rec.created,
                                            "last_request": rec.last_request, "user_metadata": rec.user_metadata},
                                 loaded=True)

    def route_training_runs(self, body):
        runs = [self.route_training_run(None, m) for m in list(self.models)] + self.training_runs_on_disk()
        return {"training_runs": runs, "cursor": {"offset": 0, "limit": len(runs), "total_count": len(runs)}}

    def route_list_checkpoints(self, body, model_id):
        return {"checkpoints": self.checkpoints.listing(model_id), "cursor": None}

    def route_delete_checkpoint(self, body, model_id, checkpoint_id):
        self.release_snapshot(self.checkpoints.delete(model_id, checkpoint_id))
        return {}

    # -- snapshots' lifetime ------------------------------------------------------------------------------------
    def release_snapshot(self, directory: str | None) -> None:
        """A snapshot directory is gone (overwritten, deleted, expired, retired): its engine-side adapter too."""
        if directory is not None and self.sampler is not None and hasattr(self.sampler, "release"):
            try:
                self.sampler.release(directory)
            except Exception:  # noqa: BLE001 - the engine may be gone; the files are what matters
                log.exception("unloading the adapter of %s", directory)

    def retain_snapshots(self, model_id: str) -> None:
        """Keep the newest ``keep_sampler_snapshots`` ephemeral sampler snapshots of a client (those the SDK's
        ``save_weights_and_get_sampling_client`` makes, with no name); named ones stay until deleted or their
        ``ttl_seconds`` runs out. 0 keeps everything."""
        keep = self.config.get("keep_sampler_snapshots", 0)
        if not keep:
            return
        mine = sorted(((meta["time"], name) for segment, name, _, meta in self.checkpoints.entries(model_id)
                       if segment == "sampler_weights" and meta.get("ephemeral")), reverse=True)
        for _, name in mine[keep:]:
            try:
                self.release_snapshot(self.checkpoints.delete(model_id, f"sampler_weights/{name}"))
            except ApiError:
                pass

    def expire_checkpoints(self) -> None:
        """Delete every checkpoint past its ``ttl_seconds`` (the janitor calls this)."""
        for model_id, checkpoint_id in self.checkpoints.expired():
            try:
                self.release_snapshot(self.checkpoints.delete(model_id, checkpoint_id))
                log.info("checkpoint %s of %s expired: deleted", checkpoint_id, model_id)
            except ApiError:
                pass

    def route_weights_info(self, body):
        path = (body or {}).get("tinker_path")
        _, segment, _, directory = self.checkpoints.resolve(path)
        meta = self.checkpoints.meta(directory)
        lora = meta["lora"]
        if lora.get("full"):
            return {"base_model": meta["base_model"], "is_lora": False, "lora_rank": None}
        return {"base_model": meta["base_model"], "is_lora": True, "lora_rank": lora["rank"],
                "train_unembed": lora["train_unembed"], "train_mlp": lora["train_mlp"],
                "train_attn": lora["train_attn"]}


def _iso(t: float) -> str:
    import datetime
    return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).isoformat()


def _types():
    from tinker import types
    return types
