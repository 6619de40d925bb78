"""``load_checkpoint``: every rank asks DCP for every slice it holds (replicas included) and reads the
overlapping parts of whatever slices the saving layout wrote, each item CRC-checked as it is read."""

from __future__ import annotations

import os

import torch
import torch.distributed.checkpoint as dcp

from ...parallel.errors import agree, run_local
from ...model.loaded import mark_loaded
from ...model.params import LOW_PRECISION
from ..dcp_io import SliceLoadPlanner, VerifyingReader, dcp_failure
from ..global_view import global_slices, uncovered_rows
from .extra import decode_extra
from .record import META_NAME, MOMENTS, check_against, check_loadable, read_record
from .start import begin, check_lora_record, check_optimizer, entries_by_param, model_layout, trained_names


def _load_targets(dims, optimizer, shapes, mine, masters):
    """Planner targets: every slice of every parameter (and of this rank's optimizer state), vocabulary padding
    rows zeroed. A full-precision parameter reads the fp32 master weights when the checkpoint has them
    (``masters``: the HF names that have them).
    Returns ``(targets, params whose optimizer state is read)``."""
    targets: dict = {}

    def want(key, piece, tensor):
        targets.setdefault(key, {}).setdefault(piece.offsets, []).append(piece.local(tensor.detach()))

    with torch.no_grad():
        for entry, chunk in mine:
            param = chunk.get_parameter(entry.local)
            pieces = global_slices(entry, param, dims, shapes)
            for piece in pieces:
                src = "optim/master" if piece.name in masters and param.dtype not in LOW_PRECISION else "model"
                want(f"{src}/{piece.name}", piece, param)
            pad = uncovered_rows(param, pieces)
            if pad:
                param.detach()[param.shape[0] - pad:].zero_()
        stepped = []
        if optimizer is not None:
            entries = entries_by_param(mine)
            for param, st in optimizer.owned():
                pieces = [piece for entry in entries[param] for piece in global_slices(entry, param, dims, shapes)]
                for piece in pieces:
                    for k in MOMENTS:
                        want(f"optim/{k}/{piece.name}", piece, st[k])
                    if "master" in st:
                        want(f"{'optim/master' if piece.name in masters else 'model'}/{piece.name}", piece,
                             st["master"])
                pad = uncovered_rows(param, pieces)
                if pad:
                    for t in st.values():
                        if torch.is_tensor(t) and t.dim():
                            t[t.shape[0] - pad:].zero_()
                # one counter per parameter (a stacked expert parameter's experts all stored the same one)
                targets.setdefault(f"optim/step/{entries[param][0].hf[0]}", []).append(st["step"])
                stepped.append(param)
    return targets, stepped


def load_checkpoint(path, chunks, optimizer=None) -> dict:
    """Fill every parameter of ``chunks`` (and ``optimizer``'s state, hyperparameters included) from the training
    checkpoint at ``path``, whatever layout saved it. Collective. Returns ``{"step": int, "extra": object}``:
    ``extra`` as rank 0 saved it, on every rank (its tensors on the CPU).

    Nothing in the checkpoint is unpickled but DCP's own ``.metadata`` file: load only checkpoints from a source
    you trust (docs/checkpoints.md). Errors, on every rank, naming the tensor or file: a checkpoint of another
    model (tensor names or shapes differ), an ``optimizer`` when the checkpoint holds no optimizer state, a
    missing, truncated or corrupted file (every item's CRC-32 is checked as it is read), a checkpoint of the
    older format that pickled ``extra``, or one holding an item that is not a tensor.

    A full checkpoint marks the chunks loaded (:mod:`parallm.model.loaded`); a LoRA one (adapters only) leaves
    the mark as it was: load the base with ``load_hf_weights`` as well. A failure while the parameters are being
    read marks them not loaded.
    """
    path, chunks, dims = begin("load_checkpoint", path, chunks)
    shapes, mine, saved = model_layout(chunks, dims)

    def preflight():
        check_optimizer(optimizer, chunks)
        record, metadata = read_record(path)
        check_lora_record(record, chunks, path)
        extra_keys = check_loadable(record, metadata, path)
        has_master = check_against(record, metadata, path, saved, optimizer, trained_names(chunks, dims))
        tensors = {k: torch.empty(tuple(metadata.state_dict_metadata[k].size),
                                  dtype=metadata.state_dict_metadata[k].properties.dtype) for k in extra_keys}
        # extra with its (still empty) tensors in place: dcp.load below fills them
        extra = decode_extra(record["extra"], tensors, where_=os.path.join(path, META_NAME))
        return record, has_master, extra, tensors

    record, has_master, extra, extra_tensors = run_local(preflight, what="load_checkpoint")
    targets, stepped = _load_targets(dims, optimizer, shapes, mine, has_master)
    targets.update({k: [t] for k, t in extra_tensors.items()})
    full = record.get("lora") is None       # a LoRA checkpoint fills the adapters only, not the base
    if full:
        mark_loaded(chunks, False)          # from here on a failure leaves a partial load
    try:
        dcp.load(targets, storage_reader=VerifyingReader(path, record["crc32"]["items"]),
                 planner=SliceLoadPlanner(targets))
        error = None
    except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        error = dcp_failure(e, "load_checkpoint")
    agree(error, what="load_checkpoint")
    if full:
        mark_loaded(chunks)
    if optimizer is not None:
        for param in stepped:
            optimizer.mark_master_loaded(param)
        optimizer.set_hyperparameters(record["optimizer"]["param_groups"])
    return {"step": record["step"], "extra": extra}
