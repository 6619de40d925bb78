"""``parallm.json``, the record of a training checkpoint: what it holds, and the checks of a directory against
it and against a model, in this process alone (no process group)."""

from __future__ import annotations

import json
import os

from ...errors import CheckpointError
from ...model.params import LOW_PRECISION
from ..dcp_io import METADATA_FILE, VerifyingReader, check_files, file_crc
from ..saver import hf_config_dict
from .extra import extra_keys

META_NAME = "parallm.json"
FORMAT = "parallm-training-checkpoint"
VERSION = 2          # 2: ``extra`` as JSON + tensors. 1 stored it pickled: read for its tensors, never loaded
READABLE = (1, 2)
MOMENTS = ("exp_avg", "exp_avg_sq")


def make_record(chunks, dims, optimizer, step: int, saved, extra_entry: dict) -> dict:
    """parallm.json without the CRCs (added once the files are written)."""
    dtype = chunks[0].config.params_dtype
    return {
        "format": FORMAT, "version": VERSION, "step": step,
        "task": chunks[0].task, "dtype": str(dtype).replace("torch.", ""),
        "hf_config": hf_config_dict(chunks[0], dtype),
        "saved_with": {"tp": dims.tp, "cp": dims.cp, "pp": dims.pp, "vpp": dims.vpp, "dp": dims.dp, "ep": dims.ep,
                       "shard_over_dp": bool(optimizer is not None and optimizer.shard_over_dp)},
        "optimizer": None if optimizer is None else {
            "kind": "AdamW", "master_weights": dtype in LOW_PRECISION,
            "param_groups": optimizer.hyperparameters()},
        "tensors": [[n, list(s)] for n, s in saved],
        "extra": extra_entry,
    }


def write_record(directory: str, record: dict, crcs: dict) -> None:
    """``record`` with the items' CRCs and that of DCP's metadata file, written durably into ``directory``."""
    record = dict(record, crc32={"items": crcs, "metadata": file_crc(os.path.join(directory, METADATA_FILE))})
    with open(os.path.join(directory, META_NAME), "w") as f:
        json.dump(record, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def read_record(path: str):
    """(parallm.json, DCP metadata) of checkpoint directory ``path``, both checked (no process group): the
    record's fields, the metadata's CRC-32, every data file present and long enough."""
    path = os.path.abspath(os.fspath(path))
    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint {path} does not exist" if not os.path.exists(path)
                              else f"checkpoint {path} is not a directory")
    meta_path = os.path.join(path, META_NAME)
    if not os.path.isfile(meta_path):
        raise CheckpointError(f"{path} is not a parallm training checkpoint ({META_NAME} is missing; an "
                              "unfinished save never has one)")
    try:
        with open(meta_path) as f:
            record = json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{meta_path} cannot be read: {e}") from None
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        raise CheckpointError(f"{meta_path} is not a parallm training-checkpoint record")
    if record.get("version") not in READABLE:
        raise CheckpointError(f"{meta_path}: format version {record.get('version')} (this parallm reads "
                              f"{', '.join(map(str, READABLE))})")
    fields = ("step", "dtype", "hf_config", "optimizer", "tensors", "crc32") + (("extra",) if
                                                                               record["version"] >= 2 else ())
    lacking = [k for k in fields if k not in record]
    if lacking or not isinstance(record["crc32"], dict) or {"items", "metadata"} - set(record["crc32"]):
        raise CheckpointError(f"{meta_path} is damaged: it lacks {', '.join(lacking) or 'crc32 entries'}")
    md_path = os.path.join(path, METADATA_FILE)
    if not os.path.isfile(md_path):
        raise CheckpointError(f"{md_path} is missing")
    if file_crc(md_path) != record["crc32"]["metadata"]:
        raise CheckpointError(f"{md_path} is corrupted: it fails its CRC-32 check")
    try:
        metadata = VerifyingReader(path, {}).read_metadata()
    except Exception as e:  # noqa: BLE001
        raise CheckpointError(f"{md_path} cannot be read: {type(e).__name__}: {e}") from None
    check_files(path, metadata)
    return record, metadata


