"""Reading HF checkpoint directories (single ``model.safetensors`` or sharded with an index), lazily; Hub ids
resolved from the local Hugging Face cache (never the network); the tokenizer / generation files a saved
directory needs to be served.

Only safetensors are read by default: pickle-based ``.bin`` / ``.pt`` checkpoints can run arbitrary code.
"""

from __future__ import annotations

import json
import os
import re
import shutil

import torch
from safetensors import safe_open

from ..errors import CheckpointError
from ..model.sharding import Source, TensorSource

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
PICKLE_INDEX_NAME = "pytorch_model.bin.index.json"
PICKLE_SINGLE_NAME = "pytorch_model.bin"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth")
# safetensors' dtype codes (a file header's "dtype") as torch dtypes.
SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                      "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                      "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
# DeepSeek-V4's scale and FP4 formats, where this torch has them: UE8M0 block scales, packed e2m1 pairs
SAFETENSORS_DTYPES.update({code: getattr(torch, name) for code, name in (("F8_E8M0", "float8_e8m0fnu"),
                                                                         ("F4", "float4_e2m1fn_x2"))
                           if hasattr(torch, name)})
# safetensors counts an F4 tensor's last dim in 4-bit values; torch's float4_e2m1fn_x2 (what a read returns) in
# bytes of two: a source reports torch's shape, so that shapes and reads agree
PACKED_PAIRS = ("F4",)


class MissingCheckpointError(CheckpointError, FileNotFoundError):
    """A checkpoint directory (or its config.json) that does not exist: a :class:`CheckpointError`, catchable as
    ``FileNotFoundError`` too."""


