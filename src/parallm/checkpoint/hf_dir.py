"""Reading HF checkpoint directories (single ``model.safetensors`` or sharded with an index), lazily.

Only safetensors are read by default: pickle-based ``.bin`` / ``.pt`` checkpoints can run arbitrary code.
"""

from __future__ import annotations

import json
import os

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


class SliceSource(Source):
    """One tensor of a safetensors file; ``read`` touches only the requested slice's bytes (a view of the
    memory-mapped file: the bytes are read by whoever copies from it)."""

    def __init__(self, handle, name: str):
        self._handle = handle
        meta = handle.get_slice(name)
        self.name = name
        self.shape = tuple(meta.get_shape())
        self.dtype_code = meta.get_dtype()          # safetensors' code: "F32", "BF16", "I32", ...
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
        base = os.path.realpath(self.path)
        files: dict[str, str] = {}
        for fname in sorted({str(v) for v in weight_map.values()}):
            full = os.path.realpath(os.path.join(self.path, fname))
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
