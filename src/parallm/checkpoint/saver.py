"""Shards -> HF tensors (the inverse of the loader), driven by the same weight table.

Three ways out:

* ``save_hf_weights(chunks)``: the full HF state dict on global rank 0. Each pipeline stage's (tp 0, dp 0) rank
  gathers its TP pieces and merges them; other stages send their tensors to rank 0 point to point.
* ``save_hf_weights(chunks, out_dir)``: a parallel write. Every rank can compute the files' layout (names, shapes
  and offsets follow from the table), so rank 0 writes the safetensors headers and sizes the files, then every
  data-parallel-rank-0 process writes the bytes of its own shards straight into their places (the
  ``shard_blocks`` layout; column slices of row-parallel tensors row by row): ``tp * pp`` writers, no gather, no
  merge copy. Files live in a temporary directory beside ``out_dir`` that is moved into place only when every
  file, the index and config.json are complete.
* ``export_hf_tensors(chunks)`` (:mod:`parallm.checkpoint.export`): the bucketed stream for weight sync.

``dtype`` conversions follow :mod:`parallm.checkpoint.cast`: converted inside the copy that moves the bytes, and a
value the target dtype cannot hold (float16 overflow) is a :class:`CheckpointError` on every rank before anything
is written or gathered.

Experts (mixture of experts): each expert-parallel rank holds its own experts, so an expert's tensors are written
by the rank of expert-data-parallel replica 0 that holds it (dense tensors by data-parallel replica 0), and the
export stream broadcasts them over the expert-parallel group first: every expert of every layer once.

Peers are found through the process groups (``get_process_group_ranks``), never by rank arithmetic.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
import warnings

import torch
import torch.distributed as dist

from ..families import family_of
from ..model.table import entry_view, expected_hf_shapes, model_entries, row_dtype, stack_experts, stacked_saves
from ..model.loaded import require_loaded
from ..parallel.errors import run_local
from ..parallel.state import ParallelDims, as_chunks, dims_of, require_initialized
from ..progress import bar
from .cast import can_overflow, check_entry_casts
from ..errors import CheckpointError
from .hf_dir import INDEX_NAME, SAFETENSORS_DTYPES, SINGLE_NAME, copy_serving_files, resolve_checkpoint

DEFAULT_MAX_SHARD_SIZE = 5 * 1024 ** 3


def parse_size(size) -> int:
    """``5 * 2**30``, ``"5GB"``, ``"500MB"``, ``"40KB"`` -> bytes (powers of 1000 for KB/MB/GB, as HF)."""
    if isinstance(size, int):
        return size
    text = str(size).strip().upper()
    for unit, mult in (("GIB", 1024 ** 3), ("MIB", 1024 ** 2), ("KIB", 1024), ("GB", 10 ** 9), ("MB", 10 ** 6),
                       ("KB", 10 ** 3), ("B", 1)):
        if text.endswith(unit):
            return int(float(text[:-len(unit)]) * mult)
    return int(text)


def _ordered_entries(chunks, layout: ParallelDims):
    """This rank's (global index, entry, chunk), in global table order."""
    mine, everything = model_entries(chunks, layout)
    order = {(e.row, e.layer): i for i, e in enumerate(everything)}
    return sorted(((order[(e.row, e.layer)], e, c) for e, c in mine), key=lambda t: t[0]), everything


def _gather_tp(param: torch.Tensor, layout: ParallelDims, dst_tp: int | None) -> list[torch.Tensor] | None:
    """Every TP rank's shard on TP rank ``dst_tp`` (None elsewhere), or on every TP rank when ``dst_tp`` is
    None."""
    if layout.tp == 1:
        return [param.detach()]
    t = param.detach().contiguous()
    if dst_tp is None:
        out = [torch.empty_like(t) for _ in range(layout.tp)]
        dist.all_gather(out, t, group=layout.tp_group)
        return out
    out = [torch.empty_like(t) for _ in range(layout.tp)] if layout.tp_rank == dst_tp else None
    dist.gather(t, out, dst=dist.get_global_rank(layout.tp_group, dst_tp), group=layout.tp_group)
    return out


