"""Checkpoint checks that need no process group: config, family, tp / pp split, tensor names and shapes.

``parallm verify`` runs them in the launching process before it starts any rank (a broken checkpoint is
reported in a second, not after the ranks started); ``parallm inspect`` prints what they find. They call the
same functions the loader calls (the family's weight table, ``check_keys_and_shapes``), so they cannot disagree
with it; the loader still checks everything again on the ranks.
"""

from __future__ import annotations

import json
import os
import struct

from .common import CLIError

ST_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
                  "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "U32": 4, "U64": 8}
ST_DTYPE_NAMES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
                  "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
                  "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}


def read_config(path: str) -> dict:
    """config.json of a checkpoint directory, as a dict; a CLIError saying what is wrong otherwise."""
    if not os.path.exists(path):
        raise CLIError(f"{path} does not exist")
    if not os.path.isdir(path):
        raise CLIError(f"{path} is not a directory (give the checkpoint directory, the one with config.json)")
    cfg = os.path.join(path, "config.json")
    if not os.path.isfile(cfg):
        raise CLIError(f"{path} has no config.json (is it a Hugging Face checkpoint directory?)")
    try:
        with open(cfg) as f:
            data = json.load(f)
    except ValueError as e:
        raise CLIError(f"{cfg} is not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise CLIError(f"{cfg} does not hold a JSON object")
    return data


def model_spec(config: dict, where: str):
    """(DecoderSpec, Family) of a config dict, or a CLIError naming the unsupported / missing field."""
    from ..families import spec_from_config
    try:
        return spec_from_config(config)
    except AttributeError as e:
        field = str(e).rsplit("'", 2)[-2] if "'" in str(e) else str(e)
        raise CLIError(f"{where}/config.json lacks {field}, which parallm needs") from None
    except (ValueError, KeyError, TypeError) as e:
        raise CLIError(f"{where}/config.json: {e}") from None


def resolve_task(config: dict, task: str | None) -> str:
    from ..api import resolve_task as _resolve
    from ..families import load_config
    try:
        return _resolve(load_config(config), task)
    except ValueError as e:
        raise CLIError(str(e)) from None


def safetensors_header(path: str) -> dict:
    """Name -> {"dtype", "shape", "bytes"} from a safetensors file's header (the tensors are not read)."""
    try:
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise ValueError("file shorter than the 8-byte header length")
            (n,) = struct.unpack("<Q", raw)
            size = os.path.getsize(path)
            if n > size - 8:
                raise ValueError(f"header length {n} exceeds the file size {size}")
            header = json.loads(f.read(n))
    except (OSError, ValueError) as e:
        raise CLIError(f"{path}: not a readable safetensors file ({e})") from None
    out = {}
    data_len = size - 8 - n
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        start, stop = meta["data_offsets"]
        if stop > data_len:
            raise CLIError(f"{path}: {name} lies past the end of the file (truncated download?)")
        out[name] = {"dtype": meta["dtype"], "shape": tuple(meta["shape"]), "bytes": stop - start}
    return out


def checkpoint_files(path: str) -> dict[str, str]:
    """Tensor name -> file name, from the index or the single model.safetensors (as the loader reads it)."""
    from ..checkpoint.hf_dir import HFCheckpoint
    from ..errors import CheckpointError
    try:
        return dict(HFCheckpoint(path).weight_map)
    except CheckpointError as e:
        raise CLIError(str(e)) from None


def tensor_table(path: str) -> dict[str, dict]:
    """Every tensor of the checkpoint: name -> {"dtype", "shape", "bytes", "file"}."""
    weight_map = checkpoint_files(path)
    headers = {f: safetensors_header(os.path.join(path, f)) for f in sorted(set(weight_map.values()))}
    out = {}
    for name, fname in weight_map.items():
        meta = headers[fname].get(name)
        if meta is None:
            raise CLIError(f"{path}: the index puts {name} in {fname}, which does not contain it")
        out[name] = dict(meta, file=fname)
    return out


def check_tensors(spec, task: str, pp: int, tensors: dict[str, dict], where: str) -> list[str]:
    """Problems (missing / unexpected / mis-shaped tensors) as the loader would report them; notes otherwise."""
    from ..checkpoint.hf_dir import check_keys_and_shapes
    from ..checkpoint.loader import ignorable_names, value_head_plan
    from ..checkpoint.table import expected_hf_shapes
    from ..errors import CheckpointError
    from ..families import family_of
    present = {k: v["shape"] for k, v in tensors.items()}
    expected = expected_hf_shapes(family_of(spec).table, spec, task=task, pp=pp)
    aliases, init = value_head_plan(present, spec, task)
    seen = {**present, **{k: present[v] for k, v in aliases.items()}}
    want = {k: v for k, v in expected.items() if k not in init}
    try:
        check_keys_and_shapes(seen, want, strict=True, ignorable=ignorable_names(spec, task), where=where)
    except CheckpointError as e:
        raise CLIError(str(e)) from None
    notes = []
    if init:
        notes.append(f"{', '.join(init)} is not in the checkpoint: a value model initialises it (seeded)")
    if aliases:
        notes.append("the value head is read from a verl-style lm_head.weight [1, hidden]")
    return notes


def check_split(spec, tp: int, pp: int, vpp: int | None) -> None:
    from ..model.spec import check_tp, layer_numbers
    try:
        check_tp(spec, tp)
        layer_numbers(spec.num_layers, pp, vpp or 1, 0, 0)
    except ValueError as e:
        raise CLIError(str(e)) from None


def preflight(path: str, *, tp: int, pp: int, vpp: int | None, task: str | None) -> dict:
    """Everything verify can check before starting ranks. Returns what the header line shows."""
    config = read_config(path)
    spec, family = model_spec(config, path)
    task = resolve_task(config, task)
    check_split(spec, tp, pp, vpp)
    tensors = tensor_table(path)
    notes = check_tensors(spec, task, pp, tensors, os.path.abspath(path))
    dtypes = sorted({ST_DTYPE_NAMES.get(v["dtype"], v["dtype"]) for v in tensors.values()})
    return dict(spec=spec, family=family.name, task=task, dtypes=dtypes, notes=notes,
                architecture=spec.architecture)
