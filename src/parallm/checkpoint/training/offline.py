"""A training checkpoint read in this process alone (no process group, no model): its full tensors, and its
model as a Hugging Face directory."""

from __future__ import annotations

import json
import os
import shutil
import warnings

import torch
import torch.distributed.checkpoint as dcp

from ...errors import CheckpointError
from ..cast import cast
from ..dcp_io import SliceLoadPlanner, VerifyingReader, from_dcp
from ..saver import DEFAULT_MAX_SHARD_SIZE, _move_into_place, check_target, make_tmp_beside, parse_size, plan_files
from .record import read_record, saved_shapes


def _read_full(path, record, metadata, keys, *, what: str) -> dict[str, torch.Tensor]:
    """The full tensors under ``keys``, read in this process alone; DCP's exception becomes parallm's."""
    state = {}
    for key in keys:
        md = metadata.state_dict_metadata.get(key)
        if md is None or not hasattr(md, "size"):
            raise CheckpointError(f"{path} has no tensor {key}")
        state[key] = [torch.empty(tuple(md.size), dtype=md.properties.dtype)]
    with warnings.catch_warnings():   # DCP warns that it runs in one process: that is the point here
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process.*")
        try:
            dcp.load(dict(state), storage_reader=VerifyingReader(path, record["crc32"]["items"]),
                     planner=SliceLoadPlanner(state), no_dist=True)
        except BaseException as e:
            if isinstance(e, Exception) or not hasattr(e, "failures"):
                raise
            raise from_dcp(e, what) from None
    return {k: v[0] for k, v in state.items()}


def read_tensors(path, keys=None) -> dict[str, torch.Tensor]:
    """The full (unsharded) tensors stored under ``keys`` (default: every tensor; keys as docs/checkpoints.md
    lists them, e.g. ``"model/model.norm.weight"``, ``"optim/exp_avg/lm_head.weight"``, ``"extra/0"``) of the
    training checkpoint at ``path``, read and CRC-checked in this process alone (no process group)."""
    record, metadata = read_record(path)
    if keys is None:
        keys = sorted(k for k, v in metadata.state_dict_metadata.items() if hasattr(v, "size"))
    return _read_full(os.path.abspath(os.fspath(path)), record, metadata, list(keys), what="read_tensors")


def stacked_of(record: dict, names) -> dict[str, tuple[str, int]]:
    """Per-expert tensor name -> ``(the stacked tensor it is written into, its expert index)`` for a family whose
    checkpoints stack their experts (gpt-oss: :func:`parallm.model.table.stacked_saves`), read from the record's
    config; ``{}`` for every other family."""
    from ...families import spec_from_config
    from ...families.registry import family_for
    from ...model.table import all_entries, stacked_saves
    if not any(r.save_fused for r in family_for(record["hf_config"]).table):
        return {}
    spec, family = spec_from_config(record["hf_config"])
    everything = all_entries(family.table, spec, task=record.get("task", "causal_lm"), pp=1)
    names = set(names)
    return {n: v for n, v in stacked_saves(everything).items() if n in names}


def checkpoint_to_hf(path, out_dir, *, dtype: torch.dtype | None = None, overwrite: bool = False,
                     max_shard_size=DEFAULT_MAX_SHARD_SIZE) -> None:
    """Turn the training checkpoint at ``path`` into an HF checkpoint directory (safetensors + index +
    config.json that transformers' ``from_pretrained`` loads), in this process alone: no process group, no
    model. ``dtype`` (default: the training dtype) float32 / bfloat16 / float16 / float64; a float32 export of
    a bf16 / fp16 run writes the fp32 master weights. Atomic and with ``overwrite`` rules as
    ``save_hf_weights``. Tensors are read one output file at a time (at most ``max_shard_size`` bytes)."""
    record, metadata = read_record(path)
    if record.get("lora") is not None:
        raise CheckpointError(f"{path} holds LoRA adapters only (base: {record['lora'].get('base')}), not a model: "
                              "load it into a model built with lora= and use parallm.save_hf_adapter (or "
                              "save_hf_weights(merged=True))")
    path = os.path.abspath(os.fspath(path))
    out_dir = os.path.abspath(os.fspath(out_dir))
    saved_dtype = getattr(torch, record["dtype"])
    dtype = dtype or saved_dtype
    names = [(n, tuple(s)) for n, s in record["tensors"]]
    masters = saved_shapes(metadata, "optim/master/")
    stored = metadata.state_dict_metadata
    # a tensor a lower-precision run kept in fp32 (the sigmoid router's weight and selection bias) stays fp32
    fp32 = {n for n, _ in names if saved_dtype != torch.float32 and stored[f"model/{n}"].properties.dtype ==
            torch.float32} if dtype.itemsize < 4 else set()
    # fp32 masters where the run has them (a trained low-precision tensor); the stored tensor elsewhere
    sources = {n: "optim/master" if dtype.itemsize >= 4 and n in masters else "model" for n, _ in names}
    stacked = stacked_of(record, [n for n, _ in names])      # gpt-oss: experts written stacked, as its checkpoints
    parts = {}
    for n, (fused, e) in stacked.items():
        parts.setdefault(fused, {})[e] = n
    outputs, seen = [], set()
    for n, shape in names:
        name = stacked[n][0] if n in stacked else n
        if name not in seen:
            seen.add(name)
            outputs.append((name, (len(parts[name]),) + shape if n in stacked else shape))
    fp32 |= {stacked[n][0] for n in fp32 if n in stacked}
    kept = dict.fromkeys(fp32, torch.float32)      # + integer tensors (DeepSeek-V4's tid2eid) in their own dtype
    kept.update({n: stored[f"model/{n}"].properties.dtype for n, _ in names
                 if not stored[f"model/{n}"].properties.dtype.is_floating_point})
    files = plan_files(outputs, dtype, parse_size(max_shard_size), fp32=kept)
    check_target(out_dir, overwrite)
    tmp = make_tmp_beside(out_dir)
    try:
        from safetensors.torch import save_file
        for f in files:
            members = {name: [parts[name][e] for e in sorted(parts[name])] if name in parts else [name]
                       for name in f["tensors"]}
            full = _read_full(path, record, metadata, [f"{sources[n]}/{n}" for ns in members.values() for n in ns],
                              what="checkpoint_to_hf")
            out = {}
            for name, ns in members.items():
                t = [cast(full[f"{sources[n]}/{n}"], kept.get(name, dtype), n, instead="export")
                     for n in ns]
                out[name] = (torch.stack(t) if name in parts else t[0]).contiguous()
            save_file(out, os.path.join(tmp, f["name"]), metadata={"format": "pt"})
        if len(files) > 1:
            weight_map = {n: f["name"] for f in files for n in f["tensors"]}
            with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as fh:
                json.dump({"metadata": {"total_size": sum(f["data_bytes"] for f in files)},
                           "weight_map": dict(sorted(weight_map.items()))}, fh, indent=2)
        config = dict(record["hf_config"])
        config["torch_dtype" if "torch_dtype" in config else "dtype"] = str(dtype).replace("torch.", "")
        with open(os.path.join(tmp, "config.json"), "w") as fh:
            json.dump(config, fh, indent=2, sort_keys=True)
        _move_into_place(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