def _merge_entry(entry, view, shards, *, dtype, device) -> dict[str, torch.Tensor]:
    """Every TP rank's shard -> this entry's HF tensors, on ``device`` in ``dtype`` (None: the param's).
    ``view``: :func:`entry_view`'s (tensor, layout). Never a view of the live parameter: the caller may keep the
    tensors while training changes it."""
    param, tp_layout = view
    out = {}
    if entry.row.keep_fp32 or entry.row.integer:   # fp32 (the router's selection bias) / int64 (tid2eid)
        dtype = row_dtype(entry.row, dtype)
    for name, tensor in zip(entry.hf, tp_layout.merge(shards)):
        tensor = tensor.to(device=device, dtype=dtype or tensor.dtype).contiguous()   # checked by _check_saveable
        if tensor.untyped_storage().data_ptr() == param.untyped_storage().data_ptr():
            tensor = tensor.clone()
        out[name] = tensor
    return out


def writes(entry, layout: ParallelDims) -> bool:
    """Whether this rank's TP group is the one that saves ``entry``: data-parallel (and context-parallel) replica 0
    for dense tensors, expert-data-parallel replica 0 for an expert's (every expert-parallel rank saves its own
    experts)."""
    return layout.edp_rank == 0 if entry.expert is not None else layout.dp_cp_rank == 0


def gather_stage_tensors(chunks, layout: ParallelDims, dtype=None, *, progress=None):
    """HF tensors of this rank's stage merged on its TP rank 0 (dense ones on data-parallel replica 0, experts
    on each expert-parallel rank of expert-data-parallel replica 0); {} elsewhere."""
    wanted, _ = _ordered_entries(chunks, layout)
    out = {}
    for i, entry, chunk in bar(wanted, desc="parallm save (gather)", rank=layout.rank, progress=progress):
        if not entry.row.save or not writes(entry, layout):
            continue
        view = entry_view(chunk, entry)
        shards = _gather_tp(view[0], layout, 0)
        if shards is not None:
            out.update(_merge_entry(entry, view, shards, dtype=dtype, device="cpu"))
    return out


def _collect_on_rank0(local: dict[str, torch.Tensor], layout: ParallelDims, device) -> dict[str, torch.Tensor]:
    """Stage writers (tp 0, dp 0 of each stage) hand their tensors to global rank 0 over rank 0's pp group.
    ``device``: where tensors travel (the params' device: NCCL cannot send CPU tensors). With expert
    parallelism the writers of other experts are data-parallel ranks outside that group:
    :func:`_collect_experts_on_rank0`."""
    if layout.ep > 1:
        return _collect_experts_on_rank0(local, layout, device)
    if layout.pp == 1 or layout.tp_rank != 0 or layout.dp_cp_rank != 0:
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
            dist.send(local[name].to(device), dst=0)
        return {}
    result = dict(local)
    for src, stage_meta in zip(ranks[1:], metas[1:]):
        for name, shape, dt in stage_meta:
            buf = torch.empty(shape, dtype=dt, device=device)
            dist.recv(buf, src=src)
            result[name] = buf.cpu()
    return result


def _collect_experts_on_rank0(local: dict[str, torch.Tensor], layout: ParallelDims, device):
    """Every rank's merged tensors to global rank 0, point to point: one gather of (name, shape, dtype) lists over
    the world tells rank 0 who sends what, then each sender sends its tensors in that order."""
    meta = [(k, tuple(v.shape), v.dtype) for k, v in local.items()] if layout.rank != 0 else []
    metas = [None] * layout.world if layout.rank == 0 else None
    dist.gather_object(meta, metas, dst=0)
    if layout.rank != 0:
        for name, _, _ in meta:
            dist.send(local[name].to(device), dst=0)
        return {}
    result = dict(local)
    for src, sent in enumerate(metas):
        for name, shape, dt in sent:
            buf = torch.empty(shape, dtype=dt, device=device)
            dist.recv(buf, src=src)
            result[name] = buf.cpu()
    return result