class SliceSource(Source):
    """One tensor of a safetensors file; ``read`` touches only the requested slice's bytes (a view of the
    memory-mapped file: the bytes are read by whoever copies from it)."""

    def __init__(self, handle, name: str):
        self._handle = handle
        meta = handle.get_slice(name)
        self.name = name
        self.dtype_code = meta.get_dtype()          # safetensors' code: "F32", "BF16", "I32", ...
        shape = tuple(meta.get_shape())
        if self.dtype_code in PACKED_PAIRS and shape:
            shape = (*shape[:-1], shape[-1] // 2)
        self.shape = shape
        self._view = None

    @property
    def is_floating(self) -> bool:
        return self.dtype_code.startswith(("F", "BF"))

    @property
    def dtype(self) -> torch.dtype | None:
        """The stored dtype (None for a code torch has no dtype for), from the header: no data touched."""
        return SAFETENSORS_DTYPES.get(self.dtype_code)

    def read(self, dim, start, stop):
        if self._view is None:          # the whole tensor as a zero-copy view of the mapping, made once
            self._view = self._handle.get_tensor(self.name)
            if not self.shape:               # 0-d: one element, read as [1] (Source.full gives it back 0-d)
                self._view = self._view.reshape(1)
        return self._view.narrow(dim, start, stop - start)


class HFCheckpoint:
    """Name -> file map of a checkpoint directory; opens each file once, on first use.

    safetensors only, unless ``allow_pickle=True``: then a directory with only ``pytorch_model.bin`` (or its
    index) is read with ``torch.load(weights_only=True)`` (whole files, no lazy slicing).
    """

    def __init__(self, path: str | os.PathLike, *, allow_pickle: bool = False):
        self.path = os.path.abspath(os.fspath(path))
        self.pickle = False
        self._handles: dict[str, object] = {}   # file name -> open safetensors handle / loaded pickle dict
        self._sources: dict[str, Source] = {}   # tensor name -> its Source (made once: shape, dtype and reads)
        if not os.path.isdir(self.path):
            raise CheckpointError(f"checkpoint directory {self.path} does not exist")
        index = os.path.join(self.path, INDEX_NAME)
        single = os.path.join(self.path, SINGLE_NAME)
        if os.path.isfile(index):
            self.weight_map = self._read_index(index)
        elif os.path.isfile(single):
            self._handles[SINGLE_NAME] = handle = self._open_file(SINGLE_NAME)   # opened once, kept for reads
            self.weight_map = {k: SINGLE_NAME for k in handle.keys()}
        else:
            pickles = sorted(f for f in os.listdir(self.path) if f.endswith(PICKLE_SUFFIXES))
            if not pickles:
                raise CheckpointError(f"{self.path} has neither {SINGLE_NAME} nor {INDEX_NAME}")
            if not allow_pickle:
                raise CheckpointError(
                    f"{self.path} holds only pickle checkpoint files ({', '.join(pickles[:4])}); pickle can run "
                    "arbitrary code, so parallm does not read it by default. Convert it to safetensors, or pass "
                    "allow_pickle=True (then it is loaded with torch.load(weights_only=True))")
            self.pickle = True
            pindex = os.path.join(self.path, PICKLE_INDEX_NAME)
            if os.path.isfile(pindex):
                self.weight_map = self._read_index(pindex)
            else:
                fname = PICKLE_SINGLE_NAME if PICKLE_SINGLE_NAME in pickles else pickles[0]
                self._handles[fname] = state = self._load_pickle(fname)
                self.weight_map = {k: fname for k in state}

    def _read_index(self, index: str) -> dict[str, str]:
        """The index's name -> file map. Each distinct file is resolved and checked once (an index lists
        hundreds of tensors in a handful of files)."""
        with open(index) as f:
            try:
                weight_map = json.load(f)["weight_map"]
            except (ValueError, KeyError, TypeError) as e:
                raise CheckpointError(f"{index}: not a checkpoint index ({type(e).__name__}: {e})") from None
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index}: weight_map is not a mapping")
        # The name, not its target, must stay in the directory: a Hugging Face cache snapshot's files are
        # symlinks into the repository's blobs/ (realpath would put every shard "outside").
        base = os.path.normpath(self.path)
        files: dict[str, str] = {}
        for fname in sorted({str(v) for v in weight_map.values()}):
            full = os.path.normpath(os.path.join(self.path, fname))
            if os.path.dirname(full) != base:
                files[fname] = "outside"
            elif not os.path.isfile(full):
                files[fname] = "missing"
        for name, fname in weight_map.items():
            problem = files.get(str(fname))
            if problem == "outside":
                raise CheckpointError(f"{index}: {name} points to {fname!r}, outside the checkpoint directory")
            if problem == "missing":
                raise CheckpointError(f"{index}: {name} is in {fname!r}, which does not exist")
        return {name: str(fname) for name, fname in weight_map.items()}

    def _load_pickle(self, fname: str) -> dict:
        full = os.path.join(self.path, fname)
        try:
            sd = torch.load(full, map_location="cpu", weights_only=True, mmap=True)
        except Exception as e:  # noqa: BLE001 - any unreadable file becomes a named CheckpointError
            raise CheckpointError(f"{full}: cannot read with torch.load(weights_only=True) "
                                  f"({type(e).__name__}: {e})") from None
        if not isinstance(sd, dict):
            raise CheckpointError(f"{full}: not a state dict")
        return sd

    def _open_file(self, fname: str):
        full = os.path.join(self.path, fname)
        try:
            return safe_open(full, framework="pt", device="cpu")
        except Exception as e:  # safetensors raises its own error types for bad headers
            raise CheckpointError(f"{full}: cannot read safetensors file ({type(e).__name__}: {e})") from None

    def keys(self) -> list[str]:
        return list(self.weight_map)

    def _handle(self, name: str):
        fname = self.weight_map[name]
        if fname not in self._handles:
            self._handles[fname] = self._load_pickle(fname) if self.pickle else self._open_file(fname)
        return self._handles[fname]

    def source(self, name: str) -> Source:
        src = self._sources.get(name)
        if src is None:
            src = self._sources[name] = self._make_source(name)
        return src

    def _make_source(self, name: str) -> Source:
        try:
            if self.pickle:
                tensor = self._handle(name).get(name)
                if tensor is None:
                    raise CheckpointError(f"{name}: listed in the index but not in {self.weight_map[name]}")
                return TensorSource(tensor)
            return SliceSource(self._handle(name), name)
        except CheckpointError:
            raise
        except Exception as e:
            raise CheckpointError(f"{name} in {self.weight_map[name]}: {type(e).__name__}: {e}") from None


def check_keys_and_shapes(present: dict[str, tuple[int, ...]], expected: dict[str, tuple[int, ...]], *,
                          strict: bool, ignorable=(), where: str) -> None:
    """Raise :class:`CheckpointError` naming every missing / unexpected / mis-shaped tensor."""
    missing = sorted(set(expected) - set(present))
    unexpected = sorted(k for k in set(present) - set(expected) if not any(k.endswith(s) for s in ignorable)
                        and k not in ignorable)
    bad = [f"{k}: checkpoint {tuple(present[k])} vs model {tuple(expected[k])}"
           for k in sorted(set(present) & set(expected)) if tuple(present[k]) != tuple(expected[k])]
    msgs = []
    if missing:
        msgs.append(f"missing tensor(s): {', '.join(missing[:10])}" + (f" (+{len(missing) - 10} more)"
                                                                        if len(missing) > 10 else ""))
    if unexpected and strict:
        msgs.append(f"unexpected tensor(s): {', '.join(unexpected[:10])}" + (
            f" (+{len(unexpected) - 10} more)" if len(unexpected) > 10 else "")
            + " (pass strict=False to ignore them)")
    if bad:
        msgs.append("wrong shape: " + "; ".join(bad[:10]))
    if msgs:
        raise CheckpointError(f"{where}: " + " | ".join(msgs))


