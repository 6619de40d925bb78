"""The server's record of training runs and sessions on disk, under the checkpoint root: ``<root>/<model id>/run.json``
per training run and ``<root>/_parallm_sessions/<id>.json`` per session (:mod:`.operations` serves them)."""

from __future__ import annotations

import json
import os
import urllib.parse

__all__ = ["RunRecords"]

SESSIONS = "_parallm_sessions"
RUN = "run.json"


class RunRecords:
    """``run.json`` per training run and one file per session, under the checkpoint root."""

    def __init__(self, store):
        self.store = store
        self.sessions_dir = os.path.join(store.root, SESSIONS)
        os.makedirs(self.sessions_dir, exist_ok=True)

    @staticmethod
    def _write(path: str, record: dict) -> None:
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(record, f)
        os.replace(tmp, path)

    def save_run(self, model_id: str, record: dict) -> None:
        run = self.store.run_dir(model_id)
        os.makedirs(run, exist_ok=True)
        self._write(os.path.join(run, RUN), record)

    def run(self, model_id: str) -> dict | None:
        try:
            with open(self.store.inside(os.path.join(self.store.run_dir(model_id), RUN))) as f:
                return json.load(f)
        except (OSError, ValueError):
            return None

    def runs(self) -> dict:
        out = {}
        for model_id in self.store.run_ids():
            rec = self.run(model_id)
            if rec is not None:
                out[model_id] = rec
        return out

    def save_session(self, sid: str, record: dict) -> None:
        self._write(os.path.join(self.sessions_dir, urllib.parse.quote(sid, safe="") + ".json"), record)

    def sessions(self) -> dict:
        out = {}
        for name in sorted(os.listdir(self.sessions_dir)):
            if name.endswith(".json"):
                try:
                    with open(os.path.join(self.sessions_dir, name)) as f:
                        rec = json.load(f)
                    out[rec["session_id"]] = rec
                except (OSError, ValueError, KeyError):
                    continue
        return out