def save_hf_weights(chunks, out_dir=None, *, dtype: torch.dtype | None = None, overwrite: bool = False,
                    max_shard_size=DEFAULT_MAX_SHARD_SIZE, progress: bool | None = None, source=None,
                    merged: bool = False):
    """Gather or write the full HF checkpoint. Collective.

    ``out_dir=None``: returns ``{hf_name: cpu tensor}`` on global rank 0 (tied lm_head omitted, vocab padding
    stripped, each replicated KV head once) and ``{}`` on every other rank.

    ``out_dir`` given: writes ``model.safetensors`` (or ``model-0000k-of-0000n.safetensors`` files of at most
    ``max_shard_size`` each plus ``model.safetensors.index.json``) and ``config.json`` (architectures follow the
    task: ``*ForSequenceClassification`` with ``num_labels`` 1 for value models), in parallel from ``tp * pp``
    processes that must share the filesystem of ``out_dir``; ``dtype`` float32 / bfloat16 / float16 / float64.
    The files are written into a temporary directory beside ``out_dir`` and moved into place at the end, so an
    interrupted save leaves ``out_dir`` as it was. A non-empty ``out_dir`` is refused unless
    ``overwrite=True``. Returns None.

    Serving files: the directory also gets the source checkpoint's tokenizer, chat-template, generation and
    processor files (:data:`parallm.checkpoint.hf_dir.SERVING_FILES`: tokenizer.json, tokenizer_config.json,
    vocab / merges / sentencepiece files, generation_config.json, ...), so that an inference engine can serve
    it as it is. ``source``: the checkpoint directory or Hub id to copy them from; None (default): the
    model's own ``chunk.hf_source``, the directory or id ``build_model`` / ``load_hf_weights`` last read (a
    load from a state dict leaves it as it was); False: none copied. With no source (a model built from a
    config object and loaded from a state dict) only the weights and config.json are written: the directory
    loads with ``from_pretrained`` but has no tokenizer; pass ``source=``. An explicit ``source`` that does
    not exist is a CheckpointError on every rank before anything is written; a remembered one that has
    disappeared since is a warning, and the weights are still saved.

    ``merged=True``: a model with LoRA adapters saves ``W + B A * alpha / r`` under the base's names
    (:func:`parallm.model.layers.lora_merge.merged_weights`: merged in place, restored bit for bit afterwards).

    A model whose weights were never loaded is refused on every rank (:mod:`parallm.model.loaded`).
    """
    if merged:
        from ..model.layers.lora_merge import merged_weights
        with merged_weights(chunks):
            return save_hf_weights(chunks, out_dir, dtype=dtype, overwrite=overwrite, max_shard_size=max_shard_size,
                                   progress=progress, source=source)
    require_initialized("save_hf_weights")
    chunks = as_chunks(chunks)
    layout = dims_of(chunks)
    run_local(lambda: _check_saveable(chunks, layout, dtype), what="save_hf_weights")
    if out_dir is None:
        local = gather_stage_tensors(chunks, layout, dtype, progress=progress)
        state = _collect_on_rank0(local, layout, next(chunks[0].parameters()).device)
        if layout.rank != 0:
            return {}
        _, everything = model_entries(chunks, layout)
        return stack_experts({n: state[n] for e in everything if e.row.save for n in e.hf}, stacked_saves(everything))
    _save_dir(chunks, layout, os.path.abspath(os.fspath(out_dir)), dtype=dtype, overwrite=overwrite,
              max_shard_size=parse_size(max_shard_size), progress=progress, source=source)
    return None


def _check_saveable(chunks, layout: ParallelDims, dtype) -> None:
    """The model was loaded (:mod:`parallm.model.loaded`), and every saved parameter of this rank fits
    ``dtype`` (checked before any collective, so either is an error on every rank rather than a rank missing
    from the next gather)."""
    require_loaded(chunks, "save_hf_weights")
    if dtype is not None and any(can_overflow(p.dtype, dtype) for c in chunks for p in c.parameters()):
        check_entry_casts(model_entries(chunks, layout)[0], dtype, instead="save")