def check_floating(names, is_floating, *, where: str) -> None:
    """Every weight the model reads must be a floating-point tensor (an integer header is not weights)."""
    bad = sorted(n for n in names if not is_floating(n))
    if bad:
        raise CheckpointError(f"{where}: tensor(s) with a non-floating-point dtype where weights are expected: "
                              f"{', '.join(bad[:10])}")


def tensor_shapes(state_dict: dict[str, torch.Tensor]) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in state_dict.items()}


# -- Hub ids, from the local Hugging Face cache ----------------------------------------------------------------

# A Hub model id: "name" or "org/name" (letters, digits, "-", "_", "."; no "--" or ".." as the Hub refuses them).
_HUB_ID = re.compile(r"^(?:[A-Za-z0-9][A-Za-z0-9._-]*/)?[A-Za-z0-9][A-Za-z0-9._-]*$")


def hf_hub_cache() -> str:
    """The Hugging Face cache directory, read from the environment now (huggingface_hub reads it once, at its
    import): ``HF_HUB_CACHE``, else ``HUGGINGFACE_HUB_CACHE``, else ``$HF_HOME/hub``, else
    ``$XDG_CACHE_HOME/huggingface/hub``, else ``~/.cache/huggingface/hub``, as huggingface_hub resolves it."""
    env = os.environ
    cache = env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE")
    if not cache:
        home = env.get("HF_HOME") or os.path.join(env.get("XDG_CACHE_HOME") or os.path.join("~", ".cache"),
                                                  "huggingface")
        cache = os.path.join(home, "hub")
    return os.path.abspath(os.path.expanduser(cache))


def is_hub_id(text) -> bool:
    """Whether ``text`` is spelled like a Hub model id (``Qwen/Qwen2.5-0.5B``, ``gpt2``)."""
    return isinstance(text, str) and bool(_HUB_ID.match(text)) and "--" not in text and ".." not in text


def resolve_checkpoint(path, *, revision: str | None = None):
    """A checkpoint path or Hub id -> the local path to read.

    ``path`` names an existing file or directory: returned as it is (a local directory keeps priority over a
    Hub id of the same spelling; ``revision`` must then be None). Otherwise, if it is spelled like a Hub id
    (``Qwen/Qwen2.5-0.5B``), the snapshot of ``revision`` (a branch, tag or commit hash; default ``main``) is
    looked up in the local Hugging Face cache (:func:`hf_hub_cache`: ``HF_HUB_CACHE`` / ``HF_HOME``) with
    ``huggingface_hub.snapshot_download(local_files_only=True)``, which makes no network call, and its
    directory (``models--org--name/snapshots/<commit>``) is returned. parallm never downloads: an id the cache
    does not hold is a :class:`CheckpointError` naming the id, the revision and the cache directory searched.
    Anything else (a missing path not spelled like an id) is returned unchanged, for the caller's own "does not
    exist" error. Non-strings (a config object, a state dict) pass through.
    """
    if not isinstance(path, (str, os.PathLike)):
        return path
    text = os.fspath(path)
    if os.path.exists(text):
        if revision is not None:
            raise ValueError(f"revision={revision!r} applies to Hub ids; {text} is a local "
                             f"{'directory' if os.path.isdir(text) else 'file'}")
        return path
    if not is_hub_id(text):
        if revision is not None:
            raise ValueError(f"revision={revision!r} applies to Hub ids; {text!r} is neither a local path nor "
                             "spelled like one (org/name)")
        return path
    return hub_snapshot(text, revision=revision)


def config_source(hf_config, *, revision: str | None = None, what: str = "build_model"):
    """:func:`resolve_checkpoint` for a model's config: a path (or id) resolved, and a path that does not exist,
    or a directory without config.json, a :class:`MissingCheckpointError` saying so (a relative path: with the
    current directory it was tried in). Non-paths (a config object, a dict) pass through."""
    resolved = resolve_checkpoint(hf_config, revision=revision)
    if not isinstance(resolved, (str, os.PathLike)):
        return resolved
    path = os.fspath(resolved)
    if not os.path.exists(path):
        where = f" (relative to the current directory {os.getcwd()})" if not os.path.isabs(path) else ""
        raise MissingCheckpointError(f"{what}: checkpoint directory {path}{where} does not exist")
    if os.path.isdir(path) and not os.path.isfile(os.path.join(path, "config.json")):
        raise MissingCheckpointError(f"{what}: {path} has no config.json (is it a Hugging Face checkpoint "
                                     "directory?)")
    return resolved


