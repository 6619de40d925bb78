"""Where checkpoints live and what ``tinker://`` paths mean.

``tinker://<model_id>/weights/<name>``: a training checkpoint (``save_state`` / ``save_weights``): a parallm
training checkpoint (``parallm.save_checkpoint``: the client's adapters and their AdamW state, loadable at any
layout) under ``<root>/<model_id>/weights/<name>``. ``tinker://<model_id>/sampler_weights/<name>``: a sampler
snapshot (``save_weights_for_sampler``): a PEFT adapter directory (``parallm.save_hf_adapter``:
``PeftModel.from_pretrained`` and vLLM load it) at ``<root>/<model_id>/sampler_weights/<name>``. Both hold a
``tinker.json`` (the base model, the LoRA settings, when it was made, when it expires) from which listings and
``weights_info`` are answered. ``root`` is the server's ``--checkpoint-dir``: every rank must see it (each rank
writes its own shards).

Sampler snapshots are immutable: each save writes a new directory ``sampler_weights/_parallm_versions/<id>`` and
then points ``sampler_weights/<name>`` at it (a relative symbolic link, swapped atomically), so a save under a
name already used never changes the files a sampling client or an engine reads; the version it replaced is
removed (with its engine-side adapter: :meth:`CheckpointStore.publish` returns it). A sampling client created
from the old version then gets an error naming the overwrite instead of other weights.

Expiry: a checkpoint saved with ``ttl_seconds`` holds ``expires`` (epoch seconds); past it, it is not listed or
resolved, and the server's janitor deletes it (:meth:`CheckpointStore.expired`).
"""

from __future__ import annotations

import datetime
import json
import os
import secrets
import shutil
import time
import urllib.parse

from .protocol import ApiError

__all__ = ["CheckpointStore", "KINDS"]

KINDS = {"weights": "training", "sampler_weights": "sampler"}
META = "tinker.json"
VERSIONS = "_parallm_versions"         # sampler snapshots' immutable directories (names never start so)


def _safe(part: str) -> str:
    return urllib.parse.quote(part, safe="")


def _check_part(what: str, value) -> str:
    """A model id or checkpoint name as one path component: non-empty, not ``.`` / ``..``, no separator, no NUL,
    not parallm's own ``_parallm*`` folders."""
    if not isinstance(value, str) or value in ("", ".", "..") or "/" in value or "\\" in value or "\0" in value \
            or value.startswith("_parallm"):
        raise ApiError(400, f"{what} {value!r}: use a non-empty name without '/', other than '.' and '..' (and "
                            "not starting with '_parallm')")
    return value


