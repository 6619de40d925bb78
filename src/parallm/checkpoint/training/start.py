"""What a save and a load of a training checkpoint start from: the chunks, their layout and tensors, the
optimizer's fit to them, earlier asynchronous saves finished."""

from __future__ import annotations

import os

from ...families import family_of
from ...model.table import expected_hf_shapes, is_trained, model_entries
from ...parallel.state import as_chunks, dims_of, require_initialized
from ...train.optim import ParallelAdamW
from .pending import wait_for_pending_saves


def begin(what: str, path, chunks):
    """The process groups, the chunks and their layout, earlier async saves finished: ``(path, chunks, dims)``
    with the path made absolute."""
    require_initialized(what)
    chunks = as_chunks(chunks)
    dims = dims_of(chunks)
    wait_for_pending_saves()
    return os.path.abspath(os.fspath(path)), chunks, dims


def model_layout(chunks, dims):
    """``(shapes, mine, saved)``: every HF tensor's full shape, this rank's ``(entry, chunk)`` pairs, and the
    ``(name, shape)`` of every tensor the model stores (all ranks' entries)."""
    spec, task = chunks[0].spec, chunks[0].task
    shapes = expected_hf_shapes(family_of(spec).table, spec, task=task, pp=dims.pp)
    mine, everything = model_entries(chunks, dims)
    saved = [(n, shapes[n]) for e in everything if e.row.save for n in e.hf]
    return shapes, mine, saved


def trained_names(chunks, dims) -> list[str]:
    """The HF names of the stored tensors the optimizer trains (of every rank): those of parameters with
    ``requires_grad`` (not the router's selection bias, not a carried MTP layer). Read from this rank's chunks'
    parameters and the table alone: every rank computes the same list."""
    mine, everything = model_entries(chunks, dims)
    frozen = {(e.row, e.layer) for e, c in mine if not c.get_parameter(e.local).requires_grad}
    frozen |= {(e.row, e.layer) for e in everything if not is_trained(e)}
    return [n for e in everything if e.row.save and (e.row, e.layer) not in frozen for n in e.hf]


def entries_by_param(mine) -> dict:
    """Parameter -> its weight-table entries among ``mine`` (one, or a stacked expert parameter's one per expert,
    in ``index`` order)."""
    out: dict = {}
    for entry, chunk in mine:
        out.setdefault(chunk.get_parameter(entry.local), []).append(entry)
    return out


def check_optimizer(optimizer, chunks) -> None:
    """``optimizer`` is None or what ``parallm.build_optimizer`` built for these chunks."""
    if optimizer is None:
        return
    if not isinstance(optimizer, ParallelAdamW):
        raise TypeError(f"optimizer must be what parallm.build_optimizer returned, got {type(optimizer).__name__}")
    params = {p for c in chunks for p in c.parameters()}
    if set(optimizer.names) != params:
        raise ValueError("the optimizer was built for other chunks than the ones passed (build it from these "
                         "chunks with parallm.build_optimizer)")