# the dtypes a weight directory may be saved in (safetensors codes from the one map in hf_dir)
_ST_DTYPES = {SAFETENSORS_DTYPES[code]: code for code in ("F64", "F32", "F16", "BF16")}
_ST_KEPT = {**_ST_DTYPES, torch.int64: "I64"}      # what a kept row may be (float32, int64: DeepSeek-V4's tid2eid)


def _held(name: str, kept, dtype: torch.dtype) -> torch.dtype:
    """A saved tensor's dtype: ``kept[name]`` (a mapping) / float32 (a set) for the kept rows, else ``dtype``."""
    if isinstance(kept, dict):
        return kept.get(name, dtype)
    return torch.float32 if name in kept else dtype


def plan_files(tensors: list[tuple[str, tuple[int, ...]]], dtype: torch.dtype, limit: int, *,
               fp32: frozenset | set = frozenset()) -> list[dict]:
    """Split ``(name, shape)`` (global order) into safetensors files of at most ``limit`` bytes and compute each
    file's header and tensor offsets; every tensor in ``dtype``, those named in ``fp32`` in float32 (a set) or in
    their dtype (a mapping name -> dtype: int64 rows too). Pure: every
    rank computes the same plan without talking to the others."""
    if dtype not in _ST_DTYPES:
        raise ValueError(f"cannot save dtype {dtype}; use one of {sorted(str(d) for d in _ST_DTYPES)}")
    groups, current, size = [], [], 0
    for name, shape in tensors:
        n = torch.empty((), dtype=_held(name, fp32, dtype)).element_size()
        for d in shape:
            n *= d
        if current and size + n > limit:
            groups.append(current)
            current, size = [], 0
        current.append((name, tuple(shape), n))
        size += n
    if current:
        groups.append(current)
    files = []
    for k, group in enumerate(groups):
        fname = SINGLE_NAME if len(groups) == 1 else f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors"
        header, offsets, pos = {"__metadata__": {"format": "pt"}}, {}, 0
        for name, shape, n in group:
            code = _ST_KEPT[_held(name, fp32, dtype)]
            header[name] = {"dtype": code, "shape": list(shape), "data_offsets": [pos, pos + n]}
            offsets[name] = (pos, shape)
            pos += n
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        base = 8 + len(raw)
        files.append({"name": fname, "header": len(raw).to_bytes(8, "little") + raw, "size": base + pos,
                      "tensors": {n: (base + off, shape) for n, (off, shape) in offsets.items()},
                      "data_bytes": pos})
    return files


def file_tensors(everything, shapes: dict) -> tuple[list[tuple[str, tuple[int, ...]]], set, dict]:
    """What a saved directory holds, in global order: ``(name, shape)`` of every saved tensor (the per-expert
    tensors of ``save_fused`` rows replaced by the stacked tensor ``[E, ...]`` they are slabs of, at the place of
    the first), the kept names' dtypes (``keep_fp32`` rows: float32, ``integer`` rows: int64), and
    :func:`~parallm.model.table.stacked_saves`."""
    stacked = stacked_saves(everything)
    out, seen, fp32 = [], set(), {}
    counts: dict[str, int] = {}
    for fused, _ in stacked.values():
        counts[fused] = counts.get(fused, 0) + 1
    for e in everything:
        if not e.row.save:
            continue
        for n in e.hf:
            name = stacked[n][0] if n in stacked else n
            if e.row.keep_fp32 or e.row.integer:
                fp32[name] = row_dtype(e.row, torch.float32)
            if name not in seen:
                seen.add(name)
                out.append((name, (counts[name],) + tuple(shapes[n]) if n in stacked else tuple(shapes[n])))
    return out, fp32, stacked


def _pwrite_all(fd: int, data, offset: int) -> None:
    view = memoryview(data).cast("B")
    while len(view):
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written