class CheckpointStore:
    """Every path it hands out or reads lies under ``root`` after ``realpath`` (symbolic links resolved): a model
    id or name that would leave it, or a link inside it that points out, is refused (a 400), so nothing outside
    the root is listed, read, loaded (a training checkpoint's DCP metadata is read with pickle) or deleted."""

    def __init__(self, root: str):
        self.root = os.path.abspath(root)
        os.makedirs(self.root, exist_ok=True)
        self.real_root = os.path.realpath(self.root)

    def inside(self, directory: str) -> str:
        """``directory`` itself when its ``realpath`` lies under the root, else a 400."""
        real = os.path.realpath(directory)
        if not real.startswith(self.real_root + os.sep):
            raise ApiError(400, f"{directory} resolves to {real}, outside this server's checkpoint directory "
                                f"{self.real_root}: refused")
        return directory

    def run_dir(self, model_id: str) -> str:
        return self.inside(os.path.join(self.root, _safe(_check_part("model id", model_id))))

    def path(self, model_id: str, segment: str, name: str) -> str:
        _check_part("checkpoint name", name)
        return self.inside(os.path.join(self.run_dir(model_id), segment, name))

    def tinker_path(self, model_id: str, segment: str, name: str) -> str:
        return f"tinker://{model_id}/{segment}/{name}"

    def resolve(self, tinker_path: str, *, want: str | None = None) -> tuple[str, str, str, str]:
        """``(model_id, segment, name, directory)`` of an existing checkpoint, ``directory`` with links resolved
        (a sampler snapshot's immutable version); a 400 for a malformed path, a 404 for one that does not exist
        or expired, a 400 when ``want`` (``"weights"`` / ``"sampler_weights"``) differs."""
        if not isinstance(tinker_path, str) or not tinker_path.startswith("tinker://"):
            raise ApiError(400, f"{tinker_path!r} is not a tinker:// path")
        parts = tinker_path[len("tinker://"):].split("/")
        if len(parts) != 3 or parts[1] not in KINDS:
            raise ApiError(400, f"{tinker_path!r}: expected tinker://<model id>/weights/<name> or "
                                "tinker://<model id>/sampler_weights/<name>")
        model_id, segment, name = parts
        if want is not None and segment != want:
            raise ApiError(400, f"{tinker_path} is a {KINDS[segment]} checkpoint; this call needs a "
                                f"{KINDS[want]} checkpoint (tinker://<model id>/{want}/<name>)")
        directory = self.path(model_id, segment, name)
        if not os.path.isfile(os.path.join(directory, META)):
            raise ApiError(404, f"no checkpoint {tinker_path} on this server (looked in {directory})")
        expires = self.meta(directory).get("expires")
        if expires is not None and expires < time.time():
            raise ApiError(404, f"checkpoint {tinker_path} expired (its ttl_seconds ran out)")
        return model_id, segment, name, os.path.realpath(directory)

    def write_meta(self, directory: str, meta: dict, *, ttl_seconds: int | None = None) -> None:
        now = time.time()
        meta = dict(meta, time=datetime.datetime.fromtimestamp(now, datetime.timezone.utc).isoformat(),
                    expires=None if ttl_seconds is None else now + ttl_seconds)
        self.write_meta_raw(directory, meta)

    def write_meta_raw(self, directory: str, meta: dict) -> None:
        tmp = self.inside(os.path.join(directory, META + ".tmp"))
        with open(tmp, "w") as f:
            json.dump(meta, f)
        os.replace(tmp, os.path.join(directory, META))

    def meta(self, directory: str) -> dict:
        with open(self.inside(os.path.join(directory, META))) as f:
            return json.load(f)

    # -- sampler snapshots: immutable versions behind a name ----------------------------------------------------
    def new_version(self, model_id: str, name: str) -> str:
        """A fresh directory path (not created) for the next snapshot saved as ``name``."""
        self.path(model_id, "sampler_weights", name)
        return os.path.join(self.run_dir(model_id), "sampler_weights", VERSIONS, secrets.token_hex(8))

    def publish(self, model_id: str, name: str, version: str) -> str | None:
        """Point ``sampler_weights/<name>`` at ``version`` (atomically); the version it pointed at before (now
        removed), or None."""
        link = self.path(model_id, "sampler_weights", name)
        old = None
        if os.path.islink(link):
            old = os.path.realpath(link)
        elif os.path.isdir(link):                   # a directory an earlier parallm wrote in place
            shutil.rmtree(link)
        tmp = os.path.join(os.path.dirname(version), f"link-{secrets.token_hex(6)}")
        os.symlink(os.path.relpath(version, os.path.dirname(link)), tmp)
        os.replace(tmp, link)
        if old is not None and old != os.path.realpath(version):
            self.remove_version(old)
            return old
        return None

    def remove_version(self, directory: str) -> None:
        """A snapshot version and the engine's copy of it (``<dir>-engine``, engine_adapters.py)."""
        if self._is_inside(directory):
            shutil.rmtree(directory, ignore_errors=True)
            shutil.rmtree(directory.rstrip("/") + "-engine", ignore_errors=True)

    def entries(self, model_id: str):
        """``(segment, name, directory, meta)`` of every checkpoint of a run (expired ones included)."""
        run = self.run_dir(model_id)
        for segment in KINDS:
            base = os.path.join(run, segment)
            if not os.path.isdir(base) or not self._is_inside(base):
                continue
            for name in sorted(os.listdir(base)):
                d = os.path.join(base, name)
                if name.startswith("_parallm") or not self._is_inside(d) or \
                        not os.path.isfile(os.path.join(d, META)):
                    continue
                try:
                    yield segment, name, d, self.meta(d)
                except (OSError, ValueError):     # being replaced or removed right now
                    continue

    def listing(self, model_id: str) -> list[dict]:
        """The SDK's ``Checkpoint`` records of one training run, oldest first (expired ones left out)."""
        out, now = [], time.time()
        for segment, name, d, meta in self.entries(model_id):
            if meta.get("expires") is not None and meta["expires"] < now:
                continue
            out.append({"checkpoint_id": f"{segment}/{name}", "checkpoint_type": KINDS[segment], "time": meta["time"],
                        "tinker_path": self.tinker_path(model_id, segment, name), "size_bytes": _size(d),
                        "public": False, "user_metadata": meta.get("user_metadata"),
                        "expires_at": _iso(meta["expires"]) if meta.get("expires") else None})
        return sorted(out, key=lambda c: c["time"])

    def run_ids(self) -> list[str]:
        """The model ids that have a folder under the root."""
        out = []
        for entry in os.listdir(self.root):
            model_id = urllib.parse.unquote(entry)
            if entry.startswith("_parallm") or model_id in (".", "..") or not os.path.isdir(
                    os.path.join(self.root, entry)):
                continue
            out.append(model_id)
        return out

    def expired(self) -> list[tuple[str, str]]:
        """``(model_id, checkpoint_id)`` of every checkpoint past its ``expires``."""
        now, out = time.time(), []
        for model_id in self.run_ids():
            try:
                for segment, name, _, meta in self.entries(model_id):
                    if meta.get("expires") is not None and meta["expires"] < now:
                        out.append((model_id, f"{segment}/{name}"))
            except ApiError:
                continue
        return out

    def _is_inside(self, directory: str) -> bool:
        try:
            self.inside(directory)
            return True
        except ApiError:
            return False

    def delete(self, model_id: str, checkpoint_id: str) -> str:
        """Delete a checkpoint; returns the directory its files were in (a snapshot's version)."""
        segment, _, name = checkpoint_id.partition("/")
        if segment not in KINDS:
            raise ApiError(400, f"checkpoint id {checkpoint_id!r}: expected weights/<name> or sampler_weights/<name>")
        directory = self.path(model_id, segment, name)
        if not os.path.isfile(os.path.join(directory, META)):
            raise ApiError(404, f"no checkpoint {checkpoint_id} of {model_id}")
        if os.path.islink(directory):
            target = os.path.realpath(directory)
            os.unlink(directory)
            self.remove_version(target)
            return target
        shutil.rmtree(directory)
        return directory


def _iso(t: float) -> str:
    return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).isoformat()


def _size(directory: str) -> int:
    total = 0
    for dirpath, _, files in os.walk(directory):
        for f in files:
            try:
                total += os.path.getsize(os.path.join(dirpath, f))
            except OSError:
                pass
    return total
