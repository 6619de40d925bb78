"""Training checkpoints: the model and the optimizer state, written in parallel with
``torch.distributed.checkpoint`` (DCP), loadable at any other layout.

What a checkpoint directory holds

    .metadata, __{rank}_{n}.distcp   DCP's files: every tensor keyed by its global identity (below), each rank
                                     writing its own boxes of the global tensors
    parallm.json                     what the checkpoint is: format, step, the HF config (for the HF export),
                                     the layout and dtype it was saved with, the optimizer's hyperparameters,
                                     the tensor list, and a CRC-32 of every stored item and of .metadata

Keys (HF names, global shapes; vocabulary padding is never stored, replicated pieces are stored once)

    model/<hf name>              the parameters, in the model's dtype
    optim/master/<hf name>       fp32 master weights (bf16 / fp16 models only)
    optim/exp_avg/<hf name>      AdamW's moments (fp32 for bf16 / fp16 models)
    optim/exp_avg_sq/<hf name>
    optim/step/<hf name>         AdamW's step counter of the parameter holding that tensor
    extra                        the caller's ``extra`` object (pickled), as rank 0 passed it

A local parameter is a list of boxes of these tensors (:func:`parallm.checkpoint.global_view.global_slices`,
from its placement and weight-table entry); optimizer state tensors have the parameter's shape, so they are
boxed the same way. Saving offers each rank's primary boxes (DCP writes a box offered by several
data-parallel replicas once); loading asks for every box a rank holds (replicas included) and DCP reads the
overlapping parts of whatever boxes the saving layout wrote. QKV / gate-up fusions and vocabulary padding
therefore round-trip exactly across tp, pp, vpp, dp and ``shard_over_dp``. A routed expert's tensors are
their own table entries under the Hub's per-expert names (``...experts.{e}...``), so under expert parallelism
each expert-parallel rank offers the boxes of the experts it holds (its expert-data-parallel replicas offer the
same boxes, written once), and a load at another ``ep`` asks for the experts it holds now: checkpoints move
between ep values like between tp values.

Atomic saves: everything is written into a temporary directory beside the target, which replaces the target
only after every rank's bytes, the DCP metadata and parallm.json are complete (the ``overwrite`` rules of
``save_hf_weights``). Asynchronous saves (``async_save=True``) use DCP's ``async_save`` on a dedicated gloo
process group, so the background thread's collectives never interleave with training's collectives on the
default group.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import threading
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from ..errors import CheckpointError, ParallelError
from ..families import family_of
from ..model.decoder import as_chunks
from ..model.table import expected_hf_shapes
from ..parallel.errors import agree, gather_objects, lost_peer_error, raise_failures, run_local, status_of
from ..parallel.state import DEFAULT_TIMEOUT_S, _GROUP_CACHE, dims_of, require_initialized
from ..parallel.grads import LOW_PRECISION
from ..train.optim import ParallelAdamW
from .cast import cast
from .dcp_io import (METADATA_FILE, BoxLoadPlanner, Boxes, BoxSavePlanner, VerifyingReader, check_files,
                     file_crc, item_crcs)
from .global_view import global_slices, uncovered_rows
from .loader import model_entries
from .saver import (DEFAULT_MAX_SHARD_SIZE, _move_into_place, check_target, hf_config_dict, make_tmp_beside,
                    parse_size, plan_files)

META_NAME = "parallm.json"
FORMAT = "parallm-training-checkpoint"
VERSION = 1
MOMENTS = ("exp_avg", "exp_avg_sq")

_PENDING: list["AsyncCheckpointSave"] = []


# -- what a rank offers / asks for ---------------------------------------------------------------------------

def _model_layout(chunks, dims):
    spec, task = chunks[0].spec, chunks[0].task
    shapes = expected_hf_shapes(family_of(spec).table, spec, task=task, pp=dims.pp)
    mine, everything = model_entries(chunks, dims)
    saved = [(n, shapes[n]) for e in everything if e.row.save for n in e.hf]
    return shapes, mine, saved


def _check_optimizer(optimizer, chunks) -> None:
    if optimizer is None:
        return
    if not isinstance(optimizer, ParallelAdamW):
        raise TypeError(f"optimizer must be what parallm.build_optimizer returned, got {type(optimizer).__name__}")
    params = {p for c in chunks for p in c.parameters()}
    if set(optimizer.names) != params:
        raise ValueError("the optimizer was built for other chunks than the ones passed (build it from these "
                         "chunks with parallm.build_optimizer)")


def _save_state(dims, optimizer, extra, shapes, mine):
    """(state dict of boxed tensor lists, Boxes): this rank's primary boxes of every saved tensor."""
    state, boxes = {}, Boxes()

    def offer(key, piece, tensor):
        boxes.add(key, piece.shape, piece.offsets)
        state.setdefault(key, []).append(piece.local(tensor.detach()))

    for entry, chunk in mine:
        if not entry.row.save:
            continue
        param = chunk.get_parameter(entry.local)
        for piece in global_slices(entry, param, dims, shapes):
            if piece.primary:
                offer(f"model/{piece.name}", piece, param)
    if optimizer is not None:
        optimizer.sync_masters()
        for param, st in optimizer.owned():
            entry = optimizer.entries[param]
            if not entry.row.save:
                continue
            for piece in global_slices(entry, param, dims, shapes):
                if piece.primary:
                    for k in MOMENTS + (("master",) if "master" in st else ()):
                        offer(f"optim/{k}/{piece.name}", piece, st[k])
            for name in entry.hf:
                state[f"optim/step/{name}"] = st["step"]
    if dims.rank == 0:
        state["extra"] = pickle.dumps(extra)
    return state, boxes