def check_loadable(record, metadata, path: str) -> list[str]:
    """What :func:`parallm.load_checkpoint` needs beyond :func:`read_record`: the current format, tensors only
    (no item it would have to unpickle), and every tensor the record's ``extra`` names. Returns those keys."""
    meta_path = os.path.join(path, META_NAME)
    if record["version"] != VERSION:
        raise CheckpointError(
            f"{path} was written by an older parallm (format version {record['version']}), which stored the "
            "checkpoint's extra as a pickle: loading it could run code the checkpoint carries, so load_checkpoint "
            "refuses it. Its tensors can still be read without it (parallm convert / checkpoint_to_hf, "
            "read_tensors)")
    objects = sorted(k for k, v in metadata.state_dict_metadata.items() if not hasattr(v, "size"))
    if objects:
        raise CheckpointError(f"{path} holds non-tensor item(s) {', '.join(objects[:4])}; a parallm training "
                              "checkpoint holds tensors only, and load_checkpoint never unpickles such items")
    keys = extra_keys(record["extra"], where_=meta_path)
    missing = [k for k in keys if k not in metadata.state_dict_metadata]
    if missing:
        raise CheckpointError(f"{path}: the extra's tensor(s) {', '.join(missing[:4])} are not in the checkpoint")
    return keys


def saved_shapes(metadata, prefix: str) -> dict[str, tuple[int, ...]]:
    """Stored tensor key (``prefix`` removed) -> global shape, for the keys under ``prefix``."""
    return {k[len(prefix):]: tuple(v.size) for k, v in metadata.state_dict_metadata.items()
            if k.startswith(prefix) and hasattr(v, "size")}


def check_against(record, metadata, path, saved, optimizer, trained=None) -> set[str]:
    """The checkpoint holds this model's tensors (names and shapes; ``saved``: what the model stores) and, when
    ``optimizer`` is given, optimizer state for each of the ``trained`` ones (HF names; None: all of them; a
    tensor without gradient, such as the router's selection bias or a carried MTP layer, has none). Returns the
    names whose fp32 master weights the checkpoint holds: every trained tensor it stores in low precision, or
    none (a checkpoint saved from an fp32 model)."""
    present = saved_shapes(metadata, "model/")
    expected = dict(saved)
    trained = set(expected) if trained is None else set(trained)
    missing = sorted(set(expected) - set(present))
    unexpected = sorted(set(present) - set(expected))
    bad = [f"{k}: checkpoint {present[k]} vs model {tuple(expected[k])}" for k in sorted(set(present) & set(expected))
           if present[k] != tuple(expected[k])]
    msgs = []
    if missing:
        msgs.append(f"the model has tensor(s) the checkpoint lacks: {', '.join(missing[:8])}"
                    + (f" (+{len(missing) - 8} more)" if len(missing) > 8 else ""))
    if unexpected:
        msgs.append(f"the checkpoint has tensor(s) the model lacks: {', '.join(unexpected[:8])}"
                    + (f" (+{len(unexpected) - 8} more)" if len(unexpected) > 8 else ""))
    if bad:
        msgs.append("shapes differ: " + "; ".join(bad[:8]))
    if msgs:
        raise CheckpointError(f"{path} is a checkpoint of another model: " + " | ".join(msgs))
    if optimizer is not None:
        if record.get("optimizer") is None:
            raise CheckpointError(f"{path} holds no optimizer state (it was saved without optimizer=...); load it "
                                  "without the optimizer, or start the optimizer fresh")
        for k in MOMENTS + ("step",):
            lacking = sorted(trained - set(saved_shapes(metadata, f"optim/{k}/")))
            if lacking:
                raise CheckpointError(f"{path}: optimizer state optim/{k} is missing for {', '.join(lacking[:8])}")
    masters = set(saved_shapes(metadata, "optim/master/"))
    stored = metadata.state_dict_metadata
    low = {n for n in trained if stored[f"model/{n}"].properties.dtype in LOW_PRECISION}
    return masters & trained if masters and masters >= low else set()
