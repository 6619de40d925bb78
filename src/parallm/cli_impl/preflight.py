"""Checkpoint checks that need no process group: config, family, tp / pp split, tensor names and shapes.

``parallm verify`` runs them in the launching process before it starts any rank (a broken checkpoint is
reported in a second, not after the ranks started); ``parallm inspect`` prints what they find. They call the
same functions the loader calls (the family's weight table, ``check_keys_and_shapes``), so they cannot disagree
with it; the loader still checks everything again on the ranks.
"""

from __future__ import annotations

import os

from .common import CLIError

ST_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
                  "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "U32": 4, "U64": 8}
ST_DTYPE_NAMES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
                  "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
                  "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}


def read_config(path: str) -> dict:
    """config.json of a checkpoint directory, as a dict; a CLIError saying what is wrong otherwise."""
    from ..families import load_config
    if not os.path.exists(path):
        raise CLIError(f"{path} does not exist")
    if not os.path.isdir(path):
        raise CLIError(f"{path} is not a directory (give the checkpoint directory, the one with config.json)")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise CLIError(f"{path} has no config.json (is it a Hugging Face checkpoint directory?)")
    try:
        return load_config(path)._raw
    except ValueError as e:
        raise CLIError(str(e)) from None


def model_spec(config: dict, where: str):
    """(DecoderSpec, Family) of a config dict, or a CLIError naming the unsupported / missing field."""
    from ..families import spec_from_config
    try:
        return spec_from_config(config)
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise CLIError(f"{where}/config.json: {e}") from None


def resolve_task(config: dict, task: str | None) -> str:
    from ..api import resolve_task as _resolve
    from ..families import load_config
    try:
        return _resolve(load_config(config), task)
    except ValueError as e:
        raise CLIError(str(e)) from None


def tensor_table(path: str) -> dict[str, dict]:
    """Every tensor of the checkpoint: name -> {"dtype", "shape", "bytes", "file"}, read from the safetensors
    headers the way the loader reads them (no tensor data is touched)."""
    from ..checkpoint.hf_dir import HFCheckpoint
    from ..errors import CheckpointError
    try:
        ckpt = HFCheckpoint(path)
        out = {}
        for name, fname in ckpt.weight_map.items():
            src = ckpt.source(name)
            n = ST_DTYPE_BYTES.get(src.dtype_code, 4)
            for d in src.shape:
                n *= d
            out[name] = {"dtype": src.dtype_code, "shape": src.shape, "bytes": n, "file": fname}
        return out
    except CheckpointError as e:
        raise CLIError(str(e)) from None


def check_tensors(spec, task: str, pp: int, tensors: dict[str, dict], where: str) -> list[str]:
    """Problems (missing / unexpected / mis-shaped tensors) as the loader reports them; notes otherwise."""
    from ..checkpoint.loader import check_checkpoint
    from ..model.table import expected_hf_shapes
    from ..errors import CheckpointError
    from ..families import family_of
    expected = expected_hf_shapes(family_of(spec).table, spec, task=task, pp=pp)
    try:
        aliases, init = check_checkpoint({k: v["shape"] for k, v in tensors.items()}, spec, task, expected,
                                         strict=True, where=where)
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