def _record(chunks, dims, optimizer, step, saved) -> dict:
    """parallm.json without the CRCs."""
    dtype = chunks[0].config.params_dtype
    return {
        "format": FORMAT, "version": VERSION, "step": step,
        "task": chunks[0].task, "dtype": str(dtype).replace("torch.", ""),
        "hf_config": hf_config_dict(chunks[0], dtype),
        "saved_with": {"tp": dims.tp, "pp": dims.pp, "vpp": dims.vpp, "dp": dims.dp, "ep": dims.ep,
                       "shard_over_dp": bool(optimizer is not None and optimizer.shard_over_dp)},
        "optimizer": None if optimizer is None else {
            "kind": "AdamW", "master_weights": dtype in LOW_PRECISION,
            "param_groups": optimizer.hyperparameters()},
        "tensors": [[n, list(s)] for n, s in saved],
    }


# -- finishing a save (sync or async) ------------------------------------------------------------------------

def _dcp_failure(e: BaseException, what: str, *, abort: bool = True) -> Exception:
    """What a collective DCP call's exception means, on every rank: a ``KeyboardInterrupt`` is re-raised; a bare
    RuntimeError is one of DCP's collectives failing, i.e. a lost peer (raised, see :func:`lost_peer_error`);
    anything else (DCP reports a rank's own failure as a CheckpointException on every rank) is returned as
    parallm's error (:func:`_from_dcp`)."""
    if isinstance(e, KeyboardInterrupt):
        raise e
    if getattr(e, "failures", None) is None and type(e) is RuntimeError:
        raise lost_peer_error(e, what, abort=abort) from e
    return _from_dcp(e, what)