def hub_snapshot(repo_id: str, *, revision: str | None = None) -> str:
    """The cached snapshot directory of Hub model ``repo_id`` at ``revision`` (see :func:`resolve_checkpoint`).
    The error for an id the cache lacks also says that no local path of that name exists relative to the
    current directory (``"tiny"`` may be a path mistyped or run from elsewhere)."""
    cache = hf_hub_cache()
    where = (f"{repo_id!r} (revision {revision or 'main'}) is not a local path (nothing of that name in the "
             f"current directory {os.getcwd()}), and the Hugging Face cache {cache}")
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise CheckpointError(f"{where} cannot be searched: huggingface_hub is not installed "
                              "(pip install huggingface_hub)") from None
    try:
        snapshot = snapshot_download(repo_id, revision=revision, cache_dir=cache, local_files_only=True)
    except Exception as e:  # noqa: BLE001 - LocalEntryNotFoundError, an incomplete snapshot, a bad id: one message
        folder = os.path.join(cache, "models--" + repo_id.replace("/", "--"))
        found = "has no snapshot of it" if not os.path.isdir(folder) else \
            f"has {folder} but no complete snapshot of that revision ({type(e).__name__}: {e})"
        raise CheckpointError(
            f"{where} {found}. parallm reads the cache only and never downloads: fetch it first (`hf download "
            f"{repo_id}`{f' --revision {revision}' if revision else ''}), or point HF_HUB_CACHE / HF_HOME at the "
            "cache holding it, or pass the checkpoint directory") from None
    return os.fspath(snapshot)


# -- what a saved directory needs besides the weights to be served ----------------------------------------------

# The files transformers' save_pretrained writes beside the weights for the tokenizer (tokenization_utils_base:
# tokenizer_config.json, special_tokens_map.json, added_tokens.json, tokenizer.json, chat_template.jinja and the
# legacy chat_template.json, additional_chat_templates/; each tokenizer class's vocab_files_names: vocab.json +
# merges.txt (GPT-2 / Qwen BPE), tokenizer.model (LLaMA / Mistral sentencepiece), vocab.txt, spiece.model,
# sentencepiece.bpe.model, ...; Mistral's tekken.json, tiktoken vocabularies), the generation defaults
# (generation_config.json) and a vision-language model's processors (preprocessor_config.json,
# processor_config.json, video_preprocessor_config.json). config.json and the weights are written by the saver.
SERVING_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "chat_template.jinja", "chat_template.json", "vocab.json", "merges.txt", "tokenizer.model", "vocab.txt",
    "spiece.model", "sentencepiece.bpe.model", "sentencepiece.model", "spm.model", "tekken.json",
    "tiktoken.model", "qwen.tiktoken", "generation_config.json", "preprocessor_config.json",
    "processor_config.json", "video_preprocessor_config.json",
)
SERVING_DIRS = ("additional_chat_templates",)
# Remote-code tokenizers (Kimi-K2's tokenization_kimi.py, named by tokenizer_config.json's auto_map).
_SERVING_PATTERN = re.compile(r"^tokenization_[A-Za-z0-9_]+\.py$")


def serving_files(src: str) -> list[str]:
    """The tokenizer, chat-template, generation and processor files of checkpoint directory ``src``
    (:data:`SERVING_FILES`, :data:`SERVING_DIRS`, remote-code ``tokenization_*.py``), as relative paths, sorted."""
    out = []
    for name in sorted(os.listdir(src)):
        full = os.path.join(src, name)
        if os.path.isfile(full) and (name in SERVING_FILES or _SERVING_PATTERN.match(name)):
            out.append(name)
        elif os.path.isdir(full) and name in SERVING_DIRS:
            out.extend(os.path.join(name, f) for f in sorted(os.listdir(full)) if os.path.isfile(os.path.join(full, f)))
    return out


def copy_serving_files(src: str, dst: str) -> list[str]:
    """Copy :func:`serving_files` of ``src`` into ``dst`` (their contents: a cache snapshot's symlinks are
    followed). Returns the relative paths copied."""
    names = serving_files(src)
    for name in names:
        os.makedirs(os.path.dirname(os.path.join(dst, name)), exist_ok=True)
        shutil.copyfile(os.path.join(src, name), os.path.join(dst, name))
    return names
