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


class CheckpointStore:
    def __init__(self, root: str):
        self.root = os.path.abspath(root)
        os.makedirs(self.root, exist_ok=True)

    def path(self, model_id: str, segment: str, name: str) -> str:
        if not name or "/" in name or name in (".", "..") or name.startswith("_parallm"):
            raise ApiError(400, f"checkpoint name {name!r}: use a non-empty name without '/'")
        return os.path.join(self.root, _safe(model_id), segment, name)

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
        return model_id, segment, name, directory

    def write_meta(self, directory: str, meta: dict) -> None:
        meta = dict(meta, time=datetime.datetime.now(datetime.timezone.utc).isoformat())
        tmp = os.path.join(directory, META + ".tmp")
        with open(tmp, "w") as f:
            json.dump(meta, f)
        os.replace(tmp, os.path.join(directory, META))

    def meta(self, directory: str) -> dict:
        with open(os.path.join(directory, META)) as f:
            return json.load(f)

    def listing(self, model_id: str) -> list[dict]:
        """The SDK's ``Checkpoint`` records of one training run, oldest first."""
        out = []
        for segment, kind in KINDS.items():
            base = os.path.join(self.root, _safe(model_id), segment)
            if not os.path.isdir(base):
                continue
            for name in sorted(os.listdir(base)):
                d = os.path.join(base, name)
                if not os.path.isfile(os.path.join(d, META)):
                    continue
                meta = self.meta(d)
                out.append({"checkpoint_id": f"{segment}/{name}", "checkpoint_type": kind, "time": meta["time"],
                            "tinker_path": self.tinker_path(model_id, segment, name), "size_bytes": _size(d),
                            "public": False, "user_metadata": meta.get("user_metadata")})
        return sorted(out, key=lambda c: c["time"])

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
