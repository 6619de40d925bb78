"""``save_checkpoint``: each rank's primary slices of the global tensors written by DCP into a temporary directory
beside the target, then (collectively) the CRCs gathered, ``parallm.json`` written and the directory moved into
place; in the background for an asynchronous save."""

from __future__ import annotations

import shutil

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from ...model.loaded import require_loaded
from ...parallel.errors import gather_objects, lost_peer_error, raise_failures, run_local, status_of
from ..dcp_io import SliceSavePlanner, SliceTable, dcp_failure, item_crcs
from ..global_view import global_slices
from ..saver import _move_into_place, check_target, make_tmp_beside
from .extra import encode_extra
from .pending import AsyncCheckpointSave, async_group
from .record import MOMENTS, make_record, write_record
from .start import begin, check_optimizer, entries_by_param, lora_record, model_layout


def _save_state(dims, optimizer, shapes, mine, extra_tensors):
    """(state dict of slice lists and plain tensors, SliceTable): this rank's primary slices of every saved
    tensor, its optimizer step counters, and (rank 0) extra's tensors."""
    state, slices = {}, SliceTable()

    def offer(key, piece, tensor):
        slices.add(key, piece.shape, piece.offsets)
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
        entries = entries_by_param(mine)
        for param, st in optimizer.owned():
            for entry in entries[param]:
                if not entry.row.save:
                    continue
                for piece in global_slices(entry, param, dims, shapes):
                    if piece.primary:
                        for k in MOMENTS + (("master",) if "master" in st else ()):
                            offer(f"optim/{k}/{piece.name}", piece, st[k])
                for name in entry.hf:       # a stacked expert parameter's one counter, under each expert's names
                    state[f"optim/step/{name}"] = st["step"]
    if dims.rank == 0:
        state.update(extra_tensors)
    return state, slices


def _finish(metadata, error, *, group, tmp, path, record, what, abort):
    """Every rank: CRCs of the items it wrote; rank 0: parallm.json and the move into place. Collective over
    ``group``. A failure anywhere (``error`` from the DCP save included) raises on every rank; the temporary
    directory is then removed (by the caller)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    crcs = None
    if error is None:
        try:
            crcs = item_crcs(tmp, metadata, rank=rank, world=world)
        except Exception as e:  # noqa: BLE001 - every rank hears of it below
            error = e
    gathered = gather_objects((status_of(error), crcs), what=what, group=group, abort=abort)
    raise_failures([s for s, _ in gathered], what=what, group=group)
    outcome = [None]   # rank 0's status, broadcast
    if rank == 0:
        try:
            every = {}
            for _, mine in gathered:
                every.update(mine)
            write_record(tmp, record, every)
            _move_into_place(tmp, path)
        except Exception as e:  # noqa: BLE001
            outcome = [status_of(e)]
    src = dist.get_global_rank(group, 0) if group is not None else 0
    try:
        dist.broadcast_object_list(outcome, src=src, group=group)
    except Exception as e:  # noqa: BLE001
        raise lost_peer_error(e, what, abort=abort) from e
    raise_failures(outcome, what=what, group=group)


def save_checkpoint(path, chunks, optimizer=None, *, step: int, extra=None, overwrite: bool = False,
                    async_save: bool = False):
    """Write a training checkpoint of ``chunks`` (and ``optimizer``'s state) to directory ``path``. Collective.

    Each rank writes its own slices of the global tensors (docs/checkpoints.md); ``step`` (an int) and ``extra``
    come back from :func:`load_checkpoint`. ``extra``: a JSON value (dicts with string keys, lists, str, int,
    float, bool, None) that may hold tensors anywhere; rank 0's is kept. Anything else (a tuple, a set, an
    object) is refused on every rank, naming where it sits: ``extra`` is stored as JSON, never pickled. The
    directory appears complete or not at all: it is written beside ``path`` and moved into place at the end, so
    a save that fails or is killed midway leaves an older checkpoint at ``path`` untouched. A non-empty ``path``
    is refused unless ``overwrite=True``. ``async_save=True`` returns an :class:`AsyncCheckpointSave` once the
    state is copied to CPU memory (call ``.wait()`` before relying on the files; ``parallm.destroy_parallel``
    waits for it too); otherwise returns None when the files are in place. A model whose weights were never
    loaded is refused on every rank (:mod:`parallm.model.loaded`).
    """
    path, chunks, dims = begin("save_checkpoint", path, chunks)

    def check():
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        check_optimizer(optimizer, chunks)
        encoded = encode_extra(extra)
        check_target(path, overwrite, replacing=" (the new checkpoint replaces it atomically once complete)")
        require_loaded(chunks, "save_checkpoint")
        return encoded

    extra_entry, extra_tensors = run_local(check, what="save_checkpoint")
    tmp_of_rank0 = [run_local(lambda: make_tmp_beside(path) if dims.rank == 0 else None, what="save_checkpoint")]
    dist.broadcast_object_list(tmp_of_rank0, src=0)
    tmp = tmp_of_rank0[0]
    shapes, mine, saved = model_layout(chunks, dims)
    try:
        state, slices = run_local(lambda: _save_state(dims, optimizer, shapes, mine, extra_tensors),
                                  what="save_checkpoint")
        record = make_record(chunks, dims, optimizer, step, saved, extra_entry) if dims.rank == 0 else None
        if record is not None and lora_record(chunks) is not None:
            record["lora"] = lora_record(chunks)          # adapters only, and the base they sit on
        writer = FileSystemWriter(tmp, sync_files=True)
        planner = SliceSavePlanner(slices)
        if async_save:
            group = async_group()
            future = dcp.async_save(state, storage_writer=writer, planner=planner, process_group=group)
            return AsyncCheckpointSave(path, tmp if dims.rank == 0 else None, future, lambda md, err: _finish(
                md, err, group=group, tmp=tmp, path=path, record=record, what="save_checkpoint (async)",
                abort=False))
        try:
            metadata, error = dcp.save(state, storage_writer=writer, planner=planner), None
        except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
            metadata, error = None, dcp_failure(e, "save_checkpoint")
        _finish(metadata, error, group=None, tmp=tmp, path=path, record=record, what="save_checkpoint",
                abort=True)
    except BaseException:
        if dims.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return None
