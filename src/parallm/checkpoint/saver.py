"""Shards -> HF tensors (the inverse of the loader), driven by the same weight table.

Each pipeline stage's (tp 0, dp 0) rank gathers its TP pieces and merges them into HF tensors; stages other than
rank 0's send them to global rank 0 point to point, one tensor at a time. Peers are found through the process
groups (``get_process_group_ranks``), never by rank arithmetic.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from ..families import family_of
from ..parallel.errors import run_local
from ..parallel.state import Layout, require_initialized
from .loader import _as_chunks, model_entries
from .transforms import merge_shards


def _gather_tp(param: torch.Tensor, layout: Layout) -> list[torch.Tensor] | None:
    """Every TP rank's shard on TP rank 0 (None elsewhere)."""
    if layout.tp == 1:
        return [param.detach()]
    t = param.detach().contiguous()
    dst = dist.get_global_rank(layout.tp_group, 0)
    out = [torch.empty_like(t) for _ in range(layout.tp)] if layout.tp_rank == 0 else None
    dist.gather(t, out, dst=dst, group=layout.tp_group)
    return out


def gather_stage_tensors(chunks, layout: Layout, dtype=None) -> dict[str, torch.Tensor]:
    """HF tensors of this stage on its (tp 0, dp 0) rank, in global table order; {} on other ranks."""
    if layout.dp_rank != 0:
        return {}
    spec = chunks[0].spec
    mine, everything = model_entries(chunks, layout)
    order = {(e.row, e.layer): i for i, e in enumerate(everything)}
    mine.sort(key=lambda ec: order[(ec[0].row, ec[0].layer)])
    out = {}
    for entry, chunk in mine:
        if not entry.row.save:
            continue
        param = chunk.get_parameter(entry.local)
        shards = _gather_tp(param, layout)
        if shards is None:
            continue
        if entry.kind == "copy":
            shards = shards[:1]
        for name, tensor in zip(entry.hf, merge_shards(entry.kind, shards, spec)):
            tensor = tensor.to(device="cpu", dtype=dtype or tensor.dtype).contiguous()
            if tensor.untyped_storage().data_ptr() == param.untyped_storage().data_ptr():
                tensor = tensor.clone()  # never hand out a view of a live parameter
            out[name] = tensor
    return out


def _collect_on_rank0(local: dict[str, torch.Tensor], layout: Layout) -> dict[str, torch.Tensor]:
    """Stage writers (tp 0, dp 0 of each stage) hand their tensors to global rank 0 over rank 0's pp group."""
    if layout.pp == 1 or layout.tp_rank != 0 or layout.dp_rank != 0:
        return local if layout.rank == 0 else {}
    group = layout.pp_group
    ranks = dist.get_process_group_ranks(group)
    if ranks[0] != 0:
        raise RuntimeError(f"rank 0 is not pipeline stage 0 of its pipeline group {ranks}")
    meta = [(k, tuple(v.shape), v.dtype) for k, v in local.items()]
    metas = [None] * len(ranks) if layout.rank == 0 else None
    dist.gather_object(meta, metas, dst=0, group=group)
    if layout.rank != 0:
        for name, _, _ in meta:
            dist.send(local[name], dst=0)
        return {}
    result = dict(local)
    for src, stage_meta in zip(ranks[1:], metas[1:]):
        for name, shape, dt in stage_meta:
            buf = torch.empty(shape, dtype=dt)
            dist.recv(buf, src=src)
            result[name] = buf
    return result


def save_hf_weights(chunks, out_dir=None, *, dtype: torch.dtype | None = None, overwrite: bool = False):
    """Gather the full HF state dict. Collective.

    ``out_dir=None``: returns ``{hf_name: cpu tensor}`` on global rank 0 (tied lm_head omitted, vocab padding
    stripped, each replicated KV head once) and ``{}`` on every other rank. With ``out_dir``: rank 0 writes an HF
    directory (``model.safetensors`` + ``config.json``) that ``from_pretrained`` loads, via a temporary directory
    moved into place at the end; a non-empty ``out_dir`` is refused unless ``overwrite=True``. Returns None.
    """
    require_initialized("save_hf_weights")
    chunks = _as_chunks(chunks)
    layout = Layout()
    if out_dir is not None:
        out_dir = os.path.abspath(os.fspath(out_dir))

        def check_target():
            if os.path.isdir(out_dir) and os.listdir(out_dir) and not overwrite:
                raise FileExistsError(f"{out_dir} is not empty; pass overwrite=True to replace it")
        run_local(check_target, what="save_hf_weights")
    local = gather_stage_tensors(chunks, layout, dtype)
    state = _collect_on_rank0(local, layout)
    if layout.rank == 0:
        _, everything = model_entries(chunks, layout)
        names = [n for e in everything if e.row.save for n in e.hf]
        state = {n: state[n] for n in names}
    if out_dir is None:
        return state
    run_local(lambda: _write_dir(state, out_dir, chunks[0]) if layout.rank == 0 else None,
              what="save_hf_weights")
    return None


def hf_config_dict(chunk) -> dict:
    """The config.json to write next to the weights (architectures follow the task)."""
    cfg = chunk.hf_config
    d = dict(cfg) if isinstance(cfg, dict) else (cfg.to_dict() if hasattr(cfg, "to_dict") else dict(vars(cfg)))
    d = {k: v for k, v in d.items() if not k.startswith("_")}
    family = family_of(chunk.spec)
    if chunk.task == "value":
        d["architectures"] = [family.value_architecture]
        d["num_labels"] = 1
        d.pop("id2label", None)
        d.pop("label2id", None)
    else:
        d["architectures"] = [family.causal_architecture]
    d.setdefault("model_type", chunk.spec.model_type)
    return d


def _write_dir(state: dict[str, torch.Tensor], out_dir: str, chunk) -> None:
    parent = os.path.dirname(out_dir) or "."
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.parallm-tmp-", dir=parent)
    try:
        save_file(state, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(hf_config_dict(chunk), f, indent=2, sort_keys=True, default=str)
        if os.path.isdir(out_dir):
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