def _finish(metadata, error, *, group, tmp, path, record, what, abort):
    """Every rank: CRCs of the items it wrote; rank 0: parallm.json and the move into place. Collective over
    ``group``. A failure anywhere (``error`` from the DCP save included) raises on every rank; the temporary
    directory is then removed."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    crcs = None
    if error is None:
        try:
            crcs = item_crcs(tmp, metadata, rank=rank, world=world)
        except Exception as e:  # noqa: BLE001 - every rank hears of it below
            error = e
    gathered = gather_objects((status_of(error), crcs), what=what, group=group, abort=abort)
    raise_failures([s for s, _ in gathered], what=what, group=group)
    done = [None]
    if rank == 0:
        try:
            crcs = {}
            for _, mine in gathered:
                crcs.update(mine)
            record = dict(record, crc32={"items": crcs, "metadata": file_crc(os.path.join(tmp, METADATA_FILE))})
            with open(os.path.join(tmp, META_NAME), "w") as f:
                json.dump(record, f, indent=1)
                f.flush()
                os.fsync(f.fileno())
            _move_into_place(tmp, path)
        except Exception as e:  # noqa: BLE001
            done = [status_of(e)]
    src = dist.get_global_rank(group, 0) if group is not None else 0
    try:
        dist.broadcast_object_list(done, src=src, group=group)
    except Exception as e:  # noqa: BLE001
        raise lost_peer_error(e, what, abort=abort) from e
    raise_failures(done, what=what, group=group)


def _from_dcp(e: BaseException, what: str) -> Exception:
    """A DCP CheckpointException (a BaseException listing each failing rank's exception) as a parallm error
    naming the first failure."""
    failures = getattr(e, "failures", None)
    if not failures:
        return e if isinstance(e, Exception) else ParallelError(f"{what}: {type(e).__name__}: {e}")
    rank, (inner, _) = sorted(failures.items())[0]
    more = f" (and {len(failures) - 1} more rank(s))" if len(failures) > 1 else ""
    etype = type(inner) if isinstance(inner, (CheckpointError, OSError, ValueError)) else ParallelError
    try:
        return etype(f"{what} failed on rank {rank}{more}: {inner}")
    except Exception:  # noqa: BLE001 - an exception type with another constructor
        return ParallelError(f"{what} failed on rank {rank}{more}: {type(inner).__name__}: {inner}")


class AsyncCheckpointSave:
    """Handle of an asynchronous :func:`save_checkpoint`. The state was copied to CPU memory before
    ``save_checkpoint`` returned; a background thread writes it, then (collectively over a dedicated gloo group)
    finishes the checkpoint and moves it into place. Training may go on meanwhile.

    ``wait()`` blocks until the checkpoint is complete at its path (or raises the save's error, on every
    rank); ``done()`` polls. The next ``save_checkpoint`` / ``load_checkpoint`` waits for it first; wait for the
    last one before the process exits (the thread is a daemon)."""

    def __init__(self, path: str, tmp: str | None, future, finish):
        self.path = path
        self._tmp = tmp   # rank 0: removed if the save fails
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(future, finish), daemon=True,
                                        name="parallm-async-checkpoint")
        self._thread.start()

    def _run(self, future, finish):
        try:
            try:
                metadata, error = future.result(), None
            except BaseException as e:  # noqa: BLE001
                metadata, error = None, _dcp_failure(e, "save_checkpoint (async)", abort=False)
            finish(metadata, error)
        except BaseException as e:  # noqa: BLE001 - handed to wait()
            self._error = e
            if self._tmp is not None:
                shutil.rmtree(self._tmp, ignore_errors=True)

    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"the asynchronous save to {self.path} is still running after {timeout} s")
        if self in _PENDING:
            _PENDING.remove(self)
        if self._error is not None:
            error, self._error = self._error, None
            raise error


def wait_for_pending_saves() -> None:
    """Wait for every asynchronous save this process started (raises the first one's error)."""
    while _PENDING:
        _PENDING[0].wait()


def _async_group():
    """A gloo group over the whole world for the asynchronous saves' collectives (created once per
    ``init_parallel``; creating it is collective)."""
    key = ("async-checkpoint",)
    if key not in _GROUP_CACHE:
        _GROUP_CACHE[key] = dist.new_group(backend="gloo", timeout=timedelta(seconds=DEFAULT_TIMEOUT_S))
    return _GROUP_CACHE[key]


def save_checkpoint(path, chunks, optimizer=None, *, step: int, extra=None, overwrite: bool = False,
                    async_save: bool = False):
    """Write a training checkpoint of ``chunks`` (and ``optimizer``'s state) to directory ``path``. Collective.

    Each rank writes its own boxes of the global tensors (module docstring); ``step`` (an int) and ``extra``
    (any picklable object, rank 0's is kept) come back from :func:`load_checkpoint`. The directory appears
    complete or not at all: it is written beside ``path`` and moved into place at the end, so a save that fails
    or is killed midway leaves an older checkpoint at ``path`` untouched. A non-empty ``path`` is refused unless
    ``overwrite=True``. ``async_save=True`` returns an :class:`AsyncCheckpointSave` once the state is copied to
    CPU memory (call ``.wait()`` before relying on the files); otherwise returns None when the files are in
    place.
    """
    path, chunks, dims = _begin("save_checkpoint", path, chunks)

    def check():
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        _check_optimizer(optimizer, chunks)
        pickle.dumps(extra)
        check_target(path, overwrite, replacing=" (the new checkpoint replaces it atomically once complete)")

    run_local(check, what="save_checkpoint")
    box = [run_local(lambda: make_tmp_beside(path) if dims.rank == 0 else None, what="save_checkpoint")]
    dist.broadcast_object_list(box, src=0)
    tmp = box[0]
    shapes, mine, saved = _model_layout(chunks, dims)
    try:
        state, boxes = run_local(lambda: _save_state(dims, optimizer, extra, shapes, mine),
                                 what="save_checkpoint")
        record = _record(chunks, dims, optimizer, step, saved) if dims.rank == 0 else None
        writer = FileSystemWriter(tmp, sync_files=True)
        planner = BoxSavePlanner(boxes)
        if async_save:
            group = _async_group()
            future = dcp.async_save(state, storage_writer=writer, planner=planner, process_group=group)
            handle = AsyncCheckpointSave(path, tmp if dims.rank == 0 else None, future, lambda md, err: _finish(
                md, err, group=group, tmp=tmp, path=path, record=record, what="save_checkpoint (async)",
                abort=False))
            _PENDING.append(handle)
            return handle
        try:
            metadata, error = dcp.save(state, storage_writer=writer, planner=planner), None
        except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
            metadata, error = None, _dcp_failure(e, "save_checkpoint")
        _finish(metadata, error, group=None, tmp=tmp, path=path, record=record, what="save_checkpoint",
                abort=True)
    except BaseException:
        if dims.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return None


# -- reading ----------------------------------------------------------------------------------------------------

def read_record(path: str):
    """(parallm.json, DCP metadata) of checkpoint directory ``path``, both checked (no process group)."""
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
    if record.get("version") != VERSION:
        raise CheckpointError(f"{meta_path}: format version {record.get('version')} (this parallm reads "
                              f"{VERSION})")
    lacking = [k for k in ("step", "dtype", "hf_config", "optimizer", "tensors", "crc32") if k not in record]
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


def _saved_shapes(metadata, prefix: str) -> dict[str, tuple[int, ...]]:
    return {k[len(prefix):]: tuple(v.size) for k, v in metadata.state_dict_metadata.items()
            if k.startswith(prefix) and hasattr(v, "size")}


def _check_against(record, metadata, path, saved, optimizer) -> bool:
    """The checkpoint holds this model's tensors (names and shapes) and, when ``optimizer`` is given, optimizer
    state for each. Returns whether it has fp32 master weights."""
    present = _saved_shapes(metadata, "model/")
    expected = dict(saved)
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
            lacking = sorted(set(expected) - set(_saved_shapes(metadata, f"optim/{k}/")))
            if lacking:
                raise CheckpointError(f"{path}: optimizer state optim/{k} is missing for {', '.join(lacking[:8])}")
    masters = _saved_shapes(metadata, "optim/master/")
    return bool(masters) and set(masters) >= set(expected)


def _load_targets(dims, optimizer, shapes, mine, has_master):
    """Planner targets: every box of every parameter (and of this rank's optimizer state), vocabulary padding
    rows zeroed. A full-precision parameter reads the fp32 master weights when the checkpoint has them."""
    targets: dict = {}

    def want(key, piece, tensor):
        targets.setdefault(key, {}).setdefault(piece.offsets, []).append(piece.local(tensor.detach()))

    with torch.no_grad():
        for entry, chunk in mine:
            param = chunk.get_parameter(entry.local)
            pieces = global_slices(entry, param, dims, shapes)
            src = "optim/master" if has_master and param.dtype not in LOW_PRECISION else "model"
            for piece in pieces:
                want(f"{src}/{piece.name}", piece, param)
            pad = uncovered_rows(param, pieces)
            if pad:
                param.detach()[param.shape[0] - pad:].zero_()
        steps = []
        if optimizer is not None:
            for param, st in optimizer.owned():
                entry = optimizer.entries[param]
                pieces = global_slices(entry, param, dims, shapes)
                for piece in pieces:
                    for k in MOMENTS:
                        want(f"optim/{k}/{piece.name}", piece, st[k])
                    if "master" in st:
                        want(f"{'optim/master' if has_master else 'model'}/{piece.name}", piece, st["master"])
                pad = uncovered_rows(param, pieces)
                if pad:
                    for t in st.values():
                        if torch.is_tensor(t) and t.dim():
                            t[t.shape[0] - pad:].zero_()
                targets.setdefault(f"optim/step/{entry.hf[0]}", []).append(st["step"])
                steps.append(param)
    targets["extra"] = None
    return targets, steps


def load_checkpoint(path, chunks, optimizer=None) -> dict:
    """Fill every parameter of ``chunks`` (and ``optimizer``'s state, hyperparameters included) from the training
    checkpoint at ``path``, whatever layout saved it. Collective. Returns ``{"step": int, "extra": object}``.

    Errors, on every rank, naming the tensor or file: a checkpoint of another model (tensor names or shapes
    differ), an ``optimizer`` when the checkpoint holds no optimizer state, a missing, truncated or corrupted
    file (every item's CRC-32 is checked as it is read).
    """
    path, chunks, dims = _begin("load_checkpoint", path, chunks)
    shapes, mine, saved = _model_layout(chunks, dims)

    def preflight():
        _check_optimizer(optimizer, chunks)
        record, metadata = read_record(path)
        has_master = _check_against(record, metadata, path, saved, optimizer)
        return record, has_master

    record, has_master = run_local(preflight, what="load_checkpoint")
    targets, stepped = _load_targets(dims, optimizer, shapes, mine, has_master)
    planner = BoxLoadPlanner(targets)
    try:
        dcp.load({k: v for k, v in targets.items() if v is not None} | {"extra": b""},
                 storage_reader=VerifyingReader(path, record["crc32"]["items"]), planner=planner)
        error = None
    except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        error = _dcp_failure(e, "load_checkpoint")
    agree(error, what="load_checkpoint")
    if optimizer is not None:
        for param in stepped:
            optimizer.mark_master_loaded(param)
        optimizer.set_hyperparameters(record["optimizer"]["param_groups"])
    return {"step": record["step"], "extra": pickle.loads(planner.bytes["extra"])}


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
                     planner=BoxLoadPlanner(state), no_dist=True)
        except BaseException as e:
            if isinstance(e, Exception) or not hasattr(e, "failures"):
                raise
            raise _from_dcp(e, what) from None
    return {k: v[0] for k, v in state.items()}


def read_tensors(path, keys=None) -> dict[str, torch.Tensor]:
    """The full (unsharded) tensors stored under ``keys`` (default: every tensor; keys as in the module
    docstring, e.g. ``"model/model.norm.weight"``, ``"optim/exp_avg/lm_head.weight"``) of the training
    checkpoint at ``path``, read and CRC-checked in this process alone (no process group)."""
    record, metadata = read_record(path)
    if keys is None:
        keys = sorted(k for k, v in metadata.state_dict_metadata.items() if hasattr(v, "size"))
    return _read_full(os.path.abspath(os.fspath(path)), record, metadata, list(keys), what="read_tensors")


# -- offline HF export ------------------------------------------------------------------------------------------

def checkpoint_to_hf(path, out_dir, *, dtype: torch.dtype | None = None, overwrite: bool = False,
                     max_shard_size=DEFAULT_MAX_SHARD_SIZE) -> None:
    """Turn the training checkpoint at ``path`` into an HF checkpoint directory (safetensors + index +
    config.json that transformers' ``from_pretrained`` loads), in this process alone: no process group, no
    model. ``dtype`` (default: the training dtype) float32 / bfloat16 / float16 / float64; a float32 export of
    a bf16 / fp16 run writes the fp32 master weights. Atomic and with ``overwrite`` rules as
    ``save_hf_weights``. Tensors are read one output file at a time (at most ``max_shard_size`` bytes)."""
    record, metadata = read_record(path)
    path = os.path.abspath(os.fspath(path))
    out_dir = os.path.abspath(os.fspath(out_dir))
    saved_dtype = getattr(torch, record["dtype"])
    dtype = dtype or saved_dtype
    names = [(n, tuple(s)) for n, s in record["tensors"]]
    masters = _saved_shapes(metadata, "optim/master/")
    src = "optim/master" if dtype.itemsize >= 4 and all(n in masters for n, _ in names) else "model"
    files = plan_files(names, dtype, parse_size(max_shard_size))
    check_target(out_dir, overwrite)
    tmp = make_tmp_beside(out_dir)
    try:
        from safetensors.torch import save_file
        for f in files:
            full = _read_full(path, record, metadata, [f"{src}/{name}" for name in f["tensors"]],
                              what="checkpoint_to_hf")
            out = {name: cast(full[f"{src}/{name}"], dtype, name, instead="export").contiguous()
                   for name in f["tensors"]}
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


def _begin(what: str, path, chunks):
    """What a save and a load start with: the process groups, the chunks and their layout, earlier async saves
    finished; ``(path, chunks, dims)`` with the path made absolute."""
    require_initialized(what)
    chunks = as_chunks(chunks)
    dims = dims_of(chunks)
    wait_for_pending_saves()
    return os.path.abspath(os.fspath(path)), chunks, dims