def _write_block(fd: int, start: int, hf_shape, elsize: int, block, local: torch.Tensor) -> None:
    """Write one block of this rank's shard straight into its place in the HF tensor's bytes."""
    dim, a, la, lb = block.dim, block.hf_start, block.local_start, block.local_stop
    piece = (local if local.dim() else local.reshape(1)).narrow(dim, la, lb - la).contiguous()
    if dim == 0:
        row_bytes = elsize
        for d in hf_shape[1:]:
            row_bytes *= d
        _pwrite_all(fd, piece.view(torch.uint8).numpy(), start + a * row_bytes)
        return
    row_bytes = hf_shape[1] * elsize       # a column block of a 2-D tensor: one write per row
    rows = piece.view(torch.uint8).numpy().reshape(piece.shape[0], -1)
    for i in range(rows.shape[0]):
        _pwrite_all(fd, rows[i], start + i * row_bytes + a * elsize)


def _save_dir(chunks, layout: ParallelDims, out_dir: str, *, dtype, overwrite: bool, max_shard_size: int, progress,
              source=None):
    """Every data-parallel-rank-0 process writes its own shards' bytes directly into their places in the final
    safetensors files (no TP gather, no merge copies); rank 0 lays the files out first and finishes last."""
    spec, task = chunks[0].spec, chunks[0].task
    dtype = dtype or chunks[0].config.params_dtype
    shapes = expected_hf_shapes(family_of(spec).table, spec, task=task, pp=layout.pp)
    _, everything = model_entries(chunks, layout)
    saved, fp32, stacked = file_tensors(everything, shapes)
    files = plan_files(saved, dtype, max_shard_size, fp32=fp32)
    where = {n: (f["name"], *f["tensors"][n]) for f in files for n in f["tensors"]}
    for name, (fused, e) in stacked.items():      # expert e's slab of the stacked tensor it is saved into
        fname, start, _ = where[fused]
        elsize = torch.empty((), dtype=_held(fused, fp32, dtype)).element_size()
        slab = elsize * math.prod(shapes[name])
        where[name] = (fname, start + e * slab, shapes[name])

    def prepare():
        check_target(out_dir, overwrite)
        if layout.rank != 0:
            return None
        serving[:] = [serving_source(chunks[0], source)]
        tmp = make_tmp_beside(out_dir)
        for f in files:  # headers written, files sized: writers fill in the tensor bytes at their offsets
            with open(os.path.join(tmp, f["name"]), "wb") as fh:
                fh.write(f["header"])
                fh.truncate(f["size"])
        return tmp

    serving = [None]            # rank 0: the directory the serving files come from
    shared = [run_local(prepare, what="save_hf_weights")]      # rank 0's temporary directory, to every rank
    dist.broadcast_object_list(shared, src=0)
    tmp = shared[0]
    try:
        def write():
            wanted, _ = _ordered_entries(chunks, layout)
            wanted = [(i, e, c) for i, e, c in wanted if e.row.save and writes(e, layout)]
            if wanted and not os.path.isdir(tmp):
                raise FileNotFoundError(f"rank {layout.rank} cannot see {tmp}: out_dir must be on a filesystem "
                                        "shared by all writing ranks")
            fds = {}
            try:
                for _, entry, chunk in bar(wanted, desc="parallm save", rank=layout.rank, progress=progress):
                    param, tp_layout = entry_view(chunk, entry)
                    out_dtype = row_dtype(entry.row, dtype)
                    elsize = torch.empty((), dtype=out_dtype).element_size()
                    local = param.detach().to(device="cpu", dtype=out_dtype)      # checked by _check_saveable
                    hf_shapes = [shapes[n] for n in entry.hf]
                    for block in tp_layout.blocks(layout.tp_rank, layout.tp, hf_shapes):
                        if not block.primary:
                            continue  # a replica: another rank writes these bytes
                        fname, start, hf_shape = where[entry.hf[block.source]]
                        if fname not in fds:
                            fds[fname] = os.open(os.path.join(tmp, fname), os.O_WRONLY)
                        _write_block(fds[fname], start, hf_shape, elsize, block, local)
            finally:
                for fd in fds.values():
                    os.close(fd)

        run_local(write, what="save_hf_weights")

        def finish():
            if layout.rank != 0:
                return
            if len(files) > 1:
                weight_map = {n: f["name"] for f in files for n in f["tensors"]}
                with open(os.path.join(tmp, INDEX_NAME), "w") as fh:
                    json.dump({"metadata": {"total_size": sum(f["data_bytes"] for f in files)},
                               "weight_map": dict(sorted(weight_map.items()))}, fh, indent=2)
            if serving[0] is not None:
                copy_serving_files(serving[0], tmp)
            with open(os.path.join(tmp, "config.json"), "w") as fh:
                json.dump(hf_config_dict(chunks[0], dtype), fh, indent=2, sort_keys=True, default=str)
            _move_into_place(tmp, out_dir)

        run_local(finish, what="save_hf_weights")
    except BaseException:
        if layout.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise


def serving_source(chunk, source) -> str | None:
    """The directory :func:`save_hf_weights` copies the serving files from (see its ``source``), or None."""
    if source is False:
        return None
    if source is not None:
        path = resolve_checkpoint(source)
        if not isinstance(path, (str, os.PathLike)) or not os.path.isdir(path):
            raise CheckpointError(f"save_hf_weights: source={source!r} is not a checkpoint directory (nor a Hub id "
                                  "in the local cache)")
        return os.fspath(path)
    path = getattr(chunk, "hf_source", None)
    if path is not None and not os.path.isdir(path):
        warnings.warn(f"save_hf_weights: the model's source checkpoint {path} no longer exists: its tokenizer and "
                      "generation files are not copied (pass source=)", stacklevel=4)
        return None
    return path


def check_target(out_dir: str, overwrite: bool, *, replacing: str = "") -> None:
    """An output directory may be written: it does not exist, or is empty, or ``overwrite`` (then it is
    replaced as a whole at the end). ``replacing``: said after the hint to pass ``overwrite=True``."""
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise FileExistsError(f"{out_dir} exists and is not a directory")
    if os.path.isdir(out_dir) and os.listdir(out_dir) and not overwrite:
        raise FileExistsError(f"{out_dir} is not empty; pass overwrite=True to replace it{replacing}")


def make_tmp_beside(out_dir: str) -> str:
    """A new temporary directory beside ``out_dir`` (same filesystem: :func:`_move_into_place` renames it)."""
    parent = os.path.dirname(out_dir) or "."
    os.makedirs(parent, exist_ok=True)
    return tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.parallm-tmp-", dir=parent)


def _move_into_place(tmp: str, out_dir: str) -> None:
    if os.path.isdir(out_dir):
        old = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.parallm-old-", dir=os.path.dirname(out_dir))
        os.rmdir(old)
        os.replace(out_dir, old)
        os.replace(tmp, out_dir)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, out_dir)


def hf_config_dict(chunk, dtype=None) -> dict:
    """The config.json to write next to the weights (architectures follow the task)."""
    cfg = chunk.hf_config
    d = dict(cfg) if isinstance(cfg, dict) else (cfg.to_dict() if hasattr(cfg, "to_dict") else dict(vars(cfg)))
    d = {k: v for k, v in d.items() if not k.startswith("_")}
    # the weights are written dequantised, in the model's (or the requested) dtype: an FP8 checkpoint's
    # quantization_config would make readers look for block scales that are not there
    d.pop("quantization_config", None)
    text = d.get("text_config")
    if isinstance(text, dict) and "quantization_config" in text:     # Kimi-K2.5's INT4 settings sit there
        d["text_config"] = {k: v for k, v in text.items() if k != "quantization_config"}
    family = family_of(chunk.spec)
    if chunk.task == "value":
        d["architectures"] = [family.value_architecture]
        d["num_labels"] = 1
        d.pop("id2label", None)
        d.pop("label2id", None)
    else:
        d["architectures"] = [family.causal_architecture]
    d.setdefault("model_type", chunk.spec.model_type)
    d["torch_dtype" if "torch_dtype" in d else "dtype"] = str(dtype or chunk.config.params_dtype).replace("torch.", "")
    return d
