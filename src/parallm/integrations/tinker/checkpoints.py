"""Where checkpoints live and what ``tinker://`` paths mean.

``tinker://<model_id>/weights/<name>``: a training checkpoint (``save_state`` / ``save_weights``): a parallm
training checkpoint (``parallm.save_checkpoint``: the client's adapters and their AdamW state, loadable at any
layout) under ``<root>/<model_id>/weights/<name>``. ``tinker://<model_id>/sampler_weights/<name>``: a sampler
snapshot (``save_weights_for_sampler``): a PEFT adapter directory (``parallm.save_hf_adapter``:
``PeftModel.from_pretrained`` and vLLM load it) under ``<root>/<model_id>/sampler_weights/<name>``. Both hold a
``tinker.json`` beside (the base model, the LoRA settings, when it was made) from which listings and
``weights_info`` are answered. ``root`` is the server's ``--checkpoint-dir``: every rank must see it (each rank
writes its own shards).
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
import urllib.parse

from .protocol import ApiError

__all__ = ["CheckpointStore", "KINDS"]

KINDS = {"weights": "training", "sampler_weights": "sampler"}
META = "tinker.json"


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
        """``(model_id, segment, name, directory)`` of an existing checkpoint; a 400 for a malformed path, a 404
        for one that does not exist, a 400 when ``want`` (``"weights"`` / ``"sampler_weights"``) differs."""
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
        self.inside(os.path.join(directory, META))
        return model_id, segment, name, directory

    def write_meta(self, directory: str, meta: dict) -> None:
        meta = dict(meta, time=datetime.datetime.now(datetime.timezone.utc).isoformat())
        tmp = os.path.join(directory, META + ".tmp")
        with open(tmp, "w") as f:
            json.dump(meta, f)
        os.replace(tmp, os.path.join(directory, META))

    def meta(self, directory: str) -> dict:
        with open(self.inside(os.path.join(directory, META))) as f:
            return json.load(f)

    def listing(self, model_id: str) -> list[dict]:
        """The SDK's ``Checkpoint`` records of one training run, oldest first."""
        out = []
        run = self.run_dir(model_id)
        for segment, kind in KINDS.items():
            base = os.path.join(run, segment)
            if not os.path.isdir(base) or not self._is_inside(base):
                continue
            for name in sorted(os.listdir(base)):
                d = os.path.join(base, name)
                if not self._is_inside(d) or not os.path.isfile(os.path.join(d, META)):
                    continue
                meta = self.meta(d)
                out.append({"checkpoint_id": f"{segment}/{name}", "checkpoint_type": kind, "time": meta["time"],
                            "tinker_path": self.tinker_path(model_id, segment, name), "size_bytes": _size(d),
                            "public": False, "user_metadata": meta.get("user_metadata")})
        return sorted(out, key=lambda c: c["time"])

    def _is_inside(self, directory: str) -> bool:
        try:
            self.inside(directory)
            return True
        except ApiError:
            return False

    def delete(self, model_id: str, checkpoint_id: str) -> None:
        segment, _, name = checkpoint_id.partition("/")
        if segment not in KINDS:
            raise ApiError(400, f"checkpoint id {checkpoint_id!r}: expected weights/<name> or sampler_weights/<name>")
        directory = self.path(model_id, segment, name)
        if not os.path.isfile(os.path.join(directory, META)):
            raise ApiError(404, f"no checkpoint {checkpoint_id} of {model_id}")
        shutil.rmtree(directory)


def _size(directory: str) -> int:
    total = 0
    for dirpath, _, files in os.walk(directory):
        for f in files:
            try:
                total += os.path.getsize(os.path.join(dirpath, f))
            except OSError:
                pass
    return total
